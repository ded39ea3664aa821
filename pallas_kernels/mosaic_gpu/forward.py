"""Fused forward of the scalar-gate delta rule (DeltaNet, GDN): state pass + output, one kernel.

Pipeline position:  prep (XLA: pad, log2 gate cumsum, gate-free inverse T0)  ->  **this kernel**.

One CTA per ``(b, h, 64 value columns)`` walks its chunks in order with three warpgroups:

* WG0 (state chain) keeps ``Sᵀ [BV, K]`` fp32 in registers, as ``K / k_block`` column blocks
  (config.PassConfig: one block up to K = 128; four of 64 at K = 256, so that the state update's
  fresh accumulator is one ``[BV, 64]`` block beside the state, 128 + 32 registers a thread,
  not a second whole state). Per chunk, with ``Γ = diag(exp2 G)``:
      Wᵀ = Vᵀ − (Sᵀ Kᵀ) Γ                 (the values minus what the state already predicts)
      Rᵀ = Wᵀ Agᵀ                         (Ag = T0 ⊙ exp2(G_i − G_j) ⊙ β_j: the gated inverse)
      Sᵀ ← exp2(G_C) Sᵀ + (Rᵀ diag(exp2(G_C − G_j))) K
  and publishes ``Sᵀ`` (chunk start state) and ``R`` in the input dtype through double-buffered SMEM
  (single-buffered with ``PassConfig.publish_buffers = 1``, K = 256).
  With ``PassConfig.split_r`` (DeltaNet at K = 64) R is the pair ``R_hi + R_lo`` in the state
  update (one more WGMMA per key block, same round trip) and in WG1's ``P R`` (one more there).
* WG1 (output) builds ``Ag`` in place of T0 for WG0, then
      O = scale · (Γ Q S + (Q Kᵀ ⊙ exp2(G_i − G_j))_{j ≤ i} R)
  from the published tiles and stores it with TMA.
* WG2 (memory) streams q, k, v, T0, the gates and β with TMA into ``stages`` buffers (q into a
  ring of its own with ``PassConfig.q_stages``, K = 256: WG1 alone reads it and frees it earlier).

Neither W, R nor the chunk states reach HBM, unless ``save_states`` asks for the chunk start states
(``[B, H, N, V, K]`` in the input dtype; the backward's ``save`` policy reads them) and ``save_r``
for R (``[B, Tp, H, V]``, K = 256: the blocked per-chunk gradient kernel reads it). The
``recompute`` policy's backward runs this kernel again with ``out_o=False``: the chain and Ag
only, for the chunk start states, in one launch with the reverse state pass (:func:`forward_part`,
launch.py). In value rows every left operand of the chain comes from
registers, so no chain product waits for a store and fence (WG1's tiles are stored while the
next product runs); in key rows the state, W and R are right operands and are staged.
Math: docs/math.md (§ chunked forward); this is the scalar-gate, gate-free-inverse form of it.

Reads:  q (not with ``out_o=False``), k [B, Tp, H, K]; v [B, Tp, H, V]; t0 [B, H, Tp, C]; g2, beta [B, H, Tp] fp32;
        h0t [B, H, V, K] fp32 (optional).
Writes: o [B, Tp, H, V] (``out_o``); final state ᵀ [B, H, V, K] fp32 (optional); chunk states (optional).

Packed sequences (``meta``): B = 1, every sequence starts on a chunk boundary (the caller re-lays
them, rewy_jax.layout), and ``meta [N, META]`` int32 holds per chunk (reset, slot, end, 0...): at a
reset chunk WG0 loads its start state from ``h0t[slot]``, after an end chunk it stores the state
to ``final[slot]``; ``h0t`` and the final states are ``[n_slots, H, V, K]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu.common import (
    blocks_times_t, C, COLS, F32, META, ROWS, WGMMA, causal_decay, cols_of, finish_together, key_block,
    memory_warpgroup, mma, mma_group, mma_sum, put, rows_of, smem, stage, stage_blocks, replace_where, start_state,
    store_state, vectors)
from pallas_kernels.mosaic_gpu.launch import Part, launch
from pallas_kernels.mosaic_gpu.config import PassConfig


def fused_forward(q, k, v, t0, g2, beta, h0t, *, scale: float, cfg: PassConfig,
                  out_final: bool, save_states: bool, meta=None, interpret=None, out_o: bool = True,
                  save_r: bool = False):
    """``(o [B, Tp, H, V] | None, final ᵀ [B, H, V, K] fp32 | None, states [B, H, N, V, K] | None)``,
    and with ``save_r`` also R ``[B, Tp, H, V]`` (input dtype, the R of every chunk as WG1 reads it).

    ``g2`` is ``None`` for DeltaNet (no gate); ``h0t`` is ``None`` for a zero initial state.
    ``out_o=False`` is the backward's state recompute: WG1 only builds Ag and hands the published
    tiles back (no Q Kᵀ, no output products, q never loaded, no o written).
    """
    B, _, H, _ = k.shape
    part = forward_part(q, k, v, t0, g2, beta, h0t, scale=scale, cfg=cfg, out_final=out_final,
                        save_states=save_states, meta=meta, out_o=out_o, save_r=save_r)
    (outs,) = launch([part], B, H, interpret=interpret)
    o = outs.pop(0) if out_o else None
    final = outs.pop(0) if out_final else None
    states = outs.pop(0) if save_states else None
    return (o, final, states) + ((outs.pop(0),) if save_r else ())


def forward_part(q, k, v, t0, g2, beta, h0t, *, scale: float, cfg: PassConfig, out_final: bool,
                 save_states: bool, meta=None, out_o: bool = True, save_r: bool = False) -> Part:
    """This kernel as a :class:`launch.Part` (arguments as for :func:`fused_forward`; its
    outputs are o if ``out_o``, the final state if ``out_final``, the states if ``save_states``,
    R if ``save_r``, in that order; ``save_r`` stores each chunk's R beside its start state, for
    the blocked per-chunk gradient kernel, value rows only). The recompute policy's backward
    launches the states-only part beside the reverse state pass (state_backward.backward_passes)."""
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    N = Tp // C
    bv = cfg.block_v
    key_rows = cfg.key_rows
    # value rows: Sᵀ in key-column blocks [bv, kb]; key rows: S in 64-row blocks [64, bv]
    kb = C if key_rows else cfg.key_block(K)
    nkb = K // kb
    dtype = k.dtype
    gated = g2 is not None
    has_h0 = h0t is not None
    packed = meta is not None
    if packed and not (B == 1 and has_h0):
        raise ValueError("packed sequences need B == 1 and per-sequence initial states h0t")
    stages = cfg.stages
    split_r = cfg.split_r
    pub = cfg.publish_buffers  # copies of each published tile (PassConfig.publish_buffers)
    own_q = out_o and cfg.q_stages is not None  # q in a TMA ring of its own (PassConfig.q_stages)

    out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), dtype)] if out_o else []
    if out_final:
        out_type.append(jax.ShapeDtypeStruct(
            h0t.shape if packed else ((B, H, K, V) if key_rows else (B, H, V, K)), F32))
    if save_states:
        out_type.append(jax.ShapeDtypeStruct((B, H, N, V, K), dtype))
    if save_r:
        if key_rows or not save_states:
            raise ValueError("save_r stores R beside the chunk states, in the value-rows layout only")
        out_type.append(jax.ShapeDtypeStruct((B, Tp, H, V), dtype))
    # WG0's TMA stores per chunk (its start state, R): the bulk groups between two uses of a buffer
    n_stores = save_states + save_r
    n_copies = 4 + (out_o and not own_q) + gated + packed  # (q), k, v, t0, beta (+ g) (+ meta)
    # A WGMMA's operands share one swizzle: [C, 32] tiles (block_v = 32) allow at most 64 bytes.
    tile = lambda shape: smem(shape, dtype, 128 if bv == C else 64)  # noqa: E731
    scratch = dict(
        k_s=tile((stages, C, K)), v_s=tile((stages, C, bv)), t_s=tile((stages, C, C)),
        tl_s=tile((stages, C, C)), b_s=vectors(stages), g_s=vectors(stages),
        s_pub=tile((pub, bv, K)), r_pub=tile((pub, C, bv)),
    )
    if out_o:  # q and the output tile (not in the states-only recompute)
        scratch.update(q_s=tile((cfg.q_stages if own_q else stages, C, K)), o_out=tile((2, C, bv)))
    if key_rows:  # the chain's right operands W and the decayed R (value rows: registers)
        scratch["w_stage"] = tile((C, bv))
    if split_r and (out_o or key_rows):  # R_lo for P R_lo (WG1) and, in key rows, Kᵀ R_lo
        scratch["rl_pub"] = tile((pub, C, bv))
    if split_r and key_rows and gated:  # the decayed tail's lo half (the chain's right operand)
        scratch["wl_stage"] = tile((C, bv))
    if has_h0 or out_final:
        # one block of the fp32 state at a time
        scratch["state_s"] = smem((kb, bv) if key_rows else (bv, kb), F32)
    if packed:
        scratch["meta_s"] = plgpu.SMEM((stages, META), jnp.int32)
    barriers = dict(
        in_bar=plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ag_ready=plgpu.Barrier(num_barriers=stages),
        s_ready=plgpu.Barrier(num_barriers=pub), s_free=plgpu.Barrier(num_barriers=pub),
        state_bar=plgpu.Barrier(), done=plgpu.Barrier(num_arrivals=3),
    )
    if own_q:  # q's ring: loaded by WG2, read and released by WG1 alone
        barriers.update(q_bar=plgpu.Barrier(num_barriers=cfg.q_stages),
                        q_free=plgpu.Barrier(num_barriers=cfg.q_stages))

    def fused_forward_body(
            iv, *refs, k_s, v_s, t_s, tl_s, b_s, g_s, s_pub, r_pub, in_bar, in_free,
            ag_ready, s_ready, s_free, state_bar, done, q_s=None, o_out=None, w_stage=None,
            state_s=None, meta_s=None, rl_pub=None, wl_stage=None, q_bar=None, q_free=None):
        refs = list(refs)
        q_ref = refs.pop(0) if out_o else None
        k_ref, v_ref, t_ref, b_ref = (refs.pop(0) for _ in range(4))
        g_ref = refs.pop(0) if gated else None
        meta_ref = refs.pop(0) if packed else None
        h0_ref = refs.pop(0) if has_h0 else None
        o_ref = refs.pop(0) if out_o else None
        fin_ref = refs.pop(0) if out_final else None
        st_ref = refs.pop(0) if save_states else None
        rs_ref = refs.pop(0) if save_r else None
        b, h = lax.axis_index("b"), lax.axis_index("h")
        vcols = pl.ds(iv * bv, bv)
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            def copies(n):
                rows = pl.ds(n * C, C)
                if out_o and not own_q:
                    yield q_ref.at[b, rows, h], q_s
                yield from ((k_ref.at[b, rows, h], k_s),
                            (v_ref.at[b, rows, h, vcols], v_s), (t_ref.at[b, h, rows], t_s),
                            (b_ref.at[b, h, rows], b_s))
                if gated:
                    yield g_ref.at[b, h, rows], g_s
                if packed:
                    yield meta_ref.at[n], meta_s

            rings = [(copies, stages, in_bar, in_free)]
            if own_q:
                rings.append((lambda n: ((q_ref.at[b, pl.ds(n * C, C), h], q_s),), cfg.q_stages, q_bar, q_free))
            memory_warpgroup(rings, N)

        # WG0's state layout (PassConfig.key_rows): where block j of a state lives in GMEM, how
        # the blocks are published as Sᵀ [bv, K], and the chunk's three chain products.
        if key_rows:  # S [K, bv] as K/64 register tiles [64, bv] (key rows j·64 onwards)
            tile = (C, bv)

            def state_view(ref, i, j):  # h0 and the final state are [.., K, V] here
                return ref.at[i, h, pl.ds(j * C, C), vcols]

            def publish(ref, blocks):
                for j, x in enumerate(blocks):
                    key_block(ref, j, C).T[...] = x.astype(dtype)
                plgpu.commit_smem()
                return ref

            def update(slot, half, publish_start, s, n):
                publish_start()  # S is the right operand of K S: published first
                s_lo = s_pub.at[half]
                pred = mma(k_s.at[slot], s_lo.T, (C, bv))  # K S [C, bv]
                v_c = plgpu.load(v_s.at[slot], layout=WGMMA).astype(F32)
                if gated:
                    g_row = plgpu.load(g_s.at[slot], layout=ROWS)
                    g_last = g_s[slot, C - 1]
                    w = v_c - pred * rows_of(jnp.exp2(g_row), (C, bv))
                else:
                    w = v_c - pred
                plgpu.barrier_wait(ag_ready.at[slot])
                w_s = stage(w_stage, w)  # R = (Ag_hi + Ag_lo) W
                r = mma_sum(((t_s.at[slot], w_s), (tl_s.at[slot], w_s)), (C, bv))
                r_hi = r.astype(dtype)
                r_pub.at[half][...] = r_hi
                if split_r:  # R = R_hi + R_lo (PassConfig.split_r)
                    rl_pub.at[half][...] = (r - r_hi.astype(F32)).astype(dtype)
                # S ← γ_C S + Kᵀ (t ⊙ R): every 64-row block in one round trip; the decayed tail
                # is stored beside R, under the same fence
                if gated:
                    tail = r * rows_of(jnp.exp2(g_last - g_row), (C, bv))
                    tail_hi = tail.astype(dtype)
                    tails = (put(w_stage, tail_hi),)
                    if split_r:
                        tails += (put(wl_stage, (tail - tail_hi.astype(F32)).astype(dtype)),)
                    decay_c = jnp.exp2(g_last)
                else:
                    tails = (r_pub.at[half],) + ((rl_pub.at[half],) if split_r else ())
                    decay_c = None
                plgpu.commit_smem()
                plgpu.barrier_arrive(s_ready.at[half])
                upd = mma_group(tuple((tuple((key_block(k_s.at[slot], j, C).T, t) for t in tails), (C, bv))
                                      for j in range(nkb)))
                return tuple(u + (x if decay_c is None else x * decay_c) for u, x in zip(upd, s))
        else:  # Sᵀ [bv, K] as nkb register tiles [bv, kb] (key columns j·kb onwards)
            tile = (bv, kb)

            def state_view(ref, i, j):
                return key_block(ref.at[i, h, vcols], j, kb)

            def publish(ref, blocks):
                return stage_blocks(ref, blocks, kb)

            def update(slot, half, publish_start, s_t, n):
                # Every left operand of the chain comes from registers (Sᵀ, Wᵀ, then Rᵀ or its
                # decayed tail), so no product waits for a store and fence: the tiles published
                # for WG1 (S, then R) are stored while the product after them runs.
                pred = mma_sum(blocks_times_t(s_t, k_s.at[slot], kb, dtype), (bv, C),
                               between=publish_start)  # Sᵀ Kᵀ
                v_t = plgpu.load(v_s.at[slot].T, layout=WGMMA).astype(F32)
                if gated:
                    g_col = plgpu.load(g_s.at[slot], layout=COLS)
                    g_last = g_s[slot, C - 1]
                    w_t = v_t - pred * cols_of(jnp.exp2(g_col), (bv, C))
                else:
                    w_t = v_t - pred
                plgpu.barrier_wait(ag_ready.at[slot])
                w_lo = w_t.astype(dtype)  # Rᵀ = Wᵀ (Ag_hi + Ag_lo)ᵀ
                r_t = mma_sum(((w_lo, t_s.at[slot].T), (w_lo, tl_s.at[slot].T)), (bv, C))

                def halves(x):  # x as its 16-bit left operands: (hi,), or (hi, lo) with split_r
                    x_hi = x.astype(dtype)
                    return (x_hi, (x - x_hi.astype(F32)).astype(dtype)) if split_r else (x_hi,)

                r_halves = halves(r_t)

                def publish_r():
                    if save_r:  # the TMA store of chunk n − pub's R has read r_pub[half]
                        plgpu.wait_smem_to_gmem(n_stores * pub - 1, wait_read_only=True)
                    r_pub.at[half].T[...] = r_halves[0]
                    if split_r and out_o:  # R_lo for WG1's P R_lo
                        rl_pub.at[half].T[...] = r_halves[1]
                    plgpu.commit_smem()
                    if save_r:
                        plgpu.copy_smem_to_gmem(r_pub.at[half], rs_ref.at[b, pl.ds(n * C, C), h, vcols])
                    plgpu.barrier_arrive(s_ready.at[half])

                # The state update, one key block at a time (one fresh [BV, kb] accumulator live).
                if gated:
                    tails = halves(r_t * cols_of(jnp.exp2(g_last - g_col), (bv, C)))
                    return tuple(mma_sum(tuple((t, key_block(k_s.at[slot], j, kb)) for t in tails), (bv, kb),
                                         acc=s_t[j] * jnp.exp2(g_last), between=publish_r if j == 0 else None)
                                 for j in range(nkb))
                tails = r_halves
                return tuple(mma_sum(tuple((t, key_block(k_s.at[slot], j, kb)) for t in tails), (bv, kb),
                                     acc=s_t[j], between=publish_r if j == 0 else None) for j in range(nkb))

        @pl.when(wg == 0)
        def _state_chain():
            plgpu.set_max_registers(232, action="increase")
            src = (lambda j: state_view(h0_ref, b, j)) if has_h0 and not packed else None
            s0 = start_state(state_s, src, state_bar, tile, nkb)

            def step(n, s_t):
                slot, half = lax.rem(n, stages), lax.rem(n, pub)
                plgpu.barrier_wait(in_bar.at[slot])

                def wait_published_free():  # WG1 is done with the tiles published pub chunks ago
                    @pl.when(n >= pub)
                    def _():
                        plgpu.barrier_wait(s_free.at[half])

                if pub == 2:  # a free buffer: wait now, before the chunk's first product
                    wait_published_free()

                if packed:  # a sequence starts here: its initial state replaces the carry
                    reset, seq = meta_s[slot, 0], meta_s[slot, 1]
                    s_t = replace_where(reset, s_t, lambda j: state_view(h0_ref, seq, j), state_s,
                                        state_bar)

                def publish_start():  # the chunk start state: WG1's Q S0, the saved states
                    if pub == 1:  # one buffer: wait only now, with the first product issued
                        wait_published_free()
                    if save_states:  # the TMA store of chunk n − pub's state has read s_pub[half]
                        plgpu.wait_smem_to_gmem(n_stores * pub - 1, wait_read_only=True)
                    publish(s_pub.at[half], s_t)
                    if save_states:
                        plgpu.copy_smem_to_gmem(s_pub.at[half], st_ref.at[b, h, n, vcols])

                s_new = update(slot, half, publish_start, s_t, n)
                if packed and out_final:  # a sequence ends here: store its final state
                    end, seq = meta_s[slot, 2], meta_s[slot, 1]

                    @pl.when(end == 1)
                    def _():  # (an earlier sequence's final store may still read state_s)
                        store_state(state_s, s_new, lambda j: state_view(fin_ref, seq, j),
                                    wait_first=True)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            s_t = lax.fori_loop(0, N, step, s0)
            for n in range(max(N - pub, 0), N):  # observe WG1's last releases of the published tiles
                plgpu.barrier_wait(s_free.at[n % pub])
            if out_final and not packed:  # no earlier store read state_s
                store_state(state_s, s_t, lambda j: state_view(fin_ref, b, j), wait_first=False)
            plgpu.wait_smem_to_gmem(0)


        @pl.when(wg == 1)
        def _output():
            plgpu.set_max_registers(232, action="increase")

            def step(n, carry):
                slot, half = lax.rem(n, stages), lax.rem(n, pub)
                o_half = half if pub == 2 else lax.rem(n, 2)  # the output tile is double-buffered
                plgpu.barrier_wait(in_bar.at[slot])
                if gated:
                    g_row = plgpu.load(g_s.at[slot], layout=ROWS)
                    decay = causal_decay(g_row, plgpu.load(g_s.at[slot], layout=COLS), strict=False)
                else:
                    decay = causal_decay(None, None, strict=False)
                # Ag = T0 ⊙ exp2(G_i − G_j) ⊙ β_j (j ≤ i) replaces T0 in its buffer for WG0, as
                # the pair Ag_hi + Ag_lo: a single rounding of Ag was the largest of the forward's
                # bf16 error sources (docs/mosaic-gpu.md, accuracy).
                beta_c = cols_of(plgpu.load(b_s.at[slot], layout=COLS), (C, C))
                ag = plgpu.load(t_s.at[slot], layout=WGMMA).astype(F32) * decay * beta_c
                ag_hi = ag.astype(dtype)
                t_s.at[slot][...] = ag_hi
                tl_s.at[slot][...] = (ag - ag_hi.astype(F32)).astype(dtype)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ag_ready.at[slot])
                if not out_o:  # the state recompute: only Ag was needed
                    plgpu.barrier_wait(s_ready.at[half])
                    plgpu.barrier_arrive(s_free.at[half])
                    plgpu.barrier_arrive(in_free.at[slot])
                    return carry
                q_slot = lax.rem(n, cfg.q_stages) if own_q else slot
                if own_q:
                    plgpu.barrier_wait(q_bar.at[q_slot])
                # P, the left operand of P R, stays in registers (never staged)
                p = (mma(q_s.at[q_slot], k_s.at[slot].T, (C, C)) * decay).astype(dtype)
                plgpu.barrier_wait(s_ready.at[half])
                qs0 = ((q_s.at[q_slot], s_pub.at[half].T),)  # Q S0
                pr = ((p, r_pub.at[half]),) + (((p, rl_pub.at[half]),) if split_r else ())  # P R
                if gated:  # Γ Q S0 + P R: two accumulators, one round trip
                    o, pr = mma_group(((qs0, (C, bv)), (pr, (C, bv))))
                    o = o * rows_of(jnp.exp2(g_row), (C, bv)) + pr
                else:
                    o = mma_sum(qs0 + pr, (C, bv))
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                if own_q:
                    plgpu.barrier_arrive(q_free.at[q_slot])
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # chunk n − 2's store read o_out[o_half]
                o_out.at[o_half][...] = (o * scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_out.at[o_half], o_ref.at[b, pl.ds(n * C, C), h, vcols])
                return carry

            lax.fori_loop(0, N, step, None)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = ([q] if out_o else []) + [k, v, t0, beta] + ([g2] if gated else []) + ([meta] if packed else [])
    args += [h0t] if has_h0 else []
    return Part(args=tuple(args), out_type=tuple(out_type), smem=scratch, barriers=barriers,
                blocks=V // bv, warpgroups=3, body=fused_forward_body)
