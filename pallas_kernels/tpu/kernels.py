"""Mosaic TPU kernels of the general delta rule: chunked forward and ReWY's reduced backward.

Chunk layout (as ``rewy_jax.xla_chunked``): q, k, e ``[B, H, N, C, K]``, z ``[B, H, N, C, V]``,
gate g None / ``[B, H, Np, C]`` (scalar: one row of C gates per chunk, N padded to a multiple of
8 so a block is a dense (8, C) tile holding 8 chunks — a ``[C, 1]`` column block would pad every
gate to 128 lanes in HBM) / ``[B, H, N, C, K]`` (vector), holding the *raw* per-token log-decays —
the chunk-local cumsum is a triangular ones matmul inside the kernel, and dg its transpose. Initial/final states
``[B, S+1, H, K, V]`` fp32 (S sequences plus one dropped slot that padding chunks map to).

Grid ``(B, H, N)``: batch and heads "parallel", chunks "arbitrary" (sequential); the state S (the
state cotangent dS in the backward) lives in a ``[K, V]`` fp32 VMEM scratch across the chunk axis.
Sequence structure comes in by scalar prefetch (SMEM): ``reset[N]`` (chunk starts a sequence:
load h0), ``seq[N]`` (which sequence: selects the h0/final/dh0 block), ``end[N]`` (chunk ends a
sequence: the backward injects d final there). A plain batch is one sequence per row; packed
variable-length input (``cu_seqlens``) is the same kernel with other metadata.

Kernels (all blocks are whole ``[C, D]`` / ``[K, V]`` tiles: last two dims equal the array's):
  ``_fwd_kernel``  mode "fwd": o, final (+ S0 and R per chunk with policy "save");
                   mode "states": only the chunk start states S0 (the recompute pass).
  ``_bwd_kernel``  reverse chunk order: dq, dk, de, dz, dg, dh0 (ReWY or the seven-product WY).
Matmuls are fp32 ``Precision.HIGHEST`` (the fp32 accuracy contract, rewy-math §8), except the
backward's leaf products for bf16 callers (``operands="bfloat16"``; see ``algebra``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.chunk_algebra import ChunkLocal
from pallas_kernels.tpu import algebra as ta

f32 = jnp.float32
_GATE_ROWS = 8  # chunks per scalar-gate tile: (8, C) is a dense f32 sublane tile


def _interpret_arg(interpret):
    """``True`` -> the TPU interpreter (``pltpu.InterpretParams()``); params pass through."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


# ----------------------------------------------------------------------------------------------
# One chunk: what a grid step computes on its loaded blocks (also traced by roofline.py)
# ----------------------------------------------------------------------------------------------
def _cum_gate(g, C):
    """Chunk-local inclusive cumsum of the raw gate block: scalar [1, C] row -> [C, 1] column
    (lane cumsum as a ones matmul, then a mask-transpose); vector [C, K] -> [C, K]."""
    if g is None:
        return None
    g = g.astype(f32)
    if g.shape[0] == 1:
        return ta.row_to_col(ta.mm_nt(g, ca_tril(C)))
    return ta.cumsum_rows(g)


def ca_tril(C):
    """[C, C] lower-triangular ones (diagonal included), fp32."""
    return ta.ca._tril_mask(C, strict=False).astype(f32)


def forward_chunk(q, k, e, z, g, S0, operands=None):
    """q, k, e [C, K]; z [C, V]; g None / [1, C] (scalar) / [C, K] (vector) raw log-decays;
    S0 [K, V] fp32.

    operands: None (exact fp32 products) or a dtype for the chunk-local matmul operands
    (``algebra.fast_operands``). Returns O [C, V], R [C, V], S_C [K, V] (fp32)."""
    q, k, e, z = (x.astype(f32) for x in (q, k, e, z))
    decay = ta.make_decay(_cum_gate(g, q.shape[0]), q.shape[0])
    with ta.fast_operands(operands):
        loc = ta.chunk_local(q, k, e, z, decay)
        O, R = ta.chunk_output(loc, S0)
        return O, R, ta.next_state(loc, decay, S0, R)


