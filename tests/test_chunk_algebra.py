"""The per-chunk algebra (pallas_kernels.chunk_algebra) checked directly in float64.

* unit_lower_inverse against np.linalg.inv;
* Decay.gram / apply / apply_t / head / tail / last / reduce (ScalarDecay with and without G,
  VectorDecay) against explicit float64 einsums with exp(G_r − G_s) masks;
* finiteness and correctness with G very negative (the cumulative sums of clamped −inf gates);
* one chunk's forward (O, S_C) against the token recurrence, and rewy_backward_chunk ==
  wy_backward_chunk == autodiff of a float64 chunk recurrence (dq, dk, de, dz, and dg w.r.t.
  the per-token log-decays), also where every row decays strongly (dg orders below dk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_algebra as ca


def _rng(seed):
    return np.random.default_rng(seed)


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(x).all()
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / den) if den > 0 else float(np.linalg.norm(x))


def _cum_gates(rng, C, K, kind, strength=1.0):
    """Cumulative log-decay G for one chunk: None, [C] or [C, K] (non-increasing rows)."""
    if kind == "none":
        return None
    shape = (C,) if kind == "scalar" else (C, K)
    g = -strength * rng.uniform(0, 1, shape)
    return np.cumsum(g, axis=0)


def _decay_matrix(G, C, K):
    """exp(G_r − G_s) for s ≤ r, else 0, as float64 [C, C, K] (K broadcast for scalar G)."""
    r, s = np.meshgrid(np.arange(C), np.arange(C), indexing="ij")
    lower = (s <= r)[..., None]
    if G is None:
        D = np.ones((C, C, 1))
    else:
        G2 = G[:, None] if G.ndim == 1 else G
        diff = G2[:, None, :] - G2[None, :, :]
        D = np.exp(np.where(lower, diff, -np.inf))
    return np.where(lower, D, 0.0) * np.ones((1, 1, K))


# ----------------------------------------------------------------------------------------------
# unit_lower_inverse
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("C", [4, 16, 32, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_unit_lower_inverse_matches_numpy(C, seed):
    rng = _rng(seed)
    # T as in the algebra: a strictly-lower Gram of unit-ish keys, scaled by β ∈ [0, 2]
    k = rng.standard_normal((C, 8))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    Tm = np.tril(rng.uniform(0, 2, (C, 1)) * (k @ k.T), -1) * 0.5
    A = np.asarray(ca.unit_lower_inverse(_f32(Tm)), np.float64)
    want = np.linalg.inv(np.eye(C) + Tm)
    assert _rel(A, want) < 1e-5
    assert np.allclose(np.triu(A, 1), 0.0) and np.allclose(np.diag(A), 1.0)
    np.testing.assert_allclose(A @ (np.eye(C) + Tm), np.eye(C), atol=1e-4)


def test_unit_lower_inverse_zero_and_nilpotent():
    np.testing.assert_array_equal(ca.unit_lower_inverse(jnp.zeros((32, 32))), np.eye(32))
    # T with ones on the first sub-diagonal: (I + N)^-1 = Σ (−N)^i, entries ±1 below the diagonal
    N = np.diag(np.ones(15), -1)
    want = np.linalg.inv(np.eye(16) + N)
    np.testing.assert_allclose(ca.unit_lower_inverse(_f32(N)), want, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Decay objects
# ----------------------------------------------------------------------------------------------
DECAYS = [("none", 16), ("scalar", 16), ("scalar", 64), ("vector", 16), ("vector", 32),
          ("vector", 64)]


@pytest.mark.parametrize("kind,C", DECAYS)
def test_decay_gram_apply_apply_t(kind, C):
    K, D = 8, 5
    rng = _rng(10 + C)
    G = _cum_gates(rng, C, K, kind, strength=0.8)
    dec = ca.make_decay(None if G is None else _f32(G), C)
    assert isinstance(dec, ca.VectorDecay if kind == "vector" else ca.ScalarDecay)
    x, y = rng.standard_normal((C, K)), rng.standard_normal((C, K))
    Dm = _decay_matrix(G, C, K)  # [C, C, K]
    for strict in (False, True):
        want = np.einsum("rc,sc,rsc->rs", x, y, Dm)
        if strict:
            want = np.tril(want, -1)
        got = dec.gram(_f32(x), _f32(y), strict)
        assert _rel(got, want) < 1e-5, f"gram strict={strict}"
        assert np.all(np.asarray(got)[np.triu_indices(C, 0 if strict else 1)] == 0.0)
    # apply / apply_t with a lower-triangular P; vector decays need feature dim K
    P = np.tril(rng.standard_normal((C, C)))
    Dk = K if kind == "vector" else D
    yv = rng.standard_normal((C, Dk))
    Dm_k = _decay_matrix(G, C, Dk)
    want_apply = np.einsum("rs,sc,rsc->rc", P, yv, Dm_k)
    assert _rel(dec.apply(_f32(P), _f32(yv)), want_apply) < 1e-5
    want_apply_t = np.einsum("rs,rc,rsc->sc", P, yv, Dm_k)
    assert _rel(dec.apply_t(_f32(P), _f32(yv)), want_apply_t) < 1e-5
    # head / tail / last / reduce
    gam = np.ones((C, 1)) if G is None else np.exp(G if G.ndim == 2 else G[:, None])
    assert _rel(dec.head(_f32(x)), gam * x) < 1e-6
    assert _rel(dec.tail(_f32(x)), gam[-1:] / gam * x) < 1e-5
    np.testing.assert_allclose(np.asarray(dec.last()) * np.ones(gam.shape[1]), gam[-1], rtol=1e-6)
    d = rng.standard_normal((C, K))
    red = dec.reduce(_f32(d))
    if kind == "none":
        assert red is None
    elif kind == "scalar":
        np.testing.assert_allclose(red, d.sum(-1), rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(red, d, rtol=1e-6)


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_decay_finite_and_exact_with_very_negative_G(kind):
    """G_r down to −40·64: exp(−G) would overflow; exp(G_r − G_s) with s ≤ r never does."""
    C, K = 64, 8
    rng = _rng(20)
    shape = (C,) if kind == "scalar" else (C, K)
    g = -rng.uniform(0, 3, shape)
    g[rng.uniform(size=shape) < 0.2] = -40.0  # the op's floor for −inf
    G = np.cumsum(g, axis=0)
    assert G.min() < -300  # exp(-G) would be inf in fp32
    dec = ca.make_decay(_f32(G), C)
    x, y = rng.standard_normal((C, K)), rng.standard_normal((C, K))
    P = np.tril(rng.standard_normal((C, C)))
    Dm = _decay_matrix(G, C, K)
    outs = {
        "gram": (dec.gram(_f32(x), _f32(y), False), np.einsum("rc,sc,rsc->rs", x, y, Dm)),
        "apply": (dec.apply(_f32(P), _f32(y)), np.einsum("rs,sc,rsc->rc", P, y, Dm)),
        "apply_t": (dec.apply_t(_f32(P), _f32(x)), np.einsum("rs,rc,rsc->sc", P, x, Dm)),
        "head": (dec.head(_f32(x)), np.exp(G if G.ndim == 2 else G[:, None]) * x),
        "tail": (dec.tail(_f32(x)), np.exp((G[-1] - G) if G.ndim == 2 else (G[-1] - G)[:, None]) * x),
    }
    for name, (got, want) in outs.items():
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=name)


# ----------------------------------------------------------------------------------------------
# One chunk: forward against the recurrence; backward against autodiff
# ----------------------------------------------------------------------------------------------
def _chunk_recurrence64(q, k, e, z, G, S0):
    """Token recurrence of one chunk in float64 jnp: returns O [C, V], S_C [K, V].

    G is the cumulative gate; per-token g_r = G_r − G_{r−1} (G_{−1} = 0)."""
    if G is None:
        alpha = jnp.ones((q.shape[0], 1), q.dtype)
    else:
        g = G - jnp.concatenate([jnp.zeros_like(G[:1]), G[:-1]], axis=0)
        alpha = jnp.exp(g if g.ndim == 2 else g[:, None])

    def step(S, xs):
        q_t, k_t, e_t, z_t, a_t = xs
        S = a_t[:, None] * S
        S = S + jnp.outer(k_t, z_t - e_t @ S)
        return S, S.T @ q_t

    S, O = jax.lax.scan(step, S0, (q, k, e, z, alpha))
    return O, S


def _chunk_inputs(seed, C, K, V, kind):
    rng = _rng(seed)
    k = rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = rng.uniform(0, 2, (C, K if kind == "vector" else 1))
    q = rng.standard_normal((C, K)) * K ** -0.5
    e = beta * k
    z = rng.uniform(0, 2, (C, 1)) * rng.standard_normal((C, V))
    G = _cum_gates(rng, C, K, kind, strength=0.5)
    S0 = rng.standard_normal((K, V))
    return q, k, e, z, G, S0


def _chunk_forward32(q, k, e, z, G, S0):
    C = q.shape[0]
    dec = ca.make_decay(None if G is None else _f32(G), C)
    loc = ca.chunk_local(_f32(q), _f32(k), _f32(e), _f32(z), dec)
    M, Bv = ca.chunk_state_transition(loc, dec)
    O, R = ca.chunk_output(loc, _f32(S0))
    return dec, loc, M, Bv, O, R


@pytest.mark.parametrize("kind,C", [("none", 16), ("scalar", 32), ("vector", 16), ("vector", 64)])
def test_chunk_forward_matches_recurrence(kind, C):
    K, V = 8, 4
    q, k, e, z, G, S0 = _chunk_inputs(30 + C, C, K, V, kind)
    dec, loc, M, Bv, O, R = _chunk_forward32(q, k, e, z, G, S0)
    O_ref, S_ref = _chunk_recurrence64(*(None if a is None else jnp.asarray(a, jnp.float64)
                                         for a in (q, k, e, z, G, S0)))
    assert _rel(O, O_ref) < 1e-5
    assert _rel(np.asarray(M) @ S0 + np.asarray(Bv), S_ref) < 1e-5
    # the WY identities of rewy-math §3: W = A Ē, U = A Z, R = U − W S0
    np.testing.assert_allclose(loc.W, np.asarray(loc.A) @ np.asarray(loc.Eg), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(R, np.asarray(loc.U) - np.asarray(loc.W) @ S0, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,C", [("none", 16), ("scalar", 16), ("scalar", 64), ("vector", 16),
                                    ("vector", 32)])
def test_chunk_backward_rewy_wy_and_autodiff(kind, C):
    K, V = 8, 4
    q, k, e, z, G, S0 = _chunk_inputs(40 + C, C, K, V, kind)
    rng = _rng(41)
    dO, dS = rng.standard_normal((C, V)), rng.standard_normal((K, V))
    dec, loc, M, Bv, O, R = _chunk_forward32(q, k, e, z, G, S0)
    args32 = (_f32(q), _f32(k), _f32(e))
    g_rewy = ca.rewy_backward_chunk(*args32, dec, loc, _f32(S0), R, _f32(dO), _f32(dS))
    g_wy = ca.wy_backward_chunk(*args32, _f32(z), dec, loc, _f32(S0), R, _f32(dO), _f32(dS))

    # autodiff of the float64 recurrence (gradient w.r.t. the per-token log-decays g, G = cumsum)
    def loss(q, k, e, z, g, S0):
        O, S = _chunk_recurrence64(q, k, e, z, None if g is None else jnp.cumsum(g, axis=0), S0)
        return jnp.sum(O * dO) + jnp.sum(S * dS)

    x64 = [jnp.asarray(a, jnp.float64) for a in (q, k, e, z)]
    if G is None:
        ref = jax.grad(lambda q, k, e, z: loss(q, k, e, z, None, jnp.asarray(S0)),
                       argnums=(0, 1, 2, 3))(*x64)
        ref = (*ref, None)
    else:
        g64 = jnp.diff(jnp.asarray(G, jnp.float64), axis=0, prepend=0.0)
        ref = jax.grad(lambda q, k, e, z, g: loss(q, k, e, z, g, jnp.asarray(S0)),
                       argnums=(0, 1, 2, 3, 4))(*x64, g64)
    for name, a, b, want in zip(("dq", "dk", "de", "dz", "dg"), g_rewy, g_wy, ref):
        if want is None:
            assert a is None and b is None
            continue
        assert _rel(a, want) < 1e-4, f"rewy {name}: {_rel(a, want):.2e}"
        assert _rel(b, want) < 1e-4, f"wy {name}: {_rel(b, want):.2e}"
        assert _rel(a, b) < 1e-5, f"rewy vs wy {name}"


@pytest.mark.parametrize("kind", ["scalar", "vector"])
def test_gate_gradient_where_every_row_decays_strongly(kind):
    """dg at its own scale where every row decays by e^−20 (|dg| ~1e-9, dq and dk ~1): no term
    with decay factor 1 (diagonal query-key pairs, a row's own path into the end state) is
    summed into dg and taken out again, so fp32 meets the 1e-4 ratio against float64."""
    C, K, V = 16, 8, 4
    q, k, e, z, _, S0 = _chunk_inputs(7, C, K, V, kind)
    g = np.full((C,) if kind == "scalar" else (C, K), -20.0)
    G = np.cumsum(g, axis=0)
    rng = _rng(8)
    dO, dS = rng.standard_normal((C, V)), rng.standard_normal((K, V))
    dec, loc, M, Bv, O, R = _chunk_forward32(q, k, e, z, G, S0)
    got = ca.rewy_backward_chunk(_f32(q), _f32(k), _f32(e), dec, loc, _f32(S0), R, _f32(dO),
                                 _f32(dS)).dg

    def loss(g):
        O, S = _chunk_recurrence64(*(jnp.asarray(a, jnp.float64) for a in (q, k, e, z)),
                                   jnp.cumsum(g, axis=0), jnp.asarray(S0, jnp.float64))
        return jnp.sum(O * dO) + jnp.sum(S * dS)

    want = jax.grad(loss)(jnp.asarray(g, jnp.float64))
    assert float(jnp.max(jnp.abs(want))) < 1e-6  # the regime: dg far below dq, dk
    assert _rel(got, want) < 1e-4


@pytest.mark.parametrize("shape,axis", [((2, 3, 64, 4, 8), 2), ((2, 4, 3, 64), 3)])
def test_inclusive_cumsum_value_and_vjp(shape, axis):
    """inclusive_cumsum = jnp.cumsum, and its VJP is the reverse cumsum — formed as a flipped
    forward cumsum, so that on a GPU it lowers to scans rather than a whole-axis reduce-window
    per element (checked on the lowered module for CUDA)."""
    x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
    np.testing.assert_allclose(ca.inclusive_cumsum(x, axis), jnp.cumsum(x, axis), rtol=1e-6)
    ours = jax.grad(lambda x: jnp.sum(ca.inclusive_cumsum(x, axis) * w))(x)
    ref = jnp.flip(jnp.cumsum(jnp.flip(w, axis), axis), axis)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours, jax.grad(lambda x: jnp.sum(jnp.cumsum(x, axis) * w))(x),
                               rtol=1e-5, atol=1e-5)

    def lowered(cumsum):
        f = jax.jit(jax.grad(lambda x: jnp.sum(cumsum(x, axis) * w)))
        return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()

    assert "reduce_window" in lowered(jnp.cumsum)  # the fallback this function avoids
    assert "reduce_window" not in lowered(ca.inclusive_cumsum)
