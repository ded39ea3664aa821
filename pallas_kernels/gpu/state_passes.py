"""State passes: the only kernels that carry a state across chunks (a loop over N per
program).

Pipeline (one op's forward and backward; ``api`` drives it, this module's stage marked *):

    forward   gates.cum_gates -> chunk_local.qk_gram (vector gates) -> chunk_local.intra
              -> state_passes.fwd_pass* (output fused in) | state_passes.fwd_pass* + output.output
    backward  chunk_local.intra (W, U from the kept A) -> output.bwd_local
              -> state_passes.twin_pass* | fwd_pass* + bwd_pass*
              -> chunk_backward.bwd_dlam -> chunk_backward.bwd_leaf -> gates.gate_grad

    fwd_pass   grid (B·H, V/BVs)    reads W, k [B,Tp,H,K], U [B,Tp,H,V], G, h0 [B,H,n_seq1,K,V];
                                    S0 = S, R = U − W S0, S ← γ_C S0 + K̄ᵀ R; writes S0
                                    [B,H,N,K,V], R [B,Tp,H,V], final [B,H,n_seq1,K,V] — or, with
                                    the output fused in, o [B,Tp,H,V] and final
    bwd_pass   grid (B·H, V/BVs)    reverse loop: reads q, k, W, dO, dRl, G, dfin;
                                    dR = dRl + K̄ dS_end, dS0 = γ_C dS_end + Qγᵀ dO − Wᵀ dR;
                                    writes dS_end [B,H,N,K,V], dR [B,Tp,H,V], dh0
    twin_pass  grid (B·H, V/BVs, 2) the backward's recomputing fwd_pass and bwd_pass in one launch
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu import launch
from pallas_kernels.gpu.blocks import (F32, chunk_decay, chunk_output, col, dot, dot_stored, exp,
                                       kt, load_rows, qg, qk_full)
from pallas_kernels.gpu.launch import Shape, grid_id, split_refs


def native_pass_dots(s, dtypes, forward=False):
    """Whether a state pass multiplies its carried state and per-chunk tensor in the 16-bit
    dtype they are stored in (KernelConfig.backward_native_pass_dots, or for the ``forward``'s
    unfused pass .forward_native_pass_dots): only where both are stored 16-bit — the
    backward's passes under .backward_low_precision, the forward's pass where
    .forward_low_precision names S0 and R."""
    on = s.cfg.forward_native_pass_dots if forward else s.cfg.backward_native_pass_dots
    return on and all(d != F32 for d in dtypes)


def _pass_dot(a, b, prec, dtype, ta=False):
    """A state pass's product: in ``dtype`` (the stored one, native 16-bit) when given — see
    ``native_pass_dots`` —, else of a and b as they are (fp32)."""
    if dtype is not None:
        return dot_stored(a.astype(dtype), b.astype(dtype), prec, ta=ta)
    return dot(a, b, prec, ta=ta)


def fwd_pass(s: Shape, W, U, k, G, h0, reset, end, seq, *, interpret, dtypes=(F32, F32),
             out=None, forward=False, decayed=False):
    """S0 [B,H,N,K,V], R [B,Tp,H,V] (stored in ``dtypes``; the pass itself carries S in fp32),
    final [B,H,n_seq1,K,V] (fp32). ``forward``: the forward's pass (not the backward's
    recomputing one), for ``native_pass_dots``.

    out = (q, P, out_dtype): the output fused into the pass instead — O = Qγ S0 + P R per chunk
    and value tile while S0 and R are in registers — returning (o [B,Tp,H,V], final) and
    storing no S0 or R (the ``recompute`` forward, KernelConfig.fused_output). P: the
    [B,H,N,C,C] matrix of ``qk_gram`` (vector gates), or None (no or scalar gates: rebuilt per
    chunk and value tile, as in ``output``).

    decayed (vector gates): k is K̄ = e^{G_C − G} ⊙ k and out's q is Qγ = e^{G} ⊙ q, from
    ``decayed_rows``; of G only each chunk's last row is read (the state's decay).
    """
    native = native_pass_dots(s, dtypes, forward)
    kernel, ins, in_specs, outputs = _fwd_pass_parts(s, W, U, k, G, h0, reset, end, seq,
                                                     dtypes, out, native, decayed)
    return launch.call(kernel, grid=(s.B * s.H, s.V // s.BVs), in_specs=in_specs, **outputs,
                 interpret=interpret, num_warps=s.warps("fwd_pass"), name="rewy_fwd_pass",
                 num_stages=s.cfg.stage(
                     ("native" if native else "fwd") if out is None
                     else "fused" if W.dtype != F32
                     else "fused_w32" if jnp.dtype(k.dtype).itemsize < 4 else "fused_f32"),
                 tile_axis=s.tile_axis(1))(*ins)


def _fwd_pass_parts(s, W, U, k, G, h0, reset, end, seq, dtypes, out, native, decayed=False):
    """``fwd_pass``'s (kernel, inputs, in_specs, outputs) on the grid (B·H, V/BVs)."""
    C, N, K, BV, prec, mode = s.C, s.N, s.K, s.BVs, s.prec, s.mode
    one_seq = s.one_seq_init
    end_after = one_seq and s.cfg.end_after_loop
    fused = out is not None
    given_P = fused and out[1] is not None
    # the recurrence's two products in the stored dtypes of S0 and R, or on fp32 values
    S_dt, R_dt = dtypes if native else (None, None)
    # scalar gates: Qγ S0 = γ ⊙ (q S0), and where the pass multiplies natively K̄ᵀ R =
    # kᵀ (d ⊙ R) with k as stored (ptxas, sm_90, GDN K = 128: the fused pass's TF32 product
    # in that form spills 412 B against 200)
    vside = s.value_side_decay()
    vside_kr = vside and R_dt is not None

    def kernel(*refs):
        refs = list(refs)
        if mode == "none":
            refs.insert(3, None)  # G
        if not fused:
            refs[8:8] = [None, None]  # q, P
        elif not given_P:
            refs.insert(9, None)  # P
        (W_ref, U_ref, k_ref, G_ref, h0_ref, reset_ref, end_ref, seq_ref, q_ref, P_ref,
         *outs) = refs
        if fused:
            o_ref, fin_ref = outs
        else:
            S0_ref, R_ref, fin_ref = outs

        def body(c, S):
            sq = 0 if one_seq else seq_ref[c]  # one sequence: seq is 0 (api.Config.one_seq)
            if not one_seq:  # else h0 is the loop's initial state
                S = jnp.where(reset_ref[c] != 0, h0_ref[sq], S)
            base = c * C
            if not fused:
                S0_ref[c] = S.astype(S0_ref.dtype)
            Uc = load_rows(U_ref, base, C)
            # W as stored when native
            R = Uc - _pass_dot(load_rows(W_ref, base, C, None if S_dt else F32), S, prec, S_dt)
            if decayed:  # the rows carry their decays: only the state's, G's last row
                Gc, gl = None, load_rows(G_ref, base + C - 1, 1)
            else:
                Gc, gl = chunk_decay(mode, G_ref, base, C)
            if fused:  # O = Qγ S0 + P R: off the recurrence's critical path
                if given_P:
                    P = P_ref[c]
                else:
                    _, P = qk_full(mode, q_ref, k_ref, G_ref, C, prec, base)
                if vside:
                    o = s.scaled(exp(Gc)[:, None] * dot(load_rows(q_ref, base, C), S, prec)
                                 + dot(P, R, prec))
                else:
                    o = chunk_output(s, Gc, load_rows(q_ref, base, C), S, P, R,
                                      decayed=decayed)
                o_ref[pl.ds(base, C), :] = o.astype(o_ref.dtype)
            else:
                R_ref[pl.ds(base, C), :] = R.astype(R_ref.dtype)
            if vside_kr:  # the row decay on R's [C, BVs] tile: k as stored (exact in bf16)
                S_new = _pass_dot(load_rows(k_ref, base, C, None if R_dt else F32),
                                  exp(gl - Gc)[:, None] * R, prec, R_dt, ta=True)
            else:
                kc = load_rows(k_ref, base, C)
                Kt = kc if decayed else kt(mode, Gc, gl, kc)
                S_new = _pass_dot(Kt, R, prec, R_dt, ta=True)
            S_new = S_new + (S if mode == "none" else col(exp(gl)) * S)
            if not end_after:

                @pl.when(end_ref[c] != 0)
                def _():
                    fin_ref[sq] = S_new

            return S_new

        S_end = lax.fori_loop(0, N, body, h0_ref[0] if one_seq else jnp.zeros((K, BV), F32))
        if end_after:
            fin_ref[0] = S_end

    ins = [W, U, k] + ([] if mode == "none" else [G]) + [h0, reset, end, seq]
    in_specs = [s.col_tok(K, False), s.col_tok(s.V, True), s.col_tok(K, False)] + (
        [] if mode == "none" else [s.col_gate()]) + [s.col_states(s.n_seq1)] + [s.col_meta()] * 3
    if fused:
        q, P, out_dtype = out
        ins.append(q)
        in_specs.append(s.col_tok(K, False))
        if given_P:
            ins.append(P)
            in_specs.append(s.col_mats(C, C))
        outputs = s.pass_outputs()
        outputs = dict(out_specs=[s.col_tok(s.V, True), outputs["out_specs"][2]],
                       out_shape=[s.sds_tok(s.V, out_dtype), outputs["out_shape"][2]])
    else:
        outputs = s.pass_outputs(dtypes)
    return kernel, ins, in_specs, outputs


