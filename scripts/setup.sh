#!/usr/bin/env bash
# Create .venv (once) and install reasonctl with its development extras.
# torch is installed as the CPU build 2.13.0 only when no torch is importable yet.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${REASONCTL_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "==> installing torch 2.13.0 (CPU build)"
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
if ! "$PY" -c "import reasonctl, pytest, av, moto" >/dev/null 2>&1 \
   || [ pyproject.toml -nt "$VENV/.reasonctl-installed" ]; then
  echo "==> installing reasonctl[dev]"
  "$PY" -m pip install --quiet -e ".[dev]"
  touch "$VENV/.reasonctl-installed"
fi
