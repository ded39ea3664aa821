"""Why our kernels take the time they take: Nsight Compute counters per kernel, as one table.

    # on the GPU machine (ncu 2025.3 is installed there): profile one fwd+bwd of an op
    ncu --clock-control none --kernel-name regex:rewy_ --launch-count 12 --csv \\
        --metrics $(python3 -m tools.stall_report metrics) --log-file ncu.csv \\
        python3 -m tools.stall_report run deltanet 2x4096x16x128
    python3 -m tools.stall_report table ncu.csv

``run`` calls ``jax.grad`` of Σ o·dO through the public op once (bf16 inputs, ``backend=
"pallas_gpu"``, as the benchmark calls it, or the backend given after the shape), so ncu sees
each of our kernels once (``rewy_*`` on pallas_gpu; on mosaic_gpu each kernel is named after its
body, e.g. ``regex:chunk_inverse_body``).
``table`` pivots ncu's long CSV into one row per kernel: time, registers, achieved occupancy and
what limits it, throughput of the SMs, DRAM and tensor pipes, and the warp stall reasons that
dominate (cycles stalled per issued instruction). Kernel-work tooling, not a benchmark: ncu
replays each kernel several times, so its times are for comparing kernels within one run.
"""

from __future__ import annotations

import csv
import sys

STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "wait", "math_pipe_throttle",
          "mio_throttle", "lg_throttle", "not_selected", "selected", "dispatch_stall",
          "no_instruction", "branch_resolving", "membar", "tex_throttle", "drain",
          "imc_miss", "sleeping", "misc")
COLUMNS = {  # table column -> ncu metric
    "us": "gpu__time_duration.sum",
    "regs": "launch__registers_per_thread",
    "threads": "launch__block_size",
    "grid": "launch__grid_size",
    "smem_KB": "launch__shared_mem_per_block_dynamic",
    "occ%": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "lim_reg": "launch__occupancy_limit_registers",
    "lim_smem": "launch__occupancy_limit_shared_mem",
    "sm%": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram%": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor%": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "ipc": "sm__inst_executed.avg.per_cycle_active",
    "inst_M": "smsp__inst_executed.sum",
}
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def metrics():
    return ",".join(list(COLUMNS.values()) + [STALL_METRIC.format(s) for s in STALLS])


def run(op, shape, backend="pallas_gpu"):
    import jax
    import jax.numpy as jnp

    from rewy_jax import testing

    B, T, H, D = (int(x) for x in shape.split("x"))
    inp = testing.make_inputs(op, B, T, H, D, D, dtype=jnp.bfloat16, initial_state=False)
    dO = jax.random.normal(jax.random.PRNGKey(1), (B, T, H, D), jnp.float32).astype(jnp.bfloat16)

    def loss(x):
        o = testing.run_op(op, x, backend=backend)[0]
        return jnp.sum(o.astype(jnp.float32) * dO.astype(jnp.float32))

    jax.block_until_ready(jax.jit(jax.grad(loss))(inp))


def table(path):
    rows, order = {}, []
    with open(path) as fh:
        lines = [ln for ln in fh if ln.startswith('"')]  # drop ncu's ==PROF== lines
    for rec in csv.DictReader(lines):
        key = (rec["ID"], rec["Kernel Name"].split("(")[0])
        if key not in rows:
            rows[key] = {}
            order.append(key)
        val = rec["Metric Value"].replace(",", "")
        try:
            v = float(val)
        except ValueError:
            continue
        unit = rec.get("Metric Unit", "")
        name = rec["Metric Name"]
        if name == COLUMNS["us"]:  # ncu 2025.3 writes "ns" (older: "nsecond")
            v *= {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
        if name == COLUMNS["smem_KB"]:  # "byte/block"
            v = v / 1024 if unit.startswith("byte") else v
        if name == COLUMNS["inst_M"]:
            v = v / 1e6
        rows[key][name] = v
    head = ["kernel"] + list(COLUMNS) + ["top stalls (cycles per issue)"]
    out = [" | ".join(head), " | ".join("---" for _ in head)]
    for key in order:
        r = rows[key]
        cells = [key[1]] + [f"{r[m]:.3g}" if m in r else "" for m in COLUMNS.values()]
        st = sorted(((r.get(STALL_METRIC.format(s), 0.0), s) for s in STALLS), reverse=True)
        cells.append(", ".join(f"{s} {v:.2g}" for v, s in st[:4] if v > 0))
        out.append(" | ".join(cells))
    print("\n".join(out))


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "metrics":
        print(metrics())
    elif cmd == "run" and len(sys.argv) in (4, 5):
        run(*sys.argv[2:])
    elif cmd == "table" and len(sys.argv) == 3:
        table(sys.argv[2])
    else:
        sys.exit(__doc__)
