"""Where one public op's fwd+bwd spends its GPU time: every kernel and XLA fusion, from a trace.

    PYTHONPATH=$PWD python3 pallas_kernels/gpu/trace_op.py [--ops deltanet,gdn,kda,gdn2]
        [--shape 2x4096x16x128] [--gate-lower-bound -5] [--iters 5] [--out-dir DIR]
        [--variants base,wut,w2]

For each op: ``jax.grad`` of Σ o·dO through the public op (``backend="pallas_gpu"``, bf16 inputs,
as the benchmark calls it), warmed up, then ``--iters`` calls under ``jax.profiler.trace``. The
Perfetto trace is summed per device event name (our kernels are named ``rewy_*``; the rest is
XLA glue: the e = b⊙k products, gate cumsums, padding, dβ/dg reductions) and printed as ms per
call, so the gap between ``profile_kernels.py``'s kernels and the benchmark's op time gets names.
Writes ``<out-dir>/trace-<op>.txt`` (the table; with ``--keep-traces`` also the raw Perfetto trace).

``--variants`` (names of ``profile_kernels.VARIANTS``) traces the op once per variant and prints
one table of device ms per kernel, variants side by side, with the op's wall time per call. This
is the way to compare variants of the small kernels: ``profile_kernels.py`` times each kernel as
a host loop of jitted calls, whose dispatch sets a floor near 0.1 ms at the anchor (profile-11:
wu 0.101 ms there against 0.065 by ncu, bwd_dlam 0.114 against 0.061), so variants of a
60-µs kernel read the same there. Variants named like ``centred`` declare g ≥ −5 for KDA/GDN2.
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
import time

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
             keep_trace=False, tag_suffix="", wall_iters=0):
    """Trace ``iters`` fwd+bwd calls of ``op``; returns (table text, {name: ms per call}), with
    "WALL" the wall ms per call of ``wall_iters`` more calls when that is > 0."""
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
    tag = op + ("" if gate_lower_bound is None else f"-g{gate_lower_bound:g}") + tag_suffix
    if keep_trace:  # the device tool returns at most 8 files: raw traces only on request
        shutil.copy(path, os.path.join(out_dir, f"trace-{tag}.json.gz"))
    times, tracks = device_times(path, iters)
    if wall_iters:  # the op's wall time per call, back to back (what the benchmark sees)
        t0 = time.perf_counter()
        out = None
        for _ in range(wall_iters):
            out = f(inp)
        jax.block_until_ready(out)
        times["WALL"] = 1e3 * (time.perf_counter() - t0) / wall_iters
    ours = sum(v for k, v in times.items() if k.startswith("rewy_"))
    glue = {k: v for k, v in times.items() if not k.startswith("rewy_") and k != "WALL"}
    lines = [f"{tag} {shape} bf16 fwd+bwd, ms per call over {iters} calls (tracks: {tracks})",
             f"  our kernels {ours:.3f}  |  everything else {sum(glue.values()):.3f}"]
    for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[:30]:
        lines.append(f"  {ms:8.3f}  {name[:100]}")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, f"trace-{tag}.txt"), "w") as fh:
        fh.write(text + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return text, times


def compare_table(op, shape, results):
    """Device ms per kernel (rows) under each variant (columns), from {variant: times}."""
    names = sorted({k for t in results.values() for k in t if k.startswith("rewy_")})
    cols = list(results)
    lines = [f"{op} {'x'.join(map(str, shape))} bf16 fwd+bwd, device ms per call",
             "| kernel | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def row(label, get):
        lines.append(f"| {label} | " + " | ".join(
            "—" if get(results[c]) is None else f"{get(results[c]):.4f}" for c in cols) + " |")

    for n in names:
        row(n, lambda t, n=n: t.get(n))
    row("our kernels", lambda t: sum(v for k, v in t.items() if k.startswith("rewy_")))
    row("XLA glue", lambda t: sum(v for k, v in t.items()
                                  if not k.startswith("rewy_") and k != "WALL"))
    row("wall per call", lambda t: t.get("WALL"))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="deltanet,gdn,kda,gdn2")
    ap.add_argument("--shape", default="2x4096x16x128")
    ap.add_argument("--gate-lower-bound", type=float, default=None,
                    help="declare g ≥ this for the vector-gate ops (kda, gdn2)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--keep-traces", action="store_true")
    ap.add_argument("--variants", default=None,
                    help="profile_kernels.VARIANTS names: one trace each, compared in one table")
    ap.add_argument("--wall-iters", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    os.makedirs(a.out_dir, exist_ok=True)
    from pallas_kernels.gpu.profile_kernels import BOUNDED_VARIANTS, with_variant

    for op in a.ops.split(","):
        vector = op in ("kda", "gdn2")
        bound = a.gate_lower_bound if vector else None
        if not a.variants:
            text, _ = trace_op(op, shape, bound, a.iters, a.out_dir, a.interpret, a.keep_traces)
            print(text, flush=True)
            continue
        results = {}
        for var in a.variants.split(","):
            b = -5.0 if vector and var in BOUNDED_VARIANTS else bound
            t0 = time.perf_counter()
            try:
                text, times = with_variant(var, lambda b=b, var=var: trace_op(
                    op, shape, b, a.iters, a.out_dir, a.interpret, a.keep_traces,
                    tag_suffix=f"-{var}", wall_iters=a.wall_iters))
            except Exception as ex:  # noqa: BLE001 — one failing variant must not hide the rest
                print(f"{op} {var} ERROR {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                continue
            results[var] = times
            print(f"{op} {var}: {time.perf_counter() - t0:.0f}s incl. compile, wall "
                  f"{times.get('WALL', float('nan')):.4f} ms", flush=True)
        table = compare_table(op, shape, results)
        with open(os.path.join(a.out_dir, f"compare-{op}.md"), "w") as fh:
            fh.write(table + "\n")
        print(table, flush=True)


if __name__ == "__main__":
    main()
