"""Gated DeltaNet layer (Yang, Kautz & Hatamizadeh, ICLR 2025)."""

from __future__ import annotations

from flax import nnx

from rewy_jax import ops
from rewy_jax.layers.base import (DeltaRuleLayer, check_gate_mode, check_init_ranges, init_A_log,
                                  init_dt_bias)
from rewy_jax.layers.modules import decay_gate, get_value
from rewy_jax.layers.partitioning import HEADS, param

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

    Extra options: gate_mode ("softplus" | "bounded"), gate_lower_bound (−5.0, bounded mode only),
    A_init_range ((0, 16)), dt_init_range ((1e-3, 1e-1)) — Mamba2's names. Short-context tasks
    learn faster from weaker initial decay, e.g. A_init_range=(1, 2), dt_init_range=(1e-3, 1e-2).
    Others: see :class:`~rewy_jax.layers.base.DeltaRuleLayer`.
    """

    _chunk_op = staticmethod(ops.chunk_gated_delta_rule)
    _recurrent_op = staticmethod(ops.fused_recurrent_gated_delta_rule)
    _default_expand_v = 2.0
    _norm_activation = "swish"

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 rngs: nnx.Rngs, gate_mode: str = "softplus", gate_lower_bound: float = -5.0,
                 A_init_range: tuple[float, float] = (0.0, 16.0),
                 dt_init_range: tuple[float, float] = (1e-3, 1e-1), **options):
        check_gate_mode(gate_mode, gate_lower_bound)
        check_init_ranges(A_init_range, dt_init_range)
        super().__init__(hidden_size, num_heads, head_dim, rngs=rngs, **options)
        self.gate_mode = gate_mode
        self.gate_lower_bound = float(gate_lower_bound)
        Hv = self.num_v_heads
        self.a_proj = self._dense(hidden_size, Hv, rngs=rngs)
        self.b_proj = self._dense(hidden_size, Hv, rngs=rngs)
        # A ~ U(A_init_range) (kept away from 0 so A_log is finite); dt = softplus(dt_bias)
        # log-uniform in dt_init_range, floored at 1e-4 (Mamba2's init, as FLA).
        self.A_log = param(init_A_log(rngs.params(), (Hv,), A_init_range), (HEADS,))
        self.dt_bias = param(init_dt_bias(rngs.params(), (Hv,), dt_init_range), (HEADS,))

    def _gates(self, x):
        g = decay_gate(self.a_proj(x), get_value(self.A_log), get_value(self.dt_bias), mode=self.gate_mode,
                       lower_bound=self.gate_lower_bound)  # [B, T, H_v]
        return g, self._beta(self.b_proj(x))
