"""Pallas (Triton lowering) kernels of the chunked delta rule and ReWY's reduced backward.

Token layout throughout: ``[B, Tp, H, D]`` with Tp = N·C (padded by the caller); per-chunk
kernels take ``[C, D]`` blocks through BlockSpecs, state passes take one (batch, head) column
``[Tp, D]`` and slice chunk n with ``pl.ds(n·C, C)``. Gates: ``G`` is the chunk-local inclusive
cumsum, ``[B, Tp, H]`` (scalar), ``[B, Tp, H, K]`` (vector) or None.

    intra      grid (N, B·H)      T (decay-gram), A = (I+T)⁻¹, W = AĒ, U = AZ; given a kept A
                                  (policy "recompute", in the backward): W, U only ("rewy_wu")
    wu         grid (N, B·H)      W = AĒγ, U = AZ from A as two whole-chunk products ("rewy_wu";
                                  DEFAULTS "rewy_wu.whole_chunk", "rewy_intra.split_wu")
    qk_gram    grid (N, B·H)      vector gates only: P = tril(Qγ K̄ᵀ) (output, bwd_local read it)
    cum_gates, gate_grad  grid (N, B·H, K/64)  vector gates only: G from g; dg from its parts
    fwd_pass   grid (B·H, V/BV)   loop over chunks: S0, R = U − W S0, S ← γ_C S0 + K_tailᵀ R
    output     grid (N, B·H)      O = Qγ S0 + P R
    bwd_local  grid (N, B·H)      Pᵀ dO (the state-free part of dR)
    bwd_pass   grid (B·H, V/BV)   reverse loop: dS_end, dR = Pᵀ dO + K_tail dS_end,
                                  dS0 = γ_C dS_end + Qγᵀ dO − Wᵀ dR   (Ēᵀ Λ = Wᵀ dR), dh0
    bwd_dlam   grid (N, B·H)      Λ = Aᵀ dR, dT = −tril(Λ Rᵀ, −1), dA_qk = tril(dO Rᵀ)
                                  (or the seven-product WY form of dT, backward="wy"); with a
                                  per-row β also dv = β ⊙ Λ and dβ's Σ_v Λ ⊙ v
    bwd_leaf   grid (N, B·H, K/BK) −Λ S0ᵀ, the leaf maps (dq, dk, de) and dg's two parts per key
                                  tile; with a per-row β, dk through Ē = β ⊙ k and dβ's part
                                  instead of de

q arrives unscaled and the op's scale multiplies the fp32 result of every product of q or dO
(``Shape.scaled``: O above, and in the backward Pᵀ dO, Qγᵀ dO, dO Rᵀ and dO S0ᵀ), so that q is not
rounded to its 16-bit dtype a second time after the scaling.

Vector gates (KDA, GDN2) run on 16-row sub-chunk blocks in reference frames (blocks.py); with no
or scalar gates the decay is one [C, C] matrix and the kernels use whole-chunk matmuls.

Sequence metadata (per chunk, int32 [N]): ``reset`` (start state is an initial state), ``end``
(end state is a final state), ``seq`` (which initial/final slot). Initial/final states are
``[B, n_seq + 1, H, K, V]`` (the extra slot absorbs padding chunks).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.chunk_algebra import clamp_gates
from pallas_kernels.gpu.blocks import (BS, F32, Blocks, Gates, Rows, ScaledRows, _sum, dot, dot_split, dot_stored, exp,
                                       inv_blocks, iota, load_rows, load_scaled_rows)
from pallas_kernels.vma import out_shapes_like

try:  # the Triton lowering's params; it warns that it is deprecated (design.md): silence here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as _plt
except ImportError:  # pragma: no cover
    _plt = None


def _compiler_params(num_warps, num_stages=None):
    if _plt is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _call(kernel, *, grid, in_specs, out_specs, out_shape, interpret, num_warps, name,
          num_stages=None, tile_axis=None):
    """``pl.pallas_call`` with the kernels' launch settings (TUNE overrides them).

    tile_axis: the grid axis that splits one (chunk or column, head) across several programs
    (value or key tiles), which all read the same per-chunk operands (q, k, W, ...). Under
    DEFAULTS "launch.tiles_first" it is launched first — CUDA dispatches blockIdx.x fastest —
    so those programs run side by side and the operands come from L2 once instead of from
    memory once per tile, on grids with more programs than the SMs hold at once. The specs and
    ``grid_id`` keep the logical axis order either way.
    """
    num_warps = TUNE.get(name + ".warps", num_warps)
    num_stages = TUNE.get(name + ".stages", num_stages)
    order = tuple(range(len(grid)))
    if tile_axis is not None and setting("launch.tiles_first"):
        order = (tile_axis,) + tuple(a for a in order if a != tile_axis)
    def call(*args):
        # Under shard_map(check_vma=True) the outputs vary along the inputs' manual axes.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pl.pallas_call(
                _launch_ordered(kernel, order), grid=tuple(grid[a] for a in order),
                in_specs=[_launch_spec(x, order) for x in in_specs],
                out_specs=([_launch_spec(x, order) for x in out_specs]
                           if isinstance(out_specs, (list, tuple))
                           else _launch_spec(out_specs, order)),
                out_shape=out_shapes_like(out_shape, *args),
                interpret=interpret, name=name,
                compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
            )(*args)
    return call


_LAUNCH_ORDER: list = []  # launch position -> logical grid axis, of the kernel being traced


def _launch_ordered(kernel, order):
    def traced(*refs):
        _LAUNCH_ORDER.append(order)
        try:
            return kernel(*refs)
        finally:
            _LAUNCH_ORDER.pop()
    return traced


def _launch_spec(spec, order):
    """A BlockSpec written for the logical grid, on the launch grid ``order``."""
    if order == tuple(range(len(order))):
        return spec
    imap = spec.index_map

    def index_map(*launch_ids):
        ids = [None] * len(order)
        for pos, axis in enumerate(order):
            ids[axis] = launch_ids[pos]
        return imap(*ids)
    return pl.BlockSpec(spec.block_shape, index_map)


def grid_id(axis):
    """``pl.program_id`` of a logical grid axis (``_call`` may launch the axes reordered)."""
    order = _LAUNCH_ORDER[-1] if _LAUNCH_ORDER else None
    return pl.program_id(order.index(axis) if order else axis)


# Launch settings. Warps per kernel from profile_kernels.py on the H200 (2x4096x16x128 bf16,
# commits cd69bc4 and after; benchmarks/results/profile-*.txt): the per-chunk kernels run faster
# with 4 (intra 0.55 -> 0.43 ms without gates and 2.39 -> 1.54 with vector gates, output
# 0.27 -> 0.18); the two with the most live tiles (bwd_pass, bwd_leaf) keep 8 (bwd_leaf with
# vector gates: 3.09 at 8, 3.23 at 4; ptxas showed the blocked kernels spilling at 4). The state
# passes software-pipeline their per-chunk loads (num_stages: _pass_stages, up to ~200 KB of
# shared memory at K = 128); at
# K = 256 that would need ~400 KB, so they drop to one stage there. qk_gram runs
# 2 warps since it contracts in key slices (profile-10, below: [16, 16] output blocks keep
# few warps busy, and at 2 warps its 153 registers leave room for more programs per SM).
# Twentieth session, from device events (trace_op.py --variants; profile_kernels' host loop
# has a ~0.1-ms dispatch floor that hid these, benchmarks/results/profile-21/): intra at 2
# warps 0.209 -> 0.145 ms (DeltaNet), 0.243 -> 0.221 (KDA); the backward's W, U ("wu": intra
# given A, or kernels.wu) at 2 0.080 -> 0.072 for DeltaNet but 0.117 -> 0.135 for KDA, so 4
# there ("<kernel>:<gate mode>" entries win over "<kernel>"). bwd_local and bwd_dlam at 2 or 8,
# and the twin pass at 8, were slower. Scalar gates (GDN): intra and wu at 2 too since profile-22
# (H100, device events, benchmarks/results/profile-22/): intra 0.231 -> 0.191 ms at the anchor,
# though ptxas counts 184 B of spills in its intra at 2 warps (none at 4).
WARPS = {"intra": 2, "wu": 2, "wu:vector": 4, "qk_gram": 2,
         "fwd_pass": 4, "output": 4,
         "bwd_local": 4, "bwd_pass": 8, "bwd_dlam": 4, "bwd_leaf": 8, "twin_pass": 4,
         "gates": 4, "row_vjp": 8}
# Algorithm choices of the vector-gate kernels, from profile-4 (H200, KDA at the anchor shape,
# benchmarks/results/profile-4-256267b.txt):
#   rowgrid     one program per 16-row block of a chunk instead of per chunk: bwd_leaf
#               5.32 -> 4.94 ms (exact loop), 3.81 -> 2.43 (exact levels), 3.09 -> 2.05
#               (centred); qk_gram 0.95 -> 0.90.
#   exact_diag  exact diagonal sub-chunk blocks: "loop" (16 dependent per-column steps) or
#               "levels" (4 masked matmuls on bit levels, blocks.Gates): bwd_leaf 5.32 -> 3.81
#               but qk_gram 0.95 -> 1.03 (1.32 with the row grid) and intra 1.50 -> 1.62.
#   gram_from_qk  vector gates: intra reads its key Gram T from qk_gram, which forms it beside
#               P with the same decay factors (profile-5, commit 81dfbbe: intra 1.38 -> 0.35,
#               qk_gram 0.91 -> 1.80; KDA fwd+bwd 5.80 -> 5.56 with the two below).
#   shared_decay  vector gates: bwd_leaf applies dT and dA_qk through one set of decay factors
#               (Gates.applies / apply_t_sum) instead of two: bwd_leaf 2.49 -> 2.39 (exact),
#               2.18 centred.
#   joint_diag_inverse  intra inverts its n diagonal 16x16 blocks in one interleaved loop
#               (blocks.inv_diags) instead of n back-to-back chains of 15 dependent steps:
#               intra 0.43 -> 0.28 (DeltaNet), 0.61 -> 0.30 (GDN), 1.46 -> 1.38 (KDA).
#   pairgrid    qk_gram: one program per (row block, column block) of a chunk instead of per
#               row block: ptxas spills 220/348 B -> 24/24, but no faster (profile-6: qk_gram
#               1.80 -> 1.79 ms, KDA fwd+bwd 6.33 -> 6.30); off.
#   recompute.keep_chunk_matrices  policy "recompute": the forward keeps A (and P) for the
#               backward, which re-forms only W, U from A ("rewy_wu", intra given A) before its
#               state pass, instead of intra and qk_gram again (profile-6,
#               benchmarks/results/profile-6/: KDA fwd+bwd 8.26 -> 6.33 ms, DeltaNet
#               2.48 -> 2.32; bit-identical gradients; peak memory unchanged, 833 / 705 MiB).
#   unroll      intra / qk_gram: their 16-step loops (diagonal inverse substitution, exact
#               "loop" diagonal blocks) unrolled at trace time (blocks.loop), so the compiler
#               can interleave the steps' independent reductions. Profile-8: intra unrolled
#               is slower (DeltaNet 0.284 -> 0.342 ms); qk_gram's not yet timed. Off.
#   backward.low_precision  16-bit inputs: which of the backward's own [C, ·] and state
#               tensors are stored in bf16 between its kernels (LOW_PRECISION_NAMES; S0 and R
#               only where the backward recomputes them — the forward's stay fp32, they make
#               o; W and U only as the backward re-forms them). Every kernel still computes
#               and carries its state in fp32; products of two stored 16-bit operands run
#               natively (blocks.dot_stored), exact in fp32.
#               They feed only gradients (tolerance 1e-2, rewy-math §8). Profile-8 (H200,
#               benchmarks/results/profile-8/): DeltaNet fwd+bwd 2.23 -> 1.80 ms (bwd_leaf
#               0.64 -> 0.37), KDA 6.26 -> 5.76 (bwd_leaf 2.38 -> 2.00); gradients move by
#               4.7e-3 / 3.9e-3 relative. CPU, float64 reference, β in [0, 2]: DeltaNet
#               (D = 128) dk 6.2e-3 -> 7.6e-3 (of 1e-2), GDN2 (D = 64) db 4.4e-3 -> 8.8e-3 (of
#               2e-2). Run h200-6 passed every accuracy check with it. Default: all.
#               "dT" (dT and dA_qk between bwd_dlam and bwd_leaf, [C, C] per chunk: at
#               C = K = 64 each fp32 copy is twice a bf16 token tensor): CPU at the benchmark's
#               accuracy shapes (benchmarks/results/interpret-accuracy-8/) DeltaNet (8, 64) dk
#               7.30e-3 -> 7.47e-3, dq 5.53e-3 -> 5.79e-3; GDN2 (8, 64) db 4.3e-3 -> 4.7e-3.
#               ptxas, DeltaNet bwd_leaf at 8 warps: 141 -> 123 registers and 112 -> 64 KB of
#               shared memory (two programs per SM instead of one). Peak memory at
#               (8,1024,8,64): −16 MiB by count. Profile-11 (H200,
#               benchmarks/results/profile-11/): fwd+bwd through the op DeltaNet 1.79 -> 1.65
#               ms, GDN 2.18 -> 2.14, KDA 4.66 -> 4.57; run h200-9: DeltaNet's peak at
#               (8,1024,8,64) 120 -> 104 MiB (FLA's 104). Default.
#   backward.native_pass_dots  the backward's two state passes multiply their carried state and
#               per-chunk tensor in the 16-bit dtype they store them in (the recompute pass:
#               W S0, K̄ᵀ R; bwd_pass: K̄ dS, Wᵀ dR) instead of TF32 on fp32 values; the forward
#               never (o's margin). The passes are issue-bound (profile-11, ncu): static SASS
#               DeltaNet 1271 -> 759 and 1125 -> 721 instructions, registers 236 -> 123 and
#               198 -> 108. CPU accuracy (benchmarks/results/interpret-accuracy-9/): DeltaNet
#               (8, 64) dk 7.47e-3 -> 8.56e-3 of 1e-2. Profile-12 (H200,
#               benchmarks/results/profile-12/): DeltaNet bwd_pass 0.314 -> 0.258 ms, fwd+bwd
#               through the op 1.65 -> 1.59; GDN 2.17 -> 2.08; KDA bwd_pass 0.461 -> 0.385;
#               DeltaNet at D = 256 29.0 -> 26.7. Run h200-10 (with it): DeltaNet dk 8.5e-3 at
#               D = 64, every shape passes. Default.
#   backward.twin_pass  the backward's recompute pass and its reverse pass in one launch
#               (``twin_pass``; policy recompute, K ≤ 128): they are independent, and each alone
#               runs one program per SM (B·H·V/32 = 128 at the anchor), issue-bound. ptxas at
#               4 warps and one stage: DeltaNet 208 registers and 28 KB shared, GDN 255 / 24
#               KB, KDA 255 (96 B spilled) / 57 KB — two programs per SM fit. At K = 256 it
#               spills 488 B (4 warps) or keeps one program per SM (8 warps): not used there.
#               Gradients bit-identical (interpret mode). Profile-13 (H200, commit 8cba3db,
#               benchmarks/results/profile-13/), the anchor: DeltaNet twin 0.357 ms against
#               0.187 + 0.255 apart, op 1.58 -> 1.51; GDN 0.433 against 0.205 + 0.301, op
#               2.08 -> 2.01; KDA 0.568 against 0.308 + 0.384, op 4.42 -> 4.33. At
#               (4,4096,64,128), 1024 programs per pass, no gain (3.36 against 1.14 + 2.17;
#               op 11.7 / 11.8). Run h200-11: DeltaNet fwd+bwd −3 to −6% at the five FLA shapes
#               with K ≤ 128 except (4,4096,64,128) (flat). Default.
#   launch.tiles_first  kernels whose grid splits a (chunk or column, head) into value or key
#               tiles — the state passes, output, bwd_local, bwd_leaf — launch the tile axis
#               first (``_call``): CUDA dispatches blockIdx.x fastest, and with (B·H, V/BV) the
#               tiles of one head were B·H programs apart — in different waves wherever the
#               grid outgrows the SMs (K = 256, (4,4096,64,128)) — so every tile re-read the
#               head's W, k, q from memory (the forward pass at (8,2048,32,256): ~6.5 GB per
#               call, ~2 ms at 3.26 TB/s, of its 5.25). Side by side, the tiles share them in L2.
#               Bit-identical results (only the launch order moves). Profile-14 (H200, commit
#               039219f, benchmarks/results/profile-14/): DeltaNet op fwd+bwd at the anchor
#               1.50 -> 1.46 ms; at (4,4096,64,128) 11.8 -> 10.7 (fwd_pass 1.50 -> 1.13, twin
#               3.36 -> 2.63, bwd_pass 2.18 -> 1.84, leaf 1.58 -> 1.45); at (8,2048,32,256)
#               26.7 (profile-12) -> 20.9 (fwd_pass 5.26 -> 3.91, output 4.23 -> 2.59). GDN:
#               15.8 -> 15.1 at (4,4096,64,128); at the anchor its fused pass slows (0.41 ->
#               0.47) — GDN no longer fuses (fwd_pass.fused_output). Run h200-12 (with
#               rewy_intra.kslice): DeltaNet fwd+bwd ÷ FLA graph against h200-11 1.97 -> 1.86
#               (anchor), 2.12 -> 1.90 ((4,4096,64,128)), 2.53 -> 1.81 (K = 256). Default.
#   rewy_bwd_leaf.store_early  no gates: the leaf stores dq and de before forming dk's two
#               products. ptxas (sm_90, K = 128, 8 warps): 123 -> 90 registers, the same 544
#               SASS instructions, 64 KB shared — two programs per SM by registers either way,
#               so a gain is not certain. Profile-14: op fwd+bwd at the anchor 1.50 either
#               way (leaf 0.228 -> 0.230): off.
#   exp2        every e^x of the kernels as exp2(x·log2 e) (blocks.exp): one ex2.approx and a
#               product instead of libdevice's ~14-instruction expf. Profile-9 (H200, commit
#               6942002, benchmarks/results/profile-9/): KDA qk_gram 1.80 -> 1.45 ms, fwd_pass
#               0.44 -> 0.38, the backward's pass 0.39 -> 0.32; KDA fwd+bwd through the op
#               6.19 -> 5.65 (gradients move 2.7e-4 relative: bf16-storage rounding flips).
#               Default since profile-9.
#   fwd_pass.fused_output  a forward whose S0, R nothing reads (policy "recompute", and the
#               primal) forms O = Qγ S0 + P R inside its state pass instead of storing S0, R
#               for the output kernel. Profile-9: DeltaNet fwd 0.685 -> 0.593 ms (the fused
#               pass 0.32 against fwd_pass 0.24 + output 0.17), fwd+bwd through the op
#               1.89 -> 1.81; KDA (with exp2 and the outer diagonals) 5.71 -> 5.69; gradients
#               identical. Default since profile-9, for K ≤ 128 (api._forward): at K = 256
#               run h200-7 measured DeltaNet's forward slower (12.2 -> 13.9 ms). Profile-13:
#               GDN's fused pass is no faster at the anchor (0.417 against 0.243 + 0.182) and
#               slower at (4,4096,64,128) (3.48 against 1.50 + 1.29), DeltaNet's faster at both
#               (0.321 against 0.393; 2.26 against 2.66): the setting may name the gate modes
#               that fuse (``fused_output``), e.g. "none,vector". Profile-14 (launch.tiles_first
#               on): GDN op fwd+bwd at the anchor 2.06 fused -> 1.98 unfused, so from
#               profile-14 to profile-22 scalar gates did not fuse. Profile-22 (H100, device
#               events, with GDN's intra and wu at 2 warps): GDN's fused pass 0.280 ms against
#               the pass 0.160 + output 0.165, fwd+bwd 1.686 -> 1.636 ms. Default: every mode
#               fuses.
#   rewy_qk_gram.kslice  qk_gram's Gram blocks (frame blocks and the per-column diagonal
#               loop) contracted over slices of this many key channels instead of all K at
#               once (Gates._frame_grams): a [16, K] row operand of a 16-row product sits whole
#               in every warp, so at K = 128 two Grams held the kernel at 255 registers with
#               spills; sliced, ptxas reports 153 (4 warps) and none. Profile-10 (H200, commit
#               acdd225, benchmarks/results/profile-10/): qk_gram 1.44 -> 0.80 ms (slices of 32,
#               4 warps), 0.76 (16, 4 warps), 0.56 (32, 2 warps), 0.545 (16, 2 warps), 0.61
#               (16, 1 warp), 1.36 (32, 1 warp), 1.68 (64, 2 warps); KDA fwd+bwd through the op
#               5.56 -> 4.66. Default 16 with 2 warps (WARPS).
#   rewy_intra.kslice  intra's own key Gram (no or scalar gates; vector gates read theirs from
#               qk_gram) from the rows as stored — native bf16 products — over key slices of
#               this many channels (0: fp32 rows, all K at once). ptxas, DeltaNet K = 128, 4
#               warps: 221 -> 172 registers (slices of 16), just short of a third program per
#               SM; slices of 64: 178, SASS 4215 -> 3399 instructions; at K = 256 232 B of
#               spills from fp32 rows, none over slices of 64. Profile-14: intra at the anchor 0.285 -> 0.267 ms (slices of 128),
#               DeltaNet op 1.50 -> 1.48, GDN 2.01 -> 1.97; at (8,2048,32,256) (slices of 64,
#               tiles first) intra 3.45 -> 1.55 ms, op 20.9 -> 19.1. Gradients move within
#               bf16 rounding (3.8e-3 relative at the anchor; run h200-12 passes rewy-math §8
#               with it at every shape). Default 64 since profile-14.
#   state_pass.one_seq_init  calls without cu_seqlens (one sequence per batch row, Shape.one_seq):
#               the forward's state pass starts its loop from h0 and the backward's reverse
#               pass from the final state's cotangent, instead of selecting h0 (adding dfin)
#               at every chunk by the chunk's metadata — an indirect [K, BV] load and a select
#               per chunk (ptxas, DeltaNet's fused pass: 64 shared loads and 32 selects of its
#               1315-instruction step). Without that load Triton buffers deeper at 3 stages,
#               too deep for shared memory for the fused pass: stages per pass below.
#               Bit-identical.
#               Profile-16 (H200, commit 73e44ca, benchmarks/results/profile-16/), the anchor:
#               DeltaNet fused pass 0.283 -> 0.261 ms, twin 0.376 -> 0.336, op 1.42 -> 1.36;
#               GDN fwd_pass 0.239 -> 0.212, twin 0.463 -> 0.393, op 1.95 -> 1.87. Default.
#   state_pass.end_after_loop  with one_seq_init: the passes store the final state (dh0) once
#               after their loop instead of under a per-chunk branch on the chunk's end
#               (reset) flag, and read no metadata in the loop. SASS (sm_90, DeltaNet's
#               backward fwd_pass at 2 stages): the loop 392 -> 303 instructions, no scalar
#               LDG of the flag before a branch at every step. Profile-17 (H200, anchor): no
#               measurable change (DeltaNet op 1.30 either way). Bit-identical; default, as the
#               simpler loop.
#   state_pass.stages  pipeline stages of the one-sequence passes per pass (_pass_stages): at
#               2 stages each step waits for its own loads, issued at the end of the step
#               before. Profile-17 (H200, benchmarks/results/profile-17/), anchor: the twin
#               pass 1 -> 2 stages DeltaNet 0.319 -> 0.240 ms (3: 0.275), GDN 0.394 -> 0.288,
#               KDA 0.583 -> 0.418, DeltaNet at (4,4096,64,128) 2.26 -> 1.65; GDN's unfused
#               forward pass 2 -> 3 stages 0.234 -> 0.174 (4: no faster for the recompute pass,
#               0.116 -> 0.163). Op fwd+bwd: DeltaNet 1.30 -> 1.22, GDN 1.84 -> 1.70, KDA 4.23
#               -> 4.05, DeltaNet (4,4096,64,128) 9.53 -> 8.92. Default {fwd 3, fused 2, bwd 2,
#               twin 2}; the fused pass stays at 2 (3 would need 237 KB), and so does the
#               vector gates' unfused forward pass (policy save: 148 KB at 2, 222 KB with
#               spills at 3 — untimed). fp32 inputs fit too (ptxas, DeltaNet: twin 131 KB,
#               fused pass 164 KB at 2 stages).
#   rewy_intra.stacked_diag  intra's joint diagonal inverse on its n [16, 16] blocks stacked
#               into one [n, 16, 16] value (blocks.inv_diags_stacked): each step's two
#               reductions then run within a block, with no layout conversion — ptxas
#               (DeltaNet): bar.sync per step 17 -> 3, SASS 3399 -> 3118. Profile-16: intra
#               0.269 -> 0.220 ms (DeltaNet), 0.282 -> 0.237 (GDN); op 1.36 -> 1.31 and 1.87 ->
#               1.83; gradients move 1.8e-3 relative (bf16 storage rounding of A, W, U; every
#               accuracy check of run h200-13 passes). Default.
#   rewy_intra.emit_P  no or scalar gates: intra also forms P = tril(Qγ K̄ᵀ) (one [C, K]·[K, C]
#               product per chunk) for the output to read instead of rebuilding it per value
#               tile. ptxas: DeltaNet's fused pass loses its spills (84 B) and 8% of its SASS,
#               GDN's output kernel 1240 -> 840 instructions; but intra gains the product.
#               Profile-16: DeltaNet intra 0.269 -> 0.294, fused pass 0.261 -> 0.247, op 1.36 ->
#               1.38; GDN op 1.87 -> 1.91 (1.85 with its output fused again). Off.
#   fwd_pass.split_kr  the forward's state pass forms K̄ᵀ R as kᵀ (d ⊙ R) in two native bf16
#               products, k as stored and R split into bf16 high and low parts (blocks.dot_split;
#               no or scalar gates, bf16 k): R keeps ~16 significant bits instead of TF32's 11,
#               and k is no longer converted to fp32 element by element. ptxas (sm_90, 4
#               warps): GDN's pass at K = 128, loop 921 -> 750 SASS instructions per step, 231 ->
#               197 registers; at K = 256 (one stage) DeltaNet's forward pass 1766 -> 1534 SASS
#               with spills 536 -> 88 B, GDN's 1990 -> 1582 with 548 -> 84 B; DeltaNet's fused
#               pass (K = 128) loop 1206 -> 1153. Untimed on the GPU (the session's device time
#               was spent): off until profiled (``profile_kernels.py`` variant splitkr).
#   forward.low_precision  16-bit inputs: which of the forward's W, U (intra's outputs, read by
#               its state pass) are stored in the input dtype instead of fp32. Accuracy
#               (benchmarks.interpret_accuracy, CPU, DeltaNet (1,512,16,128)): o 3.39e-3 ->
#               3.76e-3 of 5e-3 with W in bf16, 3.94e-3 with U, 4.27e-3 with both; the final
#               state 2.68e-3 -> 3.38e-3 (W). W in bf16 was the default for profile-18 and run
#               h200-15, so that the fused pass would fit 3 stages by ptxas's count (172 KB
#               against 237 KB with an fp32 W); profile-19 (H200, anchor) timed the fp32 W at 3
#               stages ("fused_w32" below) equal to it — DeltaNet op 1.16 ms both, fused pass
#               0.198 both; KDA 3.90 both — so the default is () again, for the accuracy.
#   forward.low_precision_wide  names added to "forward.low_precision" at K > 128 (where the
#               forward's pass is unfused): ("W", "S0", "R") stores W in the input dtype and the
#               pass's chunk-start states and residuals in bf16 for the output kernel, and the
#               pass then multiplies natively in bf16 like the backward's recomputing pass
#               (FLA's chunk_fwd_h stores h in bf16 too). Before, at (8,2048,32,256) (DeltaNet)
#               the forward's pass took twice the recomputing pass (TF32 products of an upcast
#               W, 424 B of spills by ptxas, an fp32 S0 of 2.1 GB read back by the output
#               kernel). profile-19 (H200, DeltaNet (8,2048,32,256), ms): pass 2.64 -> 1.57,
#               output 2.60 -> 1.95, forward 6.38 -> 4.66, op fwd+bwd 15.9 -> 14.2 (storage only,
#               TF32 products kept — "forward.native_pass_dots" False: pass 2.40, op 15.0). CPU
#               accuracy (benchmarks.interpret_accuracy deltanet 32 256, the benchmark's shape
#               (1,512,32,256)): o 3.02e-3 -> 4.21e-3 of 5e-3, final state 2.88e-3 -> 4.12e-3
#               (FLA on the H200 there: 4.66e-3, 4.57e-3); gradients unchanged.
#   forward.native_pass_dots  whether the forward's pass multiplies natively when S0, R are
#               stored 16-bit (as "backward.native_pass_dots" for the backward's passes);
#               False keeps the TF32 products and only halves the bytes (variant fwides).
#   forward.native_fused_dots  16-bit inputs: the forward's fused pass (K ≤ 128, the output
#               inside) multiplies its recurrence natively in bf16 — W S with S rounded to
#               bf16, K̄ᵀ R with R rounded — as the unfused pass does at K = 256 and FLA's
#               chunk_delta_h does; the state is still carried and summed in fp32, the output's
#               products stay TF32. True / False, or the gate modes it applies to (only "none"
#               and "vector" fuse). At the anchor the fused pass takes 0.20 ms against FLA's
#               0.068 + 0.061 for its state pass and output; ptxas (4 warps, 3 stages):
#               DeltaNet spills 220 B -> none, SASS 1930 -> 1588, mma 64 -> 48; KDA spills 316
#               -> 480 B, SASS 2538 -> 2690, shared memory 249 -> 217 KB. Accuracy
#               (benchmarks.interpret_accuracy, CPU, (1,512,16,128)): DeltaNet o 3.39e-3 ->
#               4.67e-3 of 5e-3, final state 2.68e-3 -> 4.86e-3 — 3% of margin left, and 5.1e-3
#               in a small test case (FLA's bf16 products fail it: 5.3e-3 on the H200) —, so not
#               for DeltaNet; KDA: see benchmarks/results/interpret-accuracy-12/. Off, untimed
#               (profile variant ffnat).
#   fwd_pass.split_w  with a bf16 W in the forward: W S as W (S_hi + S_lo), two native bf16
#               products (blocks.dot_split), instead of W upcast for a TF32 product. ptxas: the
#               fused pass spills 456 B at 3 stages (244 at 2): off.
#   rewy_wu.whole_chunk  the backward's W, U from the kept inverse by ``wu``: two [C, C]·[C, ·]
#               products — A's upper blocks are stored as zeros, and Ēγ = e^{G} ⊙ Ē with G from
#               the chunk's start stays ≤ 1 — instead of ``intra`` given A, 2·n(n+1)/2
#               [16, 16]·[16, ·] row-block products (FLA's recompute_w_u does the same: 0.040
#               ms against our wu's 0.10 at the anchor). ptxas (sm_90, 4 warps, K = 128): DeltaNet 1616 -> 304
#               SASS (mma 160 -> 8 wgmma), 96 -> 114 registers, 4 -> 24 KB shared; GDN 2008 ->
#               712; KDA 2432 -> 832 (140 -> 122 registers). Agrees with the row-block sums to
#               fp32 rounding. Off: profile-18 (H200, anchor) wu 0.103 -> 0.118 ms (DeltaNet),
#               0.112 -> 0.122 (GDN) — slower, for all its fewer instructions; KDA 0.136 ->
#               0.132. True / False, or the gate modes it applies to (variant splitv).
#   rewy_intra.split_wu  the forward's intra forms only the inverse (in fp32, a transient of
#               B·H·N·C² floats) and W, U come from a second launch of two whole-chunk products,
#               which also casts A to the dtype the backward keeps. ptxas (sm_90, 4 warps,
#               DeltaNet K = 128): intra without its 20 row-block W, U products 3118 -> 1526
#               SASS (mma 272 -> 144), 178 -> 136 registers; the W, U launch (fp32 A, TF32
#               products, and the bf16 copy of A) 808 SASS, 142 registers, 48 KB shared.
#               Gradients agree to 1.1e-4 relative (interpret, bf16). Off: profile-18 (H200,
#               anchor) DeltaNet intra 0.22 ms -> 0.137 + 0.135 for the two launches, GDN 0.236
#               -> 0.151 + 0.134 — slower; KDA 0.258 -> 0.075 + 0.150, faster (~0.03 ms of the
#               op's 3.9). True / False, or the gate modes it applies to: ("vector",) with
#               "rewy_wu.whole_chunk" ("vector",) is profile variant splitv, untimed as such.
#   forward.row_scaled_ez  per-row erase and write gates (DeltaNet, GDN, KDA: e = β ⊙ k,
#               z = β ⊙ v): the forward's intra, qk_gram (and wu under split_wu) read k, v and
#               β and form Ē, Z exactly — β on T's rows after the Gram, on A's columns before
#               W's and U's products — instead of reading e, z rounded to the inputs' 16 bits
#               (api.general_delta's ``rows``; the backward keeps the rounded e, z). That
#               rounding was most of the forward's error: interpret mode with TF32 rounding
#               emulated (blocks.TF32_EMULATION "round", which reproduces the H200's DeltaNet o
#               3.4e-3 as 3.43e-3), benchmarks/results/interpret-accuracy-13/: DeltaNet
#               (16, 128) o 3.43e-3 -> 2.43e-3 (the bf16 output's own rounding is ~2.3e-3),
#               final state 2.74e-3 -> 0.68e-3; GDN 2.92 -> 2.38, 1.75 -> 0.36; KDA 2.93 ->
#               2.39, 1.73 -> 0.36; gradients unchanged (DeltaNet dk 7.45e-3 -> 7.46e-3).
#               ptxas (sm_90, 4 warps): DeltaNet intra 178 -> 254 registers (2 programs per SM
#               either way), SASS 3118 -> 3422; KDA 179 -> 178, 3245 -> 3525; intra reads
#               [C] β rows instead of two [C, K] tensors. Default; untimed on the H200
#               (variant noezrows is the old path).
#   backward.row_scaled_wu  with forward.row_scaled_ez: the backward's W, U from k, v and the
#               row scales as well (the residuals keep v and β instead of z — the ReWY
#               backward reads z nowhere else), so its recomputed states are the forward's:
#               interpret, TF32 rounded, DeltaNet (8, 64) dk 8.61e-3 -> 7.89e-3, dq 6.38e-3 ->
#               5.82e-3, dβ 8.02e-3 -> 7.26e-3; (16, 128) dk 7.46e-3 -> 6.77e-3 (the tightest
#               checks of the suite). The default backward wu (intra given A) multiplies in
#               TF32 either way; the whole-chunk wu loses its native bf16 products. Default.
#   backward.leaf_maps_in_kernel  with a per-row β (api.general_delta's rows): bwd_dlam and
#               bwd_leaf also differentiate Ē = β ⊙ k and Z = β ⊙ v (dv = β ⊙ Λ from fp32 Λ,
#               dk + β ⊙ de, dβ), so no XLA pass touches e, de or dz. More accurate
#               (interpret-accuracy-14: DeltaNet (8, 64) dk 7.89e-3 -> 7.60e-3) but profile-20
#               (H200, anchor): bwd_leaf 0.198 -> 0.282 ms, bwd_dlam 0.101 -> 0.135 (DeltaNet),
#               1.69 -> 1.82 and 0.102 -> 0.130 (KDA) — more than the glue it removes. Off: the
#               backward forms e = β ⊙ k (api.leaf_product) and the leaf maps' VJP in XLA.
#   backward.row_vjp_kernel  with leaf_maps_in_kernel off: the VJP of e = β ⊙ k, z = β ⊙ v
#               (dk + β ⊙ de, β ⊙ dz, dβ's two row sums) by ``row_scale_vjp``, one read or write
#               of each tensor, instead of XLA's three fusions (0.054 + 0.027 + 0.022 ms of
#               device time for DeltaNet at the anchor, profile-21; ~0.036 ms of bytes at
#               3.26 TB/s). The same fp32 arithmetic. Profile-21 call 3 (DeltaNet, anchor):
#               the kernel takes 0.069 ms (1.7 TB/s; 0.068 at 4 warps) against the 0.055 of
#               glue it removes, wall 1.045 -> 1.069 ms: off (variant rowvjp). Run h200-18 ran
#               with it on.
#   forward.low_precision_modes  {gate mode: names} added to "forward.low_precision" at
#               K ≤ 128 for that mode (api._forward_dtypes): {"scalar": ("W", "S0", "R")} gives
#               GDN's unfused forward the K = 256 treatment — bf16 storage and native products
#               in its pass. ptxas (sm_90, 4 warps, 3 stages): GDN's forward pass 255 -> 176
#               registers, 156 -> 87 KB shared, SASS 1599 -> 1231; its output kernel 229 -> 188
#               registers. Accuracy (interpret, TF32 rounded, with row_scaled_ez): GDN (16, 128)
#               o 2.38e-3 -> 3.02e-3, final state 0.36e-3 -> 2.39e-3 — the level before exact
#               βk. Off, untimed: variant gdnlp. (DeltaNet's and KDA's forwards are fused: there
#               "forward.native_fused_dots" is the same trade.)
#   rewy_qk_gram.centred  with a declared gate bound (g ≥ blocks.CENTRED_MIN_GATE) qk_gram's
#               diagonal blocks as centred frame products over key slices — the off-diagonal
#               blocks' path (Gates._frame_grams) — instead of the 16-step exact loop; the leaf
#               has taken the centred blocks under the bound since profile-4. qk_gram is KDA's
#               largest forward kernel (0.545 ms of a 1.37-ms forward at the anchor, profile-10).
#               Profile-4 timed centred diagonals in qk_gram before the key slices and the row
#               grid (0.95 -> 1.0 ms). Profile-21 (device events, KDA g ≥ −5 at the anchor):
#               qk_gram 0.464 -> 0.336 ms, op 3.05 -> 2.92; accuracy (interpret, TF32 rounded,
#               (1, 512, 16, 128)) o 1.71e-3 -> 1.72e-3, gradients unchanged. Default (variant
#               qcent; "centred" now times the same).
#   rewy_wu.col_tile  ``wu`` on column tiles of this width (0: whole rows), one program per
#               (chunk, head, tile): a memory-bound kernel whose whole-row programs hold 114
#               registers (4 per SM) and stall on loads (profile-11 ncu); 74 at 64, 46 at 32
#               (ptxas, DeltaNet's backward wu). Off, untimed: variants wut, wut32 (the
#               backward's), splitt, splitt32 (and the forward's, with split_wu).
#   launch.wide_warps  warps per kernel at K > 128, by "<kernel>" or "<kernel>:<gate mode>"
#               (Shape.warps): e.g. {"fwd_pass:vector": 8}, where ptxas finds KDA's pass
#               spilling at 4 warps and DeltaNet's measured slower at 8. intra and wu stay
#               at 4 there: at 2 (their K ≤ 128 count) ptxas finds 700–1200 B of spills in
#               intra and 200–450 B in wu at K = 256.
#   rewy_qk_gram.exact_diag "outer"  (blocks.DIAG_METHODS) all pairs of a diagonal block at once:
#               profile-9 with exp2, qk_gram 1.45 (loop) -> 1.53: slower, not the default.
# (profile-5: benchmarks/results/profile-5/; the three together take KDA's gradient through the
# op 6.20 -> 5.86 ms, DeltaNet 2.01 -> 1.88, GDN 2.43 -> 2.16 at the anchor shape, jax.grad.)
#   backward.chunk_qdo  bwd_local forms each chunk's state-free term scale · Qγᵀ dO [K, V]
#               beside Pᵀ dO (it holds q and dO already; vector gates read q and G beside the
#               kept P) and the reverse state pass reads that [K, BVs] tile instead of q [C, K]
#               and dO [C, BVs]. True / False or the gate modes it applies to. The
#               aim is the twin pass's shared memory: ptxas (sm_90, K = 128, 4 warps, 2 stages)
#               DeltaNet's twin 120 -> 80 KB — its backward half's double-buffered q was what
#               held it to one program per SM, so at the anchor its 256 programs ran as two
#               waves on 132 SMs — and 156 -> 148 registers; GDN's twin 102 -> 66 KB (103 at 3
#               stages). bwd_local pays the product and a [K, V] store per chunk: 90 -> 138
#               registers (DeltaNet), 90 -> 218 (GDN: Qγ in fp32). Memory: the term is a
#               [B,H,N,K,V] tensor in the dS storage dtype (bf16: the size of dS_end) live from
#               bwd_local through the reverse pass; it is not overwritten by dS_end (see
#               bwd_pass). Accuracy (benchmarks.interpret_accuracy, TF32 rounded): DeltaNet
#               (16, 128) dk 6.65e-3 both, dβ 6.18e-3 -> 6.16e-3; (8, 64) dk 7.79e-3 -> 7.82e-3;
#               GDN (16, 128) dk 3.81e-3 -> 3.82e-3. KDA (K = 128, 2 stages): the twin
#               102 -> 97 KB, 255 -> 172 registers, SASS 3469 -> 3000; bwd_local 60 -> 154
#               registers; accuracy (g ≥ −5, (16, 128)) unchanged. Off, untimed: variants qdo,
#               qdo3.
#   rewy_bwd_local.tile_loop  bwd_local on the grid (N, B·H) with a loop over the value tiles
#               instead of one program per tile: P = tril(Qγ K̄ᵀ) is built (no or scalar gates) or
#               read (vector gates) once per chunk — at the anchor two tiles each rebuilt it, and
#               FLA's dv_local (0.036 ms against our 0.059, profile-21) forms it once. ptxas
#               (K = V = 128, 4 warps): DeltaNet 96 registers, 32 KB, 728 SASS (24 mma) for
#               both tiles, against 90 / 512 (16 mma) per tile's program; with chunk_qdo 162
#               registers, 1144 SASS against 138 / 704 per tile; GDN with chunk_qdo 206 against
#               218; KDA 65 against 60. Bit-identical. Off, untimed: variants bltl, qdotl.
#   fwd_pass.predecayed  vector gates: the forward's fused pass reads K̄ = e^{G_C − G} ⊙ k and
#               Qγ = e^{G} ⊙ q from ``decayed_rows`` (one small kernel: a read of k, q, G and
#               two writes) instead of k, q and G's rows: no per-element exponentials in its
#               value-tile programs (KDA's pass 0.39 ms against DeltaNet's 0.18 at the anchor,
#               profile-21), only G's last row per chunk for the state's decay. True: K̄ and Qγ
#               in the inputs' dtype; "kbar32": K̄ in fp32. ptxas (KDA, K = 128, 4 warps):
#               3 stages 249 KB, 316 B of spills, 2554 SASS -> 232 KB, 40 B, 1839 (True); at 2
#               stages 177 KB, 28 B, 2109 -> 160 KB, none, 1514 (True), 208 KB, none, 1538
#               ("kbar32"; 312 KB at 3). Interpret accuracy (KDA g ≥ −5, (16, 128), TF32
#               rounded): o 1.72e-3 -> 1.86e-3 (True) / 1.79e-3 ("kbar32"), final state
#               0.36e-3 -> 1.65e-3 / 0.36e-3 of 5e-3; gradients unchanged (the backward
#               recomputes). Profile-22 (H100, device events, KDA g ≥ −5 at the anchor): the
#               fused pass 0.389 -> 0.224 ms plus decayed_rows 0.074; fwd+bwd 2.81 -> 2.70 with
#               row_frames. Default True since then ("kbar32", variant pd32, was slower).
#   backward.predecayed  vector gates: the backward's state passes read K̄ and Qγ from
#               ``decayed_rows`` (formed once per token) instead of forming them from k, q and G
#               in each value-tile program — in the dtype each pass would round them to (K̄ in
#               bf16 where both passes multiply natively, else fp32; Qγ in fp32), so the results
#               are bit for bit the default's. ptxas (KDA twin, K = 128, 4 warps, 2 stages):
#               102 KB, 255 registers, 3469 SASS -> 148 KB, 160, 1958 alone (the fp32 Qγ tile
#               costs shared memory: one program per SM) and 80 KB, 144, 1477 with chunk_qdo
#               (no Qγ read: two programs per SM, DeltaNet's twin's figures). Off, untimed:
#               variants bwdpd, bwdpdq, allpd. Profile-22: with chunk_qdo the twin pass 0.405 ->
#               0.275 ms, but bwd_local 0.047 -> 0.124 and decayed_rows +0.05: net ~0. Off.
#   rewy_qk_gram.row_frames  vector gates with key slices: a row block's frame-product blocks
#               (every j < i, and the centred diagonal under a declared bound) in one loop over
#               the key slices (blocks.Gates.row_frame_grams), so the row operands q, Ē are read
#               and scaled by their frame factor once per slice for the whole row instead of
#               once per block (``_frame_grams``: i times in row block i). Bit for bit the
#               default's P and T (tested). qk_gram is KDA's largest forward kernel after the
#               fused pass (0.336 ms bounded at the anchor, profile-21; FLA forms its Grams and
#               inverse in 0.211). Profile-22 (H100, device events, anchor): qk_gram 0.335 ->
#               0.216 ms (KDA), 0.331 -> 0.216 (GDN2). Default since then (variant qrowf).
#   backward.leaf_e_rows  ReWY with no or scalar gates (DeltaNet, GDN): bwd_leaf forms e = βe ⊙ k
#               from k and βe, rounded as api.leaf_product rounds it (bit for bit, tested),
#               instead of reading an e that XLA formed and stored (profile-22, DeltaNet at the
#               anchor: that fusion 0.026 ms, and the leaf reads one [B,T,H,K] tensor less).
#               Unlike "backward.leaf_maps_in_kernel" (slower in profile-20/22) the leaf's
#               outputs are unchanged: de still goes to XLA's VJP of the row scale. ptxas (sm_90,
#               K = 128, 8 warps, 3 stages): DeltaNet's leaf 72 -> 80 KB, 138 registers either
#               way, SASS 536 -> 600, no spills; GDN's 104 -> 120 KB, 254 -> 255 registers with
#               52 B of spills (none before). Profile-23 (H100, device events, anchor):
#               DeltaNet fwd+bwd 1.144 -> 1.107 ms (leaf 0.214 -> 0.203, XLA glue 0.108 ->
#               0.083), GDN 1.638 -> 1.614 (leaf 0.488 -> 0.478, glue 0.121 -> 0.098). Default
#               since then for those modes (variant noleafe: XLA's e). Vector gates (KDA,
#               twenty-third session, variant leafev) form e through blocks.ScaledRows, except
#               with per-pair diagonals: untimed, off — ptxas (KDA bounded, K = 128, 4 warps)
#               150 -> 152 registers and SASS 4504 -> 4744 in a leaf of 0.93 ms that is bound
#               by instruction issue, against the same 0.026-ms fusion saved.
#   rewy_bwd_leaf.native_decayed  scalar gates (GDN): the decayed chunk cotangents dT ⊙ D and
#               dA_qk ⊙ D (D_rs = e^{G_r − G_s}) rounded back to the dtype dT, dA_qk are stored
#               in, so that with 16-bit inputs their four products with k, q, e run natively in
#               bf16, as DeltaNet's do — off, they are fp32 and every product TF32 (twice the
#               shared memory per operand, half the rate). One more bf16 rounding of each
#               element, as FLA's GDN backward rounds its decayed dA before its dots (dA_qk's
#               diagonal, decay factor 1, is the stored value: its products stay exact). ptxas
#               (sm_90, K = 128, 8 warps, 3 stages): GDN's leaf 120 -> 96 KB of shared memory,
#               255 -> 237 registers, no spills (20 B before), SASS 1814 -> 1454, mma 64 -> 48
#               (DeltaNet's leaf: 80 KB, 138, 600, 40). (dA_qk's diagonal as element-wise row
#               scales instead of [C, C] products: 88 KB, 245, SASS 1534; without the rounding
#               112 KB and 148 B of spills — not taken.) GDN's leaf was 0.478 ms against
#               DeltaNet's 0.203 at the anchor (profile-23, H100). Emulated accuracy:
#               benchmarks/results/interpret-accuracy-16/. Profile-24 (H100, anchor, with
#               dlam_decays off): leaf 0.475 -> 0.366 ms. Variant leaftf32 turns it off. Moot
#               under dlam_decays below, which decays dT, dA_qk before the leaf.
#   backward.dlam_decays  scalar gates (GDN): bwd_dlam stores dT ⊙ D and dA_qk ⊙ D (dA_qk's
#               diagonal with its factor 1) instead of the leaf forming D and both products per
#               key tile; the leaf's maps are then DeltaNet's — native products of the stored
#               16-bit values. One rounding of each decayed element (native_decayed: two).
#               dA_qk's diagonal (factor 1) still goes through two products of its own (the
#               leaf splits it off): the gate gradient's pairs must not read dq, dk holding
#               those terms, which cancel there (d_r k_r q_r − d_r q_r k_r) but leave rounding
#               at dk's size — the form timed below kept them in and failed the fp32
#               fully-decayed property test (dg ratio 0.63; tests/test_properties.py). ptxas
#               (sm_90, K = 128): the leaf 237 -> 185 registers, SASS 1454 -> 1250, mma 48 -> 56
#               (DeltaNet's: 80 KB, 138, 600, 40; the timed form 172, 1134, 40); bwd_dlam 186 ->
#               217 registers, SASS 1144 -> 1296. Profile-24 (H100, anchor, the timed form):
#               leaf 0.366 -> 0.324 ms, bwd_dlam 0.073 -> 0.077; GDN fwd+bwd 1.426 -> 1.385 —
#               the corrected form is untimed. Default since the twenty-fifth session (variant
#               leafdecay: the form before).
#   state_pass.value_side_decay  scalar gates (GDN): the state passes put the per-row decays
#               on the [C, BVs] operand of each product — K̄ dS = d ⊙ (k dS), Qγᵀ dO =
#               qᵀ (γ ⊙ dO) (γ ⊙ dO rounded to dO's dtype: a native product), Qγ S0 =
#               γ ⊙ (q S0), and in native passes K̄ᵀ R = kᵀ (d ⊙ R) — instead of scaling the
#               [C, K] rows of k and q: 4× fewer elements at K = 128, BVs = 32, and k, q used as
#               stored (exact). ptxas (sm_90, K = 128): the twin pass 242 -> 156 registers,
#               103 -> 119 KB, SASS 2503 -> 1745, mma 48 -> 40 (DeltaNet's: 154, 123 KB, 1477,
#               40); the fused forward pass SASS 2420 -> 2380, spills 180 -> 200 B (its TF32
#               K̄ᵀ R in the value-side form spills 412 B: kept on the key side). Profile-24
#               (H100, anchor): fused pass 0.279 -> 0.253 ms, twin 0.293 -> 0.277; GDN fwd+bwd
#               1.438 -> 1.385. Default since the twenty-fifth session (variant keyside: the
#               form before).
#   rewy_intra.gate_on_A  scalar gates (GDN): intra's and wu's W = A (γ ⊙ Ē) as
#               (A diag(βe γ)) e — the decay joins the row scale on A's [16, 16] column blocks
#               instead of scaling Ē's [16, K] rows for every block product. ptxas (sm_90,
#               K = 128, 2 warps): intra 184 -> 40 B of spills, SASS 6164 -> 5588 (DeltaNet's
#               5172); wu SASS 3896 -> 3576 (3328). Profile-24 (H100, anchor): intra 0.194 ->
#               0.174 ms, wu 0.102 -> 0.094; GDN fwd+bwd 1.409 -> 1.385. Default since the
#               twenty-fifth session (variant gaterows: the form before).
#   precision.narrow_keys  16-bit calls with K at or below it run the kernels on fp32 q, k, v
#               (no 16-bit stores; three TF32 products per dot on the GPU, api._precision;
#               o rounded to the inputs' dtype at the end) — 0: the 16-bit kernels at every K.
#               Unit keys in K channels overlap by ~K^−½, so at small K the chunk's I + T and
#               its inverse A are far from the identity and the delta rule's transitions (β
#               up to 2) amplify the 16-bit roundings (q, k rounded after their L2
#               normalisation; the backward's bf16 stores, A's the largest) past rewy-math §8:
#               interpret sweeps (benchmarks/results/interpret-sweep-26) found bf16 dk 1.14e-2
#               (DeltaNet K = 16, T = 272) and 1.06e-2 (GDN2 K = 32, T = 285) of 1e-2; fp32
#               there: 1.9e-3, 1.8e-3. At K = 64 the same regime stays under (dk 0.93–0.96 of
#               its bound). Untimed (no device in the twenty-sixth session); FLA's shapes all
#               have K ≥ 64. Since the twenty-sixth session (variant narrow16: 0).
DEFAULTS = {"rewy_bwd_leaf.rowgrid": True, "rewy_qk_gram.rowgrid": True,
            "rewy_intra.exact_diag": "loop", "rewy_qk_gram.exact_diag": "loop",
            "rewy_bwd_leaf.exact_diag": "levels", "rewy_intra.gram_from_qk": True,
            "rewy_bwd_leaf.shared_decay": True, "rewy_intra.joint_diag_inverse": True,
            "rewy_qk_gram.pairgrid": False, "recompute.keep_chunk_matrices": True,
            "rewy_intra.unroll": False, "rewy_qk_gram.unroll": False,
            "backward.low_precision": ("S0", "R", "dS", "dR", "dRl", "lam", "W", "U", "A", "dT"),
            "exp2": True, "fwd_pass.fused_output": True,
            "rewy_qk_gram.kslice": 16, "rewy_intra.kslice": 64,
            "backward.native_pass_dots": True,
            "backward.twin_pass": True, "launch.tiles_first": True,
            "rewy_bwd_leaf.store_early": False, "rewy_intra.emit_P": (),
            "rewy_intra.stacked_diag": True, "state_pass.one_seq_init": True,
            "fwd_pass.split_kr": False, "state_pass.end_after_loop": True,
            "state_pass.stages": {"fwd": 3, "fwd_vector": 2, "fused": 3, "fused_w32": 3,
                                  "fused_f32": 2, "bwd": 2, "twin": 2},
            "state_pass.wide_stages": {"native": 1},
            "forward.low_precision": (), "forward.low_precision_wide": ("W", "S0", "R"),
            "forward.native_pass_dots": True, "forward.native_fused_dots": False,
            "fwd_pass.split_w": False,
            "rewy_wu.whole_chunk": False, "rewy_intra.split_wu": False,
            "rewy_wu.col_tile": 0, "launch.wide_warps": {"intra": 4, "wu": 4}, "forward.row_scaled_ez": True,
            "forward.low_precision_modes": {}, "rewy_qk_gram.centred": True,
            "backward.row_scaled_wu": True, "backward.leaf_maps_in_kernel": False,
            "backward.row_vjp_kernel": False, "backward.chunk_qdo": False,
            "rewy_bwd_local.tile_loop": False, "fwd_pass.predecayed": True,
            "backward.predecayed": False, "rewy_qk_gram.row_frames": True,
            "backward.leaf_e_rows": ("none", "scalar"), "rewy_bwd_leaf.native_decayed": True,
            "backward.dlam_decays": True, "state_pass.value_side_decay": True,
            "rewy_intra.gate_on_A": True, "precision.narrow_keys": 32}
# The backward's stored tensors that "backward.low_precision" may name: the recomputed chunk
# start states S0 [B,H,N,K,V] and residuals R [B,Tp,H,V], dS_end "dS" [B,H,N,K,V], dR and its
# state-free part "dRl" [B,Tp,H,V], Λ "lam" [B,Tp,H,V], W [B,Tp,H,K], U [B,Tp,H,V] as re-formed
# in the backward (they set the backward's recomputed states, so they reach every gradient), and
# the inverse A [B,H,N,C,C] that the forward keeps for the backward (its own W, U use it in fp32),
# and "dT": the chunk cotangents dT and dA_qk [B,H,N,C,C] between bwd_dlam and bwd_leaf.
LOW_PRECISION_NAMES = ("S0", "R", "dS", "dR", "dRl", "lam", "W", "U", "A", "dT")
# Overrides for tuning runs (profile_kernels.py), read when a kernel is traced:
#   "<kernel name>.warps" / ".stages"          launch settings, e.g. "rewy_intra.warps": 8
#   any key of DEFAULTS                         e.g. "rewy_bwd_leaf.rowgrid": False
TUNE: dict = {}


def setting(key):
    """A DEFAULTS choice, or its TUNE override."""
    return TUNE.get(key, DEFAULTS[key])


def _names_mode(key, mode):
    """Whether the DEFAULTS setting ``key`` — True / False for every gate mode, or the gate modes
    it applies to (a name or a tuple of names) — applies to ``mode``."""
    v = setting(key)
    if isinstance(v, bool):
        return v
    modes = (v,) if isinstance(v, str) else tuple(v)
    unknown = set(modes) - {"none", "scalar", "vector"}
    if unknown:
        raise ValueError(f"{key}: unknown gate modes {sorted(unknown)}; expected "
                         "True, False or some of none, scalar, vector")
    return mode in modes


def chunk_qdo(mode):
    """Whether the backward forms each chunk's Qγᵀ dO in ``bwd_local`` for the reverse pass
    (DEFAULTS "backward.chunk_qdo": True / False, or the gate modes it applies to)."""
    return _names_mode("backward.chunk_qdo", mode)


def leaf_e_rows(s):
    """Whether ``bwd_leaf`` forms e = βe ⊙ k itself for shape ``s`` (DEFAULTS
    "backward.leaf_e_rows": True / False, or the gate modes it applies to) — never with vector
    gates' per-pair ("loop") diagonals, which read e's rows from memory one token at a time."""
    loop_diag = (s.mode == "vector" and not s.centred
                 and setting("rewy_bwd_leaf.exact_diag") == "loop")
    return _names_mode("backward.leaf_e_rows", s.mode) and not loop_diag


def fused_output(mode):
    """Whether the forward's state pass forms the output for gate mode ``mode`` ("none",
    "scalar", "vector"): DEFAULTS "fwd_pass.fused_output" is True / False for every mode, or
    the gate modes that fuse (a name or a tuple of names, e.g. ``--tune
    fwd_pass.fused_output=none,vector``)."""
    return _names_mode("fwd_pass.fused_output", mode)


def split_wu(mode):
    """Whether the forward's intra forms only the inverse and a second launch W, U for gate
    ``mode`` (DEFAULTS "rewy_intra.split_wu": True / False, or the gate modes it applies to)."""
    return _names_mode("rewy_intra.split_wu", mode)


def wu_whole_chunk(mode):
    """Whether the backward's W, U come from ``wu``'s whole-chunk products for gate ``mode``
    (DEFAULTS "rewy_wu.whole_chunk": True / False, or the gate modes it applies to)."""
    return _names_mode("rewy_wu.whole_chunk", mode)


def native_fused_dots(mode):
    """Whether the forward's fused pass multiplies its recurrence in bf16 for gate ``mode``
    (DEFAULTS "forward.native_fused_dots": True / False, or the gate modes it applies to)."""
    return _names_mode("forward.native_fused_dots", mode)


def intra_forms_P(mode):
    """Whether ``intra`` also forms P = tril(Qγ K̄ᵀ) for no or scalar gates (DEFAULTS
    "rewy_intra.emit_P"), so that the output (fused or not) and ``bwd_local`` read it instead
    of rebuilding it per value tile. Vector gates always take theirs from ``qk_gram``."""
    return mode != "vector" and _names_mode("rewy_intra.emit_P", mode)


def dlam_decays(mode):
    """Whether ``bwd_dlam`` stores the chunk cotangents already decayed, dT ⊙ D and dA_qk ⊙ D
    with D_rs = e^{G_r − G_s} (DEFAULTS "backward.dlam_decays"; scalar gates only — a vector
    gate's decay is no [C, C] matrix)."""
    return mode == "scalar" and bool(setting("backward.dlam_decays"))


def value_side_decay(mode):
    """Whether the state passes put a scalar gate's per-row decays on the [C, BVs] value-side
    operand of each product instead of the [C, K] key side (DEFAULTS
    "state_pass.value_side_decay"; a vector gate's decay runs along K and cannot move)."""
    return mode == "scalar" and bool(setting("state_pass.value_side_decay"))


def parse_tune(text):
    """"key=value" (tooling's command lines) -> (key, value) for TUNE: true/false, an integer,
    a comma list (a tuple of names; "key=," is the empty tuple) or a string."""
    key, sep, v = text.partition("=")
    if not sep:
        raise ValueError(f"a tuning setting is key=value; got {text!r}")
    if key not in DEFAULTS and not key.endswith((".warps", ".stages")):
        raise ValueError(f"unknown tuning key {key!r}; expected a key of kernels.DEFAULTS or "
                         "<kernel name>.warps / .stages")
    if "," in v:
        return key, tuple(x for x in v.split(",") if x)
    return key, {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)


def _pass_stages(s, which):
    """Software-pipeline stages of a state pass: ``which`` is "fwd" (the forward's unfused pass
    and the backward's recomputing one), "fused" (the forward's pass with the output), "bwd" or
    "twin" (``twin_pass``). Triton's pipeliner issues step c + stages − 1's loads at the end of
    step c and waits for step c's at its start, so at 2 stages each step's load latency is
    exposed after only the short tail of the step before (SASS: ``DEPBAR.LE SB0, 0x0`` before
    the first product; 0x3 at 3 stages). Reading h0 / dfin at every chunk (the per-sequence
    select of varlen calls) is an indirect load, and with it Triton keeps two buffers per
    per-chunk tile at 3 stages, so those passes keep 3 (the twin pass 1). The one-sequence
    passes take DEFAULTS "state_pass.stages": as many as shared memory holds (ptxas, sm_90,
    K = 128, DeltaNet: the fused pass 164 KB at 2 stages, 237 KB at 3 — over the 227 KB
    limit; the recompute pass 82 / 119 / 156 KB at 2 / 3 / 4, bwd_pass 127 / 184 at 2 / 3, the
    twin pass 29 / 123 / 180 KB at 1 / 2 / 3; GDN's unfused forward pass 115 / 156 at 2 / 3).
    "fused_w32": the fused pass of 16-bit inputs reading an fp32 W (the default:
    "forward.low_precision" ()), "fused" a 16-bit W. ptxas counts 237 KB for the former at 3
    stages, over the limit, yet it runs on the H200 (jaxlib's own Triton) and times as the bf16
    W's 172 KB at 3 stages (profile-19: 0.198 ms both; 0.268 at 2), so ptxas's "does not fit"
    is an upper bound. "fused_f32": fp32 inputs (q, k, U in fp32 too: ptxas 164 KB at 2
    stages, 303 KB at 3), kept at the 2 stages that have run.
    "native": an unfused pass with native bf16 products (``_native_pass_dots``: the backward's
    recomputing one, or the forward's under "forward.low_precision_wide"), "fwd" at K ≤ 128.

    K = 256: one stage (the forward's pass with TF32 products spills 424 B at one, 760 at two;
    bwd_pass needs 233 KB at two by ptxas), except the one-sequence passes DEFAULTS "state_pass.wide_stages"
    names — the native pass holds 190 registers and no spills: ptxas (DeltaNet, 4 warps) 49 /
    155 / 225 KB at 1 / 2 / 3 stages; profile-18: the recomputing pass 1.53 ms at one stage,
    1.61 at two (8,2048,32,256), so one."""
    one_seq = s.one_seq and setting("state_pass.one_seq_init")
    if s.K > 128:
        return setting("state_pass.wide_stages").get(which, 1) if one_seq else 1
    which = "fwd" if which == "native" else which
    if not one_seq:
        return 1 if which == "twin" else 3
    if which == "fwd" and s.mode == "vector":  # its [C, K] gate rows: 222 KB at 3 (KDA, save)
        which = "fwd_vector"
    return setting("state_pass.stages")[which]


class Shape:
    """Static problem description shared by the kernels."""

    def __init__(self, B, Tp, H, K, V, C, n_seq1, mode, prec, BV, BK=None, BVs=None,
                 centred=False, one_seq=False, scale=1.0):
        self.B, self.Tp, self.H, self.K, self.V, self.C = B, Tp, H, K, V, C
        # the op's query scale (K^−½ by default), applied in-kernel: q arrives unscaled, so it
        # is not rounded a second time to its 16-bit dtype after the scaling (``scaled``)
        self.scale = float(scale)
        # one sequence per batch row (no cu_seqlens): chunk 0 resets to h0[:, :, 0] and chunk
        # N − 1 ends it, so the state passes start from h0 / dfin instead of selecting them at
        # every chunk (DEFAULTS "state_pass.one_seq_init")
        self.one_seq = one_seq
        # vector gates with a declared lower bound (blocks.CENTRED_MIN_GATE): diagonal sub-chunk
        # blocks of the leaf kernel as one centred matmul instead of exact per-pair work
        self.centred = centred
        self.N, self.n = Tp // C, C // BS
        self.n_seq1, self.mode, self.prec, self.BV = n_seq1, mode, prec, BV
        # key-tile width of bwd_leaf (it holds [BK, V] state tiles) and its warps: 64 at 8
        # warps; 32 for V > 128; vector gates at K = V = 128 take 32 at 4 warps — the decay
        # maps' [16, BK] tiles hold 186 registers at BK = 64 (one program per SM), 188 at 4
        # warps with BK = 32 (two); profile-11 (H200): KDA bwd_leaf 1.95 -> 1.88 ms, fwd+bwd
        # through the op 4.57 -> 4.51, gradients identical. No or vector gates take 4 warps
        # on any key tile of 32: profile-15 (H200, benchmarks/results/profile-15/) at
        # (8,2048,32,256), KDA bwd_leaf 26.4 -> 14.0 ms, op fwd+bwd 60.3 -> 48.1 (run h200-12d:
        # 46.1 against FLA's 21.0); DeltaNet bwd_leaf 2.92 -> 2.25, op 19.0 -> 18.3; gradients
        # identical. Scalar gates (GDN) keep 8: untimed at 4 (the run ended), where ptxas
        # (sm_90, K = V = 256) reports 255 registers and 558 B of spills against 219 and none;
        # DeltaNet's 4-warp leaf holds 154 registers, no spills.
        vec128 = mode == "vector" and K == V == 128
        self.BK = min(K, BK or (64 if V <= 128 and not vec128 else 32))
        self.leaf_warps = (4 if mode in ("none", "vector") and self.BK == 32
                           else WARPS["bwd_leaf"])
        # value-tile width of the two state passes: 32 keeps S [K, 32] and the chunk's R in
        # registers without spills (ptxas, sm_90) and gives B·H·V/32 programs to the SMs
        self.BVs = min(V, BVs or 32)

    def scaled(self, x):
        """x · scale, for the fp32 result of a product with q or with dO: o = scale · (Qγ S0 +
        P R) and, in the backward, the cotangent scale · dO where dO meets q's side (P, Qγ) or
        the states (dO S0ᵀ, dO Rᵀ) — the gradients of o = scale · f(q) at the unscaled q, with
        f the op at scale 1. The final state's cotangent is not scaled (it does not pass
        through q)."""
        return x if self.scale == 1.0 else x * self.scale

    def warps(self, kernel):
        """Warps of ``kernel`` (a key of WARPS): WARPS's "<kernel>:<gate mode>" or "<kernel>"
        entry, or at K > 128 DEFAULTS
        "launch.wide_warps"'s entry "<kernel>:<gate mode>" or "<kernel>" where it has one —
        ptxas (sm_90, K = 256, KDA) finds the state passes spilling at their K ≤ 128 warp
        counts (fwd_pass 300–328 B at 4 warps, none at 8), while DeltaNet's measured slower
        at 8 (profile-12)."""
        keys = (f"{kernel}:{self.mode}", kernel)
        if self.K > 128:
            wide = setting("launch.wide_warps")
            for key in keys:
                if key in wide:
                    return wide[key]
        return next(WARPS[key] for key in keys if key in WARPS)

    # BlockSpecs ---------------------------------------------------------------------------
    def chunk_tok(self, D):
        H = self.H
        return pl.BlockSpec((None, self.C, None, D), lambda n, bh: (bh // H, n, bh % H, 0))

    def chunk_tok_v(self, BV):  # grid (N, B·H, V/BV): one value tile
        H = self.H
        return pl.BlockSpec((None, self.C, None, BV), lambda n, bh, v: (bh // H, n, bh % H, v))

    def chunk_tok3(self, D):  # grid (N, B·H, V/BV), full feature dim
        H = self.H
        return pl.BlockSpec((None, self.C, None, D), lambda n, bh, v: (bh // H, n, bh % H, 0))

    def chunk_gate3(self):
        H = self.H
        if self.mode == "scalar":
            return pl.BlockSpec((None, self.C, None), lambda n, bh, v: (bh // H, n, bh % H))
        return self.chunk_tok3(self.K)

    def chunk_mat3(self, r, c):  # [B, H, N, r, c] on grid (N, B·H, V/BV)
        H = self.H
        return pl.BlockSpec((None, None, None, r, c), lambda n, bh, v: (bh // H, bh % H, n, 0, 0))

    def chunk_state_v(self, BV):  # [B, H, N, K, V] tile
        H = self.H
        return pl.BlockSpec((None, None, None, self.K, BV), lambda n, bh, v: (bh // H, bh % H, n, 0, v))

    def chunk_row(self):  # [B, Tp, H] per-row values (scalar gates, row scales)
        H = self.H
        return pl.BlockSpec((None, self.C, None), lambda n, bh: (bh // H, n, bh % H))

    def chunk_gate(self):
        H = self.H
        if self.mode == "scalar":
            return pl.BlockSpec((None, self.C, None), lambda n, bh: (bh // H, n, bh % H))
        return self.chunk_tok(self.K)

    def chunk_mat(self, r, c):  # [B, H, N, r, c]
        H = self.H
        return pl.BlockSpec((None, None, None, r, c), lambda n, bh: (bh // H, bh % H, n, 0, 0))

    def col_tok(self, D, tiled):
        H = self.H
        if tiled:
            return pl.BlockSpec((None, self.Tp, None, self.BVs), lambda bh, v: (bh // H, 0, bh % H, v))
        return pl.BlockSpec((None, self.Tp, None, D), lambda bh, v: (bh // H, 0, bh % H, 0))

    def col_gate(self):
        H = self.H
        if self.mode == "scalar":
            return pl.BlockSpec((None, self.Tp, None), lambda bh, v: (bh // H, 0, bh % H))
        return self.col_tok(self.K, False)

    def col_mats(self, r, c):  # [B, H, N, r, c], all chunks (state passes)
        H = self.H
        return pl.BlockSpec((None, None, self.N, r, c), lambda bh, v: (bh // H, bh % H, 0, 0, 0))

    def col_states(self, lead):  # [B, H, lead, K, V] tiled over V (state passes)
        H = self.H
        return pl.BlockSpec((None, None, lead, self.K, self.BVs), lambda bh, v: (bh // H, bh % H, 0, 0, v))

    def pass_outputs(self, dtypes=(F32, F32)):
        """out_specs/out_shape of both state passes: per-chunk states [B,H,N,K,V] and a token
        tensor [B,Tp,H,V] (in ``dtypes``), and the per-sequence end states [B,H,n_seq1,K,V]
        (fp32)."""
        K, V = self.K, self.V
        return dict(
            out_specs=[self.col_states(self.N), self.col_tok(V, True), self.col_states(self.n_seq1)],
            out_shape=[jax.ShapeDtypeStruct((self.B, self.H, self.N, K, V), dtypes[0]),
                       self.sds_tok(V, dtypes[1]),
                       jax.ShapeDtypeStruct((self.B, self.H, self.n_seq1, K, V), F32)])

    def col_meta(self):
        return pl.BlockSpec((self.N,), lambda bh, v: (0,))

    def sds_tok(self, D, dtype=F32):
        return jax.ShapeDtypeStruct((self.B, self.Tp, self.H, D), dtype)

    def sds_gate(self):
        if self.mode == "scalar":
            return jax.ShapeDtypeStruct((self.B, self.Tp, self.H), F32)
        return self.sds_tok(self.K)


def _col(x):
    """[1] or [1, K] gate row -> something that scales the rows of a [K, V] state."""
    return x if x.ndim == 1 else x.reshape(x.shape[1], 1)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def _split(refs, mode, n_in):
    refs = list(refs)
    if mode == "none":
        refs.insert(n_in - 1, None)
    return refs


def intra(s: Shape, k, e, z, G, *, interpret, T=None, A=None, dtypes=(F32, F32), a_dtype=F32,
          q=None, wu=True, rows=None):
    """A [B,H,N,C,C] (stored in ``a_dtype``), W [B,Tp,H,K], U [B,Tp,H,V] (in ``dtypes``), and
    with ``q`` given (no or scalar gates, DEFAULTS "rewy_intra.emit_P") P = tril(Qγ K̄ᵀ)
    [B,H,N,C,C] fp32: one [C, K]·[K, C] product per chunk here instead of one per value tile in
    the output (fused or not) and ``bwd_local``.

    The inverse is formed and applied in fp32 either way: ``a_dtype`` is only the dtype of the
    copy kept for the backward (``backward.low_precision`` "A").

    T: the strictly lower gated key Gram [B,H,N,C,C] when ``qk_gram`` already formed it
    (vector gates, DEFAULTS "rewy_intra.gram_from_qk"); otherwise built here block by block.
    A: the inverse itself, saved by the forward (the ``recompute`` policy keeps the chunk
    matrices): then only (W, U) = (A·Ēγ, A·Z) are formed and returned — the backward's
    recomputation without the Gram and the block substitution, as row-block products (``wu``
    below forms them as two whole-chunk products instead).
    wu=False: the inverse only, (A,) — W, U left to ``wu`` (DEFAULTS "rewy_intra.split_wu").
    rows = (βe, βz), [B,Tp,H] fp32 per-row scales: e and z are then k and v as stored, and the
    kernel forms Ē = βe ⊙ k and Z = βz ⊙ v exactly in fp32 (DEFAULTS "forward.row_scaled_ez"):
    the Gram as βe_r (k_r·k_s), W and U with βe, βz on A's columns (a given T holds βe
    already).
    """
    n, C, prec, mode = s.n, s.C, s.prec, s.mode
    given_T, given_A, with_P = T is not None, A is not None, q is not None
    gate_on_A = mode == "scalar" and bool(setting("rewy_intra.gate_on_A"))
    assert not (given_T and given_A), "intra takes T (to invert) or A (inverted), not both"
    assert not with_P or (mode != "vector" and not given_A), "P: no or scalar gates, forward"
    assert wu or not (given_A or with_P), "wu=False: the inverse alone"

    def kernel(*refs):
        refs = list(refs)
        be_ref = bz_ref = None
        if rows is not None:  # the last two inputs
            be_ref, bz_ref = refs[n_in - 2:n_in]
            del refs[n_in - 2:n_in]
        M_ref = refs.pop(4 if mode != "none" else 3) if (given_T or given_A) else None
        q_ref = refs.pop(4 if mode != "none" else 3) if with_P else None
        P_ref = refs.pop() if with_P else None
        if not wu:
            refs += [None, None]  # W, U
        if given_A:
            k_ref, e_ref, z_ref, G_ref, W_ref, U_ref = _split(refs, mode, 4)
            A_ref = None
        else:
            k_ref, e_ref, z_ref, G_ref, A_ref, W_ref, U_ref = _split(refs, mode, 4)
        # exact per-pair diagonals even under a declared bound: the centred blocks measured
        # slower here (1.81 -> 2.39 ms, H200), unlike in bwd_leaf (6.0 -> 3.1 ms)
        unroll = bool(setting("rewy_intra.unroll"))
        gt = Gates(mode, G_ref, 0, C, setting("rewy_intra.exact_diag"), unroll,
                   kslice=setting("rewy_intra.kslice"))
        # with rows, es and zs are k's and v's rows as stored: the row scales βe, βz go onto
        # the [16, 16] blocks instead — T's rows after its product (the key slices stay native
        # products of the stored rows) and A's columns before W's and U's (a [16, 16] product
        # per block, not a [16, K] one per row operand: ptxas, 4 warps, KDA 245 -> 178
        # registers, DeltaNet 254 either way with SASS 3710 -> 3422)
        ks, es, zs = Rows(k_ref), Rows(e_ref), Rows(z_ref)

        def T_blk(i, j):
            if given_T:
                return M_ref[pl.ds(i * BS, BS), pl.ds(j * BS, BS)]
            t = gt.gram(i, j, es[i], ks[j], k_ref, prec, strict=True,
                        x_ref=e_ref if gt.kslice else None)  # key slices need the ref
            return t if be_ref is None else t * load_rows(be_ref, i * BS)[:, None]

        def scaled(a, j, b_ref, gated=False):
            """A[i, j] diag(β_j) (the row scale of Ē_j or Z_j), and diag(γ_j) when ``gated``
            (scalar gates: W = A (γ ⊙ Ē) with γ on A's [16, 16] columns, not Ē's [16, K] rows:
            DEFAULTS "rewy_intra.gate_on_A")."""
            f = None if b_ref is None else load_rows(b_ref, j * BS)
            if gated:
                f = exp(gt.blk(j)) if f is None else f * exp(gt.blk(j))
            return a if f is None else a * f[None, :]

        def on_row(i, A):  # row block i of A is final: emit W_i, U_i (and A's row)
            if wu:
                W_ref[pl.ds(i * BS, BS), :] = _sum(
                    dot(scaled(A[i, j], j, be_ref, gate_on_A),
                        es[j] if gate_on_A else gt.head(j, es[j]), prec)
                    for j in range(i + 1)).astype(W_ref.dtype)
                U_ref[pl.ds(i * BS, BS), :] = _sum(
                    dot(scaled(A[i, j], j, bz_ref), zs[j], prec)
                    for j in range(i + 1)).astype(U_ref.dtype)
            if A_ref is None:
                return
            for j in range(n):
                A_ref[pl.ds(i * BS, BS), pl.ds(j * BS, BS)] = (
                    A[i, j] if j <= i else jnp.zeros((BS, BS), F32)).astype(A_ref.dtype)

        if given_A:
            for i in range(n):
                on_row(i, Blocks(M_ref))
        else:
            inv_blocks(T_blk, n, prec, on_row,
                       joint_diag=setting("rewy_intra.joint_diag_inverse"), unroll=unroll,
                       stacked=setting("rewy_intra.stacked_diag"))
        if with_P:  # last: the inverse's blocks are dead by now
            P_ref[...] = _qk_full(mode, q_ref, k_ref, G_ref, C, prec)[1]

    ins = [k, e, z] + ([] if mode == "none" else [G]) + (
        [T] if given_T else [A] if given_A else []) + ([q] if with_P else []) + (
        list(rows) if rows is not None else [])
    in_specs = [s.chunk_tok(s.K), s.chunk_tok(s.K), s.chunk_tok(s.V)] + (
        [] if mode == "none" else [s.chunk_gate()]) + (
        [s.chunk_mat(C, C)] if (given_T or given_A) else []) + (
        [s.chunk_tok(s.K)] if with_P else []) + ([s.chunk_row()] * 2 if rows is not None else [])
    n_in = len(ins)
    mat = jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), a_dtype)
    mats, sds = ([], []) if given_A else ([s.chunk_mat(C, C)], [mat])
    if wu:
        mats, sds = mats + [s.chunk_tok(s.K), s.chunk_tok(s.V)], sds + [
            s.sds_tok(s.K, dtypes[0]), s.sds_tok(s.V, dtypes[1])]
    P_out = ([s.chunk_mat(C, C)], [mat.update(dtype=F32)]) if with_P else ([], [])
    out = _call(kernel, grid=(s.N, s.B * s.H), in_specs=in_specs,
                out_specs=mats + P_out[0], out_shape=sds + P_out[1], interpret=interpret,
                num_warps=s.warps("wu" if given_A else "intra"),
                name="rewy_wu" if given_A else "rewy_intra")(*ins)
    return tuple(out)


def wu(s: Shape, k, e, z, G, A, *, interpret, dtypes=(F32, F32), a_copy=None, rows=None):
    """(W, U) = (A·Ēγ, A·Z), [B,Tp,H,K] and [B,Tp,H,V] in ``dtypes``, from the inverse A
    [B,H,N,C,C] as [C, C]·[C, ·] products per chunk — A's upper blocks are stored as zeros,
    and γ = e^{G} with G from the chunk's start stays ≤ 1, so no factor overflows. With
    ``a_copy`` (a dtype) also A cast to it: (W, U, A').

    The whole-chunk form of ``intra`` given A (20 row-block products at C = 64): DEFAULTS
    "rewy_wu.whole_chunk" for the backward's W, U, and "rewy_intra.split_wu" for the forward's.
    DEFAULTS "rewy_wu.col_tile" (a width; 0: whole rows) splits the products over column tiles
    of Ēγ and Z, one program per (chunk, head, tile) with grid (N, B·H, tiles), tiles launched
    first so a chunk's tiles read A from L2 once: the kernel is memory-bound, and a whole-row
    program holds two [C, 128] fp32 accumulators (ptxas: 114 registers, 4 programs per SM),
    which leaves too few loads in flight (profile-11 ncu: long-scoreboard stalls first); on
    tiles of 64 it holds 74 registers, of 32 46 (ptxas, sm_90, 4 warps). Each output element
    is the same [C]-long product either way. ``rows`` as in ``intra``: e, z are k, v as stored
    and Ē = βe ⊙ k, Z = βz ⊙ v are formed in fp32.
    """
    C, prec, mode, H, K, V = s.C, s.prec, s.mode, s.H, s.K, s.V
    tile = setting("rewy_wu.col_tile")
    BK, BV = (min(tile, K), min(tile, V)) if tile else (K, V)
    if K % BK or V % BV:
        raise ValueError(f"rewy_wu.col_tile {tile} must divide K = {K} and V = {V}")
    nk, nv = K // BK, V // BV
    nt = max(nk, nv)

    def kernel(*refs):
        refs = list(refs)
        be_ref = bz_ref = None
        if rows is not None:  # the last two inputs
            be_ref, bz_ref = refs[n_in - 2:n_in]
            del refs[n_in - 2:n_in]
        k_ref, e_ref, z_ref, G_ref, A_ref, W_ref, U_ref, *Ac_ref = _split(refs, mode, 4)
        t = grid_id(2)
        A = A_ref[...]

        def store_W():
            e = e_ref[...]
            if be_ref is not None:
                e = be_ref[...][:, None] * e.astype(F32)
            if mode != "none":
                d = exp(G_ref[...].astype(F32))
                e = (d[:, None] if mode == "scalar" else d) * e.astype(F32)
            W_ref[...] = dot_stored(A, e, prec).astype(W_ref.dtype)

        def store_U():
            z = z_ref[...] if bz_ref is None else bz_ref[...][:, None] * z_ref[...].astype(F32)
            U_ref[...] = dot_stored(A, z, prec).astype(U_ref.dtype)

        for n_tiles, store in ((nk, store_W), (nv, store_U)):
            if n_tiles == nt:
                store()
            else:  # K ≠ V: the narrower side's programs past its last tile store nothing
                pl.when(t < n_tiles)(store)
        if Ac_ref:
            if nt == 1:
                Ac_ref[0][...] = A.astype(Ac_ref[0].dtype)
            else:
                @pl.when(t == 0)
                def _():
                    Ac_ref[0][...] = A.astype(Ac_ref[0].dtype)

    def tok(width, n_tiles):  # [C, width] column tile of a token tensor; clamped past the last
        return pl.BlockSpec((None, C, None, width), lambda n, bh, t: (
            bh // H, n, bh % H, jnp.minimum(t, n_tiles - 1)))

    gate = ([] if mode == "none" else [
        s.chunk_gate3() if mode == "scalar" else tok(BK, nk)])
    copy = (([s.chunk_mat3(C, C)], [jax.ShapeDtypeStruct(A.shape, a_copy)]) if a_copy
            else ([], []))
    row = pl.BlockSpec((None, C, None), lambda n, bh, t: (bh // H, n, bh % H))
    extra = list(rows) if rows is not None else []
    n_in = 4 + (mode != "none") + len(extra)
    return tuple(_call(
        kernel, grid=(s.N, s.B * H, nt),
        in_specs=[tok(BK, nk), tok(BK, nk), tok(BV, nv)] + gate + [s.chunk_mat3(C, C)] + (
            [row] * len(extra)),
        out_specs=[tok(BK, nk), tok(BV, nv)] + copy[0],
        out_shape=[s.sds_tok(K, dtypes[0]), s.sds_tok(V, dtypes[1])] + copy[1],
        interpret=interpret, num_warps=s.warps("wu"), name="rewy_wu",
        tile_axis=2 if nt > 1 else None)(
            k, e, z, *([] if mode == "none" else [G]), A, *extra))


def qk_gram(s: Shape, q, k, G, *, interpret, e=None, e_rows=None):
    """Vector gates only: P = tril(Qγ K̄ᵀ) [B,H,N,C,C] fp32, once per chunk, so that ``output``
    and ``bwd_local`` are plain matmuls instead of rebuilding P's per-pair (or centred) diagonal
    blocks per value tile. A kernel of its own: inside ``intra`` it would add live blocks to the
    inverse's and spill (measured 1.8 -> 6.6 ms there).

    With ``e`` it also returns intra's T = strict tril(Ēγ K̄ᵀ) (P, T): the two Grams share every
    decay factor (the same K̄ frames), so T costs matmuls here instead of exponentials in intra.
    With ``e_rows`` ([B,Tp,H] fp32, ``intra``'s βe) as well, ``e`` is k as stored and T's rows
    are scaled by βe after the products — Ē = βe ⊙ k exactly, not rounded to 16 bits.
    """
    n, C, prec = s.n, s.C, s.prec
    # Row grid (DEFAULTS): one program per 16-row block of P. Pair grid (DEFAULTS, off: no
    # faster in profile-6): one program per (row block, column block) — balanced programs (a
    # row grid's last row does n blocks, its first one) with one block's live tiles: ptxas
    # showed the row-grid program spilling once it formed T beside P.
    pairgrid = bool(setting("rewy_qk_gram.pairgrid"))
    rowgrid = bool(setting("rewy_qk_gram.rowgrid")) and not pairgrid
    # a declared gate bound (Shape.centred): the diagonal blocks as centred frame products, one
    # matmul per key slice like the off-diagonal blocks, instead of the 16-step exact loop
    # (DEFAULTS "rewy_qk_gram.centred")
    diag = ("centred" if s.centred and setting("rewy_qk_gram.centred")
            else setting("rewy_qk_gram.exact_diag"))
    with_T = e is not None
    # DEFAULTS "rewy_qk_gram.row_frames": a row block's frame products in one key-slice loop
    # (needs the key slices that Gates.row_frame_grams loops over)
    row_frames = (bool(setting("rewy_qk_gram.row_frames"))
                  and 0 < setting("rewy_qk_gram.kslice") < s.K)

    def kernel(*refs):
        be_ref = None
        if e_rows is not None:
            q_ref, k_ref, e_ref, G_ref, be_ref, P_ref, T_ref = refs
        elif with_T:
            q_ref, k_ref, e_ref, G_ref, P_ref, T_ref = refs
        else:
            (q_ref, k_ref, G_ref, P_ref), e_ref, T_ref = refs, None, None
        # exact: as fast as centred here (0.95 ms, when qk_gram formed P alone)
        gt = Gates("vector", G_ref, 0, C, diag, bool(setting("rewy_qk_gram.unroll")),
                   kslice=setting("rewy_qk_gram.kslice"))
        qs, ks = Rows(q_ref), Rows(k_ref)
        es = Rows(e_ref) if with_T else None

        x_refs, stricts = ([q_ref, e_ref], [False, True]) if with_T else ([q_ref], [False])

        def store(i, j, out):  # block (i, j) of P (and T, its rows scaled by βe)
            blk = (pl.ds(i * BS, BS), pl.ds(j * BS, BS))
            P_ref[blk] = out[0]
            if with_T:
                T_ref[blk] = out[1] if be_ref is None else (
                    out[1] * load_rows(be_ref, i * BS)[:, None])

        def block(i, j):
            if j > i:
                blk = (pl.ds(i * BS, BS), pl.ds(j * BS, BS))
                for ref in (P_ref, T_ref) if with_T else (P_ref,):
                    ref[blk] = jnp.zeros((BS, BS), F32)
                return
            xs = [qs[i], es[i]] if with_T else [qs[i]]
            store(i, j, gt.grams(i, j, xs, ks[j], k_ref, prec, stricts, x_refs=x_refs))

        def row_block(i):
            if not row_frames:
                for j in range(n):
                    block(i, j)
                return
            # every frame-product block of the row in one key-slice loop (Gates.row_frame_grams)
            outs = gt.row_frame_grams(i, x_refs, k_ref, prec, diag == "centred")
            r, c = iota((BS, BS), 0), iota((BS, BS), 1)
            for j, out in enumerate(outs):
                if j == i:  # the centred diagonal block, masked as grams masks it
                    out = [jnp.where(c < r if st else c <= r, m, 0.0)
                           for m, st in zip(out, stricts)]
                store(i, j, out)
            for j in range(len(outs), n):
                block(i, j)

        for i in range(n):
            if pairgrid:
                for j in range(n):
                    pl.when(grid_id(0) % (n * n) == i * n + j)(lambda i=i, j=j: block(i, j))
            elif rowgrid:
                pl.when(grid_id(0) % n == i)(lambda i=i: row_block(i))
            else:
                row_block(i)

    per_chunk = n * n if pairgrid else (n if rowgrid else 1)  # programs per chunk
    ch = lambda m: m // per_chunk  # noqa: E731
    H = s.H
    tok = pl.BlockSpec((None, C, None, s.K), lambda m, bh: (bh // H, ch(m), bh % H, 0))
    mat = pl.BlockSpec((None, None, None, C, C), lambda m, bh: (bh // H, bh % H, ch(m), 0, 0))
    sds = jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), F32)
    ins = [q, k] + ([e] if with_T else []) + [G]
    in_specs = [tok] * len(ins)
    if e_rows is not None:
        assert with_T, "e_rows scales T: e (k as stored) is needed too"
        ins.append(e_rows)
        in_specs.append(pl.BlockSpec((None, C, None), lambda m, bh: (bh // H, ch(m), bh % H)))
    out = _call(kernel, grid=(s.N * per_chunk, s.B * H), in_specs=in_specs,
                out_specs=[mat] * (2 if with_T else 1), out_shape=[sds] * (2 if with_T else 1),
                interpret=interpret, num_warps=s.warps("qk_gram"), name="rewy_qk_gram")(*ins)
    return tuple(out) if with_T else out[0]


def _gate_call(kernel, xs, C, name, *, interpret, out_dtypes=None):
    """A gate kernel on [B,Tp,H,K] tensors ``xs``, one [C, ≤64] block of each per program
    (grid (N, B·H, key tiles)), returning one fp32 tensor of their shape — or, with
    ``out_dtypes``, a tuple of one such tensor per dtype."""
    B, Tp, H, K = xs[0].shape
    BK = min(K, 64)
    spec = pl.BlockSpec((None, C, None, BK), lambda n, bh, t: (bh // H, n, bh % H, t))
    shapes = [jax.ShapeDtypeStruct(xs[0].shape, d) for d in (out_dtypes or [F32])]
    out = _call(kernel, grid=(Tp // C, B * H, K // BK), in_specs=[spec] * len(xs),
                out_specs=[spec] * len(shapes), out_shape=shapes, interpret=interpret,
                num_warps=WARPS["gates"], name=name)(*xs)
    return tuple(out) if out_dtypes else out[0]


def cum_gates(g, C, *, interpret, floor=None, below=False):
    """Vector gates' chunk-local inclusive cumsum G [B,Tp,H,K] fp32 of the log-decays g (same
    shape), one program per (chunk, head, key tile): one read and one write of g. In XLA the
    cumsum and the gate gradient's two cumsums were the three slowest fusions of KDA's glue
    (profile-21, anchor: 0.144 + 0.082 ms of device time plus 0.067 of slices; the scan lowers
    to a reduce-window there, up to 64 reads per output).

    floor: None, or a Python float g is first clamped to (``chunk_algebra.clamp_gates``).
    below (with a floor): also return the int8 mask [B,Tp,H,K] of g < floor — (G, mask) — for
    ``gate_grad`` to zero those gates' gradient (the clamp's VJP)."""
    def kernel(g_ref, G_ref, below_ref=None):
        x = g_ref[...]
        if floor is not None:
            if below_ref is not None:
                below_ref[...] = (x < floor).astype(jnp.int8)
            x = clamp_gates(x, floor)
        G_ref[...] = jnp.cumsum(x, axis=0)

    if below:
        assert floor is not None, "below is the mask of the clamp to floor"
        return _gate_call(kernel, [g], C, "rewy_cum_gates", interpret=interpret,
                          out_dtypes=[F32, jnp.int8])
    return _gate_call(kernel, [g], C, "rewy_cum_gates", interpret=interpret)


def decayed_rows(k, q, G, C, *, interpret, kbar_dtype=None, qg_dtype=None):
    """Vector gates: (K̄, Qγ) [B,Tp,H,K] in k's / q's dtype — K̄ = e^{G_C − G} ⊙ k (each row's
    decay to its chunk's end) and Qγ = e^{G} ⊙ q (from the chunk's start), every exponent
    ≤ 0 — for the forward's fused pass to read instead of k, q and G's rows (DEFAULTS
    "fwd_pass.predecayed"): the pass then forms no per-element exponentials in any of its
    value-tile programs and stages two 16-bit tiles instead of two 16-bit and one fp32.
    kbar_dtype, qg_dtype: K̄'s, Qγ's dtype if not k's, q's (fp32: unrounded). q None: K̄ alone,
    (K̄, None)."""
    def kernel(*refs):
        k_ref, q_ref, G_ref, kbar_ref, qg_ref = refs if q is not None else (
            refs[0], None, refs[1], refs[2], None)
        Gc = G_ref[...]
        kbar_ref[...] = (exp(load_rows(G_ref, C - 1, 1) - Gc) * k_ref[...].astype(F32)).astype(
            kbar_ref.dtype)
        if q_ref is not None:
            qg_ref[...] = (exp(Gc) * q_ref[...].astype(F32)).astype(qg_ref.dtype)

    if q is None:
        return _gate_call(kernel, [k, G], C, "rewy_decayed_rows", interpret=interpret,
                          out_dtypes=[kbar_dtype or k.dtype])[0], None
    return _gate_call(kernel, [k, q, G], C, "rewy_decayed_rows", interpret=interpret,
                      out_dtypes=[kbar_dtype or k.dtype, qg_dtype or q.dtype])


def _triangle_sum(tri, x):
    """``tri @ x`` for a 0/1 [C, C] matrix ``tri`` (bf16, exact) and fp32 ``x`` [C, ·]: x split
    into three bf16 parts (hi + mid + lo = x to the last bit or so), three native products with
    fp32 accumulation. Each output sums only the terms its row of ``tri`` selects, in fp32, as
    a cumsum does; an IEEE fp32 product spills (ptxas: 255 registers at any tile width)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(F32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(F32)).astype(jnp.bfloat16)
    prec = lax.Precision.DEFAULT
    return dot(tri, lo, prec) + dot(tri, mid, prec) + dot(tri, hi, prec)


def gate_grad(pairs, path, C, *, interpret, below=None):
    """Vector gates' dg [B,Tp,H,K] fp32 from ``bwd_leaf``'s two parts (same shape): per chunk
    and channel, the suffix sum of pairs (terms that cross every earlier token) plus the strict
    prefix sum of path (a row's path into the end state crosses only the later tokens), each a
    product with a 0/1 triangle (``_triangle_sum``; Triton's lowering has no reverse scan).
    Every output sums only its own terms, so nothing cancels — as in
    ``chunk_algebra.reverse_cumsum`` / ``exclusive_cumsum``: a chunk-wide total minus a prefix
    would put 2⁻²⁴ of the total into outputs that are ~0 (a fully decayed sequence's dg).
    below: None, or ``cum_gates``'s int8 mask: dg is 0 where it is set (the clamp's VJP)."""
    def kernel(pairs_ref, path_ref, *refs):
        below_ref, dg_ref = refs if below is not None else (None,) + refs
        r, c = iota((C, C), 0), iota((C, C), 1)
        suffix = jnp.where(c >= r, 1.0, 0.0).astype(jnp.bfloat16)
        strict_prefix = jnp.where(c < r, 1.0, 0.0).astype(jnp.bfloat16)
        dg = (_triangle_sum(suffix, pairs_ref[...])
              + _triangle_sum(strict_prefix, path_ref[...]))
        if below_ref is not None:
            dg = jnp.where(below_ref[...] != 0, 0.0, dg)
        dg_ref[...] = dg

    ins = [pairs, path] + ([] if below is None else [below])
    return _gate_call(kernel, ins, C, "rewy_gate_grad", interpret=interpret)


def row_scale_vjp(dk, de, k, dz, v, be, bz, *, C, interpret):
    """The VJP of the per-row leaf maps e = βe ⊙ k, z = βz ⊙ v in one pass (DEFAULTS
    "backward.row_vjp_kernel"; ``api._bwd`` when the kernels read the rounded e, z): from
    bwd_chunk's dk, de [B,Tp,H,K] and dz [B,Tp,H,V] (16-bit), k, v as stored and βe, βz
    [B,Tp,H] fp32, returns

        dk + βe ⊙ de  (k's dtype),   βz ⊙ dz  (v's dtype),   Σ_k de ⊙ k,  Σ_v dz ⊙ v  (fp32),

    all formed in fp32. One program per (chunk, head): each tensor is read or written once
    (XLA ran these as three fusions, 0.10 ms of device time at the anchor: profile-21)."""
    B, Tp, H, K = k.shape
    V = v.shape[-1]

    def kernel(dk_ref, de_ref, k_ref, dz_ref, v_ref, be_ref, bz_ref,
               dk_out, dv_out, dbe_out, dbz_out):
        de = de_ref[...].astype(F32)
        dz = dz_ref[...].astype(F32)
        be, bz = be_ref[...], bz_ref[...]
        dk_out[...] = (dk_ref[...].astype(F32) + be[:, None] * de).astype(dk_out.dtype)
        dv_out[...] = (bz[:, None] * dz).astype(dv_out.dtype)
        dbe_out[...] = jnp.sum(de * k_ref[...].astype(F32), axis=1)
        dbz_out[...] = jnp.sum(dz * v_ref[...].astype(F32), axis=1)

    def tok(D):
        return pl.BlockSpec((None, C, None, D), lambda n, bh: (bh // H, n, bh % H, 0))

    row = pl.BlockSpec((None, C, None), lambda n, bh: (bh // H, n, bh % H))
    return _call(kernel, grid=(Tp // C, B * H),
                 in_specs=[tok(K), tok(K), tok(K), tok(V), tok(V), row, row],
                 out_specs=[tok(K), tok(V), row, row],
                 out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                            jax.ShapeDtypeStruct(v.shape, v.dtype),
                            jax.ShapeDtypeStruct((B, Tp, H), F32),
                            jax.ShapeDtypeStruct((B, Tp, H), F32)],
                 interpret=interpret, num_warps=WARPS["row_vjp"], name="rewy_row_vjp")(
                     dk, de, k, dz, v, be, bz)


def _chunk_decay(mode, G_ref, base, C):
    """(G rows of the chunk, G of its last row) or (None, None)."""
    if mode == "none":
        return None, None
    return load_rows(G_ref, base, C), load_rows(G_ref, base + C - 1, 1)


def _kt(mode, Gc, gl, kc):
    if mode == "none":
        return kc
    d = exp(gl - Gc)
    return (d[:, None] if mode == "scalar" else d) * kc


def _qg(mode, Gc, qc):
    if mode == "none":
        return qc
    d = exp(Gc)
    return (d[:, None] if mode == "scalar" else d) * qc


def _native_pass_dots(dtypes, forward=False):
    """Whether a state pass multiplies its carried state and per-chunk tensor in the 16-bit
    dtype they are stored in (DEFAULTS "backward.native_pass_dots", or for the ``forward``'s
    unfused pass "forward.native_pass_dots"): only where both are stored 16-bit — the
    backward's passes under "backward.low_precision", the forward's pass where
    "forward.low_precision(_wide)" names S0 and R."""
    key = "forward.native_pass_dots" if forward else "backward.native_pass_dots"
    return bool(setting(key)) and all(d != F32 for d in dtypes)


def _pass_dot(a, b, prec, dtype, ta=False):
    """A state pass's product: in ``dtype`` (the stored one, native 16-bit) when given — see
    ``_native_pass_dots`` —, else of a and b as they are (fp32)."""
    if dtype is not None:
        return dot_stored(a.astype(dtype), b.astype(dtype), prec, ta=ta)
    return dot(a, b, prec, ta=ta)


def fwd_pass(s: Shape, W, U, k, G, h0, reset, end, seq, *, interpret, dtypes=(F32, F32),
             out=None, forward=False, decayed=False):
    """S0 [B,H,N,K,V], R [B,Tp,H,V] (stored in ``dtypes``; the pass itself carries S in fp32),
    final [B,H,n_seq1,K,V] (fp32). ``forward``: the forward's pass (not the backward's
    recomputing one), for ``_native_pass_dots``.

    out = (q, P, out_dtype): the output fused into the pass instead — O = Qγ S0 + P R per chunk
    and value tile while S0 and R are in registers — returning (o [B,Tp,H,V], final) and
    storing no S0 or R (the ``recompute`` forward, DEFAULTS "fwd_pass.fused_output"). P: the
    [B,H,N,C,C] matrix of ``qk_gram`` (vector gates) or ``intra`` (``intra_forms_P``), or None
    (rebuilt per chunk and value tile, as in ``output``).

    decayed (vector gates): k is K̄ = e^{G_C − G} ⊙ k and out's q is Qγ = e^{G} ⊙ q, from
    ``decayed_rows``; of G only each chunk's last row is read (the state's decay).
    """
    native = _native_pass_dots(dtypes, forward)
    kernel, ins, in_specs, outputs = _fwd_pass_parts(s, W, U, k, G, h0, reset, end, seq,
                                                     dtypes, out, native, decayed)
    return _call(kernel, grid=(s.B * s.H, s.V // s.BVs), in_specs=in_specs, **outputs,
                 interpret=interpret, num_warps=s.warps("fwd_pass"), name="rewy_fwd_pass",
                 num_stages=_pass_stages(
                     s, ("native" if native else "fwd") if out is None
                     else "fused" if W.dtype != F32
                     else "fused_w32" if jnp.dtype(k.dtype).itemsize < 4 else "fused_f32"),
                 tile_axis=1)(*ins)


def _fwd_pass_parts(s, W, U, k, G, h0, reset, end, seq, dtypes, out, native, decayed=False):
    """``fwd_pass``'s (kernel, inputs, in_specs, outputs) on the grid (B·H, V/BVs)."""
    C, N, K, BV, prec, mode = s.C, s.N, s.K, s.BVs, s.prec, s.mode
    one_seq = s.one_seq and setting("state_pass.one_seq_init")
    end_after = one_seq and setting("state_pass.end_after_loop")
    fused = out is not None
    given_P = fused and out[1] is not None
    # the recurrence's two products in the stored dtypes of S0 and R, or on fp32 values
    S_dt, R_dt = dtypes if native else (None, None)
    # K̄ᵀ R as kᵀ (d ⊙ R) in two native bf16 products (DEFAULTS "fwd_pass.split_kr"): no or
    # scalar gates — a vector gate's decay runs along K and cannot move onto R —, k stored in
    # bf16, R not stored 16-bit (the backward's native passes already multiply in bf16)
    split_kr = (setting("fwd_pass.split_kr") and mode != "vector" and R_dt is None
                and k.dtype == jnp.bfloat16)
    # the forward's W stored in bf16 (DEFAULTS "forward.low_precision"): W S as W ⋅ (S_hi + S_lo)
    # in two native products (DEFAULTS "fwd_pass.split_w"), else W upcast for one TF32 product
    split_w = setting("fwd_pass.split_w") and S_dt is None and W.dtype == jnp.bfloat16
    # scalar gates: Qγ S0 = γ ⊙ (q S0), and where the pass multiplies natively K̄ᵀ R =
    # kᵀ (d ⊙ R) with k as stored (ptxas, sm_90, GDN K = 128: the fused pass's TF32 product
    # in that form spills 412 B against 200)
    vside = value_side_decay(mode)
    vside_kr = vside and not split_kr and R_dt is not None

    def kernel(*refs):
        refs = list(refs)
        if mode == "none":
            refs.insert(3, None)  # G
        if not fused:
            refs[8:8] = [None, None]  # q, P
        elif not given_P:
            refs.insert(9, None)  # P
        (W_ref, U_ref, k_ref, G_ref, h0_ref, reset_ref, end_ref, seq_ref, q_ref, P_ref,
         *outs) = refs
        if fused:
            o_ref, fin_ref = outs
        else:
            S0_ref, R_ref, fin_ref = outs

        def body(c, S):
            sq = 0 if one_seq else seq_ref[c]  # one sequence: seq is 0 (api.Config.one_seq)
            if not one_seq:  # else h0 is the loop's initial state
                S = jnp.where(reset_ref[c] != 0, h0_ref[sq], S)
            base = c * C
            if not fused:
                S0_ref[c] = S.astype(S0_ref.dtype)
            Uc = load_rows(U_ref, base, C)
            if split_w:  # W as stored (16-bit), S in two bf16 parts: two native products
                R = Uc - dot_split(load_rows(W_ref, base, C, None), S, prec)
            else:  # W as stored when native
                R = Uc - _pass_dot(load_rows(W_ref, base, C, None if S_dt else F32), S, prec,
                                   S_dt)
            if decayed:  # the rows carry their decays: only the state's, G's last row
                Gc, gl = None, load_rows(G_ref, base + C - 1, 1)
            else:
                Gc, gl = _chunk_decay(mode, G_ref, base, C)
            if fused:  # O = Qγ S0 + P R: off the recurrence's critical path
                if given_P:
                    P = P_ref[c]
                else:
                    _, P = _qk_full(mode, q_ref, k_ref, G_ref, C, prec, base)
                if vside:
                    o = s.scaled(exp(Gc)[:, None] * dot(load_rows(q_ref, base, C), S, prec)
                                 + dot(P, R, prec))
                else:
                    o = _chunk_output(s, Gc, load_rows(q_ref, base, C), S, P, R,
                                      decayed=decayed)
                o_ref[pl.ds(base, C), :] = o.astype(o_ref.dtype)
            else:
                R_ref[pl.ds(base, C), :] = R.astype(R_ref.dtype)
            if split_kr:  # K̄ᵀ R = kᵀ (d ⊙ R), k as stored, R in two bf16 parts
                Rd = R if mode == "none" else exp(gl - Gc)[:, None] * R
                S_new = dot_split(load_rows(k_ref, base, C, None), Rd, prec, ta=True)
            elif vside_kr:  # the row decay on R's [C, BVs] tile: k as stored (exact in bf16)
                S_new = _pass_dot(load_rows(k_ref, base, C, None if R_dt else F32),
                                  exp(gl - Gc)[:, None] * R, prec, R_dt, ta=True)
            else:
                kc = load_rows(k_ref, base, C)
                Kt = kc if decayed else _kt(mode, Gc, gl, kc)
                S_new = _pass_dot(Kt, R, prec, R_dt, ta=True)
            S_new = S_new + (S if mode == "none" else _col(exp(gl)) * S)
            if not end_after:

                @pl.when(end_ref[c] != 0)
                def _():
                    fin_ref[sq] = S_new

            return S_new

        S_end = lax.fori_loop(0, N, body, h0_ref[0] if one_seq else jnp.zeros((K, BV), F32))
        if end_after:
            fin_ref[0] = S_end

    ins = [W, U, k] + ([] if mode == "none" else [G]) + [h0, reset, end, seq]
    in_specs = [s.col_tok(K, False), s.col_tok(s.V, True), s.col_tok(K, False)] + (
        [] if mode == "none" else [s.col_gate()]) + [s.col_states(s.n_seq1)] + [s.col_meta()] * 3
    if fused:
        q, P, out_dtype = out
        ins.append(q)
        in_specs.append(s.col_tok(K, False))
        if given_P:
            ins.append(P)
            in_specs.append(s.col_mats(C, C))
        outputs = s.pass_outputs()
        outputs = dict(out_specs=[s.col_tok(s.V, True), outputs["out_specs"][2]],
                       out_shape=[s.sds_tok(s.V, out_dtype), outputs["out_shape"][2]])
    else:
        outputs = s.pass_outputs(dtypes)
    return kernel, ins, in_specs, outputs


def _scalar_decay(Gc, C, strict=False):
    """D_rs = e^{G_r − G_s} for s < r (``strict``) or s ≤ r, 0 above: [C, C] fp32 from a chunk's
    scalar-gate rows Gc [C] (masked before exp, so no factor exceeds 1; the diagonal's is 1)."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    return exp(jnp.where(c < r if strict else c <= r, Gc[:, None] - Gc[None, :], -jnp.inf))


def _qk_full(mode, q_ref, k_ref, G_ref, C, prec, base=0):
    """No or scalar gates: (G rows or None, P = tril(Qγ K̄ᵀ) = (Q Kᵀ) ⊙ e^{G_r − G_s}) on the
    whole chunk at row ``base`` (the decay is masked before exp, so no factor exceeds 1)."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    P = dot_stored(load_rows(q_ref, base, C, None), load_rows(k_ref, base, C, None), prec,
                   tb=True)
    if mode == "none":
        return None, jnp.where(c <= r, P, 0.0)
    Gc = load_rows(G_ref, base, C)
    return Gc, P * _scalar_decay(Gc, C)


def _chunk_output(s, Gc, qc, S0, P, R, decayed=False):
    """One chunk's (value tile of) O = scale · (Qγ S0 + P R) — fp32, from the chunk's G rows,
    q rows (unscaled; ``decayed``: Qγ itself), start state, gated query-key matrix and
    residuals (``output`` and the fused ``fwd_pass``)."""
    Qg = qc if decayed else _qg(s.mode, Gc, qc)
    return s.scaled(dot(Qg, S0, s.prec) + dot(P, R, s.prec))


def output(s: Shape, q, k, G, S0, R, P, out_dtype, *, interpret):
    """O = Qγ S0 + P R, [B,Tp,H,V] in out_dtype. Grid (N, B·H, V/BV).

    P: the [B,H,N,C,C] matrix that ``qk_gram`` (vector gates) or ``intra`` (``intra_forms_P``)
    built, or None: no or scalar gates then rebuild it per tile (one masked [C, C] matmul).
    """
    C, prec, mode, BV = s.C, s.prec, s.mode, s.BV
    given_P = P is not None

    def kernel(*refs):
        refs = list(refs)
        if given_P:
            refs.insert(1, None)  # k
        if mode == "none":
            refs.insert(2, None)  # G
        if not given_P:
            refs.insert(5, None)  # P
        q_ref, k_ref, G_ref, S0_ref, R_ref, P_ref, o_ref = refs
        if given_P:
            Gc, P = _chunk_decay(mode, G_ref, 0, C)[0], P_ref[...]
        else:  # one [C, C] decay matrix: whole-chunk matmuls
            Gc, P = _qk_full(mode, q_ref, k_ref, G_ref, C, prec)
        o = _chunk_output(s, Gc, load_rows(q_ref, 0, C), S0_ref[...].astype(F32), P,
                          R_ref[...].astype(F32))
        o_ref[...] = o.astype(o_ref.dtype)

    gate = ([], []) if mode == "none" else ([G], [s.chunk_gate3()])
    if given_P:
        ins = [q] + gate[0] + [S0, R, P]
        in_specs = [s.chunk_tok3(s.K)] + gate[1] + [s.chunk_state_v(BV), s.chunk_tok_v(BV),
                                                    s.chunk_mat3(C, C)]
    else:
        ins = [q, k] + gate[0] + [S0, R]
        in_specs = [s.chunk_tok3(s.K)] * 2 + gate[1] + [s.chunk_state_v(BV), s.chunk_tok_v(BV)]
    return _call(kernel, grid=(s.N, s.B * s.H, s.V // BV), in_specs=in_specs,
                 out_specs=s.chunk_tok_v(BV), out_shape=s.sds_tok(s.V, out_dtype),
                 interpret=interpret, num_warps=s.warps("output"), name="rewy_output", tile_axis=2)(*ins)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
def bwd_local(s: Shape, q, k, G, P, dO, *, interpret, dtype=F32, qdo_dtype=None):
    """scale · Pᵀ dO per chunk (``Shape.scaled``), [B,Tp,H,V] in ``dtype``; P as in
    ``output``. Grid (N, B·H, V/BV), or with DEFAULTS "rewy_bwd_local.tile_loop" (N, B·H) and a
    loop over the value tiles, so that P is built (or read) once per chunk.

    qdo_dtype (DEFAULTS "backward.chunk_qdo"): also each chunk's state-free scale · Qγᵀ dO
    [B,H,N,K,V] in that dtype, for the reverse state pass to read instead of q and dO
    (``bwd_pass``'s ``qdo``); with P given (vector gates) q and G are then read for it too.
    Returns (Pᵀ dO, Qγᵀ dO) then."""
    C, prec, mode, BV, V = s.C, s.prec, s.mode, s.BV, s.V
    given_P = P is not None
    with_qdo = qdo_dtype is not None
    tile_loop = bool(setting("rewy_bwd_local.tile_loop")) and V > BV

    def kernel(*refs):
        if given_P and with_qdo:
            P_ref, q_ref, G_ref, dO_ref, out_ref, *qdo_ref = refs
            P, Gc = P_ref[...], G_ref[...]
        elif given_P:
            P_ref, dO_ref, out_ref = refs
            P = P_ref[...]
        else:
            q_ref, k_ref, G_ref, dO_ref, out_ref, *qdo_ref = _split(refs, mode, 3)
            Gc, P = _qk_full(mode, q_ref, k_ref, G_ref, C, prec)
        for vs in ([pl.ds(t * BV, BV) for t in range(V // BV)] if tile_loop else [slice(None)]):
            dOt = dO_ref[:, vs]
            out_ref[:, vs] = s.scaled(dot(P, dOt.astype(F32), prec, ta=True)).astype(
                out_ref.dtype)
            if with_qdo:
                qdo_ref[0][:, vs] = _chunk_q_dO(s, Gc, q_ref[...], dOt).astype(
                    qdo_ref[0].dtype)

    if tile_loop:  # whole rows of the chunk, one program per (chunk, head)
        tok_v, tok_k, gate, mat = s.chunk_tok(V), s.chunk_tok(s.K), s.chunk_gate(), s.chunk_mat
        grid, tile_axis = (s.N, s.B * s.H), None
    else:
        tok_v, tok_k, gate, mat = s.chunk_tok_v(BV), s.chunk_tok3(s.K), s.chunk_gate3(), s.chunk_mat3
        grid, tile_axis = (s.N, s.B * s.H, V // BV), 2
    if given_P:
        ins, in_specs = [P, dO], [mat(C, C), tok_v]
        if with_qdo:
            ins[1:1], in_specs[1:1] = [q, G], [tok_k, gate]
    else:
        ins = [q, k] + ([] if mode == "none" else [G]) + [dO]
        in_specs = [tok_k] * 2 + ([] if mode == "none" else [gate]) + [tok_v]
    out_specs, out_shape = tok_v, s.sds_tok(V, dtype)
    if with_qdo:
        out_specs, out_shape = [out_specs, mat(s.K, V) if tile_loop else s.chunk_state_v(BV)], [
            out_shape, jax.ShapeDtypeStruct((s.B, s.H, s.N, s.K, V), qdo_dtype)]
    return _call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                 interpret=interpret, num_warps=s.warps("bwd_local"), name="rewy_bwd_local",
                 tile_axis=tile_axis)(*ins)


def _chunk_q_dO(s, Gc, q, dO, decayed=False, vside=False):
    """scale · Qγᵀ dO [K, BV] of one chunk from its rows q [C, K] and dO [C, BV] as stored
    (the reverse state pass's state-free term; ``bwd_pass`` or, ahead of it, ``bwd_local``).
    No gates: the product of q and dO as stored (exact products, native rate); scalar gates:
    Qγ in fp32 (``decayed``: q is Qγ already), or with ``vside`` (``value_side_decay``)
    qᵀ (γ ⊙ dO), γ ⊙ dO rounded to dO's dtype so that the product stays native."""
    if vside:
        return s.scaled(dot_stored(q, (exp(Gc)[:, None] * dO.astype(F32)).astype(dO.dtype),
                                   s.prec, ta=True))
    if s.mode != "none":
        q, dO = q.astype(F32) if decayed else _qg(s.mode, Gc, q.astype(F32)), dO.astype(F32)
    return s.scaled(dot_stored(q, dO, s.prec, ta=True))


def bwd_pass(s: Shape, q, k, G, W, dO, dRl, dfin, reset, end, seq, *, interpret,
             dtypes=(F32, F32), qdo=None, decayed=False):
    """dS_end [B,H,N,K,V], dR [B,Tp,H,V] (stored in ``dtypes``; the pass carries dS in fp32),
    dh0 [B,H,n_seq1,K,V] (fp32).

    qdo: None, or each chunk's scale · Qγᵀ dO [B,H,N,K,V] from ``bwd_local``: the pass then
    reads it instead of q and dO. (Not written over by dS_end, though the shapes match: a
    program's threads read and write a tile in different layouts, and nothing in the Triton
    lowering orders one thread's read before another's write of the same chunk.)
    decayed: q, k are Qγ, K̄ (as ``fwd_pass``'s)."""
    kernel, ins, in_specs, outputs = _bwd_pass_parts(s, q, k, G, W, dO, dRl, dfin, reset, end,
                                                     seq, dtypes, qdo, decayed)
    return _call(kernel, grid=(s.B * s.H, s.V // s.BVs), in_specs=in_specs, **outputs,
                 interpret=interpret, num_warps=s.warps("bwd_pass"), name="rewy_bwd_pass",
                 num_stages=_pass_stages(s, "bwd"), tile_axis=1)(*ins)


def _bwd_pass_parts(s, q, k, G, W, dO, dRl, dfin, reset, end, seq, dtypes, qdo=None,
                    decayed=False):
    """``bwd_pass``'s (kernel, inputs, in_specs, outputs) on the grid (B·H, V/BVs)."""
    C, N, K, BV, prec, mode = s.C, s.N, s.K, s.BVs, s.prec, s.mode
    one_seq = s.one_seq and setting("state_pass.one_seq_init")
    end_after = one_seq and setting("state_pass.end_after_loop")
    # K̄ dS and Wᵀ dR in the stored dtypes of dS and dR, or on fp32 values
    dS_dt, dR_dt = dtypes if _native_pass_dots(dtypes) else (None, None)
    given_qdo = qdo is not None
    # scalar gates: K̄ dS = d ⊙ (k dS) and Qγᵀ dO = qᵀ (γ ⊙ dO), k and q as stored
    vside = value_side_decay(mode) and not decayed

    def kernel(*refs):
        refs, qdo_ref = _split(refs, mode, 3), None
        if given_qdo:  # [qdo, k, G, W, dRl, ...]: no q, no dO
            qdo_ref, refs = refs[0], [None] + refs[1:4] + [None] + refs[4:]
        (q_ref, k_ref, G_ref, W_ref, dO_ref, dRl_ref, dfin_ref, reset_ref, end_ref, seq_ref,
         dSe_ref, dR_ref, dh0_ref) = refs

        def body(m, carry):
            c = N - 1 - m
            sq = 0 if one_seq else seq_ref[c]  # one sequence: seq is 0 (api.Config.one_seq)
            dS = carry
            if not one_seq:  # else dfin is the loop's initial carry
                dS = dS + jnp.where(end_ref[c] != 0, dfin_ref[sq], 0.0)
            dSe_ref[c] = dS.astype(dSe_ref.dtype)
            base = c * C
            if decayed:  # the rows carry their decays: only the state's, G's last row
                Gc, gl = None, load_rows(G_ref, base + C - 1, 1)
                Kt = load_rows(k_ref, base, C)
            else:
                Gc, gl = _chunk_decay(mode, G_ref, base, C)
                Kt = None if vside else _kt(mode, Gc, gl, load_rows(k_ref, base, C))
            if vside:  # the row decay on the [C, BVs] product
                kdS = _pass_dot(load_rows(k_ref, base, C, None if dS_dt else F32), dS, prec,
                                dS_dt)
                dR = load_rows(dRl_ref, base, C) + exp(gl - Gc)[:, None] * kdS
            else:
                dR = load_rows(dRl_ref, base, C) + _pass_dot(Kt, dS, prec, dS_dt)
            dR_ref[pl.ds(base, C), :] = dR.astype(dR_ref.dtype)
            qdo_c = (_chunk_q_dO(s, Gc, load_rows(q_ref, base, C, None),
                                 load_rows(dO_ref, base, C, None), decayed, vside)
                     if qdo_ref is None else qdo_ref[c].astype(F32))
            dS0 = qdo_c - _pass_dot(  # W as stored
                load_rows(W_ref, base, C, None if dR_dt else F32), dR, prec, dR_dt, ta=True)
            dS0 = dS0 + (dS if mode == "none" else _col(exp(gl)) * dS)
            if end_after:  # chunk 0 starts the only sequence: the loop's last step
                return dS0
            is_reset = reset_ref[c] != 0

            @pl.when(is_reset)
            def _():
                dh0_ref[sq] = dS0

            return jnp.where(is_reset, 0.0, dS0)

        dS_start = lax.fori_loop(0, N, body, dfin_ref[0] if one_seq else jnp.zeros((K, BV), F32))
        if end_after:
            dh0_ref[0] = dS_start

    ins = [q, k] + ([] if mode == "none" else [G]) + [W, dO, dRl, dfin, reset, end, seq]
    in_specs = [s.col_tok(K, False)] * 2 + ([] if mode == "none" else [s.col_gate()]) + [
        s.col_tok(K, False), s.col_tok(s.V, True), s.col_tok(s.V, True),
        s.col_states(s.n_seq1)] + [s.col_meta()] * 3
    outputs = s.pass_outputs(dtypes)
    if given_qdo:  # qdo first, in place of q; no dO
        i_dO = 3 if mode == "none" else 4  # [q, k, (G), W, dO, ...]
        del ins[i_dO], in_specs[i_dO]
        ins[0], in_specs[0] = qdo, s.col_states(N)
    return kernel, ins, in_specs, outputs


def twin_pass(s: Shape, fwd_args, bwd_args, *, interpret, fwd_dtypes, bwd_dtypes, qdo=None,
              decayed=False):
    """The backward's two state passes in one launch (DEFAULTS "backward.twin_pass"):
    ``fwd_pass(s, *fwd_args, dtypes=fwd_dtypes)`` (the recomputed S0, R) and ``bwd_pass(s,
    *bwd_args, dtypes=bwd_dtypes)`` (dS_end, dR) are independent — bwd_pass reads W, not S0 or
    R — and each runs only B·H·V/BVs programs, one per SM, issue-bound at one warp per
    scheduler (profile-11, ncu). Launched apart they run one after the other; here a third grid
    axis picks the pass, so both share the SMs (two programs per SM where registers and shared
    memory allow). Returns (S0, R, final) + (dS_end, dR, dh0), as the two calls would.
    qdo, decayed: as ``bwd_pass``'s.
    """
    kf, ins_f, specs_f, out_f = _fwd_pass_parts(s, *fwd_args, fwd_dtypes, None,
                                                 _native_pass_dots(fwd_dtypes), decayed)
    kb, ins_b, specs_b, out_b = _bwd_pass_parts(s, *bwd_args, bwd_dtypes, qdo, decayed)
    n_f, n_b, n_fo = len(ins_f), len(ins_b), len(out_f["out_shape"])

    def kernel(*refs):
        ins, outs = refs[:n_f + n_b], refs[n_f + n_b:]
        which = grid_id(2)

        @pl.when(which == 0)
        def _():
            kf(*ins[:n_f], *outs[:n_fo])

        @pl.when(which == 1)
        def _():
            kb(*ins[n_f:], *outs[n_fo:])

    def on_twin_grid(spec):  # (bh, v) -> (bh, v, which): both passes see their own blocks
        return pl.BlockSpec(spec.block_shape, lambda bh, v, which: spec.index_map(bh, v))

    # Stages (_pass_stages "twin"): at one (28 KB of shared memory, DeltaNet) two programs
    # share an SM and each hides the other's load latency; one-sequence calls pipeline 2 deep
    # instead (123 KB, one program per SM) — profile-17, DeltaNet at the anchor: twin_pass
    # 0.319 -> 0.240 ms (3 stages: 0.275), at (4,4096,64,128) 2.26 -> 1.65; GDN 0.394 -> 0.288;
    # KDA 0.583 -> 0.418.
    return _call(kernel, grid=(s.B * s.H, s.V // s.BVs, 2),
                 in_specs=[on_twin_grid(x) for x in specs_f + specs_b],
                 out_specs=[on_twin_grid(x) for x in out_f["out_specs"] + out_b["out_specs"]],
                 out_shape=out_f["out_shape"] + out_b["out_shape"], interpret=interpret,
                 num_warps=s.warps("twin_pass"), name="rewy_twin_pass",
                 num_stages=_pass_stages(s, "twin"),
                 tile_axis=1)(*ins_f, *ins_b)


def bwd_dlam(s: Shape, A, R, dO, dR, e, z, G, S0, *, backward, interpret, lam_dtype=F32,
             dt_dtype=F32, rows=None):
    """The state-free core of the chunk backward, grid (N, B·H), a loop over value tiles.

    ReWY (rewy-math §4):  Λ = Aᵀ dR (product 1),  dT = −tril(Λ Rᵀ, −1) (product 2).
    WY (seven products):  dZ = Aᵀ dR,  dA = dR Zᵀ + dW Ēᵀ with dW Ēᵀ = −dR (Ē S0)ᵀ,
                          dT = −tril(Aᵀ dA Aᵀ, −1)   (dĒ = Aᵀ dW is formed in bwd_leaf).
    Both: dA_qk = scale · tril(dO Rᵀ) (``Shape.scaled``).
    No gate enters these products (only WY's Ē), so they run on whole-chunk [C, ·] tiles
    (one matmul each) rather than 16-row sub-chunk blocks: far fewer live accumulators.
    Returns Λ [B,Tp,H,V] in ``lam_dtype`` (= dz), dT and dA_qk [B,H,N,C,C] in ``dt_dtype``
    (masked; formed in fp32). With ``dlam_decays`` (scalar gates) both leave decayed, dT ⊙ D
    and dA_qk ⊙ D (``_scalar_decay``; dA_qk's diagonal keeps its factor 1): the C × C decay is
    formed once per chunk here instead of once per key tile in ``bwd_leaf``, and the leaf's
    products meet the decayed values in their stored 16 bits (one rounding, FLA's GDN rounds
    its decayed dA likewise).

    rows = (βe, βz) [B,Tp,H] fp32: e, z are k, v as stored and Ē = βe ⊙ k, Z = βz ⊙ v (formed
    here in fp32 where WY reads them). Then also the leaf gradients of Z = βz ⊙ v, from Λ in
    fp32: dv = βz ⊙ Λ [B,Tp,H,V] in v's dtype and dβz = Σ_v Λ ⊙ v [B,Tp,H] fp32 — so the op
    needs no XLA pass over Λ and v for them (``api.general_delta``).
    """
    C, prec, mode, V, BV = s.C, s.prec, s.mode, s.V, s.BV
    wy = backward == "wy"
    with_rows = rows is not None
    decays = dlam_decays(mode)

    def kernel(*refs):
        refs = list(refs)
        be_ref = bz_ref = dv_ref = dbz_ref = None
        if with_rows:  # inputs (…, βe, βz) and outputs (…, dv, dβz)
            dv_ref, dbz_ref = refs[-2:]
            be_ref, bz_ref = refs[n_in - 2:n_in]
            del refs[-2:]
            del refs[n_in - 2:n_in]
        if not wy:  # ReWY reads no e, S0, G only to decay (and z = v only with rows)
            refs[4:4] = [None] if with_rows else [None, None]  # e (, z)
            if decays:
                refs.insert(7, None)  # S0, after G
            else:
                refs[6:6] = [None, None]  # G, S0
        elif mode == "none":
            refs.insert(6, None)
        A_ref, R_ref, dO_ref, dR_ref, e_ref, z_ref, G_ref, S0_ref, lam_ref, dT_ref, dAqk_ref = refs
        A = A_ref[...]  # as stored: bf16 under backward.low_precision "A"
        r, c = iota((C, C), 0), iota((C, C), 1)
        bz = None if bz_ref is None else load_rows(bz_ref, 0, C)[:, None]  # [C, 1]
        if wy:
            Gc = None if mode == "none" else load_rows(G_ref, 0, C)
            Ec = load_rows(e_ref, 0, C)
            if be_ref is not None:
                Ec = load_rows(be_ref, 0, C)[:, None] * Ec
            Eg = _qg(mode, Gc, Ec)  # Ē = γ ⊙ E (exponents ≤ 0)
        dT = dAqk = dbz = None
        for t in range(V // BV):
            vs = pl.ds(t * BV, BV)
            R_s = R_ref[:, vs]  # as stored: bf16 under backward.low_precision "R"
            R_t, dR_t = R_s.astype(F32), dR_ref[:, vs].astype(F32)
            lam = dot_stored(A, dR_ref[:, vs], prec, ta=True)
            lam_ref[:, vs] = lam.astype(lam_ref.dtype)
            if with_rows:  # Z = βz ⊙ v: dv = βz ⊙ Λ, dβz = Σ_v Λ ⊙ v
                v_t = z_ref[:, vs].astype(F32)
                dv_ref[:, vs] = (bz * lam).astype(dv_ref.dtype)
                x = jnp.sum(lam * v_t, axis=1)
                dbz = x if dbz is None else dbz + x
            x = dot_stored(dO_ref[:, vs], R_s, prec, tb=True)
            dAqk = x if dAqk is None else dAqk + x
            if wy:
                Z_t = z_ref[:, vs].astype(F32) if bz is None else bz * v_t
                ZmES = Z_t - dot(Eg, S0_ref[:, vs].astype(F32), prec)
                x = dot(dR_t, ZmES, prec, tb=True)  # dA
            else:
                x = -dot(lam, R_t, prec, tb=True)
            dT = x if dT is None else dT + x
        if wy:
            A = A.astype(F32)
            dT = -dot(dot(A, dT, prec, ta=True), A, prec, tb=True)  # −Aᵀ dA Aᵀ
        if decays:
            D = _scalar_decay(load_rows(G_ref, 0, C), C, strict=True)
            dT_ref[...] = (dT * D).astype(dT_ref.dtype)
            # the diagonal's factor 1 as the strict matrix's zero diagonal plus 1
            dAqk_ref[...] = (s.scaled(dAqk) * jnp.where(c == r, 1.0, D)).astype(
                dAqk_ref.dtype)
        else:
            dT_ref[...] = jnp.where(c < r, dT, 0.0).astype(dT_ref.dtype)
            dAqk_ref[...] = jnp.where(c <= r, s.scaled(dAqk), 0.0).astype(dAqk_ref.dtype)
        if with_rows:
            dbz_ref[...] = dbz

    full_v = pl.BlockSpec((None, C, None, V), lambda n_, bh: (bh // s.H, n_, bh % s.H, 0))
    if wy:
        ins = [A, R, dO, dR, e, z] + ([] if mode == "none" else [G]) + [S0]
        in_specs = [s.chunk_mat(C, C)] + [full_v] * 3 + [s.chunk_tok(s.K), full_v] + (
            [] if mode == "none" else [s.chunk_gate()]) + [s.chunk_mat(s.K, V)]
    else:  # v itself only for the row scales' gradients; G only to decay
        ins = [A, R, dO, dR] + ([z] if with_rows else []) + ([G] if decays else [])
        in_specs = [s.chunk_mat(C, C)] + [full_v] * (4 if with_rows else 3) + (
            [s.chunk_gate()] if decays else [])
    n_in = len(ins) + (2 if with_rows else 0)
    out_specs = [full_v, s.chunk_mat(C, C), s.chunk_mat(C, C)]
    out_shape = [s.sds_tok(V, lam_dtype),
                 jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), dt_dtype),
                 jax.ShapeDtypeStruct((s.B, s.H, s.N, C, C), dt_dtype)]
    if with_rows:
        ins += list(rows)
        in_specs += [s.chunk_row()] * 2
        out_specs += [full_v, s.chunk_row()]
        out_shape += [s.sds_tok(V, z.dtype), jax.ShapeDtypeStruct((s.B, s.Tp, s.H), F32)]
    return _call(kernel, grid=(s.N, s.B * s.H), in_specs=in_specs, out_specs=out_specs,
                 out_shape=out_shape, interpret=interpret, num_warps=s.warps("bwd_dlam"),
                 name="rewy_bwd_dlam")(*ins)


def _state_inner(dS, S0, prec):
    """Σ_v dS ⊙ S0 per key channel, [1, BK] fp32, of two [BK, V] state tiles as stored: the
    diagonal of the product dS S0ᵀ — a native product of tiles the leaf has staged for its other
    products, where the element-wise form held both tiles in fp32 registers (ptxas, sm_90,
    K = 128: GDN's leaf 172 -> 147 registers, SASS 1134 -> 1130). Not for vector gates: in
    KDA's row-grid leaf (BK = 32, 4 warps) it took 150 -> 255 registers."""
    M = dot_stored(dS, S0, prec, tb=True)
    r, c = iota(M.shape, 0), iota(M.shape, 1)
    return jnp.sum(jnp.where(r == c, M, 0.0), axis=0)[None, :]


def bwd_leaf(s: Shape, q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, *, backward, dtypes,
             interpret, be=None, e_scale=None):
    """Leaf gradients, grid (N, B·H, K/BK): every map below acts per key channel, so key tiles
    are independent (rewy-math §5–§6, raw frame):

        dĒ_state = −Λ S0ᵀ (ReWY product 3)  or  Aᵀ dW, dW = −dR S0ᵀ (WY)
        de = γ ⊙ dĒ_state + apply(dT, k)          dq = scale · γ ⊙ dO S0ᵀ + apply(dA_qk, k)
        dk = apply_t(dT, e) + apply_t(dA_qk, q) + y,   y = e^{G_C − G} ⊙ R dSᵀ
    and the gate gradient's two parts (chunk_algebra._leaf_grads: the terms with
    decay factor 1 — dA_qk's diagonal, each row's own path y into the end state — kept out):
        pairs = de⊙e − dk'⊙k + dq'⊙q (dk', dq' without those terms), last row + γ_C ⊙ Σ_v dS⊙S0
        path  = y ⊙ k
    so that g's gradient is, per chunk, the reverse cumsum of pairs plus the exclusive cumsum of
    path (``api._bwd``). Returns dq, dk, de [B,Tp,H,K] and (pairs, path) fp32: [B,Tp,H,K] per
    channel for vector gates, [B,Tp,H,K/BK] summed over each key tile's channels for scalar
    gates; None without gates.

    be: βe [B,Tp,H] fp32 with e None — Ē = βe ⊙ k (``bwd_dlam``'s rows). dT then meets k as
    diag(βe) dT (dTᵀ Ē = (diag(βe) dT)ᵀ k), and the leaf map e = βe ⊙ k is differentiated here:
    dk gains βe ⊙ de, and instead of de the third output is dβe's part Σ de ⊙ k over each key
    tile, [B,Tp,H,K/BK] fp32 (summed outside).

    e_scale: βe [B,Tp,H] fp32 with e None (DEFAULTS "backward.leaf_e_rows"): e's rows formed
    here as βe ⊙ k rounded to e's dtype — bit for bit ``api.leaf_product``'s e — instead of
    read, so that no e is formed, stored and read back outside (DeltaNet at the anchor: an XLA
    fusion of 0.026 ms, profile-22, and one [B,T,H,K] read less here). The outputs are the same
    as with e. Vector gates: not with the per-pair ("loop") diagonals, which read e's rows one
    token at a time from the ref.
    """
    n, C, prec, mode, K, V = s.n, s.C, s.prec, s.mode, s.K, s.V
    BK = s.BK
    wy = backward == "wy"
    H = s.H
    rowgrid = mode == "vector" and bool(setting("rewy_bwd_leaf.rowgrid"))
    diag = "centred" if s.centred else setting("rewy_bwd_leaf.exact_diag")
    shared = bool(setting("rewy_bwd_leaf.shared_decay"))
    with_be, with_es = be is not None, e_scale is not None
    pre_decayed = dlam_decays(mode)  # dT, dA_qk arrive decayed (bwd_dlam)
    if with_es and (with_be or e is not None or (mode == "vector" and diag == "loop")):
        raise ValueError("bwd_leaf: e_scale needs e None, no βe, and no per-pair diagonals")

    def kernel(*refs):
        refs = list(refs)
        be_ref = dbe_ref = es_ref = None
        if with_be:  # input βe last, output dβe's part last; no e, no de
            dbe_ref = refs.pop()
            be_ref = refs.pop(n_in - 1)
            refs.insert(2, None)  # e
        if with_es:  # input βe last; e formed from k
            es_ref = refs.pop(n_in - 1)
            refs.insert(2, None)  # e
        if mode == "none":
            refs.insert(3, None)
        if not wy:
            refs.insert(4, None)  # A
        if with_be:
            refs.insert(15, None)  # de
        (q_ref, k_ref, e_ref, G_ref, A_ref, S0_ref, dSe_ref, lam_ref, R_ref, dO_ref, dR_ref,
         dT_ref, dAqk_ref, dq_ref, dk_ref, de_ref) = refs[:16]
        dg_refs = refs[16:18] if mode != "none" else None
        if mode != "vector":
            return _leaf_full(refs[:16], dg_refs, be_ref, dbe_ref, es_ref)
        pairs_ref, path_ref = dg_refs
        gt = Gates(mode, G_ref, 0, C, diag)
        qs, ks = Rows(q_ref), Rows(k_ref)
        dT, dAqk = Blocks(dT_ref), Blocks(dAqk_ref, zero_diagonal=True)
        # what dT meets in dk: Ē's rows as stored (or formed here from k), or k's with βe on
        # dT's rows
        if be_ref is not None:
            dT_e, es, e_src = Blocks(dT_ref, row_scale=be_ref), ks, k_ref
        else:  # e_src None with e_scale: only the per-pair diagonals read it (refused above)
            dT_e, es, e_src = (dT, Rows(e_ref), e_ref) if es_ref is None else (
                dT, ScaledRows(k_ref, es_ref, ed), None)
        A = Blocks(A_ref) if wy else None
        dW_memo = {}

        def state_dots(i, pairs):
            """[x_i Sᵀ for (x_ref, S_ref) in pairs]: row block i of a [C, V] tensor against a
            [BK, V] state tile, [BS, BK] each. (Contracting V in slices, as qk_gram does K,
            measured slower here: profile-10, bwd_leaf 1.94 -> 2.13 ms.)"""
            rows = pl.ds(i * BS, BS)
            return [dot_stored(x_ref[rows, :], S_ref[...], prec, tb=True) for x_ref, S_ref in pairs]

        def dW(j):  # WY's dW_j = −dR_j S0ᵀ, formed once per program at first use
            if j not in dW_memo:
                dW_memo[j] = -state_dots(j, [(dR_ref, S0_ref)])[0]
            return dW_memo[j]

        def row_block(i):
            """Row block i of dq, dk, de and the gate gradient's two parts."""
            if wy:  # dĒ_state = Aᵀ dW, dW_j = −dR_j S0ᵀ
                dEs = _sum(dot(A[j, i], dW(j), prec, ta=True) for j in range(i, n))
                dOS, = state_dots(i, [(dO_ref, S0_ref)])
            else:
                lS, dOS = state_dots(i, [(lam_ref, S0_ref), (dO_ref, S0_ref)])
                dEs = -lS
            dOS = s.scaled(dOS)
            if shared:  # dT and dA_qk meet the same decay factors: form them once
                de_k, dq_k = gt.applies([dT, dAqk], i, ks, k_ref, prec)
                dk_x = gt.apply_t_sum([(dT_e, es, e_src), (dAqk, qs, q_ref)], i, prec, n)
            else:
                de_k, dq_k = (gt.apply(dT, i, ks, k_ref, prec), gt.apply(dAqk, i, ks, k_ref, prec))
                dk_x = (gt.apply_t(dT_e, i, es, e_src, prec, n)
                        + gt.apply_t(dAqk, i, qs, q_ref, prec, n))
            de = gt.head(i, dEs) + de_k
            dq = gt.head(i, dOS) + dq_k  # both without dA_qk's diagonal (dAqk reads it as 0)
            y = gt.tail(i, state_dots(i, [(R_ref, dSe_ref)])[0])  # e^{G_C − G} ⊙ R_i dS_endᵀ
            d_i = dAqk.diagonal(i)  # [BS, 1]: its pairs (r, r) have decay factor 1
            be_i = None if be_ref is None else load_rows(be_ref, i * BS)[:, None]
            e_i = es[i] if be_i is None else be_i * ks[i]
            pairs = de * e_i - dk_x * ks[i] + dq * qs[i]
            if i == n - 1:  # the start state's decay γ_C into the end state, on the last row
                sd = jnp.sum(dSe_ref[...].astype(F32) * S0_ref[...].astype(F32),
                             axis=1)[None, :]  # [1, BK] (``_state_inner``: slower here)
                pairs = pairs + jnp.where(iota((BS, 1), 0) == BS - 1, exp(gt.glast()) * sd, 0.0)
            rows = pl.ds(i * BS, BS)
            dq_ref[rows, :] = (dq + d_i * ks[i]).astype(dq_ref.dtype)
            dk = dk_x + y + d_i * qs[i]
            if be_i is None:
                de_ref[rows, :] = de.astype(de_ref.dtype)
            else:  # through Ē = βe ⊙ k
                dk = dk + be_i * de
                dbe_ref[rows, :] = jnp.sum(de * ks[i], axis=1, keepdims=True)
            dk_ref[rows, :] = dk.astype(dk_ref.dtype)
            pairs_ref[rows, :] = pairs
            path_ref[rows, :] = y * ks[i]

        if rowgrid:  # this program owns row block program_id(0) % n of its chunk
            ib = grid_id(0) % n
            for i in range(n):
                def one(i=i):
                    dW_memo.clear()  # values of another branch are out of scope here
                    row_block(i)
                pl.when(ib == i)(one)
        else:
            for i in range(n):
                row_block(i)

    def _leaf_full(refs, dg_refs, be_ref, dbe_ref, es_ref):
        """No or scalar gates: every decay is one [C, C] matrix D_rs = e^{G_r − G_s} (s < r,
        masked before exp; the diagonal's factor is 1), so the leaf maps are whole-chunk
        matmuls (no sub-chunk frames). With ``dlam_decays`` dT and dA_qk arrive decayed
        (dA_qk with its diagonal): no D here, and the maps are DeltaNet's."""
        (q_ref, k_ref, e_ref, G_ref, A_ref, S0_ref, dSe_ref, lam_ref, R_ref, dO_ref, dR_ref,
         dT_ref, dAqk_ref, dq_ref, dk_ref, de_ref) = refs
        r, c = iota((C, C), 0), iota((C, C), 1)
        qc, kc = load_rows(q_ref, 0, C), load_rows(k_ref, 0, C)
        be = None if be_ref is None else load_rows(be_ref, 0, C)[:, None]  # [C, 1]
        if es_ref is not None:  # e = βe ⊙ k rounded to e's dtype, as api.leaf_product forms it
            e_stored = load_scaled_rows(k_ref, es_ref, 0, C, ed)
        else:
            e_stored = None if be is not None else load_rows(e_ref, 0, C, None)
        ec = be * kc if be is not None else e_stored.astype(F32)
        S0, dSe = S0_ref[...], dSe_ref[...]  # as stored (backward.low_precision)
        if mode == "none":
            D, gam, tail, gl = None, None, None, None
        else:
            Gc = load_rows(G_ref, 0, C)  # [C]
            gl = load_rows(G_ref, C - 1, 1)  # [1]
            # strictly lower: dT has no diagonal, and dA_qk's (decay factor 1) joins dq, dk
            # apart from the gate gradient's terms (below)
            D = None if pre_decayed else _scalar_decay(Gc, C, strict=True)
            gam, tail = exp(Gc)[:, None], exp(gl - Gc)[:, None]
        dT, dAqk = dT_ref[...], dAqk_ref[...]
        d_qk = None
        if pre_decayed:
            # dA_qk arrives with its diagonal (factor 1): taken out of the maps that the gate
            # gradient's pairs read, so that dq, dk there hold no terms of dk's size that
            # cancel (d_r k_r q_r − d_r q_r k_r): their rounding would swamp a fully decayed
            # row's dg (tests/test_properties.py, fp32: dg ~1e-9 against dk ~1). ptxas (K =
            # 128): as a [C, C] matrix for two more products 185 registers, SASS 1250; as a
            # [C, 1] column scaling k and q 204, 1306 (and 147, 1122 with the terms left in)
            d_qk = jnp.where(r == c, dAqk, jnp.zeros_like(dAqk))
            dAqk = jnp.where(r == c, jnp.zeros_like(dAqk), dAqk)
        elif D is not None:
            d_qk = jnp.where(r == c, dAqk, 0.0)  # dA_qk's diagonal, as a [C, C] matrix
            dT, dAqk = dT * D, dAqk * D
            if setting("rewy_bwd_leaf.native_decayed"):  # back to 16 bits: native products
                dT, dAqk = dT.astype(dT_ref.dtype), dAqk.astype(dAqk_ref.dtype)
        if wy:
            dW = -dot_stored(dR_ref[...], S0, prec, tb=True)
            dEs = dot(A_ref[...].astype(F32), dW, prec, ta=True)
        else:
            dEs = -dot_stored(lam_ref[...], S0, prec, tb=True)
        dOS = s.scaled(dot_stored(dO_ref[...], S0, prec, tb=True))
        RdS = dot_stored(R_ref[...], dSe, prec, tb=True)
        if gam is not None:
            dEs, dOS, RdS_t = gam * dEs, gam * dOS, tail * RdS
        else:
            RdS_t = RdS
        # dT, dA_qk as stored: in bf16 (backward.low_precision "dT") and ungated they multiply
        # the stored 16-bit k, e, q natively; with βe, dT meets k as diag(βe) dT (in dT's dtype,
        # so ungated it stays a native product: one rounding, as e's own was)
        ks_, qs_ = load_rows(k_ref, 0, C, None), load_rows(q_ref, 0, C, None)
        if be is None:
            es_, dT_e = e_stored, dT
        else:
            es_, dT_e = ks_, (be * dT.astype(F32)).astype(dT.dtype)
        de = dEs + dot_stored(dT, ks_, prec)
        dq = dOS + dot_stored(dAqk, ks_, prec)

        def store_de():  # de, or through Ē = βe ⊙ k: dβe's part (dk's share is added to dk)
            if be is None:
                de_ref[...] = de.astype(de_ref.dtype)
            else:
                dbe_ref[...] = jnp.sum(de * kc, axis=1, keepdims=True)

        dk_e = None if be is None else be * de
        if mode == "none":
            early = bool(setting("rewy_bwd_leaf.store_early"))
            if early:  # dq, de out before dk's products are staged: fewer live [C, K] tiles
                dq_ref[...] = dq.astype(dq_ref.dtype)
                store_de()
            dk = dot_stored(dT_e, es_, prec, ta=True) + dot_stored(dAqk, qs_, prec, ta=True) + RdS_t
            dk_ref[...] = (dk if dk_e is None else dk + dk_e).astype(dk_ref.dtype)
            if not early:
                dq_ref[...] = dq.astype(dq_ref.dtype)
                store_de()
            return
        # each result stored as soon as it is whole (fewer live [C, K] tiles); the gate
        # gradient's parts summed over this tile's channels (one decay per row); dA_qk's
        # diagonal (decay factor 1) joins dq and dk only as they are stored
        pairs_ref, path_ref = dg_refs
        store_de()
        dq_ref[...] = (dq + dot_stored(d_qk, ks_, prec)).astype(dq_ref.dtype)
        pairs = de * ec + dq * qc
        path_ref[...] = jnp.sum(RdS_t * kc, axis=1, keepdims=True)
        dk = dot_stored(dT_e, es_, prec, ta=True) + dot_stored(dAqk, qs_, prec, ta=True)
        dk_all = dk + RdS_t + dot_stored(d_qk, qs_, prec, ta=True)
        dk_ref[...] = (dk_all if dk_e is None else dk_all + dk_e).astype(dk_ref.dtype)
        # the start state's decay into the end state, on the last row: γ_C Σ_k Σ_v dS ⊙ S0
        # over this tile's channels
        sd = jnp.sum(_state_inner(dSe, S0, prec), axis=1)  # [1]
        pairs = jnp.sum(pairs - dk * kc, axis=1, keepdims=True)
        pairs_ref[...] = pairs + jnp.where(iota((C, 1), 0) == C - 1, exp(gl) * sd, 0.0)

    # Row grid (vector gates, DEFAULTS): n programs per chunk, one per 16-row block — n× the
    # parallelism and one block's live tiles per program (the gate gradient's parts are summed
    # across blocks outside, api._gate_grad). Blocks stay whole chunks (each program stores only
    # its rows).
    ch = (lambda m: m // n) if rowgrid else (lambda m: m)
    tok_k = pl.BlockSpec((None, C, None, BK), lambda m, bh, kt: (bh // H, ch(m), bh % H, kt))
    tok_v = pl.BlockSpec((None, C, None, V), lambda m, bh, kt: (bh // H, ch(m), bh % H, 0))
    st_k = pl.BlockSpec((None, None, None, BK, V), lambda m, bh, kt: (bh // H, bh % H, ch(m), kt, 0))
    mat = pl.BlockSpec((None, None, None, C, C), lambda m, bh, kt: (bh // H, bh % H, ch(m), 0, 0))
    row = pl.BlockSpec((None, C, None), lambda m, bh, kt: (bh // H, ch(m), bh % H))
    gate = row if mode == "scalar" else tok_k
    no_e = with_be or with_es
    ins = [q, k] + ([] if no_e else [e]) + ([] if mode == "none" else [G]) + (
        [A] if wy else []) + [S0, dSe, lam, R, dO, dR, dT, dAqk] + ([be] if with_be else []) + (
        [e_scale] if with_es else [])
    in_specs = [tok_k] * (2 if no_e else 3) + ([] if mode == "none" else [gate]) + (
        [mat] if wy else []) + [st_k, st_k, tok_v, tok_v, tok_v, tok_v, mat, mat] + (
        [row] if no_e else [])
    n_in = len(ins)
    qd, kd, ed = dtypes
    # per key tile: a [C, 1] column per (chunk, head, tile) of [B,Tp,H,K/BK] fp32
    n_kt = K // BK
    tile_part = (pl.BlockSpec((None, C, None, 1), lambda m, bh, kt: (bh // H, ch(m), bh % H, kt)),
                 jax.ShapeDtypeStruct((s.B, s.Tp, H, n_kt), F32))
    # the gate gradient's two parts: per channel (vector gates) or per key tile (scalar)
    gate_part = (tok_k, s.sds_tok(K)) if mode == "vector" else tile_part
    out_specs = [tok_k] * (2 if with_be else 3) + ([] if mode == "none" else [gate_part[0]] * 2)
    out_shape = [s.sds_tok(K, qd), s.sds_tok(K, kd)] + ([] if with_be else [s.sds_tok(K, ed)]) + (
        [] if mode == "none" else [gate_part[1]] * 2)
    if with_be:
        out_specs.append(tile_part[0])
        out_shape.append(tile_part[1])
    outs = list(_call(kernel, grid=(s.N * (n if rowgrid else 1), s.B * H, K // BK),
                      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                      interpret=interpret, num_warps=s.leaf_warps, name="rewy_bwd_leaf",
                      tile_axis=2)(*ins))
    third = outs.pop() if with_be else outs.pop(2)  # dβe's parts, or de
    return outs[:2] + [third, None if mode == "none" else tuple(outs[2:])]


def bwd_chunk(s: Shape, q, k, e, z, G, A, S0, dSe, R, dO, dR, *, backward, dtypes, interpret,
              lam_dtype=F32, dt_dtype=F32, rows=None, e_scale=None):
    """Per-chunk cotangents (raw frame): dq, dk, de [B,Tp,H,K], dz [B,Tp,H,V], the gate
    gradient's two parts (pairs, path) per token ([B,Tp,H] for scalar gates; ``bwd_leaf``) or
    None, and None.
    lam_dtype, dt_dtype: how Λ and dT, dA_qk are stored between the two kernels.
    rows = (βe, βz) [B,Tp,H] fp32, e None and z = v: Ē = βe ⊙ k and Z = βz ⊙ v, differentiated
    in-kernel — then (dq, dk, None, dv, dg parts, (dβe, dβz)), dk and dv through Ē and Z too.
    e_scale: βe with e None (ReWY; DEFAULTS "backward.leaf_e_rows"): the leaf forms e = βe ⊙ k
    itself (``bwd_leaf``); bwd_dlam reads no e under ReWY.

    Two kernels, so that neither holds a chunk's worth of [C, K] and [C, V] blocks at once:
    bwd_dlam (the C×C core: Λ, dT, dA_qk) then bwd_leaf (key-tiled leaf maps and dg's parts).
    """
    kw = dict(backward=backward, interpret=interpret)
    if rows is None:
        lam, dT, dAqk = bwd_dlam(s, A, R, dO, dR, e, z, G, S0, lam_dtype=lam_dtype,
                                 dt_dtype=dt_dtype, **kw)
        dz, drows = lam.astype(dtypes[3]), None
    else:
        lam, dT, dAqk, dz, dbz = bwd_dlam(s, A, R, dO, dR, k, z, G, S0, lam_dtype=lam_dtype,
                                          dt_dtype=dt_dtype, rows=rows, **kw)
    dq, dk, de, dg_parts = bwd_leaf(s, q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk,
                                    dtypes=dtypes[:3], be=None if rows is None else rows[0],
                                    e_scale=e_scale, **kw)
    if rows is not None:  # de's place holds dβe's per-key-tile parts
        de, drows = None, (jnp.sum(de, axis=-1), dbz)
    if dg_parts is not None and s.mode == "scalar":
        dg_parts = tuple(jnp.sum(x, axis=-1) for x in dg_parts)
    return dq, dk, de, dz, dg_parts, drows
