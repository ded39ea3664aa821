"""Merge partial benchmark results (e.g. a full run split over several GPU calls by --shapes/--ops).

    python -m benchmarks.merge benchmarks/results/a.json benchmarks/results/b.json \
        --out-dir benchmarks/results --stem merged

With one input it just rewrites that result's tables (and, with --readme, the README headline).
Inputs oldest first; for each (shape, op) the newest run's rows are kept (ratios are only ever
taken within one run). Writes <stem>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--stem", default="merged")
    ap.add_argument("--readme", default=None,
                    help="also put the headline into this README's 'Latest headline' section")
    a = ap.parse_args(argv)
    results = [json.loads(Path(f).read_text()) for f in a.files]
    merged = report.merge(results)
    paths = report.write_all(merged, Path(a.out_dir), a.stem)
    for p in paths.values():
        print(p)
    if a.readme:
        report.update_readme(merged, Path(a.readme), str(paths["md"]))
        print("updated", a.readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
