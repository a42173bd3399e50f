"""Issue 33, cases 6-8: what a crashed writer leaves behind, what a record or
a planted file says, and a step vanishing under a reader must each end in a
clear lazyckpt error (or no error at all), never in a blocked restart, a write
outside the directory, an invisible step or a bare CheckpointError.

* 6: the writer lease is not inherited through fork; lease files are never
  followed through a symlink (nor is any fixed-name write in the directory).
* 7: numbers read from a record, a manifest or an event key are range-checked.
* 8: a step deleted (renamed away by ``lazyckpt prune``) while a path to it is
  being resolved is CheckpointNotFoundError, whichever entry point resolves it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

pytestmark = pytest.mark.timeout(120)


def _steps(directory, n=3, **kw):
    with lazyckpt.Checkpointer(directory, **kw) as c:
        for s in range(1, n + 1):
            c.save({"x": torch.full((4,), float(s))}, step=s).wait(60)
        return {s: c.step_path(s) for s in c.steps()}


# --------------------------------------------------------------------------- case 8


def _vanish_after_first_look(monkeypatch, path, elsewhere):
    """The first time anything stats ``path``, it answers from the real file
    system and then ``path`` is renamed away (as `lazyckpt prune` renames a step
    before deleting it): the race of case 8, on purpose instead of by chance."""
    real_rename = os.rename
    fired = []

    def wrap(real):
        def look(p, *a, **k):
            result = real(p, *a, **k)
            if not fired and isinstance(p, (str, os.PathLike)) and os.fspath(p) == path:
                fired.append(True)
                real_rename(path, elsewhere)
            return result
        return look

    for name in ("stat", "lstat"):
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
    for name in ("exists", "isfile", "isdir", "lexists"):
        monkeypatch.setattr(os.path, name, wrap(getattr(os.path, name)))
    return fired


@pytest.mark.parametrize("entry", ["load", "verify", "inspect"])
def test_step_renamed_away_while_resolved_is_not_found(tmp_path, monkeypatch, entry):
    paths = _steps(str(tmp_path / "run"))
    target = paths[2]
    fired = _vanish_after_first_look(monkeypatch, target, str(tmp_path / "trash"))
    if entry == "load":
        call = lambda: lazyckpt.load(target)                                     # noqa: E731
    elif entry == "verify":
        from lazyckpt.loading.verify import verify
        from lazyckpt.storage.stores import LOCAL
        call = lambda: verify(target, store=LOCAL)                               # noqa: E731
    else:
        from lazyckpt.cli.inspect import describe
        call = lambda: describe(target)                                          # noqa: E731
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was being read"):
        call()
    assert fired


def test_cli_verify_of_a_vanishing_step_says_not_found(tmp_path, monkeypatch, capsys):
    from lazyckpt.cli import main
    paths = _steps(str(tmp_path / "run"))
    _vanish_after_first_look(monkeypatch, paths[2], str(tmp_path / "trash"))
    rc = main(["verify", paths[2]])
    assert rc != 0
    assert "deleted while it was being read" in capsys.readouterr().err


def test_checkpointer_load_of_a_step_pruned_meanwhile_is_not_found(tmp_path, monkeypatch):
    directory = str(tmp_path / "run")
    paths = _steps(directory)
    with lazyckpt.Checkpointer(directory) as c:
        _vanish_after_first_look(monkeypatch, paths[2], str(tmp_path / "trash"))
        with pytest.raises(CheckpointNotFoundError):
            c.load(step=2)


def test_load_of_the_directory_whose_latest_vanishes_is_not_found(tmp_path, monkeypatch):
    directory = str(tmp_path / "run")
    paths = _steps(directory)
    _vanish_after_first_look(monkeypatch, paths[3], str(tmp_path / "trash"))
    with pytest.raises(CheckpointNotFoundError):
        lazyckpt.load(directory)


def test_a_real_fifo_or_device_still_gets_its_own_error(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        with pytest.raises(CheckpointError, match="not a regular file or directory") as info:
            lazyckpt.load(path)
        assert not isinstance(info.value, CheckpointNotFoundError)


def test_load_racing_prune_is_exact_or_not_found(tmp_path):
    """The real race, a few rounds: every read returns its step's values or
    CheckpointNotFoundError (before the fix, about one round in 15 raised a bare
    CheckpointError here)."""
    from lazyckpt.cli.prune import prune
    problems = []
    for rnd in range(8):
        directory = str(tmp_path / f"r{rnd}")
        paths = _steps(directory, n=8)
        stop = threading.Event()

        def reader():
            rounds = 0
            while not stop.is_set() or rounds < 1:
                rounds += 1
                for s, p in paths.items():
                    try:
                        got = lazyckpt.load(p)
                    except CheckpointNotFoundError:
                        continue
                    except Exception as exc:        # noqa: BLE001 -- what the test looks for
                        problems.append(f"step {s}: {type(exc).__name__}: {exc}")
                        continue
                    if not torch.equal(got["x"], torch.full((4,), float(s))):
                        problems.append(f"step {s}: other values")

        t = threading.Thread(target=reader)
        t.start()
        try:
            prune(directory, 1)
        finally:
            stop.set()
            t.join()
    assert not problems, problems[:3]


def test_verify_of_a_step_pruned_after_its_manifest_was_read_is_not_damage(tmp_path, monkeypatch):
    """Before: the step's files vanished under `lazyckpt verify`, which reported
    them as DAMAGED. Now the step is held while verified, and one gone anyway
    is CheckpointNotFoundError."""
    from lazyckpt.loading.verify import verify
    from lazyckpt.storage.localstore import LocalStore
    from lazyckpt.storage.stores import LOCAL
    paths = _steps(str(tmp_path / "run"))
    real = LocalStore.read_manifest

    def read_then_prune(self, step_path, options):
        manifest = real(self, step_path, options)
        os.rename(step_path, str(tmp_path / "trash"))
        return manifest

    monkeypatch.setattr(LocalStore, "read_manifest", read_then_prune)
    with pytest.raises(CheckpointNotFoundError):
        verify(paths[2], store=LOCAL)


# --------------------------------------------------------------------------- case 6: the writer lease


_FORKING_WRITER = r"""
import os, sys, time, torch, lazyckpt
directory, ready = sys.argv[1], sys.argv[2]
ckpt = lazyckpt.Checkpointer(directory)
ckpt.save({"x": torch.ones(4)}, step=1).wait(60)      # holds DIR/.writer from here on
held = {}
if sys.argv[3] == "reading":                            # and a step being read, shared-locked
    from lazyckpt.storage.locks import StepDir
    held["r"] = StepDir(ckpt.step_path(1), 1).reading()
    held["r"].__enter__()