def backward_chunk(q, k, e, z, g, S0, R, dO, dS, scheme="rewy", operands=None):
    """One chunk's backward. R None: recomputed from S0 (policy "recompute"), else saved.

    Returns ((dq, dk, de, dz, dg or None), dS0): raw-frame input cotangents, dg w.r.t. the raw
    per-token gates (reverse cumsum of dG as a ones matmul), dS0 for the previous chunk."""
    q, k, e, z, dO = (x.astype(f32) for x in (q, k, e, z, dO))
    decay = ta.make_decay(_cum_gate(g, q.shape[0]), q.shape[0])
    scalar_row = g is not None and g.shape[0] == 1
    with ta.fast_operands(operands):
        grads, dS0 = _backward_chunk(q, k, e, z, decay, S0, R, dO, dS, scheme)
    dg = grads[4]
    if scalar_row:  # [C, 1] reverse cumsum -> the [1, C] row layout of the gate
        dg = ta.col_to_row(dg)
    return grads[:4] + (dg,), dS0


def _backward_chunk(q, k, e, z, decay, S0, R, dO, dS, scheme):
    if R is not None:  # policy "save": R and S0 come from the forward; W, U not needed
        with ta.fast_operands(None):  # the forward's exact T, A, P
            loc = ChunkLocal(A=ta.unit_lower_inverse(decay.gram(e, k, strict=True)), W=None,
                             U=None, P=decay.gram(q, k, strict=False), Qg=decay.head(q),
                             Eg=decay.head(e), Kt=decay.tail(k))
    else:
        loc = ta.chunk_local(q, k, e, z, decay)
        R = loc.U - ta.mm(loc.W, S0)  # exact: U and W S0 nearly cancel
    grads, dS0 = ta.backward_chunk(q, k, e, z, decay, loc, S0, R, dO, dS, scheme)
    dg = None if grads.dG is None else ta.rev_cumsum_rows(grads.dG)
    return (grads.dq, grads.dk, grads.de, grads.dz, dg), dS0


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def _load_gate(g_ref, c, gate_rows):
    """The gate block of chunk c: vector [C, K], or row c % 8 of a scalar (8, C) tile."""
    if g_ref is None:
        return None
    if gate_rows:
        return g_ref[pl.ds(c % _GATE_ROWS, 1), :]
    return g_ref[...]


def _fwd_kernel(reset_ref, seq_ref, end_ref, *refs, has_g, gate_rows, mode, save, operands):
    del seq_ref, end_ref  # used by the index maps only
    it = iter(refs)
    q_ref, k_ref, e_ref, z_ref = next(it), next(it), next(it), next(it)
    g_ref = next(it) if has_g else None
    h0_ref = next(it)
    if mode == "fwd":
        o_ref, final_ref = next(it), next(it)
        s0_ref, r_ref = (next(it), next(it)) if save else (None, None)
    else:
        s0_ref = next(it)
    S_scr = next(it)

    n = pl.program_id(2)

    @pl.when(reset_ref[n] != 0)
    def _():
        S_scr[...] = h0_ref[...]

    S0 = S_scr[...]
    g = _load_gate(g_ref, n, gate_rows)
    O, R, S_new = forward_chunk(q_ref[...], k_ref[...], e_ref[...], z_ref[...], g, S0, operands)
    S_scr[...] = S_new
    if s0_ref is not None:
        s0_ref[...] = S0
    if mode == "fwd":
        o_ref[...] = O.astype(o_ref.dtype)
        # Written every chunk; the block (b, seq, h) is flushed after its sequence's last chunk.
        final_ref[...] = S_new
        if save:
            r_ref[...] = R


