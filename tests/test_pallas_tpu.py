"""Pallas TPU kernels on CPU: the TPU interpreter against the float64 recurrence, and lowering
for TPU (Mosaic MLIR) from CPU for every kernel at K = V ∈ {64, 128, 256}, C = 64, bf16 and fp32.

No TPU is needed. The interpreter (``pltpu.InterpretParams``) simulates TPU memory (uninitialised
buffers are NaN, out-of-bounds reads raise, optional race detection); the lowering runs the
Pallas → Mosaic lowering with a TPU device kind in scope, which rejects block shapes that break
the (8, 128) tiling and ops Mosaic has no rule for. (The final Mosaic compile needs libtpu.)
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu as ptpu
from pallas_kernels.tpu import algebra as talg
from pallas_kernels.tpu import kernels as tk
from rewy_jax import backends, testing

# (op, dtype, chunk_size, T, extra op kwargs, make_inputs kwargs). Small shapes, T never a
# multiple of the chunk; every op, both policies, both backward schemes, varlen, strong decays.
CASES = [
    ("deltanet", jnp.float32, 16, 40, {}, {}),
    ("gdn", jnp.float32, 16, 150, dict(policy="save", backward="wy"), {}),  # 10 chunks: 2 gate tiles
    ("gdn2", jnp.float32, 64, 72, {}, {}),
    ("gdn2", jnp.float32, 32, 56, dict(policy="save", backward="wy"), dict(n_seqs=2)),
    ("gdn", jnp.float32, 32, 40, {}, dict(decay="strong")),
    ("gdn2", jnp.float32, 32, 40, dict(policy="save"), dict(decay="strong")),
    ("kda", jnp.bfloat16, 32, 40, dict(backward="wy"), {}),
    ("deltanet", jnp.bfloat16, 16, 40, {}, {}),  # no decay: errors would accumulate, if any
]


def _emulate_bf16x3(monkeypatch):
    """Make the kernels' ``Precision.HIGH`` products (bf16 callers) round like the TPU's bf16x3
    — hi·hi + hi·lo + lo·hi of a bf16 split — instead of XLA:CPU's exact fp32."""
    real = jax.lax

    def dot_general(a, b, dims, precision=None, preferred_element_type=None):
        if precision != real.Precision.HIGH:
            return real.dot_general(a, b, dims, precision=precision,
                                    preferred_element_type=preferred_element_type)
        split = lambda x: (x.astype(jnp.bfloat16).astype(jnp.float32),  # noqa: E731
                           (x - x.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16)
                           .astype(jnp.float32))
        (ah, al), (bh, bl) = split(a), split(b)
        d = lambda x, y: real.dot_general(x, y, dims, precision=real.Precision.HIGHEST,  # noqa: E731
                                          preferred_element_type=jnp.float32)
        return d(ah, bh) + d(ah, bl) + d(al, bh)

    shim = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    shim.dot_general = dot_general
    monkeypatch.setattr(talg, "lax", shim)


def _case_id(case):
    op, dtype, C, _, kw, mk = case
    return "-".join([op, jnp.dtype(dtype).name, f"C{C}", *(list(map(str, kw.values())) or ["default"]),
                     *mk])


@pytest.mark.parametrize("op,dtype,C,T,kw,mk", CASES, ids=[_case_id(c) for c in CASES])
def test_interpret_accuracy(op, dtype, C, T, kw, mk, monkeypatch):
    if dtype == jnp.bfloat16:
        _emulate_bf16x3(monkeypatch)
    inputs = testing.make_inputs(op, 1, T, 1, 8, 16, dtype=dtype, seed=3, **mk)
    rep = testing.accuracy_report(op, inputs, backend="pallas_tpu", interpret=True,
                                  chunk_size=C, **kw)
    bad = {k: v for k, v in rep.items() if not v[0] <= v[1]}
    assert not bad, f"{op}: ratios above tolerance: {bad} (all: {rep})"


def test_bf16_strong_scalar_decay_dg(monkeypatch):
    """Issue 40, item 1: GDN, bf16, strong scalar decays, C = 128. The gate gradient dots the
    backward's bf16-operand pair products with the rows q, k, e; dotted with unrounded rows the
    pairs that do not cross t kept their bf16 errors, which summed over every later row
    (dg 2.2e-2 here, beyond §8's 2e-2; the XLA path, exact fp32, 1.5e-3). With the rows as the
    products read them (ScalarDecayTPU.pair_row) they cancel: 3.2e-3. Asserted: §8, and half
    of it, the margin the fix gives."""
    _emulate_bf16x3(monkeypatch)
    inputs = testing.make_inputs("gdn", 1, 256, 1, 32, 32, dtype=jnp.bfloat16, seed=1,
                                 decay="strong")
    rep = testing.accuracy_report("gdn", inputs, seed=2, backend="pallas_tpu", interpret=True,
                                  chunk_size=128)
    bad = {k: v for k, v in rep.items() if not v[0] <= v[1]}
    assert not bad, f"ratios above tolerance: {bad} (all: {rep})"
    assert rep["dg"][0] <= rep["dg"][1] / 2, rep["dg"]


