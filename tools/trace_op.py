"""Where one public op's fwd+bwd spends its GPU time: every kernel and XLA fusion, from a trace.

    python -m tools.trace_op [--ops deltanet,gdn,kda,gdn2] [--backend pallas_gpu|mosaic_gpu]
        [--policy recompute|save]
        [--shape 2x4096x16x128] [--gate-lower-bound -5] [--iters 5] [--out-dir DIR]
        [--variants base,nopd,w2 | --variants "deltanet:base,apart kda:centred,nopd"]

For each op: o and the inputs' gradients for a cotangent dO (``testing.output_and_vjp``, as
the benchmark times fwd+bwd) through the public op (``backend="pallas_gpu"``, bf16 inputs,
as the benchmark calls it), warmed up, then ``--iters`` calls under ``jax.profiler.trace``. The
Perfetto trace is summed per device event name (our kernels are named ``rewy_*`` on
``pallas_gpu`` and ``<stage>_body_mosaic_gpu_kernel`` on ``mosaic_gpu``; the rest is
XLA glue: the e = b⊙k products, gate cumsums, padding, dβ/dg reductions) and printed as ms per
call, so the gap between ``profile_kernels.py``'s kernels and the benchmark's op time gets names.
Writes ``<out-dir>/trace-<op>.txt`` (the table; with ``--keep-traces`` also the raw Perfetto trace).

``--variants`` (names of ``profile_kernels.VARIANTS``, or "a+b" for two together) traces the
op once per variant and prints one table of device ms per kernel, variants side by side, with
the op's wall time per call. This
is the way to compare variants of the small kernels: ``profile_kernels.py`` times each kernel as
a host loop of jitted calls, whose dispatch sets a floor near 0.1 ms at the anchor (profile-11:
wu 0.101 ms there against 0.065 by ncu, bwd_dlam 0.114 against 0.061), so variants of a
60-µs kernel read the same there. Variants named like ``centred`` declare g ≥ −5 for KDA/GDN2.
All variants of all ops are lowered first, compiled together on every CPU core, then traced one
at a time (``trace_variants``): one process for a whole device call's plan.
Kernel-work tooling, not the peer benchmark (benchmarks/).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import glob
import gzip
import json
import os
import re
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


def fusion_sources(hlo_text: str) -> dict:
    """{fusion instruction name: "shape = op, op | file:line, ..."} from a compiled module's HLO
    text (``compiled.as_text()``): the result shape, the fused computation's opcodes and the
    Python lines its instructions came from (innermost frames, through the module's StackFrames
    table), so that a trace's XLA fusions (``loop_select_fusion`` …) get named by their source."""
    files = dict(re.findall(r'^(\d+) "([^"]*)"$', hlo_text.split("FunctionNames")[0], re.M))
    locs = {m[0]: (files.get(m[1], "?"), m[2]) for m in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)", hlo_text, re.M)}
    frames = dict(re.findall(r"^(\d+) \{file_location_id=(\d+)", hlo_text, re.M))

    def where(line):
        m = re.search(r"stack_frame_id=(\d+)", line)
        if not m or m[1] not in frames:
            return None
        path, lineno = locs.get(frames[m[1]], ("?", "?"))
        return f"{os.path.basename(path)}:{lineno}"

    bodies, current = {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"^%(\S+) \(.*\{$", line)
        if head:
            current = bodies.setdefault(head[1], [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    out = {}
    for m in re.finditer(r"^\s*%(\S+) = (.+?) fusion\(.*calls=%([^,\s]+)", hlo_text, re.M):
        name, shape, comp = m[1], m[2], m[3]
        body = bodies.get(comp, [])
        ops = [o for o in dict.fromkeys(re.findall(r"= \S+ ([a-z][\w-]*)\(", "\n".join(body)))
               if o not in ("parameter", "constant", "broadcast", "bitcast", "reshape")]
        srcs = [w for w in dict.fromkeys(where(x) for x in body) if w]
        shape = re.sub(r"\{[^}]*\}", "", shape)  # without the layout
        out[name] = f"{shape} = {', '.join(ops[:6])} | {', '.join(srcs[:4])}"
    return out


def lower_op(op, shape, gate_lower_bound=None, interpret=False, inp=None, kernel_config=None,
             backend="pallas_gpu", policy="recompute"):
    """(the op's jitted fwd+bwd lowered for bf16 inputs of ``shape``, those inputs — ``inp``
    when given, as an earlier call returned them), with ``kernel_config`` (KernelConfig
    overrides, e.g. ``profile_kernels.variant_overrides(name)``) passed to the op."""
    B, T, H, D = shape
    if inp is None:
        inp = testing.make_inputs(op, B, T, H, D, D, dtype=jnp.bfloat16, initial_state=False)
    dO = jax.random.normal(jax.random.PRNGKey(7), inp["v"].shape, F32).astype(jnp.bfloat16)
    kw = dict(backend=backend, interpret=interpret, policy=policy)
    if kernel_config is not None:
        kw["kernel_config"] = kernel_config
    if gate_lower_bound is not None:
        kw["gate_lower_bound"] = gate_lower_bound

    # o and the inputs' gradients for dO, as the benchmark times fwd+bwd (testing.output_and_vjp)
    return jax.jit(lambda x: testing.output_and_vjp(
        lambda y: testing.run_op(op, y, **kw)[0], x, dO)).lower(inp), inp


def trace_compiled(f, inp, tag, shape, iters=5, out_dir=".", keep_trace=False, wall_iters=0):
    """Trace ``iters`` calls of the compiled fwd+bwd ``f(inp)``; returns (table text,
    {name: ms per call}), with "WALL" the wall ms per call of ``wall_iters`` more calls when
    that is > 0."""
    jax.block_until_ready(f(inp))
    jax.block_until_ready(f(inp))
    tmp = tempfile.mkdtemp(prefix="rewy-trace-")
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
        for _ in range(iters):
            jax.block_until_ready(f(inp))
    path = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)[0]
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
    ours = sum(v for k, v in times.items() if is_ours(k))
    glue = {k: v for k, v in times.items() if not is_ours(k) and k != "WALL"}
    lines = [f"{tag} {shape} bf16 fwd+bwd, ms per call over {iters} calls (tracks: {tracks})",
             f"  our kernels {ours:.3f}  |  everything else {sum(glue.values()):.3f}"]
    try:  # what each XLA fusion computes and where in our code it comes from
        sources = fusion_sources(f.as_text())
    except Exception:  # noqa: BLE001 - the table stands without it
        sources = {}
    for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[:30]:
        lines.append(f"  {ms:8.3f}  {name[:100]}" + (f"  [{sources[name][:160]}]" if name in sources else ""))
    text = "\n".join(lines)
    with open(os.path.join(out_dir, f"trace-{tag}.txt"), "w") as fh:
        fh.write(text + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return text, times


def _tag(op, gate_lower_bound, variant=None):
    return (op + ("" if gate_lower_bound is None else f"-g{gate_lower_bound:g}")
            + ("" if variant is None else f"-{variant}"))


def is_ours(name: str) -> bool:
    """A device event of our kernels: ``rewy_*`` (Pallas Triton) or a Mosaic GPU kernel (its name
    is the kernel body's function name + ``_mosaic_gpu_kernel``)."""
    return name.startswith("rewy_") or name.endswith("_mosaic_gpu_kernel")


def trace_op(op, shape, gate_lower_bound=None, iters=5, out_dir=".", interpret=False,
             keep_trace=False, wall_iters=0, backend="pallas_gpu", policy="recompute"):
    """Lower, compile and trace one op under the current kernel settings (trace_compiled)."""
    lowered, inp = lower_op(op, shape, gate_lower_bound, interpret, backend=backend, policy=policy)
    tag = (_tag(op, gate_lower_bound) + ("" if backend == "pallas_gpu" else f"-{backend}")
           + ("" if policy == "recompute" else f"-{policy}"))
    return trace_compiled(lowered.compile(), inp, tag, shape, iters, out_dir, keep_trace, wall_iters)


def trace_variants(plan, shape, gate_lower_bound=None, iters=5, out_dir=".", interpret=False,
                   keep_trace=False, wall_iters=20, workers=None, log=print):
    """{op: {variant: times}} for ``plan`` = [(op, [variant, ...]), ...].

    Every (op, variant) is lowered first, one after another, then all are compiled at once
    in a thread pool (XLA compiles each module's Triton kernels then, releasing the GIL;
    compiling, by this machine's timings, was most of the ~15 s a variant cost the GPU
    machine when each was compiled in turn), then traced one at a time, so no two share the GPU. A variant that fails to lower, compile or run is
    reported and skipped.
    """
    from tools.profile_kernels import is_bounded, variant_overrides

    t0 = time.perf_counter()
    lowered = {}  # (op, variant) -> (lowered, inputs, bound)
    inputs = {}  # op -> its inputs, shared by its variants
    for op, variants in plan:
        vector = op in ("kda", "gdn2")
        for var in variants:
            b = -5.0 if vector and is_bounded(var) else (
                gate_lower_bound if vector else None)
            try:
                lo, inputs[op] = lower_op(op, shape, b, interpret, inputs.get(op),
                                          variant_overrides(var))
            except Exception as ex:  # noqa: BLE001 — one failing variant must not hide the rest
                log(f"{op} {var} ERROR lowering {type(ex).__name__}: {str(ex)[:300]}")
                continue
            lowered[op, var] = (lo, inputs[op], b)
    t1 = time.perf_counter()
    workers = workers or max(1, min(len(lowered), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {key: pool.submit(lo.compile) for key, (lo, _, _) in lowered.items()}
        concurrent.futures.wait(futures.values())
    t2 = time.perf_counter()
    log(f"lowered {len(lowered)} variants in {t1 - t0:.0f}s, compiled them in {t2 - t1:.0f}s "
        f"({workers} threads)")
    results = {op: {} for op, _ in plan}
    for (op, var), (_, inp, b) in lowered.items():
        t = time.perf_counter()
        try:
            _, times = trace_compiled(futures[op, var].result(), inp, _tag(op, b, var), shape,
                                      iters, out_dir, keep_trace, wall_iters)
        except Exception as ex:  # noqa: BLE001
            log(f"{op} {var} ERROR {type(ex).__name__}: {str(ex)[:300]}")
            continue
        results[op][var] = times
        log(f"{op} {var}: traced in {time.perf_counter() - t:.0f}s, wall "
            f"{times.get('WALL', float('nan')):.4f} ms")
    return results


def compare_table(op, shape, results):
    """Device ms per kernel (rows) under each variant (columns), from {variant: times}."""
    names = sorted({k for t in results.values() for k in t if is_ours(k)})
    cols = list(results)
    lines = [f"{op} {'x'.join(map(str, shape))} bf16 fwd+bwd, device ms per call",
             "| kernel | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def row(label, get):
        lines.append(f"| {label} | " + " | ".join(
            "—" if get(results[c]) is None else f"{get(results[c]):.4f}" for c in cols) + " |")

    for n in names:
        row(n, lambda t, n=n: t.get(n))
    row("our kernels", lambda t: sum(v for k, v in t.items() if is_ours(k)))
    row("XLA glue", lambda t: sum(v for k, v in t.items()
                                  if not is_ours(k) and k != "WALL"))
    row("wall per call", lambda t: t.get("WALL"))
    return "\n".join(lines)


def parse_plan(ops, variants):
    """[(op, [variant, ...]), ...] from ``--ops`` and ``--variants``: "a,b" gives every op the
    same list; "deltanet:a,b kda:c,d" (space-separated groups) gives each op its own, and then
    names the ops itself."""
    if ":" not in variants:
        return [(op, variants.split(",")) for op in ops.split(",")]
    plan = []
    for group in variants.split():
        op, _, names = group.partition(":")
        if not op or not names:
            raise ValueError(f"--variants group {group!r}: expected OP:VARIANT[,VARIANT...]")
        plan.append((op, names.split(",")))
    return plan


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
                    help="profile_kernels.VARIANTS names, one trace each, compared in one table "
                         "per op: 'a,b' for every op, or 'deltanet:a,b kda:c,d'")
    ap.add_argument("--wall-iters", type=int, default=20)
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="threads compiling the variants at once (default: one per CPU core)")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    ap.add_argument("--backend", default="pallas_gpu", choices=("pallas_gpu", "mosaic_gpu"),
                    help="the op's backend (without --variants: those are KernelConfig overrides)")
    ap.add_argument("--policy", default="recompute", choices=("recompute", "save"))
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    os.makedirs(a.out_dir, exist_ok=True)

    if a.variants and (a.backend != "pallas_gpu" or a.policy != "recompute"):
        ap.error("--variants trace pallas_gpu KernelConfig overrides under policy recompute: "
                 "leave --backend and --policy out")
    if not a.variants:
        for op in a.ops.split(","):
            bound = a.gate_lower_bound if op in ("kda", "gdn2") else None
            text, _ = trace_op(op, shape, bound, a.iters, a.out_dir, a.interpret, a.keep_traces,
                               a.wall_iters, a.backend, a.policy)
            print(text, flush=True)
        return
    results = trace_variants(parse_plan(a.ops, a.variants), shape, a.gate_lower_bound, a.iters,
                             a.out_dir, a.interpret, a.keep_traces, a.wall_iters,
                             a.compile_threads, log=lambda m: print(m, flush=True))
    for op, res in results.items():
        table = compare_table(op, shape, res)
        with open(os.path.join(a.out_dir, f"compare-{op}.md"), "w") as fh:
            fh.write(table + "\n")
        print(table, flush=True)


if __name__ == "__main__":
    main()
