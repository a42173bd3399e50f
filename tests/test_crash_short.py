"""Crash consistency under SIGKILL, short CI version of benchmarks/stress_crash.py
(the full run is ``--trials 60``; see docs/RELIABILITY.md).

A forked training child saves asynchronously every step (keep_last=2, host
cache far smaller than the state) and is SIGKILLed at random instants; the
next process must find every committed step loadable and bit-exact against a
reference log fsynced before each save, no leftover listed or surviving a
Checkpointer open, and must resume from the latest step."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import lazyckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "stress_crash.py")


def _stress_module():
    spec = importlib.util.spec_from_file_location("stress_crash", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_sigkill_at_random_instants_loses_nothing(tmp_path):
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--trials", "5", "--size", "small", "--max-delay", "0.8",
         "--targeted-fraction", "0.5", "--dir", str(tmp_path / "run"), "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["trials"] == 5 and summary["successes"] == 5, summary
    assert summary["failures"] == []
    assert sum(summary["phases"].values()) == 5
    # Training made progress across the kills and the last state is committed. A
    # kill after a commit's rename and before its retention legitimately leaves
    # keep_last + 1 committed steps (stress_crash classifies that phase): the
    # next commit's retention trims them; opening a Checkpointer deletes nothing.
    assert summary["final_steps"] and len(summary["final_steps"]) <= 2 + 1
    # Nothing but committed steps (and the advisory latest, the history record) is left.
    names = sorted(os.listdir(tmp_path / "run"))
    assert all(n in ("latest", "history.json") or n.startswith("step_") for n in names), names


@pytest.mark.timeout(120)
def test_sigkill_with_incremental_checkpoints_loses_nothing(tmp_path):
    """The same with incremental checkpoints (a frozen layer referred to in
    earlier steps, a full save every third): kills during the retention of
    referred-to steps must never leave a committed step with a dangling
    reference (every committed step is loaded and compared)."""
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--trials", "6", "--size", "small", "--max-delay", "0.8",
         "--targeted-fraction", "0.5", "--incremental", "content", "--full-every", "3",
         "--dir", str(tmp_path / "run"), "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["trials"] == 6 and summary["successes"] == 6 and summary["failures"] == []
    steps = summary["final_steps"]
    manifests = [json.loads((tmp_path / "run" / f"step_{s:010d}" / "manifest.json").read_text()) for s in steps]
    # Not vacuous: committed steps referred to earlier ones, as seen by the checks after
    # each kill (the final steps alone may all be full saves: a restart's first save is).
    assert summary["referring_steps_seen"] > 0, "no committed step referred to an earlier one"
    for m in manifests:
        assert set(m.get("references", [])) <= set(steps)


def test_the_checker_detects_a_wrong_checkpoint(tmp_path):
    """The verification is not vacuous: a committed step whose bytes differ from
    its reference, or whose reference is missing, is reported."""
    sc = _stress_module()
    directory, log = str(tmp_path / "run"), str(tmp_path / "run.reflog")
    model, opt = sc.build(16)
    with lazyckpt.Checkpointer(directory, keep=2) as ckpt:
        for step in (1, 2):
            sc.train_step(model, opt, 16, step)
            state = sc.make_state(model, opt, step)
            sc.append_reference(log, step, sc.state_digests(state))
            ckpt.save(state, step=step).wait()
    report, ckpt, *_ = sc.verify_directory(directory, log, 16, {})
    ckpt.close()
    assert report["problems"] == [] and report["steps"] == [1, 2] and report["restored_step"] == 2

    # A reference that no longer matches (as if the checkpoint held other bytes).
    lines = open(log).read().splitlines()
    rec = json.loads(lines[0])
    key = next(k for k in rec["digests"] if k.startswith("/model/"))
    rec["digests"][key] = "0" * 64
    with open(log, "w") as f:
        f.write(json.dumps(rec) + "\n" + lines[1] + "\n")
    report, ckpt, *_ = sc.verify_directory(directory, log, 16, {})
    ckpt.close()
    assert any("step 1 differs" in p for p in report["problems"]), report["problems"]

    # A leftover is cleaned on open and reported in the inferred phase.
    os.mkdir(os.path.join(directory, ".deleting-step_0000000001-deadbeef"))
    assert sc.classify(directory).startswith("retention delete")
    report, ckpt, *_ = sc.verify_directory(directory, log, 16, {})
    ckpt.close()
    assert report["leftovers_before_open"] == [".deleting-step_0000000001-deadbeef"]
    assert report["leftovers_after_open"] == []


def test_torn_reference_line_is_ignored_and_determinism_is_checked(tmp_path):
    sc = _stress_module()
    log = str(tmp_path / "log")
    sc.append_reference(log, 1, {"a": "x"})
    sc.append_reference(log, 2, {"a": "y"})
    with open(log, "a") as f:
        f.write('{"step": 3, "dig')                 # killed mid-append
    refs, problems = sc.read_references(log)
    assert sorted(refs) == [1, 2] and problems == []
    sc.truncate_torn_tail(log)
    sc.append_reference(log, 2, {"a": "z"})         # a recomputed step that hashes differently
    refs, problems = sc.read_references(log)
    assert refs[2] == {"a": "z"} and any("step 2" in p for p in problems)


def test_digest_covers_dtype_shape_and_bytes():
    sc = _stress_module()
    a = torch.zeros(4)
    assert sc.tensor_digest(a) != sc.tensor_digest(torch.zeros(2, 2))
    assert sc.tensor_digest(a) != sc.tensor_digest(torch.zeros(4, dtype=torch.int32))
    b = a.clone()
    b[3] = -0.0
    assert sc.tensor_digest(a) != sc.tensor_digest(b)     # bit-exact, not ==
