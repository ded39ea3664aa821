"""Context parallelism: the sequence axis T split across the devices of one mesh axis.

Used through the ops' ``context_axis=`` argument inside ``jax.shard_map``: each device holds a
contiguous slice of T (``in_specs`` ``P(None, axis)`` on q/k/v/gates), and the call returns that
slice's outputs and the global final state. ``cu_seqlens`` (global offsets, replicated) may put
sequence boundaries anywhere, including sequences that straddle several devices.

The state after a run of tokens is affine in the state before it (rewy-math §2):

    S_end = M · S_start + B,      M = Π_t (I − k_t e_tᵀ) Diag(α_t)   (K × K),

so each device p

1. runs the op once on its slice with the value columns widened from V to V + K: zero writes in
   the K extra columns and the start state ``[0 | I_K]`` for a sequence continuing from device
   p − 1 (``[h0 | 0]`` for one starting here) give the end state ``[B_p | M_p]`` of its last
   sequence in one call (M_p = 0 when that sequence starts on the device);
2. ``all_gather`` s the small (M_p, B_p) pairs over the axis and folds them,
   ``S_in(p + 1) = M_p S_in(p) + B_p``, to get the state entering its slice;
3. runs the op again from S_in, for its outputs; the final state of each sequence is taken
   from the device where the sequence ends (one ``psum``).

The backward is JAX's autodiff of these three steps: each op call differentiates by its own
backend's (ReWY) backward, ``all_gather`` transposes to a reduce-scatter, so the cotangents of
the start states flow back across devices exactly as the states flowed forward. Costs are
discussed in docs/sharding.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["run_chunk", "axis_size"]

_HI = lax.Precision.HIGHEST


def axis_size(axis: str) -> int:
    """Static size of a manual mesh axis (inside shard_map)."""
    if not isinstance(axis, str):
        raise ValueError(f"context_axis must be a mesh axis name (str); got {axis!r}")
    try:
        if hasattr(lax, "axis_size"):
            return int(lax.axis_size(axis))
        return int(lax.psum(1, axis))  # pragma: no cover - jax 0.11
    except NameError as err:
        raise ValueError(f"context_axis={axis!r} must name a mesh axis of the enclosing "
                         "jax.shard_map (the ops split T over it); no such axis is bound "
                         "here") from err


def _widen(call, h0_aug):
    """The call with K zero value columns appended (and the widened start states)."""
    K = call.q.shape[-1]
    zeros = jnp.zeros(call.v.shape[:-1] + (K,), call.v.dtype)
    v = jnp.concatenate([call.v, zeros], axis=-1)
    w = call.w
    if w is call.b:
        w = None  # shared scalar β: stays shared (restored below)
    elif w.ndim == call.v.ndim:  # per-channel write gate [B, T, H, V]
        w = jnp.concatenate([w, jnp.zeros(w.shape[:-1] + (K,), w.dtype)], axis=-1)
    out = call._replace(v=v, h0=h0_aug)
    return out._replace(w=out.b if w is None else w)


def _eye_block(lead, H, K, V, dtype=jnp.float32):
    """[lead, H, K, V + K] states ``[0 | I]``."""
    eye = jnp.broadcast_to(jnp.eye(K, dtype=dtype), (lead, H, K, K))
    return jnp.concatenate([jnp.zeros((lead, H, K, V), dtype), eye], axis=-1)


def run_chunk(call, axis: str, *, impl_for, chunk_size, policy, backward, interpret):
    """The op on this device's slice of T, with the state carried across ``axis``.

    ``call``: a GeneralCall on the local slice (q [B, T_local, H, K], ...) whose ``h0`` and
    ``cu_seqlens`` are global (``h0`` [B or N, H, K, V]; ``cu_seqlens`` offsets into the global
    T = T_local · axis size). ``impl_for(call)``: the backend implementation for a call.
    Returns (o [B, T_local, H, V], final [B or N, H, K, V] fp32, identical on every device).
    """
    n_dev = axis_size(axis)
    p = lax.axis_index(axis)
    B, Tl, H, K = call.q.shape
    V = call.v.shape[-1]
    kw = dict(chunk_size=chunk_size, policy=policy, backward=backward, interpret=interpret)
    h0 = call.h0.astype(jnp.float32)
    a = p * Tl  # global index of this device's first token

    if call.cu_seqlens is None:
        first = p == 0  # device 0 starts every sequence of the batch; the others continue one
        h0_aug = jnp.where(first, jnp.concatenate([h0, jnp.zeros((B, H, K, K), h0.dtype)], -1),
                           _eye_block(B, H, K, V))
        wide = _widen(call, h0_aug)
        _, end = impl_for(wide)(wide, **kw)
        B_p, M_p = end[..., :V], end[..., V:]  # [B, H, K, V], [B, H, K, K]
        S_in = _incoming(M_p, B_p, axis, n_dev, p)
        o, final = impl_for(call)(call._replace(h0=jnp.where(first, h0, S_in)), **kw)
        last = p == n_dev - 1
        final = lax.psum(jnp.where(last, final, 0.0), axis)
        return o, final

    cu = jnp.asarray(call.cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    local_cu = jnp.clip(cu - a, 0, Tl)  # empty local segments for sequences elsewhere
    cont = (cu[:-1] < a) & (cu[1:] > a)  # [N] the sequence entering from device p − 1
    c4 = cont[:, None, None, None]
    h0_aug = jnp.where(c4, _eye_block(N, H, K, V),
                       jnp.concatenate([h0, jnp.zeros((N, H, K, K), h0.dtype)], -1))
    wide = _widen(call._replace(cu_seqlens=local_cu), h0_aug)
    _, end = impl_for(wide)(wide, **kw)
    m = jnp.searchsorted(cu[1:], a + Tl - 1, side="right")  # sequence of the last local token
    end_m = lax.dynamic_index_in_dim(end, m, axis=0, keepdims=True)  # [1, H, K, V + K]
    B_p, M_p = end_m[..., :V], end_m[..., V:]
    S_in = _incoming(M_p, B_p, axis, n_dev, p)  # [1, H, K, V]
    local = call._replace(cu_seqlens=local_cu, h0=jnp.where(c4, S_in, h0))
    o, fin = impl_for(local)(local, **kw)
    ends_here = (cu[1:] > a) & (cu[1:] <= a + Tl) & (cu[1:] > cu[:-1])
    empty = (cu[1:] == cu[:-1]) & (p == 0)  # a sequence with no tokens keeps h0 (device 0 says)
    final = (jnp.where(ends_here[:, None, None, None], fin, 0.0)
             + jnp.where(empty[:, None, None, None], h0, 0.0))
    return o, lax.psum(final, axis)  # one contribution per sequence: replicated


def _incoming(M_p, B_p, axis, n_dev, p):
    """State entering device p: fold S ← M_j S + B_j over the devices j < p (gathered)."""
    Ms = lax.all_gather(M_p, axis)  # [P, lead, H, K, K]
    Bs = lax.all_gather(B_p, axis)  # [P, lead, H, K, V]
    S = jnp.zeros_like(B_p)
    states = [S]
    for j in range(n_dev - 1):
        S = jnp.einsum("nhij,nhjv->nhiv", Ms[j], S, precision=_HI) + Bs[j]
        states.append(S)
    return lax.dynamic_index_in_dim(jnp.stack(states), p, axis=0, keepdims=False)
