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
from rewy_jax import backends, testing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

_ON_GPU = jax.default_backend() == "gpu"


def _check(rep):
    bad = {n: f"{r:.2e} > {tol:.0e}" for n, (r, tol) in rep.items() if not r <= tol}
    assert not bad, bad


@pytest.fixture
def small_tiles(monkeypatch):
    """Value and key tiles of 16 so that V = 32 / K = 32 run two tiles through the kernels."""
    from pallas_kernels.gpu import api

    monkeypatch.setattr(api, "DEFAULT_BV", 16)
    monkeypatch.setattr(api, "DEFAULT_BK", 16)
    monkeypatch.setattr(api, "DEFAULT_BV_STATE", 16)


@pytest.fixture(autouse=True)
def sixteen_bit_kernels_at_small_keys(monkeypatch):
    """This file's small K (16, 32) stand in for the production head dims (≥ 64), at which 16-bit
    calls run the 16-bit kernels; DEFAULTS "precision.narrow_keys" would run them on fp32 here.
    The tests of that policy set it back."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "precision.narrow_keys", 0)


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
    """DEFAULTS "precision.narrow_keys": at K ≤ 32 a bf16 call runs the kernels on fp32 q, k, v (three-TF32
    products on the GPU, exact fp32 here) and still returns o in bf16. On the case an interpret
    sweep found (benchmarks/results/interpret-sweep-26: DeltaNet, K = 16, T = 272, no decay,
    β ∈ [0, 2], two packed sequences with initial states) the 16-bit kernels' dk exceeds
    rewy-math §8's 1e-2; this path meets every bound with room."""
    from pallas_kernels.gpu import api, kernels

    case = testing.Case("deltanet", 1, 272, 1, 16, 16, 64, "none", "rewy", "recompute", True, 2,
                        "bfloat16")
    monkeypatch.setitem(kernels.TUNE, "precision.narrow_keys", kernels.DEFAULTS["precision.narrow_keys"])
    assert kernels.DEFAULTS["precision.narrow_keys"] >= 16
    o, _ = testing.run_op("deltanet", case.inputs(27002), backend="pallas_gpu", interpret=True,
                          use_qk_l2norm=True, **case.kwargs())
    assert o.dtype == jnp.bfloat16
    rep = case.report(27002, backend="pallas_gpu", interpret=True)
    assert all(r <= tol / 2 for r, tol in rep.values()), rep
    assert api._precision(jnp.bfloat16, False, narrow=True) == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    monkeypatch.setitem(kernels.TUNE, "precision.narrow_keys", 0)  # the 16-bit kernels, same case
    sixteen = case.report(27002, backend="pallas_gpu", interpret=True)
    assert sixteen["dk"][0] > sixteen["dk"][1], sixteen


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("kw", [{}, {"gate_lower_bound": -5.0}, {"backward": "wy"}],
                         ids=["exact", "centred", "wy"])
def test_interpret_leaf_chunk_grid(kw, small_tiles, monkeypatch):
    """The leaf and qk_gram kernels with one program per chunk (their row grids off; a tuning
    option — the row grids are the default)."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_bwd_leaf.rowgrid", False)
    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.rowgrid", False)
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
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", gram_from_qk)
    monkeypatch.setitem(kernels.TUNE, "rewy_bwd_leaf.shared_decay", shared)
    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.exact_diag", diag)
    monkeypatch.setitem(kernels.TUNE, "rewy_bwd_leaf.exact_diag", diag)
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=13)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_fused_output_by_gate_mode(small_tiles, monkeypatch):
    """"fwd_pass.fused_output" naming gate modes: only those fuse the output into the forward's
    pass (the others launch the output kernel), with the same o; an unknown mode is refused."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", ("none", "vector"))
    assert [kernels.fused_output(m) for m in ("none", "scalar", "vector")] == [True, False, True]
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", "scalar")
    assert [kernels.fused_output(m) for m in ("none", "scalar", "vector")] == [False, True, False]
    calls = []
    output = kernels.output
    monkeypatch.setattr(kernels, "output", lambda *a, **k: calls.append(1) or output(*a, **k))
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16)
    for op, fused in (("deltanet", True), ("gdn", False)):
        inp = testing.make_inputs(op, 1, 40, 2, 16, 16, decay="strong", seed=5)
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", ("none", "vector"))
        jax.clear_caches()
        calls.clear()
        o1, f1 = testing.run_op(op, inp, **kw)
        assert len(calls) == (not fused), op
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", not fused)
        jax.clear_caches()
        o2, f2 = testing.run_op(op, inp, **kw)  # the other form
        assert _rel(o1, o2) < 1e-6 and _rel(f1, f2) < 1e-6, op
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", ("none", "gated"))
    with pytest.raises(ValueError, match="fwd_pass.fused_output.*gated"):
        kernels.fused_output("none")


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,gram_from_qk,kw", [("kda", True, {}),
                                                ("gdn2", False, {"gate_lower_bound": -5.0})])
def test_interpret_qk_gram_pair_grid(op, gram_from_qk, kw, small_tiles, monkeypatch):
    """qk_gram with one program per (row block, column block) (a tuning option), forming P alone
    or P and intra's T: every output and gradient at strong decays, T not a multiple of 64."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.pairgrid", True)
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", gram_from_qk)
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay="strong" if not kw else "bounded",
                              seed=15)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,n_seqs,C", [("deltanet", "none", None, 16),
                                               ("gdn", "strong", 3, 32),
                                               ("kda", "strong", None, 64),
                                               ("gdn2", "normal", 2, 16)])
def test_interpret_fused_output_pass(op, decay, n_seqs, C, small_tiles, monkeypatch):
    """DEFAULTS "fwd_pass.fused_output": the output formed inside the forward state pass (no
    S0, R stored) — every output and gradient against the float64 recurrence, initial states
    and packed sequences included, T not a multiple of the chunk; o and the final state equal
    the two-kernel forward's to fp32 rounding; policy "save" (which keeps S0, R) still runs."""
    from pallas_kernels.gpu import kernels

    inp = testing.make_inputs(op, 1 if n_seqs else 2, 70, 2, 32, 32, decay=decay, seed=19,
                              n_seqs=n_seqs)
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=C, use_qk_l2norm=True)
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", False)
    o2, f2 = testing.run_op(op, inp, **kw)
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", True)
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
    blocks.OUTER_SLICE; K = 32 makes two slices): every output and gradient at strong
    decays (g down to −50 and −inf), forming P alone or P and intra's T. The method needs the
    row operands' refs: intra's own Gram reads them over key slices (``rewy_intra.kslice``, the
    default) and then runs it too; from fp32 rows (kslice 0: no refs) it refuses it by name."""
    from pallas_kernels.gpu import blocks, kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.exact_diag", "outer")
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", gram_from_qk)
    monkeypatch.setattr(blocks, "OUTER_SLICE", 16)
    inp = testing.make_inputs(op, 1, 70, 2, 32, 16, decay="strong", seed=16)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.exact_diag", "outer")
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", False)
    if not gram_from_qk:  # intra's own vector-gate Gram by "outer", read over key slices
        _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                       chunk_size=64, **kw))
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.kslice", 0)
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
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.kslice", kslice)
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.kslice", kslice)
    # GDN2: intra forms its own vector-gate key Gram (frame blocks and diagonal loop, sliced)
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", op != "gdn2")
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
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_intra.joint_diag_inverse", False)
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
    from pallas_kernels.gpu import kernels

    for k in ("intra", "qk_gram", "bwd_leaf"):
        monkeypatch.setitem(kernels.TUNE, f"rewy_{k}.exact_diag", diag)
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay="strong", seed=12)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("kda", "strong", {}),
                                         ("deltanet", "none", {"policy": "save"}),
                                         ("gdn", "strong", {"backward": "wy"})])
def test_interpret_unrolled_loops(op, decay, kw, small_tiles, monkeypatch):
    """intra's and qk_gram's 16-step loops unrolled at trace time (a tuning option): the
    diagonal inverse substitution and the exact per-column diagonal blocks, every output and
    gradient at strong decays."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_intra.unroll", True)
    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.unroll", True)
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", False)  # intra's own Gram too
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=18)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("gdn2", "strong", {}),
                                         ("deltanet", "none", {"backward": "wy"})])
def test_interpret_full_recompute(op, decay, kw, small_tiles, monkeypatch):
    """Policy "recompute" re-forming A (and P) in the backward instead of keeping them (the
    tuning alternative to the default): every output and gradient."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "recompute.keep_chunk_matrices", False)
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=16)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "normal", {}), ("gdn", "strong", {}),
                                         ("kda", "strong", {}),
                                         ("kda", "normal", {"backward": "wy", "policy": "save"})])
def test_interpret_leaf_maps_in_kernel(op, decay, kw, small_tiles, monkeypatch):
    """DEFAULTS "backward.leaf_maps_in_kernel" (off): bwd_dlam and bwd_leaf differentiate
    Ē = β ⊙ k and Z = β ⊙ v themselves — every gradient to fp32 accuracy, both backwards."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "backward.leaf_maps_in_kernel", True)
    inp = testing.make_inputs(op, 2, 40, 2, 16, 32, decay=decay, seed=9)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True, chunk_size=16,
                                   **kw))


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
    from pallas_kernels.gpu import api, kernels as kn

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
    cfg = api.Config(C, "recompute", "rewy", True, 16)
    _, res = api._fwd(cfg, q, k, e, z, G, h0, *meta)
    kept = res[-2]
    assert res[-1] is None  # no per-row scales given (general_delta's rows)
    assert len(kept) == 2 and kept[0].shape == (B, H, N, C, C)
    assert (kept[1] is None) == (mode != "vector")
    assert all(a.shape[-2:] != (K, V) for a in jax.tree_util.tree_leaves(res)
               if a is not h0 and hasattr(a, "shape"))
    s = api._shape(cfg, q, z, G, h0)
    A, W, U, _ = api._intra(s, q, k, e, z, G, True)
    W2, U2 = kn.intra(s, k, e, z, G, A=A, interpret=True)
    np.testing.assert_array_equal(np.asarray(W2), np.asarray(W))
    np.testing.assert_array_equal(np.asarray(U2), np.asarray(U))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {}), ("kda", "strong", {}),
                                         ("gdn", "normal", {"backward": "wy", "policy": "save"})])
