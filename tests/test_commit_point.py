"""Issue 33: one commit point per local commit, recovery on open, fencing.

A commit records itself in ``history.json`` (naming its complete temporary
directory) under the directory's commit lock: that write is the commit point.
The renames after it (superseded steps aside, the new step in) are replayed
by the next process that opens the directory; readers see the committed line
in between. These tests stop a real process (SIGKILL) between every two of a
rollback commit's renames, and pause a writer inside its commit while another
Checkpointer takes the directory over.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import pytest
import torch

import lazyckpt
from _env import child_env
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.storage.stores import LOCAL


def _state(step: int, run: str) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(f"{run}/{step}".encode()))
    return {"w": torch.randn(64, generator=g), "step": step, "run": run}


def _same(a: dict, b: dict) -> bool:
    return a["run"] == b["run"] and a["step"] == b["step"] and torch.equal(a["w"], b["w"])


# The child: a run that reached step 5 resumed from step 2 and saves step 3; it is
# SIGKILLed just before the rename number KILL_AT of that commit (counting every
# os.rename the library makes from the start of the save).
_CHILD = textwrap.dedent("""
    import os, signal, sys, torch, lazyckpt
    sys.path.insert(0, {tests!r})
    from test_commit_point import _state
    directory, kill_at, keep_last = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    keep_last = None if keep_last == "None" else int(keep_last)
    ckpt = lazyckpt.Checkpointer(directory, keep=keep_last)
    renames = [0]
    real_rename = os.rename
    def rename(src, dst, *a, **k):
        # Only the step directories' moves (a manifest's own temp rename is not one of them).
        if os.path.basename(str(src)).startswith((".tmp-step_", "step_")):
            renames[0] += 1
            if renames[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst, *a, **k)
    os.rename = rename
    ckpt.save(_state(3, "resumed"), step=3).wait()
    print("committed", renames[0], flush=True)
