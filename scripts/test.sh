#!/usr/bin/env bash
# Set up (if needed) and run the test suite that CI runs: everything except
# tests marked slow or gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests run every integration against the real framework: install them all.
LAZYCKPT_EXTRAS="${LAZYCKPT_EXTRAS:-test,s3,bench,cli,plot,deepspeed,lightning,pytorch-lightning,hf,torchtitan}" bash scripts/setup.sh
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -m "not slow and not gpu" "$@"
