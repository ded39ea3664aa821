"""The identities of docs/math.md, each checked in NumPy float64 on one random chunk.

These test the mathematics, not an implementation: no JAX, no rounding beyond float64, so every
identity must hold to ~1e-12. The implementations are checked against the float64 token
recurrence elsewhere (docs/math.md names those tests beside each identity):

* the chunk as an affine map of its start state (§ Chunked WY form): ``S_C = M S0 + B``;
* ReWY's core step (§ Reduced backward): with ``dA = dR (Z − Ē S0)ᵀ``, ``Aᵀ dA Aᵀ = Λ Rᵀ``,
  and so the seven-product backward's dT, dĒ, dZ equal the three-product ones;
* the scalar-gate reduction (§ Scalar-gate reduction): the gate gradient's Gram sums are row
  dot products of the key-gradient products;
* the reference frame (§ Centred contractions): a decayed Gram matrix is the same contraction
  evaluated around any frame row m, and around the sub-chunk midpoint it stays inside fp32's
  range whenever every g ≥ −5.
"""

from __future__ import annotations

import numpy as np
import pytest

C, K, V = 16, 8, 6


def _chunk(seed, gate):
    """One chunk: rows q, k, e (= β k), z (= β v), cumulative gate G ([C] or [C, K]), state S0."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q = rng.standard_normal((C, K)) * K ** -0.5
    beta = rng.uniform(0, 2, (C, 1))
    e, z = beta * k, beta * rng.standard_normal((C, V))
    g = -rng.uniform(0, 0.5, (C,) if gate == "scalar" else (C, K))
    return q, k, e, z, np.cumsum(g, axis=0), rng.standard_normal((K, V)), rng


def _wy(q, k, e, z, G, S0):
    """The chunked WY form written out with γ = exp(G) (fine at these mild gates)."""
    gam = np.exp(G)[:, None] * np.ones((1, K)) if G.ndim == 1 else np.exp(G)
    Eb, Kb, Qg = gam * e, k / gam, gam * q
    T = np.tril(Eb @ Kb.T, -1)
    A = np.linalg.inv(np.eye(C) + T)
    R = A @ (z - Eb @ S0)
    P = np.tril(Qg @ Kb.T)
    Kt = gam[-1] * Kb
    return dict(gam=gam, Eb=Eb, Kb=Kb, Qg=Qg, T=T, A=A, R=R, P=P, Kt=Kt,
                O=Qg @ S0 + P @ R, S=np.diag(gam[-1]) @ S0 + Kt.T @ R)


def _recurrence(q, k, e, z, G, S0):
    g = np.diff(G, axis=0, prepend=0.0)
    S, O = S0.copy(), np.zeros((C, V))
    for r in range(C):
        a = np.exp(g[r])
        S = (a[:, None] if np.ndim(a) else a) * S
        S = S + np.outer(k[r], z[r] - e[r] @ S)
        O[r] = S.T @ q[r]
    return O, S


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_wy_form_and_affine_state_map(gate):
    """O and S_C of the WY form are the recurrence's, and S_C = M S0 + B with
    M = Diag(γ_C) − K_tailᵀ W, B = K_tailᵀ U (W = A Ē, U = A Z): the state pass is linear in S0."""
    q, k, e, z, G, S0, rng = _chunk(1, gate)
    f = _wy(q, k, e, z, G, S0)
    O, S = _recurrence(q, k, e, z, G, S0)
    np.testing.assert_allclose(f["O"], O, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f["S"], S, rtol=1e-12, atol=1e-12)
    W, U = f["A"] @ f["Eb"], f["A"] @ z
    M = np.diag(f["gam"][-1]) - f["Kt"].T @ W
    B = f["Kt"].T @ U
    for S_in in (S0, rng.standard_normal((K, V))):
        np.testing.assert_allclose(M @ S_in + B, _recurrence(q, k, e, z, G, S_in)[1],
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate", ["scalar", "vector"])
def test_reduced_backward_equals_seven_products(gate):
    """Aᵀ dA Aᵀ = Λ Rᵀ for dA = dU Zᵀ + dW Ēᵀ, dU = dR, dW = −dR S0ᵀ; hence dT, dĒ (from S0) and
    dZ of the three-product form equal the seven-product form's — and a finite-difference check
    of the loss along a random direction of Ē confirms the common dĒ."""
    q, k, e, z, G, S0, rng = _chunk(2, gate)
    f = _wy(q, k, e, z, G, S0)
    A, R, Eb = f["A"], f["R"], f["Eb"]
    dR = rng.standard_normal((C, V))
    # seven products
    dU, dW = dR, -dR @ S0.T
    dA = dU @ z.T + dW @ Eb.T
    dZ7, dE7 = A.T @ dU, A.T @ dW
    dT7 = -np.tril(A.T @ dA @ A.T, -1)
    # three products
    lam = A.T @ dR
    dT3 = -np.tril(lam @ R.T, -1)
    dE3 = -lam @ S0.T
    np.testing.assert_allclose(A.T @ dA @ A.T, lam @ R.T, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dT3, dT7, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dE3, dE7, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(lam, dZ7, rtol=1e-11, atol=1e-11)
    # ⟨dR, R(Ē)⟩ differentiated in Ē through both T and the residual: dĒ = −Λ S0ᵀ + dT K̄
    loss = lambda Eb_: np.sum(dR * (np.linalg.inv(np.eye(C) + np.tril(Eb_ @ f["Kb"].T, -1))  # noqa: E731
                                    @ (z - Eb_ @ S0)))
    d = rng.standard_normal(Eb.shape)
    h = 1e-6
    fd = (loss(Eb + h * d) - loss(Eb - h * d)) / (2 * h)
    assert abs(fd - np.sum((dE3 + dT3 @ f["Kb"]) * d)) < 1e-6 * max(1.0, abs(fd))


def test_scalar_gate_reduction():
    """GDN's gate gradient needs Σ_s dT_rs T_rs and Σ_s dT_sr T_sr; they are the row dot products
    ⟨(dT K̄)_r, ē_r⟩ and ⟨(dTᵀ Ē)_r, k̄_r⟩ of the key-gradient products, and likewise
    Σ_s dP_rs P_rs = ⟨(dP K̄)_r, qγ_r⟩ for the output path: no Gram matrix is recomputed."""
    q, k, e, z, G, S0, rng = _chunk(3, "scalar")
    f = _wy(q, k, e, z, G, S0)
    dT = np.tril(rng.standard_normal((C, C)), -1)
    dP = np.tril(rng.standard_normal((C, C)))
    np.testing.assert_allclose(np.sum(dT * f["T"], axis=1),
                               np.sum((dT @ f["Kb"]) * f["Eb"], axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.sum(dT * f["T"], axis=0),
                               np.sum((dT.T @ f["Eb"]) * f["Kb"], axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.sum(dP * f["P"], axis=1),
                               np.sum((dP @ f["Kb"]) * f["Qg"], axis=1), rtol=1e-12, atol=1e-12)


def test_reference_frames_and_the_centred_bound():
    """T_rs = Σ_c e_rc k_sc exp(G_rc − G_sc) equals the contraction (e_r ⊙ e^{G_r − G_m}) ·
    (k_s ⊙ e^{G_m − G_s}) for every frame m. Around the midpoint of a 16-row sub-chunk with every
    g ≥ −5 the largest exponent is 8 · 5 = 40 (e^40 ≈ 2.4e17, far inside fp32); around row 0 of a
    64-row chunk it would be 63 · 5 = 315, which overflows fp32 — why frames are per sub-chunk."""
    rng = np.random.default_rng(4)
    sub = 16
    e, k = rng.standard_normal((sub, K)), rng.standard_normal((sub, K))
    G = np.cumsum(np.full((sub, K), -5.0), axis=0)  # the strongest decay g = −5 admits
    exact = np.einsum("rc,sc,rsc->rs", e, k, np.exp(G[:, None, :] - G[None, :, :]))
    exact = np.tril(exact)
    for m in (0, sub // 2, sub - 1):
        framed = np.tril((e * np.exp(G - G[m])) @ (k * np.exp(G[m] - G)).T)
        np.testing.assert_allclose(framed, exact, rtol=1e-10, atol=1e-300)
    m = sub // 2
    with np.errstate(over="raise"):
        left = (e * np.exp(G - G[m])).astype(np.float32)
        right = (k * np.exp(G[m] - G)).astype(np.float32)
    assert np.isfinite(left).all() and np.isfinite(right).all()
    assert np.max(np.abs(G - G[m])) <= 40.0
    G64 = np.cumsum(np.full((64, K), -5.0), axis=0)
    with np.errstate(over="ignore"):
        first_row_frame = (k[:1] * np.exp(G64[0] - G64)).astype(np.float32)  # e^{G_0 − G_s}
    assert not np.isfinite(first_row_frame).all()
