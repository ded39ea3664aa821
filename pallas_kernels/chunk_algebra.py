"""The per-chunk algebra of the delta-rule family, written once (rewy-math §3–§6).

Every function here works on the blocks of **one chunk** (rows ``r = 0..C-1``):

    q, k, e : [C, K]   query (already scaled), key, erase vector e_r (β_r k_r or b_r ⊙ k_r)
    z       : [C, V]   write vector z_r (β_r v_r or w_r ⊙ v_r)
    G       : None, [C] or [C, K]   inclusive cumulative log-decay within the chunk
              (or a ``cum_gates`` pair (G, N): G without the resets, N their count)
    S0      : [K, V]   the state entering the chunk (fp32)

and is plain ``jnp`` with fp32 accumulation, so it runs as XLA (``rewy_jax.xla_chunked`` maps it
over chunks with ``vmap``) and is the specification the Pallas kernels evaluate on the blocks they
load. Names follow rewy-math: ``Ē = γ ⊙ E``, ``K̄ = K ⊘ γ``, ``Qγ = γ ⊙ Q``,
``T = tril(Ē K̄ᵀ, −1)``, ``A = (I + T)⁻¹``, ``R = A (Z − Ē S0)``.

Gates never appear as ``exp(−G)``: every decay factor is ``exp(G_r − G_s)`` with ``s ≤ r``
(≤ 1), evaluated by a :class:`Decay` object in reference frames, so the algebra is finite for any
``g ≤ 0``. Backward quantities are kept in the *raw frame* (the gradient with respect to the
un-decayed rows ``q_r, k_r, e_r``), which is what the leaf maps need and again avoids ``1/γ``.
"""

from __future__ import annotations

from typing import NamedTuple

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "inclusive_cumsum",
    "reverse_cumsum",
    "exclusive_cumsum",
    "Decay",
    "ScalarDecay",
    "VectorDecay",
    "make_decay",
    "RESET_GATE",
    "cum_gates",
    "decay_factor",
    "unit_lower_inverse",
    "ChunkLocal",
    "chunk_local",
    "chunk_state_transition",
    "chunk_output",
    "ChunkGrads",
    "rewy_backward_chunk",
    "wy_backward_chunk",
    "SUBCHUNK",
]

# fp32 matmuls must not silently drop to TF32/bf16 passes on GPUs (design.md, "numerics").
_HIGHEST = lax.Precision.HIGHEST
# Rows per sub-chunk for the reference frames of vector gates and the blocked inverse.
SUBCHUNK = 16


