"""A second actor between one's decision and its act, and an error right after
a commit's rename: each interleaving forced by a hook in the process under test.

- prune plans its deletions, a rollback commits a new step under a number it
  planned to delete, then prune acts: it must never delete the new step;
- an EIO from fsync(DIR) right after the new step's rename: what wait()
  reports, the record and the listing agree, and the step can be retried;
- prune (or a Checkpointer's own tidy at open) lists a dead writer lease, a
  restarted run takes the lease, then the removal acts: the live lease stays;
- close() does not wait for the background leftover scan."""

from __future__ import annotations

import errno
import json
import sys
import os
import threading
import time

import pytest

import lazyckpt
import lazyckpt.storage.layout as layout_mod
from lazyckpt.cli.prune import prune
from lazyckpt.storage.layout import CheckpointDir
from lazyckpt.storage.record import LocalRecord

from _steps import is_step_state, make_steps, step_state


# --------------------------------------------------------------------------- prune beside a commit

def test_prune_beside_a_rollback_never_deletes_the_new_step(tmp_path, monkeypatch):
    """Prune's plan (keep 2 of 1..5: delete 3, 2, 1) is acted on by step number;
    a rollback that commits a new step 3 between the plan and the act must not
    lose it: the deletions are decided and done under the commit lock."""
    d = tmp_path / "run"
    make_steps(d, range(1, 6))
    real_retire = CheckpointDir._retire
    box = {}

    def commit_rollback():
        try:
            with lazyckpt.Checkpointer(d, keep=None) as ck:
                ck.save(step_state(30), 3).wait()
        except BaseException as exc:          # reported by the test below
            box["error"] = exc

    def retire(self, step, prefix, force):
        if "thread" not in box and prefix.startswith(".deleting"):
            box["thread"] = threading.Thread(target=commit_rollback, daemon=True)
            box["thread"].start()
            box["thread"].join(3)             # done here on a prune without the lock; else it waits for it
        return real_retire(self, step, prefix, force)
    monkeypatch.setattr(CheckpointDir, "_retire", retire)
    report = prune(str(d), keep=2)
    box["thread"].join(60)
    monkeypatch.undo()
    assert "error" not in box, box.get("error")
    # Whichever order the two took, the rollback's step 3 is committed and is the latest.
    assert is_step_state(lazyckpt.load(d), 30)
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        assert ck.steps()[-1] == 3 and is_step_state(ck.load(3), 30)
    # The report says what prune itself did: its kept steps were on the line when it finished.
    deleted = sorted(a["step"] for a in report["actions"] if a["what"] == "step" and a["done"])
    assert not set(deleted) & set(report["kept"])
    assert report["kept"] in ([4, 5], [3], [2, 3]), report


def test_prune_report_says_what_it_kept_when_the_line_changed(tmp_path, monkeypatch):
    """Prune plans on one listing; if a rollback commits before prune takes the
    lock, it deletes by the line it finds under the lock and reports that."""
    d = tmp_path / "run"
    make_steps(d, range(1, 6))
    real_retire_old = CheckpointDir.retire_old
    box = {}

    def retire_old(self, policy, **kw):
        if "done" not in box:
            box["done"] = True
            with lazyckpt.Checkpointer(d, keep=None) as ck:
                ck.save(step_state(30), 3).wait()
        return real_retire_old(self, policy, **kw)
    monkeypatch.setattr(CheckpointDir, "retire_old", retire_old)
    report = prune(str(d), keep=2)
    monkeypatch.undo()
    assert is_step_state(lazyckpt.load(d), 30)
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        assert ck.steps() == report["kept"] == [2, 3]
    done = sorted(a["step"] for a in report["actions"] if a["what"] == "step" and a["done"])
    assert done == [1], report


