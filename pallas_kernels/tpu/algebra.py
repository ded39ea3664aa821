"""Mosaic-lowerable forms of the per-chunk algebra (``pallas_kernels.chunk_algebra``).

The TPU kernels evaluate :mod:`pallas_kernels.chunk_algebra` on the blocks they load. Its
products, masks and ``ChunkLocal``/``ChunkGrads`` structure lower unchanged; four pieces do not,
and get a lowerable twin here with the same contract as the original (checked against it in
float32 to ~1e-6 and, through the kernels, against the float64 recurrence in the tests):

* ``VectorDecay`` builds 4-D per-pair tensors with gathers (``P4[idx, :, idx, :]``) and 4-D
  einsums, which Mosaic cannot lower ("Unable to parse attribute"). :class:`VectorDecayTPU` keeps
  the same reference frames (rewy-math §3) with 2-D ``[C, K]`` / ``[C, C]`` arrays only:
  off-diagonal sub-chunk blocks are one ``[σ, C] × [C, K]`` matmul per sub-chunk (rows sliced at
  tile-aligned offsets, stacked back by sublane concatenation), diagonal blocks exact per-pair
  factors swept over the σ pivot rows of every sub-chunk at once (σ = ``DIAG_SUB`` = 8). It never
  forms ``exp(−G)``: every exponent is masked to ``≤ 0`` *before* ``exp``.
* ``ScalarDecay`` takes ``G`` as a rank-1 ``[C]`` array; a TPU block wants 2-D tails, so
  :class:`ScalarDecayTPU` takes ``G`` as a ``[C, 1]`` column and builds the row by a mask-reduce.
* ``_leaf_grads`` sums the gate gradient's rows with scans on rank-1 arrays (no Mosaic rule);
  :func:`leaf_grads` uses triangular ones matmuls and ``[1, K]`` sums instead.
* ``unit_lower_inverse`` slices and concatenates ``[C, C]`` at 16/32-lane offsets (relayouts
  Mosaic may reject); :func:`unit_lower_inverse` here runs forward substitution on all diagonal
  16×16 blocks at once (one ``[C/16, C] × [C, C]`` product per step), then merges the blocks by
  the nilpotent product ``(I + N)⁻¹ = (I − N)(I + N²)…`` at block level (N = D·T_off).

No cumsum (a triangular ones matmul), no triangular solve; fp32 state and accumulation. Matmul
precision/operands follow :func:`operand_policy` (below).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp
from jax import lax

from pallas_kernels import chunk_algebra as ca
from pallas_kernels.chunk_algebra import mm, mm_nt, mm_tn

SUB = ca.SUBCHUNK  # diagonal blocks of the triangular inverse
# Rows per sub-chunk of the vector-gate reference frames. The exact per-pair diagonal sweep
# costs DIAG_SUB elementwise [C, K] passes per product (VPU/EUP), the off-diagonal frames one
# small matmul per sub-chunk (MXU): 8 rows trade +3% MXU FLOPs for −35% VPU and −30% EUP work
# per chunk at K = 128 (counted by tools/tpu_roofline.py); 8 is also one f32 sublane tile.
DIAG_SUB = 8
f32 = jnp.float32


# ----------------------------------------------------------------------------------------------
# Matmul operands. ``mm``/``mm_nt``/``mm_tn`` (chunk_algebra) are exact fp32 (HIGHEST); the
# ``f``-prefixed products below take bf16 operands (one MXU pass, fp32 accumulation) inside
# ``fast_operands(jnp.bfloat16)`` — used for bf16/fp16 callers. Measured against the §8
# protocol, bf16 operands are used in the *backward's* chunk-local products only (gradient
# tolerance 1e-2/2e-2; measured ≈ 4e-3). Always fp32 operands: the whole forward (o's tolerance is
# 5e-3 and bf16 output rounding alone costs ≈ 1.7e-3; bf16 Qγ S0 took it to 3.5e-3), the gate
# cumsum, the triangular system T, A, W, U, R = U − W S0 (U and W S0 nearly cancel), and the
# sequential state products (S_C; dR, Λ and dS0 in the backward), whose rounding would compound
# across chunks — without decay (DeltaNet) bf16 dR/Λ took dh0 to 1.1e-2.
# ----------------------------------------------------------------------------------------------
#
# The "fp32" products (``xmm``/``xmm_nt``/``xmm_tn``) run at ``_NEAR`` precision: HIGHEST (6 bf16
# MXU passes) by default; bf16/fp16 callers (``operand_policy("bfloat16")``) take HIGH (bf16x3,
# 3 passes, ≈2⁻¹⁶ relative error: three orders below their bf16 inputs' own rounding). The gate
# cumsum and the triangular inverse stay HIGHEST for everyone: an error in G is amplified by
# exp over |G| up to 40·C, and the inverse is the precision-sensitive step (rewy-math §3).
# The CPU interpreter computes every fp32 product exactly, so it cannot observe HIGH vs
# HIGHEST; the bf16x3 bound above is analytic.
# ----------------------------------------------------------------------------------------------
_FAST = contextvars.ContextVar("rewy_tpu_fast_operands", default=None)
_NEAR = contextvars.ContextVar("rewy_tpu_fp32_precision", default=lax.Precision.HIGHEST)


@contextlib.contextmanager
def fast_operands(dtype):
    """Trace the chunk products with ``dtype`` operands (None: fp32 at ``_NEAR`` precision)."""
    token = _FAST.set(None if dtype is None else jnp.dtype(dtype))
    try:
        yield
    finally:
        _FAST.reset(token)


@contextlib.contextmanager
def operand_policy(operands):
    """The kernels' policy: None -> every product fp32 HIGHEST; "bfloat16" -> bf16 operands for
    the backward's leaf products (``fast_operands``) and HIGH for the other fp32 products."""
    token = _NEAR.set(lax.Precision.HIGHEST if operands is None else lax.Precision.HIGH)
    try:
        with fast_operands(operands):
            yield
    finally:
        _NEAR.reset(token)


