#!/usr/bin/env bash
# torchtitan's own checkpoint tests, plain and with lazyckpt's LazyCheckpointManager swapped in.
#   bash benchmarks/torchtitan/run_suite.sh VENV TORCHTITAN_GIT_DIR
# TORCHTITAN_GIT_DIR: a clone (or the mirror) of pytorch/torchtitan; the tests are taken at
# 0b2a804dd, whose checkpointer files are byte-identical to the 0.3.0 wheel's.
set -euo pipefail
VENV=${1:?usage: run_suite.sh VENV TORCHTITAN_GIT_DIR}
GIT=${2:?usage: run_suite.sh VENV TORCHTITAN_GIT_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/tests/unit_tests"
for f in test_checkpoint.py test_torch_checkpointing.py; do
  git -C "$GIT" show "0b2a804dd:tests/unit_tests/$f" > "$WORK/tests/unit_tests/$f"
done
cd "$WORK"
echo "== plain torchtitan"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/unit_tests/test_checkpoint.py tests/unit_tests/test_torch_checkpointing.py 2>&1 | tail -3
echo "== LazyCheckpointManager swapped in"
PYTHONPATH="$HERE" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p lazyckpt_swap tests/unit_tests/test_checkpoint.py tests/unit_tests/test_torch_checkpointing.py 2>&1 | tail -15
