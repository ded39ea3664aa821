"""Accuracy of every timed implementation against the float64 token recurrence (rewy-math §8).

The reference runs in a child CPU process (:mod:`benchmarks.reference_job`) on a reduced shape
with the benchmark shape's (H, D) (B = 1, T = 512): the float64 recurrence at the benchmark sizes
would take far too long. Each implementation computes o, the final state and the gradients of
⟨o, dO⟩ + ⟨final, dS⟩ on the same (bf16-rounded) inputs, and every tensor is compared by
``rewy_jax.testing.ratio`` against ``rewy_jax.testing.tolerance`` (bf16 thresholds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import inputs as binputs
from rewy_jax import testing


class ReferenceJobs:
    """Writes one job per (op, accuracy shape) and runs the float64 reference in a child process."""

    def __init__(self, workdir: Path):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jobs = {}  # key -> (inputs, cts)
        self.proc = None
        self.log = self.dir / "reference.log"

    @staticmethod
    def key(op, acc_shape) -> str:
        return f"{op}_{acc_shape.key()}"

    def add(self, order: int, op: str, acc_shape, seed: int = 0):
        k = self.key(op, acc_shape)
        if k in self.jobs:
            return
        inp = binputs.accuracy_inputs(op, *acc_shape[:3], acc_shape.D, seed=seed)
        cts = binputs.accuracy_cotangents(inp, seed=seed + 1)
        self.jobs[k] = (inp, cts)
        payload = {"op": np.array(op)}
        payload.update({"in_" + n: v for n, v in inp.items()})
        payload.update({"ct_" + n: v for n, v in cts.items()})
        np.savez(self.dir / f"job_{order:03d}_{k}.npz", **payload)

    def start(self):
        env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = (env["PYTHONPATH"] + os.pathsep if env.get("PYTHONPATH") else "") + root
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.reference_job", str(self.dir)],
                                     env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def result(self, op, acc_shape, timeout_s: float) -> dict | None:
        k = self.key(op, acc_shape)
        files = list(self.dir.glob(f"ref_*_{k}.npz"))
        t_end = time.time() + timeout_s
        while not files:
            if self.proc is not None and self.proc.poll() is not None:
                files = list(self.dir.glob(f"ref_*_{k}.npz"))
                break
            if time.time() > t_end:
                return None
            time.sleep(0.2)
            files = list(self.dir.glob(f"ref_*_{k}.npz"))
        if not files:
            return None
        with np.load(files[0]) as d:
            return {n: d[n] for n in d.files}

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


def compare(o, s, grads: dict, ref: dict, dtype=jnp.bfloat16) -> dict:
    """Ratios of every output/gradient vs the reference; status pass / FAIL / fwd-only."""
    ratios = {}
    names = ["o", "final_state"] + sorted(k for k in grads if k != "error")
    vals = {"o": o, "final_state": s, **{k: v for k, v in grads.items() if k != "error"}}
    for n in names:
        if n not in ref:
            continue
        ratios[n] = (testing.ratio(np.asarray(jnp.asarray(vals[n], jnp.float32)), ref[n]),
                     testing.tolerance(n, dtype))
    failed = [n for n, (r, t) in ratios.items() if not (r <= t)]
    worst = max(ratios, key=lambda n: ratios[n][0] / ratios[n][1]) if ratios else None
    out = {"ratios": {n: [float(r), float(t)] for n, (r, t) in ratios.items()}, "failed": failed,
           "worst_name": worst, "worst_ratio": ratios[worst][0] if worst else None,
           "worst_tol": ratios[worst][1] if worst else None}
    if "error" in grads:
        out["status"] = ("fwd pass, bwd refused" if not failed else "FAIL")
        out["reason"] = grads["error"]
    else:
        out["status"] = "pass" if not failed else "FAIL"
    return out


def _jax_args(inputs_np, cts_np):
    inp = {n: jnp.asarray(v, jnp.bfloat16 if n in ("q", "k", "v") else jnp.float32)
           for n, v in inputs_np.items()}
    cts = {n: jnp.asarray(v, jnp.float32) for n, v in cts_np.items()}
    return inp, cts


def prepare(impl, op: str, inputs_np: dict, cts_np: dict):
    """Compile a JAX implementation's accuracy step (thread-safe); None for PyTorch ones."""
    if getattr(impl, "framework", "jax") == "torch":
        return None
    inp, cts = _jax_args(inputs_np, cts_np)
    return jax.jit(lambda i, c: impl.accuracy_grads(op, i, c)).lower(inp, cts).compile()


def run_impl(impl, op: str, inputs_np: dict, cts_np: dict, compiled=None) -> tuple:
    """(o, final, grads) of one implementation on the accuracy inputs (numpy in, numpy out)."""
    if getattr(impl, "framework", "jax") == "torch":
        return impl.accuracy_grads(op, inputs_np, cts_np)
    if compiled is None:
        compiled = prepare(impl, op, inputs_np, cts_np)
    o, s, grads = compiled(*_jax_args(inputs_np, cts_np))
    return (np.asarray(o.astype(jnp.float32)), np.asarray(s, np.float32),
            {k: np.asarray(jnp.asarray(v, jnp.float32)) for k, v in grads.items()})
