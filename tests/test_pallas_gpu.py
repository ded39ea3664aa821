"""The Pallas GPU (Triton) kernels against the float64 token recurrence.

CPU: the same kernels in Pallas interpret mode (``interpret=True``) on small shapes — every
output and gradient, T not a multiple of the chunk, initial state, strong decays, several value
tiles, varlen, both policies, both backward schemes, dispatch/fallback. fp32 inputs, so the
tolerance is rewy-math §8's 1e-4.

GPU (``-m gpu``, skipped without a CUDA device): every op at bf16 at FLA-like head dims on the
real Triton lowering, with reduced T so the reference stays cheap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewy_jax
from pallas_kernels.gpu import chunk_backward, chunk_local, launch, state_passes
from pallas_kernels.gpu import gates as gates_mod
from pallas_kernels.gpu import output as output_mod
from rewy_jax import backends, testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

_ON_GPU = jax.default_backend() == "gpu"


def _check(rep):
    bad = {n: f"{r:.2e} > {tol:.0e}" for n, (r, tol) in rep.items() if not r <= tol}
    assert not bad, bad


# Field overrides on every call's default KernelConfig during one test (reset by ``tuned``):
# tests set entries to run the kernels under another setting, as the ops' kernel_config= does.
_TUNED: dict = {}
_DEFAULT_CONFIG = None  # config.default_config itself, before ``tuned`` wraps it


@pytest.fixture(autouse=True)
def tuned(monkeypatch):
    """Every pallas_gpu call of the test runs its default config with ``_TUNED``'s overrides.
    This file's small K (16, 32) stand in for the production head dims (≥ 64), at which 16-bit
    calls run the 16-bit kernels; KernelConfig.narrow_keys would run them on fp32 here, so it
    is 0 (the tests of that policy set it back)."""
    from pallas_kernels.gpu import config

    global _DEFAULT_CONFIG
    _DEFAULT_CONFIG = _DEFAULT_CONFIG or config.default_config
    _TUNED.clear()
    _TUNED["narrow_keys"] = 0
    real = _DEFAULT_CONFIG
    monkeypatch.setattr(config, "default_config",
                        lambda *a, **k: real(*a, **k).with_overrides(_TUNED))
    yield _TUNED
    _TUNED.clear()


def _default(mode="scalar", K=32, V=32, dtype=jnp.bfloat16, **kw):
    """The measured default KernelConfig (without this file's overrides)."""
    from pallas_kernels.gpu import config

    return (_DEFAULT_CONFIG or config.default_config)(mode, K, V, dtype, **kw)


def _kcfg(mode="scalar", K=32, V=32, dtype=jnp.float32, **over):
    """A KernelConfig for tests that call the kernels directly: the default plus ``over``."""
    return _default(mode, K, V, dtype).with_overrides({"narrow_keys": 0, **_TUNED, **over})


def _wu_case(mode, K, V, seed):
    """(Shape, k, e = 0.7 k, z, G, a spare PRNG key): bf16 rows at B = 1, T = 128, H = 2, C = 64,
    strong gates of ``mode`` (G from the chunk's start), the config with ``_TUNED`` — the
    kernel-level tests of W, U."""
    from pallas_kernels.gpu import api

    B, T, H, C = 1, 128, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    k = (jax.random.normal(ks[0], (B, T, H, K)) / K ** 0.5).astype(jnp.bfloat16)
    e = (0.7 * k.astype(jnp.float32)).astype(jnp.bfloat16)
    z = jax.random.normal(ks[1], (B, T, H, V)).astype(jnp.bfloat16)
    G = None
    if mode != "none":
        g = -jax.random.uniform(ks[2], (B, T, H) if mode == "scalar" else (B, T, H, K),
                                jnp.float32, 0.01, 3.0)
        G, _ = api._cum_gates(g, C, True, 4)
    h0 = jnp.zeros((B, H, 2, K, V), jnp.float32)
    s = api._shape(api.Config(C, "recompute", "rewy", True, _kcfg(mode, K, V, jnp.bfloat16),
                              one_seq=True), k, z, G, h0)
    return s, k, e, z, G, ks[3]


@pytest.fixture
def small_tiles(tuned):
    """Value and key tiles of 16 so that V = 32 / K = 32 run two tiles through the kernels."""
    tuned.update(block_v=16, block_k=16, block_v_state=16)


# (op, T, K, V, chunk, decay, extra kwargs) — each case compiles its own interpret kernels.
CPU_CASES = [
    ("deltanet", 40, 16, 32, 16, "normal", {}),
    ("gdn", 50, 32, 16, 32, "strong", {}),
    ("kda", 40, 16, 32, 16, "strong", {}),
    ("gdn2", 33, 32, 16, 32, "normal", {}),
    ("kda", 40, 16, 16, 32, "normal", {"backward": "wy", "policy": "save"}),
    ("gdn", 40, 16, 16, 16, "normal", {"backward": "wy"}),
    ("gdn2", 40, 16, 16, 16, "strong", {"policy": "save"}),
    ("kda", 70, 16, 16, 64, "strong", {}),  # the default chunk: four sub-chunk blocks
    ("gdn", 70, 16, 16, 64, "normal", {"backward": "wy"}),
    # declared gate bound: centred diagonal blocks, at the strongest decays the bound admits
    ("kda", 70, 16, 16, 64, "bounded", {"gate_lower_bound": -5.0}),
    ("gdn2", 40, 32, 16, 16, "bounded", {"gate_lower_bound": -5.0, "backward": "wy", "policy": "save"}),
]


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin; the GPU test below runs the real kernels")
@pytest.mark.parametrize("op,T,K,V,C,decay,kw", CPU_CASES,
                         ids=[f"{c[0]}-T{c[1]}-K{c[2]}V{c[3]}-C{c[4]}-{c[5]}-" +
                              "-".join(f"{v}" for v in c[6].values()) for c in CPU_CASES])
def test_interpret_matches_reference(op, T, K, V, C, decay, kw, small_tiles):
    inp = testing.make_inputs(op, 2, T, 2, K, V, decay=decay, seed=3)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=C, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1))
def test_interpret_random_cases(seed, small_tiles):
    """Redrawn cases beside the fixed ones above (``testing.random_case``: any op, T, K ≠ V,
    chunk, decay regime, scheme, policy, initial state, packing), fp32: the kernels' defaults
    within 1e-4 of the float64 recurrence for every output and gradient. The same draws, many
    more and in bf16 too: ``python -m benchmarks.interpret_sweep``."""
    case = testing.random_case(np.random.default_rng(seed), max_T=90, dtypes=("float32",))
    rep = case.report(seed=seed, backend="pallas_gpu", interpret=True)
    bad = {n: f"{r:.2e} > {tol:.0e}" for n, (r, tol) in rep.items() if not r <= tol}
    assert not bad, (case.label(), bad)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_interpret_narrow_keys_run_in_fp32(small_tiles, monkeypatch):
    """KernelConfig.narrow_keys: at K ≤ 32 a bf16 call runs the kernels on fp32 q, k, v (three-TF32
    products on the GPU, exact fp32 here) and still returns o in bf16. On the case an interpret
    sweep found (benchmarks/results/interpret-sweep-26: DeltaNet, K = 16, T = 272, no decay,
    β ∈ [0, 2], two packed sequences with initial states) the 16-bit kernels' dk exceeds
    rewy-math §8's 1e-2; this path meets every bound with room."""
    from pallas_kernels.gpu import api

    case = testing.Case("deltanet", 1, 272, 1, 16, 16, 64, "none", "rewy", "recompute", True, 2,
                        "bfloat16")
    _TUNED["narrow_keys"] = _default().narrow_keys
    assert _default().narrow_keys >= 16
    o, _ = testing.run_op("deltanet", case.inputs(27002), backend="pallas_gpu", interpret=True,
                          use_qk_l2norm=True, **case.kwargs())
    assert o.dtype == jnp.bfloat16
    rep = case.report(27002, backend="pallas_gpu", interpret=True)
    assert all(r <= tol / 2 for r, tol in rep.values()), rep
    assert api._precision(jnp.bfloat16, False, narrow=True) == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    _TUNED["narrow_keys"] = 0  # the 16-bit kernels, same case
    sixteen = case.report(27002, backend="pallas_gpu", interpret=True)
    assert sixteen["dk"][0] > sixteen["dk"][1], sixteen


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("kw", [{}, {"gate_lower_bound": -5.0}, {"backward": "wy"}],
                         ids=["exact", "centred", "wy"])
def test_interpret_leaf_chunk_grid(kw, small_tiles, monkeypatch):
    """The leaf and qk_gram kernels with one program per chunk (their row grids off; a tuning
    option — the row grids are the default)."""
    _TUNED["leaf_rowgrid"] = False
    _TUNED["qk_gram_rowgrid"] = False
    inp = testing.make_inputs("kda", 1, 70, 2, 16, 16, decay="bounded", seed=11)
    _check(testing.accuracy_report("kda", inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw,diag,gram_from_qk,shared", [
    ("kda", "strong", {}, "loop", True, True),
    ("kda", "strong", {}, "levels", True, True),
    ("gdn2", "bounded", {"gate_lower_bound": -5.0, "policy": "save"}, "loop", True, False),
    ("kda", "bounded", {"gate_lower_bound": -5.0, "backward": "wy"}, "levels", False, True),
    ("kda", "strong", {}, "loop", False, False)])
