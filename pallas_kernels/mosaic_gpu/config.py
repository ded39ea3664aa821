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
