"""The writer lease (``DIR/.writer``, storage/locks.py) between two processes,
each interleaving forced by a pause in this process at its unlink of the lease
file while a second process (a fresh interpreter) acts:

- a writer displaced by a takeover closes: its release must never remove the
  takeover's lease (the takeover's later saves would be refused);
- the cleanup at open (or prune) removing a dead holder's lease stalls while
  it holds that file's lock: a writer beside it waits for the removal (bounded,
  a clear error past the bound) and then takes the lease, never a second live
  writer."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
import time

import pytest

import lazyckpt
from lazyckpt.cli.prune import prune

from _steps import is_step_state, make_steps, step_state


def _dead_lease(d):
    path = d / ".writer"
    path.write_text(json.dumps({"pid": 999999, "host": "gone", "id": "dead", "since": 0}))
    old = time.time() - 3600
    os.utime(path, (old, old))
    return path


class _Other:
    """A second process running ``body`` (Python, ``d`` the directory, ``state``
    and ``say`` given); it says ``ready`` and waits for ``go`` first. Lines it
    says come back through :meth:`heard`; :meth:`tell` sends one."""

    PRELUDE = textwrap.dedent("""
        import json, sys, torch, lazyckpt
        d = sys.argv[1]
        from _steps import step_state as state
        def say(what):
            print(json.dumps(what), flush=True)
        def listen():
            sys.stdin.readline()
        say("ready")
        listen()
    """)

    def __init__(self, d, body, *args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen([sys.executable, "-c", self.PRELUDE + textwrap.dedent(body), str(d), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""
        assert self.heard(120) == "ready"

    def heard(self, timeout):
        """The next line it said (decoded JSON), or None if none within ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def tell(self):
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def end(self):
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _pause_at_unlink_of(monkeypatch, path, pause):
    """Call ``pause()`` once, right before this process unlinks ``path``."""
    real = os.unlink
    box = {}

    def unlink(p, *a, **k):
        if "paused" not in box and os.path.abspath(os.fspath(p)) == os.path.abspath(os.fspath(path)):
            box["paused"] = True
            pause()
            try:
                return real(p, *a, **k)
            finally:
                box["done"] = True
        return real(p, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    return box


#: How long the paused process waits for the other one to act before it goes on. The other
#: process is started and ready before the pause, so its act takes well under a second unless
#: it waits for a lock the paused process holds.
ACT_S = 5.0


def test_a_displaced_writers_close_never_removes_the_takeovers_lease(tmp_path, monkeypatch):
    """The displaced writer's ``close()`` found ``.writer`` still its own and is
    about to unlink it when the takeover renames its new lease in: the unlink
    must not remove the takeover's lease (the takeover's next saves would fail,
    "the writer lease was removed"). Either the takeover waits for the release,
    or the release sees the new file and keeps it."""
    d = tmp_path / "run"
    d.mkdir()
    ck = lazyckpt.Checkpointer(d, keep=None)
    ck.save(step_state(1), 1).wait()
    other = _Other(d, """
        ck = lazyckpt.Checkpointer(d, keep=None, takeover=True)
        h = ck.save(state(100), 100)            # takes the lease over
        say("took")
        listen()
        try:
            h.wait()
            ck.save(state(101), 101).wait()
            steps = ck.steps()
            ck.close()
            say({"ok": True, "steps": steps})
        except Exception as exc:
            say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    """)
    heard = {}

    def takeover_now():
        other.tell()
        heard["took"] = other.heard(ACT_S)
    box = _pause_at_unlink_of(monkeypatch, d / ".writer", takeover_now)
    try:
        ck.close()
        monkeypatch.undo()
        assert box.get("paused"), "the displaced writer's close never unlinked its lease"
        if heard["took"] is None:                   # it waited for the release
            assert other.heard(120) == "took"
        other.tell()
        result = other.heard(120)
    finally:
        other.end()
    assert result == {"ok": True, "steps": [1, 100, 101]}, result
    with lazyckpt.Checkpointer(d, keep=None) as again:
        assert is_step_state(again.load(), 101) and again.loaded_from["step"] == 101


_WRITER_BESIDE = """
    try:
        with lazyckpt.Checkpointer(d, keep=None, **eval(sys.argv[2])) as ck:
            ck.save(state(2), 2).wait()
            say({"ok": True, "steps": ck.steps()})
    except Exception as exc:
        say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
"""


def _writer_beside(d, kwargs="{}"):
    """A second process that opens a Checkpointer on ``d`` (``kwargs``, a Python
    expression) once told, saves step 2 and says how that went."""
    return _Other(d, _WRITER_BESIDE, kwargs)


@pytest.mark.parametrize("remover", ["prune", "open"])
def test_a_writer_beside_a_stalled_dead_lease_removal_takes_the_lease(tmp_path, monkeypatch, remover):
    """The removal of a dead holder's ``.writer`` (prune, or the cleanup of a
    Checkpointer opened to load) holds that file's lock to unlink it, and
    stalls there; a writer starting beside it must not be refused as if a live
    writer held the lease: it waits for the removal, then takes the lease."""
    d = tmp_path / "run"
    make_steps(d, [1])
    _dead_lease(d)
    writer = _writer_beside(d)
    heard = {}

    def writer_now():
        writer.tell()
        heard["early"] = writer.heard(ACT_S)
    box = _pause_at_unlink_of(monkeypatch, d / ".writer", writer_now)
    try:
        if remover == "prune":
            report = prune(str(d), keep=5)
            assert [a["done"] for a in report["actions"] if a["what"] == "dead-writer"] == [True]
        else:
            reader = lazyckpt.Checkpointer(d, keep=None)
            assert is_step_state(reader.load(), 1)
            deadline = time.monotonic() + 60
            while "done" not in box and time.monotonic() < deadline:
                time.sleep(0.05)                # the scan at open removes it in the background
            reader.close()
        monkeypatch.undo()
        assert box.get("paused"), "the dead lease was never unlinked"
        result = heard["early"] or writer.heard(120)
    finally:
        writer.end()
    assert result == {"ok": True, "steps": [1, 2]}, result


def test_a_writer_beside_a_dead_lease_removal_stalled_past_the_expiry_is_refused_clearly(tmp_path, monkeypatch):
    """The wait for a stalled removal is bounded by the lease expiry: past it the
    writer is refused with an error that says what holds it up and what to do,
    and commits nothing."""
    d = tmp_path / "run"
    make_steps(d, [1])
    _dead_lease(d)
    writer = _writer_beside(d, "{'io': lazyckpt.IO(lease_expiry=1.0)}")
    heard = {}

    def writer_now():
        writer.tell()
        heard["result"] = writer.heard(60)      # stalled until the writer gives up
    box = _pause_at_unlink_of(monkeypatch, d / ".writer", writer_now)
    try:
        prune(str(d), keep=5)
        monkeypatch.undo()
    finally:
        writer.end()
    assert box.get("paused")
    result = heard["result"]
    assert result is not None and result["ok"] is False, result
    assert result["error"].startswith("CheckpointError"), result
    assert "being removed" in result["error"] and "retry once" in result["error"].lower(), result
    with lazyckpt.Checkpointer(d, keep=None) as ck:
        assert ck.steps() == [1]
