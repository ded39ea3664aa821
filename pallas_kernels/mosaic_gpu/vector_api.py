"""The Mosaic GPU backend of the vector-gate delta rule: KDA and GDN2, differentiable (ReWY).

Pipeline (each stage's module docstring gives its shapes):

    vector_prep.py            pad T, GDN2's z = w ⊙ v (XLA); clamp g and its log2 per-channel
                              chunk sums (gpu/gates.cum_gates, a Pallas Triton kernel; g arrives
                              unclamped: no XLA pass clamps it)
    vector_chunk.py           per chunk: gated Grams in reference frames, A, W, U, Qγ, K_tail, P
                              (+ A as a split pair for the backward)
    vector_forward.py         fused state pass + output; saves chunk start states and R
                              (policy "save"; "recompute" re-forms W, U from the kept A and
                              reruns the pass, states only, in the backward)
    vector_state_backward.py  reverse state pass: dR per chunk, each chunk's end cotangent, dh0;
                              under "recompute" one launch with the states-only pass (launch.py)
    vector_wy.py              backward="wy" only (the ablation): dT and dĒ by the seven products
    vector_chunk_backward.py  per (chunk, 64 key channels): Λ = Aᵀ dR, dq, and through each op's
                              leaf maps dk, dv and the gate gradients (KDA: dβ's parts; GDN2: db,
                              dw), and the per-row parts of dg
    gpu/gates.gate_grad       dg's sums along each chunk (a Pallas Triton kernel)
    XLA (here)                dg's ⟨dS, S0⟩ per channel and the clamp's VJP (one pass)

:func:`supports` says which calls it serves (``None``) or why not; :func:`vector_delta_rule` is
the differentiable op. Packed sequences (cu_seqlens) take the scalar path's layout: api.pack
re-lays them on chunk boundaries and builds the per-chunk (reset, slot, end) ``meta`` that the two
serial kernels read; the per-chunk kernels need nothing (padding rows are zeros).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.gates import gate_grad
from pallas_kernels.mosaic_gpu import compat, config
from pallas_kernels.mosaic_gpu import api
from pallas_kernels.mosaic_gpu.common import C, DTYPES
from pallas_kernels.mosaic_gpu.prep import pad_time
from pallas_kernels.mosaic_gpu.vector_chunk import vector_chunk, vector_wu
from pallas_kernels.mosaic_gpu.vector_chunk_backward import vector_chunk_backward
from pallas_kernels.mosaic_gpu.launch import launch
from pallas_kernels.mosaic_gpu.vector_forward import HEAD_DIMS, vector_state_output, vector_state_part
from pallas_kernels.mosaic_gpu.vector_prep import centred_ok, gate_floor, prepare_vector
from pallas_kernels.mosaic_gpu.vector_state_backward import vector_state_backward_part
from pallas_kernels.mosaic_gpu.vector_wy import vector_wy_products

F32 = jnp.float32


def supports(*, K: int, V: int, dtype, chunk_size: int, static_scale: bool, backward: str,
             packed: bool, interpret: bool) -> str | None:
    """``None`` when the vector-gate kernels serve such a call (KDA: g [B,T,H,K], β [B,T,H];
    GDN2: g, b [B,T,H,K], w [B,T,H,V]), else the reason they do not. ``packed`` (cu_seqlens)
    calls are served too (api.pack's layout)."""
    del packed
    reason = api.device_reason(interpret)
    if reason is not None:
        return reason
    if jnp.dtype(dtype) not in DTYPES:
        return f"the Mosaic GPU KDA/GDN2 kernels take bf16 or fp16 inputs, got {jnp.dtype(dtype).name}"
    if K not in HEAD_DIMS or V != K:
        return f"the Mosaic GPU KDA/GDN2 kernels take K = V in {HEAD_DIMS}, got K={K}, V={V}"
    reason = api.options_reason(chunk_size=chunk_size, static_scale=static_scale, backward=backward)
    if reason is not None:
        return reason
    if backward != "rewy" and K > 128:
        return (f"the Mosaic GPU KDA/GDN2 seven-product backward (backward='wy', the ablation) takes "
                f"K = V <= 128, got K={K}")
    return None


def write_gate(w):
    """GDN2's write gate as the kernels read it: bf16, fp16 or fp32 as given (the gradient kernel
    writes dw in that dtype, so no XLA pass converts it), anything else as fp32."""
    return w if jnp.dtype(w.dtype) in (*DTYPES, jnp.dtype(F32)) else w.astype(F32)


def _erase_tokens(erase, k):
    """e = β k or b ⊙ k in the input dtype, token layout ``[B, Tp, H, K]`` (the backward kernel's
    operand; β arrives head-major ``[B, H, Tp]`` from vector_prep)."""
    if erase.ndim == 3:
        erase = jnp.swapaxes(erase, 1, 2)[..., None]
    return (erase * k.astype(F32)).astype(k.dtype)


def _prepare(q, k, v, g, b, w, bound, interpret):
    kda = w is None
    return prepare_vector(q, k, v, g, beta=b if kda else None, b=None if kda else b, w=w,
                          gate_lower_bound=bound, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def vector_delta_rule(q, k, v, g, b, w, h0, meta, scale: float, policy: str, gate_lower_bound,
                      cfg: config.VectorConfig, interpret: bool):
    """KDA (``w`` None, ``b`` = β [B, T, H]) or GDN2 (``b`` [B, T, H, K], ``w`` [B, T, H, V]) on
    the Mosaic GPU kernels, differentiable with the ReWY backward.

    q, k: [B, T, H, K], v: [B, T, H, V] bf16; g: [B, T, H, K] fp32 (≤ 0, as given: clamped to the
    floor or ``gate_lower_bound`` in gates.cum_gates, the clamp's VJP in the backward); b fp32;
    w in bf16, fp16 or fp32 (:func:`write_gate`; dw is returned in its dtype); h0: [B, H, K, V] fp32. ``scale`` multiplies q.
    ``policy``: "save" keeps every chunk kernel output, the chunk start states and R for the
    backward; "recompute" keeps only the chunk matrices A (a pair) and P ``[B, H, Tp, C]``, as the
    scalar-gate path keeps T0, and re-forms W, U, Qγ, K_tail from them (``vector_wu``) and the
    states (the state pass) there. ``meta``: None, or packed sequences (B = 1, each sequence starting
    on a chunk boundary, :func:`api.pack`): int32 ``[N, META]`` per chunk (reset, slot, end, 0...),
    and h0 is ``[n_slots, H, K, V]``. Returns ``(o [B, T, H, V], final [B or n_slots, H, K, V]
    fp32)``.
    """
    return _forward(q, k, v, g, b, w, h0, meta, scale, policy, gate_lower_bound, cfg, interpret,
                    residuals=False)[0]


def _forward_rule(q, k, v, g, b, w, h0, meta, scale, policy, bound, cfg, interpret):
    return _forward(q, k, v, g, b, w, h0, meta, scale, policy, bound, cfg, interpret, residuals=True)


def _forward(q, k, v, g, b, w, h0, meta, scale, policy, bound, cfg, interpret, *, residuals: bool):
    """``((o, final), residuals)``; without ``residuals`` (a call not differentiated) the chunk
    kernel does not write A and nothing is kept."""
    T = q.shape[1]
    save = residuals and policy == "save"
    with compat.x32():
        prep = _prepare(q, k, v, g, b, w, bound, interpret)
        # differentiated, A leaves the chunk kernel under both policies: the backward's Λ = Aᵀ dR reads it
        chunk = vector_chunk(*prep, scale=scale, centred=cfg.centred, out_inverse=residuals,
                             interpret=compat.interpret_params(interpret))
        h0t = jnp.swapaxes(h0.astype(F32), -1, -2)
        outs = vector_state_output(*chunk[:5], prep[3], h0t, cfg=cfg, out_final=True, save_states=save,
                                   meta=meta, interpret=compat.interpret_params(interpret))
    if not residuals:
        return (outs[0][:, :T], jnp.swapaxes(outs[1], -1, -2)), None
    saved = (prep, chunk, outs[2], outs[3]) if save else chunk[4:]  # recompute: P and A's pair
    res = (q, k, v, g, b, w, h0, meta, saved)
    return (outs[0][:, :T], jnp.swapaxes(outs[1], -1, -2)), res


def _backward(scale, policy, bound, cfg, interpret, res, cts):
    with compat.x32():
        return _backward_x32(scale, policy, bound, cfg, interpret, res, cts)


def _backward_x32(scale, policy, bound, cfg, interpret, res, cts):
    q, k, v, g, b, w, h0, meta, saved = res
    do, dfinal = cts
    B, T, H, K = k.shape
    ip = compat.interpret_params(interpret)
    recompute = policy == "recompute"
    if recompute:  # W, U, Qγ, K_tail from the kept A (the states: below)
        p, a_hi, a_lo = saved
        prep = _prepare(q, k, v, g, b, w, bound, interpret)
        chunk = vector_wu(*prep[:5], a_hi, a_lo, scale=scale, interpret=ip) + (p, a_hi, a_lo)
    else:
        prep, chunk, states, r = saved
    qp, kp, _, g2, erase, flags = prep
    w_, _, qg, kt, p, a_hi, a_lo = chunk
    Tp = kp.shape[1]
    N = Tp // C
    dop = pad_time(do.astype(kp.dtype), Tp)
    dfinal_t = jnp.swapaxes(dfinal.astype(F32), -1, -2)
    reverse = vector_state_backward_part(kt, w_, qg, p, dop, g2, dfinal_t, cfg=cfg.state_backward, meta=meta,
                                         n_slots=h0.shape[0], warpgroups=3 if recompute else 2)
    if recompute:
        # the states (and R) again, no output, in one launch with the reverse state pass (they do
        # not depend on each other; launch.py)
        h0t = jnp.swapaxes(h0.astype(F32), -1, -2)
        states_only = vector_state_part(*chunk[:5], g2, h0t, cfg=cfg, out_final=False, save_states=True,
                                        meta=meta, out_o=False)
        (states, r), (dr, dstates, dh0t) = launch([states_only, reverse], B, H, interpret=ip)
    else:
        ((dr, dstates, dh0t),) = launch([reverse], B, H, interpret=ip)
    kda = w is None
    wy = None
    if cfg.backward == "wy":  # the ablation: dT and dĒ by the seven products (vector_wy.py)
        wy = vector_wy_products(a_hi, a_lo, dr, prep[2], states, kp, g2, erase, interpret=ip)
    outs = vector_chunk_backward(
        qp, kp, _erase_tokens(erase, kp), g2, dop, dr, r, states, dstates, a_hi, a_lo, flags, scale=scale,
        centred=cfg.centred, kda_leaf=(erase, prep[2]) if kda else None,
        gdn2_leaf=None if kda else (erase, pad_time(w, Tp), pad_time(v, Tp)), wy=wy,
        load_sets=cfg.grad_load_sets, interpret=ip)
    pairs, yk = outs[4:6]

    # dg: dg_t = Σ_{r ≥ t} pairs_r + Σ_{s < t} yk_s + 2^{G_C} ⊙ Σ_v dS ⊙ S0, per key channel and
    # chunk (the start state's decay crosses every token of the chunk). The two sums along each
    # chunk are the Pallas GPU backend's gate_grad kernel (each output sums only its own terms).
    # g arrived unclamped (the clamp is in gates.cum_gates), so the clamp's VJP is here, in the
    # same XLA pass as the state term: no gradient to the gates below the floor.
    sds = jnp.einsum("bhnvk,bhnvk->bnhk", states.astype(F32), dstates.astype(F32))
    gam_c = jnp.exp2(jnp.swapaxes(g2.reshape(B, H, N, C, K)[:, :, :, -1], 1, 2))  # [B, N, H, K]
    dg = gate_grad(pairs, yk, C, interpret=interpret, warps=cfg.gate_grad_warps).reshape(B, N, C, H, K)
    dg = (dg + (gam_c * sds)[:, :, None]).reshape(B, Tp, H, K)[:, :T]
    dg = jnp.where(g < gate_floor(bound), 0.0, dg)

    # The leaf maps are applied in the gradient kernel. KDA (β erases and writes): it returns
    # dβ's parts per key piece. GDN2 (e = b ⊙ k, z = w ⊙ v): db and dw themselves.
    dv, dq, dk = (x[:, :T] for x in outs[:3])
    if kda:
        db = jnp.swapaxes(jnp.sum(outs[3], axis=2), 1, 2)[:, :T]  # [B, H, K/64, Tp] -> [B, T, H]
        dw = None
    else:
        db, dw = outs[3][:, :T], outs[6][:, :T]
    dh0 = jnp.swapaxes(dh0t, -1, -2)
    return (dq, dk, dv, dg, db, dw, dh0, None)


vector_delta_rule.defvjp(_forward_rule, _backward)


def default_config(K: int, V: int, gate_lower_bound, backward: str = "rewy", op: str = "kda") -> config.VectorConfig:
    """The kernels' settings for these head dims, gate bound, backward and op ("kda" or "gdn2"; bf16)."""
    return config.default_vector_config(K, V, 2, centred_ok(gate_lower_bound), backward, op)