def _specs(B, H, N, C, K, V, g, reverse=False):
    """BlockSpecs of the chunk-layout inputs (q, k, e, z[, g]) and the per-sequence states."""
    def chunk(b, h, n, *_):
        return (b, h, N - 1 - n if reverse else n, 0, 0)

    def gate_rows(b, h, n, *_):  # scalar gates: the (8, C) tile holding chunk n's row
        return (b, h, (N - 1 - n if reverse else n) // _GATE_ROWS, 0)

    def state(b, h, n, reset, seq, end):
        return (b, seq[N - 1 - n if reverse else n], h, 0, 0)

    sq = pl.Squeezed() if hasattr(pl, "Squeezed") else None
    kspec = pl.BlockSpec((sq, sq, sq, C, K), chunk)
    vspec = pl.BlockSpec((sq, sq, sq, C, V), chunk)
    if g is None:
        gspec = []
    elif g.ndim == 4:
        gspec = [pl.BlockSpec((sq, sq, _GATE_ROWS, C), gate_rows)]
    else:
        gspec = [pl.BlockSpec((sq, sq, sq, C, K), chunk)]
    ins = [kspec, kspec, kspec, vspec] + gspec
    st = pl.BlockSpec((sq, sq, sq, K, V), state)
    s0 = pl.BlockSpec((sq, sq, sq, K, V), chunk)
    return ins, vspec, st, s0


_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def forward_call(q, k, e, z, g, h0, meta, *, mode="fwd", save=False, operands=None,
                 interpret=False):
    """Run the forward kernel. meta = (reset, seq, end) int32 [N].

    mode "fwd": returns (o [B,H,N,C,V] in z.dtype, final [B,S+1,H,K,V] fp32, S0s, R) with S0s, R
    None unless save. mode "states": returns S0s [B,H,N,K,V] fp32.
    """
    B, H, N, C, K = q.shape
    V = z.shape[-1]
    has_g = g is not None
    ins, vspec, st, s0 = _specs(B, H, N, C, K, V, g)
    in_specs = ins + [st]
    args = [q, k, e, z] + ([g] if has_g else []) + [h0]
    s0_shape = jax.ShapeDtypeStruct((B, H, N, K, V), f32)
    if mode == "fwd":
        out_specs = [vspec, st] + ([s0, vspec] if save else [])
        out_shape = [jax.ShapeDtypeStruct((B, H, N, C, V), z.dtype),
                     jax.ShapeDtypeStruct(h0.shape, f32)]
        if save:
            out_shape += [s0_shape, jax.ShapeDtypeStruct((B, H, N, C, V), f32)]
    else:
        out_specs, out_shape = [s0], [s0_shape]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), f32)])
    kern = functools.partial(_fwd_kernel, has_g=has_g, gate_rows=has_g and g.ndim == 4, mode=mode,
                             save=save, operands=operands)
    outs = pl.pallas_call(kern, grid_spec=grid_spec, out_shape=out_shape,
                          compiler_params=_PARAMS, interpret=_interpret_arg(interpret))(*meta, *args)
    if mode == "fwd":
        return (outs[0], outs[1]) + ((outs[2], outs[3]) if save else (None, None))
    return outs[0]


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
def _bwd_kernel(reset_ref, seq_ref, end_ref, *refs, has_g, gate_rows, has_r, scheme, n_chunks,
                operands):
    del seq_ref
    it = iter(refs)
    q_ref, k_ref, e_ref, z_ref = next(it), next(it), next(it), next(it)
    g_ref = next(it) if has_g else None
    s0_ref = next(it)
    r_ref = next(it) if has_r else None
    do_ref, dfinal_ref = next(it), next(it)
    dq_ref, dk_ref, de_ref, dz_ref = next(it), next(it), next(it), next(it)
    dg_ref = next(it) if has_g else None
    dh0_ref = next(it)
    dS_scr = next(it)

    n = pl.program_id(2)
    c = n_chunks - 1 - n  # chunks run in reverse

    @pl.when(n == 0)
    def _():
        dS_scr[...] = jnp.zeros(dS_scr.shape, f32)

    @pl.when(end_ref[c] != 0)
    def _():
        dS_scr[...] = dfinal_ref[...]  # a sequence's last chunk: the carry from the next is 0

    g = _load_gate(g_ref, c, gate_rows)
    R = None if r_ref is None else r_ref[...]
    (dq, dk, de, dz, dg), dS0 = backward_chunk(q_ref[...], k_ref[...], e_ref[...], z_ref[...], g,
                                               s0_ref[...], R, do_ref[...], dS_scr[...], scheme,
                                               operands)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    de_ref[...] = de.astype(de_ref.dtype)
    dz_ref[...] = dz.astype(dz_ref.dtype)
    if gate_rows:  # scalar gates: row c % 8 of the (8, C) tile
        dg_ref[pl.ds(c % _GATE_ROWS, 1), :] = dg.astype(dg_ref.dtype)
    elif has_g:
        dg_ref[...] = dg.astype(dg_ref.dtype)
    dS_scr[...] = dS0
    dh0_ref[...] = dS0  # flushed after the sequence's first chunk (the last one visited)


