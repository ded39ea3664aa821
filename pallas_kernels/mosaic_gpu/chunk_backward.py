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
    C, COLS, F32, ROWS, WGMMA, causal_decay, cols_of, iota, mma, mma_group, mma_sum, rows_of,
    smem, stage)


def chunk_backward(q, k, v, do, lam, states, dstates, t0, g2, beta, *, scale: float, interpret=None):
    """``(dq, dk, dv, dbeta)`` and, with a gate, ``(dG, u, sds)``; see the module docstring."""
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    N = Tp // C
    dtype = k.dtype
    gated = g2 is not None

    if K != V:
        raise ValueError(f"chunk_backward needs K == V (dq reuses a [C, V] tile), got K={K}, V={V}")
    per_token = jax.ShapeDtypeStruct((B, H, Tp), F32)
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), dtype), jax.ShapeDtypeStruct((B, Tp, H, K), dtype),
                jax.ShapeDtypeStruct((B, Tp, H, V), dtype), per_token)
    if gated:
        out_type += (per_token, per_token, jax.ShapeDtypeStruct((B, H, N, V), F32))
    vec = plgpu.SMEM((C,), F32)
    scratch = dict(
        q_s=smem((C, K), dtype), k_s=smem((C, K), dtype), v_s=smem((C, V), dtype),
        do_s=smem((C, V), dtype), lam_s=smem((C, V), dtype),
        s0_s=smem((V, K), dtype), ds_s=smem((V, K), dtype), t_s=smem((C, C), dtype),
        b_s=vec, g_s=vec, db_s=vec, dg_s=vec, u_s=vec, sds_s=plgpu.SMEM((V,), F32),
        w_st=smem((C, V), dtype), r_st=smem((C, V), dtype), cc_a=smem((C, C), dtype),
        cc_b=smem((C, C), dtype), bk_st=smem((C, K), dtype),
        bar=plgpu.Barrier(num_arrivals=9 + gated),
    )

    def body(*refs, q_s, k_s, v_s, do_s, lam_s, s0_s, ds_s, t_s, b_s, g_s, db_s, dg_s, u_s, sds_s,
             w_st, r_st, cc_a, cc_b, bk_st, bar):
        refs = list(refs)
        q_ref, k_ref, v_ref, do_ref, lam_ref, st_ref, dst_ref, t_ref, b_ref = (refs.pop(0) for _ in range(9))
        g_ref = refs.pop(0) if gated else None
        dq_ref, dk_ref, dv_ref, db_ref = refs[:4]
        dg_ref, u_ref, sds_ref = refs[4:] if gated else (None, None, None)
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        for src, dst in ((q_ref.at[b, rows, h], q_s), (k_ref.at[b, rows, h], k_s),
                         (v_ref.at[b, rows, h], v_s), (do_ref.at[b, rows, h], do_s),
                         (lam_ref.at[b, rows, h], lam_s), (st_ref.at[b, h, n], s0_s),
                         (dst_ref.at[b, h, n], ds_s), (t_ref.at[b, h, rows], t_s),
                         (b_ref.at[b, h, rows], b_s)) + (((g_ref.at[b, h, rows], g_s),) if gated else ()):
            plgpu.copy_gmem_to_smem(src, dst, bar)
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
        ag = stage(cc_a, plgpu.load(t_s, layout=WGMMA).astype(F32) * decay * cols_of(beta_c, (C, C)))
        r = stage(r_st, mma(ag, w, (C, V)))

        # The three ReWY products (Λ = Aᵀ dR came from the reverse pass): Λ Rᵀ, Λ S0ᵀ, and dO Rᵀ.
        # Products are grouped so that each group costs one tensor-core round trip (this kernel
        # is latency-bound: one warpgroup per chunk). Signs ride on staged operands: the tiles
        # below hold −dT ⊙ D and −β K, so that every sum shares one accumulator; a negated
        # accumulator is never used (it gave zeros on sm_90 with jax 0.11.2 in jla's kernels).
        lr, dor = mma_group(((((lam_s, r.T),), (C, C)), (((do_s, r.T),), (C, C))))
        ndt_d = stage(cc_a, jnp.where(strict, lr, 0.0) * decay)  # −dT ⊙ D
        da_d = stage(cc_b, dor * (decay * scale))  # scale·(dA ⊙ D) (D is 0 above the diagonal)
        # K and Q are read from SMEM where each use needs them (not held in registers across
        # the kernel: at K = 128 a [C, K] fp32 tile is 64 registers per thread).
        k_f = lambda: plgpu.load(k_s, layout=WGMMA).astype(F32)  # noqa: E731
        nbk = stage(bk_st, k_f() * rows_of(beta_r * -1.0, (C, K)))  # −β K

        # dq = scale·Γ dO S0ᵀ + scale·(dA ⊙ D) K, and its gate term ⟨q, dq⟩.
        dos0, dak = mma_group(((((do_s, s0_s),), (C, K)), (((da_d, k_s),), (C, K))))
        dq = dos0 * (rows_of(gam_r * scale, (C, K)) if gated else scale) + dak
        dg = jnp.sum(plgpu.load(q_s, layout=WGMMA).astype(F32) * dq, axis=1)
        w_st[...] = dq.astype(dtype)  # w is consumed: its tile carries dq out (K == V)
        # The erase-side terms e_r = −γ_r (Λ S0ᵀ)_r + ((dT ⊙ D) K)_r: dk = β e + ..., dβ = ⟨k, e⟩ + ⟨v, Λ⟩.
        if gated:
            ls0, ndtk = mma_group(((((lam_s, s0_s),), (C, K)), (((ndt_d, k_s),), (C, K))))
            e = (ls0 * rows_of(gam_r, (C, K)) + ndtk) * -1.0
        else:
            e = mma_sum(((lam_s, s0_s), (ndt_d, k_s)), (C, K)) * -1.0
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
        plgpu.copy_smem_to_gmem(db_s, db_ref.at[b, h, rows])
        if gated:
            plgpu.copy_smem_to_gmem(dg_s, dg_ref.at[b, h, rows])
            plgpu.copy_smem_to_gmem(u_s, u_ref.at[b, h, rows])
            plgpu.copy_smem_to_gmem(sds_s, sds_ref.at[b, h, n])
        plgpu.wait_smem_to_gmem(0)

    args = [q, k, v, do, lam, states, dstates, t0, beta] + ([g2] if gated else [])
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H, N), grid_names=("b", "h", "n"),
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(*args)
