"""Per-kernel GPU times of flash-linear-attention's chunked ops: the peer's breakdown, to set
beside ours from ``tools/profile_kernels.py`` (a measurement tool, not a benchmark).

    python3 -m benchmarks.fla_kernel_times --ops deltanet,kda --shape 2x4096x16x128 [--reps 20]

For each op, the forward and fwd+bwd (backward of Σ o·dO) on the inputs of the benchmark
(``benchmarks.inputs.device_inputs``) run ``reps`` times eagerly under ``torch.profiler``; each
CUDA kernel's summed device time divided by ``reps`` is printed (ms per call), largest first,
with the total. Needs torch and fla-core (``benchmarks/gpu_run.sh`` installs the wheels and
FLA's autotune cache; the first calls are warm-up, so autotuning is not timed).
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from benchmarks.inputs import device_inputs, gate_names
from benchmarks.impls import TorchFla


def _torch_inputs(op, B, T, H, D):
    import torch

    x = device_inputs(op, B, T, H, D)
    return {n: torch.tensor(np.asarray(x[n], np.float32), device="cuda").to(
        torch.bfloat16 if n in ("q", "k", "v") else torch.float32).requires_grad_(True)
        for n in ("q", "k", "v") + tuple(gate_names(op))}


def kernel_times(op, shape, reps=20):
    """{"fwd": [(kernel, ms per call)], "fwd+bwd": [...]} for FLA's ``op`` at ``shape``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t = _torch_inputs(op, *shape)
    fla = TorchFla(graph=False)
    do = torch.randn_like(t["v"])

    def fwd():
        return fla.call(op, t["q"], t["k"], t["v"], {n: t[n] for n in gate_names(op)}, False)[0]

    def fwdbwd():
        o = fwd()
        torch.autograd.grad(o, [t[n] for n in t], do)

    out = {}
    for name, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        for _ in range(3):  # warm-up (autotune, compile)
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                f()
            torch.cuda.synchronize()
        per = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name] += ev.device_time_total / 1e3 / reps  # µs -> ms per call
        out[name] = per.most_common()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="deltanet")
    ap.add_argument("--shape", default="2x4096x16x128")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    for op in a.ops.split(","):
        for name, rows in kernel_times(op, shape, a.reps).items():
            print(f"FLA {op} {a.shape} {name}: total {sum(ms for _, ms in rows):.3f} ms")
            for kernel, ms in rows:
                print(f"  {ms:8.4f}  {kernel[:100]}")


if __name__ == "__main__":
    main()
