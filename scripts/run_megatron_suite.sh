#!/usr/bin/env bash
# Megatron-Core's own dist_checkpointing unit tests (tag core_v0.19.0, the tag of
# the installed megatron-core 0.19.2's line) on CPU, 2 gloo ranks under torchrun (NPROC=8 for the tests written for 8 GPUs),
# with Megatron's save strategy (baseline) and with lazyckpt's LazySaveStrategy
# swapped in (scripts/megatron_suite_swap.py). Not part of CI.
#   MEGATRON_SRC=/path/to/Megatron-LM-checkout scripts/run_megatron_suite.sh [baseline|lazyckpt]...
# FILES=... picks the test files (relative to tests/unit_tests/dist_checkpointing).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SRC=${MEGATRON_SRC:?set MEGATRON_SRC to a Megatron-LM git checkout}
TAG=${MEGATRON_TAG:-core_v0.19.0}
WORK=${WORK:-/tmp/megatron-suite}
if [ ! -d "$WORK/tests/unit_tests/dist_checkpointing" ]; then
  mkdir -p "$WORK"
  git -C "$SRC" archive "$TAG" tests/__init__.py tests/unit_tests/__init__.py tests/unit_tests/conftest.py \
    tests/unit_tests/test_utilities.py tests/unit_tests/dist_checkpointing | tar -x -C "$WORK"
  # The suite's session fixture downloads a data set the dist_checkpointing tests do not read:
  # this stand-in makes it warn instead (the machine is offline).
  mkdir -p "$WORK/tests/test_utils/python_scripts"
  touch "$WORK/tests/test_utils/__init__.py" "$WORK/tests/test_utils/python_scripts/__init__.py"
  printf 'def download_and_extract_asset(*args, **kwargs):\n    raise ImportError("offline: no test data")\n' \
    > "$WORK/tests/test_utils/python_scripts/download_unit_tests_dataset.py"
fi
FILES=${FILES:-"test_serialization.py test_torch_dist.py test_async_save.py test_fully_parallel.py
test_mapping.py test_strict.py test_validation.py test_replication.py test_checkpointable.py test_safe_globals.py
test_integrity.py test_global_metadata_reuse.py"}
MODES=${*:-baseline lazyckpt}
for mode in $MODES; do
  swap=1; [ "$mode" = baseline ] && swap=
  echo "=== $mode"
  (cd "$WORK" && \
   LAZYCKPT_SWAP=$swap SUITE_RESULTS="$WORK/results-$mode" PYTHONPATH="$ROOT/scripts:$ROOT/src:$WORK" DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \
   nice -n ${NICE:-10} "$ROOT/.venv/bin/torchrun" --nproc-per-node ${NPROC:-2} --master-port ${PORT:-29571} -m pytest -q \
     -p megatron_suite_swap -p no:cacheprovider -p no:randomly --timeout ${TIMEOUT:-300} -o addopts="" \
     $(for f in $FILES; do echo "tests/unit_tests/dist_checkpointing/$f"; done) 2>&1 \
     | grep -E "passed|failed|error|lazyckpt swap|^(FAILED|ERROR)" | tail -${TAIL:-80}) || true
done
# Per test and rank: $WORK/results-<mode>-<rank>.json; the summary compares the modes.
"$ROOT/.venv/bin/python" - "$WORK" $MODES <<'PY'
import glob, json, sys
work, modes = sys.argv[1], sys.argv[2:]
merged = {}
for mode in modes:
    per = {}
    for path in sorted(glob.glob(f"{work}/results-{mode}-*.json")):
        for test, outcome in json.load(open(path))["outcomes"].items():
            if per.get(test, "passed") == "passed":
                per[test] = outcome          # a test passes only where it passed on every rank
    merged[mode] = per
    counts = {}
    for outcome in per.values():
        counts[outcome.split()[0]] = counts.get(outcome.split()[0], 0) + 1
    print(mode, len(per), "tests:", counts)
if len(modes) == 2:
    a, b = (merged[m] for m in modes)
    for test in sorted(set(a) | set(b)):
        if a.get(test) != b.get(test):
            print(f"  differs: {test}: {modes[0]} {a.get(test)}, {modes[1]} {b.get(test)}")
PY