def test_prune_of_an_s3_directory_beside_a_rollback_keeps_the_new_step(s3_server, s3_bucket, monkeypatch):
    """The same interleaving on an object store, where there is no commit lock:
    prune deletes each save by its save id, so the rollback's new step 3 (a
    new save id) is never the one deleted."""
    from lazyckpt.storage.s3layout import ObjectCheckpointDir
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/run"
    make_steps(url, range(1, 6))
    real_drop = ObjectCheckpointDir._drop
    box = {}

    def drop(self, step, save_id, even_if_read=True):
        if "done" not in box and not even_if_read:        # prune's first deletion (not a supersede)
            box["done"] = True
            with lazyckpt.Checkpointer(url, keep=None) as ck:
                ck.save(step_state(30), 3).wait()
        return real_drop(self, step, save_id, even_if_read)
    monkeypatch.setattr(ObjectCheckpointDir, "_drop", drop)
    report = prune(url, keep=2)
    monkeypatch.undo()
    assert box["done"]
    assert is_step_state(lazyckpt.load(url), 30)
    with lazyckpt.Checkpointer(url, keep=None) as ck:
        steps = ck.steps()
        assert steps[-1] == 3 and is_step_state(ck.load(3), 30)
    assert set(report["kept"]) <= set(steps), (report["kept"], steps)


# --------------------------------------------------------------------------- fsync(DIR) fails after the rename

@pytest.mark.parametrize("rollback", [False, True])
def test_directory_fsync_error_right_after_the_rename(tmp_path, monkeypatch, rollback):
    """After the rename, fsync(DIR) fails with EIO: the rename's durability is
    unknown, so the commit is undone (the step back out, the superseded steps
    back in, the record as it was), the save is reported failed, the record
    and the listing agree, and a retry of that step commits."""
    d = tmp_path / "run"
    real_fsync = layout_mod.fsync_dir
    armed = {"on": False, "failed": 0}

    def fsync(path):
        if armed["on"] and not armed["failed"] and os.path.abspath(path) == str(d) \
                and not any(n.startswith(".tmp-step_") for n in os.listdir(d)):
            armed["failed"] += 1              # the new step is renamed in: the next fsync of DIR fails
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real_fsync(path)
    new = 2 if rollback else 4
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        for s in (1, 2, 3):
            ck.save(step_state(s), s)
        ck.wait()
        monkeypatch.setattr(layout_mod, "fsync_dir", fsync)
        armed["on"] = True
        error = None
        try:
            ck.save(step_state(40), new).wait()
        except lazyckpt.CheckpointError as exc:
            error = exc
        monkeypatch.undo()
        assert armed["failed"] == 1
        assert error is not None, "a commit whose durability is unknown is reported failed"
        # Undone consistently: the listing, the latest and the record are the line before.
        assert ck.steps() == [1, 2, 3]
        assert is_step_state(ck.load(), 3) and is_step_state(ck.load(2), 2)
        assert LocalRecord(str(d)).committing().event.step == 3
        assert not any(n.startswith((".tmp-step_", ".abandoned-")) for n in os.listdir(d)), os.listdir(d)
        # The same process retries the step.
        ck.save(step_state(40), new).wait()
        assert ck.steps() == ([1, 2] if rollback else [1, 2, 3, 4])
        assert is_step_state(ck.load(), 40)
    assert is_step_state(lazyckpt.load(d), 40)          # and a restart agrees


# --------------------------------------------------------------------------- a dead writer lease

def _dead_lease(d):
    path = d / ".writer"
    path.write_text(json.dumps({"pid": 999999, "host": "gone", "id": "dead", "since": 0}))
    old = time.time() - 3600
    os.utime(path, (old, old))
    return path


