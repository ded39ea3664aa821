"""Public ops: ``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda``, ``chunk_gdn2``.

Each op is one member of the general recurrence (rewy-math §2)

    S_t = (I − k_t e_tᵀ) Diag(α_t) S_{t−1} + k_t z_tᵀ,      o_t = scale · S_tᵀ q_t

| op                       | α_t = exp(g_t)        | e_t (erase) | z_t (write) |
|--------------------------|-----------------------|-------------|-------------|
| chunk_delta_rule         | 1                     | β_t k_t     | β_t v_t     |
| chunk_gated_delta_rule   | scalar g [B, T, H]    | β_t k_t     | β_t v_t     |
| chunk_kda                | vector g [B, T, H, K] | β_t k_t     | β_t v_t     |
| chunk_gdn2               | vector g [B, T, H, K] | b_t ⊙ k_t   | w_t ⊙ v_t   |

Every op returns ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32 or None)``, is
safe under ``jit``/``grad``/``vmap``/``checkpoint`` and differentiable in every array input.
The ``fused_recurrent_*`` twins run the token recurrence (for decoding a few tokens with a
carried state).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.chunk_algebra import RESET_GATE, clamp_gates
from pallas_kernels.vma import vary_like
from rewy_jax import backends, validate
from rewy_jax.reference import l2norm, reference_general

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_gdn2",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "fused_recurrent_gdn2",
]

log = logging.getLogger("rewy_jax")


# A gate below this is a reset for every purpose in fp32 (exp(-40) ≈ 4e-18). Clamping keeps −inf
# (full reset) from turning exp(G_r − G_s) into exp(−inf + inf) = NaN. The XLA path and the TPU
# kernels then leave resets out of the chunk-local cumulative sums (chunk_algebra.cum_gates: a
# decay across a reset is 0), so they stay small and their differences accurate.
GATE_FLOOR = RESET_GATE


class GeneralCall(NamedTuple):
    """An op call in the general form, ready for a backend: q normalised (if asked), not yet
    scaled — ``q_scaled`` is q · scale in fp32; a backend that applies the scale inside its
    kernels reads q as given, so a 16-bit q is not rounded again after the scaling."""

    q: jax.Array  # [B, T, H, K], the input's dtype (fp32 after L2 normalisation)
    k: jax.Array  # [B, T, H, K]
    v: jax.Array  # [B, T, H, V]
    g_in: jax.Array | None  # None, [B, T, H] or [B, T, H, K] fp32 log-decay as given (≤ 0)
    b: jax.Array  # [B, T, H] or [B, T, H, K] erase gate
    w: jax.Array  # [B, T, H] or [B, T, H, V] write gate
    h0: jax.Array  # [B or N, H, K, V] fp32
    cu_seqlens: jax.Array | None
    out_dtype: jnp.dtype
    g_bound: float | None = None  # declared lower bound of g (vector gates), g clamped to it
    scale: float | jax.Array = 1.0  # multiplies q (a Python float, or traced)
    g_floor: float = GATE_FLOOR  # g is clamped to it: g_bound if declared, else GATE_FLOOR

    @property
    def g(self):
        """The log-decay every backend's recurrence reads: g_in clamped to g_floor
        (``clamp_gates``). The Pallas GPU kernels and the Mosaic GPU vector-gate kernels read
        g_in and clamp in-kernel instead, so that under jit XLA drops this tensor (and its VJP)
        as unused."""
        return clamp_gates(self.g_in, self.g_floor)

    @property
    def q_scaled(self):
        """q · scale in fp32 (fp64 for fp64 inputs): what o_t = S_tᵀ q_t reads."""
        return self.q.astype(jnp.promote_types(self.q.dtype, jnp.float32)) * self.scale


def _prepare(q, k, v, g, b, w, *, g_kind, b_kind, w_kind, scale, initial_state, use_qk_l2norm,
             cu_seqlens, gate_names, gate_lower_bound=None, context_axis=None,
             use_qk_l2norm_in_kernel=None, checked=False):
    validate.check_qkv(q, k, v)
    validate.check_checked(checked)
    use_qk_l2norm = validate.resolve_l2norm(use_qk_l2norm, use_qk_l2norm_in_kernel)
    validate.check_scale(scale)
    K, V = q.shape[-1], v.shape[-1]
    g_name, b_name, w_name = gate_names
    if g_kind == "scalar":
        validate.check_per_token(g_name, g, q, None, "")
    elif g_kind == "vector":
        validate.check_per_token(g_name, g, q, K, "K")
    validate.check_per_token(b_name, b, q, K if b_kind == "vector" else None, "K")
    if w_name is not None:
        validate.check_per_token(w_name, w, q, V if w_kind == "vector" else None, "V")
    # Gate domains (rewy-math §1–§2): g ≤ 0, β and b in [0, 2], w in [0, 2].
    validate.check_gate_domain(g_name, g, None, 0.0, checked=checked)
    validate.check_gate_domain(b_name, b, 0.0, 2.0, checked=checked)
    if w_name is not None:
        validate.check_gate_domain(w_name, w, 0.0, 2.0, checked=checked)
    validate.check_gate_lower_bound(gate_lower_bound, g, GATE_FLOOR)
    validate.check_traced_gate_bound(gate_lower_bound, g, checked=checked)
    n_seq = validate.check_cu_seqlens(cu_seqlens, _global_tokens(q, context_axis))
    validate.check_traced_cu_seqlens(cu_seqlens, _global_tokens(q, context_axis).shape[1],
                                     checked=checked)
    validate.check_initial_state(initial_state, q, v, n_seq)
    if scale is None:
        scale = K ** -0.5
    out_dtype = q.dtype
    # Normalise in fp32 and keep fp32: rounding q and k back to bf16 here would add a bf16
    # rounding on top of the inputs' own (the kernels read them once either way). The scale
    # travels beside q (GeneralCall.q_scaled) for the same reason.
    if use_qk_l2norm:
        f32 = jnp.promote_types(q.dtype, jnp.float32)
        q, k = l2norm(q.astype(f32)), l2norm(k.astype(f32))
    floor = GATE_FLOOR if gate_lower_bound is None else float(gate_lower_bound)
    if g is not None:
        g = g.astype(jnp.float32)  # clamped to floor where read (GeneralCall.g)
    B, _, H, _ = q.shape
    lead = B if n_seq is None else n_seq
    h0 = (jnp.zeros((lead, H, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    # Under shard_map(check_vma=True) every array of the call varies along the same manual axes:
    # an invariant (replicated) input is cast to varying, whose transpose sums its cotangent.
    shared_bw = w is b  # DeltaNet/GDN/KDA pass β once; backends rely on the identity
    q, k, v, g, b, w, h0 = vary_like((q, k, v, g, b, w, h0), q, k, v, g, b, w, h0)
    w = b if shared_bw else w
    return GeneralCall(q, k, v, g, b, w, h0, cu_seqlens, out_dtype,
                       None if gate_lower_bound is None else float(gate_lower_bound), scale,
                       floor)


def _global_tokens(q, context_axis):
    """q's shape over the whole sequence: T_local · devices under context parallelism."""
    if context_axis is None:
        return q
    from rewy_jax.context_parallel import axis_size

    B, T, H, K = q.shape
    return jax.ShapeDtypeStruct((B, T * axis_size(context_axis), H, K), q.dtype)


