"""Backend table and dispatch.

A backend is a function ``impl(call, *, chunk_size, policy, backward, interpret) -> (o, final)``
taking an :class:`rewy_jax.ops.GeneralCall`, plus a predicate
``supports(call, chunk_size, interpret, backward)`` that returns ``None`` when it can serve the
call or a reason string when it cannot.
``backend=None`` walks the preference list of the current platform and takes the first backend
that supports the call, logging why it skipped the others; an explicit ``backend=`` that cannot
serve the call raises with the reason. Nothing falls back silently.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from rewy_jax import layout
from rewy_jax.reference import reference_general
from rewy_jax.sharding import wrap_if_multi_device
from rewy_jax.xla_chunked import chunked_delta

log = logging.getLogger("rewy_jax")


class Backend(NamedTuple):
    name: str
    impl: Callable
    supports: Callable  # (call, chunk_size, interpret, backward) -> None | reason
    # backend=None asks this one instead, when given: a backend may serve more calls explicitly
    # than it is chosen for automatically (same signature)
    auto_supports: Callable | None = None


# ----------------------------------------------------------------------------------------------
# xla: the chunked jnp path with ReWY's custom VJP
# ----------------------------------------------------------------------------------------------
def _expand(x, ndim):
    return x if x.ndim == ndim else x[..., None]


def xla_impl(call, *, chunk_size, policy, backward, interpret=False):
    del interpret
    q, k, v, g, b, w, h0 = call.q_scaled, call.k, call.v, call.g, call.b, call.w, call.h0
    T = q.shape[1]
    # Gates enter only through these leaf maps: e = b ⊙ k, z = w ⊙ v (their VJPs give db, dw, dβ).
    f32 = jnp.float32
    e = _expand(b, 4).astype(f32) * k.astype(f32)
    z = _expand(w, 4).astype(f32) * v.astype(f32)
    plan = layout.plan_chunks(T, chunk_size, call.cu_seqlens)
    to = lambda x: layout.to_chunks(x, plan)  # noqa: E731
    g = None if g is None else to(g.astype(f32))  # chunked_delta forms the chunk cumsum
    h0 = h0[None] if call.cu_seqlens is not None else h0[:, None]  # [B, n_seq, H, K, V]
    o, final = chunked_delta(to(q), to(k), to(e), to(z), g, h0, plan.chunk_reset, plan.chunk_seq,
                             plan.end_chunk, policy, backward)
    o = layout.from_chunks(o, plan, T)
    final = final[0] if call.cu_seqlens is not None else final[:, 0]
    return o, final


def _always(call, chunk_size, interpret, backward):
    return None


# ----------------------------------------------------------------------------------------------
# reference: the token recurrence (slow; the oracle)
# ----------------------------------------------------------------------------------------------
def reference_impl(call, *, chunk_size, policy, backward, interpret=False):
    del chunk_size, policy, backward, interpret
    o, final = reference_general(call.q_scaled, call.k, call.v, call.g, call.b, call.w,
                                 scale=1.0, initial_state=call.h0, cu_seqlens=call.cu_seqlens,
                                 dtype=jnp.promote_types(call.out_dtype, jnp.float32))
    return o, final.astype(jnp.float32)


def _reference_supports(call, chunk_size, interpret, backward):
    if call.cu_seqlens is not None and isinstance(call.cu_seqlens, jax.core.Tracer):
        return "the reference runs sequences one by one and needs concrete cu_seqlens (not traced)"
    return None


# ----------------------------------------------------------------------------------------------
# pallas_tpu: the Mosaic TPU kernels (pallas_kernels.tpu), imported on first use
# ----------------------------------------------------------------------------------------------
def pallas_tpu_impl(call, *, chunk_size, policy, backward, interpret=False):
    from pallas_kernels.tpu import chunk_meta, chunked_delta_tpu

    B, T, H, K = call.q.shape
    V = call.v.shape[-1]
    plan = layout.plan_chunks(T, chunk_size, call.cu_seqlens)
    # Token layout (no HBM transpose): [B, T, H, D] padded to N·C rows and viewed as
    # [B, N·C, H·D]; a (C, D) block is a legal TPU tile when D is a multiple of 128. Packed
    # varlen (sequences re-laid on chunk boundaries) and D = 64 use the chunk layout.
    token = call.cu_seqlens is None and K % 128 == 0 and V % 128 == 0
    Tp = plan.n_chunks * chunk_size

    def to(x, scalar=False):
        if x is None:
            return None
        if token and not scalar:
            x = jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2)) if Tp != T else x
            return x.reshape(B, Tp, -1)
        return layout.to_chunks(x, plan)

    # The leaf maps e = b ⊙ k, z = w ⊙ v and the gate cumsum run in-kernel; a shared scalar β
    # (DeltaNet, GDN, KDA) is passed once.
    w = None if call.w is call.b else call.w
    sc = lambda x: x is not None and x.ndim == 3  # per-token scalar [B, T, H]  # noqa: E731
    h0 = call.h0[None] if call.cu_seqlens is not None else call.h0[:, None]
    h0 = jnp.concatenate([h0, jnp.zeros_like(h0[:, :1])], axis=1)  # + the padding chunks' slot
    meta = chunk_meta(plan.chunk_reset, plan.chunk_seq, plan.end_chunk)
    # bf16/fp16 callers: bf16 operands for the backward's leaf products (fp32 accumulation).
    operands = "bfloat16" if jnp.dtype(call.out_dtype).itemsize < 4 else None
    o, final = chunked_delta_tpu(to(call.q_scaled), to(call.k), to(call.v), to(call.b, sc(call.b)),
                                 to(w, sc(w)), to(call.g, sc(call.g)), h0, meta, policy, backward,
                                 operands, interpret)
    final = final[0, :-1] if call.cu_seqlens is not None else final[:, 0]
    if token:
        return o.reshape(B, Tp, H, V)[:, :T], final
    return layout.from_chunks(o, plan, T), final


def _pallas_tpu_supports(call, chunk_size, interpret, backward):
    from pallas_kernels.tpu import supports_reason

    return supports_reason(call.q.shape[-1], call.v.shape[-1], chunk_size, call.q.dtype,
                           _platform() == "tpu", interpret)


# ----------------------------------------------------------------------------------------------
# pallas_gpu: the Triton-lowered Pallas kernels (pallas_kernels.gpu), imported lazily
# ----------------------------------------------------------------------------------------------
def pallas_gpu_impl(call, *, chunk_size, policy, backward, interpret=False, kernel_config=None):
    """kernel_config: None (the measured defaults), a ``pallas_kernels.gpu.config.KernelConfig``
    or a mapping of its field overrides (the ops' ``kernel_config=``)."""
    from pallas_kernels.gpu import api

    plan = (None if call.cu_seqlens is None
            else layout.plan_chunks(call.q.shape[1], chunk_size, call.cu_seqlens))
    return api.delta_rule_call(call, chunk_size=chunk_size, policy=policy, backward=backward,
                               interpret=interpret, plan=plan, gate_lower_bound=call.g_bound,
                               kernel_config=kernel_config)


def _pallas_gpu_supports(call, chunk_size, interpret, backward):
    from pallas_kernels.gpu import api

    return api.supports(call, chunk_size, interpret)


# ----------------------------------------------------------------------------------------------
# mosaic_gpu: the Hopper kernels in Pallas Mosaic GPU (pallas_kernels.mosaic_gpu), DeltaNet and
# GDN (api.py), KDA and GDN2 (vector_api.py); imported lazily
# ----------------------------------------------------------------------------------------------
def _mosaic_gpu_vector_kind(call):
    """"kda" (per-channel g, shared scalar β), "gdn2" (per-channel g, b, w) or None (another
    mix of gate shapes) for a call with a non-scalar gate."""
    if call.g_in is None or call.g_in.ndim != 4:
        return None
    if call.w is call.b and call.b.ndim == 3:
        return "kda"
    if call.b.ndim == 4 and call.w.ndim == 4:
        return "gdn2"
    return None


def _scalar_gates(call) -> bool:
    """DeltaNet or GDN: no gate or a scalar one per token, one β for erase and write."""
    return (call.g_in is None or call.g_in.ndim == 3) and call.b.ndim == 3 and call.w is call.b


def _mosaic_gpu_reason(call, chunk_size, interpret, backward):
    from pallas_kernels.mosaic_gpu import api

    scalar = _scalar_gates(call)
    static_scale = isinstance(call.scale, (int, float))
    if not scalar:
        # KDA and GDN2: the vector-gate kernels (vector_api.py), with their own limits.
        from pallas_kernels.mosaic_gpu import vector_api

        if _mosaic_gpu_vector_kind(call) is None:
            return ("the Mosaic GPU kernels serve DeltaNet, GDN, KDA and GDN2 (this mix of gate "
                    "shapes is none of them)")
        return vector_api.supports(K=call.q.shape[-1], V=call.v.shape[-1], dtype=call.out_dtype,
                                   chunk_size=chunk_size, static_scale=static_scale, backward=backward,
                                   packed=call.cu_seqlens is not None, interpret=interpret)
    return api.supports(K=call.q.shape[-1], V=call.v.shape[-1], dtype=call.out_dtype,
                        chunk_size=chunk_size, scalar_gates=scalar, static_scale=static_scale,
                        backward=backward, interpret=interpret)


def mosaic_gpu_impl(call, *, chunk_size, policy, backward, interpret=False):
    from pallas_kernels.mosaic_gpu import api, config

    reason = _mosaic_gpu_reason(call, chunk_size, interpret, backward)
    if reason is not None:
        raise NotImplementedError(f"backend='mosaic_gpu' cannot serve this call: {reason}")
    dtype = call.out_dtype
    if _mosaic_gpu_vector_kind(call) is not None:  # KDA, GDN2
        from pallas_kernels.mosaic_gpu import vector_api

        K, V = call.q.shape[-1], call.v.shape[-1]
        w = None if call.w is call.b else vector_api.write_gate(call.w)
        # g as given: the gate-sum kernel clamps it to call.g_floor (gates.cum_gates), and the
        # clamp's VJP joins the backward's dg pass; XLA's clamp took 0.061 ms of KDA's 1.51 (H100)
        xs = [call.q.astype(dtype), call.k.astype(dtype), call.v.astype(dtype), call.g_in,
              call.b.astype(jnp.float32), w]
        vcfg = vector_api.default_config(K, V, call.g_bound, backward, _mosaic_gpu_vector_kind(call))
        run = lambda xs, h0, meta: vector_api.vector_delta_rule(  # noqa: E731
            *xs, h0, meta, float(call.scale), policy, call.g_bound, vcfg, bool(interpret))
    else:
        cfg = config.default_config(call.q.shape[-1], call.v.shape[-1], jnp.dtype(dtype).itemsize,
                                    backward, heads=call.q.shape[0] * call.q.shape[2],
                                    gated=call.g_in is not None, policy=policy)
        g = None if call.g_in is None else call.g
        xs = [call.q.astype(dtype), call.k.astype(dtype), call.v.astype(dtype), g,
              call.b.astype(jnp.float32)]
        run = lambda xs, h0, meta: api.delta_rule(*xs, h0, meta, float(call.scale), policy, cfg,  # noqa: E731
                                                  bool(interpret))
    if call.cu_seqlens is None:
        return run(xs, call.h0, None)
    # Packed sequences: re-laid so that each starts on a chunk boundary (rewy_jax.layout).
    plan = layout.plan_chunks(call.q.shape[1], chunk_size, call.cu_seqlens)
    xs, h0, meta = api.pack(plan, xs, call.h0)
    o, final = run(xs, h0, meta)
    return api.unpack(plan, o, final)


def _mosaic_gpu_supports(call, chunk_size, interpret, backward):
    return _mosaic_gpu_reason(call, chunk_size, interpret, backward)


def _mosaic_gpu_auto_supports(call, chunk_size, interpret, backward):
    """What backend=None takes the Mosaic GPU kernels for: all four ops at K = V ≤ 128, with either
    backward (the seven-product body runs in the same kernels). DeltaNet/GDN and KDA/GDN2 passed
    the benchmark's accuracy check on the H100 (KDA/GDN2: benchmarks/results/h100-26.md) and
    time below the Triton-lowered kernels (KDA 2.13 against 3.63 ms, GDN2 2.48 against 3.86 at
    the anchor in one run, h100-24, with slower Mosaic kernels than now). At K = V = 256
    DeltaNet and GDN passed it too and took 1.4× and 1.8× jla's time (benchmarks/results/
    h100-29b.md) against the Triton-lowered kernels' 2.1× and 2.3× (h100-20); KDA/GDN2's K = 256
    kernels run only when asked for by name: their accuracy is checked in the GPU interpreter only."""
    scalar = _scalar_gates(call)
    if call.q.shape[-1] > 128 and not scalar:
        return ("its KDA/GDN2 kernels at K = V = 256 are chosen only by name (backend='mosaic_gpu'): "
                "their accuracy is not yet checked on a GPU")
    return _mosaic_gpu_reason(call, chunk_size, interpret, backward)


# ----------------------------------------------------------------------------------------------
# Table and selection
# ----------------------------------------------------------------------------------------------
_TABLE: dict[str, Backend] = {
    "xla": Backend("xla", xla_impl, _always),
    "reference": Backend("reference", reference_impl, _reference_supports),
    # Several devices: per-shard kernels under jit (rewy_jax.sharding).
    "pallas_tpu": Backend("pallas_tpu", wrap_if_multi_device(pallas_tpu_impl, unless_interpret=True),
                          _pallas_tpu_supports),
    "pallas_gpu": Backend("pallas_gpu", wrap_if_multi_device(pallas_gpu_impl), _pallas_gpu_supports),
    "mosaic_gpu": Backend("mosaic_gpu", wrap_if_multi_device(mosaic_gpu_impl), _mosaic_gpu_supports,
                          _mosaic_gpu_auto_supports),
}

# Preference per platform for backend=None (kernels first once registered, xla always last). On a
# GPU the Mosaic GPU kernels serve what they support on sm_90 (their supports() refuses other GPUs)
# and the Triton-lowered Pallas kernels the rest.
_PREFERENCE = {"gpu": ["mosaic_gpu", "pallas_gpu", "xla"], "tpu": ["pallas_tpu", "xla"], "cpu": ["xla"]}


def register(backend: Backend):
    """Add (or replace) a backend; kernel packages call this when they import."""
    _TABLE[backend.name] = backend


def _platform():
    return jax.default_backend()


def select(name, call, *, chunk_size, interpret, backward="rewy"):
    """The backend implementation that serves this call (see module docstring)."""
    if name == "pallas":
        name = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(_platform())
        if name is None and interpret:
            name = "pallas_gpu"
        if name is None:
            raise NotImplementedError(
                f"backend='pallas' needs a GPU or TPU (this device is {_platform()!r}); "
                "pass interpret=True to run a Pallas backend on CPU, or use backend='xla'")
    if name is not None:
        be = _TABLE.get(name)
        if be is None:
            raise NotImplementedError(
                f"backend={name!r} is not available in this build of rewy_jax "
                f"(available: {sorted(_TABLE)}); use backend='xla' or backend=None")
        reason = be.supports(call, chunk_size, interpret, backward)
        if reason is not None:
            raise NotImplementedError(f"backend={name!r} cannot serve this call: {reason}")
        return be.impl
    for cand in _PREFERENCE.get(_platform(), ["xla"]):
        be = _TABLE.get(cand)
        if be is None:
            continue
        reason = (be.auto_supports or be.supports)(call, chunk_size, interpret, backward)
        if reason is None:
            return be.impl
        log.info("rewy_jax: backend %r skipped: %s", cand, reason)
    return _TABLE["xla"].impl
