"""Reverse state pass of the ReWY backward (DeltaNet, GDN): dS over chunks, Λ per chunk, dh0.

Pipeline position:  forward (saves or recomputes chunk start states)  ->  **this kernel**
->  chunk_backward.py (per-chunk gradients, parallel over chunks).

One CTA per ``(b, h, 64 value columns)`` walks the chunks last to first with three warpgroups.
``dSᵀ [BV, K]`` (the cotangent of the chunk's end state) is fp32 in WG0's registers, as
``K / k_block`` column blocks (config.PassConfig: one block up to K = 128; four of 64 at K = 256,
so that the update's fresh ``[BV, 64]`` accumulator sits beside the cotangent's 128 registers a
thread instead of a second whole ``[BV, K]`` one). With
``P̃ = scale·(Q Kᵀ ⊙ exp2(G_i − G_j))_{j ≤ i}``, ``A = T0 ⊙ exp2(G_i − G_j)`` (the gated inverse,
rewy-math §3, without β) and ``t_j = exp2(G_C − G_j)``:

* WG1 (chunk-local) builds ``A`` in place of T0, ``X = dOᵀ P̃ [BV, C]`` (fp32) and
  ``dO_γ = scale·Γ dO`` (input dtype), and publishes them in double-buffered SMEM;
* WG0 (chain), per chunk:
      dRᵀ = X + (dSᵀ Kᵀ) diag(t)                     (dR = P̃ᵀ dO + K_tail dS)
      Λᵀ  = dRᵀ A                                      (ReWY's one adjoint solve, Λ = Aᵀ dR)
      dSᵀ ← exp2(G_C) dSᵀ + dO_γᵀ Q − (Λᵀ diag(β γ)) K   (the previous chunk's end cotangent)
  and stores Λ (input dtype, token layout) and the chunk's end cotangent dS (input dtype);
* WG2 (memory) streams q, k, dO, T0, the gates and β with TMA, last chunk first.

Reads:  q, k [B, Tp, H, K]; do [B, Tp, H, V]; t0 [B, H, Tp, C]; g2, beta [B, H, Tp] fp32;
        dfinal ᵀ [B, H, V, K] fp32 (optional: the final state's cotangent).
Writes: lam [B, Tp, H, V]; dstates [B, H, N, V, K] (each chunk's end cotangent, input dtype);
        dh0 ᵀ [B, H, V, K] fp32.

Packed sequences (``meta [N, META]`` int32 per chunk (reset, slot, end, 0...), B = 1, as in
forward.py): at an end chunk the carried cotangent is replaced by the final-state cotangent of
its slot (zero without one); after a reset chunk the start-state cotangent goes to ``dh0[slot]``
(``[n_slots, H, V, K]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.common import (
    C, COLS, F32, META, ROWS, WGMMA, causal_decay, cols_of, finish_together, key_block,
    memory_warpgroup, mma, mma_sum, rows_of, smem, stage, stage_blocks, replace_where, start_state, store_state,
    vectors)
from pallas_kernels.mosaic_gpu.config import PassConfig


def state_backward(q, k, do, t0, g2, beta, dfinal_t, *, scale: float, cfg: PassConfig,
                   meta=None, n_slots: int = 0, interpret=None):
    """``(lam [B, Tp, H, V], dstates [B, H, N, V, K], dh0 ᵀ [B, H, V, K] fp32)``.

    ``g2`` is ``None`` for DeltaNet; ``dfinal_t`` is ``None`` when the final state has no
    cotangent.
    """
    B, Tp, H, K = k.shape
    V = do.shape[-1]
    N = Tp // C
    bv = cfg.block_v
    kb = cfg.key_block(K)  # key columns per register-cotangent block
    nkb = K // kb
    dtype = k.dtype
    gated = g2 is not None
    has_df = dfinal_t is not None
    packed = meta is not None
    if packed and B != 1:
        raise ValueError("packed sequences need B == 1")
    stages = cfg.stages

    out_type = (jax.ShapeDtypeStruct((B, Tp, H, V), dtype),
                jax.ShapeDtypeStruct((B, H, N, V, K), dtype),
                jax.ShapeDtypeStruct((n_slots, H, V, K) if packed else (B, H, V, K), F32))
    n_copies = 5 + gated + packed  # q, k, do, t0, beta (+ g) (+ meta)
    scratch = dict(
        q_s=smem((stages, C, K), dtype), k_s=smem((stages, C, K), dtype),
        do_s=smem((stages, C, bv), dtype), a_s=smem((stages, C, C), dtype),
        b_s=vectors(stages), g_s=vectors(stages),
        x_pub=smem((2, bv, C), F32), dog_pub=smem((2, C, bv), dtype), p_stage=smem((C, C), dtype),
        # The dS and Λ tiles are single-buffered: only TMA stores read them, and each store has
        # a whole chunk's work to finish before the tile is rewritten (SMEM is the limit here).
        ds_pub=smem((bv, K), dtype), dr_stage=smem((bv, C), dtype), lam_out=smem((C, bv), dtype),
        state_s=smem((bv, kb), F32),  # one block of the fp32 cotangent at a time
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        a_ready=plgpu.Barrier(num_barriers=stages),
        x_ready=plgpu.Barrier(num_barriers=2), x_free=plgpu.Barrier(num_barriers=2),
        state_bar=plgpu.Barrier(), done=plgpu.Barrier(num_arrivals=3),
    )
    if packed:
        scratch["meta_s"] = plgpu.SMEM((stages, META), jnp.int32)

    def body(*refs, q_s, k_s, do_s, a_s, b_s, g_s, x_pub, dog_pub, p_stage, ds_pub, dr_stage, lam_out,
             state_s, in_bar, in_free, a_ready, x_ready, x_free, state_bar, done, meta_s=None):
        refs = list(refs)
        q_ref, k_ref, do_ref, t_ref, b_ref = (refs.pop(0) for _ in range(5))
        g_ref = refs.pop(0) if gated else None
        meta_ref = refs.pop(0) if packed else None
        df_ref = refs.pop(0) if has_df else None
        lam_ref, dst_ref, dh0_ref = refs
        b, h, iv = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("v")
        vcols = pl.ds(iv * bv, bv)
        wg = lax.axis_index("wg")

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

            memory_warpgroup(copies, N, stages, in_bar, in_free)

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

                x_pub.at[half][...] = mma(do_s.at[slot].T, p, (bv, C))  # dOᵀ P̃
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
            # The cotangent is a tuple of nkb register tiles [BV, kb] (key columns j·kb onwards).
            src = (lambda j: key_block(df_ref.at[b, h, vcols], j, kb)) if has_df and not packed else None
            ds0 = start_state(state_s, src, state_bar, (bv, kb), nkb)

            def step(i, ds_t):
                slot, half = lax.rem(i, stages), lax.rem(i, 2)
                n = N - 1 - i
                plgpu.barrier_wait(in_bar.at[slot])
                if packed:  # a sequence ends here: its final-state cotangent replaces the carry
                    end, seq = meta_s[slot, 2], meta_s[slot, 1]
                    if has_df:
                        ds_t = replace_where(end, ds_t, lambda j: key_block(df_ref.at[seq, h, vcols], j, kb),
                                             state_s, state_bar)
                    else:
                        ds_t = tuple(jnp.where(end == 1, 0.0, x) for x in ds_t)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # chunk i − 1's stores have read
                ds_lo = stage_blocks(ds_pub, ds_t, kb)
                plgpu.copy_smem_to_gmem(ds_pub, dst_ref.at[b, h, n, vcols], commit_group=False)
                y = mma(ds_lo, k_s.at[slot].T, (bv, C))  # dSᵀ Kᵀ
                if gated:
                    g_col = plgpu.load(g_s.at[slot], layout=COLS)
                    g_last = g_s[slot, C - 1]
                    y = y * cols_of(jnp.exp2(g_last - g_col), (bv, C))
                plgpu.barrier_wait(x_ready.at[half])
                dr = y + plgpu.load(x_pub.at[half], layout=WGMMA)
                plgpu.barrier_wait(a_ready.at[slot])
                lam = mma(stage(dr_stage, dr), a_s.at[slot], (bv, C))  # Λᵀ = dRᵀ A
                lam_out.T[...] = lam.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lam_out, lam_ref.at[b, pl.ds(n * C, C), h, vcols])
                beta_c = plgpu.load(b_s.at[slot], layout=COLS)
                # −Λᵀ diag(β γ): the sign rides on the staged operand, so both terms of the
                # update share one accumulator (one tensor-core round trip on the chain).
                if gated:
                    lam = lam * cols_of(beta_c * jnp.exp2(g_col) * -1.0, (bv, C))
                    ds_t = tuple(x * jnp.exp2(g_last) for x in ds_t)
                else:
                    lam = lam * cols_of(beta_c * -1.0, (bv, C))
                lam_lo = stage(dr_stage, lam)
                # One key block at a time: one fresh [BV, kb] accumulator beside the cotangent.
                ds_new = tuple(mma_sum(((dog_pub.at[half].T, key_block(q_s.at[slot], j, kb)),
                                        (lam_lo, key_block(k_s.at[slot], j, kb))), (bv, kb), acc=ds_t[j])
                               for j in range(nkb))
                if packed:  # a sequence starts here: its initial state's cotangent is done
                    reset, seq = meta_s[slot, 0], meta_s[slot, 1]

                    @pl.when(reset == 1)
                    def _():
                        store_state(state_s, ds_new, lambda j: key_block(dh0_ref.at[seq, h, vcols], j, kb),
                                    wait_first=True)
                plgpu.barrier_arrive(x_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                return ds_new

            ds_t = lax.fori_loop(0, N, step, ds0)
            if not packed:
                store_state(state_s, ds_t, lambda j: key_block(dh0_ref.at[b, h, vcols], j, kb),
                            wait_first=True)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [q, k, do, t0, beta] + ([g2] if gated else []) + ([meta] if packed else [])
    args += [dfinal_t] if has_df else []
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(B, H, V // bv),
        grid_names=("b", "h", "v"), num_threads=3, thread_name="wg",
        compiler_params=compat.compiler_params(), interpret=interpret,
    )(*args)