def _near(dims):
    def product(a, b):
        return lax.dot_general(a.astype(f32), b.astype(f32), (dims, ((), ())),
                               precision=_NEAR.get(), preferred_element_type=f32)
    return product


xmm = _near(((1,), (0,)))
xmm_nt = _near(((1,), (1,)))
xmm_tn = _near(((0,), (0,)))


def _fast(exact_fn, dims):
    def product(a, b):
        dt = _FAST.get()
        if dt is None:
            return exact_fn(a, b)
        return lax.dot_general(a.astype(dt), b.astype(dt), (dims, ((), ())),
                               preferred_element_type=f32)
    return product


fmm = _fast(xmm, ((1,), (0,)))
fmm_nt = _fast(xmm_nt, ((1,), (1,)))
fmm_tn = _fast(xmm_tn, ((0,), (0,)))


def as_operand(x):
    """x as the ``f``-products read it: rounded to the fast operand dtype (fp32 value), or x."""
    dt = _FAST.get()
    return x if dt is None else x.astype(dt).astype(f32)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def cumsum_rows(g):
    """Inclusive cumsum over rows (axis 0) as a lower-triangular ones matmul. g: [C, D]."""
    C = g.shape[0]
    return mm(ca._tril_mask(C, strict=False).astype(f32), g)


def rev_cumsum_rows(d):
    """Reverse inclusive cumsum over rows: ``out_r = Σ_{s ≥ r} d_s`` (= Lᵀ d). d: [C, D]."""
    C = d.shape[0]
    return mm_tn(ca._tril_mask(C, strict=False).astype(f32), d)


def col_to_row(x):
    """[n, 1] -> [1, n] without a transpose op (identity mask + sublane reduction)."""
    n = x.shape[0]
    return jnp.sum(jnp.where(_iota((n, n), 0) == _iota((n, n), 1), x, 0.0), axis=0, keepdims=True)


def row_to_col(x):
    """[1, n] -> [n, 1] (identity mask + lane reduction)."""
    n = x.shape[1]
    return jnp.sum(jnp.where(_iota((n, n), 0) == _iota((n, n), 1), x, 0.0), axis=1, keepdims=True)


