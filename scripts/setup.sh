#!/usr/bin/env bash
# Create .venv and install lazyckpt with the extras named in $LAZYCKPT_EXTRAS
# (default "bench": what the demo needs). torch is pinned by constraints.txt to
# the 2.13.0 CPU build: without the pin pip may pull a multi-GB CUDA build.
set -euo pipefail
# DeepSpeed (extra "deepspeed") must not try to compile its CUDA/CPU ops at install.
export DS_BUILD_OPS=0
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[${LAZYCKPT_EXTRAS:-bench}]"
case ",${LAZYCKPT_EXTRAS:-bench}," in
  *,torchtitan,*)   # its checkpoint manager alone: see the torchtitan extra in pyproject.toml
    .venv/bin/python -m pip install --quiet -c constraints.txt --no-deps "torchtitan==0.3.0" ;;
esac
.venv/bin/python -c "import torch, lazyckpt; print('lazyckpt', lazyckpt.__version__, 'torch', torch.__version__)"
