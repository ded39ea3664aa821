"""Per-kernel times of the Pallas GPU kernels, under launch-setting variants (one GPU process).

    PYTHONPATH=$PWD python3 pallas_kernels/gpu/profile_kernels.py [--modes none,scalar,vector]
        [--variants base,w4,bvs64] [--shape 2x4096x16x128] [--out FILE]

Each kernel of the forward and the backward is jitted alone on random bf16 inputs of the anchor
shape and timed as the mean of 20 back-to-back launches (median of 5 such runs), so launch
gaps hide behind the previous kernel; the whole forward and forward+backward of
``api.general_delta`` are timed the same way, and fwd+bwd through the public op (deltanet, gdn
or kda for the three gate modes) — the gap to general_delta is the op's XLA glue. Variants set ``kernels.TUNE`` and the tile widths
of ``api`` before tracing. Kernel-work tooling, not the peer benchmark (benchmarks/).

The host loop's dispatch costs ~0.1 ms a call at the anchor, so kernels faster than that all
read ~0.1 ms here (profile-11: wu 0.101 against ncu's 0.065): compare variants of small kernels
with ``trace_op.py --variants``, which sums device events (profile-21). ``VARIANTS`` serves both.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gpu import api
from pallas_kernels.gpu import kernels as kn
from rewy_jax import testing

F32 = jnp.float32


def _stages(**kw):
    """kernels.DEFAULTS "state_pass.stages" with some passes' stages replaced."""
    return dict(kn.DEFAULTS["state_pass.stages"], **kw)


