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


# The centred contraction of a diagonal sub-chunk block (rewy-math §3) takes the reference frame
# m = row 8 of the 16: every factor is e^{±(G_r − G_m)} with |r − m| ≤ 8, so a per-token gate
# g ≥ CENTRED_MIN_GATE keeps each factor ≤ e^40 ≈ 2e17 and every masked-out product below
# e^75·|x||y| — finite in fp32/TF32 — while the kept products (s ≤ r) equal e^{G_r − G_s} ≤ 1
# times fp32 rounding. Below that bound only the exact per-pair loops are safe.
CENTRED_MIN_GATE = -5.0
_MID = BS // 2


# How a vector-gate diagonal sub-chunk block is evaluated:
#   "loop"     exact per-pair factors, one column per step (16 dependent [16, K] steps);
#   "levels"   exact, by bit levels: a pair s < r of the block differs first at one bit b of its
#              row index (b = 8, 4, 2, 1); at that level r lies in the upper half of a 2b-group
#              and s in its lower half, and the row u where the upper half starts is a reference
#              frame with both exponents ≤ 0: (x_r e^{G_r − G_u}) · (y_s e^{G_u − G_s}). Four
#              masked [16, K] × [K, 16] matmuls (frame rows gathered from the ref) replace the
#              16 steps; rows outside a level's role are zeroed *before* exp, so nothing overflows;
#   "outer"    exact, every pair at once: the [16, 16, KS] tensor x_rc y_sc e^{G_rc − G_sc}
#              (s ≤ r; masked before exp) per slice of KS key channels, summed over them — no
#              dependent steps and one reduction per slice instead of one per column; for Gram
#              blocks (``grams`` given the row operands' refs; the apply maps run it as "loop").
#              Profile-9 (H200): qk_gram 1.53 ms against the loop's 1.45 with exp2 — off;
#   "centred"  one matmul in the frame of row 8, only under a declared bound (CENTRED_MIN_GATE).
DIAG_METHODS = ("loop", "levels", "outer", "centred")
OUTER_SLICE = 16  # key channels per slice of the "outer" diagonal: [16, 16, 16] fp32 tiles


