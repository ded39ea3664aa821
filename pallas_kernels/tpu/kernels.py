"""Mosaic TPU kernels of the general delta rule: chunked forward and ReWY's reduced backward.

Per-token arrays come in one of two layouts (see ``_token_spec``): the *token layout*
``[B, N·C, H·D]`` — the public ``[B, T, H, D]`` padded to N·C rows and reshaped for free, whose
(C, D) blocks are legal TPU tiles when D is a multiple of 128, so no HBM transpose is needed — or
the chunk layout (as ``rewy_jax.xla_chunked``): q, k ``[B, H, N, C, K]``, v ``[B, H, N, C, V]``;
the per-token gates — erase b, write w (None: the same scalar β as b) and log-decay g (None or
raw per-token values; the chunk-local cumsum is a triangular ones matmul in-kernel and dg its
transpose) — are either dense vectors ``[B, H, N, C, D]`` or per-token scalars laid out as
``[B, H, Np, C]`` (one row of C values per chunk, N padded to a multiple of 8, so a block is a
dense (8, C) tile holding 8 chunks; a ``[C, 1]`` column block would pad every scalar to 128 lanes
in HBM). The leaf maps e = b ⊙ k and z = w ⊙ v run in-kernel (and their VJPs: db, dw, dβ), so
e and z never touch HBM. Initial/final states ``[B, S+1, H, K, V]`` fp32 (S sequences plus one
dropped slot that padding chunks map to).

Grid ``(B, H, N)``: batch and heads "parallel", chunks "arbitrary" (sequential); the state S (the
state cotangent dS in the backward) lives in a ``[K, V]`` fp32 VMEM scratch across the chunk axis.
Sequence structure comes in by scalar prefetch (SMEM): ``reset[N]`` (chunk starts a sequence:
load h0), ``seq[N]`` (which sequence: selects the h0/final/dh0 block), ``end[N]`` (chunk ends a
sequence: the backward injects d final there). A plain batch is one sequence per row; packed
variable-length input (``cu_seqlens``) is the same kernel with other metadata.

Kernels (dense blocks are whole ``[C, D]`` / ``[K, V]`` tiles: last two dims equal the array's):
  ``_fwd_kernel``  mode "fwd": o, final (+ S0 and R per chunk with policy "save");
                   mode "states": only the chunk start states S0 (the recompute pass).
  ``_bwd_kernel``  reverse chunk order: dq, dk, dv, db, dw, dg, dh0 (ReWY or the seven-product WY).
Matmuls are fp32 ``Precision.HIGHEST`` for fp32 callers (the 1e-4 contract, rewy-math §8). For
bf16/fp16 callers (``operands="bfloat16"``; see ``algebra.operand_policy``) the backward's leaf
products take bf16 operands and the other products ``Precision.HIGH`` (bf16x3); the gate cumsum
and the triangular inverse stay ``HIGHEST``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.chunk_algebra import ChunkLocal
from pallas_kernels.tpu import algebra as ta
from pallas_kernels.vma import out_shapes_like

f32 = jnp.float32
_GATE_ROWS = 8  # chunks per scalar-gate tile: (8, C) is a dense f32 sublane tile


def _interpret_arg(interpret):
    """``True`` -> the TPU interpreter (``pltpu.InterpretParams()``); params pass through."""
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


# ----------------------------------------------------------------------------------------------
# One chunk: what a grid step computes on its loaded blocks (also traced by tools/tpu_roofline.py)
# ----------------------------------------------------------------------------------------------
def ca_tril(C):
    """[C, C] lower-triangular ones (diagonal included), fp32."""
    return ta.ca._tril_mask(C, strict=False).astype(f32)


def _is_row(x):
    """A per-token scalar given as one [1, C] row (scalar gate / β tiles)."""
    return x is not None and x.shape[0] == 1


def _cum_gate(g, C):
    """Chunk-local cumulative gate of the raw gate block, as ``chunk_algebra.cum_gates``' pair
    (G without resets, reset counts N): scalar [1, C] row -> [C, 1] columns (lane cumsum as a
    ones matmul, then a mask-transpose); vector [C, K] -> [C, K]."""
    if g is None:
        return None
    if _is_row(g):
        return ta.ca.cum_gates(g, 1, lambda x: ta.row_to_col(ta.mm_nt(x, ca_tril(C))))
    return ta.ca.cum_gates(g, 0, ta.cumsum_rows)


def _leaf_in(k, v, b, w):
    """The leaf maps, fused: e = b ⊙ k, z = w ⊙ v (w None: w = b, a scalar β)."""
    bc = ta.row_to_col(b.astype(f32)) if _is_row(b) else b.astype(f32)
    if w is None:
        wc = bc
    else:
        wc = ta.row_to_col(w.astype(f32)) if _is_row(w) else w.astype(f32)
    return bc * k, wc * v, bc, wc


def _leaf_out(k, v, b, w, bc, wc, dk, de, dz):
    """Cotangents of the leaf maps: dk += b ⊙ de, dv = w ⊙ dz, db, dw (rows for scalars)."""
    dk = dk + bc * de
    dv = wc * dz
    db = k * de
    dw = v * dz
    if _is_row(b):
        db = jnp.sum(db, axis=1, keepdims=True)
        if w is None:  # shared β: both maps contribute
            db = db + jnp.sum(dw, axis=1, keepdims=True)
        db = ta.col_to_row(db)
    if w is None:
        dw = None
    elif _is_row(w):
        dw = ta.col_to_row(jnp.sum(dw, axis=1, keepdims=True))
    return dk, dv, db, dw


def forward_chunk(q, k, v, b, w, g, S0, operands=None):
    """One chunk forward. q, k [C, K]; v [C, V]; b: [1, C] (scalar β row) or [C, K] erase gate;
    w: None (= b), [1, C] or [C, V] write gate; g: None / [1, C] / [C, K] raw log-decays;
    S0 [K, V] fp32. operands: None (exact fp32 products) or the backward's operand dtype (the
    forward is exact either way, see ``algebra``). Returns O [C, V], R [C, V], S_C [K, V]."""
    q, k, v = (x.astype(f32) for x in (q, k, v))
    e, z, _, _ = _leaf_in(k, v, b, w)
    decay = ta.make_decay(_cum_gate(g, q.shape[0]), q.shape[0])
    with ta.operand_policy(operands):
        loc = ta.chunk_local(q, k, e, z, decay)
        O, R = ta.chunk_output(loc, S0)
        return O, R, ta.next_state(loc, decay, S0, R)


def backward_chunk(q, k, v, b, w, g, S0, R, dO, dS, scheme="rewy", operands=None):
    """One chunk's backward. R None: recomputed from S0 (policy "recompute"), else saved.

    Returns ((dq, dk, dv, db, dw or None, dg or None), dS0): cotangents of the loaded blocks
    (scalar ones as [1, C] rows), dg w.r.t. the raw per-token gates, and dS0 for the previous
    chunk."""
    q, k, v, dO = (x.astype(f32) for x in (q, k, v, dO))
    e, z, bc, wc = _leaf_in(k, v, b, w)
    decay = ta.make_decay(_cum_gate(g, q.shape[0]), q.shape[0])
    with ta.operand_policy(operands):
        if R is not None:  # policy "save": R and S0 come from the forward; W, U not needed
            with ta.fast_operands(None):  # the forward's exact T, A, P
                loc = ChunkLocal(A=ta.unit_lower_inverse(decay.gram(e, k, strict=True)), W=None,
                                 U=None, P=decay.gram(q, k, strict=False), Qg=decay.head(q),
                                 Eg=decay.head(e), Kt=decay.tail(k))
        else:
            loc = ta.chunk_local(q, k, e, z, decay)
            R = loc.U - ta.xmm(loc.W, S0)  # fp32: U and W S0 nearly cancel
        grads, dS0 = ta.backward_chunk(q, k, e, z, decay, loc, S0, R, dO, dS, scheme)
    dg = grads.dg
    if dg is not None and _is_row(g):  # [C, 1] -> the [1, C] row layout of the gate
        dg = ta.col_to_row(dg)
    dk, dv, db, dw = _leaf_out(k, v, b, w, bc, wc, grads.dk, grads.de, grads.dz)
    return (grads.dq, dk, dv, db, dw, dg), dS0


# ----------------------------------------------------------------------------------------------
# BlockSpecs
# ----------------------------------------------------------------------------------------------
def _token_spec(x, H, N, C, reverse):
    """BlockSpec of a per-token array, by layout:

    * token layout ``[B, N·C, H·D]`` (the public ``[B, T, H, D]`` reshaped for free; D a multiple
      of 128): block (C, D) at row block n, column block h — no transpose in HBM;
    * chunk layout ``[B, H, N, C, D]``: block (C, D);
    * scalar row tiles ``[B, H, Np, C]``: the (8, C) tile holding chunk n's row.
    """
    sq = pl.Squeezed() if hasattr(pl, "Squeezed") else None
    idx = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    if x.ndim == 3:
        return pl.BlockSpec((sq, C, x.shape[-1] // H), lambda b, h, n, *_: (b, idx(n), h))
    if x.ndim == 4:
        return pl.BlockSpec((sq, sq, _GATE_ROWS, C), lambda b, h, n, *_: (b, h, idx(n) // _GATE_ROWS, 0))
    return pl.BlockSpec((sq, sq, sq, C, x.shape[-1]), lambda b, h, n, *_: (b, h, idx(n), 0, 0))


def _dims(q, h0, meta):
    """(B, H, N, C, K, V) from the inputs, in either layout."""
    B = q.shape[0]
    H, K, V = h0.shape[2:]
    N = meta[0].shape[0]
    C = q.shape[-2] if q.ndim == 5 else q.shape[1] // N
    return B, H, N, C, K, V


def _state_specs(N, K, V, reverse):
    """(per-sequence state block [K, V] selected by seq[c], per-chunk state block)."""
    sq = pl.Squeezed() if hasattr(pl, "Squeezed") else None
    idx = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    per_seq = pl.BlockSpec((sq, sq, sq, K, V), lambda b, h, n, reset, seq, end: (b, seq[idx(n)], h, 0, 0))
    per_chunk = pl.BlockSpec((sq, sq, sq, K, V), lambda b, h, n, *_: (b, h, idx(n), 0, 0))
    return per_seq, per_chunk


def _read_token(ref, c, rows):
    if ref is None:
        return None
    return ref[pl.ds(c % _GATE_ROWS, 1), :] if rows else ref[...]


def _write_token(ref, c, rows, x):
    if rows:
        ref[pl.ds(c % _GATE_ROWS, 1), :] = x.astype(ref.dtype)
    else:
        ref[...] = x.astype(ref.dtype)


_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _token_args(q, k, v, b, w, g):
    """The per-token kernel inputs in order, and which of them are row tiles."""
    xs = [x for x in (q, k, v, b, w, g) if x is not None]
    return xs, tuple(x.ndim == 4 for x in (b, w, g) if x is not None)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def _fwd_kernel(reset_ref, seq_ref, end_ref, *refs, present, rows, mode, save, operands):
    del seq_ref, end_ref  # used by the index maps only
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    side = [next(it) if p else None for p in present]  # b, w, g
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
    row_it = iter(rows)
    b, w, g = (_read_token(r, n, next(row_it)) if r is not None else None for r in side)
    O, R, S_new = forward_chunk(q_ref[...], k_ref[...], v_ref[...], b, w, g, S0, operands)
    S_scr[...] = S_new
    if s0_ref is not None:
        s0_ref[...] = S0
    if mode == "fwd":
        o_ref[...] = O.astype(o_ref.dtype)
        # Written every chunk; the block (b, seq, h) is flushed after its sequence's last chunk.
        final_ref[...] = S_new
        if save:
            r_ref[...] = R


def forward_call(q, k, v, b, w, g, h0, meta, *, mode="fwd", save=False, operands=None,
                 interpret=False):
    """Run the forward kernel. meta = (reset, seq, end) int32 [N].

    mode "fwd": returns (o [B,H,N,C,V] in v.dtype, final [B,S+1,H,K,V] fp32, S0s, R) with S0s, R
    None unless save. mode "states": returns S0s [B,H,N,K,V] fp32.
    """
    B, H, N, C, K, V = _dims(q, h0, meta)
    xs, rows = _token_args(q, k, v, b, w, g)
    per_seq, per_chunk = _state_specs(N, K, V, False)
    in_specs = [_token_spec(x, H, N, C, False) for x in xs] + [per_seq]
    vspec = _token_spec(v, H, N, C, False)  # o: v's layout
    r_shape = jax.ShapeDtypeStruct((B, H, N, C, V), f32)  # R: chunk layout, kernel-internal
    s0_shape = jax.ShapeDtypeStruct((B, H, N, K, V), f32)
    if mode == "fwd":
        out_specs = [vspec, per_seq] + ([per_chunk, _token_spec(r_shape, H, N, C, False)]
                                        if save else [])
        out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(h0.shape, f32)]
        if save:
            out_shape += [s0_shape, r_shape]
    else:
        out_specs, out_shape = [per_chunk], [s0_shape]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), f32)])
    kern = functools.partial(_fwd_kernel, present=tuple(x is not None for x in (b, w, g)),
                             rows=rows, mode=mode, save=save, operands=operands)
    outs = pl.pallas_call(kern, grid_spec=grid_spec,
                          out_shape=out_shapes_like(out_shape, *meta, *xs, h0),
                          compiler_params=_PARAMS, interpret=_interpret_arg(interpret))(
        *meta, *xs, h0)
    if mode == "fwd":
        return (outs[0], outs[1]) + ((outs[2], outs[3]) if save else (None, None))
    return outs[0]


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
def _bwd_kernel(reset_ref, seq_ref, end_ref, *refs, present, rows, has_r, scheme, n_chunks,
                operands):
    del seq_ref, reset_ref
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    side = [next(it) if p else None for p in present]  # b, w, g
    s0_ref = next(it)
    r_ref = next(it) if has_r else None
    do_ref, dfinal_ref = next(it), next(it)
    dq_ref, dk_ref, dv_ref = next(it), next(it), next(it)
    dside = [next(it) if p else None for p in present]  # db, dw, dg
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

    row_it = iter(rows)
    side_rows = [next(row_it) if r is not None else False for r in side]
    b, w, g = (_read_token(r, c, rw) for r, rw in zip(side, side_rows))
    R = None if r_ref is None else r_ref[...]
    (dq, dk, dv, db, dw, dg), dS0 = backward_chunk(
        q_ref[...], k_ref[...], v_ref[...], b, w, g, s0_ref[...], R, do_ref[...], dS_scr[...],
        scheme, operands)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    for ref, rw, x in zip(dside, side_rows, (db, dw, dg)):
        if ref is not None:
            _write_token(ref, c, rw, x)
    dS_scr[...] = dS0
    dh0_ref[...] = dS0  # flushed after the sequence's first chunk (the last one visited)


def backward_call(q, k, v, b, w, g, S0s, R, dO, dfinal, meta, *, scheme="rewy", operands=None,
                  interpret=False):
    """Run the backward kernel.

    Returns (dq, dk, dv, db, dw or None, dg or None, dh0 [B,S+1,H,K,V])."""
    B, H, N, C, K, V = _dims(q, dfinal, meta)
    xs, rows = _token_args(q, k, v, b, w, g)
    per_seq, per_chunk = _state_specs(N, K, V, True)
    has_r = R is not None
    in_specs = ([_token_spec(x, H, N, C, True) for x in xs] + [per_chunk]
                + ([_token_spec(R, H, N, C, True)] if has_r else [])
                + [_token_spec(dO, H, N, C, True), per_seq])
    out_specs = [_token_spec(x, H, N, C, True) for x in xs] + [per_seq]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
    out_shape.append(jax.ShapeDtypeStruct(dfinal.shape, f32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), f32)])
    kern = functools.partial(_bwd_kernel, present=tuple(x is not None for x in (b, w, g)),
                             rows=rows, has_r=has_r, scheme=scheme, n_chunks=N,
                             operands=operands)
    args = (*meta, *xs, S0s, *([R] if has_r else []), dO, dfinal)
    outs = pl.pallas_call(kern, grid_spec=grid_spec, out_shape=out_shapes_like(out_shape, *args),
                          compiler_params=_PARAMS, interpret=_interpret_arg(interpret))(*args)
    outs = list(outs)
    dq, dk, dv = outs[:3]
    rest = iter(outs[3:-1])
    db, dw, dg = (next(rest) if x is not None else None for x in (b, w, g))
    return dq, dk, dv, db, dw, dg, outs[-1]


# ----------------------------------------------------------------------------------------------
# The differentiable op
# ----------------------------------------------------------------------------------------------
def _row_tiles(x):
    """A per-token scalar in chunk layout ([B, H, N, C] or [B, H, N, C, 1]) as (8, C) row tiles
    [B, H, Np, C] (N padded to a multiple of 8; the pad is differentiated by JAX)."""
    x = x.reshape(x.shape[:4])
    return jnp.pad(x, ((0, 0), (0, 0), (0, -x.shape[2] % _GATE_ROWS), (0, 0)))


def chunked_delta_tpu(q, k, v, b, w, g, h0, meta, policy="recompute", backward="rewy",
                      operands=None, interpret=False):
    """The general delta rule on chunk-layout inputs, by the TPU kernels (module docstring).

    Args:
      q, k: [B, H, N, C, K] scaled query and key; v: [B, H, N, C, V] (chunk layout) — or all three
        in token layout [B, N·C, H·D] (the public [B, T, H, D] padded to N·C rows and reshaped;
        D ∈ {128, 256}: no HBM transpose), vector gates alike.
      b: erase gate, scalar [B, H, N, C(, 1)] or vector [B, H, N, C, K].
      w: write gate, None (the same scalar β as b), scalar or vector [B, H, N, C, V].
      g: None, scalar [B, H, N, C(, 1)] or vector [B, H, N, C, K] raw log-decays (≤ 0; the
        chunk-local cumsum is done in-kernel). Scalars travel as (8, C) row tiles.
      h0: [B, S+1, H, K, V] fp32 initial states (slot S is for padding chunks).
      meta: (reset, seq, end) int32 [N] chunk metadata (not differentiated).
      policy: "recompute" | "save"; backward: "rewy" | "wy".
      operands: None (exact fp32 products) or "bfloat16" (bf16 operands for the backward's leaf
        products, fp32 accumulation; see ``algebra``).
      interpret: False, True (the TPU interpreter) or ``pltpu.InterpretParams``.
    Returns:
      o [B, H, N, C, V] (v.dtype), final [B, S+1, H, K, V] fp32.
    """
    scalar = lambda x: x is not None and (x.ndim == 4 or x.shape[-1] == 1)  # noqa: E731
    b, w, g = (_row_tiles(x) if scalar(x) else x for x in (b, w, g))
    return _chunked_delta(q, k, v, b, w, g, h0, meta, policy, backward, operands, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _chunked_delta(q, k, v, b, w, g, h0, meta, policy, backward, operands, interpret):
    o, final, _, _ = forward_call(q, k, v, b, w, g, h0, meta, operands=operands,
                                  interpret=interpret)
    return o, final


def _fwd(q, k, v, b, w, g, h0, meta, policy, backward, operands, interpret):
    save = policy == "save"
    o, final, S0s, R = forward_call(q, k, v, b, w, g, h0, meta, save=save, operands=operands,
                                    interpret=interpret)
    return (o, final), (q, k, v, b, w, g, h0, meta, S0s, R)


def _bwd(policy, backward, operands, interpret, res, cts):
    q, k, v, b, w, g, h0, meta, S0s, R = res
    dO, dfinal = cts
    if S0s is None:  # "recompute": one forward state pass for the chunk start states
        S0s = forward_call(q, k, v, b, w, g, h0, meta, mode="states", operands=operands,
                           interpret=interpret)
    dq, dk, dv, db, dw, dg, dh0 = backward_call(q, k, v, b, w, g, S0s, R, dO,
                                                dfinal.astype(f32), meta, scheme=backward,
                                                operands=operands, interpret=interpret)
    dmeta = jax.tree.map(lambda m: None, meta)
    return dq, dk, dv, db, dw, dg, dh0.astype(h0.dtype), dmeta


_chunked_delta.defvjp(_fwd, _bwd)


def chunk_meta(chunk_reset, chunk_seq, end_chunk):
    """(reset, seq, end) int32 [N] from ``rewy_jax.layout.ChunkPlan`` fields."""
    N = chunk_reset.shape[0]
    end = jnp.zeros((N,), jnp.int32).at[end_chunk].set(1)
    return (chunk_reset.astype(jnp.int32), chunk_seq.astype(jnp.int32), end)
