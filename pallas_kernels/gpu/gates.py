"""Gate kernels of vector gates (KDA, GDN2): the chunk cumsum G of the log-decays, the
decayed rows the fused forward pass reads, and the gate gradient from the leaf's two parts.

Pipeline (one op's forward and backward; ``api`` drives it, this module's stage marked *):

    forward   gates.cum_gates* -> chunk_local.qk_gram (vector gates) -> chunk_local.intra
              -> state_passes.fwd_pass (output fused in) | state_passes.fwd_pass + output.output
    backward  chunk_local.intra (W, U from the kept A) -> output.bwd_local
              -> state_passes.twin_pass | fwd_pass + bwd_pass
              -> chunk_backward.bwd_dlam -> chunk_backward.bwd_leaf -> gates.gate_grad*

    cum_gates     grid (N, B·H, K/64)  g [B,Tp,H,K] -> G [B,Tp,H,K] fp32 (+ the clamp's int8 mask)
    decayed_rows  grid (N, B·H, K/64)  k, q, G -> K̄ = e^(G_C − G) ⊙ k, Qγ = e^G ⊙ q [B,Tp,H,K]
    gate_grad     grid (N, B·H, K/64)  pairs, path [B,Tp,H,K] -> dg [B,Tp,H,K] fp32

Each reads one [C, ≤64] block of each input per program. Scalar gates do these in jnp (api).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.chunk_algebra import clamp_gates
from pallas_kernels.gpu import launch
from pallas_kernels.gpu.blocks import F32, dot, exp, iota, load_rows


def _gate_call(kernel, xs, C, name, *, interpret, warps, out_dtypes=None, head_major=False):
    """A gate kernel on [B,Tp,H,K] tensors ``xs``, one [C, ≤64] block of each per program
    (grid (N, B·H, key tiles)), returning one fp32 tensor of their shape — or, with
    ``out_dtypes``, a tuple of one such tensor per dtype. ``head_major``: the outputs are
    [B,H,Tp,K] instead (the Mosaic GPU kernels' layout of G)."""
    B, Tp, H, K = xs[0].shape
    BK = min(K, 64)
    spec = pl.BlockSpec((None, C, None, BK), lambda n, bh, t: (bh // H, n, bh % H, t))
    out_spec, out_shape = spec, xs[0].shape
    if head_major:
        out_spec = pl.BlockSpec((None, None, C, BK), lambda n, bh, t: (bh // H, bh % H, n, t))
        out_shape = (B, H, Tp, K)
    shapes = [jax.ShapeDtypeStruct(out_shape, d) for d in (out_dtypes or [F32])]
    out = launch.call(kernel, grid=(Tp // C, B * H, K // BK), in_specs=[spec] * len(xs),
                out_specs=[out_spec] * len(shapes), out_shape=shapes, interpret=interpret,
                num_warps=warps, name=name)(*xs)
    return tuple(out) if out_dtypes else out[0]


def cum_gates(g, C, *, interpret, warps, floor=None, below=False, scale=None, head_major=False):
    """Vector gates' chunk-local inclusive cumsum G [B,Tp,H,K] fp32 of the log-decays g (same
    shape), one program per (chunk, head, key tile): one read and one write of g. In XLA the
    cumsum and the gate gradient's two cumsums were the three slowest fusions of KDA's glue
    (profile-21, anchor: 0.144 + 0.082 ms of device time plus 0.067 of slices; the scan lowers
    to a reduce-window there, up to 64 reads per output).

    floor: None, or a Python float g is first clamped to (``chunk_algebra.clamp_gates``).
    below (with a floor): also return the int8 mask [B,Tp,H,K] of g < floor — (G, mask) — for
    ``gate_grad`` to zero those gates' gradient (the clamp's VJP).
    scale: None, or a Python float the clamped gates are multiplied by before the sum (the Mosaic
    GPU backend's log2 units: ``LOG2E``). head_major: G as [B,H,Tp,K] (no mask then)."""
    if head_major and below:
        raise ValueError("cum_gates: the clamp's mask is token-major; head_major takes below=False")
    def kernel(g_ref, G_ref, below_ref=None):
        x = g_ref[...]
        if floor is not None:
            if below_ref is not None:
                below_ref[...] = (x < floor).astype(jnp.int8)
            x = clamp_gates(x, floor)
        if scale is not None:
            x = x * scale
        G_ref[...] = jnp.cumsum(x, axis=0)

    if below:
        assert floor is not None, "below is the mask of the clamp to floor"
        return _gate_call(kernel, [g], C, "rewy_cum_gates", interpret=interpret, warps=warps,
                          out_dtypes=[F32, jnp.int8])
    return _gate_call(kernel, [g], C, "rewy_cum_gates", interpret=interpret, warps=warps,
                      head_major=head_major)


def decayed_rows(k, q, G, C, *, interpret, warps):
    """Vector gates: (K̄, Qγ) [B,Tp,H,K] in k's / q's dtype — K̄ = e^{G_C − G} ⊙ k (each row's
    decay to its chunk's end) and Qγ = e^{G} ⊙ q (from the chunk's start), every exponent
    ≤ 0 — for the forward's fused pass to read instead of k, q and G's rows
    (KernelConfig.fwd_predecayed): the pass then forms no per-element exponentials in any of
    its value-tile programs and stages two 16-bit tiles instead of two 16-bit and one fp32."""
    def kernel(k_ref, q_ref, G_ref, kbar_ref, qg_ref):
        Gc = G_ref[...]
        kbar_ref[...] = (exp(load_rows(G_ref, C - 1, 1) - Gc) * k_ref[...].astype(F32)).astype(
            kbar_ref.dtype)
        qg_ref[...] = (exp(Gc) * q_ref[...].astype(F32)).astype(qg_ref.dtype)

    return _gate_call(kernel, [k, q, G], C, "rewy_decayed_rows", interpret=interpret,
                      warps=warps, out_dtypes=[k.dtype, q.dtype])


def _triangle_sum(tri, x):
    """``tri @ x`` for a 0/1 [C, C] matrix ``tri`` (bf16, exact) and fp32 ``x`` [C, ·]: x split
    into three bf16 parts (hi + mid + lo = x to the last bit or so), three native products with
    fp32 accumulation. Each output sums only the terms its row of ``tri`` selects, in fp32, as
    a cumsum does; an IEEE fp32 product spills (ptxas: 255 registers at any tile width)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(F32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(F32)).astype(jnp.bfloat16)
    prec = lax.Precision.DEFAULT
    return dot(tri, lo, prec) + dot(tri, mid, prec) + dot(tri, hi, prec)


def gate_grad(pairs, path, C, *, interpret, warps, below=None):
    """Vector gates' dg [B,Tp,H,K] fp32 from ``bwd_leaf``'s two parts (same shape): per chunk
    and channel, the suffix sum of pairs (terms that cross every earlier token) plus the strict
    prefix sum of path (a row's path into the end state crosses only the later tokens), each a
    product with a 0/1 triangle (``_triangle_sum``; Triton's lowering has no reverse scan).
    Every output sums only its own terms, so nothing cancels — as in
    ``chunk_algebra.reverse_cumsum`` / ``exclusive_cumsum``: a chunk-wide total minus a prefix
    would put 2⁻²⁴ of the total into outputs that are ~0 (a fully decayed sequence's dg).
    below: None, or ``cum_gates``'s int8 mask: dg is 0 where it is set (the clamp's VJP)."""
    def kernel(pairs_ref, path_ref, *refs):
        below_ref, dg_ref = refs if below is not None else (None,) + refs
        r, c = iota((C, C), 0), iota((C, C), 1)
        suffix = jnp.where(c >= r, 1.0, 0.0).astype(jnp.bfloat16)
        strict_prefix = jnp.where(c < r, 1.0, 0.0).astype(jnp.bfloat16)
        dg = (_triangle_sum(suffix, pairs_ref[...])
              + _triangle_sum(strict_prefix, path_ref[...]))
        if below_ref is not None:
            dg = jnp.where(below_ref[...] != 0, 0.0, dg)
        dg_ref[...] = dg

    ins = [pairs, path] + ([] if below is None else [below])
    return _gate_call(kernel, ins, C, "rewy_gate_grad", interpret=interpret, warps=warps)