""")


def _prepare(directory: str, keep_last) -> None:
    with lazyckpt.Checkpointer(directory, keep=keep_last) as ckpt:
        for s in range(1, 6):
            ckpt.save(_state(s, "first"), step=s).wait()


def _rename_kills():
    # Every rename with both retentions; CI runs each rename once, the retention
    # alternating (the crash-point programs rollback-keepNone and rollback-keep2 kill
    # the same commit before each of its calls in CI, tests/test_crash_points.py).
    for kill_at in (1, 2, 3, 4, 5):
        for i, keep_last in enumerate((None, 10)):
            marks = [pytest.mark.slow] if (kill_at + i) % 2 == 0 else []
            yield pytest.param(kill_at, keep_last, marks=marks, id=f"{kill_at}-{keep_last}")


@pytest.mark.parametrize("kill_at,keep_last", list(_rename_kills()))
def test_a_kill_between_the_renames_of_a_rollback_commit_never_loads_an_abandoned_step(tmp_path, kill_at, keep_last):
    """Case 1 of issue 33: killed after the commit moved step 5 (then 4, then 3) aside,
    the restarted Checkpointer loaded the abandoned run's step 4. Now every kill point
    gives the line before the commit (step 5) or the new step 3, on every read path."""
    directory = str(tmp_path / "run")
    _prepare(directory, keep_last)
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests), directory, str(kill_at), str(keep_last)],
                          capture_output=True, text=True, timeout=120)
    killed = proc.returncode == -9
    assert killed or proc.returncode == 0, proc.stderr[-3000:]
    if not killed:                                  # the commit made fewer renames than kill_at
        assert "committed" in proc.stdout
    before = {s: _state(s, "first") for s in range(1, 6)}
    after = {1: before[1], 2: before[2], 3: _state(3, "resumed")}

    def check(got: dict, step: int, where: str) -> str:
        if step == 5 and _same(got, before[5]):
            return "before"
        assert step == 3 and _same(got, after[3]), \
            f"{where}: kill at rename {kill_at}: loaded step {step} of run {got['run']!r}, neither the line " \
            f"before the commit (5) nor the new step 3"
        return "after"

    # A reader first (it repairs nothing): the line as the record says it.
    got = lazyckpt.load(directory)
    outcome = check(got, got["step"], "lazyckpt.load(DIR)")
    expected_steps = sorted(before if outcome == "before" else after)
    with lazyckpt.Checkpointer(directory, keep=keep_last) as reader:
        assert reader.steps() == expected_steps
        assert check(reader.load(), reader.loaded_from["step"], "Checkpointer.load()") == outcome
        for s in reader.steps():
            want = (before if outcome == "before" else after)[s]
            assert _same(reader.load(step=s), want), f"load(step={s}) after a kill at rename {kill_at}"
        # A superseded step's own path is refused, never loaded.
        for s in (4, 5):
            if outcome == "after" and os.path.isdir(os.path.join(directory, f"step_{s:010d}")):
                with pytest.raises(CheckpointNotFoundError):
                    lazyckpt.load(os.path.join(directory, f"step_{s:010d}"))
    # Opening it repaired it: the listing alone now says the same, and the run goes on.
    names = sorted(n for n in os.listdir(directory) if n.startswith("step_"))
    assert [int(n[5:]) for n in names] == expected_steps
    with lazyckpt.Checkpointer(directory, keep=keep_last) as ckpt:
        ckpt.save(_state(len(expected_steps) + 1, "next"), step=len(expected_steps) + 1).wait()
        assert _same(ckpt.load(), _state(len(expected_steps) + 1, "next"))
    report = lazyckpt.loading.verify.verify(directory, store=LOCAL)
    assert report.ok, [p.message for p in report.problems]


def _pause_inside_commit(ckpt, module: str):
    """Start ``ckpt.save(step=10)`` on a thread that pauses just after its lease
    check inside the directory's commit (``module``.commit: the last check before
    the publish); returns (paused, release, the thread) once it is paused."""
    writer = ckpt._writer
    inside, release = threading.Event(), threading.Event()
    real_check = writer.check

    def paused_check() -> None:
        real_check()
        caller = sys._getframe(1).f_code
        if caller.co_name == "commit" and os.path.basename(caller.co_filename) == f"{module}.py":
            inside.set()
            release.wait(60)

    writer.check = paused_check

    def save() -> None:
        try:
            ckpt.save(_state(10, "a"), step=10).wait()
        except CheckpointError:
            pass                                 # refused: it was displaced

    thread = threading.Thread(target=save)
    thread.start()
    assert inside.wait(60), "the save never reached its commit"
    return inside, release, thread


def test_a_writer_paused_inside_its_commit_never_publishes_after_a_takeover(tmp_path):
    """Case 5 of issue 33: a writer that paused just after its lease check inside the
    commit still renamed its step in after a takeover, and the new writer's load()
    returned the displaced writer's step. The check now runs under the directory's
    commit lock, which a takeover takes too: the paused commit either completes
    before the takeover or is refused, and the new writer's save is the latest."""
    directory = str(tmp_path / "run")
    a = lazyckpt.Checkpointer(directory)
    a.save(_state(1, "a"), step=1).wait()
    writer, real_check = a._writer, a._writer.check
    inside, release, ta = _pause_inside_commit(a, "layout")
    done_b: list = []

    def take_over() -> None:
        b = lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(takeover=True))
        b.save(_state(5, "b"), step=5).wait()
        done_b.append(b)

    tb = threading.Thread(target=take_over)
    tb.start()
    time.sleep(0.5)                          # B is taking over while A sits inside its commit
    release.set()
    ta.join(60)
    tb.join(60)
    assert done_b, "the takeover did not complete"
    b = done_b[0]
    try:
        got = b.load()
        assert b.loaded_from["step"] == 5 and _same(got, _state(5, "b")), \
            f"the new writer's load() returned step {b.loaded_from['step']} of writer {got['run']!r}"
        assert b.steps() == [1, 5], b.steps()
        assert _same(lazyckpt.load(directory), _state(5, "b"))
        # The displaced writer can never save here again.
        with pytest.raises(CheckpointError, match="took over"):
            writer.check = real_check
            a.save(_state(11, "a"), step=11).wait()
    finally:
        b.close()
        a.close()


