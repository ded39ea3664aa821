"""Mosaic-lowerable forms of the per-chunk algebra (``pallas_kernels.chunk_algebra``).

The TPU kernels evaluate :mod:`pallas_kernels.chunk_algebra` on the blocks they load. Most of it
lowers unchanged (``mm``/``mm_nt``/``mm_tn``, ``chunk_output``, the masks). Three pieces do not,
and get a lowerable twin here, each with the same contract as the original:

* ``VectorDecay`` builds 4-D per-pair tensors with gathers (``P4[idx, :, idx, :]``) and 4-D
  einsums, which Mosaic cannot lower ("Unable to parse attribute"). :class:`VectorDecayTPU` keeps
  the same reference frames (rewy-math §3) but uses only 2-D ``[C, K]`` / ``[C, C]`` arrays:
  off-diagonal sub-chunk blocks are one full-size masked matmul per frame, diagonal blocks are
  exact per-pair factors swept over the 16 pivot rows of every sub-chunk at once. It never forms
  ``exp(−G)``: every exponent is masked to ``≤ 0`` *before* ``exp``.
* ``ScalarDecay`` takes ``G`` as a rank-1 ``[C]`` array; a TPU block wants 2-D tails, so
  :class:`ScalarDecayTPU` takes ``G`` as a ``[C, 1]`` column and builds the row by a mask-reduce.
* ``_leaf_grads`` adds the last-row gate terms with ``rows.at[-1].add(...)`` (a scatter, no Mosaic
  rule) on rank-1 sums; :func:`leaf_grads` uses a row mask and ``[1, K]`` sums instead.
* ``unit_lower_inverse`` slices and concatenates ``[C, C]`` at 16/32-lane offsets (relayouts
  Mosaic may reject); :func:`unit_lower_inverse` here runs forward substitution on all diagonal
  16×16 blocks at once with full-size masks, then merges the blocks by the nilpotent product
  ``(I + N)⁻¹ = (I − N)(I + N²)…`` at block level (N = D·T_off is strictly block-lower).

Everything is fp32 with ``HIGHEST`` matmuls, no cumsum (a triangular ones matmul), no solve.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import chunk_algebra as ca
from pallas_kernels.chunk_algebra import mm, mm_nt, mm_tn

SUB = ca.SUBCHUNK
f32 = jnp.float32


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
    """``ScalarDecay`` with ``G`` as a ``[C, 1]`` column (or None). gram/apply/apply_t inherited."""

    def __init__(self, Gcol, n_rows: int):
        self.G = Gcol
        self.C = n_rows
        tri = ca._tril_mask(n_rows, strict=False)
        if Gcol is None:
            self.D = tri.astype(f32)
        else:
            # Mask before exp: upper-triangular differences are positive and could overflow.
            self.D = jnp.exp(jnp.where(tri, Gcol - col_to_row(Gcol), -jnp.inf))

    def head(self, x):
        return x if self.G is None else jnp.exp(self.G) * x

    def tail(self, x):
        C = self.C
        return x if self.G is None else jnp.exp(self.G[C - 1:C, :] - self.G) * x

    def last_row(self):
        """γ_C as a [1, 1] (broadcasts against [1, K] rows and [K, V] states)."""
        C = self.C
        return jnp.ones((1, 1), f32) if self.G is None else jnp.exp(self.G[C - 1:C, :])

    last_col = last_row

    def reduce(self, d):
        return None if self.G is None else jnp.sum(d, axis=1, keepdims=True)


class VectorDecayTPU(ca.Decay):
    """``VectorDecay`` in 2-D, lowerable by Mosaic. ``G``: [C, K] chunk-local cumulative gate.

    Sub-chunk i (rows [16i, 16i+16)) has frame m_i = its first row. For s in an earlier sub-chunk
    than r: ``exp(G_r − G_s) = exp(G_r − G_{m_i}) · exp(G_{m_i} − G_s)``, both ≤ 1. For s, r in
    one sub-chunk the factor is exact per pair: pivot j sweeps the 16 rows of every sub-chunk
    simultaneously (``piv_j(r) = 16·blk(r) + j``).
    """

    def __init__(self, G, sub: int = SUB):
        C, K = G.shape
        self.sub = min(sub, C)
        self.n = C // self.sub
        self.G, self.C, self.K = G, C, K
        r = _iota((C, 1), 0)
        self.r = r
        self.blk = r // self.sub  # [C, 1] sub-chunk of each row
        self.loc = r - self.blk * self.sub  # [C, 1] row within its sub-chunk

    # frames ------------------------------------------------------------------------------
    def _in_frame(self, i):
        """Rows of sub-chunk i scaled into frame m_i: exp(G_r − G_{m_i}) (0 outside block i)."""
        Gm = self.G[self.sub * i:self.sub * i + 1, :]
        return jnp.exp(jnp.where(self.blk == i, self.G - Gm, -jnp.inf))

    def _from_frame(self, i):
        """Rows s before sub-chunk i, decayed to frame m_i: exp(G_{m_i} − G_s) (0 elsewhere)."""
        Gm = self.G[self.sub * i:self.sub * i + 1, :]
        return jnp.exp(jnp.where(self.r < self.sub * i, Gm - self.G, -jnp.inf))

    def _pivot(self, x, j):
        """Row piv_j(r) of x broadcast to every row r of its sub-chunk. x: [C, D]."""
        n, sub, D = self.n, self.sub, x.shape[1]
        return jnp.broadcast_to(x.reshape(n, sub, D)[:, j:j + 1, :], (n, sub, D)).reshape(self.C, D)

    def _pivot_mask(self, j):
        """[C, C] mask of column piv_j(r) in row r."""
        return _iota((self.C, self.C), 1) == self.blk * self.sub + j

    # Decay interface ---------------------------------------------------------------------
    def gram(self, x, y, strict):
        M = jnp.zeros((self.C, self.C), f32)
        for i in range(1, self.n):
            M = M + mm_nt(x * self._in_frame(i), y * self._from_frame(i))
        for j in range(self.sub):
            keep = self.loc > j if strict else self.loc >= j
            Gp = self._pivot(self.G, j)
            col = jnp.sum(x * self._pivot(y, j) * jnp.exp(jnp.where(keep, self.G - Gp, -jnp.inf)),
                          axis=1, keepdims=True)  # [C, 1]: M[r, piv_j(r)]
            M = M + jnp.where(self._pivot_mask(j), col, 0.0)
        return M

    def apply(self, P, y):
        Y = jnp.zeros((self.C, y.shape[1]), f32)
        for i in range(1, self.n):
            Y = Y + self._in_frame(i) * mm(P, y * self._from_frame(i))
        for j in range(self.sub):
            Pc = jnp.sum(jnp.where(self._pivot_mask(j), P, 0.0), axis=1, keepdims=True)
            Gp = self._pivot(self.G, j)
            Y = Y + Pc * self._pivot(y, j) * jnp.exp(jnp.where(self.loc >= j, self.G - Gp, -jnp.inf))
        return Y

    def apply_t(self, P, x):
        Y = jnp.zeros((self.C, x.shape[1]), f32)
        for i in range(1, self.n):
            Y = Y + self._from_frame(i) * mm_tn(P, x * self._in_frame(i))
        Pt = P.T
        for j in range(self.sub):
            # Row s gathers r = piv_j(s) ≥ s: P[piv_j(s), s] = Pᵀ[s, piv_j(s)].
            Pc = jnp.sum(jnp.where(self._pivot_mask(j), Pt, 0.0), axis=1, keepdims=True)
            Gp = self._pivot(self.G, j)
            Y = Y + Pc * self._pivot(x, j) * jnp.exp(jnp.where(self.loc <= j, Gp - self.G, -jnp.inf))
        return Y

    def head(self, x):
        return jnp.exp(self.G) * x

    def tail(self, x):
        C = self.C
        return jnp.exp(self.G[C - 1:C, :] - self.G) * x

    def last_row(self):
        """γ_C as [1, K]."""
        C = self.C
        return jnp.exp(self.G[C - 1:C, :])

    def last_col(self):
        """γ_C as [K, 1] (for Diag(γ_C) S with K on the rows of S)."""
        return row_to_col(self.last_row())

    def reduce(self, d):
        return d


def make_decay(G, n_rows: int):
    """Decay for a chunk's cumulative gate: None, [C, 1] (scalar) or [C, K] (vector)."""
    if G is None or G.shape[1] == 1:
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
    rloc = r - (r // sub) * sub
    for j in range(1, sub):
        D = jnp.where(rloc == j, eye - mm(Tbd, D), D)
    n = C // sub
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
    T = decay.gram(e, k, strict=True)
    A = unit_lower_inverse(T)
    Eg = decay.head(e)
    return ca.ChunkLocal(A=A, W=mm(A, Eg), U=mm(A, z), P=decay.gram(q, k, strict=False),
                         Qg=decay.head(q), Eg=Eg, Kt=decay.tail(k))


def next_state(loc: ca.ChunkLocal, decay, S0, R):
    """``S_C = Diag(γ_C) S0 + K_tailᵀ R`` (C·K·V instead of the K×K×V affine map)."""
    return decay.last_col() * S0 + mm_tn(loc.Kt, R)


def leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, dEg_state, dz) -> ca.ChunkGrads:
    """``chunk_algebra._leaf_grads`` with 2-D last-row terms (no scatter, no rank-1 arrays)."""
    C, V = R.shape
    RdS = mm_nt(R, dS)
    de = decay.head(dEg_state) + decay.apply(dT, k)
    dk = decay.apply_t(dT, e) + decay.apply_t(dA_qk, q) + decay.tail(RdS)
    dq = decay.head(mm_nt(dO, S0)) + decay.apply(dA_qk, k)
    dG = None
    if decay.G is not None:
        rows = de * e - dk * k + dq * q
        # Σ_v dS⊙S0 as a [1, K] row: ones[1, V] · (dS ⊙ S0)ᵀ.
        last = (mm_nt(jnp.ones((1, V), f32), dS * S0) * decay.last_row()
                + jnp.sum(RdS * loc.Kt, axis=0, keepdims=True))
        rows = rows + jnp.where(_iota((C, 1), 0) == C - 1, last, 0.0)
        dG = decay.reduce(rows)
    return ca.ChunkGrads(dq=dq, dk=dk, de=de, dz=dz, dG=dG)


