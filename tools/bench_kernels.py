"""Check and time the Pallas GPU kernels against rewy_jax's xla backend (one process, one GPU).

    python -m tools.bench_kernels [--acc [--cases 4]] [--time]
        [--ops kda,gdn2] [--backends pallas_gpu,xla] [--variants]

--acc: accuracy ratios vs the float64 token recurrence (rewy_jax.testing.accuracy_report) on
reduced shapes (bf16 at K = V = 128, T not a multiple of the chunk; plus fp32, K ≠ V, K = 256,
varlen, policy="save", backward="wy").
--time: fwd and fwd+bwd at the anchor shape B=2, T=4096, H=16, K=V=128 bf16 (anchors.md),
pallas_gpu vs xla, median of repeated runs after warm-up.

A script for kernel work (not the peer benchmark, which lives in benchmarks/); it imports
rewy_jax, so it is not part of the pallas_kernels library layer.
"""

from __future__ import annotations

import argparse
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def _acc_cases():
    bf, f32 = jnp.bfloat16, jnp.float32
    cases = []
    for op in ("deltanet", "gdn", "kda", "gdn2"):
        cases.append((op, {"B": 1, "T": 300, "H": 2, "K": 128, "V": 128, "dtype": bf}, {}))
    cases += [
        ("kda", {"B": 1, "T": 200, "H": 2, "K": 64, "V": 64, "dtype": f32}, {}),
        ("gdn", {"B": 1, "T": 200, "H": 2, "K": 64, "V": 64, "dtype": f32, "decay": "strong"}, {}),
        ("gdn2", {"B": 1, "T": 200, "H": 2, "K": 128, "V": 64, "dtype": bf}, {}),
        ("gdn2", {"B": 1, "T": 200, "H": 2, "K": 64, "V": 128, "dtype": bf}, {"policy": "save"}),
        ("kda", {"B": 1, "T": 300, "H": 2, "K": 128, "V": 128, "dtype": bf, "decay": "strong"}, {"backward": "wy"}),
        ("kda", {"B": 1, "T": 300, "H": 2, "K": 128, "V": 128, "dtype": bf, "n_seqs": 3}, {}),
        ("gdn", {"B": 1, "T": 200, "H": 2, "K": 256, "V": 256, "dtype": bf}, {}),
        ("kda", {"B": 1, "T": 200, "H": 2, "K": 256, "V": 256, "dtype": bf}, {}),
    ]
    return cases


def run_accuracy(ops, n_cases=None):
    from rewy_jax import testing

    rows = []
    for op, shp, kw in _acc_cases()[:n_cases]:
        if op not in ops:
            continue
        shp = dict(shp)
        B, T, H, K, V = (shp.pop(x) for x in ("B", "T", "H", "K", "V"))
        label = f"{op} B{B} T{T} H{H} K{K} V{V} {jnp.dtype(shp['dtype']).name} " + \
            " ".join(f"{k}={v}" for k, v in list(shp.items())[1:] + list(kw.items()))
        t0 = time.perf_counter()
        try:
            inp = testing.make_inputs(op, B, T, H, K, V, **shp)
            rep = testing.accuracy_report(op, inp, backend="pallas_gpu", **kw)
            ok = all(r <= tol for r, tol in rep.values())
            worst = max(rep, key=lambda n: rep[n][0] / rep[n][1])
            rows.append((label, "OK" if ok else "FAIL", f"worst {worst} {rep[worst][0]:.2e} (tol {rep[worst][1]:.0e})",
                         time.perf_counter() - t0))
            print(label, {n: f"{r:.2e}" for n, (r, _) in rep.items()}, flush=True)
        except Exception as ex:  # noqa: BLE001 — keep going: one failing case must not hide the others
            traceback.print_exc()
            rows.append((label, "ERROR", f"{type(ex).__name__}: {str(ex)[:200]}", time.perf_counter() - t0))
    return rows


def _median_ms(f, *args, n=20):
    out = f(*args)
    jax.block_until_ready(out)
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def run_timing(ops, B=2, T=4096, H=16, D=128, backends=("pallas_gpu", "xla"), extra=None):
    from rewy_jax import testing

    rows = []
    for op in ops:
        inp = testing.make_inputs(op, B, T, H, D, D, dtype=jnp.bfloat16, initial_state=False)
        names = [n for n in inp]
        for be in backends:
            for label, kw in [(be, {})] + ([(f"{be} {k}", v) for k, v in (extra or {}).items()]
                                           if be == "pallas_gpu" else []):
                try:
                    def fwd(*xs, kw=kw, be=be, op=op, names=names):
                        o, _ = testing.run_op(op, dict(zip(names, xs)), backend=be,
                                              use_qk_l2norm=True, **kw)
                        return o

                    def loss(*xs, fwd=fwd):
                        return jnp.sum(fwd(*xs).astype(jnp.float32))

                    f_fwd = jax.jit(fwd)
                    f_all = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))
                    args = [inp[n] for n in names]
                    t_f = _median_ms(f_fwd, *args)
                    t_fb = _median_ms(f_all, *args)
                    rows.append((op, label, t_f, t_fb))
                    print(f"time {op:9s} {label:28s} fwd {t_f:8.3f} ms  fwd+bwd {t_fb:8.3f} ms", flush=True)
                except Exception as ex:  # noqa: BLE001 — report and go on with the next case
                    traceback.print_exc()
                    rows.append((op, label, float("nan"), float("nan")))
                    print(f"time {op} {label} ERROR {type(ex).__name__}: {str(ex)[:300]}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--acc", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--ops", default="deltanet,gdn,kda,gdn2")
    ap.add_argument("--variants", action="store_true", help="also time policy=save and backward=wy")
    ap.add_argument("--cases", type=int, default=None, help="only the first N accuracy cases (4: bf16 per op)")
    ap.add_argument("--backends", default="pallas_gpu,xla")
    a = ap.parse_args()
    ops = a.ops.split(",")
    print(jax.devices(), jax.__version__, flush=True)
    acc = run_accuracy(ops, a.cases) if a.acc else []
    extra = {"save": {"policy": "save"}, "wy": {"backward": "wy"}} if a.variants else None
    tim = run_timing(ops, backends=tuple(a.backends.split(",")), extra=extra) if a.time else []
    print("\n==== accuracy (ratio vs float64 recurrence) ====")
    for label, st, msg, dt in acc:
        print(f"{st:5s} {label:60s} {msg}  [{dt:.0f}s]")
    print("==== timing B=2 T=4096 H=16 K=V=128 bf16 (ms) ====")
    for op, label, t_f, t_fb in tim:
        print(f"{op:9s} {label:28s} fwd {t_f:8.3f}  fwd+bwd {t_fb:8.3f}")


if __name__ == "__main__":
    main()
