"""The gate-free chunk inverse T0 on the tensor cores (first kernel of the pipeline).

Pipeline position:  **this kernel**  ->  forward.py (fused state pass + output); the backward
reads the same T0 (a residual of the forward).

One CTA (one warpgroup) per ``(b, h, chunk)``:

    A  = diag(β) tril(K Kᵀ, −1)            (one WGMMA, fp32 accumulation)
    T0 = (I + A)⁻¹                          by recursive block inversion:

each level doubles the block size s with ``X ← X − (X A)|_s X``, where ``(X A)|_s`` keeps the
entries in the sub-diagonal s-block of each 2s-block (``[[L11, 0], [A21, L22]]⁻¹ =
[[X11, 0], [−X22 A21 X11, X22]]``; X is block-diagonal at level s, so ``(X A)|_s = X A_s`` and A
is staged once for every level). The first level needs no product (``X = I − A`` on the 2×2
blocks); five levels with two products each reach C = 64. The operands of every product are
split into bf16 pairs (``x = hi + lo``) and multiplied as ``hi·hi + hi·lo + lo·hi`` in one
accumulator (one tensor-core round trip), about 16 mantissa bits: the inverse is the most
precision-sensitive step (rewy-math §3), and only its final value is rounded to the input dtype.
Every block entry stays an entry of a true inverse of a diagonal block, so nothing grows.
Left operands come from registers and right operands are packed to the width of the blocks
being merged (:func:`invert_unit_lower`): the levels s = 2, 4, 8 and 16 take a quarter and a
half of a ``[C, C]`` product's tensor-core work, and the last level (one off-diagonal block)
contracts over 32 rows into 32 columns, an eighth: 9 of the 64³ products' work a chunk (13.5
with the last level whole, 30 with five whole levels; the Gram adds K/32).

Reads:  k [B, Tp, H, K] (16-bit); beta [B, H, Tp] fp32.
Writes: t0 [B, H, Tp, C] in k's dtype (rows of each chunk's T0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.common import (
    C, F32, ROWS, bit_level_pairs, iota, mma, mma_sum, put, rows_of, same_block, smem, stage)



def split_pair(hi_ref, lo_ref, x):
    """Stage ``x`` (fp32 registers) as the pair ``hi + lo ≈ x`` in the refs' 16-bit dtype (bf16
    here; the vector kernels' A for fp16 inputs is an fp16 pair); returns the two refs."""
    hi = x.astype(hi_ref.dtype)
    stage(hi_ref, hi)
    stage(lo_ref, x - hi.astype(F32))
    return hi_ref, lo_ref


def _mm3(a, b, width: int = C):
    """``a @ b`` for split pairs ``a = (hi, lo)`` (registers or SMEM, ``[C, k]``), ``b = (hi,
    lo)`` (SMEM, ``[k, width]``): hi·hi + hi·lo + lo·hi."""
    return mma_sum(((a[0], b[0]), (a[0], b[1]), (a[1], b[0])), (C, width))


def split_regs(x, dtype):
    """``x`` (fp32 registers) as the register pair ``(hi, lo)``, ``hi + lo ≈ x`` in ``dtype``
    (a WGMMA left operand may come from registers in the WGMMA layout, 16-bit)."""
    hi = x.astype(dtype)
    return hi, (x - hi.astype(F32)).astype(dtype)


# Packed tiles. A [C, C] tile that is block-diagonal in w-blocks (w = 16, 32) is held as
# [C, w]: row i keeps the columns of its own block, packed[i, j] = full[i, w·(i // w) + j].
# Products whose result lies in those blocks then take an N = w right operand (a quarter or a
# half of the tensor-core work of N = 64).
WIDTHS = (16, 32)  # the packed widths of the levels s = 2, 4, 8 | 16 (s = 32: see invert_unit_lower)
HALF = C // 2


