"""Shared pytest setup for the rewy-jax CPU test suite.

* float64 on (the oracle, ``rewy_jax.testing.accuracy_report``, runs the recurrence in float64);
* the fast tier: tests whose node id matches ``FAST`` below get the ``fast`` marker, and
  ``bash scripts/test.sh`` runs only those (``-m fast``); ``bash scripts/test.sh --all`` runs
  every test;
* ``@pytest.mark.slow`` tests are skipped unless ``RUN_SLOW=1``;
* a bounded hypothesis profile (few examples, no deadline: first calls compile);
* fixtures with small helpers: an independent NumPy float64 recurrence and report checking.
"""

from __future__ import annotations

import os

# The Mosaic GPU interpreter runs each warpgroup of a kernel as a host thread whose barrier waits
# block inside XLA host callbacks on the CPU client's thread pool, one thread per CPU unless NPROC
# says otherwise (XLA's CPU client reads it when it starts). A serial kernel's three warpgroups
# then need three pool threads: on a 2-CPU machine two blocked waits held both threads and the
# third warpgroup never ran (a deadlock of the simulation, not of the kernel). Four threads, set
# before JAX starts its CPU client, let those cases run on any machine.
os.environ.setdefault("NPROC", str(max(4, os.cpu_count() or 1)))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

# Most of the suite's CPU time is XLA compiling many small executables (eager op-by-op dispatch
# of the chunk algebra). A persistent compilation cache makes every run after the first one
# several times faster. REWY_JAX_TEST_CACHE=0 turns it off; another path moves it.
_CACHE = os.environ.get("REWY_JAX_TEST_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     ".pytest_cache", "jax-compilation-cache"))
if _CACHE not in ("", "0"):
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

try:  # hypothesis is a test extra; only test_properties needs it.
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "rewy", max_examples=10, deadline=None, derandomize=False, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "rewy"))
except ImportError:  # pragma: no cover
    pass


RUN_SLOW = os.environ.get("RUN_SLOW", "0") not in ("", "0")

# The fast tier (``bash scripts/test.sh``, ≤ 5 minutes on a 2-core machine): every op on every
# backend at a small size (test_backends), the math identities, the chunk algebra against the
# float64 recurrence, every validation error, the layers and the README's examples, and the
# demo's smoke run. Patterns are fnmatch patterns on pytest node ids; a pattern that matches no
# test of a full run is an error (a renamed test must not silently leave the tier). Everything
# else runs in the full tier (``bash scripts/test.sh --all``, CI).
FAST = (
    "tests/test_backends.py::*",
    "tests/test_math_identities.py::*",
    "tests/test_validation.py::*",
    "tests/test_readme.py::*",
    "tests/test_chunk_algebra.py::test_chunk_forward_matches_recurrence*",
    "tests/test_chunk_algebra.py::test_chunk_backward_rewy_wy_and_autodiff*",
    "tests/test_chunk_algebra.py::test_decay_finite_and_exact_with_very_negative_G*",
    "tests/test_layers.py::test_shape_and_dtype*",
    "tests/test_layers.py::test_bad_*",
    "tests/test_layers.py::test_bounded_gates_declare_their_bound*",
    "tests/test_mqar.py::*",
    "tests/test_ops_transforms.py::test_backend_none_on_cpu_is_xla",
    "tests/test_mosaic_gpu.py::test_supports_says_why_not",
    "tests/test_mosaic_gpu.py::test_chunk_inverse_interpret?64?",
    "tests/test_mosaic_gpu.py::test_kernels_lower_for_cuda?True-False-64-False?",  # ? for the brackets
    "tests/test_mosaic_gpu.py::test_interpret_matches_float64?deltanet-save-None-130-2-None-64-bfloat16?",
    "tests/test_mosaic_gpu.py::test_dispatch_prefers_mosaic_on_hopper",
    "tests/test_mosaic_gpu.py::test_wy_interpret_matches_float64?gdn-save-strong-100-10-64-bfloat16?",
    "tests/test_mosaic_gpu.py::test_wy_refused_where_not_implemented",
    "tests/test_mosaic_gpu_vector.py::test_vector_supports_says_why_not",
    "tests/test_mosaic_gpu_vector.py::test_vector_dispatch_on_hopper",
    "tests/test_mosaic_gpu_vector.py::test_vector_kernels_lower_for_cuda?kda-False-bfloat16-64?",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier, run by `bash scripts/test.sh` "
                                       "(assigned from FAST in tests/conftest.py)")
    config.addinivalue_line("markers", "key_rows: tests/test_mosaic_gpu.py runs the fused forward and the "
                                       "reverse state pass in their key-rows layout (else the value-rows one)")
    config.addinivalue_line("markers", "key_rows_forward: tests/test_mosaic_gpu.py runs the fused forward "
                            "in the key-rows layout and the reverse state pass in value rows")


