#!/usr/bin/env bash
# The test suite on CPU (Pallas kernels in interpret mode). Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
export JAX_PLATFORMS=cpu
exec python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