def test_interpret_low_precision_backward(op, decay, kw, monkeypatch):
    """backward.low_precision: the backward's stored S0, R, dS, dR, dRl, Λ, W, U, dT and dA_qk
    and the forward's kept A in bf16 (16-bit inputs). The forward is untouched bit for bit; every gradient stays within the bf16
    thresholds against the float64 recurrence; the stored tensors really are bf16."""
    from pallas_kernels.gpu import api, kernels

    inp = testing.make_inputs(op, 1, 100, 2, 32, 32, dtype=jnp.bfloat16, decay=decay, seed=23)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32)
    monkeypatch.setitem(kernels.TUNE, "backward.low_precision", ())  # all fp32
    ref = testing.accuracy_report(op, inp, **kw)
    o_ref = testing.run_op(op, inp, **kw)[0]
    monkeypatch.setitem(kernels.TUNE, "backward.low_precision", kernels.LOW_PRECISION_NAMES)
    rep = testing.accuracy_report(op, inp, **kw)
    _check(rep)
    np.testing.assert_array_equal(np.asarray(testing.run_op(op, inp, **kw)[0]), np.asarray(o_ref))
    assert any(rep[n][0] != ref[n][0] for n in rep if n.startswith("d"))  # it did take effect
    sd = api._stored_dtypes(jnp.bfloat16)
    assert set(sd.values()) == {jnp.bfloat16} and set(api._stored_dtypes(jnp.float32).values()) == {
        jnp.float32}
    monkeypatch.setitem(kernels.TUNE, "backward.low_precision", ("S0", "dW"))
    with pytest.raises(ValueError, match="unknown names.*dW"):
        api._stored_dtypes(jnp.bfloat16)


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
    from pallas_kernels.gpu import kernels

    n_seqs = kw.pop("n_seqs", None)
    inp = testing.make_inputs(op, 1, 100, 2, 32, 32, dtype=jnp.bfloat16, decay=decay, seed=31,
                              n_seqs=n_seqs)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32)
    monkeypatch.setitem(kernels.TUNE, "backward.native_pass_dots", False)
    ref = testing.accuracy_report(op, inp, **kw)
    o_ref = testing.run_op(op, inp, **kw)[0]
    monkeypatch.setitem(kernels.TUNE, "backward.native_pass_dots", True)
    rep = testing.accuracy_report(op, inp, **kw)
    _check(rep)
    np.testing.assert_array_equal(np.asarray(testing.run_op(op, inp, **kw)[0]), np.asarray(o_ref))
    assert any(rep[n][0] != ref[n][0] for n in rep if n.startswith("d"))  # it did take effect
    assert not kernels._native_pass_dots((jnp.float32, jnp.bfloat16))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("deltanet", "none", {}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "strong", {})])
def test_interpret_chunk_qdo(op, decay, kw, small_tiles, monkeypatch):
    """DEFAULTS "backward.chunk_qdo" (off until timed): bwd_local forms each chunk's Qγᵀ dO
    (reading q and G beside the kept P for vector gates) and the reverse state pass (twin or
    alone) reads it instead of q and dO. Every gradient
    stays within the bf16 thresholds against the float64 recurrence (initial states, packed
    sequences, T not a multiple of the chunk, two value tiles), the forward is untouched bit for
    bit, and the option takes effect: bwd_local returns the term, the pass reads no q."""
    from pallas_kernels.gpu import kernels

    assert not kernels.DEFAULTS["backward.chunk_qdo"]
    n_seqs = kw.pop("n_seqs", None)
    inp = testing.make_inputs(op, 1, 100, 2, 32, 32, dtype=jnp.bfloat16, decay=decay, seed=41,
                              n_seqs=n_seqs)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32)
    ref = testing.accuracy_report(op, inp, **kw)
    o_ref = testing.run_op(op, inp, **kw)[0]
    monkeypatch.setitem(kernels.TUNE, "backward.chunk_qdo", True)
    launches = _record_launches(monkeypatch)
    jax.clear_caches()
    rep = testing.accuracy_report(op, inp, **kw)
    _check(rep)
    np.testing.assert_array_equal(np.asarray(testing.run_op(op, inp, **kw)[0]), np.asarray(o_ref))
    assert any(rep[n][0] != ref[n][0] for n in rep if n.startswith("d"))  # it did take effect
    calls = {}
    for launch in launches:
        calls.setdefault(launch["name"], launch)
    reverse = calls.get("rewy_twin_pass", calls.get("rewy_bwd_pass"))
    n_in = 8 if op == "deltanet" else 9  # [qdo, k, (G), W, dRl, dfin, reset, end, seq]
    assert len(reverse["in_specs"]) == n_in + ("rewy_twin_pass" in calls) * (n_in - 1)
    assert len(calls["rewy_bwd_local"]["out_shape"]) == 2


def _record_launches(monkeypatch):
    """Wrap kernels._call so that every launch's settings (name, grid, in_specs, out_shape, …)
    are appended to the returned list, for tests that check which kernels an option runs."""
    from pallas_kernels.gpu import kernels

    launches, call = [], kernels._call

    def recorded(kernel, **launch):
        launches.append(launch)
        return call(kernel, **launch)

    monkeypatch.setattr(kernels, "_call", recorded)
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
    keywords) with kernels.TUNE[key] = value are bit for bit those without; returns the
    launches of the run with it (``_record_launches``), to check which kernels it ran."""
    from pallas_kernels.gpu import kernels

    op, inp, cts, kw = case
    jax.clear_caches()
    base = testing.loss_and_grads(op, inp, cts, **kw)
    launched = _record_launches(monkeypatch)
    monkeypatch.setitem(kernels.TUNE, key, value)
    jax.clear_caches()
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
    G, below = api._cum_gates(g, C, True, floor, keep_below=True)
    assert np.array_equal(G, api._cum_gates(clamped, C, True)[0])
    assert np.array_equal(np.asarray(below) != 0, np.asarray(g) < floor)
    assert 0 < int(np.sum(np.asarray(below) != 0)) < below.size
    assert api._cum_gates(g, C, True, floor)[1] is None  # the primal keeps no mask
    dg = api._gate_grad((pairs, path), C, True, below)
    _, vjp = jax.vjp(lambda x: clamp_gates(x, floor), g)
    assert np.array_equal(dg, vjp(api._gate_grad((pairs, path), C, True))[0])


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
    """kernels.cum_gates / gate_grad (vector gates' G and dg, in-kernel since profile-21)
    against the plain-JAX cumsums of chunk_algebra in float64, over several chunks, heads and
    key tiles, with strong decays (g down to −60) and gradient parts of mixed sign."""
    from pallas_kernels.chunk_algebra import exclusive_cumsum, reverse_cumsum
    from pallas_kernels.gpu import api, kernels

    C, shape = 16, (2, 48, 3, K)
    ks = jax.random.split(jax.random.PRNGKey(K), 3)
    g = -jax.random.uniform(ks[0], shape, jnp.float32, 0.0, 60.0) ** 2 / 60.0
    pairs = 30.0 * jax.random.normal(ks[1], shape, jnp.float32)
    path = jax.random.normal(ks[2], shape, jnp.float32)
    f64 = lambda x: np.asarray(x, np.float64).reshape(2, 3, C, 3, K)  # noqa: E731
    G = kernels.cum_gates(g, C, interpret=True)
    np.testing.assert_allclose(np.asarray(G).reshape(2, 3, C, 3, K),
                               np.cumsum(f64(g), axis=2), rtol=1e-6, atol=1e-5)
    dg = kernels.gate_grad(pairs, path, C, interpret=True)
    ref = np.flip(np.cumsum(np.flip(f64(pairs), 2), 2), 2) + np.cumsum(f64(path), 2) - f64(path)
    err = np.linalg.norm(np.asarray(dg, np.float64).reshape(ref.shape) - ref) / np.linalg.norm(ref)
    assert err < 1e-6, err
    # the dispatch: vector gates through the kernels, scalar gates in jnp (same sums)
    assert np.array_equal(api._cum_gates(g, C, True)[0], G)
    np.testing.assert_allclose(api._gate_grad((pairs, path), C, True), dg)
    gs = g[..., 0]
    np.testing.assert_allclose(api._cum_gates(gs, C, True)[0], G[..., 0], rtol=1e-6, atol=1e-5)
    sc = api._gate_grad((pairs[..., 0], path[..., 0]), C, True)
    c = lambda x: api._chunks(x, C)  # noqa: E731
    np.testing.assert_allclose(
        sc, (reverse_cumsum(c(pairs[..., 0]), 2) + exclusive_cumsum(c(path[..., 0]), 2)
             ).reshape(sc.shape), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,dtype", [("deltanet", jnp.float32), ("kda", jnp.bfloat16)])
def test_interpret_row_vjp_kernel(op, dtype, monkeypatch):
    """DEFAULTS "backward.row_vjp_kernel" (off: measured slower in profile-21): the VJP of
    e = β ⊙ k, z = β ⊙ v by kernels.row_scale_vjp gives the gradients of XLA's three fusions
    (the same fp32 arithmetic; the row sums may round in another order), and the kernel runs."""
    from pallas_kernels.gpu import kernels

    assert not kernels.DEFAULTS["backward.row_vjp_kernel"]
    monkeypatch.setitem(kernels.TUNE, "backward.row_vjp_kernel", True)
    inp = testing.make_inputs(op, 2, 40, 2, 32, 16, dtype=dtype, seed=3)
    rng = np.random.default_rng(0)
    cts = {"o": jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32),
           "final_state": jnp.asarray(rng.standard_normal((2, 2, 32, 16)), jnp.float32)}
    kw = dict(backend="pallas_gpu", interpret=True, chunk_size=16, use_qk_l2norm=True)
    launched = _record_launches(monkeypatch)
    jax.clear_caches()
    _, _, g1 = testing.loss_and_grads(op, inp, cts, **kw)
    assert any(launch["name"] == "rewy_row_vjp" for launch in launched)
    monkeypatch.setitem(kernels.TUNE, "backward.row_vjp_kernel", False)
    jax.clear_caches()
    _, _, g2 = testing.loss_and_grads(op, inp, cts, **kw)
    for name in g1:
        assert _rel(g1[name], g2[name]) < 1e-5, (name, _rel(g1[name], g2[name]))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_interpret_qk_gram_centred(monkeypatch):
    """DEFAULTS "rewy_qk_gram.centred": under a declared gate bound qk_gram's diagonal blocks as
    centred frame products give P and T as the exact loop does, to fp32 rounding, with every
    gate at the bound (factors up to e^40 before the mask); without the bound the loop stays;
    KDA through the op within the bf16 thresholds."""
    from pallas_kernels.gpu import api, kernels

    s, k, e, _, _, key = _wu_case("vector", 32, 32, 17)
    kq, kg = jax.random.split(key)
    q = (jax.random.normal(kq, k.shape) / k.shape[-1] ** 0.5).astype(jnp.bfloat16)
    g = -jax.random.uniform(kg, k.shape, jnp.float32, 0.0, 5.0).at[:, ::7].set(-5.0)
    G, _ = api._cum_gates(g, s.C, True)
    h0 = jnp.zeros((1, 2, 2, 32, 32), jnp.float32)
    centred = api._shape(api.Config(s.C, "recompute", "rewy", True, 64, centred=True,
                                    one_seq=True), k, k, G, h0)
    assert kernels.DEFAULTS["rewy_qk_gram.centred"]  # default since profile-21
    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.centred", False)
    exact = kernels.qk_gram(centred, q, k, G, e=e, interpret=True)
    seen = []
    gates = kernels.Gates
    monkeypatch.setattr(kernels, "Gates", lambda *a, **k_: seen.append(a[4]) or gates(*a, **k_))
    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.centred", True)
    got = kernels.qk_gram(centred, q, k, G, e=e, interpret=True)
    assert seen == ["centred"], seen
    for x, y in zip(got, exact, strict=True):  # P, T
        assert _rel(x, y) < 1e-5, _rel(x, y)
    seen.clear()
    kernels.qk_gram(s, q, k, G, e=e, interpret=True)  # no declared bound: exact
    assert seen == [kernels.setting("rewy_qk_gram.exact_diag")], seen
    inp, _, kw = _bf16_case("kda", "normal", 79, {})
    jax.clear_caches()
    _check(testing.accuracy_report("kda", inp, gate_lower_bound=-5.0, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("backward,keep", [("rewy", True), ("wy", True), ("rewy", False)])
def test_interpret_backward_row_scaled_wu(backward, keep, monkeypatch):
    """DEFAULTS "backward.row_scaled_wu": the backward re-forms W, U from k, v and β like the
    forward (off: from βk, βv rounded to bf16), for kept or re-formed chunk matrices — the key
    gradients come closer to the float64 recurrence and every check passes (DeltaNet, packed
    sequences, β in [0, 2])."""
    from pallas_kernels.gpu import api, kernels

    inp, _, kw = _bf16_case("deltanet", "none", 83, {"n_seqs": 2, "backward": backward})
    for n in ("q", "k"):  # unit rows as bf16 inputs (see test_interpret_row_scaled_ez)
        x = inp[n].astype(jnp.float32)
        inp[n] = (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    kw["use_qk_l2norm"] = False
    monkeypatch.setitem(kernels.TUNE, "recompute.keep_chunk_matrices", keep)
    in_bwd, rows_seen = [False], []  # whether each W, U re-formation of the backward got rows

    def spy(real):
        def call(*a, rows=None, **kw):
            if in_bwd[0]:
                rows_seen.append(rows is not None)
            return real(*a, rows=rows, **kw)
        return call

    monkeypatch.setattr(api, "_wu", spy(api._wu))
    monkeypatch.setattr(api, "_intra", spy(api._intra))
    bwd = api._bwd

    def bwd_spy(*a):
        in_bwd[0] = True
        try:
            return bwd(*a)
        finally:
            in_bwd[0] = False

    api.general_delta.defvjp(api._fwd, bwd_spy)
    reps = {}
    try:
        for on in (False, True):
            monkeypatch.setitem(kernels.TUNE, "backward.row_scaled_wu", on)
            jax.clear_caches()
            rows_seen.clear()
            reps[on] = testing.accuracy_report("deltanet", inp, **kw)
            _check(reps[on])
            assert rows_seen and all(r == on for r in rows_seen), (on, rows_seen)
    finally:
        api.general_delta.defvjp(api._fwd, bwd)
    assert reps[True]["dk"][0] < reps[False]["dk"][0], reps


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("mode", ["none", "scalar", "vector"])
@pytest.mark.parametrize("kslice", [0, 16])
def test_interpret_intra_rows(mode, kslice, monkeypatch):
    """kernels.intra and qk_gram with per-row scales (``rows``, ``e_rows``): from k, v as stored
    and β, the same A, W, U, T as from the exactly scaled fp32 rows — with the Grams over key
    slices (native products of the stored rows) or whole."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_intra.kslice", kslice)
    monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.kslice", kslice)
    s, k, _, v, G, key = _wu_case(mode, 32, 32, 13)
    kq, kb = jax.random.split(key)
    q = (jax.random.normal(kq, k.shape) / k.shape[-1] ** 0.5).astype(jnp.bfloat16)
    be = jax.random.uniform(kb, k.shape[:3], jnp.float32, 0.0, 2.0)
    bz = 0.5 * be
    e32, z32 = be[..., None] * k.astype(jnp.float32), bz[..., None] * v.astype(jnp.float32)
    Tg = Tg32 = None
    if mode == "vector":
        P, Tg = kernels.qk_gram(s, q, k, G, e=k, e_rows=be, interpret=True)
        P32, Tg32 = kernels.qk_gram(s, q, k, G, e=e32, interpret=True)
        assert _rel(P, P32) == 0 and _rel(Tg, Tg32) < 1e-6, _rel(Tg, Tg32)
    got = kernels.intra(s, k, k, v, G, T=Tg, interpret=True, rows=(be, bz))
    want = kernels.intra(s, k, e32, z32, G, T=Tg32, interpret=True)
    for x, y in zip(got, want, strict=True):  # A, W, U
        assert _rel(x, y) < 1e-5, (_rel(x, y), mode)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "normal", {}),
                                         ("gdn2", "normal", {})])
