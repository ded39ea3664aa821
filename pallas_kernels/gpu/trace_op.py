"""Where one public op's fwd+bwd spends its GPU time: every kernel and XLA fusion, from a trace.

    PYTHONPATH=$PWD python3 pallas_kernels/gpu/trace_op.py [--ops deltanet,gdn,kda,gdn2]
        [--shape 2x4096x16x128] [--gate-lower-bound -5] [--iters 5] [--out-dir DIR]

For each op: ``jax.grad`` of Σ o·dO through the public op (``backend="pallas_gpu"``, bf16 inputs,
as the benchmark calls it), warmed up, then ``--iters`` calls under ``jax.profiler.trace``. The
Perfetto trace is summed per device event name (our kernels are named ``rewy_*``; the rest is
XLA glue: the e = b⊙k products, gate cumsums, padding, dβ/dg reductions) and printed as ms per
call, so the gap between ``profile_kernels.py``'s kernels and the benchmark's op time gets names.
Writes ``<out-dir>/trace-<op>.txt`` (the table; with ``--keep-traces`` also the raw Perfetto trace).
Kernel-work tooling, not the peer benchmark (benchmarks/).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp

from rewy_jax import testing

F32 = jnp.float32


def device_times(trace_path: str, iters: int) -> tuple[dict, str]:
    """{event name: ms per call} over the device (non-host) tracks of a Perfetto trace, and the
    track names it read."""
    with gzip.open(trace_path) as fh:
        t = json.load(fh)
    events = t["traceEvents"] if isinstance(t, dict) else t
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, name in procs.items() if "host" not in name.lower()}
    if not device:  # CPU run: everything is on the host track
        device = set(procs)
    # A GPU's process holds the kernels on its "Stream #…" threads and the same time again as
    # XLA op/module spans on other threads: count the streams only (all threads if none).
    streams = {key for key, name in threads.items() if key[0] in device and name.startswith("Stream")}
    keep = (lambda e: (e.get("pid"), e.get("tid")) in streams) if streams else (
        lambda e: e.get("pid") in device)
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and keep(e):
            totals[e["name"]] += e.get("dur", 0.0) / 1e3 / iters  # µs -> ms per call
    where = sorted({threads.get(k, "") for k in streams}) if streams else sorted(
        procs[p] for p in device)
    return dict(totals), ", ".join(where)


def trace_op(op, shape, gate_lower_bound=None, iters=5, out_dir=".", interpret=False,
             keep_trace=False):
    """Trace ``iters`` fwd+bwd calls of ``op``; returns (table text, {name: ms per call})."""
    B, T, H, D = shape
    inp = testing.make_inputs(op, B, T, H, D, D, dtype=jnp.bfloat16, initial_state=False)
    dO = jax.random.normal(jax.random.PRNGKey(7), inp["v"].shape, F32).astype(jnp.bfloat16)
    kw = dict(backend="pallas_gpu", interpret=interpret)
    if gate_lower_bound is not None:
        kw["gate_lower_bound"] = gate_lower_bound

    def loss(diff):
        o, _ = testing.run_op(op, diff, **kw)
        return jnp.sum(o.astype(F32) * dO.astype(F32))

    f = jax.jit(jax.value_and_grad(loss))  # grad alone would drop the output kernel as dead code
    jax.block_until_ready(f(inp))
    jax.block_until_ready(f(inp))
    tmp = tempfile.mkdtemp(prefix="rewy-trace-")
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
        for _ in range(iters):
            jax.block_until_ready(f(inp))
    path = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    tag = op + ("" if gate_lower_bound is None else f"-g{gate_lower_bound:g}")
    if keep_trace:  # the device tool returns at most 8 files: raw traces only on request
        shutil.copy(path, os.path.join(out_dir, f"trace-{tag}.json.gz"))
    times, tracks = device_times(path, iters)
    ours = sum(v for k, v in times.items() if k.startswith("rewy_"))
    glue = {k: v for k, v in times.items() if not k.startswith("rewy_")}
    lines = [f"{tag} {shape} bf16 fwd+bwd, ms per call over {iters} calls (tracks: {tracks})",
             f"  our kernels {ours:.3f}  |  everything else {sum(glue.values()):.3f}"]
    for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[:30]:
        lines.append(f"  {ms:8.3f}  {name[:100]}")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, f"trace-{tag}.txt"), "w") as fh:
        fh.write(text + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return text, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="deltanet,gdn,kda,gdn2")
    ap.add_argument("--shape", default="2x4096x16x128")
    ap.add_argument("--gate-lower-bound", type=float, default=None,
                    help="declare g ≥ this for the vector-gate ops (kda, gdn2)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--keep-traces", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    os.makedirs(a.out_dir, exist_ok=True)
    for op in a.ops.split(","):
        bound = a.gate_lower_bound if op in ("kda", "gdn2") else None
        text, _ = trace_op(op, shape, bound, a.iters, a.out_dir, a.interpret, a.keep_traces)
        print(text, flush=True)


if __name__ == "__main__":
    main()
