"""Every op on every backend, once, at a small size: the fast tier's coverage of the kernels.

One test, parametrised over the four ops and the three implementations that run on a CPU — the
chunked XLA path, the Pallas GPU (Triton) kernels in interpret mode and the Pallas TPU kernels in
the TPU interpreter — checks the output, the final state and every gradient (q, k, v, each gate,
the initial state) against autodiff of the float64 token recurrence, within rewy-math's fp32
bound (1e-4). T = 24 is not a multiple of the chunk (16), so padding and a partial last chunk are
exercised, and an initial state is passed. The deeper per-backend suites (test_pallas_gpu.py,
test_pallas_tpu.py, test_ops_accuracy.py) run in the full tier.
"""

from __future__ import annotations

import jax
import pytest

from rewy_jax import testing

OPS = ("deltanet", "gdn", "kda", "gdn2")
# backend name → extra keyword arguments of the op on a CPU
BACKENDS = {
    "xla": {},
    "pallas_gpu": {"interpret": True},
    "pallas_tpu": {"interpret": True},
}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode: a CPU test")
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("op", OPS)
def test_every_op_on_every_backend(op, backend):
    inputs = testing.make_inputs(op, 1, 24, 1, 16, 16, seed=7)
    report = testing.accuracy_report(op, inputs, backend=backend, chunk_size=16,
                                     **BACKENDS[backend])
    expected = {"o", "final_state", "dq", "dk", "dv", "dinitial_state"}
    assert expected <= set(report), report  # every output and gradient was compared
    bad = {n: f"{r:.2e} > {tol:.0e}" for n, (r, tol) in report.items() if not r <= tol}
    assert not bad, (op, backend, bad)
