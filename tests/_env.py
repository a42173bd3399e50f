"""The environment of a child process a test starts."""

from __future__ import annotations

import os
from typing import Dict


def child_env(**overrides: str) -> Dict[str, str]:
    """This process's environment less lazyckpt's knobs (``LAZYCKPT_*``: a
    developer's shell must not change what a child exercises, as
    conftest.py's autouse fixture ensures for this process), with one OpenMP
    thread (the child shares the machine's cores with the test and its other
    children) and unbuffered output (a test reading a child's lines sees each
    as it is printed), then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYCKPT_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(overrides)
    return env
