"""The Flax layers sharded by their parameters' logical axes over 8 devices (tensor parallel over
heads, data parallel over batch) give the unsharded outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rewy_jax.layers import LAYERS
from rewy_jax.layers.partitioning import TENSOR_PARALLEL_RULES, shard_model

from _md import auto_mesh, rel, require_devices


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_layer_sharded_by_logical_axes(name):
    require_devices()
    mesh = auto_mesh((2, 4), ("data", "model"))
    layer = LAYERS[name](64, 4, 16, rngs=nnx.Rngs(0), backend="xla", chunk_size=16)
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.float32)

    @nnx.jit
    def fwd(m, x):
        return m(x)

    want = fwd(layer, x)
    shard_model(layer, mesh, TENSOR_PARALLEL_RULES)
    q_kernel = nnx.state(layer)["q_proj"]["kernel"].get_value()
    assert q_kernel.sharding.spec == P(None, "model"), q_kernel.sharding
    assert len({s.device for s in q_kernel.addressable_shards}) == 8
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = fwd(layer, xs)
    assert rel(got, want) <= 1e-6, rel(got, want)
    assert np.isfinite(np.asarray(got)).all()
