"""One command for the benchmark (issue #6): time, measure and check every implementation.

    python -m benchmarks.run --quick            # one 10-minute GPU call: 2 shapes, all ops
    python -m benchmarks.run                    # full: 7 shapes × 4 ops (split with --shapes/--ops)
    python -m benchmarks.run --cpu-smoke        # tiny shapes on CPU, peers skipped (the CPU tests)

For each shape × op and each implementation (ours: every registered backend × backward × policy;
jla mosaic_gpu and chunked; FLA eager and under a CUDA graph; plain JAX autodiff) it reports fwd,
bwd (= fwd+bwd − fwd), fwd+bwd (medians of interleaved rounds in one process), peak memory, the
roofline floor and each time as % of it, ratios to FLA-graph and jla, and the accuracy of every
output and gradient vs the float64 recurrence on a reduced shape (B=1, T=512, same H and D).
Results: <out-dir>/<stem>.json, .md and .png, stamped with date, GPU, driver, versions, command.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")  # FLA's own Triton kernels

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.metadata as md  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402


def log(*a):
    print(f"[bench {time.strftime('%H:%M:%S')}]", *a, flush=True)


def environment() -> dict:
    import jax

    versions = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "numpy", "torch", "triton", "fla-core",
                 "jax-linear-attention", "rewy-jax"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    import rewy_jax

    versions["rewy_jax (imported)"] = rewy_jax.__version__
    snap = Path(rewy_jax.__file__).resolve().parents[1] / "COMMIT"  # benchmarks/snapshot.sh
    if snap.exists():
        versions["rewy-jax commit"] = snap.read_text().split()[0] + " (snapshot)"
    try:
        commit = "" if snap.exists() else subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "rewy_jax", "pallas_kernels"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        if commit and dirty:
            commit += " + uncommitted changes"
        if commit:
            versions["rewy-jax commit"] = commit
    except Exception:  # noqa: BLE001
        pass
    dev = jax.devices()[0]
    gpu, driver = dev.device_kind, "n/a"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        if q:
            gpu, driver = [x.strip() for x in q[0].split(",")][:2]
    except Exception:  # noqa: BLE001
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": gpu if jax.default_backend() == "gpu" else f"CPU ({platform.processor() or platform.machine()})",
            "driver": driver, "jax_backend": jax.default_backend(), "versions": versions,
            "host": platform.node()}


@contextmanager
def gpu_turn(path, shared=False):
    """The GPU among benchmark processes sharing the lock file ``path`` (none: no-op), as a
    readers-writer lock: timing rounds hold it exclusively (``shared=False``); every other phase
    that runs GPU work — set-up and warm-ups (FLA's autotune), accuracy calls — holds it shared,
    so such phases overlap each other but never a timing round. (Run h200-4 had only the timing
    rounds locked: other processes' set-ups ran beside them and doubled some medians.) Compiles
    stay outside it. A writer waits on ``path + '.turn'`` first, which stops new readers from
    entering meanwhile (flock has no writer preference: without it timing could starve)."""
    if not path:
        yield
        return
    import fcntl

    with open(path + ".turn", "a") as turn, open(path, "a") as fh:
        t0 = time.time()
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(fh, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        fcntl.flock(turn, fcntl.LOCK_UN)
        if not shared and time.time() - t0 > 1:
            log(f"  (waited {time.time() - t0:.0f}s for the GPU)")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, a subset of our variants")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (peers skipped)")
    ap.add_argument("--shapes", default=None, help="comma list of BxTxHxD (default: mode's shapes)")
    ap.add_argument("--ops", default=None, help="comma list of deltanet,gdn,kda,gdn2")
    ap.add_argument("--impls", default=None,
                    help="comma list of substrings; keep implementations whose name contains one")
    ap.add_argument("--backends", default=None, help="comma list of our backends (default: registered)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (median)")
    ap.add_argument("--sets", type=int, default=4, help="rotated input sets per shape")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--accuracy-first", action="store_true",
                    help="check each (shape, op)'s accuracy before timing it, so that a run stopped by "
                         "its time limit (the compile of the timed runners can take ~50 s each) still "
                         "has the accuracy of every implementation it reached")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop starting new (shape, op) groups after this many seconds")
    ap.add_argument("--fla-deadline-s", type=float, default=None,
                    help="skip FLA setup (compile + autotune, up to ~200 s/op at a new shape) after this")
    ap.add_argument("--serial-compile", action="store_true", help="compile one runner at a time")
    ap.add_argument("--fla-shapes", default=None,
                    help="comma list of shapes where FLA runs, or 'all' (quick default: the anchor "
                         "shape, whose autotune results benchmarks/fla-autotune-cache.tgz holds)")
    ap.add_argument("--gpu-lock", default=None,
                    help="a lock file shared by benchmark processes run side by side (gpu_run.sh "
                         "BENCH_SPLIT): each compiles on its own CPU cores but holds the lock "
                         "while it times on the GPU")
    ap.add_argument("--kernel-config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a Pallas GPU KernelConfig override for this run's pallas_gpu rows "
                         "(e.g. twin_pass=false, warps.bwd_leaf=4); repeatable; recorded in the "
                         "results' command line")
    ap.add_argument("--variant", default=None, metavar="NAME[+NAME...]",
                    help="KernelConfig overrides of tools/profile_kernels.VARIANTS (trace_op's "
                         "names; 'a+b' for several), under --kernel-config's")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--stem", default=None, help="file stem (default: <mode>-<date>)")
    return ap.parse_args(argv)


def kernel_overrides(variant, settings):
    """The pallas_gpu rows' KernelConfig overrides: ``variant``'s (tools/profile_kernels.VARIANTS,
    or None), then each "field=value" of ``settings`` (warps.<kernel> / stages.<pass> entries
    update those tables)."""
    from tools.profile_kernels import parse_setting, variant_overrides

    out = variant_overrides(variant) if variant else {}
    for text in settings:
        field, value = parse_setting(text)
        out[field] = {**out.get(field, {}), **value} if isinstance(value, dict) else value
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before the imports below load jax

    from benchmarks import accuracy, impls as I, report, roofline, shapes as S
    from benchmarks.inputs import device_inputs

    t_start = time.time()
    elapsed = lambda: time.time() - t_start  # noqa: E731
    mode = "smoke" if a.cpu_smoke else ("quick" if a.quick else "full")
    shape_list = ([S.parse_shape(s) for s in a.shapes.split(",") if s] if a.shapes else
                  {"smoke": S.SMOKE_SHAPES, "quick": S.QUICK_SHAPES, "full": S.FULL_SHAPES}[mode])
    ops = a.ops.split(",") if a.ops else list(S.OPS)
    rounds = a.rounds or {"smoke": 2, "quick": 10, "full": 12}[mode]
    if mode == "quick":  # fit one 10-minute device call (machine start and transfers included)
        a.deadline_s = 330.0 if a.deadline_s is None else a.deadline_s
        a.fla_deadline_s = 300.0 if a.fla_deadline_s is None else a.fla_deadline_s
    backends_ = a.backends.split(",") if a.backends else None
    impl_list = I.all_impls(quick=mode != "full", backends_=backends_,
                            kernel_config=kernel_overrides(a.variant, a.kernel_config) or None)
    if a.impls:
        keys = [k.strip() for k in a.impls.split(",") if k.strip()]
        impl_list = [i for i in impl_list if any(k in i.name for k in keys)]
    stem = a.stem or f"{mode}-{datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%d-%H%M')}"
    out_dir = Path(a.out_dir)
    run_id = uuid.uuid4().hex[:8]

    meta = environment()
    meta.update(command="python -m benchmarks.run " + " ".join(shlex.quote(x) for x in argv),
                mode=mode, run_id=run_id, rounds=rounds, input_sets=a.sets,
                env={k: os.environ.get(k) for k in ("XLA_FLAGS", "TRITON_CACHE_DIR",
                                                     "FLA_DISABLE_BACKEND_DISPATCH") if os.environ.get(k)})
    log("mode", mode, "| shapes", [s.label() for s in shape_list], "| ops", ops, "| on", meta["gpu"])

    unavailable = {}
    for impl in impl_list:
        try:
            why = impl.unavailable()
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
        if why:
            unavailable[impl.name] = why
            log(f"skip {impl.name}: {why}")

    with gpu_turn(a.gpu_lock):
        meta["ceilings"] = roofline.measure_ceilings()
    log("ceilings", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in meta["ceilings"].items()})
    meta["jax_fwdbwd"] = I.JAX_FWDBWD
    result = {"meta": meta, "runs": {run_id: {"date": meta["date"], "command": meta["command"],
                                              "triton": meta["versions"].get("triton"),
                                              "jax_fwdbwd": I.JAX_FWDBWD}},
              "rows": []}

    refs = None
    if not a.no_accuracy:
        refs = accuracy.ReferenceJobs(Path(tempfile.mkdtemp(prefix="rewy-bench-ref-")))
        n = 0
        for s in shape_list:
            for op in ops:
                refs.add(n, op, S.accuracy_shape(s, smoke=mode == "smoke"))
                n += 1
        refs.start()
    acc_cache = {}

    def save(final=False):
        if final:
            paths = report.write_all(result, out_dir, stem)
            log("wrote", ", ".join(str(p) for p in paths.values()))
        else:
            report.write_json(out_dir / f"{stem}.json", {**result, "rows": report.add_derived(result["rows"])})

    # gpu_run.sh stops a process past BENCH_TIMEOUT with SIGTERM (SIGKILL 10 s later): exit
    # through the finally below, so that the tables of what was measured are still written
    # (a one-shape process stopped during FLA's autotune or the accuracy check wrote nothing)
    on_term = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    untimed = None  # --accuracy-first: the (shape, op) checked but not yet timed
    try:
        for shape in shape_list:
            for op in ops:
                if refs is not None and a.accuracy_first:  # into the cache; attached to the rows below
                    available = [{"impl": i.name, "status": "ok"} for i in impl_list if i.name not in unavailable]
                    check_accuracy(op, S.accuracy_shape(shape, smoke=mode == "smoke"), impl_list, unavailable,
                                   available, refs, acc_cache, elapsed, a)
                    untimed = (shape, op)
                rows = run_group(a, shape, op, impl_list, unavailable, meta, rounds, run_id, elapsed,
                                 device_inputs, I, roofline, mode)
                result["rows"].extend(rows)
                untimed = None
                save()  # the timings first: a process stopped in the accuracy check keeps them
                if refs is not None:
                    acc_shape = S.accuracy_shape(shape, smoke=mode == "smoke")
                    check_accuracy(op, acc_shape, impl_list, unavailable, rows, refs, acc_cache, elapsed, a)
                    save()
                gc.collect()
    finally:
        signal.signal(signal.SIGTERM, on_term)
        if untimed is not None:  # stopped while timing a group whose accuracy is known: keep it
            shape, op = untimed
            base = group_base(run_id, shape, op, roofline.floor_ms(op, shape, meta["ceilings"]))
            rows = [dict(base, impl=i.name, family=i.family, status="skipped",
                         reason=unavailable.get(i.name, "the run stopped before timing it")) for i in impl_list]
            check_accuracy(op, S.accuracy_shape(shape, smoke=mode == "smoke"), impl_list, unavailable, rows,
                           refs, acc_cache, elapsed, a)  # (from the cache: nothing is run again)
            result["rows"].extend(rows)
        if refs is not None:
            refs.stop()
        save(final=True)
        print(summary(result), flush=True)
    return 0


def parallel_compile(items, fn, serial, is_kernel=None):
    """``[fn(x) for x in items]``, the XLA-only ones in a thread pool (XLA compiles outside the
    GIL); those with Pallas/Mosaic kernels inside first, on this thread, to stay on the safe side."""
    is_kernel = is_kernel or (lambda r: getattr(r.impl, "kernels", False))
    results = {}
    for i, x in enumerate(items):
        if serial or is_kernel(x):
            results[i] = fn(x)
    rest = [i for i in range(len(items)) if i not in results]
    if rest:
        with ThreadPoolExecutor(max_workers=8) as ex:
            for i, res in zip(rest, ex.map(lambda i: fn(items[i]), rest)):
                results[i] = res
    return [results[i] for i in range(len(items))]


def fla_allowed(a, shape, mode) -> bool:
    from benchmarks import shapes as S

    if a.fla_shapes is None:
        return mode != "quick" or shape == S.ANCHOR_SHAPE
    if a.fla_shapes == "all":
        return True
    return shape in [S.parse_shape(x) for x in a.fla_shapes.split(",") if x]


def group_base(run_id, shape, op, floor) -> dict:
    """The fields every row of one (shape, op) group shares."""
    B, T, H, D = shape
    return {"run_id": run_id, "shape": shape.key(), "B": B, "T": T, "H": H, "D": D, "op": op, "floor": floor}


def run_group(a, shape, op, impl_list, unavailable, meta, rounds, run_id, elapsed, device_inputs, I,
              roofline, mode):
    """Time every implementation on one (shape, op), interleaved; returns rows."""
    import jax
    import jax.numpy as jnp

    B, T, H, D = shape
    floor = roofline.floor_ms(op, shape, meta["ceilings"])
    base = group_base(run_id, shape, op, floor)
    rows, runners = [], []
    deadline_hit = a.deadline_s is not None and elapsed() > a.deadline_s
    log(f"== {op} {shape.label()} (t={elapsed():.0f}s)")
    sets = do_sets = None
    for impl in impl_list:
        row = dict(base, impl=impl.name, family=impl.family)
        rows.append(row)
        if impl.name in unavailable:
            row.update(status="skipped", reason=unavailable[impl.name])
            continue
        if deadline_hit:
            row.update(status="skipped", reason=f"deadline ({a.deadline_s:.0f}s) reached before this group")
            continue
        try:
            why = impl.unsupported(op, shape)
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {str(e)[:200]}"
        if why:
            row.update(status="unsupported", reason=why)
            continue
        if impl.framework == "torch" and not fla_allowed(a, shape, mode):
            row.update(status="skipped", reason="FLA not run at this shape in this mode: its Triton autotune "
                       "is not cached for it (~100–200 s per op); pass --fla-shapes all")
            continue
        if sets is None:
            sets = [device_inputs(op, B, T, H, D, seed=1000 * i + 7) for i in range(a.sets)]
            kd = jax.random.split(jax.random.PRNGKey(99), 2)
            do_sets = [jax.random.normal(k, (B, T, H, D), jnp.float32).astype(jnp.bfloat16) for k in kd]
        try:
            runner = (I.FlaRunner if impl.framework == "torch" else I.JaxRunner)(impl, op, sets, do_sets)
        except Exception as e:  # noqa: BLE001
            row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            continue
        shared = [r for r in runners if impl.fwd_key and r.impl.fwd_key == impl.fwd_key]
        runner.shared_fwd = shared[0] if shared else None
        runner.phases = ("fwdbwd",) if runner.shared_fwd else I.PHASES
        runner.row = row
        runners.append(runner)
    # Compile every JAX runner of the group in parallel threads (XLA compiles outside the GIL).
    t0 = time.time()
    jax_runners = [r for r in runners if isinstance(r, I.JaxRunner)]
    parallel_compile(jax_runners, lambda r: r.compile(r.phases), a.serial_compile)
    log(f"  compiled {len(jax_runners)} JAX runners in {time.time() - t0:.1f}s")
    runners = _setup_and_sample(a, runners, rounds, elapsed)
    for r in runners:
        row = r.row
        row["ms"], row["spread_ms"], row["n_samples"] = {}, {}, {}
        for ph, xs in r.samples.items():
            if xs and ph not in r.refused:
                row["ms"][ph] = float(np.median(xs))
                row["spread_ms"][ph] = [float(np.percentile(xs, 25)), float(np.percentile(xs, 75))]
                row["n_samples"][ph] = len(xs)
        if r.shared_fwd is not None:
            src = r.shared_fwd.row
            for key in ("ms", "spread_ms", "n_samples"):
                if "fwd" in src.get(key, {}):
                    row[key]["fwd"] = src[key]["fwd"]
            row["fwd_shared_with"] = src["impl"]
            r.mem.setdefault("fwd", r.shared_fwd.mem.get("fwd"))
        row["mem_bytes"] = dict(r.mem)
        row["calls_per_sample"] = dict(r.reps)
        if r.refused:
            row["refused"] = dict(r.refused)
        ms = row["ms"]
        log(f"  {row['impl']:<32} fwd {ms.get('fwd', float('nan')):8.3f}  fwd+bwd "
            f"{ms.get('fwdbwd', float('nan')):8.3f} ms" + (f"  refused {list(r.refused)}" if r.refused else ""))
    for r in runners:
        r.close()
    del sets, do_sets
    return rows


def _setup_and_sample(a, runners, rounds, elapsed):
    """Set up every runner (FLA: compile + autotune) and sample them in interleaved rounds;
    returns the runners that are ready, with ``.samples`` {phase: [ms]}."""
    ready = []
    for runner in runners:
        row = runner.row
        if runner.impl.framework == "torch" and a.fla_deadline_s is not None and elapsed() > a.fla_deadline_s:
            row.update(status="skipped", reason=f"FLA setup (autotune) would not fit the time budget "
                                               f"(t={elapsed():.0f}s > {a.fla_deadline_s:.0f}s)")
            runner.close()
            continue
        t0 = time.time()
        try:
            with gpu_turn(a.gpu_lock, shared=True):
                runner.setup(phases=runner.phases)
        except Exception as e:  # noqa: BLE001
            row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            log(f"  {runner.impl.name}: setup error {row['reason']}")
            traceback.print_exc()
            continue
        log(f"  {runner.impl.name}: set up in {time.time() - t0:.1f}s; refused={runner.refused or '-'}")
        row["setup_s"] = time.time() - t0
        if not runner.fns and runner.refused:
            row.update(status="refused", reason="; ".join(f"{k}: {v}" for k, v in runner.refused.items()),
                       refused=dict(runner.refused))
            runner.close()
            continue
        row["status"] = "ok"
        if getattr(runner, "nonfinite", None):
            row["nonfinite"] = list(runner.nonfinite)
        ready.append(runner)
    runners = ready
    for r in runners:
        r.samples = {ph: [] for ph in r.fns}
    # The timing rounds hold the GPU alone (side-by-side processes); set-ups above held it shared.
    with gpu_turn(a.gpu_lock):
        for k in range(rounds):
            order = runners[k % max(1, len(runners)):] + runners[:k % max(1, len(runners))]
            for r in order:
                for ph in r.fns:
                    try:
                        r.samples[ph].append(r.sample(ph))
                    except Exception as e:  # noqa: BLE001
                        r.refused[ph] = f"sampling: {type(e).__name__}: {str(e)[:200]}"
    return runners


def _run_accuracy(todo, compiled, op, inputs, cts, ref, out):
    """Run each implementation of ``todo`` (with its prepared ``compiled`` call or the exception
    that preparing it raised) on the accuracy inputs; ``out[name]`` = its comparison with the
    float64 reference ``ref``, or the error."""
    from benchmarks import accuracy

    for impl, c in zip(todo, compiled):
        try:
            if isinstance(c, Exception):
                raise c
            o, s, grads = accuracy.run_impl(impl, op, inputs, cts, compiled=c)
            out[impl.name] = accuracy.compare(o, s, grads, ref)
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()
            out[impl.name] = {"status": "error",
                              "reason": f"{type(e).__name__}: {msg[0][:200] if msg else ''}"}


def check_accuracy(op, acc_shape, impl_list, unavailable, rows, refs, cache, elapsed, a):
    """Accuracy of every implementation timed in this group (cached per op and accuracy shape)."""
    from benchmarks import accuracy

    key = (op, acc_shape.key())
    cache.setdefault(key, {})
    timed = {r["impl"] for r in rows if r.get("status") == "ok"}
    todo = [i for i in impl_list if i.name in timed and i.name not in cache[key]]
    if todo:
        t0 = time.time()
        ref = refs.result(op, acc_shape, timeout_s=600 if a.deadline_s is None else
                          max(5.0, a.deadline_s + 60 - elapsed()))
        inputs, cts = refs.jobs[refs.key(op, acc_shape)]
        if ref is None:
            for impl in todo:
                cache[key][impl.name] = {"status": "not checked", "reason": "float64 reference not ready"}
        else:
            def prep(impl):
                try:
                    return accuracy.prepare(impl, op, inputs, cts)
                except Exception as e:  # noqa: BLE001
                    return e

            compiled = parallel_compile(todo, prep, a.serial_compile,
                                        is_kernel=lambda i: getattr(i, "kernels", False))
            # shared: overlaps other processes' set-ups, never their timing rounds (jla compiles
            # inside its first call, so this can hold the shared lock for a while)
            with gpu_turn(a.gpu_lock, shared=True):
                _run_accuracy(todo, compiled, op, inputs, cts, ref, cache[key])
        log(f"  accuracy {op} {acc_shape.label()} in {time.time() - t0:.1f}s: "
            + "; ".join(f"{n}: {cache[key][n]['status']}" for n in [i.name for i in todo]))
    for row in rows:
        acc = cache[key].get(row["impl"])
        if acc is not None:
            row["accuracy"] = dict(acc, shape=acc_shape.key())


def summary(result) -> str:
    from benchmarks import report

    rows = report.add_derived(list(result["rows"]))
    lines = ["", "shape            op        impl                              fwd      f+b     xjla   xFLAg  acc"]
    for r in rows:
        if r.get("status") != "ok":
            continue
        t = r.get("ms", {})
        f = lambda x: f"{x:8.3f}" if isinstance(x, float) else "       —"  # noqa: E731
        g = lambda x: f"{x:6.2f}" if isinstance(x, float) else "     —"  # noqa: E731
        acc = (r.get("accuracy") or {}).get("status", "-")
        lines.append(f"{r['shape']:<16} {r['op']:<9} {r['impl']:<32} {f(t.get('fwd'))} {f(t.get('fwdbwd'))} "
                     f"{g(r['vs_jla'].get('fwdbwd'))} {g(r['vs_fla_graph'].get('fwdbwd'))}  {acc}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