# variants that declare g >= -5 for the vector-gate ops (the centred diagonal blocks)
BOUNDED_VARIANTS = ("centred", "cw4", "qcent", "qw2")
# name -> (kernels.TUNE, api.DEFAULT_BV, api.DEFAULT_BV_STATE, api.DEFAULT_BK)
VARIANTS = {
    "base": ({}, 64, None, None),
    "w4": ({f"rewy_{k}.warps": 4 for k in ("intra", "fwd_pass", "output", "bwd_local", "bwd_pass",
                                           "bwd_dlam", "bwd_leaf")}, 64, None, None),
    "bvs64": ({}, 64, 64, None),
    "bv128": ({}, 128, None, None),
    "bk128": ({}, 64, None, 128),
    "st2": ({"rewy_fwd_pass.stages": 2, "rewy_bwd_pass.stages": 2}, 64, None, None),
    "bvs16": ({}, 64, 16, None),
    "centred": ({}, 64, None, None),  # vector gates: centred diagonal blocks (g ≥ −5 here)
    "cw4": ({f"rewy_{k}.warps": 4 for k in ("intra", "bwd_leaf", "qk_gram")}, 64, None, None),
    "lw4": ({"rewy_bwd_leaf.warps": 4}, 64, None, None),
    # the three shared-factor options, default since profile-5, switched off (one, or all):
    "nogramqk": ({"rewy_intra.gram_from_qk": False}, 64, None, None),  # intra builds its T
    "noshared": ({"rewy_bwd_leaf.shared_decay": False}, 64, None, None),
    "nojinv": ({"rewy_intra.joint_diag_inverse": False}, 64, None, None),
    "unprepared": ({"rewy_intra.gram_from_qk": False, "rewy_bwd_leaf.shared_decay": False,
                    "rewy_intra.joint_diag_inverse": False}, 64, None, None),
    "pairgrid": ({"rewy_qk_gram.pairgrid": True}, 64, None, None),  # qk_gram per block pair
    "qw8": ({"rewy_qk_gram.warps": 8}, 64, None, None),
    "pw8": ({"rewy_qk_gram.pairgrid": True, "rewy_qk_gram.warps": 8}, 64, None, None),
    # policy "recompute" re-forming A (and P) in the backward instead of keeping them
    "fullre": ({"recompute.keep_chunk_matrices": False}, 64, None, None),
    # the 16-step loops of intra and qk_gram unrolled at trace time (both, or one)
    "unroll": ({"rewy_intra.unroll": True, "rewy_qk_gram.unroll": True}, 64, None, None),
    "iunroll": ({"rewy_intra.unroll": True}, 64, None, None),
    "qunroll": ({"rewy_qk_gram.unroll": True}, 64, None, None),
    "chunkgrid": ({"rewy_bwd_leaf.rowgrid": False, "rewy_qk_gram.rowgrid": False}, 64, None,
                  None),  # one program per chunk (the row grids off)
    "loopleaf": ({"rewy_bwd_leaf.exact_diag": "loop"}, 64, None, None),
    "levels": ({f"rewy_{k}.exact_diag": "levels" for k in ("intra", "qk_gram", "bwd_leaf")},
               64, None, None),  # exact bit-level diagonals everywhere
    # the backward's stored tensors in bf16 (default: all): none, the two state tensors, all
    # but W and U, or all
    "fp32bwd": ({"backward.low_precision": ()}, 64, None, None),
    "lps": ({"backward.low_precision": ("S0", "dS")}, 64, None, None),
    "lp6": ({"backward.low_precision": ("S0", "R", "dS", "dR", "dRl", "lam")}, 64, None, None),
    "lpall": ({"backward.low_precision": kn.LOW_PRECISION_NAMES}, 64, None, None),
    "exp2": ({"exp2": True}, 64, None, None),  # e^x as one ex2.approx (blocks.exp)
    # and qk_gram's diagonal blocks by bit levels (4 masked matmuls, no 16-step loop)
    "qlevels2": ({"exp2": True, "rewy_qk_gram.exact_diag": "levels"}, 64, None, None),
    # or all pairs of a diagonal block at once per 16-channel key slice (blocks "outer")
    "qouter2": ({"exp2": True, "rewy_qk_gram.exact_diag": "outer"}, 64, None, None),
    "qouter": ({"rewy_qk_gram.exact_diag": "outer"}, 64, None, None),
    # the recompute forward's output formed inside its state pass (no S0, R stored)
    "fused": ({"fwd_pass.fused_output": True}, 64, None, None),
    # fused for no and vector gates only: scalar gates' forward as pass + output (profile-13)
    "unfusedscalar": ({"fwd_pass.fused_output": ("none", "vector")}, 64, None, None),
    "fused2": ({"fwd_pass.fused_output": True, "exp2": True,
                "rewy_qk_gram.exact_diag": "outer"}, 64, None, None),
    # qk_gram's Grams contracted over all K at once at 4 warps (before profile-10), or over
    # slices of 32 at 2 warps
    "noks": ({"rewy_qk_gram.kslice": 0, "rewy_qk_gram.warps": 4}, 64, None, None),
    "ks32": ({"rewy_qk_gram.kslice": 32}, 64, None, None),
    # intra's own key Gram (no or scalar gates) read as stored and over key slices of 16
    # (ptxas, DeltaNet: 221 -> 172 registers at 4 warps); dT and dA_qk kept in fp32 (their
    # bf16 storage, default since the eighth session, is untimed)
    "iks16": ({"rewy_intra.kslice": 16}, 64, None, None),
    "nodt": ({"backward.low_precision": tuple(
        n for n in kn.DEFAULTS["backward.low_precision"] if n != "dT")}, 64, None, None),
    # the same at 8 warps (ptxas: 128 registers, 4 B spilled: two programs of 8 warps per SM)
    "iks16w8": ({"rewy_intra.kslice": 16, "rewy_intra.warps": 8}, 64, None, None),
    # the vector leaf on key tiles of 32 at 4 warps (ptxas: 188 registers, no spills; tiles of
    # 64 at 8 warps hold 186, one program per SM): profile-11, default since; and the old tile
    "lk32w4": ({"rewy_bwd_leaf.warps": 4}, 64, None, 32),
    "lk32": ({"rewy_bwd_leaf.warps": 8}, 64, None, 32),
    "lk64": ({"rewy_bwd_leaf.warps": 8}, 64, None, 64),
    # no or scalar gates at K = 128: one key tile, so the leaf reads its [C, V] tiles (Λ, dO, R)
    # and dT, dA_qk once per chunk instead of once per tile of 64
    "lk128": ({"rewy_bwd_leaf.warps": 8}, 64, None, 128),
    # the leaf on key tiles of 16 at 4 warps — for GDN at K = 256, whose tiles of 32 hold 219
    # registers at 8 warps (one program per SM) and spill 558 B at 4; ptxas for 16 at 4 warps:
    # 255 registers, no spills, 94 KB shared (two programs per SM), SASS 1550 -> 1918
    "lk16w4": ({"rewy_bwd_leaf.warps": 4}, 64, None, 16),
    # the backward's two state passes multiplying in the bf16 they store (S, R; dS, dR)
    "npd": ({"backward.native_pass_dots": True}, 64, None, None),
    # the forward's pass at 8 warps (ptxas, DeltaNet fused pass: 255 registers with 84 B of
    # spills at 4 warps, none at 8)
    "fpw8": ({"rewy_fwd_pass.warps": 8}, 64, None, None),
    # both (ptxas, DeltaNet: the backward's pass 759 -> 607 SASS instructions at 8 warps; at
    # K = 256 the forward's pass spills 528 B at 4 warps, none at 8)
    "npdw8": ({"backward.native_pass_dots": True, "rewy_fwd_pass.warps": 8}, 64, None, None),
    # the backward's two state passes in one launch, two programs per SM (4 warps, one stage;
    # ptxas: DeltaNet 208 registers, 28 KB shared), or at 8 warps (DeltaNet 148 registers)
    "twin": ({"backward.twin_pass": True}, 64, None, None),
    "twinw8": ({"backward.twin_pass": True, "rewy_twin_pass.warps": 8}, 64, None, None),
    # the two launched apart (the default before profile-13)
    "apart": ({"backward.twin_pass": False}, 64, None, None),
    # and with the passes' three pipeline stages (143 KB shared: one program per SM again)
    "twin3": ({"backward.twin_pass": True, "rewy_twin_pass.stages": 3}, 64, None, None),
    # the state passes at one pipeline stage (ptxas, DeltaNet: 24–57 KB of shared memory
    # instead of 100–180, so two programs per SM where the grid has more programs than SMs);
    # profile-13: slower at the anchor and at (4,4096,64,128) alike
    "st1": ({"rewy_fwd_pass.stages": 1, "rewy_bwd_pass.stages": 1}, 64, None, None),
    # the twin pass with the forward's pass at one stage too
    "twinst1": ({"backward.twin_pass": True, "rewy_fwd_pass.stages": 1}, 64, None, None),
    # the tiled kernels launch their tile axis first (value/key tiles of a head side by side,
    # sharing its per-chunk reads in L2), alone and with the other candidates of profile-14 —
    # tiles first, intra's kslice 64 and GDN unfused are the defaults since, so "tiles",
    # "tilesik64" and "tilesunfused" now time what "base" does; "notiles" is the old order
    "notiles": ({"launch.tiles_first": False}, 64, None, None),
    "tiles": ({"launch.tiles_first": True}, 64, None, None),
    "tilesbv128": ({"launch.tiles_first": True}, 128, None, None),
    "tilesbvs64": ({"launch.tiles_first": True}, 64, 64, None),
    "tilesunfused": ({"launch.tiles_first": True, "fwd_pass.fused_output": ("none", "vector")},
                     64, None, None),
    # intra's own key Gram (no or scalar gates) from the rows as stored, native bf16 products
    # over key slices (ptxas, sm_90, 4 warps: DeltaNet K = 128, all K at once: 221 -> 180
    # registers, SASS 4215 -> 3079; GDN 4847 -> 3631; K = 256, slices of 64: the 232 B of
    # spills gone, SASS 7431 -> 5459)
    "ik": ({"rewy_intra.kslice": 128}, 64, None, None),
    "tilesik64": ({"launch.tiles_first": True, "rewy_intra.kslice": 64}, 64, None, None),
    # no gates: the leaf stores dq and de before dk's products (ptxas: 123 -> 90 registers)
    "early": ({"rewy_bwd_leaf.store_early": True}, 64, None, None),
    # intra forms P = tril(Qγ K̄ᵀ) for no and scalar gates, read by the (fused) output instead
    # of one [C, K]·[K, C] product per value tile; and with GDN's output fused again
    "emitP": ({"rewy_intra.emit_P": ("none", "scalar")}, 64, None, None),
    "emitPfused": ({"rewy_intra.emit_P": ("none", "scalar"), "fwd_pass.fused_output": True},
                   64, None, None),
    # intra's diagonal inverses on the blocks stacked as one [n, 16, 16] value (no layout
    # conversion in the 15-step loop; ptxas, DeltaNet: bar.sync per step 17 -> 3, SASS 3399 ->
    # 3118, unrolled 4912 -> 4633): profile-16, intra 0.269 -> 0.220 ms, default since; and the
    # per-block loop it replaced
    "stacked": ({"rewy_intra.stacked_diag": True}, 64, None, None),
    "perblock": ({"rewy_intra.stacked_diag": False}, 64, None, None),
    # both forward candidates together
    "fwdnew": ({"rewy_intra.emit_P": ("none", "scalar"), "rewy_intra.stacked_diag": True},
               64, None, None),
    # the forward's pass at 3 stages without the per-chunk h0 (three buffers per tile; ptxas:
    # GDN's unfused pass 156 KB of shared memory — DeltaNet's fused pass would need 237 KB)
    "fp3": ({"rewy_fwd_pass.stages": 3}, 64, None, None),
    # the forward's pass forming K̄ᵀ R as two native bf16 products (no or scalar gates; ptxas:
    # GDN's pass 921 -> 750 SASS per step, D = 256 spills 536 -> 88 B): untimed
    "splitkr": ({"fwd_pass.split_kr": True}, 64, None, None),
    # the state passes selecting h0 / adding dfin at every chunk (before the one_seq_init)
    "perchunkh0": ({"state_pass.one_seq_init": False}, 64, None, None),
    # the one-sequence passes storing the final state under a per-chunk branch on the end flag
    # (before state_pass.end_after_loop)
    "endin": ({"state_pass.end_after_loop": False}, 64, None, None),
    # pipeline depth of the state passes (state_pass.stages; twin_pass: its own launch
    # setting): 2 stages leave each step's load latency exposed (SASS: DEPBAR.LE SB0, 0x0
    # before the step's first product)
    "twin2": ({"rewy_twin_pass.stages": 2}, 64, None, None),
    "apart3": ({"backward.twin_pass": False,
                "state_pass.stages": _stages(fwd=3, fwd_vector=2, fused=2, bwd=3)}, 64, None,
               None),
    "apart4": ({"backward.twin_pass": False,
                "state_pass.stages": _stages(fwd=4, fwd_vector=2, fused=2, bwd=3)}, 64, None,
               None),
    "fwd3": ({"state_pass.stages": _stages(fwd=3, fwd_vector=2, fused=2, bwd=2)}, 64, None,
             None),
    "twin3fwd3": ({"rewy_twin_pass.stages": 3,
                   "state_pass.stages": _stages(fwd=3, fwd_vector=2, fused=2, bwd=2)},
                  64, None, None),
    "twin2fwd3": ({"rewy_twin_pass.stages": 2,
                   "state_pass.stages": _stages(fwd=3, fwd_vector=2, fused=2, bwd=2)},
                  64, None, None),
    # the forward's W in bf16 (forward.low_precision) so that its fused pass fits 3 stages
    # (ptxas, DeltaNet: 172 KB, 128 B spills; CPU accuracy o 3.39e-3 -> 3.76e-3 of 5e-3)
    "fw16s3": ({"forward.low_precision": ("W",),
                "state_pass.stages": _stages(fwd=3, fwd_vector=2, fused=3, bwd=2, twin=2)},
               64, None, None),
    "fw16": ({"forward.low_precision": ("W",), "state_pass.stages": _stages(fused=2)},
             64, None, None),
    # (profile-18: fw16s3 the default then; fw16, W bf16 at 2 stages, gains nothing.) The
    # forward's W in fp32 with the fused pass at 2 stages (the default before profile-18;
    # profile-19: fused pass 0.268 ms against 0.198 at 3)
    "fw32": ({"forward.low_precision": (), "state_pass.stages": _stages(fused_w32=2)},
             64, None, None),
    # the forward's W in fp32 with the fused pass at 3 stages anyway: profile-18's fw16s3 row
    # of fwd_pass_fused (0.203 ms) was fed intra's default fp32 W at 3 stages, and ran (ptxas
    # counts 237 KB of shared memory for it). profile-19: equal to fw16s3 (op 1.16 ms both at
    # the anchor), so the default since
    "fw32s3": ({"forward.low_precision": (), "state_pass.stages": _stages(fused_w32=3)},
               64, None, None),
    # K = 256: the forward's unfused pass storing S0, R in bf16 and multiplying natively
    # (forward.low_precision_wide), alone or with k's conversion split off (fwd_pass.split_kr).
    # profile-19 (with W bf16): DeltaNet (8,2048,32,256) op 15.9 -> 14.2 ms; the default since
    # as ("W", "S0", "R"); "fwide0" is the fp32 storage before it
    "fwide0": ({"forward.low_precision_wide": ()}, 64, None, None),
    "fwide": ({"forward.low_precision_wide": ("S0", "R")}, 64, None, None),
    # S0, R stored in bf16 but multiplied in TF32 as before (bytes only, not the spills)
    "fwides": ({"forward.low_precision_wide": ("S0", "R"), "forward.native_pass_dots": False},
               64, None, None),
    "fwidekr": ({"forward.low_precision_wide": ("S0", "R"), "fwd_pass.split_kr": True},
                64, None, None),
    # the backward's W, U from the kept inverse as two whole-chunk products (kernels.wu; ptxas,
    # DeltaNet: 1616 -> 304 SASS, 160 mma -> 8 wgmma)
    "wuwhole": ({"rewy_wu.whole_chunk": True}, 64, None, None),
    # and the forward's intra split the same way: the inverse alone (fp32), then W, U (ptxas,
    # DeltaNet: intra 3118 -> 1639 SASS)
    "splitwu": ({"rewy_intra.split_wu": True, "rewy_wu.whole_chunk": True}, 64, None, None),
    # both for vector gates only, where profile-18 found the split faster (KDA intra 0.258 ->
    # 0.075 + 0.150 ms, wu 0.136 -> 0.132)
    "splitv": ({"rewy_intra.split_wu": ("vector",), "rewy_wu.whole_chunk": ("vector",)}, 64,
               None, None),
    # all three: W bf16 with the fused pass at 3 stages, intra split, the whole-chunk W, U
    "fw16s3split": ({"forward.low_precision": ("W",),
                     "state_pass.stages": _stages(fused=3),  # profile-18: slower than fw16s3
                     "rewy_intra.split_wu": True, "rewy_wu.whole_chunk": True}, 64, None, None),
    # K = 256: the backward's recomputing pass (native bf16 products) pipelined 2 or 3 deep
    # (ptxas: DeltaNet 155 / 225 KB, no spills; GDN 107 KB at 2, spills at 3; KDA 173 KB at 2),
    # and the forward's unfused pass at 2 as well (it spills 424 B at 1 stage, 760 at 2)
    "wide2": ({"state_pass.wide_stages": {"native": 2}}, 64, None, None),
    "wide3": ({"state_pass.wide_stages": {"native": 3}}, 64, None, None),
    "wide2f2": ({"state_pass.wide_stages": {"native": 2, "fwd": 2}}, 64, None, None),
    # K = 256, after profile-19: bwd_pass (3.16 ms, the largest kernel there) at 2 stages —
    # ptxas counts 233 KB, but its count ran over for the fused pass that fits (profile-19);
    # the output kernel (1.95 ms) at 8 warps (ptxas: 254 -> 244 registers, SASS 1392 -> 1088)
    # K ≤ 128: the forward's fused pass multiplying its recurrence in bf16
    # (forward.native_fused_dots)
    "ffnat": ({"forward.native_fused_dots": True}, 64, None, None),
    # GDN's unfused forward at K ≤ 128 storing W, S0, R in bf16 and multiplying natively, as
    # at K = 256 (forward.low_precision_modes)
    "gdnlp": ({"forward.low_precision_modes": {"scalar": ("W", "S0", "R")}}, 64, None, None),
    # qk_gram's diagonal blocks centred under the declared bound (g ≥ −5 here, as "centred")
    "qcent": ({"rewy_qk_gram.centred": True}, 64, None, None),
    # the op forming e = βk, z = βv rounded to bf16 and differentiating them in XLA (before
    # forward.row_scaled_ez: every in-kernel row-scale change at once), or only the backward's
    # wu reading them (backward.row_scaled_wu; the backward then forms them in XLA, one pass)
    "noezrows": ({"forward.row_scaled_ez": False}, 64, None, None),
    "nobwdrows": ({"backward.row_scaled_wu": False}, 64, None, None),
    # β's leaf maps differentiated in bwd_dlam and bwd_leaf (profile-20: slower, off)
    "leafk": ({"backward.leaf_maps_in_kernel": True}, 64, None, None),
    # the per-chunk kernels ptxas compiles at 2 warps without spills (DeltaNet, KDA: intra 255
    # registers, wu 146, bwd_local 176), as FLA's autotune picks for several of its own
    "w2": ({"rewy_intra.warps": 2, "rewy_wu.warps": 2, "rewy_bwd_local.warps": 2}, 64, None,
           None),
    # K > 128 only (launch.wide_warps): KDA's state passes at 8 warps, the output at 8
    "widew8v": ({"launch.wide_warps": {"fwd_pass:vector": 8}}, 64, None, None),
    "widewo8": ({"launch.wide_warps": {"output": 8}}, 64, None, None),
    # bwd_dlam at 8 warps at K > 128: with dv = β ⊙ Λ and Σ_v Λ ⊙ v in it (nineteenth session)
    # ptxas (K = V = 256) finds 172 B of spills at 4 warps (32 before), none at 8 (210 registers)
    "widedl8": ({"launch.wide_warps": {"bwd_dlam": 8}}, 64, None, None),
    "wideb2": ({"state_pass.wide_stages": {"native": 1, "bwd": 2}}, 64, None, None),
    "out8": ({"rewy_output.warps": 8}, 64, None, None),
    # W, U from the kept inverse on column tiles (rewy_wu.col_tile): the backward's alone
    # (wut, wut32), and the forward's too, its intra forming only the inverse (splitt, splitt32)
    # the small per-chunk kernels' warps, timed from device events (trace_op.py --variants;
    # twentieth session): intra and the backward's wu at 2 (bwd_local kept at 4), or intra at 1;
    # bwd_local and bwd_dlam at 2 or 8; with qcent for KDA under the declared bound
    "w2i": ({"rewy_intra.warps": 2, "rewy_wu.warps": 2}, 64, None, None),
    "w2nb": ({"rewy_intra.warps": 2, "rewy_wu.warps": 2, "backward.row_scaled_wu": False}, 64,
             None, None),
    "w2t32": ({"rewy_intra.warps": 2, "rewy_wu.warps": 2, "rewy_wu.whole_chunk": True,
               "rewy_wu.col_tile": 32}, 64, None, None),
    "i1": ({"rewy_intra.warps": 1, "rewy_wu.warps": 2}, 64, None, None),
    "bl8": ({"rewy_bwd_local.warps": 8}, 64, None, None),
    "dl2": ({"rewy_bwd_dlam.warps": 2}, 64, None, None),
    "dl8": ({"rewy_bwd_dlam.warps": 8}, 64, None, None),
    # DeltaNet's forward as pass + output kernel (profile-9/13 judged the fused pass faster by
    # the host loop; with "emitP" above, the fused pass reads P from intra)
    "unfused": ({"fwd_pass.fused_output": ("vector",)}, 64, None, None),
    # every forward unfused, S0 and R stored in bf16 for the output kernel (FLA's h and v_new
    # are), the pass's products still TF32. ptxas (K = 128, 4 warps): DeltaNet's pass 152 KB,
    # 245 registers, no spills, SASS 1390 at 3 stages (the fused pass: 232 KB, 220 B of
    # spills, 1946); KDA's 145 KB, no spills, SASS 2009 at 2 (fused: 177 KB, 28 B, 2109);
    # GDN's (unfused already) 255 -> 234 registers, its output kernel 229 -> 188.
    # Interpret accuracy (TF32 rounded), o of 5e-3: DeltaNet 1.77e-3 -> 2.69e-3 at (16, 128),
    # 1.82e-3 -> 2.95e-3 at (8, 64); KDA g >= -5 1.72e-3 -> 2.43e-3; GDN 1.70e-3 -> 2.41e-3;
    # gradients unchanged.
    # (bf16 products as well: DeltaNet o 4.07e-3 — not that.)
    "unfused16": ({"fwd_pass.fused_output": (), "forward.low_precision": ("S0", "R"),
                   "forward.native_pass_dots": False}, 64, None, None),
    # the reverse pass reading each chunk's Qγᵀ dO from bwd_local instead of q and dO
    # (backward.chunk_qdo; ptxas: DeltaNet's twin 120 -> 80 KB, two programs per SM; GDN's
    # 102 -> 66 KB at 2 stages, 103 KB at 3)
    "qdo": ({"backward.chunk_qdo": True}, 64, None, None),
    "qdo3": ({"backward.chunk_qdo": True, "rewy_twin_pass.stages": 3}, 64, None, None),
    # bwd_local on one program per (chunk, head) over its value tiles: P built or read once
    # (rewy_bwd_local.tile_loop; ptxas, K = V = 128, 4 warps: DeltaNet 96 registers and 728 SASS
    # for both tiles against 90 and 512 per tile's program; with qdo 162 / 1144 against 138 /
    # 704 per tile; GDN with qdo 206 against 218; KDA 65 against 60)
    "bltl": ({"rewy_bwd_local.tile_loop": True}, 64, None, None),
    # vector gates' fused forward pass reading K̄ = e^{G_C − G} ⊙ k and Qγ = e^{G} ⊙ q, formed
    # once by kernels.decayed_rows, instead of k, q and G's rows (fwd_pass.predecayed). ptxas
    # (KDA, K = 128, 4 warps): 16-bit K̄ 249 KB / 316 B of spills / 2554 SASS -> 232 / 40 /
    # 1839 at 3 stages (160 KB, none, 1514 at 2); an fp32 K̄ ("kbar32": the final state as
    # accurate as before) 208 KB, no spills, 1538 SASS at 2 stages (312 KB at 3: too many)
    "predecayed": ({"fwd_pass.predecayed": True}, 64, None, None),
    "pd32": ({"fwd_pass.predecayed": "kbar32", "rewy_fwd_pass.stages": 2}, 64, None, None),
    # the backward's state passes reading K̄, Qγ from decayed_rows (backward.predecayed:
    # bit-identical), alone, with chunk_qdo, and with the forward's too
    "bwdpd": ({"backward.predecayed": True}, 64, None, None),
    "bwdpdq": ({"backward.predecayed": True, "backward.chunk_qdo": True}, 64, None, None),
    "allpd": ({"backward.predecayed": True, "backward.chunk_qdo": True,
               "fwd_pass.predecayed": True}, 64, None, None),
    "qdotl": ({"backward.chunk_qdo": True, "rewy_bwd_local.tile_loop": True}, 64, None, None),
    # qk_gram's frame products of a row block in one key-slice loop, the row operands scaled
    # once per slice (rewy_qk_gram.row_frames; bit-identical)
    "qrowf": ({"rewy_qk_gram.row_frames": True}, 64, None, None),
    # the forms that profile-22's winners replaced as defaults (twenty-third session): qk_gram
    # with one key-slice loop per block, the fused vector pass forming K̄ and Qγ per value
    # tile, GDN's forward as pass + output kernel (fused_output for the other modes only)
    # the leaf forming e = βe ⊙ k itself instead of reading XLA's (backward.leaf_e_rows;
    # bit-identical; DeltaNet and GDN under ReWY; default since profile-23) or not
    "leafe": ({"backward.leaf_e_rows": ("none", "scalar")}, 64, None, None),
    "noleafe": ({"backward.leaf_e_rows": False}, 64, None, None),
    "leafev": ({"backward.leaf_e_rows": True}, 64, None, None),  # vector gates too
    # GDN's leaf with its decayed dT, dA_qk in fp32 and TF32 products (the form before the
    # twenty-fourth session)
    "leaftf32": ({"rewy_bwd_leaf.native_decayed": False}, 64, None, None),
    # GDN's decays where they were before the twenty-fifth session: dT, dA_qk decayed in the
    # leaf (per key tile) rather than in bwd_dlam (backward.dlam_decays), and the state passes'
    # scalar decays on the key side (state_pass.value_side_decay); profile-23's GDN is
    # "leafdecay+keyside+gaterows+leaftf32"
    "leafdecay": ({"backward.dlam_decays": False}, 64, None, None),
    "keyside": ({"state_pass.value_side_decay": False}, 64, None, None),
    # and intra's and wu's W = A (γ ⊙ Ē) with γ on Ē's [16, K] rows, not A's columns
    "gaterows": ({"rewy_intra.gate_on_A": False}, 64, None, None),
    # 16-bit calls at K ≤ 32 on the 16-bit kernels, not on fp32 (precision.narrow_keys; time
    # the narrow-key path at a K = 32 shape against it)
    "narrow16": ({"precision.narrow_keys": 0}, 64, None, None),
    "noqrowf": ({"rewy_qk_gram.row_frames": False}, 64, None, None),
    "nopd": ({"fwd_pass.predecayed": False}, 64, None, None),
    "unfusedg": ({"fwd_pass.fused_output": ("none", "vector")}, 64, None, None),
    # the small kernels' warps before the twentieth session (intra and wu at 4)
    "w4i": ({"rewy_intra.warps": 4, "rewy_wu.warps": 4}, 64, None, None),
    # the VJP of e = β ⊙ k, z = β ⊙ v in XLA (three fusions) or by kernels.row_scale_vjp (at
    # 8 warps, or 4: ptxas 191 registers there); profile-21: the kernel is slower, off
    "norowvjp": ({"backward.row_vjp_kernel": False}, 64, None, None),
    "rowvjp": ({"backward.row_vjp_kernel": True}, 64, None, None),
    "rv4": ({"backward.row_vjp_kernel": True, "rewy_row_vjp.warps": 4}, 64, None, None),
    "qw2": ({"rewy_qk_gram.centred": True, "rewy_intra.warps": 2, "rewy_wu.warps": 2}, 64, None,
            None),
    "wut": ({"rewy_wu.whole_chunk": True, "rewy_wu.col_tile": 64}, 64, None, None),
    "wut32": ({"rewy_wu.whole_chunk": True, "rewy_wu.col_tile": 32}, 64, None, None),
    "splitt": ({"rewy_wu.whole_chunk": True, "rewy_intra.split_wu": True,
                "rewy_wu.col_tile": 64}, 64, None, None),
    "splitt32": ({"rewy_wu.whole_chunk": True, "rewy_intra.split_wu": True,
                  "rewy_wu.col_tile": 32}, 64, None, None),
    "w8": ({f"rewy_{k}.warps": 8 for k in ("intra", "fwd_pass", "output", "bwd_local", "bwd_pass",
                                           "bwd_dlam", "bwd_leaf")}, 64, None, None),
}


