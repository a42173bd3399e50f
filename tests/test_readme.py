"""The code a newcomer copies runs as written: every ```python block of the
README and of the docs' Getting started page, each alone, in a fresh
interpreter in an empty directory (so a block cannot lean on another one, on
the test's imports, or on files left by an earlier run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", os.path.join("docs", "getting-started.md")]
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(path: str) -> list:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


CASES = [pytest.param(path, line, code, id=f"{os.path.basename(path)}:{line}")
         for path in DOCS for line, code in python_blocks(path)]


def test_each_page_has_code_to_run():
    for path in DOCS:
        assert python_blocks(path), f"{path} has no ```python block: the quickstart is gone or mis-fenced"


@pytest.mark.parametrize("path,line,code", CASES)
def test_python_block_runs_as_written(tmp_path, path, line, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYCKPT_")}
    env.update(HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="always::DeprecationWarning")   # a block uses only the current spellings
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (f"the ```python block at {path}:{line} failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert "LazyckptDeprecationWarning" not in proc.stderr, \
        f"the ```python block at {path}:{line} uses a deprecated spelling:\n{proc.stderr[-4000:]}"