def pack(x, w: int):
    """``[C, C]`` → ``[C, w]``; ``x`` must be zero outside the diagonal w-blocks."""
    out = x[:, :w]
    for blk in range(1, C // w):
        out = out + x[:, blk * w:(blk + 1) * w]
    return out


def unpack(xp, w: int):
    """``[C, w]`` → ``[C, C]``, zero outside the diagonal w-blocks (inverse of :func:`pack`)."""
    if w == C:
        return xp
    r, c = iota((C, C), 0), iota((C, C), 1)
    return jnp.where(same_block(r, c, w), jnp.concatenate([xp] * (C // w), axis=1), 0.0)


def inverse_scratch(dtype) -> tuple:
    """SMEM of :func:`invert_unit_lower` in ``dtype`` (16-bit), as alternatives for a
    ``plgpu.RefUnion``: one tree per width w in :data:`WIDTHS`, ``(A pairs, X pair of width w)``.
    The A pairs (hi, lo) — A's diagonal 16- and 32-blocks packed, and A's first 32 columns, whose
    rows 32..63 are the last level's A21 — lie first in each tree, at the same offsets (20 KiB in
    bf16: one set, live through the whole inverse); the X pairs of the two widths, used one after
    the other, share the bytes after them (8 KiB). :func:`inverse_refs` takes the union's trees
    apart."""
    pair = lambda w: (smem((C, w), dtype), smem((C, w), dtype))  # noqa: E731
    a_pairs = (pair(16), pair(32), pair(HALF))
    return tuple((a_pairs, pair(w)) for w in WIDTHS)


def inverse_refs(trees) -> tuple:
    """``(a_pairs, x_pairs)`` for :func:`invert_unit_lower` from the union's trees of
    :func:`inverse_scratch` (in the same order)."""
    return trees[0][0], tuple(x for _, x in trees)


def invert_unit_lower(a, a_pairs, x_pairs):
    """``(I + a)⁻¹`` in fp32 registers ``[C, C]`` for a strictly lower-triangular fp32 tile ``a``
    (WGMMA layout), by the module docstring's recursive block inversion with split-bf16
    products. ``a_pairs``, ``x_pairs``: :func:`inverse_refs` (free on return; their dtype is
    the pairs'). Also used by the vector-gate chunk kernel (vector_chunk.py),
    whose ``a`` carries the per-channel decays.

    Both products of a level take their left operand (X, then Y = (X A)|_s) from registers and
    their right operand (A, then X) packed to the width of the merged blocks: 16 columns for
    s = 2, 4, 8 and 32 for s = 16 (every product lies in those blocks), so these levels cost a
    quarter and a half of a [C, C] product. The last level (s = 32) has one off-diagonal block,
    ``X21 = −X22 A21 X11``, so its products contract over 32 rows and give 32 columns:
    ``Y = X[:, 32:] A[32:, :32]`` (X's rows 0..31 are zero there, so Y's are) and
    ``X[:, :32] −= Y X11``, an eighth of a [C, C] product's work each (the terms left out are
    exact zeros, so the sums are those of the whole products).
    """
    dtype = a_pairs[0][0].dtype
    r, c = iota((C, C), 0), iota((C, C), 1)
    a_tiles = (pack(jnp.where(same_block(r, c, 16), a, 0.0), 16),
               pack(jnp.where(same_block(r, c, 32), a, 0.0), 32),
               a[:, :HALF])  # rows 32..63: A21, the last level's right operand
    for pair, tile in zip(a_pairs, a_tiles):  # staged once
        for ref, part in zip(pair, split_regs(tile, dtype)):
            put(ref, part)
    plgpu.commit_smem()
    # Level s = 1: the 2×2 diagonal blocks [[1, 0], [a, 1]] invert to [[1, 0], [−a, 1]].
    x = jnp.where(r == c, 1.0, 0.0) - jnp.where(bit_level_pairs(r, c, 1), a, 0.0)

    def level(e, x_p, w, a_pair, x_pair):
        """Level s = 2^e on X packed to width w: row in the second half, column in the first
        half, of the same 2s-block (r and c first differ at bit e and r has it set)."""
        rw, cw = iota((C, w), 0), iota((C, w), 1)
        col = (rw // w) * w + cw  # the chunk column of each packed column
        keep = (lax.shift_right_logical(rw ^ col, e) == 1) & ((lax.shift_right_logical(rw, e) & 1) == 1)
        # X's packed pair goes to SMEM for the second product (unfenced: X A reads registers and A)
        for ref, part in zip(x_pair, split_regs(x_p, dtype)):
            put(ref, part)
        y = jnp.where(keep, _mm3(split_regs(unpack(x_p, w), dtype), a_pair, w), 0.0)  # X A_s
        plgpu.commit_smem()
        return x_p - _mm3(split_regs(unpack(y, w), dtype), x_pair, w)  # X − (X A_s) X

    # s = 2, 4, 8 on 16-column packs: one loop body (less code: the vector chunk kernel, which
    # holds the Grams' code beside the inverse, ran 0.375 instead of 0.557 ms with its levels
    # in a loop, docs/performance-log.md)
    x16 = lax.fori_loop(jnp.int32(1), jnp.int32(4),  # int32 under x64 too
                        lambda e, x_p: level(e, x_p, 16, a_pairs[0], x_pairs[0]), pack(x, 16))
    x32 = level(jnp.int32(4), pack(unpack(x16, 16), 32), 32, a_pairs[1], x_pairs[1])
    # s = 32: X11 is the top half of X's 32-packed pair, A21 the bottom half of A[:, :32]
    x_full = unpack(x32, 32)
    for ref, part in zip(x_pairs[1], split_regs(x32, dtype)):
        put(ref, part)
    lower = tuple(ref.at[pl.ds(HALF, HALF)] for ref in a_pairs[2])
    y = _mm3(split_regs(x_full[:, HALF:], dtype), lower, HALF)  # X22 A21 (rows 0..31: zero)
    plgpu.commit_smem()
    x11 = tuple(ref.at[pl.ds(0, HALF)] for ref in x_pairs[1])
    x21 = _mm3(split_regs(y, dtype), x11, HALF)  # (X22 A21) X11 (rows 0..31: zero)
    return jnp.concatenate([x_full[:, :HALF] - x21, x_full[:, HALF:]], axis=1)


def chunk_inverse(k, beta, *, interpret=None):
    """``t0 [B, H, Tp, C]``; see the module docstring."""
    B, Tp, H, K = k.shape
    N = Tp // C
    dtype = k.dtype
    bf = jnp.bfloat16
    # Buffers with disjoint lifetimes share SMEM (28 KiB a CTA at K ≤ 128): k is dead once the
    # Gram is formed, the inverse's buffers once it returns, and then the result takes them.
    scratch = dict(union=plgpu.RefUnion(smem((C, K), dtype), smem((C, C), dtype), *inverse_scratch(bf)),
                   b_s=plgpu.SMEM((C,), F32), bar=plgpu.Barrier(num_arrivals=2))

    def chunk_inverse_body(k_ref, b_ref, t_ref, union, b_s, bar):
        k_s, out, *trees = union
        a_pairs, x_pairs = inverse_refs(trees)
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_s, bar)
        plgpu.copy_gmem_to_smem(b_ref.at[b, h, rows], b_s, bar)
        plgpu.barrier_wait(bar)
        r, c = iota((C, C), 0), iota((C, C), 1)
        gram = mma(k_s, k_s.T, (C, C))
        a = jnp.where(r > c, gram * rows_of(plgpu.load(b_s, layout=ROWS), (C, C)), 0.0)
        x = invert_unit_lower(a, a_pairs, x_pairs)
        out[...] = x.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, t_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        chunk_inverse_body, out_type=jax.ShapeDtypeStruct((B, H, Tp, C), dtype), scratch_types=scratch,
        grid=(B, H, N), grid_names=("b", "h", "n"), compiler_params=compat.compiler_params(),
        interpret=interpret,
    )(k, beta)
