"""The chunk output and its state-free transpose: per-chunk kernels on value tiles.

Pipeline (one op's forward and backward; ``api`` drives it, this module's stage marked *):

    forward   gates.cum_gates -> chunk_local.qk_gram (vector gates) -> chunk_local.intra
              -> state_passes.fwd_pass (output fused in) | state_passes.fwd_pass + output.output*
    backward  chunk_local.intra (W, U from the kept A) -> output.bwd_local*
              -> state_passes.twin_pass | fwd_pass + bwd_pass
              -> chunk_backward.bwd_dlam -> chunk_backward.bwd_leaf -> gates.gate_grad

    output     grid (N, B·H, V/BV)  reads q [B,Tp,H,K], S0 [B,H,N,K,V], R [B,Tp,H,V], P
                                    [B,H,N,C,C] (or k, G to rebuild it); writes
                                    o = scale · (Qγ S0 + P R) [B,Tp,H,V]
    bwd_local  grid (N, B·H, V/BV)  reads P (or q, k, G) and dO [B,Tp,H,V]; writes
                                    dRl = scale · Pᵀ dO [B,Tp,H,V] (the state-free part of dR)
"""

from __future__ import annotations

from pallas_kernels.gpu import launch
from pallas_kernels.gpu.blocks import F32, chunk_decay, chunk_output, dot, load_rows, qk_full
from pallas_kernels.gpu.launch import Shape, split_refs


def output(s: Shape, q, k, G, S0, R, P, out_dtype, *, interpret):
    """O = Qγ S0 + P R, [B,Tp,H,V] in out_dtype. Grid (N, B·H, V/BV).

    P: the [B,H,N,C,C] matrix that ``qk_gram`` built (vector gates), or None: no or scalar
    gates rebuild it per tile (one masked [C, C] matmul).
    """
    C, prec, mode, BV = s.C, s.prec, s.mode, s.BV
    given_P = P is not None

    def kernel(*refs):
        refs = list(refs)
        if given_P:
            refs.insert(1, None)  # k
        if mode == "none":
            refs.insert(2, None)  # G
        if not given_P:
            refs.insert(5, None)  # P
        q_ref, k_ref, G_ref, S0_ref, R_ref, P_ref, o_ref = refs
        if given_P:
            Gc, P = chunk_decay(mode, G_ref, 0, C)[0], P_ref[...]
        else:  # one [C, C] decay matrix: whole-chunk matmuls
            Gc, P = qk_full(mode, q_ref, k_ref, G_ref, C, prec)
        o = chunk_output(s, Gc, load_rows(q_ref, 0, C), S0_ref[...].astype(F32), P,
                          R_ref[...].astype(F32))
        o_ref[...] = o.astype(o_ref.dtype)

    gate = ([], []) if mode == "none" else ([G], [s.chunk_gate3()])
    if given_P:
        ins = [q] + gate[0] + [S0, R, P]
        in_specs = [s.chunk_tok3(s.K)] + gate[1] + [s.chunk_state_v(BV), s.chunk_tok_v(BV),
                                                    s.chunk_mat3(C, C)]
    else:
        ins = [q, k] + gate[0] + [S0, R]
        in_specs = [s.chunk_tok3(s.K)] * 2 + gate[1] + [s.chunk_state_v(BV), s.chunk_tok_v(BV)]
    return launch.call(kernel, grid=(s.N, s.B * s.H, s.V // BV), in_specs=in_specs,
                 out_specs=s.chunk_tok_v(BV), out_shape=s.sds_tok(s.V, out_dtype),
                 interpret=interpret, num_warps=s.warps("output"), name="rewy_output",
                 tile_axis=s.tile_axis(2))(*ins)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
def bwd_local(s: Shape, q, k, G, P, dO, *, interpret, dtype=F32):
    """scale · Pᵀ dO per chunk (``Shape.scaled``), [B,Tp,H,V] in ``dtype``; P as in
    ``output``. Grid (N, B·H, V/BV)."""
    C, prec, mode, BV, V = s.C, s.prec, s.mode, s.BV, s.V
    given_P = P is not None

    def kernel(*refs):
        if given_P:
            P_ref, dO_ref, out_ref = refs
            P = P_ref[...]
        else:
            q_ref, k_ref, G_ref, dO_ref, out_ref = split_refs(refs, mode, 3)
            _, P = qk_full(mode, q_ref, k_ref, G_ref, C, prec)
        out_ref[:, :] = s.scaled(dot(P, dO_ref[:, :].astype(F32), prec, ta=True)).astype(
            out_ref.dtype)

    tok_v, tok_k = s.chunk_tok_v(BV), s.chunk_tok3(s.K)
    if given_P:
        ins, in_specs = [P, dO], [s.chunk_mat3(C, C), tok_v]
    else:
        ins = [q, k] + ([] if mode == "none" else [G]) + [dO]
        in_specs = [tok_k] * 2 + ([] if mode == "none" else [s.chunk_gate3()]) + [tok_v]
    return launch.call(kernel, grid=(s.N, s.B * s.H, V // BV), in_specs=in_specs, out_specs=tok_v,
                 out_shape=s.sds_tok(V, dtype), interpret=interpret,
                 num_warps=s.warps("bwd_local"), name="rewy_bwd_local",
                 tile_axis=s.tile_axis(2))(*ins)
