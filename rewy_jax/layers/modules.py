"""Building blocks of the delta-rule layers: short causal convolution, RMS norms, the decay gate.

Shapes: B batch, T time, D channels. Every module here computes in the dtype its owner asks for
and keeps its parameters in ``param_dtype`` (fp32 by default).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rewy_jax.layers.partitioning import CONV, HEADS, NORM, param

__all__ = ["ShortConvolution", "RMSNorm", "GatedRMSNorm", "decay_gate", "inverse_softplus",
           "GATE_MODES", "seq_ids", "get_value", "set_value"]


def get_value(var):
    """A Variable's array (``get_value`` on flax ≥ 0.12, where ``.value`` is deprecated)."""
    return var.get_value() if hasattr(var, "get_value") else var.value


def set_value(var, value):
    """Replace a Variable's array (works on old and new flax)."""
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value

GATE_MODES = ("softplus", "bounded")


def inverse_softplus(y):
    """x with softplus(x) = y, for y > 0 (used to initialise ``dt_bias``)."""
    return y + jnp.log(-jnp.expm1(-y))


def decay_gate(a, A_log, dt_bias, *, mode: str = "softplus", lower_bound: float = -5.0):
    """Per-token log-decay g ≤ 0 from a pre-activation, in fp32.

    ``mode="softplus"`` (Mamba2/GDN/KDA):  g = −exp(A_log) · softplus(a + dt_bias)   ∈ (−∞, 0]
    ``mode="bounded"``  (KDA "safe gate"): g = lower_bound · sigmoid(exp(A_log) · (a + dt_bias))
                                                                          ∈ (lower_bound, 0)

    ``a`` is [..., H] (scalar gate per head, A_log and dt_bias [H]) or [..., H, K] (per key
    channel, A_log [H] broadcast over K, dt_bias [H, K]). The bounded form keeps every token's
    decay above ``lower_bound`` so a chunk's cumulative decay stays in fp32's exp range.
    """
    a = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    A = jnp.exp(A_log.astype(jnp.float32))
    if a.ndim > 0 and A.ndim == 1 and a.shape[-1] != A.shape[0]:
        A = A[:, None]  # per-head rate over a per-channel gate [..., H, K]
    if mode == "softplus":
        return -A * jax.nn.softplus(a)
    if mode == "bounded":
        return lower_bound * jax.nn.sigmoid(A * a)
    raise ValueError(f"gate_mode must be one of {GATE_MODES}; got {mode!r}")


def seq_ids(cu_seqlens, T: int):
    """Sequence index [T] and position within its sequence [T] of each packed token."""
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    return seq, t - cu[seq]


