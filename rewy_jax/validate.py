"""Argument checks for the public ops: every mistake gets an error naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

BACKENDS = ("pallas", "pallas_gpu", "mosaic_gpu", "pallas_tpu", "xla", "reference")
POLICIES = ("recompute", "save")
BACKWARDS = ("rewy", "wy")


def _shape(x):
    return tuple(x.shape)


def check_float(name: str, x):
    if x is None:
        return
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
        dtype = getattr(x, "dtype", type(x).__name__)
        raise TypeError(f"{name} must be a floating-point array (bf16, fp16, fp32 or fp64); got dtype {dtype}")


def check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            raise ValueError(f"{name} is required: pass an array of shape [B, T, H, D]; got None")
        check_float(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [B, T, H, D]; got shape {_shape(x)}")
    if _shape(k) != _shape(q):
        raise ValueError(f"k must have the shape of q {_shape(q)} = [B, T, H, K]; got {_shape(k)}")
    if _shape(v)[:3] != _shape(q)[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] with B, T, H = {_shape(q)[:3]} of q; got {_shape(v)}")
    if q.shape[1] < 1:
        raise ValueError(f"the sequence length T (axis 1 of q) must be ≥ 1; got shape {_shape(q)}")


def check_per_token(name: str, x, q, last_dim: int | None, what: str):
    """x must be [B, T, H] (last_dim None) or [B, T, H, last_dim]."""
    B, T, H = q.shape[:3]
    want = (B, T, H) if last_dim is None else (B, T, H, last_dim)
    if x is None:
        spec = "[B, T, H]" if last_dim is None else f"[B, T, H, {what}]"
        raise ValueError(f"{name} is required: pass an array of shape {spec} = {want}; got None")
    check_float(name, x)
    if _shape(x) != want:
        spec = "[B, T, H]" if last_dim is None else f"[B, T, H, {what}]"
        raise ValueError(f"{name} must have shape {spec} = {want} to match q {_shape(q)}; got {_shape(x)}")


def check_options(*, chunk_size, policy, backward, backend, scale):
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two ≥ 16; got {chunk_size!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}; got {backward!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}; got {backend!r}")
    check_scale(scale)


def check_scale(scale):
    if scale is None or isinstance(scale, jax.core.Tracer):
        return
    if np.size(scale) != 1:
        raise ValueError(f"scale must be a positive number (one value); got shape "
                         f"{np.shape(scale)}")
    if not 0 < float(np.reshape(scale, ())) < float("inf"):
        raise ValueError(f"scale must be a positive number (finite); got {scale!r}")


def check_gate_lower_bound(bound, g, floor):
    """``gate_lower_bound``: None or a Python number in [floor, 0); a concrete g must respect it."""
    if bound is None:
        return
    if isinstance(bound, bool) or not isinstance(bound, (int, float, np.floating, np.integer)):
        raise TypeError(f"gate_lower_bound must be None or a Python float (a static bound, "
                        f"not an array); got {type(bound).__name__}")
    if not floor <= float(bound) < 0:
        raise ValueError(f"gate_lower_bound must lie in [{floor}, 0); got {bound!r}")
    c = _concrete(g)
    if c is not None and c.size and float(np.min(c)) < float(bound):
        raise ValueError(f"g has values below gate_lower_bound={bound} (min {float(np.min(c)):.4g}); "
                         f"raise the bound or bound the gates (e.g. g = bound * sigmoid(x))")


def resolve_l2norm(use_qk_l2norm, use_qk_l2norm_in_kernel):
    """``use_qk_l2norm`` and FLA's name for it, ``use_qk_l2norm_in_kernel``: either may be given
    (both only if they agree); neither means False."""
    for name, x in (("use_qk_l2norm", use_qk_l2norm),
                    ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)):
        if x is not None and not isinstance(x, (bool, np.bool_)):
            raise TypeError(f"{name} must be a Python bool; got {type(x).__name__}")
    if use_qk_l2norm is None:
        return bool(use_qk_l2norm_in_kernel)
    if use_qk_l2norm_in_kernel is not None and bool(use_qk_l2norm_in_kernel) != bool(use_qk_l2norm):
        raise ValueError(f"use_qk_l2norm={use_qk_l2norm} and use_qk_l2norm_in_kernel="
                         f"{use_qk_l2norm_in_kernel} disagree: they name the same option (the "
                         f"second is FLA's spelling); pass one of them")
    return bool(use_qk_l2norm)


def check_checked(checked):
    if not isinstance(checked, (bool, np.bool_)):
        raise TypeError(f"checked must be a Python bool; got {type(checked).__name__}")


# The domains of the gates (rewy-math §1–§2). A gate outside them does not fail: it computes a
# different, unstable recurrence (g = +0.5 gave |o| up to 2.7e8, g = +5 all-NaN), so values
# known now are checked; traced values are checked only in the checked mode (``checked=True``,
# under ``jax.experimental.checkify.checkify``). NaN is not a domain error here (it propagates,
# see docs/input-contract.md); a NaN next to a bad value does not hide it (nanmin/nanmax).
_HINTS = {
    "g": "a per-token natural-log decay, −inf = reset; e.g. g = jax.nn.log_sigmoid(x)",
    "beta": "e.g. beta = jax.nn.sigmoid(x), or 2·sigmoid(x) for negative eigenvalues",
    "b": "the erase gate, e.g. b = jax.nn.sigmoid(x), or 2·sigmoid(x) for negative eigenvalues",
    "w": "the write gate, e.g. w = jax.nn.sigmoid(x)",
}


def check_gate_domain(name: str, x, lo: float | None, hi: float | None, *, checked: bool):
    """``lo ≤ x ≤ hi`` (None: unbounded on that side) for a gate named ``name``.

    Concrete x: a ValueError naming the argument, the range and the offending extreme. Traced x
    (under jit): trusted, unless ``checked`` — then a ``checkify.check`` (the caller wraps the
    function in ``checkify.checkify``; jax raises at trace time if it is not wrapped)."""
    if x is None or x.size == 0:
        return
    rng = f"[{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
    hint = _HINTS.get(name, "")
    if isinstance(x, jax.core.Tracer):
        if not checked:
            return
        xf = x.astype(jnp.float32)
        ok = jnp.bool_(True)
        if lo is not None:
            ok &= ~jnp.any(xf < lo)
        if hi is not None:
            ok &= ~jnp.any(xf > hi)
        checkify.check(ok, f"{name} must lie in {rng} ({hint}); got values in "
                       f"[{{lo}}, {{hi}}]", lo=jnp.nanmin(xf), hi=jnp.nanmax(xf))
        return
    with jax.ensure_compile_time_eval():  # reduced where x lives: two numbers come back
        xf = jnp.asarray(x, jnp.float32)
        mn, mx = (float(v) for v in np.asarray(jnp.stack([jnp.nanmin(xf), jnp.nanmax(xf)])))
    if (lo is not None and mn < lo) or (hi is not None and mx > hi):
        raise ValueError(f"{name} must lie in {rng} ({hint}); got values in [{mn:.4g}, {mx:.4g}]")


def check_traced_cu_seqlens(cu_seqlens, T: int, *, checked: bool):
    """The checked mode's version of check_cu_seqlens' value checks, for traced offsets."""
    if not checked or not isinstance(cu_seqlens, jax.core.Tracer):
        return
    c = cu_seqlens
    checkify.check(c[0] == 0, "cu_seqlens must start at 0; got {c0}", c0=c[0])
    checkify.check(c[-1] == T, f"cu_seqlens must end at T = {T} (axis 1 of q); got {{cN}}",
                   cN=c[-1])
    checkify.check(jnp.all(c[1:] > c[:-1]), "cu_seqlens must be strictly increasing (no empty "
                   "sequences); got a step of {step}", step=jnp.min(c[1:] - c[:-1]))


def check_traced_gate_bound(bound, g, *, checked: bool):
    """Checked mode: a traced g respects a declared gate_lower_bound (otherwise it is clamped)."""
    if bound is None or not checked or not isinstance(g, jax.core.Tracer):
        return
    gf = g.astype(jnp.float32)
    checkify.check(~jnp.any(gf < bound), f"g has values below gate_lower_bound={bound} (min "
                   "{mn}); raise the bound or bound the gates (e.g. g = bound * sigmoid(x))",
                   mn=jnp.nanmin(gf))


def _concrete(x):
    """A numpy copy of x if its value is known now (not traced under jit), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_cu_seqlens(cu_seqlens, q):
    """FLA-style offsets: 1-D integers [N+1], B = 1, 0 = c_0 < c_1 < … < c_N = T."""
    if cu_seqlens is None:
        return None
    if getattr(cu_seqlens, "ndim", None) != 1 or not jnp.issubdtype(jnp.asarray(cu_seqlens).dtype, jnp.integer):
        raise ValueError("cu_seqlens must be a 1-D integer array [N+1] of sequence offsets; got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} of shape "
                         f"{getattr(cu_seqlens, 'shape', '?')}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must hold at least two offsets [0, T]; got shape {cu_seqlens.shape}")
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T); q has B = {q.shape[0]}")
    c = _concrete(cu_seqlens)
    if c is not None:  # under jit the offsets are traced: they are trusted, as in FLA
        T = q.shape[1]
        if c[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0; got {c[0]}")
        if c[-1] != T:
            raise ValueError(f"cu_seqlens must end at T = {T} (axis 1 of q); got {c[-1]}")
        if np.any(np.diff(c) <= 0):
            raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequences); got {c.tolist()}")
    return cu_seqlens.shape[0] - 1


def check_initial_state(initial_state, q, v, n_seq):
    if initial_state is None:
        return
    check_float("initial_state", initial_state)
    B, _, H, K = q.shape
    V = v.shape[-1]
    want = (B if n_seq is None else n_seq, H, K, V)
    lead = "B" if n_seq is None else "N (number of sequences in cu_seqlens)"
    if _shape(initial_state) != want:
        raise ValueError(f"initial_state must have shape [{lead}, H, K, V] = {want}; got {_shape(initial_state)}")
