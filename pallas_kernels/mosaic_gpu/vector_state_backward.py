"""Reverse state pass of the vector-gate (KDA, GDN2) ReWY backward: dR per chunk, each chunk's end
cotangent, dh0.

Pipeline position:  vector_chunk.py + vector_forward.py (W, K_tail, Qγ, P; chunk start states and
R saved or recomputed)  ->  **this kernel**  ->  vector_chunk_backward.py (per chunk, parallel:
Λ = Aᵀ dR and every gradient)  ->  XLA (leaf maps, dg).

One CTA per ``(b, h, 64 value columns)`` walks the chunks last to first. Per chunk, with the
chunk's forward products (vector_chunk.py: W = A Ē, K_tail, Qγ, P; scale inside Qγ and P):

    dRᵀ = dSᵀ K_tailᵀ + dOᵀ P                          (dR = Pᵀ dO + K_tail dS: one accumulator)
    dSᵀ ← dSᵀ Diag(2^{G_C}) + dOᵀ Qγ − dRᵀ W           (the previous chunk's end cotangent)

The second line is rewy-math §4's ``dS0 = Qγᵀ dO + Diag(γ_C) dS − Ēᵀ Λ`` with
``Ēᵀ Λ = Ēᵀ Aᵀ dR = Wᵀ dR``: the serial chain needs neither Λ nor the inverse (Λ = Aᵀ dR, ReWY's
one adjoint solve, is parallel over chunks and done in vector_chunk_backward.py). So the chain is
two tensor-core round trips per chunk (4 WGMMAs in 2 round trips: the second reads the first's
dR, so nothing more can be grouped) and no warpgroup is needed for chunk-local work.

Warpgroups:
* WG0 (chain, 232 registers) keeps ``dSᵀ [BV, K]`` fp32 in registers (64 registers at K = 128);
  stores dS (input dtype, for the per-chunk gradients) and dR (input dtype, token layout).
* WG1 (memory, 40 registers) streams K_tail, W, Qγ ``[C, K]``, P ``[C, C]``, dO ``[C, 64]`` and
  the chunk's last row of G ``[K]`` fp32 into ``stages`` buffers, last chunk first.

SMEM (config.vector_state_backward_smem_bytes): per stage 3·C·K + C·C + C·64 16-bit values and K
fp32; fixed: dSᵀ (16-bit) and dR, the store tiles, and the fp32 tile for d(final) and dh0 (the
chain's left operands dSᵀ and −dRᵀ come from registers). K = 128: 2 stages, 185 KiB; K = 64:
4 stages, 193 KiB. K = 256 (``cfg.k_block = 64``): the cotangent as four ``[64, 64]`` register
blocks, each updated by its own accumulator, d(final) and dh0 one block at a time; 1 stage,
169 KiB.

Reads:  kt, w, qg [B, H, Tp, K]; p [B, H, Tp, C]; do [B, Tp, H, V]; g2 [B, H, Tp, K] fp32 (row
        C − 1 of each chunk); dfinal ᵀ [B, H, V, K] fp32 (optional).
Writes: dr [B, Tp, H, V]; dstates [B, H, N, V, K] (each chunk's end cotangent, transposed; input
        dtype); dh0 ᵀ [B, H, V, K] fp32.

Packed sequences (``meta [N, META]`` int32 per chunk (reset, slot, end, 0...), B = 1, as in
vector_forward.py and the scalar state_backward.py): at an end chunk the carried cotangent is
replaced by the final-state cotangent of its slot (zero without one); after a reset chunk the
start-state cotangent goes to ``dh0[slot]`` (``[n_slots, H, V, K]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu.launch import Part, launch
from pallas_kernels.mosaic_gpu.common import (
    blocks_times_t, C, COLS, F32, META, cols_of, finish_together, key_block, memory_warpgroup, mma_sum, smem,
    stage_blocks, replace_where, start_state, store_state)
from pallas_kernels.mosaic_gpu.config import PassConfig


def vector_state_backward(kt, w, qg, p, do, g2, dfinal_t, *, cfg: PassConfig, meta=None,
                          n_slots: int = 0, interpret=None):
    """``(dr [B, Tp, H, V], dstates [B, H, N, V, K], dh0 ᵀ [B, H, V, K] fp32)``; see the module
    docstring. ``dfinal_t`` is ``None`` when the final state has no cotangent; with ``meta``
    (packed sequences) dfinal_t and dh0 are ``[n_slots, H, V, K]``."""
    part = vector_state_backward_part(kt, w, qg, p, do, g2, dfinal_t, cfg=cfg, meta=meta, n_slots=n_slots)
    (outs,) = launch([part], w.shape[0], w.shape[1], interpret=interpret)
    return tuple(outs)


def vector_state_backward_part(kt, w, qg, p, do, g2, dfinal_t, *, cfg: PassConfig, meta=None,
                               n_slots: int = 0, warpgroups: int = 2) -> Part:
    """This kernel as a :class:`launch.Part` (arguments and outputs as for
    :func:`vector_state_backward`). ``warpgroups=3``: one more, idle warpgroup (it gives up its
    registers and waits for the others to finish), so that the part can share a launch with the
    three-warpgroup states-only forward (vector_api.py, policy "recompute")."""
    if warpgroups not in (2, 3):
        raise ValueError(f"the vector reverse state pass runs on 2 or 3 warpgroups, got {warpgroups}")
    B, H, Tp, K = w.shape
    V = do.shape[-1]
    N = Tp // C
    bv = cfg.block_v
    stages = cfg.stages
    kb = cfg.key_block(K)  # key columns per register block of the cotangent
    nkb = K // kb
    dtype = w.dtype
    has_df = dfinal_t is not None
    packed = meta is not None
    if packed and B != 1:
        raise ValueError("packed sequences need B == 1")

    out_type = (jax.ShapeDtypeStruct((B, Tp, H, V), dtype),
                jax.ShapeDtypeStruct((B, H, N, V, K), dtype),
                jax.ShapeDtypeStruct((n_slots, H, V, K) if packed else (B, H, V, K), F32))
    scratch = dict(
        kt_s=smem((stages, C, K), dtype), w_s=smem((stages, C, K), dtype), qg_s=smem((stages, C, K), dtype),
        p_s=smem((stages, C, C), dtype), do_s=smem((stages, C, bv), dtype), gl_s=plgpu.SMEM((stages, K), F32),
        # Single-buffered: only this warpgroup's TMA stores read ds_pub and dr_out, and each store
        # has the next chunk's first product to finish before the tile is rewritten.
        ds_pub=smem((bv, K), dtype), dr_out=smem((C, bv), dtype),
        state_s=smem((bv, kb), F32),  # one block of d(final) / dh0 at a time
    )
    if packed:
        scratch["meta_s"] = plgpu.SMEM((stages, META), jnp.int32)
    barriers = dict(
        in_bar=plgpu.Barrier(num_arrivals=6 + packed, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        state_bar=plgpu.Barrier(), done=plgpu.Barrier(num_arrivals=warpgroups),
    )

    def vector_state_backward_body(
            iv, *refs, kt_s, w_s, qg_s, p_s, do_s, gl_s, ds_pub, dr_out, state_s, in_bar, in_free,
            state_bar, done, meta_s=None):
        refs = list(refs)
        kt_ref, w_ref, qg_ref, p_ref, do_ref, g_ref = (refs.pop(0) for _ in range(6))
        meta_ref = refs.pop(0) if packed else None
        df_ref = refs.pop(0) if has_df else None
        dr_ref, dst_ref, dh0_ref = refs
        b, h = lax.axis_index("b"), lax.axis_index("h")
        vcols = pl.ds(iv * bv, bv)
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _memory():
            def copies(i):  # i-th chunk from the end
                n = N - 1 - i
                rows = pl.ds(n * C, C)
                yield from ((kt_ref.at[b, h, rows], kt_s), (w_ref.at[b, h, rows], w_s),
                            (qg_ref.at[b, h, rows], qg_s), (p_ref.at[b, h, rows], p_s),
                            (do_ref.at[b, rows, h, vcols], do_s))
                yield g_ref.at[b, h, n * C + C - 1], gl_s
                if packed:
                    yield meta_ref.at[n], meta_s

            memory_warpgroup([(copies, stages, in_bar, in_free)], N)

        @pl.when(wg == 0)
        def _chain():
            plgpu.set_max_registers(232, action="increase")
            src = (lambda j: key_block(df_ref.at[b, h, vcols], j, kb)) if has_df and not packed else None
            ds0 = start_state(state_s, src, state_bar, (bv, kb), nkb)

            def step(i, ds_t):
                slot = lax.rem(i, stages)
                n = N - 1 - i
                plgpu.barrier_wait(in_bar.at[slot])
                if packed:  # a sequence ends here: its final-state cotangent replaces the carry
                    end, seq = meta_s[slot, 2], meta_s[slot, 1]
                    if has_df:
                        ds_t = replace_where(end, ds_t, lambda j: key_block(df_ref.at[seq, h, vcols], j, kb),
                                             state_s, state_bar)
                    else:
                        ds_t = tuple(jnp.where(end == 1, 0.0, x) for x in ds_t)
                # The chain's left operands dSᵀ and −dRᵀ come from registers, so no product waits
                # for a store and fence: the outputs dSᵀ and dR are stored while a product runs.
                def publish_ds():  # the chunk's end cotangent, an output
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # chunk i − 1's stores have read
                    stage_blocks(ds_pub, ds_t, kb)
                    plgpu.copy_smem_to_gmem(ds_pub, dst_ref.at[b, h, n, vcols])

                dr_t = mma_sum(blocks_times_t(ds_t, kt_s.at[slot], kb, dtype) + ((do_s.at[slot].T, p_s.at[slot]),),
                               (bv, C), between=publish_ds)

                def store_dr():
                    dr_out.T[...] = dr_t.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dr_out, dr_ref.at[b, pl.ds(n * C, C), h, vcols])

                # −dRᵀ: the sign rides on the operand, so the update is one accumulator
                ndr = (dr_t * -1.0).astype(dtype)
                ds_new = []
                for j, ds_j in enumerate(ds_t):  # block by block: one block's fresh accumulator live
                    decay = cols_of(jnp.exp2(plgpu.load(key_block(gl_s.at[slot], j, kb), layout=COLS)),
                                    (bv, kb))  # 2^{G_C}
                    ds_new.append(mma_sum(((do_s.at[slot].T, key_block(qg_s.at[slot], j, kb)),
                                           (ndr, key_block(w_s.at[slot], j, kb))), (bv, kb), acc=ds_j * decay,
                                          between=store_dr if j == 0 else None))
                ds_new = tuple(ds_new)
                if packed:  # a sequence starts here: its initial state's cotangent is done
                    reset, seq = meta_s[slot, 0], meta_s[slot, 1]

                    @pl.when(reset == 1)
                    def _():
                        store_state(state_s, ds_new, lambda j: key_block(dh0_ref.at[seq, h, vcols], j, kb),
                                    wait_first=True)
                plgpu.barrier_arrive(in_free.at[slot])
                return ds_new

            ds_t = lax.fori_loop(0, N, step, ds0)
            if not packed:
                store_state(state_s, ds_t, lambda j: key_block(dh0_ref.at[b, h, vcols], j, kb), wait_first=True)
            plgpu.wait_smem_to_gmem(0)

        if warpgroups == 3:
            @pl.when(wg == 2)
            def _idle():
                plgpu.set_max_registers(40, action="decrease")

        finish_together(done)

    args = [kt, w, qg, p, do, g2] + ([meta] if packed else []) + ([dfinal_t] if has_df else [])
    return Part(args=tuple(args), out_type=out_type, smem=scratch, barriers=barriers, blocks=V // bv,
                warpgroups=warpgroups, body=vector_state_backward_body)