class ShortConvolution(nnx.Module):
    """Causal depthwise convolution over time followed by SiLU (FLA's ``ShortConvolution``).

        y_t = silu( Σ_{j=0}^{W−1} kernel[j] ⊙ x_{t−(W−1)+j}  + bias )        x, y: [B, T, D]

    ``kernel`` is [W, D] (FLA's Conv1d weight [D, 1, W] transposed; kernel[W−1] multiplies the
    current token). Tokens before the start of a sequence are zeros, or — when decoding — the last
    W−1 inputs kept in the ``cache`` ([B, W−1, D], an ``nnx.Cache`` made by :meth:`init_cache`).
    With ``cu_seqlens`` (B = 1, packed sequences) no tap crosses a sequence boundary.
    """

    def __init__(self, features: int, kernel_size: int = 4, *, use_bias: bool = False,
                 activation: bool = True, kernel_init=nnx.initializers.normal(0.02),
                 dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if kernel_size < 1:
            raise ValueError(f"conv_size must be ≥ 1; got {kernel_size}")
        self.features = features
        self.kernel_size = kernel_size
        self.activation = activation
        self.dtype = dtype
        self.kernel = param(kernel_init(rngs.params(), (kernel_size, features), param_dtype),
                            (CONV, HEADS))
        self.bias = param(jnp.zeros((features,), param_dtype), (HEADS,)) if use_bias else None
        self.cache = nnx.data(None)  # nnx.Cache [B, W−1, D] after init_cache

    def init_cache(self, batch: int, dtype=jnp.float32):
        """Zero history: ``cache`` [batch, W−1, D] (batch = N sequences when using cu_seqlens)."""
        self.cache = nnx.Cache(jnp.zeros((batch, self.kernel_size - 1, self.features), dtype))

    def __call__(self, x, *, cu_seqlens=None, decode: bool = False, context_axis=None):
        """x: [B, T, D] -> [B, T, D]; with ``decode`` reads and advances ``cache``.

        context_axis: inside shard_map, the mesh axis T is split over (context parallelism):
        the first W−1 taps read the previous device's last W−1 tokens (one ``ppermute``).
        """
        W = self.kernel_size
        dtype = self.dtype or jnp.result_type(x.dtype, self.kernel.dtype)
        x = x.astype(dtype)
        B, T, D = x.shape
        if decode and self.cache is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch, dtype) first")
        n_hist = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        hist = (get_value(self.cache).astype(dtype) if decode
                else jnp.zeros((n_hist, W - 1, D), dtype))
        if context_axis is not None and W > 1:
            if decode or cu_seqlens is not None:
                raise NotImplementedError("ShortConvolution with context_axis supports neither "
                                          "decode=True nor cu_seqlens; got "
                                          f"decode={decode}, cu_seqlens={cu_seqlens is not None}")
            if T < W - 1:
                raise ValueError(f"context_axis needs ≥ conv_size − 1 = {W - 1} tokens per "
                                 f"device; got T = {T}")
            n = jax.lax.axis_size(context_axis)
            # device i receives device i−1's last W−1 tokens; device 0 receives zeros
            hist = jax.lax.ppermute(x[:, T - (W - 1):], context_axis,
                                    [(i, i + 1) for i in range(n - 1)])
        if decode and hist.shape[0] != n_hist:
            raise ValueError(f"the decode cache holds {hist.shape[0]} sequences but the input has "
                             f"{n_hist}; call init_cache with batch={n_hist}")
        if cu_seqlens is None:
            xe = jnp.concatenate([hist, x], axis=1)  # [B, W−1+T, D]
            taps = [xe[:, j:j + T] for j in range(W)]
            new_hist = xe[:, xe.shape[1] - (W - 1):]
        else:
            taps, new_hist = self._varlen_taps(x, hist, cu_seqlens)
        k = get_value(self.kernel).astype(dtype)
        y = sum(taps[j] * k[j] for j in range(W))
        if self.bias is not None:
            y = y + get_value(self.bias).astype(dtype)
        if decode:
            set_value(self.cache, new_hist.astype(get_value(self.cache).dtype))
        return jax.nn.silu(y) if self.activation else y

    def _varlen_taps(self, x, hist, cu_seqlens):
        """Gather each tap from the packed tokens or, before a sequence's start, its history."""
        W = self.kernel_size
        T = x.shape[1]
        N = hist.shape[0]
        src = jnp.concatenate([x[0], hist.reshape(N * (W - 1), -1)], axis=0)  # [T + N(W−1), D]
        seq, pos = seq_ids(cu_seqlens, T)
        t = jnp.arange(T, dtype=jnp.int32)

        def index(tok, s, p):  # token tok of sequence s at position p (p < 0: history slot)
            return jnp.where(p >= 0, tok, T + s * (W - 1) + (W - 1) + p)

        taps = []
        for j in range(W):
            lag = W - 1 - j
            taps.append(src[index(t - lag, seq, pos - lag)][None])
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        lens = cu[1:] - cu[:-1]
        s = jnp.arange(N, dtype=jnp.int32)[:, None]
        p = lens[:, None] - (W - 1) + jnp.arange(W - 1, dtype=jnp.int32)[None]  # [N, W−1]
        new_hist = src[index(cu[:-1, None] + p, s, p)]
        return taps, new_hist


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x²) + eps) ⊙ weight over the last axis, computed in fp32."""

    def __init__(self, features: int, *, eps: float = 1e-5, dtype=None, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        del rngs
        self.eps = eps
        self.dtype = dtype
        self.weight = param(jnp.ones((features,), param_dtype), (NORM,))

    def __call__(self, x):
        out_dtype = self.dtype or x.dtype
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * get_value(self.weight).astype(jnp.float32)).astype(out_dtype)


class GatedRMSNorm(RMSNorm):
    """FLA's ``FusedRMSNormGated``: y = RMSNorm(x) ⊙ act(gate), act = SiLU ("swish") or sigmoid."""

    def __init__(self, features: int, *, activation: str = "swish", eps: float = 1e-5, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"activation must be 'swish' or 'sigmoid'; got {activation!r}")
        super().__init__(features, eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.activation = activation

    def __call__(self, x, gate):
        out_dtype = self.dtype or x.dtype
        y = super().__call__(x.astype(jnp.float32)).astype(jnp.float32)
        gf = gate.astype(jnp.float32)
        act = jax.nn.sigmoid(gf) if self.activation == "sigmoid" else jax.nn.silu(gf)
        return (y * act).astype(out_dtype)
