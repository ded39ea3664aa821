"""The benchmark's accuracy check for our Pallas GPU kernels without a GPU (interpret mode, CPU).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python -m benchmarks.interpret_accuracy gdn2 16 128 [--T 512] [--tf32 truncate]
        [--kernel-config backward_native_pass_dots=false]

Same inputs, float64 reference process and thresholds as ``benchmarks/accuracy.py`` uses at an
accuracy shape (1, T, H, D); ours (ReWY, policy recompute) run through the Pallas interpreter,
once with the backward's stored tensors in bf16 (the default, ``KernelConfig
.backward_low_precision``) and once all in fp32, so that the cost of that storage is read
off one table (and, with ``--kernel-config``, a third row with other kernel settings). The interpreter
evaluates the same kernel code with exact fp32 dots where the GPU uses TF32, so this checks the
algorithm and the storage precision, not the TF32 rounding — unless ``--tf32`` rounds the fp32
operands of every product to TF32 first (``KernelConfig.tf32_emulation``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks import accuracy
from benchmarks.impls import Ours
from benchmarks.shapes import Shape


class OursInterpret(Ours):
    def kwargs(self, op):
        return dict(super().kwargs(op), interpret=True)


def reference(op: str, shape: Shape):
    """(inputs, cotangents, float64 reference) of the benchmark's accuracy check at ``shape``."""
    with tempfile.TemporaryDirectory() as d:
        refs = accuracy.ReferenceJobs(Path(d))  # the benchmark's inputs and reference process
        refs.add(0, op, shape)
        refs.start()
        try:
            ref = refs.result(op, shape, timeout_s=3600)
        finally:
            refs.stop()
        if ref is None:
            raise RuntimeError("the float64 reference failed:\n" + refs.log.read_text()[-2000:])
    inp, cts = refs.jobs[refs.key(op, shape)]
    return inp, cts, ref


def check(op: str, H: int, D: int, T: int = 512, tune: dict | None = None,
          gate_bound: float | None = None, base: dict | None = None) -> dict:
    """{"bf16-backward" | "fp32-backward" [| "bf16-backward + tune"]: accuracy.compare's report}
    at (1, T, H, D); ``tune``: KernelConfig overrides for a third row; ``base``: overrides
    every row starts from (at D ≤ 32 the default ``narrow_keys`` runs 16-bit calls on fp32
    kernels: {"narrow_keys": 0} checks the 16-bit ones there); ``gate_bound``: declare g ≥ it
    (vector gates), as the benchmark's "g≥-5" rows do."""
    inp, cts, ref = reference(op, Shape(1, T, H, D))
    rows = {"bf16-backward": {}, "fp32-backward": {"backward_low_precision": ()}}
    if tune:
        rows["bf16-backward + " + " ".join(f"{k}={v}" for k, v in tune.items())] = tune
    out = {}
    for name, settings in rows.items():  # each row: the caller's base, then its own
        impl = OursInterpret("pallas_gpu", "rewy", "recompute", gate_bound,
                             kernel_config={**(base or {}), **settings})
        out[name] = accuracy.compare(*accuracy.run_impl(impl, op, inp, cts), ref)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op")
    ap.add_argument("H", type=int)
    ap.add_argument("D", type=int)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--kernel-config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a KernelConfig override for a third row; repeatable")
    ap.add_argument("--tf32", choices=("truncate", "round"), default=None,
                    help="multiply fp32 operands as TF32 (as the GPU does for 16-bit inputs): "
                         "their 13 low mantissa bits truncated or rounded")
    ap.add_argument("--gate-bound", type=float, default=None,
                    help="declare g ≥ this (kda, gdn2): the centred diagonal blocks")
    a = ap.parse_args(argv)
    from benchmarks.run import kernel_overrides

    tune = kernel_overrides(None, a.kernel_config)
    t0 = time.time()
    reports = check(a.op, a.H, a.D, a.T, tune, a.gate_bound,
                    base={"tf32_emulation": a.tf32} if a.tf32 else None)
    tf32 = (f" (TF32 {a.tf32})" if a.tf32 else "") + (
        "" if a.gate_bound is None else f" g≥{a.gate_bound:g}")
    for name, rep in reports.items():
        print(f"{a.op} (1, {a.T}, {a.H}, {a.D}) {name}{tf32}: {rep['status']} " + " ".join(
            f"{n}={r:.2e}/{t:.0e}" for n, (r, t) in rep["ratios"].items()), flush=True)
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