def test_interpret_shared_decay_options(op, decay, kw, diag, gram_from_qk, shared, small_tiles,
                                        monkeypatch):
    """The shared-decay-factor options (default on) and their alternatives — intra reading its
    key Gram T from qk_gram or building it, the leaf applying dT and dA_qk through one set of
    factors or two — with each diagonal method (exact
    loop, exact bit levels, centred under a bound) at strong decays: every output and gradient."""
    _TUNED["gram_from_qk"] = gram_from_qk
    _TUNED["leaf_shared_decay"] = shared
    _TUNED["qk_gram_diag"] = diag
    _TUNED["leaf_diag"] = diag
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=13)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,n_seqs,C", [("deltanet", "none", None, 16),
                                               ("gdn", "strong", 3, 32),
                                               ("kda", "strong", None, 64),
                                               ("gdn2", "normal", 2, 16)])
def test_interpret_fused_output_pass(op, decay, n_seqs, C, small_tiles, monkeypatch):
    """KernelConfig.fused_output: the output formed inside the forward state pass (no
    S0, R stored) — every output and gradient against the float64 recurrence, initial states
    and packed sequences included, T not a multiple of the chunk; o and the final state equal
    the two-kernel forward's to fp32 rounding; policy "save" (which keeps S0, R) still runs."""
    inp = testing.make_inputs(op, 1 if n_seqs else 2, 70, 2, 32, 32, decay=decay, seed=19,
                              n_seqs=n_seqs)
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=C, use_qk_l2norm=True)
    _TUNED["fused_output"] = False
    o2, f2 = testing.run_op(op, inp, **kw)
    _TUNED["fused_output"] = True
    o1, f1 = testing.run_op(op, inp, **kw)
    assert _rel(o1, o2) < 1e-6 and _rel(f1, f2) < 1e-6
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True, chunk_size=C))
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True, chunk_size=C,
                                   policy="save"))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,gram_from_qk,kw", [("kda", True, {}),
                                                ("gdn2", False, {"policy": "save"})])
def test_interpret_outer_diagonal(op, gram_from_qk, kw, small_tiles, monkeypatch):
    """qk_gram's diagonal blocks by the "outer" method (all pairs at once, key slices of
    decay.OUTER_SLICE; K = 32 makes two slices): every output and gradient at strong
    decays (g down to −50 and −inf), forming P alone or P and intra's T. The method needs the
    row operands' refs: intra's own Gram reads them over key slices (``intra_kslice``, the
    default) and then runs it too; from fp32 rows (kslice 0: no refs) it refuses it by name."""
    from pallas_kernels.gpu import decay

    _TUNED["qk_gram_diag"] = "outer"
    _TUNED["gram_from_qk"] = gram_from_qk
    monkeypatch.setattr(decay, "OUTER_SLICE", 16)
    inp = testing.make_inputs(op, 1, 70, 2, 32, 16, decay="strong", seed=16)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))
    _TUNED["intra_diag"] = "outer"
    _TUNED["gram_from_qk"] = False
    if not gram_from_qk:  # intra's own vector-gate Gram by "outer", read over key slices
        _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                       chunk_size=64, **kw))
    _TUNED["intra_kslice"] = 0
    with pytest.raises(ValueError, match="outer"):
        testing.run_op(op, inp, backend="pallas_gpu", interpret=True, chunk_size=64)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,kw,kslice", [("kda", {}, 16), ("kda", {"gate_lower_bound": -5.0}, 0),
                                          ("gdn2", {"backward": "wy", "policy": "save"}, 16),
                                          ("deltanet", {}, 16), ("gdn", {"backward": "wy"}, 16)])
def test_interpret_key_sliced_grams(op, kw, kslice, monkeypatch):
    """Gram blocks contracted over key slices — qk_gram's (``rewy_qk_gram.kslice``, default
    16) and intra's own (``rewy_intra.kslice``, an option: the no-gate and scalar-gate key
    Gram, read as stored) — K = 32 in two loop steps, or over all K at once (0): strong or
    bounded decays, every output and gradient."""
    _TUNED["qk_gram_kslice"] = kslice
    _TUNED["intra_kslice"] = kslice
    # GDN2: intra forms its own vector-gate key Gram (frame blocks and diagonal loop, sliced)
    _TUNED["gram_from_qk"] = op != "gdn2"
    decay = "bounded" if kw.get("gate_lower_bound") else "strong"
    inp = testing.make_inputs(op, 1, 70, 2, 32, 32, decay=decay, seed=17)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {}),
                                         ("gdn", "strong", {"backward": "wy"}),
                                         ("kda", "strong", {"policy": "save"})])
def test_interpret_chained_diagonal_inverse(op, decay, kw, small_tiles, monkeypatch):
    """intra inverting its diagonal blocks one after another (the tuning alternative to the
    default interleaved loop): every output and gradient, each gate kind, strong decays."""
    _TUNED["joint_diag_inverse"] = False
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=14)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,kw,diag", [("kda", {}, "levels"), ("kda", {}, "loop"),
                                        ("gdn2", {"backward": "wy", "policy": "save"}, "levels")])
def test_interpret_exact_diagonals_strong_decay(op, kw, diag, small_tiles, monkeypatch):
    """Both exact diagonal-block methods (per-column loop, bit levels) in every kernel that has
    them, at strong decays (g down to −10, −50 and −inf): every output and gradient, no
    overflow. (The defaults mix them: loop in intra/qk_gram, levels in bwd_leaf.)"""
    for k in ("intra", "qk_gram", "leaf"):
        _TUNED[f"{k}_diag"] = diag
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay="strong", seed=12)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("gdn2", "strong", {}),
                                         ("deltanet", "none", {"backward": "wy"})])
def test_interpret_full_recompute(op, decay, kw, small_tiles, monkeypatch):
    """Policy "recompute" re-forming A (and P) in the backward instead of keeping them (the
    tuning alternative to the default): every output and gradient."""
    _TUNED["keep_chunk_matrices"] = False
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=16)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_row_scales_keep_no_products(monkeypatch):
    """With a per-row β (general_delta's rows) the backward's residuals hold k, v and β — no
    e = βk or z = βv — and the gradient comes back for k, v, β themselves: dk, dv in their
    dtypes, dβ fp32, none for e."""
    from pallas_kernels.gpu import api

    residuals = []
    fwd = api._fwd
    monkeypatch.setattr(api, "_fwd", lambda *a: (lambda out: residuals.append(out[1]) or out)(
        fwd(*a)))
    api.general_delta.defvjp(api._fwd, api._bwd)
    try:
        inp = testing.make_inputs("kda", 1, 40, 2, 16, 16, dtype=jnp.bfloat16, seed=3)
        kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16)

        def loss(k, v, beta):
            o, _ = rewy_jax.chunk_kda(inp["q"], k, v, inp["g"], beta, **kw)
            return jnp.sum(o.astype(jnp.float32))

        dk, dv, dbeta = jax.grad(loss, argnums=(0, 1, 2))(inp["k"], inp["v"], inp["beta"])
    finally:
        api.general_delta.defvjp(fwd, api._bwd)
    (res,) = residuals
    q, k, e, z, *_, rows = res
    assert e is None  # z is v itself, and rows β twice (erase and write), laid out (T 40 -> 48)
    np.testing.assert_array_equal(np.asarray(z[:, :40], np.float32),
                                  np.asarray(inp["v"], np.float32))
    for r in rows:
        np.testing.assert_array_equal(np.asarray(r[:, :40]), np.asarray(inp["beta"]))
    assert dk.dtype == dv.dtype == jnp.bfloat16 and dbeta.dtype == jnp.float32
    assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in (dk, dv, dbeta))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("mode", ["none", "scalar", "vector"])
def test_recompute_keeps_chunk_matrices_not_states(mode):
    """Policy "recompute" keeps A (and P for vector gates) for the backward and no chunk state;
    intra given that A re-forms the forward's W and U exactly (same fp32 products)."""
    from pallas_kernels.gpu import api

    B, T, H, K, V, C = 1, 128, 2, 16, 32, 64
    rng = np.random.default_rng(17)
    x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, e, z = x(B, T, H, K), x(B, T, H, K) / 4, x(B, T, H, K) / 4, x(B, T, H, V)
    G = None if mode == "none" else -jnp.abs(x(*((B, T, H) if mode == "scalar" else
                                                 (B, T, H, K)))).cumsum(1) / 8
    N = T // C
    h0 = jnp.zeros((B, H, 2, K, V), jnp.float32)
    meta = ((jnp.arange(N) == 0).astype(jnp.int32), (jnp.arange(N) == N - 1).astype(jnp.int32),
            jnp.zeros((N,), jnp.int32))
    cfg = api.Config(C, "recompute", "rewy", True, _kcfg(mode, K, V, block_v=16))
    _, res = api._fwd(cfg, q, k, e, z, G, h0, *meta)
    kept = res[-2]
    assert res[-1] is None  # no per-row scales given (general_delta's rows)
    assert len(kept) == 2 and kept[0].shape == (B, H, N, C, C)
    assert (kept[1] is None) == (mode != "vector")
    assert all(a.shape[-2:] != (K, V) for a in jax.tree_util.tree_leaves(res)
               if a is not h0 and hasattr(a, "shape"))
    s = api._shape(cfg, q, z, G, h0)
    A, W, U, _ = api._intra(s, q, k, e, z, G, True)
    W2, U2 = chunk_local.intra(s, k, e, z, G, A=A, interpret=True)
    np.testing.assert_array_equal(np.asarray(W2), np.asarray(W))
    np.testing.assert_array_equal(np.asarray(U2), np.asarray(U))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {}), ("kda", "strong", {}),
                                         ("gdn", "normal", {"backward": "wy", "policy": "save"})])
