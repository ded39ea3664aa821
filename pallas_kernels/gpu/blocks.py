"""Lowerable per-chunk block algebra for the Pallas Triton kernels.

This is :mod:`pallas_kernels.chunk_algebra` rewritten for what the Triton lowering accepts:
every tensor a power-of-two tile, no reshape/einsum/concatenate of values, no scratch memory,
``jnp.dot``-style 2-D contractions only (each side ≥ 16). A chunk of C rows is therefore held as
``n = C / 16`` *sub-chunk blocks* of 16 rows (Python lists / dicts of ``[16, D]`` and
``[16, 16]`` values), loaded from refs with static ``pl.ds`` slices — the same sub-chunk
structure that ``chunk_algebra.VectorDecay`` expresses with reshapes and einsums:

* off-diagonal blocks (s in an earlier sub-chunk than r): one matmul in the reference frame
  m = first row of r's sub-chunk, ``(x_r ⊙ e^{G_r−G_m}) · (y_s ⊙ e^{G_m−G_s})`` (both ≤ 1);
* diagonal blocks: exact per-pair factors ``e^{G_r−G_s}`` (s ≤ r), one column (or row) of the
  block per loop step, reading row s from its ref — ``[16, K]`` elementwise work per step
  instead of chunk_algebra's ``[16, 16, K]`` tensor (rank-3 tiles would not fit registers).

The decay of a chunk (``Gates``: its Grams and leaf maps, every diagonal method) lives in
:mod:`pallas_kernels.gpu.decay`; this module holds the dots, row and block loads, the blocked
inverse and the whole-chunk helpers of no and scalar gates.

No ``exp(−G)`` is ever formed, so everything is finite for any g ≤ 0 (rewy-math §3).
The unit-lower inverse is chunk_algebra's blocked scheme (forward substitution on 16×16
diagonal blocks, then block forward substitution) with the row updates written as masked
reductions, since values cannot be indexed.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.chunk_algebra import SUBCHUNK

BS = SUBCHUNK  # rows per sub-chunk: 16, also the smallest tile tl.dot accepts
F32 = jnp.float32


LOG2E = 1.4426950408889634


def exp(x):
    """e^x in the kernels, as 2^(x·log2 e).

    The Triton lowering takes ``jnp.exp`` to libdevice's accurate expf — about 14 instructions
    per element in the sm_90 PTX — and ``jnp.exp2`` to one ex2.approx, so this form is 2
    (the product and ex2). Error: ex2.approx's 2 ulp plus the product's rounding,
    |x|·log2(e)·2⁻²⁴ — at most ~5e-6 relative for the exponents x ≤ 0 used here where e^x is a
    normal fp32 (x ≥ −87); −inf still gives 0.
    """
    return jnp.exp2(x * LOG2E)


@dataclass(frozen=True)
class EmulatedTF32:
    """Interpret mode only, as the ``prec`` of ``dot``: a DEFAULT-precision product whose fp32
    operands are first rounded to TF32 as the GPU's tensor cores read them (the interpreter
    multiplies exact fp32 otherwise) — ``mode`` "truncate" drops each fp32 operand's 13 low
    mantissa bits, "round" rounds them to nearest (ties away). From
    ``KernelConfig.tf32_emulation`` (api._precision); 16-bit operands are exact either way."""

    mode: str


def _as_tf32(x, mode):
    if x.dtype != F32:
        return x  # 16-bit operands are exact in TF32
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    if mode == "round":  # to nearest, ties away: add half of the dropped ulp first
        bits = bits + jnp.uint32(0x1000)
    return lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFE000), F32)


def dot(a, b, prec, ta=False, tb=False):
    """``a @ b`` (``aᵀ`` / ``bᵀ`` when ta / tb) with fp32 accumulation; ``prec`` a lax
    precision (or dot algorithm preset), or ``EmulatedTF32`` in interpret mode."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    if isinstance(prec, EmulatedTF32):
        a, b, prec = _as_tf32(a, prec.mode), _as_tf32(b, prec.mode), lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


def dot_stored(a, b, prec, ta=False, tb=False):
    """``dot`` of operands as they were stored: two 16-bit operands of one dtype multiply
    natively — their products are exact in the fp32 accumulator, so this is the TF32/fp32 dot
    of the upcast values at twice the tensor-core rate and with half the operand registers —
    anything else in fp32."""
    if a.dtype == b.dtype and a.dtype != F32:
        return dot(a, b, prec, ta, tb)
    return dot(a.astype(F32), b.astype(F32), prec, ta, tb)


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def load_rows(ref, start, rows=BS, dtype=F32):
    """Rows ``start .. start+rows`` of a [R, D] or [R] ref, as fp32 (or as stored: dtype=None)."""
    x = ref[pl.ds(start, rows)] if len(ref.shape) == 1 else ref[pl.ds(start, rows), :]
    return x if dtype is None else x.astype(dtype)


def diag_of(P):
    """[BS, 1]: the diagonal of a [BS, BS] block."""
    eye = iota((BS, BS), 0) == iota((BS, BS), 1)
    return jnp.sum(jnp.where(eye, P, 0.0), axis=1, keepdims=True)


