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
case ",${LAZYCKPT_EXTRAS:-bench}," in
  *,megatron,*)     # 0.19.2 declares Python >= 3.12: see the megatron extra in pyproject.toml
    .venv/bin/python -m pip install --quiet -c constraints.txt --no-deps --ignore-requires-python \
      "megatron-core==0.19.2" ;;
esac
case ",${LAZYCKPT_EXTRAS:-bench}," in
  *,test,*)   # the browser tests (marker browser) open `lazyckpt report`'s page in Debian's chromium
    if ! command -v chromium >/dev/null 2>&1; then
      SUDO=""
      [ "$(id -u)" = 0 ] || SUDO="sudo -n"
      if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }; then
        { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium; } \
          >/dev/null || echo "setup.sh: apt-get could not install chromium: the browser tests will skip" \
                             "(and fail under CI)" >&2
      else
        echo "setup.sh: chromium is missing and cannot be installed here (needs apt-get as root or" \
             "password-less sudo): the browser tests (marker browser) will skip" >&2
      fi
    fi ;;
esac
.venv/bin/python -c "import torch, lazyckpt; print('lazyckpt', lazyckpt.__version__, 'torch', torch.__version__)"
