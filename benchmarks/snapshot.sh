#!/usr/bin/env bash
# Freeze the committed code for a GPU run: writes .bench_snapshot/{rewy_jax,pallas_kernels,benchmarks,tools}
# from a git revision (default HEAD) plus .bench_snapshot/COMMIT, so that a benchmark measures a
# commit and not whatever is half-edited in the working tree. gpu_run.sh runs from it when it is
# there (carry it: carry=[".whl", ".bench_snapshot"]).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev="${1:-HEAD}"
grep -qx '/.bench_snapshot/' .git/info/exclude 2>/dev/null || echo '/.bench_snapshot/' >> .git/info/exclude
rm -rf .bench_snapshot && mkdir -p .bench_snapshot
# without benchmarks/results (14 MB of past runs the benchmark never reads): the device tool's
# carry holds 64 MiB in all, and a slim Triton for FLA's GDN (slim_triton.sh) takes 37 of them
git archive "$rev" rewy_jax pallas_kernels benchmarks tools ':(exclude)benchmarks/results' | tar -x -C .bench_snapshot
echo "$(git rev-parse --short "$rev") $(git log -1 --format=%cI "$rev")" > .bench_snapshot/COMMIT
cat .bench_snapshot/COMMIT
