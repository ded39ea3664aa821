"""Pallas TPU kernels (Mosaic TPU)."""
