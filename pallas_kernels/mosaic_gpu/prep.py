"""XLA preparation of the Mosaic GPU kernels' inputs (first stage of the pipeline).

    pad T to a multiple of C (zero rows: k = v = 0, β = 0, g = 0 leave the state unchanged)
    g2   [B, H, Tp]  chunk-local inclusive cumsum of g, in log2 units (kernels use exp2)
    beta [B, H, Tp]  fp32, head-major so a chunk is one contiguous TMA row
(the gate-free inverse T0 per chunk is the next stage, chunk_inverse.py).

Why a gate-free inverse suffices for scalar gates: with Γ = diag(exp G), the gated system
L = I + diag(β) tril(K Kᵀ ⊙ exp(G_i − G_j), −1) equals Γ L0 Γ⁻¹, so L⁻¹ = T0 ⊙ exp(G_i − G_j)
entrywise (j ≤ i). The kernels apply that factor in-tile; exp(−G) is never formed.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_kernels.mosaic_gpu.common import C

LOG2E = math.log2(math.e)
HIGHEST = lax.Precision.HIGHEST


def pad_time(x, Tp: int):
    """Zero-pad axis 1 (time) of ``x`` to ``Tp``."""
    T = x.shape[1]
    if T == Tp:
        return x
    return jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))


def head_major(x, Tp: int):
    """Per-token scalars ``[B, T, H]`` -> padded fp32 ``[B, H, Tp]``."""
    return jnp.swapaxes(pad_time(x.astype(jnp.float32), Tp), 1, 2)


def log2_chunk_cumsum(g, Tp: int):
    """``[B, T, H]`` natural-log gates (≤ 0, already clamped) -> ``[B, H, Tp]`` chunk-local
    inclusive cumulative sums in log2 units."""
    B, _, H = g.shape
    gc = head_major(g, Tp).reshape(B, H, Tp // C, C)
    return (jnp.cumsum(gc, axis=-1) * LOG2E).reshape(B, H, Tp)
