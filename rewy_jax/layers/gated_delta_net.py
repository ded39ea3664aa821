"""Gated DeltaNet layer (Yang, Kautz & Hatamizadeh, ICLR 2025)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from rewy_jax import ops
from rewy_jax.layers.base import DeltaRuleLayer, check_gate_mode
from rewy_jax.layers.modules import decay_gate, inverse_softplus

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(DeltaRuleLayer):
    """Gated DeltaNet (GDN): the delta rule with a scalar decay per head, as FLA's ``GatedDeltaNet``.

    Per value head (q, k ∈ R^K L2-normalised, v ∈ R^V):

        β_t = sigmoid(x_t W_β)                       (×2 with allow_neg_eigval)     [H_v]
        g_t = −exp(A_log) · softplus(x_t W_a + dt_bias)                              [H_v]
              (gate_mode="bounded": g_t = gate_lower_bound · sigmoid(exp(A_log)·(x_t W_a + dt_bias)))
        S_t = (I − β_t k_t k_tᵀ) e^{g_t} S_{t−1} + β_t k_t v_tᵀ                       [K, V]
        o_t = K^{−1/2} · S_tᵀ q_t
        y_t = (RMSNorm(o_t) ⊙ silu(x_t W_g)) W_o

    FLA's defaults and initialisation: expand_v = 2, output gate on, A = exp(A_log) ~ U(0, 16),
    dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1] (floored at 1e-4), projections N(0, 0.02²).

    Extra options: gate_mode ("softplus" | "bounded"), gate_lower_bound (−5.0, bounded mode only).
    Others: see :class:`~rewy_jax.layers.base.DeltaRuleLayer`.
    """

    _chunk_op = staticmethod(ops.chunk_gated_delta_rule)
    _recurrent_op = staticmethod(ops.fused_recurrent_gated_delta_rule)
    _default_expand_v = 2.0
    _norm_activation = "swish"

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 rngs: nnx.Rngs, gate_mode: str = "softplus", gate_lower_bound: float = -5.0,
                 **options):
        check_gate_mode(gate_mode, gate_lower_bound)
        super().__init__(hidden_size, num_heads, head_dim, rngs=rngs, **options)
        self.gate_mode = gate_mode
        self.gate_lower_bound = float(gate_lower_bound)
        Hv = self.num_v_heads
        self.a_proj = self._dense(hidden_size, Hv, rngs=rngs)
        self.b_proj = self._dense(hidden_size, Hv, rngs=rngs)
        # A ~ U(0, 16) (kept away from 0 so A_log is finite); no weight decay on A_log, dt_bias.
        A = jax.random.uniform(rngs.params(), (Hv,), jnp.float32, 0.0, 16.0)
        self.A_log = nnx.Param(jnp.log(jnp.maximum(A, 1e-4)))
        dt_min, dt_max, dt_floor = 1e-3, 1e-1, 1e-4
        u = jax.random.uniform(rngs.params(), (Hv,), jnp.float32)
        dt = jnp.maximum(jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)),
                         dt_floor)
        self.dt_bias = nnx.Param(inverse_softplus(dt))

    def _gates(self, x):
        g = decay_gate(self.a_proj(x), self.A_log.value, self.dt_bias.value, mode=self.gate_mode,
                       lower_bound=self.gate_lower_bound)  # [B, T, H_v]
        return g, self._beta(self.b_proj(x))