def test_interpret_row_scaled_ez(op, decay, kw, monkeypatch):
    """forward.row_scaled_ez (default): with per-row β (DeltaNet, GDN, KDA) the forward's
    kernels form Ē = β ⊙ k and Z = β ⊙ v from k, v and β instead of reading e, z rounded to
    bf16 — o and the final state come closer to the float64 recurrence (β in [0, 2], packed
    sequences, strong decays, both policies), the gradients move by rounding only, and GDN2 (b, w
    per channel) keeps the rounded e, z."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 71, kw)
    # q, k of unit norm as bf16 inputs (normalised in-op, they would be rounded to bf16 after
    # the reference saw them in fp32): the forward's own rounding alone
    for n in ("q", "k"):
        x = inp[n].astype(jnp.float32)
        inp[n] = (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    kw["use_qk_l2norm"] = False
    seen = []
    intra = kernels.intra
    monkeypatch.setattr(kernels, "intra", lambda *a, **k: seen.append(k.get("rows") is not None)
                        or intra(*a, **k))
    reps, grads = {}, {}
    for on in (False, True):
        monkeypatch.setitem(kernels.TUNE, "forward.row_scaled_ez", on)
        jax.clear_caches()  # read when the kernels are traced
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
                                                  "kbar32")])
def test_interpret_fwd_predecayed(op, decay, kw, setting, small_tiles, monkeypatch):
    """DEFAULTS "fwd_pass.predecayed" (vector gates; True since profile-22): the fused forward
    pass reads K̄ = e^{G_C − G} ⊙ k and Qγ = e^{G} ⊙ q from kernels.decayed_rows (Qγ rounded to
    the inputs' 16 bits, K̄ too or kept in fp32) instead of forming them per value tile from k,
    q and G (False). The output and final state move by that rounding only and stay within the bf16 thresholds against the float64 recurrence
    (strong decays, packed sequences, initial states, T not a multiple of the chunk); the
    gradients, which the backward recomputes, are unchanged bit for bit."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 47, kw)
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.predecayed", False)
    jax.clear_caches()
    base = testing.loss_and_grads(op, inp, cts, **kw)
    _check(testing.accuracy_report(op, inp, **kw))
    launched = _record_launches(monkeypatch)
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.predecayed", setting)
    jax.clear_caches()
    pre = testing.loss_and_grads(op, inp, cts, **kw)
    assert any(launch["name"] == "rewy_decayed_rows" for launch in launched)
    _same_runs(pre[2], base[2])  # the gradients
    assert 0 < _rel(pre[0], base[0]) < 1e-2  # o: Qγ's rounding to 16 bits
    assert _rel(pre[1], base[1]) < 1e-2  # the final state: K̄'s (none for an fp32 K̄)
    _check(testing.accuracy_report(op, inp, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw,qdo", [("kda", "strong", {"n_seqs": 2}, False),
                                             ("kda", "normal", {"policy": "save"}, False),
                                             ("gdn2", "strong", {"gate_lower_bound": -5.0}, True)])
def test_interpret_bwd_predecayed(op, decay, kw, qdo, small_tiles, monkeypatch):
    """DEFAULTS "backward.predecayed" (vector gates; off until timed): the backward's state
    passes read K̄ and Qγ from kernels.decayed_rows instead of forming them from k, q and G in
    each value-tile program — in the dtype each pass would round them to, so the outputs and
    every gradient are bit for bit the default's (twin and lone reverse pass, with and without
    chunk_qdo, packed sequences, strong decays)."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 53, kw)
    monkeypatch.setitem(kernels.TUNE, "backward.chunk_qdo", qdo)
    launched = _bit_identical_with(monkeypatch, (op, inp, cts, kw), "backward.predecayed", True)
    assert any(launch["name"] == "rewy_decayed_rows" for launch in launched)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("kda", "normal", {"gate_lower_bound": -5.0}),
                                         ("kda", "strong", {"n_seqs": 2, "chunk_size": 64}),
                                         ("gdn2", "normal", {"gate_lower_bound": -5.0,
                                                             "chunk_size": 64})])
def test_interpret_qk_gram_row_frames(op, decay, kw, monkeypatch):
    """DEFAULTS "rewy_qk_gram.row_frames" (True since profile-22): qk_gram's frame-product
    blocks of a row — every block left of the diagonal, and the centred diagonal under a
    declared bound — in one key-slice loop give P, T and so the outputs and every gradient bit
    for bit as one loop per block (False): exact and centred diagonals, chunks of 2 and 4 row
    blocks, packed sequences, strong decays."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw2 = _bf16_case(op, decay, 59, {k: v for k, v in kw.items() if k != "chunk_size"})
    kw2["chunk_size"] = kw.get("chunk_size", kw2["chunk_size"])
    assert 0 < kernels.setting("rewy_qk_gram.kslice") < 32  # K = 32: two key slices
    assert kernels.setting("rewy_qk_gram.row_frames") is True
    launched = _bit_identical_with(monkeypatch, (op, inp, cts, kw2), "rewy_qk_gram.row_frames",
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
    """DEFAULTS "backward.leaf_e_rows" (no and scalar gates since profile-23; vector gates by
    TUNE True): under ReWY the leaf kernel forms e = βe ⊙ k from k and βe, rounded as
    api.leaf_product rounds it, instead of reading XLA's e — the outputs and every gradient
    bit for bit (both policies, packed sequences, strong decays, β in [0, 2], every diagonal
    form); the leaf got βe and no e, except with vector gates' per-pair diagonals."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw2 = _bf16_case(op, decay, 61, kw)
    if diag is not None:
        monkeypatch.setitem(kernels.TUNE, "rewy_bwd_leaf.exact_diag", diag)
    assert kernels.DEFAULTS["backward.leaf_e_rows"] == ("none", "scalar")
    monkeypatch.setitem(kernels.TUNE, "backward.leaf_e_rows", True)
    got = []
    leaf = kernels.bwd_leaf
    monkeypatch.setattr(kernels, "bwd_leaf", lambda *a, **k: got.append(
        (a[3] is None, k.get("e_scale") is not None)) or leaf(*a, **k))
    _bit_identical_with(monkeypatch, (op, inp, cts, kw2), "backward.leaf_e_rows", False)
    formed = diag != "loop"
    assert got == [(formed, formed), (False, False)], got  # with the option, then XLA's e
    monkeypatch.setitem(kernels.TUNE, "backward.leaf_e_rows", True)
    got.clear()  # the seven-product backward's bwd_dlam reads e: it keeps XLA's
    jax.clear_caches()
    testing.loss_and_grads(op, inp, cts, **dict(kw2, backward="wy"))
    assert got == [(False, False)], got


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("key,kw", [("backward.dlam_decays", {}),
                                    ("backward.dlam_decays", {"n_seqs": 2}),
                                    ("rewy_bwd_leaf.native_decayed", {})])
def test_interpret_gdn_decayed_cotangents(key, kw, small_tiles, monkeypatch):
    """Where GDN's decayed chunk cotangents dT ⊙ D, dA_qk ⊙ D are rounded to bf16 for native
    products: in bwd_dlam, once per chunk (DEFAULTS "backward.dlam_decays", dA_qk's diagonal
    inside), or in the leaf ("rewy_bwd_leaf.native_decayed", dlam_decays off). Either way every
    output and gradient stays within the bf16 thresholds of the float64 recurrence (strong
    decays, β in [0, 2], packed sequences); against the form without it, o, the final state and
    dv (none of them the leaf's) are bit for bit the same and the leaf's gradients move by about
    a bf16 rounding, not more."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw2 = _bf16_case("gdn", "strong", 71, kw)
    assert kernels.DEFAULTS[key]
    if key != "backward.dlam_decays":
        monkeypatch.setitem(kernels.TUNE, "backward.dlam_decays", False)
    _check(testing.accuracy_report("gdn", inp, **kw2))
    jax.clear_caches()
    o, s, g = testing.loss_and_grads("gdn", inp, cts, **kw2)
    monkeypatch.setitem(kernels.TUNE, key, False)
    jax.clear_caches()
    o2, s2, g2 = testing.loss_and_grads("gdn", inp, cts, **kw2)
    assert np.array_equal(o, o2) and np.array_equal(s, s2) and np.array_equal(g["dv"], g2["dv"])
    for name in ("dq", "dk", "dg", "dbeta"):
        moved = testing.ratio(g[name], g2[name])
        assert 0 < moved < 1e-2, (name, moved)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("key,kw", [("state_pass.value_side_decay", {}),
                                    ("state_pass.value_side_decay", {"n_seqs": 2}),
                                    ("state_pass.value_side_decay",
                                     {"policy": "save", "backward": "wy"}),
                                    ("rewy_intra.gate_on_A", {"n_seqs": 2})])
def test_interpret_gdn_value_side_decay(key, kw, small_tiles, monkeypatch):
    """GDN's decays on the narrow side of a product: DEFAULTS "state_pass.value_side_decay"
    (the state passes scale R, k·dS, q·S0 and dO instead of k and q) and "rewy_intra.gate_on_A"
    (intra and wu put γ on A's columns instead of Ē's rows). Every output and gradient stays
    within the bf16 thresholds of the float64 recurrence (strong decays, packed sequences, both
    policies); against the key-side form the outputs and gradients move by about a rounding,
    not more — and something moves, so the setting reaches the kernels."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw2 = _bf16_case("gdn", "strong", 73, kw)
    assert kernels.DEFAULTS[key]
    _check(testing.accuracy_report("gdn", inp, **kw2))
    intra, W = kernels.intra, []  # the forward's W: where gate_on_A shows (sub-ulp in o here)

    def recording(*a, **k):
        out = intra(*a, **k)
        if k.get("A") is None:  # the forward's (A, W, U), not the backward's (W, U)
            W.append(out[1])
        return out

    monkeypatch.setattr(kernels, "intra", recording)
    jax.clear_caches()
    o, s, g = testing.loss_and_grads("gdn", inp, cts, **kw2)
    n_first = len(W)
    monkeypatch.setitem(kernels.TUNE, key, False)
    jax.clear_caches()
    o2, s2, g2 = testing.loss_and_grads("gdn", inp, cts, **kw2)
    # Some may not move at all: o is bf16 (values an fp32 rounding apart may round alike), the
    # interpreter multiplies fp32 exactly where the GPU rounds to TF32, and under "save" the
    # backward reads S0 and R as the forward stored them, in bf16.
    moved = {name: testing.ratio(g[name], g2[name]) for name in ("dq", "dk", "dv", "dg", "dbeta")}
    moved.update(o=testing.ratio(o, o2), final_state=testing.ratio(s, s2),
                 W=testing.ratio(W[0], W[n_first]))
    assert max(moved.values()) < 1e-2 and max(moved.values()) > 0, moved


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,qdo", [("deltanet", "none", False), ("gdn", "strong", True),
                                          ("kda", "normal", False)])
def test_interpret_bwd_local_tile_loop(op, decay, qdo, small_tiles, monkeypatch):
    """DEFAULTS "rewy_bwd_local.tile_loop" (off until timed): bwd_local on one program per
    (chunk, head) looping over the value tiles — P built (no or scalar gates, with the chunk's
    Qγᵀ dO under "backward.chunk_qdo") or read (vector gates) once — gives the outputs and
    every gradient bit for bit as one program per value tile (packed sequences, initial
    states, T not a multiple of the chunk, two value tiles)."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 43, {"n_seqs": 2})
    monkeypatch.setitem(kernels.TUNE, "backward.chunk_qdo", qdo)
    launches = _bit_identical_with(monkeypatch, (op, inp, cts, kw), "rewy_bwd_local.tile_loop",
                                   True)
    grids = [launch["grid"] for launch in launches if launch["name"] == "rewy_bwd_local"]
    assert grids and all(len(g) == 2 for g in grids)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {}),
                                         ("kda", "normal", {"policy": "save"})])
