"""Run every op forward and backward and print its accuracy against the float64 recurrence.

    python examples/accuracy_demo.py                 # xla backend, fp32 and bf16, CPU-sized
    python examples/accuracy_demo.py --backend pallas_gpu --T 512 --K 128 --V 128

For each op (DeltaNet, GDN, KDA, GDN2) and input dtype it draws fresh random inputs (β, b in
[0, 2], an initial state, T not a multiple of the chunk, q/k L2-normalised), computes the output,
the final state and the gradient of every input under a random cotangent, and prints
``‖x − ref‖_rms / ‖ref‖_rms`` against autodiff of the float64 token recurrence, with the
thresholds of rewy-math §8 (fp32 ≤ 1e-4; bf16: o/state 5e-3, dq/dk/dv/dh0 1e-2, gates 2e-2).
Exits non-zero if any ratio is over its threshold.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

from rewy_jax.testing import OPS, accuracy_report, make_inputs  # noqa: E402

COLUMNS = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "db", "dw", "dinitial_state"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="xla")
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=100)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--K", type=int, default=32)
    p.add_argument("--V", type=int, default=48)
    p.add_argument("--chunk-size", type=int, default=32)
    p.add_argument("--decay", default="normal", choices=["normal", "strong", "none"])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    print(f"rewy-jax accuracy vs the float64 token recurrence — backend={a.backend}, "
          f"B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} C={a.chunk_size}, decay={a.decay}, "
          f"device={jax.devices()[0].platform}")
    header = "| op | dtype | " + " | ".join(COLUMNS) + " | time (s) |"
    print(header)
    print("|" + "---|" * (len(COLUMNS) + 3))
    failed = []
    for op in a.ops.split(","):
        for dt in a.dtypes.split(","):
            t0 = time.perf_counter()
            inp = make_inputs(op, a.B, a.T, a.H, a.K, a.V, dtype=jnp.dtype(dt), decay=a.decay,
                              seed=a.seed)
            rep = accuracy_report(op, inp, backend=a.backend, chunk_size=a.chunk_size)
            cells = []
            for c in COLUMNS:
                if c not in rep:
                    cells.append("—")
                    continue
                r, tol = rep[c]
                ok = r <= tol
                cells.append(f"{r:.1e}" + ("" if ok else " ✗"))
                if not ok:
                    failed.append(f"{op}/{dt}/{c}: {r:.2e} > {tol:.0e}")
            print(f"| {op} | {dt} | " + " | ".join(cells) + f" | {time.perf_counter() - t0:.1f} |")
    if failed:
        print("\nover threshold:\n  " + "\n  ".join(failed))
        return 1
    print("\nall outputs and gradients within rewy-math §8 thresholds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