def test_interpret_low_precision_backward(op, decay, kw, monkeypatch):
    """KernelConfig.backward_low_precision: the backward's stored S0, R, dS, dR, dRl, Λ, W, U, dT and dA_qk
    and the forward's kept A in bf16 (16-bit inputs). The forward is untouched bit for bit; every gradient stays within the bf16
    thresholds against the float64 recurrence; the stored tensors really are bf16."""
    from pallas_kernels.gpu import api, config

    inp = testing.make_inputs(op, 1, 100, 2, 32, 32, dtype=jnp.bfloat16, decay=decay, seed=23)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32)
    _TUNED["backward_low_precision"] = ()  # all fp32
    ref = testing.accuracy_report(op, inp, **kw)
    o_ref = testing.run_op(op, inp, **kw)[0]
    _TUNED["backward_low_precision"] = config.LOW_PRECISION_NAMES
    rep = testing.accuracy_report(op, inp, **kw)
    _check(rep)
    np.testing.assert_array_equal(np.asarray(testing.run_op(op, inp, **kw)[0]), np.asarray(o_ref))
    assert any(rep[n][0] != ref[n][0] for n in rep if n.startswith("d"))  # it did take effect
    s = api._shape(api.Config(32, "recompute", "rewy", True, _kcfg()), inp["q"], inp["v"],
                   None, jnp.zeros((1, 2, 2, 32, 32)))
    sd = api._stored_dtypes(s, jnp.bfloat16)
    assert set(sd.values()) == {jnp.bfloat16} and set(api._stored_dtypes(s, jnp.float32).values()) == {
        jnp.float32}
    with pytest.raises(ValueError, match="backward_low_precision.*must be a tuple of some of"):
        _kcfg(backward_low_precision=("S0", "dW"))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("kda", "strong", {}),
                                         ("gdn", "normal", {"policy": "save"})])
def test_interpret_native_pass_dots(op, decay, kw, small_tiles, monkeypatch):
    """backward.native_pass_dots (default): the backward's state passes multiply in the bf16
    they store (S, R; dS, dR), against the TF32 products of the fp32 values. The forward is untouched bit for bit, every gradient stays within the bf16
    thresholds against the float64 recurrence (initial states, packed sequences, T not a
    multiple of the chunk, two value tiles), and the option does change the gradients; fp32
    inputs never take it."""
    n_seqs = kw.pop("n_seqs", None)
    inp = testing.make_inputs(op, 1, 100, 2, 32, 32, dtype=jnp.bfloat16, decay=decay, seed=31,
                              n_seqs=n_seqs)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32)
    _TUNED["backward_native_pass_dots"] = False
    ref = testing.accuracy_report(op, inp, **kw)
    o_ref = testing.run_op(op, inp, **kw)[0]
    _TUNED["backward_native_pass_dots"] = True
    rep = testing.accuracy_report(op, inp, **kw)
    _check(rep)
    np.testing.assert_array_equal(np.asarray(testing.run_op(op, inp, **kw)[0]), np.asarray(o_ref))
    assert any(rep[n][0] != ref[n][0] for n in rep if n.startswith("d"))  # it did take effect
    s = launch.Shape(1, 32, 1, 32, 32, 32, 2, "none", None, _kcfg())
    assert not state_passes.native_pass_dots(s, (jnp.float32, jnp.bfloat16))
    assert state_passes.native_pass_dots(s, (jnp.bfloat16, jnp.bfloat16))


def _record_launches(monkeypatch):
    """Wrap launch.call so that every launch's settings (name, grid, in_specs, out_shape, …)
    are appended to the returned list, for tests that check which kernels an option runs."""
    launches, call = [], launch.call

    def recorded(kernel, **launch):
        launches.append(launch)
        return call(kernel, **launch)

    monkeypatch.setattr(launch, "call", recorded)
    return launches


