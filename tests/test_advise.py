"""Which interval to checkpoint at (issue 26): the save costs each committed
step records in its manifest (lazyckpt/saving/costs.py), ``lazyckpt advise``
(lazyckpt/cli/advise.py) and the Checkpointer's logged advice.

Real Checkpointer runs: a small model trained with Adam, the optimizer
attached, so the barrier waits are the training's real waits; a state pushed
through a tiny host cache makes the capture slow enough that the optimizer
step right after ``save()`` must wait."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import pytest
import torch

import lazyckpt
import lazyckpt.cli
from lazyckpt.cli import advise
from lazyckpt import knobs
from lazyckpt.saving import costs
from lazyckpt.saving.costs import problems
from lazyckpt.formats.manifest import checksum

from _dist import run_ranks
from _groups import groups

#: A tiny host cache: the capture of a state of 4 MB and more waits for the writers
#: (256 chunks), so the optimizer step called right after save() waits at the barrier.
SLOW_CAPTURE = dict(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)
BUFFER = 1 << 20        # floats saved beside the model (an EMA copy, a replay buffer)


def _train(ckpt_dir, saves=4, iterations_between=4, width=256, **kwargs):
    """Train, save every few iterations; returns (handles by step, opt.step() wall times after each save)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    opt = torch.optim.Adam(model.parameters())
    buffer = torch.randn(BUFFER)
    handles, step_times = {}, {}
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SLOW_CAPTURE, **kwargs)) as ckpt:
        ckpt.attach(opt)
        it = 0
        for s in range(saves):
            for _ in range(iterations_between):
                model(torch.randn(16, width)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                it += 1
            model(torch.randn(16, width)).pow(2).mean().backward()
            handles[it] = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "buffer": buffer},
                                    step=it)
            t0 = time.perf_counter()
            opt.step()                  # the capture is still running: this waits
            step_times[it] = time.perf_counter() - t0
            opt.zero_grad()
        ckpt.wait()
    return handles, step_times


def _manifest(ckpt_dir, step):
    with open(os.path.join(ckpt_dir, f"step_{step:010d}", "manifest.json")) as f:
        return json.load(f)


def _files_bytes(ckpt_dir, step):
    d = os.path.join(ckpt_dir, f"step_{step:010d}")
    return sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".lzc"))


def _strip_costs(ckpt_dir, steps):
    """Rewrite manifests as lazyckpt wrote them before it recorded save costs."""
    for s in steps:
        path = os.path.join(ckpt_dir, f"step_{s:010d}", "manifest.json")
        with open(path) as f:
            m = json.load(f)
        m.pop("cost")
        m.pop("checksum")
        m["checksum"] = checksum(m)
        with open(path, "w") as f:
            json.dump(m, f)


def cli(capsys, *args):
    capsys.readouterr()
    code = lazyckpt.cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("advise") / "run")
    handles, step_times = _train(d)
    return d, handles, step_times


# ---------------------------------------------------------------------- recorded figures


def test_every_committed_step_records_plausible_costs(trained_run):
    d, handles, step_times = trained_run
    steps = sorted(handles)
    for i, s in enumerate(steps):
        cost = _manifest(d, s)["cost"]
        assert problems(cost) == []
        h = handles[s]
        assert cost["ranks"] == 1
        assert cost["bytes"] == _files_bytes(d, s) == h.bytes
        assert cost["blocking_s"] == pytest.approx(h.blocking_s, abs=1e-3)
        assert 0 < cost["blocking_s"] <= cost["flush_s"] <= h.flush_s
        assert 0 < cost["capture_s"] <= cost["flush_s"]
        if i == 0:
            assert "previous_save" not in cost        # the first save of the process
            continue
        prev = cost["previous_save"]
        p = steps[i - 1]
        assert prev["step"] == p
        # The previous save's barrier wait: the training thread's, exactly, and real.
        assert prev["barrier_wait_s"] == handles[p].barrier_wait_s
        assert 0 < prev["barrier_wait_s"] <= step_times[p]
        assert prev["committed_s"] == handles[p].flush_s
        assert prev["interval_s"] > prev["barrier_wait_s"]
    # attach() timed every iteration: 20 optimizer steps are 19 intervals, each in the
    # manifest of the first commit after it ended. The 18 that ended before the last
    # save() are all recorded; among them the 3 that held a save() call are busy.
    # A commit with no interval ended since the one before has no "iterations" (costs.py:
    # the clock had nothing to give; CI once committed two saves inside one interval).
    its = [_manifest(d, s)["cost"].get("iterations") for s in steps]
    its = [i for i in its if i is not None]
    for i in its:
        for n, median in i.values():
            assert (median is None) == (n == 0) and (median is None or median >= 0)
    assert 18 <= sum(i["busy"][0] + i["quiet"][0] for i in its) <= 19
    assert sum(i["busy"][0] for i in its) >= 3


