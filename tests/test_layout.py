"""Token layout [B, T, H, D] <-> chunk layout [B, H, N, C, D] (rewy_jax.layout).

plan_chunks metadata, to_chunks / from_chunks round trips (plain batches and varlen, including
traced cu_seqlens under jit), sequences starting on chunk boundaries, zero padding rows, and the
gradient of the round trip.
"""

from __future__ import annotations

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewy_jax import layout


def _x(B, T, H, *D, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, H, *D)), jnp.float32)


@pytest.mark.parametrize("T,C", [(1, 16), (15, 16), (16, 16), (17, 16), (100, 32), (64, 64)])
def test_plain_plan_and_round_trip(T, C):
    plan = layout.plan_chunks(T, C)
    N = -(-T // C)
    assert plan.n_chunks == N and plan.chunk_size == C
    assert plan.gather is None and plan.scatter is None
    np.testing.assert_array_equal(plan.chunk_reset, np.arange(N) == 0)
    np.testing.assert_array_equal(plan.chunk_seq, np.zeros(N))
    np.testing.assert_array_equal(plan.end_chunk, [N - 1])
    x = _x(2, T, 3, 5)
    xc = layout.to_chunks(x, plan)
    chex.assert_shape(xc, (2, 3, N, C, 5))
    # row r of chunk n is token n·C + r; padding rows are zero
    flat = np.asarray(jnp.moveaxis(xc, 1, 3)).reshape(2, N * C, 3, 5)
    np.testing.assert_array_equal(flat[:, :T], x)
    assert np.all(flat[:, T:] == 0)
    np.testing.assert_array_equal(layout.from_chunks(xc, plan, T), x)
    # per-token scalars ([B, T, H]) too
    g = _x(2, T, 3)
    gc = layout.to_chunks(g, plan)
    chex.assert_shape(gc, (2, 3, N, C))
    assert layout.to_chunks(None, plan) is None


def _check_varlen_plan(plan, cu, T, C, x, xc):
    """Every sequence starts on a chunk boundary, rows keep order, padding is zero."""
    cu = np.asarray(cu)
    n = len(cu) - 1
    reset, seq, end = (np.asarray(a) for a in (plan.chunk_reset, plan.chunk_seq, plan.end_chunk))
    flat = np.asarray(jnp.moveaxis(xc, 1, 3)).reshape(x.shape[0], -1, *x.shape[2:])
    chunk = 0
    used = np.zeros(flat.shape[1], bool)
    for i in range(n):
        L = cu[i + 1] - cu[i]
        nch = -(-L // C)
        assert reset[chunk] and np.all(seq[chunk:chunk + nch] == i)
        assert not np.any(reset[chunk + 1:chunk + nch])
        assert end[i] == chunk + nch - 1
        rows = slice(chunk * C, chunk * C + L)
        np.testing.assert_array_equal(flat[:, rows], np.asarray(x)[:, cu[i]:cu[i + 1]])
        used[chunk * C:(chunk + nch) * C] = True
        used_rows = np.zeros(flat.shape[1], bool)
        used_rows[rows] = True
        assert np.all(flat[:, chunk * C:(chunk + nch) * C][:, ~used_rows[chunk * C:(chunk + nch) * C]] == 0)
        chunk += nch
    # chunks after the last sequence are padding: marked with seq = n and reset, all zero
    assert np.all(seq[chunk:] == n) and np.all(reset[chunk:])
    assert np.all(flat[:, ~used] == 0)


@pytest.mark.parametrize("cu,C", [([0, 5, 40, 41, 70], 16), ([0, 1, 2, 3], 16),
                                  ([0, 33, 34, 100], 32)])
def test_varlen_plan_and_round_trip(cu, C):
    T = cu[-1]
    plan = layout.plan_chunks(T, C, jnp.asarray(cu, jnp.int32))
    n = len(cu) - 1
    assert plan.n_chunks == (T + n * (C - 1)) // C  # static bound, valid under jit
    assert plan.n_chunks >= sum(-(-(b - a) // C) for a, b in zip(cu[:-1], cu[1:]))
    x = _x(1, T, 2, 3, seed=1)
    xc = layout.to_chunks(x, plan)
    chex.assert_shape(xc, (1, 2, plan.n_chunks, C, 3))
    _check_varlen_plan(plan, cu, T, C, x, xc)
    np.testing.assert_array_equal(layout.from_chunks(xc, plan, T), x)


def test_varlen_traced_under_jit_equals_concrete():
    cu = jnp.asarray([0, 5, 40, 41, 70], jnp.int32)
    x = _x(1, 70, 2, 3, seed=2)

    def round_trip(x, cu):
        plan = layout.plan_chunks(70, 16, cu)
        xc = layout.to_chunks(x, plan)
        return xc, layout.from_chunks(xc, plan, 70), plan.chunk_reset, plan.chunk_seq, plan.end_chunk

    eager = round_trip(x, cu)
    jitted = jax.jit(round_trip)(x, cu)
    chex.assert_trees_all_equal(jitted, eager)
    np.testing.assert_array_equal(jitted[1], x)
    # the same compiled function with other offsets
    cu2 = jnp.asarray([0, 31, 32, 33, 70], jnp.int32)
    chex.assert_trees_all_equal(jax.jit(round_trip)(x, cu2), round_trip(x, cu2))
    np.testing.assert_array_equal(jax.jit(round_trip)(x, cu2)[1], x)


def test_round_trip_gradient_is_identity():
    cu = jnp.asarray([0, 7, 30], jnp.int32)
    x = _x(1, 30, 2, 4, seed=3)
    w = _x(1, 30, 2, 4, seed=4)

    def f(x):
        plan = layout.plan_chunks(30, 16, cu)
        return jnp.sum(layout.from_chunks(layout.to_chunks(x, plan), plan, 30) * w)

    np.testing.assert_array_equal(jax.grad(f)(x), w)
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(x), w)


@settings(max_examples=(25 if os.environ.get("RUN_SLOW", "0") not in ("", "0") else 4), deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       C=st.sampled_from([16, 32, 64]))
def test_varlen_round_trip_property(lens, C):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    plan = layout.plan_chunks(T, C, jnp.asarray(cu))
    x = _x(1, T, 1, 2, seed=T)
    xc = layout.to_chunks(x, plan)
    _check_varlen_plan(plan, cu, T, C, x, xc)
    np.testing.assert_array_equal(layout.from_chunks(xc, plan, T), x)
