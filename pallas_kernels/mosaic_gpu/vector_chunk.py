"""Per-chunk kernel of the vector-gate forward (KDA, GDN2): gated Grams, inverse, W and U.

Pipeline position:  vector_prep.py (XLA)  ->  **this kernel**  ->  vector_forward.py (state pass
+ output). Parallel over chunks: one CTA, one warpgroup (128 threads), per ``(b, h, chunk)``.

With G the chunk's log2 cumulative gates ``[C, K]``, e_r the erase vector (β_r k_r or b_r ⊙ k_r)
and z_r the write vector (β_r v_r or w_r ⊙ v_r), it forms (rewy-math §3, FLA's names):

    T  = tril(Σ_c e_rc k_sc 2^{G_rc − G_sc}, −1)        A = (I + T)⁻¹
    P  = scale · tril(Σ_c q_rc k_sc 2^{G_rc − G_sc})     (diagonal included)
    W  = A Ē,  Ē = 2^G ⊙ E        U = A Z
    Qγ = scale · 2^G ⊙ Q          K_tail = 2^{G_C − G} ⊙ K

so that the state pass needs only ``R = U − W S0``, ``O = Qγ S0 + P R`` and
``S ← 2^{G_C} ⊙ S0 + K_tailᵀ R`` (two products on its serial chain).

**The Grams on the tensor cores, in reference frames.** 2^{−G} is never formed. A pair s ≤ r is
evaluated as ``(x_r 2^{G_r − F_r}) · (y_s 2^{F_s − G_s})`` where the frames agree on the pairs a
product keeps (F_r = F_s). Frames are per row, so each product below is one WGMMA over all 64 rows
(its operands staged as bf16 ``[C, 64]`` tiles, contracted over K in 64-column pieces), and a
select keeps the pairs it is exact for:

* bit levels (exact for any g ≤ 0): a pair s < r first differs at one bit b ∈ {32, 16, 8, 4, 2,
  1} of its row indices, r in the upper and s in the lower half of one 2b-row group. The frame of
  every row of that group is the group's row f = start + b: x-side factors ``2^{G_r − G_f}`` on
  upper rows (r ≥ f), y-side ``2^{G_f − G_s}`` on lower rows (s < f), zero elsewhere (masked
  before exp2). Every factor is ≤ 1, so no product overflows, even across groups.
* centred: levels 32 and 16 as above for pairs in different 16-row sub-chunks; the four
  diagonal sub-chunk blocks in one product with frame = the sub-chunk's row 8 (factors ≤ e^40;
  cross-block products are discarded). Every chunk takes it when the gates are declared ≥ −5
  (``centred=True``); otherwise each chunk whose sub-chunks decay by at most 40 does, chosen at
  run time from ``centred_chunks`` (vector_prep.py: the same e^40 bound), and the others take
  the exact bit levels 8…1 — one branch per CTA around the whole body, so a chunk costs one
  set of products (:func:`vector_chunk` runs the static centred kernel when every chunk
  qualifies).
* the diagonal of P (r = s, factor 1): one plain ``Q Kᵀ`` product of the unscaled inputs.

So the two Grams cost 6 (exact) or 3 (centred) levels × K/64 pieces × two WGMMAs (T and P
share the y-side operand), one ``[C, 64]`` exp2 per side, level and piece, and K/64 WGMMAs for
P's diagonal. Frame rows are read from
the fp32 G tile in SMEM and selected per row group (64/(2b) selects at level b).

**Round trips.** The levels are independent: a level's 3·K/64 operand tiles are stored and
fenced together and its T and P products (each summed over the key pieces in one accumulator)
issued as one group, two levels per group where the staging tiles hold them
(config.vector_chunk_staging_tiles: at K = 64, and for KDA at K = 128; GDN2 at K = 128 one);
P's diagonal rides with the first group. W and U take A split as hi + lo (two WGMMAs into one
accumulator each), every piece of both in one group. Per chunk (counted from the traced
program; before grouping, KDA and GDN2 alike, in brackets):

    D = 128, KDA    exact 64 WGMMAs in 14 round trips (44)    centred 52 in 13 (32)
    D = 128, GDN2   exact 64 in 17 (44)                       centred 52 in 14 (32)
    D = 64          exact 47 in 14 (27)                       centred 41 in 13 (21)

of which the inverse is 30 in 10 (its two products per level depend on each other).

The inverse is chunk_inverse.invert_unit_lower (split-bf16 products). W and U take A split as
hi + lo: A is the precision-sensitive factor; KDA folds β into A's columns
(A diag(β) Ē' with Ē' = 2^G ⊙ K, and A diag(β) V), GDN2 reads Z = w ⊙ v from vector_prep.

Warpgroup: one, holding in registers the T and P accumulators ``[C, C]`` fp32 beside a group's
products (two ``[C, C]`` a level: ≤ 192 registers a thread), then the K/64 + V/64 W and U
accumulators ``[C, 64]`` (128 at D = 128).
SMEM (vector_chunk_smem_bytes in config.py; at K = V = 128 GDN2 200 KiB as before grouping, KDA
216 KiB with its twelve staging tiles, 168 KiB before; at 64 unchanged, 128 and 112 KiB):
  inputs q, k [K/64, C, 64] and x [V/64, C, 64] (16-bit, swizzled), G [K/64, C, 64] fp32 twice
  (swizzled for tiles, plain for the frame rows), b [K/64, C, 64] fp32 (GDN2) or β [C]; six or
  twelve [C, C] 16-bit staging tiles, seen two ways: bf16 for the Gram operands (centred frame
  factors reach e^40, past fp16's 65504) and the inverse's split pairs, the input dtype for A's
  hi/lo, Ē and then W (A meets x in U = A Z, and a WGMMA's operands share one dtype; for fp16
  inputs A is an fp16 pair); one output tile (P). Qγ, K_tail and U are staged in place of q, k
  and x.

K = 256: the Grams one 128-column key block at a time (``config.CHUNK_KEY_BLOCK``; T and P are
sums over key channels), the block's q, k, G and b reloaded into the same tiles; the kernel then
writes P and A's pair only, and :func:`vector_wu` forms W, U, Qγ and K_tail (KDA 200 KiB, GDN2
184 KiB of SMEM).

Reads:  q, k [B, Tp, H, K]; x [B, Tp, H, V] (v for KDA, z for GDN2); g2 [B, H, Tp, K] fp32;
        erase: β [B, H, Tp] fp32 (KDA) or b [B, Tp, H, K] fp32 (GDN2).
Writes: w, qg, kt [B, H, Tp, K]; u [B, H, Tp, V]; p [B, H, Tp, C] (input dtype, head-major);
        with ``out_inverse`` (every differentiated call: the backward reads A under both policies)
        A as a pair a_hi, a_lo [B, H, Tp, C] in the input dtype, β not folded in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.chunk_inverse import inverse_refs, inverse_scratch, invert_unit_lower, split_pair
from pallas_kernels.mosaic_gpu.common import (
    C, COLS, DTYPES, F32, META, ROWS, WGMMA, bit_level_pairs, cols_of, iota, mma_group, put, rows_of,
    same_block, smem, stage, upper_half)
from pallas_kernels.mosaic_gpu import vector_prep
from pallas_kernels.mosaic_gpu.config import PIECE, vector_chunk_key_block, vector_chunk_staging_tiles

CROSS_LEVELS = (32, 16)  # pairs in different 16-row sub-chunks: bit-level frames in every chunk
SUB_LEVELS = (8, 4, 2, 1)  # pairs within a sub-chunk, exact frames (chunks not centred)
SUB = vector_prep.SUB  # rows per sub-chunk of the centred diagonal blocks
MID = 8  # the centred frame's row within its sub-chunk


def _frame_tile(g_piece, size: int, offset: int):
    """``[C, 64]`` fp32 tile whose row r holds G at row ``(r // size)·size + offset``: the frame
    of r's group, one row read from SMEM per group and selected into its rows."""
    r = iota((C, PIECE), 0)
    tile = None
    for grp in range(C // size):
        row = cols_of(plgpu.load(g_piece.at[grp * size + offset], layout=COLS), (C, PIECE))
        tile = row if tile is None else jnp.where(r // size == grp, row, tile)
    return tile


def _load(ref):
    return plgpu.load(ref, layout=WGMMA).astype(F32)


def gated_tail(a, pair, *, q, k, x, ebar, g, g_last, erase, scale: float, qg_out, kt_out, w_out, u_out):
    """The chunk's gated operands and its W, U from the inverse A, stored to HBM: per key piece
    ``Ē = 2^G ⊙ E`` (E = k for KDA, b ⊙ k for GDN2), ``Qγ = scale · 2^G ⊙ q`` over q's tile and
    ``K_tail = 2^{G_C − G} ⊙ k`` over k's, then ``W = A Ē`` over Ē's and ``U = A Z`` over x's
    (A as hi + lo: one accumulator each, every piece in one group); waits for the stores.

    ``a``: A [C, C] fp32 registers, β not folded in (KDA folds it here: A diag(β)), split into the
    16-bit refs ``pair``; or None when ``pair`` already holds the A that W and U take (GDN2).
    ``q``, ``k``, ``ebar`` (free tiles), ``g`` (swizzled fp32), ``g_last`` (G's last row, plain
    fp32): per key piece ``[C, 64]``; ``x``: per value piece; ``erase``: β ``[C]`` (KDA) or b's
    fp32 tiles per key piece (GDN2). ``*_out``: the GMEM views each piece goes to. Shared by the
    chunk kernel and :func:`vector_wu` (one code path for the same math)."""
    kda = not isinstance(erase, (list, tuple))
    if a is not None:
        if kda:
            a = a * cols_of(plgpu.load(erase, layout=COLS), (C, C))  # A diag(β): W, U take β from here
        pair = split_pair(*pair, a)
    a_hi, a_lo = pair
    tile = (C, PIECE)
    for j in range(len(q)):
        g_t = _load(g[j])
        gam = jnp.exp2(g_t)  # ≤ 1
        k_t = _load(k[j])
        put(ebar[j], (k_t if kda else _load(erase[j]) * k_t) * gam)  # Ē
        g_c = cols_of(plgpu.load(g_last[j], layout=COLS), tile)
        put(q[j], _load(q[j]) * gam * scale)  # Qγ
        put(k[j], k_t * jnp.exp2(g_c - g_t))  # K_tail (exponent ≤ 0)
    plgpu.commit_smem()
    for j in range(len(q)):
        plgpu.copy_smem_to_gmem(q[j], qg_out[j])
        plgpu.copy_smem_to_gmem(k[j], kt_out[j])
    split_a = lambda y: ((a_hi, y), (a_lo, y))  # noqa: E731
    wu = mma_group([(split_a(y), tile) for y in ebar] + [(split_a(y), tile) for y in x])
    # W over Ē, U over x: each tile's only reader was its own product, complete now.
    for y, val in zip(list(ebar) + list(x), wu):
        put(y, val)
    plgpu.commit_smem()
    for y, dst in zip(list(ebar) + list(x), list(w_out) + list(u_out)):
        plgpu.copy_smem_to_gmem(y, dst)
    plgpu.wait_smem_to_gmem(0)


def vector_chunk(q, k, x, g2, erase, centred_chunks=None, *, scale: float, centred: bool,
                 out_inverse: bool = False, interpret=None):
    """``(w, u, qg, kt, p)``, and with ``out_inverse`` also ``(a_hi, a_lo)``: :func:`_vector_chunk`,
    whose docstring gives the arrays. With ``centred_chunks`` (no declared bound), a call whose
    chunks all qualify for the centred frames runs the kernel built for a declared bound: the
    kernel that picks frames per chunk holds both frames' code, and ptxas then serialises its
    WGMMAs for want of registers even where every chunk takes the centred side (H100, KDA at
    (2, 4096, 16, 128): 0.72 against 0.56 ms). The choice is one predicate on the device."""
    K = k.shape[-1]
    blocked = vector_chunk_key_block(K) < K
    # the kernel holding more key columns than one block forms only P and A (see _vector_chunk)
    kw = dict(scale=scale, out_inverse=out_inverse or blocked, interpret=interpret)
    if centred_chunks is None:
        out = _vector_chunk(q, k, x, g2, erase, None, centred=centred, **kw)
    elif centred:
        raise ValueError("vector_chunk takes centred_chunks exactly when centred is False")
    else:
        out = lax.cond(jnp.all(centred_chunks[..., 0] == 1),
                       lambda: _vector_chunk(q, k, x, g2, erase, None, centred=True, **kw),
                       lambda: _vector_chunk(q, k, x, g2, erase, centred_chunks, centred=False, **kw))
    if not blocked:
        return out
    p, a_hi, a_lo = out
    return vector_wu(q, k, x, g2, erase, a_hi, a_lo, scale=scale, interpret=interpret) + (
        (p, a_hi, a_lo) if out_inverse else (p,))


def _vector_chunk(q, k, x, g2, erase, centred_chunks, *, scale: float, centred: bool,
                  out_inverse: bool, interpret):
    """``(w, u, qg, kt, p)``, and with ``out_inverse`` also ``(a_hi, a_lo)`` [B, H, Tp, C]: the
    chunk inverse A = (I + T)⁻¹ as a split pair in the input dtype (β not folded in; the backward's
    Λ = Aᵀ dR reads it). See the module docstring. KDA when ``erase`` is β ``[B, H, Tp]``, GDN2
    when it is b ``[B, Tp, H, K]``. ``centred``: every chunk's diagonal sub-chunk blocks centred
    (a declared gate bound, ``centred_chunks`` None); else ``centred_chunks`` (vector_prep) says
    per chunk which frames its sub-chunk pairs take.

    K = 256 (more than ``config.CHUNK_KEY_BLOCK`` key columns): the Grams are sums over key
    channels, so the CTA forms them one 128-column key block at a time (reloading q, k, G and b
    into the same SMEM: the whole width's would need 192 KiB for those alone) and returns only
    ``(p, a_hi, a_lo)``; :func:`vector_chunk` then forms W, U, Qγ, K_tail with :func:`vector_wu`."""
    B, Tp, H, K = k.shape
    V = x.shape[-1]
    N = Tp // C
    dtype = k.dtype
    bf = jnp.bfloat16
    channel_erase = erase.ndim == 4
    kb = vector_chunk_key_block(K)  # key columns held at once
    if K not in (PIECE, 2 * PIECE, 4 * PIECE) or V % PIECE:  # a level's 3·kb/64 operands fit the staging tiles
        raise ValueError(f"vector_chunk needs K in {{{PIECE}, {2 * PIECE}, {4 * PIECE}}} and V a multiple of "
                         f"{PIECE}, got K={K}, V={V}")
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(f"vector_chunk takes bf16 or fp16 inputs, got {jnp.dtype(dtype).name}")
    if centred == (centred_chunks is not None):
        raise ValueError("vector_chunk takes centred_chunks exactly when centred is False")
    nk, nv = kb // PIECE, V // PIECE  # key pieces of a block; value pieces
    n_blocks = K // kb
    if n_blocks > 1 and not out_inverse:
        raise ValueError("_vector_chunk at more than one key block forms only P and A: out_inverse=True")
    # [C, C] bf16 staging tiles: two Gram levels' operands per round trip where SMEM holds them
    n_staging = vector_chunk_staging_tiles(K, V, jnp.dtype(dtype).itemsize, channel_erase)
    tile = lambda n: smem((n, C, PIECE), dtype)  # noqa: E731
    scratch = dict(
        q_s=tile(nk), k_s=tile(nk), x_s=tile(nv), g_s=smem((nk, C, PIECE), F32),
        # G again, untransformed: single rows (the frames) load from it; whole tiles load from
        # the swizzled g_s (an untransformed fp32 tile has no bank-conflict-free WGMMA load)
        g_rows=plgpu.SMEM((nk, C, PIECE), F32),
        e_s=smem((nk, C, PIECE), F32) if channel_erase else plgpu.SMEM((C,), F32),
        # the staging tiles, seen as bf16 (the Gram operands, whose frame factors reach e^40), in
        # the input dtype (A's pair, Ē and W: the operands that meet x in U = A Z, which a WGMMA
        # needs in one dtype) and as the inverse's packed bf16 pairs (28 KiB); the same bytes
        st=plgpu.RefUnion(smem((n_staging, C, C), bf), smem((n_staging, C, C), dtype), *inverse_scratch(bf)),
        out_s=smem((C, C), dtype),
        bar=plgpu.Barrier(num_arrivals=4 * nk + (nk if channel_erase else 1) + (not centred)),
        # x has a barrier of its own: its first use is U = A Z at the end, so the Grams and the
        # inverse need not wait for its tiles
        bar_x=plgpu.Barrier(num_arrivals=nv),
    )
    if n_blocks > 1:  # no x (W and U are vector_wu's); key blocks after the first: q, k, G twice, b
        del scratch["x_s"], scratch["bar_x"]
        scratch["bar_next"] = plgpu.Barrier(num_arrivals=(4 + channel_erase) * nk)
    if not centred:
        scratch["flag_s"] = plgpu.SMEM((META,), jnp.int32)
    out_type = (jax.ShapeDtypeStruct((B, H, Tp, K), dtype), jax.ShapeDtypeStruct((B, H, Tp, V), dtype),
                jax.ShapeDtypeStruct((B, H, Tp, K), dtype), jax.ShapeDtypeStruct((B, H, Tp, K), dtype),
                jax.ShapeDtypeStruct((B, H, Tp, C), dtype))
    if n_blocks > 1:
        out_type = out_type[4:]  # P only (and A's pair below)
    if out_inverse:
        out_type += (jax.ShapeDtypeStruct((B, H, Tp, C), dtype), jax.ShapeDtypeStruct((B, H, Tp, C), dtype))

    def vector_chunk_body(
            q_ref, k_ref, x_ref, g_ref, e_ref, *refs, q_s, k_s, g_s, g_rows, e_s, st, out_s, bar,
            x_s=None, bar_x=None, flag_s=None, bar_next=None):
        st, st_x, *inv_trees = st  # bf16 and input-dtype views of the staging tiles; the inverse's
        flag_ref = None if centred else refs[0]
        refs = refs[0 if centred else 1:]
        if n_blocks == 1:
            w_ref, u_ref, qg_ref, kt_ref, p_ref, *inv_refs = refs
        else:
            p_ref, *inv_refs = refs
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)

        def load_key_block(blk, barrier):
            """TMA-loads key block ``blk``'s pieces of q, k, G (twice) and b (GDN2) on ``barrier``."""
            for j in range(nk):
                cols = pl.ds((blk * nk + j) * PIECE, PIECE)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h, cols], q_s.at[j], barrier)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h, cols], k_s.at[j], barrier)
                plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows, cols], g_s.at[j], barrier)
                plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows, cols], g_rows.at[j], barrier)
                if channel_erase:
                    plgpu.copy_gmem_to_smem(e_ref.at[b, rows, h, cols], e_s.at[j], barrier)

        load_key_block(0, bar)
        if not channel_erase:
            plgpu.copy_gmem_to_smem(e_ref.at[b, h, rows], e_s, bar)
        if not centred:
            plgpu.copy_gmem_to_smem(flag_ref.at[b, h, n], flag_s, bar)
        if n_blocks == 1:
            for j in range(nv):
                plgpu.copy_gmem_to_smem(x_ref.at[b, rows, h, pl.ds(j * PIECE, PIECE)], x_s.at[j], bar_x)
        plgpu.barrier_wait(bar)
        def chunk(centred_frames: bool):
            """Everything after the loads, in the chunk's frames (no value lives across the
            run-time branch below, so each branch is the whole straight-line kernel)."""

            r, c = iota((C, C), 0), iota((C, C), 1)
            load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)  # noqa: E731

            def erase_piece(j):  # the x side of T: b ⊙ k (GDN2), or k (KDA: β scales T's rows after)
                return load(e_s.at[j]) * load(k_s.at[j]) if channel_erase else load(k_s.at[j])

            def level_operands(size, offset, masked, tiles):
                """Stores (unfenced) the operands of one level's (T, P) products in the frames of row
                groups of ``size`` rows, frame row ``offset`` in each, into ``tiles`` = (staging
                ref, first index): three tiles per key piece, E_x, Q_x, Y; returns the two
                products' specs for mma_group:
                ``Σ_j E_x,j Y_jᵀ`` and ``Σ_j Q_x,j Y_jᵀ`` (T and P share Y). ``masked``: bit-level
                frames (x side only on rows ≥ the frame, y side only on rows below it: every factor
                ≤ 1); else centred (both sides on every row)."""
                assert 2 * offset == size  # the frame row starts the group's upper half
                up = upper_half(iota((C, PIECE), 0), size)
                # One loop body for the key pieces: less code, the same work (the kernel took
                # 0.331 instead of 0.375 ms with it, H100, KDA at the anchor, K = 128).
                def piece(j, carry):
                    xe_s, xq_s, y_s = (tiles_ref.at[first_tile + 3 * j + m] for m in range(3))
                    d = load(g_s.at[j]) - _frame_tile(g_rows.at[j], size, offset)  # G_r − G_f(r)
                    fx = jnp.exp2(jnp.where(up, d, -jnp.inf) if masked else d)
                    put(xe_s, erase_piece(j) * fx)
                    put(xq_s, load(q_s.at[j]) * fx)
                    fy = jnp.exp2(jnp.where(up, -jnp.inf, -d) if masked else -d)
                    put(y_s, load(k_s.at[j]) * fy)
                    return carry

                tiles_ref, first_tile = tiles
                if nk == 1:
                    piece(0, None)
                else:
                    lax.fori_loop(jnp.int32(0), jnp.int32(nk), piece, None)
                t_pairs, p_pairs = [], []
                for j in range(nk):
                    xe_s, xq_s, y_s = (tiles_ref.at[first_tile + 3 * j + m] for m in range(3))
                    t_pairs.append((xe_s, y_s.T))
                    p_pairs.append((xq_s, y_s.T))
                return [(tuple(t_pairs), (C, C)), (tuple(p_pairs), (C, C))]

            # (select of the pairs a level keeps, group size, frame row, masked)
            bit_levels = lambda levs: [(bit_level_pairs(r, c, lev), 2 * lev, lev, True)  # noqa: E731
                                       for lev in levs]  # r upper, s lower half
            # the diagonal sub-chunk blocks (select, not multiply: cross-block entries may be inf)
            centred_tail = [(same_block(r, c, SUB) & (c < r), SUB, MID, False)]
            # As many levels per round trip as the staging tiles hold (3·K/64 operands a level): the
            # levels are independent, so their products go together (two: K = 64, and KDA at 128).
            per_trip = n_staging // (3 * nk)
            # The diagonal of P (decay factor 1) from the inputs as given, in the first group: its
            # operands are not rounded again after a frame scaling (taking it from the centred product
            # instead raised o's error from 3.1e-3 to 4.0e-3 in tests/test_mosaic_gpu_vector.py's
            # bounded KDA case).
            qk_spec = [(tuple((q_s.at[j], k_s.at[j].T) for j in range(nk)), (C, C))]
            def run(levels, t, p):
                """The levels' products over the key block in SMEM, ``per_trip`` levels a round trip,
                summed into T and P (None: the first key block, which starts them)."""
                for first in range(0, len(levels), per_trip):
                    batch = levels[first:first + per_trip]
                    specs = []
                    for i, (_, size, offset, masked) in enumerate(batch):
                        specs += level_operands(size, offset, masked, (st, 3 * nk * i))
                    plgpu.commit_smem()
                    prods = mma_group(specs + (qk_spec if first == 0 else []))
                    if t is None:  # every entry of T and P comes from exactly one level (or the diagonal)
                        t = jnp.zeros((C, C), F32)
                        p = jnp.where(r == c, prods[-1], 0.0)
                    elif first == 0:
                        p = p + jnp.where(r == c, prods[-1], 0.0)
                    for i, (keep, *_) in enumerate(batch):
                        t = t + jnp.where(keep, prods[2 * i], 0.0)
                        p = p + jnp.where(keep, prods[2 * i + 1], 0.0)
                return t, p

            levels = bit_levels(CROSS_LEVELS) + (centred_tail if centred_frames else bit_levels(SUB_LEVELS))
            t, p = run(levels, None, None)
            for blk in range(1, n_blocks):  # the Grams are sums over key channels: block by block
                plgpu.commit_smem()  # every thread has read the last block before TMA refills its tiles
                load_key_block(blk, bar_next)
                plgpu.barrier_wait(bar_next)
                t, p = run(levels, t, p)
            stage(out_s, p * scale)
            plgpu.copy_smem_to_gmem(out_s, p_ref.at[b, h, rows])

            if not channel_erase:
                t = t * rows_of(plgpu.load(e_s, layout=ROWS), (C, C))  # KDA: T = diag(β) tril(...)
            a = invert_unit_lower(t, *inverse_refs(inv_trees))
            if out_inverse:  # A for the backward, before β is folded in (st 4 and 5 are not reused)
                a_out = split_pair(st_x.at[4], st_x.at[5], a)
                for ref, out in zip(a_out, inv_refs):
                    plgpu.copy_smem_to_gmem(ref, out.at[b, h, rows])
            if n_blocks > 1:  # W, U, Qγ and K_tail are vector_wu's, from this A
                plgpu.wait_smem_to_gmem(0)
                return
            # Ē into the staging tiles the inverse left free (st 0, 1), Qγ over q, K_tail over k
            # (their last reads were the Grams), W over Ē and U over x. GDN2 folds nothing into A, so
            # with out_inverse the pair sent out is W's and U's.
            cols = lambda j: pl.ds(j * PIECE, PIECE)  # noqa: E731
            ready = channel_erase and out_inverse
            plgpu.barrier_wait(bar_x)
            gated_tail(
                None if ready else a, a_out if ready else (st_x.at[2], st_x.at[3]),
                q=[q_s.at[j] for j in range(nk)], k=[k_s.at[j] for j in range(nk)],
                x=[x_s.at[j] for j in range(nv)], ebar=[st_x.at[j] for j in range(nk)],
                g=[g_s.at[j] for j in range(nk)], g_last=[g_rows.at[j, C - 1] for j in range(nk)],
                erase=[e_s.at[j] for j in range(nk)] if channel_erase else e_s, scale=scale,
                qg_out=[qg_ref.at[b, h, rows, cols(j)] for j in range(nk)],
                kt_out=[kt_ref.at[b, h, rows, cols(j)] for j in range(nk)],
                w_out=[w_ref.at[b, h, rows, cols(j)] for j in range(nk)],
                u_out=[u_ref.at[b, h, rows, cols(j)] for j in range(nv)])

        if centred:
            chunk(True)
        else:  # this chunk's frames (vector_prep.centred_chunks), one branch for the whole CTA
            lax.cond(flag_s[0] == 1, lambda: chunk(True), lambda: chunk(False))

    return plgpu.kernel(
        vector_chunk_body, out_type=out_type, scratch_types=scratch,
        grid=(B, H, N), grid_names=("b", "h", "n"),
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(q, k, x, g2, erase, *(() if centred else (centred_chunks,)))


def vector_wu(q, k, x, g2, erase, a_hi, a_lo, *, scale: float, interpret=None):
    """``(w, u, qg, kt)`` as :func:`vector_chunk` returns them, from the chunk inverse A that it
    sent out (``out_inverse``): no Gram and no inverse, only :func:`gated_tail`. The backward's
    policy "recompute" keeps A and P from the forward (``[B, H, Tp, C]`` each, as the scalar-gate
    path keeps T0) and recomputes the ``[C, K]``-sized operands here instead of rerunning the
    chunk kernel (a memory-bound kernel against the Gram levels and the 30-WGMMA inverse).

    One CTA, one warpgroup, per ``(b, h, chunk, 64-column piece j)`` (K = V): W, Qγ, K_tail and U
    of piece j, so the CTA holds one piece of each input (SMEM 80 KiB at 16 bits: two CTAs an SM).
    Reads q, k, x piece j, G's piece j (fp32, and its last row), β [C] (KDA) or b's piece j
    (GDN2), the A pair (input dtype); KDA folds β into A (A diag(β)) and splits it again.
    """
    B, Tp, H, K = k.shape
    V = x.shape[-1]
    N = Tp // C
    dtype = k.dtype
    channel_erase = erase.ndim == 4
    if K != V or K % PIECE:
        raise ValueError(f"vector_wu needs K == V, a multiple of {PIECE}; got K={K}, V={V}")
    if a_hi.dtype != dtype or a_lo.dtype != dtype:
        raise ValueError(f"vector_wu takes A's pair in the input dtype {jnp.dtype(dtype).name}, "
                         f"got {jnp.dtype(a_hi.dtype).name}")
    nk = K // PIECE
    tile = lambda: smem((C, PIECE), dtype)  # noqa: E731
    scratch = dict(
        q_s=tile(), k_s=tile(), x_s=tile(), e_bar=tile(), g_s=smem((C, PIECE), F32),
        g_last=plgpu.SMEM((PIECE,), F32), a_in=smem((2, C, C), dtype),
        e_s=smem((C, PIECE), F32) if channel_erase else plgpu.SMEM((C,), F32),
        bar=plgpu.Barrier(num_arrivals=8),
    )
    if not channel_erase:  # KDA: A diag(β) split again
        scratch["a_split"] = smem((2, C, C), dtype)
    out_type = (jax.ShapeDtypeStruct((B, H, Tp, K), dtype), jax.ShapeDtypeStruct((B, H, Tp, V), dtype),
                jax.ShapeDtypeStruct((B, H, Tp, K), dtype), jax.ShapeDtypeStruct((B, H, Tp, K), dtype))

    def vector_wu_body(q_ref, k_ref, x_ref, g_ref, e_ref, ahi_ref, alo_ref, w_ref, u_ref, qg_ref, kt_ref,
                       q_s, k_s, x_s, e_bar, g_s, g_last, a_in, e_s, bar, a_split=None):
        b, h, nj = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("nj")
        n, j = lax.div(nj, jnp.int32(nk)), lax.rem(nj, jnp.int32(nk))
        rows = pl.ds(n * C, C)
        cols = pl.ds(j * PIECE, PIECE)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h, cols], q_s, bar)
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h, cols], k_s, bar)
        plgpu.copy_gmem_to_smem(x_ref.at[b, rows, h, cols], x_s, bar)
        plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows, cols], g_s, bar)
        plgpu.copy_gmem_to_smem(g_ref.at[b, h, n * C + C - 1, cols], g_last, bar)
        plgpu.copy_gmem_to_smem(ahi_ref.at[b, h, rows], a_in.at[0], bar)
        plgpu.copy_gmem_to_smem(alo_ref.at[b, h, rows], a_in.at[1], bar)
        if channel_erase:
            plgpu.copy_gmem_to_smem(e_ref.at[b, rows, h, cols], e_s, bar)
        else:
            plgpu.copy_gmem_to_smem(e_ref.at[b, h, rows], e_s, bar)
        plgpu.barrier_wait(bar)
        if channel_erase:  # GDN2: W and U take the pair as sent
            a, pair = None, (a_in.at[0], a_in.at[1])
        else:  # hi + lo is exact in fp32; β is folded in and the sum split again
            a, pair = _load(a_in.at[0]) + _load(a_in.at[1]), (a_split.at[0], a_split.at[1])
        dst = lambda ref: [ref.at[b, h, rows, cols]]  # noqa: E731
        gated_tail(a, pair, q=[q_s], k=[k_s], x=[x_s], ebar=[e_bar], g=[g_s], g_last=[g_last],
                   erase=[e_s] if channel_erase else e_s, scale=scale, qg_out=dst(qg_ref),
                   kt_out=dst(kt_ref), w_out=dst(w_ref), u_out=dst(u_ref))

    return plgpu.kernel(
        vector_wu_body, out_type=out_type, scratch_types=scratch,
        grid=(B, H, N * nk), grid_names=("b", "h", "nj"),
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(q, k, x, g2, erase, a_hi, a_lo)
