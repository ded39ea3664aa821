"""The float64 token-recurrence reference, computed in a separate CPU process.

The benchmark process keeps x64 off (it would change the dtypes every timed implementation
traces with), so the oracle runs here: ``python -m benchmarks.reference_job JOBDIR`` reads every
``job_*.npz`` (inputs and cotangents) in JOBDIR in name order and writes ``ref_*.npz`` beside it
(o, final_state and every gradient, float64) via ``rewy_jax.testing.loss_and_grads`` with
``backend="reference"``. Each result appears atomically (written then renamed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def compute(op: str, inputs: dict, cts: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from rewy_jax import testing

    jax.config.update("jax_enable_x64", True)
    inp = {k: jnp.asarray(v, jnp.float64) for k, v in inputs.items()}
    c = {k: jnp.asarray(v, jnp.float64) for k, v in cts.items()}
    fn = jax.jit(lambda i, c: testing.loss_and_grads(op, i, c, backend="reference",
                                                     use_qk_l2norm=False))
    o, s, grads = fn(inp, c)
    out = {"o": o, "final_state": s}
    out.update(grads)
    import numpy as np
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def split_job(data) -> tuple[str, dict, dict]:
    op = str(data["op"])
    inputs = {k[3:]: data[k] for k in data.files if k.startswith("in_")}
    cts = {k[3:]: data[k] for k in data.files if k.startswith("ct_")}
    return op, inputs, cts


def main(jobdir: str) -> int:
    import numpy as np

    d = Path(jobdir)
    for job in sorted(d.glob("job_*.npz")):
        out = d / ("ref_" + job.name[4:])
        if out.exists():
            continue
        t0 = time.time()
        with np.load(job) as data:
            op, inputs, cts = split_job(data)
        ref = compute(op, inputs, cts)
        tmp = out.with_suffix(".tmp.npz")
        np.savez(tmp, **ref)
        os.replace(tmp, out)
        print(f"[reference] {job.name}: {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main(sys.argv[1]))
