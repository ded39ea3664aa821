"""Chunk-local forward kernels: the WY representation of each chunk (no state).

Pipeline (one op's forward and backward; ``api`` drives it, this module's stage marked *):

    forward   gates.cum_gates -> chunk_local.qk_gram* (vector gates) -> chunk_local.intra*
              -> state_passes.fwd_pass (output fused in) | state_passes.fwd_pass + output.output
    backward  chunk_local.intra* (W, U from the kept A) -> output.bwd_local
              -> state_passes.twin_pass | fwd_pass + bwd_pass
              -> chunk_backward.bwd_dlam -> chunk_backward.bwd_leaf -> gates.gate_grad

    intra    grid (N, B·H)   reads k, e (or k and βe), z (or v and βz) [B,Tp,H,K|V], G, and
                             T [B,H,N,C,C] from qk_gram (vector gates) or A (the backward);
                             writes A = (I + T)⁻¹ [B,H,N,C,C], W = A Ēγ [B,Tp,H,K], U = A Z
                             [B,Tp,H,V] — given A, only W, U (launch name "rewy_wu")
    qk_gram  grid (N·n, B·H) vector gates: reads q, k (, e, βe) [B,Tp,H,K], G; writes
                             P = tril(Qγ K̄ᵀ) (and intra's T = strict tril(Ēγ K̄ᵀ)) [B,H,N,C,C]

Vector gates (KDA, GDN2) run on 16-row sub-chunk blocks in reference frames (blocks.Gates); with
no or scalar gates the decay is one [C, C] matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gpu import launch
from pallas_kernels.gpu.blocks import (BS, F32, Blocks, Rows, _sum, dot, exp, inv_blocks,
                                       iota, load_rows)
from pallas_kernels.gpu.decay import Gates
from pallas_kernels.gpu.launch import Shape, grid_id, split_refs


def intra(s: Shape, k, e, z, G, *, interpret, T=None, A=None, dtypes=(F32, F32), a_dtype=F32,
          rows=None):
    """A [B,H,N,C,C] (stored in ``a_dtype``), W [B,Tp,H,K], U [B,Tp,H,V] (in ``dtypes``).

    The inverse is formed and applied in fp32 either way: ``a_dtype`` is only the dtype of the
    copy kept for the backward (``backward.low_precision`` "A").

    T: the strictly lower gated key Gram [B,H,N,C,C] when ``qk_gram`` already formed it
    (vector gates, KernelConfig.gram_from_qk); otherwise built here block by block.
    A: the inverse itself, saved by the forward (the ``recompute`` policy keeps the chunk
    matrices): then only (W, U) = (A·Ēγ, A·Z) are formed and returned — the backward's
    recomputation without the Gram and the block substitution, as row-block products.
    rows = (βe, βz), [B,Tp,H] fp32 per-row scales: e and z are then k and v as stored, and the
    kernel forms Ē = βe ⊙ k and Z = βz ⊙ v exactly in fp32 (KernelConfig.row_scaled_ez):
    the Gram as βe_r (k_r·k_s), W and U with βe, βz on A's columns (a given T holds βe
    already).
    """
    n, C, prec, mode = s.n, s.C, s.prec, s.mode
    given_T, given_A = T is not None, A is not None
    gate_on_A = mode == "scalar" and s.cfg.gate_on_A
    assert not (given_T and given_A), "intra takes T (to invert) or A (inverted), not both"

    def kernel(*refs):
        refs = list(refs)
        be_ref = bz_ref = None
        if rows is not None:  # the last two inputs
            be_ref, bz_ref = refs[n_in - 2:n_in]
            del refs[n_in - 2:n_in]
        M_ref = refs.pop(4 if mode != "none" else 3) if (given_T or given_A) else None
        if given_A:
            k_ref, e_ref, z_ref, G_ref, W_ref, U_ref = split_refs(refs, mode, 4)
            A_ref = None
        else:
            k_ref, e_ref, z_ref, G_ref, A_ref, W_ref, U_ref = split_refs(refs, mode, 4)
        # exact per-pair diagonals even under a declared bound: the centred blocks measured
        # slower here (1.81 -> 2.39 ms, H200), unlike in bwd_leaf (6.0 -> 3.1 ms)
        gt = Gates(mode, G_ref, 0, C, s.cfg.intra_diag, kslice=s.cfg.intra_kslice)
        # with rows, es and zs are k's and v's rows as stored: the row scales βe, βz go onto
        # the [16, 16] blocks instead — T's rows after its product (the key slices stay native
        # products of the stored rows) and A's columns before W's and U's (a [16, 16] product
        # per block, not a [16, K] one per row operand: ptxas, 4 warps, KDA 245 -> 178
        # registers, DeltaNet 254 either way with SASS 3710 -> 3422)
        ks, es, zs = Rows(k_ref), Rows(e_ref), Rows(z_ref)

        def T_blk(i, j):
            if given_T:
                return M_ref[pl.ds(i * BS, BS), pl.ds(j * BS, BS)]
            t = gt.gram(i, j, es[i], ks[j], k_ref, prec, strict=True,
                        x_ref=e_ref if gt.kslice else None)  # key slices need the ref
            return t if be_ref is None else t * load_rows(be_ref, i * BS)[:, None]

        def scaled(a, j, b_ref, gated=False):
            """A[i, j] diag(β_j) (the row scale of Ē_j or Z_j), and diag(γ_j) when ``gated``
            (scalar gates: W = A (γ ⊙ Ē) with γ on A's [16, 16] columns, not Ē's [16, K] rows:
            KernelConfig.gate_on_A)."""
            f = None if b_ref is None else load_rows(b_ref, j * BS)
            if gated:
                f = exp(gt.blk(j)) if f is None else f * exp(gt.blk(j))
            return a if f is None else a * f[None, :]

        def on_row(i, A):  # row block i of A is final: emit W_i, U_i (and A's row)
            W_ref[pl.ds(i * BS, BS), :] = _sum(
                dot(scaled(A[i, j], j, be_ref, gate_on_A),
                    es[j] if gate_on_A else gt.head(j, es[j]), prec)
                for j in range(i + 1)).astype(W_ref.dtype)
            U_ref[pl.ds(i * BS, BS), :] = _sum(
                dot(scaled(A[i, j], j, bz_ref), zs[j], prec)
                for j in range(i + 1)).astype(U_ref.dtype)
            if A_ref is None:
                return
            for j in range(n):
                A_ref[pl.ds(i * BS, BS), pl.ds(j * BS, BS)] = (
                    A[i, j] if j <= i else jnp.zeros((BS, BS), F32)).astype(A_ref.dtype)

        if given_A:
            for i in range(n):
                on_row(i, Blocks(M_ref))
        else:
            inv_blocks(T_blk, n, prec, on_row, joint_diag=s.cfg.joint_diag_inverse,
                       stacked=s.cfg.stacked_diag)

    ins = [k, e, z] + ([] if mode == "none" else [G]) + (
        [T] if given_T else [A] if given_A else []) + (list(rows) if rows is not None else [])
    in_specs = [s.chunk_tok(s.K), s.chunk_tok(s.K), s.chunk_tok(s.V)] + (
        [] if mode == "none" else [s.chunk_gate()]) + (
        [s.chunk_mat(C, C)] if (given_T or given_A) else []) + (
        [s.chunk_row()] * 2 if rows is not None else [])
    n_in = len(ins)
    mat = jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), a_dtype)
    mats, sds = ([], []) if given_A else ([s.chunk_mat(C, C)], [mat])
    mats, sds = mats + [s.chunk_tok(s.K), s.chunk_tok(s.V)], sds + [
        s.sds_tok(s.K, dtypes[0]), s.sds_tok(s.V, dtypes[1])]
    out = launch.call(kernel, grid=(s.N, s.B * s.H), in_specs=in_specs,
                out_specs=mats, out_shape=sds, interpret=interpret,
                num_warps=s.warps("wu" if given_A else "intra"),
                name="rewy_wu" if given_A else "rewy_intra")(*ins)
    return tuple(out)


def qk_gram(s: Shape, q, k, G, *, interpret, e=None, e_rows=None):
    """Vector gates only: P = tril(Qγ K̄ᵀ) [B,H,N,C,C] fp32, once per chunk, so that ``output``
    and ``bwd_local`` are plain matmuls instead of rebuilding P's per-pair (or centred) diagonal
    blocks per value tile. A kernel of its own: inside ``intra`` it would add live blocks to the
    inverse's and spill (measured 1.8 -> 6.6 ms there).

    With ``e`` it also returns intra's T = strict tril(Ēγ K̄ᵀ) (P, T): the two Grams share every
    decay factor (the same K̄ frames), so T costs matmuls here instead of exponentials in intra.
    With ``e_rows`` ([B,Tp,H] fp32, ``intra``'s βe) as well, ``e`` is k as stored and T's rows
    are scaled by βe after the products — Ē = βe ⊙ k exactly, not rounded to 16 bits.
    """
    n, C, prec = s.n, s.C, s.prec
    cfg = s.cfg
    # Row grid (KernelConfig.qk_gram_rowgrid): one program per 16-row block of P.
    rowgrid = cfg.qk_gram_rowgrid
    # a declared gate bound (Shape.centred): the diagonal blocks as centred frame products, one
    # matmul per key slice like the off-diagonal blocks, instead of the 16-step exact loop
    # (KernelConfig.qk_gram_centred)
    diag = "centred" if s.centred and cfg.qk_gram_centred else cfg.qk_gram_diag
    with_T = e is not None
    # KernelConfig.qk_gram_row_frames: a row block's frame products in one key-slice loop
    # (needs the key slices that Gates.row_frame_grams loops over)
    row_frames = cfg.qk_gram_row_frames and 0 < cfg.qk_gram_kslice < s.K

    def kernel(*refs):
        be_ref = None
        if e_rows is not None:
            q_ref, k_ref, e_ref, G_ref, be_ref, P_ref, T_ref = refs
        elif with_T:
            q_ref, k_ref, e_ref, G_ref, P_ref, T_ref = refs
        else:
            (q_ref, k_ref, G_ref, P_ref), e_ref, T_ref = refs, None, None
        # exact: as fast as centred here (0.95 ms, when qk_gram formed P alone)
        gt = Gates("vector", G_ref, 0, C, diag, kslice=cfg.qk_gram_kslice)
        qs, ks = Rows(q_ref), Rows(k_ref)
        es = Rows(e_ref) if with_T else None

        x_refs, stricts = ([q_ref, e_ref], [False, True]) if with_T else ([q_ref], [False])

        def store(i, j, out):  # block (i, j) of P (and T, its rows scaled by βe)
            blk = (pl.ds(i * BS, BS), pl.ds(j * BS, BS))
            P_ref[blk] = out[0]
            if with_T:
                T_ref[blk] = out[1] if be_ref is None else (
                    out[1] * load_rows(be_ref, i * BS)[:, None])

        def block(i, j):
            if j > i:
                blk = (pl.ds(i * BS, BS), pl.ds(j * BS, BS))
                for ref in (P_ref, T_ref) if with_T else (P_ref,):
                    ref[blk] = jnp.zeros((BS, BS), F32)
                return
            xs = [qs[i], es[i]] if with_T else [qs[i]]
            store(i, j, gt.grams(i, j, xs, ks[j], k_ref, prec, stricts, x_refs=x_refs))

        def row_block(i):
            if not row_frames:
                for j in range(n):
                    block(i, j)
                return
            # every frame-product block of the row in one key-slice loop (Gates.row_frame_grams)
            outs = gt.row_frame_grams(i, x_refs, k_ref, prec, diag == "centred")
            r, c = iota((BS, BS), 0), iota((BS, BS), 1)
            for j, out in enumerate(outs):
                if j == i:  # the centred diagonal block, masked as grams masks it
                    out = [jnp.where(c < r if st else c <= r, m, 0.0)
                           for m, st in zip(out, stricts)]
                store(i, j, out)
            for j in range(len(outs), n):
                block(i, j)

        for i in range(n):
            if rowgrid:
                pl.when(grid_id(0) % n == i)(lambda i=i: row_block(i))
            else:
                row_block(i)

    per_chunk = n if rowgrid else 1  # programs per chunk
    ch = lambda m: m // per_chunk  # noqa: E731
    H = s.H
    tok = pl.BlockSpec((None, C, None, s.K), lambda m, bh: (bh // H, ch(m), bh % H, 0))
    mat = pl.BlockSpec((None, None, None, C, C), lambda m, bh: (bh // H, bh % H, ch(m), 0, 0))
    sds = jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), F32)
    ins = [q, k] + ([e] if with_T else []) + [G]
    in_specs = [tok] * len(ins)
    if e_rows is not None:
        assert with_T, "e_rows scales T: e (k as stored) is needed too"
        ins.append(e_rows)
        in_specs.append(pl.BlockSpec((None, C, None), lambda m, bh: (bh // H, ch(m), bh % H)))
    out = launch.call(kernel, grid=(s.N * per_chunk, s.B * H), in_specs=in_specs,
                out_specs=[mat] * (2 if with_T else 1), out_shape=[sds] * (2 if with_T else 1),
                interpret=interpret, num_warps=s.warps("qk_gram"), name="rewy_qk_gram")(*ins)
    return tuple(out) if with_T else out[0]