def mm(a, b):
    """``a @ b`` in fp32 with full precision."""
    return jnp.matmul(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def mm_nt(a, b):
    """``a @ bᵀ`` in fp32 with full precision."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def mm_tn(a, b):
    """``aᵀ @ b`` in fp32 with full precision."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def inclusive_cumsum(x, axis: int):
    """``jnp.cumsum(x, axis)`` — how the Pallas GPU path forms every chunk's G from its
    log-decays g (its kernels return the gradient w.r.t. G) — whose VJP is a flipped *forward*
    cumsum. Autodiff of ``jnp.cumsum`` gives a reverse cumsum, which the
    GPU lowering does not support as a scan: it falls back to a reduce-window summing the whole
    axis for every element (64 reads per output at chunk 64). Flipping is exact."""
    return jnp.cumsum(x, axis)


def _inclusive_cumsum_fwd(x, axis):
    return jnp.cumsum(x, axis), None


def _inclusive_cumsum_bwd(axis, _, ct):
    return (jnp.flip(jnp.cumsum(jnp.flip(ct, axis), axis), axis),)


inclusive_cumsum.defvjp(_inclusive_cumsum_fwd, _inclusive_cumsum_bwd)


def _tril_mask(n: int, strict: bool):
    r = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    s = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return s < r if strict else s <= r


# ----------------------------------------------------------------------------------------------
# Resets. A gate at or below RESET_GATE (exp(−40) ≈ 4e-18: below fp32 resolution of any state)
# is a reset: the decay across it is taken as exactly 0. The chunk-local cumulative gate G then
# sums only the other gates, and N counts the resets up to each row; exp(G_r − G_s) is read only
# where N_r = N_s (no reset in (s, r]) and is 0 elsewhere. Summing the clamped −40s into G
# instead grew |G| by 40 per reset, and fp32's rounding of G (ulp ≈ 6e-8·|G|) turned into that
# relative error of every decay factor after it: 10% of gates at −inf and 10% at −50 gave
# errors of 1e-5 to 2e-5 at C = 64 (tests/test_ops_accuracy.py::test_fp32_resets_in_chunk).
# ----------------------------------------------------------------------------------------------
RESET_GATE = -40.0


def cum_gates(g, axis: int, cumsum=None):
    """(G, N) of raw (clamped) per-token log-decays g: G = inclusive cumsum along ``axis`` of g
    with resets (g ≤ RESET_GATE) zeroed, N = inclusive count of resets (fp32, exact integers).
    ``cumsum``: the cumsum to use (default ``jnp.cumsum``; the TPU kernels pass a ones matmul).
    None stays None."""
    if g is None:
        return None
    cumsum = cumsum or (lambda x: jnp.cumsum(x, axis=axis))
    g = g.astype(jnp.float32)
    reset = g <= RESET_GATE
    return cumsum(jnp.where(reset, 0.0, g)), cumsum(reset.astype(jnp.float32))


def decay_factor(Ga, Gb, Na, Nb, keep=None):
    """``exp(G_a − G_b)`` where ``keep`` (None: everywhere) and no reset lies between the rows
    (N_a = N_b), else 0. Masked before exp, so a positive difference cannot overflow."""
    ok = Na == Nb
    if keep is not None:
        ok = ok & keep
    return jnp.exp(jnp.where(ok, Ga - Gb, -jnp.inf))


def split_gates(G):
    """(G, N) from a ``cum_gates`` pair, or (G, zeros) from a bare cumulative gate (no reset
    accounting: what callers that form G themselves pass). None stays (None, None)."""
    if G is None:
        return None, None
    if isinstance(G, tuple):
        return G
    return G, jnp.zeros_like(G)


# ----------------------------------------------------------------------------------------------
# Decay: the only place gates enter the chunk algebra.
# ----------------------------------------------------------------------------------------------
class Decay:
    """Decay factors ``exp(G_r − G_s)`` (s ≤ r) of one chunk, applied without forming ``exp(−G)``.

    Methods (C rows, feature dim K for vector gates; any feature dim for scalar gates):
      gram(x, y, strict) -> [C, C]: ``M_rs = Σ_c x_rc y_sc exp(G_rc − G_sc)`` for s ≤ r (s < r if strict), else 0.
      apply(P, y)        -> [C, D]: ``Y_r = Σ_{s ≤ r} P_rs · y_s ⊙ exp(G_r − G_s)``   (P lower-triangular).
      apply_t(P, x)      -> [C, D]: ``Y_s = Σ_{r ≥ s} P_rs · x_r ⊙ exp(G_r − G_s)``.
      head(x)            -> ``γ ⊙ x`` (rows ``exp(G_r) ⊙ x_r``).
      tail(x)            -> rows ``exp(G_C − G_r) ⊙ x_r`` (``K_tail`` when x = K).
      last()             -> ``γ_C``: [K] or scalar, for ``Diag(γ_C) S0``.
      reduce(d)          -> per-row gate cotangent in the gate's own shape (sum over K for scalars).
    """


class ScalarDecay(Decay):
    """One decay per row (GDN; DeltaNet with ``G = None``). ``G``: [C], a ``cum_gates`` pair
    ([C], [C]) or None."""

    def __init__(self, G, n_rows: int):
        G, N = split_gates(G)
        self.G, self.N = G, N
        self.C = n_rows
        tri = _tril_mask(n_rows, strict=False)
        if G is None:
            self.D = tri.astype(jnp.float32)
        else:
            # Mask *before* exp: upper-triangular differences are positive and could overflow.
            self.D = decay_factor(G[:, None], G[None, :], N[:, None], N[None, :], tri)

    def gram(self, x, y, strict):
        m = mm_nt(x, y) * self.D
        return jnp.where(_tril_mask(self.C, strict), m, 0.0) if strict else m

    def apply(self, P, y):
        return mm(P * self.D, y)

    def apply_t(self, P, x):
        return mm_tn(P * self.D, x)

    def head(self, x):
        return x if self.G is None else decay_factor(self.G, 0.0, self.N, 0.0)[:, None] * x

    def tail(self, x):
        if self.G is None:
            return x
        return decay_factor(self.G[-1], self.G, self.N[-1], self.N)[:, None] * x

    def last(self):
        if self.G is None:
            return jnp.float32(1.0)
        return decay_factor(self.G[-1], 0.0, self.N[-1], 0.0)

    def reduce(self, d):
        return None if self.G is None else jnp.sum(d, axis=-1)


class VectorDecay(Decay):
    """One decay per key channel and row (KDA, GDN2). ``G``: [C, K].

    Off-diagonal sub-chunk blocks use the frame ``m`` = first row of the *later* sub-chunk:
    ``exp(G_r − G_s) = exp(G_r − G_m) · exp(G_m − G_s)``, both factors ≤ 1, so one matmul per
    block is exact and cannot overflow. Diagonal blocks use exact per-pair factors
    ``[SUBCHUNK, SUBCHUNK, K]`` (finite for any g ≤ 0; no declared lower bound needed).
    """

    def __init__(self, G, sub: int = SUBCHUNK):
        G, N = split_gates(G)
        C, K = G.shape
        sub = min(sub, C)
        n = C // sub
        self.G, self.N, self.C, self.K, self.sub, self.n = G, N, C, K, sub, n
        Gs, Ns = G.reshape(n, sub, K), N.reshape(n, sub, K)
        Gm, Nm = Gs[:, 0, :], Ns[:, 0, :]  # frame of sub-chunk i: its first row
        # [n, sub, K] exp(G_r − G_m), r in i
        self.row_in_frame = decay_factor(Gs, Gm[:, None, :], Ns, Nm[:, None, :])
        i = lax.broadcasted_iota(jnp.int32, (n, n), 0)
        j = lax.broadcasted_iota(jnp.int32, (n, n), 1)
        earlier = (j < i)[:, :, None, None]  # s in sub-chunk j strictly before r's sub-chunk i
        # [n(i), n(j), sub, K] exp(G_m(i) − G_s), s in j < i
        self.frame_from = decay_factor(Gm[:, None, None, :], Gs[None, :, :, :],
                                       Nm[:, None, None, :], Ns[None, :, :, :], earlier)
        tri = _tril_mask(sub, strict=False)[None, :, :, None]
        # [n, sub(r), sub(s), K] exp(G_r − G_s), s ≤ r in one sub-chunk
        self.pair = decay_factor(Gs[:, :, None, :], Gs[:, None, :, :], Ns[:, :, None, :],
                                 Ns[:, None, :, :], tri)

    def _blocks(self, P):
        n, sub = self.n, self.sub
        P4 = P.reshape(n, sub, n, sub)
        idx = jnp.arange(n)
        return P4, P4[idx, :, idx, :]  # full blocks [i, a, j, b]; diagonal blocks [i, a, b]

    def _diag_to_full(self, off4, dia):
        n = self.n
        eye = jnp.eye(n, dtype=off4.dtype)[:, None, :, None]
        return (off4 + eye * dia[:, :, None, :]).reshape(self.C, self.C)

    def gram(self, x, y, strict):
        n, sub, K = self.n, self.sub, self.K
        xs, ys = x.reshape(n, sub, K), y.reshape(n, sub, K)
        off = jnp.einsum("iac,ijbc->iajb", xs * self.row_in_frame, ys[None] * self.frame_from,
                         precision=_HIGHEST, preferred_element_type=jnp.float32)
        dia = jnp.einsum("iac,ibc,iabc->iab", xs, ys, self.pair,
                         precision=_HIGHEST, preferred_element_type=jnp.float32)
        if strict:
            dia = jnp.where(_tril_mask(sub, strict=True)[None], dia, 0.0)
        return self._diag_to_full(off, dia)

    def apply(self, P, y):
        n, sub, K = self.n, self.sub, self.K
        ys = y.reshape(n, sub, K)
        P4, Pd = self._blocks(P)
        off = self.row_in_frame * jnp.einsum("iajb,ijbc->iac", P4, ys[None] * self.frame_from,
                                             precision=_HIGHEST, preferred_element_type=jnp.float32)
        dia = jnp.einsum("iab,ibc,iabc->iac", Pd, ys, self.pair,
                         precision=_HIGHEST, preferred_element_type=jnp.float32)
        return (off + dia).reshape(self.C, K)

    def apply_t(self, P, x):
        n, sub, K = self.n, self.sub, self.K
        xs = x.reshape(n, sub, K)
        P4, Pd = self._blocks(P)
        off = jnp.einsum("iajb,iac,ijbc->jbc", P4, xs * self.row_in_frame, self.frame_from,
                         precision=_HIGHEST, preferred_element_type=jnp.float32)
        dia = jnp.einsum("jab,jac,jabc->jbc", Pd, xs, self.pair,
                         precision=_HIGHEST, preferred_element_type=jnp.float32)
        return (off + dia).reshape(self.C, K)

    def head(self, x):
        return decay_factor(self.G, 0.0, self.N, 0.0) * x

    def tail(self, x):
        return decay_factor(self.G[-1][None, :], self.G, self.N[-1][None, :], self.N) * x

    def last(self):
        return decay_factor(self.G[-1], 0.0, self.N[-1], 0.0)

    def reduce(self, d):
        return d


def make_decay(G, n_rows: int) -> Decay:
    """The :class:`Decay` for a chunk's cumulative gate ``G``: None, [C] or [C, K], or a
    ``cum_gates`` pair (G, N) of those shapes."""
    if G is None or split_gates(G)[0].ndim == 1:
        return ScalarDecay(G, n_rows)
    return VectorDecay(G)


# ----------------------------------------------------------------------------------------------
# The unit lower-triangular inverse A = (I + T)⁻¹, matmul/mask only (lowerable by Pallas).
# ----------------------------------------------------------------------------------------------
def _forward_substitution_inverse(T):
    """``(I + T)⁻¹`` for a small strictly-lower ``T`` [n, n] by row-wise forward substitution.

    Row i of A is ``e_i − T_i A`` (only rows j < i of A are read, and they are final). Written
    with masks instead of dynamic indexing so every backend lowers it; n ≤ SUBCHUNK steps.
    """
    n = T.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    A = jnp.eye(n, dtype=jnp.float32)
    for i in range(1, n):
        t_i = jnp.sum(jnp.where(rows == i, T, 0.0), axis=0)  # row i of T, [n]
        new_row = A[i] - mm(t_i[None, :], A)[0]
        A = jnp.where(rows == i, new_row[None, :], A)
    return A


def unit_lower_inverse(T):
    """``(I + T)⁻¹`` for strictly-lower ``T`` [C, C], C a power of two.

    Forward substitution on SUBCHUNK×SUBCHUNK diagonal blocks (the precision-sensitive part),
    then block merges ``[[A11, 0], [A21, A22]]⁻¹ = [[A11⁻¹, 0], [−A22⁻¹ A21 A11⁻¹, A22⁻¹]]``.
    """
    C = T.shape[0]
    if C <= SUBCHUNK:
        return _forward_substitution_inverse(T)
    h = C // 2
    inv11 = unit_lower_inverse(T[:h, :h])
    inv22 = unit_lower_inverse(T[h:, h:])
    inv21 = -mm(inv22, mm(T[h:, :h], inv11))
    top = jnp.concatenate([inv11, jnp.zeros((h, h), jnp.float32)], axis=1)
    bottom = jnp.concatenate([inv21, inv22], axis=1)
    return jnp.concatenate([top, bottom], axis=0)


# ----------------------------------------------------------------------------------------------
# Forward (rewy-math §3)
# ----------------------------------------------------------------------------------------------
class ChunkLocal(NamedTuple):
    """Chunk-local quantities that need no state (parallel over chunks)."""

    A: jnp.ndarray  # [C, C]  (I + T)⁻¹
    W: jnp.ndarray  # [C, K]  A Ē
    U: jnp.ndarray  # [C, V]  A Z
    P: jnp.ndarray  # [C, C]  tril(Qγ K̄ᵀ), diagonal included
    Qg: jnp.ndarray  # [C, K]  Qγ
    Eg: jnp.ndarray  # [C, K]  Ē
    Kt: jnp.ndarray  # [C, K]  K_tail = γ_C ⊙ K̄


def chunk_local(q, k, e, z, decay: Decay) -> ChunkLocal:
    """Build T, invert L = I + T, and form W, U, P, Qγ, Ē, K_tail for one chunk."""
    T = decay.gram(e, k, strict=True)
    A = unit_lower_inverse(T)
    Eg = decay.head(e)
    return ChunkLocal(A=A, W=mm(A, Eg), U=mm(A, z), P=decay.gram(q, k, strict=False),
                      Qg=decay.head(q), Eg=Eg, Kt=decay.tail(k))


def chunk_state_transition(loc: ChunkLocal, decay: Decay):
    """The chunk as an affine map of its start state: ``S_C = M S0 + B``.

    ``M = Diag(γ_C) − K_tailᵀ W`` [K, K], ``B = K_tailᵀ U`` [K, V]; the sequential state pass
    then costs one K×K×V product per chunk.
    """
    K = loc.Kt.shape[1]
    last = decay.last()
    diag = jnp.diag(last) if jnp.ndim(last) == 1 else last * jnp.eye(K, dtype=jnp.float32)
    return diag - mm_tn(loc.Kt, loc.W), mm_tn(loc.Kt, loc.U)


def chunk_output(loc: ChunkLocal, S0):
    """``R = U − W S0`` and ``O = Qγ S0 + P R``. Returns (O [C, V], R [C, V])."""
    R = loc.U - mm(loc.W, S0)
    return mm(loc.Qg, S0) + mm(loc.P, R), R


# ----------------------------------------------------------------------------------------------
# Backward (rewy-math §4–§6)
# ----------------------------------------------------------------------------------------------
class ChunkGrads(NamedTuple):
    """Cotangents of one chunk's inputs, in the raw frame (w.r.t. q, k, e, z, G rows)."""

    dq: jnp.ndarray  # [C, K]
    dk: jnp.ndarray  # [C, K]
    de: jnp.ndarray  # [C, K]
    dz: jnp.ndarray  # [C, V]
    dg: jnp.ndarray | None  # [C] / [C, K] / None, w.r.t. the chunk's per-token log-decays g
                            # (G = inclusive cumsum of g within the chunk)


def diagonal_split(dA_qk):
    """(dA_qk with a zero diagonal, its diagonal as a [C, 1] column): the diagonal query-key
    pairs carry the decay factor exp(G_r − G_r) = 1, so they enter no gate gradient."""
    C = dA_qk.shape[0]
    eye = _tril_mask(C, strict=False) & ~_tril_mask(C, strict=True)
    return jnp.where(eye, 0.0, dA_qk), jnp.sum(jnp.where(eye, dA_qk, 0.0), axis=1, keepdims=True)


def _leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, dEg_state, dz):
    """Shared tail of both backward schemes: Gram terms, raw-frame leaves and dg.

    ``dEg_state`` is the part of dĒ that does not come from T (−Λ S0ᵀ in ReWY; Aᵀ dW in WY).
    """
    RdS = mm_nt(R, dS)  # [C, K]  R dSᵀ
    dA_off, dA_diag = diagonal_split(dA_qk)
    y = decay.tail(RdS)  # each row's path into the end state, factor exp(G_C − G_s)
    de = decay.head(dEg_state) + decay.apply(dT, k)  # γ ⊙ dĒ
    dk_pairs = decay.apply_t(dT, e) + decay.apply_t(dA_off, q)
    dq_rest = decay.head(mm_nt(dO, S0)) + decay.apply(dA_off, k)
    dg = None
    if decay.G is not None:
        # The gate gradient from the key-gradient products already formed (§5, §6). Per row
        #     dG_r = dĒ_r⊙ē_r − dK̄_r⊙k̄_r + dQγ_r⊙qγ_r   (+ the end state's terms in the last row)
        # and dg_t = Σ_{r ≥ t} dG_r. Summed that way, the terms with decay factor 1 — the
        # diagonal query-key pairs, each row's own path into the end state — enter with both
        # signs and cancel, leaving rounding at the size of dq, dk in dg (orders above dg where
        # every token decays strongly). So they are left out: the pair and head terms are
        # reverse-summed, a row's path into the end state crosses only the later tokens (summed
        # over the rows before t), and the start state's decay crosses every token.
        pairs = decay.reduce(de * e - dk_pairs * k + dq_rest * q)
        dg = (reverse_cumsum(pairs) + exclusive_cumsum(decay.reduce(y * k))
              + decay.reduce((jnp.sum(dS * S0, axis=1) * decay.last())[None]))
    dk = dk_pairs + y + dA_diag * q  # dK̄ ⊘ γ
    dq = dq_rest + dA_diag * k  # γ ⊙ dQγ
    return ChunkGrads(dq=dq, dk=dk, de=de, dz=dz, dg=dg)


