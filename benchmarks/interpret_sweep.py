"""Redrawn random cases of the Pallas kernels in interpret mode against the float64 recurrence.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python -m benchmarks.interpret_sweep --seed 26 --cases 60 \
        [--backend pallas_gpu] [--tiles 16] [--out-dir DIR]

The suite's interpret tests run fixed cases (tests/test_pallas_gpu.py, seed 3) plus a few
hypothesis draws; this draws many more (``testing.random_case``: every op, T not a multiple of
the chunk, K ≠ V, initial states, packed sequences, strong and bounded decays, β/b/w in [0, 2],
both backward schemes and policies, fp32 and bf16; ``--decays``/``--ops``/``--dtypes`` narrow the
draw, e.g. ``--backend pallas_tpu --ops gdn --dtypes bfloat16 --decays strong``, the TPU kernels'
strong-decay bf16 case of issue 40) with the kernels' defaults, and prints one row
per case: every output and gradient's ratio against its rewy-math §8 threshold. The tiles are
made small (``--tiles``) so that K, V = 32 run two tiles through every kernel. At K ≤ 32 16-bit
calls run the kernels on fp32 (KernelConfig.narrow_keys); ``--narrow-keys 0`` runs the 16-bit
kernels there instead, as production head dims (≥ 64) do. Exits 1 if any ratio is over its
threshold or not finite.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def run(seed: int, cases: int, backend: str, tiles: int, narrow_keys: int | None = None,
        **draw) -> list[dict]:
    """``cases`` rows; ``draw``: testing.random_case's keywords (ops, dtypes, max_T, dims);
    ``tiles`` (several key and value tiles at K, V = 32) and ``narrow_keys``: KernelConfig
    overrides of the pallas_gpu backend."""
    from rewy_jax import testing

    kcfg = {}
    if tiles:
        kcfg.update(block_v=tiles, block_k=tiles, block_v_state=tiles)
    if narrow_keys is not None:
        kcfg["narrow_keys"] = narrow_keys
    extra = {"kernel_config": kcfg} if kcfg and backend == "pallas_gpu" else {}
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(cases):
        case = testing.random_case(rng, **draw)
        t0 = time.time()
        rep = case.report(seed=seed * 1000 + 2 * i,
                          backend=backend, interpret=True, **extra)
        bad = sorted(n for n, (r, tol) in rep.items() if not (math.isfinite(r) and r <= tol))
        worst = max(rep, key=lambda n: rep[n][0] / rep[n][1])
        rows.append(dict(case=case._asdict(), label=case.label(), seconds=time.time() - t0,
                         ratios={n: r for n, (r, _) in rep.items()},
                         tolerances={n: tol for n, (_, tol) in rep.items()}, bad=bad,
                         worst=worst))
        r, tol = rep[worst]
        print(f"{i:3d} {'FAIL ' + ','.join(bad) if bad else 'ok  '} worst {worst} {r:.2e} of "
              f"{tol:.0e}  {case.label()}  ({time.time() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--backend", default="pallas_gpu", choices=["pallas_gpu", "pallas_tpu", "xla"])
    ap.add_argument("--tiles", type=int, default=16, help="key/value tile (0: the defaults)")
    ap.add_argument("--ops", nargs="+", help="draw only these ops (default: all four)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float32", "bfloat16"],
                    help="input dtypes to draw from (repeat one to weight it)")
    ap.add_argument("--decays", nargs="+", help="draw only these decay regimes "
                    "(testing.ALL_DECAYS; default: testing.DECAYS; e.g. --decays strong, or "
                    "resets: 10%% of gates −inf and 10%% −50)")
    ap.add_argument("--max-T", type=int, default=150)
    ap.add_argument("--dims", type=int, nargs="+", default=[16, 32], help="K and V to draw from")
    ap.add_argument("--narrow-keys", type=int, help="KernelConfig.narrow_keys for the run (0: 16-bit "
                    "calls run the 16-bit kernels at every K; default: the library's)")
    ap.add_argument("--out-dir", type=Path)
    a = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # the code this run loads
    rows = run(a.seed, a.cases, a.backend, a.tiles, a.narrow_keys, ops=a.ops, dtypes=tuple(a.dtypes),
               max_T=a.max_T, dims=tuple(a.dims), decays=a.decays)
    n_bad = sum(bool(r["bad"]) for r in rows)
    worst = max(rows, key=lambda r: r["ratios"][r["worst"]] / r["tolerances"][r["worst"]])
    w = worst["worst"]
    summary = (f"{len(rows) - n_bad} of {len(rows)} cases within every threshold; highest "
               f"ratio ÷ threshold {worst['ratios'][w] / worst['tolerances'][w]:.3f} "
               f"({w}, {worst['label']})")
    print(summary)
    if a.out_dir:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        meta = dict(seed=a.seed, backend=a.backend, tiles=a.tiles, commit=commit,
                    python=platform.python_version(),
                    command="python -m benchmarks.interpret_sweep " + " ".join(argv or sys.argv[1:]))
        (a.out_dir / "sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (a.out_dir / "summary.txt").write_text(summary + "\n")
    return 1 if n_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
