"""The Mosaic GPU (Hopper) backend of the scalar-gate delta rule: DeltaNet and GDN.

Pipeline (each stage's module docstring gives its shapes):

    prep.py             XLA: pad T, log2 gate cumsum, β head-major
    chunk_inverse.py    the gate-free inverse T0 per chunk (tensor cores, split-bf16 products)
    forward.py          fused state pass + output (3 warpgroups); saves chunk start states
                        (policy "save"; "recompute" reruns it, states only, in the backward)
    state_backward.py   reverse state pass: Λ per chunk, each chunk's end cotangent, dh0;
                        under "recompute" one launch with the states-only forward (launch.py)
    chunk_backward.py   per-chunk gradients dq, dk, dv, dβ, dG (parallel over chunks); the
                        ReWY products, or at K ≤ 128 the seven-product WY ones (backward="wy",
                        config.ChunkBackwardConfig.backward, for the ablation)
    XLA                 dg = reverse cumsum of dG within each chunk (+ the last-row terms)

:func:`supports` says which calls this backend serves (``None``) or why not (a reason string);
:func:`delta_rule` is the differentiable op (a ``jax.custom_vjp`` over the kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import compat, config, prep
from pallas_kernels.mosaic_gpu.common import C, DTYPES, META
from pallas_kernels.mosaic_gpu.chunk_backward import chunk_backward
from pallas_kernels.mosaic_gpu.chunk_inverse import chunk_inverse
from pallas_kernels.mosaic_gpu.forward import forward_part, fused_forward
from pallas_kernels.mosaic_gpu.launch import launch
from pallas_kernels.mosaic_gpu.state_backward import state_backward_part

HEAD_DIMS = (64, 128, 256)  # 256: the blocked tilings of config.default_config
BACKWARDS = ("rewy", "wy")  # "wy": the whole-width per-chunk gradient kernel only (K ≤ 128)


def is_hopper() -> bool:
    """True when the default device is an sm_90 GPU (H100/H200)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and getattr(dev, "compute_capability", None) == "9.0"


def device_reason(interpret: bool) -> str | None:
    """Why these kernels cannot run here (``None``: they can): an sm_90 GPU, or the GPU
    interpreter (jax ≥ 0.12) when ``interpret``. Shared with vector_api.supports."""
    if interpret:
        if not compat.has_interpreter():
            return f"the Mosaic GPU interpreter needs jax >= 0.12 (this is jax {jax.__version__})"
    elif not is_hopper():
        return "the Mosaic GPU kernels need an sm_90 GPU (H100/H200)"
    return None


def options_reason(*, chunk_size: int, static_scale: bool, backward: str) -> str | None:
    """The call options every Mosaic GPU kernel needs. Shared with vector_api.supports (which
    also refuses backward='wy')."""
    if backward not in BACKWARDS:
        return f"the Mosaic GPU kernels implement backward in {BACKWARDS}, got {backward!r}"
    if chunk_size != C:
        return f"the Mosaic GPU kernels use chunk_size={C}, got {chunk_size}"
    if not static_scale:
        return "the Mosaic GPU kernels need a Python float scale (not traced)"
    return None


def supports(*, K: int, V: int, dtype, chunk_size: int, scalar_gates: bool, static_scale: bool,
             backward: str, interpret: bool) -> str | None:
    """``None`` when the Mosaic GPU kernels serve such a call, else the reason they do not."""
    reason = device_reason(interpret)
    if reason is not None:
        return reason
    if not scalar_gates:
        return "the Mosaic GPU kernels serve DeltaNet and GDN (scalar β, scalar or no gate)"
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU kernels take bf16 or fp16 inputs, got {jnp.dtype(dtype).name}"
    if K not in HEAD_DIMS or V != K:
        return f"the Mosaic GPU kernels take K = V in {HEAD_DIMS}, got K={K}, V={V}"
    if backward == "wy" and K > 128:
        return ("the Mosaic GPU kernels have the seven-product backward (backward='wy') at K = V "
                f"<= 128 only (the whole-width per-chunk gradient kernel), got K={K}; the blocked "
                "K = 256 kernel implements the ReWY backward only")
    return options_reason(chunk_size=chunk_size, static_scale=static_scale, backward=backward)


