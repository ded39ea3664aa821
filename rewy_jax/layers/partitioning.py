"""Logical axis names on the layers' parameters, for FSDP and tensor parallelism by annotation.

Every parameter of the delta-rule layers carries Flax partitioning metadata (``out_sharding``,
set through ``nnx.with_partitioning``) in *logical* names:

    EMBED  "embed"   the model width (hidden_size): rows of q/k/v/gate projections, o_proj's
                     columns. FSDP maps it to the data axis.
    HEADS  "heads"   a head-major projected axis (H·K, H_v·V, H or H_v): the columns of the
                     q/k/v/gate projections, o_proj's rows, the convolutions' channels, the
                     per-head decay parameters. Tensor parallelism maps it to the model axis;
                     contiguous blocks of H·K are whole heads when H divides by the axis size.
    RANK   "rank"    the low-rank gate projections' inner dimension (replicate it).
    NORM   "norm"    the per-head-dim RMSNorm weight (replicate it).
    CONV   "conv"    the short convolution's taps (replicate it).

Map them to mesh axes with ``nnx.logical_axis_rules`` and shard the state (:func:`shard_model`):

    rules = (("embed", None), ("heads", "model"), ("rank", None), ("norm", None), ("conv", None))
    model = shard_model(model, mesh, rules)

The annotations do not shard parameters when the layer is built (``eager_sharding=False``), so
building a layer needs no mesh in scope; :func:`shard_model` (or Flax's own
``nnx.get_partition_spec`` + ``jax.device_put``) places them.
"""

from __future__ import annotations

import jax
from flax import nnx

EMBED, HEADS, RANK, NORM, CONV = "embed", "heads", "rank", "norm", "conv"

# Tensor parallelism over "model"; add ("embed", "data") for FSDP on top.
TENSOR_PARALLEL_RULES = ((EMBED, None), (HEADS, "model"), (RANK, None), (NORM, None),
                         (CONV, None))

__all__ = ["EMBED", "HEADS", "RANK", "NORM", "CONV", "TENSOR_PARALLEL_RULES", "with_axes",
           "param", "shard_model"]


def with_axes(init, names):
    """``init`` whose parameter carries the logical ``names`` (one per dimension)."""
    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


def param(value, names):
    """An ``nnx.Param`` holding ``value`` with the logical axis ``names``."""
    return nnx.Param(value, sharding_names=tuple(names), eager_sharding=False)


def shard_model(model, mesh, rules):
    """Place ``model``'s parameters on ``mesh`` by their logical names under ``rules``
    (pairs (logical name, mesh axis or None)); returns the model (updated in place)."""
    state = nnx.state(model)
    with nnx.logical_axis_rules(tuple(rules)):
        specs = nnx.get_partition_spec(state)
    shardings = jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                                       is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    nnx.update(model, jax.device_put(state, shardings))
    return model