def _chunk_q_dO(s, Gc, q, dO, vside=False):
    """scale · Qγᵀ dO [K, BV] of one chunk from its rows q [C, K] and dO [C, BV] as stored
    (the reverse state pass's state-free term). No gates: the product of q and dO as stored
    (exact products, native rate); scalar gates: Qγ in fp32, or with ``vside``
    (``Shape.value_side_decay``) qᵀ (γ ⊙ dO), γ ⊙ dO rounded to dO's dtype so that the
    product stays native."""
    if vside:
        return s.scaled(dot_stored(q, (exp(Gc)[:, None] * dO.astype(F32)).astype(dO.dtype),
                                   s.prec, ta=True))
    if s.mode != "none":
        q, dO = qg(s.mode, Gc, q.astype(F32)), dO.astype(F32)
    return s.scaled(dot_stored(q, dO, s.prec, ta=True))


def bwd_pass(s: Shape, q, k, G, W, dO, dRl, dfin, reset, end, seq, *, interpret,
             dtypes=(F32, F32)):
    """dS_end [B,H,N,K,V], dR [B,Tp,H,V] (stored in ``dtypes``; the pass carries dS in fp32),
    dh0 [B,H,n_seq1,K,V] (fp32)."""
    kernel, ins, in_specs, outputs = _bwd_pass_parts(s, q, k, G, W, dO, dRl, dfin, reset, end,
                                                     seq, dtypes)
    return launch.call(kernel, grid=(s.B * s.H, s.V // s.BVs), in_specs=in_specs, **outputs,
                 interpret=interpret, num_warps=s.warps("bwd_pass"), name="rewy_bwd_pass",
                 num_stages=s.cfg.stage("bwd"), tile_axis=s.tile_axis(1))(*ins)


def _bwd_pass_parts(s, q, k, G, W, dO, dRl, dfin, reset, end, seq, dtypes):
    """``bwd_pass``'s (kernel, inputs, in_specs, outputs) on the grid (B·H, V/BVs)."""
    C, N, K, BV, prec, mode = s.C, s.N, s.K, s.BVs, s.prec, s.mode
    one_seq = s.one_seq_init
    end_after = one_seq and s.cfg.end_after_loop
    # K̄ dS and Wᵀ dR in the stored dtypes of dS and dR, or on fp32 values
    dS_dt, dR_dt = dtypes if native_pass_dots(s, dtypes) else (None, None)
    # scalar gates: K̄ dS = d ⊙ (k dS) and Qγᵀ dO = qᵀ (γ ⊙ dO), k and q as stored
    vside = s.value_side_decay()

    def kernel(*refs):
        (q_ref, k_ref, G_ref, W_ref, dO_ref, dRl_ref, dfin_ref, reset_ref, end_ref, seq_ref,
         dSe_ref, dR_ref, dh0_ref) = split_refs(refs, mode, 3)

        def body(m, carry):
            c = N - 1 - m
            sq = 0 if one_seq else seq_ref[c]  # one sequence: seq is 0 (api.Config.one_seq)
            dS = carry
            if not one_seq:  # else dfin is the loop's initial carry
                dS = dS + jnp.where(end_ref[c] != 0, dfin_ref[sq], 0.0)
            dSe_ref[c] = dS.astype(dSe_ref.dtype)
            base = c * C
            Gc, gl = chunk_decay(mode, G_ref, base, C)
            Kt = None if vside else kt(mode, Gc, gl, load_rows(k_ref, base, C))
            if vside:  # the row decay on the [C, BVs] product
                kdS = _pass_dot(load_rows(k_ref, base, C, None if dS_dt else F32), dS, prec,
                                dS_dt)
                dR = load_rows(dRl_ref, base, C) + exp(gl - Gc)[:, None] * kdS
            else:
                dR = load_rows(dRl_ref, base, C) + _pass_dot(Kt, dS, prec, dS_dt)
            dR_ref[pl.ds(base, C), :] = dR.astype(dR_ref.dtype)
            qdo_c = _chunk_q_dO(s, Gc, load_rows(q_ref, base, C, None),
                                load_rows(dO_ref, base, C, None), vside)
            dS0 = qdo_c - _pass_dot(  # W as stored
                load_rows(W_ref, base, C, None if dR_dt else F32), dR, prec, dR_dt, ta=True)
            dS0 = dS0 + (dS if mode == "none" else col(exp(gl)) * dS)
            if end_after:  # chunk 0 starts the only sequence: the loop's last step
                return dS0
            is_reset = reset_ref[c] != 0

            @pl.when(is_reset)
            def _():
                dh0_ref[sq] = dS0

            return jnp.where(is_reset, 0.0, dS0)

        dS_start = lax.fori_loop(0, N, body, dfin_ref[0] if one_seq else jnp.zeros((K, BV), F32))
        if end_after:
            dh0_ref[0] = dS_start

    ins = [q, k] + ([] if mode == "none" else [G]) + [W, dO, dRl, dfin, reset, end, seq]
    in_specs = [s.col_tok(K, False)] * 2 + ([] if mode == "none" else [s.col_gate()]) + [
        s.col_tok(K, False), s.col_tok(s.V, True), s.col_tok(s.V, True),
        s.col_states(s.n_seq1)] + [s.col_meta()] * 3
    return kernel, ins, in_specs, s.pass_outputs(dtypes)


def twin_pass(s: Shape, fwd_args, bwd_args, *, interpret, fwd_dtypes, bwd_dtypes):
    """The backward's two state passes in one launch (KernelConfig.twin_pass):
    ``fwd_pass(s, *fwd_args, dtypes=fwd_dtypes)`` (the recomputed S0, R) and ``bwd_pass(s,
    *bwd_args, dtypes=bwd_dtypes)`` (dS_end, dR) are independent — bwd_pass reads W, not S0 or
    R — and each runs only B·H·V/BVs programs, one per SM, issue-bound at one warp per
    scheduler (profile-11, ncu). Launched apart they run one after the other; here a third grid
    axis picks the pass, so both share the SMs (two programs per SM where registers and shared
    memory allow). Returns (S0, R, final) + (dS_end, dR, dh0), as the two calls would.
    """
    kf, ins_f, specs_f, out_f = _fwd_pass_parts(s, *fwd_args, fwd_dtypes, None,
                                                 native_pass_dots(s, fwd_dtypes))
    kb, ins_b, specs_b, out_b = _bwd_pass_parts(s, *bwd_args, bwd_dtypes)
    n_f, n_b, n_fo = len(ins_f), len(ins_b), len(out_f["out_shape"])

    def kernel(*refs):
        ins, outs = refs[:n_f + n_b], refs[n_f + n_b:]
        which = grid_id(2)

        @pl.when(which == 0)
        def _():
            kf(*ins[:n_f], *outs[:n_fo])

        @pl.when(which == 1)
        def _():
            kb(*ins[n_f:], *outs[n_fo:])

    def on_twin_grid(spec):  # (bh, v) -> (bh, v, which): both passes see their own blocks
        return pl.BlockSpec(spec.block_shape, lambda bh, v, which: spec.index_map(bh, v))

    # Stages (KernelConfig.stages "twin"): at one (28 KB of shared memory, DeltaNet) two
    # programs share an SM and each hides the other's load latency; one-sequence calls
    # pipeline 2 deep instead (123 KB, one program per SM; profile-17).
    return launch.call(kernel, grid=(s.B * s.H, s.V // s.BVs, 2),
                 in_specs=[on_twin_grid(x) for x in specs_f + specs_b],
                 out_specs=[on_twin_grid(x) for x in out_f["out_specs"] + out_b["out_specs"]],
                 out_shape=out_f["out_shape"] + out_b["out_shape"], interpret=interpret,
                 num_warps=s.warps("twin_pass"), name="rewy_twin_pass",
                 num_stages=s.cfg.stage("twin"), tile_axis=s.tile_axis(1))(*ins_f, *ins_b)
