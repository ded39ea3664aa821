"""Pallas GPU kernels (Triton lowering)."""