def _run_chunk(call: GeneralCall, *, chunk_size, policy, backward, backend, interpret,
               output_final_state, scale, context_axis=None, kernel_config=None):
    validate.check_options(chunk_size=chunk_size, policy=policy, backward=backward,
                           backend=backend, scale=scale)
    if context_axis is not None:  # T split over a shard_map axis (rewy_jax.context_parallel)
        from rewy_jax import context_parallel

        name = backend
        if call.cu_seqlens is not None:
            # Each device sees the sequences outside its slice as empty segments, which only the
            # XLA path handles (the Pallas kernels leave an empty sequence's dh0 unwritten).
            if backend not in (None, "xla"):
                raise NotImplementedError(
                    f"context_axis with cu_seqlens runs on backend='xla' (or None); got "
                    f"backend={backend!r}")
            name = "xla"

        def impl_for(c):
            return backends.select(name, c, chunk_size=chunk_size, interpret=interpret,
                                   backward=backward)

        o, final = context_parallel.run_chunk(call, context_axis, impl_for=impl_for,
                                              chunk_size=chunk_size, policy=policy,
                                              backward=backward, interpret=interpret)
        return o.astype(call.out_dtype), (final if output_final_state else None)
    if kernel_config is not None and backend is None:
        backend = "pallas_gpu"  # the only kernels it configures (refused below off a GPU)
    impl = backends.select(backend, call, chunk_size=chunk_size, interpret=interpret,
                           backward=backward)
    # kernel settings exist only for the Pallas GPU kernels: refused elsewhere, not ignored
    kw = {}
    if kernel_config is not None:
        if getattr(impl, "__wrapped__", impl) is not backends.pallas_gpu_impl:
            raise ValueError("kernel_config= configures the Pallas GPU kernels; this call runs "
                             "another backend (pass backend='pallas_gpu')")
        kw = {"kernel_config": kernel_config}
    o, final = impl(call, chunk_size=chunk_size, policy=policy, backward=backward,
                    interpret=interpret, **kw)
    return o.astype(call.out_dtype), (final if output_final_state else None)


