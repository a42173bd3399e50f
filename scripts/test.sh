#!/usr/bin/env bash
# Set up (if needed) and run the test suite that CI runs: everything except
# tests marked slow or gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m "not slow and not gpu" "$@"
