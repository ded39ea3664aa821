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
from pallas_kernels.mosaic_gpu.config import SMS
from pallas_kernels.mosaic_gpu.common import (
    C, F32, ROWS, bit_level_pairs, iota, mma, mma_sum, rows_of, smem, stage)

LEVELS = (2, 4, 8, 16, 32)  # block sizes s merged into 2s (s = 1 needs no product)


def split_pair(hi_ref, lo_ref, x):
    """Stage ``x`` (fp32 registers) as the pair ``hi + lo ≈ x`` in the refs' 16-bit dtype (bf16
    here; the vector kernels' A for fp16 inputs is an fp16 pair); returns the two refs."""
    hi = x.astype(hi_ref.dtype)
    stage(hi_ref, hi)
    stage(lo_ref, x - hi.astype(F32))
    return hi_ref, lo_ref


def _mm3(a, b):
    """``a @ b`` for split pairs ``a = (hi, lo)``, ``b = (hi, lo)``: hi·hi + hi·lo + lo·hi."""
    return mma_sum(((a[0], b[0]), (a[0], b[1]), (a[1], b[0])), (C, C))


def invert_unit_lower(a, x_pair, a_pair, y_pair):
    """``(I + a)⁻¹`` in fp32 registers ``[C, C]`` for a strictly lower-triangular fp32 tile ``a``
    (WGMMA layout), by the module docstring's recursive block inversion with split-bf16
    products. ``x_pair``, ``a_pair``, ``y_pair``: (hi, lo) pairs of ``[C, C]`` bf16 SMEM staging
    buffers (free on return). Also used by the vector-gate chunk kernel (vector_chunk.py), whose
    ``a`` carries the per-channel decays."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    a_split = split_pair(*a_pair, a)
    # Level s = 1: the 2×2 diagonal blocks [[1, 0], [a, 1]] invert to [[1, 0], [−a, 1]].
    x = jnp.where(r == c, 1.0, 0.0) - jnp.where(bit_level_pairs(r, c, 1), a, 0.0)
    diff = r ^ c

    def level(i, x):
        # Level s = 2^(i+1): row in the second half, column in the first half, of the same
        # 2s-block — r and c first differ at bit i+1 and r has it set. One loop body instead of
        # five unrolled levels: the same work in a fifth of the code (shifts by the traced level).
        e = i + 1
        keep = (lax.shift_right_logical(diff, e) == 1) & ((lax.shift_right_logical(r, e) & 1) == 1)
        xs = split_pair(*x_pair, x)
        y = jnp.where(keep, _mm3(xs, a_split), 0.0)  # X A_s
        return x - _mm3(split_pair(*y_pair, y), xs)  # X − (X A_s) X

    return lax.fori_loop(jnp.int32(0), jnp.int32(len(LEVELS)), level, x)  # int32 under x64 too


def chunks_per_cta(B: int, H: int, N: int, sms: int = SMS) -> int:
    """Chunks one CTA walks (the next one's keys prefetched): the most of 8, 4, 2 that divides N
    and leaves at least 1.5 CTAs per SM (two fit on one), else 1."""
    for cpc in (8, 4, 2):
        if N % cpc == 0 and 2 * B * H * (N // cpc) >= 3 * sms:
            return cpc
    return 1


def chunk_inverse(k, beta, *, interpret=None, cpc: int | None = None):
    """``t0 [B, H, Tp, C]``; see the module docstring. Each CTA walks :func:`chunks_per_cta`
    chunks, the next chunk's k and β loading while this one's inverse runs, and its T0 store left
    in flight (two slots each)."""
    B, Tp, H, K = k.shape
    N = Tp // C
    cpc = chunks_per_cta(B, H, N) if cpc is None else cpc
    dtype = k.dtype
    bf = jnp.bfloat16
    scratch = dict(k_s=smem((2, C, K), dtype), b_s=plgpu.SMEM((2, C), F32),
                   st=smem((6, C, C), bf), out=smem((2, C, C), dtype),
                   bar=plgpu.Barrier(num_arrivals=2, num_barriers=2))

    def chunk_inverse_body(k_ref, b_ref, t_ref, k_s, b_s, st, out, bar):
        b, h, nb = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")

        def rows(i):
            return pl.ds((nb * cpc + i) * C, C)

        def issue(i, slot):
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows(i), h], k_s.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(b_ref.at[b, h, rows(i)], b_s.at[slot], bar.at[slot])

        issue(0, 0)
        r, c = iota((C, C), 0), iota((C, C), 1)

        @pl.loop(0, cpc)
        def _chunk(i):
            slot = lax.rem(i, 2)
            plgpu.barrier_wait(bar.at[slot])

            @pl.when(i + 1 < cpc)
            def _prefetch():  # the other slot's last reader was chunk i − 1's Gram (complete)
                plgpu.commit_smem()
                issue(i + 1, 1 - slot)

            gram = mma(k_s.at[slot], k_s.at[slot].T, (C, C))
            a = jnp.where(r > c, gram * rows_of(plgpu.load(b_s.at[slot], layout=ROWS), (C, C)), 0.0)
            x = invert_unit_lower(a, (st.at[0], st.at[1]), (st.at[2], st.at[3]), (st.at[4], st.at[5]))
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # out[slot] of chunk i − 2 has been read
            out.at[slot][...] = x.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out.at[slot], t_ref.at[b, h, rows(i)])

        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        chunk_inverse_body, out_type=jax.ShapeDtypeStruct((B, H, Tp, C), dtype), scratch_types=scratch,
        grid=(B, H, N // cpc), grid_names=("b", "h", "n"), compiler_params=compat.compiler_params(),
        interpret=interpret,
    )(k, beta)
