"""Pallas GPU kernels (Triton lowering) of the chunked delta rule and ReWY's reduced backward.

* :mod:`pallas_kernels.gpu.blocks` — the per-chunk algebra of ``pallas_kernels.chunk_algebra`` in
  a Triton-lowerable form (16-row sub-chunk blocks, reference frames for vector gates, masked
  forward substitution for the inverse).
* :mod:`pallas_kernels.gpu.kernels` — the ``pallas_call`` kernels (chunk-local, state passes,
  output, backward core and leaf maps).
* :mod:`pallas_kernels.gpu.api` — ``general_delta`` (the kernels behind ``jax.custom_vjp``) and
  the adapter that ``rewy_jax.backends`` registers as backend ``"pallas_gpu"``.
* Device-session tools (import rewy_jax; never imported by the library): ``bench_kernels.py``
  (accuracy and timing against the xla backend), ``trace_op.py`` (one op's fwd+bwd per kernel
  and XLA fusion from a trace; ``--variants`` compares tuning variants by device time — the
  way to time kernels under ~0.2 ms), ``profile_kernels.py`` (the variants' table, and each
  kernel jitted alone as a host loop, whose dispatch floor is ~0.1 ms at the anchor),
  ``resource_report.py`` (ptxas registers/spills without a GPU); findings in ``PERF.md``.

Nothing here is imported by ``import rewy_jax``; the backend imports it on first use.
"""
