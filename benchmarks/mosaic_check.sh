#!/usr/bin/env bash
# The Mosaic GPU backend checked and timed in one call of the GPU machine (jax 0.11.2, no network):
#
#   bash benchmarks/mosaic_check.sh            (with .whl/ carried: the peers' wheels)
#
# 1. The interpreter test cases of tests/test_mosaic_gpu*.py compiled for the GPU instead
#    (REWY_MOSAIC_ON_GPU=1): every output and gradient against float64. pytest comes from the
#    machine, or from .whl/pytest_site/ (pytest and its pure-Python dependencies, copied from a
#    local environment's site-packages) when the machine has none.
# 2. Each kernel alone at the anchor shape, with the A/B rows of `benchmarks.mosaic_kernels --parts`.
# 3. Ours against jla at FLA's shapes (`benchmarks.mosaic_kernels --shapes fla`).
# 4. (CHECK_STEPS=vector) The KDA/GDN2 kernels alone at the anchor (`--vector-parts`: undeclared
#    mild gates, with resets, and a declared bound), about 80 s per case on an H100.
# Logs land in $OUT; the tables are printed last. Each step has its own time limit, so that what
# finished comes back when a later step runs out of time. On the H100 each test case compiles in
# about 15 s and a vector-gate op (fwd+bwd) in about 50 s.
# Env: CHECK_STEPS (comma list of tests,parts,fla,vector; default tests,parts,fla), CHECK_TESTS
# (pytest -k expression), CHECK_T1/T2/T3/T4 (the steps' limits in s).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/mosaic-check}"
mkdir -p "$OUT"
site=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl 2>/dev/null \
  || echo "no peers' wheels: jla rows fail"
export PYTHONPATH="$PWD:$site" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import pytest" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/.whl/pytest_site"
nvidia-smi --query-gpu=name --format=csv,noheader
tests=${CHECK_TESTS:-"(interpret_matches or wy_interpret or two_warpgroups or forward_matches or backward_matches or packed_matches) and not 256"}
steps=",${CHECK_STEPS:-tests,parts,fla},"
touch "$OUT/pytest.log" "$OUT/parts.log" "$OUT/fla.log" "$OUT/vector.log"
[[ $steps == *,tests,* ]] && REWY_MOSAIC_ON_GPU=1 REWY_JAX_TEST_CACHE=0 timeout "${CHECK_T1:-200}" \
  python3 -m pytest -q -p no:cacheprovider -rs tests/test_mosaic_gpu.py tests/test_mosaic_gpu_vector.py \
  -k "$tests" > "$OUT/pytest.log" 2>&1
[[ $steps == *,parts,* ]] && timeout "${CHECK_T2:-130}" python3 -m benchmarks.mosaic_kernels --shapes anchor \
  --parts --skip-accuracy --impls "ours mosaic,ours mosaic wy,jla mosaic" > "$OUT/parts.log" 2>&1
[[ $steps == *,fla,* ]] && timeout "${CHECK_T3:-200}" python3 -m benchmarks.mosaic_kernels --shapes fla \
  --impls "ours mosaic,jla mosaic" > "$OUT/fla.log" 2>&1
[[ $steps == *,vector,* ]] && timeout "${CHECK_T4:-300}" python3 -m benchmarks.mosaic_kernels --vector-parts \
  > "$OUT/vector.log" 2>&1
echo "== tests (a line of dots without a summary: the step ran out of time)"
grep -v "^ptxas\|bytes stack frame\|Compile time" "$OUT/pytest.log" | tail -15 | cut -c1-300
echo "== kernels at the anchor"
grep "kind': 'check" "$OUT/parts.log" | cut -c1-300
sed -n '/| op | part/,$p' "$OUT/parts.log"
echo "== FLA's shapes"
grep "kind': 'accuracy" "$OUT/fla.log" | cut -c1-200
sed -n '/| op | shape | phase/,$p' "$OUT/fla.log"
echo "== vector kernels at the anchor"
sed -n '/| op | part/,/^$/p' "$OUT/vector.log"
