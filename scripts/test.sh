#!/usr/bin/env bash
# Set up, then run the linter and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check reasonctl tests examples bench
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