# ----------------------------------------------------------------------------------------------
# Decays
# ----------------------------------------------------------------------------------------------
class ScalarDecayTPU(ca.ScalarDecay):
    """``ScalarDecay`` with ``G`` as a ``[C, 1]`` column (or None)."""

    def __init__(self, Gcol, n_rows: int):
        Gcol, Ncol = ca.split_gates(Gcol)  # a cum_gates pair of [C, 1] columns, or [C, 1]
        self.G, self.N = Gcol, Ncol
        self.C = n_rows
        tri = ca._tril_mask(n_rows, strict=False)
        if Gcol is None:
            self.D = tri.astype(f32)
        else:
            # Mask before exp: upper-triangular differences are positive and could overflow.
            self.D = ca.decay_factor(Gcol, col_to_row(Gcol), Ncol, col_to_row(Ncol), tri)

    def gram(self, x, y, strict):
        m = fmm_nt(x, y) * self.D
        return jnp.where(ca._tril_mask(self.C, strict), m, 0.0) if strict else m

    def apply(self, P, y):
        return fmm(P * self.D, y)

    def apply_t(self, P, x):
        return fmm_tn(P * self.D, x)

    def head(self, x):
        return x if self.G is None else ca.decay_factor(self.G, 0.0, self.N, 0.0) * x

    def tail(self, x):
        C = self.C
        if self.G is None:
            return x
        return ca.decay_factor(self.G[C - 1:C, :], self.G, self.N[C - 1:C, :], self.N) * x

    def last_row(self):
        """γ_C as a [1, 1] (broadcasts against [1, K] rows and [K, V] states)."""
        C = self.C
        if self.G is None:
            return jnp.ones((1, 1), f32)
        return ca.decay_factor(self.G[C - 1:C, :], 0.0, self.N[C - 1:C, :], 0.0)

    last_col = last_row

    def reduce(self, d):
        return None if self.G is None else jnp.sum(d, axis=1, keepdims=True)

    def pair_row(self, x):
        """A row q_r, k_r or e_r as the pair products (``gram``/``apply``/``apply_t``) read it:
        rounded to the fast operand dtype, if any. The gate gradient dots the products with
        these rows (``leaf_grads``): pair (r, s) then enters row r's and row s's sum as the
        same Σ X̃_rs (ã_r · b̃_s), with X̃ = round(P ⊙ D) shared by apply and apply_t, and the
        pairs that do not cross t cancel to fp32 rounding. Dotted with unrounded rows, each side
        keeps its own bf16 error and dg_t sums the uncancelled errors of every later row: GDN,
        bf16, strong decays, dg up to 1.6e-2 at C = 64 and 2.2e-2 at C = 128, against §8's 2e-2
        (tests/test_pallas_tpu.py::test_bf16_strong_scalar_decay_dg; docs/accuracy-notes.md)."""
        return as_operand(x)


