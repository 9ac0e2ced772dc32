#!/usr/bin/env bash
# Set up, then fine-tune the built-in tiny model on the bundled data set (CPU, ~2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT="${1:-outputs/quickstart_sft}"
exec .venv/bin/reasonctl run --algo sft --config examples/configs/quickstart_sft.toml \
  --set "run.output_dir='$OUT'"
