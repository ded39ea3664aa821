"""Developer tools for the Pallas GPU kernels (device sessions and CPU cross-lowering).

Run from the repository root as modules, e.g. ``python -m tools.trace_op --variants base,nopd``.
They import ``rewy_jax`` and ``pallas_kernels``; nothing in the library imports them.

* ``profile_kernels`` — each kernel jitted alone per config variant (``VARIANTS``: KernelConfig
  overrides), host-loop timing; ``variant_overrides`` / ``parse_setting`` build configs.
* ``trace_op`` — one op's fwd+bwd per kernel and XLA fusion from a device trace; compares
  variants by device time (the way to time kernels under ~0.2 ms).
* ``resource_report`` — ptxas registers / spills / shared memory per kernel, without a GPU.
* ``stall_report`` — ncu stall reasons per kernel.
* ``bench_kernels`` — accuracy and timing against the xla backend.
* ``tpu_roofline`` — FLOPs and HBM bytes of the TPU kernels, counted from their jaxprs.
* ``kernel_fingerprint`` — every op's traced kernels as text, to diff before and after a refactor.
"""
