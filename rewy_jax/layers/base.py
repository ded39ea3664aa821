"""The machinery the four delta-rule layers share (FLA's layer architecture, in Flax NNX).

Every layer maps x [B, T, hidden_size] -> y [B, T, hidden_size] as

    q = silu(conv_q(x W_q)),  k = silu(conv_k(x W_k)),  v = silu(conv_v(x W_v))   per head
    (gates from x: β, g, b, w — see each layer)
    o = op(q, k, v, gates; use_qk_l2norm=True)             the delta-rule recurrence (rewy-math §2)
    y = ( RMSNorm(o) ⊙ act(x W_g) ) W_o                     (or plain RMSNorm when use_gate=False)

with H = ``num_heads`` query/key heads of size K = ``head_dim`` and H_v = ``num_v_heads`` value
heads of size V = ``head_v_dim`` (= expand_v · K). With H_v > H (grouped value heads) every q/k
head serves H_v / H value heads: q, k (and per-q/k-head gates) are repeated per group before the
op, so the recurrent state is [B, H_v, K, V].

Subclasses add their gate parameters in ``__init__`` and implement ``_gates(x)``, returning the op's
gate arguments at value-head resolution.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from rewy_jax import validate
from rewy_jax.layers.modules import (GATE_MODES, GatedRMSNorm, RMSNorm, ShortConvolution,
                                      get_value, inverse_softplus, set_value)
from rewy_jax.layers.partitioning import EMBED, HEADS, RANK, with_axes

__all__ = ["DeltaRuleLayer", "LowRankProjection"]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def check_gate_mode(gate_mode, gate_lower_bound):
    if gate_mode not in GATE_MODES:
        raise ValueError(f"gate_mode must be one of {GATE_MODES}; got {gate_mode!r}")
    if gate_mode == "bounded" and not -40.0 <= float(gate_lower_bound) < 0:
        raise ValueError(f"gate_lower_bound must lie in [-40, 0) (a log-decay); got {gate_lower_bound!r}")


def _uniform(bound):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def check_init_ranges(A_init_range, dt_init_range):
    lo, hi = A_init_range
    if not 0 <= lo <= hi:
        raise ValueError(f"A_init_range must be (low, high) with 0 ≤ low ≤ high; got {A_init_range!r}")
    if dt_init_range is not None and not 0 < dt_init_range[0] <= dt_init_range[1]:
        raise ValueError(f"dt_init_range must be (low, high) with 0 < low ≤ high; got {dt_init_range!r}")


def init_A_log(key, shape, A_init_range):
    """log A with A ~ U(A_init_range), floored at 1e-4 so that A_log is finite."""
    A = jax.random.uniform(key, shape, jnp.float32, *A_init_range)
    return jnp.log(jnp.maximum(A, 1e-4))


def init_dt_bias(key, shape, dt_init_range):
    """dt_bias = softplus⁻¹(dt), dt log-uniform in dt_init_range, floored at 1e-4 (Mamba2)."""
    lo, hi = dt_init_range
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(hi) - math.log(lo)) + math.log(lo)), 1e-4)
    return inverse_softplus(dt)


class LowRankProjection(nnx.Module):
    """x [..., D_in] -> (x W_down) W_up (+ bias) [..., D_out]: FLA's two-Linear ``nn.Sequential``."""

    def __init__(self, in_features: int, rank: int, out_features: int, *, use_bias: bool = False,
                 kernel_init, dtype, param_dtype, rngs: nnx.Rngs):
        self.down = nnx.Linear(in_features, rank, use_bias=False,
                               kernel_init=with_axes(kernel_init, (EMBED, RANK)),
                               dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.up = nnx.Linear(rank, out_features, use_bias=use_bias,
                             kernel_init=with_axes(kernel_init, (RANK, HEADS)),
                             bias_init=with_axes(nnx.initializers.zeros_init(), (HEADS,)),
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.up(self.down(x))


class DeltaRuleLayer(nnx.Module):
    """Base of :class:`DeltaNet`, :class:`GatedDeltaNet`, :class:`KimiDeltaAttention`,
    :class:`GatedDeltaNet2`: ``Layer(hidden_size, num_heads, head_dim=None, *, rngs, **options)``;
    ``head_dim`` defaults to hidden_size // num_heads.

    Common options (keyword-only):
      num_v_heads: value heads H_v, a multiple of num_heads (default num_heads).
      expand_v / head_v_dim: value head size V = expand_v · head_dim, or given directly.
      use_short_conv, conv_size (4), conv_bias (False): the causal depthwise convs with SiLU
        (without them q, k, v get a plain SiLU, as in FLA). conv_init: "normal" (FLA's model
        init, N(0, initializer_range²)) or "uniform" (PyTorch's Conv1d default, U(±conv_size^−½)).
      allow_neg_eigval: β (and GDN2's erase gate b) = 2·sigmoid(·) ∈ (0, 2) instead of (0, 1).
      use_gate: output gate (RMSNorm(o) ⊙ act(x W_g)); default per layer as in FLA.
      gate_low_rank_dim: rank of the low-rank gate projections of KDA/GDN2 (default head_v_dim).
      norm_eps (1e-5), initializer_range (0.02; normal init of every projection and conv kernel,
        as FLA's ``_init_weights``), dtype (computation; None = promote input and params),
        param_dtype (fp32).
      backend, chunk_size, policy, backward, interpret: passed to the chunked op.
      recurrent_max_len (16): in decode mode, inputs of at most this many tokens take the
        token-recurrent ``fused_recurrent_*`` form; longer prompts take the chunked form.
    """

    # Filled in by subclasses (as staticmethods wrapping the public ops).
    _chunk_op: Callable = None
    _recurrent_op: Callable = None
    _default_expand_v: float = 1.0
    _default_use_gate: bool = True
    _norm_activation: str = "swish"
    _low_rank_output_gate: bool = False

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 rngs: nnx.Rngs, num_v_heads: int | None = None, expand_v: float | None = None,
                 head_v_dim: int | None = None, use_short_conv: bool = True, conv_size: int = 4,
                 conv_bias: bool = False, conv_init: str = "normal", allow_neg_eigval: bool = False,
                 use_gate: bool | None = None, gate_low_rank_dim: int | None = None, norm_eps: float = 1e-5,
                 initializer_range: float = 0.02, dtype=None, param_dtype=jnp.float32,
                 backend: str | None = None, chunk_size: int = 64, policy: str = "recompute",
                 backward: str = "rewy", interpret: bool = False, recurrent_max_len: int = 16):
        _positive_int("hidden_size", hidden_size)
        _positive_int("num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"head_dim: hidden_size={hidden_size} is not divisible by "
                                 f"num_heads={num_heads}; pass head_dim explicitly")
            head_dim = hidden_size // num_heads
        _positive_int("head_dim", head_dim)
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        _positive_int("num_v_heads", num_v_heads)
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads} "
                             "(grouped value heads share a q/k head)")
        if head_v_dim is not None and expand_v is not None:
            raise ValueError("pass either expand_v or head_v_dim, not both")
        if head_v_dim is None:
            expand_v = self._default_expand_v if expand_v is None else expand_v
            if not expand_v > 0 or not math.isclose(head_dim * expand_v, round(head_dim * expand_v)):
                raise ValueError(f"expand_v={expand_v!r} times head_dim={head_dim} must be a positive "
                                 "integer (the value head size)")
            head_v_dim = int(round(head_dim * expand_v))
        _positive_int("head_v_dim", head_v_dim)
        if use_short_conv:
            _positive_int("conv_size", conv_size)
        if conv_init not in ("normal", "uniform"):
            raise ValueError(f"conv_init must be 'normal' or 'uniform'; got {conv_init!r}")
        if gate_low_rank_dim is not None:
            _positive_int("gate_low_rank_dim", gate_low_rank_dim)
        _positive_int("recurrent_max_len", recurrent_max_len)
        validate.check_options(chunk_size=chunk_size, policy=policy, backward=backward,
                               backend=backend, scale=None)

        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_dim = head_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * head_v_dim
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.use_gate = self._default_use_gate if use_gate is None else bool(use_gate)
        self.gate_low_rank_dim = head_v_dim if gate_low_rank_dim is None else gate_low_rank_dim
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.op_options = dict(backend=backend, chunk_size=chunk_size, policy=policy,
                               backward=backward, interpret=interpret)
        self.recurrent_max_len = recurrent_max_len

        self.initializer_range = initializer_range
        init = nnx.initializers.normal(initializer_range)
        lin = lambda i, o: self._dense(i, o, rngs=rngs)  # noqa: E731
        self.q_proj = lin(hidden_size, self.key_dim)
        self.k_proj = lin(hidden_size, self.key_dim)
        self.v_proj = lin(hidden_size, self.value_dim)
        if use_short_conv:
            # "normal": FLA's model init, N(0, initializer_range²); "uniform": PyTorch's Conv1d
            # default U(±1/sqrt(conv_size)), what a freshly built FLA layer holds.
            conv_kernel_init = init if conv_init == "normal" else _uniform(conv_size ** -0.5)
            conv = lambda d: ShortConvolution(d, conv_size, use_bias=conv_bias,  # noqa: E731
                                              kernel_init=conv_kernel_init, dtype=dtype,
                                              param_dtype=param_dtype, rngs=rngs)
            self.q_conv1d = conv(self.key_dim)
            self.k_conv1d = conv(self.key_dim)
            self.v_conv1d = conv(self.value_dim)
        if self.use_gate:
            if self._low_rank_output_gate:
                self.g_proj = self._low_rank(self.value_dim, use_bias=True, rngs=rngs)
            else:
                self.g_proj = lin(hidden_size, self.value_dim)
            self.o_norm = GatedRMSNorm(head_v_dim, activation=self._norm_activation, eps=norm_eps,
                                       param_dtype=param_dtype)
        else:
            self.o_norm = RMSNorm(head_v_dim, eps=norm_eps, param_dtype=param_dtype)
        # (the norms' weights and the convolutions' kernels are annotated in layers.modules)
        self.o_proj = self._dense(self.value_dim, hidden_size, rngs=rngs, axes=(HEADS, EMBED))
        # nnx.data: the attribute holds data (an nnx.Cache) once init_cache has run.
        self.recurrent_state = nnx.data(None)  # nnx.Cache [B, H_v, K, V] fp32 after init_cache

    # -- helpers for subclasses -----------------------------------------------------------------
    def _dense(self, in_features, out_features, *, rngs, use_bias=False, axes=(EMBED, HEADS)):
        """A projection with FLA's init: kernel ~ N(0, initializer_range²), bias 0; ``axes``:
        the kernel's logical axis names (layers.partitioning)."""
        return nnx.Linear(in_features, out_features, use_bias=use_bias,
                          kernel_init=with_axes(nnx.initializers.normal(self.initializer_range),
                                                axes),
                          bias_init=with_axes(nnx.initializers.zeros_init(), axes[1:]),
                          dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)

    def _low_rank(self, out_features, *, use_bias=False, rngs):
        """hidden_size -> gate_low_rank_dim -> out_features (FLA's KDA gate projections)."""
        return LowRankProjection(self.hidden_size, self.gate_low_rank_dim, out_features,
                                 use_bias=use_bias,
                                 kernel_init=nnx.initializers.normal(self.initializer_range),
                                 dtype=self.dtype, param_dtype=self.param_dtype, rngs=rngs)

    def _beta(self, logits):
        """β = sigmoid(logits) (×2 with allow_neg_eigval), fp32."""
        beta = jax.nn.sigmoid(logits.astype(jnp.float32))
        return 2.0 * beta if self.allow_neg_eigval else beta

    def _to_v_heads(self, x):
        """[B, T, H, ...] per q/k head -> [B, T, H_v, ...] (each head repeated for its group)."""
        group = self.num_v_heads // self.num_heads
        return x if group == 1 else jnp.repeat(x, group, axis=2)

    def _chunk_gate_options(self):
        """Extra keywords of the chunked op about the gates (none by default)."""
        return {}

    def _gates(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    # -- decoding ---------------------------------------------------------------------------------
    def init_cache(self, batch: int, dtype=None):
        """Create the decode cache (zeros) for ``batch`` sequences.

        ``recurrent_state``: nnx.Cache [batch, H_v, K, V] fp32; each conv's ``cache``: nnx.Cache
        [batch, conv_size − 1, D] in ``dtype`` (default: the layer's dtype, else fp32). With
        ``cu_seqlens`` prefill, ``batch`` is the number of packed sequences N. Calling it again
        resets the cache.
        """
        _positive_int("batch", batch)
        dtype = dtype or self.dtype or jnp.float32
        self.recurrent_state = nnx.Cache(
            jnp.zeros((batch, self.num_v_heads, self.head_dim, self.head_v_dim), jnp.float32))
        if self.use_short_conv:
            for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
                conv.init_cache(batch, dtype)

    # -- forward ------------------------------------------------------------------------------------
    def __call__(self, x, *, cu_seqlens=None, decode: bool = False, context_axis=None):
        """x: [B, T, hidden_size] -> [B, T, hidden_size] in x's dtype.

        cu_seqlens: [N+1] int offsets of N sequences packed along T (B must be 1); convolutions and
          the recurrence restart at each sequence start.
        decode: continue from the cache (:meth:`init_cache`) and advance it; the input may be a
          prompt (prefill) or one or a few new tokens (a step, in the token-recurrent form).
        context_axis: inside ``jax.shard_map``, the mesh axis over which T is split (context
          parallelism: x is this device's slice; see rewy_jax.context_parallel). Not with decode.
        """
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [B, T, hidden_size={self.hidden_size}]; got {x.shape}")
        if cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T); "
                             f"x has B = {x.shape[0]}")
        if decode and context_axis is not None:
            raise NotImplementedError("decode=True with context_axis is not supported: decode "
                                      "one sequence per device (context_axis=None)")
        if decode and self.recurrent_state is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch, dtype) first")
        B, T, _ = x.shape
        H, Hv, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim

        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            cv = dict(cu_seqlens=cu_seqlens, decode=decode, context_axis=context_axis)
            q, k, v = self.q_conv1d(q, **cv), self.k_conv1d(k, **cv), self.v_conv1d(v, **cv)
        else:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        q = self._to_v_heads(q.reshape(B, T, H, K))
        k = self._to_v_heads(k.reshape(B, T, H, K))
        v = v.reshape(B, T, Hv, V)
        gates = self._gates(x)

        common = dict(use_qk_l2norm=True, cu_seqlens=cu_seqlens, output_final_state=decode,
                      initial_state=get_value(self.recurrent_state) if decode else None)
        # The token recurrence serves decode steps (a few tokens); packed (cu_seqlens) inputs and
        # long prompts take the chunked form, which is also what training uses.
        if decode and cu_seqlens is None and T <= self.recurrent_max_len:
            o, state = self._recurrent_op(q, k, v, *gates, **common)
        else:
            ctx = {} if context_axis is None else {"context_axis": context_axis}
            o, state = self._chunk_op(q, k, v, *gates, **common, **self.op_options,
                                      **self._chunk_gate_options(), **ctx)
        if decode:
            set_value(self.recurrent_state, state)

        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).reshape(B, T, Hv, V))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(B, T, Hv * V)).astype(x.dtype)