_COMMON_DOC = """
    Args (shapes: B batch, T time, H heads, K key dim, V value dim):
      q, k: [B, T, H, K]; v: [B, T, H, V] (bf16, fp16, fp32 or fp64).
{gates}
      scale: multiplies q; default K^-1/2.
      initial_state: [B, H, K, V] (or [N, H, K, V] with cu_seqlens); fp32 recommended.
      output_final_state: also return the final state [B (or N), H, K, V] fp32.
      use_qk_l2norm: L2-normalise q and k over the feature axis first (VJP included); default
        False. use_qk_l2norm_in_kernel: FLA's name for the same option (give either; both only
        if equal).
      chunk_size: rows per chunk, a power of two ≥ 16 (default 64).
      policy: "recompute" (least memory; backward recomputes the chunk states; the Pallas GPU
        kernels keep the [C, C] chunk matrices, see the README's API table) or "save"
        (forward keeps chunk states and residuals; faster backward).
      backward: "rewy" (the reduced backward, three local WY products) or "wy" (the standard
        seven-product backward, for ablations). Both give the same gradients.
      backend: None (fastest that supports the call on this device), "pallas" (this device's
        kernels), "pallas_gpu", "mosaic_gpu" (Hopper kernels: DeltaNet, GDN), "pallas_tpu",
        "xla" (chunked jnp; runs anywhere) or "reference" (token recurrence).
      interpret: run a Pallas backend in interpret mode (on CPU).
      cu_seqlens: [N+1] int offsets of N packed sequences (FLA convention, B must be 1).
      context_axis: inside ``jax.shard_map``, the mesh axis over which T is split (context
        parallelism, rewy_jax.context_parallel): q/k/v/gates are this device's contiguous slice
        of T; initial_state and cu_seqlens are global (replicated); o is the local slice and
        final_state the global one, the same on every device. Default None: T is local.
      checked: also check traced inputs (under jit): g ≤ 0, β/b/w in [0, 2], gate_lower_bound,
        cu_seqlens, as ``jax.experimental.checkify`` checks — wrap the caller in
        ``checkify.checkify``. Concrete inputs are always checked (ValueError naming the
        argument); see docs/input-contract.md.
      kernel_config: backend "pallas_gpu" only (with backend=None it selects "pallas_gpu") —
        None (the measured defaults), a
        ``pallas_kernels.gpu.config.KernelConfig`` or a dict of its field overrides, e.g.
        ``{{"block_v": 32}}`` (tiles, warps, stages, precision policy, algorithm choices).
{extra}    Returns:
      (o [B, T, H, V] in q's dtype, final_state fp32 or None).
"""


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm=None, chunk_size=64, policy="recompute", backward="rewy",
                     backend=None, interpret=False, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=None, checked=False, context_axis=None,
                     kernel_config=None):
    call = _prepare(q, k, v, None, beta, beta, g_kind=None, b_kind="scalar", w_kind="scalar",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checked=checked, context_axis=context_axis,
                    gate_names=(None, "beta", None))
    return _run_chunk(call, chunk_size=chunk_size, policy=policy, backward=backward,
                      backend=backend, interpret=interpret, output_final_state=output_final_state,
                      scale=scale, context_axis=context_axis,
                      kernel_config=kernel_config)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm=None, chunk_size=64,
                           policy="recompute", backward="rewy", backend=None, interpret=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=None, checked=False, context_axis=None,
                           kernel_config=None):
    call = _prepare(q, k, v, g, beta, beta, g_kind="scalar", b_kind="scalar", w_kind="scalar",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checked=checked, context_axis=context_axis,
                    gate_names=("g", "beta", None))
    return _run_chunk(call, chunk_size=chunk_size, policy=policy, backward=backward,
                      backend=backend, interpret=interpret, output_final_state=output_final_state,
                      scale=scale, context_axis=context_axis,
                      kernel_config=kernel_config)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm=None, chunk_size=64, policy="recompute", backward="rewy",
              backend=None, interpret=False, cu_seqlens=None, gate_lower_bound=None,
              use_qk_l2norm_in_kernel=None, checked=False, context_axis=None,
              kernel_config=None):
    call = _prepare(q, k, v, g, beta, beta, g_kind="vector", b_kind="scalar", w_kind="scalar",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, gate_lower_bound=gate_lower_bound,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, checked=checked,
                    context_axis=context_axis, gate_names=("g", "beta", None))
    return _run_chunk(call, chunk_size=chunk_size, policy=policy, backward=backward,
                      backend=backend, interpret=interpret, output_final_state=output_final_state,
                      scale=scale, context_axis=context_axis,
                      kernel_config=kernel_config)


