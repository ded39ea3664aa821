"""The input contract (docs/input-contract.md): gate domains, the checked mode under jit, FLA's
``use_qk_l2norm_in_kernel`` spelling, and where a NaN in one token can reach."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import rewy_jax as rj
from rewy_jax import testing

B, T, H, K, V = 2, 45, 2, 16, 8

# The four chunked ops and their decode twins, with the gate arguments they take.
CHUNK_OPS = {
    "deltanet": (rj.chunk_delta_rule, ("beta",)),
    "gdn": (rj.chunk_gated_delta_rule, ("g", "beta")),
    "kda": (rj.chunk_kda, ("g", "beta")),
    "gdn2": (rj.chunk_gdn2, ("g", "b", "w")),
}
RECURRENT_OPS = {
    "deltanet": rj.fused_recurrent_delta_rule,
    "gdn": rj.fused_recurrent_gated_delta_rule,
    "kda": rj.fused_recurrent_kda,
    "gdn2": rj.fused_recurrent_gdn2,
}


@pytest.fixture(scope="module")
def inputs():
    return {op: testing.make_inputs(op, B, T, H, K, V, seed=i, initial_state=False)
            for i, op in enumerate(CHUNK_OPS)}


def _call(op, d, fn=None, **kw):
    f, gates = CHUNK_OPS[op]
    f = fn or f
    kw.setdefault("use_qk_l2norm", True)
    if fn is None:
        kw.setdefault("chunk_size", 16)
        kw.setdefault("backend", "xla")
    return f(d["q"], d["k"], d["v"], *[d[n] for n in gates], **kw)


# ----------------------------------------------------------------------------------------------
# Item 2: gates outside their domain
# ----------------------------------------------------------------------------------------------
# (op, gate, bad value, the range the message must name)
BAD_GATES = [
    ("gdn", "g", 0.5, r"g must lie in \[-inf, 0\]"),
    ("kda", "g", 5.0, r"g must lie in \[-inf, 0\]"),
    ("gdn2", "g", 1e-3, r"g must lie in \[-inf, 0\]"),
    ("deltanet", "beta", 2.5, r"beta must lie in \[0, 2\]"),
    ("gdn", "beta", -0.1, r"beta must lie in \[0, 2\]"),
    ("kda", "beta", 3.0, r"beta must lie in \[0, 2\]"),
    ("gdn2", "b", -1.0, r"b must lie in \[0, 2\]"),
    ("gdn2", "w", 2.01, r"w must lie in \[0, 2\]"),
]


def _with(d, name, value, at=(1, 7, 0)):
    return dict(d, **{name: d[name].at[at].set(value)})


@pytest.mark.parametrize("op,name,value,pattern", BAD_GATES)
def test_concrete_gate_outside_domain_raises(inputs, op, name, value, pattern):
    bad = _with(inputs[op], name, value)
    with pytest.raises(ValueError, match=pattern):
        _call(op, bad)
    with pytest.raises(ValueError, match=pattern):  # the decode form checks the same
        _call(op, bad, fn=RECURRENT_OPS[op])


def test_gate_error_names_the_offending_value(inputs):
    bad = _with(inputs["gdn"], "g", 0.5)
    with pytest.raises(ValueError, match=r"got values in \[.*, 0\.5\]"):
        _call("gdn", bad)


@pytest.mark.parametrize("op", sorted(CHUNK_OPS))
def test_gates_at_domain_edges_pass(inputs, op):
    """g = 0 and −inf, β/b/w = 0 and 2 are inside the domain; a NaN gate is not a domain error
    (it propagates, see test_nan_* below), and does not hide a bad value beside it."""
    d = dict(inputs[op])
    for name in CHUNK_OPS[op][1]:
        lo, hi = (-jnp.inf, 0.0) if name == "g" else (0.0, 2.0)
        d[name] = d[name].at[0, 0].set(lo).at[0, 1].set(hi)
    o, _ = _call(op, d)
    assert bool(jnp.all(jnp.isfinite(o)))
    name = CHUNK_OPS[op][1][0]
    nan = _with(d, name, jnp.nan, at=(0, 2))
    _call(op, nan)  # no error
    with pytest.raises(ValueError, match=f"{name} must lie in"):
        _call(op, _with(nan, name, 9.0, at=(0, 3)))


def test_traced_gates_are_trusted_without_checked_mode(inputs):
    d = inputs["gdn"]
    f = jax.jit(lambda g: _call("gdn", dict(d, g=g))[0])
    o = f(d["g"].at[1, 7, 0].set(0.5))  # documented contract: no check under jit
    assert o.shape == d["v"].shape


@pytest.mark.parametrize("op,name,value,pattern", BAD_GATES)
def test_checked_mode_reports_traced_gates(inputs, op, name, value, pattern):
    d = inputs[op]
    f = jax.jit(lambda x: _call(op, dict(d, **{name: x}), checked=True)[0])
    err, _ = checkify.checkify(f)(d[name].at[1, 7, 0].set(value))
    assert err.get() is not None and "must lie in" in err.get(), err.get()
    with pytest.raises(Exception, match=pattern):
        err.throw()
    err, o = checkify.checkify(f)(d[name])  # in the domain: no error, the same result
    assert err.get() is None
    np.testing.assert_allclose(np.asarray(o), np.asarray(_call(op, d, checked=True)[0]),
                               rtol=1e-5, atol=1e-5)


def test_checked_mode_without_checkify_says_so(inputs):
    d = inputs["gdn"]
    f = jax.jit(lambda g: _call("gdn", dict(d, g=g), checked=True)[0])
    with pytest.raises(ValueError, match="checkify"):
        f(d["g"])


def test_checked_mode_gate_lower_bound(inputs):
    d = inputs["kda"]
    f = jax.jit(lambda g: _call("kda", dict(d, g=g), checked=True, gate_lower_bound=-5.0)[0])
    err, _ = checkify.checkify(f)(jnp.maximum(d["g"], -5.0).at[0, 3, 0, 0].set(-6.0))
    assert err.get() is not None and "gate_lower_bound=-5.0" in err.get()
    err, _ = checkify.checkify(f)(jnp.maximum(d["g"], -5.0))
    assert err.get() is None


@pytest.mark.parametrize("cu,pattern", [
    ([0, 20, 20, 45], "strictly increasing"),
    ([0, 20, 44], "must end at T = 45"),
    ([1, 20, 45], "must start at 0"),
])
def test_checked_mode_traced_cu_seqlens(inputs, cu, pattern):
    d = {n: x[:1] for n, x in inputs["gdn"].items()}
    f = jax.jit(lambda c: _call("gdn", d, cu_seqlens=c, checked=True)[0])
    err, _ = checkify.checkify(f)(jnp.asarray(cu, jnp.int32))
    assert err.get() is not None and pattern in err.get(), err.get()
    err, _ = checkify.checkify(f)(jnp.asarray([0, 20, 45], jnp.int32))
    assert err.get() is None


def test_checked_must_be_bool(inputs):
    with pytest.raises(TypeError, match="checked must be a Python bool"):
        _call("gdn", inputs["gdn"], checked="yes")


# ----------------------------------------------------------------------------------------------
# Item 5: FLA's spelling use_qk_l2norm_in_kernel
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(CHUNK_OPS))
def test_use_qk_l2norm_in_kernel_alias(inputs, op):
    d = inputs[op]
    ours = _call(op, d, use_qk_l2norm=True)[0]
    fla = _call(op, d, use_qk_l2norm=None, use_qk_l2norm_in_kernel=True)[0]
    plain = _call(op, d, use_qk_l2norm=None)[0]
    np.testing.assert_array_equal(np.asarray(fla), np.asarray(ours))
    assert not np.allclose(np.asarray(fla), np.asarray(plain))  # the alias does normalise
    both = _call(op, d, use_qk_l2norm=True, use_qk_l2norm_in_kernel=True)[0]
    np.testing.assert_array_equal(np.asarray(both), np.asarray(ours))
    np.testing.assert_array_equal(
        np.asarray(_call(op, d, use_qk_l2norm=None, use_qk_l2norm_in_kernel=False)[0]),
        np.asarray(plain))
    rec = _call(op, d, fn=RECURRENT_OPS[op], use_qk_l2norm=None, use_qk_l2norm_in_kernel=True)[0]
    np.testing.assert_allclose(np.asarray(rec), np.asarray(ours), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", sorted(CHUNK_OPS))
def test_use_qk_l2norm_disagreeing_spellings_raise(inputs, op):
    with pytest.raises(ValueError, match="use_qk_l2norm=True and use_qk_l2norm_in_kernel=False"):
        _call(op, inputs[op], use_qk_l2norm=True, use_qk_l2norm_in_kernel=False)
    with pytest.raises(ValueError, match="disagree"):
        _call(op, inputs[op], fn=RECURRENT_OPS[op], use_qk_l2norm=False,
              use_qk_l2norm_in_kernel=True)


# ----------------------------------------------------------------------------------------------
# Item 4: a NaN in one token stays in its own sequence / batch row
# ----------------------------------------------------------------------------------------------
BACKENDS = [dict(backend="xla"), dict(backend="pallas_gpu", interpret=True),
            dict(backend="pallas_tpu", interpret=True)]
_BID = ["xla", "pallas_gpu", "pallas_tpu"]
NAN_C = 16


def _nan_case(op, packed):
    """Inputs for the NaN tests: three packed sequences [0, 21), [21, 60), [60, 64) (B = 1), or
    a batch of two rows."""
    Tn = 64
    if packed:
        d = testing.make_inputs(op, 1, Tn, 1, K, K, seed=7, n_seqs=3)
        d["cu_seqlens"] = jnp.asarray([0, 21, 60, Tn], jnp.int32)  # t0 = 45 in sequence 1
    else:
        d = testing.make_inputs(op, 2, Tn, 1, K, K, seed=7)
    return d


@pytest.mark.parametrize("kw", BACKENDS, ids=_BID)
@pytest.mark.parametrize("packed", [True, False], ids=["cu_seqlens", "batch"])
@pytest.mark.parametrize("op,name", [("gdn", "k"), ("kda", "g"), ("gdn2", "b")])
def test_nan_stays_in_its_sequence(op, name, packed, kw):
    """A NaN at token t0 (in k, g or b) makes o NaN at most from the start of t0's chunk (C =
    16; sequences start on chunk boundaries) to the end of t0's sequence; every other sequence
    (cu_seqlens) or batch row keeps its exact NaN-free output, final state and input
    gradients."""
    d = _nan_case(op, packed)
    row, t0 = (0, 45) if packed else (1, 30)
    bad = dict(d)
    at = (row, t0, 0) if d[name].ndim == 3 else (row, t0, 0, 0)
    bad[name] = d[name].at[at].set(jnp.nan)
    ct = jax.random.normal(jax.random.key(0), d["v"].shape, jnp.float32)

    def run(x):
        f, gates = CHUNK_OPS[op]
        extra = {n: x[n] for n in ("initial_state", "cu_seqlens") if n in x}

        def loss(k, g0):
            y = dict(x, k=k, **{gates[0]: g0})
            o, s = f(y["q"], y["k"], y["v"], *[y[n] for n in gates], chunk_size=NAN_C,
                     output_final_state=True, **extra, **kw)
            return jnp.sum(o * ct), (o, s)

        (_, (o, s)), (dk, dg0) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            x["k"], x[gates[0]])
        return o, s, dk, dg0

    o_ref, s_ref, dk_ref, dg_ref = map(np.asarray, run(d))
    o, s, dk, dg0 = map(np.asarray, run(bad))
    if packed:  # token ranges of the other sequences; the NaN sequence is 1 = [21, 60)
        clean_t = np.r_[0:21, 60:64]
        clean_seq = [0, 2]
        first_clean = np.r_[21:21 + (t0 - 21) // NAN_C * NAN_C]  # seq 1's chunks before t0's
        o_row, s_sel = o[0], s[clean_seq]
        ref_row, ref_sel = o_ref[0], s_ref[clean_seq]
        dk_c, dk_r = dk[0, clean_t], dk_ref[0, clean_t]
        dg_c, dg_r = dg0[0, clean_t], dg_ref[0, clean_t]
    else:
        clean_t = np.r_[0:64]
        first_clean = np.r_[0:t0 // NAN_C * NAN_C]
        o_row, s_sel = o[1 - row], s[1 - row]
        ref_row, ref_sel = o_ref[1 - row], s_ref[1 - row]
        dk_c, dk_r = dk[1 - row], dk_ref[1 - row]
        dg_c, dg_r = dg0[1 - row], dg_ref[1 - row]
    # Other sequences / rows: bit-identical to the NaN-free run (no NaN, nothing mixed in).
    np.testing.assert_array_equal(o_row[clean_t], ref_row[clean_t])
    np.testing.assert_array_equal(s_sel, ref_sel)
    assert np.all(np.isfinite(dk_c)) and np.all(np.isfinite(dg_c))
    np.testing.assert_allclose(dk_c, dk_r, rtol=0, atol=0)
    np.testing.assert_allclose(dg_c, dg_r, rtol=0, atol=0)
    # In the NaN's own sequence/row: the chunks before t0's chunk are untouched too (the
    # documented reach: from the start of t0's chunk on).
    own = o[0] if packed else o[row]
    own_ref = o_ref[0] if packed else o_ref[row]
    np.testing.assert_array_equal(own[first_clean], own_ref[first_clean])
    assert np.isnan(own[t0]).any()