# The same rollback on an object-store directory: the child is SIGKILLed just before
# PUT number KILL_AT among its commit's event and manifest PUTs.
_S3_CHILD = textwrap.dedent("""
    import os, signal, sys, lazyckpt
    sys.path.insert(0, {tests!r})
    from test_commit_point import _state
    from lazyckpt.storage import s3
    url, kill_at = sys.argv[1], int(sys.argv[2])
    ckpt = lazyckpt.Checkpointer(url)
    ckpt.load(step=2)
    puts = [0]
    real_put = s3.ObjectStore.put
    def put(self, key, data):
        if key.endswith("/manifest.json") or "/history/" in key:
            puts[0] += 1
            if puts[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_put(self, key, data)
    s3.ObjectStore.put = put
    ckpt.save(_state(3, "resumed"), step=3).wait()
    print("committed", puts[0], flush=True)
""")


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_a_kill_inside_an_object_store_rollback_commit_leaves_no_partial_line(s3_server, s3_bucket, monkeypatch,
                                                                              kill_at):
    """On an s3:// Checkpointer the rollback's event was PUT before its manifest:
    killed in between, readers saw the abandoned steps superseded and the new step
    absent -- a partial line (step 2 loaded, neither 5 nor the new 3). The manifest
    now goes first and the event (the commit point) after it."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/rollback-{kill_at}"
    with lazyckpt.Checkpointer(url) as ckpt:
        for s in range(1, 6):
            ckpt.save(_state(s, "first"), step=s).wait()
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _S3_CHILD.format(tests=tests), url, str(kill_at)],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode in (0, -9), proc.stderr[-3000:]
    got = lazyckpt.load(url)
    before, after = _same(got, _state(5, "first")), _same(got, _state(3, "resumed"))
    assert before or after, f"kill before commit PUT {kill_at}: loaded step {got['step']} of run {got['run']!r}"
    assert after or proc.returncode == -9
    reader = lazyckpt.Checkpointer(url)
    try:
        assert reader.steps() == ([1, 2, 3, 4, 5] if before else [1, 2, 3])
        for s in reader.steps():
            want = _state(s, "first") if before or s < 3 else _state(3, "resumed")
            assert _same(reader.load(step=s), want), f"load(step={s})"
    finally:
        reader.close()


def test_a_writer_paused_inside_its_object_store_commit_never_publishes_after_a_takeover(s3_server, s3_bucket,
                                                                                        monkeypatch):
    """Case 5 of issue 33 on an object store, where no lock orders a takeover and a
    commit: the displaced writer, paused after its lease check, PUT its manifest and
    event after the takeover and the new writer's load() returned its step. The
    takeover now PUTs a fence for the displaced writer (``.fences/<its fence id>``,
    the prefix of its save ids) and waits out the 1 s stamp resolution; readers
    ignore a commit event stamped after its writer's fence."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/fenced"
    a = lazyckpt.Checkpointer(url)
    a.save(_state(1, "a"), step=1).wait()
    writer, real_check = a._writer, a._writer.check
    inside, release, ta = _pause_inside_commit(a, "s3layout")
    b = lazyckpt.Checkpointer(url, distributed=lazyckpt.Distributed(takeover=True))
    try:
        b.save(_state(5, "b"), step=5).wait()
        release.set()                        # A publishes now, after the takeover
        ta.join(60)
        for reader in (b, lazyckpt.Checkpointer(url)):
            got = reader.load()
            assert reader.loaded_from["step"] == 5 and _same(got, _state(5, "b")), \
                f"load() returned step {reader.loaded_from['step']} of writer {got['run']!r}"
            assert reader.steps() == [1, 5], reader.steps()
        assert _same(lazyckpt.load(url), _state(5, "b"))
        with pytest.raises(CheckpointError, match="took over|removed"):
            writer.check = real_check
            a.save(_state(11, "a"), step=11).wait()
    finally:
        release.set()
        b.close()
        try:
            a.close()
        except CheckpointError:
            pass


