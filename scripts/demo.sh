#!/usr/bin/env bash
# Set up (if needed) and run the demo: train with a checkpoint every step,
# compare with torch.save, crash, restore, verify bit-exact.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
