"""Typed, frozen settings of the Mosaic GPU kernels, passed with each call (part of the jit key).

:func:`default_config` is the one place that chooses them per shape and dtype.

Head dims: K = V ∈ {64, 128} run the scalar-gate kernels on whole-width tiles (``k_block = K``,
``ChunkBackwardConfig.block = K``: the programs timed on the H100). K = V = 256 splits the
serial passes' fp32 register state and the per-chunk gradients' columns into 64-wide blocks,
because neither the registers (255 a thread) nor SMEM (227 KB a CTA) hold the whole-width tiles
there (docs/mosaic-gpu.md, "K = V = 256").
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pallas_kernels.mosaic_gpu.common import C

# SMEM a CTA may use on sm_90 (227 KB), less room for the barriers and the compiler's scratch.
SMEM_BUDGET = 220 * 1024
# SMs of the Hopper GPUs these kernels target (H100 SXM and H200: 132), for one-wave grid choices.
SMS = 132
# fp32 registers a thread of a serial pass's state warpgroup may spend on its register state and
# the fresh accumulator of the state update (of the 232 it gets; the rest holds addresses,
# scalars and the chunk's [64, 64] tiles). Over 255 a thread, Mosaic silently gave zeros on
# sm_90 (jax 0.11.2).
STATE_REGS = 192


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """Tiling of a serial pass over chunks (the fused forward, the reverse state pass).

    block_v: value columns per CTA (the state tile ``[block_v, K]`` is fp32 in registers).
    stages: depth of the TMA input pipeline (chunks in flight; 1 = no prefetch, K = 256).
    k_block: key columns of one block of the scalar-gate register state; ``None`` = K (one
        block, the whole-width program). A smaller block holds the state as ``K / k_block``
        tiles ``[block_v, k_block]``, runs the state update one WGMMA per block (one block's
        fresh accumulator live beside the state, not a second whole state) and moves the fp32
        initial/final state through SMEM one block at a time (the vector-gate serial kernels too).
    key_rows: the pass holds its register state as ``S [K, block_v]`` (``K / 64`` blocks of 64
        key rows; every chain product takes both operands from SMEM; ``k_block`` is ignored)
        instead of ``Sᵀ [block_v, K]``, so that ``block_v = 32`` is possible (twice the CTAs).
        The fused forward's h0 and final state are then ``[.., K, V]``; so are the reverse state
        pass's ``dS [K, block_v]`` carry, its final-state cotangent and dh0 (api._state_layout).
        The chunk states and cotangents it saves stay ``[.., V, K]`` in both layouts.
    split_r: the fused forward (and the states-only recompute) uses the chain's R as the bf16
        pair ``R_hi + R_lo`` (both in the input dtype) in the state update ``S += Kᵀ R`` and in
        the output's ``P R``, instead of ``R`` rounded once: one more WGMMA on the chain per key
        block (WG0: ``Kᵀ R_lo``, in the same round trip as ``Kᵀ R_hi``) and, with the output,
        one more on WG1 (``P R_lo``, off the chain), plus a published ``[C, block_v]`` R_lo tile
        pair. R's rounding is the forward's largest bf16 error source (docs/mosaic-gpu.md,
        "Accuracy"); :func:`split_r_for` chooses it. The reverse state pass ignores it.
    publish_buffers: the fused forward's tiles published from WG0 to WG1 (the chunk start state,
        R, R_lo) are double-buffered (2: WG0 publishes chunk n + 1's while WG1 still reads chunk
        n's) or single (1: WG0 waits for WG1's release of chunk n's tiles just before it stores
        chunk n + 1's, after issuing the product that the store overlaps). One buffer costs
        little in this pipeline: WG0 needs chunk n + 1's Ag, which WG1 builds only after that
        release. It frees ``[block_v, K] + [C, block_v]`` of SMEM (40 KB at K = 256).
    q_stages: the fused forward's q in a TMA ring of its own with this many slots (WG1 alone
        reads q, so its slot is refilled as soon as WG1's Q S0 has read it); ``None``: q
        travels with the other inputs in the ``stages`` pipeline. The reverse state pass
        ignores both fields. At K = 256 (:func:`default_config`) one q slot and single
        publications let the other inputs run two stages deep (220 KB) instead of one.
    """

    block_v: int = 64
    stages: int = 2
    k_block: int | None = None
    key_rows: bool = False
    split_r: bool = False
    publish_buffers: int = 2
    q_stages: int | None = None

    def __post_init__(self):
        if self.block_v not in ((32, 64) if self.key_rows else (64,)):
            raise ValueError(f"PassConfig.block_v must be 64 (one WGMMA M-tile), or 32 with "
                             f"key_rows, got {self.block_v}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"PassConfig.stages must be in [1, 4], got {self.stages}")
        if self.k_block not in (None, 64, 128):
            raise ValueError(f"PassConfig.k_block must be None, 64 or 128, got {self.k_block}")
        if self.publish_buffers not in (1, 2):
            raise ValueError(f"PassConfig.publish_buffers must be 1 or 2, got {self.publish_buffers}")
        if self.q_stages is not None and not 1 <= self.q_stages <= 4:
            raise ValueError(f"PassConfig.q_stages must be None or in [1, 4], got {self.q_stages}")

    def key_block(self, K: int) -> int:
        """Key columns per register-state block at head dim K (a divisor of K)."""
        kb = K if self.k_block is None else min(self.k_block, K)
        if K % kb:
            raise ValueError(f"K={K} is not a multiple of PassConfig.k_block={kb}")
        return kb


@dataclasses.dataclass(frozen=True)
class ChunkBackwardConfig:
    """Tiling of the scalar-gate per-chunk gradient kernel (chunk_backward.py).

    block: ``None`` = K: the whole-width kernel (every tile ``[64, K]``, S0ᵀ and dSᵀ ``[V, K]``
        whole in SMEM). 64: the blocked kernel of K = 256, which forms R, dT, dA per 64 value
        columns and dq, dk per 64 key columns, streaming S0ᵀ and dSᵀ as ``[64, 64]`` tiles
        through a two-slot TMA ring (chunk_backward.py, "Tiling").
    backward: the products the whole-width kernel issues. "rewy": the reduced backward (Λ Rᵀ and
        Λ S0ᵀ beside the Gram terms); "wy": the standard seven-product WY backward (dR, dW, the
        inverse's adjoint dA, Aᵀ dW, Aᵀ dA Aᵀ), same gradients, kept for the ablation
        (chunk_backward.py, "The seven-product form"). The blocked kernel has "rewy" only.
    warpgroups: 1 = the one-warpgroup whole-width kernel (DeltaNet's, and every K but 128);
        2 = the same math split over two warpgroups of one CTA (chunk_backward.py,
        ``_chunk_backward_2wg``: WG0 the R / dT / dA / dq chain, WG1 dk and the per-row sums),
        so that each holds fewer live fp32 tiles: GDN's at K = 128, where the gate's tiles made
        the one-warpgroup kernel spill (:func:`default_config` has the H100 times). Whole width
        and ReWY only (``block`` None, K ≤ 128).
    """

    block: int | None = None
    backward: Literal["rewy", "wy"] = "rewy"
    warpgroups: int = 1

    def __post_init__(self):
        if self.block not in (None, 64):
            raise ValueError(f"ChunkBackwardConfig.block must be None or 64, got {self.block}")
        if self.backward not in ("rewy", "wy"):
            raise ValueError(f"ChunkBackwardConfig.backward must be 'rewy' or 'wy', got {self.backward!r}")
        if self.warpgroups not in (1, 2):
            raise ValueError(f"ChunkBackwardConfig.warpgroups must be 1 or 2, got {self.warpgroups}")
        if self.warpgroups == 2 and self.block is not None:
            raise ValueError("ChunkBackwardConfig.warpgroups=2 is the whole-width kernel (block None)")
        if self.warpgroups == 2 and self.backward != "rewy":
            raise ValueError("ChunkBackwardConfig.warpgroups=2 has the ReWY backward only")


@dataclasses.dataclass(frozen=True)
class Config:
    """All Mosaic GPU kernel settings of one call.

    forward: the fused forward. state_backward: the reverse state pass. recompute: the
    states-only forward of the ``recompute`` policy's backward, launched together with the
    reverse state pass (launch.py: the two serial passes share the SMs; the grid is both
    passes' CTAs). chunk_backward: the per-chunk gradients."""

    forward: PassConfig = PassConfig()
    state_backward: PassConfig = PassConfig()
    chunk_backward: ChunkBackwardConfig = ChunkBackwardConfig()
    recompute: PassConfig = PassConfig()

    @property
    def saves_r(self) -> bool:
        """The forward (policy "save") or the states-only recompute stores each chunk's R beside
        its start state: the blocked per-chunk gradient kernel (K = 256) reads R instead of
        forming it from S0ᵀ (phase A's ``K S0ᵀ`` products and S0ᵀ's first 15 tile loads)."""
        return self.chunk_backward.block is not None


def forward_smem_bytes(K: int, block_v: int, stages: int, itemsize: int, with_state: bool,
                       k_block: int | None = None, key_rows: bool = False,
                       with_output: bool = True, split_r: bool = False, gated: bool = False,
                       publish_buffers: int = 2, q_stages: int | None = None) -> int:
    """SMEM the fused forward needs (its scratch list, see forward.forward_part); the fp32
    state buffer holds one ``[block_v, k_block]`` block (``None``: the whole ``[block_v, K]``).
    ``with_output=False``: the states-only recompute (no q, no output tile). ``split_r``
    (:attr:`PassConfig.split_r`): the published R_lo tiles (with the output or in key rows) and,
    gated in key rows, the decayed tail's lo stage. ``publish_buffers``, ``q_stages``: as the
    :class:`PassConfig` fields."""
    own_q = with_output and q_stages is not None
    # per stage: q (with the output, unless in its own ring), k, v, Ag_hi (T0's buffer), Ag_lo, β and g
    per_stage = (1 + (with_output and not own_q)) * C * K * itemsize + C * block_v * itemsize \
        + 2 * C * C * itemsize + 2 * C * 4
    # the published state and R (publish_buffers each), the output tile (2, with the output),
    # the W stage (key rows only: value rows take the chain's left operands from registers);
    # q's own ring; the fp32 state
    fixed = publish_buffers * (block_v * K + C * block_v) * itemsize
    fixed += (2 * with_output + key_rows) * C * block_v * itemsize
    fixed += q_stages * C * K * itemsize if own_q else 0
    fixed += block_v * (k_block or K) * 4 if with_state else 0
    if split_r:
        fixed += (publish_buffers * (with_output or key_rows) + (key_rows and gated)) * C * block_v * itemsize
    return stages * per_stage + fixed


def split_r_for(K: int, gated: bool) -> bool:
    """:attr:`PassConfig.split_r`: ungated DeltaNet at K = 64 only. There the forward failed
    the benchmark's bf16 bound on the H100 (o 5.42e-3, final state 5.49e-3 > 5e-3 at
    (1, 512, 8, 64)). A float64 emulation of the kernel's rounding points on the benchmark's
    inputs (tools/mosaic_rounding_emulation.py) puts R first (o 3.0e-3, final state 3.3e-3
    alone); with the pair the interpreter gives o 4.47e-3, final state 4.32e-3
    (tools/mosaic_accuracy_repro.py). GDN (o 3.5e-3 at K = 64) and K ≥ 128 (DeltaNet o 4.7e-3:
    64 unit keys per chunk in more dimensions give a better conditioned Gram) pass without it
    (docs/mosaic-gpu.md, "Accuracy")."""
    return K == 64 and not gated


def state_backward_smem_bytes(K: int, block_v: int, stages: int, itemsize: int,
                              k_block: int | None = None, key_rows: bool = False) -> int:
    """SMEM the reverse state pass needs (its scratch list, see state_backward.state_backward);
    the fp32 cotangent buffer holds one ``[block_v, k_block]`` block (``None``: the whole), or
    with ``key_rows`` one ``[64, block_v]`` block (the other tiles are the same sizes, some
    transposed)."""
    per_stage = 2 * C * K * itemsize + C * block_v * itemsize + C * C * itemsize + 2 * C * 4
    fixed = 2 * block_v * C * 4 + 2 * C * block_v * itemsize + C * C * itemsize
    # dSᵀ, Λ, and (key rows only: value rows take the chain's left operands from registers) dR
    fixed += block_v * K * itemsize + (1 + key_rows) * block_v * C * itemsize
    fixed += block_v * (C if key_rows else (k_block or K)) * 4
    return stages * per_stage + fixed


# Slots of each of the blocked per-chunk gradient kernel's two TMA rings ([64, 64] tiles of S0ᵀ
# and dSᵀ): loads run two tiles ahead of the products (K = 256, bf16: 223,488 B of SMEM).
BLOCKED_RING_SLOTS = 3


def chunk_backward_smem_bytes(K: int, itemsize: int, block: int | None = None,
                              warpgroups: int = 1) -> int:
    """SMEM the per-chunk gradient kernel needs (its scratch list, see chunk_backward). The
    two-warpgroup kernel has the whole-width buffers and one more fp32 row vector (⟨q, dq⟩,
    handed from WG0 to WG1)."""
    vecs = (5 + (warpgroups == 2)) * C * 4 + K * 4  # β, g, dβ, dG, u (+ ⟨q, dq⟩); sds
    if block is None:  # q, k, v, dO, Λ, W, R, βK [C, K]; S0ᵀ, dSᵀ [K, K]; T0, two [C, C]
        return 8 * C * K * itemsize + 2 * K * K * itemsize + 3 * C * C * itemsize + vecs
    whole = 4 * C * K * itemsize  # k, v (then R), dO, Λ
    cc = 2 * C * C * itemsize  # T0 (then Ag, then dT ⊙ D), dA ⊙ D
    blocks = 3 * C * block * itemsize  # W (then dq), q block, dv (then βK, then dk)
    ring = 2 * BLOCKED_RING_SLOTS * block * block * itemsize  # S0ᵀ and dSᵀ tiles
    return whole + cc + blocks + ring + vecs


def k_block_for(K: int) -> int:
    """Key columns per register-state block. The state ``[64, K]`` fp32 costs K/2 registers a
    thread and the update's fresh accumulator ``[64, k_block]`` k_block/2 more: the whole width
    while that stays within STATE_REGS (K = 128: 64 + 64), else 64 (K = 256: 128 + 32)."""
    return K if K // 2 + K // 2 <= STATE_REGS else 64


def _deepest(fits, shallowest: int = 2) -> int:
    for stages in range(4, shallowest - 1, -1):
        if fits(stages):
            return stages
    raise ValueError("no Mosaic GPU tiling fits SMEM")


def default_config(K: int, V: int, itemsize: int, backward: Literal["rewy", "wy"] = "rewy",
                   heads: int | None = None, gated: bool = False, sms: int = SMS,
                   policy: Literal["recompute", "save"] = "recompute") -> Config:
    """The defaults: the deepest input pipeline that fits SMEM, per kernel. K ≤ 128: whole-width
    tiles and at least two stages (the tilings timed on the H100); K = 256: the register state
    in blocks of :func:`k_block_for`, whatever depth fits (the reverse pass one stage: a whole
    chunk's q and k are 64 KB there; the fused forward two, with q in one slot of its own and
    single publications, PassConfig.q_stages) and the blocked per-chunk gradient kernel. ``backward`` picks the
    per-chunk gradient kernel's products (:class:`ChunkBackwardConfig`; "wy" at K ≤ 128 only).

    ``heads``: the call's B·H (None: unknown). The fused forward's serial chain is latency-bound
    (on the H100 its time did not change from 32 to 128 CTAs), so where 32 value columns per CTA
    still fit one wave on ``sms`` SMs it takes the key-rows layout with ``block_v = 32``: twice
    the CTAs, each chain step half the work (GDN forward at the anchor 155 → 123 µs); beyond one
    wave the 64-column value-rows layout (at 256 CTAs on 132 SMs key rows took 238 µs, value
    rows 149). Its pipeline is two stages deep (three: GDN 130 µs, two: 126). The reverse state
    pass, a serial chain of the same kind, follows the same rule (key rows, 32 columns, two
    stages where the grid fits one wave; untimed on the GPU so far: three stages would fit SMEM
    too, 194 KB at K = 128 against 148 KB).

    ``gated`` (GDN) at K = 128: the per-chunk gradients on two warpgroups (GDN 0.213 → 0.169 ms
    at the anchor on the H100; DeltaNet, without the gate's live tiles, 0.178 → 0.214, so it
    keeps one).

    ``policy`` "recompute": the reverse state pass and the states-only forward share one launch
    (both passes' CTAs in one grid), so the one-wave rule counts both: key rows where twice the
    32-column grid fits one wave, else value rows for both (at the anchor 2 · 64 = 128 CTAs)."""
    split = split_r_for(K, gated)  # the fused forward and its recompute (the same chunk states)
    if K <= 128:
        def pass_cfg(key_rows: bool, smem_bytes, split_r: bool = False) -> PassConfig:
            if key_rows:
                return PassConfig(block_v=32, key_rows=True, stages=2, split_r=split_r)
            return PassConfig(block_v=64, stages=_deepest(lambda s: smem_bytes(s) <= SMEM_BUDGET),
                              split_r=split_r)

        one_wave = lambda passes: heads is not None and passes * heads * (V // 32) <= sms  # noqa: E731
        passes = 2 if policy == "recompute" else 1  # CTAs sharing the reverse pass's launch
        return Config(forward=pass_cfg(one_wave(1), lambda s: forward_smem_bytes(
                          K, 64, s, itemsize, True, split_r=split, gated=gated), split),
                      state_backward=pass_cfg(one_wave(passes),
                                              lambda s: state_backward_smem_bytes(K, 64, s, itemsize)),
                      recompute=pass_cfg(one_wave(2), lambda s: forward_smem_bytes(
                          K, 64, s, itemsize, True, with_output=False, split_r=split, gated=gated), split),
                      chunk_backward=ChunkBackwardConfig(
                          backward=backward,
                          warpgroups=2 if gated and K == 128 and backward == "rewy" else 1))
    if backward != "rewy":
        raise ValueError(f"the blocked per-chunk gradient kernel (K = {K}) has the ReWY backward only")
    kb = k_block_for(K)
    # the fused forward: q in one slot of its own and single publications, so that the other
    # inputs get two stages (PassConfig.q_stages)
    fwd = _deepest(lambda s: forward_smem_bytes(K, 64, s, itemsize, True, kb, split_r=split, publish_buffers=1,
                                                q_stages=1) <= SMEM_BUDGET, 1)
    rec = _deepest(lambda s: forward_smem_bytes(K, 64, s, itemsize, True, kb, with_output=False)
                   <= SMEM_BUDGET, 1)
    bwd = _deepest(lambda s: state_backward_smem_bytes(K, 64, s, itemsize, kb) <= SMEM_BUDGET, 1)
    if chunk_backward_smem_bytes(K, itemsize, 64) > SMEM_BUDGET:
        raise ValueError(f"no Mosaic GPU chunk-gradient tiling fits SMEM at K={K}")
    return Config(forward=PassConfig(block_v=64, stages=fwd, k_block=kb, split_r=split, publish_buffers=1,
                                     q_stages=1),
                  state_backward=PassConfig(block_v=64, stages=bwd, k_block=kb),
                  recompute=PassConfig(block_v=64, stages=rec, k_block=kb, split_r=split),
                  chunk_backward=ChunkBackwardConfig(block=64))


# ---------------------------------------------------------------------------------------------
# Vector gates (KDA, GDN2): vector_chunk.py + vector_forward.py
# ---------------------------------------------------------------------------------------------
PIECE = 64  # key/value columns per tile of the vector-gate chunk kernel (one [C, 64] tile)
# Value pieces whose dO, dR, R, S0ᵀ and dSᵀ tiles the vector-gate gradient kernel holds at once
# (160 KiB at two); above it (V = 256) it streams them one piece at a time.
GRAD_RESIDENT_PIECES = 2


@dataclasses.dataclass(frozen=True)
class VectorConfig:
    """Settings of the vector-gate forward (vector_chunk.py, vector_forward.py).

    centred: the diagonal 16-row sub-chunk blocks of the chunk Grams as one centred product
        (frame = the sub-chunk's row 8), valid only for gates declared ≥ ``CENTRED_MIN_GATE``
        (vector_prep.py says why); otherwise exact bit-level frames.
    state: tiling of the fused state + output pass.
    out_buffers: SMEM buffers of the output tile (2 overlaps the TMA store of chunk n − 1 with
        chunk n; 1 where two do not fit beside the input pipeline, K = 128).
    state_backward: tiling of the reverse state pass (vector_state_backward.py).
    gate_grad_warps: warps of the gate gradient's chunk sums (``pallas_kernels.gpu.gates.gate_grad``,
        a Pallas Triton kernel: Mosaic GPU has no scan, and XLA's cumsums cost 0.30 ms at the
        anchor; 4 as in the Pallas GPU backend).
    backward: "rewy" (the reduced backward) or "wy": the seven-product chunk backward for the
        ablation (vector_wy.py; K = V ≤ 128), same gradients.
    grad_load_sets: the per-chunk gradient kernel's inputs in three TMA sets, each awaited at
        its first use, instead of one awaited before any work (vector_chunk_backward.py). GDN2
        takes them (H100, ``benchmarks.kernel_ab``, the op's fwd+bwd at the anchor with g ≥ −5:
        1.950 → 1.764 ms); KDA does not (its gradient kernel 0.578 → 0.816 ms, its op 1.686 →
        1.905, the same call; why is not known yet).
    """

    centred: bool = False
    state: PassConfig = PassConfig()
    out_buffers: int = 2
    state_backward: PassConfig = PassConfig()
    gate_grad_warps: int = 4
    backward: Literal["rewy", "wy"] = "rewy"
    grad_load_sets: bool = False

    def __post_init__(self):
        if self.backward not in ("rewy", "wy"):
            raise ValueError(f"VectorConfig.backward must be 'rewy' or 'wy', got {self.backward!r}")
        if self.out_buffers not in (1, 2):
            raise ValueError(f"VectorConfig.out_buffers must be 1 or 2, got {self.out_buffers}")
        if self.gate_grad_warps not in (1, 2, 4, 8):
            raise ValueError(f"VectorConfig.gate_grad_warps must be 1, 2, 4 or 8, got {self.gate_grad_warps}")


# Key columns the vector-gate chunk kernel holds at once. Above it (K = 256) the kernel forms the
# chunk Grams one key block at a time (they are sums over key channels), reloading its input tiles,
# and leaves W, U, Qγ and K_tail to vector_chunk.vector_wu: the whole width's q, k and G (twice, fp32)
# alone would be 192 KiB.
CHUNK_KEY_BLOCK = 128


def vector_chunk_key_block(K: int) -> int:
    """Key columns per block of the vector-gate chunk kernel's Grams (K itself up to 128)."""
    return min(K, CHUNK_KEY_BLOCK)


def _vector_chunk_bytes(K: int, V: int, itemsize: int, channel_erase: bool, staging: int) -> int:
    kb = vector_chunk_key_block(K)
    x = C * V * itemsize if kb == K else 0  # x's tiles: only the one-block kernel forms U
    inputs = 2 * C * kb * itemsize + x + 2 * C * kb * 4 + (C * kb * 4 if channel_erase else C * 4)
    return inputs + staging * C * C * 2 + C * C * itemsize


def vector_chunk_staging_tiles(K: int, V: int, itemsize: int, channel_erase: bool) -> int:
    """[C, C] bf16 staging tiles of the vector-gate chunk kernel: room for two Gram levels' operands
    (3 tiles a 64-column key piece of one key block, each) per round trip where SMEM holds them
    beside the inputs, else for one; at least six (the inverse's three split pairs). Six at K = 64
    (two levels; KDA keeps two CTAs on an SM), twelve for KDA at K = 128 and 256, six for GDN2 there
    (its fp32 b leaves no room: one level)."""
    two_levels = max(6, 6 * (vector_chunk_key_block(K) // PIECE))
    return two_levels if _vector_chunk_bytes(K, V, itemsize, channel_erase, two_levels) <= SMEM_BUDGET else 6


def vector_chunk_smem_bytes(K: int, V: int, itemsize: int, channel_erase: bool) -> int:
    """SMEM of the vector-gate chunk kernel (its scratch list, see vector_chunk.vector_chunk):
    inputs q, k, G twice (fp32, swizzled and plain), b (fp32, GDN2) or β over one key block, and
    v|z when one block spans K; the vector_chunk_staging_tiles [C, C] bf16 staging tiles and one
    output tile (the other outputs reuse the inputs' buffers)."""
    return _vector_chunk_bytes(K, V, itemsize, channel_erase,
                               vector_chunk_staging_tiles(K, V, itemsize, channel_erase))


def vector_state_smem_bytes(K: int, block_v: int, stages: int, itemsize: int, out_buffers: int,
                            with_state: bool, k_block: int | None = None) -> int:
    """SMEM of the vector-gate state + output pass (its scratch list, see
    vector_forward.vector_state_output); the fp32 state buffer holds one ``[block_v, k_block]``
    block (``None``: the whole ``[block_v, K]``)."""
    per_stage = 3 * C * K * itemsize + C * block_v * itemsize + C * C * itemsize + K * 4
    fixed = 2 * block_v * K * itemsize + 2 * C * block_v * itemsize + out_buffers * C * block_v * itemsize
    fixed += block_v * (k_block or K) * 4 if with_state else 0
    return stages * per_stage + fixed


def default_vector_config(K: int, V: int, itemsize: int, centred: bool,
                          backward: Literal["rewy", "wy"] = "rewy",
                          op: Literal["kda", "gdn2"] = "kda") -> VectorConfig:
    """The deepest state-pass pipeline that fits SMEM with a double-buffered output tile, else
    the deepest with a single one (K = 128: 2 stages, one output tile); the gradient kernel's
    loads in sets for GDN2 (``grad_load_sets``, as measured). K = 256: the serial
    kernels' fp32 register state as four ``[64, 64]`` blocks (:func:`k_block_for`: the whole
    width and its update's fresh accumulator would be 256 registers a thread) and one stage (a
    chunk's W, Qγ and K_tail alone are 96 KiB there)."""
    if vector_chunk_smem_bytes(K, V, itemsize, True) > SMEM_BUDGET:
        raise ValueError(f"the vector-gate chunk kernel does not fit SMEM at K={K}, V={V}")
    kb = None if K <= 128 else k_block_for(K)
    for out_buffers in (2, 1):
        for stages in (4, 3, 2) if kb is None else (4, 3, 2, 1):
            if vector_state_smem_bytes(K, 64, stages, itemsize, out_buffers, True, kb) <= SMEM_BUDGET:
                bwd = default_vector_backward_stages(K, itemsize)
                return VectorConfig(centred=centred, state=PassConfig(block_v=64, stages=stages, k_block=kb),
                                    out_buffers=out_buffers,
                                    state_backward=PassConfig(block_v=64, stages=bwd, k_block=kb),
                                    backward=backward, grad_load_sets=op == "gdn2")
    raise ValueError(f"no vector-gate state-pass tiling fits SMEM at K={K}")


def vector_state_backward_smem_bytes(K: int, block_v: int, stages: int, itemsize: int,
                                     k_block: int | None = None) -> int:
    """SMEM of the vector-gate reverse state pass (its scratch list, see
    vector_state_backward.vector_state_backward); the fp32 cotangent buffer holds one
    ``[block_v, k_block]`` block (``None``: the whole)."""
    per_stage = 3 * C * K * itemsize + C * C * itemsize + C * block_v * itemsize + K * 4
    fixed = block_v * K * itemsize + block_v * C * itemsize + block_v * (k_block or K) * 4  # dSᵀ, dR, fp32 block
    return stages * per_stage + fixed


def vector_chunk_backward_smem_bytes(K: int, V: int, itemsize: int, op: str | None = None) -> int:
    """SMEM of the vector-gate per-chunk gradient kernel (its scratch list, see
    vector_chunk_backward.vector_chunk_backward): dO, dR, R ``[C, V]``, S0ᵀ and dSᵀ
    ``[V, 64]`` (V = 256: Λ ``[C, V]`` and two sets of three ``[C, 64]`` slots), A hi/lo, q, k, e ``[C, 64]``; G twice and three output tiles (fp32); for
    ``op`` "kda" also v's ``[C, 64]`` piece and β and dβ's part ``[C]`` (fp32), for "gdn2" b's
    ``[C, 64]`` piece (fp32), and w's (fp32 at most) and v's pieces past the five staging tiles
    of the value-side union: the leaf maps each applies in the kernel."""
    leaf = {None: 0, "kda": C * PIECE * itemsize + 2 * C * 4, "gdn2": C * PIECE * 4}[op]
    # V = 256 streams the value pieces: Λ's and two sets of three slots instead of five [C, V] tiles
    values = (C * V + 6 * C * PIECE if V > GRAD_RESIDENT_PIECES * PIECE else 5 * C * V) * itemsize
    if op == "gdn2":
        values = max(values, 5 * C * PIECE * 2 + C * PIECE * (4 + itemsize))
    return values + 2 * C * C * 2 + 3 * C * PIECE * itemsize + 5 * C * PIECE * 4 + leaf


def default_vector_backward_stages(K: int, itemsize: int) -> int:
    """The deepest reverse-state-pass pipeline that fits SMEM (K = 128: 2, K = 64: 4, K = 256 with
    its blocked cotangent: 1)."""
    kb = None if K <= 128 else k_block_for(K)
    return _deepest(lambda s: vector_state_backward_smem_bytes(K, 64, s, itemsize, kb) <= SMEM_BUDGET,
                    2 if kb is None else 1)
