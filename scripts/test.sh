#!/usr/bin/env bash
# The test suite on CPU (Pallas kernels in interpret mode).
#
#   bash scripts/test.sh           the fast tier (tests marked `fast` in tests/conftest.py):
#                                  every op on every backend at small sizes, the layers, the
#                                  demo's smoke run, the validation errors — a few minutes
#   bash scripts/test.sh --all     every test (what CI runs, .ci/run)
#
# Other arguments go to pytest (`bash scripts/test.sh -k gdn2 -x`, `bash scripts/test.sh --all
# tests/test_layers.py`). PYTEST_WORKERS sets the number of pytest-xdist workers (default 2).
# RUN_SLOW=1 also runs the few tests marked slow (larger shapes).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export JAX_PLATFORMS=cpu
tier=(-m fast)
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then tier=(); else args+=("$a"); fi
done
exec python -m pytest -n "${PYTEST_WORKERS:-2}" "${tier[@]}" "${args[@]}"
