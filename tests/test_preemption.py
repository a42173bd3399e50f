"""Preemption with a real signal (lazyckpt/preemption.py, Checkpointer.should_save).

A training run (tests/_preempt_train.py: a small model and AdamW, saving with
``interval=Every(steps=1000)``, ``preemption=True``) gets SIGTERM mid-run from
this process: it must end within 30 s with a committed step at or after the
step the signal arrived at, the step committed when its ``save()`` returned,
its own SIGTERM handler run (after the save); a run resumed from that step is
bit-exact with an uninterrupted one. The same with 2 ranks under torchrun, the
signal sent to one rank only: both ranks save the same step and stop. And the
round through the store that agrees on it, on a real TCPStore.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from _env import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_preempt_train.py")


def _launch(world: int, args: list, cwd: str) -> subprocess.Popen:
    head = [sys.executable] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    err = open(os.path.join(cwd, "stderr.txt"), "a")
    return subprocess.Popen(head + [SCRIPT] + args, stdout=subprocess.PIPE, stderr=err, text=True, env=child_env(),
                            cwd=cwd)


def _wait_for_steps(proc: subprocess.Popen, world: int, at_least: int, timeout: float = 120.0) -> int:
    """Read the runs' "rank R step S" lines until every rank is past ``at_least``;
    returns the highest step printed so far (the signal arrives at or after it)."""
    deadline = time.monotonic() + timeout
    seen = {}
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the run ended before step {at_least} (rc {proc.wait()})")
        words = line.split()
        if len(words) == 4 and words[0] == "rank" and words[2] == "step":
            seen[int(words[1])] = int(words[3])
            if len(seen) == world and min(seen.values()) >= at_least:
                return max(seen.values())
    raise AssertionError(f"no step {at_least} within {timeout} s")


def _drain(proc: subprocess.Popen) -> threading.Thread:
    """Keep reading stdout (a full pipe would block the run while it stops)."""
    t = threading.Thread(target=lambda: proc.stdout.read(), daemon=True)
    t.start()
    return t


def _stderr(cwd: str) -> str:
    with open(os.path.join(cwd, "stderr.txt")) as f:
        return f.read()[-4000:]


def _preempt_and_resume(tmp_path, world: int, signalled_rank: int) -> None:
    cwd = str(tmp_path)
    ck = os.path.join(cwd, "ck")
    proc = _launch(world, ["run", ck, "0.01"], cwd)
    try:
        _wait_for_steps(proc, world, 20)
        pid_file = os.path.join(cwd, f"pid_rank{signalled_rank}")
        pid = int(open(pid_file).read())
        # The step every rank printed last, read again right before the signal.
        arrived = _wait_for_steps(proc, world, 21)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        _drain(proc)
        assert proc.wait(30) == 0, _stderr(cwd)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 30
    reports = [json.load(open(os.path.join(cwd, f"rank{r}.json"))) for r in range(world)]
    saved = {r["rank"]: r["saved"] for r in reports}
    # One save on every rank, of the same step (the interval would save at 1000 only).
    steps = {tuple(s["step"] for s in v) for v in saved.values()}
    assert len(steps) == 1, saved
    (step,), = steps
    assert step >= arrived and all(r["preempted"] and r["last_step"] == step for r in reports)
    assert all(v[0]["committed_on_return"] for v in saved.values()), saved
    assert sorted(n for n in os.listdir(ck) if n.startswith("step_")) == [f"step_{step:010d}"]
    # The user's own SIGTERM handler ran, after the preempted save, on the rank the signal reached only.
    for r in reports:
        assert os.path.exists(os.path.join(cwd, f"user_handler_rank{r['rank']}")) == (r["rank"] == signalled_rank)
        assert r["user_ran_before_close"] == (r["rank"] == signalled_rank)
    # Resumed from that step for 25 more steps: bit-exact with a run that was never interrupted.
    proc = _launch(world, ["resume", ck, "25"], cwd)
    try:
        proc.stdout.read()
        assert proc.wait(120) == 0, _stderr(cwd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for r in range(world):
        resumed = json.load(open(os.path.join(cwd, f"resume_rank{r}.json")))
        assert resumed["latest"] == step and resumed["target"] == step + 25
        assert resumed["equal"], resumed


@pytest.mark.timeout(240)
def test_sigterm_mid_run_saves_the_step_and_resumes_bit_exact(tmp_path):
    _preempt_and_resume(tmp_path, 1, 0)


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_of_two_under_torchrun(tmp_path):
    _preempt_and_resume(tmp_path, 2, 1)


def test_the_agreement_round_on_a_real_store():
    """Two ranks (threads, each its own client of one TCPStore): any rank's flag and
    rank 0's clock reach both; each round's keys go once the next round is complete."""
    from datetime import timedelta

    import torch.distributed as dist

    from lazyckpt.distributed import RankInfo
    from lazyckpt.schedule import SaveSchedule

    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    stores = [dist.PrefixStore("t/", server),
              dist.PrefixStore("t/", dist.TCPStore("127.0.0.1", server.port, 2, False,
                                                   timeout=timedelta(seconds=30)))]
    schedules = [SaveSchedule(None, False, dist=RankInfo(rank=r, world_size=2, store=stores[r], timeout_s=20))
                 for r in range(2)]
    rounds = [(False, False, False), (False, True, False), (True, False, False), (False, False, True),
              (False, False, False)]
    results = {0: [], 1: []}

    def rank(r):
        for clock, flag0, flag1 in rounds:
            flag = flag0 if r == 0 else flag1
            results[r].append(schedules[r]._agree(flag, clock and r == 0))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = [(f0 or f1, c) for c, f0, f1 in rounds]
    assert results[0] == want and results[1] == want
    # Rounds 0..3 were deleted by the round after each; the last one's keys stay.
    assert not stores[0].check(["sched/0"]) and not stores[0].check(["sched/3/sum"])
    assert stores[0].check(["sched/4/sum"])


def _clock_ranks(rank, world, directory):
    import lazyckpt
    import torch
    with lazyckpt.Checkpointer(directory, interval=lazyckpt.Every(seconds=0.15)) as ck:
        saved = []
        for step in range(1, 40):
            time.sleep(0.01 * (1 + rank))       # the ranks' own clocks would disagree
            if ck.should_save(step):
                ck.save({"w": torch.full((100,), float(step))}, step)
                saved.append(step)
        ck.wait()
        return saved, ck.steps()


def test_a_clock_interval_saves_the_same_steps_on_every_rank(tmp_path):
    """Every(seconds=) under torch.distributed: rank 0's clock, agreed on at every call."""
    from _dist import run_ranks
    results = run_ranks(2, _clock_ranks, str(tmp_path / "run"))
    (saved0, steps0), (saved1, steps1) = results
    assert saved0 == saved1 and steps0 == steps1 == saved0 and len(saved0) >= 2
