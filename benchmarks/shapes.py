"""Benchmark shapes (THE BENCHMARK PROTOCOL, shared/docs/anchors.md) and the reduced accuracy shapes.

(B, T, H, D) with K = V = D and chunk 64: flash-linear-attention's six benchmark shapes plus the
anchor table's (2, 4096, 16, 128).
"""

from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    B: int
    T: int
    H: int
    D: int

    @property
    def K(self) -> int:
        return self.D

    @property
    def V(self) -> int:
        return self.D

    def key(self) -> str:
        return f"{self.B}x{self.T}x{self.H}x{self.D}"

    def label(self) -> str:
        return f"({self.B},{self.T},{self.H},{self.D})"


FLA_SHAPES = [Shape(1, 8192, 96, 128), Shape(2, 16384, 16, 128), Shape(4, 2048, 16, 128),
              Shape(4, 4096, 64, 128), Shape(8, 2048, 32, 256), Shape(8, 1024, 8, 64)]
ANCHOR_SHAPE = Shape(2, 4096, 16, 128)
FULL_SHAPES = [ANCHOR_SHAPE] + FLA_SHAPES
QUICK_SHAPES = [ANCHOR_SHAPE, Shape(8, 1024, 8, 64)]
# Tiny shapes for --cpu-smoke (and the CPU tests): two chunks of 64.
SMOKE_SHAPES = [Shape(1, 128, 2, 32)]

OPS = ("deltanet", "gdn", "kda", "gdn2")
CHUNK = 64

# The float64 token recurrence is too slow at the benchmark sizes: accuracy is checked on a
# reduced shape with the same (H, D) and B = 1, T = ACC_T.
ACC_T = 512


def accuracy_shape(s: Shape, smoke: bool = False) -> Shape:
    """The reduced shape whose float64 reference stands in for ``s`` (same H and D)."""
    if smoke:
        return Shape(1, min(s.T, 128), s.H, s.D)
    return Shape(1, min(s.T, ACC_T), s.H, s.D)


def parse_shape(text: str) -> Shape:
    """'2x4096x16x128' or '2,4096,16,128' -> Shape."""
    parts = text.replace("(", "").replace(")", "").replace("x", ",").split(",")
    vals = [int(p) for p in parts if p.strip()]
    if len(vals) != 4:
        raise ValueError(f"shape {text!r}: expected B,T,H,D")
    return Shape(*vals)