def test_interpret_token_layout():
    """K = V = 128 and no cu_seqlens: the kernels read and write the public [B, T, H, D] layout
    (viewed as [B, T, H·D]) without transposes; KDA, fp32, T not a multiple of the chunk."""
    inputs = testing.make_inputs("kda", 1, 40, 2, 128, 128, seed=4)
    rep = testing.accuracy_report("kda", inputs, backend="pallas_tpu", interpret=True,
                                  chunk_size=16)
    bad = {k: v for k, v in rep.items() if not v[0] <= v[1]}
    assert not bad, f"ratios above tolerance: {bad} (all: {rep})"


def test_interpret_race_detection():
    """Forward and backward kernels under the race detector, two simulated cores, NaN-filled
    uninitialised memory; gradients must also agree with the XLA path."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2,
                                   uninitialized_memory="nan")
    inputs = testing.make_inputs("gdn", 1, 24, 2, 8, 8, seed=5)
    cts = {"o": jnp.ones((1, 24, 2, 8)), "final_state": jnp.ones((1, 2, 8, 8))}
    o, s, g = testing.loss_and_grads("gdn", inputs, cts, backend="pallas_tpu", interpret=params,
                                     chunk_size=16, use_qk_l2norm=True)
    o_x, s_x, g_x = testing.loss_and_grads("gdn", inputs, cts, backend="xla", chunk_size=16,
                                           use_qk_l2norm=True)
    assert testing.ratio(o, o_x) < 1e-5 and testing.ratio(s, s_x) < 1e-5
    for name in g:
        assert testing.ratio(g[name], g_x[name]) < 1e-5, name


def test_supports_reasons():
    on_cpu = lambda **kw: ptpu.supports_reason(**{**dict(K=64, V=64, chunk_size=64,  # noqa: E731
                                                         dtype=jnp.float32, on_tpu=False,
                                                         interpret=True), **kw})
    assert on_cpu() is None
    assert "TPU" in on_cpu(interpret=False)
    assert "float64" in on_cpu(dtype=jnp.float64)
    assert "chunk_size" in on_cpu(chunk_size=256)
    assert "K=" in on_cpu(K=320)
    inputs = testing.make_inputs("gdn", 1, 20, 1, 8, 8)
    with pytest.raises(NotImplementedError, match="pallas_tpu"):
        testing.run_op("gdn", inputs, backend="pallas_tpu")  # on CPU without interpret


# ----------------------------------------------------------------------------------------------
# Lowering for TPU from CPU
# ----------------------------------------------------------------------------------------------
def _tpu_mesh(device_kind="TPU v6 lite"):
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=1, platform="tpu"))


def lower_for_tpu(f, *args, device_kind="TPU v6 lite"):
    """Lower ``f`` for TPU from CPU; returns the StableHLO text (with the Mosaic kernels).

    Unlike design.md's recipe, tracing also happens inside the abstract mesh: kernels with
    scalar prefetch / compiler params query the device kind already while tracing."""
    with jax.sharding.use_abstract_mesh(_tpu_mesh(device_kind)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


# Per op: (erase b, write w, gate g) kinds as the backend glue passes them.
OP_GATES = {"deltanet": ("scalar", None, None), "gdn": ("scalar", None, "scalar"),
            "kda": ("scalar", None, "vector"), "gdn2": ("vector", "vector", "vector")}


def _kernel_calls(D, dtype, op):
    B, H, N, C = 1, 2, 2, 64
    S = jax.ShapeDtypeStruct
    x = S((B, H, N, C, D), dtype)

    def token(kind):  # scalars as (8, C) row tiles (N padded to 8), vectors dense
        return {None: None, "scalar": S((B, H, 8, C), jnp.float32),
                "vector": S((B, H, N, C, D), jnp.float32)}[kind]

    b, w, g = (token(kind) for kind in OP_GATES[op])
    h0, S0 = S((B, 2, H, D, D), jnp.float32), S((B, H, N, D, D), jnp.float32)
    R = S((B, H, N, C, D), jnp.float32)
    meta = tuple(S((N,), jnp.int32) for _ in range(3))
    ops = "bfloat16" if dtype == jnp.bfloat16 else None  # as the backend glue chooses
    fwd = lambda **kw: lambda *a: tk.forward_call(*a, operands=ops, **kw)  # noqa: E731
    bwd = lambda scheme: lambda *a: tk.backward_call(*a, scheme=scheme, operands=ops)  # noqa: E731
    fwd_args = (x, x, x, b, w, g, h0, meta)
    return {
        "forward": (fwd(), fwd_args),
        "forward_save": (fwd(save=True), fwd_args),
        "states": (fwd(mode="states"), fwd_args),
        "backward_rewy": (bwd("rewy"), (x, x, x, b, w, g, S0, None, x, h0, meta)),
        "backward_rewy_saved_R": (bwd("rewy"), (x, x, x, b, w, g, S0, R, x, h0, meta)),
        "backward_wy": (bwd("wy"), (x, x, x, b, w, g, S0, None, x, h0, meta)),
    }


@pytest.mark.parametrize("op", list(OP_GATES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_lowers_for_tpu(D, dtype, op):
    failed = {}
    for name, (f, args) in _kernel_calls(D, dtype, op).items():
        try:
            text = lower_for_tpu(f, *args)
            assert "tpu_custom_call" in text
        except Exception as e:  # noqa: BLE001 - report every kernel that fails, then fail
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    assert not failed, failed


@pytest.mark.parametrize("op,D", [("gdn2", 128), ("gdn", 256), ("kda", 64)])
@pytest.mark.parametrize("device_kind", ["TPU v5 lite", "TPU v6 lite"], ids=["v5e", "v6e"])
def test_op_lowers_for_tpu_end_to_end(monkeypatch, device_kind, op, D):
    """The public op with jax.grad (custom VJP, layout glue, both kernels) lowers for TPU; D 128
    and 256 take the token layout (no transposes), D = 64 the chunk layout."""
    spec = testing.OPS[op]
    inputs = testing.make_inputs(op, 1, 100, 2, D, D, dtype=jnp.bfloat16)
    names = ("q", "k", "v") + spec.gates + ("initial_state",)

    def loss(*a):
        o, s = spec.fn(*a[:-1], initial_state=a[-1], output_final_state=True,
                       use_qk_l2norm=True, backend="pallas_tpu", chunk_size=64)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    args = [inputs[n] for n in names]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    monkeypatch.setattr(backends, "_platform", lambda: "tpu")  # dispatch as on a TPU
    text = lower_for_tpu(jax.value_and_grad(loss, argnums=tuple(range(len(args)))), *specs,
                         device_kind=device_kind)
    assert text.count("tpu_custom_call") >= 3  # forward, recompute states, backward
    if D % 128 == 0:  # token layout: the kernels take q as [B, N·C, H·D] = [1, 128, 2·D]
        assert f"tensor<1x128x{2 * D}xbf16>" in text


def test_jit_in_interpreter():
    """The op is jit-safe with the TPU kernels (interpreter)."""
    inputs = testing.make_inputs("gdn", 2, 20, 1, 8, 8, seed=7)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    fn = lambda *a: testing.OPS["gdn"].fn(*a, backend="pallas_tpu", interpret=True,  # noqa: E731
                                          chunk_size=16)[0]
    ref = testing.OPS["gdn"].fn(*args, backend="xla", chunk_size=16)[0]
    assert testing.ratio(jax.jit(fn)(*args), ref) < 1e-5


def test_vmap_lowers_for_tpu():
    """vmap of the kernels lowers for TPU (the pallas_call batching rule adds a grid axis).

    Not run in the interpreter: jax 0.12's TPU interpreter zips the grid with the
    ``dimension_semantics`` and rejects the extra vmapped grid axis (a JAX limitation)."""
    S = jax.ShapeDtypeStruct
    for name in ("forward", "backward_rewy"):
        f, args = _kernel_calls(128, jnp.bfloat16, "gdn")[name]
        batched = [a if a is None or isinstance(a, tuple) else S((3,) + a.shape, a.dtype)
                   for a in args]
        in_axes = [None if a is None or isinstance(a, tuple) else 0 for a in args]
        assert "tpu_custom_call" in lower_for_tpu(jax.vmap(f, in_axes=in_axes), *batched), name


def test_roofline_counts():
    """The roofline counter (tools/tpu_roofline.py) runs on the kernels' own chunk functions;
    ReWY's backward does fewer MXU FLOPs than the seven-product baseline for every op."""
    from tools import tpu_roofline as roofline

    for op in roofline.OPS:
        w = roofline.chunk_work(op, 64, 64, 64)
        assert w["backward rewy"]["mxu_flops"] < w["backward wy"]["mxu_flops"]
        assert w["forward"]["mxu_flops"] > 0 and w["forward"]["hbm_bytes"] > 0