def chunk_gdn2(q, k, v, g, b, w, *, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm=None, chunk_size=64, policy="recompute", backward="rewy",
               backend=None, interpret=False, cu_seqlens=None, gate_lower_bound=None,
               use_qk_l2norm_in_kernel=None, checked=False, context_axis=None,
               kernel_config=None):
    call = _prepare(q, k, v, g, b, w, g_kind="vector", b_kind="vector", w_kind="vector",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, gate_lower_bound=gate_lower_bound,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, checked=checked,
                    context_axis=context_axis, gate_names=("g", "b", "w"))
    return _run_chunk(call, chunk_size=chunk_size, policy=policy, backward=backward,
                      backend=backend, interpret=interpret, output_final_state=output_final_state,
                      scale=scale, context_axis=context_axis,
                      kernel_config=kernel_config)


_BOUND_DOC = """      gate_lower_bound: None, or a static float in [−40, 0) that every g respects (a concrete g
        below it raises; a traced one is clamped to it), as a layer with bounded gates declares.
        At ≥ −5 the Pallas GPU backward evaluates diagonal sub-chunk decays as one centred
        matmul instead of the exact bit-level form (rewy-math §3); other backends are exact
        regardless.
"""

chunk_delta_rule.__doc__ = "DeltaNet: α = 1, e = βk, z = βv (chunked).\n" + _COMMON_DOC.format(
    gates="      beta: [B, T, H] write strength β ∈ [0, 2].", extra="")
