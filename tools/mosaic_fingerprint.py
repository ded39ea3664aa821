"""The Mosaic GPU kernels as traced programs, as text: one file per (kernel, D, variant) case.

    JAX_PLATFORMS=cpu python -m tools.mosaic_fingerprint /tmp/before   # on the old commit
    JAX_PLATFORMS=cpu python -m tools.mosaic_fingerprint /tmp/after    # on the new one
    diff -r /tmp/before /tmp/after                                     # empty: same kernels

Each case is the jaxpr of the kernel call (the kernel body, grid, scratch and compiler parameters
included; no source locations, unlike the lowered module), traced on the CPU, not run: how a
change to the shared kernel code shows that it leaves the kernels the GPU has timed and checked
unchanged (the scalar-gate pipeline at K = V in {64, 128}: T0, fused forward, reverse state
pass, per-chunk gradients (ReWY on one or two warpgroups, and the seven-product "-wy" body);
gated and not, packed and not, both policies' forward, the fused forward and the reverse state
pass in both state layouts (value rows, key rows); and the vector-gate kernels of KDA/GDN2).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic_gpu import compat, config
from pallas_kernels.mosaic_gpu.chunk_backward import chunk_backward
from pallas_kernels.mosaic_gpu.chunk_inverse import chunk_inverse
from pallas_kernels.mosaic_gpu.common import META
from pallas_kernels.mosaic_gpu.forward import fused_forward
from pallas_kernels.mosaic_gpu.state_backward import state_backward

BF16 = jnp.bfloat16


def cases():
    """(name, function, argument structs) for every kernel variant at D in {64, 128}."""
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    out = []
    for D in (64, 128):
        cfg = config.default_config(D, D, 2)
        for gated in (False, True):
            for packed in (False, True):
                B, T, H = (1 if packed else 2), 256, 2
                N = T // 64
                tok, t0, vec = S((B, T, H, D), BF16), S((B, H, T, 64), BF16), S((B, H, T), f32)
                st = S((3, H, D, D) if packed else (B, H, D, D), f32)
                states = S((B, H, N, D, D), BF16)
                meta = jnp.zeros((N, META), jnp.int32) if packed else None
                slots = dict(n_slots=3) if packed else {}
                pick = (lambda g: g) if gated else (lambda g: None)
                tag = f"D{D}-{'gated' if gated else 'plain'}-{'packed' if packed else 'batch'}"
                for save in (False, True):
                    def fwd(q, k, v, t, g, b, h0, save=save, pick=pick, meta=meta):
                        return fused_forward(q, k, v, t, pick(g), b, h0, scale=0.1, cfg=cfg.forward,
                                             out_final=True, save_states=save, meta=meta)
                    out.append((f"forward-{tag}-save{int(save)}", fwd, [tok] * 3 + [t0, vec, vec, st]))
                # the key-rows layout (32 value columns: the default where the grid fits one
                # wave), with its states-only recompute
                kr = config.default_config(D, D, 2, heads=1).forward
                for save, out_o in ((False, True), (True, True), (True, False)):
                    def fwd_kr(q, k, v, t, g, b, h0, save=save, out_o=out_o, pick=pick, meta=meta, kr=kr):
                        return fused_forward(None if not out_o else q, k, v, t, pick(g), b, h0, scale=0.1,
                                             cfg=kr, out_final=out_o, save_states=save, meta=meta,
                                             out_o=out_o)
                    out.append((f"forward_key_rows-{tag}-save{int(save)}-o{int(out_o)}", fwd_kr,
                                [tok] * 3 + [t0, vec, vec, st]))

                def sbwd(q, k, do, t, g, b, df, pick=pick, meta=meta, slots=slots):
                    return state_backward(q, k, do, t, pick(g), b, df, scale=0.1,
                                          cfg=cfg.state_backward, meta=meta, **slots)
                out.append((f"state_backward-{tag}", sbwd, [tok] * 3 + [t0, vec, vec, st]))
                # the reverse state pass in the key-rows layout (dS [K, 32] in 64-row blocks; the
                # final-state cotangent and dh0 [.., K, V])
                skr = config.default_config(D, D, 2, heads=1).state_backward

                def sbwd_kr(q, k, do, t, g, b, df, pick=pick, meta=meta, slots=slots, skr=skr):
                    return state_backward(q, k, do, t, pick(g), b, df, scale=0.1, cfg=skr, meta=meta,
                                          **slots)
                out.append((f"state_backward_key_rows-{tag}", sbwd_kr, [tok] * 3 + [t0, vec, vec, st]))
                if not packed:
                    for bw in ("rewy", "wy"):  # wy: the seven-product body, for the ablation
                        cb_cfg = config.default_config(D, D, 2, backward=bw).chunk_backward

                        def cbwd(q, k, v, do, lam, s0, ds, t, g, b, pick=pick, cb_cfg=cb_cfg):
                            return chunk_backward(q, k, v, do, lam, s0, ds, t, pick(g), b, scale=0.1,
                                                  cfg=cb_cfg)
                        out.append((f"chunk_backward-{tag}" + ("-wy" if bw == "wy" else ""), cbwd,
                                    [tok] * 5 + [states] * 2 + [t0, vec, vec]))
                    # the two-warpgroup variant (ChunkBackwardConfig.warpgroups=2), for A/B timing
                    cfg2 = dataclasses.replace(cfg.chunk_backward, warpgroups=2)

                    def cbwd2(q, k, v, do, lam, s0, ds, t, g, b, pick=pick, cfg2=cfg2):
                        return chunk_backward(q, k, v, do, lam, s0, ds, t, pick(g), b, scale=0.1,
                                              cfg=cfg2)
                    out.append((f"chunk_backward_2wg-{tag}", cbwd2,
                                [tok] * 5 + [states] * 2 + [t0, vec, vec]))
        out.append((f"chunk_inverse-D{D}", lambda k, b: chunk_inverse(k, b),
                    [S((2, 256, 2, D), BF16), S((2, 2, 256), f32)]))
    return out


def vector_cases():
    """(name, function, argument structs) for the vector-gate (KDA, GDN2) kernels at D in
    {64, 128, 256}, exact and centred frames: the chunk kernel (and vector_wu, policy "recompute"'s
    W and U from the kept A), the state/output pass (with and without the saved states), the
    reverse state pass and the per-chunk gradients; at D ≤ 128 also the seven-product ablation's
    kernel and the gradient kernel reading its dT and dĒ (the "-wy" cases)."""
    from pallas_kernels.mosaic_gpu.vector_chunk import vector_chunk, vector_wu
    from pallas_kernels.mosaic_gpu.vector_chunk_backward import vector_chunk_backward
    from pallas_kernels.mosaic_gpu.vector_forward import vector_state_output
    from pallas_kernels.mosaic_gpu.vector_state_backward import vector_state_backward
    from pallas_kernels.mosaic_gpu.vector_wy import vector_wy_products

    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    B, T, H = 2, 256, 2
    N = T // 64
    out = []
    for D in (64, 128, 256):
        tok, g2, head = S((B, T, H, D), BF16), S((B, H, T, D), f32), S((B, H, T, D), BF16)
        cc, st, st32 = S((B, H, T, 64), BF16), S((B, H, N, D, D), BF16), S((B, H, D, D), f32)
        for centred in (False, True):
            cfg = config.default_vector_config(D, D, 2, centred)
            tag = f"D{D}-{'centred' if centred else 'exact'}"
            flags = [] if centred else [S((B, H, N, 32), jnp.int32)]  # per-chunk frames
            for op, erase in (("kda", S((B, H, T), f32)), ("gdn2", S((B, T, H, D), f32))):
                out.append((f"vector_chunk-{op}-{tag}",
                            lambda q, k, x, g, e, *fl, c=centred: vector_chunk(
                                q, k, x, g, e, *fl, scale=0.1, centred=c, out_inverse=True),
                            [tok, tok, tok, g2, erase] + flags))
                if centred:  # (no frames: once per D)
                    out.append((f"vector_wu-{op}-D{D}", lambda *a: vector_wu(*a, scale=0.1),
                                [tok, tok, tok, g2, erase, cc, cc]))
            for save in (False, True):
                out.append((f"vector_state_output-{tag}-save{int(save)}",
                            lambda *a, cfg=cfg, save=save: vector_state_output(
                                *a, cfg=cfg, out_final=not save, save_states=save),
                            [head, head, head, head, cc, g2, st32]))
            out.append((f"vector_state_backward-{tag}",
                        lambda *a, cfg=cfg: vector_state_backward(*a, cfg=cfg.state_backward),
                        [head, head, head, cc, tok, g2, st32]))
            nf = len(flags)
            grad_in = [tok, tok, g2, tok, tok, tok, st, st, cc, cc] + flags
            out.append((f"vector_chunk_backward-kda-{tag}",
                        lambda *a, c=centred, nf=nf: vector_chunk_backward(
                            *a[:10 + nf], scale=0.1, centred=c, kda_leaf=a[10 + nf:]),
                        grad_in + [S((B, H, T), f32), tok]))
            out.append((f"vector_chunk_backward-gdn2-{tag}",
                        lambda *a, c=centred, nf=nf: vector_chunk_backward(
                            *a[:10 + nf], scale=0.1, centred=c, gdn2_b=a[10 + nf]),
                        grad_in + [S((B, T, H, D), f32)]))
            if D <= 128:  # the seven-product ablation (backward="wy")
                out.append((f"vector_chunk_backward-{tag}-wy",
                            lambda *a, c=centred, nf=nf: vector_chunk_backward(
                                *a[:10 + nf], scale=0.1, centred=c, gdn2_b=a[10 + nf], wy=a[11 + nf:]),
                            grad_in + [S((B, T, H, D), f32), cc, S((B, T, H, D), f32)]))
        if D <= 128:
            for op, erase in (("kda", S((B, H, T), f32)), ("gdn2", S((B, T, H, D), f32))):
                out.append((f"vector_wy-{op}-D{D}", lambda *a: vector_wy_products(*a),
                            [cc, cc, tok, tok, st, tok, g2, erase]))
    return out


def main(out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    with compat.x32():
        for name, f, args in cases() + vector_cases():
            text = str(jax.make_jaxpr(f)(*args))
            with open(os.path.join(out_dir, name + ".jaxpr"), "w") as fh:
                fh.write(text)
            print(name, len(text), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