def _sum(terms):
    out = None
    for t in terms:
        out = t if out is None else out + t
    return out


class Rows:
    """Lazy sub-chunk blocks of a [C, D] ref: ``Rows(ref)[i]`` loads rows 16i..16i+15 (fp32).

    Kernels index blocks through this instead of holding a list of loaded blocks, so a block is
    live only while it is used (a chunk's q, k, e as fp32 lists would not fit in registers).
    """

    def __init__(self, ref, base=0):
        self.ref, self.base = ref, base

    def __getitem__(self, i):
        return load_rows(self.ref, self.base + i * BS)


def load_scaled_rows(ref, scale_ref, start, rows, dtype):
    """Rows ``start .. start+rows`` of x = scale ⊙ y from a [R, D] ref of y and an [R] ref of
    the row scales: scale_r · y_r in fp32 rounded to ``dtype`` — bit for bit a stored x formed
    so (``api.leaf_product``), without x being stored."""
    return (load_rows(scale_ref, start, rows)[:, None] * load_rows(ref, start, rows)).astype(dtype)


class ScaledRows:
    """``Rows`` of x = scale ⊙ y (``load_scaled_rows``), each block read back as fp32."""

    def __init__(self, ref, scale_ref, dtype):
        self.ref, self.scale_ref, self.dtype = ref, scale_ref, dtype

    def __getitem__(self, i):
        return load_scaled_rows(self.ref, self.scale_ref, i * BS, BS, self.dtype).astype(F32)


class Blocks:
    """Lazy [16, 16] blocks of a [C, C] ref: ``Blocks(ref)[i, j]``; with ``zero_diagonal`` the
    matrix's diagonal reads as 0 (``diagonal(i)`` gives it, [BS, 1])."""

    def __init__(self, ref, zero_diagonal=False):
        self.ref = ref
        self.zero_diagonal = zero_diagonal

    def __getitem__(self, ij):
        i, j = ij
        blk = self.ref[pl.ds(i * BS, BS), pl.ds(j * BS, BS)].astype(F32)
        if self.zero_diagonal and i == j:
            blk = jnp.where(iota((BS, BS), 0) == iota((BS, BS), 1), 0.0, blk)
        return blk

    def diagonal(self, i):
        return diag_of(self.ref[pl.ds(i * BS, BS), pl.ds(i * BS, BS)].astype(F32))


def inv_diag(T):
    """``(I + T)⁻¹`` of a strictly lower [BS, BS] block by forward substitution (masked rows)."""
    return inv_diags([T])[0]


def inv_diags(Ts):
    """``inv_diag`` of several blocks in one loop: their BS − 1 dependent substitution steps
    (each two cross-thread reductions) interleave instead of running one chain after another."""
    r, c = iota((BS, BS), 0), iota((BS, BS), 1)
    A0 = (r == c).astype(F32)

    def step(o, T, A):
        t = jnp.sum(jnp.where(r == o, T, 0.0), axis=0)  # row o of T, indexed by column j
        upd = jnp.sum(t[:, None] * A, axis=0)  # Σ_j T_oj A_j
        return jnp.where(r == o, A - upd[None, :], A)

    def body(o, As):
        return tuple(step(o, T, A) for T, A in zip(Ts, As))

    return list(lax.fori_loop(1, BS, body, tuple(A0 for _ in Ts)))


def stack_blocks(blocks):
    """n = 2^m [BS, BS] values -> one [n, BS, BS] value (block b at index b). The Triton lowering
    concatenates only by joining two values along a new last axis, so the blocks are joined
    pairwise m times ([BS, BS, 2, …, 2], block bits least significant first) and the block
    axes moved to the front."""
    m = len(blocks).bit_length() - 1
    assert len(blocks) == 1 << m, "a power-of-two number of blocks"
    while len(blocks) > 1:  # join neighbours: the new last axis is the next block bit
        blocks = [lax.stack([blocks[i], blocks[i + 1]], axis=blocks[i].ndim)
                  for i in range(0, len(blocks), 2)]
    x = blocks[0]
    return jnp.transpose(x, tuple(range(x.ndim - 1, 1, -1)) + (0, 1)).reshape(-1, BS, BS)


def unstack_blocks(x):
    """``stack_blocks``' inverse: [n, BS, BS] -> the list of its n [BS, BS] blocks."""
    n = x.shape[0]
    m = n.bit_length() - 1
    x = jnp.transpose(x.reshape((2,) * m + (BS, BS)), (m, m + 1) + tuple(range(m - 1, -1, -1)))

    def split(x):  # the last axis is the most significant remaining block bit
        if x.ndim == 2:
            return [x]
        lo, hi = lax.unstack(x, axis=x.ndim - 1)
        return split(lo) + split(hi)

    return split(x)


