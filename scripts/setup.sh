#!/usr/bin/env bash
# Create .venv (once) and install reasonctl from this clone, editable.
#   bash scripts/setup.sh        the core package: what the quickstart needs
#   bash scripts/setup.sh dev    the development extras (tests, linters, docs, every integration)
# torch is installed as the CPU build 2.13.0 only when no torch is importable yet.
set -euo pipefail
cd "$(dirname "$0")/.."
LEVEL="${1:-core}"
case "$LEVEL" in
  core) TARGET="."; CHECK="import reasonctl" ;;
  dev) TARGET=".[dev]"; CHECK="import reasonctl, pytest, av, moto, mkdocs" ;;
  *) echo "usage: bash scripts/setup.sh [core|dev]" >&2; exit 2 ;;
esac
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
MARKER="$VENV/.reasonctl-installed-$LEVEL"
if ! "$PY" -c "$CHECK" >/dev/null 2>&1 || [ pyproject.toml -nt "$MARKER" ]; then
  echo "==> installing reasonctl ($TARGET)"
  "$PY" -m pip install --quiet -e "$TARGET"
  touch "$MARKER"
fi
