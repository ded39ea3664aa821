"""Gated DeltaNet-2 layer: KDA's per-channel decay with separate erase and write gates."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rewy_jax import ops
from rewy_jax.layers.kda import KimiDeltaAttention

__all__ = ["GatedDeltaNet2"]


class GatedDeltaNet2(KimiDeltaAttention):
    """Gated DeltaNet-2 (GDN2): KDA with β split into an erase gate b (key axis) and a write gate w
    (value axis), each from its own low-rank projection.

    Per q/k head h (repeated over its value heads), per value head for w:

        g_t = −exp(A_log_h) · softplus((x_t W_f↓) W_f↑ + dt_bias)   (or bounded)       [H, K]
        b_t = sigmoid((x_t W_b↓) W_b↑)               (×2 with allow_neg_eigval)        [H, K]
        w_t = sigmoid((x_t W_w↓) W_w↑)                                                 [H_v, V]
        S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(e^{g_t}) S_{t−1} + k_t (w_t ⊙ v_t)ᵀ          [K, V]
        o_t = K^{−1/2} · S_tᵀ q_t
        y_t = (RMSNorm(o_t) ⊙ sigmoid((x_t W_g↓) W_g↑ + b_g)) W_o

    With b_t = w_t = β_t·1 this is KDA (rewy-math §2). Initialisation as KDA; the b and w
    projections are N(0, 0.02²), so both gates start near 1/2 like KDA's β.

    Extra options as KDA: gate_mode, gate_lower_bound, A_init_range, dt_init_range.
    Others: see :class:`~rewy_jax.layers.base.DeltaRuleLayer`.
    """

    _chunk_op = staticmethod(ops.chunk_gdn2)
    _recurrent_op = staticmethod(ops.fused_recurrent_gdn2)

    def _init_update_gates(self, rngs):
        # Replaces KDA's scalar β projection: erase gate per key channel of each q/k head, write
        # gate per value channel of each value head.
        self.b_proj = self._low_rank(self.key_dim, rngs=rngs)
        self.w_proj = self._low_rank(self.value_dim, rngs=rngs)

    def _gates(self, x):
        B, T, _ = x.shape
        b = self._beta(self.b_proj(x)).reshape(B, T, self.num_heads, self.head_dim)
        w = jax.nn.sigmoid(self.w_proj(x).astype(jnp.float32))
        return self._decay(x), self._to_v_heads(b), w.reshape(B, T, self.num_v_heads, self.head_v_dim)