def clamp_gates(g, floor):
    """Log-decays g with every value below ``floor`` raised to it (None stays None): what every
    backend's recurrence reads (rewy_jax.ops.GATE_FLOOR, or a declared gate bound). ``where``,
    not ``maximum``: maximum's VJP halves the gradient of a gate exactly at the floor; here a
    gate at the floor keeps its gradient and one below it gets none. The Pallas GPU kernels
    apply it in-kernel (kernels.cum_gates) and its VJP there too (kernels.gate_grad)."""
    if g is None:
        return None
    # full_like, not a Python float: inside a Pallas kernel traced under shard_map the float
    # would be an invariant operand next to a varying g, which `<` rejects.
    floor = lax.full_like(g, floor)
    return jnp.where(g < floor, floor, g)


def reverse_cumsum(x, axis: int = 0):
    """Σ_{s ≥ r} x_s along ``axis``, as a flipped forward cumsum (``inclusive_cumsum`` says
    why)."""
    return jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis=axis), axis)


def exclusive_cumsum(x, axis: int = 0):
    """Σ_{s < r} x_s along ``axis`` (summed without x_r, so nothing cancels)."""
    n = x.shape[axis]
    head = jnp.zeros_like(lax.slice_in_dim(x, 0, 1, axis=axis))
    return jnp.concatenate([head, jnp.cumsum(lax.slice_in_dim(x, 0, n - 1, axis=axis),
                                             axis=axis)], axis=axis)