def test_interpret_twin_pass(op, decay, kw, small_tiles, monkeypatch):
    """backward.twin_pass (default): the recompute pass and the reverse pass in one launch give
    the outputs and every gradient bit for bit as the two launches (packed sequences, initial
    states, T not a multiple of the chunk, two value tiles); it is taken under ``recompute``
    only, and the gradients stay within the bf16 thresholds."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 37, kw)
    monkeypatch.setitem(kernels.TUNE, "backward.twin_pass", False)  # the two launches apart
    jax.clear_caches()
    apart = testing.loss_and_grads(op, inp, cts, **kw)
    calls = []
    twin = kernels.twin_pass
    monkeypatch.setattr(kernels, "twin_pass", lambda *a, **k: calls.append(1) or twin(*a, **k))
    monkeypatch.setitem(kernels.TUNE, "backward.twin_pass", True)
    jax.clear_caches()  # the setting is read when the kernels are traced
    together = testing.loss_and_grads(op, inp, cts, **kw)
    assert len(calls) == (kw.get("policy", "recompute") == "recompute")
    _same_runs(together, apart)
    _check(testing.accuracy_report(op, inp, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("kda", "strong", {"policy": "save"}),
                                         ("gdn", "normal", {})])
def test_interpret_tiles_first(op, decay, kw, small_tiles, monkeypatch):
    """launch.tiles_first: the kernels with value or key tiles launch that grid axis first; the
    outputs and every gradient are bit for bit those of the logical order (two value and key
    tiles, packed sequences, T not a multiple of the chunk, both policies, the twin pass), and
    the reordering did happen."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 41, kw)
    orders = []
    ordered = kernels._launch_ordered
    monkeypatch.setattr(kernels, "_launch_ordered",
                        lambda kernel, order: orders.append(order) or ordered(kernel, order))
    runs = []
    for first in (False, True):
        monkeypatch.setitem(kernels.TUNE, "launch.tiles_first", first)
        jax.clear_caches()  # the setting is read when the kernels are traced
        orders.clear()
        runs.append(testing.loss_and_grads(op, inp, cts, **kw))
        moved = [o for o in orders if o != tuple(range(len(o)))]
        assert bool(moved) == first, orders
    if kw.get("policy") == "save":  # the output kernel, bwd_local, bwd_leaf, both passes
        assert {(1, 0), (2, 0, 1)} <= set(moved)
    _same_runs(runs[1], runs[0])


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {}),
                                         ("gdn", "normal", {"policy": "save"}),
                                         ("deltanet", "none", {"_fuse_all": False})])
def test_interpret_intra_forms_P(op, decay, kw, small_tiles, monkeypatch):
    """rewy_intra.emit_P: intra forms P = tril(Qγ K̄ᵀ) for no and scalar gates, and the output
    (fused into the pass or its own kernel) and, under ``save``, bwd_local read it — the outputs
    and every gradient bit for bit as when each rebuilds it (same fp32 products), with intra
    really called with q (packed sequences, strong decays, both policies)."""
    from pallas_kernels.gpu import kernels

    kw = dict(kw)
    fuse_all = kw.pop("_fuse_all", True)
    if not fuse_all:  # DeltaNet's forward through the output kernel too
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", False)
    inp, cts, kw = _bf16_case(op, decay, 43, kw)
    with_q = []
    intra = kernels.intra
    monkeypatch.setattr(kernels, "intra", lambda *a, **k: with_q.append(
        k.get("q") is not None) or intra(*a, **k))
    runs = []
    for modes in ((), ("none", "scalar")):
        monkeypatch.setitem(kernels.TUNE, "rewy_intra.emit_P", modes)
        jax.clear_caches()  # the setting is read when the kernels are traced
        with_q.clear()
        runs.append(testing.loss_and_grads(op, inp, cts, **kw))
        assert any(with_q) == bool(modes), with_q
    _same_runs(runs[1], runs[0])
    assert [kernels.intra_forms_P(m) for m in ("none", "scalar", "vector")] == [True, True, False]
    monkeypatch.setitem(kernels.TUNE, "rewy_intra.emit_P", ("none", "gated"))
    with pytest.raises(ValueError, match="rewy_intra.emit_P.*gated"):
        kernels.intra_forms_P("none")


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {}),
                                         ("gdn", "normal", {"policy": "save"}),
                                         ("deltanet", "none", {"_fuse": False})])
