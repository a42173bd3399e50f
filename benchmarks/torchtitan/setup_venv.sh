#!/usr/bin/env bash
# A venv that trains with torchtitan 0.3.0 on this machine's CPU torch, with lazyckpt from this
# checkout (a .pth file: an editable install would rewrite src/lazyckpt.egg-info of the main venv).
#   bash benchmarks/torchtitan/setup_venv.sh /work/ttvenv
# Pins (constraints): torch 2.13.0 (the CPU build; unpinned, pip may pull a CUDA one);
# torch_checkpointing 0.1.0 (0.1.1 renamed the module torchtitan's torch_checkpointing backend
# imports). triton: torchtitan.trainer imports it (distributed/minimal_async_ep/kernels.py) and
# the CPU torch wheel does not bring it.
set -euo pipefail
VENV=${1:?usage: setup_venv.sh VENV_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "$HERE/../../src" && pwd)
CONSTRAINTS=$(mktemp)
printf 'torch==2.13.0\ntorch_checkpointing==0.1.0\n' > "$CONSTRAINTS"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS" torch==2.13.0
"$VENV/bin/python" -m pip install --quiet -c "$CONSTRAINTS" torchtitan==0.3.0 torch_checkpointing==0.1.0 triton pytest \
    numpy xxhash isal
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$SRC" > "$SITE/lazyckpt-dev.pth"
"$VENV/bin/python" -c "import torch, torchtitan, lazyckpt.integrations.torchtitan; print('torch', torch.__version__, 'lazyckpt ok')"
