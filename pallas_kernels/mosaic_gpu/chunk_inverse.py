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
Left operands come from registers, in K = 16 or 32 pieces of X held packed, and right operands
are packed to the width of the blocks being merged (:func:`invert_unit_lower`): no ``[C, C]``
operand is formed and no block that is zero by the structure is multiplied, 6.75 of the 64³
products' work a chunk against 30 for five whole levels (the Gram adds K/32).

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
    The A pairs (hi, lo) — A's diagonal 16-blocks and the 16-blocks below them, packed to 16
    columns, and A's first 32 columns, whose rows 32..63 are the last level's A21 — lie first in
    each tree, at the same offsets (16 KiB in bf16: one set, live through the whole inverse); the
    X pairs of the two widths, used one after the other, share the bytes after them (8 KiB).
    :func:`inverse_refs` takes the union's trees apart."""
    pair = lambda w: (smem((C, w), dtype), smem((C, w), dtype))  # noqa: E731
    a_pairs = (pair(16), pair(16), pair(HALF))
    return tuple((a_pairs, pair(w)) for w in WIDTHS)


def inverse_refs(trees) -> tuple:
    """``(a_pairs, x_pairs)`` for :func:`invert_unit_lower` from the union's trees of
    :func:`inverse_scratch` (in the same order)."""
    return trees[0][0], tuple(x for _, x in trees)


def _blockwise(x, pair, blocks, w: int = 16):
    """``Σ x_b @ pair[16-row block m]`` over ``blocks``, pairs ``(b, m)``, on the tensor cores
    (split products, one accumulator), ``x_b = x`` on the rows of 16-block ``b`` and 0
    elsewhere: the product of a packed tile whose row block b only meets row block m of the
    right operand, in K = 16 pieces, so no ``[C, C]`` left operand is formed and no zero block
    is multiplied. ``x``: fp32 ``[C, 16]``; ``pair``: SMEM (hi, lo) ``[C, w]``."""
    dtype = pair[0].dtype
    hi, lo = split_regs(x, dtype)
    blk = iota(x.shape, 0) // 16
    terms = []
    for b, m in blocks:
        rows = tuple(ref.at[pl.ds(16 * m, 16)] for ref in pair)
        h, l = (jnp.where(blk == b, t, jnp.zeros_like(t)) for t in (hi, lo))
        terms += [(h, rows[0]), (h, rows[1]), (l, rows[0])]
    return mma_sum(tuple(terms), (C, w))