def test_interpret_split_kr(op, decay, kw, small_tiles, monkeypatch):
    """fwd_pass.split_kr: the forward's pass forms K̄ᵀ R as two native bf16 products (R split
    into high and low parts) — the outputs and final state agree with the fp32 product to
    R's ~16 bits, every output and gradient stays within the bf16 thresholds (packed sequences,
    strong decays, both policies, the fused and the separate output), the split really ran,
    and it is skipped for vector gates."""
    from pallas_kernels.gpu import blocks, kernels

    kw = dict(kw)
    if not kw.pop("_fuse", True):
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", False)
    inp, cts, kw = _bf16_case(op, decay, 53, kw)
    splits = []
    split = blocks.dot_split
    monkeypatch.setattr(kernels, "dot_split", lambda *a, **k: splits.append(1) or split(*a, **k))
    runs = []
    for on in (False, True):
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.split_kr", on)
        jax.clear_caches()  # the setting is read when the kernels are traced
        splits.clear()
        runs.append(testing.run_op(op, inp, **kw))
        assert bool(splits) == on
    for x, y in zip(runs[1], runs[0], strict=True):
        assert _rel(x, y) < 1e-3, (_rel(x, y), op)
    _check(testing.accuracy_report(op, inp, **kw))
    splits.clear()
    kda, _, _ = _bf16_case("kda", "normal", 53, {})
    jax.clear_caches()
    testing.run_op("kda", kda, **kw)
    assert not splits


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "normal", {})])
def test_interpret_forward_low_precision(op, decay, kw, small_tiles, monkeypatch):
    """forward.low_precision ("W"; the default is ()): intra stores the forward's W in bf16 for the
    state pass — W really is bf16 there (fp32 when the setting is empty), and with W S as one
    upcast product or split (fwd_pass.split_w) the outputs agree with the fp32 W to bf16
    rounding, and every output and gradient stays within the bf16 thresholds (packed sequences,
    strong decays, both policies, all gate modes)."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 59, kw)
    w_dtypes = []
    fwd_pass = kernels.fwd_pass
    monkeypatch.setattr(kernels, "fwd_pass",
                        lambda s, W, *a, **k: w_dtypes.append(W.dtype) or fwd_pass(s, W, *a, **k))
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision", ())
    base = testing.run_op(op, inp, **kw)
    assert w_dtypes[0] == jnp.float32
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision", ("W",))
    for split in (False, True):
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.split_w", split)
        jax.clear_caches()  # the settings are read when the kernels are traced
        w_dtypes.clear()
        run = testing.run_op(op, inp, **kw)
        assert w_dtypes[0] == jnp.bfloat16, w_dtypes
        for x, y in zip(run, base, strict=True):
            assert _rel(x, y) < 1e-2, (_rel(x, y), op, split)
        _check(testing.accuracy_report(op, inp, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_interpret_forward_low_precision_modes(monkeypatch):
    """DEFAULTS "forward.low_precision_modes": at K ≤ 128 the names one gate mode gets — GDN's
    unfused forward storing S0, R in bf16 for its output kernel (and multiplying natively) —
    other modes and K > 128 untouched; the outputs within the bf16 thresholds (packed
    sequences, strong decays); an unknown mode is refused."""
    from pallas_kernels.gpu import api, kernels

    assert kernels.DEFAULTS["forward.low_precision_modes"] == {}
    # GDN's forward unfused (fused by default since profile-22), so that it stores S0, R
    monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", ("none", "vector"))
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision_modes", {"scalar": ("S0", "R")})
    assert api._forward_dtypes(jnp.bfloat16, 128, "scalar")["S0"] == jnp.bfloat16
    assert api._forward_dtypes(jnp.bfloat16, 128, "none")["S0"] == jnp.float32
    assert api._forward_dtypes(jnp.bfloat16, 128)["S0"] == jnp.float32
    assert api._forward_dtypes(jnp.float32, 128, "scalar")["S0"] == jnp.float32
    s0_dtypes = []
    output = kernels.output
    monkeypatch.setattr(kernels, "output", lambda s, q, k, G, S0, *a, **k_: s0_dtypes.append(
        S0.dtype) or output(s, q, k, G, S0, *a, **k_))
    inp, _, kw = _bf16_case("gdn", "strong", 73, {"n_seqs": 2})
    jax.clear_caches()
    _check(testing.accuracy_report("gdn", inp, **kw))
    assert s0_dtypes and set(s0_dtypes) == {jnp.dtype(jnp.bfloat16)}, s0_dtypes
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision_modes", {"gated": ("S0",)})
    with pytest.raises(ValueError, match="unknown gate modes"):
        api._forward_dtypes(jnp.bfloat16, 128, "scalar")


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("kda", "strong", {"policy": "save"})])
def test_interpret_forward_low_precision_wide(op, decay, kw, monkeypatch):
    """forward.low_precision_wide (the default ("W", "S0", "R"), or ("S0", "R")): at K > 128 the
    forward's unfused pass stores S0 and R in bf16 for the output kernel (and the save policy's
    backward) — really bf16 there, fp32 at K ≤ 128 and with the setting empty — and the outputs
    agree with the fp32 storage to bf16
    rounding, every output and gradient within the bf16 thresholds (K = V = 256, T = 70 not a
    multiple of the chunk, packed sequences, strong decays)."""
    from pallas_kernels.gpu import api, kernels

    n_seqs = kw.pop("n_seqs", None)
    inp = testing.make_inputs(op, 1, 70, 1, 256, 256, dtype=jnp.bfloat16, decay=decay, seed=61,
                              n_seqs=n_seqs)
    kw = dict(kw, backend="pallas_gpu", interpret=True, chunk_size=32, use_qk_l2norm=True)
    s0_dtypes = []
    output = kernels.output
    monkeypatch.setattr(kernels, "output", lambda s, q, k, G, S0, *a, **k_: s0_dtypes.append(
        S0.dtype) or output(s, q, k, G, S0, *a, **k_))
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision_wide", ())
    base = testing.run_op(op, inp, **kw)
    assert s0_dtypes and set(s0_dtypes) == {jnp.dtype(jnp.float32)}, s0_dtypes
    assert set(kernels.DEFAULTS["forward.low_precision_wide"]) >= {"S0", "R"}
    assert api._forward_dtypes(jnp.bfloat16, 256)["W"] == jnp.float32
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision_wide", ("S0", "R"))
    assert api._forward_dtypes(jnp.bfloat16, 128)["S0"] == jnp.float32  # K ≤ 128 untouched
    assert api._forward_dtypes(jnp.float32, 256)["S0"] == jnp.float32  # fp32 inputs too
    jax.clear_caches()
    s0_dtypes.clear()
    run = testing.run_op(op, inp, **kw)
    assert s0_dtypes and set(s0_dtypes) == {jnp.dtype(jnp.bfloat16)}, s0_dtypes
    for x, y in zip(run, base, strict=True):
        assert _rel(x, y) < 1e-2, (_rel(x, y), op)
    _check(testing.accuracy_report(op, inp, **kw))
    # the same storage with the forward's products kept off bf16 (forward.native_pass_dots):
    # closer to the fp32 storage than the native products are
    monkeypatch.setitem(kernels.TUNE, "forward.native_pass_dots", False)
    jax.clear_caches()
    kept = testing.run_op(op, inp, **kw)
    # (on the fp32 final state: o's own bf16 rounding can hide the difference)
    assert _rel(kept[1], base[1]) < _rel(run[1], base[1]), op
    _check(testing.accuracy_report(op, inp, **kw))
    monkeypatch.setitem(kernels.TUNE, "forward.low_precision_wide", ("S1",))
    with pytest.raises(ValueError, match=r"unknown names \['S1'\]"):
        api._forward_dtypes(jnp.bfloat16, 256)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("kda", "strong", {})])
def test_interpret_forward_native_fused_dots(op, decay, kw, small_tiles, monkeypatch):
    """forward.native_fused_dots (off by default; True or the gate modes it applies to): the
    forward's fused pass (policy recompute, no or vector gates) is handed bf16 "stored" dtypes
    for 16-bit inputs — fp32 by default, for fp32 inputs and for modes not named — so it
    multiplies its recurrence in bf16, and the outputs agree with the TF32 products to bf16
    rounding (packed sequences, strong decays). KDA stays within every bf16 threshold; DeltaNet
    does not always (o 5.1e-3 > 5e-3 here, as FLA's bf16 state products fail it), which is why
    the option is off."""
    from pallas_kernels.gpu import api, kernels

    inp, cts, kw = _bf16_case(op, decay, 67, kw)
    mode = "none" if op == "deltanet" else "vector"
    fused_dtypes = []
    fwd_pass = kernels.fwd_pass

    def spy(*a, **k):
        if k.get("out") is not None:
            fused_dtypes.append(tuple(k.get("dtypes", ())))
        return fwd_pass(*a, **k)

    monkeypatch.setattr(kernels, "fwd_pass", spy)
    base = testing.run_op(op, inp, **kw)
    assert fused_dtypes and set(fused_dtypes) == {(jnp.float32,) * 2}, fused_dtypes
    monkeypatch.setitem(kernels.TUNE, "forward.native_fused_dots",
                        ("scalar", "vector") if mode == "none" else ("vector",))
    assert api._fused_pass_dtypes(jnp.bfloat16, mode) == (
        (jnp.float32,) * 2 if mode == "none" else (jnp.bfloat16,) * 2)  # named modes only
    monkeypatch.setitem(kernels.TUNE, "forward.native_fused_dots", True)
    assert api._fused_pass_dtypes(jnp.float32, mode) == (jnp.float32,) * 2  # fp32 inputs
    jax.clear_caches()  # the settings are read when the kernels are traced
    fused_dtypes.clear()
    run = testing.run_op(op, inp, **kw)
    assert fused_dtypes and set(fused_dtypes) == {(jnp.bfloat16,) * 2}, fused_dtypes
    for x, y in zip(run, base, strict=True):
        assert _rel(x, y) < 1e-2, (_rel(x, y), op)
    assert _rel(run[0], base[0]) > 1e-4, op  # the products really changed
    rep = testing.accuracy_report(op, inp, **kw)
    if op == "kda":
        _check(rep)
    else:  # the gradients are the backward's own; the forward's outputs near their threshold
        _check({n: v for n, v in rep.items() if n not in ("o", "final_state")})
        assert rep["o"][0] < 2 * rep["o"][1] and rep["final_state"][0] < 2 * rep["o"][1], rep
    monkeypatch.setitem(kernels.TUNE, "forward.native_fused_dots", ("gated",))
    with pytest.raises(ValueError, match="unknown gate modes"):
        api._fused_pass_dtypes(jnp.bfloat16, mode)


def _wu_case(mode, K, V, seed):
    """(Shape, k, e = 0.7 k, z, G, a spare PRNG key): bf16 rows at B = 1, T = 128, H = 2, C = 64,
    strong gates of ``mode`` (G from the chunk's start) — the kernel-level tests of W, U."""
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
        G, _ = api._cum_gates(g, C, True)
    h0 = jnp.zeros((B, H, 2, K, V), jnp.float32)
    s = api._shape(api.Config(C, "recompute", "rewy", True, 64, one_seq=True), k, z, G, h0)
    return s, k, e, z, G, ks[3]


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("mode", ["none", "scalar", "vector"])
def test_interpret_wu_whole_chunk(mode, monkeypatch):
    """kernels.wu (DEFAULTS "rewy_wu.whole_chunk"): W, U re-formed from the kept inverse as two
    whole-chunk products agree with intra's row-block sums to fp32 rounding (strong decays: the
    factors e^{G} stay ≤ 1), with A kept in fp32 or bf16, its copy in another dtype is A cast;
    the backward takes it under the setting, and the op's gradients stay within the bf16
    thresholds."""
    from pallas_kernels.gpu import kernels

    s, k, e, z, G, _ = _wu_case(mode, 32, 32, 5)
    for a_dtype in (jnp.float32, jnp.bfloat16):
        A, W, U = kernels.intra(s, k, e, z, G, interpret=True, a_dtype=a_dtype)
        rows = kernels.intra(s, k, e, z, G, A=A, interpret=True)
        whole = kernels.wu(s, k, e, z, G, A, interpret=True, a_copy=jnp.float16)
        for x, y in zip(whole[:2], rows, strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert _rel(x, y) < 1e-6, (_rel(x, y), mode, a_dtype)
        assert whole[2].dtype == jnp.float16
        np.testing.assert_array_equal(np.asarray(whole[2]), np.asarray(A.astype(jnp.float16)))
        if a_dtype == jnp.float32:  # the forward's own W, U from the same inverse
            assert _rel(whole[0], W) < 1e-6 and _rel(whole[1], U) < 1e-6
    calls = []
    wu = kernels.wu
    monkeypatch.setattr(kernels, "wu", lambda *a, **kw: calls.append(1) or wu(*a, **kw))
    # the setting names this gate mode only (True / False would take every mode)
    monkeypatch.setitem(kernels.TUNE, "rewy_wu.whole_chunk", (mode,))
    assert [kernels.wu_whole_chunk(m) for m in ("none", "scalar", "vector")] == [
        m == mode for m in ("none", "scalar", "vector")]
    op = {"none": "deltanet", "scalar": "gdn", "vector": "kda"}[mode]
    inp, _, kw = _bf16_case(op, "strong" if mode != "none" else "none", 61, {})
    jax.clear_caches()
    _check(testing.accuracy_report(op, inp, **kw))
    assert calls  # the backward's W, U came from kernels.wu


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("mode", ["none", "scalar", "vector"])
@pytest.mark.parametrize("K,V", [(32, 32), (32, 64), (64, 32)])
def test_interpret_wu_col_tile(mode, K, V, monkeypatch):
    """DEFAULTS "rewy_wu.col_tile": kernels.wu on column tiles (one program per chunk, head and
    tile; K ≠ V leaves the narrower side's last programs idle) gives W, U as whole rows do, to
    rounding, and A's copy bit for bit; with per-row scales of k and v (``rows``) they are the
    products of the exactly scaled rows; a width that does not divide K and V is refused."""
    from pallas_kernels.gpu import kernels

    s, k, e, z, G, key = _wu_case(mode, K, V, 11)
    B, T, H = k.shape[:3]
    (A,) = kernels.intra(s, k, e, z, G, interpret=True, wu=False)
    outs = {}
    for tile in (0, 16):
        monkeypatch.setitem(kernels.TUNE, "rewy_wu.col_tile", tile)
        outs[tile] = kernels.wu(s, k, e, z, G, A, interpret=True,
                                dtypes=(jnp.bfloat16, jnp.float32), a_copy=jnp.bfloat16)
    assert [x.shape for x in outs[16]] == [(B, T, H, K), (B, T, H, V), A.shape]
    for x, y in zip(outs[16], outs[0], strict=True):
        assert x.dtype == y.dtype
        # the same products; a narrower matmul may sum in another order (XLA:CPU here)
        assert _rel(x, y) < 1e-5, (_rel(x, y), mode, K, V)
    np.testing.assert_array_equal(np.asarray(outs[16][2]), np.asarray(outs[0][2]))
    assert float(jnp.abs(outs[16][0].astype(jnp.float32)).max()) > 0  # not an empty buffer
    # per-row scales (forward.row_scaled_ez): from k, v and β the products of exact β ⊙ k, β ⊙ v
    beta = jax.random.uniform(key, (B, T, H), jnp.float32, 0.0, 2.0)
    v = z
    exact = (beta[..., None] * k.astype(jnp.float32), beta[..., None] * v.astype(jnp.float32))
    for tile in (0, 16):
        monkeypatch.setitem(kernels.TUNE, "rewy_wu.col_tile", tile)
        got = kernels.wu(s, k, k, v, G, A, interpret=True, rows=(beta, 0.5 * beta))
        want = kernels.wu(s, k, exact[0], 0.5 * exact[1], G, A, interpret=True)
        for x, y in zip(got, want, strict=True):
            assert _rel(x, y) < 1e-6, (_rel(x, y), tile, mode)
    monkeypatch.setitem(kernels.TUNE, "rewy_wu.col_tile", 24)
    with pytest.raises(ValueError, match="rewy_wu.col_tile 24 must divide"):
        kernels.wu(s, k, e, z, G, A, interpret=True)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {"n_seqs": 2}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "normal", {})])
