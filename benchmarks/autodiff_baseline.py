""""What a JAX user has": a plain chunked forward in jnp, differentiated by ``jax.grad``.

No custom VJP, no kernels: the chunk-parallel WY form (rewy-math §3) written the way model code
(MaxText-style) writes it, with ``lax.scan`` over chunks for the state pass, and autodiff for the
backward (which saves what the scan needs per chunk). Per chunk of C rows, with γ = exp(G), G the
chunk-local inclusive cumsum of the log-decays:

    Qγ = γ ⊙ Q,  Ē = γ ⊙ E,  K̄ = K ⊘ γ,  A = (I + tril(Ē K̄ᵀ, −1))⁻¹,  W = A Ē,  U = A Z
    scan over chunks:  R = U − W S,   O = Qγ S + tril(Qγ K̄ᵀ) R,   S ← Diag(γ_C) S + (γ_C ⊙ K̄)ᵀ R

Like flash-linear-attention's ``naive_chunk_*`` it forms ``K ⊘ γ``, which is fine for the
benchmark's mild decays but overflows for very strong ones (the library itself never does this).
Matmuls in fp32 at JAX's default precision (what a user gets without asking).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import solve_triangular

from benchmarks.shapes import CHUNK

f32 = jnp.float32


def _chunks(x, C):
    """[B, T, H, *] -> [B, H, N, C, *]."""
    B, T, H = x.shape[:3]
    x = x.reshape((B, T // C, C, H) + x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def chunked_general(q, k, v, g, b, w, *, scale=None, initial_state=None, chunk_size=CHUNK,
                    precision=None):
    """The general delta rule S_t = (I − k_t e_tᵀ) Diag(α_t) S_{t−1} + k_t z_tᵀ, o_t = scale·S_tᵀ q_t.

    q, k [B,T,H,K]; v [B,T,H,V]; g None, [B,T,H] or [B,T,H,K] log-decay; b [B,T,H] or [B,T,H,K]
    (e = b ⊙ k); w [B,T,H] or [B,T,H,V] (z = w ⊙ v); T a multiple of ``chunk_size``.
    Returns (o [B,T,H,V] in q's dtype, final state [B,H,K,V] fp32).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if T % C:
        raise ValueError(f"T={T} must be a multiple of chunk_size={C}")
    scale = K ** -0.5 if scale is None else scale
    ex = lambda x: x if x.ndim == 4 else x[..., None]  # noqa: E731
    qf = q.astype(f32) * scale
    kf = k.astype(f32)
    e = ex(b).astype(f32) * kf
    z = ex(w).astype(f32) * v.astype(f32)
    Q, Kc, E, Z = (_chunks(x, C) for x in (qf, kf, e, z))  # [B,H,N,C,*]
    if g is None:
        G = jnp.zeros(Q.shape[:-1] + (1,), f32)
    else:
        G = jnp.cumsum(_chunks(ex(g).astype(f32), C), axis=3)  # [B,H,N,C,1 or K]
    gam = jnp.exp(G)
    Qg, Eb, Kb = Q * gam, E * gam, Kc / gam
    mm = lambda a, b_: jnp.einsum("...ik,...jk->...ij", a, b_, precision=precision)  # noqa: E731
    r = jnp.arange(C)
    strict = r[:, None] > r[None, :]
    Tm = jnp.where(strict, mm(Eb, Kb), 0.0)
    eye = jnp.eye(C, dtype=f32)
    A = solve_triangular(eye + Tm, jnp.broadcast_to(eye, Tm.shape), lower=True, unit_diagonal=True)
    Wm = jnp.einsum("...ij,...jk->...ik", A, Eb, precision=precision)
    U = jnp.einsum("...ij,...jv->...iv", A, Z, precision=precision)
    P = jnp.where(r[:, None] >= r[None, :], mm(Qg, Kb), 0.0)
    gC = gam[..., -1:, :]  # [B,H,N,1,1 or K]
    Ktail = gC * Kb  # [B,H,N,C,K]
    S0 = (jnp.zeros((B, H, K, V), f32) if initial_state is None
          else initial_state.astype(f32))

    def step(S, xs):
        W_c, U_c, Qg_c, P_c, Kt_c, gC_c = xs  # [B,H,C,*]
        R = U_c - jnp.einsum("bhck,bhkv->bhcv", W_c, S, precision=precision)
        O = (jnp.einsum("bhck,bhkv->bhcv", Qg_c, S, precision=precision)
             + jnp.einsum("bhcs,bhsv->bhcv", P_c, R, precision=precision))
        S = jnp.swapaxes(gC_c, -1, -2) * S + jnp.einsum("bhck,bhcv->bhkv", Kt_c, R, precision=precision)
        return S, O

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (Wm, U, Qg, P, Ktail, gC))
    S, O = lax.scan(step, S0, xs)  # O [N,B,H,C,V]
    o = jnp.moveaxis(O, 0, 2).reshape(B, H, T, V)
    return jnp.moveaxis(o, 1, 2).astype(q.dtype), S


def op_call(op: str, q, k, v, gates: dict, **kw):
    """Map an op's gates (rewy_jax.testing.OPS names) to the general form."""
    if op == "deltanet":
        return chunked_general(q, k, v, None, gates["beta"], gates["beta"], **kw)
    if op in ("gdn", "kda"):
        return chunked_general(q, k, v, gates["g"], gates["beta"], gates["beta"], **kw)
    if op == "gdn2":
        return chunked_general(q, k, v, gates["g"], gates["b"], gates["w"], **kw)
    raise ValueError(op)