def inv_diags_stacked(Ts):
    """``inv_diags`` on the blocks stacked as one [n, BS, BS] value: row o of each T is read as
    column o of Tᵀ, which lands in the layout that scales the rows of A, so a step needs no
    layout conversion. ptxas (sm_90, DeltaNet, n = 4): 3 barriers per step against the
    per-block form's 17 (each [BS, BS] block's reductions crossed warps, plus a conversion);
    the layout Triton picks still splits a block's rows over two warps, hence the 3.
    Profile-16 (H200): intra 0.269 -> 0.220 ms at the anchor."""
    Tt = stack_blocks([jnp.transpose(T) for T in Ts])  # [n, j, r] = T[r, j]
    shape = Tt.shape
    r, c = iota(shape, 1), iota(shape, 2)
    A0 = (r == c).astype(F32)

    def step(o, A):
        t = jnp.sum(jnp.where(c == o, Tt, 0.0), axis=2)  # [n, j]: row o of each T
        upd = jnp.sum(t[:, :, None] * A, axis=1)  # [n, c]: Σ_j T_oj A_jc
        return jnp.where(r == o, A - upd[:, None, :], A)

    return unstack_blocks(lax.fori_loop(1, BS, step, A0))


def inv_blocks(T, n, prec, on_row=None, joint_diag=False, stacked=False):
    """Blocked ``(I + T)⁻¹``: T(i, j) -> [BS, BS] for i ≥ j (diagonal blocks strict).

    A_ii = inv(L_ii); A_ij = −A_ii Σ_{j ≤ k < i} T_ik A_kj (block forward substitution).
    Row block i of T is built only when row i of A is (``T`` is called, not indexed), and
    ``on_row(i, A)`` may consume row i at once, so only A and one row of T are live.
    joint_diag: invert the n diagonal blocks first, in one interleaved loop (``inv_diags``),
    instead of each when its row comes (n chains of BS − 1 dependent steps back to back).
    stacked: the joint loop on the blocks
    stacked into one value (``inv_diags_stacked``).
    """
    A = {}
    if joint_diag:
        inv = inv_diags_stacked if stacked else inv_diags
        for i, Aii in enumerate(inv([T(i, i) for i in range(n)])):
            A[i, i] = Aii
    for i in range(n):
        Ti = {k: T(i, k) for k in range(i + (0 if joint_diag else 1))}
        if not joint_diag:
            A[i, i] = inv_diag(Ti[i])
        for j in range(i - 1, -1, -1):
            acc = None
            for k in range(j, i):
                t = dot(Ti[k], A[k, j], prec)
                acc = t if acc is None else acc + t
            A[i, j] = -dot(A[i, i], acc, prec)
        if on_row is not None:
            on_row(i, A)
    return A


# ----------------------------------------------------------------------------------------------
# Whole-chunk helpers shared by the stages (no or scalar gates: the decay is one [C, C] matrix;
# ``s``: a launch.Shape — its gate mode, precision and query scale)
# ----------------------------------------------------------------------------------------------
def col(x):
    """[1] or [1, K] gate row -> something that scales the rows of a [K, V] state."""
    return x if x.ndim == 1 else x.reshape(x.shape[1], 1)


def chunk_decay(mode, G_ref, base, C):
    """(G rows of the chunk, G of its last row) or (None, None)."""
    if mode == "none":
        return None, None
    return load_rows(G_ref, base, C), load_rows(G_ref, base + C - 1, 1)


def kt(mode, Gc, gl, kc):
    if mode == "none":
        return kc
    d = exp(gl - Gc)
    return (d[:, None] if mode == "scalar" else d) * kc


def qg(mode, Gc, qc):
    if mode == "none":
        return qc
    d = exp(Gc)
    return (d[:, None] if mode == "scalar" else d) * qc


def scalar_decay(Gc, C, strict=False):
    """D_rs = e^{G_r − G_s} for s < r (``strict``) or s ≤ r, 0 above: [C, C] fp32 from a chunk's
    scalar-gate rows Gc [C] (masked before exp, so no factor exceeds 1; the diagonal's is 1)."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    return exp(jnp.where(c < r if strict else c <= r, Gc[:, None] - Gc[None, :], -jnp.inf))


def qk_full(mode, q_ref, k_ref, G_ref, C, prec, base=0):
    """No or scalar gates: (G rows or None, P = tril(Qγ K̄ᵀ) = (Q Kᵀ) ⊙ e^{G_r − G_s}) on the
    whole chunk at row ``base`` (the decay is masked before exp, so no factor exceeds 1)."""
    r, c = iota((C, C), 0), iota((C, C), 1)
    P = dot_stored(load_rows(q_ref, base, C, None), load_rows(k_ref, base, C, None), prec,
                   tb=True)
    if mode == "none":
        return None, jnp.where(c <= r, P, 0.0)
    Gc = load_rows(G_ref, base, C)
    return Gc, P * scalar_decay(Gc, C)


def chunk_output(s, Gc, qc, S0, P, R, decayed=False):
    """One chunk's (value tile of) O = scale · (Qγ S0 + P R) — fp32, from the chunk's G rows,
    q rows (unscaled; ``decayed``: Qγ itself), start state, gated query-key matrix and
    residuals (``output`` and the fused ``fwd_pass``)."""
    Qg = qc if decayed else qg(s.mode, Gc, qc)
    return s.scaled(dot(Qg, S0, s.prec) + dot(P, R, s.prec))