def test_interpret_split_wu(op, decay, kw, small_tiles, monkeypatch):
    """rewy_intra.split_wu: the forward's intra forms only the inverse and a second launch W, U
    (and the backward's bf16 copy of A) — the launches really split, the outputs and every
    gradient agree with the one-launch intra to rounding and stay within the bf16 thresholds
    (packed sequences, strong decays, both policies, all gate modes)."""
    from pallas_kernels.gpu import kernels

    inp, cts, kw = _bf16_case(op, decay, 67, kw)
    launches = []
    intra, wu = kernels.intra, kernels.wu
    monkeypatch.setattr(kernels, "intra", lambda *a, **k: launches.append(
        "A" if k.get("wu", True) is False else "rows" if k.get("A") is not None else "intra")
        or intra(*a, **k))
    monkeypatch.setattr(kernels, "wu", lambda *a, **k: launches.append(
        "wu" if k.get("a_copy") is None else "wu+A") or wu(*a, **k))
    runs = []
    mode = {"deltanet": "none", "gdn": "scalar"}.get(op, "vector")
    # True / False, or the gate modes it applies to: this op's mode alone, or another one's
    for split, setting in ((False, tuple({"none", "scalar", "vector"} - {mode})), (True, (mode,))):
        monkeypatch.setitem(kernels.TUNE, "rewy_intra.split_wu", setting)
        assert kernels.split_wu(mode) == split
        jax.clear_caches()  # the setting is read when the kernels are traced
        launches.clear()
        runs.append(testing.loss_and_grads(op, inp, cts, **kw))
        assert ({"A", "wu+A"} <= set(launches)) == split, launches
        assert ("intra" in launches) != split, launches
    for x, y in zip(jax.tree_util.tree_leaves(runs[1]), jax.tree_util.tree_leaves(runs[0]),
                    strict=True):
        assert _rel(x, y) < 1e-3, (_rel(x, y), op)
    _check(testing.accuracy_report(op, inp, **kw))


