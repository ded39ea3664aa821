"""Shared helpers of the multi-device test modules (run with 8 fake CPU devices)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rewy_jax import testing

N_DEVICES = 8


def require_devices(n: int = N_DEVICES):
    if jax.device_count() < n:
        pytest.fail(f"needs {n} devices, found {jax.device_count()}: run through "
                    "tests/test_multidevice.py or set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8")


def auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def rel(x, ref) -> float:
    """‖x − ref‖ / ‖ref‖ (Frobenius) in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def op_args(op, inputs):
    spec = testing.OPS[op]
    return [inputs["q"], inputs["k"], inputs["v"]] + [inputs[n] for n in spec.gates]


def assert_close(got: dict, want: dict, tol: float, label: str):
    errs = {k: rel(got[k], want[k]) for k in want}
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"{label}: relative errors over {tol}: {bad} (all: {errs})"