def rewy_backward_chunk(q, k, e, decay: Decay, loc: ChunkLocal, S0, R, dO, dS) -> ChunkGrads:
    """ReWY's reduced backward of one chunk: three local WY products, no inverse adjoint.

    dO [C, V] is the output cotangent, dS [K, V] the cotangent of the chunk's end state.
        dR = Pᵀ dO + K_tail dS
        Λ  = Aᵀ dR                  (1: one adjoint solve of L R = Z − Ē S0)
        dT = −tril(Λ Rᵀ, −1)        (2)
        dĒ = −Λ S0ᵀ + dT K̄         (3, plus the Gram term)
    """
    dR = mm_tn(loc.P, dO) + mm(loc.Kt, dS)
    lam = mm_tn(loc.A, dR)
    dT = -jnp.where(_tril_mask(loc.A.shape[0], strict=True), mm_nt(lam, R), 0.0)
    dA_qk = jnp.where(_tril_mask(loc.A.shape[0], strict=False), mm_nt(dO, R), 0.0)
    return _leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, -mm_nt(lam, S0), lam)


def wy_backward_chunk(q, k, e, z, decay: Decay, loc: ChunkLocal, S0, R, dO, dS) -> ChunkGrads:
    """The standard seven-product WY backward (baseline for ablations; same result).

    dU = dR; dW = −dR S0ᵀ; dA = dU Zᵀ + dW Ēᵀ; dZ = Aᵀ dU; dĒ = Aᵀ dW; dT = −tril(Aᵀ dA Aᵀ, −1).
    """
    dR = mm_tn(loc.P, dO) + mm(loc.Kt, dS)
    dW = -mm_nt(dR, S0)  # 1
    dA = mm_nt(dR, z) + mm_nt(dW, loc.Eg)  # 2, 3
    dz = mm_tn(loc.A, dR)  # 4
    dEg = mm_tn(loc.A, dW)  # 5
    dT = -jnp.where(_tril_mask(loc.A.shape[0], strict=True),
                    mm_nt(mm_tn(loc.A, dA), loc.A), 0.0)  # 6, 7
    dA_qk = jnp.where(_tril_mask(loc.A.shape[0], strict=False), mm_nt(dO, R), 0.0)
    return _leaf_grads(q, k, e, decay, loc, S0, R, dO, dS, dT, dA_qk, dEg, dz)
