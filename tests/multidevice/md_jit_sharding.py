"""Batch and head sharding under ``jit`` with ``NamedSharding``: every backend runs per shard
(no all-gather or all-to-all in the compiled program), and outputs, final states and every
gradient equal the single-device results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rewy_jax import testing

from _md import assert_close, auto_mesh, require_devices

# The XLA and reference paths are partitioned by XLA itself; the Pallas GPU kernels (here in
# interpret mode) through rewy_jax.sharding's custom partitioning.
CASES = [("xla", False, "kda"), ("reference", False, "gdn"), ("pallas_gpu", True, "gdn2")]


def _program(op, backend, interpret):
    spec = testing.OPS[op]
    names = ["q", "k", "v", *spec.gates, "initial_state"]

    def f(*xs):
        d = dict(zip(names, xs))
        return spec.fn(*[d[n] for n in names[:-1]], initial_state=d["initial_state"],
                       output_final_state=True, use_qk_l2norm=True, chunk_size=16,
                       backend=backend, interpret=interpret)

    def loss(*xs):
        o, s = f(*xs)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * s)

    def both(*xs):
        return f(*xs), jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)

    return names, jax.jit(both)


@pytest.mark.parametrize("backend,interpret,op", CASES)
def test_batch_head_sharding_no_gather(backend, interpret, op):
    require_devices()
    mesh = auto_mesh((4, 2), ("data", "heads"))
    inputs = testing.make_inputs(op, 4, 32, 2, 16, 16, seed=2)
    names, prog = _program(op, backend, interpret)
    xs = [inputs[n] for n in names]
    tok, state = P("data", None, "heads"), P("data", "heads")
    sharded = [jax.device_put(x, NamedSharding(mesh, state if n == "initial_state" else tok))
               for n, x in zip(names, xs)]
    (o, s), grads = prog(*sharded)
    (o1, s1), grads1 = prog(*xs)  # the same program on unsharded (single-device) inputs
    got = {"o": o, "final": s, **{"d" + n: g for n, g in zip(names, grads)}}
    want = {"o": o1, "final": s1, **{"d" + n: g for n, g in zip(names, grads1)}}
    assert_close(got, want, 1e-6, f"{op}/{backend} batch+head sharded")
    assert o.sharding.spec[0] == "data" and o.sharding.spec[2] == "heads", o.sharding
    hlo = prog.lower(*sharded).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute"):
        lines = [ln for ln in hlo.splitlines() if collective in ln]
        assert not lines, f"{op}/{backend}: compiled program has {collective}:\n" + \
            "\n".join(lines[:5])


def test_packed_sequences_head_sharded_pallas():
    """cu_seqlens (B = 1) with heads sharded: the offsets travel replicated, the kernels run per
    head shard, and nothing is gathered."""
    require_devices()
    mesh = auto_mesh((4, 2), ("data", "heads"))
    inputs = testing.make_inputs("gdn", 1, 48, 4, 16, 16, seed=5, n_seqs=3)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    spec = testing.OPS["gdn"]

    def f(*xs):
        d = dict(zip(names, xs[:-1]))
        return spec.fn(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                       cu_seqlens=xs[-1], output_final_state=True, use_qk_l2norm=True,
                       chunk_size=16, backend="pallas_gpu", interpret=True)

    def loss(*xs):
        o, s = f(*xs)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * s)

    prog = jax.jit(lambda *xs: (f(*xs), jax.grad(loss, argnums=tuple(range(6)))(*xs)))
    xs = [inputs[n] for n in names] + [inputs["cu_seqlens"]]
    sharded = [jax.device_put(x, NamedSharding(mesh, P(None, "heads") if n == "initial_state"
                                               else P(None, None, "heads")))
               for n, x in zip(names, xs)] + [xs[-1]]
    (o, s), grads = prog(*sharded)
    (o1, s1), grads1 = prog(*xs)
    got = {"o": o, "final": s, **{"d" + n: g for n, g in zip(names, grads)}}
    want = {"o": o1, "final": s1, **{"d" + n: g for n, g in zip(names, grads1)}}
    assert_close(got, want, 1e-6, "packed gdn/pallas_gpu head sharded")
    hlo = prog.lower(*sharded).compile().as_text()
    assert not [ln for ln in hlo.splitlines() if "all-gather" in ln or "all-to-all" in ln]


def test_partitioned_pallas_op_under_vmap_and_grad():
    """custom_partitioning has no batching rule: the wrapped Pallas op falls back to the vmapped
    per-shard function, and its gradient under vmap equals the per-example gradients."""
    require_devices()
    inputs = testing.make_inputs("deltanet", 1, 16, 2, 16, 16, seed=4, initial_state=False)
    names = ("q", "k", "v", "beta")

    def f(q, k, v, beta):
        o, _ = testing.OPS["deltanet"].fn(q, k, v, beta, chunk_size=16, backend="pallas_gpu",
                                          interpret=True, use_qk_l2norm=True)
        return jnp.sum(o * jnp.cos(o))

    xs = [jnp.concatenate([inputs[n], 0.5 * inputs[n]])[:, None] for n in names]  # 2 examples
    got = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2, 3))))(*xs)
    for i in range(2):
        want = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(*[x[i] for x in xs])
        assert_close({n: g[i] for n, g in zip(names, got)}, dict(zip(names, want)), 1e-6,
                     f"vmap example {i}")