def test_tf32_emulation(monkeypatch):
    """blocks.TF32_EMULATION (interpret_accuracy --tf32): fp32 operands keep 10 mantissa bits —
    truncated, or rounded to nearest (ties away) — 16-bit operands and None leave dots exact."""
    from pallas_kernels.gpu import blocks

    x = jnp.array([1 + 2.0 ** -10, 1 + 2.0 ** -11, 1 + 2.0 ** -12, -(1 + 3 * 2.0 ** -12)],
                  jnp.float32)
    want = {"truncate": [1 + 2.0 ** -10, 1, 1, -1], "round": [1 + 2.0 ** -10, 1 + 2.0 ** -10, 1,
                                                                -(1 + 2.0 ** -10)]}
    for mode, w in want.items():
        monkeypatch.setattr(blocks, "TF32_EMULATION", mode)
        np.testing.assert_array_equal(np.asarray(blocks._as_tf32(x)), np.float32(w))
        xb = x.astype(jnp.bfloat16)
        assert blocks._as_tf32(xb) is xb
        eye = jnp.eye(4, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(blocks.dot(x[None, :], eye, None)[0]),
                                      np.float32(w))
    monkeypatch.setattr(blocks, "TF32_EMULATION", None)
    np.testing.assert_array_equal(np.asarray(blocks.dot(x[None, :], jnp.eye(4), None)[0]),
                                  np.asarray(x))


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
    """rewy_intra.stacked_diag off (the tuning alternative to the stacked inverse): intra's
    joint diagonal loop on the [16, 16] blocks — every output and gradient against the float64
    recurrence (default chunk: four diagonal blocks), each gate kind, strong decays."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "rewy_intra.stacked_diag", False)
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=15)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True,
                                   chunk_size=64, **kw))


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay,kw", [("deltanet", "none", {}),
                                         ("gdn", "strong", {"policy": "save"}),
                                         ("kda", "normal", {"backward": "wy"})])
def test_interpret_one_seq_init(op, decay, kw, small_tiles, monkeypatch):
    """state_pass.one_seq_init: without cu_seqlens the state passes start from h0 and dfin
    instead of selecting them at every chunk, and (state_pass.end_after_loop) store the final
    state and dh0 after their loop instead of under a per-chunk branch — the outputs and every gradient (dh0 and the
    final state's cotangent included) bit for bit as the per-chunk select, both policies, the
    twin pass and the separate passes; a varlen call keeps the per-chunk select."""
    from pallas_kernels.gpu import api, kernels

    inp, cts, kw = _bf16_case(op, decay, 47, kw)
    shapes = []
    shape = api._shape
    monkeypatch.setattr(api, "_shape", lambda *a: shapes.append(shape(*a)) or shapes[-1])
    runs = []
    for init, end_after in ((False, False), (True, False), (True, True)):
        monkeypatch.setitem(kernels.TUNE, "state_pass.one_seq_init", init)
        monkeypatch.setitem(kernels.TUNE, "state_pass.end_after_loop", end_after)
        jax.clear_caches()  # the settings are read when the kernels are traced
        runs.append(testing.loss_and_grads(op, inp, cts, **kw))
    _same_runs(runs[1], runs[0])
    _same_runs(runs[2], runs[0])
    assert shapes and all(s.one_seq for s in shapes)
    shapes.clear()
    varlen, _, _ = _bf16_case(op, decay, 47, dict(kw, n_seqs=2))
    testing.run_op(op, varlen, **kw)
    assert shapes and not any(s.one_seq for s in shapes)


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
@pytest.mark.parametrize("op,decay", [("kda", "strong"), ("gdn", "strong")])
def test_interpret_exp2(op, decay, small_tiles, monkeypatch):
    """kernels.DEFAULTS "exp2": every e^x of the kernels as exp2(x·log2 e) — the fp32 bound
    (1e-4) at strong decays (g down to −50 and −inf: masked −inf exponents still give 0)."""
    from pallas_kernels.gpu import kernels

    monkeypatch.setitem(kernels.TUNE, "exp2", True)
    inp = testing.make_inputs(op, 1, 70, 2, 16, 16, decay=decay, seed=29)
    _check(testing.accuracy_report(op, inp, backend="pallas_gpu", interpret=True, chunk_size=64))


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
    qk_gram (DEFAULTS "rewy_qk_gram.centred", since profile-21) to the centred contraction:
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
    ("kda", 128, 64, jnp.bfloat16, {"_pairgrid": True}, False),
    ("gdn", 256, 256, jnp.float16, {"_chained_inverse": True}, False),
    ("kda", 128, 128, jnp.bfloat16, {"_unroll": True}, False),
    ("gdn2", 64, 64, jnp.bfloat16, {"_vmap": True}, False),
    ("deltanet", 128, 128, jnp.bfloat16, {"_fp32_backward": True, "backward": "wy"}, False),
    ("kda", 64, 128, jnp.bfloat16, {"_fp32_backward": True}, False),
    ("gdn2", 128, 64, jnp.bfloat16, {"_expf": True}, False),
    ("deltanet", 128, 64, jnp.bfloat16, {"_unfused": True}, False),
    ("deltanet", 128, 128, jnp.bfloat16, {"_tune": "qdotl"}, False),
    # narrow keys (DEFAULTS "precision.narrow_keys", which this file's fixture sets off and
    # "_narrow" back on): fp32 kernels for a bf16 call, three-TF32 products
    ("deltanet", 32, 32, jnp.bfloat16, {"_narrow": True}, True),
    ("kda", 16, 32, jnp.bfloat16, {"policy": "save", "_narrow": True}, False),
    ("gdn", 64, 128, jnp.bfloat16, {"_tune": "qdo", "policy": "save"}, True),
    ("kda", 128, 128, jnp.bfloat16, {"_tune": "nopd", "gate_lower_bound": -5.0}, False),
    ("gdn2", 64, 64, jnp.bfloat16, {"_tune": "qdotl"}, True),
    ("kda", 128, 64, jnp.bfloat16, {"_tune": "bwdpd"}, False),
    ("kda", 64, 64, jnp.bfloat16, {"_tune": "bwdpd", "policy": "save"}, True),
    ("kda", 128, 64, jnp.bfloat16, {"_tune": "unfused16"}, False),
    ("kda", 128, 128, jnp.bfloat16, {"_tune": "noqrowf", "gate_lower_bound": -5.0}, False),
    ("gdn2", 64, 64, jnp.bfloat16, {"_tune": "noqrowf"}, True),
    ("gdn", 128, 128, jnp.bfloat16, {"_tune": "w4i+unfusedg"}, False),
    ("deltanet", 128, 128, jnp.bfloat16, {"_tune": "noleafe"}, True),
    ("gdn", 64, 64, jnp.bfloat16, {"_tune": "noleafe"}, False),
    ("kda", 128, 128, jnp.bfloat16, {"_tune": "leafev", "gate_lower_bound": -5.0}, False),
    ("kda", 64, 64, jnp.bfloat16, {"_tune": "leafev"}, True),
    ("gdn", 128, 128, jnp.bfloat16, {"_tune": "leaftf32"}, False),
]
# "_tune": kernel settings of profile_kernels.VARIANTS ("a+b": several) that change what the
# kernels lower to — options off by default, or the forms the defaults replaced


@pytest.mark.skipif(_ON_GPU, reason="the GPU tests above run the real kernels")
@pytest.mark.parametrize("op,K,V,dtype,kw,varlen", LOWER_CASES,
                         ids=[f"{c[0]}-K{c[1]}V{c[2]}-{jnp.dtype(c[3]).name}-" +
                              "-".join(f"{v}" for v in c[4].values()) + ("-varlen" if c[5] else "")
                              for c in LOWER_CASES])
def test_kernels_lower_for_h200(op, K, V, dtype, kw, varlen, monkeypatch):
    from pallas_kernels.gpu import api, kernels

    monkeypatch.setattr(api, "supports", lambda call, chunk_size, interpret: None)  # no GPU here
    kw = dict(kw)
    if "_exact_diag" in kw:  # one exact diagonal method everywhere (a tuning option)
        diag = kw.pop("_exact_diag")
        for k in ("intra", "qk_gram", "bwd_leaf"):
            monkeypatch.setitem(kernels.TUNE, f"rewy_{k}.exact_diag", diag)
    if kw.pop("_pairgrid", False):  # qk_gram's (row, column) block grid (tuning option)
        monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.pairgrid", True)
    if kw.pop("_unroll", False):  # intra's and qk_gram's loops unrolled (tuning option)
        monkeypatch.setitem(kernels.TUNE, "rewy_intra.unroll", True)
        monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.unroll", True)
    if kw.pop("_chained_inverse", False):  # intra's diagonal inverses one after another
        monkeypatch.setitem(kernels.TUNE, "rewy_intra.joint_diag_inverse", False)
    if kw.pop("_unshared", False):  # the shared-decay-factor options off (tuning alternative)
        monkeypatch.setitem(kernels.TUNE, "rewy_intra.gram_from_qk", False)
        monkeypatch.setitem(kernels.TUNE, "rewy_bwd_leaf.shared_decay", False)
    if varlen:  # and the one-program-per-chunk tuning variant of the leaf and qk_gram kernels
        monkeypatch.setitem(kernels.TUNE, "rewy_bwd_leaf.rowgrid", False)
        monkeypatch.setitem(kernels.TUNE, "rewy_qk_gram.rowgrid", False)
    if kw.pop("_fp32_backward", False):  # the backward's stored tensors in fp32 (tuning option)
        monkeypatch.setitem(kernels.TUNE, "backward.low_precision", ())
    if kw.pop("_expf", False):  # e^x as jnp.exp (libdevice's expf; the alternative to exp2)
        monkeypatch.setitem(kernels.TUNE, "exp2", False)
    if kw.pop("_narrow", False):  # the narrow-key policy's default (this file sets it off)
        monkeypatch.setitem(kernels.TUNE, "precision.narrow_keys",
                            kernels.DEFAULTS["precision.narrow_keys"])
    unfused = kw.pop("_unfused", False)  # the forward's output kernel instead of the fused pass
    if unfused:
        monkeypatch.setitem(kernels.TUNE, "fwd_pass.fused_output", False)
    if "_tune" in kw:
        from pallas_kernels.gpu import profile_kernels

        for key, value in profile_kernels.variant_settings(kw.pop("_tune"))[0].items():
            monkeypatch.setitem(kernels.TUNE, key, value)
        unfused = not kernels.fused_output({"deltanet": "none", "gdn": "scalar"}.get(op, "vector"))
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
    # the gate modes whose recompute forward fuses its output (DEFAULTS "fwd_pass.fused_output")
    mode_fuses = kernels.fused_output({"deltanet": "none", "gdn": "scalar"}.get(op, "vector"))
    kernels = {"rewy_intra", "rewy_fwd_pass", "rewy_bwd_local", "rewy_bwd_pass",
               "rewy_bwd_dlam", "rewy_bwd_leaf"} | ({"rewy_qk_gram"} if op in ("kda", "gdn2") else set())
    recompute = kw.get("policy", "recompute") == "recompute"
    if recompute:  # the backward's W, U from the kept A
        kernels.add("rewy_wu")
    # the output kernel unless the recompute forward fuses it into its pass (K ≤ 128)
    fused = recompute and K <= 128 and not unfused and mode_fuses
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


@pytest.mark.skipif(_ON_GPU, reason="CPU smoke test of the profiling script")
def test_profile_script_runs_its_variants():
    """pallas_kernels/gpu/profile_kernels.py (the device-session tool) runs every kernel of a
    variant in interpret mode and leaves the module settings as it found them."""
    from pallas_kernels.gpu import api, kernels, profile_kernels

    before = dict(kernels.TUNE), api.DEFAULT_BV
    rows, grads = profile_kernels.profile("vector", "levels", (1, 64, 1, 16), interpret=True,
                                          reps=1, runs=1)
    assert {"intra", "wu", "qk_gram", "fwd_pass", "output", "bwd_local", "bwd_pass", "bwd_dlam",
            "bwd_leaf", "OP_FWD+BWD (kda)"} <= set(rows)
    assert all(t > 0 for t in rows.values())
    assert (dict(kernels.TUNE), api.DEFAULT_BV) == before
    # a variant that only reorganises work agrees with the base one (the two state passes
    # launched apart instead of the default twin pass, which has its own row); a changed input
    # does not
    rows2, grads2 = profile_kernels.profile("vector", "apart", (1, 64, 1, 16), interpret=True,
                                            reps=1, runs=1)
    assert rows["twin_pass"] > 0 and "twin_pass" not in rows2
    assert profile_kernels.grad_gap(grads2, grads) < 1e-5
    assert profile_kernels.grad_gap(jax.tree_util.tree_map(lambda g: 2 * g, grads), grads) > 0.9


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode twin")
def test_fused_pass_stage_entry(monkeypatch):
    """The forward's fused pass takes its "state_pass.stages" entry by what it reads: "fused_w32"
    for 16-bit inputs with an fp32 W (the default), "fused" with a 16-bit W, "fused_f32" for
    fp32 inputs (more bytes per stage: kept at the stages that have run)."""
    from pallas_kernels.gpu import kernels

    seen = []
    pass_stages = kernels._pass_stages
    monkeypatch.setattr(kernels, "_pass_stages",
                        lambda s, which: seen.append(which) or pass_stages(s, which))
    for dtype, low, want in ((jnp.bfloat16, (), "fused_w32"), (jnp.bfloat16, ("W",), "fused"),
                             (jnp.float32, (), "fused_f32")):
        monkeypatch.setitem(kernels.TUNE, "forward.low_precision", low)
        inp = testing.make_inputs("deltanet", 1, 40, 1, 16, 16, dtype=dtype, seed=3)
        seen.clear()
        jax.clear_caches()
        testing.run_op("deltanet", inp, backend="pallas_gpu", interpret=True, chunk_size=16)
        assert want in seen and not {"fused", "fused_w32", "fused_f32"} - {want} & set(seen), (
            dtype, low, seen)


def test_wide_warps(monkeypatch):
    """DEFAULTS "launch.wide_warps": at K > 128 a kernel takes its "<kernel>:<gate mode>" entry
    before its "<kernel>" one, at K ≤ 128 always WARPS; and the launches get it."""
    from pallas_kernels.gpu import kernels

    def warps(K, mode, kernel):
        return kernels.Shape(1, 64, 1, K, K, 64, 1, mode, None, 64).warps(kernel)

    # the defaults: intra and the backward's wu at 2 warps at K ≤ 128 (wu at 4 for vector
    # gates: WARPS's "<kernel>:<gate mode>" entry), both at 4 at K > 128
    assert kernels.DEFAULTS["launch.wide_warps"] == {"intra": 4, "wu": 4}
    assert warps(128, "none", "intra") == 2 and warps(256, "none", "intra") == 4
    assert warps(128, "none", "wu") == 2 and warps(128, "vector", "wu") == 4
    assert warps(256, "scalar", "wu") == 4
    assert warps(128, "scalar", "intra") == 2 and warps(128, "scalar", "wu") == 2  # profile-22
    assert warps(256, "vector", "fwd_pass") == kernels.WARPS["fwd_pass"]
    monkeypatch.setitem(kernels.TUNE, "launch.wide_warps",
                        {"fwd_pass:vector": 8, "fwd_pass": 2, "output": 8})
    assert warps(256, "vector", "fwd_pass") == 8 and warps(256, "none", "fwd_pass") == 2
    assert warps(128, "vector", "fwd_pass") == kernels.WARPS["fwd_pass"]
    assert warps(256, "scalar", "output") == 8 and warps(256, "none", "intra") == 2
    launched = {}
    call = kernels._call
    monkeypatch.setattr(kernels, "_call", lambda k, **kw: launched.update(
        {kw["name"]: kw["num_warps"]}) or call(k, **kw))
    for K in (128, 256):
        inp = testing.make_inputs("deltanet", 1, 16, 1, K, K, dtype=jnp.bfloat16, seed=1)
        launched.clear()
        jax.clear_caches()
        testing.run_op("deltanet", inp, backend="pallas_gpu", interpret=True, chunk_size=16)
        assert launched["rewy_fwd_pass"] == (2 if K > 128 else kernels.WARPS["fwd_pass"]), launched
        assert launched["rewy_intra"] == 2, launched  # WARPS: no "intra" entry in the TUNE


def test_pass_stages():
    """kernels._pass_stages: the one-sequence passes take DEFAULTS "state_pass.stages" (vector
    gates' unfused forward pass its own entry, the fused pass reading an fp32 W another), varlen
    calls 3 (the twin pass 1), K = 256 one; and every profile variant that sets the stages names
    every pass."""
    from pallas_kernels.gpu import kernels, profile_kernels

    def stages(K, mode, one_seq, which):
        return kernels._pass_stages(
            kernels.Shape(1, 64, 1, K, K, 64, 2, mode, None, 64, one_seq=one_seq), which)

    want = kernels.DEFAULTS["state_pass.stages"]
    for which in ("fwd", "fused", "bwd", "twin"):
        assert stages(128, "none", True, which) == want[which]
        assert stages(128, "none", False, which) == (1 if which == "twin" else 3)
    assert stages(128, "vector", True, "fwd") == want["fwd_vector"]
    assert stages(128, "scalar", True, "fwd") == want["fwd"]
    assert stages(128, "none", True, "fused_w32") == want["fused_w32"]
    assert stages(128, "none", True, "fused_f32") == want["fused_f32"] <= 2  # fp32 inputs
    assert stages(128, "none", False, "fused_w32") == 3
    assert stages(256, "none", True, "fused_w32") == 1
    # K = 256: one stage unless "state_pass.wide_stages" names the pass (one-sequence calls)
    wide = kernels.DEFAULTS["state_pass.wide_stages"]
    for which in ("fwd", "native", "bwd"):
        assert stages(256, "none", True, which) == wide.get(which, 1)
        assert stages(256, "none", False, which) == 1
    # a pass with native products takes the forward's unfused-pass entry at K ≤ 128
    assert stages(128, "none", True, "native") == want["fwd"]
    assert stages(128, "vector", True, "native") == want["fwd_vector"]
    for name, (tune, *_) in profile_kernels.VARIANTS.items():
        if "state_pass.stages" in tune:
            assert set(tune["state_pass.stages"]) == set(want), name


def test_variants_name_known_settings():
    """Every variant of profile_kernels / trace_op sets kernel settings that exist (DEFAULTS keys
    or "<kernel>.warps" / ".stages"), so a misspelt one fails here and not on the GPU machine,
    after its start; and the variants the device plan in PERF.md names are defined."""
    import re
    from pathlib import Path

    from pallas_kernels.gpu import kernels, profile_kernels

    for name, (tune, *_) in profile_kernels.VARIANTS.items():
        for key in tune:
            assert key in kernels.DEFAULTS or key.endswith((".warps", ".stages")), (name, key)
    perf = (Path(kernels.__file__).parent / "PERF.md").read_text()
    plan = perf[perf.index("## Next session"):]
    # --variants a,b | --variants "op:a,b op2:c+d" (trace_op.parse_plan's forms)
    from pallas_kernels.gpu import trace_op

    named = {v for m in re.finditer(r'--variants (?:"([^"]+)"|([\w,+]+))', plan)
             for _, vs in trace_op.parse_plan("x", m.group(1) or m.group(2)) for v in vs}
    assert len(named) >= 15, named
    for v in named:  # raises on an unknown name or two parts that disagree
        profile_kernels.variant_settings(v)


def test_parse_tune():
    """kernels.parse_tune: the tooling's key=value settings, and clear errors."""
    from pallas_kernels.gpu import kernels

    assert kernels.parse_tune("exp2=true") == ("exp2", True)
    assert kernels.parse_tune("rewy_bwd_pass.warps=4") == ("rewy_bwd_pass.warps", 4)
    assert kernels.parse_tune("rewy_qk_gram.exact_diag=outer") == ("rewy_qk_gram.exact_diag",
                                                                    "outer")
    assert kernels.parse_tune("backward.low_precision=S0,dS") == ("backward.low_precision",
                                                                   ("S0", "dS"))
    assert kernels.parse_tune("backward.low_precision=,") == ("backward.low_precision", ())
    with pytest.raises(ValueError, match="key=value"):
        kernels.parse_tune("exp2")
    with pytest.raises(ValueError, match="unknown tuning key 'exp3'"):
        kernels.parse_tune("exp3=true")


def test_leaf_tile_choice():
    """bwd_leaf's key tile and warps (kernels.Shape, profile-11, profile-15): tiles of 64 up to
    V = 128 and 32 above, except vector gates at K = V = 128 (32); no or vector gates run tiles
    of 32 at 4 warps, everything else 8; an explicit tile is kept (capped at K)."""
    from pallas_kernels.gpu import kernels

    def leaf(mode, K, V, BK=None):
        s = kernels.Shape(1, 64, 1, K, V, 64, 2, mode, None, 64, BK)
        return s.BK, s.leaf_warps

    w = kernels.WARPS["bwd_leaf"]
    assert leaf("vector", 128, 128) == (32, 4)
    assert leaf("vector", 64, 64) == (64, w)
    assert leaf("vector", 256, 256) == (32, 4)
    assert leaf("none", 256, 256) == (32, 4)
    assert leaf("none", 128, 128) == (64, w)
    assert leaf("scalar", 128, 256) == (32, w)
    assert leaf("scalar", 256, 256) == (32, w)
    assert leaf("vector", 128, 128, BK=64) == (64, w)
    assert leaf("none", 16, 32, BK=64) == (16, w)


@pytest.mark.skipif(_ON_GPU, reason="CPU smoke test of the tracing script")
def test_trace_script_sums_stream_kernels(tmp_path, monkeypatch):
    """pallas_kernels/gpu/trace_op.py (the device-session tool): on a GPU-like trace it sums
    the stream threads only (the XLA-op spans repeat the same time); it runs end to end on
    CPU in interpret mode."""
    import gzip
    import json

    from pallas_kernels.gpu import kernels, trace_op

    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10, "args": {"name": "Stream #13"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 11, "args": {"name": "XLA Ops"}},
          {"ph": "X", "pid": 1, "tid": 10, "name": "rewy_intra", "dur": 400.0},
          {"ph": "X", "pid": 1, "tid": 10, "name": "rewy_intra", "dur": 400.0},
          {"ph": "X", "pid": 1, "tid": 10, "name": "loop_fusion", "dur": 100.0},
          {"ph": "X", "pid": 1, "tid": 11, "name": "custom-call.1", "dur": 900.0},
          {"ph": "X", "pid": 2, "tid": 5, "name": "PjitFunction", "dur": 5000.0}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": ev}, fh)
    times, tracks = trace_op.device_times(str(path), iters=2)
    assert times == {"rewy_intra": 0.4, "loop_fusion": 0.05} and tracks == "Stream #13"

    text, times = trace_op.trace_op("gdn", (1, 64, 1, 16), iters=1, out_dir=str(tmp_path),
                                    interpret=True)
    assert (tmp_path / "trace-gdn.txt").read_text().startswith("gdn ") and times
    # variants side by side: each kernel's device ms under each variant, kernels summed apart
    # from the glue, and the wall time per call
    table = trace_op.compare_table("gdn", (1, 64, 1, 16), {
        "base": {"rewy_wu": 0.1, "rewy_intra": 0.2, "fusion": 0.05, "WALL": 0.5},
        "wut": {"rewy_wu": 0.07, "rewy_intra": 0.2, "WALL": 0.45}})
    assert "| rewy_wu | 0.1000 | 0.0700 |" in table
    assert "| our kernels | 0.3000 | 0.2700 |" in table
    assert "| XLA glue | 0.0500 | 0.0000 |" in table and "| wall per call | 0.5000 | 0.4500 |" in table
    saved = dict(kernels.TUNE)
    from pallas_kernels.gpu.profile_kernels import with_variant
    assert with_variant("wut", lambda: kernels.setting("rewy_wu.col_tile")) == 64
    assert kernels.TUNE == saved
    # one process for a device call's plan: per-op variant lists, all lowered, then compiled in
    # threads, then traced; each variant's settings reach its own lowering (unfused: one more
    # forward kernel), a failing variant is reported and the rest still run
    assert trace_op.parse_plan("gdn,kda", "a,b") == [("gdn", ["a", "b"]), ("kda", ["a", "b"])]
    assert trace_op.parse_plan("x", "deltanet:a,b kda:c") == [("deltanet", ["a", "b"]),
                                                                ("kda", ["c"])]
    with pytest.raises(ValueError, match="OP:VARIANT"):
        trace_op.parse_plan("x", "deltanet: kda:c")
    launches, logs, kernels_of = _record_launches(monkeypatch), [], []
    real_lower = trace_op.lower_op

    def lower(*a):
        n = len(launches)
        out = real_lower(*a)
        kernels_of.append({x["name"] for x in launches[n:]})
        return out

    monkeypatch.setattr(trace_op, "lower_op", lower)
    res = trace_op.trace_variants([("deltanet", ["base", "nonesuch", "unfused"])],
                                  (1, 64, 1, 16), iters=1, out_dir=str(tmp_path),
                                  interpret=True, wall_iters=1, workers=2, log=logs.append)
    assert set(res["deltanet"]) == {"base", "unfused"} and res["deltanet"]["unfused"]["WALL"] > 0
    assert any("nonesuch ERROR lowering KeyError" in m for m in logs), logs
    assert any(m.startswith("lowered 2 variants") for m in logs), logs
    assert kernels_of[1] - kernels_of[0] == {"rewy_output"}, kernels_of
    assert kernels.TUNE == saved


def test_variants_combine():
    """profile_kernels.variant_settings("a+b"): two variants' settings together (a trace's
    winners for different kernels, or a benchmark's --variant); a key set two ways is an error."""
    from pallas_kernels.gpu import profile_kernels as pk

    tune, BV, BVs, BK = pk.variant_settings("qdo+bltl+predecayed")
    assert tune == {"backward.chunk_qdo": True, "rewy_bwd_local.tile_loop": True,
                    "fwd_pass.predecayed": True} and (BV, BVs, BK) == pk.VARIANTS["qdo"][1:]
    assert pk.variant_settings("qdo+qdotl")[0] == pk.VARIANTS["qdotl"][0]  # agreeing keys
    with pytest.raises(ValueError, match="fwd_pass.predecayed"):
        pk.variant_settings("predecayed+pd32")
    with pytest.raises(KeyError, match="nonesuch"):
        pk.variant_settings("qdo+nonesuch")
    assert pk.is_bounded("qdo+centred") and not pk.is_bounded("qdo+bltl")


@pytest.mark.skipif(_ON_GPU, reason="CPU check of the lowering tool")
def test_resource_report_plan_records_each_kernels_launch(tmp_path):
    """resource_report.py plan: every (op, variant) of a device plan lowered for CUDA on CPU,
    each kernel's Triton IR written with the warps and stages it launches with (what ptxas then
    compiles it with); a variant that cannot lower is reported; the jax patches are undone."""
    import contextlib
    import io
    import json

    from pallas_kernels.gpu import api, kernels, resource_report

    supports = api.supports
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        resource_report.plan(str(tmp_path), "deltanet:base,unfused,nonesuch", "1x128x2x32")
    assert "deltanet nonesuch LOWERING FAILED KeyError" in log.getvalue()
    launches = json.loads((tmp_path / "launches.json").read_text())
    files = {p.name for p in tmp_path.glob("*.ttir")}
    assert files == set(launches) and files
    leaf_warps = kernels.Shape(1, 128, 2, 32, 32, 64, 2, "none", None, 64, None).leaf_warps
    assert launches["deltanet__base__rewy_bwd_leaf__1.ttir"][0] == leaf_warps
    assert launches["deltanet__base__rewy_intra__1.ttir"][0] == kernels.WARPS["intra"]
    assert ("deltanet__unfused__rewy_output__1.ttir" in files
            and not any("base__rewy_output" in f for f in files))
    assert api.supports is supports
