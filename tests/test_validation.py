"""Every argument check of rewy_jax.validate, through the public ops: each mistake raises with a
message that names the offending argument (asserted with ``match``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rewy_jax as rj
from rewy_jax import testing

B, T, H, K, V = 2, 45, 2, 16, 8  # the geometry most op tests use (shared compilations)


@pytest.fixture(scope="module")
def gdn():
    return testing.make_inputs("gdn", B, T, H, K, V, seed=0)


@pytest.fixture(scope="module")
def kda():
    return testing.make_inputs("kda", B, T, H, K, V, seed=1)


@pytest.fixture(scope="module")
def gdn2():
    return testing.make_inputs("gdn2", B, T, H, K, V, seed=2)


def _gdn(d, **over):
    args = {n: d[n] for n in ("q", "k", "v", "g", "beta")}
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    kw.setdefault("backend", "xla")
    kw.setdefault("chunk_size", 16)
    return rj.chunk_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"], **kw)


# ----------------------------------------------------------------------------------------------
# q, k, v
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_qkv_must_be_rank4(gdn, name):
    with pytest.raises(ValueError, match=rf"^{name} must have shape \[B, T, H, D\]"):
        _gdn(gdn, **{name: gdn[name][0]})


def test_k_must_match_q(gdn):
    with pytest.raises(ValueError, match=r"^k must have the shape of q"):
        _gdn(gdn, k=gdn["k"][:, :, :, :4])
    with pytest.raises(ValueError, match=r"^k must have the shape of q"):
        _gdn(gdn, k=gdn["k"][:1])


@pytest.mark.parametrize("axis,what", [(0, "B"), (1, "T"), (2, "H")])
def test_v_must_match_q_in_B_T_H(gdn, axis, what):
    v = jnp.take(gdn["v"], jnp.arange(1), axis=axis)
    with pytest.raises(ValueError, match=r"^v must have shape \[B, T, H, V\] with B, T, H"):
        _gdn(gdn, v=v)


def test_v_may_have_a_different_feature_dim(gdn):
    o, _ = _gdn(gdn, v=jnp.ones((B, T, H, 3), jnp.float32))  # V ≠ K is allowed
    assert o.shape == (B, T, H, 3)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_qkv_must_be_floating(gdn, name, dtype):
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point array .* got dtype"):
        _gdn(gdn, **{name: gdn[name].astype(dtype)})


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_qkv_none_is_named(gdn, name):
    with pytest.raises(ValueError, match=rf"^{name} is required"):
        _gdn(gdn, **{name: None})


def test_empty_sequence_rejected(gdn):
    with pytest.raises(ValueError, match=r"sequence length T .* must be ≥ 1"):
        _gdn({n: x[:, :0] for n, x in gdn.items()})


# ----------------------------------------------------------------------------------------------
# Gates: shapes, rank (scalar vs vector), dtype, missing
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["g", "beta"])
@pytest.mark.parametrize("bad", ["batch", "time", "heads"])
def test_scalar_gates_must_match_q(gdn, name, bad):
    x = gdn[name]
    x = {"batch": x[:1], "time": x[:, :-1], "heads": x[:, :, :1]}[bad]
    with pytest.raises(ValueError, match=rf"^{name} must have shape \[B, T, H\] = \({B}, {T}, {H}\)"):
        _gdn(gdn, **{name: x})


def test_gdn_gate_must_be_scalar_per_head(gdn, kda):
    """GDN takes g [B, T, H]; a KDA-style vector gate [B, T, H, K] is a rank error."""
    with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H\]"):
        _gdn(gdn, g=kda["g"])


def test_kda_gate_must_be_vector(gdn, kda):
    """KDA takes g [B, T, H, K]; a GDN-style scalar gate is a rank error."""
    with pytest.raises(ValueError, match=rf"^g must have shape \[B, T, H, K\] = \({B}, {T}, {H}, {K}\)"):
        rj.chunk_kda(kda["q"], kda["k"], kda["v"], gdn["g"], kda["beta"], backend="xla")
    with pytest.raises(ValueError, match=r"^beta must have shape \[B, T, H\]"):
        rj.chunk_kda(kda["q"], kda["k"], kda["v"], kda["g"], kda["g"], backend="xla")


@pytest.mark.parametrize("name,shape,pattern", [
    ("g", (B, T, H), r"^g must have shape \[B, T, H, K\]"),
    ("g", (B, T, H, K + 1), r"^g must have shape \[B, T, H, K\]"),
    ("b", (B, T, H), r"^b must have shape \[B, T, H, K\]"),
    ("b", (B, T, H, V), r"^b must have shape \[B, T, H, K\]"),
    ("w", (B, T, H, K), rf"^w must have shape \[B, T, H, V\] = \({B}, {T}, {H}, {V}\)"),
    ("w", (B, T - 1, H, V), r"^w must have shape \[B, T, H, V\]"),
])
def test_gdn2_gate_shapes(gdn2, name, shape, pattern):
    d = dict(gdn2, **{name: jnp.zeros(shape, jnp.float32)})
    with pytest.raises(ValueError, match=pattern):
        rj.chunk_gdn2(*(d[n] for n in ("q", "k", "v", "g", "b", "w")), backend="xla")


def test_deltanet_beta_shape(gdn):
    with pytest.raises(ValueError, match=r"^beta must have shape \[B, T, H\]"):
        rj.chunk_delta_rule(gdn["q"], gdn["k"], gdn["v"], gdn["beta"][..., None])


@pytest.mark.parametrize("name", ["g", "beta"])
def test_gates_must_be_floating(gdn, name):
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point array"):
        _gdn(gdn, **{name: gdn[name].astype(jnp.int32)})


@pytest.mark.parametrize("name", ["g", "beta"])
def test_missing_gate_is_named(gdn, name):
    with pytest.raises(ValueError, match=rf"^{name} is required"):
        _gdn(gdn, **{name: None})


def test_gate_dtypes_may_differ_from_q(gdn):
    o, _ = _gdn(gdn, g=gdn["g"].astype(jnp.bfloat16), beta=gdn["beta"].astype(jnp.float16))
    assert o.dtype == jnp.float32 and np.isfinite(np.asarray(o)).all()


# ----------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [0, 8, 15, 24, 48, 100, 16.0, "64", None, -16])
def test_chunk_size_power_of_two_at_least_16(gdn, chunk_size):
    with pytest.raises(ValueError, match=r"^chunk_size must be a power of two ≥ 16"):
        _gdn(gdn, chunk_size=chunk_size)


def test_chunk_size_numpy_int_accepted(gdn):
    o, _ = _gdn(gdn, chunk_size=np.int64(32))
    assert o.shape == (B, T, H, V)


@pytest.mark.parametrize("policy", ["Save", "remat", None, ""])
def test_bad_policy(gdn, policy):
    with pytest.raises(ValueError, match=r"^policy must be one of \('recompute', 'save'\)"):
        _gdn(gdn, policy=policy)


@pytest.mark.parametrize("backward", ["ReWY", "seven", None])
def test_bad_backward(gdn, backward):
    with pytest.raises(ValueError, match=r"^backward must be one of \('rewy', 'wy'\)"):
        _gdn(gdn, backward=backward)


@pytest.mark.parametrize("backend", ["cuda", "triton", "XLA", ""])
def test_bad_backend_name(gdn, backend):
    with pytest.raises(ValueError, match=r"^backend must be None or one of"):
        _gdn(gdn, backend=backend)


@pytest.mark.parametrize("scale", [-1.0, 0.0, -0.125, float("nan"), float("inf"),
                                   np.float32(-2.0), np.array([0.5, 0.5])])
def test_scale_must_be_positive(gdn, scale):
    with pytest.raises(ValueError, match=r"^scale must be a positive number"):
        _gdn(gdn, scale=scale)


def test_scale_checked_by_every_op(gdn, kda, gdn2):
    d = gdn2
    with pytest.raises(ValueError, match=r"^scale"):
        rj.chunk_delta_rule(gdn["q"], gdn["k"], gdn["v"], gdn["beta"], scale=-1.0)
    with pytest.raises(ValueError, match=r"^scale"):
        rj.chunk_kda(*(kda[n] for n in ("q", "k", "v", "g", "beta")), scale=-1.0)
    with pytest.raises(ValueError, match=r"^scale"):
        rj.chunk_gdn2(*(d[n] for n in ("q", "k", "v", "g", "b", "w")), scale=-1.0)
    with pytest.raises(ValueError, match=r"^scale"):
        rj.fused_recurrent_gated_delta_rule(*(gdn[n] for n in ("q", "k", "v", "g", "beta")),
                                            scale=0.0)


def test_pallas_on_cpu_without_interpret(gdn):
    assert jax.default_backend() == "cpu"
    with pytest.raises(NotImplementedError, match=r"backend='pallas' needs a GPU or TPU.*interpret=True"):
        _gdn(gdn, backend="pallas")


# ----------------------------------------------------------------------------------------------
# initial_state
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(B, H, K), (B, H, V, K), (1, H, K, V), (B, H + 1, K, V),
                                   (B, 1, H, K, V)])
def test_initial_state_shape(gdn, shape):
    want = rf"^initial_state must have shape \[B, H, K, V\] = \({B}, {H}, {K}, {V}\)"
    with pytest.raises(ValueError, match=want):
        _gdn(gdn, initial_state=jnp.zeros(shape, jnp.float32))


def test_initial_state_dtype(gdn):
    with pytest.raises(TypeError, match=r"^initial_state must be a floating-point array"):
        _gdn(gdn, initial_state=jnp.zeros((B, H, K, V), jnp.int32))


def test_initial_state_per_sequence_with_cu_seqlens(gdn):
    d1 = {n: x[:1] for n, x in gdn.items()}
    cu = jnp.asarray([0, 5, T], jnp.int32)
    with pytest.raises(ValueError, match=r"^initial_state must have shape \[N \(number of sequences"):
        _gdn(d1, cu_seqlens=cu, initial_state=jnp.zeros((1, H, K, V), jnp.float32))
    o, s = _gdn(d1, cu_seqlens=cu, initial_state=jnp.zeros((2, H, K, V), jnp.float32),
                output_final_state=True)
    assert s.shape == (2, H, K, V)


# ----------------------------------------------------------------------------------------------
# cu_seqlens
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one(gdn):
    return {n: x[:1] for n, x in gdn.items()}


@pytest.mark.parametrize("cu,pattern", [
    ([0, 5, 5, T], r"^cu_seqlens must be strictly increasing"),
    ([0, 12, 7, T], r"^cu_seqlens must be strictly increasing"),
    ([1, 5, T], r"^cu_seqlens must start at 0; got 1"),
    ([0, 5, T - 1], rf"^cu_seqlens must end at T = {T} \(axis 1 of q\); got {T - 1}"),
    ([0, 5, T + 3], rf"^cu_seqlens must end at T = {T}"),
    ([0], r"^cu_seqlens must hold at least two offsets"),
])
def test_cu_seqlens_values(one, cu, pattern):
    with pytest.raises(ValueError, match=pattern):
        _gdn(one, cu_seqlens=jnp.asarray(cu, jnp.int32))


def test_cu_seqlens_numpy_accepted(one):
    o, s = _gdn(one, cu_seqlens=np.asarray([0, 7, T], np.int32), output_final_state=True)
    assert s.shape == (2, H, K, V)


@pytest.mark.parametrize("cu", [jnp.asarray([0.0, 5.0, T]), jnp.asarray([[0, 5, T]]), [0, 5, T]])
def test_cu_seqlens_must_be_1d_integer(one, cu):
    with pytest.raises(ValueError, match=r"^cu_seqlens must be a 1-D integer array"):
        _gdn(one, cu_seqlens=cu)


def test_cu_seqlens_needs_batch_1(gdn):
    with pytest.raises(ValueError, match=r"^with cu_seqlens the batch size must be 1.*B = 2"):
        _gdn(gdn, cu_seqlens=jnp.asarray([0, 5, T], jnp.int32))


def test_traced_cu_seqlens_are_trusted_by_xla_but_rejected_by_reference(one):
    """Under jit the values are unknown: the xla path accepts them (FLA convention); the
    token-by-token reference and the decode form need concrete offsets and say so."""
    cu = jnp.asarray([0, 5, T], jnp.int32)
    o = jax.jit(lambda c: _gdn(one, cu_seqlens=c)[0])(cu)
    assert o.shape == (1, T, H, V)
    with pytest.raises(NotImplementedError, match=r"backend='reference' cannot serve.*concrete cu_seqlens"):
        jax.jit(lambda c: _gdn(one, cu_seqlens=c, backend="reference")[0])(cu)
    with pytest.raises(NotImplementedError, match=r"fused_recurrent_\* with cu_seqlens needs concrete"):
        jax.jit(lambda c: rj.fused_recurrent_gated_delta_rule(
            *(one[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=c)[0])(cu)


# ----------------------------------------------------------------------------------------------
# The decode form validates like the chunked ops
# ----------------------------------------------------------------------------------------------
def test_fused_recurrent_validates(gdn, kda):
    with pytest.raises(ValueError, match=r"^g must have shape \[B, T, H, K\]"):
        rj.fused_recurrent_kda(kda["q"], kda["k"], kda["v"], gdn["g"], kda["beta"])
    with pytest.raises(ValueError, match=r"^initial_state must have shape"):
        rj.fused_recurrent_gated_delta_rule(*(gdn[n] for n in ("q", "k", "v", "g", "beta")),
                                            initial_state=jnp.zeros((B, H, K, K)))
    with pytest.raises(TypeError, match=r"^v must be a floating-point array"):
        rj.fused_recurrent_delta_rule(gdn["q"], gdn["k"], gdn["v"].astype(jnp.int8), gdn["beta"])


# ----------------------------------------------------------------------------------------------
# gate_lower_bound (KDA, GDN2)
# ----------------------------------------------------------------------------------------------
def _kda(d, g=None, **kw):
    kw.setdefault("backend", "xla")
    kw.setdefault("chunk_size", 16)
    return rj.chunk_kda(d["q"], d["k"], d["v"], d["g"] if g is None else g, d["beta"], **kw)


@pytest.mark.parametrize("bound", [0.0, 0.5, -41.0, float("nan")])
def test_gate_lower_bound_range(kda, bound):
    with pytest.raises(ValueError, match=r"^gate_lower_bound must lie in \[-40.0, 0\)"):
        _kda(kda, gate_lower_bound=bound)


def test_gate_lower_bound_must_be_static(kda):
    with pytest.raises(TypeError, match=r"^gate_lower_bound must be None or a Python float"):
        _kda(kda, gate_lower_bound=jnp.float32(-5.0)[None])


def test_concrete_gate_below_bound_is_named(kda):
    g = kda["g"].at[0, 3, 1, 2].set(-7.5)
    with pytest.raises(ValueError, match=r"^g has values below gate_lower_bound=-5.0 \(min -7.5\)"):
        _kda(kda, g=g, gate_lower_bound=-5.0)


def test_traced_gate_is_clamped_to_bound(kda):
    """Under jit the values are unknown: the op clamps g to the bound (documented), so it equals
    the op on explicitly clamped gates — never a NaN or an unrelated answer."""
    g = kda["g"].at[0, 3, 1, 2].set(-7.5).at[1, 10].set(-30.0)
    o = jax.jit(lambda g: _kda(kda, g=g, gate_lower_bound=-5.0)[0])(g)
    ref, _ = _kda(kda, g=jnp.maximum(g, -5.0))
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_gate_at_bound_keeps_its_full_gradient(kda):
    """A gate exactly at the bound is inside the admitted range: its gradient must be the
    unclamped one (jnp.maximum's VJP would halve it at the tie)."""
    g = kda["g"].at[:, ::3].set(-5.0)

    def dg(**kw):
        return jax.grad(lambda g: jnp.sum(_kda(kda, g=g, **kw)[0] ** 2))(g)

    np.testing.assert_allclose(np.asarray(dg(gate_lower_bound=-5.0)), np.asarray(dg()),
                               rtol=1e-6, atol=1e-7)