class Gates:
    """Decay of one chunk whose cumulative gate G lives in ``G_ref`` from row ``base``.

    mode: "none" (DeltaNet), "scalar" (G_ref [R]) or "vector" (G_ref [R, K]).
    diag: how vector-gate diagonal blocks are evaluated (DIAG_METHODS); "centred" only for
    gates known to satisfy g ≥ CENTRED_MIN_GATE.
    """

    def __init__(self, mode, G_ref, base, C, diag="loop", kslice=0):
        if diag not in DIAG_METHODS:
            raise ValueError(f"diag must be one of {DIAG_METHODS}; got {diag!r}")
        self.mode, self.G_ref, self.base, self.C = mode, G_ref, base, C
        # Gram blocks given their row operands' refs contracted over slices of this many key
        # channels (0: the whole key width at once, from the loaded fp32 rows): vector gates
        # in ``_frame_grams`` and the diagonal loop, no or scalar gates in ``_sliced_products``
        self.kslice = kslice
        self.diag = diag if mode == "vector" else "loop"
        self.centred = self.diag == "centred"

    def _levels(self, i):
        """Per bit level b of diagonal block i, yielded one at a time (so that only one level's
        tiles are live): e_up = e^{G_r − G_u} on rows in the upper half of their 2b-group (else
        0), e_lo = e^{G_u − G_s} on rows in the lower half (else 0), and the pair mask [BS, BS]
        (r upper, s lower, same 2b-group); u = the row where r's (s's next) b-block starts."""
        r = iota((BS, 1), 0)
        rr, ss = iota((BS, BS), 0), iota((BS, BS), 1)
        start = self.base + i * BS
        for b in (8, 4, 2, 1):
            Gi = self.blk(i)
            up = (r // b) % 2 == 1
            lo = jnp.logical_not(up)
            G_up = self.G_ref[start + (r[:, 0] // b) * b, :].astype(F32)  # frame of an up row
            G_lo = self.G_ref[start + jnp.where(lo[:, 0], (r[:, 0] // b + 1) * b, r[:, 0]),
                              :].astype(F32)  # frame of a lo row (its own row otherwise)
            e_up = exp(jnp.where(up, Gi - G_up, -jnp.inf))
            e_lo = exp(jnp.where(lo, G_lo - Gi, -jnp.inf))
            pair = (((rr // b) % 2 == 1) & ((ss // b) % 2 == 0)
                    & (rr // (2 * b) == ss // (2 * b)))
            yield e_up, e_lo, pair

    @staticmethod
    def _diag_of(P):  # [BS, 1]: P's diagonal
        eye = iota((BS, BS), 0) == iota((BS, BS), 1)
        return jnp.sum(jnp.where(eye, P, 0.0), axis=1, keepdims=True)

    def blk(self, i):
        # Re-loaded at every use (an L1/L2 hit) rather than kept live: register pressure, not
        # memory traffic, is what limits these kernels.
        return load_rows(self.G_ref, self.base + i * BS)

    def row(self, r):  # [1] (scalar) or [1, K] (vector): G at chunk row r (r may be traced)
        return load_rows(self.G_ref, self.base + r, 1)

    def glast(self):
        return self.row(self.C - 1)

    # -- elementwise maps (all exponents ≤ 0) -------------------------------------------------
    def head(self, i, x):  # γ ⊙ x
        if self.mode == "none":
            return x
        G = self.blk(i)
        return exp(G)[:, None] * x if self.mode == "scalar" else exp(G) * x

    def tail(self, i, x):  # e^{G_C − G_r} ⊙ x_r
        if self.mode == "none":
            return x
        d = self.glast() - self.blk(i)
        return exp(d)[:, None] * x if self.mode == "scalar" else exp(d) * x

    def last(self):  # γ_C: [1] or [1, K] (1.0 without gates)
        return None if self.mode == "none" else exp(self.glast())

    def _sdecay(self, i, j, mask):  # scalar gates: [BS, BS] e^{G_r − G_s}
        d = self.blk(i)[:, None] - self.blk(j)[None, :]
        if mask is not None:
            d = jnp.where(mask, d, -jnp.inf)  # mask *before* exp (upper part is positive)
        return exp(d)

    # -- gram block M_ij[r, s] = Σ_c x_rc y_sc e^{G_rc − G_sc}, s ≤ r (s < r if strict) -------
    def gram(self, i, j, x_i, y_j, y_ref, prec, strict, x_ref=None):
        return self.grams(i, j, [x_i], y_j, y_ref, prec, [strict],
                          x_refs=None if x_ref is None else [x_ref])[0]

    def grams(self, i, j, xs, y_j, y_ref, prec, stricts, x_refs=None):
        """``gram`` for several row operands against one column operand (e.g. Qγ K̄ᵀ and
        Ēγ K̄ᵀ): the decay factors — the exponentials, most of the cost — are formed once.
        x_refs: the row operands' [C, K] refs (the "outer" diagonal reads key slices of them)."""
        r, s = iota((BS, BS), 0), iota((BS, BS), 1)
        masks = [(s < r if st else s <= r) if i == j else None for st in stricts]
        if self.mode != "vector" and x_refs is not None and self.kslice > 0:
            # the plain products x_i y_jᵀ from the refs as stored, over key slices
            # (``_sliced_products``), then the same masks and scalar decay as below
            xs = self._sliced_products(i, j, x_refs, y_ref, prec)
            y_j = None
        if self.mode == "none":
            if y_j is None:
                return [x if m is None else jnp.where(m, x, 0.0) for x, m in zip(xs, masks)]
            return [dot(x, y_j, prec, tb=True) if m is None else
                    jnp.where(m, dot(x, y_j, prec, tb=True), 0.0) for x, m in zip(xs, masks)]
        if self.mode == "scalar":
            D = self._sdecay(i, j, None if i > j else (s <= r))
            return [(x if y_j is None else dot(x, y_j, prec, tb=True))
                    * (D if m is None else jnp.where(m, D, 0.0)) for x, m in zip(xs, masks)]
        K = self.G_ref.shape[-1]
        if (i > j or self.centred) and x_refs is not None and 0 < self.kslice < K:
            return [m_ if m is None else jnp.where(m, m_, 0.0) for m_, m in
                    zip(self._frame_grams(i, j, x_refs, y_ref, prec), masks)]
        Gi = self.blk(i)
        if i > j or self.centred:  # one frame row: the block's first (i > j) or middle row
            # (centred diagonal blocks: factors up to e^40, masked after the matmul)
            Gm = self.row(i * BS + (0 if i > j else _MID))
            f_x = exp(Gi - Gm)
            y_f = y_j * exp(Gm - (self.blk(j) if i > j else Gi))
            return [dot(x * f_x, y_f, prec, tb=True) if m is None else
                    jnp.where(m, dot(x * f_x, y_f, prec, tb=True), 0.0)
                    for x, m in zip(xs, masks)]
        eye = r == s
        if self.diag == "outer":
            if x_refs is None:
                raise ValueError('the "outer" diagonal method needs the row operands\' refs')
            ms = self._outer_diag(i, x_refs, y_ref)
            return [jnp.where(eye, 0.0, m) if st else m for m, st in zip(ms, stricts)]
        if self.diag == "levels":  # exact: one masked matmul per bit level, + the diagonal
            ms = [None] * len(xs)
            for e_up, e_lo, pair in self._levels(i):
                y_lo = y_j * e_lo
                for n, x in enumerate(xs):
                    t = jnp.where(pair, dot(x * e_up, y_lo, prec, tb=True), 0.0)
                    ms[n] = t if ms[n] is None else ms[n] + t
            for n, (x, st) in enumerate(zip(xs, stricts)):
                if not st:  # r = s: factor 1
                    ms[n] = ms[n] + jnp.where(eye, jnp.sum(x * y_j, axis=1, keepdims=True), 0.0)
            return ms
        # diagonal block: per-pair exact factors, one column s = o per step (factor 1 at r = o;
        # strict outputs drop their diagonal after the loop)
        rr = iota((BS, 1), 0)
        cc = iota((1, BS), 1)
        base = self.base + i * BS
        if x_refs is not None and 0 < self.kslice < K:  # the same steps per key slice
            ks = self.kslice
            rows = pl.ds(base, BS)

            def slice_body(c, ms):
                cols = pl.ds(c * ks, ks)
                xs_c = [x_ref[rows, cols].astype(F32) for x_ref in x_refs]
                Gi_c = self.G_ref[rows, cols].astype(F32)

                def body(o, ms):
                    y_o = y_ref[pl.ds(base + o, 1), cols].astype(F32)
                    g_o = self.G_ref[pl.ds(base + o, 1), cols].astype(F32)
                    yf = y_o * exp(jnp.where(rr >= o, Gi_c - g_o, -jnp.inf))
                    return tuple(jnp.where(cc == o, m + jnp.sum(x * yf, axis=1, keepdims=True), m)
                                 for x, m in zip(xs_c, ms))

                return lax.fori_loop(0, BS, body, ms)

            ms = lax.fori_loop(0, K // ks, slice_body,
                               tuple(jnp.zeros((BS, BS), F32) for _ in xs))
            return [jnp.where(eye, 0.0, m) if st else m for m, st in zip(ms, stricts)]

        def body(o, ms):
            y_o = y_ref[pl.ds(base + o, 1), :].astype(F32)  # [1, K]
            g_o = load_rows(self.G_ref, base + o, 1)  # [1, K]
            yf = y_o * exp(jnp.where(rr >= o, Gi - g_o, -jnp.inf))
            return tuple(jnp.where(cc == o, jnp.sum(x * yf, axis=1, keepdims=True), m)
                         for x, m in zip(xs, ms))

        ms = lax.fori_loop(0, BS, body, tuple(jnp.zeros((BS, BS), F32) for _ in xs))
        return [jnp.where(eye, 0.0, m) if st else m for m, st in zip(ms, stricts)]

    def _sliced_products(self, i, j, x_refs, y_ref, prec):
        """[x_i y_jᵀ for x in x_refs] ([BS, BS], no decay), the rows read as stored (16-bit
        inputs multiply natively) and contracted over key slices of ``kslice`` channels (all K
        when kslice ≥ K) — the row operand's registers, as in ``_frame_grams``."""
        K = y_ref.shape[-1]
        ks = min(self.kslice, K)
        rows_i = pl.ds(self.base + i * BS, BS)
        rows_j = pl.ds(self.base + j * BS, BS)

        def body(c, accs):
            cols = pl.ds(c * ks, ks)
            y = y_ref[rows_j, cols]
            return tuple(a + dot_stored(x_ref[rows_i, cols], y, prec, tb=True)
                         for a, x_ref in zip(accs, x_refs))

        return list(lax.fori_loop(0, K // ks, body, tuple(jnp.zeros((BS, BS), F32) for _ in x_refs)))

    def _frame_grams(self, i, j, x_refs, y_ref, prec):
        """[M_ij for x in x_refs] in one frame row m (i > j: row 16i; centred: 16i + 8),
        summed over slices of ``kslice`` key channels read from the refs.

        Why slices: a [16, K] × [K, 16] product's row operand sits whole in every warp's
        registers (16 rows fill one mma tile, so the warps split only the 16 columns); at
        K = 128 that is 64 registers per operand and thread, and two Grams plus their decay
        factors hold the kernel at the 255-register cap (ptxas). A slice of 32 channels holds
        a quarter of that live at a time."""
        K = self.G_ref.shape[-1]
        ks = self.kslice
        rows_i = pl.ds(self.base + i * BS, BS)
        rows_j = pl.ds(self.base + j * BS, BS)
        m = self.base + i * BS + (0 if i > j else _MID)

        def body(c, accs):
            cols = pl.ds(c * ks, ks)
            Gi = self.G_ref[rows_i, cols].astype(F32)
            Gm = self.G_ref[pl.ds(m, 1), cols].astype(F32)
            Gj = self.G_ref[rows_j, cols].astype(F32) if i > j else Gi
            f_x = exp(Gi - Gm)
            y_f = y_ref[rows_j, cols].astype(F32) * exp(Gm - Gj)
            return tuple(a + dot(x_ref[rows_i, cols].astype(F32) * f_x, y_f, prec, tb=True)
                         for a, x_ref in zip(accs, x_refs))

        return list(lax.fori_loop(0, K // ks, body, tuple(jnp.zeros((BS, BS), F32) for _ in x_refs)))

    def row_frame_grams(self, i, x_refs, y_ref, prec, centred_diag):
        """Row block i of the Grams, every block at once: ``[[M_ij for x in x_refs] for j in
        range(i)]``, plus j = i (unmasked; centred in its middle row) when ``centred_diag`` —
        ``_frame_grams`` for each of those blocks in one loop over the key slices, so that the
        row operands are read and scaled by the off-diagonal frame factor e^{G_r − G_m} (m = row
        16i) once per slice for all j < i instead of once per block. The same products summed
        in the same order: bit for bit ``_frame_grams``'s blocks."""
        ks = self.kslice
        nx = len(x_refs)
        rows_i = pl.ds(self.base + i * BS, BS)
        m_off, m_mid = self.base + i * BS, self.base + i * BS + _MID

        def body(c, accs):
            cols = pl.ds(c * ks, ks)
            accs = list(accs)
            Gi = self.G_ref[rows_i, cols].astype(F32)
            xs = [x_ref[rows_i, cols].astype(F32) for x_ref in x_refs]
            if i > 0:
                Gm = self.G_ref[pl.ds(m_off, 1), cols].astype(F32)
                f_x = exp(Gi - Gm)
                xf = [x * f_x for x in xs]
                for j in range(i):
                    rows_j = pl.ds(self.base + j * BS, BS)
                    y_f = (y_ref[rows_j, cols].astype(F32)
                           * exp(Gm - self.G_ref[rows_j, cols].astype(F32)))
                    for n, x in enumerate(xf):
                        accs[j * nx + n] = accs[j * nx + n] + dot(x, y_f, prec, tb=True)
            if centred_diag:
                Gm = self.G_ref[pl.ds(m_mid, 1), cols].astype(F32)
                f_x = exp(Gi - Gm)
                y_f = y_ref[rows_i, cols].astype(F32) * exp(Gm - Gi)
                for n, x in enumerate(xs):
                    accs[i * nx + n] = accs[i * nx + n] + dot(x * f_x, y_f, prec, tb=True)
            return tuple(accs)

        nb = i + bool(centred_diag)
        K = self.G_ref.shape[-1]
        flat = lax.fori_loop(0, K // ks, body, tuple(jnp.zeros((BS, BS), F32) for _ in range(nb * nx)))
        return [list(flat[j * nx:(j + 1) * nx]) for j in range(nb)]

    def _outer_diag(self, i, x_refs, y_ref):
        """[M_ii for x in x_refs], M_ii[r, s] = Σ_c x_rc y_sc e^{G_rc − G_sc} (s ≤ r, else 0):
        per slice of OUTER_SLICE key channels, the [16, 16, KS] pair tensor at once (Triton
        cannot slice a loaded block, so each slice is loaded from the refs)."""
        K = self.G_ref.shape[-1]
        KS = min(OUTER_SLICE, K)
        rows = pl.ds(self.base + i * BS, BS)
        keep = iota((BS, BS, 1), 1) <= iota((BS, BS, 1), 0)  # s ≤ r

        def body(c, ms):
            cols = pl.ds(c * KS, KS)
            G = self.G_ref[rows, cols].astype(F32)  # [16, KS]
            f = exp(jnp.where(keep, G[:, None, :] - G[None, :, :], -jnp.inf))  # ≤ 1
            yf = y_ref[rows, cols].astype(F32)[None, :, :] * f
            return tuple(m + jnp.sum(x_ref[rows, cols].astype(F32)[:, None, :] * yf, axis=2)
                         for m, x_ref in zip(ms, x_refs))

        return lax.fori_loop(0, K // KS, body, tuple(jnp.zeros((BS, BS), F32) for _ in x_refs))

    # -- Y_i = Σ_{j ≤ i} Σ_s P_ij[r, s] y_s ⊙ e^{G_r − G_s}   (P lower block-triangular) -------
    def apply(self, P, i, y, y_ref, prec):
        return self.applies([P], i, y, y_ref, prec)[0]

    def applies(self, Ps, i, y, y_ref, prec):
        """``apply`` of several [C, C] matrices to the same rows y: [Y_i for P in Ps], the decay
        factors (exponentials and frame-scaled operands) formed once for all of them."""
        if self.mode != "vector":
            outs = []
            for P in Ps:
                acc = None
                for j in range(i + 1):
                    Pij = P[i, j]
                    if self.mode == "scalar":
                        Pij = Pij * self._sdecay(i, j, (iota((BS, BS), 1) <= iota((BS, BS), 0))
                                                 if i == j else None)
                    t = dot(Pij, y[j], prec)
                    acc = t if acc is None else acc + t
                outs.append(acc)
            return outs
        Gi = self.blk(i)
        outs = [None] * len(Ps)
        if i > 0:
            Gm = self.row(i * BS)
            for j in range(i):
                y_f = y[j] * exp(Gm - self.blk(j))
                for n, P in enumerate(Ps):
                    t = dot(P[i, j], y_f, prec)
                    outs[n] = t if outs[n] is None else outs[n] + t
            f_i = exp(Gi - Gm)
            outs = [f_i * o for o in outs]
        Piis = [P[i, i] for P in Ps]
        if self.centred:  # P is lower-triangular: e^{G_r − G_m} ⊙ P_ii (y ⊙ e^{G_m − G_s})
            Gm = self.row(i * BS + _MID)
            y_f, f_i = y[i] * exp(Gm - Gi), exp(Gi - Gm)
            dias = [f_i * dot(Pii, y_f, prec) for Pii in Piis]
        elif self.diag == "levels":
            y_i = y[i]
            dias = [self._diag_of(Pii) * y_i for Pii in Piis]
            for e_up, e_lo, pair in self._levels(i):
                y_lo = y_i * e_lo
                dias = [d + e_up * dot(jnp.where(pair, Pii, 0.0), y_lo, prec)
                        for d, Pii in zip(dias, Piis)]
        else:
            rr = iota((BS, 1), 0)
            cc = iota((1, BS), 1)
            base = self.base + i * BS

            def body(o, Ys):
                y_o = y_ref[pl.ds(base + o, 1), :].astype(F32)
                g_o = load_rows(self.G_ref, base + o, 1)
                yf = y_o * exp(jnp.where(rr >= o, Gi - g_o, -jnp.inf))  # [BS, K]
                return tuple(Y + jnp.sum(jnp.where(cc == o, Pii, 0.0), axis=1, keepdims=True) * yf
                             for Y, Pii in zip(Ys, Piis))

            dias = lax.fori_loop(0, BS, body, tuple(jnp.zeros(y[i].shape, F32) for _ in Ps))
        return [d if o is None else o + d for o, d in zip(outs, dias)]

    # -- Y_j = Σ_{i ≥ j} Σ_r P_ij[r, s] x_r ⊙ e^{G_r − G_s} ------------------------------------
    def apply_t(self, P, j, x, x_ref, prec, n):
        return self.apply_t_sum([(P, x, x_ref)], j, prec, n)

    def apply_t_sum(self, terms, j, prec, n):
        """Σ over terms (P, x, x_ref) of ``apply_t(P, j, x, ...)``: the terms share every decay
        factor (they differ in P and x only), so the sum is formed inside each factor."""
        if self.mode != "vector":
            acc = None
            for P, x, _ in terms:
                for i in range(j, n):
                    Pij = P[i, j]
                    if self.mode == "scalar":
                        Pij = Pij * self._sdecay(i, j, (iota((BS, BS), 1) <= iota((BS, BS), 0))
                                                 if i == j else None)
                    t = dot(Pij, x[i], prec, ta=True)
                    acc = t if acc is None else acc + t
            return acc
        Gj = self.blk(j)
        out = None
        for i in range(j + 1, n):
            Gm = self.row(i * BS)
            f_x = exp(self.blk(i) - Gm)
            t = _sum(dot(P[i, j], x[i] * f_x, prec, ta=True) for P, x, _ in terms)
            t = exp(Gm - Gj) * t
            out = t if out is None else out + t
        Pjjs = [P[j, j] for P, _, _ in terms]
        xjs = [x[j] for _, x, _ in terms]
        if self.centred:  # e^{G_m − G_s} ⊙ P_jjᵀ (x ⊙ e^{G_r − G_m})
            Gm = self.row(j * BS + _MID)
            f_x = exp(Gj - Gm)
            dia = exp(Gm - Gj) * _sum(dot(Pjj, x_j * f_x, prec, ta=True)
                                          for Pjj, x_j in zip(Pjjs, xjs))
        elif self.diag == "levels":
            dia = _sum(self._diag_of(Pjj) * x_j for Pjj, x_j in zip(Pjjs, xjs))
            for e_up, e_lo, pair in self._levels(j):
                dia = dia + e_lo * _sum(dot(jnp.where(pair, Pjj, 0.0), x_j * e_up, prec, ta=True)
                                        for Pjj, x_j in zip(Pjjs, xjs))
        else:
            ss = iota((BS, 1), 0)  # output row s
            rr = iota((BS, BS), 0)
            base = self.base + j * BS
            x_refs = [x_ref for _, _, x_ref in terms]

            def body(o, Y):
                g_o = load_rows(self.G_ref, base + o, 1)
                f = exp(jnp.where(ss <= o, g_o - Gj, -jnp.inf))
                px = _sum(jnp.sum(jnp.where(rr == o, Pjj, 0.0), axis=0)[:, None]  # P[o, s]
                          * x_ref[pl.ds(base + o, 1), :].astype(F32)
                          for Pjj, x_ref in zip(Pjjs, x_refs))
                return Y + px * f

            dia = lax.fori_loop(0, BS, body, jnp.zeros(xjs[0].shape, F32))
        return dia if out is None else out + dia


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
        return Gates._diag_of(self.ref[pl.ds(i * BS, BS), pl.ds(i * BS, BS)].astype(F32))


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
