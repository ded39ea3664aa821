#!/usr/bin/env bash
# The main job. Extra arguments go to the demo.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec python examples/accuracy_demo.py "$@"
