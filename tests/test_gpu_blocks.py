"""The GPU block layer (``pallas_kernels.gpu.blocks`` and ``.decay``) piece by piece against the one chunk
algebra (``pallas_kernels.chunk_algebra``, fp32 HIGHEST einsums) on small chunks, in Pallas
interpret mode: the decay Grams of every diagonal method, the leaf products (apply and its
transpose, alone and shared), the blocked unit-lower inverse, and the whole-chunk helpers of
no and scalar gates. Each runs inside a ``pallas_call`` on whole-array refs, as the kernels
call them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import chunk_algebra as ca
from pallas_kernels.gpu import blocks as bk
from pallas_kernels.gpu import decay as dc

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpret-mode units")
HI = lax.Precision.HIGHEST
C, K = 32, 32  # two sub-chunk blocks, two key slices of 16


def _run(kernel, ins, out_shapes):
    """``kernel(*in_refs, *out_refs)`` as one interpret-mode program on whole arrays."""
    out = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(s, jnp.float32)
                                            for s in out_shapes], interpret=True)(*ins)
    return [np.asarray(o) for o in out]


def _gates(seed, mode, strong=True, bound=None):
    """Chunk-local cumulative gates G ([C] or [C, K]; g down to −10 and a few −50 when strong,
    in [bound, 0] with a declared bound) and rows x, y [C, K]."""
    rng = np.random.default_rng(seed)
    shape = (C,) if mode == "scalar" else (C, K)
    if bound is not None:
        g = rng.uniform(bound, 0, shape)
    else:
        g = -rng.uniform(0, 10 if strong else 1, shape)
        if strong:
            g.reshape(-1)[rng.choice(g.size, g.size // 20, replace=False)] = -50.0
    G = jnp.asarray(np.cumsum(g, axis=0), jnp.float32)
    x, y = (jnp.asarray(rng.standard_normal((C, K)) / 4, jnp.float32) for _ in range(2))
    return G, x, y


def _close(got, want, tol=2e-5):
    want = np.asarray(want, np.float64)
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30)
    assert err < tol, err


@pytest.mark.parametrize("diag,kslice,bound", [("loop", 0, None), ("loop", 16, None),
                                               ("levels", 16, None), ("outer", 16, None),
                                               ("centred", 16, -5.0)])
@pytest.mark.parametrize("strict", [False, True])
def test_vector_grams_match_chunk_algebra(diag, kslice, bound, strict):
    """Gates.grams (Σ_c x_rc y_sc e^{G_rc − G_sc}, s ≤ r or s < r) block by block, and
    row_frame_grams' off-diagonal blocks, = VectorDecay.gram — at strong decays (−50 included)
    for the exact methods, at the declared bound for the centred one."""
    G, x, y = _gates(1, "vector", bound=bound)
    n = C // bk.BS

    def kernel(G_ref, x_ref, y_ref, o_ref, f_ref):
        o_ref[...] = jnp.zeros((C, C), jnp.float32)  # the blocks above the diagonal
        f_ref[...] = jnp.zeros((C, C), jnp.float32)
        gt = dc.Gates("vector", G_ref, 0, C, diag, kslice=kslice)
        xs, ys = bk.Rows(x_ref), bk.Rows(y_ref)
        for i in range(n):
            for j in range(i + 1):
                o_ref[pl.ds(i * bk.BS, bk.BS), pl.ds(j * bk.BS, bk.BS)] = gt.grams(
                    i, j, [xs[i]], ys[j], y_ref, HI, [strict], x_refs=[x_ref])[0]
            if kslice and i:  # the row's frame products in one key-slice loop
                for j, (m,) in enumerate(gt.row_frame_grams(i, [x_ref], y_ref, HI, False)):
                    f_ref[pl.ds(i * bk.BS, bk.BS), pl.ds(j * bk.BS, bk.BS)] = m

    got, frames = _run(kernel, [G, x, y], [(C, C), (C, C)])
    want = np.asarray(ca.VectorDecay(G).gram(x, y, strict))
    _close(got, want)
    if kslice:
        _close(frames[bk.BS:, :bk.BS], want[bk.BS:, :bk.BS])


@pytest.mark.parametrize("diag", ["loop", "levels"])
def test_vector_leaf_products_match_chunk_algebra(diag):
    """Gates.applies (Y_r = Σ_{s ≤ r} P_rs y_s e^{G_r − G_s}) and apply_t_sum (its transpose,
    summed over two terms) = VectorDecay.apply / apply_t, P lower-triangular, strong decays;
    head and tail = Decay.head / tail."""
    G, x, y = _gates(2, "vector")
    rng = np.random.default_rng(3)
    P1, P2 = (jnp.asarray(np.tril(rng.standard_normal((C, C))), jnp.float32) for _ in range(2))
    n = C // bk.BS

    def kernel(G_ref, x_ref, y_ref, P1_ref, P2_ref, a1_ref, a2_ref, t_ref, h_ref, tl_ref):
        gt = dc.Gates("vector", G_ref, 0, C, diag)
        xs, ys = bk.Rows(x_ref), bk.Rows(y_ref)
        B1, B2 = bk.Blocks(P1_ref), bk.Blocks(P2_ref)
        for i in range(n):
            rows = pl.ds(i * bk.BS, bk.BS)
            a1_ref[rows, :], a2_ref[rows, :] = gt.applies([B1, B2], i, ys, y_ref, HI)
            t_ref[rows, :] = gt.apply_t_sum([(B1, xs, x_ref), (B2, ys, y_ref)], i, HI, n)
            h_ref[rows, :] = gt.head(i, xs[i])
            tl_ref[rows, :] = gt.tail(i, xs[i])

    a1, a2, t, h, tl = _run(kernel, [G, x, y, P1, P2], [(C, K)] * 5)
    d = ca.VectorDecay(G)
    _close(a1, d.apply(P1, y))
    _close(a2, d.apply(P2, y))
    _close(t, d.apply_t(P1, x) + d.apply_t(P2, y))
    _close(h, d.head(x))
    _close(tl, d.tail(x))


@pytest.mark.parametrize("mode", ["none", "scalar"])
def test_whole_chunk_helpers_match_chunk_algebra(mode):
    """No or scalar gates: scalar_decay (D_rs = e^{G_r − G_s}, masked before exp) and qk_full
    (P = tril(Qγ K̄ᵀ)), and Gates' scalar Gram blocks, = ScalarDecay's D and gram."""
    G, x, y = _gates(4, "scalar")
    G = None if mode == "none" else G
    n = C // bk.BS

    def kernel(*refs):
        if G is None:
            refs = (None,) + refs
        G_ref, x_ref, y_ref, D_ref, P_ref, g_ref = refs
        P_ref[...] = bk.qk_full(mode, x_ref, y_ref, G_ref, C, HI)[1]
        D_ref[...] = (bk.scalar_decay(G_ref[...], C) if G_ref is not None
                      else jnp.where(bk.iota((C, C), 1) <= bk.iota((C, C), 0), 1.0, 0.0))
        gt = dc.Gates(mode, G_ref, 0, C)
        xs, ys = bk.Rows(x_ref), bk.Rows(y_ref)
        for i in range(n):
            for j in range(n):
                blk = (gt.gram(i, j, xs[i], ys[j], y_ref, HI, True) if j <= i
                       else jnp.zeros((bk.BS, bk.BS), jnp.float32))
                g_ref[pl.ds(i * bk.BS, bk.BS), pl.ds(j * bk.BS, bk.BS)] = blk

    ins = [x, y] if G is None else [G, x, y]
    D, P, gram = _run(kernel, ins, [(C, C)] * 3)
    d = ca.ScalarDecay(G, C)
    _close(D, d.D)
    _close(P, d.gram(x, y, strict=False))
    _close(gram, d.gram(x, y, strict=True))


@pytest.mark.parametrize("joint,stacked", [(False, False), (True, False), (True, True)])
def test_blocked_inverse_matches_chunk_algebra(joint, stacked):
    """inv_blocks — per-block, joint and stacked diagonal substitution, then block forward
    substitution — = chunk_algebra.unit_lower_inverse at C = 64 (four blocks)."""
    Cn = 64
    rng = np.random.default_rng(5)
    T = jnp.asarray(np.tril(rng.standard_normal((Cn, Cn)) * 0.2, -1), jnp.float32)

    def kernel(T_ref, A_ref):
        Tb = bk.Blocks(T_ref)
        A = bk.inv_blocks(lambda i, j: Tb[i, j], Cn // bk.BS, HI, joint_diag=joint,
                          stacked=stacked)
        for i in range(Cn // bk.BS):
            for j in range(Cn // bk.BS):
                A_ref[pl.ds(i * bk.BS, bk.BS), pl.ds(j * bk.BS, bk.BS)] = (
                    A[i, j] if j <= i else jnp.zeros((bk.BS, bk.BS), jnp.float32))

    (A,) = _run(kernel, [T], [(Cn, Cn)])
    _close(A, ca.unit_lower_inverse(T), tol=1e-5)
