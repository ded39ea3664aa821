"""The Mosaic GPU (Hopper) backend of the scalar-gate delta rule: DeltaNet and GDN.

Pipeline (each stage's module docstring gives its shapes):

    prep.py       XLA: pad T, log2 gate cumsum, β head-major, gate-free inverse T0 per chunk
    forward.py    fused state pass + output (3 warpgroups); optionally saves chunk start states

:func:`supports` says which calls this backend serves (``None``) or why not (a reason string);
:func:`forward` runs the prepared kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import compat, config, prep
from pallas_kernels.mosaic_gpu.common import C
from pallas_kernels.mosaic_gpu.forward import fused_forward

HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_hopper() -> bool:
    """True when the default device is an sm_90 GPU (H100/H200)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and getattr(dev, "compute_capability", None) == "9.0"


def supports(*, K: int, V: int, dtype, chunk_size: int, scalar_gates: bool, varlen: bool,
             static_scale: bool, interpret: bool) -> str | None:
    """``None`` when the Mosaic GPU kernels serve such a call, else the reason they do not."""
    if interpret:
        if not compat.has_interpreter():
            return f"the Mosaic GPU interpreter needs jax >= 0.12 (this is jax {jax.__version__})"
    elif not is_hopper():
        return "the Mosaic GPU kernels need an sm_90 GPU (H100/H200)"
    if not scalar_gates:
        return "the Mosaic GPU kernels serve DeltaNet and GDN (scalar β, scalar or no gate)"
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU kernels take bf16 or fp16 inputs, got {jnp.dtype(dtype).name}"
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        return f"the Mosaic GPU kernels take K, V in {HEAD_DIMS}, got K={K}, V={V}"
    if chunk_size != C:
        return f"the Mosaic GPU kernels use chunk_size={C}, got {chunk_size}"
    if varlen:
        return "the Mosaic GPU kernels do not take cu_seqlens yet"
    if not static_scale:
        return "the Mosaic GPU kernels need a Python float scale (not traced)"
    return None


def prepare(q, k, v, g, beta):
    """Padded kernel inputs ``(q, k, v, t0, g2 | None, beta_hm)``; see :mod:`prep`."""
    B, T, H, K = k.shape
    Tp = -(-T // C) * C
    dtype = v.dtype
    q, k, v = (prep.pad_time(x.astype(dtype), Tp) for x in (q, k, v))
    beta_hm = prep.head_major(beta, Tp)
    g2 = None if g is None else prep.log2_chunk_cumsum(g, Tp)
    t0 = prep.gate_free_inverse(k, beta_hm, dtype)
    return q, k, v, t0, g2, beta_hm


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "out_final", "save_states", "interpret"))
def forward(q, k, v, g, beta, h0, *, scale: float, cfg: config.Config, out_final: bool = True,
            save_states: bool = False, interpret: bool = False):
    """``(o [B, T, H, V], final [B, H, K, V] fp32 | None, states | None)`` of DeltaNet (``g`` None)
    or GDN: q, k [B, T, H, K] and v [B, T, H, V] in bf16/fp16, g and beta [B, T, H] fp32
    (g ≤ 0, already clamped), h0 [B, H, K, V] fp32 or None."""
    T = q.shape[1]
    qp, kp, vp, t0, g2, beta_hm = prepare(q, k, v, g, beta)
    h0t = None if h0 is None else jnp.swapaxes(h0.astype(jnp.float32), -1, -2)
    o, final_t, states = fused_forward(qp, kp, vp, t0, g2, beta_hm, h0t, scale=scale, cfg=cfg.forward,
                                       out_final=out_final, save_states=save_states,
                                       interpret=compat.interpret_params(interpret))
    final = None if final_t is None else jnp.swapaxes(final_t, -1, -2)
    return o[:, :T], final, states
