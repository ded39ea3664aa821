"""The XLA chunked path: the per-chunk algebra mapped over chunks, with ReWY's custom VJP.

Data layout inside this module ("chunk layout"): ``[B, H, N, C, D]`` — N chunks of C rows.
Every chunk-local step is ``vmap``-ed over (B, H, N) at once; the only sequential parts are the
two state passes (forward: ``S ← M S + B``; backward: the state cotangent), each one
``lax.scan`` over N with one K×K×V product per step.

Sequences are described by per-chunk metadata so that batched and variable-length inputs share
one code path (``rewy_jax.layout`` builds it):

    chunk_reset [N] bool   the chunk starts a sequence (its start state is an initial state)
    chunk_seq   [N] int32  which sequence the chunk belongs to (== n_seq for padding chunks)
    end_chunk   [n_seq]    the last chunk of each sequence (its end state is the final state)

Initial states ``h0`` are ``[B, n_seq, H, K, V]`` fp32 (``n_seq = 1`` for a plain batch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import chunk_algebra as ca
from pallas_kernels.vma import vary_like

Policy = str  # "recompute" | "save"
Backward = str  # "rewy" | "wy"


def _vmap_chunks(fn):
    """vmap a per-chunk function over the (B, H, N) axes of chunk-layout arrays."""
    return jax.vmap(jax.vmap(jax.vmap(fn)))


def _local(q, k, e, z, G):
    """Chunk-local quantities for all chunks, plus the affine state maps (M, B)."""

    def one(q, k, e, z, G):
        decay = ca.make_decay(G, q.shape[0])
        loc = ca.chunk_local(q, k, e, z, decay)
        M, Bv = ca.chunk_state_transition(loc, decay)
        return loc, M, Bv

    if G is None:
        return _vmap_chunks(lambda q, k, e, z: one(q, k, e, z, None))(q, k, e, z)
    return _vmap_chunks(one)(q, k, e, z, G)


def _to_f32(*xs):
    return tuple(None if x is None else x.astype(jnp.float32) for x in xs)


def _forward_state_pass(M, Bv, h0, chunk_reset, chunk_seq):
    """Start state of every chunk. M [B,H,N,K,K], Bv [B,H,N,K,V], h0 [B,n_seq,H,K,V].

    Returns S0 [B, H, N, K, V] (fp32).
    """
    Bsz, H, N, K, V = Bv.shape
    h0_ext = jnp.concatenate([h0, jnp.zeros_like(h0[:, :1])], axis=1)  # padding chunks start at 0
    h0_per_chunk = jnp.moveaxis(h0_ext[:, chunk_seq], 1, 2)  # [B, H, N, K, V]

    xs = (jnp.moveaxis(M, 2, 0), jnp.moveaxis(Bv, 2, 0), jnp.moveaxis(h0_per_chunk, 2, 0),
          chunk_reset)
    step_b = jax.vmap(jax.vmap(ca.mm))  # M S over (B, H)

    def step_bh(S, xs):
        M_c, B_c, h0_c, reset_c = xs
        S0 = jnp.where(reset_c, h0_c, S)
        return step_b(M_c, S0) + B_c, S0

    S_init = vary_like(jnp.zeros((Bsz, H, K, V), jnp.float32), xs)  # shard_map: vary as xs do
    _, S0s = lax.scan(step_bh, S_init, xs)
    return jnp.moveaxis(S0s, 0, 2)


def _final_states(M, Bv, S0s, end_chunk):
    """End state of each sequence's last chunk: ``M S0 + B`` there. -> [B, n_seq, H, K, V]."""
    M_e, B_e, S_e = M[:, :, end_chunk], Bv[:, :, end_chunk], S0s[:, :, end_chunk]
    final = jnp.einsum("bhnij,bhnjv->bhniv", M_e, S_e, precision=lax.Precision.HIGHEST) + B_e
    return jnp.moveaxis(final, 2, 1)


def _cum_gates(g):
    """Chunk-local cumulative log-decays (rows: axis 3) as ``chunk_algebra.cum_gates``' pair
    (G without the resets, reset counts N), fp32; None stays None."""
    return ca.cum_gates(g, axis=3)


def _forward(q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk):
    q, k, e, z = _to_f32(q, k, e, z)
    loc, M, Bv = _local(q, k, e, z, _cum_gates(g))
    S0s = _forward_state_pass(M, Bv, h0, chunk_reset, chunk_seq)
    O, R = _vmap_chunks(ca.chunk_output)(loc, S0s)
    final = _final_states(M, Bv, S0s, end_chunk)
    return O, final, loc, M, S0s, R


