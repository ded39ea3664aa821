"""XLA preparation of the Mosaic GPU kernels' inputs (first stage of the pipeline).

    pad T to a multiple of C (zero rows: k = v = 0, β = 0, g = 0 leave the state unchanged)
    g2   [B, H, Tp]  chunk-local inclusive cumsum of g, in log2 units (kernels use exp2)
    beta [B, H, Tp]  fp32, head-major so a chunk is one contiguous TMA row
    t0   [B, H, Tp, C]  the gate-free inverse (I + diag(β) tril(K Kᵀ, −1))⁻¹ per chunk

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


def gate_free_inverse(k, beta_hm, dtype):
    """``t0 [B, H, Tp, C]``: per chunk ``(I + diag(β) tril(K Kᵀ, −1))⁻¹`` in ``dtype``.

    k: ``[B, Tp, H, K]`` (padded, 16-bit); beta_hm: ``[B, H, Tp]`` fp32. The Gram comes from the
    16-bit k with fp32 accumulation, read in the token layout; the four 16×16 diagonal blocks
    are solved by triangular solves and merged in two levels, ``[[X11, 0], [−X22 A21 X11, X22]]``
    in fp32; only the result is rounded. (One batched 64×64 triangular solve measured 0.45 ms
    against 0.25 at the anchor shape on the H100, same values.)"""
    B, Tp, H, K = k.shape
    N = Tp // C
    kc = k.reshape(B, N, C, H, K)
    gram = jnp.einsum("bnihk,bnjhk->bhnij", kc, kc, preferred_element_type=jnp.float32)
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    A = jnp.where(strict, gram * beta_hm.reshape(B, H, N, C, 1), 0.0)  # strictly lower
    s = 16
    blocks = jnp.stack([A[..., i * s:(i + 1) * s, i * s:(i + 1) * s] for i in range(C // s)], axis=-3)
    eye = jnp.eye(s, dtype=jnp.float32)
    X = lax.linalg.triangular_solve(blocks + eye, jnp.broadcast_to(eye, blocks.shape), left_side=True,
                                    lower=True, unit_diagonal=True)  # [B, H, N, 4, 16, 16]
    inv = [X[..., i, :, :] for i in range(C // s)]
    while s < C:  # merge pairs of diagonal blocks of size s into blocks of size 2s
        nxt = []
        for j in range(len(inv) // 2):
            r0 = 2 * j * s
            a21 = A[..., r0 + s:r0 + 2 * s, r0:r0 + s]
            x11, x22 = inv[2 * j], inv[2 * j + 1]
            x21 = -jnp.einsum("...ij,...jk,...kl->...il", x22, a21, x11, precision=HIGHEST)
            top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
            nxt.append(jnp.concatenate([top, jnp.concatenate([x21, x22], axis=-1)], axis=-2))
        inv, s = nxt, 2 * s
    return inv[0].reshape(B, H, Tp, C).astype(dtype)