def backward_call(q, k, e, z, g, S0s, R, dO, dfinal, meta, *, scheme="rewy", operands=None,
                  interpret=False):
    """Run the backward kernel. Returns (dq, dk, de, dz, dg or None, dh0 [B,S+1,H,K,V])."""
    B, H, N, C, K = q.shape
    V = z.shape[-1]
    has_g, has_r = g is not None, R is not None
    ins, vspec, st, s0 = _specs(B, H, N, C, K, V, g, reverse=True)
    kspec = ins[0]
    in_specs = ins + [s0] + ([vspec] if has_r else []) + [vspec, st]
    args = [q, k, e, z] + ([g] if has_g else []) + [S0s] + ([R] if has_r else []) + [dO, dfinal]
    out_specs = [kspec, kspec, kspec, vspec] + ([ins[4]] if has_g else []) + [st]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, e, z)]
    if has_g:
        out_shape.append(jax.ShapeDtypeStruct(g.shape, g.dtype))
    out_shape.append(jax.ShapeDtypeStruct(dfinal.shape, f32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), f32)])
    kern = functools.partial(_bwd_kernel, has_g=has_g, gate_rows=has_g and g.ndim == 4,
                             has_r=has_r, scheme=scheme, n_chunks=N, operands=operands)
    outs = pl.pallas_call(kern, grid_spec=grid_spec, out_shape=out_shape,
                          compiler_params=_PARAMS, interpret=_interpret_arg(interpret))(*meta, *args)
    dq, dk, de, dz = outs[:4]
    dg = outs[4] if has_g else None
    return dq, dk, de, dz, dg, outs[-1]


# ----------------------------------------------------------------------------------------------
# The differentiable op
# ----------------------------------------------------------------------------------------------
def chunked_delta_tpu(q, k, e, z, g, h0, meta, policy="recompute", backward="rewy",
                      operands=None, interpret=False):
    """The general delta rule on chunk-layout inputs, by the TPU kernels (module docstring).

    Scalar gates may come as ``[B, H, N, C]`` or ``[B, H, N, C, 1]``; they are laid out as
    (8, C) row tiles here (N padded to a multiple of 8; the pad is differentiated by JAX).
    """
    if g is not None and (g.ndim == 4 or g.shape[-1] == 1):
        g = g.reshape(g.shape[:4])
        N = g.shape[2]
        g = jnp.pad(g, ((0, 0), (0, 0), (0, -N % _GATE_ROWS), (0, 0)))
    return _chunked_delta(q, k, e, z, g, h0, meta, policy, backward, operands, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunked_delta(q, k, e, z, g, h0, meta, policy="recompute", backward="rewy",
                   operands=None, interpret=False):
    """The general delta rule on chunk-layout inputs, by the TPU kernels (module docstring).

    Args:
      q, k, e: [B, H, N, C, K] scaled query, key, erase vectors; z: [B, H, N, C, V] write vectors.
      g: None, [B, H, Np, C] (scalar, row tiles) or [B, H, N, C, K] raw log-decays (≤ 0;
        cumsum done in-kernel).
      h0: [B, S+1, H, K, V] fp32 initial states (slot S is for padding chunks).
      meta: (reset, seq, end) int32 [N] chunk metadata (not differentiated).
      policy: "recompute" | "save"; backward: "rewy" | "wy"; interpret: bool or InterpretParams.
      operands: None (exact fp32 products) or "bfloat16" (bf16 operands for the chunk-local
        products, fp32 accumulation; the state products stay fp32).
    Returns:
      o [B, H, N, C, V] (z.dtype), final [B, S+1, H, K, V] fp32.
    """
    o, final, _, _ = forward_call(q, k, e, z, g, h0, meta, operands=operands, interpret=interpret)
    return o, final


def _fwd(q, k, e, z, g, h0, meta, policy, backward, operands, interpret):
    save = policy == "save"
    o, final, S0s, R = forward_call(q, k, e, z, g, h0, meta, save=save, operands=operands,
                                    interpret=interpret)
    return (o, final), (q, k, e, z, g, h0, meta, S0s, R)


def _bwd(policy, backward, operands, interpret, res, cts):
    q, k, e, z, g, h0, meta, S0s, R = res
    dO, dfinal = cts
    if S0s is None:  # "recompute": one forward state pass for the chunk start states
        S0s = forward_call(q, k, e, z, g, h0, meta, mode="states", operands=operands,
                           interpret=interpret)
    dq, dk, de, dz, dg, dh0 = backward_call(q, k, e, z, g, S0s, R, dO, dfinal.astype(f32), meta,
                                            scheme=backward, operands=operands,
                                            interpret=interpret)
    dmeta = jax.tree.map(lambda m: None, meta)
    return dq, dk, de, dz, dg, dh0.astype(h0.dtype), dmeta


_chunked_delta.defvjp(_fwd, _bwd)


def chunk_meta(chunk_reset, chunk_seq, end_chunk):
    """(reset, seq, end) int32 [N] from ``rewy_jax.layout.ChunkPlan`` fields."""
    N = chunk_reset.shape[0]
    end = jnp.zeros((N,), jnp.int32).at[end_chunk].set(1)
    return (chunk_reset.astype(jnp.int32), chunk_seq.astype(jnp.int32), end)