def _backward_state_pass(loc, M, dO, dfinal, chunk_reset, chunk_seq, end_chunk, n_seq):
    """Cotangent of every chunk's end state, and of the initial states.

    With ``S_C = M S0 + B`` and ``O = Qγ S0 + P (U − W S0)``:
        dS0 = Qγᵀ dO − Wᵀ Pᵀ dO + Mᵀ dS_C,
    and at a sequence start dS0 flows into dh0 instead of the previous chunk.
    Returns dS_end [B, H, N, K, V], dh0 [B, n_seq, H, K, V].
    """
    Bsz, H, N, K, V = dO.shape[0], dO.shape[1], dO.shape[2], M.shape[-1], dO.shape[-1]

    def local_dS0(loc, dO):
        dR_o = ca.mm_tn(loc.P, dO)
        return ca.mm_tn(loc.Qg, dO) - ca.mm_tn(loc.W, dR_o)

    X = _vmap_chunks(local_dS0)(loc, dO)  # [B, H, N, K, V]
    # Final-state cotangents enter at each sequence's last chunk. Picked per step inside the scan
    # (not scattered into a [B, H, N, K, V] buffer up front: with no final-state cotangent that
    # buffer is a constant, and XLA spent seconds constant-folding the scatter).
    is_end = jnp.zeros((N,), bool).at[end_chunk].set(True)
    seq_clamped = jnp.minimum(chunk_seq, n_seq - 1)
    mT_s = jax.vmap(jax.vmap(ca.mm_tn))  # Mᵀ dS over (B, H)

    def step(carry, xs):
        X_c, M_c, reset_c, end_c, seq_c = xs
        inj_c = lax.dynamic_index_in_dim(dfinal, seq_c, axis=1, keepdims=False)  # [B, H, K, V]
        dS_end = carry + jnp.where(end_c, inj_c, 0.0)
        dS0 = X_c + mT_s(M_c, dS_end)
        return jnp.where(reset_c, 0.0, dS0), (dS_end, dS0)

    xs = (jnp.moveaxis(X, 2, 0), jnp.moveaxis(M, 2, 0), chunk_reset, is_end, seq_clamped)
    dS_init = vary_like(jnp.zeros((Bsz, H, K, V), jnp.float32), xs, dfinal)
    _, (dS_end, dS0) = lax.scan(step, dS_init, xs, reverse=True)
    dS_end, dS0 = jnp.moveaxis(dS_end, 0, 2), jnp.moveaxis(dS0, 0, 2)
    # dh0[b, n] = Σ over chunks that start sequence n of dS0 (exactly one such chunk).
    starts = jnp.where(chunk_reset, chunk_seq, n_seq)  # non-start chunks go to a dropped slot
    dh0 = jnp.zeros((Bsz, n_seq + 1, H, K, V), jnp.float32)
    dh0 = dh0.at[:, starts].add(jnp.moveaxis(dS0, 2, 1))
    return dS_end, dh0[:, :n_seq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def chunked_delta(q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk, policy, backward):
    """The general delta rule on chunk-layout inputs; differentiable by ReWY's backward.

    Args:
      q, k, e: [B, H, N, C, K]  scaled query, key, erase vectors (any float dtype).
      z:       [B, H, N, C, V]  write vectors.
      g:       None, [B, H, N, C] or [B, H, N, C, K]: per-token log-decays (≤ 0; padding rows
               0). Their chunk-local cumsum G is formed here, so the backward returns dg
               directly (chunk_algebra._leaf_grads: no term that cancels is summed twice).
      h0:      [B, n_seq, H, K, V] fp32 initial states.
      chunk_reset, chunk_seq, end_chunk: sequence metadata (module docstring).
      policy:   "recompute" (save inputs only) or "save" (also save S0, R and the chunk locals).
      backward: "rewy" (three local products) or "wy" (seven-product baseline).
    Returns:
      o [B, H, N, C, V] in z's dtype, final [B, n_seq, H, K, V] fp32.
    """
    O, final, *_ = _forward(q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk)
    return O.astype(z.dtype), final


def _fwd(q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk, policy, backward):
    O, final, loc, M, S0s, R = _forward(q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk)
    inputs = (q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk)
    saved = (loc, M, S0s, R) if policy == "save" else None
    return (O.astype(z.dtype), final), (inputs, saved)


def _bwd(policy, backward, res, cts):
    (q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk), saved = res
    dO, dfinal = cts
    if saved is None:  # "recompute": one more forward state pass
        _, _, loc, M, S0s, R = _forward(q, k, e, z, g, h0, chunk_reset, chunk_seq, end_chunk)
    else:
        loc, M, S0s, R = saved
    dO = dO.astype(jnp.float32)
    n_seq = h0.shape[1]
    dS_end, dh0 = _backward_state_pass(loc, M, dO, dfinal.astype(jnp.float32), chunk_reset,
                                       chunk_seq, end_chunk, n_seq)
    qf, kf, ef, zf = _to_f32(q, k, e, z)
    Gf = _cum_gates(g)

    def one(q, k, e, z, G, loc, S0, R, dO, dS):
        decay = ca.make_decay(G, q.shape[0])
        if backward == "wy":
            return ca.wy_backward_chunk(q, k, e, z, decay, loc, S0, R, dO, dS)
        return ca.rewy_backward_chunk(q, k, e, decay, loc, S0, R, dO, dS)

    if Gf is None:
        grads = _vmap_chunks(lambda q, k, e, z, *rest: one(q, k, e, z, None, *rest))(
            qf, kf, ef, zf, loc, S0s, R, dO, dS_end)
    else:
        grads = _vmap_chunks(one)(qf, kf, ef, zf, Gf, loc, S0s, R, dO, dS_end)
    dg = None if g is None else grads.dg.astype(g.dtype)
    return (grads.dq.astype(q.dtype), grads.dk.astype(k.dtype), grads.de.astype(e.dtype),
            grads.dz.astype(z.dtype), dg, dh0.astype(h0.dtype), None, None, None)


chunked_delta.defvjp(_fwd, _bwd)
