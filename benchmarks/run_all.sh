#!/usr/bin/env bash
# Regenerate every figure of BENCHMARKS.md on this machine (about 30 minutes on
# 2 cores; run it alone: other load distorts the timings). Outputs go to
# bench-out/ (logs, JSON) and docs/ (charts).
set -euo pipefail
cd "$(dirname "$0")/.."
LAZYCKPT_EXTRAS=test,bench,cli,plot,deepspeed,hf bash scripts/setup.sh
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1
mkdir -p bench-out/cli
PY=.venv/bin/python
$PY benchmarks/bench_core.py --gib 1 --reps 3                                   | tee bench-out/core.log
$PY benchmarks/bench_training.py --hidden 768 --layers 8 --seq 512 --batch 2 --iters 8 --every 1 \
    --cache-mib 2048 --dir bench-out/training --json bench-out/training.json    | tee bench-out/training.log
$PY benchmarks/bench_memory.py --gib 1 --saves 3 --dir bench-out/memory         | tee bench-out/memory.log
$PY benchmarks/bench_integrations.py --mib 128 --reps 3                         | tee bench-out/integrations.log
$PY benchmarks/bench_scale.py                                                   | tee bench-out/scale.log
.venv/bin/lazyckpt bench --size 1G --reps 3 --drop-caches --dir bench-out/cli \
    --json bench-out/cli-bench.json --png docs/bench.png                        | tee bench-out/cli-bench.log
.venv/bin/lazyckpt bench --timeline docs/timeline.png --no-table --dir bench-out/cli | tee bench-out/timeline.log
