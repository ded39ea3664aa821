"""Linen interop: the NNX layers as Linen modules through ``flax.nnx.bridge``.

    from rewy_jax.layers import GatedDeltaNet, to_linen

    model = to_linen(GatedDeltaNet, hidden_size=256, num_heads=4)   # a flax.linen.Module
    variables = model.init(jax.random.key(0), x)                     # {"params": ...}
    y = model.apply(variables, x)

Inside a Linen ``@nn.compact`` body, ``to_linen(GatedDeltaNet, ...)(x)`` works as any submodule.
Keyword call options (``cu_seqlens=``) pass through ``apply``. Decoding with a cache is an NNX
feature (``init_cache`` / ``decode=True``); from Linen, run the NNX layer via
``nnx.bridge.to_linen`` with ``method=`` or use the NNX API directly.
"""

from __future__ import annotations

from flax import nnx

__all__ = ["to_linen"]


def to_linen(layer_cls, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
             name: str | None = None, **options):
    """A Linen module wrapping ``layer_cls(hidden_size, num_heads, head_dim, rngs=..., **options)``.

    Parameters live in the Linen ``"params"`` collection, initialised from the ``"params"`` RNG
    stream passed to ``init``.
    """
    return nnx.bridge.to_linen(layer_cls, hidden_size, num_heads, head_dim, name=name, **options)