@pytest.mark.parametrize("remover", ["prune", "open"])
def test_removing_a_dead_writer_lease_never_removes_a_live_one(tmp_path, monkeypatch, remover):
    """A dead ``.writer`` is listed, a restarted run takes the lease, then the
    removal acts: it must look at the file it would unlink (its lock, the same
    inode), not the name, and keep the live lease."""
    d = tmp_path / "run"
    make_steps(d, [1])
    _dead_lease(d)
    box = {}
    if remover == "prune":
        real = CheckpointDir.remove_leftovers

        def remove(self, leftovers):
            if "ck" not in box:
                box["ck"] = lazyckpt.Checkpointer(d, keep=None)
                box["ck"].save(step_state(2), 2).wait()       # the restarted run holds the lease
            return real(self, leftovers)
        monkeypatch.setattr(CheckpointDir, "remove_leftovers", remove)
        prune(str(d), keep=5)
    else:
        # A Checkpointer opened only to load tidies at open: it lists the dead lease...
        real_leftovers = CheckpointDir.leftovers

        def leftovers(self, *a, **k):
            found = real_leftovers(self, *a, **k)
            if "busy" not in box and any(x.kind == "dead-writer" for x in found):
                box["busy"] = True
                box["ck"] = lazyckpt.Checkpointer(d, keep=None)   # ...and the run restarts in between
                box["ck"].save(step_state(2), 2).wait()
            return found
        monkeypatch.setattr(CheckpointDir, "leftovers", leftovers)
        reader = lazyckpt.Checkpointer(d, keep=None)
        reader.close()
    monkeypatch.undo()
    ck = box["ck"]
    try:
        assert os.path.exists(d / ".writer")
        ck.save(step_state(3), 3).wait()          # the restarted run still holds its lease
        assert ck.steps() == [1, 2, 3]
    finally:
        ck.close()


def test_a_writer_meeting_the_lock_of_a_dead_lease_removal_takes_the_lease(tmp_path, monkeypatch):
    """The other order: the removal holds the dead lease's lock (to unlink it)
    when the restarted run tries it; the run waits for the name to go and
    takes a new lease, it is not refused as if a live writer held it."""
    import fcntl
    from lazyckpt.storage import locks
    d = tmp_path / "run"
    make_steps(d, [1])
    _dead_lease(d)
    real_flock = locks._flock
    box = {}

    def flock(fd, op):
        real_flock(fd, op)
        st = os.fstat(fd)
        if "thread" not in box and os.path.samestat(st, os.stat(d / ".writer")) and \
                not locks._held_here(st) and os.get_blocking(fd) is False and box.get("removing"):
            def restart():
                try:
                    with lazyckpt.Checkpointer(d, keep=None) as ck:
                        ck.save(step_state(2), 2).wait()
                        box["steps"] = ck.steps()
                except BaseException as exc:
                    box["error"] = exc
            box["thread"] = threading.Thread(target=restart, daemon=True)
            box["thread"].start()
            time.sleep(0.1)                   # its lease attempt meets this lock
    real_remove = locks.remove_dead_lease

    def remove(path, expiry_s):
        box["removing"] = True
        try:
            return real_remove(path, expiry_s)
        finally:
            box["removing"] = False
    monkeypatch.setattr(locks, "_flock", flock)
    monkeypatch.setattr(locks, "remove_dead_lease", remove)
    report = prune(str(d), keep=5)
    box["thread"].join(60)
    monkeypatch.undo()
    assert "error" not in box, box.get("error")
    assert box["steps"] == [1, 2]
    assert [a["done"] for a in report["actions"] if a["what"] == "dead-writer"] == [True]
    del fcntl


def test_a_dead_writer_lease_is_still_removed(tmp_path):
    d = tmp_path / "run"
    make_steps(d, [1])
    _dead_lease(d)
    report = prune(str(d), keep=5)
    assert [a["done"] for a in report["actions"] if a["what"] == "dead-writer"] == [True]
    assert not os.path.exists(d / ".writer")
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        ck.save(step_state(2), 2).wait()


# --------------------------------------------------------------------------- close and the leftover scan

def _lazy_threads():
    from lazyckpt import keptpools
    return {t for t in threading.enumerate() if t.name.startswith("lazyckpt-")} - keptpools.threads()