def prepare(q, k, v, g, beta, interpret: bool = False):
    """Padded kernel inputs ``(q, k, v, t0, g2 | None, beta_hm)``; see :mod:`prep` and
    :mod:`chunk_inverse`."""
    B, T, H, K = k.shape
    Tp = -(-T // C) * C
    dtype = v.dtype
    q, k, v = (prep.pad_time(x.astype(dtype), Tp) for x in (q, k, v))
    beta_hm = prep.head_major(beta, Tp)
    g2 = None if g is None else prep.log2_chunk_cumsum(g, Tp)
    t0 = chunk_inverse(k, beta_hm, interpret=compat.interpret_params(interpret))
    return q, k, v, t0, g2, beta_hm


def _state_layout(x, cfg: config.PassConfig):
    """A fp32 state ``[.., K, V]`` to a serial pass's layout and back (the fused forward's h0 and
    final state, the reverse state pass's final-state cotangent and dh0): as is with
    ``key_rows``, else transposed to ``[.., V, K]``."""
    return x if cfg.key_rows else jnp.swapaxes(x, -1, -2)


def _unpad_scalars(x, T: int):
    """Head-major ``[B, H, Tp]`` -> ``[B, T, H]``."""
    return jnp.swapaxes(x, 1, 2)[:, :T]


def _gate_grad(dG, u, sds, g2):
    """dg ``[B, H, Tp]`` from the chunk kernel's per-row dG and its last-row parts.

    dg_t = Σ_{r ≥ t in t's chunk} dG_r; the last row's extra γ_C ⟨dS, S0⟩ + Σ_s u_s therefore
    reaches every row of the chunk.
    """
    B, H, Tp = dG.shape
    N = Tp // C
    dG = dG.reshape(B, H, N, C)
    rev = jnp.flip(jnp.cumsum(jnp.flip(dG, -1), -1), -1)
    gamma_C = jnp.exp2(g2.reshape(B, H, N, C)[..., -1])
    extra = gamma_C * sds.sum(-1) + u.reshape(B, H, N, C).sum(-1)
    return (rev + extra[..., None]).reshape(B, H, Tp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def delta_rule(q, k, v, g, beta, h0, meta, scale: float, policy: str, cfg: config.Config,
               interpret: bool):
    """DeltaNet (``g`` None) or GDN on the Mosaic GPU kernels, differentiable: the ReWY backward,
    or the seven-product one where ``cfg.chunk_backward.backward`` is "wy" (the reverse state
    pass is the same in both: it gives Λ = Aᵀ dR, the wy form's dZ).

    q, k: [B, T, H, K], v: [B, T, H, V] (bf16/fp16, one dtype); g, beta: [B, T, H] fp32
    (g ≤ 0, already clamped); h0: [B, H, K, V] fp32. ``scale`` multiplies q. ``policy``:
    "save" keeps the chunk start states for the backward, "recompute" reruns the forward there.
    ``meta``: None, or packed sequences (B = 1, each sequence starting on a chunk boundary,
    :func:`pack`): int32 ``[N, META]`` per chunk (reset, slot, end, 0...), and h0 is
    ``[n_slots, H, K, V]``. Returns ``(o [B, T, H, V], final [B or n_slots, H, K, V] fp32)``.
    """
    return _forward(q, k, v, g, beta, h0, meta, scale, policy, cfg, interpret, residuals=False)[0]


def _forward_rule(q, k, v, g, beta, h0, meta, scale, policy, cfg, interpret):
    return _forward(q, k, v, g, beta, h0, meta, scale, policy, cfg, interpret, residuals=True)


def _forward(q, k, v, g, beta, h0, meta, scale, policy, cfg, interpret, *, residuals: bool):
    """``((o, final), residuals)``; without ``residuals`` (a call not differentiated) no chunk
    states are stored under policy "save"."""
    T = q.shape[1]
    with compat.x32():
        qp, kp, vp, t0, g2, beta_hm = prepare(q, k, v, g, beta, interpret)
        h0t = _state_layout(h0.astype(jnp.float32), cfg.forward)
        save = residuals and policy == "save"
        o, final_t, states, *r = fused_forward(qp, kp, vp, t0, g2, beta_hm, h0t, scale=scale,
                                               cfg=cfg.forward, out_final=True, save_states=save, meta=meta,
                                               interpret=compat.interpret_params(interpret),
                                               save_r=save and cfg.saves_r)
    res = (qp, kp, vp, t0, g2, beta_hm, h0t, states, r[0] if r else None, meta, g is None)
    return (o[:, :T], _state_layout(final_t, cfg.forward)), res


def _backward(scale, policy, cfg, interpret, res, cts):
    with compat.x32():
        return _backward_x32(scale, cfg, interpret, res, cts)


def _backward_x32(scale, cfg, interpret, res, cts):
    qp, kp, vp, t0, g2, beta_hm, h0t, states, r, meta, no_gate = res
    do, dfinal = cts
    T = do.shape[1]
    Tp = kp.shape[1]
    ip = compat.interpret_params(interpret)
    dop = prep.pad_time(do.astype(vp.dtype), Tp)
    dfinal_t = _state_layout(dfinal.astype(jnp.float32), cfg.state_backward)
    reverse = state_backward_part(qp, kp, dop, t0, g2, beta_hm, dfinal_t, scale=scale,
                                  cfg=cfg.state_backward, meta=meta, n_slots=h0t.shape[0])
    B, _, H, _ = kp.shape
    if states is None:
        # policy "recompute": the forward again for the chunk states only, in one launch with
        # the reverse state pass (they do not depend on each other; launch.py)
        h0r = _state_layout(_state_layout(h0t, cfg.forward), cfg.recompute)
        recompute = forward_part(None, kp, vp, t0, g2, beta_hm, h0r, scale=scale, cfg=cfg.recompute,
                                 out_final=False, save_states=True, meta=meta, out_o=False,
                                 save_r=cfg.saves_r)
        (states, *r), (lam, dstates, dh0t) = launch([recompute, reverse], B, H, interpret=ip)
        r = r[0] if r else None
    else:
        ((lam, dstates, dh0t),) = launch([reverse], B, H, interpret=ip)
    outs = chunk_backward(qp, kp, vp, dop, lam, states, dstates, t0, g2, beta_hm, scale=scale,
                          cfg=cfg.chunk_backward, interpret=ip, r=r)
    dq, dk, dv, dbeta = outs[:4]
    dg = None if no_gate else _unpad_scalars(_gate_grad(*outs[4:], g2), T)
    return (dq[:, :T], dk[:, :T], dv[:, :T], dg, _unpad_scalars(dbeta, T),
            _state_layout(dh0t, cfg.state_backward), None)


delta_rule.defvjp(_forward_rule, _backward)


def pack(plan, xs, h0):
    """Packed sequences for :func:`delta_rule` from a ``rewy_jax.layout.ChunkPlan`` (B = 1).

    ``xs``: per-token arrays ``[1, T, ...]`` (None passes through), gathered so that every
    sequence starts on a chunk boundary (zero rows between: k = v = β = g = 0 leave the state
    unchanged); ``h0 [n_seq, H, K, V]`` gains a zero slot that the padding chunks use.
    Returns ``(xs, h0, meta)``; :func:`unpack` maps the outputs back.
    """
    def gather(x):
        if x is None:
            return None
        x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
        return x[:, plan.gather]

    end = jnp.zeros((plan.n_chunks,), jnp.int32).at[plan.end_chunk].set(1)
    meta = jnp.stack([plan.chunk_reset.astype(jnp.int32), plan.chunk_seq.astype(jnp.int32), end],
                     axis=1)
    meta = jnp.pad(meta, [(0, 0), (0, META - 3)])
    h0 = jnp.concatenate([h0, jnp.zeros_like(h0[:1])], axis=0)
    return [gather(x) for x in xs], h0, meta


def unpack(plan, o, final):
    """``o [1, N·C, H, V]`` back to the token order; the padding slot of ``final`` dropped."""
    return o[:, plan.scatter], final[:-1]
