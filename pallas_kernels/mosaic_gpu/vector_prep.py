"""Preparation of the vector-gate (KDA, GDN2) Mosaic GPU kernels' inputs: XLA, and the Pallas GPU
backend's gate-sum kernel for G (Mosaic GPU has no scan; XLA's took 0.15 ms at the anchor).

Pipeline:  **this stage**  ->  vector_chunk.py (per chunk: gated Grams, inverse, W, U, Qγ,
K_tail, P)  ->  vector_forward.py (fused state pass + output).

    pad T to a multiple of C (zero rows: k = v = 0, β = b = w = 0, g = 0 leave the state unchanged)
    g      clamped to the declared bound, else to RESET_GATE (−40: e^−40 is below fp32 resolution
           of any state; the clamp keeps −inf out of the cumulative sums)
    g2     [B, H, Tp, K]  chunk-local inclusive cumsum of g per key channel, log2 units, fp32
    KDA    x = v [B, Tp, H, V];       erase = β head-major [B, H, Tp] fp32
    GDN2   x = z = w ⊙ v [B, Tp, H, V] (input dtype: the kernel rounds Z there anyway, as the
           WGMMA operand of U = A Z, so forming it here adds no rounding);
           erase = b [B, Tp, H, K] fp32 (kept fp32: e = b ⊙ k is rounded once, in the kernel)

**When the centred contraction is safe.** The chunk kernel evaluates every decay factor
``2^{G_r − G_s}`` (s ≤ r) as a product ``(x_r 2^{G_r − G_m}) · (y_s 2^{G_m − G_s})`` in a reference
frame m (rewy-math §3). The exact frames keep both exponents ≤ 0, for any g. The centred frame of
a 16-row sub-chunk is its row 8: with every per-token gate ≥ ``CENTRED_MIN_GATE`` = −5 each factor
is at most e^{8·5} = e^40 ≈ 2e17 (bf16 and fp32 share the exponent range, to 3e38), so the WGMMA
operands stay finite; kept products equal e^{G_r − G_s} ≤ 1 up to rounding, and the products of
masked-out pairs (which may overflow to inf in fp32) are discarded by a select, never summed.
Below that bound the centred frame is safe only where the gates allow it, so without a declared
bound every chunk is checked here (:func:`centred_chunks`): a chunk whose 16-row sub-chunks each
decay by at most 40 in every key channel (the total ``G_{start−1} − G_{end}``, natural units)
bounds every centred factor by e^40, exactly as the declared bound does, and takes the centred
diagonal blocks; any other chunk takes the exact bit-level frames (a reset gate, −40 per token,
forces them). Mild gates, the common case, so cost the centred path's products whether or not a
bound is declared.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.chunk_algebra import RESET_GATE
from pallas_kernels.gpu.gates import cum_gates
from pallas_kernels.mosaic_gpu.common import C, META
from pallas_kernels.mosaic_gpu.prep import LOG2E, head_major, pad_time

SUB = 16  # rows per sub-chunk of the centred diagonal blocks (vector_chunk.py)

CENTRED_MIN_GATE = -5.0
# The largest total decay of a 16-row sub-chunk (natural units) at which a chunk takes the centred
# frame: the same e^40 bound on every factor as CENTRED_MIN_GATE gives (8 tokens of −5).
CENTRED_MAX_DECAY = 40.0


def centred_ok(gate_lower_bound) -> bool:
    """Whether a declared per-token gate bound admits the centred diagonal blocks."""
    return gate_lower_bound is not None and float(gate_lower_bound) >= CENTRED_MIN_GATE


def gate_floor(gate_lower_bound) -> float:
    """What g is clamped to (``chunk_algebra.clamp_gates``): the declared bound, else RESET_GATE."""
    return RESET_GATE if gate_lower_bound is None else float(gate_lower_bound)


def log2_chunk_cumsum_vec(g, Tp: int, floor: float, *, interpret: bool = False, warps: int = 4):
    """``[B, T, H, K]`` natural-log gates -> ``[B, H, Tp, K]`` fp32 chunk-local inclusive
    cumulative sums in log2 units of the gates clamped to ``floor`` (head-major: a chunk's
    ``[C, 64]`` tiles are contiguous rows). One read of g and one write of G: the Pallas GPU
    backend's ``gates.cum_gates`` (XLA's cumsum here took 0.15 ms at the anchor, h100-23)."""
    return cum_gates(pad_time(g.astype(jnp.float32), Tp), C, interpret=interpret, warps=warps,
                     floor=floor, scale=LOG2E, head_major=True)


def centred_chunks(g2):
    """``[B, H, N, META]`` int32, entry 0 per chunk: 1 where every 16-row sub-chunk of the chunk
    decays by at most ``CENTRED_MAX_DECAY`` in every key channel (the module docstring), else 0.
    ``g2``: the log2 chunk cumsums ``[B, H, Tp, K]``."""
    B, H, Tp, K = g2.shape
    N = Tp // C
    ends = g2.reshape(B, H, N, C // SUB, SUB, K)[:, :, :, :, -1]  # G at each sub-chunk's last row
    starts = jnp.concatenate([jnp.zeros_like(ends[:, :, :, :1]), ends[:, :, :, :-1]], axis=3)
    ok = jnp.max(starts - ends, axis=(3, 4)) <= CENTRED_MAX_DECAY * LOG2E  # [B, H, N]
    return jnp.pad(ok.astype(jnp.int32)[..., None], [(0, 0)] * 3 + [(0, META - 1)])


def prepare_vector(q, k, v, g, beta=None, b=None, w=None, *, gate_lower_bound=None, interpret: bool = False):
    """``(q, k, x, g2, erase, flags)`` padded for vector_chunk.vector_chunk; KDA when ``beta`` is
    given, GDN2 when ``b`` and ``w`` are (see the module docstring for each array). ``flags``:
    :func:`centred_chunks`, or None where a declared bound centres every chunk. ``interpret``:
    the gate sums' Pallas Triton kernel in the interpreter (CPU)."""
    B, T, H, K = k.shape
    Tp = -(-T // C) * C
    dtype = v.dtype
    g2 = log2_chunk_cumsum_vec(g, Tp, gate_floor(gate_lower_bound), interpret=interpret)
    q, k = (pad_time(x.astype(dtype), Tp) for x in (q, k))
    flags = None if centred_ok(gate_lower_bound) else centred_chunks(g2)
    if beta is not None:
        return q, k, pad_time(v, Tp), g2, head_major(beta, Tp), flags
    z = (w.astype(jnp.float32) * v.astype(jnp.float32)).astype(dtype)
    return q, k, pad_time(z, Tp), g2, pad_time(b.astype(jnp.float32), Tp), flags