class VectorDecayTPU(ca.Decay):
    """``VectorDecay`` in 2-D, lowerable by Mosaic. ``G``: [C, K] chunk-local cumulative gate.

    Sub-chunk i holds rows [σi, σi + σ) (σ = DIAG_SUB); its frame m_i is its first row. For a
    row s in an earlier sub-chunk than r: ``exp(G_r − G_s) = exp(G_r − G_{m_i})·exp(G_{m_i} − G_s)``,
    both ≤ 1 (one matmul per sub-chunk). For s, r in one sub-chunk the factor is exact per pair:
    pivot j sweeps the σ rows of every sub-chunk at once (``piv_j(r) = σ·blk(r) + j``).
    """

    def __init__(self, G, sub: int = DIAG_SUB):
        G, self.N = ca.split_gates(G)  # a cum_gates pair (G, N) [C, K], or G
        C, K = G.shape
        self.sub = min(sub, C)
        self.n = C // self.sub
        self.G, self.C, self.K = G, C, K
        r = _iota((C, 1), 0)
        self.r = r
        self.blk = r // self.sub  # [C, 1] sub-chunk of each row
        self.loc = r - self.blk * self.sub  # [C, 1] row within its sub-chunk
        # Decay factors depend only on G: computed once per chunk and shared by every
        # gram/apply/apply_t of the chunk (halves the EUP work of the backward).
        self._memo = {}

    def _cached(self, key, fn):
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    # frames ------------------------------------------------------------------------------
    def _from_frame(self, i):
        """Rows s before sub-chunk i, decayed to frame m_i: exp(G_{m_i} − G_s) (0 elsewhere)."""
        m = slice(self.sub * i, self.sub * i + 1)
        return self._cached(("from_frame", i), lambda: ca.decay_factor(
            self.G[m, :], self.G, self.N[m, :], self.N, self.r < self.sub * i))

    def _down(self, j, strict=False):
        """exp(G_r − G_{piv_j(r)}) where piv_j(r) ≤ r (< r if strict), else 0: [C, K]."""
        def f():
            keep = self.loc > j if strict else self.loc >= j
            return ca.decay_factor(self.G, self._pivot(self.G, j), self.N,
                                   self._pivot(self.N, j), keep)
        return self._cached(("down", j, strict), f)

    def _up(self, j):
        """exp(G_{piv_j(s)} − G_s) where piv_j(s) ≥ s, else 0: [C, K]."""
        return self._cached(("up", j), lambda: ca.decay_factor(
            self._pivot(self.G, j), self.G, self._pivot(self.N, j), self.N, self.loc <= j))

    def _pivot(self, x, j):
        """Row piv_j(r) of x broadcast to every row r of its sub-chunk. x: [C, D]."""
        n, sub, D = self.n, self.sub, x.shape[1]
        return jnp.broadcast_to(x.reshape(n, sub, D)[:, j:j + 1, :], (n, sub, D)).reshape(self.C, D)

    def _pivot_mask(self, j):
        """[C, C] mask of column piv_j(r) in row r."""
        return self._cached(("mask", j), lambda: _iota((self.C, self.C), 1) == self.blk * self.sub + j)

    def _pivot_down(self, y, j):
        """pivot_j(y) ⊙ down_j, shared by every product of the chunk with the same y (k is the
        right operand of both grams and of both ``apply``s)."""
        key = ("pivot_down", id(y), j)
        hit = self._memo.get(key)
        if hit is None or hit[0] is not y:  # keep y alive with the entry: ids stay unique
            hit = (y, self._pivot(y, j) * self._down(j))
            self._memo[key] = hit
        return hit[1]

    # Decay interface ---------------------------------------------------------------------
    def _rows(self, i, x):
        """Rows of sub-chunk i of x (a static, tile-aligned sublane slice)."""
        return x[self.sub * i:self.sub * (i + 1)]

    def _row_in_frame(self, i):
        """exp(G_r − G_{m_i}) for the rows r of sub-chunk i: [sub, K], ≤ 1."""
        def f():
            Gi, Ni = self._rows(i, self.G), self._rows(i, self.N)
            return ca.decay_factor(Gi, Gi[0:1, :], Ni, Ni[0:1, :])
        return self._cached(("row_in_frame", i), f)

    def _stack(self, blocks, width):
        """Row blocks of sub-chunks 1..n-1 stacked under a zero block 0 -> [C, width]."""
        return jnp.concatenate([jnp.zeros((self.sub, width), f32)] + blocks, axis=0)

    # Decay interface ---------------------------------------------------------------------
    # Off-diagonal sub-chunk blocks: one [sub, C] x [C, D] product per sub-chunk i ≥ 1, the
    # earlier rows (s < 16 i) decayed into i's frame; diagonal blocks: the pivot sweep.
    def gram(self, x, y, strict):
        off = [fmm_nt(self._rows(i, x) * self._row_in_frame(i), y * self._from_frame(i))
               for i in range(1, self.n)]
        M = self._stack(off, self.C) if off else jnp.zeros((self.C, self.C), f32)
        for j in range(self.sub):
            # strict drops r = piv_j(r): mask the column, the factor is shared with non-strict.
            yd = self._pivot_down(y, j)
            if strict:  # the diagonal pair (r = piv_j(r)) is left out
                yd = jnp.where(self.loc > j, yd, 0.0)
            col = jnp.sum(x * yd, axis=1, keepdims=True)  # M[r, piv_j(r)]
            M = M + jnp.where(self._pivot_mask(j), col, 0.0)
        return M

    def apply(self, P, y):
        D = y.shape[1]
        off = [self._row_in_frame(i) * fmm(self._rows(i, P), y * self._from_frame(i))
               for i in range(1, self.n)]
        Y = self._stack(off, D) if off else jnp.zeros((self.C, D), f32)
        for j in range(self.sub):
            Pc = jnp.sum(jnp.where(self._pivot_mask(j), P, 0.0), axis=1, keepdims=True)
            Y = Y + Pc * self._pivot_down(y, j)
        return Y

    def apply_t(self, P, x):
        Y = jnp.zeros((self.C, x.shape[1]), f32)
        for i in range(1, self.n):
            Y = Y + self._from_frame(i) * fmm_tn(self._rows(i, P), self._rows(i, x) * self._row_in_frame(i))
        Pt = P.T
        for j in range(self.sub):
            # Row s gathers r = piv_j(s) ≥ s: P[piv_j(s), s] = Pᵀ[s, piv_j(s)].
            Pc = jnp.sum(jnp.where(self._pivot_mask(j), Pt, 0.0), axis=1, keepdims=True)
            Y = Y + Pc * self._pivot(x, j) * self._up(j)
        return Y

    def head(self, x):
        return ca.decay_factor(self.G, 0.0, self.N, 0.0) * x

    def tail(self, x):
        C = self.C
        return ca.decay_factor(self.G[C - 1:C, :], self.G, self.N[C - 1:C, :], self.N) * x

    def last_row(self):
        """γ_C as [1, K]."""
        C = self.C
        return ca.decay_factor(self.G[C - 1:C, :], 0.0, self.N[C - 1:C, :], 0.0)

    def last_col(self):
        """γ_C as [K, 1] (for Diag(γ_C) S with K on the rows of S)."""
        return row_to_col(self.last_row())

    def reduce(self, d):
        return d

    def pair_row(self, x):
        """The raw row: the pair products read frame-scaled rows (x ⊙ exp(G − G_m)), rounded
        after the scaling, so no row rounding matches both sides of a pair here. (Rounding
        the raw row anyway measured worse: per chunk, KDA bf16 dg 4.1e-3 -> 8.5e-3.)"""
        return x


