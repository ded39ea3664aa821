"""The seven-product (standard WY) chunk backward of KDA/GDN2, for the ablation against ReWY.

Pipeline position (``backward="wy"``):  vector_state_backward.py (dR per chunk)  ->  **this
kernel** (dT and dĒ per chunk)  ->  vector_chunk_backward.py (``wy=``: reads them in place of
its Λ Rᵀ and Λ S0ᵀ products)  ->  XLA and gate_grad as under ReWY.

The forward forms ``W = A Ē`` and ``U = A Z`` (A = (I + T)⁻¹, Ē = 2^G ⊙ E with E = β k or b ⊙ k,
Z = β v or w ⊙ v) and ``R = U − W S0``. The standard backward of that step, given dR:

    dU = dR,   dW = −dR S0ᵀ                       (product 1: over V)
    dA = dU Zᵀ + dW Ēᵀ                             (products 2, 3: over V and over K)
    dĒ = Aᵀ dW,   dZ = Aᵀ dU                       (products 4, 5; dZ = Λ is the gradient
                                                   kernel's, shared with ReWY)
    dT = −(Aᵀ dA Aᵀ)_{s<r}                         (products 6, 7: the inverse's adjoint)

ReWY gets the same dT and dĒ from Λ = Aᵀ dR as ``−(Λ Rᵀ)_{s<r}`` and ``−Λ S0ᵀ`` (three products
in all, no inverse adjoint). dA contracts over all K key channels, and the gradient kernel holds
one 64-channel key piece per CTA, so these products take a CTA per chunk of their own here,
with the whole K: K = V ≤ 128 (the ablation's range, as for DeltaNet/GDN).

One CTA, one warpgroup, per ``(b, h, chunk)``. Every product's A is the split pair the forward
sent out (two WGMMAs into one accumulator); dW, dA and Aᵀ dA are staged in the input dtype
between products. Round trips per chunk: dW; then dA with dĒ (one group); Aᵀ dA; (Aᵀ dA) Aᵀ.
SMEM: A's pair, dR and Z ``[V/64, C, 64]``, S0ᵀ ``[V/64, K/64, 64, 64]`` (16-bit), k ``[K/64, C,
64]`` (16-bit, Ē over it), G ``[K/64, C, 64]`` fp32 (dĒ over it), b (GDN2, fp32) or β, one
``[C, C]`` tile: 168 KiB for GDN2 at K = V = 128.

Reads:  a_hi, a_lo [B, H, Tp, C]; dr [B, Tp, H, V]; x [B, Tp, H, V] (v for KDA, z = w ⊙ v for
        GDN2); states [B, H, N, V, K]; k [B, Tp, H, K]; g2 [B, H, Tp, K] fp32; erase: β [B, H,
        Tp] fp32 (KDA) or b [B, Tp, H, K] fp32 (GDN2).
Writes: dt [B, H, Tp, C] (input dtype, strictly lower), debar [B, Tp, H, K] fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.common import C, F32, ROWS, WGMMA, iota, mma_group, put, rows_of, smem
from pallas_kernels.mosaic_gpu.config import PIECE


def vector_wy_products(a_hi, a_lo, dr, x, states, k, g2, erase, *, interpret=None):
    """``(dt [B, H, Tp, C], debar [B, Tp, H, K] fp32)``: the seven-product backward's dT and dĒ of
    every chunk (module docstring). KDA when ``erase`` is β ``[B, H, Tp]`` (then ``x`` is v), GDN2
    when it is b ``[B, Tp, H, K]`` (``x`` is z = w ⊙ v)."""
    B, Tp, H, K = k.shape
    V = dr.shape[-1]
    N = Tp // C
    dtype = k.dtype
    channel_erase = erase.ndim == 4
    if K != V or K not in (PIECE, 2 * PIECE):
        raise ValueError(f"vector_wy_products needs K = V in {{{PIECE}, {2 * PIECE}}} (the whole K in one "
                         f"CTA), got K={K}, V={V}")
    nk, nv = K // PIECE, V // PIECE
    piece = lambda n, dt=dtype: smem((n, C, PIECE), dt)  # noqa: E731
    scratch = dict(
        a_s=smem((2, C, C), dtype), dr_s=piece(nv), x_s=piece(nv), s0_s=smem((nv, nk, PIECE, PIECE), dtype),
        k_s=piece(nk), g_s=piece(nk, F32),
        e_s=piece(nk, F32) if channel_erase else plgpu.SMEM((C,), F32),
        cc_s=smem((C, C), dtype),
        bar=plgpu.Barrier(num_arrivals=2 + 2 * nv + nv * nk + 2 * nk + (nk if channel_erase else 1)),
    )
    out_type = (jax.ShapeDtypeStruct((B, H, Tp, C), dtype), jax.ShapeDtypeStruct((B, Tp, H, K), F32))

    def vector_wy_body(ahi_ref, alo_ref, dr_ref, x_ref, st_ref, k_ref, g_ref, e_ref, dt_ref, debar_ref,
                       a_s, dr_s, x_s, s0_s, k_s, g_s, e_s, cc_s, bar):
        b, h, n = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("n")
        rows = pl.ds(n * C, C)
        cols = lambda j: pl.ds(j * PIECE, PIECE)  # noqa: E731
        plgpu.copy_gmem_to_smem(ahi_ref.at[b, h, rows], a_s.at[0], bar)
        plgpu.copy_gmem_to_smem(alo_ref.at[b, h, rows], a_s.at[1], bar)
        for i in range(nv):
            plgpu.copy_gmem_to_smem(dr_ref.at[b, rows, h, cols(i)], dr_s.at[i], bar)
            plgpu.copy_gmem_to_smem(x_ref.at[b, rows, h, cols(i)], x_s.at[i], bar)
            for j in range(nk):
                plgpu.copy_gmem_to_smem(st_ref.at[b, h, n, cols(i), cols(j)], s0_s.at[i, j], bar)
        for j in range(nk):
            plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h, cols(j)], k_s.at[j], bar)
            plgpu.copy_gmem_to_smem(g_ref.at[b, h, rows, cols(j)], g_s.at[j], bar)
            if channel_erase:
                plgpu.copy_gmem_to_smem(e_ref.at[b, rows, h, cols(j)], e_s.at[j], bar)
        if not channel_erase:
            plgpu.copy_gmem_to_smem(e_ref.at[b, h, rows], e_s, bar)
        plgpu.barrier_wait(bar)

        load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)  # noqa: E731
        tile = (C, PIECE)
        a_pair = (a_s.at[0], a_s.at[1])
        # dR S0ᵀ (= −dW), one key piece per accumulator (summed over the value pieces)
        dr_s0 = mma_group([(tuple((dr_s.at[i], s0_s.at[i, j]) for i in range(nv)), tile) for j in range(nk)])
        # Ē over k (its only reader), KDA's Z = β v over v; dW over S0ᵀ's first value row (spent)
        beta = None if channel_erase else rows_of(plgpu.load(e_s, layout=ROWS), tile)
        for j in range(nk):
            e_j = load(e_s.at[j]) * load(k_s.at[j]) if channel_erase else beta * load(k_s.at[j])
            put(k_s.at[j], e_j * jnp.exp2(load(g_s.at[j])))
            put(s0_s.at[0, j], dr_s0[j] * -1.0)  # dW
        if not channel_erase:
            for i in range(nv):
                put(x_s.at[i], beta * load(x_s.at[i]))
        plgpu.commit_smem()
        # dA = dR Zᵀ + dW Ēᵀ (one accumulator) beside dĒ = Aᵀ dW per key piece
        outs = mma_group(
            [(tuple((dr_s.at[i], x_s.at[i].T) for i in range(nv)) + tuple((s0_s.at[0, j], k_s.at[j].T)
                                                                       for j in range(nk)), (C, C))]
            + [(tuple((a.T, s0_s.at[0, j]) for a in a_pair), tile) for j in range(nk)])
        for j in range(nk):  # dĒ over G (spent)
            put(g_s.at[j], outs[1 + j])
        put(cc_s, outs[0])
        plgpu.commit_smem()
        for j in range(nk):
            plgpu.copy_smem_to_gmem(g_s.at[j], debar_ref.at[b, rows, h, cols(j)])
        (x_t,) = mma_group([(tuple((a.T, cc_s) for a in a_pair), (C, C))])  # Aᵀ dA
        put(cc_s, x_t)
        plgpu.commit_smem()
        (y,) = mma_group([(tuple((cc_s, a.T) for a in a_pair), (C, C))])  # (Aᵀ dA) Aᵀ
        r, c = iota((C, C), 0), iota((C, C), 1)
        put(cc_s, jnp.where(r > c, y, 0.0) * -1.0)  # dT
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(cc_s, dt_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        vector_wy_body, out_type=out_type, scratch_types=scratch,
        grid=(B, H, N), grid_names=("b", "h", "n"),
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(a_hi, a_lo, dr, x, states, k, g2, erase)
