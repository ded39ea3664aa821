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
    C, F32, ROWS, bit_level_pairs, iota, mma, mma_sum, put, rows_of, smem, stage)

LEVELS = (2, 4, 8, 16, 32)  # block sizes s merged into 2s (s = 1 needs no product)


def split_pair(hi_ref, lo_ref, x):
    """Stage ``x`` (fp32 registers) as the pair ``hi + lo ≈ x`` in the refs' 16-bit dtype (bf16
    here; the vector kernels' A for fp16 inputs is an fp16 pair); returns the two refs."""
    hi = x.astype(hi_ref.dtype)
    stage(hi_ref, hi)
    stage(lo_ref, x - hi.astype(F32))
    return hi_ref, lo_ref


def _mm3(a, b):
    """``a @ b`` for split pairs ``a = (hi, lo)`` (registers or SMEM), ``b = (hi, lo)`` (SMEM):
    hi·hi + hi·lo + lo·hi."""
    return mma_sum(((a[0], b[0]), (a[0], b[1]), (a[1], b[0])), (C, C))


def split_regs(x, dtype):
    """``x`` (fp32 registers) as the register pair ``(hi, lo)``, ``hi + lo ≈ x`` in ``dtype``
    (a WGMMA left operand may come from registers in the WGMMA layout, 16-bit)."""
    hi = x.astype(dtype)
    return hi, (x - hi.astype(F32)).astype(dtype)


def invert_unit_lower(a, x_pair, a_pair):
    """``(I + a)⁻¹`` in fp32 registers ``[C, C]`` for a strictly lower-triangular fp32 tile ``a``
    (WGMMA layout), by the module docstring's recursive block inversion with split-bf16
    products. ``x_pair``, ``a_pair``: (hi, lo) pairs of ``[C, C]`` 16-bit SMEM staging buffers
    (free on return; their dtype is the pair's). Also used by the vector-gate chunk kernel
    (vector_chunk.py), whose ``a`` carries the per-channel decays.

    The left operand of both products of a level comes from registers (X, then Y = (X A)|_s):
    only the right operands A (once) and X (each level, stored while X A runs) go through SMEM.
    """
    dtype = a_pair[0].dtype
    r, c = iota((C, C), 0), iota((C, C), 1)
    a_split = split_pair(*a_pair, a)
    # Level s = 1: the 2×2 diagonal blocks [[1, 0], [a, 1]] invert to [[1, 0], [−a, 1]].
    x = jnp.where(r == c, 1.0, 0.0) - jnp.where(bit_level_pairs(r, c, 1), a, 0.0)
    diff = r ^ c

    def level(i, x):
        # Level s = 2^(i+1): row in the second half, column in the first half, of the same
        # 2s-block — r and c first differ at bit i+1 and r has it set (shifts by the traced
        # level). One loop body instead of five unrolled levels, a third of the code: the vector
        # chunk kernel, which holds the Grams' code beside it, took 0.375 instead of 0.557 ms
        # with it (H100, KDA at the anchor); T0 alone 0.078 against 0.075 (docs/performance-log.md).
        e = i + 1
        keep = (lax.shift_right_logical(diff, e) == 1) & ((lax.shift_right_logical(r, e) & 1) == 1)
        xr = split_regs(x, dtype)
        # X's pair goes to SMEM for the second product (unfenced: X A reads registers and A)
        xs = (put(x_pair[0], xr[0]), put(x_pair[1], xr[1]))
        y = jnp.where(keep, _mm3(xr, a_split), 0.0)  # X A_s
        plgpu.commit_smem()
        return x - _mm3(split_regs(y, dtype), xs)  # X − (X A_s) X

    return lax.fori_loop(jnp.int32(0), jnp.int32(len(LEVELS)), level, x)  # int32 under x64 too


def chunk_inverse(k, beta, *, interpret=None):
    """``t0 [B, H, Tp, C]``; see the module docstring."""
    B, Tp, H, K = k.shape
    N = Tp // C
    dtype = k.dtype
    bf = jnp.bfloat16
    tile = lambda: smem((C, C), bf)  # noqa: E731
    # Buffers with disjoint lifetimes share SMEM (32 KB a CTA at K = 128): k is dead once the
    # Gram is formed and its bytes hold the split X; the split A is dead after the last level
    # and its bytes hold the result.
    scratch = dict(k_or_x=plgpu.RefUnion(smem((C, K), dtype), (tile(), tile())),
                   a_or_out=plgpu.RefUnion((tile(), tile()), smem((C, C), dtype)),
                   b_s=plgpu.SMEM((C,), F32), bar=plgpu.Barrier(num_arrivals=2))

    def chunk_inverse_body(k_ref, b_ref, t_ref, k_or_x, a_or_out, b_s, bar):
        k_s, (xh, xl) = k_or_x
        (ah, al), out = a_or_out
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_s, bar)
        plgpu.copy_gmem_to_smem(b_ref.at[b, h, rows], b_s, bar)
        plgpu.barrier_wait(bar)
        r, c = iota((C, C), 0), iota((C, C), 1)
        gram = mma(k_s, k_s.T, (C, C))
        a = jnp.where(r > c, gram * rows_of(plgpu.load(b_s, layout=ROWS), (C, C)), 0.0)
        x = invert_unit_lower(a, (xh, xl), (ah, al))
        out[...] = x.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, t_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        chunk_inverse_body, out_type=jax.ShapeDtypeStruct((B, H, Tp, C), dtype), scratch_types=scratch,
        grid=(B, H, N), grid_names=("b", "h", "n"), compiler_params=compat.compiler_params(),
        interpret=interpret,
    )(k, beta)
