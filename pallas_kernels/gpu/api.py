"""The Pallas GPU delta rule: kernels behind a ``jax.custom_vjp`` (ReWY or WY backward).

``general_delta`` works on padded token-layout inputs (``[B, Tp, H, D]``, Tp a multiple of C):

    q, k, e : [B, Tp, H, K]   query (unscaled: the kernels apply Config.scale), key, erase
                              vectors (bf16 / fp16 / fp32)
    z       : [B, Tp, H, V]   write vectors
    g       : None, [B, Tp, H] or [B, Tp, H, K] fp32 per-token log-decays (padding rows 0); their
              chunk-local inclusive cumsum G is what the kernels read, after clamping g to
              Config.g_floor (if set) in the same kernel
    h0      : [B, H, n_seq + 1, K, V] fp32 initial states (last slot: padding chunks)
    reset, end, seq : int32 [N] chunk metadata (launch.py docstring)
    rows    : None, or (βe, βz) [B, Tp, H] fp32 with e None and z = v: Ē = βe ⊙ k, Z = βz ⊙ v
              formed and differentiated in-kernel (one β per row: DeltaNet, GDN, KDA)

It returns ``o [B, Tp, H, V]`` (z's dtype) and ``final [B, H, n_seq + 1, K, V]`` fp32, and is
differentiable in q, k, e, z, g, h0 and rows (dg summed per token from the leaf kernel's two
parts, ``_gate_grad``). ``delta_rule_call`` adapts a backend call of ``rewy_jax``: with per-row
gates it passes rows; per-channel ones (GDN2) go as e = b ⊙ k, z = w ⊙ v in plain JAX, whose
VJPs — db, dw — come from autodiff around the kernels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.chunk_algebra import clamp_gates, exclusive_cumsum, reverse_cumsum
from pallas_kernels.gpu import chunk_backward, chunk_local, gates, launch, output, state_passes
from pallas_kernels.gpu import config as kconfig
from pallas_kernels.gpu.blocks import EmulatedTF32
from pallas_kernels.gpu.decay import CENTRED_MIN_GATE
from pallas_kernels.gpu.config import KernelConfig

F32 = jnp.float32


class Config(NamedTuple):
    chunk_size: int
    policy: str  # "recompute" | "save"
    backward: str  # "rewy" | "wy"
    interpret: bool
    kernel: KernelConfig  # every kernel setting (tiles, warps, stages, precision, algorithms)
    centred: bool = False  # vector gates declared ≥ decay.CENTRED_MIN_GATE (centred diagonals)
    # one sequence per batch row (no cu_seqlens): the metadata is reset = [chunk 0], end =
    # [chunk N − 1], seq = 0, and h0's slot 0 is the start state (launch.Shape.one_seq)
    one_seq: bool = False
    # the op's query scale, applied in-kernel to the products of q and of dO (launch.Shape.scaled)
    scale: float = 1.0
    # None, or the floor g is clamped to (chunk_algebra.clamp_gates) by the kernel that forms G,
    # the clamp's VJP applied by the one that sums dg: XLA then neither writes a clamped copy
    # of g nor masks dg (two select fusions, 0.11 ms of KDA's 2.71 at the anchor: profile-23)
    g_floor: float | None = None
    # the caller's 16-bit dtype where the kernels run on fp32 q, k, v for it
    # (KernelConfig.narrow_keys): its products are then three-TF32 ones (``_precision``)
    caller_dtype: str | None = None


def _mode(G):
    return "none" if G is None else ("scalar" if G.ndim == 3 else "vector")


def _chunks(x, C):
    """[B, Tp, ...] -> [B, Tp/C, C, ...]."""
    return x.reshape((x.shape[0], x.shape[1] // C, C) + x.shape[2:])


def _cum_gates(g, C, interpret, warps, floor=None, keep_below=False):
    """(G, below): G the chunk-local inclusive cumsum of the log-decays g clamped to ``floor``
    (None: not clamped), below None or — with keep_below and a floor — where g < floor (the
    clamp's VJP zeroes dg there: ``_gate_grad``), int8 for vector gates, bool for scalar ones.
    g None gives (None, None). Vector gates by a kernel (``cum_gates``: XLA's scan was
    the slowest of KDA's glue)."""
    if g is None:
        return None, None
    keep_below = keep_below and floor is not None
    if g.ndim == 4:
        out = gates.cum_gates(g, C, interpret=interpret, warps=warps, floor=floor, below=keep_below)
        return out if keep_below else (out, None)
    gc = g if floor is None else clamp_gates(g, floor)
    return (jnp.cumsum(_chunks(gc, C), axis=2).reshape(g.shape),
            g < floor if keep_below else None)


def _gate_grad(parts, C, interpret, warps, below=None):
    """g's gradient from ``bwd_leaf``'s two parts (pairs, path): per chunk, the reverse
    cumsum of pairs (the terms that cross every earlier token) plus the exclusive cumsum of path
    (each row's path into the end state crosses only the later tokens). Summed so, no term
    enters with both signs (chunk_algebra._leaf_grads). Vector gates by ``gate_grad``.
    below: None, or ``_cum_gates``'s mask of the gates the clamp raised (their dg is 0)."""
    if parts[0].ndim == 4:
        return gates.gate_grad(*parts, C, interpret=interpret, warps=warps, below=below)
    pairs, path = (_chunks(x, C) for x in parts)
    dg = (reverse_cumsum(pairs, 2) + exclusive_cumsum(path, 2)).reshape(parts[0].shape)
    return dg if below is None else jnp.where(below, 0.0, dg)


def _precision(dtype, interpret, narrow=False, tf32_emulation=None):
    """Dot precision for fp32 operands inside the kernels; ``dtype``: the caller's inputs'.

    fp32 inputs promise ~1e-4 (rewy-math §8): full fp32 (IEEE) dots. bf16/fp16 inputs promise
    5e-3..2e-2: TF32 dots on fp32 operands are ample and run on tensor cores — except where the
    kernels run on fp32 inputs for a 16-bit call because its keys are narrow
    (KernelConfig.narrow_keys): one TF32 rounding of the state per chunk is then most of the
    error (interpret mode, TF32 truncation emulated: DeltaNet K = 16 o 0.81 of its bound), so
    three TF32 products per dot (~fp32). The interpreter (CPU) has no TF32: its 16-bit calls'
    DEFAULT dots are exact fp32, or with ``tf32_emulation`` (KernelConfig.tf32_emulation)
    ``blocks.EmulatedTF32`` products that round their fp32 operands as the GPU does; the rest
    HIGHEST.
    """
    if jnp.dtype(dtype) == jnp.dtype(F32) or (narrow and interpret):
        return lax.Precision.HIGHEST
    if narrow:
        return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    if interpret and tf32_emulation is not None:
        return EmulatedTF32(tf32_emulation)
    return lax.Precision.DEFAULT


def _shape(cfg, q, v, G, h0):
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    return launch.Shape(B, Tp, H, K, V, cfg.chunk_size, h0.shape[2], _mode(G),
                    _precision(cfg.caller_dtype or q.dtype, cfg.interpret,
                               narrow=cfg.caller_dtype is not None,
                               tf32_emulation=cfg.kernel.tf32_emulation), cfg.kernel,
                    cfg.centred, cfg.one_seq, cfg.scale)


def _intra(s, q, k, e, z, G, interpret, dtypes=(F32, F32), rows=None):
    """(A, W, U, P): P is the gated query-key matrix [B,H,N,C,C] (vector gates: ``qk_gram``;
    None otherwise); W, U stored in ``dtypes``; A (kept only for the backward) as
    ``_stored_dtypes`` says. rows = (βe, βz): e, z are k, v as stored and the kernels scale
    their rows (``chunk_local.intra``)."""
    a_dtype = _stored_dtypes(s, q.dtype)["A"]
    P = T = None
    if s.mode == "vector" and s.cfg.gram_from_qk:
        P, T = chunk_local.qk_gram(s, q, k, G, e=e, interpret=interpret,
                          e_rows=None if rows is None else rows[0])
    elif s.mode == "vector":
        P = chunk_local.qk_gram(s, q, k, G, interpret=interpret)
    A, W, U = chunk_local.intra(s, k, e, z, G, T=T, interpret=interpret, dtypes=dtypes, a_dtype=a_dtype,
                       rows=rows)
    return A, W, U, P


def _forward_dtypes(s, dtype):
    """name -> dtype in which the forward stores W, U (intra's outputs, read by the state pass)
    and S0, R (the unfused pass's outputs, read by the output kernel and, under policy save, the
    backward): for 16-bit inputs the names in KernelConfig.forward_low_precision in 16 bits —
    W, U in the input dtype, S0, R in bf16 (its range holds any state) —, the rest in fp32.
    S0 and R both 16-bit make the pass multiply natively in bf16 (state_passes.native_pass_dots),
    as the backward's passes do."""
    names = s.cfg.forward_low_precision if jnp.dtype(dtype).itemsize < 4 else ()
    return {n: (F32 if n not in names else dtype if n in ("W", "U") else jnp.bfloat16)
            for n in kconfig.FORWARD_LOW_PRECISION_NAMES}


def _forward(cfg, q, k, e, z, G, h0, reset, end, seq, keep_states=True, rows=None):
    """(o, final, (A, W, S0, R, P)); without ``keep_states`` (nothing will read S0 and R) the
    output may be fused into the state pass (KernelConfig.fused_output), and W, S0, R then
    come back as None. rows = (βe, βz) with e None and z = v: the kernels form Ē = βe ⊙ k and
    Z = βz ⊙ v exactly (``general_delta``)."""
    s = _shape(cfg, q, z, G, h0)
    fd = _forward_dtypes(s, q.dtype)
    if rows is not None:
        e = k  # the kernels' rows convention: e, z as stored, scaled by βe, βz in-kernel
    A, W, U, P = _intra(s, q, k, e, z, G, cfg.interpret, dtypes=(fd["W"], fd["U"]), rows=rows)
    if not keep_states and s.cfg.fused_output:
        predecayed = s.mode == "vector" and s.cfg.fwd_predecayed
        kp, qp = k, q
        if predecayed:  # K̄, Qγ formed once
            kp, qp = gates.decayed_rows(k, q, G, s.C, interpret=cfg.interpret,
                                     warps=s.warps("gates"))
        # the fused pass's products: TF32 on fp32 operands (bf16 ones measured no faster)
        o, final = state_passes.fwd_pass(s, W, U, kp, G, h0, reset, end, seq, interpret=cfg.interpret,
                               out=(qp, P, q.dtype), forward=True, decayed=predecayed)
        return o, final, (A, None, None, None, P)
    S0, R, final = state_passes.fwd_pass(s, W, U, k, G, h0, reset, end, seq, interpret=cfg.interpret,
                               dtypes=(fd["S0"], fd["R"]), forward=True)
    o = output.output(s, q, k, G, S0, R, P, q.dtype, interpret=cfg.interpret)
    return o, final, (A, W, S0, R, P)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def general_delta(cfg: Config, q, k, e, z, g, h0, reset, end, seq, rows=None):
    """The op on laid-out chunks: (o [B,Tp,H,V], final [B,H,n_seq1,K,V]).

    rows: None (e, z as given), or per-row scales (βe, βz) [B,Tp,H] fp32 with e None and z the
    values v: the op's Ē = βe ⊙ k and Z = βz ⊙ v are then formed in-kernel in fp32 — exactly,
    never stored — and the backward re-forms W, U from k, v and β the same way
    (KernelConfig.row_scaled_ez: DeltaNet, GDN and KDA, whose β is one number per row).
    """
    G, _ = _cum_gates(g, cfg.chunk_size, cfg.interpret, cfg.kernel.warp("gates"), cfg.g_floor)
    o, final, _ = _forward(cfg, q, k, e, z, G, h0, reset, end, seq, keep_states=False, rows=rows)
    return o, final


def _fwd(cfg, q, k, e, z, g, h0, reset, end, seq, rows=None):
    G, below = _cum_gates(g, cfg.chunk_size, cfg.interpret, cfg.kernel.warp("gates"),
                          cfg.g_floor, keep_below=True)
    o, final, saved = _forward(cfg, q, k, e, z, G, h0, reset, end, seq,
                               keep_states=cfg.policy == "save", rows=rows)
    if cfg.policy == "recompute":
        # Keep the [C, C] chunk matrices (A, and P for vector gates: C/K of a key tensor each)
        # unless told not to (KernelConfig.keep_chunk_matrices): the backward then re-forms
        # W, U with two matmuls per row block instead of the Gram, the block substitution and
        # (vector gates) qk_gram's decay factors. The states S0 and R ([K, V] per chunk) are
        # what recompute saves memory on. P of no or scalar gates is not kept: bwd_local
        # rebuilds it.
        A, _, _, _, P = saved
        P = P if _mode(g) == "vector" else None
        saved = (A, P) if cfg.kernel.keep_chunk_matrices else None
    # G, not g, is the residual: the backward reads only G (and the clamp's int8 mask), so it
    # does not form G again (profile-21 call 3: 0.037 ms of KDA's at the anchor)
    return (o, final), (q, k, e, z, G, below, h0, reset, end, seq, saved, rows)


def _stored_dtypes(s, dtype):
    """name -> dtype in which the backward stores that tensor between kernels
    (KernelConfig.backward_low_precision): bf16 for the named ones when the inputs are 16-bit
    (bf16 also for fp16 inputs: its range holds any state), fp32 otherwise."""
    low = jnp.dtype(dtype).itemsize < 4
    names = s.cfg.backward_low_precision
    return {n: jnp.bfloat16 if (low and n in names) else F32
            for n in kconfig.LOW_PRECISION_NAMES}


def _bwd(cfg, res, cts):
    q, k, e, z, G, below, h0, reset, end, seq, saved, rows = res
    # W, U are re-formed from k, v and β exactly, as the forward formed them (rows)
    we, wz, wu_rows = (k, z, rows) if rows is not None else (e, z, None)
    dO, dfin = cts
    s = _shape(cfg, q, z, G, h0)
    it = cfg.interpret
    sd = _stored_dtypes(s, q.dtype)
    recompute = cfg.policy == "recompute"
    # both state passes in one launch (KernelConfig.twin_pass)
    twin = recompute and s.cfg.twin_pass
    if recompute:  # W, U (and A, P unless kept) and one forward state pass
        if saved is None:
            A, W, U, P = _intra(s, q, k, we, wz, G, it, dtypes=(sd["W"], sd["U"]),
                                rows=wu_rows)
        else:
            A, P = saved
            W, U = chunk_local.intra(s, k, we, wz, G, A=A, interpret=it, dtypes=(sd["W"], sd["U"]),
                            rows=wu_rows)
        fwd_args = (W, U, k, G, h0, reset, end, seq)
        if not twin:
            S0, R, _ = state_passes.fwd_pass(s, *fwd_args, interpret=it, dtypes=(sd["S0"], sd["R"]))
    else:
        A, W, S0, R, P = saved
    dRl = output.bwd_local(s, q, k, G, P, dO, interpret=it, dtype=sd["dRl"])
    bwd_args = (q, k, G, W, dO, dRl, dfin.astype(F32), reset, end, seq)
    if twin:  # the recomputed forward pass and the reverse pass in one launch
        S0, R, _, dSe, dR, dh0 = state_passes.twin_pass(s, fwd_args, bwd_args, interpret=it,
                                              fwd_dtypes=(sd["S0"], sd["R"]),
                                              bwd_dtypes=(sd["dS"], sd["dR"]))
    else:
        dSe, dR, dh0 = state_passes.bwd_pass(s, *bwd_args, interpret=it, dtypes=(sd["dS"], sd["dR"]))
    # β's leaf maps Ē = βe ⊙ k, Z = βz ⊙ v are differentiated by the kernels' e, z path and
    # XLA. Under ReWY the leaf forms e = βe ⊙ k from k itself, bit for bit
    # (KernelConfig.leaf_e_rows), so that XLA neither writes e nor the leaf reads it back; the
    # seven-product backward's bwd_dlam reads e too
    e_rows = rows is not None and cfg.backward != "wy" and s.leaf_e_rows()
    if rows is not None:
        e, z_v, z = None if e_rows else leaf_product(rows[0], k), z, leaf_product(rows[1], z)
    dq, dk, de, dz, dg = chunk_backward.bwd_chunk(
        s, q, k, e, z, G, A, S0, dSe, R, dO, dR, backward=cfg.backward,
        dtypes=(q.dtype, k.dtype, k.dtype if e is None else e.dtype, z.dtype), interpret=it,
        lam_dtype=sd["lam"], dt_dtype=sd["dT"], e_scale=rows[0] if e_rows else None)
    drows = None
    if rows is not None:  # the VJP of e = βe ⊙ k, z = βz ⊙ v
        (be, bz), de32, dz32 = rows, de.astype(F32), dz.astype(F32)
        drows = (jnp.sum(de32 * k.astype(F32), axis=-1), jnp.sum(dz32 * z_v.astype(F32), axis=-1))
        dk = (dk.astype(F32) + be[..., None] * de32).astype(k.dtype)
        de, dz = None, (bz[..., None] * dz32).astype(z_v.dtype)
    dg = None if dg is None else _gate_grad(dg, cfg.chunk_size, cfg.interpret, s.warps("gates"),
                                            below)
    return dq, dk, de, dz, dg, dh0, None, None, None, drows


general_delta.defvjp(_fwd, _bwd)


# ----------------------------------------------------------------------------------------------
# Adapter for rewy_jax's backend calls
# ----------------------------------------------------------------------------------------------
def supports(call, chunk_size, interpret):
    """None if the kernels serve this call, else the reason (rewy_jax.backends protocol)."""
    if not interpret and jax.default_backend() != "gpu":
        return f"the Pallas Triton kernels need a CUDA GPU (this device: {jax.default_backend()!r}); pass interpret=True to run them on CPU"
    K, V = call.q.shape[-1], call.v.shape[-1]
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d & (d - 1):
            return f"head dim {name}={d} must be a power of two ≥ 16 (Triton tiles)"
        if d > 256:
            return f"head dim {name}={d} > 256 is not supported by the kernels"
    if chunk_size not in (16, 32, 64):
        return f"chunk_size={chunk_size} must be 16, 32 or 64 for the Pallas GPU kernels"
    dt = jnp.dtype(call.out_dtype)
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(F32)):
        return f"input dtype {dt} is not supported (bf16, fp16 or fp32)"
    return None


def leaf_product(gate, x):
    """gate ⊙ x formed in fp32 and rounded to x's dtype — e = b ⊙ k or z = w ⊙ v as the kernels
    read them where they do not form them (per-channel gates, the backward's leaf maps).
    gate: [B,T,H] (one per row) or x's shape."""
    gate = gate if gate.ndim == x.ndim else gate[..., None]
    return (gate.astype(F32) * x.astype(F32)).astype(x.dtype)


def call_config(call, kernel_config=None, *, varlen=False):
    """The ``KernelConfig`` that ``delta_rule_call`` runs ``call`` with: ``kernel_config`` None
    (``config.default_config`` for the call's gate mode, head dims and dtype), a KernelConfig
    (as is) or a mapping of field overrides on that default (``config.resolve``)."""
    g = call.g_in
    mode = "none" if g is None else ("scalar" if g.ndim == 3 else "vector")
    return kconfig.resolve(kernel_config, mode, call.k.shape[-1], call.v.shape[-1],
                           call.out_dtype, one_seq=not varlen)


def delta_rule_call(call, *, chunk_size, policy, backward, interpret, plan=None,
                    gate_lower_bound=None, kernel_config=None):
    """Serve a ``rewy_jax.ops.GeneralCall``: returns (o [B,T,H,V], final [B or N,H,K,V] fp32).

    ``plan``: a ``rewy_jax.layout.ChunkPlan`` for variable-length inputs (its ``gather`` and
    ``scatter`` re-lay tokens so every sequence starts on a chunk boundary), else None.
    ``kernel_config``: None, a ``KernelConfig`` or a mapping of overrides (``call_config``).
    """
    kcfg = call_config(call, kernel_config, varlen=plan is not None and plan.gather is not None)
    k, v, b, w, h0 = call.k, call.v, call.b, call.w, call.h0
    # a Python scale multiplies in-kernel (Config.scale), so the kernels read q as given — a bf16
    # q·K^−½ would round again (K^−½ is not a power of two at K = 128); a traced one cannot
    # enter the kernels' static config, so it is folded into q here
    static_scale = not isinstance(call.scale, jax.core.Tracer)
    q = call.q if static_scale else call.q_scaled
    B, T = q.shape[:2]
    out_dt = call.out_dtype  # inputs' dtype (q, k may arrive in fp32 after L2 normalisation)
    K = k.shape[-1]
    # what the kernels read: fp32 for a 16-bit call with narrow keys
    # (KernelConfig.narrow_keys: its 16-bit roundings would exceed rewy-math §8 there)
    dt = F32 if K <= kcfg.narrow_keys else out_dt
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    C = chunk_size
    g = call.g_in  # fp32, clamped to call.g_floor in-kernel (Config.g_floor), not by XLA
    # per-row erase and write gates (DeltaNet, GDN, KDA): the kernels form Ē = β ⊙ k and
    # Z = β ⊙ v themselves, exactly (KernelConfig.row_scaled_ez); otherwise e, z are formed
    # here, rounded to the inputs' dtype
    row_scaled = kcfg.row_scaled_ez and b.ndim == 3 and w.ndim == 3
    if row_scaled:
        e, z, rows = None, v, (b.astype(F32), w.astype(F32))
    else:
        e, z, rows = leaf_product(b, k), leaf_product(w, v), None

    if plan is None or plan.gather is None:
        N = -(-T // C)
        Tp = N * C

        def lay(x):
            if x is None:
                return None
            pad = [(0, 0)] * x.ndim
            pad[1] = (0, Tp - T)
            return jnp.pad(x, pad)

        reset = (jnp.arange(N) == 0).astype(jnp.int32)
        end = (jnp.arange(N) == N - 1).astype(jnp.int32)
        seq = jnp.zeros((N,), jnp.int32)
        h0x = jnp.stack([h0, jnp.zeros_like(h0)], axis=2)  # [B, H, 2, K, V]
        n_seq = None
    else:
        N = plan.n_chunks
        Tp = N * C

        def lay(x):
            if x is None:
                return None
            return jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)[:, plan.gather]

        reset = plan.chunk_reset.astype(jnp.int32)
        end = jnp.zeros((N,), jnp.int32).at[plan.end_chunk].set(1)
        seq = plan.chunk_seq.astype(jnp.int32)
        n_seq = h0.shape[0]
        h0x = jnp.concatenate([h0, jnp.zeros_like(h0[:1])], axis=0)  # [n_seq + 1, H, K, V]
        h0x = jnp.moveaxis(h0x, 0, 1)[None]  # [1, H, n_seq + 1, K, V]
    centred = (gate_lower_bound is not None and g is not None and g.ndim == 4
               and gate_lower_bound >= CENTRED_MIN_GATE)
    cfg = Config(C, policy, backward, bool(interpret), kcfg, centred, n_seq is None,
                 float(call.scale) if static_scale else 1.0,
                 None if g is None else float(call.g_floor),
                 None if jnp.dtype(dt) == jnp.dtype(out_dt) else jnp.dtype(out_dt).name)
    o, final = general_delta(cfg, lay(q), lay(k), lay(e), lay(z), lay(g), h0x, reset, end, seq,
                             None if rows is None else tuple(map(lay, rows)))
    o = o.astype(out_dt)
    if n_seq is None:
        return o[:, :T], final[:, :, 0]
    return o[:, plan.scatter], jnp.moveaxis(final[0, :, :n_seq], 1, 0)
