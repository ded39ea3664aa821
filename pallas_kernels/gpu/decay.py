"""The decay of one chunk in the Pallas GPU kernels: ``Gates``, whose Grams and leaf maps are
``chunk_algebra.Decay``'s (``ScalarDecay`` / ``VectorDecay``: gram, apply, apply_t, head, tail)
evaluated on 16-row sub-chunk blocks from refs, as the Triton lowering allows.

    gram(i, j, x_i, y_j)   [16, 16] block (i, j) of  M_rs = Σ_c x_rc y_sc e^{G_rc − G_sc}  (s ≤ r)
    applies(Ps, i, y)      [16, K] row block i of  Y_r = Σ_{s ≤ r} P_rs y_s ⊙ e^{G_r − G_s}
    apply_t_sum(terms, j)  [16, K] row block j of  Σ_terms Σ_{r ≥ s} P_rs x_r ⊙ e^{G_r − G_s}
    head(i, x), tail(i, x) γ ⊙ x, e^{G_C − G} ⊙ x on row block i

Off-diagonal blocks take one matmul in a reference frame (both factors ≤ 1); diagonal blocks
one of ``DIAG_METHODS`` (tests/test_gpu_blocks.py checks each against chunk_algebra).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.blocks import BS, F32, _sum, diag_of, dot, dot_stored, exp, iota, load_rows


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
            dias = [diag_of(Pii) * y_i for Pii in Piis]
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
            dia = _sum(diag_of(Pjj) * x_j for Pjj, x_j in zip(Pjjs, xjs))
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