def make_decay(G, n_rows: int):
    """Decay for a chunk's cumulative gate: None, [C, 1] (scalar) or [C, K] (vector), or a
    ``chunk_algebra.cum_gates`` pair of those shapes."""
    if G is None or ca.split_gates(G)[0].shape[1] == 1:
        return ScalarDecayTPU(G, n_rows)
    return VectorDecayTPU(G)


# ----------------------------------------------------------------------------------------------
# Inverse
# ----------------------------------------------------------------------------------------------
def unit_lower_inverse(T):
    """``(I + T)⁻¹`` for strictly-lower ``T`` [C, C] (C a multiple of SUB, or ≤ SUB).

    1. Diagonal 16×16 blocks, all at once: forward substitution, step j finalises local row j of
       every block (``A_r = e_r − T_r A`` reads only final rows), fp32.
    2. Merge: with D = blockdiag inverse and N = D·T_off (strictly block-lower, Nⁿ = 0),
       ``(I + T)⁻¹ = (I + N)⁻¹ D = (I − N)(I + N²)(I + N⁴)… D`` — the recursive block merge of
       ``chunk_algebra.unit_lower_inverse`` written as full-size products.
    """
    C = T.shape[0]
    sub = min(SUB, C)
    r, c = _iota((C, C), 0), _iota((C, C), 1)
    same = (r // sub) == (c // sub)
    eye = (r == c).astype(f32)
    Tbd = jnp.where(same, T, 0.0)
    D = eye
    n = C // sub
    rloc = r - (r // sub) * sub
    for j in range(1, sub):
        # Local row j of every block at once: [n, C] rows e_r − T_r D, then back into D.
        pick = lambda x: x.reshape(n, sub, C)[:, j, :]  # noqa: E731
        new = pick(eye) - mm(pick(Tbd), D)
        D = jnp.where(rloc == j, jnp.broadcast_to(new[:, None, :], (n, sub, C)).reshape(C, C), D)
    if n == 1:
        return D
    N = mm(D, jnp.where(same, 0.0, T))
    acc = eye - N
    p, Np = 2, N
    while p < n:
        Np = mm(Np, Np)
        acc = mm(acc, eye + Np)
        p *= 2
    return mm(acc, D)


# ----------------------------------------------------------------------------------------------
# Forward and backward of one chunk
# ----------------------------------------------------------------------------------------------
def chunk_local(q, k, e, z, decay) -> ca.ChunkLocal:
    """``chunk_algebra.chunk_local`` with the lowerable inverse."""
    with fast_operands(None):  # T, A, W, U: the triangular system, always exact fp32
        T = decay.gram(e, k, strict=True)
        A = unit_lower_inverse(T)
        Eg = decay.head(e)
        W, U = xmm(A, Eg), xmm(A, z)
    with fast_operands(None):
        P = decay.gram(q, k, strict=False)
    return ca.ChunkLocal(A=A, W=W, U=U, P=P,
                         Qg=decay.head(q), Eg=Eg, Kt=decay.tail(k))


def chunk_output(loc: ca.ChunkLocal, S0):
    """``chunk_algebra.chunk_output`` (R = U − W S0, O = Qγ S0 + P R) with the operand policy."""
    R = loc.U - xmm(loc.W, S0)  # fp32: U and W S0 nearly cancel
    return xmm(loc.Qg, S0) + xmm(loc.P, R), R  # exact: o has the tightest tolerance (§8)


def next_state(loc: ca.ChunkLocal, decay, S0, R):
    """``S_C = Diag(γ_C) S0 + K_tailᵀ R`` (C·K·V instead of the K×K×V affine map)."""
    return decay.last_col() * S0 + xmm_tn(loc.Kt, R)


def leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, dEg_state, dz) -> ca.ChunkGrads:
    """``chunk_algebra._leaf_grads`` with its row sums as triangular ones matmuls and the
    start-state term as a ``[1, K]`` row (no scan, no rank-1 arrays). dg: [C, 1] / [C, K]."""
    C, V = R.shape
    RdS = fmm_nt(R, dS)
    dA_off, dA_diag = ca.diagonal_split(dA_qk)
    y = decay.tail(RdS)
    de = decay.head(dEg_state) + decay.apply(dT, k)
    dk_pairs = decay.apply_t(dT, e) + decay.apply_t(dA_off, q)
    dq_rest = decay.head(fmm_nt(dO, S0)) + decay.apply(dA_off, k)
    dg = None
    if decay.G is not None:  # the terms of chunk_algebra._leaf_grads, summed the same way
        # Each pair (r, s) enters row r's and row s's term with opposite signs; the reverse
        # cumsum cancels the pairs that do not cross t. decay.pair_row: the row as the pair
        # products read it (ScalarDecayTPU says why).
        qo, ko, eo = decay.pair_row(q), decay.pair_row(k), decay.pair_row(e)
        pairs = decay.reduce(de * eo - dk_pairs * ko + dq_rest * qo)
        # Σ_v dS⊙S0 as a [1, K] row: ones[1, V] · (dS ⊙ S0)ᵀ.
        start = mm_nt(jnp.ones((1, V), f32), dS * S0) * decay.last_row()
        before = ca._tril_mask(C, strict=True).astype(f32)  # row r: the rows s < r
        dg = (rev_cumsum_rows(pairs) + mm(before, decay.reduce(y * k))
              + decay.reduce(start))
    dk = dk_pairs + y + dA_diag * q
    dq = dq_rest + dA_diag * k
    return ca.ChunkGrads(dq=dq, dk=dk, de=de, dz=dz, dg=dg)


def backward_chunk(q, k, e, z, decay, loc, S0, R, dO, dS, scheme: str = "rewy"):
    """One chunk's backward, ReWY (three local products) or the seven-product WY baseline.

    Returns (ChunkGrads, dS0) with ``dS0 = Qγᵀ dO + Diag(γ_C) dS − Ēᵀ Λ`` (Λ = dZ).
    """
    C = loc.A.shape[0]
    dR = xmm_tn(loc.P, dO) + xmm(loc.Kt, dS)  # exact: dR and Λ feed the state cotangent dS0
    strict = ca._tril_mask(C, strict=True)
    dA_qk = jnp.where(ca._tril_mask(C, strict=False), fmm_nt(dO, R), 0.0)
    if scheme == "wy":
        dW = -fmm_nt(dR, S0)  # 1
        dA = fmm_nt(dR, z) + fmm_nt(dW, loc.Eg)  # 2, 3
        lam = xmm_tn(loc.A, dR)  # 4
        dEg_state = fmm_tn(loc.A, dW)  # 5
        dT = -jnp.where(strict, fmm_nt(fmm_tn(loc.A, dA), loc.A), 0.0)  # 6, 7
    else:
        lam = xmm_tn(loc.A, dR)  # 1: Λ = Aᵀ dR
        dT = -jnp.where(strict, fmm_nt(lam, R), 0.0)  # 2: −tril(Λ Rᵀ, −1)
        dEg_state = -fmm_nt(lam, S0)  # 3: −Λ S0ᵀ
    g = leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, dEg_state, lam)
    dS0 = xmm_tn(loc.Qg, dO) + decay.last_col() * dS - xmm_tn(loc.Eg, lam)
    return g, dS0