chunk_gated_delta_rule.__doc__ = "Gated DeltaNet (GDN): scalar decay per head (chunked).\n" + \
    _COMMON_DOC.format(gates="      g: [B, T, H] log-decay ≤ 0 (−inf = reset); beta: [B, T, H] in [0, 2].",
                       extra="")
chunk_kda.__doc__ = "Kimi Delta Attention (KDA): per-key-channel decay (chunked).\n" + \
    _COMMON_DOC.format(gates="      g: [B, T, H, K] log-decay ≤ 0 (−inf = reset); beta: [B, T, H] in [0, 2].",
                       extra=_BOUND_DOC)
chunk_gdn2.__doc__ = "Gated DeltaNet-2 (GDN2): per-channel decay, erase gate b, write gate w.\n" + \
    _COMMON_DOC.format(gates=("      g: [B, T, H, K] log-decay ≤ 0; b: [B, T, H, K] erase gate in [0, 2];\n"
                              "      w: [B, T, H, V] write gate."), extra=_BOUND_DOC)


# ----------------------------------------------------------------------------------------------
# Recurrent (decode) form
# ----------------------------------------------------------------------------------------------
def _run_recurrent(call: GeneralCall, output_final_state):
    if call.cu_seqlens is not None and isinstance(call.cu_seqlens, jax.core.Tracer):
        # reference_general runs the sequences one by one, so it needs the offsets' values.
        raise NotImplementedError(
            "fused_recurrent_* with cu_seqlens needs concrete offsets (not traced under jit): "
            "pass cu_seqlens as a static/NumPy value, or use the chunk_* op (backend='xla') "
            "which accepts traced cu_seqlens")
    o, final = reference_general(call.q_scaled, call.k, call.v, call.g, call.b, call.w,
                                 scale=1.0, initial_state=call.h0, cu_seqlens=call.cu_seqlens,
                                 dtype=jnp.promote_types(call.out_dtype, jnp.float32))
    return o.astype(call.out_dtype), (final.astype(jnp.float32) if output_final_state else None)


def fused_recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None,
                               output_final_state=True, use_qk_l2norm=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=None, checked=False):
    """Token-by-token DeltaNet (decode form); arguments as ``chunk_delta_rule``."""
    call = _prepare(q, k, v, None, beta, beta, g_kind=None, b_kind="scalar", w_kind="scalar",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checked=checked, gate_names=(None, "beta", None))
    return _run_recurrent(call, output_final_state)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                                     output_final_state=True, use_qk_l2norm=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=None, checked=False):
    """Token-by-token GDN (decode form); arguments as ``chunk_gated_delta_rule``."""
    call = _prepare(q, k, v, g, beta, beta, g_kind="scalar", b_kind="scalar", w_kind="scalar",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checked=checked, gate_names=("g", "beta", None))
    return _run_recurrent(call, output_final_state)


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
                        output_final_state=True, use_qk_l2norm=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=None, checked=False):
    """Token-by-token KDA (decode form); arguments as ``chunk_kda``."""
    call = _prepare(q, k, v, g, beta, beta, g_kind="vector", b_kind="scalar", w_kind="scalar",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checked=checked, gate_names=("g", "beta", None))
    return _run_recurrent(call, output_final_state)


def fused_recurrent_gdn2(q, k, v, g, b, w, *, scale=None, initial_state=None,
                         output_final_state=True, use_qk_l2norm=None, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=None, checked=False):
    """Token-by-token GDN2 (decode form); arguments as ``chunk_gdn2``."""
    call = _prepare(q, k, v, g, b, w, g_kind="vector", b_kind="vector", w_kind="vector",
                    scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                    cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checked=checked, gate_names=("g", "b", "w"))
    return _run_recurrent(call, output_final_state)