def _same_runs(a, b):
    """Two runs' outputs and gradients (pytrees of arrays) agree bit for bit."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _bf16_case(op, decay, seed, kw):
    """bf16 inputs (B = 1, T = 100, H = 2, K = V = 32; packed sequences when kw has "n_seqs"),
    fp32 cotangents for o and the final state, and the interpret-mode call's keywords (chunk
    32, two value tiles with ``small_tiles``) — for tests comparing two kernel settings."""
    kw = dict(kw)
    n_seqs = kw.pop("n_seqs", None)
    inp = testing.make_inputs(op, 1, 100, 2, 32, 32, dtype=jnp.bfloat16, decay=decay, seed=seed,
                              n_seqs=n_seqs)
    cts = testing.make_inputs(op, 1, 100, 2, 32, 32, seed=seed + 1, n_seqs=n_seqs)
    cts = {"o": cts["v"], "final_state": cts["initial_state"]}
    return inp, cts, dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32,
                          use_qk_l2norm=True)


def _bit_identical_with(monkeypatch, case, key, value):
    """The outputs and every gradient of ``case`` (``_bf16_case``'s inputs, cotangents and
    keywords) with the KernelConfig field ``key`` = value are bit for bit those without;
    returns the launches of the run with it (``_record_launches``), to check which kernels it
    ran."""
    op, inp, cts, kw = case
    base = testing.loss_and_grads(op, inp, cts, **kw)
    launched = _record_launches(monkeypatch)
    _TUNED[key] = value
    _same_runs(testing.loss_and_grads(op, inp, cts, **kw), base)
    return launched


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("vector", [True, False])
def test_interpret_gate_clamp_in_kernel(vector):
    """The clamp of g to its floor (chunk_algebra.clamp_gates) done by the kernel that forms G,
    and its VJP by the one that sums dg (api.Config.g_floor): G, the mask and dg equal the
    clamp in jnp followed by the unclamped kernels, bit for bit, with gates below the floor,
    exactly at it (their gradient passes) and −inf."""
    from pallas_kernels.gpu import api
    from pallas_kernels.chunk_algebra import clamp_gates

    C, floor = 16, -5.0
    shape = (2, 48, 3) + ((32,) if vector else ())
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    g = -jax.random.uniform(ks[0], shape, jnp.float32, 0.0, 8.0)
    pick = jax.random.randint(ks[3], shape, 0, 8)
    g = jnp.where(pick == 0, floor, jnp.where(pick == 1, -jnp.inf, g))
    pairs = jax.random.normal(ks[1], shape, jnp.float32)
    path = jax.random.normal(ks[2], shape, jnp.float32)
    clamped = clamp_gates(g, floor)
    G, below = api._cum_gates(g, C, True, 4, floor, keep_below=True)
    assert np.array_equal(G, api._cum_gates(clamped, C, True, 4)[0])
    assert np.array_equal(np.asarray(below) != 0, np.asarray(g) < floor)
    assert 0 < int(np.sum(np.asarray(below) != 0)) < below.size
    assert api._cum_gates(g, C, True, 4, floor)[1] is None  # the primal keeps no mask
    dg = api._gate_grad((pairs, path), C, True, 4, below)
    _, vjp = jax.vjp(lambda x: clamp_gates(x, floor), g)
    assert np.array_equal(dg, vjp(api._gate_grad((pairs, path), C, True, 4))[0])


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_interpret_op_clamps_gates_in_kernel(op, monkeypatch):
    """Through the op, the Pallas GPU backend reads g as given and clamps it in-kernel: XLA's
    clamp (ops.clamp_gates, what GeneralCall.g applies) is never traced, and every gate below
    the floor (strong decays: −50 and −inf under the floor −40) gets a gradient of exactly 0."""
    from rewy_jax import ops

    def refuse(*_):
        raise AssertionError("the Pallas GPU path traced XLA's gate clamp")

    inp = testing.make_inputs(op, 1, 40, 2, 16, decay="strong", seed=5)
    cts = {"o": jnp.ones((1, 40, 2, 16)), "final_state": jnp.ones((1, 2, 16, 16))}
    monkeypatch.setattr(ops, "clamp_gates", refuse)
    o, s, grads = testing.loss_and_grads(op, inp, cts, backend="pallas_gpu", interpret=True,
                                         chunk_size=16)
    below = np.asarray(inp["g"]) < ops.GATE_FLOOR
    assert below.any() and np.all(np.isfinite(np.asarray(grads["dg"])))
    assert np.all(np.asarray(grads["dg"])[below] == 0.0)
    assert np.any(np.asarray(grads["dg"])[~below] != 0.0)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("K", [32, 128])
def test_interpret_gate_kernels(K):
    """gates_mod.cum_gates / gate_grad (vector gates' G and dg, in-kernel since profile-21)
    against the plain-JAX cumsums of chunk_algebra in float64, over several chunks, heads and
    key tiles, with strong decays (g down to −60) and gradient parts of mixed sign."""
    from pallas_kernels.chunk_algebra import exclusive_cumsum, reverse_cumsum
    from pallas_kernels.gpu import api

    C, shape = 16, (2, 48, 3, K)
    ks = jax.random.split(jax.random.PRNGKey(K), 3)
    g = -jax.random.uniform(ks[0], shape, jnp.float32, 0.0, 60.0) ** 2 / 60.0
    pairs = 30.0 * jax.random.normal(ks[1], shape, jnp.float32)
    path = jax.random.normal(ks[2], shape, jnp.float32)
    f64 = lambda x: np.asarray(x, np.float64).reshape(2, 3, C, 3, K)  # noqa: E731
    G = gates_mod.cum_gates(g, C, interpret=True, warps=4)
    np.testing.assert_allclose(np.asarray(G).reshape(2, 3, C, 3, K),
                               np.cumsum(f64(g), axis=2), rtol=1e-6, atol=1e-5)
    # the Mosaic GPU backend's form: clamped, scaled, head-major [B, H, Tp, K]
    Gh = gates_mod.cum_gates(g, C, interpret=True, warps=4, floor=-40.0, scale=1.5, head_major=True)
    want = np.cumsum(np.maximum(f64(g), -40.0) * 1.5, axis=2).reshape(2, 48, 3, K).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.asarray(Gh), want, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="head_major"):
        gates_mod.cum_gates(g, C, interpret=True, warps=4, floor=-40.0, below=True, head_major=True)
    dg = gates_mod.gate_grad(pairs, path, C, interpret=True, warps=4)
    ref = np.flip(np.cumsum(np.flip(f64(pairs), 2), 2), 2) + np.cumsum(f64(path), 2) - f64(path)
    err = np.linalg.norm(np.asarray(dg, np.float64).reshape(ref.shape) - ref) / np.linalg.norm(ref)
    assert err < 1e-6, err
    # the dispatch: vector gates through the kernels, scalar gates in jnp (same sums)
    assert np.array_equal(api._cum_gates(g, C, True, 4)[0], G)
    np.testing.assert_allclose(api._gate_grad((pairs, path), C, True, 4), dg)
    gs = g[..., 0]
    np.testing.assert_allclose(api._cum_gates(gs, C, True, 4)[0], G[..., 0], rtol=1e-6, atol=1e-5)
    sc = api._gate_grad((pairs[..., 0], path[..., 0]), C, True, 4)
    c = lambda x: api._chunks(x, C)  # noqa: E731
    np.testing.assert_allclose(
        sc, (reverse_cumsum(c(pairs[..., 0]), 2) + exclusive_cumsum(c(path[..., 0]), 2)
             ).reshape(sc.shape), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_interpret_qk_gram_centred(monkeypatch):
    """KernelConfig.qk_gram_centred: under a declared gate bound qk_gram's diagonal blocks as
    centred frame products give P and T as the exact loop does, to fp32 rounding, with every
    gate at the bound (factors up to e^40 before the mask); without the bound the loop stays;
    KDA through the op within the bf16 thresholds."""
    from pallas_kernels.gpu import api

    s, k, e, _, _, key = _wu_case("vector", 32, 32, 17)
    kq, kg = jax.random.split(key)
    q = (jax.random.normal(kq, k.shape) / k.shape[-1] ** 0.5).astype(jnp.bfloat16)
    g = -jax.random.uniform(kg, k.shape, jnp.float32, 0.0, 5.0).at[:, ::7].set(-5.0)
    G, _ = api._cum_gates(g, s.C, True, 4)
    h0 = jnp.zeros((1, 2, 2, 32, 32), jnp.float32)

    def centred(on):  # the shape of a call with a declared bound
        return api._shape(api.Config(s.C, "recompute", "rewy", True,
                                     _kcfg("vector", qk_gram_centred=on), centred=True,
                                     one_seq=True), k, k, G, h0)

    assert _default("vector").qk_gram_centred  # default since profile-21
    exact = chunk_local.qk_gram(centred(False), q, k, G, e=e, interpret=True)
    seen = []
    gates = chunk_local.Gates
    monkeypatch.setattr(chunk_local, "Gates", lambda *a, **k_: seen.append(a[4]) or gates(*a, **k_))
    got = chunk_local.qk_gram(centred(True), q, k, G, e=e, interpret=True)
    assert seen == ["centred"], seen
    for x, y in zip(got, exact, strict=True):  # P, T
        assert _rel(x, y) < 1e-5, _rel(x, y)
    seen.clear()
    chunk_local.qk_gram(s, q, k, G, e=e, interpret=True)  # no declared bound: exact
    assert seen == [_default("vector").qk_gram_diag], seen
    inp, _, kw = _bf16_case("kda", "normal", 79, {})
    _check(testing.accuracy_report("kda", inp, gate_lower_bound=-5.0, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("mode", ["none", "scalar", "vector"])
@pytest.mark.parametrize("kslice", [0, 16])
def test_interpret_intra_rows(mode, kslice, monkeypatch):
    """chunk_local.intra and qk_gram with per-row scales (``rows``, ``e_rows``): from k, v as stored
    and β, the same A, W, U, T as from the exactly scaled fp32 rows — with the Grams over key
    slices (native products of the stored rows) or whole."""
    _TUNED["intra_kslice"] = kslice
    _TUNED["qk_gram_kslice"] = kslice
    s, k, _, v, G, key = _wu_case(mode, 32, 32, 13)
    kq, kb = jax.random.split(key)
    q = (jax.random.normal(kq, k.shape) / k.shape[-1] ** 0.5).astype(jnp.bfloat16)
    be = jax.random.uniform(kb, k.shape[:3], jnp.float32, 0.0, 2.0)
    bz = 0.5 * be
    e32, z32 = be[..., None] * k.astype(jnp.float32), bz[..., None] * v.astype(jnp.float32)
    Tg = Tg32 = None
    if mode == "vector":
        P, Tg = chunk_local.qk_gram(s, q, k, G, e=k, e_rows=be, interpret=True)
        P32, Tg32 = chunk_local.qk_gram(s, q, k, G, e=e32, interpret=True)
        assert _rel(P, P32) == 0 and _rel(Tg, Tg32) < 1e-6, _rel(Tg, Tg32)
    got = chunk_local.intra(s, k, k, v, G, T=Tg, interpret=True, rows=(be, bz))
    want = chunk_local.intra(s, k, e32, z32, G, T=Tg32, interpret=True)
    for x, y in zip(got, want, strict=True):  # A, W, U
        assert _rel(x, y) < 1e-5, (_rel(x, y), mode)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "normal", {}),
                                         ("gdn2", "normal", {})])
def test_interpret_row_scaled_ez(op, decay, kw, monkeypatch):
    """KernelConfig.row_scaled_ez (default): with per-row β (DeltaNet, GDN, KDA) the forward's
    kernels form Ē = β ⊙ k and Z = β ⊙ v from k, v and β instead of reading e, z rounded to
    bf16 — o and the final state come closer to the float64 recurrence (β in [0, 2], packed
    sequences, strong decays, both policies), the gradients move by rounding only, and GDN2 (b, w
    per channel) keeps the rounded e, z."""
    inp, cts, kw = _bf16_case(op, decay, 71, kw)
    # q, k of unit norm as bf16 inputs (normalised in-op, they would be rounded to bf16 after
    # the reference saw them in fp32): the forward's own rounding alone
    for n in ("q", "k"):
        x = inp[n].astype(jnp.float32)
        inp[n] = (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    kw["use_qk_l2norm"] = False
    seen = []
    intra = chunk_local.intra
    monkeypatch.setattr(chunk_local, "intra", lambda *a, **k: seen.append(k.get("rows") is not None)
                        or intra(*a, **k))
    reps, grads = {}, {}
    for on in (False, True):
        _TUNED["row_scaled_ez"] = on
        seen.clear()
        reps[on] = testing.accuracy_report(op, inp, **kw)
        grads[on] = testing.loss_and_grads(op, inp, cts, **kw)[2]  # the gradients alone
        assert any(seen) == (on and op != "gdn2"), (on, seen)
        _check(reps[on])
    if op == "gdn2":
        assert reps[True] == reps[False]
        return
    for name in ("o", "final_state"):  # the old error included e, z's bf16 rounding
        assert reps[True][name][0] < 0.9 * reps[False][name][0], (name, reps)
    # the backward reads the forward's inverse (and under "save" its states), now from exact rows
    gaps = {n: _rel(grads[True][n], grads[False][n]) for n in grads[True]}
    assert max(gaps.values()) < 1e-2, gaps


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw,setting", [("kda", "strong", {"n_seqs": 2}, True),
                                                 ("gdn2", "normal", {"gate_lower_bound": -5.0},
                                                  True)])
def test_interpret_fwd_predecayed(op, decay, kw, setting, small_tiles, monkeypatch):
    """KernelConfig.fwd_predecayed (vector gates; True since profile-22): the fused forward
    pass reads K̄ = e^{G_C − G} ⊙ k and Qγ = e^{G} ⊙ q from gates_mod.decayed_rows (both rounded
    to the inputs' 16 bits) instead of forming them per value tile from k,
    q and G (False). The output and final state move by that rounding only and stay within the bf16 thresholds against the float64 recurrence
    (strong decays, packed sequences, initial states, T not a multiple of the chunk); the
    gradients, which the backward recomputes, are unchanged bit for bit."""
    inp, cts, kw = _bf16_case(op, decay, 47, kw)
    _TUNED["fwd_predecayed"] = False
    base = testing.loss_and_grads(op, inp, cts, **kw)
    _check(testing.accuracy_report(op, inp, **kw))
    launched = _record_launches(monkeypatch)
    _TUNED["fwd_predecayed"] = setting
    pre = testing.loss_and_grads(op, inp, cts, **kw)
    assert any(launch["name"] == "rewy_decayed_rows" for launch in launched)
    _same_runs(pre[2], base[2])  # the gradients
    assert 0 < _rel(pre[0], base[0]) < 1e-2  # o: Qγ's rounding to 16 bits
    assert _rel(pre[1], base[1]) < 1e-2  # the final state: K̄'s
    _check(testing.accuracy_report(op, inp, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("kda", "normal", {"gate_lower_bound": -5.0}),
                                         ("kda", "strong", {"n_seqs": 2, "chunk_size": 64}),
                                         ("gdn2", "normal", {"gate_lower_bound": -5.0,
                                                             "chunk_size": 64})])
def test_interpret_qk_gram_row_frames(op, decay, kw, monkeypatch):
    """KernelConfig.qk_gram_row_frames (True since profile-22): qk_gram's frame-product
    blocks of a row — every block left of the diagonal, and the centred diagonal under a
    declared bound — in one key-slice loop give P, T and so the outputs and every gradient bit
    for bit as one loop per block (False): exact and centred diagonals, chunks of 2 and 4 row
    blocks, packed sequences, strong decays."""
    inp, cts, kw2 = _bf16_case(op, decay, 59, {k: v for k, v in kw.items() if k != "chunk_size"})
    kw2["chunk_size"] = kw.get("chunk_size", kw2["chunk_size"])
    assert 0 < _default("vector").qk_gram_kslice < 32  # K = 32: two key slices
    assert _default("vector").qk_gram_row_frames is True
    launched = _bit_identical_with(monkeypatch, (op, inp, cts, kw2), "qk_gram_row_frames",
                                   False)
    assert any(launch["name"] == "rewy_qk_gram" for launch in launched)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw,diag", [
    ("deltanet", "none", {}, None),
    ("deltanet", "none", {"n_seqs": 3, "policy": "save"}, None),
    ("gdn", "strong", {"n_seqs": 2}, None),
    ("kda", "strong", {"n_seqs": 2}, "levels"),  # vector gates: their default exact diagonals
    ("kda", "normal", {"gate_lower_bound": -5.0}, None),  # the centred ones
    ("kda", "normal", {}, "loop")])  # per-pair diagonals: XLA's e, always
def test_interpret_leaf_e_rows(op, decay, kw, diag, monkeypatch):
    """KernelConfig.leaf_e_rows (no and scalar gates since profile-23; vector gates by
    override): under ReWY the leaf kernel forms e = βe ⊙ k from k and βe, rounded as
    api.leaf_product rounds it, instead of reading XLA's e — the outputs and every gradient
    bit for bit (both policies, packed sequences, strong decays, β in [0, 2], every diagonal
    form); the leaf got βe and no e, except with vector gates' per-pair diagonals."""
    inp, cts, kw2 = _bf16_case(op, decay, 61, kw)
    if diag is not None:
        _TUNED["leaf_diag"] = diag
    assert [_default(m).leaf_e_rows for m in ("none", "scalar", "vector")] == [True, True, False]
    _TUNED["leaf_e_rows"] = True
    got = []
    leaf = chunk_backward.bwd_leaf
    monkeypatch.setattr(chunk_backward, "bwd_leaf", lambda *a, **k: got.append(
        (a[3] is None, k.get("e_scale") is not None)) or leaf(*a, **k))
    _bit_identical_with(monkeypatch, (op, inp, cts, kw2), "leaf_e_rows", False)
    formed = diag != "loop"
    assert got == [(formed, formed), (False, False)], got  # with the option, then XLA's e
    _TUNED["leaf_e_rows"] = True
    got.clear()  # the seven-product backward's bwd_dlam reads e: it keeps XLA's
    testing.loss_and_grads(op, inp, cts, **dict(kw2, backward="wy"))
    assert got == [(False, False)], got


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("key,kw", [("dlam_decays", {}),
                                    ("dlam_decays", {"n_seqs": 2}),
                                    ("leaf_native_decayed", {})])
def test_interpret_gdn_decayed_cotangents(key, kw, small_tiles, monkeypatch):
    """Where GDN's decayed chunk cotangents dT ⊙ D, dA_qk ⊙ D are rounded to bf16 for native
    products: in bwd_dlam, once per chunk (KernelConfig.dlam_decays, dA_qk's diagonal
    inside), or in the leaf ("leaf_native_decayed", dlam_decays off). Either way every
    output and gradient stays within the bf16 thresholds of the float64 recurrence (strong
    decays, β in [0, 2], packed sequences); against the form without it, o, the final state and
    dv (none of them the leaf's) are bit for bit the same and the leaf's gradients move by about
    a bf16 rounding, not more."""
    inp, cts, kw2 = _bf16_case("gdn", "strong", 71, kw)
    assert getattr(_default("scalar"), key)
    if key != "dlam_decays":
        _TUNED["dlam_decays"] = False
    _check(testing.accuracy_report("gdn", inp, **kw2))
    o, s, g = testing.loss_and_grads("gdn", inp, cts, **kw2)
    _TUNED[key] = False
    o2, s2, g2 = testing.loss_and_grads("gdn", inp, cts, **kw2)
    assert np.array_equal(o, o2) and np.array_equal(s, s2) and np.array_equal(g["dv"], g2["dv"])
    for name in ("dq", "dk", "dg", "dbeta"):
        moved = testing.ratio(g[name], g2[name])
        assert 0 < moved < 1e-2, (name, moved)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("key,kw", [("value_side_decay", {}),
                                    ("value_side_decay", {"n_seqs": 2}),
                                    ("value_side_decay",
                                     {"policy": "save", "backward": "wy"}),
                                    ("gate_on_A", {"n_seqs": 2})])
def test_interpret_gdn_value_side_decay(key, kw, small_tiles, monkeypatch):
    """GDN's decays on the narrow side of a product: KernelConfig.value_side_decay
    (the state passes scale R, k·dS, q·S0 and dO instead of k and q) and "gate_on_A"
    (intra and wu put γ on A's columns instead of Ē's rows). Every output and gradient stays
    within the bf16 thresholds of the float64 recurrence (strong decays, packed sequences, both
    policies); against the key-side form the outputs and gradients move by about a rounding,
    not more — and something moves, so the setting reaches the kernels."""
    inp, cts, kw2 = _bf16_case("gdn", "strong", 73, kw)
    assert getattr(_default("scalar"), key)
    _check(testing.accuracy_report("gdn", inp, **kw2))
    intra, W = chunk_local.intra, []  # the forward's W: where gate_on_A shows (sub-ulp in o here)

    def recording(*a, **k):
        out = intra(*a, **k)
        if k.get("A") is None:  # the forward's (A, W, U), not the backward's (W, U)
            W.append(out[1])
        return out

    monkeypatch.setattr(chunk_local, "intra", recording)
    o, s, g = testing.loss_and_grads("gdn", inp, cts, **kw2)
    n_first = len(W)
    _TUNED[key] = False
    o2, s2, g2 = testing.loss_and_grads("gdn", inp, cts, **kw2)
    # Some may not move at all: o is bf16 (values an fp32 rounding apart may round alike), the
    # interpreter multiplies fp32 exactly where the GPU rounds to TF32, and under "save" the
    # backward reads S0 and R as the forward stored them, in bf16.
    moved = {name: testing.ratio(g[name], g2[name]) for name in ("dq", "dk", "dv", "dg", "dbeta")}
    moved.update(o=testing.ratio(o, o2), final_state=testing.ratio(s, s2),
                 W=testing.ratio(W[0], W[n_first]))
    assert max(moved.values()) < 1e-2 and max(moved.values()) > 0, moved


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {}),
                                         ("kda", "normal", {"policy": "save"})])