def _whole_suite(config) -> bool:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return all(os.path.abspath(a) == tests_dir for a in config.args) or not config.args


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    import fnmatch

    fast = pytest.mark.fast
    matched = set()
    for item in items:
        hits = [p for p in FAST if fnmatch.fnmatchcase(item.nodeid, p)]
        if hits:
            item.add_marker(fast)
            matched.update(hits)
    if _whole_suite(config) and len({i.nodeid.split("::")[0] for i in items}) > 1:
        unmatched = [p for p in FAST if p not in matched]
        if unmatched:
            raise pytest.UsageError(f"tests/conftest.py FAST: no test matches {unmatched}")
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow test: set RUN_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------------------------
# An oracle written without JAX: the §2 recurrence token by token in NumPy float64. It shares no
# code with rewy_jax (not even l2norm, scale or gate clamping), so a bug in the common front end
# (ops._prepare) or in reference.py cannot hide behind "both paths agree".
# ----------------------------------------------------------------------------------------------
def numpy_recurrence(q, k, v, g, b, w, *, scale=None, initial_state=None, use_qk_l2norm=False,
                     cu_seqlens=None):
    """o [B, T, H, V], final [B or N, H, K, V] of S_t = (I − k eᵀ) Diag(α) S + k zᵀ, o = scale Sᵀq.

    g: None, [B,T,H] or [B,T,H,K]; b: [B,T,H] or [B,T,H,K]; w: [B,T,H] or [B,T,H,V].
    """
    f = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    q, k, v, g, b, w = map(f, (q, k, v, g, b, w))
    B, T, H, K = q.shape
    V = v.shape[-1]
    if use_qk_l2norm:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        segs = [(bi, 0, T, bi) for bi in range(B)]
        n_states = B
    else:
        cu = np.asarray(cu_seqlens)
        segs = [(0, int(cu[i]), int(cu[i + 1]), i) for i in range(len(cu) - 1)]
        n_states = len(cu) - 1
    h0 = (np.zeros((n_states, H, K, V)) if initial_state is None
          else np.asarray(initial_state, np.float64))
    o = np.zeros((B, T, H, V))
    final = np.zeros((n_states, H, K, V))
    for bi, t0, t1, si in segs:
        for h in range(H):
            S = h0[si, h].copy()
            for t in range(t0, t1):
                if g is not None:
                    a = np.exp(g[bi, t, h])  # scalar or [K]; exp(-inf) = 0
                    S = (a[:, None] if np.ndim(a) else a) * S
                bb = b[bi, t, h]
                ww = w[bi, t, h]
                e = bb * k[bi, t, h]
                z = ww * v[bi, t, h]
                S = S + np.outer(k[bi, t, h], z - e @ S)
                o[bi, t, h] = scale * (S.T @ q[bi, t, h])
            final[si, h] = S
    return o, final


@pytest.fixture
def np_recurrence():
    return numpy_recurrence


def _check_report(report: dict, *, label: str = ""):
    """Every entry (ratio, tolerance) of an accuracy report must be finite and within tolerance."""
    bad = {k: v for k, v in report.items() if not (np.isfinite(v[0]) and v[0] <= v[1])}
    assert not bad, f"{label}: ratios over tolerance (ratio, tol): {bad}; full report: {report}"
    return report


@pytest.fixture
def check_report():
    return _check_report


def rel_err(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (inf for NaN/Inf in x)."""
    x = np.asarray(np.asarray(x, np.float32) if getattr(x, "dtype", None) == "bfloat16" else x,
                   np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / den) if den > 0 else float(np.linalg.norm(x))


@pytest.fixture
def rel():
    return rel_err
