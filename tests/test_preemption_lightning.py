"""Preemption under Lightning (lazyckpt/integrations/lightning_preemption.py):
a real SIGTERM sent to a Lightning fit with ``LazyCheckpointIO`` and
``SaveOnPreemption`` ends it within 30 s with a durable checkpoint of the step
the signal arrived at (or the next one), and ``fit(ckpt_path=...)`` from it is
bit-exact with an uninterrupted run (tests/_preempt_lightning.py)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _env import child_env
from _frameworks import require

require("lightning.pytorch")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_preempt_lightning.py")


def test_sigterm_saves_the_step_then_fit_ends_and_resumes_bit_exact(tmp_path):
    ck = str(tmp_path / "ck")
    err = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, SCRIPT, "run", ck], stdout=subprocess.PIPE, stderr=err, text=True,
                            env=child_env(), cwd=str(tmp_path))
    try:
        arrived = None
        while arrived is None or arrived < 20:
            line = proc.stdout.readline()
            assert line, f"the run ended early: {open(tmp_path / 'stderr.txt').read()[-3000:]}"
            if line.startswith("rank 0 step "):
                arrived = int(line.split()[-1])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.stdout.read()
        assert proc.wait(30) == 0, open(tmp_path / "stderr.txt").read()[-3000:]
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 30
    run = json.load(open(tmp_path / "run.json"))
    (path,) = glob.glob(os.path.join(ck, "preempted-step=*.ckpt"))
    assert run["saved"] == path and run["stopped_by"] == "SIGTERMException"
    step = int(path.rsplit("=", 1)[1].split(".")[0])
    # The signal came after the step printed last began; the save is of the global step after it.
    assert step >= arrived + 1 and run["global_step"] == step
    assert torch.load(path, weights_only=False)["global_step"] == step     # whole: durable when fit ended
    proc = subprocess.run([sys.executable, SCRIPT, "resume", ck, "15"], capture_output=True, text=True,
                          env=child_env(), cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.load(open(tmp_path / "resume.json"))
    assert resumed == {"step": step, "equal": True}


def test_refuses_a_filename_without_the_step():
    from lazyckpt.integrations.lightning_preemption import SaveOnPreemption
    with pytest.raises(ValueError, match=r"\{step\}"):
        SaveOnPreemption(filename="preempted.ckpt")
    with pytest.raises(ValueError, match="grace"):
        SaveOnPreemption(grace="soon")