def test_interpret_twin_pass(op, decay, kw, small_tiles, monkeypatch):
    """KernelConfig.twin_pass (default): the recompute pass and the reverse pass in one launch give
    the outputs and every gradient bit for bit as the two launches (packed sequences, initial
    states, T not a multiple of the chunk, two value tiles); it is taken under ``recompute``
    only, and the gradients stay within the bf16 thresholds."""
    inp, cts, kw = _bf16_case(op, decay, 37, kw)
    _TUNED["twin_pass"] = False  # the two launches apart
    apart = testing.loss_and_grads(op, inp, cts, **kw)
    calls = []
    twin = state_passes.twin_pass
    monkeypatch.setattr(state_passes, "twin_pass", lambda *a, **k: calls.append(1) or twin(*a, **k))
    _TUNED["twin_pass"] = True
    together = testing.loss_and_grads(op, inp, cts, **kw)
    assert len(calls) == (kw.get("policy", "recompute") == "recompute")
    _same_runs(together, apart)
    _check(testing.accuracy_report(op, inp, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("kda", "strong", {"policy": "save"}),
                                         ("gdn", "normal", {})])
def test_interpret_tiles_first(op, decay, kw, small_tiles, monkeypatch):
    """KernelConfig.tiles_first: the kernels with value or key tiles launch that grid axis first; the
    outputs and every gradient are bit for bit those of the logical order (two value and key
    tiles, packed sequences, T not a multiple of the chunk, both policies, the twin pass), and
    the reordering did happen."""
    inp, cts, kw = _bf16_case(op, decay, 41, kw)
    orders = []
    ordered = launch._launch_ordered
    monkeypatch.setattr(launch, "_launch_ordered",
                        lambda kernel, order: orders.append(order) or ordered(kernel, order))
    runs = []
    for first in (False, True):
        _TUNED["tiles_first"] = first
        orders.clear()
        runs.append(testing.loss_and_grads(op, inp, cts, **kw))
        moved = [o for o in orders if o != tuple(range(len(o)))]
        assert bool(moved) == first, orders
    if kw.get("policy") == "save":  # the output kernel, bwd_local, bwd_leaf, both passes
        assert {(1, 0), (2, 0, 1)} <= set(moved)
    _same_runs(runs[1], runs[0])


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("kda", "strong", {"policy": "save"})])
def test_interpret_forward_low_precision_wide(op, decay, kw, monkeypatch):
    """KernelConfig.forward_low_precision (at K > 128 by default ("W", "S0", "R")): the
    forward's unfused pass stores S0 and R in bf16 for the output kernel (and the save policy's
    backward) — really bf16 there, fp32 at K ≤ 128 and with the setting empty — and the outputs
    agree with the fp32 storage to bf16
    rounding, every output and gradient within the bf16 thresholds (K = V = 256, T = 70 not a
    multiple of the chunk, packed sequences, strong decays)."""
    from pallas_kernels.gpu import api

    n_seqs = kw.pop("n_seqs", None)
    inp = testing.make_inputs(op, 1, 70, 1, 256, 256, dtype=jnp.bfloat16, decay=decay, seed=61,
                              n_seqs=n_seqs)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32, use_qk_l2norm=True)
    s0_dtypes = []
    output = output_mod.output
    monkeypatch.setattr(output_mod, "output", lambda s, q, k, G, S0, *a, **k_: s0_dtypes.append(
        S0.dtype) or output(s, q, k, G, S0, *a, **k_))
    _TUNED["forward_low_precision"] = ()
    base = testing.run_op(op, inp, **kw)
    assert s0_dtypes and set(s0_dtypes) == {jnp.dtype(jnp.float32)}, s0_dtypes
    assert _default("none", 256, 256).forward_low_precision == ("W", "S0", "R")
    assert _default("none", 128, 128).forward_low_precision == ()  # K ≤ 128 untouched
    assert _default("none", 256, 256, jnp.float32).forward_low_precision == ()  # fp32 too
    _TUNED["forward_low_precision"] = ("S0", "R")
    s0_dtypes.clear()
    run = testing.run_op(op, inp, **kw)
    assert s0_dtypes and set(s0_dtypes) == {jnp.dtype(jnp.bfloat16)}, s0_dtypes
    for x, y in zip(run, base, strict=True):
        assert _rel(x, y) < 1e-2, (_rel(x, y), op)
    _check(testing.accuracy_report(op, inp, **kw))
    # the same storage with the forward's products kept off bf16 (forward_native_pass_dots):
    # closer to the fp32 storage than the native products are
    _TUNED["forward_native_pass_dots"] = False
    kept = testing.run_op(op, inp, **kw)
    # (on the fp32 final state: o's own bf16 rounding can hide the difference)
    assert _rel(kept[1], base[1]) < _rel(run[1], base[1]), op
    _check(testing.accuracy_report(op, inp, **kw))
    with pytest.raises(ValueError, match=r"forward_low_precision=\('S1',\) must be"):
        _kcfg(forward_low_precision=("S1",))


