#!/usr/bin/env bash
# Lightning's own checkpointing tests (tag 2.6.5, the nearest to the installed
# 2.6.6) with the default CheckpointIO and with lazyckpt's LazyCheckpointIO
# swapped into every Trainer (scripts/lightning_suite_swap.py). Not part of CI.
#   LIGHTNING_SRC=/path/to/pytorch-lightning-checkout scripts/run_lightning_suite.sh [baseline|torch|lazyckpt]...
# LIGHTNING_SRC: a git checkout of Lightning-AI/pytorch-lightning (the tests are exported from tag 2.6.5).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=${LIGHTNING_SRC:?set LIGHTNING_SRC to a pytorch-lightning git checkout}
WORK=${WORK:-/tmp/lightning-suite}
if [ ! -d "$WORK/tests/tests_pytorch" ]; then
  mkdir -p "$WORK"
  git -C "$SRC" archive 2.6.5 tests/tests_pytorch tests/legacy | tar -x -C "$WORK"
fi
FILES="checkpointing/test_model_checkpoint.py checkpointing/test_checkpoint_callback_frequency.py
checkpointing/test_trainer_checkpoint.py checkpointing/test_legacy_checkpoints.py checkpointing/test_torch_saving.py
plugins/test_checkpoint_io_plugin.py plugins/test_async_checkpoint.py"
MODES=${*:-baseline torch lazyckpt}
for mode in $MODES; do
  swap=$mode; [ "$mode" = baseline ] && swap=
  echo "=== $mode"
  (cd "$WORK/tests/tests_pytorch" && \
   LAZYCKPT_SWAP=$swap PYTHONPATH="$ROOT/scripts:$ROOT/src:$WORK/tests" DS_ACCELERATOR=cpu \
   "$ROOT/.venv/bin/python" -m pytest -q -p lightning_suite_swap -p no:cacheprovider --timeout 300 \
     -o addopts="" $FILES 2>&1 | tail -${TAIL:-40}) || true
done
