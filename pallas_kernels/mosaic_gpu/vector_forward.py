"""Fused state pass + output of the vector-gate forward (KDA, GDN2), and the forward's entry.

Pipeline:  vector_prep.py (XLA)  ->  vector_chunk.py (per chunk: W, U, Qγ, K_tail, P)  ->
**vector_state_output** (this kernel). :func:`vector_forward` runs the three.

One CTA per ``(b, h, 64 value columns)`` walks its chunks in order with three warpgroups:

* WG0 (state chain, 232 registers) keeps ``Sᵀ [BV, K]`` fp32 in registers. Per chunk:
      Rᵀ = Uᵀ − Sᵀ Wᵀ                                  (one WGMMA)
      Sᵀ ← Sᵀ Diag(2^{G_C}) + Rᵀ K_tail                 (one WGMMA; the decay per key column)
  and publishes ``Sᵀ`` (the chunk start state) and ``R`` in the input dtype through
  double-buffered SMEM. The gates were folded into W, K_tail by vector_chunk, so the serial chain
  is two products per chunk (the scalar-gate forward.py has three: it builds R from the inverse).
* WG1 (output, 232 registers): ``O = Qγ S0 + P R`` (two WGMMAs into one accumulator; scale is
  folded into Qγ and P) from the published tiles, stored with TMA.

Per chunk: 4 WGMMAs in 3 round trips (before grouping 4): the chain's two depend on each other,
the output's two share one accumulator.
* WG2 (memory, 40 registers) streams W, K_tail, Qγ ``[C, K]``, U ``[C, 64]``, P ``[C, C]`` and
  the chunk's last row of G ``[K]`` fp32 into ``stages`` buffers.

Neither R nor the chunk states reach HBM.
SMEM (config.vector_state_smem_bytes): per stage 3·C·K + C·64 + C·C 16-bit values and K fp32;
fixed: published Sᵀ and R (two each), ``out_buffers`` output tiles, the fp32 state tile for h0 and
the final state. K = 128: 2 stages, one output tile, 217 KiB; K = 64: 3 stages, two, 185 KiB.
K = 256 (``cfg.state.k_block = 64``): WG0 holds ``Sᵀ`` as four ``[64, 64]`` register blocks and
updates them one WGMMA per block (the whole width and its fresh accumulator would be 256
registers a thread); h0 and the final state pass through one fp32 ``[64, 64]`` block of SMEM;
1 stage, one output tile, 217 KiB.

Reads:  w, kt, qg [B, H, Tp, K]; u [B, H, Tp, V]; p [B, H, Tp, C]; g2 [B, H, Tp, K] fp32 (row
        C − 1 of each chunk); h0t [B, H, V, K] fp32 (optional).
Writes: o [B, Tp, H, V]; final state ᵀ [B, H, V, K] fp32 (optional); with ``save_states`` (for the
        backward) WG0 also stores each chunk's start state ᵀ [B, H, N, V, K] and R [B, Tp, H, V]
        (input dtype) from the tiles it publishes anyway.

Packed sequences (``meta``), as in forward.py: B = 1, every sequence starts on a chunk boundary
(the caller re-lays them, rewy_jax.layout), and ``meta [N, META]`` int32 holds per chunk (reset,
slot, end, 0...): at a reset chunk WG0 loads its start state from ``h0t[slot]``, after an end
chunk it stores the state to ``final[slot]``; ``h0t`` and the final states are
``[n_slots, H, V, K]``. Padding rows between sequences are zeros (k = v = 0, gates 0: W, U,
K_tail rows 0 and 2^{G} = 1), so they leave the state unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat
from pallas_kernels.mosaic_gpu.launch import Part, launch
from pallas_kernels.mosaic_gpu.common import (
    blocks_times_t, C, COLS, DTYPES, F32, META, WGMMA, cols_of, finish_together, key_block, memory_warpgroup, mma, mma_sum,
    replace_where, smem, stage_blocks, start_state, store_state)
from pallas_kernels.mosaic_gpu.config import VectorConfig, default_vector_config
from pallas_kernels.mosaic_gpu.vector_chunk import vector_chunk
from pallas_kernels.mosaic_gpu.vector_prep import centred_ok, prepare_vector

HEAD_DIMS = (64, 128, 256)


def vector_state_output(w, u, qg, kt, p, g2, h0t, *, cfg: VectorConfig, out_final: bool,
                        save_states: bool = False, meta=None, interpret=None):
    """``(o [B, Tp, H, V], final ᵀ [B, H, V, K] fp32 | None)``, and with ``save_states`` also
    ``(states [B, H, N, V, K], r [B, Tp, H, V])`` in the input dtype: each chunk's start state
    (transposed, as published for the output warpgroup) and its residual R, which the backward
    reads (vector_chunk_backward.py). See the module docstring. ``h0t`` is ``None`` for a zero
    initial state; ``meta``: packed sequences (module docstring), with ``h0t`` and the final
    states per slot."""
    B, H = w.shape[:2]
    part = vector_state_part(w, u, qg, kt, p, g2, h0t, cfg=cfg, out_final=out_final,
                             save_states=save_states, meta=meta)
    (outs,) = launch([part], B, H, interpret=interpret)
    if save_states:
        return outs[0], (outs[1] if out_final else None), outs[-2], outs[-1]
    return outs[0], (outs[1] if out_final else None)


def vector_state_part(w, u, qg, kt, p, g2, h0t, *, cfg: VectorConfig, out_final: bool,
                      save_states: bool = False, meta=None, out_o: bool = True) -> Part:
    """This kernel as a :class:`launch.Part` (arguments as for :func:`vector_state_output`;
    outputs o if ``out_o``, the final state if ``out_final``, the states and R if
    ``save_states``, in that order). ``out_o=False`` is the recompute policy's states-only pass
    (no Qγ, P loads, no output products, no o): vector_api launches it beside the reverse state
    pass."""
    B, H, Tp, K = w.shape
    V = u.shape[-1]
    N = Tp // C
    bv = cfg.state.block_v
    stages = cfg.state.stages
    kb = cfg.state.key_block(K)  # key columns per register block of the state
    nkb = K // kb
    n_out = cfg.out_buffers
    dtype = w.dtype
    has_h0 = h0t is not None
    packed = meta is not None
    if packed and not (B == 1 and has_h0):
        raise ValueError("packed sequences need B == 1 and per-sequence initial states h0t")

    out_type = [jax.ShapeDtypeStruct((B, Tp, H, V), dtype)] if out_o else []
    if out_final:
        out_type.append(jax.ShapeDtypeStruct(h0t.shape if packed else (B, H, V, K), F32))
    if save_states:
        out_type += [jax.ShapeDtypeStruct((B, H, N, V, K), dtype), jax.ShapeDtypeStruct((B, Tp, H, V), dtype)]
    scratch = dict(
        w_s=smem((stages, C, K), dtype), kt_s=smem((stages, C, K), dtype), u_s=smem((stages, C, bv), dtype),
        gl_s=plgpu.SMEM((stages, K), F32), s_pub=smem((2, bv, K), dtype), r_pub=smem((2, C, bv), dtype),
    )
    if out_o:  # the output's operands and tile
        scratch.update(qg_s=smem((stages, C, K), dtype), p_s=smem((stages, C, C), dtype),
                       o_out=smem((n_out, C, bv), dtype))
    if has_h0 or out_final:
        scratch["state_s"] = smem((bv, kb), F32)  # one block of h0 / the final state at a time
    if packed:
        scratch["meta_s"] = plgpu.SMEM((stages, META), jnp.int32)
    barriers = dict(
        in_bar=plgpu.Barrier(num_arrivals=4 + 2 * out_o + packed, num_barriers=stages),
        in_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        s_ready=plgpu.Barrier(num_barriers=2), s_free=plgpu.Barrier(num_barriers=2),
        state_bar=plgpu.Barrier(), done=plgpu.Barrier(num_arrivals=3),
    )

    def vector_state_output_body(iv, *refs, w_s, kt_s, u_s, gl_s, s_pub, r_pub, in_bar, in_free,
                                 s_ready, s_free, state_bar, done, qg_s=None, p_s=None, o_out=None,
                                 state_s=None, meta_s=None):
        refs = list(refs)
        w_ref, u_ref, qg_ref, kt_ref, p_ref, g_ref = (refs.pop(0) for _ in range(6))
        meta_ref = refs.pop(0) if packed else None
        h0_ref = refs.pop(0) if has_h0 else None
        o_ref = refs.pop(0) if out_o else None
        fin_ref = refs.pop(0) if out_final else None
        st_ref, r_ref = (refs.pop(0), refs.pop(0)) if save_states else (None, None)
        b, h = lax.axis_index("b"), lax.axis_index("h")
        vcols = pl.ds(iv * bv, bv)
        wg = lax.axis_index("wg")

        @pl.when(wg == 2)
        def _memory():
            def copies(n):
                rows = pl.ds(n * C, C)
                yield from ((w_ref.at[b, h, rows], w_s), (kt_ref.at[b, h, rows], kt_s),
                            (u_ref.at[b, h, rows, vcols], u_s))
                if out_o:
                    yield from ((qg_ref.at[b, h, rows], qg_s), (p_ref.at[b, h, rows], p_s))
                yield g_ref.at[b, h, n * C + C - 1], gl_s
                if packed:
                    yield meta_ref.at[n], meta_s

            memory_warpgroup([(copies, stages, in_bar, in_free)], N)

        @pl.when(wg == 0)
        def _state_chain():
            plgpu.set_max_registers(232, action="increase")
            src = (lambda j: key_block(h0_ref.at[b, h, vcols], j, kb)) if has_h0 and not packed else None
            s0 = start_state(state_s, src, state_bar, (bv, kb), nkb)

            def step(n, s_t):
                slot, half = lax.rem(n, stages), lax.rem(n, 2)
                plgpu.barrier_wait(in_bar.at[slot])

                @pl.when(n >= 2)
                def _():  # WG1 is done with the tiles published two chunks ago
                    plgpu.barrier_wait(s_free.at[half])

                if packed:  # a sequence starts here: its initial state replaces the carry
                    reset, seq = meta_s[slot, 0], meta_s[slot, 1]
                    s_t = replace_where(reset, s_t, lambda j: key_block(h0_ref.at[seq, h, vcols], j, kb),
                                        state_s, state_bar)

                # The chain's left operands (Sᵀ, Rᵀ) come from registers, so no product waits for
                # a store and fence: the tiles published for WG1 (and the saved states) are stored
                # while the product after them runs.
                def publish_s():  # the chunk start state
                    if save_states:  # the stores from this half, two chunks ago, have read it
                        plgpu.wait_smem_to_gmem(2, wait_read_only=True)
                    stage_blocks(s_pub.at[half], s_t, kb)
                    if save_states:
                        plgpu.copy_smem_to_gmem(s_pub.at[half], st_ref.at[b, h, n, vcols])

                pred = mma_sum(blocks_times_t(s_t, w_s.at[slot], kb, dtype), (bv, C),
                               between=publish_s)  # Sᵀ Wᵀ = (W S)ᵀ
                r_t = plgpu.load(u_s.at[slot].T, layout=WGMMA).astype(F32) - pred  # Rᵀ
                r_lo = r_t.astype(dtype)

                def publish_r():
                    r_pub.at[half].T[...] = r_lo
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(s_ready.at[half])
                    if save_states:
                        plgpu.copy_smem_to_gmem(r_pub.at[half], r_ref.at[b, pl.ds(n * C, C), h, vcols])

                s_new = []
                for j, s_j in enumerate(s_t):  # block by block: one block's fresh accumulator live
                    decay = cols_of(jnp.exp2(plgpu.load(key_block(gl_s.at[slot], j, kb), layout=COLS)),
                                    (bv, kb))  # 2^{G_C} per key
                    s_new.append(mma(r_lo, key_block(kt_s.at[slot], j, kb), (bv, kb),
                                     acc=s_j * decay, between=publish_r if j == 0 else None))
                s_new = tuple(s_new)
                if packed and out_final:  # a sequence ends here: store its final state
                    end, seq = meta_s[slot, 2], meta_s[slot, 1]

                    @pl.when(end == 1)
                    def _():  # (an earlier sequence's final store may still read state_s)
                        store_state(state_s, s_new, lambda j: key_block(fin_ref.at[seq, h, vcols], j, kb),
                                    wait_first=True)
                plgpu.barrier_arrive(in_free.at[slot])
                return s_new

            s_t = lax.fori_loop(0, N, step, s0)
            for n in range(max(N - 2, 0), N):  # observe WG1's last releases of the published tiles
                plgpu.barrier_wait(s_free.at[n % 2])
            if out_final and not packed:  # no earlier store read state_s
                store_state(state_s, s_t, lambda j: key_block(fin_ref.at[b, h, vcols], j, kb), wait_first=False)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _output():
            plgpu.set_max_registers(232, action="increase")

            def step(n, carry):
                slot, half, ob = lax.rem(n, stages), lax.rem(n, 2), lax.rem(n, n_out)
                plgpu.barrier_wait(in_bar.at[slot])
                plgpu.barrier_wait(s_ready.at[half])
                if not out_o:  # the states-only pass: hand the published tiles back
                    plgpu.barrier_arrive(s_free.at[half])
                    plgpu.barrier_arrive(in_free.at[slot])
                    return carry
                # Qγ S0 + P R in one accumulator (scale inside Qγ and P)
                o = mma_sum(((qg_s.at[slot], s_pub.at[half].T), (p_s.at[slot], r_pub.at[half])), (C, bv))
                plgpu.barrier_arrive(s_free.at[half])
                plgpu.barrier_arrive(in_free.at[slot])
                plgpu.wait_smem_to_gmem(n_out - 1, wait_read_only=True)  # o_out[ob] has been sent
                o_out.at[ob][...] = o.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_out.at[ob], o_ref.at[b, pl.ds(n * C, C), h, vcols])
                return carry

            lax.fori_loop(0, N, step, None)
            plgpu.wait_smem_to_gmem(0)

        finish_together(done)

    args = [w, u, qg, kt, p, g2] + ([meta] if packed else []) + ([h0t] if has_h0 else [])
    return Part(args=tuple(args), out_type=tuple(out_type), smem=scratch, barriers=barriers,
                blocks=V // bv, warpgroups=3, body=vector_state_output_body)


def vector_forward(q, k, v, g, beta=None, b=None, w=None, h0=None, *, scale: float | None = None,
                   gate_lower_bound: float | None = None, output_final_state: bool = True,
                   cfg: VectorConfig | None = None, interpret: bool = False):
    """The KDA / GDN2 forward on the Mosaic GPU kernels: ``(o [B, T, H, V], final | None)``.

    q, k: [B, T, H, K], v: [B, T, H, V] (bf16; q and k as the recurrence reads
    them, e.g. already L2-normalised); g: [B, T, H, K] natural-log decays ≤ 0. KDA: ``beta``
    [B, T, H]; GDN2: ``b`` [B, T, H, K] (erase) and ``w`` [B, T, H, V] (write), all in [0, 2].
    h0: [B, H, K, V] fp32 or None; final: [B, H, K, V] fp32. ``scale`` defaults to K^−1/2.
    ``gate_lower_bound``: a declared bound on g (g is clamped to it); ≥ −5 takes the centred
    diagonal blocks (vector_prep.py). K = V ∈ {64, 128, 256}. Forward only (the differentiable op is
    vector_api.vector_delta_rule).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if (beta is None) == (b is None or w is None):
        raise ValueError("pass beta (KDA) or both b and w (GDN2)")
    if K not in HEAD_DIMS or V != K:
        raise ValueError(f"vector_forward takes K = V in {HEAD_DIMS}, got K={K}, V={V}")
    if jnp.dtype(v.dtype) not in DTYPES:
        raise ValueError(f"vector_forward takes bf16 or fp16 inputs, got {jnp.dtype(v.dtype).name}")
    scale = K ** -0.5 if scale is None else float(scale)
    if cfg is None:
        cfg = default_vector_config(K, V, jnp.dtype(v.dtype).itemsize, centred_ok(gate_lower_bound))
    elif cfg.centred and not centred_ok(gate_lower_bound):
        raise ValueError("VectorConfig.centred needs a declared gate_lower_bound >= -5")
    ip = compat.interpret_params(interpret)
    with compat.x32():
        prep = prepare_vector(q, k, v, g, beta, b, w, gate_lower_bound=gate_lower_bound,
                              interpret=bool(interpret))
        w_, u_, qg, kt, p = vector_chunk(*prep, scale=scale, centred=cfg.centred, interpret=ip)
        g2 = prep[3]
        h0t = None if h0 is None else jnp.swapaxes(h0.astype(F32), -1, -2)
        o, final_t = vector_state_output(w_, u_, qg, kt, p, g2, h0t, cfg=cfg, out_final=output_final_state,
                                         interpret=ip)
    return o[:, :T], (None if final_t is None else jnp.swapaxes(final_t, -1, -2))