def test_close_does_not_wait_for_the_leftover_scan(tmp_path, monkeypatch):
    """The scan at open reads the directory (here slowed to 10 ms a name, 500
    names: 5 s); close() cancels it and returns within one name, the scan's
    thread gone and nothing removed after close."""
    d = tmp_path / "run"
    make_steps(d, [1])
    for i in range(500):
        (d / f"other-{i:04d}").write_bytes(b"")
    dead = d / ".tmp-step_0000000002-0123abcd4567"      # a dead save's leftover the scan would remove
    dead.mkdir()
    old = time.time() - 3600
    os.utime(dead, (old, old))
    real_scandir = os.scandir
    reading = threading.Event()

    class Slow:
        def __init__(self, it):
            self.it = it

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            for entry in self.it:
                reading.set()
                time.sleep(0.01)
                yield entry

    def scanning(path):
        return not isinstance(path, int) and os.path.abspath(os.fspath(path)) == str(d) and \
            threading.current_thread().name == "lazyckpt-leftovers"

    def scandir(path="."):
        it = real_scandir(path)
        return Slow(it) if scanning(path) else it
    real_listdir = os.listdir

    def listdir(path="."):
        return [e.name for e in scandir(path)] if scanning(path) else real_listdir(path)
    before = _lazy_threads()
    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    ck = lazyckpt.Checkpointer(d, keep=None)
    assert reading.wait(10)
    t0 = time.monotonic()
    ck.close()
    took = time.monotonic() - t0
    monkeypatch.undo()
    assert took < 1.0, f"close() waited {took:.2f} s for the leftover scan"
    assert _lazy_threads() <= before, "the scan's thread outlived close()"
    assert dead.exists()                       # a cancelled scan removes nothing; the next open does
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        ck.layout.tidy()                       # waits for its scan
    assert not dead.exists()


# --------------------------------------------------------------------------- abandoned steps a failing commit puts back

def test_prune_never_removes_the_steps_a_failing_rollback_puts_back(tmp_path, monkeypatch):
    """A rollback (keep=None) sets steps 3-5 aside as ``.abandoned-*``, then
    its commit fails (EIO from fsync(DIR) after the new step's rename) and puts
    them back. Prune, which listed them as abandoned while the commit ran,
    must not remove them: they are only abandoned once that commit holds, so
    the removal is decided under the commit lock (the failed save then leaves
    the line 1..5 whole)."""
    d = tmp_path / "run"
    make_steps(d, range(1, 6))
    real_fsync = layout_mod.fsync_dir
    inside, go = threading.Event(), threading.Event()
    box = {}

    def fsync(path):
        if threading.current_thread() is not threading.main_thread() and os.path.abspath(path) == str(d):
            names = os.listdir(d)
            if "set aside" not in box and any(n.startswith(".abandoned-") for n in names):
                box["set aside"] = True           # steps 3-5 renamed aside: prune acts now
                inside.set()
                go.wait(30)
            elif "set aside" in box and "failed" not in box and "step_0000000003" in names:
                box["failed"] = True              # the new step renamed in: its durability fails
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real_fsync(path)

    def rollback():
        try:
            with lazyckpt.Checkpointer(d, keep=None) as ck:
                ck.load(step=2)
                ck.save(step_state(30), 3).wait()
        except BaseException as exc:              # the save is reported failed
            box["error"] = exc
    monkeypatch.setattr(layout_mod, "fsync_dir", fsync)
    real_leftovers = CheckpointDir.leftovers

    def leftovers(self, *a, **k):
        if sys._getframe(1).f_code.co_name == "prune" and "thread" not in box:     # prune's own listing
            box["thread"] = threading.Thread(target=rollback, name="rollback", daemon=True)
            box["thread"].start()
            assert inside.wait(30)
            timer = threading.Timer(1.0, go.set)  # the commit goes on (prune may wait for its lock)
            timer.start()
        return real_leftovers(self, *a, **k)
    monkeypatch.setattr(CheckpointDir, "leftovers", leftovers)
    report = prune(str(d), keep=10)
    go.set()
    box["thread"].join(60)
    monkeypatch.undo()
    assert box.get("failed") and isinstance(box.get("error"), lazyckpt.CheckpointError), box
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        assert ck.steps() == [1, 2, 3, 4, 5]
        for s in range(1, 6):
            assert is_step_state(ck.load(s), s)
    # The report agrees: what the failed commit put back was not removed.
    abandoned = [a for a in report["actions"] if a["what"] == "abandoned"]
    assert abandoned and not any(a["done"] for a in abandoned), report