def invert_unit_lower(a, a_pairs, x_pairs):
    """``(I + a)⁻¹`` in fp32 registers ``[C, C]`` for a strictly lower-triangular fp32 tile ``a``
    (WGMMA layout), by the module docstring's recursive block inversion with split-bf16
    products. ``a_pairs``, ``x_pairs``: :func:`inverse_refs` (free on return; their dtype is
    the pairs'). Also used by the vector-gate chunk kernel (vector_chunk.py),
    whose ``a`` carries the per-channel decays.

    X is held packed (:func:`pack`): ``[C, 16]`` up to s = 16, then ``[C, 32]``. Every product
    takes its left operand from registers in K = 16 or 32 pieces of the packed tile (the row
    blocks it meets, :func:`_blockwise`) and its right operand from a packed SMEM pair, so no
    ``[C, C]`` operand is formed and no term that is zero by the block structure is multiplied:

    * s = 2, 4, 8 (inside 16-blocks): ``Y = (X A)|_s`` from X's 16-blocks times A's diagonal
      16-blocks, then ``X ← X − Y X``, each four K = 16 pieces into 16 columns;
    * s = 16: ``Y = X22 A21`` per 32-block from the odd 16-blocks of X times the 16-blocks below
      A's diagonal, ``X21 = −Y X11`` from the even 16-blocks of X: two pieces each;
    * s = 32: ``Y = X[:, 32:] A[32:, :32]``, ``X21 = −Y X11``: K = 32, 32 columns.

    The sums are those of the whole-tile products (the terms left out are exact zeros).
    """
    dtype = a_pairs[0][0].dtype
    r, c = iota((C, C), 0), iota((C, C), 1)
    a_tiles = (pack(jnp.where(same_block(r, c, 16), a, 0.0), 16),  # A's diagonal 16-blocks
               pack(jnp.where(bit_level_pairs(r, c, 16), a, 0.0), 16),  # the 16-blocks below them
               a[:, :HALF])  # rows 32..63: A21, the last level's right operand
    for pair, tile in zip(a_pairs, a_tiles):  # staged once
        for ref, part in zip(pair, split_regs(tile, dtype)):
            put(ref, part)
    plgpu.commit_smem()
    rw, cw = iota((C, 16), 0), iota((C, 16), 1)
    blk = rw // 16
    # Level s = 1, packed: the 2×2 diagonal blocks [[1, 0], [a, 1]] invert to [[1, 0], [−a, 1]].
    col = blk * 16 + cw  # the chunk column of each packed column
    x16 = jnp.where(rw == col, 1.0, 0.0) - jnp.where(bit_level_pairs(rw, col, 1), a_tiles[0], 0.0)

    def level(e, x16):
        """Level s = 2^e < 16 on X packed to 16 columns: row in the second half, column in the
        first half, of the same 2s-block (r and c first differ at bit e and r has it set)."""
        col = blk * 16 + cw  # the chunk column of each packed column
        keep = (lax.shift_right_logical(rw ^ col, e) == 1) & ((lax.shift_right_logical(rw, e) & 1) == 1)
        # X's pair goes to SMEM for the second product (unfenced: X A reads registers and A)
        for ref, part in zip(x_pairs[0], split_regs(x16, dtype)):
            put(ref, part)
        diagonal = tuple((b, b) for b in range(4))  # X and Y lie in the diagonal 16-blocks
        y = jnp.where(keep, _blockwise(x16, a_pairs[0], diagonal), 0.0)  # X A_s
        plgpu.commit_smem()
        return x16 - _blockwise(y, x_pairs[0], diagonal)  # X − (X A_s) X

    # s = 2, 4, 8: one loop body (less code: the vector chunk kernel, which holds the Grams'
    # code beside the inverse, ran 0.375 instead of 0.557 ms with its levels in a loop,
    # docs/performance-log.md)
    x16 = lax.fori_loop(jnp.int32(1), jnp.int32(4),  # int32 under x64 too
                        lambda e, x_p: level(e, x_p), x16)
    # s = 16: the odd 16-blocks (each 32-block's second half) meet A's 16-blocks below the
    # diagonal; then Y meets X11, the even 16-blocks of X's pair
    for ref, part in zip(x_pairs[0], split_regs(x16, dtype)):
        put(ref, part)
    y = _blockwise(x16, a_pairs[1], ((1, 1), (3, 3)))  # X22 A21 per 32-block (odd row blocks)
    plgpu.commit_smem()
    x21 = _blockwise(y, x_pairs[0], ((1, 0), (3, 2)))  # times X11: the 32-block's even 16-block
    upper = blk % 2 == 0  # rows in the first half of their 32-block
    x32 = jnp.concatenate([jnp.where(upper, x16, -x21), jnp.where(upper, 0.0, x16)], axis=1)
    # s = 32: X11 is the top half of X's 32-packed pair, A21 the bottom half of A[:, :32]
    top = iota((C, HALF), 0) < HALF
    x22 = jnp.where(top, 0.0, x32)  # X[:, 32:] (X is block-diagonal: its rows 0..31 are zero)
    for ref, part in zip(x_pairs[1], split_regs(x32, dtype)):
        put(ref, part)
    lower = tuple(ref.at[pl.ds(HALF, HALF)] for ref in a_pairs[2])
    y = _mm3(split_regs(x22, dtype), lower, HALF)  # X22 A21 (rows 0..31: zero)
    plgpu.commit_smem()
    x11 = tuple(ref.at[pl.ds(0, HALF)] for ref in x_pairs[1])
    x21 = _mm3(split_regs(y, dtype), x11, HALF)  # (X22 A21) X11 (rows 0..31: zero)
    return jnp.concatenate([jnp.where(top, x32, 0.0) - x21, x22], axis=1)


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
