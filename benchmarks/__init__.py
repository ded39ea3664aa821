"""Benchmark harness for rewy-jax (issue #6): timing, peak memory, roofline floor and accuracy of
ours and the peers (jax-linear-attention, flash-linear-attention, plain JAX autodiff) in one
process. Entry point: ``python -m benchmarks.run`` (see benchmarks/README.md)."""