def test_tf32_emulation():
    """KernelConfig.tf32_emulation (interpret_accuracy --tf32): in interpret mode the 16-bit
    calls' DEFAULT products become blocks.EmulatedTF32 ones, whose fp32 operands keep 10
    mantissa bits — truncated, or rounded to nearest (ties away); 16-bit operands, fp32 calls
    (HIGHEST), the GPU and None leave the products as they were."""
    from pallas_kernels.gpu import api, blocks

    x = jnp.array([1 + 2.0 ** -10, 1 + 2.0 ** -11, 1 + 2.0 ** -12, -(1 + 3 * 2.0 ** -12)],
                  jnp.float32)
    want = {"truncate": [1 + 2.0 ** -10, 1, 1, -1], "round": [1 + 2.0 ** -10, 1 + 2.0 ** -10, 1,
                                                                -(1 + 2.0 ** -10)]}
    eye = jnp.eye(4, dtype=jnp.float32)
    for mode, w in want.items():
        np.testing.assert_array_equal(np.asarray(blocks._as_tf32(x, mode)), np.float32(w))
        xb = x.astype(jnp.bfloat16)
        assert blocks._as_tf32(xb, mode) is xb
        prec = api._precision(jnp.bfloat16, True, tf32_emulation=mode)
        assert prec == blocks.EmulatedTF32(mode)
        np.testing.assert_array_equal(np.asarray(blocks.dot(x[None, :], eye, prec)[0]),
                                      np.float32(w))
        assert api._precision(jnp.float32, True, tf32_emulation=mode) == jax.lax.Precision.HIGHEST
        assert api._precision(jnp.bfloat16, False, tf32_emulation=mode) == jax.lax.Precision.DEFAULT
    assert api._precision(jnp.bfloat16, True) == jax.lax.Precision.DEFAULT
    np.testing.assert_array_equal(
        np.asarray(blocks.dot(x[None, :], eye, jax.lax.Precision.DEFAULT)[0]), np.asarray(x))
    with pytest.raises(ValueError, match="tf32_emulation='nearest'"):
        _kcfg(tf32_emulation="nearest")


def test_stacked_blocks_and_inverse():
    """blocks.stack_blocks / unstack_blocks round-trip 1–8 blocks in order, and the stacked
    diagonal inverse equals the per-block one and inverts I + T (fp32, random strict T)."""
    from pallas_kernels.gpu import blocks

    rng = np.random.default_rng(3)
    for n in (1, 2, 4, 8):
        Ts = [jnp.asarray(np.tril(rng.standard_normal((16, 16)), -1) * 0.3, jnp.float32)
              for _ in range(n)]
        x = blocks.stack_blocks(Ts)
        assert x.shape == (n, 16, 16)
        _same_runs(list(x), Ts)
        _same_runs(blocks.unstack_blocks(x), Ts)
        inv = blocks.inv_diags_stacked(Ts)
        for A, A_ref, T in zip(inv, blocks.inv_diags(Ts), Ts, strict=True):
            np.testing.assert_allclose(np.asarray(A), np.asarray(A_ref), rtol=0, atol=1e-5)
            np.testing.assert_allclose(np.asarray(A) @ (np.eye(16) + np.asarray(T)), np.eye(16),
                                       atol=1e-5)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {}),
                                         ("gdn", "strong", {"backward": "wy"}),
                                         ("kda", "strong", {"policy": "save"})])
def test_interpret_per_block_diagonal_inverse(op, decay, kw, monkeypatch):
    """KernelConfig.stacked_diag off (the tuning alternative to the stacked inverse): intra's
    joint diagonal loop on the [16, 16] blocks — every output and gradient against the float64
    recurrence (default chunk: four diagonal blocks), each gate kind, strong decays."""
    _TUNED["stacked_diag"] = False
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=15)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "normal", {"backward": "wy"})])
def test_interpret_one_seq_init(op, decay, kw, small_tiles, monkeypatch):
    """KernelConfig.one_seq_init: without cu_seqlens the state passes start from h0 and dfin
    instead of selecting them at every chunk, and (.end_after_loop) store the final
    state and dh0 after their loop instead of under a per-chunk branch — the outputs and every gradient (dh0 and the
    final state's cotangent included) bit for bit as the per-chunk select, both policies, the
    twin pass and the separate passes; a varlen call keeps the per-chunk select."""
    from pallas_kernels.gpu import api

    inp, cts, kw = _bf16_case(op, decay, 47, kw)
    shapes = []
    shape = api._shape
    monkeypatch.setattr(api, "_shape", lambda *a: shapes.append(shape(*a)) or shapes[-1])
    runs = []
    for init, end_after in ((False, False), (True, False), (True, True)):
        _TUNED["one_seq_init"] = init
        _TUNED["end_after_loop"] = end_after
        runs.append(testing.loss_and_grads(op, inp, cts, **kw))
    _same_runs(runs[1], runs[0])
    _same_runs(runs[2], runs[0])
    assert shapes and all(s.one_seq for s in shapes)
    shapes.clear()
    varlen, _, _ = _bf16_case(op, decay, 47, dict(kw, n_seqs=2))
    testing.run_op(op, varlen, **kw)
    assert shapes and not any(s.one_seq for s in shapes)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,policy", [("kda", "recompute"), ("gdn", "save")])
def test_interpret_under_vmap_checkpoint_jit(op, policy, small_tiles):
    """The kernels inside an LM's usual transforms: jax.vmap of the gradient equals a loop over
    the batch, jax.grad(jax.checkpoint(f)) (rematerialised layers) and its jit equal jax.grad(f)
    — the custom VJP's kept residuals (chunk matrices / states) survive the rewrites."""
    ds = [testing.make_inputs(op, 1, 40, 2, 16, 32, seed=19 + i) for i in range(2)]
    names = [n for n in ds[0] if n != "cu_seqlens"]
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16, policy=policy,
              use_qk_l2norm=True)

    def loss(x):
        o, st = testing.run_op(op, x, **kw)
        return jnp.sum(o * o) + jnp.sum(jnp.sin(st))

    grad = jax.grad(loss)
    g_vmap = jax.vmap(grad)({n: jnp.stack([d[n] for d in ds]) for n in names})
    for i, d in enumerate(ds):
        g = grad({n: d[n] for n in names})
        for n in names:
            assert _rel(g_vmap[n][i], g[n]) < 1e-5, (i, n)
    x = {n: ds[0][n] for n in names}
    g = grad(x)
    for g2 in (jax.grad(jax.checkpoint(loss))(x), jax.jit(jax.grad(jax.checkpoint(loss)))(x)):
        for n in names:
            assert np.all(np.isfinite(np.asarray(g2[n]))) and _rel(g2[n], g[n]) < 1e-5, n


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op", ["kda", "deltanet"])
def test_interpret_varlen(op, small_tiles):
    inp = testing.make_inputs(op, 1, 45, 2, 16, 32, n_seqs=3, seed=5)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True, chunk_size=16))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay", [("deltanet", "normal"), ("gdn", "strong"), ("kda", "strong"),
                                      ("gdn2", "normal")])
