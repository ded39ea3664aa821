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

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_gdn2",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "fused_recurrent_gdn2",
]
