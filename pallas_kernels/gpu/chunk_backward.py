"""The chunk backward: ReWY's reduced backward (or the seven-product WY one) per chunk, once
the state passes have given each chunk's start state S0 and end-state cotangent dS_end.

Pipeline (one op's forward and backward; ``api`` drives it, this module's stage marked *):

    forward   gates.cum_gates -> chunk_local.qk_gram (vector gates) -> chunk_local.intra
              -> state_passes.fwd_pass (output fused in) | state_passes.fwd_pass + output.output
    backward  chunk_local.intra (W, U from the kept A) -> output.bwd_local
              -> state_passes.twin_pass | fwd_pass + bwd_pass
              -> chunk_backward.bwd_dlam* -> chunk_backward.bwd_leaf* -> gates.gate_grad

    bwd_dlam  grid (N, B·H)          reads A [B,H,N,C,C], R, dO, dR [B,Tp,H,V] (WY: e, z, G, S0);
                                     Λ = Aᵀ dR, dT = −tril(Λ Rᵀ, −1), dA_qk = scale · tril(dO Rᵀ);
                                     writes Λ [B,Tp,H,V], dT, dA_qk [B,H,N,C,C]
    bwd_leaf  grid (N[·n], B·H, K/BK) reads q, k, e (or βe) [B,Tp,H,K], G, S0, dS_end [B,H,N,K,V],
                                     Λ, R, dO, dR, dT, dA_qk; writes dq, dk, de [B,Tp,H,K] and
                                     the gate gradient's two parts (pairs, path)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu import launch
from pallas_kernels.gpu.blocks import (BS, F32, Blocks, Rows, ScaledRows, _sum, dot,
                                       dot_stored, exp, iota, load_rows, load_scaled_rows, qg,
                                       scalar_decay)
from pallas_kernels.gpu.decay import Gates
from pallas_kernels.gpu.launch import Shape, grid_id


def bwd_dlam(s: Shape, A, R, dO, dR, e, z, G, S0, *, backward, interpret, lam_dtype=F32,
             dt_dtype=F32):
    """The state-free core of the chunk backward, grid (N, B·H), a loop over value tiles.

    ReWY (rewy-math §4):  Λ = Aᵀ dR (product 1),  dT = −tril(Λ Rᵀ, −1) (product 2).
    WY (seven products):  dZ = Aᵀ dR,  dA = dR Zᵀ + dW Ēᵀ with dW Ēᵀ = −dR (Ē S0)ᵀ,
                          dT = −tril(Aᵀ dA Aᵀ, −1)   (dĒ = Aᵀ dW is formed in bwd_leaf).
    Both: dA_qk = scale · tril(dO Rᵀ) (``Shape.scaled``).
    No gate enters these products (only WY's Ē), so they run on whole-chunk [C, ·] tiles
    (one matmul each) rather than 16-row sub-chunk blocks: far fewer live accumulators.
    Returns Λ [B,Tp,H,V] in ``lam_dtype`` (= dz), dT and dA_qk [B,H,N,C,C] in ``dt_dtype``
    (masked; formed in fp32). With ``dlam_decays`` (scalar gates) both leave decayed, dT ⊙ D
    and dA_qk ⊙ D (``scalar_decay``; dA_qk's diagonal keeps its factor 1): the C × C decay is
    formed once per chunk here instead of once per key tile in ``bwd_leaf``, and the leaf's
    products meet the decayed values in their stored 16 bits (one rounding, FLA's GDN rounds
    its decayed dA likewise).
    """
    C, prec, mode, V, BV = s.C, s.prec, s.mode, s.V, s.BV
    wy = backward == "wy"
    decays = s.dlam_decays()

    def kernel(*refs):
        refs = list(refs)
        if not wy:  # ReWY reads no e, z, S0, G only to decay
            refs[4:4] = [None, None]  # e, z
            if decays:
                refs.insert(7, None)  # S0, after G
            else:
                refs[6:6] = [None, None]  # G, S0
        elif mode == "none":
            refs.insert(6, None)
        A_ref, R_ref, dO_ref, dR_ref, e_ref, z_ref, G_ref, S0_ref, lam_ref, dT_ref, dAqk_ref = refs
        A = A_ref[...]  # as stored: bf16 under backward.low_precision "A"
        r, c = iota((C, C), 0), iota((C, C), 1)
        if wy:
            Gc = None if mode == "none" else load_rows(G_ref, 0, C)
            Eg = qg(mode, Gc, load_rows(e_ref, 0, C))  # Ē = γ ⊙ E (exponents ≤ 0)
        dT = dAqk = None
        for t in range(V // BV):
            vs = pl.ds(t * BV, BV)
            R_s = R_ref[:, vs]  # as stored: bf16 under backward.low_precision "R"
            R_t, dR_t = R_s.astype(F32), dR_ref[:, vs].astype(F32)
            lam = dot_stored(A, dR_ref[:, vs], prec, ta=True)
            lam_ref[:, vs] = lam.astype(lam_ref.dtype)
            x = dot_stored(dO_ref[:, vs], R_s, prec, tb=True)
            dAqk = x if dAqk is None else dAqk + x
            if wy:
                Z_t = z_ref[:, vs].astype(F32)
                ZmES = Z_t - dot(Eg, S0_ref[:, vs].astype(F32), prec)
                x = dot(dR_t, ZmES, prec, tb=True)  # dA
            else:
                x = -dot(lam, R_t, prec, tb=True)
            dT = x if dT is None else dT + x
        if wy:
            A = A.astype(F32)
            dT = -dot(dot(A, dT, prec, ta=True), A, prec, tb=True)  # −Aᵀ dA Aᵀ
        if decays:
            D = scalar_decay(load_rows(G_ref, 0, C), C, strict=True)
            dT_ref[...] = (dT * D).astype(dT_ref.dtype)
            # the diagonal's factor 1 as the strict matrix's zero diagonal plus 1
            dAqk_ref[...] = (s.scaled(dAqk) * jnp.where(c == r, 1.0, D)).astype(
                dAqk_ref.dtype)
        else:
            dT_ref[...] = jnp.where(c < r, dT, 0.0).astype(dT_ref.dtype)
            dAqk_ref[...] = jnp.where(c <= r, s.scaled(dAqk), 0.0).astype(dAqk_ref.dtype)

    full_v = pl.BlockSpec((None, C, None, V), lambda n_, bh: (bh // s.H, n_, bh % s.H, 0))
    if wy:
        ins = [A, R, dO, dR, e, z] + ([] if mode == "none" else [G]) + [S0]
        in_specs = [s.chunk_mat(C, C)] + [full_v] * 3 + [s.chunk_tok(s.K), full_v] + (
            [] if mode == "none" else [s.chunk_gate()]) + [s.chunk_mat(s.K, V)]
    else:  # G only to decay
        ins = [A, R, dO, dR] + ([G] if decays else [])
        in_specs = [s.chunk_mat(C, C)] + [full_v] * 3 + ([s.chunk_gate()] if decays else [])
    out_specs = [full_v, s.chunk_mat(C, C), s.chunk_mat(C, C)]
    out_shape = [s.sds_tok(V, lam_dtype),
                 jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), dt_dtype),
                 jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), dt_dtype)]
    return launch.call(kernel, grid=(s.N, s.B * s.H), in_specs=in_specs, out_specs=out_specs,
                 out_shape=out_shape, interpret=interpret, num_warps=s.warps("bwd_dlam"),
                 name="rewy_bwd_dlam")(*ins)


def _state_inner(dS, S0, prec):
    """Σ_v dS ⊙ S0 per key channel, [1, BK] fp32, of two [BK, V] state tiles as stored: the
    diagonal of the product dS S0ᵀ — a native product of tiles the leaf has staged for its other
    products, where the element-wise form held both tiles in fp32 registers (ptxas, sm_90,
    K = 128: GDN's leaf 172 -> 147 registers, SASS 1134 -> 1130). Not for vector gates: in
    KDA's row-grid leaf (BK = 32, 4 warps) it took 150 -> 255 registers."""
    M = dot_stored(dS, S0, prec, tb=True)
    r, c = iota(M.shape, 0), iota(M.shape, 1)
    return jnp.sum(jnp.where(r == c, M, 0.0), axis=0)[None, :]


def bwd_leaf(s: Shape, q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, *, backward, dtypes,
             interpret, e_scale=None):
    """Leaf gradients, grid (N, B·H, K/BK): every map below acts per key channel, so key tiles
    are independent (rewy-math §5–§6, raw frame):

        dĒ_state = −Λ S0ᵀ (ReWY product 3)  or  Aᵀ dW, dW = −dR S0ᵀ (WY)
        de = γ ⊙ dĒ_state + apply(dT, k)          dq = scale · γ ⊙ dO S0ᵀ + apply(dA_qk, k)
        dk = apply_t(dT, e) + apply_t(dA_qk, q) + y,   y = e^{G_C − G} ⊙ R dSᵀ
    and the gate gradient's two parts (chunk_algebra._leaf_grads: the terms with
    decay factor 1 — dA_qk's diagonal, each row's own path y into the end state — kept out):
        pairs = de⊙e − dk'⊙k + dq'⊙q (dk', dq' without those terms), last row + γ_C ⊙ Σ_v dS⊙S0
        path  = y ⊙ k
    so that g's gradient is, per chunk, the reverse cumsum of pairs plus the exclusive cumsum of
    path (``api._bwd``). Returns dq, dk, de [B,Tp,H,K] and (pairs, path) fp32: [B,Tp,H,K] per
    channel for vector gates, [B,Tp,H,K/BK] summed over each key tile's channels for scalar
    gates; None without gates.

    e_scale: βe [B,Tp,H] fp32 with e None (KernelConfig.leaf_e_rows): e's rows formed
    here as βe ⊙ k rounded to e's dtype — bit for bit ``api.leaf_product``'s e — instead of
    read, so that no e is formed, stored and read back outside (DeltaNet at the anchor: an XLA
    fusion of 0.026 ms, profile-22, and one [B,T,H,K] read less here). The outputs are the same
    as with e. Vector gates: not with the per-pair ("loop") diagonals, which read e's rows one
    token at a time from the ref.
    """
    n, C, prec, mode, K, V = s.n, s.C, s.prec, s.mode, s.K, s.V
    BK = s.BK
    wy = backward == "wy"
    H = s.H
    cfg = s.cfg
    rowgrid = mode == "vector" and cfg.leaf_rowgrid
    diag = "centred" if s.centred else cfg.leaf_diag
    shared = cfg.leaf_shared_decay
    with_es = e_scale is not None
    pre_decayed = s.dlam_decays()  # dT, dA_qk arrive decayed (bwd_dlam)
    if with_es and (e is not None or (mode == "vector" and diag == "loop")):
        raise ValueError("bwd_leaf: e_scale needs e None and no per-pair diagonals")

    def kernel(*refs):
        refs = list(refs)
        es_ref = None
        if with_es:  # input βe last; e formed from k
            es_ref = refs.pop(n_in - 1)
            refs.insert(2, None)  # e
        if mode == "none":
            refs.insert(3, None)
        if not wy:
            refs.insert(4, None)  # A
        (q_ref, k_ref, e_ref, G_ref, A_ref, S0_ref, dSe_ref, lam_ref, R_ref, dO_ref, dR_ref,
         dT_ref, dAqk_ref, dq_ref, dk_ref, de_ref) = refs[:16]
        dg_refs = refs[16:18] if mode != "none" else None
        if mode != "vector":
            return _leaf_full(refs[:16], dg_refs, es_ref)
        pairs_ref, path_ref = dg_refs
        gt = Gates(mode, G_ref, 0, C, diag)
        qs, ks = Rows(q_ref), Rows(k_ref)
        dT, dAqk = Blocks(dT_ref), Blocks(dAqk_ref, zero_diagonal=True)
        # what dT meets in dk: Ē's rows as stored, or formed here from k (e_src None: only the
        # per-pair diagonals read it, refused above)
        dT_e, es, e_src = (dT, Rows(e_ref), e_ref) if es_ref is None else (
            dT, ScaledRows(k_ref, es_ref, ed), None)
        A = Blocks(A_ref) if wy else None
        dW_memo = {}

        def state_dots(i, pairs):
            """[x_i Sᵀ for (x_ref, S_ref) in pairs]: row block i of a [C, V] tensor against a
            [BK, V] state tile, [BS, BK] each. (Contracting V in slices, as qk_gram does K,
            measured slower here: profile-10, bwd_leaf 1.94 -> 2.13 ms.)"""
            rows = pl.ds(i * BS, BS)
            return [dot_stored(x_ref[rows, :], S_ref[...], prec, tb=True) for x_ref, S_ref in pairs]

        def dW(j):  # WY's dW_j = −dR_j S0ᵀ, formed once per program at first use
            if j not in dW_memo:
                dW_memo[j] = -state_dots(j, [(dR_ref, S0_ref)])[0]
            return dW_memo[j]

        def row_block(i):
            """Row block i of dq, dk, de and the gate gradient's two parts."""
            if wy:  # dĒ_state = Aᵀ dW, dW_j = −dR_j S0ᵀ
                dEs = _sum(dot(A[j, i], dW(j), prec, ta=True) for j in range(i, n))
                dOS, = state_dots(i, [(dO_ref, S0_ref)])
            else:
                lS, dOS = state_dots(i, [(lam_ref, S0_ref), (dO_ref, S0_ref)])
                dEs = -lS
            dOS = s.scaled(dOS)
            if shared:  # dT and dA_qk meet the same decay factors: form them once
                de_k, dq_k = gt.applies([dT, dAqk], i, ks, k_ref, prec)
                dk_x = gt.apply_t_sum([(dT_e, es, e_src), (dAqk, qs, q_ref)], i, prec, n)
            else:
                de_k, dq_k = (gt.apply(dT, i, ks, k_ref, prec), gt.apply(dAqk, i, ks, k_ref, prec))
                dk_x = (gt.apply_t(dT_e, i, es, e_src, prec, n)
                        + gt.apply_t(dAqk, i, qs, q_ref, prec, n))
            de = gt.head(i, dEs) + de_k
            dq = gt.head(i, dOS) + dq_k  # both without dA_qk's diagonal (dAqk reads it as 0)
            y = gt.tail(i, state_dots(i, [(R_ref, dSe_ref)])[0])  # e^{G_C − G} ⊙ R_i dS_endᵀ
            d_i = dAqk.diagonal(i)  # [BS, 1]: its pairs (r, r) have decay factor 1
            pairs = de * es[i] - dk_x * ks[i] + dq * qs[i]
            if i == n - 1:  # the start state's decay γ_C into the end state, on the last row
                sd = jnp.sum(dSe_ref[...].astype(F32) * S0_ref[...].astype(F32),
                             axis=1)[None, :]  # [1, BK] (``_state_inner``: slower here)
                pairs = pairs + jnp.where(iota((BS, 1), 0) == BS - 1, exp(gt.glast()) * sd, 0.0)
            rows = pl.ds(i * BS, BS)
            dq_ref[rows, :] = (dq + d_i * ks[i]).astype(dq_ref.dtype)
            dk = dk_x + y + d_i * qs[i]
            de_ref[rows, :] = de.astype(de_ref.dtype)
            dk_ref[rows, :] = dk.astype(dk_ref.dtype)
            pairs_ref[rows, :] = pairs
            path_ref[rows, :] = y * ks[i]

        if rowgrid:  # this program owns row block program_id(0) % n of its chunk
            ib = grid_id(0) % n
            for i in range(n):
                def one(i=i):
                    dW_memo.clear()  # values of another branch are out of scope here
                    row_block(i)
                pl.when(ib == i)(one)
        else:
            for i in range(n):
                row_block(i)

    def _leaf_full(refs, dg_refs, es_ref):
        """No or scalar gates: every decay is one [C, C] matrix D_rs = e^{G_r − G_s} (s < r,
        masked before exp; the diagonal's factor is 1), so the leaf maps are whole-chunk
        matmuls (no sub-chunk frames). With ``dlam_decays`` dT and dA_qk arrive decayed
        (dA_qk with its diagonal): no D here, and the maps are DeltaNet's."""
        (q_ref, k_ref, e_ref, G_ref, A_ref, S0_ref, dSe_ref, lam_ref, R_ref, dO_ref, dR_ref,
         dT_ref, dAqk_ref, dq_ref, dk_ref, de_ref) = refs
        r, c = iota((C, C), 0), iota((C, C), 1)
        qc, kc = load_rows(q_ref, 0, C), load_rows(k_ref, 0, C)
        if es_ref is not None:  # e = βe ⊙ k rounded to e's dtype, as api.leaf_product forms it
            e_stored = load_scaled_rows(k_ref, es_ref, 0, C, ed)
        else:
            e_stored = load_rows(e_ref, 0, C, None)
        ec = e_stored.astype(F32)
        S0, dSe = S0_ref[...], dSe_ref[...]  # as stored (backward.low_precision)
        if mode == "none":
            D, gam, tail, gl = None, None, None, None
        else:
            Gc = load_rows(G_ref, 0, C)  # [C]
            gl = load_rows(G_ref, C - 1, 1)  # [1]
            # strictly lower: dT has no diagonal, and dA_qk's (decay factor 1) joins dq, dk
            # apart from the gate gradient's terms (below)
            D = None if pre_decayed else scalar_decay(Gc, C, strict=True)
            gam, tail = exp(Gc)[:, None], exp(gl - Gc)[:, None]
        dT, dAqk = dT_ref[...], dAqk_ref[...]
        d_qk = None
        if pre_decayed:
            # dA_qk arrives with its diagonal (factor 1): taken out of the maps that the gate
            # gradient's pairs read, so that dq, dk there hold no terms of dk's size that
            # cancel (d_r k_r q_r − d_r q_r k_r): their rounding would swamp a fully decayed
            # row's dg (tests/test_properties.py, fp32: dg ~1e-9 against dk ~1). ptxas (K =
            # 128): as a [C, C] matrix for two more products 185 registers, SASS 1250; as a
            # [C, 1] column scaling k and q 204, 1306 (and 147, 1122 with the terms left in)
            d_qk = jnp.where(r == c, dAqk, jnp.zeros_like(dAqk))
            dAqk = jnp.where(r == c, jnp.zeros_like(dAqk), dAqk)
        elif D is not None:
            d_qk = jnp.where(r == c, dAqk, 0.0)  # dA_qk's diagonal, as a [C, C] matrix
            dT, dAqk = dT * D, dAqk * D
            if cfg.leaf_native_decayed:  # back to 16 bits: native products
                dT, dAqk = dT.astype(dT_ref.dtype), dAqk.astype(dAqk_ref.dtype)
        if wy:
            dW = -dot_stored(dR_ref[...], S0, prec, tb=True)
            dEs = dot(A_ref[...].astype(F32), dW, prec, ta=True)
        else:
            dEs = -dot_stored(lam_ref[...], S0, prec, tb=True)
        dOS = s.scaled(dot_stored(dO_ref[...], S0, prec, tb=True))
        RdS = dot_stored(R_ref[...], dSe, prec, tb=True)
        if gam is not None:
            dEs, dOS, RdS_t = gam * dEs, gam * dOS, tail * RdS
        else:
            RdS_t = RdS
        # dT, dA_qk as stored: in bf16 (backward_low_precision "dT") and ungated they multiply
        # the stored 16-bit k, e, q natively
        ks_, qs_ = load_rows(k_ref, 0, C, None), load_rows(q_ref, 0, C, None)
        de = dEs + dot_stored(dT, ks_, prec)
        dq = dOS + dot_stored(dAqk, ks_, prec)
        if mode == "none":
            dk = dot_stored(dT, e_stored, prec, ta=True) + dot_stored(dAqk, qs_, prec, ta=True) + RdS_t
            dk_ref[...] = dk.astype(dk_ref.dtype)
            dq_ref[...] = dq.astype(dq_ref.dtype)
            de_ref[...] = de.astype(de_ref.dtype)
            return
        # each result stored as soon as it is whole (fewer live [C, K] tiles); the gate
        # gradient's parts summed over this tile's channels (one decay per row); dA_qk's
        # diagonal (decay factor 1) joins dq and dk only as they are stored
        pairs_ref, path_ref = dg_refs
        de_ref[...] = de.astype(de_ref.dtype)
        dq_ref[...] = (dq + dot_stored(d_qk, ks_, prec)).astype(dq_ref.dtype)
        pairs = de * ec + dq * qc
        path_ref[...] = jnp.sum(RdS_t * kc, axis=1, keepdims=True)
        dk = dot_stored(dT, e_stored, prec, ta=True) + dot_stored(dAqk, qs_, prec, ta=True)
        dk_ref[...] = (dk + RdS_t + dot_stored(d_qk, qs_, prec, ta=True)).astype(dk_ref.dtype)
        # the start state's decay into the end state, on the last row: γ_C Σ_k Σ_v dS ⊙ S0
        # over this tile's channels
        sd = jnp.sum(_state_inner(dSe, S0, prec), axis=1)  # [1]
        pairs = jnp.sum(pairs - dk * kc, axis=1, keepdims=True)
        pairs_ref[...] = pairs + jnp.where(iota((C, 1), 0) == C - 1, exp(gl) * sd, 0.0)

    # Row grid (vector gates, KernelConfig.leaf_rowgrid): n programs per chunk, one per 16-row block — n× the
    # parallelism and one block's live tiles per program (the gate gradient's parts are summed
    # across blocks outside, api._gate_grad). Blocks stay whole chunks (each program stores only
    # its rows).
    ch = (lambda m: m // n) if rowgrid else (lambda m: m)
    tok_k = pl.BlockSpec((None, C, None, BK), lambda m, bh, kt: (bh // H, ch(m), bh % H, kt))
    tok_v = pl.BlockSpec((None, C, None, V), lambda m, bh, kt: (bh // H, ch(m), bh % H, 0))
    st_k = pl.BlockSpec((None, None, None, BK, V), lambda m, bh, kt: (bh // H, bh % H, ch(m), kt, 0))
    mat = pl.BlockSpec((None, None, None, C, C), lambda m, bh, kt: (bh // H, bh % H, ch(m), 0, 0))
    row = pl.BlockSpec((None, C, None), lambda m, bh, kt: (bh // H, ch(m), bh % H))
    gate = row if mode == "scalar" else tok_k
    ins = [q, k] + ([] if with_es else [e]) + ([] if mode == "none" else [G]) + (
        [A] if wy else []) + [S0, dSe, lam, R, dO, dR, dT, dAqk] + (
        [e_scale] if with_es else [])
    in_specs = [tok_k] * (2 if with_es else 3) + ([] if mode == "none" else [gate]) + (
        [mat] if wy else []) + [st_k, st_k, tok_v, tok_v, tok_v, tok_v, mat, mat] + (
        [row] if with_es else [])
    n_in = len(ins)
    qd, kd, ed = dtypes
    # per key tile: a [C, 1] column per (chunk, head, tile) of [B,Tp,H,K/BK] fp32
    n_kt = K // BK
    tile_part = (pl.BlockSpec((None, C, None, 1), lambda m, bh, kt: (bh // H, ch(m), bh % H, kt)),
                 jax.ShapeDtypeStruct((s.B, s.Tp, H, n_kt), F32))
    # the gate gradient's two parts: per channel (vector gates) or per key tile (scalar)
    gate_part = (tok_k, s.sds_tok(K)) if mode == "vector" else tile_part
    out_specs = [tok_k] * 3 + ([] if mode == "none" else [gate_part[0]] * 2)
    out_shape = [s.sds_tok(K, qd), s.sds_tok(K, kd), s.sds_tok(K, ed)] + (
        [] if mode == "none" else [gate_part[1]] * 2)
    outs = list(launch.call(kernel, grid=(s.N * (n if rowgrid else 1), s.B * H, K // BK),
                      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                      interpret=interpret, num_warps=s.warps("bwd_leaf"), name="rewy_bwd_leaf",
                      tile_axis=s.tile_axis(2))(*ins))
    return outs[:3] + [None if mode == "none" else tuple(outs[3:])]


def bwd_chunk(s: Shape, q, k, e, z, G, A, S0, dSe, R, dO, dR, *, backward, dtypes, interpret,
              lam_dtype=F32, dt_dtype=F32, e_scale=None):
    """Per-chunk cotangents (raw frame): dq, dk, de [B,Tp,H,K], dz [B,Tp,H,V] and the gate
    gradient's two parts (pairs, path) per token ([B,Tp,H] for scalar gates; ``bwd_leaf``) or
    None.
    lam_dtype, dt_dtype: how Λ and dT, dA_qk are stored between the two kernels.
    e_scale: βe with e None (ReWY; KernelConfig.leaf_e_rows): the leaf forms e = βe ⊙ k
    itself (``bwd_leaf``); bwd_dlam reads no e under ReWY.

    Two kernels, so that neither holds a chunk's worth of [C, K] and [C, V] blocks at once:
    bwd_dlam (the C×C core: Λ, dT, dA_qk) then bwd_leaf (key-tiled leaf maps and dg's parts).
    """
    kw = dict(backward=backward, interpret=interpret)
    lam, dT, dAqk = bwd_dlam(s, A, R, dO, dR, e, z, G, S0, lam_dtype=lam_dtype,
                             dt_dtype=dt_dtype, **kw)
    dq, dk, de, dg_parts = bwd_leaf(s, q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk,
                                    dtypes=dtypes[:3], e_scale=e_scale, **kw)
    if dg_parts is not None and s.mode == "scalar":
        dg_parts = tuple(jnp.sum(x, axis=-1) for x in dg_parts)
    return dq, dk, de, lam.astype(dtypes[3]), dg_parts