def test_interpret_fp16_inputs(op, decay, small_tiles):
    """fp16 q, k, v (the backward then stores in bf16, whose range holds any state): every
    output and gradient within the 16-bit thresholds, T not a multiple of the chunk."""
    inp = testing.make_inputs(op, 1, 90, 2, 32, 32, dtype=jnp.float16, decay=decay, seed=41)
    o, final = testing.run_op(op, inp, backend="pallas_gpu", interpret=True, chunk_size=32)
    assert o.dtype == jnp.float16 and final.dtype == jnp.float32
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True, chunk_size=32))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_scale_applied_in_kernel(monkeypatch):
    """A Python scale reaches the kernels as Config.scale and q as the caller's bf16 values:
    q·K^−½ rounded to bf16 would be a second rounding (K^−½ is not a power of two at K = 32).
    A traced scale cannot enter the static config, so it is folded into q (scale 1)."""
    from pallas_kernels.gpu import api

    seen = []
    real = api.general_delta

    def spy(cfg, q, *args):
        seen.append((cfg.scale, q))
        return real(cfg, q, *args)

    monkeypatch.setattr(api, "general_delta", spy)
    inp = testing.make_inputs("deltanet", 1, 32, 2, 32, 16, dtype=jnp.bfloat16, seed=2)
    args = (inp["q"], inp["k"], inp["v"], inp["beta"])
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16)
    o_static, _ = rewy_jax.chunk_delta_rule(*args, **kw)
    scale, q_seen = seen.pop()
    assert scale == 32 ** -0.5
    np.testing.assert_array_equal(np.asarray(q_seen, np.float32), np.asarray(inp["q"], np.float32))

    def traced(scale):
        o = rewy_jax.chunk_delta_rule(*args, scale=scale, **kw)[0]
        return o, seen[-1][1]  # the q the kernels read, out of the trace

    o_traced, q_seen = jax.jit(traced)(32 ** -0.5)
    assert seen.pop()[0] == 1.0
    q_rounded = (inp["q"].astype(jnp.float32) * 32 ** -0.5).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(q_seen, np.float32), np.asarray(q_rounded, np.float32))
    # the same op either way, up to the extra rounding of q
    assert testing.ratio(o_traced, o_static) < 1e-2


def test_dispatch_rejects_and_falls_back():
    inp = testing.make_inputs("gdn", 1, 20, 1, 24, 24)  # K = 24: not a power of two
    with pytest.raises(NotImplementedError, match="power of two"):
        testing.run_op("gdn", inp, backend="pallas_gpu", interpret=True, chunk_size=16)
    # backend=None never picks an unsupported kernel: on CPU it is xla, on a GPU the fallback.
    o, _ = testing.run_op("gdn", inp, chunk_size=16)
    assert jnp.all(jnp.isfinite(o))
    if not _ON_GPU:
        with pytest.raises(NotImplementedError, match="CUDA GPU"):
            backends.select("pallas_gpu", rewy_jax.ops._prepare(
                inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["beta"],
                g_kind="scalar", b_kind="scalar", w_kind="scalar", scale=None,
                initial_state=None, use_qk_l2norm=False, cu_seqlens=None,
                gate_names=("g", "beta", None)), chunk_size=16, interpret=False)


# ----------------------------------------------------------------------------------------------
# GPU: the real Triton lowering (run on the lent H200: pytest -m gpu tests/test_pallas_gpu.py)
# ----------------------------------------------------------------------------------------------
# FLA's head dims (128 and 64; K ≠ V once); each case compiles its kernels (~30–60 s on the H200).
GPU_CASES = [("deltanet", 128, 128), ("gdn", 128, 128), ("kda", 128, 128), ("gdn2", 128, 128),
             ("kda", 64, 64), ("gdn2", 128, 64)]


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("op,K,V", GPU_CASES)
def test_gpu_bf16_matches_reference(op, K, V):
    inp = testing.make_inputs(op, 2, 300, 4, K, V, dtype=jnp.bfloat16, seed=7)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["gdn2"])
def test_gpu_fp32_strong_decay(op):
    inp = testing.make_inputs(op, 1, 200, 2, 64, 64, dtype=jnp.float32, decay="strong", seed=8)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu"))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_declared_bound_takes_the_centred_path(small_tiles):
    """gate_lower_bound switches the diagonal blocks of the leaf-gradient kernel and of
    qk_gram (KernelConfig.qk_gram_centred, since profile-21) to the centred contraction:
    outputs and gradients that round differently but agree."""
    inp = testing.make_inputs("kda", 1, 40, 2, 16, 16, decay="bounded", seed=7)
    rng = np.random.default_rng(8)
    cts = {"o": jnp.asarray(rng.standard_normal((1, 40, 2, 16)), jnp.float32),
           "final_state": jnp.asarray(rng.standard_normal((1, 2, 16, 16)), jnp.float32)}
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16)
    o1, s1, g1 = testing.loss_and_grads("kda", inp, cts, **kw)
    o2, s2, g2 = testing.loss_and_grads("kda", inp, cts, gate_lower_bound=-5.0, **kw)
    for x, y in ((o2, o1), (s2, s1)):
        assert not np.array_equal(np.asarray(x), np.asarray(y))  # another path ran
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-3, atol=1e-5)
    assert not np.array_equal(np.asarray(g1["dk"]), np.asarray(g2["dk"]))
    for name in g1:
        np.testing.assert_allclose(np.asarray(g2[name]), np.asarray(g1[name]), rtol=1e-3,
                                   atol=1e-4, err_msg=name)


# ----------------------------------------------------------------------------------------------
# CPU: cross-lowering for the H200 — the kernels' Triton IR is generated without a GPU, so a
# construct the Triton lowering rejects (a non-power-of-two tile, an unsupported op) fails here.
# ----------------------------------------------------------------------------------------------
LOWER_CASES = [  # (op, K, V, dtype, extra kwargs, varlen)
    ("deltanet", 64, 64, jnp.bfloat16, {}, False),
    ("gdn", 128, 64, jnp.bfloat16, {"backward": "wy"}, False),
    ("kda", 64, 128, jnp.bfloat16, {"policy": "save"}, False),
    ("kda", 64, 64, jnp.bfloat16, {"gate_lower_bound": -5.0}, True),
    ("gdn2", 64, 64, jnp.float32, {"gate_lower_bound": -5.0, "backward": "wy"}, False),
    ("gdn2", 128, 128, jnp.bfloat16, {"_exact_diag": "loop", "_unshared": True}, False),
    ("gdn", 256, 256, jnp.float16, {"_chained_inverse": True}, False),
    ("gdn2", 64, 64, jnp.bfloat16, {"_vmap": True}, False),
    ("deltanet", 128, 128, jnp.bfloat16, {"_fp32_backward": True, "backward": "wy"}, False),
    ("kda", 64, 128, jnp.bfloat16, {"_fp32_backward": True}, False),
    ("deltanet", 128, 64, jnp.bfloat16, {"_unfused": True}, False),
    # narrow keys (KernelConfig.narrow_keys, which this file's fixture sets off and
    # "_narrow" back on): fp32 kernels for a bf16 call, three-TF32 products
    ("deltanet", 32, 32, jnp.bfloat16, {"_narrow": True}, True),
    ("kda", 16, 32, jnp.bfloat16, {"policy": "save", "_narrow": True}, False),
    ("kda", 128, 128, jnp.bfloat16, {"_cfg": {"fwd_predecayed": False},
                                     "gate_lower_bound": -5.0}, False),
    ("kda", 128, 64, jnp.bfloat16, {"_cfg": {"fused_output": False,
                                             "forward_low_precision": ("S0", "R")}}, False),
    ("kda", 128, 128, jnp.bfloat16, {"_cfg": {"qk_gram_row_frames": False},
                                     "gate_lower_bound": -5.0}, False),
    ("gdn2", 64, 64, jnp.bfloat16, {"_cfg": {"qk_gram_row_frames": False}}, True),
    ("gdn", 128, 128, jnp.bfloat16, {"_cfg": {"warps": {"intra": 4, "wu": 4},
                                              "fused_output": False}}, False),
    ("deltanet", 128, 128, jnp.bfloat16, {"_cfg": {"leaf_e_rows": False}}, True),
    ("gdn", 64, 64, jnp.bfloat16, {"_cfg": {"leaf_e_rows": False}}, False),
    ("kda", 128, 128, jnp.bfloat16, {"_cfg": {"leaf_e_rows": True}, "gate_lower_bound": -5.0},
     False),
    ("kda", 64, 64, jnp.bfloat16, {"_cfg": {"leaf_e_rows": True}}, True),
    ("gdn", 128, 128, jnp.bfloat16, {"_cfg": {"leaf_native_decayed": False}}, False),
]
# "_cfg": KernelConfig overrides that change what the kernels lower to (the forms the
# defaults replaced)


