"""Kimi Delta Attention layer (Kimi Linear, Moonshot AI, 2025)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rewy_jax import ops
from rewy_jax.layers.base import (DeltaRuleLayer, check_gate_mode, check_init_ranges, init_A_log,
                                  init_dt_bias)
from rewy_jax.layers.modules import decay_gate, get_value
from rewy_jax.layers.partitioning import HEADS, param

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(DeltaRuleLayer):
    """Kimi Delta Attention (KDA): a decay per key channel, as FLA's ``KimiDeltaAttention``.

    Per q/k head h (K channels; repeated over its value heads with num_v_heads > num_heads):

        β_t = sigmoid(x_t W_β)                      (×2 with allow_neg_eigval)        [H]
        a_t = (x_t W_f↓) W_f↑                       low rank (gate_low_rank_dim)      [H, K]
        g_t = −exp(A_log_h) · softplus(a_t + dt_bias)                                 [H, K]
              (gate_mode="bounded": g_t = gate_lower_bound · sigmoid(exp(A_log_h)·(a_t + dt_bias)))
        S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ                 [K, V]
        o_t = K^{−1/2} · S_tᵀ q_t
        y_t = (RMSNorm(o_t) ⊙ sigmoid((x_t W_g↓) W_g↑ + b_g)) W_o

    FLA's initialisation: A = exp(A_log) ~ U(1, 16) per head, dt_bias = 0, projections
    N(0, 0.02²); gate_low_rank_dim defaults to head_v_dim. The bounded gate keeps g above
    gate_lower_bound (KDA's "safe gate"), which lets the chunked kernels use their fast path.

    Extra options: gate_mode ("softplus" | "bounded"), gate_lower_bound (−5.0), A_init_range
    ((1, 16)), dt_init_range (None: dt_bias = 0 as FLA; or a range: softplus(dt_bias) log-uniform in
    it, Mamba2-style). Short-context tasks learn faster from weaker initial decay, e.g.
    A_init_range=(1, 2), dt_init_range=(1e-3, 1e-2).
    Others: see :class:`~rewy_jax.layers.base.DeltaRuleLayer`.
    """

    _chunk_op = staticmethod(ops.chunk_kda)
    _recurrent_op = staticmethod(ops.fused_recurrent_kda)
    _norm_activation = "sigmoid"
    _low_rank_output_gate = True

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 rngs: nnx.Rngs, gate_mode: str = "softplus", gate_lower_bound: float = -5.0,
                 A_init_range: tuple[float, float] = (1.0, 16.0),
                 dt_init_range: tuple[float, float] | None = None, **options):
        check_gate_mode(gate_mode, gate_lower_bound)
        check_init_ranges(A_init_range, dt_init_range)
        self.A_init_range, self.dt_init_range = tuple(A_init_range), dt_init_range
        options.setdefault("use_gate", True)
        super().__init__(hidden_size, num_heads, head_dim, rngs=rngs, **options)
        self.gate_mode = gate_mode
        self.gate_lower_bound = float(gate_lower_bound)
        self._init_decay(rngs)
        self._init_update_gates(rngs)

    def _chunk_gate_options(self):
        # bounded gates are ≥ gate_lower_bound by construction: declare it, so the GPU kernels
        # may take their centred fast path (rewy-math §3) when the bound allows
        if self.gate_mode == "bounded":
            return {"gate_lower_bound": self.gate_lower_bound}
        return {}

    def _init_decay(self, rngs):
        H, K = self.num_heads, self.head_dim
        self.f_proj = self._low_rank(H * K, rngs=rngs)
        self.A_log = param(init_A_log(rngs.params(), (H,), self.A_init_range), (HEADS,))
        if self.dt_init_range is None:  # FLA's KDA: dt_bias = 0
            self.dt_bias = param(jnp.zeros((H * K,), jnp.float32), (HEADS,))
        else:
            self.dt_bias = param(init_dt_bias(rngs.params(), (H * K,), self.dt_init_range), (HEADS,))

    def _init_update_gates(self, rngs):
        self.b_proj = self._dense(self.hidden_size, self.num_heads, rngs=rngs)  # β per q/k head

    def _decay(self, x):
        """g [B, T, H_v, K] fp32 (per q/k head, repeated over its value heads)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        g = decay_gate(self.f_proj(x).reshape(B, T, H, K), get_value(self.A_log),
                       get_value(self.dt_bias).reshape(H, K), mode=self.gate_mode,
                       lower_bound=self.gate_lower_bound)
        return self._to_v_heads(g)

    def _gates(self, x):
        return self._decay(x), self._to_v_heads(self._beta(self.b_proj(x)))
