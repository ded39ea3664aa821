"""Every op on every backend, once, at a small size: the fast tier's coverage of the kernels.

One test, parametrised over the four ops and the backends — the chunked XLA path, the Pallas
GPU (Triton) kernels and the Pallas TPU kernels, each Pallas backend interpreted on a CPU and
compiled on its own device (skipped elsewhere) — checks the output, the final state and every
gradient (q, k, v, each gate, the initial state) against autodiff of the float64 token
recurrence, within the fp32 bound (1e-4, docs/accuracy.md). T = 24 is not a multiple of the
chunk (16), so padding and a partial last chunk are exercised, and an initial state is passed.
The deeper per-backend suites (test_pallas_gpu.py, test_pallas_tpu.py, test_ops_accuracy.py)
run in the full tier.
"""

from __future__ import annotations

import jax
import pytest

from rewy_jax import testing

OPS = ("deltanet", "gdn", "kda", "gdn2")
# (backend, interpret, the device it needs): the kernels written once, run interpreted on a CPU
# and compiled on their own device.
BACKENDS = [
    ("xla", False, None),
    ("pallas_gpu", True, "cpu"),
    ("pallas_tpu", True, "cpu"),
    ("pallas_gpu", False, "gpu"),
    ("pallas_tpu", False, "tpu"),
]


@pytest.mark.parametrize("backend,interpret,device", BACKENDS,
                         ids=[f"{b}-{'interpret' if i else 'compiled'}" for b, i, _ in BACKENDS])
@pytest.mark.parametrize("op", OPS)
def test_every_op_on_every_backend(op, backend, interpret, device):
    if device is not None and jax.default_backend() != device:
        pytest.skip(f"needs a {device.upper()} (this device: {jax.default_backend()})")
    inputs = testing.make_inputs(op, 1, 24, 1, 16, 16, seed=7)
    report = testing.accuracy_report(op, inputs, backend=backend, chunk_size=16,
                                     **({"interpret": True} if interpret else {}))
    expected = {"o", "final_state", "dq", "dk", "dv", "dinitial_state"}
    assert expected <= set(report), report  # every output and gradient was compared
    bad = {n: f"{r:.2e} > {tol:.0e}" for n, (r, tol) in report.items() if not r <= tol}
    assert not bad, (op, backend, bad)
