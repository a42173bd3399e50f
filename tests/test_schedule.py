"""When to save (lazyckpt/schedule.py): ``Every``, ``Auto`` and the preemption
flag in one process; the Auto decision from given costs; bad arguments. The
real signal sent to training runs (one process, two ranks under torchrun) is
tests/test_preemption.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest
import torch

import lazyckpt
from lazyckpt import schedule as sched
from lazyckpt.saving.costs import daly
from lazyckpt.schedule import METADATA_KEY, Auto, Every, SaveSchedule


def due(schedule: SaveSchedule, steps) -> list:
    """The steps saved: a step said due is saved (as Checkpointer.save tells the schedule)."""
    out = []
    for s in steps:
        if schedule.should_save(s):
            schedule.saved(s)
            out.append(s)
    return out


# ----------------------------------------------------------------------------- Every


def test_every_steps_is_a_multiple_of_the_step_and_not_step_0():
    s = SaveSchedule(Every(steps=3))
    assert due(s, range(0, 13)) == [3, 6, 9, 12]
    assert not s.preempted
    # A resumed run asks from its own first step: the same multiples.
    assert due(SaveSchedule(Every(steps=3)), range(7, 13)) == [9, 12]


def test_every_seconds_counts_from_the_first_question_and_restarts_at_each_save():
    s = SaveSchedule(Every(seconds=0.2))
    assert not s.should_save(1)                  # the clock starts here
    assert not s.should_save(2)
    time.sleep(0.25)
    assert s.should_save(3)
    s.saved(3)
    assert not s.should_save(4)                  # restarted by the save
    time.sleep(0.25)
    assert s.should_save(5)


def test_every_steps_or_seconds_whichever_is_due():
    s = SaveSchedule(Every(steps=4, seconds="1h"))
    assert due(s, range(1, 9)) == [4, 8]
    s = SaveSchedule(Every(steps=1000, seconds=0.1))
    s.should_save(1)
    time.sleep(0.15)
    assert s.should_save(2)


def test_no_interval_never_saves_on_its_own():
    assert due(SaveSchedule(None), range(0, 50)) == []


@pytest.mark.parametrize("kwargs,match", [
    ({}, "needs steps=, seconds= or both"),
    ({"steps": 0}, r"Every\(steps=\) must be an int >= 1"),
    ({"steps": 2.5}, r"Every\(steps=\) must be an int >= 1"),
    ({"steps": True}, r"Every\(steps=\) must be an int >= 1"),
    ({"seconds": "10"}, "a unit is required"),
    ({"seconds": -1}, "positive"),
])
def test_every_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Every(**kwargs)


def test_durations_and_interval_spellings():
    assert Every(seconds="30min").seconds == 1800.0
    assert Every(seconds=90).seconds == 90.0
    assert sched.as_interval("auto") == Auto() and sched.as_interval(" AUTO ") == Auto()
    with pytest.raises(TypeError, match=r"Every\(steps=100\)"):
        sched.as_interval(100)
    with pytest.raises(ValueError, match="the only string is 'auto'"):
        sched.as_interval("hourly")
    with pytest.raises(TypeError, match="interval= must be"):
        sched.as_interval(1.5)
    with pytest.raises(ValueError, match=r"Auto\(mtbf=\)"):
        Auto(mtbf="eight hours")
    with pytest.raises(ValueError, match=r"Auto\(first_steps=\)"):
        Auto(first_steps=0)


# ----------------------------------------------------------------------------- Auto


def _cost(blocking: float, wait: float, prev_step: int, interval_s: float = 10.0) -> dict:
    return {"ranks": 1, "bytes": 1000, "blocking_s": blocking, "capture_s": 0.01, "flush_s": 0.02,
            "previous_save": {"step": prev_step, "interval_s": interval_s, "barrier_wait_s": wait,
                              "committed_s": 0.05}}


def test_auto_saves_every_first_steps_until_measured(monkeypatch):
    monkeypatch.delenv(sched.MTBF_ENV, raising=False)
    s = SaveSchedule(Auto(mtbf="8h", first_steps=5))
    assert due(s, range(10, 30)) == [15, 20, 25]     # counted from the first question, then each save
    assert s.should_save(30) and s.should_save(31)     # due until saved
    assert s.annotate({})[METADATA_KEY]["mode"] == "first_steps"


def test_auto_decides_daly_from_the_measured_costs(caplog):
    s = SaveSchedule(Auto(mtbf=3600.0, first_steps=10))
    # C = median blocking + median barrier wait (no iterations measured: incomplete).
    records = [{"step": 10 * i, "cost": _cost(0.02, 0.08, 10 * (i - 1))} for i in range(1, 4)]
    with caplog.at_level(logging.INFO, logger="lazyckpt"):
        decision = s.decide(records)
    c = 0.02 + 0.08
    assert decision["mode"] == "daly"
    assert decision["interval_s"] == pytest.approx(daly(c, 3600.0) + c)
    assert decision["cost_s"] == pytest.approx(c) and decision["mtbf_s"] == 3600.0
    assert decision["steps"] == round(decision["interval_s"] * 1.0)     # 10 steps per 10 s
    assert decision["cost_complete"] is False
    text = caplog.text
    assert "interval='auto': a save every" in text and "Daly's interval" in text and "M = 60 min" in text
    assert s.annotate({"loss": 1.0}) == {"loss": 1.0, METADATA_KEY: decision}
    # A cheaper save: a shorter interval (sqrt(C)).
    cheaper = s.decide([{"step": 10 * i, "cost": _cost(0.005, 0.02, 10 * (i - 1))} for i in range(1, 4)])
    assert cheaper["interval_s"] < decision["interval_s"] / 1.9


def test_auto_redecides_every_few_measured_saves_from_a_bounded_window():
    s = SaveSchedule(Auto(mtbf=100.0, first_steps=1))
    decisions = []
    for i in range(1, 1 + sched.AUTO_FIRST + 2 * sched.AUTO_EVERY):
        s.observe(i, _cost(0.001 * i, 0.0, i - 1))
        decisions.append(s._decision["mode"] == "daly" and s._decision["at_step"])
    assert decisions.index(sched.AUTO_FIRST) == sched.AUTO_FIRST - 1       # the first decision
    decided_at = sorted({d for d in decisions if d})
    assert decided_at == [sched.AUTO_FIRST, sched.AUTO_FIRST + sched.AUTO_EVERY,
                          sched.AUTO_FIRST + 2 * sched.AUTO_EVERY]
    assert len(s._records) == sched.AUTO_WINDOW
    # Decided: the clock uses the interval (a short one here).
    s._interval_s = 0.05
    s.saved(100)
    assert not s.should_save(101)
    time.sleep(0.07)
    assert s.should_save(102)
    # Ill-formed costs are not counted.
    n = s._measured
    s.observe(200, {"ranks": 0})
    s.observe(201, None)
    assert s._measured == n


def test_auto_mtbf_from_the_environment_or_assumed(monkeypatch, caplog):
    monkeypatch.setenv(sched.MTBF_ENV, "6h")
    assert SaveSchedule("auto")._mtbf_s == 6 * 3600.0
    monkeypatch.delenv(sched.MTBF_ENV)
    with caplog.at_level(logging.INFO, logger="lazyckpt"):
        s = SaveSchedule("auto")
    assert s._mtbf_s == 24 * 3600.0 and "assumes a job MTBF of 24h" in caplog.text
    monkeypatch.setenv(sched.MTBF_ENV, "forever")
    with pytest.raises(ValueError, match="LAZYCKPT_MTBF"):
        SaveSchedule("auto")


def test_auto_in_a_checkpointer_records_its_interval_in_the_manifests(tmp_path, caplog, monkeypatch):
    """A real run: the committed saves' costs reach the schedule; after AUTO_FIRST of them
    the interval is Daly's, logged, and the next saves' manifests record it."""
    monkeypatch.delenv(sched.MTBF_ENV, raising=False)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    with caplog.at_level(logging.INFO, logger="lazyckpt"):
        # A short MTBF: Daly's interval (sqrt(2 C M), C some ms) comes within the test's time.
        with lazyckpt.Checkpointer(str(tmp_path / "run"), interval=Auto(mtbf=0.5, first_steps=2)) as ck:
            ck.attach(opt)
            saved = []
            t0 = time.monotonic()
            for step in range(1, 100_000):
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                if ck.should_save(step):
                    ck.save({"model": model.state_dict()}, step).wait()
                    saved.append(step)
                if len(saved) == sched.AUTO_FIRST + 2 or time.monotonic() - t0 > 30:
                    break
                time.sleep(0.002)
            decision = ck._schedule._decision
    assert saved[:sched.AUTO_FIRST] == [3, 5, 7]
    assert decision["mode"] == "daly" and decision["saves"] >= sched.AUTO_FIRST
    assert "interval='auto': a save every" in caplog.text

    def recorded(step):
        with open(os.path.join(str(tmp_path / "run"), f"step_{step:010d}", "manifest.json")) as f:
            return json.load(f)["metadata"][METADATA_KEY]
    assert recorded(saved[0])["mode"] == "first_steps"
    assert recorded(saved[sched.AUTO_FIRST])["mode"] == "daly"


# ----------------------------------------------------------------------------- preemption (one process)


def test_preemption_flag_chain_and_restore():
    calls = []

    def mine(signum, frame):
        calls.append(signum)
    before = signal.signal(signal.SIGUSR1, mine)
    try:
        s = SaveSchedule(Every(steps=1000), lazyckpt.Preemption(grace="5s"))
        assert signal.getsignal(signal.SIGUSR1) != mine
        assert due(s, range(1, 5)) == [] and not s.preempted
        os.kill(os.getpid(), signal.SIGUSR1)
        assert s.preempted and calls == []       # recorded only: the user's handler waits for the save
        assert s.should_save(5) and s.should_save(5)    # until the save is made
        assert 0 < s.grace_left() <= 5.0
        assert s.saved(5) is True                # the preempted save
        assert not s.should_save(6) and s.preempted
        s.chain()
        s.chain()
        assert calls == [signal.SIGUSR1]          # once
        s.close()
        assert signal.getsignal(signal.SIGUSR1) == mine
        assert calls == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_preemption_without_should_save_marks_the_next_save_and_close_chains():
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        s = SaveSchedule(None, True)
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.preempted
        s.close()                                 # no save came: the user's handler runs at close
        assert calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
    s = SaveSchedule(None, True)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert s.saved(7) is True and s.saved(8) is False
    finally:
        s.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_checkpointer_preempted_save_is_committed_on_return(tmp_path):
    with lazyckpt.Checkpointer(str(tmp_path / "run"), interval=Every(steps=1000), preemption=True) as ck:
        for step in range(1, 100):
            if step == 7:
                os.kill(os.getpid(), signal.SIGTERM)
            if ck.should_save(step):
                h = ck.save({"w": torch.full((1000,), float(step))}, step)
                assert h.done() and h.error is None
            if ck.preempted:
                break
        assert step == 7 and ck.steps() == [7]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_the_preempted_save_is_also_persisted_on_return(tmp_path):
    """With a persistent tier the preempted save() returns once the step is uploaded too."""
    import uuid
    url = f"mem://b{uuid.uuid4().hex[:10]}/run"
    with lazyckpt.Checkpointer(str(tmp_path / "run"), interval=Every(steps=1000), preemption=True,
                               persist=lazyckpt.Persist(url)) as ck:
        ck.save({"w": torch.ones(10)}, 1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ck.should_save(2)
        h = ck.save({"w": torch.full((1000,), 2.0)}, 2)
        assert h.done() and h.persist_state == "persisted"
        assert ck.preempted
        assert 2 in ck.persistent.dir.steps()


@pytest.mark.parametrize("value,error,match", [
    ("yes", TypeError, "preemption= must be True, False or"),
    (lazyckpt.Preemption, TypeError, "preemption= must be"),
])
def test_preemption_refuses_bad_values(value, error, match):
    with pytest.raises(error, match=match):
        SaveSchedule(None, value)


def test_preemption_refuses_bad_signals_and_grace():
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        lazyckpt.Preemption(signals=(signal.SIGKILL,))
    with pytest.raises(ValueError, match="signal numbers"):
        lazyckpt.Preemption(signals=("TERM",))
    with pytest.raises(ValueError, match=r"Preemption\(grace=\)"):
        lazyckpt.Preemption(grace="soon")
    assert lazyckpt.Preemption(signals=signal.SIGINT, grace="2min") == \
        lazyckpt.Preemption(signals=(signal.SIGINT,), grace=120)


def test_preemption_needs_the_main_thread():
    errors = []

    def make():
        try:
            SaveSchedule(None, True)
        except ValueError as exc:
            errors.append(str(exc))
    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(errors) == 1 and "only in the main thread" in errors[0]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("kwargs,error,match", [
    ({"interval": 100}, TypeError, r"Every\(steps=100\)"),
    ({"interval": "hourly"}, ValueError, "the only string is 'auto'"),
    ({"preemption": "yes"}, TypeError, "preemption= must be"),
])
def test_the_checkpointer_refuses_a_bad_schedule_before_opening_the_directory(kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        lazyckpt.Checkpointer(str(tmp_path / "d"), **kwargs)
    assert not (tmp_path / "d").exists()


def test_a_checkpointer_with_preemption_outside_the_main_thread_is_refused_before_opening(tmp_path):
    errors = []

    def make():
        try:
            lazyckpt.Checkpointer(str(tmp_path / "d"), preemption=True)
        except ValueError as exc:
            errors.append(str(exc))
    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(errors) == 1 and "only in the main thread" in errors[0]
    assert not (tmp_path / "d").exists()