def backward_chunk(q, k, e, z, decay, loc, S0, R, dO, dS, scheme: str = "rewy"):
    """One chunk's backward, ReWY (three local products) or the seven-product WY baseline.

    Returns (ChunkGrads, dS0) with ``dS0 = Qγᵀ dO + Diag(γ_C) dS − Ēᵀ Λ`` (Λ = dZ).
    """
    C = loc.A.shape[0]
    dR = mm_tn(loc.P, dO) + mm(loc.Kt, dS)
    strict = ca._tril_mask(C, strict=True)
    dA_qk = jnp.where(ca._tril_mask(C, strict=False), mm_nt(dO, R), 0.0)
    if scheme == "wy":
        dW = -mm_nt(dR, S0)  # 1
        dA = mm_nt(dR, z) + mm_nt(dW, loc.Eg)  # 2, 3
        lam = mm_tn(loc.A, dR)  # 4
        dEg_state = mm_tn(loc.A, dW)  # 5
        dT = -jnp.where(strict, mm_nt(mm_tn(loc.A, dA), loc.A), 0.0)  # 6, 7
    else:
        lam = mm_tn(loc.A, dR)  # 1: Λ = Aᵀ dR
        dT = -jnp.where(strict, mm_nt(lam, R), 0.0)  # 2: −tril(Λ Rᵀ, −1)
        dEg_state = -mm_nt(lam, S0)  # 3: −Λ S0ᵀ
    g = leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, dEg_state, lam)
    dS0 = mm_tn(loc.Qg, dO) + decay.last_col() * dS - mm_tn(loc.Eg, lam)
    return g, dS0
