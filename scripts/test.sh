#!/usr/bin/env bash
# Set up, then run the linter and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check reasonctl tests examples bench
# Without arguments: the default suite. The end-to-end learning runs (marker slow), the
# fault campaign (faults) and the vLLM suite (scripts/test_vllm.sh) are steps of their own
# in .ci/run; `bash scripts/test.sh -m slow` runs the learning runs.
if [ "$#" -eq 0 ]; then
  set -- -m "not slow and not faults and not vllm"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
