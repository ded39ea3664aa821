"""XLA preparation of the vector-gate (KDA, GDN2) Mosaic GPU kernels' inputs.

Pipeline:  **this stage**  ->  vector_chunk.py (per chunk: gated Grams, inverse, W, U, Qγ,
K_tail, P)  ->  vector_forward.py (fused state pass + output).

    pad T to a multiple of C (zero rows: k = v = 0, β = b = w = 0, g = 0 leave the state unchanged)
    g      clamped to the declared bound, else to RESET_GATE (−40: e^−40 is below fp32 resolution
           of any state; the clamp keeps −inf out of the cumulative sums)
    g2     [B, H, Tp, K]  chunk-local inclusive cumsum of g per key channel, log2 units, fp32
    KDA    x = v [B, Tp, H, V];       erase = β head-major [B, H, Tp] fp32
    GDN2   x = z = w ⊙ v [B, Tp, H, V] (input dtype: the kernel rounds Z there anyway, as the
           WGMMA operand of U = A Z, so forming it here adds no rounding);
           erase = b [B, Tp, H, K] fp32 (kept fp32: e = b ⊙ k is rounded once, in the kernel)

**When the centred contraction is safe.** The chunk kernel evaluates every decay factor
``2^{G_r − G_s}`` (s ≤ r) as a product ``(x_r 2^{G_r − G_m}) · (y_s 2^{G_m − G_s})`` in a reference
frame m (rewy-math §3). The exact frames keep both exponents ≤ 0, for any g. The centred frame of
a 16-row sub-chunk is its row 8: with every per-token gate ≥ ``CENTRED_MIN_GATE`` = −5 each factor
is at most e^{8·5} = e^40 ≈ 2e17 (bf16 and fp32 share the exponent range, to 3e38), so the WGMMA
operands stay finite; kept products equal e^{G_r − G_s} ≤ 1 up to rounding, and the products of
masked-out pairs (which may overflow to inf in fp32) are discarded by a select, never summed.
Below that bound only the exact frames are safe, so the centred path is taken only when the
caller declares ``gate_lower_bound ≥ −5`` (and g is clamped to the bound, as the ops do).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.chunk_algebra import RESET_GATE, clamp_gates
from pallas_kernels.mosaic_gpu.common import C
from pallas_kernels.mosaic_gpu.prep import LOG2E, head_major, pad_time

CENTRED_MIN_GATE = -5.0


def centred_ok(gate_lower_bound) -> bool:
    """Whether a declared per-token gate bound admits the centred diagonal blocks."""
    return gate_lower_bound is not None and float(gate_lower_bound) >= CENTRED_MIN_GATE


def log2_chunk_cumsum_vec(g, Tp: int):
    """``[B, T, H, K]`` clamped natural-log gates -> ``[B, H, Tp, K]`` fp32 chunk-local inclusive
    cumulative sums in log2 units (head-major: a chunk's ``[C, 64]`` tiles are contiguous rows)."""
    B, _, H, K = g.shape
    gc = jnp.swapaxes(pad_time(g.astype(jnp.float32), Tp), 1, 2).reshape(B, H, Tp // C, C, K)
    return (jnp.cumsum(gc, axis=3) * LOG2E).reshape(B, H, Tp, K)


def prepare_vector(q, k, v, g, beta=None, b=None, w=None, *, gate_lower_bound=None):
    """``(q, k, x, g2, erase)`` padded for vector_chunk.vector_chunk; KDA when ``beta`` is given,
    GDN2 when ``b`` and ``w`` are (see the module docstring for each array)."""
    B, T, H, K = k.shape
    Tp = -(-T // C) * C
    dtype = v.dtype
    floor = RESET_GATE if gate_lower_bound is None else float(gate_lower_bound)
    g2 = log2_chunk_cumsum_vec(clamp_gates(g.astype(jnp.float32), floor), Tp)
    q, k = (pad_time(x.astype(dtype), Tp) for x in (q, k))
    if beta is not None:
        return q, k, pad_time(v, Tp), g2, head_major(beta, Tp)
    z = (w.astype(jnp.float32) * v.astype(jnp.float32)).astype(dtype)
    return q, k, pad_time(z, Tp), g2, pad_time(b.astype(jnp.float32), Tp)
