"""The public ops under JAX transformations, and the decode (fused_recurrent_*) form.

* chex variants (with and without jit) of forward and gradient against the float64 reference;
* jax.vmap (forward and grad) == a Python loop; jax.grad(jax.checkpoint(f)) == jax.grad(f);
* jax.test_util.check_grads (order 1, reverse mode) on tiny float64 inputs, argument by argument,
  so a wrong VJP for any single input fails;
* jit with traced cu_seqlens == eager; traced scale;
* no NaN/Inf in outputs or gradients, including g = −inf and β = 0 everywhere;
* fused_recurrent_* over the whole sequence == chunk_*; prefill with chunk_* then decode steps
  with the carried state == the full sequence.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.test_util import check_grads

import rewy_jax as rj
from rewy_jax.testing import OPS, make_inputs

ALL_OPS = tuple(OPS)
RECURRENT = {
    "deltanet": rj.fused_recurrent_delta_rule,
    "gdn": rj.fused_recurrent_gated_delta_rule,
    "kda": rj.fused_recurrent_kda,
    "gdn2": rj.fused_recurrent_gdn2,
}
# One canonical geometry for most tests (shared compilations): B, T, H, K, V, C.
B, T, H, K, V, C = 2, 45, 2, 16, 8, 16
KW = dict(backend="xla", chunk_size=C, use_qk_l2norm=True)


def _gates(op, d):
    return [d[n] for n in OPS[op].gates]


def _cotangents(o_shape, s_shape, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(o_shape), dtype),
            jnp.asarray(rng.standard_normal(s_shape), dtype))


def _loss_fn(op, cts, **kw):
    """loss(q, k, v, *gates, h0) = ⟨o, dO⟩ + ⟨final, dS⟩."""
    dO, dS = cts

    def loss(q, k, v, *rest):
        *gates, h0 = rest
        o, s = OPS[op].fn(q, k, v, *gates, initial_state=h0, output_final_state=True, **kw)
        return jnp.sum(o * dO.astype(o.dtype)) + jnp.sum(s * dS.astype(s.dtype))

    return loss


def _args(op, d):
    return (d["q"], d["k"], d["v"], *_gates(op, d), d["initial_state"])


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _assert_close_rel(tree, ref_tree, tol, what=""):
    for i, (x, r) in enumerate(zip(jax.tree.leaves(tree), jax.tree.leaves(ref_tree), strict=True)):
        chex.assert_shape(x, r.shape)
        assert np.isfinite(np.asarray(x, np.float64)).all(), f"{what} leaf {i} not finite"
        err = _rel(x, r)
        assert err <= tol, f"{what} leaf {i}: relative error {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------------------------
# chex variants: with and without jit, forward and gradient vs the float64 reference
# ----------------------------------------------------------------------------------------------
class VariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("gdn2", "gdn2"), ("deltanet", "deltanet"))
    def test_forward_and_grad_match_reference(self, op):
        d = make_inputs(op, B, T, H, K, V, seed=200 + len(op))
        cts = _cotangents((B, T, H, V), (B, H, K, V), seed=201)
        args = _args(op, d)
        fwd = lambda *a: OPS[op].fn(*a[:-1], initial_state=a[-1], output_final_state=True, **KW)  # noqa: E731
        o, s = self.variant(fwd)(*args)
        chex.assert_shape(o, (B, T, H, V))
        chex.assert_shape(s, (B, H, K, V))
        chex.assert_type([o, s], [jnp.float32, jnp.float32])
        grads = self.variant(jax.grad(_loss_fn(op, cts, **KW), argnums=tuple(range(len(args)))))(*args)

        args64 = tuple(a.astype(jnp.float64) for a in args)
        ref_kw = dict(backend="reference", use_qk_l2norm=True)
        o_r, s_r = OPS[op].fn(*args64[:-1], initial_state=args64[-1], output_final_state=True, **ref_kw)
        cts64 = tuple(c.astype(jnp.float64) for c in cts)
        grads_r = jax.grad(_loss_fn(op, cts64, **ref_kw), argnums=tuple(range(len(args))))(*args64)
        chex.assert_trees_all_close((o, s), (o_r.astype(jnp.float32), s_r.astype(jnp.float32)),
                                    rtol=1e-4, atol=1e-5)
        _assert_close_rel(grads, grads_r, 1e-4, f"{op} grads")

    def test_no_final_state_and_default_scale(self):
        d = make_inputs("kda", B, T, H, K, V, seed=210, initial_state=False)
        o, s = rj.chunk_kda(*(d[n] for n in ("q", "k", "v", "g", "beta")), **KW)
        assert s is None
        chex.assert_shape(o, (B, T, H, V))
        # default scale is K^-1/2: same as passing it explicitly, different from scale=1
        o2, _ = rj.chunk_kda(*(d[n] for n in ("q", "k", "v", "g", "beta")), scale=K ** -0.5, **KW)
        o3, _ = rj.chunk_kda(*(d[n] for n in ("q", "k", "v", "g", "beta")), scale=1.0, **KW)
        chex.assert_trees_all_close(o, o2, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(o3, o * K ** 0.5, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# vmap, checkpoint, jit with traced arguments
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["gdn2"])
def test_vmap_forward_and_grad_equal_loop(op):
    ds = [make_inputs(op, B, T, H, K, V, seed=220 + i) for i in range(2)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *[_args(op, d) for d in ds])
    fwd = lambda *a: OPS[op].fn(*a[:-1], initial_state=a[-1], output_final_state=True, **KW)  # noqa: E731
    cts = _cotangents((B, T, H, V), (B, H, K, V), seed=221)
    grad = jax.grad(_loss_fn(op, cts, **KW), argnums=tuple(range(len(stacked))))
    out_v = jax.vmap(fwd)(*stacked)
    grad_v = jax.vmap(grad)(*stacked)
    for i, d in enumerate(ds):  # (batched fp32 matmuls round differently: compare in norm)
        _assert_close_rel(jax.tree.map(lambda x: x[i], out_v), fwd(*_args(op, d)), 1e-5, "vmap fwd")
        _assert_close_rel(jax.tree.map(lambda x: x[i], grad_v), grad(*_args(op, d)), 1e-5,
                          "vmap grad")


@pytest.mark.parametrize("op,policy,jit", [("kda", "save", True), ("deltanet", "recompute", False)])
def test_grad_of_checkpoint(op, policy, jit):
    d = make_inputs(op, B, T, H, K, V, seed=230)
    cts = _cotangents((B, T, H, V), (B, H, K, V), seed=231)
    loss = _loss_fn(op, cts, policy=policy, **KW)
    argnums = tuple(range(len(_args(op, d))))
    g_plain = jax.grad(loss, argnums=argnums)(*_args(op, d))
    g_ckpt = jax.grad(jax.checkpoint(loss), argnums=argnums)(*_args(op, d))
    chex.assert_trees_all_close(g_ckpt, g_plain, rtol=1e-5, atol=1e-6)
    if jit:
        g_ckpt_jit = jax.jit(jax.grad(jax.checkpoint(loss), argnums=argnums))(*_args(op, d))
        chex.assert_trees_all_close(g_ckpt_jit, g_plain, rtol=1e-4, atol=1e-5)


def test_jit_with_traced_cu_seqlens():
    """Offsets traced under jit (a static chunk bound): same outputs and grads as eager, and the
    same compiled function serves other offsets (nothing baked in at trace time)."""
    op = "gdn2"
    d = make_inputs(op, 1, T, H, K, V, seed=240, n_seqs=4)
    args = _args(op, d)

    def loss(args, cu):
        o, s = OPS[op].fn(*args[:-1], initial_state=args[-1], output_final_state=True,
                          cu_seqlens=cu, **KW)
        return jnp.sum(o * o) + jnp.sum(jnp.sin(s)), (o, s)

    vg = jax.value_and_grad(loss, has_aux=True)
    vg_jit = jax.jit(vg)
    for cu in ([0, 3, 20, 21, T], [0, 16, 17, 40, T]):  # short, long, length-1, unaligned
        cu = jnp.asarray(cu, jnp.int32)
        eager = vg(args, cu)
        jitted = vg_jit(args, cu)
        _assert_close_rel(jitted, eager, 1e-5, f"jit vs eager, cu={cu}")


def test_traced_scale_under_jit_and_grad():
    d = make_inputs("gdn", B, T, H, K, V, seed=250)
    args = _args("gdn", d)

    def f(scale):
        o, _ = rj.chunk_gated_delta_rule(*args[:-1], initial_state=args[-1], scale=scale, **KW)
        return jnp.sum(o)

    val = jax.jit(f)(0.3)
    np.testing.assert_allclose(val, f(0.3), rtol=1e-5)
    # o is linear in scale (q is scaled; the state does not depend on q)
    np.testing.assert_allclose(jax.grad(f)(0.3), f(0.3) / 0.3, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# check_grads: finite differences against the custom VJP (float64 in, fp32 inside)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,backward", [("gdn", "wy"), ("gdn2", "rewy")])
def test_check_grads_each_argument(op, backward):
    """Central differences (eps 1e-3) vs the VJP for each input separately. The path computes in
    fp32, so differences carry ~3e-4 relative noise; a 2% error in any one gradient is > 1e-3."""
    d = make_inputs(op, 1, 20, 1, 4, 3, seed=260 + len(op))
    d = {k: v.astype(jnp.float64) for k, v in d.items()}
    names = ["q", "k", "v", *OPS[op].gates, "initial_state"]
    dO, dS = _cotangents((1, 20, 1, 3), (1, 1, 4, 3), seed=261, dtype=jnp.float64)
    for name in names:
        def f(x, name=name):
            dd = dict(d, **{name: x})
            o, s = OPS[op].fn(dd["q"], dd["k"], dd["v"], *_gates(op, dd),
                              initial_state=dd["initial_state"], output_final_state=True,
                              backward=backward, **KW)
            return jnp.sum(o * dO) + jnp.sum(s * dS)

        check_grads(f, (d[name],), order=1, modes=["rev"], eps=1e-3, atol=1e-3, rtol=1e-3)


# ----------------------------------------------------------------------------------------------
# Finiteness: g = −inf (full resets), −50, β = 0, bf16
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["gdn", "kda", "gdn2"])
def test_no_nan_inf_with_infinite_decay(op):
    d = make_inputs(op, B, T, H, K, V, seed=280, decay="strong")
    g = np.array(d["g"])
    g[:, ::7] = -np.inf  # whole rows of resets, including the first token of chunks
    g[:, 16] = -np.inf
    g[:, 5] = -50.0
    d["g"] = jnp.asarray(g)
    for n in OPS[op].gates:
        if n in ("beta", "b"):
            d[n] = d[n].at[:, 3:9].set(0.0)
    cts = _cotangents((B, T, H, V), (B, H, K, V), seed=281)
    args = _args(op, d)
    for backward in ("rewy", "wy"):
        o, s = OPS[op].fn(*args[:-1], initial_state=args[-1], output_final_state=True,
                          backward=backward, **KW)
        grads = jax.grad(_loss_fn(op, cts, backward=backward, **KW),
                         argnums=tuple(range(len(args))))(*args)
        for x in (o, s, *grads):
            assert np.isfinite(np.asarray(x)).all()
    # a reset at token t makes o_t independent of everything before t
    t0 = 28  # g[:, 28] = −inf
    assert np.isneginf(g[:, t0]).all()
    args2 = list(args)
    args2[2] = args[2].at[:, :t0].multiply(-3.0)  # change v before the reset
    args2[-1] = args[-1] * 5.0
    o2, _ = OPS[op].fn(*args2[:-1], initial_state=args2[-1], **KW)
    np.testing.assert_allclose(o2[:, t0:], o[:, t0:], rtol=1e-5, atol=1e-6)
    assert not np.allclose(o2[:, :t0], o[:, :t0])


def test_all_gates_minus_inf_and_bf16_finite():
    d = make_inputs("gdn2", 1, 33, 1, 8, 8, seed=290, dtype=jnp.bfloat16)
    d["g"] = jnp.full_like(d["g"], -jnp.inf)
    cts = _cotangents((1, 33, 1, 8), (1, 1, 8, 8), seed=291)
    args = _args("gdn2", d)
    grads = jax.grad(_loss_fn("gdn2", cts, **KW), argnums=tuple(range(len(args))))(*args)
    for x in grads:
        assert np.isfinite(np.asarray(x, np.float32)).all()
    # every token resets: the state is k_t z_tᵀ of the last token only
    _, s = rj.chunk_gdn2(*args[:-1], initial_state=args[-1], output_final_state=True, **KW)
    from rewy_jax.reference import l2norm
    k_last = np.asarray(l2norm(d["k"].astype(jnp.float32))[0, -1, 0], np.float64)
    z_last = np.asarray(d["w"][0, -1, 0], np.float64) * np.asarray(d["v"][0, -1, 0], np.float64)
    np.testing.assert_allclose(np.asarray(s[0, 0]), np.outer(k_last, z_last), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------------------------
# Decode form
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ALL_OPS)
def test_fused_recurrent_equals_chunk(op):
    d = make_inputs(op, B, T, H, K, V, seed=300, decay="strong" if op != "deltanet" else "normal")
    args = _args(op, d)
    o_c, s_c = OPS[op].fn(*args[:-1], initial_state=args[-1], output_final_state=True, **KW)
    o_r, s_r = RECURRENT[op](*args[:-1], initial_state=args[-1], use_qk_l2norm=True)
    chex.assert_shape(o_r, o_c.shape)
    chex.assert_trees_all_close((o_r, s_r), (o_c, s_c), rtol=1e-4, atol=1e-5)
    # the decode form is differentiable and agrees with the chunked VJP
    cts = _cotangents((B, T, H, V), (B, H, K, V), seed=301)

    def loss_r(*a):
        o, s = RECURRENT[op](*a[:-1], initial_state=a[-1], use_qk_l2norm=True)
        return jnp.sum(o * cts[0]) + jnp.sum(s * cts[1])

    argnums = tuple(range(len(args)))
    g_r = jax.grad(loss_r, argnums=argnums)(*args)
    g_c = jax.grad(_loss_fn(op, cts, **KW), argnums=argnums)(*args)
    _assert_close_rel(g_r, g_c, 1e-4, f"{op} recurrent grads")


@pytest.mark.parametrize("op,prefill", [(op, 30) for op in ALL_OPS] + [("gdn", 1), ("gdn2", 16)])
def test_prefill_then_decode(op, prefill):
    """chunk_* on the prompt, then fused_recurrent_* token by token and one multi-token step
    with the carried state, reproduces the full-sequence output and final state."""
    Tn = T
    d = make_inputs(op, B, Tn, H, K, V, seed=310 + prefill)
    seq = lambda x, a, b: x[:, a:b]  # noqa: E731
    names = ["q", "k", "v", *OPS[op].gates]
    o_full, s_full = OPS[op].fn(*(d[n] for n in names), initial_state=d["initial_state"],
                                output_final_state=True, **KW)
    o_pre, state = OPS[op].fn(*(seq(d[n], 0, prefill) for n in names),
                              initial_state=d["initial_state"], output_final_state=True, **KW)
    outs = [o_pre]
    steps = [(prefill + i, prefill + i + 1) for i in range(3)] + [(prefill + 3, Tn)]
    for a, b in steps:
        o_t, state = RECURRENT[op](*(seq(d[n], a, b) for n in names), initial_state=state,
                                   use_qk_l2norm=True)
        chex.assert_shape(state, (B, H, K, V))
        outs.append(o_t)
    chex.assert_trees_all_close((jnp.concatenate(outs, axis=1), state), (o_full, s_full),
                                rtol=1e-4, atol=1e-5)


def test_fused_recurrent_varlen_and_jit():
    d = make_inputs("kda", 1, T, H, K, V, seed=320, n_seqs=2)
    args = _args("kda", d)
    o_c, s_c = rj.chunk_kda(*args[:-1], initial_state=args[-1], output_final_state=True,
                            cu_seqlens=d["cu_seqlens"], **KW)
    o_r, s_r = rj.fused_recurrent_kda(*args[:-1], initial_state=args[-1], use_qk_l2norm=True,
                                      cu_seqlens=d["cu_seqlens"])
    chex.assert_trees_all_close((o_r, s_r), (o_c, s_c), rtol=1e-4, atol=1e-5)
    step = jax.jit(lambda *a: rj.fused_recurrent_kda(*a[:-1], initial_state=a[-1],
                                                     use_qk_l2norm=True))
    one = [x[:, :1] for x in args[:-1]]
    o1, s1 = step(*one, args[-1][:1])
    o1e, s1e = rj.fused_recurrent_kda(*one, initial_state=args[-1][:1], use_qk_l2norm=True)
    chex.assert_trees_all_close((o1, s1), (o1e, s1e), rtol=1e-6, atol=1e-6)
    chex.assert_shape(o1, (1, 1, H, V))
    # output_final_state=False gives None
    assert rj.fused_recurrent_kda(*one, initial_state=args[-1][:1],
                                  output_final_state=False)[1] is None


def test_backend_none_on_cpu_is_xla():
    d = make_inputs("gdn", B, T, H, K, V, seed=330)
    args = _args("gdn", d)
    o_auto = rj.chunk_gated_delta_rule(*args[:-1], initial_state=args[-1], chunk_size=C,
                                       use_qk_l2norm=True)[0]
    o_xla = rj.chunk_gated_delta_rule(*args[:-1], initial_state=args[-1], **KW)[0]
    chex.assert_trees_all_equal(o_auto, o_xla)