@pytest.mark.skipif(_ON_GPU, reason="the GPU tests above run the real kernels")
@pytest.mark.parametrize("op,K,V,dtype,kw,varlen", LOWER_CASES,
                         ids=[f"{c[0]}-K{c[1]}V{c[2]}-{jnp.dtype(c[3]).name}-" +
                              "-".join(f"{v}" for v in c[4].values()) + ("-varlen" if c[5] else "")
                              for c in LOWER_CASES])
def test_kernels_lower_for_h200(op, K, V, dtype, kw, varlen, monkeypatch):
    from pallas_kernels.gpu import api

    monkeypatch.setattr(api, "supports", lambda call, chunk_size, interpret: None)  # no GPU here
    kw = dict(kw)
    if "_exact_diag" in kw:  # one exact diagonal method everywhere (a tuning option)
        diag = kw.pop("_exact_diag")
        for k in ("intra", "qk_gram", "leaf"):
            _TUNED[f"{k}_diag"] = diag
    if kw.pop("_chained_inverse", False):  # intra's diagonal inverses one after another
        _TUNED["joint_diag_inverse"] = False
    if kw.pop("_unshared", False):  # the shared-decay-factor options off (tuning alternative)
        _TUNED["gram_from_qk"] = False
        _TUNED["leaf_shared_decay"] = False
    if varlen:  # and the one-program-per-chunk tuning variant of the leaf and qk_gram kernels
        _TUNED["leaf_rowgrid"] = False
        _TUNED["qk_gram_rowgrid"] = False
    if kw.pop("_fp32_backward", False):  # the backward's stored tensors in fp32 (tuning option)
        _TUNED["backward_low_precision"] = ()
    if kw.pop("_narrow", False):  # the narrow-key policy's default (this file sets it off)
        _TUNED["narrow_keys"] = _default().narrow_keys
    if kw.pop("_unfused", False):  # the forward's output kernel instead of the fused pass
        _TUNED["fused_output"] = False
    _TUNED.update(kw.pop("_cfg", {}))
    mode = {"deltanet": "none", "gdn": "scalar"}.get(op, "vector")
    run_cfg = _default(mode, K, V, dtype).with_overrides(_TUNED)
    vmapped = kw.pop("_vmap", False)  # the gradient under jax.vmap: one more grid axis
    inp = testing.make_inputs(op, 1, 100, 2, K, V, dtype=dtype, n_seqs=3 if varlen else None)
    diff = {n: x for n, x in inp.items() if n != "cu_seqlens"}

    def one(diff):
        o, s = testing.run_op(op, dict(inp, **diff), backend="pallas_gpu", **kw)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    def loss(diff):
        return jnp.sum(jax.vmap(one)(diff)) if vmapped else one(diff)

    if vmapped:
        diff = {n: jnp.stack([x, x]) for n, x in diff.items()}

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss)).trace(diff).lower(lowering_platforms=("cuda",)).as_text()
    kernels = {"rewy_intra", "rewy_fwd_pass", "rewy_bwd_local", "rewy_bwd_pass",
               "rewy_bwd_dlam", "rewy_bwd_leaf"} | ({"rewy_qk_gram"} if op in ("kda", "gdn2") else set())
    recompute = kw.get("policy", "recompute") == "recompute"
    if recompute:  # the backward's W, U from the kept A
        kernels.add("rewy_wu")
    # the output kernel unless the recompute forward fuses it into its pass (K ≤ 128)
    fused = recompute and run_cfg.fused_output
    if not fused:
        kernels.add("rewy_output")
    assert ("rewy_output" in text) == (not fused)
    # the backward's two state passes in one launch under recompute at K ≤ 128 (the default)
    twin = recompute and K <= 128
    if twin:
        kernels = (kernels - {"rewy_bwd_pass"}) | {"rewy_twin_pass"}
    assert ("rewy_bwd_pass" in text) == (not twin)
    missing = {k for k in kernels if k not in text}
    assert not missing, f"kernels absent from the lowered module: {missing}"



# ----------------------------------------------------------------------------------------------
# The kernel config: one frozen, validated KernelConfig per call
# ----------------------------------------------------------------------------------------------
def test_default_config_measured_choices():
    """default_config's per-(mode, K, V, dtype, varlen) choices, as measured
    (docs/performance-log.md): warps, stages, the leaf's key tile and the K > 128 forms."""
    from pallas_kernels.gpu import config

    d = _default("none", 128, 128, jnp.bfloat16)
    assert dict(d.warps) == {"intra": 2, "wu": 2, "qk_gram": 2, "fwd_pass": 4, "output": 4,
                             "bwd_local": 4, "bwd_pass": 8, "bwd_dlam": 4, "bwd_leaf": 8,
                             "twin_pass": 4, "gates": 4}
    assert dict(d.stages) == {"fwd": 3, "native": 3, "fused": 3, "fused_w32": 3,
                              "fused_f32": 2, "bwd": 2, "twin": 2}
    assert (d.block_v, d.block_k, d.block_v_state) == (64, 64, 32)
    assert d.fused_output and d.twin_pass and d.forward_low_precision == ()
    v = _default("vector", 128, 128)
    assert v.block_k == 32 and v.warp("bwd_leaf") == 4 and v.warp("wu") == 4
    assert v.stage("fwd") == v.stage("native") == 2 and not v.leaf_e_rows
    assert _default("scalar", 64, 256).block_k == 32 and _default("scalar", 64, 256).warp(
        "bwd_leaf") == 8  # scalar gates keep 8 warps on 32-wide key tiles
    wide = _default("scalar", 256, 256, jnp.bfloat16)
    assert set(dict(wide.stages).values()) == {1} and wide.warp("intra") == wide.warp("wu") == 4
    assert not wide.fused_output and not wide.twin_pass
    assert wide.forward_low_precision == ("W", "S0", "R")
    varlen = _default("none", 64, 64, one_seq=False)
    assert dict(varlen.stages) == {**dict.fromkeys(config.PASSES, 3), "twin": 1}
    assert _default("none", 16, 16).block_v == 16  # tiles no wider than the head dims


def test_kernel_config_validated_frozen_hashable():
    """KernelConfig refuses bad values on construction (naming the field), cannot be changed
    in place, and is hashable — equal configs hash alike, so it can key jit's cache."""
    import dataclasses

    from pallas_kernels.gpu import config

    d = _default("vector", 64, 64)
    assert hash(d) == hash(_default("vector", 64, 64)) and d == _default("vector", 64, 64)
    assert d != d.with_overrides({"block_v": 32})
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.block_v = 32
    for bad, match in [({"block_v": 48}, "block_v=48 must be a power of two"),
                       ({"leaf_diag": "centred"}, "leaf_diag='centred' must be one of"),
                       ({"twin_pass": 1}, "twin_pass=1 must be a bool"),
                       ({"backward_low_precision": ("S0", "dW")}, "backward_low_precision"),
                       ({"warps": {"intra": 0}}, r"warps\['intra'\]=0 must be a positive int"),
                       ({"no_such_field": 1}, "no fields.*no_such_field")]:
        with pytest.raises(ValueError, match=match):
            d.with_overrides(bad)
    with pytest.raises(ValueError, match="warps must give every one of"):
        dataclasses.replace(d, warps=(("intra", 2),))
    with pytest.raises(ValueError, match="mode must be one of"):
        config.default_config("gated", 64, 64, jnp.float32)
    assert d.with_overrides({"warps": {"intra": 8}}).warp("intra") == 8  # a table entry


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_kernel_config_keyword_reaches_the_kernels(monkeypatch):
    """The ops' kernel_config= (a KernelConfig, or a dict of overrides on the call's default)
    is the config every kernel of the call reads, under jit too (each config traces its own
    kernels); another backend refuses it rather than ignore it."""
    shapes = []
    shape = launch.Shape.__init__

    def recording(self, *a, **k):
        shape(self, *a, **k)
        shapes.append(self.cfg)

    monkeypatch.setattr(launch.Shape, "__init__", recording)
    inp = testing.make_inputs("gdn", 1, 40, 2, 16, 32, decay="strong", seed=5)
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16)
    o1, _ = testing.run_op("gdn", inp, kernel_config={"twin_pass": False, "block_v": 16}, **kw)
    assert shapes and all(c.block_v == 16 and not c.twin_pass for c in shapes)
    full = _default("scalar", 16, 32, jnp.float32).with_overrides({"dlam_decays": False})
    shapes.clear()
    o2, _ = testing.run_op("gdn", inp, kernel_config=full, **kw)
    assert shapes and all(c == full for c in shapes)
    assert _rel(o1, o2) < 1e-6

    calls = []
    shapes.clear()
    f = jax.jit(lambda x, bv: calls.append(bv) or testing.run_op(
        "gdn", dict(inp, q=x), kernel_config={"block_v": bv}, **kw)[0], static_argnums=1)
    f(inp["q"], 16)
    f(inp["q"], 32)
    assert calls == [16, 32] and {c.block_v for c in shapes} == {16, 32}
    with pytest.raises(ValueError, match="kernel_config= configures the Pallas GPU kernels"):
        testing.run_op("gdn", inp, backend="xla", kernel_config={"block_v": 16})
