"""Property-based tests (hypothesis): random small shapes, chunk sizes, decays and packings, the
XLA chunked path against the float64 token recurrence (forward and every gradient)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewy_jax import testing
from rewy_jax.testing import OPS, make_inputs


# Every example is a new shape, hence new compilations (~5–10 s of CPU each): keep the budget
# small by default; RUN_SLOW=1 runs five times as many.
_SCALE = 5 if os.environ.get("RUN_SLOW", "0") not in ("", "0") else 1


def _check(op, inputs, label, **kw):
    """Every output and gradient within the fp32 ratio bound against the float64 recurrence."""
    ratios = testing.accuracy_report(op, inputs, **kw)
    bad = {k: r for k, (r, tol) in ratios.items() if not r <= tol}
    assert not bad, f"{label}: {bad}"


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_gate_gradient_of_a_fully_decayed_sequence(op):
    """Where hypothesis once found dg off by 6.8e-4 (fp32, xla): two tokens both decaying by
    e^−20, so dg ~1e-9 against dk ~1. Formed as rowsum − colsum then a reverse cumsum, the
    terms with decay factor 1 (diagonal query-key pairs, each row's own path into the end state)
    enter with both signs and leave rounding at dk's size (ratio ~400 here); every backend now
    keeps them out of dg's sums (chunk_algebra._leaf_grads) and meets the 1e-4 bound."""
    inputs = make_inputs(op, 1, 2, 1, 16, 16, seed=0, decay="strong", initial_state=False)
    inputs["g"] = jnp.full(inputs["g"].shape, -20.0, jnp.float32)
    for backend in ("xla", "pallas_tpu", "pallas_gpu"):
        pairs = testing.compare_to_reference(op, inputs, seed=1, backend=backend, chunk_size=16,
                                             interpret=True)
        assert float(np.max(np.abs(np.asarray(pairs["dg"][1])))) < 1e-6  # the regime
        bad = {n: testing.ratio(*p) for n, p in pairs.items() if not testing.ratio(*p) <= 1e-4}
        assert not bad, (backend, bad)


@settings(max_examples=6 * _SCALE, deadline=None)
@given(op=st.sampled_from(sorted(OPS)),
       B=st.integers(1, 2), T=st.integers(1, 70), H=st.integers(1, 2),
       K=st.sampled_from([4, 8, 16]), V=st.sampled_from([4, 8, 16]),
       C=st.sampled_from([16, 32, 64]),
       decay=st.sampled_from(["normal", "strong", "none"]),
       backward=st.sampled_from(["rewy", "wy"]), policy=st.sampled_from(["recompute", "save"]),
       initial_state=st.booleans(), seed=st.integers(0, 2**16))
def test_xla_matches_float64_reference(op, B, T, H, K, V, C, decay, backward, policy,
                                       initial_state, seed):
    inputs = make_inputs(op, B, T, H, K, V, seed=seed, decay=decay, initial_state=initial_state)
    _check(op, inputs, f"{op} B={B} T={T} H={H} K={K} V={V} C={C} {decay} {backward} {policy}",
           seed=seed + 1, backend="xla", chunk_size=C, backward=backward, policy=policy)


@settings(max_examples=3 * _SCALE, deadline=None)
@given(op=st.sampled_from(sorted(OPS)), lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       C=st.sampled_from([16, 32]), decay=st.sampled_from(["normal", "strong"]),
       seed=st.integers(0, 2**16))
def test_varlen_matches_float64_reference(op, lens, C, decay, seed):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    inputs = make_inputs(op, 1, T, 2, 8, 4, seed=seed, decay=decay, initial_state=False)
    inputs["cu_seqlens"] = jnp.asarray(cu)
    inputs["initial_state"] = jnp.asarray(
        np.random.default_rng(seed).standard_normal((len(lens), 2, 8, 4)), jnp.float32)
    _check(op, inputs, f"{op} cu={cu.tolist()} C={C} {decay}", seed=seed + 1, backend="xla",
           chunk_size=C)


@settings(max_examples=3 * _SCALE, deadline=None)
@given(op=st.sampled_from(sorted(OPS)), T=st.integers(2, 40), split=st.integers(1, 39),
       seed=st.integers(0, 2**16))
def test_state_carry_splits_sequences(op, T, split, seed):
    """Running [0, s) then [s, T) with the carried final state == running [0, T) at once."""
    split = min(split, T - 1)
    d = make_inputs(op, 1, T, 1, 8, 4, seed=seed)
    kw = dict(backend="xla", chunk_size=16, use_qk_l2norm=True)
    o, s = testing.run_op(op, d, **kw)
    first = {k: (v[:, :split] if k != "initial_state" else v) for k, v in d.items()}
    o1, s1 = testing.run_op(op, first, **kw)
    second = {k: (v[:, split:] if k != "initial_state" else s1) for k, v in d.items()}
    o2, s2 = testing.run_op(op, second, **kw)
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s2, s, rtol=1e-4, atol=1e-5)