child = os.fork()                                       # a DataLoader worker, say
if child == 0:
    time.sleep(300)                                     # outlives its parent
    os._exit(0)
with open(ready, "w") as f:
    f.write(str(child))
time.sleep(300)                                         # SIGKILLed here
"""


def _kill_writer_keep_its_child(tmp_path, directory, reading=""):
    import signal
    import subprocess
    import sys
    import time
    ready = str(tmp_path / "ready")
    proc = subprocess.Popen([sys.executable, "-c", _FORKING_WRITER, directory, ready, reading])
    deadline = time.monotonic() + 90
    while not os.path.exists(ready) or not open(ready).read():
        assert proc.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    child = int(open(ready).read())
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    return child


def _kill(pid):
    import signal
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_killed_writers_forked_child_does_not_block_the_restart(tmp_path):
    directory = str(tmp_path / "run")
    child = _kill_writer_keep_its_child(tmp_path, directory)
    try:
        os.kill(child, 0)                               # the child lives on
        with lazyckpt.Checkpointer(directory) as c:     # before: "another Checkpointer is saving ..."
            c.save({"x": torch.full((4,), 2.0)}, step=2).wait(60)
            assert c.steps() == [1, 2]
    finally:
        _kill(child)


def test_a_killed_readers_forked_child_does_not_pin_the_step(tmp_path):
    """The shared lock of a step being read is not inherited either: once the
    reader is dead, retention may delete the step although its fork lives."""
    from lazyckpt.storage.locks import locked_by_someone
    directory = str(tmp_path / "run")
    child = _kill_writer_keep_its_child(tmp_path, directory, "reading")
    try:
        os.kill(child, 0)
        manifest = os.path.join(directory, "step_0000000001", "manifest.json")
        assert locked_by_someone(manifest) is False
        assert locked_by_someone(os.path.join(directory, ".writer")) is False
    finally:
        _kill(child)


def test_a_fork_does_not_take_the_lease_from_its_parent(tmp_path):
    """Closing the child's copies leaves the parent's locks held."""
    import multiprocessing
    from lazyckpt.storage.locks import locked_by_someone
    directory = str(tmp_path / "run")
    with lazyckpt.Checkpointer(directory) as c:
        c.save({"x": torch.ones(4)}, step=1).wait(60)
        p = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        c.save({"x": torch.ones(4)}, step=2).wait(60)       # still the writer
        probe = multiprocessing.get_context("spawn")
        with probe.Pool(1) as pool:                         # another process sees it held
            assert pool.apply(locked_by_someone, (os.path.join(directory, ".writer"),)) is True


@pytest.mark.parametrize("planted", ["symlink", "dangling", "fifo", "directory"])
def test_a_planted_writer_file_is_refused_and_nothing_outside_is_written(tmp_path, planted):
    directory = tmp_path / "run"
    directory.mkdir()
    outside = tmp_path / "outside.txt"
    writer = directory / ".writer"
    if planted == "symlink":
        outside.write_text("precious")
        writer.symlink_to(outside)
    elif planted == "dangling":
        writer.symlink_to(outside)
    elif planted == "fifo":
        os.mkfifo(writer)
    else:
        writer.mkdir()
    c = lazyckpt.Checkpointer(str(directory))
    try:
        with pytest.raises(CorruptCheckpointError, match=r"\.writer") as info:
            c.save({"x": torch.ones(4)}, step=1).wait(60)
        assert info.value.path == str(writer)
    finally:
        c.close()
    if planted == "symlink":
        assert outside.read_text() == "precious"
    else:
        assert not outside.exists()
    assert os.path.lexists(writer)          # refused, not removed: someone should look at it


def test_read_writer_does_not_follow_a_symlink(tmp_path):
    from lazyckpt.storage.locks import read_writer
    outside = tmp_path / "outside.json"
    outside.write_text('{"pid": 1, "host": "elsewhere"}')
    link = tmp_path / ".writer"
    link.symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match=r"\.writer"):
        read_writer(str(link))


def test_write_file_atomic_never_writes_through_a_planted_temporary(tmp_path, monkeypatch):
    """The record (history.json), `latest` and the manifest are written to a
    temporary renamed into place: a symlink planted at the temporary's name
    (were it guessed) is not written through."""
    from lazyckpt.storage import fileio
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    monkeypatch.setattr(fileio.os, "urandom", lambda n: b"\0" * n)
    target = tmp_path / "history.json"
    (tmp_path / ("history.json.tmp-" + "00" * 6)).symlink_to(outside)
    with pytest.raises(OSError):
        fileio.write_file_atomic(str(target), b"{}")
    assert outside.read_text() == "precious"
    assert not target.exists()


def test_a_planted_record_symlink_is_replaced_not_written_through(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    (directory / "history.json").symlink_to(outside)
    with lazyckpt.Checkpointer(str(directory)) as c:
        c.save({"x": torch.ones(4)}, step=1).wait(60)
        assert torch.equal(c.load()["x"], torch.ones(4))
    assert outside.read_text() == "precious"
    assert not os.path.islink(directory / "history.json")


# --------------------------------------------------------------------------- case 7: records are not trusted


def _record(directory):
    import json
    with open(os.path.join(directory, "history.json")) as f:
        return json.load(f)


def _write_record(directory, doc):
    import json
    with open(os.path.join(directory, "history.json"), "w") as f:
        json.dump(doc, f)


def _forge_manifest(step_path, **fields):
    """Rewrite a step's manifest with ``fields`` and a valid checksum (what a
    bug or a hand edit could leave: only the range check can tell)."""
    import json
    from lazyckpt.formats import manifest as manifests
    path = os.path.join(step_path, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc.update(fields)
    doc.pop("checksum", None)
    doc["checksum"] = manifests.checksum(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _manifest(step_path):
    import json
    with open(os.path.join(step_path, "manifest.json")) as f:
        return json.load(f)


def test_an_out_of_range_seq_in_the_record_never_numbers_a_commit(tmp_path, caplog):
    from lazyckpt.lineage import Event, event_key, parse_event_key
    directory = str(tmp_path / "run")
    _steps(directory, n=2)
    doc = _record(directory)
    doc["seq"] = 10 ** 12
    _write_record(directory, doc)
    with lazyckpt.Checkpointer(directory) as c:
        c.save({"x": torch.full((4,), 3.0)}, step=3).wait(60)
        m = _manifest(c.step_path(3))
    e = Event(3, m["save_id"], m["seq"])
    assert parse_event_key(event_key(e)) == e          # before: seq 10**12 + 1, a key nothing parses
    assert "seq" in caplog.text and "history.json" in caplog.text


@pytest.mark.parametrize("bad", [
    {"events": [[-1, "abc", 1]]},
    {"events": [[10 ** 10, "abc", 1]]},
    {"events": [[1, "abc", 10 ** 12]]},
    {"events": [[1, "../../etc", 1]]},
    {"events": [[1, "a/b", 1]]},
    {"events": [[1, "", 1]]},
    {"events": [[True, "abc", 1]]},
    {"seq": -5},
    {"seq": 10 ** 12},
])
def test_an_out_of_range_record_is_read_as_damaged(tmp_path, caplog, bad):
    from lazyckpt.storage.record import LocalRecord
    directory = str(tmp_path / "run")
    os.makedirs(directory)
    doc = {"seq": 1, "events": [[1, "abc", 1]]}
    doc.update(bad)
    _write_record(directory, doc)
    assert LocalRecord(directory).read() == (0, [])
    assert "history.json" in caplog.text


def test_a_commit_past_the_largest_seq_is_refused(tmp_path):
    """The manifests (valid, checksummed) have numbered the line up to the
    largest seq an event key holds: the next commit is refused, not numbered
    into a key that cannot be parsed back."""
    directory = str(tmp_path / "run")
    paths = _steps(directory, n=1)
    _forge_manifest(paths[1], seq=10 ** 12 - 1)
    os.unlink(os.path.join(directory, "history.json"))
    with lazyckpt.Checkpointer(directory) as c:
        with pytest.raises(CheckpointError, match="seq") as info:      # the failed save's error,
            c.save({"x": torch.ones(4)}, step=2).wait(60)               # its cause the refusal
        cause = info.value if isinstance(info.value, CorruptCheckpointError) else info.value.__cause__
        assert isinstance(cause, CorruptCheckpointError) and "history.json" in str(cause)
    assert torch.equal(lazyckpt.load(directory)["x"], torch.ones(4))   # step 1 still there, loadable


@pytest.mark.parametrize("field,value", [
    ("seq", 10 ** 12), ("seq", 0), ("seq", -1), ("seq", "7"),
    ("save_id", "a/../b"), ("save_id", ""), ("save_id", 7),
])
def test_an_out_of_range_manifest_field_is_corrupt(tmp_path, field, value):
    paths = _steps(str(tmp_path / "run"), n=1)
    _forge_manifest(paths[1], **{field: value})
    with pytest.raises(CorruptCheckpointError, match=field) as info:
        lazyckpt.load(paths[1])
    assert "manifest.json" in str(info.value)


def test_a_manifest_of_a_huge_world_is_corrupt_without_expanding_it(tmp_path):
    paths = _steps(str(tmp_path / "run"), n=1)
    _forge_manifest(paths[1], world_size=10 ** 12, file_bytes=[[16, 10 ** 12]])
    with pytest.raises(CorruptCheckpointError, match="world_size"):
        lazyckpt.load(paths[1])


def test_manifest_event_ignores_out_of_range_numbers():
    import json
    from lazyckpt.lineage import manifest_event
    ok = manifest_event(json.dumps({"step": 3, "save_id": "abc", "seq": 5}).encode())
    assert ok is not None and ok.seq == 5
    for doc in ({"step": 10 ** 10, "save_id": "abc", "seq": 5}, {"step": -1, "save_id": "abc"},
                {"step": 3, "save_id": "abc", "seq": 10 ** 12}, {"step": 3, "save_id": "a/b", "seq": 5},
                {"step": 3, "save_id": "abc", "seq": 0}):
        assert manifest_event(json.dumps(doc).encode()) is None, doc


def test_event_keys_refuse_what_they_cannot_hold():
    from lazyckpt.lineage import Event, event_key, parse_event_key
    assert parse_event_key(event_key(Event(10 ** 10 - 1, "a.b-c_d", 10 ** 12 - 1))) == \
        Event(10 ** 10 - 1, "a.b-c_d", 10 ** 12 - 1)
    for e in (Event(10 ** 10, "abc", 1), Event(1, "abc", 10 ** 12), Event(-1, "abc", 1), Event(1, "a/b", 1),
              Event(1, "abc", None)):
        with pytest.raises(CorruptCheckpointError):
            event_key(e)
    assert parse_event_key("history/000000000001-0000000001-" + "a" * 4096) is None


def test_a_persisted_step_stays_visible_after_an_out_of_range_record(s3_server, s3_bucket, tmp_path):
    """Before: the record's seq 10**12 numbered step 3 with 13 digits; its event
    key did not parse, so the persistent tier read step 3 as older than steps 1
    and 2 (superseded by them): a fresh node resumed from step 2."""
    opts = {"endpoint_url": s3_server.endpoint, "access_key_id": s3_server.access_key,
            "secret_access_key": s3_server.secret_key, "region": s3_server.region}
    url, local = f"s3://{s3_bucket}/run", str(tmp_path / "local")
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as c:
        for s in (1, 2):
            c.save({"x": torch.full((4,), float(s))}, step=s).wait(persisted=True)
    doc = _record(local)
    doc["seq"] = 10 ** 12
    _write_record(local, doc)
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as c:
        c.save({"x": torch.full((4,), 3.0)}, step=3).wait(persisted=True)
    with lazyckpt.Checkpointer(str(tmp_path / "fresh"), persist=lazyckpt.Persist(url, storage_options=opts)) as other:
        assert other.persistent.dir.steps() == [1, 2, 3]
        assert torch.equal(other.load()["x"], torch.full((4,), 3.0))
        assert other.loaded_from["step"] == 3


def _save_in_forked_child(ckpt, queue):
    try:
        ckpt.save({"x": torch.ones(4)}, step=9).wait(60)
        queue.put("saved")
    except CheckpointError as exc:
        queue.put(str(exc))


def test_a_forked_child_cannot_save_with_its_parents_lease(tmp_path):
    import multiprocessing
    directory = str(tmp_path / "run")
    ctx = multiprocessing.get_context("fork")
    with lazyckpt.Checkpointer(directory) as c:
        c.save({"x": torch.ones(4)}, step=1).wait(60)
        queue = ctx.Queue()
        p = ctx.Process(target=_save_in_forked_child, args=(c, queue))
        p.start()
        said = queue.get(timeout=60)
        p.join(30)
        assert "inherited through fork" in said, said
        c.save({"x": torch.ones(4)}, step=2).wait(60)
        assert c.steps() == [1, 2]


def test_a_forked_child_loads_with_its_own_pools(tmp_path):
    """The functional API's reader pool, made by a load before a fork, has no threads
    in the forked child: a load there waited forever (the crash-point test's fork
    server hung on it; so would a DataLoader worker forked after a load). The child
    now builds its own pools."""
    path = str(tmp_path / "x.lzc")
    script = textwrap.dedent(f"""
        import os, signal, sys, torch, lazyckpt
        lazyckpt.save({{"w": torch.arange(10)}}, {path!r})
        lazyckpt.load({path!r})                      # the parent's pools exist now
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)                         # a hang ends the child with SIGALRM
            ok = torch.equal(lazyckpt.load({path!r})["w"], torch.arange(10))
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
