"""Per-chunk gradients of the ReWY backward (DeltaNet, GDN): dq, dk, dv, dβ and the gate's dG.

Pipeline position:  state_backward.py (Λ, each chunk's end cotangent dS)  ->  **this kernel**
->  XLA (reverse cumsum of dG within each chunk gives dg).

One CTA (one warpgroup) per ``(b, h, chunk)``; every chunk is independent. With the chunk
start state S0 and end cotangent dS (both ``[V, K]``-transposed, input dtype), Λ from the
reverse pass, ``D = exp2(G_i − G_j)`` on ``j ≤ i``, γ = exp2(G), ``t = exp2(G_C − G)``:

    R     = Ag (V − Γ K S0)              Ag = T0 ⊙ D ⊙ β_j (recomputed: R never reached HBM)
    dT    = −(Λ Rᵀ)_{j < i}              dA = (dO Rᵀ)_{j ≤ i}       (ReWY: no inverse adjoint)
    dq    = scale·(Γ dO S0ᵀ + (dA ⊙ D) K)
    dk    = −βγ ⊙ Λ S0ᵀ + β ⊙ (dT ⊙ D) K + (dT ⊙ D)ᵀ (β K) + scale·(dA ⊙ D)ᵀ Q + t ⊙ R dSᵀ
    dv    = β ⊙ Λ
    dβ_r  = ⟨k_r, −γ_r (Λ S0ᵀ)_r + ((dT ⊙ D) K)_r⟩ + ⟨v_r, Λ_r⟩
    dG_r  = β_r ⟨k_r, −γ_r (Λ S0ᵀ)_r + ((dT ⊙ D) K)_r⟩ − ⟨k_r, (dk without its first two terms)_r⟩
            + ⟨q_r, dq_r⟩,   and the last row adds γ_C ⟨dS, S0⟩ + Σ_s t_s ⟨(R dSᵀ)_s, k_s⟩

The last row's two sums are left to XLA (a reduction to one scalar does not fit the per-row
register layout): the kernel writes their per-row parts ``u_s = t_s ⟨(R dSᵀ)_s, k_s⟩`` and
``sds_v = Σ_k S0ᵀ_vk dSᵀ_vk``.

(rewy-math §4–6: the scalar-gate reduction takes dG from the key-gradient products, so no
K Kᵀ Gram is recomputed for it.)

The seven-product form (``ChunkBackwardConfig.backward = "wy"``, the whole-width kernel only):
the standard WY backward's products in the same kernel, for the ablation against ReWY. With
A = T0 ⊙ D (the gated inverse, rewy-math §2; it replaces T0 in SMEM), Z = β V, Ē = βγ K,
P̃ = scale·(Q Kᵀ ⊙ D)_{j ≤ i} and K_tail = t ⊙ K (:func:`_wy_products`):

    dR    = P̃ᵀ dO + K_tail dS            (dU; the shared reverse pass emits Λ, not dR)
    dW    = −dR S0ᵀ
    dA    = dR Zᵀ + dW Ēᵀ                (the inverse's adjoint; β, βγ scale its columns)
    dT    = −(Aᵀ dA Aᵀ)_{j < i}          (in place of ReWY's −(Λ Rᵀ)_{j < i})
    dĒ    = Aᵀ dW + dT K̄                 (Aᵀ dW in place of ReWY's −Λ S0ᵀ)
    dZ    = Aᵀ dR = Λ                    (not formed again: the reverse state pass's Λ, shared
                                          with ReWY, gives dv and dβ's ⟨v, Λ⟩)

Everything after dT and dĒ's state part (dq, dk, dβ, dG, the Gram terms, R, dP = dO Rᵀ) is the
ReWY body's code, and the wy body stages its tiles in the ReWY kernel's SMEM buffers, so the
scratch is the same. Products per chunk (one WGMMA each, the sds diagonals aside): ReWY 11 in 6
round trips, wy 18 in 10 (docs/mosaic-gpu.md).

Two kernels (config.ChunkBackwardConfig.block): up to K = 128 (``block=None``) the whole-width
kernel :func:`chunk_backward` holds every operand whole in SMEM (``[64, K]`` tiles, S0ᵀ and dSᵀ
``[V, K]``): the program timed on the H100. At K = V = 256 that is 551,168 B of SMEM, so
``block=64`` selects :func:`_chunk_backward_blocked`, the same math over 64-column blocks:

    phase A, per value block jv:  dT += Λ_jv R_jvᵀ,  dA += dO_jv R_jvᵀ,  dv_jv = β Λ_jv
                                  (R = Ag (V − Γ K S0) as the forward stored it, config.Config.saves_r)
    phase B, per key block jk:    one pass over jv: dq_jk = Σ_jv dO_jv S0ᵀ[jv, jk],
                                  e_jk = Σ_jv Λ_jv S0ᵀ[jv, jk],  (R dSᵀ)_jk = Σ_jv R_jv dSᵀ[jv, jk]
                                  (and sds from the same tile pairs)       (then dq and dk out)
    the per-row sums (dβ, dG, u) add up over the key blocks in registers.

S0ᵀ and dSᵀ stream as ``[64, 64]`` tiles through two three-slot TMA rings, one load per tile
(phase B only: with R from the forward, phase A needs neither S0ᵀ nor k, so v shares k's buffer
and k is loaded after it). Every sum over tiles (:func:`_ring_products`) accumulates in place and is
pipelined: a tile's products are issued as soon as it arrives, and the warpgroup waits for the
previous tile's products (and frees their slots for the loads two ahead) only after that, so the
tensor cores are not left idle behind each load. The three accumulators of phase B
(96 registers a thread) are live together.
No tile wider than ``[64, 64]`` fp32 lives in registers.

``warpgroups=2`` (K ≤ 128) selects :func:`_chunk_backward_2wg`, the whole-width kernel split
over two warpgroups of one CTA (WG0: R, dT, dA, dq; WG1: dk, dv and the row sums; at most two
live fp32 ``[C, K]`` tiles in each instead of three): GDN's kernel at K = 128 (H100: 0.169 ms
against 0.213 at the anchor; DeltaNet keeps one warpgroup, 0.178 against 0.214;
``benchmarks/mosaic_kernels.py --parts`` times the other count beside the default).

Reads:  q, k [B, Tp, H, K]; v, do, lam [B, Tp, H, V]; states, dstates [B, H, N, V, K];
        t0 [B, H, Tp, C]; g2, beta [B, H, Tp] fp32.
Writes: dq, dk [B, Tp, H, K]; dv [B, Tp, H, V] (input dtype); dbeta [B, H, Tp] fp32; with a
        gate also dG, u [B, H, Tp] and sds [B, H, N, V] fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.common import (
    C, COLS, F32, ROWS, WGMMA, causal_decay, cols_of, finish_together, iota, key_block, mma,
    mma_group, mma_sum, rows_of, smem, stage)
from pallas_kernels.mosaic_gpu.config import BLOCKED_RING_SLOTS, ChunkBackwardConfig


def _out_types(k, v, gated: bool):
    """dq, dk [B, Tp, H, K], dv [B, Tp, H, V] (input dtype), dβ [B, H, Tp] fp32, and with a gate
    dG, u [B, H, Tp] and sds [B, H, N, V] fp32."""
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    per_token = jax.ShapeDtypeStruct((B, H, Tp), F32)
    out = (jax.ShapeDtypeStruct((B, Tp, H, K), k.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), k.dtype),
           jax.ShapeDtypeStruct((B, Tp, H, V), k.dtype), per_token)
    if gated:
        out += (per_token, per_token, jax.ShapeDtypeStruct((B, H, Tp // C, V), F32))
    return out


def _kernel_refs(refs, gated: bool):
    """Every per-chunk gradient kernel's refs in order: q, k, v, dO, Λ, S0ᵀ, dSᵀ, T0, β, g (None
    without a gate), then dq, dk, dv, dβ, dG, u, sds (the last three None without a gate)."""
    refs = list(refs)
    ins = [refs.pop(0) for _ in range(9)]
    g_ref = refs.pop(0) if gated else None
    outs = refs[:4] + (refs[4:] if gated else [None, None, None])
    return (*ins, g_ref, *outs)


def _send_row_vectors(per_token, per_chunk, b, h, n, rows, gated: bool) -> None:
    """The chunk's fp32 row vectors from SMEM to HBM, then waits for every store: dβ and, with a
    gate, dG and u (``per_token``: (SMEM, GMEM) pairs in that order; ``rows``: the chunk's
    token slice) and sds (``per_chunk``)."""
    for src, dst in per_token[:1] + (per_token[1:] if gated else ()):
        plgpu.copy_smem_to_gmem(src, dst.at[b, h, rows])
    if gated:
        plgpu.copy_smem_to_gmem(per_chunk[0], per_chunk[1].at[b, h, n])
    plgpu.wait_smem_to_gmem(0)


def _launch(body, out_type, scratch, grid, interpret, *args):
    """One CTA (one warpgroup) per ``(b, h, chunk)``."""
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=("b", "h", "n"),
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(*args)


def chunk_backward(q, k, v, do, lam, states, dstates, t0, g2, beta, *, scale: float,
                   cfg: ChunkBackwardConfig = ChunkBackwardConfig(), interpret=None, r=None):
    """``(dq, dk, dv, dbeta)`` and, with a gate, ``(dG, u, sds)``; see the module docstring.
    ``cfg.block`` 64 (K = 256) runs the blocked kernel, which reads each chunk's R ``r
    [B, Tp, H, V]`` as the forward stored it (config.Config.saves_r), ``None`` the whole-width one;
    ``cfg.backward`` "wy" the whole-width kernel's seven-product body (same operands, outputs);
    ``cfg.warpgroups`` 2 the whole-width ReWY math on two warpgroups (:func:`_chunk_backward_2wg`)."""
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    N = Tp // C
    dtype = k.dtype
    gated = g2 is not None

    if K != V:
        raise ValueError(f"chunk_backward needs K == V (dq reuses a [C, V] tile), got K={K}, V={V}")
    wy = cfg.backward == "wy"
    if cfg.warpgroups == 2:
        return _chunk_backward_2wg(q, k, v, do, lam, states, dstates, t0, g2, beta, scale=scale,
                                   interpret=interpret)
    if cfg.block is not None and cfg.block < K:
        if wy:
            raise ValueError("the blocked per-chunk gradient kernel (K = 256) has the ReWY backward "
                             "only; backward='wy' needs the whole-width kernel (K <= 128)")
        if r is None:
            raise ValueError("the blocked per-chunk gradient kernel reads R from the forward (r=None)")
        return _chunk_backward_blocked(q, k, v, r, do, lam, states, dstates, t0, g2, beta, scale=scale,
                                       bk=cfg.block, interpret=interpret)
    out_type = _out_types(k, v, gated)
    vec = plgpu.SMEM((C,), F32)
    scratch = dict(
        q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), v_s=smem((C, V), dtype),
        do_s=smem((C, V), dtype), lam_s=smem((C, V), dtype),
        s0_s=smem((V, K), dtype), ds_s=smem((V, K), dtype), t_s=smem((C, C), dtype),
        b_s=vec, g_s=vec, db_s=vec, dg_s=vec, u_s=vec, sds_s=plgpu.SMEM((V,), F32),
        w_st=smem((C, V), dtype), r_st=smem((C, V), dtype), cc_a=smem((C, C), dtype),
        cc_b=smem((C, C), dtype), bk_st=smem((C, K), dtype),
        # the inputs in three sets, each awaited before its first use: what R needs (k, S0ᵀ, v,
        # T0, β, G); Λ and dO (the ReWY products); q and dSᵀ
        bar=plgpu.Barrier(num_arrivals=5 + gated), bar_lo=plgpu.Barrier(num_arrivals=2),
        bar_q=plgpu.Barrier(num_arrivals=2),
    )

    def chunk_backward_body(
            *refs, q_s, k_s, v_s, do_s, lam_s, s0_s, ds_s, t_s, b_s, g_s, db_s, dg_s, u_s, sds_s, w_st, r_st,
            cc_a, cc_b, bk_st, bar, bar_lo, bar_q):
        (q_ref, k_ref, v_ref, do_ref, lam_ref, st_ref, dst_ref, t_ref, b_ref, g_ref,
         dq_ref, dk_ref, dv_ref, db_ref, dg_ref, u_ref, sds_ref) = _kernel_refs(refs, gated)
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        for src, dst, barrier in (
                (k_ref.at[b, rows, h], k_s, bar), (st_ref.at[b, h, n], s0_s, bar),
                (v_ref.at[b, rows, h], v_s, bar), (t_ref.at[b, h, rows], t_s, bar),
                (b_ref.at[b, h, rows], b_s, bar), *(((g_ref.at[b, h, rows], g_s, bar),) if gated else ()),
                (lam_ref.at[b, rows, h], lam_s, bar_lo), (do_ref.at[b, rows, h], do_s, bar_lo),
                (q_ref.at[b, rows, h], q_s, bar_q), (dst_ref.at[b, h, n], ds_s, bar_q)):
            plgpu.copy_gmem_to_smem(src, dst, barrier)
        plgpu.barrier_wait(bar)

        beta_r = plgpu.load(b_s, layout=ROWS)
        if gated:
            g_row = plgpu.load(g_s, layout=ROWS)
            g_last = g_s[C - 1]
            decay = causal_decay(g_row, plgpu.load(g_s, layout=COLS), strict=False)
            gam_r = jnp.exp2(g_row)
            tail_r = jnp.exp2(g_last - g_row)
        else:
            decay = causal_decay(None, None, strict=False)
        strict = iota((C, C), 0) > iota((C, C), 1)
        diag_mask = iota((C, C), 0) == iota((C, C), 1)

        # R = Ag (V − Γ K S0), recomputed from the saved chunk start state.
        ks0 = mma(k_s, s0_s.T, (C, V))
        if gated:
            ks0 = ks0 * rows_of(gam_r, (C, V))
        w = stage(w_st, plgpu.load(v_s, layout=WGMMA).astype(F32) - ks0)
        beta_c = plgpu.load(b_s, layout=COLS)
        # K and Q are read from SMEM where each use needs them (not held in registers across
        # the kernel: at K = 128 a [C, K] fp32 tile is 64 registers per thread).
        k_f = lambda: plgpu.load(k_s, layout=WGMMA).astype(F32)  # noqa: E731
        # Products are grouped so that each group costs one tensor-core round trip (this kernel
        # is latency-bound: one warpgroup per chunk). Signs ride on staged operands: the tiles
        # below hold −dT ⊙ D and −β K, so that every sum shares one accumulator; a negated
        # accumulator is never used (it gave zeros on sm_90 with jax 0.11.2 in jla's kernels).
        if wy:  # (its first product group reads q; its second dO and dSᵀ)
            plgpu.barrier_wait(bar_lo)
            plgpu.barrier_wait(bar_q)
            ndt_d, da_d = _wy_products(
                w, beta_c, decay, strict, scale, gated, k_f, tail_r if gated else None,
                q_s=q_s, k_s=k_s, v_s=v_s, do_s=do_s, s0_s=s0_s, ds_s=ds_s, t_s=t_s, g_s=g_s,
                w_st=w_st, r_st=r_st, cc_a=cc_a, cc_b=cc_b, bk_st=bk_st)
            r = r_st
            e_pair = (t_s.T, bk_st)  # Aᵀ (dR S0ᵀ) = −Aᵀ dW, the state part of −dĒ
            nbk = None  # −β K goes to bk_st once that product has read dR S0ᵀ there
        else:
            # Ag = T0 ⊙ D ⊙ β_j, the left operand of R = Ag W, from registers (never staged)
            ag = (plgpu.load(t_s, layout=WGMMA).astype(F32) * decay * cols_of(beta_c, (C, C))).astype(dtype)
            r = stage(r_st, mma(ag, w, (C, V)))
            # The three ReWY products (Λ = Aᵀ dR came from the reverse pass): Λ Rᵀ, Λ S0ᵀ, and dO Rᵀ.
            plgpu.barrier_wait(bar_lo)
            lr, dor = mma_group(((((lam_s, r.T),), (C, C)), (((do_s, r.T),), (C, C))))
            ndt_d = stage(cc_a, jnp.where(strict, lr, 0.0) * decay)  # −dT ⊙ D
            da_d = stage(cc_b, dor * (decay * scale))  # scale·(dA ⊙ D) (D is 0 above the diagonal)
            nbk = stage(bk_st, k_f() * rows_of(beta_r * -1.0, (C, K)))  # −β K
            e_pair = (lam_s, s0_s)  # Λ S0ᵀ, the state part of −dĒ
            plgpu.barrier_wait(bar_q)

        # dq = scale·Γ dO S0ᵀ + scale·(dA ⊙ D) K, and its gate term ⟨q, dq⟩.
        dos0, dak = mma_group(((((do_s, s0_s),), (C, K)), (((da_d, k_s),), (C, K))))
        dq = dos0 * (rows_of(gam_r * scale, (C, K)) if gated else scale) + dak
        dg = jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * dq, axis=1)
        w_st[...] = dq.astype(dtype)  # w is consumed: its tile carries dq out (K == V)
        # The erase-side terms e_r = −γ_r (Λ S0ᵀ)_r + ((dT ⊙ D) K)_r: dk = β e + ..., dβ = ⟨k, e⟩ + ⟨v, Λ⟩.
        if gated:
            ls0, ndtk = mma_group((((e_pair,), (C, K)), (((ndt_d, k_s),), (C, K))))
            e = (ls0 * rows_of(gam_r, (C, K)) + ndtk) * -1.0
        else:
            e = mma_sum((e_pair, (ndt_d, k_s)), (C, K)) * -1.0
        if nbk is None:  # wy: bk_st held dR S0ᵀ until the product above
            nbk = stage(bk_st, k_f() * rows_of(beta_r * -1.0, (C, K)))  # −β K
        ke = jnp.sum(k_f() * e, axis=1)
        lam_f = plgpu.load(lam_s, layout=WGMMA).astype(F32)
        db = ke + jnp.sum(plgpu.load(v_s, layout=WGMMA).astype(F32) * lam_f, axis=1)
        # The key-side terms dK̄/γ: (dT ⊙ D)ᵀ (β K) + scale·(dA ⊙ D)ᵀ Q + t ⊙ R dSᵀ.
        kbar_pairs = ((ndt_d.T, nbk), (da_d.T, q_s))
        if gated:
            kbar, rds = mma_group(((kbar_pairs, (C, K)), (((r, ds_s),), (C, K))))
            rds = rds * rows_of(tail_r, (C, K))  # t ⊙ R dSᵀ
            kbar = kbar + rds
        else:
            kbar = mma_sum(kbar_pairs + ((r, ds_s),), (C, K))
        dk = e * rows_of(beta_r, (C, K)) + kbar
        if gated:
            # dG_r = β_r ⟨k_r, e_r⟩ − ⟨k_r, kbar_r⟩ + ⟨q_r, dq_r⟩; the last row adds the state terms.
            k_now = k_f()
            dg_s[...] = dg + beta_r * ke - jnp.sum(k_now * kbar, axis=1)
            u_s[...] = jnp.sum(k_now * rds, axis=1)
            # sds_v = Σ_k S0ᵀ_vk dSᵀ_vk: the diagonal of S0ᵀ dS per 64-row strip, on the tensor
            # cores (two [V, K] fp32 tiles in registers would take 256 registers at K = 128).
            strips = [pl.ds(v0, C) for v0 in range(0, V, C)]
            diags = mma_group([(((s0_s.at[sl], ds_s.at[sl].T),), (C, C)) for sl in strips])
            for sl, d in zip(strips, diags):
                sds_s[sl] = jnp.sum(jnp.where(diag_mask, d, 0.0), axis=1)
        db_s[...] = db
        r_st[...] = dk.astype(dtype)
        v_s[...] = (lam_f * rows_of(beta_r, (C, V))).astype(dtype)  # dv = β Λ
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(w_st, dq_ref.at[b, rows, h])
        plgpu.copy_smem_to_gmem(r_st, dk_ref.at[b, rows, h])
        plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, h])
        _send_row_vectors(((db_s, db_ref), (dg_s, dg_ref), (u_s, u_ref)), (sds_s, sds_ref), b, h, n,
                          rows, gated)

    return _launch(chunk_backward_body, out_type, scratch, (B, H, N), interpret,
                   q, k, v, do, lam, states, dstates, t0, beta, *([g2] if gated else []))


def _wy_products(w, beta_c, decay, strict, scale, gated: bool, k_f, tail_r, *, q_s, k_s, v_s, do_s,
                 s0_s, ds_s, t_s, g_s, w_st, r_st, cc_a, cc_b, bk_st):
    """The chunk-local products of the seven-product (``backward="wy"``) body, up to −dT ⊙ D.

    In: ``w`` = W = V − Γ K S0 staged in ``w_st`` ``[C, V]``; ``beta_c`` (COLS), ``decay`` D and
    ``strict`` ``[C, C]`` registers; ``tail_r`` t (ROWS, None without a gate); the chunk's SMEM
    operands as in the kernel body. Out, in SMEM: ``cc_a`` −dT ⊙ D and ``cc_b`` scale·(dP ⊙ D)
    ``[C, C]`` (returned, as the ReWY body leaves them); R in ``r_st``, A = T0 ⊙ D in ``t_s``
    (T0 replaced), dR S0ᵀ = −dW in ``bk_st`` ``[C, K]`` (the kernel's e product reads the last
    two, Aᵀ (dR S0ᵀ) = −dĒ's state part); ``w_st`` holds dR, free once this returns.

    Every tile staged here is ``[C, C]`` or takes the place of one the ReWY body stages, so the
    scratch (SMEM) is the ReWY kernel's; no ``[C, K]`` fp32 tile lives across a product.
    """
    V, K = w_st.shape[-1], k_s.shape[-1]
    a_f = plgpu.load(t_s, layout=WGMMA).astype(F32) * decay  # A = T0 ⊙ D, the gated inverse
    # Ag = A diag(β): R = A (Z − Ē S0) = Ag W, Ag from registers
    ag = (a_f * cols_of(beta_c, (C, C))).astype(t_s.dtype)
    a = stage(t_s, a_f)
    # R and the query-key Gram (for P̃ of dR), one round trip.
    r, qk = mma_group(((((ag, w),), (C, V)), (((q_s, k_s.T),), (C, C))))
    r = stage(r_st, r)
    p = stage(cc_a, qk * (decay * scale))  # P̃ = scale·(Q Kᵀ ⊙ D), j ≤ i
    # dR = P̃ᵀ dO + K_tail dS: what the standard backward's state pass hands the WY products
    # (the shared reverse pass here emits Λ = Aᵀ dR instead, so the wy body forms dR again).
    kt = stage(bk_st, k_f() * rows_of(tail_r, (C, K))) if gated else k_s  # K_tail = t ⊙ K
    dr, dor = mma_group(((((p.T, do_s), (kt, ds_s.T)), (C, V)), (((do_s, r.T),), (C, C))))
    dr = stage(w_st, dr)  # W is done
    da_d = stage(cc_b, dor * (decay * scale))  # scale·(dP ⊙ D), dP = dO Rᵀ (as in ReWY)
    dws0 = stage(bk_st, mma(dr, s0_s, (C, K)))  # dR S0ᵀ = −dW
    # The inverse's adjoint dA = dR Zᵀ + dW Ēᵀ, Z = diag(β) V and Ē = diag(β γ) K: the diagonal
    # factors scale dA's columns, so the products read V and K as they are in SMEM.
    drv, dwk = mma_group(((((dr, v_s.T),), (C, C)), (((dws0, k_s.T),), (C, C))))
    if gated:
        gam_c = jnp.exp2(plgpu.load(g_s, layout=COLS))
        da = drv * cols_of(beta_c, (C, C)) + dwk * cols_of(beta_c * gam_c * -1.0, (C, C))
    else:
        da = (drv + dwk * -1.0) * cols_of(beta_c, (C, C))
    da = stage(cc_a, da)  # P̃ is done
    # dT = −tril(Aᵀ dA Aᵀ, −1): two dependent [C, C] products.
    ada = stage(cc_a, mma(a.T, da, (C, C)))
    ndt = mma(ada, a.T, (C, C))
    return stage(cc_a, jnp.where(strict, ndt, 0.0) * decay), da_d  # −dT ⊙ D


class _TileRing:
    """TMA ring over a static sequence of uses of ``[bk, bk]`` tiles of one ``[V, K]`` matrix
    (``src``: its GMEM view; ``buf [slots, bk, bk]`` SMEM, ``bars`` one barrier per slot).

    ``uses``: tile keys ``(jv, jk)`` in the order the kernel reads them; consecutive equal keys
    share one load (the tile stays in its slot). Loads go ``slots`` ahead: the slot of a load is
    refilled once its last use is released. One warpgroup both issues and consumes, so every
    step is unrolled at trace time and the barrier phases follow the load order.
    """

    def __init__(self, buf, bars, src, uses, bk: int):
        self.buf, self.bars, self.src, self.bk = buf, bars, src, bk
        self.loads, self.load_of = [], []
        for key in uses:
            if not self.loads or self.loads[-1] != key:
                self.loads.append(key)
            self.load_of.append(len(self.loads) - 1)
        self.slots = buf.shape[0]
        self.waited = -1

    @staticmethod
    def n_loads(uses) -> int:
        return sum(1 for i, key in enumerate(uses) if i == 0 or uses[i - 1] != key)

    def _issue(self, li: int):
        jv, jk = self.loads[li]
        bk = self.bk
        src = self.src.at[pl.ds(jv * bk, bk), pl.ds(jk * bk, bk)]
        slot = li % self.slots
        plgpu.copy_gmem_to_smem(src, self.buf.at[slot], self.bars.at[slot])

    def start(self):
        for li in range(min(self.slots, len(self.loads))):
            self._issue(li)

    def get(self, u: int):
        li = self.load_of[u]
        if li > self.waited:
            plgpu.barrier_wait(self.bars.at[li % self.slots])
            self.waited = li
        return self.buf.at[li % self.slots]

    def release(self, u: int):
        li = self.load_of[u]
        last_use = u + 1 == len(self.load_of) or self.load_of[u + 1] != li
        if last_use and li + self.slots < len(self.loads):
            plgpu.commit_smem()  # every thread has read the tile before TMA overwrites its slot
            self._issue(li + self.slots)


def _ring_products(specs, starts, n: int, shape, between=None):
    """Sums over ``n`` consecutive uses of tile rings, one fp32 accumulator per spec, pipelined.

    ``specs``: ``(ring, pairs_of)`` with ``pairs_of(tile, i)`` the ``(a, b)`` operand pairs of
    step ``i`` (``tile``: that spec's ring tile at use ``start + i``); ``starts``: each spec's
    first use (specs on one ring at the same use share its tile). Step i's products are issued
    as soon as its tiles have arrived and accumulate in place; only then does the warpgroup wait
    for step i − 1's products and release their tiles, so the tensor cores run one step's
    products while the next step's tiles are awaited and the freed slots refill. ``between``
    (optional): ``between(tiles)`` after step i's products are issued, with the step's tiles
    (reads only); its results are returned per step. Returns ``(sums, between_results)``.
    """
    if isinstance(starts, int):
        starts = (starts,) * len(specs)

    def uses(i):  # each (ring, use) of step i once
        seen = {}
        for (ring, _), u0 in zip(specs, starts):
            seen[(id(ring), u0 + i)] = (ring, u0 + i)
        return list(seen.values())

    def body(*accs):
        extra = []
        for i in range(n):
            tiles = [ring.get(u0 + i) for (ring, _), u0 in zip(specs, starts)]
            issued = 0
            for acc, (_, pairs_of), tile in zip(accs, specs, tiles):
                for a, b in pairs_of(tile, i):
                    plgpu.wgmma(acc, a, b)
                    issued += 1
            if between is not None:
                extra.append(between(tiles))
            if i:
                plgpu.wgmma_wait(issued)  # step i − 1's products have read their tiles
                for ring, u in uses(i - 1):
                    ring.release(u)
        plgpu.wgmma_wait(0)
        for ring, u in uses(n - 1):
            ring.release(u)
        return tuple(acc[...] for acc in accs), tuple(extra)

    return lax.optimization_barrier(pl.run_scoped(body, *(plgpu.ACC(shape, F32) for _ in specs)))


def _chunk_backward_blocked(q, k, v, r, do, lam, states, dstates, t0, g2, beta, *, scale: float, bk: int,
                            interpret=None):
    """:func:`chunk_backward` over ``bk``-column blocks (the module docstring's phases A and B);
    same operands and outputs, and each chunk's R ``r [B, Tp, H, V]`` from the forward. ``K = V``
    a multiple of ``bk``."""
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    N = Tp // C
    dtype = k.dtype
    gated = g2 is not None
    if K % bk:
        raise ValueError(f"K={K} is not a multiple of the block {bk}")
    nb = K // bk
    rev = list(reversed(range(nb)))
    # Uses of the S0ᵀ and dSᵀ tiles: phase B only, by key block (jv descending inside).
    s0_uses = [(jv, jk) for jk in rev for jv in rev]
    ds_uses = list(s0_uses)
    s0_slots = min(BLOCKED_RING_SLOTS, _TileRing.n_loads(s0_uses))
    ds_slots = min(BLOCKED_RING_SLOTS, _TileRing.n_loads(ds_uses))

    out_type = _out_types(k, v, gated)
    vec = plgpu.SMEM((C,), F32)
    scratch = dict(
        k_s=smem((C, K), dtype), vr_s=smem((C, V), dtype), do_s=smem((C, V), dtype),
        lam_s=smem((C, V), dtype), t_s=smem((C, C), dtype), da_s=smem((C, C), dtype),
        w_st=smem((C, bk), dtype), q_st=smem((C, bk), dtype), bk_st=smem((C, bk), dtype),
        s0_t=smem((s0_slots, bk, bk), dtype), ds_t=smem((ds_slots, bk, bk), dtype),
        b_s=vec, g_s=vec, db_s=vec, dg_s=vec, u_s=vec, sds_s=plgpu.SMEM((V,), F32),
        bar=plgpu.Barrier(num_arrivals=5 + gated), q_bar=plgpu.Barrier(), k_bar=plgpu.Barrier(),
        s0_bar=plgpu.Barrier(num_barriers=s0_slots), ds_bar=plgpu.Barrier(num_barriers=ds_slots),
    )

    def chunk_backward_blocked_body(
            *refs, k_s, vr_s, do_s, lam_s, t_s, da_s, w_st, q_st, bk_st, s0_t, ds_t, b_s, g_s, db_s,
            dg_s, u_s, sds_s, bar, q_bar, k_bar, s0_bar, ds_bar):
        refs = list(refs)
        r_ref = refs.pop(9 + gated)  # after the inputs of _kernel_refs
        (q_ref, k_ref, v_ref, do_ref, lam_ref, st_ref, dst_ref, t_ref, b_ref, g_ref,
         dq_ref, dk_ref, dv_ref, db_ref, dg_ref, u_ref, sds_ref) = _kernel_refs(refs, gated)
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        # v goes into k's buffer: phase A reads v (for ⟨v, Λ⟩) and no k, phase B k and no v. T0 is
        # not read (R comes from the forward); its buffer stages dT ⊙ D.
        for src, dst in ((v_ref.at[b, rows, h], k_s), (r_ref.at[b, rows, h], vr_s),
                         (do_ref.at[b, rows, h], do_s), (lam_ref.at[b, rows, h], lam_s),
                         (b_ref.at[b, h, rows], b_s)) + (
                             ((g_ref.at[b, h, rows], g_s),) if gated else ()):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        s0_ring = _TileRing(s0_t, s0_bar, st_ref.at[b, h, n], s0_uses, bk)
        ds_ring = _TileRing(ds_t, ds_bar, dst_ref.at[b, h, n], ds_uses, bk)
        s0_ring.start()
        ds_ring.start()
        q_rows = q_ref.at[b, rows, h]
        # q of phase B's first key block (its dq and dk read it; it has all of phase A to arrive)
        plgpu.copy_gmem_to_smem(key_block(q_rows, rev[0], bk), q_st, q_bar)
        plgpu.barrier_wait(bar)

        beta_r = plgpu.load(b_s, layout=ROWS)
        if gated:
            g_row = plgpu.load(g_s, layout=ROWS)
            g_last = g_s[C - 1]
            gam_r = jnp.exp2(g_row)
            tail_r = jnp.exp2(g_last - g_row)

        # Phase A, per value block: the ReWY Gram terms' V-sums Λ Rᵀ and dO Rᵀ from the forward's
        # R, dv = β Λ and dβ's ⟨v, Λ⟩. Signs are applied as a product with −1, never as a negated
        # accumulator (which gave zeros on sm_90 with jax 0.11.2 in jla's kernels).
        dt = da = db = None
        for jv in range(nb):
            r_blk, lam_blk = key_block(vr_s, jv, bk), key_block(lam_s, jv, bk)
            v_f = plgpu.load(key_block(k_s, jv, bk), layout=WGMMA).astype(F32)
            lam_f = plgpu.load(lam_blk, layout=WGMMA).astype(F32)
            part = jnp.sum(v_f * lam_f, axis=1)  # ⟨v, Λ⟩ of dβ
            db = part if db is None else db + part
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous block's dv store read bk_st

            def dv_out(lam_f=lam_f, jv=jv):  # dv = β Λ, stored while the products run
                stage(bk_st, lam_f * rows_of(beta_r, (C, bk)))
                plgpu.copy_smem_to_gmem(bk_st, key_block(dv_ref.at[b, rows, h], jv, bk))

            lr, dor = mma_group(((((lam_blk, r_blk.T),), (C, C)),  # Λ Rᵀ and dO Rᵀ: one round trip
                                 (((key_block(do_s, jv, bk), r_blk.T),), (C, C))), between=dv_out)
            dt, da = (lr, dor) if dt is None else (dt + lr, da + dor)
        # k replaces v in its buffer (every thread read its v blocks before stage()'s fence above);
        # phase B first reads it after its first key block's ring products
        plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_s, k_bar)
        # D after phase A (not one more [C, C] fp32 tile beside its accumulators)
        decay = (causal_decay(g_row, plgpu.load(g_s, layout=COLS), strict=False) if gated
                 else causal_decay(None, None, strict=False))
        strict = iota((C, C), 0) > iota((C, C), 1)
        dt_d = stage(t_s, jnp.where(strict, dt * -1.0, 0.0) * decay)  # dT ⊙ D (T0 is not read)
        da_d = stage(da_s, da * (decay * scale))  # scale·(dA ⊙ D) (D is 0 above the diagonal)

        # Phase B, per key block: dq, dk and the per-row gate and β sums. One pass over the value
        # blocks per key block forms dq's Σ dO S0ᵀ, e's Σ Λ S0ᵀ and Σ R dSᵀ (each S0ᵀ tile loaded
        # once for two products), and sds = Σ_k S0ᵀ ⊙ dSᵀ per value row while they run.
        dg = u_acc = None
        sds = [None] * nb
        sds_part = lambda s0_tile, ds_tile: jnp.sum(  # noqa: E731
            plgpu.load(s0_tile, layout=WGMMA).astype(F32) * plgpu.load(ds_tile, layout=WGMMA).astype(F32), axis=1)
        use = d = 0  # the next use of the S0ᵀ and dSᵀ rings
        for m, jk in enumerate(rev):
            k_blk = key_block(k_s, jk, bk)
            (dq, e, rds), parts = _ring_products(
                ((s0_ring, lambda t, i: ((key_block(do_s, rev[i], bk), t),)),      # dO S0ᵀ
                 (s0_ring, lambda t, i: ((key_block(lam_s, rev[i], bk), t),)),     # Λ S0ᵀ
                 (ds_ring, lambda t, i: ((key_block(vr_s, rev[i], bk), t),))),     # R dSᵀ
                (use, use, d), nb, (C, bk),
                between=(lambda tiles: sds_part(tiles[0], tiles[2])) if gated else None)
            use += nb
            d += nb
            if gated:
                for i, jv in enumerate(rev):
                    sds[jv] = parts[i] if sds[jv] is None else sds[jv] + parts[i]
            # dq = scale·Γ dO S0ᵀ + scale·(dA ⊙ D) K and its gate term ⟨q, dq⟩; e's (dT ⊙ D) K
            # in the same round trip
            if m == 0:
                plgpu.barrier_wait(k_bar)
            dak, dtk = mma_group(((((da_d, k_blk),), (C, bk)), (((dt_d, k_blk),), (C, bk))))
            dq = dq * (rows_of(gam_r * scale, (C, bk)) if gated else scale) + dak
            plgpu.barrier_wait(q_bar)
            if gated:
                part = jnp.sum(plgpu.load(q_st, layout=WGMMA).astype(F32) * dq, axis=1)
                dg = part if dg is None else dg + part
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous dq, dk, dv stores have read
            stage(w_st, dq)
            plgpu.copy_smem_to_gmem(w_st, key_block(dq_ref.at[b, rows, h], jk, bk))
            # The erase-side terms e = −γ Λ S0ᵀ + (dT ⊙ D) K (dk = β e + ..., dβ = ⟨k, e⟩ + ⟨v, Λ⟩).
            e = e * (rows_of(gam_r * -1.0, (C, bk)) if gated else -1.0) + dtk
            k_f = plgpu.load(k_blk, layout=WGMMA).astype(F32)
            ke = jnp.sum(k_f * e, axis=1)
            db = db + ke
            # The key-side terms dK̄/γ: t ⊙ R dSᵀ + (dT ⊙ D)ᵀ (β K) + scale·(dA ⊙ D)ᵀ Q.
            kbar = rds * rows_of(tail_r, (C, bk)) if gated else rds
            if gated:
                part = jnp.sum(k_f * kbar, axis=1)
                u_acc = part if u_acc is None else u_acc + part
            kbar = kbar + mma_sum(((dt_d.T, stage(bk_st, k_f * rows_of(beta_r, (C, bk)))), (da_d.T, q_st)), (C, bk))
            dk = e * rows_of(beta_r, (C, bk)) + kbar
            if gated:
                # dG_r = β_r ⟨k_r, e_r⟩ − ⟨k_r, kbar_r⟩ + ⟨q_r, dq_r⟩; the last row adds the state terms.
                dg = dg + beta_r * ke - jnp.sum(k_f * kbar, axis=1)
            stage(bk_st, dk)
            plgpu.copy_smem_to_gmem(bk_st, key_block(dk_ref.at[b, rows, h], jk, bk))
            if m + 1 < nb:  # the next key block's q: q_st's last readers (the (dA ⊙ D)ᵀ Q product,
                # the ⟨q, dq⟩ loads) finished before stage()'s fence above
                plgpu.copy_gmem_to_smem(key_block(q_rows, rev[m + 1], bk), q_st, q_bar)
        db_s[...] = db
        if gated:
            dg_s[...] = dg
            u_s[...] = u_acc
            for jv in range(nb):
                sds_s[pl.ds(jv * bk, bk)] = sds[jv]
        plgpu.commit_smem()
        _send_row_vectors(((db_s, db_ref), (dg_s, dg_ref), (u_s, u_ref)), (sds_s, sds_ref), b, h, n,
                          rows, gated)

    return _launch(chunk_backward_blocked_body, out_type, scratch, (B, H, N), interpret,
                   q, k, v, do, lam, states, dstates, t0, beta, *([g2] if gated else []), r)


def _chunk_backward_2wg(q, k, v, do, lam, states, dstates, t0, g2, beta, *, scale: float,
                        interpret=None):
    """:func:`chunk_backward`'s whole-width kernel (K = V ≤ 128) on two warpgroups of one CTA;
    same operands, outputs and rounding steps (every product, staged operand and fp32 sum of the
    one-warpgroup kernel, the row sums only reassociated). One CTA per ``(b, h, chunk)``, 256
    threads.

    Why: the one-warpgroup kernel keeps up to three fp32 ``[C, K]`` tiles live beside its row
    sums (at K = 128 a tile is 64 registers a thread: ptxas reported 255 registers and, for GDN,
    252 bytes of spills on the H100), and as the only warpgroup of its SM (its SMEM allows one
    CTA) it waits out every tensor-core round trip alone. Here each warpgroup holds at most two
    such tiles, and the work of dk that does not need R overlaps the chain that forms R. The
    inputs land in four groups (barriers), in the order of first use, so that each warpgroup
    starts before all ~150 KB (K = 128) have arrived: k, S0ᵀ, β, g | v, T0 | Λ, dO | dSᵀ, q.

    WG0 (the chain: R, dT, dA, dq; it also issues the TMA loads):
        R = Ag (V − Γ K S0)                   (Ag from registers)        -> R staged, ``r_ready``
        Λ Rᵀ, dO Rᵀ                           (one round trip)
        −dT ⊙ D and scale·(dA ⊙ D) staged                                 -> ``cc_ready``
        dq = scale·Γ dO S0ᵀ + (dA ⊙ D) K      (two accumulators, one round trip)
        ⟨q, dq⟩ (fp32 row vector) to SMEM                                 -> ``rows_ready`` (GDN)
    WG1 (dk, dv and the row sums):
        before R:      −βK staged; ⟨v, Λ⟩; e0 = −γ Λ S0ᵀ; (GDN) sds, the diagonals of the
                       S0ᵀ dS strips (one round trip)
        after R:       acc = β e0 + t ⊙ R dSᵀ,  u = ⟨k, t ⊙ R dSᵀ⟩;  dv = β Λ into V's buffer
                       (WG0 read V before it staged R)
        after dT, dA:  e1 = (dT ⊙ D) K,  acc += β e1;   dK̄' = (dT ⊙ D)ᵀ βK + scale·(dA ⊙ D)ᵀ Q
                       dk = acc + dK̄' (= β e + dK̄, e = e0 + e1, dK̄ = dK̄' + t ⊙ R dSᵀ)
        dβ = ⟨k, e0⟩ + ⟨k, e1⟩ + ⟨v, Λ⟩;   dG = ⟨q, dq⟩ + β⟨k, e⟩ − u − ⟨k, dK̄'⟩

    Live fp32 registers a thread at K = 128 (a ``[C, K]`` tile 64, a ``[C, C]`` tile 32), counted
    from the live tiles, not from a compiled kernel: WG0 ≤ 128 (K S0 beside the loaded V; Λ Rᵀ,
    dO Rᵀ and D; dq's two accumulators), WG1 ≤ 128 (one held tile, e0 or acc, beside one fresh
    accumulator or the two [C, C] sds diagonals), against ≈ 192 in
    the one-warpgroup kernel (e and its two fresh accumulators). At K = 64 half. No
    set_max_registers: with 256 threads each may use 255.

    SMEM (config.chunk_backward_smem_bytes(K, itemsize, warpgroups=2)): the one-warpgroup
    kernel's buffers (q, k, v (then dv), dO, Λ, W (then dq), R, −βK (then dk) ``[C, K]``; S0ᵀ,
    dSᵀ ``[V, K]``; T0 (then Ag), −dT ⊙ D, dA ⊙ D ``[C, C]``) and six fp32 row vectors plus sds:
    223,232 B at K = 128 (bf16), 108,288 B at K = 64. Only V's buffer is written by one
    warpgroup after the other read it (ordered by ``r_ready``); every other hand-over is one
    write, then a barrier, then reads.
    """
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    N = Tp // C
    dtype = k.dtype
    gated = g2 is not None
    if K > 128:
        raise ValueError(f"the two-warpgroup chunk backward is whole-width (K ≤ 128), got K={K}")

    out_type = _out_types(k, v, gated)
    vec = plgpu.SMEM((C,), F32)
    scratch = dict(
        q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), v_s=smem((C, V), dtype),
        do_s=smem((C, V), dtype), lam_s=smem((C, V), dtype),
        s0_s=smem((V, K), dtype), ds_s=smem((V, K), dtype), t_s=smem((C, C), dtype),
        b_s=vec, g_s=vec, db_s=vec, dg_s=vec, u_s=vec, qdq_s=vec, sds_s=plgpu.SMEM((V,), F32),
        w_st=smem((C, V), dtype), r_st=smem((C, V), dtype), cc_a=smem((C, C), dtype),
        cc_b=smem((C, C), dtype), bk_st=smem((C, K), dtype),
        # The inputs arrive in four groups, in the order of first use, so that work starts
        # before the CTA's ~150 KB of inputs have all landed: k, S0ᵀ, β, g (K S0; −βK); v, T0
        # (the rest of R); Λ, dO (Λ S0ᵀ, the Gram products); dSᵀ, q.
        bar_k=plgpu.Barrier(num_arrivals=3 + gated), bar_v=plgpu.Barrier(num_arrivals=2),
        bar_l=plgpu.Barrier(num_arrivals=2), bar_b=plgpu.Barrier(num_arrivals=2),
        r_ready=plgpu.Barrier(), cc_ready=plgpu.Barrier(), rows_ready=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=2),
    )

    def chunk_backward_2wg_body(
            *refs, q_s, k_s, v_s, do_s, lam_s, s0_s, ds_s, t_s, b_s, g_s, db_s, dg_s, u_s, qdq_s, sds_s,
            w_st, r_st, cc_a, cc_b, bk_st, bar_k, bar_v, bar_l, bar_b, r_ready, cc_ready, rows_ready, done):
        (q_ref, k_ref, v_ref, do_ref, lam_ref, st_ref, dst_ref, t_ref, b_ref, g_ref,
         dq_ref, dk_ref, dv_ref, db_ref, dg_ref, u_ref, sds_ref) = _kernel_refs(refs, gated)
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        wg = lax.axis_index("wg")

        def row_vectors():
            """β, and with a gate G, γ = exp2(G), t = exp2(G_C − G), in ROWS."""
            beta_r = plgpu.load(b_s, layout=ROWS)
            if not gated:
                return beta_r, None, None, None
            g_row = plgpu.load(g_s, layout=ROWS)
            return beta_r, g_row, jnp.exp2(g_row), jnp.exp2(g_s[C - 1] - g_row)

        # D is formed where it is used (for Ag, then for dT ⊙ D and dA ⊙ D), not held across
        # the products between: one [C, C] fp32 tile, 32 registers.
        decay_tile = lambda g_row: (causal_decay(g_row, plgpu.load(g_s, layout=COLS), strict=False)  # noqa: E731
                                    if gated else causal_decay(None, None, strict=False))
        # K (and Q) are read from SMEM where each use needs them, not held in registers.
        k_f = lambda: plgpu.load(k_s, layout=WGMMA).astype(F32)  # noqa: E731

        @pl.when(wg == 0)
        def _chain():
            groups = ((bar_k, ((k_ref.at[b, rows, h], k_s), (st_ref.at[b, h, n], s0_s),
                               (b_ref.at[b, h, rows], b_s))
                       + (((g_ref.at[b, h, rows], g_s),) if gated else ())),
                      (bar_v, ((v_ref.at[b, rows, h], v_s), (t_ref.at[b, h, rows], t_s))),
                      (bar_l, ((lam_ref.at[b, rows, h], lam_s), (do_ref.at[b, rows, h], do_s))),
                      (bar_b, ((dst_ref.at[b, h, n], ds_s), (q_ref.at[b, rows, h], q_s))))
            for bar, copies in groups:
                for src, dst in copies:
                    plgpu.copy_gmem_to_smem(src, dst, bar)
            plgpu.barrier_wait(bar_k)
            _, g_row, gam_r, _ = row_vectors()

            # R = Ag (V − Γ K S0), recomputed from the saved chunk start state.
            ks0 = mma(k_s, s0_s.T, (C, V))
            if gated:
                ks0 = ks0 * rows_of(gam_r, (C, V))
            plgpu.barrier_wait(bar_v)
            w = stage(w_st, plgpu.load(v_s, layout=WGMMA).astype(F32) - ks0)
            beta_c = plgpu.load(b_s, layout=COLS)
            ag = (plgpu.load(t_s, layout=WGMMA).astype(F32) * decay_tile(g_row)
                  * cols_of(beta_c, (C, C))).astype(dtype)  # R's left operand, from registers
            r = stage(r_st, mma(ag, w, (C, V)))
            plgpu.barrier_arrive(r_ready)  # R is in SMEM, and V has been read (WG1 writes dv there)

            # Λ Rᵀ and dO Rᵀ in one round trip. The staged tiles hold −dT ⊙ D (the sign rides on
            # the operand: a negated accumulator gave zeros on sm_90 with jax 0.11.2 in jla's
            # kernels) and scale·(dA ⊙ D).
            plgpu.barrier_wait(bar_l)
            lr, dor = mma_group(((((lam_s, r.T),), (C, C)), (((do_s, r.T),), (C, C))))
            decay = decay_tile(g_row)
            strict = iota((C, C), 0) > iota((C, C), 1)
            cc_a[...] = (jnp.where(strict, lr, 0.0) * decay).astype(dtype)  # −dT ⊙ D
            cc_b[...] = (dor * (decay * scale)).astype(dtype)  # D is 0 above the diagonal
            plgpu.commit_smem()
            plgpu.barrier_arrive(cc_ready)

            # dq = scale·Γ dO S0ᵀ + scale·(dA ⊙ D) K (the Γ scaling keeps two accumulators), and
            # its gate term ⟨q, dq⟩ for WG1's dG.
            dos0, dak = mma_group(((((do_s, s0_s),), (C, K)), (((cc_b, k_s),), (C, K))))
            dq = dos0 * (rows_of(gam_r * scale, (C, K)) if gated else scale) + dak
            if gated:
                plgpu.barrier_wait(bar_b)  # q
                qdq_s[...] = jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * dq, axis=1)
            w_st[...] = dq.astype(dtype)  # W is consumed: its tile carries dq out (K == V)
            plgpu.commit_smem()
            if gated:
                plgpu.barrier_arrive(rows_ready)
            plgpu.copy_smem_to_gmem(w_st, dq_ref.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _keys():
            plgpu.barrier_wait(bar_k)
            beta_r, _, gam_r, tail_r = row_vectors()
            nbk = stage(bk_st, k_f() * rows_of(beta_r * -1.0, (C, K)))  # −β K
            plgpu.barrier_wait(bar_v)
            plgpu.barrier_wait(bar_l)
            # ⟨v, Λ⟩ of dβ, before any tile is held (V and Λ are loaded whole for it)
            v_lam = jnp.sum(plgpu.load(v_s, layout=WGMMA).astype(F32)
                            * plgpu.load(lam_s, layout=WGMMA).astype(F32), axis=1)
            # The erase-side terms e = e0 + e1, e0 = −γ Λ S0ᵀ, e1 = (dT ⊙ D) K:
            # dk = β e + dK̄, dβ = ⟨k, e⟩ + ⟨v, Λ⟩.
            e0 = mma(lam_s, s0_s, (C, K)) * (rows_of(gam_r * -1.0, (C, K)) if gated else -1.0)
            ke = jnp.sum(k_f() * e0, axis=1)
            plgpu.barrier_wait(bar_b)
            if gated:
                # sds_v = Σ_k S0ᵀ_vk dSᵀ_vk: the diagonal of S0ᵀ dS per 64-row strip, on the
                # tensor cores (two [V, K] fp32 tiles in registers would take 256 registers), in
                # one round trip while WG0 still forms R.
                strips = [pl.ds(v0, C) for v0 in range(0, V, C)]
                diags = mma_group([(((s0_s.at[sl], ds_s.at[sl].T),), (C, C)) for sl in strips])
                diag_mask = iota((C, C), 0) == iota((C, C), 1)
                for sl, d in zip(strips, diags):
                    sds_s[sl] = jnp.sum(jnp.where(diag_mask, d, 0.0), axis=1)

            plgpu.barrier_wait(r_ready)
            rds = mma(r_st, ds_s, (C, K))
            if gated:
                rds = rds * rows_of(tail_r, (C, K))  # t ⊙ R dSᵀ
                u = jnp.sum(k_f() * rds, axis=1)
            acc = e0 * rows_of(beta_r, (C, K)) + rds
            v_s[...] = (plgpu.load(lam_s, layout=WGMMA).astype(F32) * rows_of(beta_r, (C, V))).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(v_s, dv_ref.at[b, rows, h])  # dv = β Λ

            plgpu.barrier_wait(cc_ready)
            e1 = mma(cc_a, k_s, (C, K)) * -1.0
            ke = ke + jnp.sum(k_f() * e1, axis=1)
            acc = acc + e1 * rows_of(beta_r, (C, K))
            # dK̄' = (dT ⊙ D)ᵀ (β K) + scale·(dA ⊙ D)ᵀ Q (the signs of −dT ⊙ D and −βK cancel).
            kbar = mma_sum(((cc_a.T, nbk), (cc_b.T, q_s)), (C, K))
            if gated:
                k_kbar = jnp.sum(k_f() * kbar, axis=1)
            bk_st[...] = (acc + kbar).astype(dtype)  # dk; −β K was consumed by the product above
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(bk_st, dk_ref.at[b, rows, h])
            db_s[...] = ke + v_lam
            if gated:
                # dG_r = ⟨q_r, dq_r⟩ + β_r ⟨k_r, e_r⟩ − ⟨k_r, dK̄_r⟩; the last row adds the state
                # terms (from u and sds, in XLA).
                plgpu.barrier_wait(rows_ready)
                dg_s[...] = plgpu.load(qdq_s, layout=ROWS) + beta_r * ke - (u + k_kbar)
                u_s[...] = u
            plgpu.commit_smem()
            _send_row_vectors(((db_s, db_ref), (dg_s, dg_ref), (u_s, u_ref)), (sds_s, sds_ref), b, h, n,
                              rows, gated)

        finish_together(done)

    return plgpu.kernel(
        chunk_backward_2wg_body, out_type=out_type, scratch_types=scratch,
        grid=(B, H, N), grid_names=("b", "h", "n"),
        num_threads=2, thread_name="wg", compiler_params=compat.compiler_params(), interpret=interpret,
    )(q, k, v, do, lam, states, dstates, t0, beta, *([g2] if gated else []))