@pytest.mark.parametrize("reader", ["lazyckpt.load", "Checkpointer.load"])
def test_a_reader_of_the_latest_step_follows_a_commit_renaming_it_in(tmp_path, monkeypatch, reader):
    """Between a commit's record (its commit point) and its rename, readers take the
    new step from its temporary directory. If the rename happens while a reader is
    about to read it there, the reader reads it under its name: never a spurious
    'not found' for a step that exists (a training run's evaluator polling latest)."""
    from lazyckpt import checkpointer as checkpointer_module
    from lazyckpt.loading import loader
    from lazyckpt.storage import layout
    directory = str(tmp_path / "run")
    writer = lazyckpt.Checkpointer(directory)
    for s in (1, 2):
        writer.save(_state(s, "w"), step=s).wait()
    looker = lazyckpt.Checkpointer(directory) if reader == "Checkpointer.load" else None
    recorded, go = threading.Event(), threading.Event()
    real_move_in = layout.CheckpointDir._move_in

    def move_in(self, tmp, step, keep_superseded, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            recorded.set()
            go.wait(30)
        return real_move_in(self, tmp, step, keep_superseded, **kwargs)

    monkeypatch.setattr(layout.CheckpointDir, "_move_in", move_in)
    t = threading.Thread(target=lambda: writer.save(_state(3, "w"), step=3).wait())
    t.start()
    assert recorded.wait(30)
    module = loader if looker is None else checkpointer_module
    real_load_step = module.load_step
    first = [True]

    def load_step(path, *args, **kwargs):
        if first[0]:                           # the rename lands between locating and reading
            first[0] = False
            assert os.path.basename(path).startswith(".tmp-step_0000000003"), path
            go.set()
            t.join(30)
        return real_load_step(path, *args, **kwargs)

    monkeypatch.setattr(module, "load_step", load_step)
    try:
        got = lazyckpt.load(directory) if looker is None else looker.load()
        assert _same(got, _state(3, "w"))
    finally:
        go.set()
        t.join(30)
        writer.close()
        if looker is not None:
            looker.close()


@pytest.mark.parametrize("undo", ["succeeds", "fails"])
def test_a_rename_failing_inside_a_rollback_commit_leaves_one_line(tmp_path, monkeypatch, undo):
    """A rename that fails after the record (EIO) fails the save. The process is
    alive to undo it: the superseded steps go back and the record is restored, so
    the failed save changes nothing (steps 1-5). If the undo fails too, the step
    stays committed (the record names it): the failed job must not remove its
    temporary directory, and the next Checkpointer finishes the commit. Before,
    the failed job's cleanup deleted it and the rollback left step 2."""
    import errno
    from lazyckpt.storage import layout
    directory = str(tmp_path / "run")
    _prepare(directory, None)
    ckpt = lazyckpt.Checkpointer(directory)
    ckpt.load(step=2)
    real_rename, real_write = os.rename, layout.write_file_atomic

    def rename(src, dst, *a, **k):
        if os.path.basename(str(src)).startswith(".tmp-step_"):
            raise OSError(errno.EIO, "injected", str(src))
        return real_rename(src, dst, *a, **k)

    def write(path, data):
        # The record is written by history.py; the layout rewrites it only to undo a commit.
        if undo == "fails" and path.endswith("history.json"):
            raise OSError(errno.EIO, "injected", path)
        return real_write(path, data)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(layout, "write_file_atomic", write)
    with pytest.raises(lazyckpt.CheckpointError):
        ckpt.save(_state(3, "resumed"), step=3).wait()
    monkeypatch.undo()
    ckpt.close()
    if undo == "succeeds":
        expected, latest = [1, 2, 3, 4, 5], _state(5, "first")
        assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    else:
        expected, latest = [1, 2, 3], _state(3, "resumed")
    assert _same(lazyckpt.load(directory), latest)
    with lazyckpt.Checkpointer(directory) as again:
        assert again.steps() == expected
        assert _same(again.load(), latest)
        for s in expected:
            want = _state(3, "resumed") if undo == "fails" and s == 3 else _state(s, "first")
            assert _same(again.load(step=s), want)