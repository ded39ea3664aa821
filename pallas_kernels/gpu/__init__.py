"""Pallas GPU kernels (Triton lowering) of the chunked delta rule and ReWY's reduced backward.

* :mod:`pallas_kernels.gpu.config` — ``KernelConfig``, every setting the kernels read (tiles,
  warps, stages, precision policy, algorithm choices), and ``default_config``, the measured
  defaults per (gate mode, head dims, dtype); docs/performance-log.md records what each
  alternative measured.
* :mod:`pallas_kernels.gpu.blocks` — the per-chunk algebra of ``pallas_kernels.chunk_algebra``
  in a Triton-lowerable form (16-row sub-chunk blocks, reference frames for vector gates,
  masked forward substitution for the inverse); :mod:`pallas_kernels.gpu.decay` — ``Gates``,
  a chunk's decay factors (Grams and leaf maps of ``chunk_algebra.Decay`` on those blocks).
* :mod:`pallas_kernels.gpu.launch` — ``call`` (``pallas_call`` with a config's launch settings)
  and ``Shape`` (sizes, gate mode, precision, the config, BlockSpecs of the token layout).
* The ``pallas_call`` kernels by pipeline stage, in the order a call runs them:
  :mod:`~pallas_kernels.gpu.gates` (G from g; dg at the end), :mod:`~pallas_kernels.gpu.chunk_local`
  (qk_gram, intra: the chunk's WY form), :mod:`~pallas_kernels.gpu.state_passes` (fwd_pass,
  bwd_pass, twin_pass: the loops over chunks), :mod:`~pallas_kernels.gpu.output` (output,
  bwd_local), :mod:`~pallas_kernels.gpu.chunk_backward` (bwd_dlam, bwd_leaf).
* :mod:`pallas_kernels.gpu.api` — ``general_delta`` (the kernels behind ``jax.custom_vjp``) and
  the adapter that ``rewy_jax.backends`` registers as backend ``"pallas_gpu"``.

Imports go one way: api -> the stages -> launch -> decay -> blocks, config (tests/test_import_layers.py).
The developer tools (profiling, traces, ptxas reports) live in the top-level ``tools/``
package. Nothing here is imported by ``import rewy_jax``; the backend imports it on first use.
"""