def test_without_attach_no_iteration_figures_and_advise_says_unknown(ckpt_dir, capsys):
    with lazyckpt.Checkpointer(ckpt_dir) as ckpt:
        for s in range(3):
            ckpt.save({"w": torch.randn(100)}, step=s).wait()
    costs = [_manifest(ckpt_dir, s)["cost"] for s in range(3)]
    assert all("iterations" not in c and problems(c) == [] for c in costs)
    assert [c["previous_save"]["barrier_wait_s"] for c in costs[1:]] == [0.0, 0.0]   # nobody waited
    code, out, err = cli(capsys, "advise", ckpt_dir, "--mtbf", "8h", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["cost"]["slowdown_s"] is None and not doc["cost"]["complete"]
    assert "iteration slow-down" in doc["cost"]["unknown"][0]
    code, out, _ = cli(capsys, "advise", ckpt_dir, "--mtbf", "8h")
    assert "iteration slow-down     unknown" in out and "a lower bound" in out


def _two_ranks(rank, world, d):
    torch.manual_seed(rank)
    width = 128 * (rank + 1)            # rank 1 holds more: its figures are the larger ones
    model = torch.nn.Linear(width, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer = torch.randn(BUFFER // 4)
    out = {}
    with lazyckpt.Checkpointer(d, **groups(SLOW_CAPTURE)) as ckpt:
        ckpt.attach(opt)
        for s in (1, 2, 3):
            model(torch.randn(4, width)).sum().backward()
            h = ckpt.save({"model": model.state_dict(), "buffer": buffer}, step=s)
            opt.step()
            opt.zero_grad()
            out[s] = h
        ckpt.wait()
    return {s: {"blocking_s": h.blocking_s, "barrier_wait_s": h.barrier_wait_s, "flush_s": h.flush_s,
                "bytes": h.bytes} for s, h in out.items()}


def test_two_ranks_record_the_maximum_over_ranks(tmp_path):
    d = str(tmp_path / "run")
    by_rank = run_ranks(2, _two_ranks, d)
    for s in (1, 2, 3):
        cost = _manifest(d, s)["cost"]
        assert problems(cost) == [] and cost["ranks"] == 2
        assert cost["bytes"] == _files_bytes(d, s) == sum(r[s]["bytes"] for r in by_rank)
        assert cost["blocking_s"] == pytest.approx(max(r[s]["blocking_s"] for r in by_rank), abs=1e-3)
        if s > 1:
            prev = cost["previous_save"]
            assert prev["barrier_wait_s"] == max(r[s - 1]["barrier_wait_s"] for r in by_rank) > 0
            assert prev["committed_s"] == max(r[s - 1]["flush_s"] for r in by_rank)
    code = lazyckpt.cli.main(["advise", d, "--failure-rate", "3/day", "--json"])
    assert code == 0


# ---------------------------------------------------------------------- the formulas


def test_young_and_daly_against_hand_computed_values():
    # C = 50 ms, M = 8 h = 28800 s: sqrt(2CM) = sqrt(2880) = 53.665631...;
    # C/2M = 8.680556e-7, sqrt = 9.316950e-4: 53.665631 x (1 + 3.105650e-4 + 9.645e-8) - 0.05 = 53.632303
    assert costs.young(0.05, 28800) == pytest.approx(53.665631, abs=1e-6)
    assert costs.daly(0.05, 28800) == pytest.approx(53.632303, abs=1e-6)
    assert costs.daly(100.0, 40.0) == 40.0          # C >= 2M: checkpoint every M
    assert costs.lost_per_failure(100.0, 3.0) == 53.0
    assert costs.lost_fraction(1.0, 100.0, 3.0, 3600.0) == pytest.approx(0.01 + 53 / 3600)


def _rec(step, blocking, prev=None, busy=None, quiet=None):
    cost = {"ranks": 1, "bytes": 1000, "blocking_s": blocking, "capture_s": 0.5, "flush_s": 1.0}
    if prev is not None:
        cost["previous_save"] = dict(zip(("step", "interval_s", "barrier_wait_s", "committed_s"), prev))
    if busy is not None:
        cost["iterations"] = {"busy": busy, "quiet": quiet}
    assert problems(cost) == []
    return {"step": step, "cost": cost}


def test_advice_from_known_figures():
    # blocking 10/20/30 ms -> 20 ms; waits 0.1/0.3 -> 0.2 s; slow-down 2 busy iterations x (1.5 - 1.0) = 1 s
    # -> C = 1.22 s. M = 1 h. Interval 100 s (10 steps), L (save() to committed) 2/4 -> 3 s.
    records = [_rec(10, 0.01, busy=[2, 1.5], quiet=[8, 1.0]),
               _rec(20, 0.02, (10, 100.0, 0.1, 2.0), busy=[2, 1.5], quiet=[8, 1.0]),
               _rec(30, 0.03, (20, 100.0, 0.3, 4.0), busy=[2, 1.5], quiet=[8, 1.0])]
    a = costs.advise(records, 3600.0)
    c = a["cost"]
    assert (c["blocking_s"], c["barrier_wait_s"], c["slowdown_s"]) == (0.02, pytest.approx(0.2), 1.0)
    assert c["total_s"] == pytest.approx(1.22) and c["complete"]
    assert a["young"]["interval_s"] == pytest.approx(93.722996, abs=1e-6)          # sqrt(8784)
    assert a["daly"]["tau_s"] == pytest.approx(92.911427, abs=1e-6)
    assert a["advised"]["interval_s"] == pytest.approx(92.911427 + 1.22, abs=1e-6)
    assert a["advised"]["steps"] == 9                      # 0.1 step/s x 94.1 s
    assert a["latency_s"] == 3.0 and a["latency_from"] == "committed_s"
    assert a["current"] == {"interval_s": 100.0, "steps": 10, "lost_per_failure_s": 53.0,
                            "lost_fraction": pytest.approx(1.22 / 100 + 53 / 3600)}
    assert a["advised"]["lost_per_failure_s"] == pytest.approx(94.131427 / 2 + 3, abs=1e-6)
    # The optimum loses less time than the current interval.
    assert a["advised"]["lost_fraction"] < a["current"]["lost_fraction"]
    # Busy iterations faster than quiet ones: no slow-down counted, the figure shown as measured.
    records = [_rec(10, 0.01, (0, 100.0, 0.1, 2.0), busy=[3, 0.5], quiet=[8, 1.0])]
    a = costs.advise(records, 3600.0)
    assert a["cost"]["slowdown_s"] == -1.5 and a["cost"]["total_s"] == pytest.approx(0.11)


def test_cli_prints_the_formula_and_json_equals_the_api(trained_run, capsys):
    d = trained_run[0]
    code, out, err = cli(capsys, "advise", d, "--mtbf", "8h", "--json")
    assert code == 0, err
    doc = json.loads(out)
    records, skipped, where = advise.read_run(d)
    expected = costs.advise(records, 8 * 3600)
    assert doc["run"] == where and doc["skipped"] == []
    assert {k: doc[k] for k in expected} == json.loads(json.dumps(expected))
    assert doc["cost"]["complete"] and doc["cost"]["barrier_wait_s"] > 0
    assert doc["mtbf_s"] == 28800 and doc["current"]["steps"] == 4
    c = doc["cost"]["total_s"]
    assert doc["young"]["interval_s"] == pytest.approx(math.sqrt(2 * c * 28800))
    code, out, err = cli(capsys, "advise", d, "--failure-rate", "3/day")
    assert code == 0, err
    assert "T = sqrt(2*C*M)" in out and "tau = sqrt(2*C*M) * (1 + sqrt(C/(2*M))/3" in out
    assert "M (MTBF of the whole job)  8 h = 28800 s" in out
    assert "current interval" in out and "advised interval" in out and "per failure" in out


def test_checkpointer_logs_the_advice_once_when_given_an_mtbf(ckpt_dir, caplog):
    caplog.set_level(logging.INFO, logger="lazyckpt")
    # advise_mtbf= is the deprecated knob that only logs the advice (interval=Auto(mtbf=) acts on it).
    with pytest.warns(DeprecationWarning, match="advise_mtbf"):
        _train(ckpt_dir, saves=costs.MIN_SAVES_TO_LOG + 2, iterations_between=1, width=64, advise_mtbf="8h")
    advice = [r.getMessage() for r in caplog.records if "checkpoint cost C" in r.getMessage()]
    assert len(advice) == 1 and "Daly's interval" in advice[0] and "MTBF M = 8 h" in advice[0]
    caplog.clear()
    _train(ckpt_dir + "-off", saves=costs.MIN_SAVES_TO_LOG + 2, iterations_between=1, width=64)
    assert not [r for r in caplog.records if "checkpoint cost C" in r.getMessage()]


# ---------------------------------------------------------------------- bad input


def test_steps_without_costs_give_a_clear_error_or_a_skipped_row(ckpt_dir, capsys):
    with lazyckpt.Checkpointer(ckpt_dir) as ckpt:
        for s in (1, 2, 3):
            ckpt.save({"w": torch.randn(10)}, step=s).wait()
    _strip_costs(ckpt_dir, [1])
    assert lazyckpt.load(ckpt_dir) is not None          # still an ordinary checkpoint
    code, out, err = cli(capsys, "advise", ckpt_dir, "--mtbf", "8h")
    assert code == 0, err
    assert "skipped step 1: no save costs recorded" in out
    _strip_costs(ckpt_dir, [2, 3])
    code, out, err = cli(capsys, "advise", ckpt_dir, "--mtbf", "8h")
    assert code == 2 and out == ""
    assert "none of its 3 committed steps records what its save cost" in err
    assert "save a few steps with this version" in err


def test_ill_formed_costs_are_skipped_naming_why(ckpt_dir, capsys):
    with lazyckpt.Checkpointer(ckpt_dir) as ckpt:
        for s in (1, 2):
            ckpt.save({"w": torch.randn(10)}, step=s).wait()
    path = os.path.join(ckpt_dir, "step_0000000002", "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m["cost"]["blocking_s"] = -1
    m.pop("checksum")
    m["checksum"] = checksum(m)
    with open(path, "w") as f:
        json.dump(m, f)
    code, out, err = cli(capsys, "advise", ckpt_dir, "--mtbf", "8h", "--json")
    assert code == 0, err
    assert json.loads(out)["skipped"] == [{"step": 2, "reason": "ill-formed cost: cost.blocking_s is not a "
                                                                  "non-negative number"}]


def test_missing_run_and_bad_mtbf_are_clear_errors(ckpt_dir, tmp_path, capsys):
    code, _, err = cli(capsys, "advise", tmp_path / "nope", "--mtbf", "8h")
    assert code == 2 and "nope: no such directory" in err
    code, _, err = cli(capsys, "advise", ckpt_dir, "--mtbf", "8h")
    assert code == 2 and "no committed step" in err
    for value, message in (("8", "a unit is required"), ("eight hours", "bad duration 'eight hours'"),
                           ("-3h", "bad duration"), ("0h", "must be positive")):
        code, _, err = cli(capsys, "advise", ckpt_dir, f"--mtbf={value}")
        assert code == 2 and message in err, (value, err)
    for value in ("3", "x/day", "0/day", "3/", "-1/day"):
        code, _, err = cli(capsys, "advise", ckpt_dir, f"--failure-rate={value}")
        assert code == 2 and f"bad failure rate {value!r}" in err, (value, err)
    with pytest.raises(SystemExit):                      # one of --mtbf / --failure-rate is required
        lazyckpt.cli.main(["advise", ckpt_dir])
    with pytest.warns(DeprecationWarning, match="advise_mtbf"), \
            pytest.raises(ValueError, match="advise_mtbf: bad duration '8' \\(a unit is required"):
        lazyckpt.Checkpointer(ckpt_dir, advise_mtbf="8")


def test_durations_and_rates():
    assert knobs.parse_duration("8h") == 28800
    assert knobs.parse_duration("1h30m") == 5400
    assert knobs.parse_duration(" 2 days ") == 172800
    assert knobs.parse_duration(90) == 90.0              # a number is seconds
    assert advise.parse_failure_rate("3/day") == 28800
    assert advise.parse_failure_rate("1/8h") == 28800
    assert advise.parse_failure_rate("0.5/h") == 7200


# ---------------------------------------------------------------------- object store


def test_advise_on_an_object_store(s3_server, s3_bucket, monkeypatch, capsys):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url) as ckpt:
        for s in (1, 2, 3):
            ckpt.save({"w": torch.randn(1000)}, step=s).wait()
    code, out, err = cli(capsys, "advise", url, "--mtbf", "1d", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["steps"] == [1, 2, 3] and doc["bytes"] > 4000 and doc["cost"]["samples"]["barrier_wait"] == 2
