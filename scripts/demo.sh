#!/usr/bin/env bash
# The main job: MQAR recall benchmark of the four delta-rule mixers and a softmax baseline on CPU
# (a few minutes on 2 cores; progress bars, a results table, runs/mqar/mqar.png).
# Extra arguments go to examples/mqar.py (see --help), e.g. --steps, --seq-len, --d-model, --backend.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python examples/mqar.py "$@"
