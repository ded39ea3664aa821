# Sourced by the project's commands: find Python >= 3.12 (PATH first, then pyenv), make .venv,
# install the package with its test and example extras. Idempotent and quick when up to date.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c
  for c in python3.13 python3.12 python3 python; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$c"; then command -v "$c"; return 0; fi
  done
  if command -v pyenv >/dev/null 2>&1 || [ -d "${PYENV_ROOT:-$HOME/.pyenv}/versions" ]; then
    local root="${PYENV_ROOT:-$HOME/.pyenv}" v
    for v in $(ls -1 "$root/versions" 2>/dev/null | sort -rV); do
      if [ -x "$root/versions/$v/bin/python" ] && py_ok "$root/versions/$v/bin/python"; then
        echo "$root/versions/$v/bin/python"; return 0
      fi
    done
  fi
  return 1
}

VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ] || ! py_ok "$VENV/bin/python"; then
  PY="$(find_python)" || {
    echo "error: rewy-jax needs Python >= 3.12; none found on PATH or under pyenv." >&2
    echo "       Install one (e.g. 'pyenv install 3.12') and run this command again." >&2
    exit 1
  }
  echo "==> creating .venv with $PY ($("$PY" --version 2>&1))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.installed-$(cat setup.cfg pyproject.toml | cksum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ]; then
  echo "==> installing rewy-jax and its dependencies into .venv (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[test,examples]"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
