"""Per-chunk gradients of the vector-gate (KDA, GDN2) ReWY backward, in raw frames.

Pipeline position:  vector_state_backward.py (dR per chunk, each chunk's end cotangent dS)  ->
**this kernel** (with each op's leaf maps: KDA's dk, dv, dβ; GDN2's dk, dv, db, dw)  ->  dg's chunk
sums (gpu/gates.gate_grad) and XLA (vector_api.py: dg's state term).

One CTA, one warpgroup, per ``(b, h, chunk, 64-column key piece j)``. Every chunk is independent;
the K/64 pieces of a chunk repeat the small [C, C] part (Λ, dT, dA) and each forms the per-channel
terms of its own 64 key channels, so one piece's tiles fit registers and SMEM at K = 128.

With q̃ = scale·q, e the erase vectors (β k or b ⊙ k, rounded to the input dtype), G the chunk's
log2 cumulative gates, A the chunk inverse (split pair from vector_chunk), S0 / dS the chunk's start
state and end cotangent, R its residual (saved by the forward's state pass), and decay factors
``D_rs = 2^{G_r − G_s}`` per key channel (rewy-math §4–§5, chunk_algebra._leaf_grads):

    Λ   = Aᵀ dR                          (ReWY's one adjoint solve; A as hi + lo: two WGMMAs)
    dT  = −(Λ Rᵀ)_{s<r}     dA = (dO Rᵀ)_{s<r}     dA_diag = diag(dO Rᵀ)
    de  = −2^G ⊙ (Λ S0ᵀ) + Σ_s dT_rs k_s D_rs                 (the cotangent of e)
    dq̃  = 2^G ⊙ (dO S0ᵀ) + Σ_s dA_rs k_s D_rs  [+ dA_diag k]
    dk  = Σ_r dT_rs e_r D_rs + Σ_r dA_rs q̃_r D_rs  [+ y + dA_diag q̃],  y = 2^{G_C − G} ⊙ (R dSᵀ)
    pairs = de ⊙ e − dk ⊙ k + dq̃ ⊙ q̃    (each without its bracketed terms)

The four decayed contractions are evaluated in the forward's reference frames
(vector_chunk.py, with the same per-chunk choice): per bit level (exact: 32…1; centred: 32, 16,
then the 16-row diagonal blocks around row 8) the kept pairs (r upper, s lower half of a row group) share the frame row f, so
``Σ_s dT_rs k_s D_rs = 2^{G_r − G_f} Σ_s dT_rs (k_s 2^{G_f − G_s})``: the masked [C, C] tile
times a frame-scaled [C, 64] tile, one WGMMA, then a per-row factor ≤ 1 (≤ e^40 centred). Per
level one round trip: dT_l K_y, dA_l K_y and dT_lᵀ E_x + dA_lᵀ Q_x (one accumulator), four
WGMMAs in one group.

**Round trips.** Λ is one group (A as hi + lo, every value piece); everything else outside the
Gram terms (Λ Rᵀ, dO Rᵀ, Λ S0ᵀ, dO S0ᵀ, R dSᵀ) a second; then one per level. Per chunk and key
piece (counted from the traced program): exact 38 WGMMAs in 8 round trips at D = 128, 31 in 8
at D = 64; centred 26 in 5, 19 in 5.

The gate gradient is left as per-row parts for XLA (the sums along the chunk do not fit the
per-row register layout): dg_t = Σ_{r ≥ t} pairs_r + Σ_{s < t} (y ⊙ k)_s + 2^{G_C} ⊙ Σ_v (dS ⊙ S0).
(Summing along the chunk in here — two 0/1 triangular tiles times a three-way bf16 split of
``pairs`` and ``y ⊙ k``, six WGMMAs — made this kernel 0.27 ms slower on an H100
(docs/performance-log.md); the two fp32 parts it saves are 134 MB written and read again at
the anchor, about 0.08 ms of HBM time, plus XLA's cumsums, not yet timed apart.) The terms with
decay factor 1 (the diagonal query-key pairs, each row's own path into the end state) are kept
out of ``pairs``: they would enter with both signs and cancel (chunk_algebra).

Registers: the accumulators de, dq̃, dk [C, 64] fp32 (96 per thread) and, across a level's wait,
its three products and one frame-factor tile (128 more, 224 in all: the bit levels' two sides
share one exp2 tile, the centred level re-forms its y side from SMEM after the wait); the second
group's five products are 160. The [C, C] tiles dT and dA wait in SMEM (input dtype) between
levels; each level's five operands are staged in bf16 over spent input tiles (frame factors
reach e^40, past fp16's range).
SMEM (config.vector_chunk_backward_smem_bytes): dO, dR, R ``[V/64, C, 64]``, S0ᵀ and dSᵀ
``[V/64, 64, 64]`` (the piece's key columns), A hi/lo, q, k, e ``[C, 64]`` (16-bit); G twice
(swizzled for tiles, plain for the frame rows) and three fp32 output tiles. The level loop's five
staging tiles reuse the dO, R, S0, dS buffers (spent by then); Λ is staged over dR, dT and dA
over A. 200 KiB at K = V = 128, 160 KiB at 64 (unchanged by the grouping); KDA's leaf maps add
v's piece, β and dβ's part (8.5 KiB at 128), GDN2's b's piece (16 KiB); GDN2's w and v pieces
arrive during the level loop over value-side tiles spent by then (past the five staging tiles;
at K = 64 they widen that union by 24 KiB), and Λ's piece waits for them in an fp32 tile. At V = 256
the five value-side tiles would take 160 KiB: they stream one value piece at a time instead
(:func:`_streamed_value_products`; Λ ``[C, V]`` and two sets of three ``[C, 64]`` slots, 200
KiB).
Loads: one CTA an SM, so nothing else hides them. With ``load_sets`` (GDN2's default) they go
out in three TMA sets, each awaited just before its first use (A's pair and dR for Λ; dO, R,
S0ᵀ, dSᵀ for the second group; the rest after it); without, as one set awaited before any work
(KDA's default: with sets its kernel took 0.816 instead of 0.578 ms, GDN2's op 1.764 instead of
1.950, H100, config.VectorConfig.grad_load_sets).

Reads:  q, k, e [B, Tp, H, K]; g2 [B, H, Tp, K] fp32; do, dr, r [B, Tp, H, V];
        states, dstates [B, H, N, V, K]; a_hi, a_lo [B, H, Tp, C] (per piece: all of dO, dR, R, A,
        and the piece's columns of the others).
Writes: dv [B, Tp, H, V] (piece j writes value columns j), dq (scale applied), dk [B, Tp, H, K]
        in the input dtype; pairs, yk [B, Tp, H, K] fp32; and the gate gradients of the leaf maps:
        KDA (also reads β [B, H, Tp] and v's piece j) dβ's parts [B, H, K/64, Tp] fp32; GDN2 (also
        reads b's piece j and w's and v's value columns j) db [B, Tp, H, K] fp32 and dw
        [B, Tp, H, V] in w's dtype. Λ, de and the raw-frame dk never reach HBM (three fp32
        tensors, 67 MB each at the anchor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.common import (
    C, COLS, F32, META, ROWS, WGMMA, bit_level_pairs, cols_of, iota, mma_group, put, rows_of, same_block, smem,
    upper_half)
from pallas_kernels.mosaic_gpu.config import GRAD_RESIDENT_PIECES, PIECE
from pallas_kernels.mosaic_gpu.vector_chunk import CROSS_LEVELS, MID, SUB, SUB_LEVELS, _frame_tile


def _streamed_value_products(tiles, a_s, bars, j, nv: int, lam_out, stage_dt_da, *, dr, r, do, s0, ds):
    """The value-side products of one CTA at V = 256, one 64-column value piece at a time: sums
    over the pieces i of Λ_i Rᵢᵀ, dO_i Rᵢᵀ (pass 1, which also forms Λ_i = Aᵀ dR_i into SMEM),
    then Λ_i S0ᵀ_i and dO_i S0ᵀ_i (pass 2), then R_i dSᵀ_i (pass 3). The 3·nv steps' tiles go
    through two slot sets: step s + 1's TMA loads are issued before step s's products, so they
    overlap. Each pass holds at most its own sums and one piece's fresh products (≤ 128 fp32
    registers a thread), and dT, dA are staged after pass 1 (A is spent then).

    ``tiles``: (Λ ``[nv, C, 64]``, slots ``[2, 3, C, 64]``) in the input dtype; ``bars``: two
    barrier pairs, of 3 arrivals (pass 1) and 2 (passes 2 and 3), one barrier per slot set;
    ``dr(vc)`` etc.: the GMEM views of value columns ``vc``. Pieces go in the order j, j + 1, …
    (mod nv), so pass 1's first Λ is piece j, which ``lam_out`` sends out. Returns
    ``(Λ S0ᵀ, dO S0ᵀ, R dSᵀ, stage_dt_da's result, Σ Λ ⊙ v or None)``."""
    lam_s, slots = tiles
    bar3, bar2 = bars
    tile = (C, PIECE)
    steps = [((dr, r, do), bar3, i) for i in range(nv)] + [((do, s0), bar2, i) for i in range(nv)] + \
        [((r, ds), bar2, i) for i in range(nv)]

    def issue(s):
        """Step s's tiles into slot set s % 2 (its last reader, step s − 2, has completed)."""
        srcs, bar, i = steps[s]
        vc = pl.ds(lax.rem(j + i, jnp.int32(nv)) * PIECE, PIECE)
        plgpu.commit_smem()  # every thread is past step s − 2's products
        for m, src in enumerate(srcs):
            plgpu.copy_gmem_to_smem(src(vc), slots.at[s % 2, m], bar.at[s % 2])

    def arrive(s):
        """Waits for step s's tiles, issues step s + 1's; returns step s's slots."""
        plgpu.barrier_wait(steps[s][1].at[s % 2])
        if s + 1 < len(steps):
            issue(s + 1)
        return slots.at[s % 2]

    def add(acc, new):
        return new if acc is None else tuple(a + x for a, x in zip(acc, new))

    issue(0)
    sums, lam_v = None, None
    for i in range(nv):  # pass 1: Λ_i into SMEM, Λ Rᵀ and dO Rᵀ
        slot = arrive(i)
        (lam_i,) = mma_group([(((a_s.at[0].T, slot.at[0]), (a_s.at[1].T, slot.at[0])), tile)])
        if i == 0:
            copy_lam, lam_v = lam_out(lam_i)
        put(lam_s.at[i], lam_i)
        plgpu.commit_smem()
        if i == 0:
            copy_lam()
        sums = add(sums, mma_group(((((lam_s.at[i], slot.at[1].T),), (C, C)),
                                    (((slot.at[2], slot.at[1].T),), (C, C)))))
    dt_da = stage_dt_da(*sums)
    sums = None
    for i in range(nv):  # pass 2: Λ S0ᵀ and dO S0ᵀ (this CTA's key columns)
        slot = arrive(nv + i)
        sums = add(sums, mma_group(((((lam_s.at[i], slot.at[1]),), tile), (((slot.at[0], slot.at[1]),), tile))))
    ls0, dos0 = sums
    rds = None
    for i in range(nv):  # pass 3: R dSᵀ
        slot = arrive(2 * nv + i)
        (x,) = mma_group([(((slot.at[0], slot.at[1]),), tile)])
        rds = x if rds is None else rds + x
    return ls0, dos0, rds, dt_da, lam_v


def vector_chunk_backward(q, k, e, g2, do, dr, r, states, dstates, a_hi, a_lo, centred_chunks=None, *,
                          scale: float, centred: bool, kda_leaf=None, gdn2_leaf=None, wy=None,
                          load_sets: bool = False, interpret=None):
    """The gradients through each op's leaf maps; see the module docstring. ``centred`` and
    ``centred_chunks`` as for vector_chunk.vector_chunk (the same frames per chunk). Exactly one
    of ``kda_leaf`` and ``gdn2_leaf`` is given.

    ``kda_leaf``: KDA's ``(β [B, H, Tp] fp32, v [B, Tp, H, V])`` (e = β k, z = β v). Returns
    ``(dv, dq, dk, db_parts, pairs, yk)``: dv = β ⊙ Λ and dk = dk_raw + β ⊙ de in the input
    dtype, and db_parts ``[B, H, K/64, Tp]`` fp32, piece j's ``Σ de ⊙ k`` over its key channels
    plus ``Σ Λ ⊙ v`` over its value columns (dβ is their sum over j).

    ``gdn2_leaf``: GDN2's ``(b [B, Tp, H, K] fp32, w [B, Tp, H, V] (its own float dtype), v [B,
    Tp, H, V])`` (e = b ⊙ k, z = w ⊙ v). Returns ``(dv, dq, dk, db, pairs, yk, dw)``: dv = w ⊙ Λ
    and dk = dk_raw + b ⊙ de in the input dtype, db = de ⊙ k fp32 and dw = v ⊙ Λ in w's dtype.

    ``load_sets``: the inputs in three TMA sets awaited at first use, else one (module docstring).

    ``wy``: the seven-product backward's ``(dt [B, H, Tp, C], debar [B, Tp, H, K] fp32)`` from
    vector_wy.vector_wy_products (the ablation, K ≤ 128): the kernel reads dT and its piece of dĒ
    in place of forming ``−(Λ Rᵀ)_{s<r}`` and ``−Λ S0ᵀ``; everything else is the same."""
    if (kda_leaf is None) == (gdn2_leaf is None):
        raise ValueError("vector_chunk_backward takes exactly one of kda_leaf (KDA) and gdn2_leaf (GDN2)")
    B, Tp, H, K = k.shape
    V = do.shape[-1]
    N = Tp // C
    dtype = k.dtype
    if K != V or K % PIECE:
        raise ValueError(f"vector_chunk_backward needs K == V, a multiple of {PIECE}; got K={K}, V={V}")
    if centred == (centred_chunks is not None):
        raise ValueError("vector_chunk_backward takes centred_chunks exactly when centred is False")
    nk = nv = K // PIECE
    streamed = nv > GRAD_RESIDENT_PIECES  # V = 256: the value-side tiles one piece at a time
    if wy is not None and streamed:
        raise ValueError("vector_chunk_backward's seven-product form (wy=) takes K = V <= 128")
    leaf = kda_leaf is not None  # KDA's leaf maps; else GDN2's
    w_dtype = None if leaf else gdn2_leaf[1].dtype
    piece = lambda n: smem((n, C, PIECE), dtype)  # noqa: E731
    staging = tuple(smem((C, PIECE), jnp.bfloat16) for _ in range(5 if streamed else 5 * nv))
    # dO, R, S0ᵀ, dSᵀ, dR (Λ over it) in the input dtype; once spent, their first five [C, 64]
    # tiles are the Gram levels' staging tiles, seen as bf16 (frame factors reach e^40); the same
    # bytes. Streamed: Λ's pieces and two sets of three slots for the value pieces' tiles. GDN2:
    # w's and v's pieces j past the staging tiles (spent value-side tiles while the levels run).
    views = [(piece(nv), smem((2, 3, C, PIECE), dtype)) if streamed else (piece(nv),) * 5, staging]
    if not leaf:
        views.append((smem((5, C, PIECE), jnp.bfloat16), smem((C, PIECE), w_dtype), smem((C, PIECE), dtype)))
    scratch = dict(
        io=plgpu.RefUnion(*views),
        a_s=smem((2, C, C), dtype), q_s=smem((C, PIECE), dtype), k_s=smem((C, PIECE), dtype),
        e_s=smem((C, PIECE), dtype), g_s=smem((C, PIECE), F32), g_rows=plgpu.SMEM((C, PIECE), F32),
        o32=smem((3, C, PIECE), F32),
    )
    # The input sets (load_sets): A's pair and dR (and KDA's β, v: Λ's leaf map) for Λ; dO, R,
    # S0ᵀ, dSᵀ for the second product group; the rest (q, k, e, G twice, flags, GDN2's b) after it.
    # Without load_sets the first barrier takes them all.
    n_lam, n_vals = 2 + (0 if streamed else nv) + 2 * leaf, 0 if streamed else 4 * nv
    n_rest = 5 + (not centred) + (not leaf)
    if load_sets:
        scratch.update(bar_lam=plgpu.Barrier(num_arrivals=n_lam), bar_rest=plgpu.Barrier(num_arrivals=n_rest))
        if not streamed:
            scratch["bar_vals"] = plgpu.Barrier(num_arrivals=n_vals)
    else:
        scratch["bar_lam"] = plgpu.Barrier(num_arrivals=n_lam + n_vals + n_rest)
    if streamed:  # a value piece's (dR, R, dO), then (dO, S0ᵀ), then (R, dSᵀ)
        scratch.update(bar3=plgpu.Barrier(num_arrivals=3, num_barriers=2),
                       bar2=plgpu.Barrier(num_arrivals=2, num_barriers=2))
    if not centred:
        scratch["flag_s"] = plgpu.SMEM((META,), jnp.int32)
    if leaf:  # β's rows, v's piece-j columns (dv goes out over them), the dβ parts
        scratch.update(beta_s=plgpu.SMEM((C,), F32), v_s=smem((C, PIECE), dtype), db_s=plgpu.SMEM((C,), F32))
    if wy is not None:  # dT over A's first tile once Λ is formed, dĒ's piece over an fp32 tile
        scratch["wy_bar"] = plgpu.Barrier(num_arrivals=2)
    if not leaf:  # b's piece-j columns; w's and v's arrive over spent tiles (io's third view)
        scratch.update(b_s=smem((C, PIECE), F32), wv_bar=plgpu.Barrier(num_arrivals=2))
    tok32 = jax.ShapeDtypeStruct((B, Tp, H, K), F32)
    tok = jax.ShapeDtypeStruct((B, Tp, H, K), dtype)
    val = jax.ShapeDtypeStruct((B, Tp, H, V), dtype)
    if leaf:
        out_type = (val, tok, tok, jax.ShapeDtypeStruct((B, H, nk, Tp), F32), tok32, tok32)
    else:
        out_type = (val, tok, tok, tok32, tok32, tok32, jax.ShapeDtypeStruct((B, Tp, H, V), w_dtype))

    def vector_chunk_backward_body(
            q_ref, k_ref, e_ref, g_ref, do_ref, dr_ref, r_ref, st_ref, dst_ref, ahi_ref, alo_ref, *refs,
            io, a_s, q_s, k_s, e_s, g_s, g_rows, o32, bar_lam, bar_rest=None, bar_vals=None, flag_s=None,
            beta_s=None, v_s=None, db_s=None, b_s=None, wv_bar=None, bar3=None, bar2=None, wy_bar=None):
        tiles, spent = io[:2]
        refs = list(refs)
        flag_ref = None if centred else refs.pop(0)
        if leaf:
            beta_ref, v_ref = refs.pop(0), refs.pop(0)
        else:
            b_ref, w_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
            _, w_s, v_s = io[2]
        dt_ref, debar_ref = (refs.pop(0), refs.pop(0)) if wy is not None else (None, None)
        dv_ref, dq_ref, dk_ref, db_ref, pairs_ref, yk_ref = refs[:6]
        dw_ref = None if leaf else refs[6]
        b, h, nj = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("nj")
        n, j = lax.div(nj, jnp.int32(nk)), lax.rem(nj, jnp.int32(nk))
        rows = pl.ds(n * C, C)
        cols = pl.ds(j * PIECE, PIECE)  # this CTA's key channels (and Λ's value columns)
        # Loads, issued in the order of first use (see bar_lam, bar_vals, bar_rest); one set: all on bar_lam.
        if not load_sets:
            bar_vals = bar_rest = bar_lam
        plgpu.copy_gmem_to_smem(ahi_ref.at[b, h, rows], a_s.at[0], bar_lam)
        plgpu.copy_gmem_to_smem(alo_ref.at[b, h, rows], a_s.at[1], bar_lam)
        if not streamed:
            do_s, r_s, s0_s, ds_s, dr_s = tiles
            for i in range(nv):
                plgpu.copy_gmem_to_smem(dr_ref.at[b, rows, h, pl.ds(i * PIECE, PIECE)], dr_s.at[i], bar_lam)
        if leaf:
            plgpu.copy_gmem_to_smem(beta_ref.at[b, h, rows], beta_s, bar_lam)
            plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h, cols], v_s, bar_lam)
        if not streamed:
            for i in range(nv):
                vc = pl.ds(i * PIECE, PIECE)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h, vc], do_s.at[i], bar_vals)
                plgpu.copy_gmem_to_smem(r_ref.at[b, rows, h, vc], r_s.at[i], bar_vals)
                plgpu.copy_gmem_to_smem(st_ref.at[b, h, n, vc, cols], s0_s.at[i], bar_vals)
                plgpu.copy_gmem_to_smem(dst_ref.at[b, h, n, vc, cols], ds_s.at[i], bar_vals)
        for src, dst in ((q_ref, q_s), (k_ref, k_s), (e_ref, e_s)):
            plgpu.copy_gmem_to_smem(src.at[b, rows, h, cols], dst, bar_rest)
        plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows, cols], g_s, bar_rest)
        plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows, cols], g_rows, bar_rest)
        if not centred:
            plgpu.copy_gmem_to_smem(flag_ref.at[b, h, n], flag_s, bar_rest)
        if not leaf:
            plgpu.copy_gmem_to_smem(b_ref.at[b, rows, h, cols], b_s, bar_rest)
        plgpu.barrier_wait(bar_lam)

        load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)  # noqa: E731
        rr, cc = iota((C, C), 0), iota((C, C), 1)
        tile = (C, PIECE)

        def lam_out(lam_j):
            """Λ's piece j (value columns j), unfenced. KDA: dv = β ⊙ Λ over v's tile, once Λ ⊙ v
            is summed; returns the issue of dv's copy to HBM and Σ Λ ⊙ v. GDN2: Λ's piece into
            an fp32 tile, where it waits for w's and v's pieces (the epilogue); returns a no-op
            and None."""
            if leaf:
                lam_v = jnp.sum(lam_j * load(v_s), axis=1)  # one value per row, held to the end
                put(v_s, lam_j * rows_of(plgpu.load(beta_s, layout=ROWS), tile))
                return lambda: plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, h, cols]), lam_v
            put(o32.at[0], lam_j)
            return lambda: None, None

        def stage_dt_da(lr, dor):
            """dT = −(Λ Rᵀ)_{s<r} and dA = (dO Rᵀ)_{s<r} over A's tiles (spent), unfenced; returns
            diag(dO Rᵀ) and the strict-lower mask. ``lr`` None: dT is there already (wy)."""
            strict = rr > cc
            da_diag = jnp.sum(jnp.where(rr == cc, dor, 0.0), axis=1)  # decay factor 1: kept apart
            if lr is not None:
                put(a_s.at[0], jnp.where(strict, lr, 0.0) * -1.0)  # dT over A (spent)
            put(a_s.at[1], jnp.where(strict, dor, 0.0))  # dA without its diagonal
            return da_diag, strict

        if streamed:
            ls0, dos0, rds, (da_diag, strict), lam_v = _streamed_value_products(
                tiles, a_s, (bar3, bar2), j, nv, lam_out, stage_dt_da,
                dr=lambda vc: dr_ref.at[b, rows, h, vc], r=lambda vc: r_ref.at[b, rows, h, vc],
                do=lambda vc: do_ref.at[b, rows, h, vc], s0=lambda vc: st_ref.at[b, h, n, vc, cols],
                ds=lambda vc: dst_ref.at[b, h, n, vc, cols])
        else:
            # Λ = Aᵀ dR, all value pieces (Λ Rᵀ and Λ S0ᵀ contract over V); piece j goes to HBM.
            lam = mma_group([(((a_s.at[0].T, dr_s.at[i]), (a_s.at[1].T, dr_s.at[i])), tile) for i in range(nv)])
            if nv == 1:
                lam_j = lam[0]
            elif nv == 2:  # select piece j by arithmetic (exact for a 0/1 weight): no scalar-predicate select
                jf = j.astype(F32)
                lam_j = lam[0] * (1.0 - jf) + lam[1] * jf
            else:  # (V = 256 streams its pieces; held whole only in the interpreter's test of that)
                lam_j = sum(x * (j == i).astype(F32) for i, x in enumerate(lam))
            copy_lam, lam_v = lam_out(lam_j)
            for i in range(nv):
                put(dr_s.at[i], lam[i])  # Λ over dR (spent), as the operand of the products below
            plgpu.commit_smem()
            copy_lam()
            lam_s = dr_s
            # Everything else outside the Gram terms, in one group: Λ Rᵀ and dO Rᵀ (→ dT, dA), and
            # Λ S0ᵀ, dO S0ᵀ, R dSᵀ (this piece's key columns).
            # Σ over the value pieces of x_i y_i (or x_i y_iᵀ)
            over_v = lambda x, y: tuple((x.at[i], y.at[i]) for i in range(nv))  # noqa: E731
            over_v_t = lambda x, y: tuple((x.at[i], y.at[i].T) for i in range(nv))  # noqa: E731
            if load_sets:
                plgpu.barrier_wait(bar_vals)
            if wy is None:
                lr, dor, ls0, dos0, rds = mma_group((
                    (over_v_t(lam_s, r_s), (C, C)), (over_v_t(do_s, r_s), (C, C)),
                    (over_v(lam_s, s0_s), tile), (over_v(do_s, s0_s), tile), (over_v(r_s, ds_s), tile)))
                da_diag, strict = stage_dt_da(lr, dor)
            else:  # the seven-product form: dT and dĒ from vector_wy, A spent since Λ (fenced above)
                plgpu.copy_gmem_to_smem(dt_ref.at[b, h, rows], a_s.at[0], wy_bar)
                plgpu.copy_gmem_to_smem(debar_ref.at[b, rows, h, cols], o32.at[2], wy_bar)
                dor, dos0, rds = mma_group(((over_v_t(do_s, r_s), (C, C)), (over_v(do_s, s0_s), tile),
                                            (over_v(r_s, ds_s), tile)))
                plgpu.barrier_wait(wy_bar)
                da_diag, strict = stage_dt_da(None, dor)
                ls0 = load(o32.at[2]) * -1.0  # ReWY's Λ S0ᵀ is −dĒ (o32[2] is rewritten with y below)
        if not leaf:  # GDN2: w's and v's pieces j over value-side tiles spent by now, during the levels
            for src, dst in ((w_ref, w_s), (v_ref, v_s)):
                plgpu.copy_gmem_to_smem(src.at[b, rows, h, cols], dst, wv_bar)
        if load_sets:
            plgpu.barrier_wait(bar_rest)
        g_last = cols_of(plgpu.load(g_rows.at[C - 1], layout=COLS), tile)
        gam = jnp.exp2(load(g_s))  # ≤ 1
        de = ls0 * gam * -1.0
        dq = dos0 * gam
        y = rds * jnp.exp2(g_last - load(g_s))  # each row's path into the end state (≤ 1)
        put(o32.at[2], y)  # kept for dk (not summed into the accumulator: see pairs)
        put(o32.at[1], y * load(k_s))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o32.at[1], yk_ref.at[b, rows, h, cols])
        dk = plgpu.layout_cast(jnp.zeros(tile, F32), WGMMA)

        # The decayed Gram terms, level by level; the staging tiles reuse spent buffers.
        dtl_s, dal_s, xe_s, xq_s, ky_s = spent[:5]
        up_rows = iota(tile, 0)

        def level(pair, size, offset, masked, acc):
            """One level's four products in one round trip: ``dT_l K_y``, ``dA_l K_y`` and
            ``dT_lᵀ E_x + dA_lᵀ Q_x`` (one accumulator), scaled per row into ``acc`` = (de, dq̃,
            dk). Besides the three products and ``acc``, one factor tile (32 registers a
            thread) waits for them."""
            de, dq, dk = acc
            put(dtl_s, jnp.where(pair, load(a_s.at[0]), 0.0))
            put(dal_s, jnp.where(pair, load(a_s.at[1]), 0.0))
            assert 2 * offset == size  # the frame row starts the group's upper half
            up = upper_half(up_rows, size)
            offsets = lambda: load(g_s) - _frame_tile(g_rows, size, offset)  # noqa: E731  G_r − G_f(r)
            d = offsets()
            if masked:
                # bit levels: x side on rows ≥ the frame, y side below it (every factor ≤ 1); the
                # two sides' rows are disjoint, so one exp2 tile holds both
                f = jnp.exp2(jnp.where(up, d, -d))
                fx, fy = jnp.where(up, f, 0.0), jnp.where(up, 0.0, f)
            else:
                fx, fy = jnp.exp2(d), jnp.exp2(-d)
            put(xe_s, load(e_s) * fx)
            put(xq_s, load(q_s) * (fx * scale))
            put(ky_s, load(k_s) * fy)
            plgpu.commit_smem()
            m34, m1, m2 = mma_group(((((dtl_s.T, xe_s), (dal_s.T, xq_s)), tile),
                                     (((dtl_s, ky_s),), tile), (((dal_s, ky_s),), tile)))
            if masked:  # m1, m2 live on the x rows and m34 on the y rows, so f alone scales them
                return (de + jnp.where(up, m1 * f, 0.0), dq + jnp.where(up, m2 * f, 0.0),
                        dk + jnp.where(up, 0.0, m34 * f))
            # centred: fy is formed again from SMEM rather than held beside fx across the wait
            return de + m1 * fx, dq + m2 * fx, dk + m34 * jnp.exp2(-offsets())

        def bit_levels(levs, acc):
            for lev in levs:
                acc = level(bit_level_pairs(rr, cc, lev), 2 * lev, lev, True, acc)
            return acc

        def centred_tail(acc):  # the diagonal sub-chunk blocks, frame = row 8 (operands ≤ e^40, finite)
            return level(same_block(rr, cc, SUB) & strict, SUB, MID, False, acc)

        acc = bit_levels(CROSS_LEVELS, (de, dq, dk))
        if centred:
            acc = centred_tail(acc)
        else:  # the chunk's frames, as in the forward (vector_prep.centred_chunks)
            acc = lax.cond(flag_s[0] == 1, centred_tail, lambda acc: bit_levels(SUB_LEVELS, acc), acc)
        de, dq, dk = acc

        # Outputs, fenced once: de, pairs, dk_raw through the fp32 tiles; dq (scale applied) over q.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dv (KDA) and yk have been read
        diag = rows_of(da_diag, tile)
        qs = load(q_s) * scale
        k_t = load(k_s)
        put(o32.at[1], dq * qs - dk * k_t + de * load(e_s))  # pairs
        dk_raw = dk + load(o32.at[2]) + diag * qs  # pairs' dk + y + dA_diag q̃
        if leaf:  # dk = dk_raw + β ⊙ de over k's tile; dβ's part Σ de ⊙ k + Σ Λ ⊙ v
            db_s[...] = jnp.sum(de * k_t, axis=1) + lam_v
            put(k_s, dk_raw + rows_of(plgpu.load(beta_s, layout=ROWS), tile) * de)
        else:  # dk = dk_raw + b ⊙ de over k's tile; db = de ⊙ k over b's
            put(k_s, dk_raw + load(b_s) * de)
            put(b_s, de * k_t)
        put(q_s, (dq + diag * k_t) * scale)
        outs = ((o32.at[1], pairs_ref), (q_s, dq_ref), (k_s, dk_ref))
        if not leaf:  # GDN2's write side, after the accumulators: dv = w ⊙ Λ over v's tile, dw = v ⊙ Λ over w's
            plgpu.barrier_wait(wv_bar)
            lam_j = load(o32.at[0])
            dv = load(w_s) * lam_j
            put(w_s, load(v_s) * lam_j)
            put(v_s, dv)
            outs += ((b_s, db_ref), (v_s, dv_ref), (w_s, dw_ref))
        plgpu.commit_smem()
        for src, ref in outs:
            plgpu.copy_smem_to_gmem(src, ref.at[b, rows, h, cols])
        if leaf:
            plgpu.copy_smem_to_gmem(db_s, db_ref.at[b, h, j, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        vector_chunk_backward_body, out_type=out_type, scratch_types=scratch,
        grid=(B, H, N * nk), grid_names=("b", "h", "nj"),
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(q, k, e, g2, do, dr, r, states, dstates, a_hi, a_lo, *(() if centred else (centred_chunks,)),
      *(kda_leaf if leaf else gdn2_leaf), *(wy if wy is not None else ()))
