"""The one place where the Mosaic GPU backend meets differences between JAX releases.

The GPU machine runs jax 0.11.2 and CI runs jax 0.12.x. Both have ``plgpu.kernel(out_type=...)``,
``plgpu.wgmma``, TMA copies and barriers with the same signatures; what differs is the GPU
interpreter, which runs a Mosaic GPU kernel on CPU with simulated SMEM, TMA and barriers. It is
public as ``plgpu.InterpretGPUParams`` on 0.12 and absent on 0.11.2 (where only real GPUs run
these kernels).
"""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu


def interpret_params(interpret: bool):
    """The ``interpret=`` argument of ``plgpu.kernel``: ``None`` on a GPU, the GPU interpreter's
    parameters on CPU. Raises ``NotImplementedError`` where this JAX has no GPU interpreter."""
    if not interpret:
        return None
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        import jax

        raise NotImplementedError(
            f"interpret=True needs the Mosaic GPU interpreter (jax >= 0.12); this is jax {jax.__version__}")
    return params()


def has_interpreter() -> bool:
    """Whether :func:`interpret_params` can run kernels on CPU with this JAX."""
    return hasattr(plgpu, "InterpretGPUParams")


def compiler_params() -> plgpu.CompilerParams:
    """Compiler settings of every kernel here: Lane lowering semantics (layouts are explicit in
    the kernels, as ``plgpu.load(..., layout=...)``; jax 0.12 defaults to Warpgroup semantics,
    whose layout inference does not accept these kernels), fast approximate ``exp2``."""
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)


def x32():
    """A scope that traces the kernels with 32-bit indices even when the caller enabled x64
    (the test suite does, for its float64 oracle): under x64 the loop indices become int64, and
    the GPU interpreter was seen to hang on the reverse state pass then. The kernels' inputs
    are 16-bit and fp32 either way."""
    import jax

    return jax.enable_x64(False)
