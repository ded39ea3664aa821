"""Context parallelism (``context_axis=``): T split over 2, 4 and 8 devices inside
``jax.shard_map``, against the single-device op — every output and gradient (fp32, ≤ 1e-5
relative), with h0, the final state, and packed sequences straddling device boundaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rewy_jax import testing

from _md import assert_close, auto_mesh, require_devices

T = 64
# (op, devices, packed): every op, every device count, batched and packed.
CASES = [("gdn2", 2, True), ("kda", 4, False), ("deltanet", 8, True), ("gdn", 4, True)]
# Offsets with boundaries inside device slices and sequences spanning several devices (at 8
# devices each slice is 8 tokens: the 2nd sequence covers 3–44, i.e. slices 0–5).
CU = np.array([0, 3, 45, 50, 64], np.int32)


def _run(op, inputs, cu, axis_devices, backend="xla", interpret=False):
    spec = testing.OPS[op]
    names = ["q", "k", "v", *spec.gates, "initial_state"]
    ctx = {} if axis_devices is None else {"context_axis": "seq"}

    def f(*xs):
        d = dict(zip(names, xs))
        return spec.fn(*[d[n] for n in names[:-1]], initial_state=d["initial_state"],
                       cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                       chunk_size=16, backend=backend, interpret=interpret, **ctx)

    if axis_devices is not None:
        mesh = auto_mesh((axis_devices,), ("seq",))
        tok = P(None, "seq")
        f = jax.shard_map(f, mesh=mesh, in_specs=(tok,) * (len(names) - 1) + (P(),),
                          out_specs=(tok, P()))

    def loss(*xs):
        o, s = f(*xs)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(jnp.sin(s) * s)

    def both(*xs):  # one program: outputs and gradients (compiles once)
        return f(*xs), jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)

    xs = [inputs[n] for n in names]
    (o, s), grads = jax.jit(both)(*xs)
    return {"o": o, "final": s, **{"d" + n: g for n, g in zip(names, grads)}}


@pytest.mark.parametrize("op,devices,packed", CASES)
def test_context_parallel_matches_single_device(op, devices, packed):
    require_devices(devices)
    if packed:
        inputs = testing.make_inputs(op, 1, T, 2, 16, 16, seed=3, n_seqs=len(CU) - 1)
        cu = jnp.asarray(CU)
    else:
        inputs = testing.make_inputs(op, 2, T, 2, 16, 16, seed=3)
        cu = None
    want = _run(op, inputs, cu, None)
    got = _run(op, inputs, cu, devices)
    assert_close(got, want, 1e-5, f"{op} context-parallel over {devices} devices")


def test_context_axis_outside_shard_map_names_the_argument():
    inputs = testing.make_inputs("deltanet", 1, 16, 1, 16, 16, seed=0, initial_state=False)
    with pytest.raises(ValueError, match="context_axis='seq' must name a mesh axis"):
        testing.OPS["deltanet"].fn(inputs["q"], inputs["k"], inputs["v"], inputs["beta"],
                                   context_axis="seq")


def test_packed_context_parallel_needs_the_xla_backend():
    require_devices(2)
    inputs = testing.make_inputs("deltanet", 1, 32, 1, 16, 16, seed=0, n_seqs=3)
    mesh = auto_mesh((2,), ("seq",))
    tok = P(None, "seq")

    def f(q, k, v, beta, h0, cu):
        return testing.OPS["deltanet"].fn(q, k, v, beta, initial_state=h0, cu_seqlens=cu,
                                          backend="pallas_tpu", interpret=True,
                                          context_axis="seq")

    sf = jax.shard_map(f, mesh=mesh, in_specs=(tok,) * 4 + (P(), P()), out_specs=(tok, P()))
    args = [inputs[n] for n in ("q", "k", "v", "beta", "initial_state", "cu_seqlens")]
    with pytest.raises(NotImplementedError, match="context_axis with cu_seqlens runs on "
                                                  "backend='xla'"):
        jax.eval_shape(sf, *args)
