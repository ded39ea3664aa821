"""Flax NNX layers of the delta-rule family, with FLA's architecture and initialisation.

    from flax import nnx
    from rewy_jax.layers import GatedDeltaNet

    layer = GatedDeltaNet(hidden_size=512, num_heads=4, head_dim=64, rngs=nnx.Rngs(0))
    y = layer(x)                                   # [B, T, 512] -> [B, T, 512]

    layer.init_cache(batch=B)                      # decoding: recurrent + conv state (nnx.Cache)
    y_prompt = layer(prompt, decode=True)          # prefill (chunked form)
    y_next = layer(x_next, decode=True)            # steps (token-recurrent form)

Layers: :class:`DeltaNet`, :class:`GatedDeltaNet`, :class:`KimiDeltaAttention`,
:class:`GatedDeltaNet2`. Constructor options are documented on
:class:`~rewy_jax.layers.base.DeltaRuleLayer`; Linen users wrap them with :func:`to_linen`.
"""

from rewy_jax.layers.base import DeltaRuleLayer, LowRankProjection
from rewy_jax.layers.delta_net import DeltaNet
from rewy_jax.layers.gated_delta_net import GatedDeltaNet
from rewy_jax.layers.gdn2 import GatedDeltaNet2
from rewy_jax.layers.kda import KimiDeltaAttention
from rewy_jax.layers.linen import to_linen
from rewy_jax.layers.modules import GatedRMSNorm, RMSNorm, ShortConvolution, decay_gate

LAYERS = {
    "deltanet": DeltaNet,
    "gdn": GatedDeltaNet,
    "kda": KimiDeltaAttention,
    "gdn2": GatedDeltaNet2,
}

__all__ = [
    "DeltaNet",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "GatedDeltaNet2",
    "DeltaRuleLayer",
    "LowRankProjection",
    "ShortConvolution",
    "RMSNorm",
    "GatedRMSNorm",
    "decay_gate",
    "to_linen",
    "LAYERS",
]
