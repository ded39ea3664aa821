"""rewy-jax: delta-rule attention (DeltaNet, GDN, KDA, GDN2) for JAX with ReWY's reduced backward.

Public ops mirror flash-linear-attention's names; see :mod:`rewy_jax.ops`.
"""

from rewy_jax.ops import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gdn2,
    chunk_kda,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gdn2,
    fused_recurrent_kda,
)

__version__ = "0.1.0"


def __getattr__(name):
    # ``rewy_jax.layers`` (the Flax layers) is imported on first use, so that users of the ops
    # alone do not pay for importing Flax.
    if name == "layers":
        import importlib

        return importlib.import_module("rewy_jax.layers")
    raise AttributeError(f"module 'rewy_jax' has no attribute {name!r}")


__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_gdn2",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "fused_recurrent_gdn2",
    "layers",
]
