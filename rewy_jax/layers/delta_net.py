"""DeltaNet layer (Yang et al., 2024, "Parallelizing Linear Transformers with the Delta Rule")."""

from __future__ import annotations

from flax import nnx

from rewy_jax import ops
from rewy_jax.layers.base import DeltaRuleLayer

__all__ = ["DeltaNet"]


class DeltaNet(DeltaRuleLayer):
    """DeltaNet: the delta rule with no decay, as FLA's ``fla.layers.DeltaNet``.

    Per value head (shapes per token; q, k ∈ R^K L2-normalised, v ∈ R^V):

        β_t = sigmoid(x_t W_β)              (×2 with allow_neg_eigval)            [H_v]
        S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ                          [K, V]
        o_t = K^{−1/2} · S_tᵀ q_t

    then ``o_norm`` (RMSNorm; gated when ``use_gate=True``, default False as in FLA) and ``o_proj``.
    Parameters: q/k_proj [hidden, H·K], v_proj [hidden, H_v·V], b_proj [hidden, H_v], the three
    conv kernels, o_norm weight [V], o_proj [H_v·V, hidden] (+ g_proj with use_gate).

    Example::

        layer = DeltaNet(hidden_size=256, num_heads=4, rngs=nnx.Rngs(0))
        y = layer(x)                                  # x: [B, T, 256] -> y: [B, T, 256]

    Options: see :class:`~rewy_jax.layers.base.DeltaRuleLayer`.
    """

    _chunk_op = staticmethod(ops.chunk_delta_rule)
    _recurrent_op = staticmethod(ops.fused_recurrent_delta_rule)
    _default_use_gate = False

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 rngs: nnx.Rngs, **options):
        super().__init__(hidden_size, num_heads, head_dim, rngs=rngs, **options)
        self.b_proj = self._dense(hidden_size, self.num_v_heads, rngs=rngs)

    def _gates(self, x):
        return (self._beta(self.b_proj(x)),)  # β [B, T, H_v]
