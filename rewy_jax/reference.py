"""The token-by-token recurrence: the oracle every other path is checked against (rewy-math §2).

    S_t = (I − k_t e_tᵀ) Diag(α_t) S_{t−1} + k_t z_tᵀ,      o_t = S_tᵀ (scale · q_t)

with α_t = exp(g_t) (1 when there is no gate), e_t = b_t ⊙ k_t, z_t = w_t ⊙ v_t. Written with
``lax.scan`` in whatever float dtype it is given (use float64 as the oracle) and differentiated
by plain autodiff. Also the decode step form (one or a few tokens with a carried state).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.vma import vary_like

__all__ = ["l2norm", "delta_rule_recurrence", "reference_general"]


def l2norm(x, eps: float = 1e-6):
    """``x / sqrt(Σ x² + eps)`` over the last axis (FLA's q/k normalisation)."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (xf * lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _expand(x, ndim_target):
    """Scalar-per-head gates [B, T, H] -> [B, T, H, 1]; per-channel gates pass through."""
    return x if x is None or x.ndim == ndim_target else x[..., None]


def delta_rule_recurrence(q, k, v, g, b, w, state, *, precision=lax.Precision.HIGHEST):
    """Run the general recurrence over the T axis for a batch of sequences.

    Args:
      q, k: [B, T, H, K] (q already scaled and normalised as desired).
      v:    [B, T, H, V].
      g:    None, [B, T, H] or [B, T, H, K] per-token log-decay (≤ 0).
      b:    [B, T, H] or [B, T, H, K] erase gate (β).
      w:    [B, T, H] or [B, T, H, V] write gate (β).
      state: [B, H, K, V] initial state, in the compute dtype.
    Returns:
      o [B, T, H, V] and the final state [B, H, K, V], both in the compute dtype.
    """
    g, b, w = _expand(g, 4), _expand(b, 4), _expand(w, 4)
    e = b * k
    z = w * v

    def step(S, xs):
        q_t, k_t, e_t, z_t, g_t = xs  # [B, H, *]
        if g_t is not None:
            S = jnp.exp(g_t)[..., None] * S  # [B, H, K or 1, 1]: per-channel or scalar decay
        err = jnp.einsum("bhk,bhkv->bhv", e_t, S, precision=precision)
        S = S + k_t[..., :, None] * (z_t - err)[..., None, :]
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=precision)
        return S, o_t

    tm = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)  # noqa: E731
    state = vary_like(state, q, k, e, z, g)  # shard_map(check_vma=True): carry types must match
    S, o = lax.scan(step, state, (tm(q), tm(k), tm(e), tm(z), tm(g)))
    return jnp.moveaxis(o, 0, 1), S


def reference_general(q, k, v, g, b, w, *, scale, initial_state=None, use_qk_l2norm=False,
                      cu_seqlens=None, dtype=None):
    """The general recurrence with FLA's options, on [B, T, H, D] inputs.

    ``dtype`` is the compute dtype (default: the promoted input dtype, at least float32); use
    ``jnp.float64`` (with ``jax_enable_x64``) for the oracle. ``cu_seqlens`` (B = 1) must be
    concrete here: sequences are run one by one. Returns (o in the compute dtype, final state
    [B or N, H, K, V] in the compute dtype).
    """
    if dtype is None:
        dtype = jnp.promote_types(q.dtype, jnp.float32)
    cast = lambda x: None if x is None else x.astype(dtype)  # noqa: E731
    q, k, v, g, b, w = map(cast, (q, k, v, g, b, w))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    Bsz, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        h0 = (jnp.zeros((Bsz, H, K, V), dtype) if initial_state is None
              else initial_state.astype(dtype))
        return delta_rule_recurrence(q, k, v, g, b, w, h0)
    offsets = np.asarray(cu_seqlens)
    n = len(offsets) - 1
    h0 = jnp.zeros((n, H, K, V), dtype) if initial_state is None else initial_state.astype(dtype)
    outs, finals = [], []
    for i in range(n):
        sl = slice(int(offsets[i]), int(offsets[i + 1]))
        pick = lambda x: None if x is None else x[:, sl]  # noqa: E731
        o_i, s_i = delta_rule_recurrence(pick(q), pick(k), pick(v), pick(g), pick(b), pick(w),
                                         h0[i:i + 1])
        outs.append(o_i)
        finals.append(s_i)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(finals, axis=0)

