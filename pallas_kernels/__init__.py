"""Compute floor of rewy-jax: the per-chunk block algebra and the Pallas kernels evaluating it.

Imports nothing from ``rewy_jax`` (layering: rewy_jax -> pallas_kernels).
"""