def _bench(f, *args, reps=20, runs=5):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps)
    return 1e3 * float(np.median(ts))


def _inputs(mode, B, T, H, D, C=64, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    bf = jnp.bfloat16

    def nrm(key, shape, scale=1.0):
        x = jax.random.normal(key, shape, F32)
        return (scale * x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(bf)

    q = nrm(ks[0], (B, T, H, D), D ** -0.5 * D ** 0.5)
    k = nrm(ks[1], (B, T, H, D))
    b = jax.random.uniform(ks[2], (B, T, H, 1), F32, 0.0, 1.0)
    e = api.leaf_product(b, k)
    v = jax.random.normal(ks[3], (B, T, H, D), F32).astype(bf)
    z = api.leaf_product(b, v)
    g = G = None
    if mode != "none":
        gshape = (B, T, H) if mode == "scalar" else (B, T, H, D)
        g = -jax.random.uniform(ks[4], gshape, F32, 0.005, 0.2)
        G = jnp.cumsum(api._chunks(g, C), axis=2).reshape(g.shape)  # as api._cum_gates
    N = T // C
    h0 = jnp.zeros((B, H, 2, D, D), F32).at[:, :, 0].set(
        0.1 * jax.random.normal(ks[5], (B, H, D, D), F32))
    reset = (jnp.arange(N) == 0).astype(jnp.int32)
    end = (jnp.arange(N) == N - 1).astype(jnp.int32)
    seq = jnp.zeros((N,), jnp.int32)
    dO = jax.random.normal(ks[6], (B, T, H, D), F32).astype(bf)
    return q, k, e, z, g, G, h0, reset, end, seq, dO, v, b[..., 0]


def variant_settings(variant):
    """(kernels.TUNE, BV, BV_STATE, BK) of ``VARIANTS[variant]``, or of "a+b+…": the named
    variants together (say, a trace's winners for different kernels). Two parts that set one
    key differently, or different tile widths, are an error."""
    tune, widths = {}, None
    for part in variant.split("+"):
        if part not in VARIANTS:
            raise KeyError(f"unknown variant {part!r}; expected one of profile_kernels.VARIANTS")
        t, *w = VARIANTS[part]
        for key, value in t.items():
            if key in tune and tune[key] != value:
                raise ValueError(f"variant {variant!r}: {part!r} sets {key} = {value!r}, "
                                 f"another part {tune[key]!r}")
            tune[key] = value
        if widths is not None and tuple(w) != widths:
            raise ValueError(f"variant {variant!r}: {part!r} has tile widths {tuple(w)}, "
                             f"another part {widths}")
        widths = tuple(w)
    return (tune, *widths)


def is_bounded(variant):
    """Whether the variant (or a part of "a+b") declares g ≥ −5 for the vector-gate ops."""
    return any(part in BOUNDED_VARIANTS for part in variant.split("+"))


def apply_variant(variant):
    """Set ``variant_settings(variant)`` for the rest of the process (a benchmark run's
    ``--variant``): its settings are added to kernels.TUNE, and api's tile widths set."""
    tune, BV, BVs, BK = variant_settings(variant)
    kn.TUNE.update(tune)
    api.DEFAULT_BV, api.DEFAULT_BV_STATE, api.DEFAULT_BK = BV, BVs, BK


def with_variant(variant, fn):
    """``fn()`` under ``variant_settings(variant)`` alone: kernels.TUNE and api's tile widths
    set for the call, and the module settings put back after it (also used by trace_op.py)."""
    saved = dict(kn.TUNE), (api.DEFAULT_BV, api.DEFAULT_BV_STATE, api.DEFAULT_BK)
    try:
        kn.TUNE.clear()
        apply_variant(variant)
        return fn()
    finally:
        kn.TUNE.clear()
        kn.TUNE.update(saved[0])
        api.DEFAULT_BV, api.DEFAULT_BV_STATE, api.DEFAULT_BK = saved[1]


def profile(mode, variant, shape, backward="rewy", interpret=False, reps=20, runs=5):
    """({kernel or whole pass: ms}, general_delta's gradients) for one gate mode ("none",
    "scalar", "vector") and variant."""
    BV = variant_settings(variant)[1]
    return with_variant(variant, lambda: _profile(
        mode, variant, shape, backward, interpret, BV,
        lambda f, *a: _bench(f, *a, reps=reps, runs=runs)))  # (rows, grads)


def _profile(mode, variant, shape, backward, interpret, BV, _bench):
    B, T, H, D = shape
    q, k, e, z, g, G, h0, reset, end, seq, dO, v, beta = _inputs(mode, B, T, H, D)
    cfg = api.Config(64, "recompute", backward, interpret, BV,
                     is_bounded(variant),
                     one_seq=True,  # one sequence per row: the metadata of _inputs
                     scale=D ** -0.5)  # applied in-kernel, as the op does (kernels.Shape.scaled)
    s = api._shape(cfg, q, z, G, h0)
    it = interpret
    rows = {}
    # the forward's e, z, as the op passes them (api.delta_rule_call): k, v and β's per-row
    # scales under DEFAULTS "forward.row_scaled_ez", else the rounded products
    ez_rows = (v, beta, beta) if kn.setting("forward.row_scaled_ez") else None
    fe, fz, frows = (k, v, (beta, beta)) if ez_rows else (e, z, None)

    P = Tg = None
    if G is not None and G.ndim == 4 and kn.setting("rewy_intra.gram_from_qk"):
        f = jax.jit(lambda q, k, e, G: kn.qk_gram(s, q, k, G, e=e, interpret=it,
                                                  e_rows=frows and frows[0]))
        rows["qk_gram"] = _bench(f, q, k, fe, G)  # P and intra's T
        P, Tg = f(q, k, fe, G)
    elif G is not None and G.ndim == 4:
        f = jax.jit(lambda q, k, G: kn.qk_gram(s, q, k, G, interpret=it))
        rows["qk_gram"] = _bench(f, q, k, G)
        P = f(q, k, G)
    # the forward's stored dtypes (forward.low_precision): W, U as intra stores them for the
    # state pass, S0, R as the unfused pass stores them for the output
    fd = api._forward_dtypes(q.dtype, D, mode)
    wu_dt = (fd["W"], fd["U"])
    if kn.intra_forms_P(mode):  # intra forms P too (no or scalar gates)
        f = jax.jit(lambda k, e, z, G, q: kn.intra(s, k, e, z, G, q=q, interpret=it,
                                                   dtypes=wu_dt, rows=frows))
        rows["intra"] = _bench(f, k, fe, fz, G, q)
        A, W, U, P = f(k, fe, fz, G, q)
    else:
        f = jax.jit(lambda k, e, z, G, Tg: kn.intra(s, k, e, z, G, T=Tg, interpret=it,
                                                    dtypes=wu_dt, rows=frows))
        rows["intra"] = _bench(f, k, fe, fz, G, Tg)
        A, W, U = f(k, fe, fz, G, Tg)
    if kn.split_wu(mode) and not kn.intra_forms_P(mode):  # intra as the inverse + a W, U launch
        f = jax.jit(lambda k, e, z, G, Tg: kn.intra(s, k, e, z, G, T=Tg, interpret=it, wu=False,
                                                    rows=frows))
        rows["intra_A"] = _bench(f, k, fe, fz, G, Tg)
        (A32,) = f(k, fe, fz, G, Tg)
        f = jax.jit(lambda k, e, z, G, A: kn.wu(s, k, e, z, G, A, interpret=it, dtypes=wu_dt,
                                                a_copy=jnp.bfloat16, rows=frows))
        rows["wu_fwd"] = _bench(f, k, fe, fz, G, A32)
    sd = api._stored_dtypes(q.dtype)  # the backward's stored dtypes (backward.low_precision)
    # the backward's W, U from the kept A (from k, v and β under backward.row_scaled_wu)
    bw = ez_rows and kn.setting("backward.row_scaled_wu")
    be, bz, bw_rows = (fe, fz, frows) if bw else (e, z, None)
    f = jax.jit(lambda k, e, z, G, A, r: api._wu(s, k, e, z, G, A, it, (sd["W"], sd["U"]),
                                                 rows=r))
    rows["wu"] = _bench(f, k, be, bz, G, A, bw_rows)
    Wb, Ub = f(k, be, bz, G, A, bw_rows)
    f = jax.jit(lambda W, U, k, G, h0: kn.fwd_pass(s, W, U, k, G, h0, reset, end, seq,
                                                   interpret=it, dtypes=(fd["S0"], fd["R"]),
                                                   forward=True))
    rows["fwd_pass"] = _bench(f, W, U, k, G, h0)
    S0, R, fin = f(W, U, k, G, h0)
    f = jax.jit(lambda q, k, G, S0, R, P: kn.output(s, q, k, G, S0, R, P, jnp.bfloat16,
                                                    interpret=it))
    rows["output"] = _bench(f, q, k, G, S0, R, P)
    # the forward's pass with the output inside, and the backward's twin pass: K ≤ 128 only,
    # as in api (at K = 256 neither runs, so their rows would only cost compile time)
    if kn.fused_output(mode) and s.K <= 128:
        f = jax.jit(lambda W, U, k, G, h0, q, P: kn.fwd_pass(
            s, W, U, k, G, h0, reset, end, seq, interpret=it, out=(q, P, jnp.bfloat16),
            forward=True, dtypes=api._fused_pass_dtypes(q.dtype, mode)))
        rows["fwd_pass_fused"] = _bench(f, W, U, k, G, h0, q, P)
    if set(sd.values()) != {F32}:  # the backward's own state pass reads and stores those
        f = jax.jit(lambda W, U, k, G, h0: kn.fwd_pass(s, W, U, k, G, h0, reset, end, seq,
                                                       interpret=it, dtypes=(sd["S0"], sd["R"])))
        rows["fwd_pass_bwd"] = _bench(f, Wb, Ub, k, G, h0)
        S0, R, _ = f(Wb, Ub, k, G, h0)
        W = Wb
    P = P if mode == "vector" else None  # the recompute backward keeps only vector gates' P
    f = jax.jit(lambda q, k, G, P, dO: kn.bwd_local(s, q, k, G, P, dO, interpret=it,
                                                     dtype=sd["dRl"]))
    rows["bwd_local"] = _bench(f, q, k, G, P, dO)
    dRl = f(q, k, G, P, dO)
    dfin = jnp.zeros_like(fin)
    if kn.setting("backward.twin_pass") and s.K <= 128:  # bwd_pass and the recompute, one launch
        f = jax.jit(lambda W, U, k, G, h0, q, dO, dRl, dfin: kn.twin_pass(
            s, (W, U, k, G, h0, reset, end, seq), (q, k, G, W, dO, dRl, dfin, reset, end, seq),
            interpret=it, fwd_dtypes=(sd["S0"], sd["R"]), bwd_dtypes=(sd["dS"], sd["dR"])))
        rows["twin_pass"] = _bench(f, W, Ub, k, G, h0, q, dO, dRl, dfin)
    f = jax.jit(lambda q, k, G, W, dO, dRl, dfin: kn.bwd_pass(s, q, k, G, W, dO, dRl, dfin, reset,
                                                              end, seq, interpret=it,
                                                              dtypes=(sd["dS"], sd["dR"])))
    rows["bwd_pass"] = _bench(f, q, k, G, W, dO, dRl, dfin)
    dSe, dR, dh0 = f(q, k, G, W, dO, dRl, dfin)
    # the backward's leaf kernels as the op runs them: under forward.row_scaled_ez they read k,
    # v and β and return dk, dv, dβ through Ē = β ⊙ k and Z = β ⊙ v (api.general_delta's rows)
    brows = (beta, beta) if ez_rows else None
    de_in, dz_in = (None, v) if ez_rows else (e, z)
    f = jax.jit(lambda A, R, dO, dR, e, z, G, S0, r: kn.bwd_dlam(
        s, A, R, dO, dR, e, z, G, S0, backward=backward, interpret=it, lam_dtype=sd["lam"],
        dt_dtype=sd["dT"], rows=r))
    e_dlam = k if ez_rows else e
    rows["bwd_dlam"] = _bench(f, A, R, dO, dR, e_dlam, dz_in, G, S0, brows)
    lam, dT, dAqk = f(A, R, dO, dR, e_dlam, dz_in, G, S0, brows)[:3]
    bf = jnp.bfloat16
    f = jax.jit(lambda q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, be: kn.bwd_leaf(
        s, q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, backward=backward,
        dtypes=(bf, bf, bf), interpret=it, be=be))
    be_leaf = brows and brows[0]
    rows["bwd_leaf"] = _bench(f, q, k, de_in, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, be_leaf)

    def fwd(q, k, v, beta, g, h0):
        """general_delta as the op calls it (api.delta_rule_call), as a function of the
        op's k, v and β: the gradients are comparable between variants either way."""
        if ez_rows:
            return api.general_delta(cfg, q, k, None, v, g, h0, reset, end, seq,
                                     (beta, beta))[0]
        return api.general_delta(cfg, q, k, api.leaf_product(beta, k), api.leaf_product(beta, v),
                                 g, h0, reset, end, seq)[0]

    def loss(q, k, v, beta, g, h0):
        return jnp.sum(fwd(q, k, v, beta, g, h0).astype(F32) * dO.astype(F32))

    argn = (0, 1, 2, 3, 5) if g is None else (0, 1, 2, 3, 4, 5)
    rows["FWD (general_delta)"] = _bench(jax.jit(fwd), q, k, v, beta, g, h0)
    vg = jax.jit(jax.value_and_grad(loss, argnums=argn))
    rows["FWD+BWD (general_delta)"] = _bench(vg, q, k, v, beta, g, h0)
    grads = vg(q, k, v, beta, g, h0)[1]
    grads = (*grads[:-1], grads[-1][:, :, :1])  # dh0 without the padding slot (never written)
    # The same through the public op (rewy_jax), as the benchmark calls it: the difference is
    # the op's XLA glue (the gate cumsum and its VJP, dg's and dβ's last sums, layout).
    op = {"none": "deltanet", "scalar": "gdn", "vector": "kda"}[mode]
    inp = testing.make_inputs(op, B, T, H, D, D, dtype=jnp.bfloat16, initial_state=False)
    kw = dict(backend="pallas_gpu", interpret=interpret, backward=backward)
    if cfg.centred and mode == "vector":  # the bound is a vector-gate option
        kw["gate_lower_bound"] = -5.0

    def op_loss(x):
        return jnp.sum(testing.run_op(op, x, **kw)[0].astype(F32) * dO.astype(F32))

    rows[f"OP_FWD+BWD ({op})"] = _bench(jax.jit(jax.value_and_grad(op_loss)), inp)
    return rows, grads


def grad_gap(grads, ref):
    """Worst ‖x − y‖ / ‖y‖ over the gradients of two variants (same inputs): a variant that
    only reorganises work should agree with the base one to rounding."""
    gap = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if not np.all(np.isfinite(x)):
            return float("inf")
        gap = max(gap, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return gap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,scalar,vector")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--shape", default="2x4096x16x128")
    ap.add_argument("--backward", default="rewy")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    print(jax.devices(), jax.__version__, flush=True)
    table = {}
    for mode in a.modes.split(","):
        first = None  # the mode's first variant's gradients: the others are compared to them
        for var in a.variants.split(","):
            t0 = time.perf_counter()
            try:
                table[mode, var], grads = profile(mode, var, shape, a.backward, a.interpret)
            except Exception as ex:  # noqa: BLE001 — one failing variant must not hide the rest
                print(f"{mode} {var} ERROR {type(ex).__name__}: {str(ex)[:400]}", flush=True)
                continue
            if first is None:
                first = grads
            else:
                table[mode, var]["grad_gap"] = grad_gap(grads, first)
            print(f"{mode} {var} ({time.perf_counter() - t0:.0f}s incl. compile): " +
                  ", ".join(f"{k} {v:.3g}" for k, v in table[mode, var].items()), flush=True)
    lines = [f"per-kernel ms, shape {a.shape} bf16, backward={a.backward}, jax {jax.__version__}"]
    for (mode, var), rows in table.items():
        lines.append(f"{mode:6s} {var:6s} " + " ".join(f"{k.split(' ')[0]}={v:.3g}"
                                                       for k, v in rows.items()))
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
