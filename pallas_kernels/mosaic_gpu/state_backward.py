"""Reverse state pass of the ReWY backward (DeltaNet, GDN): dS over chunks, Λ per chunk, dh0.

Pipeline position:  forward (saves chunk start states, or the backward recomputes them: the
states-only forward runs in one launch with this kernel, launch.py)  ->  **this kernel**
->  chunk_backward.py (per-chunk gradients, parallel over chunks).

One CTA per ``(b, h, block_v value columns)`` walks the chunks last to first with three
warpgroups. With ``P̃ = scale·(Q Kᵀ ⊙ exp2(G_i − G_j))_{j ≤ i}``, ``A = T0 ⊙ exp2(G_i − G_j)``
(the gated inverse, rewy-math §3, without β) and ``t_j = exp2(G_C − G_j)``, per chunk:

    dR = P̃ᵀ dO + diag(t) K dS                          (X = P̃ᵀ dO: the chunk-local part)
    Λ  = Aᵀ dR                                          (ReWY's one adjoint solve)
    dS ← exp2(G_C) dS + Qᵀ dO_γ − Kᵀ diag(β γ) Λ        (the previous chunk's end cotangent)

with ``dO_γ = scale·Γ dO``. Two layouts of the carried cotangent (config.PassConfig.key_rows,
like forward.py's state), one kernel body: the layout's pieces (``state_view``, ``publish``,
``chunk_local``, ``predict``, ``adjoint``, ``put_lam``, ``update``) are chosen once, the rest
is shared.

* Value rows (``block_v = 64``): WG0 holds ``dSᵀ [BV, K]`` fp32 in registers, as
  ``K / k_block`` column blocks (one block up to K = 128; four of 64 at K = 256, so that the
  update's fresh ``[BV, 64]`` accumulator sits beside the cotangent's 128 registers a thread
  instead of a second whole ``[BV, K]`` one). The chain runs transposed: ``dRᵀ = Xᵀ + (dSᵀ
  Kᵀ) diag(t)``, ``Λᵀ = dRᵀ A``, ``dSᵀ ← γ_C dSᵀ + dO_γᵀ Q − (Λᵀ diag(β γ)) K`` (the last two
  terms in one accumulator per key block), the published ``dSᵀ`` its left operand.
  WG1 publishes ``Xᵀ = dOᵀ P̃ [BV, C]`` fp32.
* Key rows (``block_v = 32``: twice the CTAs of value rows, for grids within one wave): WG0
  holds ``dS [K, BV]`` fp32 as ``K / 64`` register tiles ``[64, BV]`` (key rows j·64 onwards;
  32 registers a thread at K = 128). Every chain product is an M = 64 WGMMA with both operands
  in SMEM: ``K dS`` (B operand: the published ``dSᵀ`` transposed), ``Λ = Aᵀ dR`` (A read
  transposed), and ``Qᵀ dO_γ − Kᵀ Λ̃`` for all row blocks in one round trip (per block one
  accumulator, ``Qᵀ`` and ``Kᵀ`` read as transposed 64-column blocks of q and k). WG1
  publishes ``X = P̃ᵀ dO [C, BV]`` fp32. Every 16-bit operand buffer uses a 64-byte swizzle
  (a WGMMA's operands share one, and a 32-column tile allows no more: common.smem).

In both layouts:

* WG1 (chunk-local) builds ``A`` in place of T0, X and ``dO_γ [C, BV]`` (input dtype), and
  publishes them in double-buffered SMEM;
* WG0 (chain) publishes each chunk's end cotangent as ``dSᵀ [BV, K]`` (input dtype, the layout
  of dstates) and stores it and ``Λ [C, BV]`` (token layout) with TMA;
* WG2 (memory) streams q, k, dO, T0, the gates and β with TMA, last chunk first.

Reads:  q, k [B, Tp, H, K]; do [B, Tp, H, V]; t0 [B, H, Tp, C]; g2, beta [B, H, Tp] fp32;
        dfinal ᵀ [B, H, V, K] fp32 (optional: the final state's cotangent; key rows:
        dfinal [B, H, K, V]).
Writes: lam [B, Tp, H, V]; dstates [B, H, N, V, K] (each chunk's end cotangent, input dtype,
        both layouts); dh0 ᵀ [B, H, V, K] fp32 (key rows: dh0 [B, H, K, V]; api._state_layout
        maps both to the caller's [.., K, V]).

Packed sequences (``meta [N, META]`` int32 per chunk (reset, slot, end, 0...), B = 1, as in
forward.py): at an end chunk the carried cotangent is replaced by the final-state cotangent of
its slot (zero without one); after a reset chunk the start-state cotangent goes to ``dh0[slot]``
(``[n_slots, H, V, K]``, key rows ``[n_slots, H, K, V]``), block by block through the one-block
fp32 buffer (common.replace_where, common.store_state).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu.launch import Part, launch
from pallas_kernels.mosaic_gpu.common import (
    blocks_times_t, C, COLS, F32, META, ROWS, WGMMA, causal_decay, cols_of, finish_together, key_block,
    memory_warpgroup, mma, mma_group, mma_sum, put, rows_of, smem, stage, stage_blocks, replace_where, start_state,
    store_state,
    vectors)
from pallas_kernels.mosaic_gpu.config import PassConfig


def state_backward(q, k, do, t0, g2, beta, dfinal_t, *, scale: float, cfg: PassConfig,
                   meta=None, n_slots: int = 0, interpret=None):
    """``(lam [B, Tp, H, V], dstates [B, H, N, V, K], dh0 ᵀ [B, H, V, K] fp32)``; with
    ``cfg.key_rows`` dh0 is ``[B, H, K, V]`` and so is ``dfinal_t`` (api._state_layout).

    ``g2`` is ``None`` for DeltaNet; ``dfinal_t`` is ``None`` when the final state has no
    cotangent.
    """
    part = state_backward_part(q, k, do, t0, g2, beta, dfinal_t, scale=scale, cfg=cfg, meta=meta,
                               n_slots=n_slots)
    (outs,) = launch([part], k.shape[0], k.shape[2], interpret=interpret)
    return tuple(outs)


def state_backward_part(q, k, do, t0, g2, beta, dfinal_t, *, scale: float, cfg: PassConfig,
                        meta=None, n_slots: int = 0) -> Part:
    """This kernel as a :class:`launch.Part` (arguments and outputs as for
    :func:`state_backward`): the recompute policy launches it beside the states-only forward
    (api.py)."""
    B, Tp, H, K = k.shape
    V = do.shape[-1]
    N = Tp // C
    bv = cfg.block_v
    key_rows = cfg.key_rows
    # value rows: dSᵀ in key-column blocks [bv, kb]; key rows: dS in 64-row blocks [64, bv]
    kb = C if key_rows else cfg.key_block(K)
    nkb = K // kb
    dtype = k.dtype
    gated = g2 is not None
    has_df = dfinal_t is not None
    packed = meta is not None
    if packed and B != 1:
        raise ValueError("packed sequences need B == 1")
    stages = cfg.stages

    state_shape = (K, V) if key_rows else (V, K)
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, V), dtype),
                jax.ShapeDtypeStruct((B, H, N, V, K), dtype),
                jax.ShapeDtypeStruct((n_slots if packed else B, H) + state_shape, F32))
    n_copies = 5 + gated + packed  # q, k, do, t0, beta (+ g) (+ meta)
    # A WGMMA's operands share one swizzle: [C, 32] tiles (block_v = 32) allow at most 64 bytes.
    tile = lambda shape: smem(shape, dtype, 128 if bv == C else 64)  # noqa: E731
    chain = (C, bv) if key_rows else (bv, C)  # the chain's per-chunk tiles X, dR, Λ
    scratch = dict(
        q_s=tile((stages, C, K)), k_s=tile((stages, C, K)),
        do_s=tile((stages, C, bv)), a_s=tile((stages, C, C)),
        b_s=vectors(stages), g_s=vectors(stages),
        x_pub=smem((2,) + chain, F32), dog_pub=tile((2, C, bv)), p_stage=tile((C, C)),
        # The dS and Λ tiles are single-buffered: only TMA stores read them, and each store has
        # a whole chunk's work to finish before the tile is rewritten (SMEM is the limit here).
        ds_pub=tile((bv, K)), lam_out=tile((C, bv)),
        # one block of the fp32 cotangent at a time
        state_s=smem((kb, bv) if key_rows else (bv, kb), F32),
    )
    if key_rows:  # the chain's right operands dR and Λ̃ (value rows: left operands, registers)
        scratch["dr_stage"] = tile(chain)
    if packed:
        scratch["meta_s"] = plgpu.SMEM((stages, META), jnp.int32)
    barriers = dict(
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        a_ready=plgpu.Barrier(num_barriers=stages),
        x_ready=plgpu.Barrier(num_barriers=2), x_free=plgpu.Barrier(num_barriers=2),
        state_bar=plgpu.Barrier(), done=plgpu.Barrier(num_arrivals=3),
    )

    def state_backward_body(
            iv, *refs, q_s, k_s, do_s, a_s, b_s, g_s, x_pub, dog_pub, p_stage, ds_pub, lam_out,
            state_s, in_bar, in_free, a_ready, x_ready, x_free, state_bar, done, dr_stage=None, meta_s=None):
        refs = list(refs)
        q_ref, k_ref, do_ref, t_ref, b_ref = (refs.pop(0) for _ in range(5))
        g_ref = refs.pop(0) if gated else None
        meta_ref = refs.pop(0) if packed else None
        df_ref = refs.pop(0) if has_df else None
        lam_ref, dst_ref, dh0_ref = refs
        b, h = lax.axis_index("b"), lax.axis_index("h")
        vcols = pl.ds(iv * bv, bv)
        wg = lax.axis_index("wg")

        # The cotangent's layout (PassConfig.key_rows): where block j of a state lives in GMEM,
        # how the blocks are published as dSᵀ [bv, K] (the layout of dstates), the chain's
        # products and the per-token vectors along the chain tiles' token axis.
        if key_rows:  # dS [K, bv] as K/64 register tiles [64, bv] (key rows j·64 onwards)
            state_tile, per_token = (C, bv), ROWS

            def along_tokens(vec):
                return rows_of(vec, (C, bv))

            def state_view(ref, i, j):  # dfinal and dh0 are [.., K, V] here
                return ref.at[i, h, pl.ds(j * C, C), vcols]

            def publish(ref, blocks):
                for j, x in enumerate(blocks):
                    key_block(ref, j, C).T[...] = x.astype(dtype)
                plgpu.commit_smem()
                return ref

            def chunk_local(slot, p):  # X = P̃ᵀ dO [C, bv]
                return mma(p.T, do_s.at[slot], (C, bv))

            def predict(slot, ds, publish_ds):  # K dS [C, bv]: dS is a right operand, published first
                publish_ds()
                return mma(k_s.at[slot], ds_pub.T, (C, bv))

            def adjoint(slot, dr):  # Λ = Aᵀ dR [C, bv]
                return mma(a_s.at[slot].T, stage(dr_stage, dr), (C, bv))

            def put_lam(lam):
                lam_out[...] = lam.astype(dtype)

            def update(slot, half, lam, ds, store_lam):
                # (γ_C dS) + Qᵀ dO_γ − Kᵀ diag(β γ) Λ: every 64-row block in one round trip
                lam_lo = put(dr_stage, lam)
                store_lam()  # Λ's output tile, fenced together with Λ̃'s stage
                upd = mma_group(tuple((((key_block(q_s.at[slot], j, C).T, dog_pub.at[half]),
                                        (key_block(k_s.at[slot], j, C).T, lam_lo)), (C, bv))
                                      for j in range(nkb)))
                return tuple(u + x for u, x in zip(upd, ds))
        else:  # dSᵀ [bv, K] as nkb register tiles [bv, kb] (key columns j·kb onwards)
            state_tile, per_token = (bv, kb), COLS

            def along_tokens(vec):
                return cols_of(vec, (bv, C))

            def state_view(ref, i, j):
                return key_block(ref.at[i, h, vcols], j, kb)

            def publish(ref, blocks):
                return stage_blocks(ref, blocks, kb)

            def chunk_local(slot, p):  # Xᵀ = dOᵀ P̃ [bv, C]
                return mma(do_s.at[slot].T, p, (bv, C))

            # The chain's left operands (dSᵀ, dRᵀ, Λ̃ᵀ) come from registers: no product waits
            # for a store and fence; the published dSᵀ and Λ are stored while a product runs.
            def predict(slot, ds_t, publish_ds):  # dSᵀ Kᵀ [bv, C]
                return mma_sum(blocks_times_t(ds_t, k_s.at[slot], kb, dtype), (bv, C), between=publish_ds)

            def adjoint(slot, dr):  # Λᵀ = dRᵀ A [bv, C]
                return mma(dr.astype(dtype), a_s.at[slot], (bv, C))

            def put_lam(lam):
                lam_out.T[...] = lam.astype(dtype)

            def update(slot, half, lam, ds_t, store_lam):
                # One key block at a time: one fresh [BV, kb] accumulator beside the cotangent.
                lam_lo = lam.astype(dtype)
                return tuple(mma_sum(((dog_pub.at[half].T, key_block(q_s.at[slot], j, kb)),
                                      (lam_lo, key_block(k_s.at[slot], j, kb))), (bv, kb), acc=ds_t[j],
                                     between=store_lam if j == 0 else None)
                             for j in range(nkb))

        @pl.when(wg == 2)
        def _memory():
            def copies(i):  # i-th chunk from the end
                rows = pl.ds((N - 1 - i) * C, C)
                yield from ((q_ref.at[b, rows, h], q_s), (k_ref.at[b, rows, h], k_s),
                            (do_ref.at[b, rows, h, vcols], do_s), (t_ref.at[b, h, rows], a_s),
                            (b_ref.at[b, h, rows], b_s))
                if gated:
                    yield g_ref.at[b, h, rows], g_s
                if packed:
                    yield meta_ref.at[N - 1 - i], meta_s

            memory_warpgroup([(copies, stages, in_bar, in_free)], N)

        @pl.when(wg == 1)
        def _chunk_local():
            plgpu.set_max_registers(232, action="increase")

            def step(i, carry):
                slot, half = lax.rem(i, stages), lax.rem(i, 2)
                plgpu.barrier_wait(in_bar.at[slot])
                if gated:
                    g_row = plgpu.load(g_s.at[slot], layout=ROWS)
                    decay = causal_decay(g_row, plgpu.load(g_s.at[slot], layout=COLS), strict=False)
                else:
                    decay = causal_decay(None, None, strict=False)
                t0_t = plgpu.load(a_s.at[slot], layout=WGMMA).astype(F32)
                a_s.at[slot][...] = (t0_t * decay).astype(dtype)  # A = T0 ⊙ exp2(G_i − G_j)
                plgpu.commit_smem()
                plgpu.barrier_arrive(a_ready.at[slot])
                p = stage(p_stage, mma(q_s.at[slot], k_s.at[slot].T, (C, C)) * (decay * scale))

                @pl.when(i >= 2)
                def _():  # WG0 is done with the tiles published two chunks ago
                    plgpu.barrier_wait(x_free.at[half])

                x_pub.at[half][...] = chunk_local(slot, p)
                do_t = plgpu.load(do_s.at[slot], layout=WGMMA).astype(F32)
                if gated:
                    do_t = do_t * rows_of(jnp.exp2(g_row) * scale, (C, bv))
                else:
                    do_t = do_t * scale
                dog_pub.at[half][...] = do_t.astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(x_ready.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                return carry

            lax.fori_loop(0, N, step, None)
            for i in range(max(N - 2, 0), N):  # observe WG0's last releases of the published tiles
                plgpu.barrier_wait(x_free.at[i % 2])

        @pl.when(wg == 0)
        def _chain():
            plgpu.set_max_registers(232, action="increase")
            # The cotangent is a tuple of nkb register tiles state_tile.
            src = (lambda j: state_view(df_ref, b, j)) if has_df and not packed else None
            ds0 = start_state(state_s, src, state_bar, state_tile, nkb)

            def step(i, ds_t):
                slot, half = lax.rem(i, stages), lax.rem(i, 2)
                n = N - 1 - i
                plgpu.barrier_wait(in_bar.at[slot])
                if packed:  # a sequence ends here: its final-state cotangent replaces the carry
                    end, seq = meta_s[slot, 2], meta_s[slot, 1]
                    if has_df:
                        ds_t = replace_where(end, ds_t, lambda j: state_view(df_ref, seq, j),
                                             state_s, state_bar)
                    else:
                        ds_t = tuple(jnp.where(end == 1, 0.0, x) for x in ds_t)
                def publish_ds():  # the chunk's end cotangent, an output (and key rows' operand)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # chunk i − 1's stores have read
                    publish(ds_pub, ds_t)
                    plgpu.copy_smem_to_gmem(ds_pub, dst_ref.at[b, h, n, vcols], commit_group=False)

                y = predict(slot, ds_t, publish_ds)
                if gated:
                    g_tok = plgpu.load(g_s.at[slot], layout=per_token)
                    g_last = g_s[slot, C - 1]
                    y = y * along_tokens(jnp.exp2(g_last - g_tok))
                plgpu.barrier_wait(x_ready.at[half])
                dr = y + plgpu.load(x_pub.at[half], layout=WGMMA)
                plgpu.barrier_wait(a_ready.at[slot])
                lam = adjoint(slot, dr)

                def store_lam():
                    put_lam(lam)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(lam_out, lam_ref.at[b, pl.ds(n * C, C), h, vcols])

                beta_tok = plgpu.load(b_s.at[slot], layout=per_token)
                # −diag(β γ) Λ: the sign rides on the operand, so both terms of the update share
                # one accumulator (one tensor-core round trip on the chain).
                if gated:
                    lam_s = lam * along_tokens(beta_tok * jnp.exp2(g_tok) * -1.0)
                    ds_t = tuple(x * jnp.exp2(g_last) for x in ds_t)
                else:
                    lam_s = lam * along_tokens(beta_tok * -1.0)
                ds_new = update(slot, half, lam_s, ds_t, store_lam)
                if packed:  # a sequence starts here: its initial state's cotangent is done
                    reset, seq = meta_s[slot, 0], meta_s[slot, 1]

                    @pl.when(reset == 1)
                    def _():
                        store_state(state_s, ds_new, lambda j: state_view(dh0_ref, seq, j),
                                    wait_first=True)
                plgpu.barrier_arrive(x_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                return ds_new

            ds_t = lax.fori_loop(0, N, step, ds0)
            if not packed:
                store_state(state_s, ds_t, lambda j: state_view(dh0_ref, b, j), wait_first=True)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [q, k, do, t0, beta] + ([g2] if gated else []) + ([meta] if packed else [])
    args += [dfinal_t] if has_df else []
    return Part(args=tuple(args), out_type=out_type, smem=scratch, barriers=barriers,
                blocks=V // bv, warpgroups=3, body=state_backward_body)
