"""Typed, frozen settings of the Mosaic GPU kernels, passed with each call (part of the jit key).

:func:`default_config` is the one place that chooses them per shape and dtype.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.mosaic_gpu.common import C

# SMEM a CTA may use on sm_90 (227 KB), less room for the barriers and the compiler's scratch.
SMEM_BUDGET = 220 * 1024


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """Tiling of a serial pass over chunks (the fused forward, the reverse state pass).

    block_v: value columns per CTA (the state tile ``[block_v, K]`` is fp32 in registers).
    stages: depth of the TMA input pipeline (chunks in flight).
    """

    block_v: int = 64
    stages: int = 2

    def __post_init__(self):
        if self.block_v != 64:
            raise ValueError(f"PassConfig.block_v must be 64 (one WGMMA M-tile), got {self.block_v}")
        if not 2 <= self.stages <= 4:
            raise ValueError(f"PassConfig.stages must be in [2, 4], got {self.stages}")


@dataclasses.dataclass(frozen=True)
class Config:
    """All Mosaic GPU kernel settings of one call."""

    forward: PassConfig = PassConfig()
    state_backward: PassConfig = PassConfig()


def forward_smem_bytes(K: int, block_v: int, stages: int, itemsize: int, with_state: bool) -> int:
    """SMEM the fused forward needs (its scratch list, see forward.fused_forward)."""
    # per stage: q, k, v, Ag_hi (T0's buffer), Ag_lo, β and g
    per_stage = 2 * C * K * itemsize + C * block_v * itemsize + 2 * C * C * itemsize + 2 * C * 4
    # the published state (2 halves), R (2), the output/P tile (2), the W stage; the fp32 state
    fixed = 2 * block_v * K * itemsize + 5 * C * block_v * itemsize
    fixed += block_v * K * 4 if with_state else 0
    return stages * per_stage + fixed


def state_backward_smem_bytes(K: int, block_v: int, stages: int, itemsize: int) -> int:
    """SMEM the reverse state pass needs (its scratch list, see state_backward.state_backward)."""
    per_stage = 2 * C * K * itemsize + C * block_v * itemsize + C * C * itemsize + 2 * C * 4
    fixed = 2 * block_v * C * 4 + 2 * C * block_v * itemsize + C * C * itemsize
    fixed += block_v * K * itemsize + block_v * C * itemsize + C * block_v * itemsize + block_v * K * 4
    return stages * per_stage + fixed


def _deepest(fits) -> int:
    for stages in (4, 3, 2):
        if fits(stages):
            return stages
    raise ValueError("no Mosaic GPU tiling fits SMEM")


def default_config(K: int, V: int, itemsize: int) -> Config:
    """The defaults: the deepest input pipeline that fits SMEM, per kernel."""
    fwd = _deepest(lambda s: forward_smem_bytes(K, 64, s, itemsize, True) <= SMEM_BUDGET)
    bwd = _deepest(lambda s: state_backward_smem_bytes(K, 64, s, itemsize) <= SMEM_BUDGET)
    return Config(forward=PassConfig(block_v=64, stages=fwd),
                  state_backward=PassConfig(block_v=64, stages=bwd))


# ---------------------------------------------------------------------------------------------
# Vector gates (KDA, GDN2): vector_chunk.py + vector_forward.py
# ---------------------------------------------------------------------------------------------
PIECE = 64  # key/value columns per tile of the vector-gate chunk kernel (one [C, 64] tile)


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
    """

    centred: bool = False
    state: PassConfig = PassConfig()
    out_buffers: int = 2
    state_backward: PassConfig = PassConfig()

    def __post_init__(self):
        if self.out_buffers not in (1, 2):
            raise ValueError(f"VectorConfig.out_buffers must be 1 or 2, got {self.out_buffers}")


def vector_chunk_smem_bytes(K: int, V: int, itemsize: int, channel_erase: bool) -> int:
    """SMEM of the vector-gate chunk kernel (its scratch list, see vector_chunk.vector_chunk):
    inputs q, k, v|z, G twice (fp32, swizzled and plain), b (fp32, GDN2) or β; six [C, C] bf16
    staging tiles and one output tile (the other outputs reuse the inputs' buffers)."""
    inputs = 2 * C * K * itemsize + C * V * itemsize + 2 * C * K * 4 + (C * K * 4 if channel_erase else C * 4)
    return inputs + 6 * C * C * 2 + C * C * itemsize


def vector_state_smem_bytes(K: int, block_v: int, stages: int, itemsize: int, out_buffers: int,
                            with_state: bool) -> int:
    """SMEM of the vector-gate state + output pass (its scratch list, see
    vector_forward.vector_state_output)."""
    per_stage = 3 * C * K * itemsize + C * block_v * itemsize + C * C * itemsize + K * 4
    fixed = 2 * block_v * K * itemsize + 2 * C * block_v * itemsize + out_buffers * C * block_v * itemsize
    fixed += block_v * K * 4 if with_state else 0
    return stages * per_stage + fixed


def default_vector_config(K: int, V: int, itemsize: int, centred: bool) -> VectorConfig:
    """The deepest state-pass pipeline that fits SMEM with a double-buffered output tile, else
    the deepest with a single one (K = 128: 2 stages, one output tile)."""
    if vector_chunk_smem_bytes(K, V, itemsize, True) > SMEM_BUDGET:
        raise ValueError(f"the vector-gate chunk kernel does not fit SMEM at K={K}, V={V}")
    for out_buffers in (2, 1):
        for stages in (4, 3, 2):
            if vector_state_smem_bytes(K, 64, stages, itemsize, out_buffers, True) <= SMEM_BUDGET:
                bwd = default_vector_backward_stages(K, itemsize)
                return VectorConfig(centred=centred, state=PassConfig(block_v=64, stages=stages),
                                    out_buffers=out_buffers,
                                    state_backward=PassConfig(block_v=64, stages=bwd))
    raise ValueError(f"no vector-gate state-pass tiling fits SMEM at K={K}")


def vector_state_backward_smem_bytes(K: int, block_v: int, stages: int, itemsize: int) -> int:
    """SMEM of the vector-gate reverse state pass (its scratch list, see
    vector_state_backward.vector_state_backward)."""
    per_stage = 3 * C * K * itemsize + C * C * itemsize + C * block_v * itemsize + K * 4
    fixed = block_v * K * itemsize + 2 * block_v * C * itemsize + block_v * K * 4
    return stages * per_stage + fixed


def vector_chunk_backward_smem_bytes(K: int, V: int, itemsize: int) -> int:
    """SMEM of the vector-gate per-chunk gradient kernel (its scratch list, see
    vector_chunk_backward.vector_chunk_backward): dO, dR, R ``[C, V]``, S0ᵀ and dSᵀ
    ``[V, 64]``, A hi/lo, q, k, e ``[C, 64]``; G twice and three output tiles (fp32)."""
    return 5 * C * V * itemsize + 2 * C * C * 2 + 3 * C * PIECE * itemsize + 5 * C * PIECE * 4


def default_vector_backward_stages(K: int, itemsize: int) -> int:
    """The deepest reverse-state-pass pipeline that fits SMEM (K = 128: 2, K = 64: 4)."""
    return _deepest(lambda s: vector_state_backward_smem_bytes(K, 64, s, itemsize) <= SMEM_BUDGET)
