#!/usr/bin/env bash
# Set up (if needed) and run the test suite that CI runs: everything except
# tests marked slow or gpu, on two pytest-xdist workers (most tests wait on
# processes, a server or the disk for part of their time: two workers on the
# 2-core machine take the suite from 31 to about 17 minutes).
#
#   bash scripts/test.sh            # the full CI run: the docs site (mkdocs build --strict), then the tests
#   bash scripts/test.sh unit       # the unit layer only (no process, server or framework): under a minute
#   bash scripts/test.sh -n 0 ...   # extra arguments go to pytest (-n 0: one process, e.g. to debug)
set -euo pipefail
cd "$(dirname "$0")/.."
# The tests run every integration against the real framework: install them all.
LAZYCKPT_EXTRAS="${LAZYCKPT_EXTRAS:-test,s3,bench,cli,plot,report,deepspeed,lightning,pytorch-lightning,hf,torchtitan,megatron,docs}" bash scripts/setup.sh
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1
if [ "${1:-}" = "unit" ]; then
  shift
  exec .venv/bin/python -m pytest -m unit "$@"
fi
# The docs site (a few seconds): a broken link, a missing page or an API reference
# that no longer resolves fails the run before the tests start.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
exec .venv/bin/python -m pytest -m "not slow and not gpu" -n 2 --dist worksteal "$@"
