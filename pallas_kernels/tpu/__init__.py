"""Pallas TPU kernels (Mosaic TPU) of the delta-rule family: chunked forward, ReWY backward.

``chunked_delta_tpu`` is the differentiable op on chunk-layout inputs (see :mod:`.kernels`);
``supports_reason`` says which calls the kernels serve. ``rewy_jax.backends`` registers them as
the ``"pallas_tpu"`` backend; ``interpret=True`` runs them in the TPU interpreter on CPU.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.tpu.kernels import backward_call, chunk_meta, chunked_delta_tpu, forward_call

__all__ = ["chunked_delta_tpu", "chunk_meta", "forward_call", "backward_call", "supports_reason"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supports_reason(K: int, V: int, chunk_size: int, dtype, on_tpu: bool, interpret) -> str | None:
    """None if the TPU kernels serve this call, else why not."""
    if not on_tpu and not interpret:
        return "needs a TPU (pass interpret=True to run the kernels in the TPU interpreter)"
    if jnp.dtype(dtype) not in _DTYPES:
        return f"dtype {jnp.dtype(dtype)} (TPU kernels take float32, bfloat16 or float16)"
    if chunk_size % 16 or chunk_size > 128:
        return f"chunk_size={chunk_size} (needs a multiple of 16 up to 128: 16-row sub-chunks)"
    for name, d in (("K", K), ("V", V)):
        if d % 8 or d > 256:
            return f"{name}={d} (needs a multiple of 8 up to 256: whole [C, {name}] VMEM tiles)"
    return None
