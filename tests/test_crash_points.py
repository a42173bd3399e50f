"""Enumerated crash points (issue 33 item 4): every short program of
tests/_crashprograms.py is crashed before each of its mutating calls, in
two modes (``kill``: SIGKILL; ``power``: SIGKILL plus a simulated power loss
that drops what was not fsynced), and the invariants are checked after each
crash (tests/_crashpoints.py; docs/RELIABILITY.md §5 has the table of
programs and point counts). In ``error`` mode (tests/_crasherrors.py,
RELIABILITY.md §5.1) the call at each point fails instead and the process
goes on: ``test_every_error_point``.

    .venv/bin/python -m pytest -q tests/test_crash_points.py -rA    # per-program counts in the summary
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import _crashpoints as cp
from _crashprograms import all_programs, file_program, save_program

torch.set_num_threads(1)

PROGRAMS = {p.name: p for p in all_programs()}

# Every (program, mode) holds at every point. On 71f4faf the rollback programs did not: a
# crash between the supersede renames and the rename of the new step (or, with power loss,
# before the parent directory's fsync after it) loaded step 4 or 3 of the abandoned run, or
# step 2 -- 6 kill and 2 power points each, 9 and 9 with persist_to.

_SUMMARY: list = []

#: CI's samples of the slowest programs (every point of each is slow): the HF Trainer's
#: (a Trainer per check) and the Checkpointer directory's with a persistent tier (the
#: server's requests in every check), each plus its last 8 points. The persistent-tier
#: programs' points before their last 8 are local commits, every one of which the local
#: programs (save-keepNone, rollback-keepNone) crash in CI in both modes: every 6th.
HF_EVERY = 4
PERSIST_EVERY = 6


@pytest.fixture(scope="module", autouse=True)
def _print_point_counts(request):
    yield
    if not _SUMMARY:
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n\ncrash points per program (program, mode, points, distinct states checked, "
              "states with violations, seconds):")
        for row in _SUMMARY:
            print("  %-28s %-5s %4d %4d %3d %6.1f" % row)
        print("  total %.1f s" % sum(r[-1] for r in _SUMMARY))


def _cases():
    for name, program in PROGRAMS.items():
        for mode in cp.MODES:
            marks = []
            if program.persist and mode == "power" and program.kind in ("dir", "hf"):
                # ~2 min each (1.6 s a point: ~40 requests to the server per check); the power
                # model changes only the local directory, which the local programs cover in CI.
                # hf: 78 s (a Trainer per check); its local commit (a staged directory renamed
                # in) is unchanged by the persistent tier, whose requests the kill mode covers.
                marks.append(pytest.mark.slow)
            if program.kind == "hf" and not marks:
                # 112 s in full (a Trainer per point, 34 points): every point is slow; CI runs
                # every 4th and the last 8 (the persistent tier's requests).
                yield pytest.param(name, mode, 1, marks=[pytest.mark.slow], id=f"{name}-{mode}")
                yield pytest.param(name, mode, HF_EVERY, id=f"{name}-{mode}-every{HF_EVERY}")
                continue
            if program.persist and program.kind == "dir" and not marks:
                # 45 s and 70 s in full (1.6 s a point, the server's requests in every check):
                # every point is slow; CI runs every 6th and the last 8 (the uploads). The
                # local commits in between are the local programs' (save-keepNone,
                # rollback-keepNone: every point in CI in both modes).
                yield pytest.param(name, mode, 1, marks=[pytest.mark.slow], id=f"{name}-{mode}")
                yield pytest.param(name, mode, PERSIST_EVERY, id=f"{name}-{mode}-every{PERSIST_EVERY}")
                continue
            if name.endswith("-auto"):
                # The o_direct="auto" twins of programs CI runs in full: every point is slow;
                # CI runs every 3rd and the last 8 (the buffered chunk's write-back is near the start).
                yield pytest.param(name, mode, 1, marks=[pytest.mark.slow], id=f"{name}-{mode}")
                yield pytest.param(name, mode, 3, id=f"{name}-{mode}-every3")
                continue
            yield pytest.param(name, mode, 1, marks=marks, id=f"{name}-{mode}")


def _s3(request):
    return request.getfixturevalue("s3_server").crash_store()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,mode,every", list(_cases()))
def test_every_crash_point(name, mode, every, tmp_path, request):
    program = PROGRAMS[name]
    s3 = _s3(request) if program.persist else None
    outcome = cp.enumerate_program(program, mode, str(tmp_path), s3, every=every, always_last=8)
    _SUMMARY.append((name if every == 1 else f"{name}/{every}", mode, outcome.points, outcome.checked,
                     len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)


#: The power modes besides "power" (a file's un-fsynced tail zero-filled, or partly
#: kept: _crashpoints.POWER_TAILS): every point of every program is slow; CI runs
#: every VARIANT_EVERY-th point (each variant from another first point) and the last
#: 3 of the programs below, which write files and commit them in each way lazyckpt
#: has (a step directory, a rollback's, an incremental step, a lone file, a new
#: directory, DCP in both layouts, the "auto" I/O).
VARIANTS = [m for m in cp.POWER_TAILS if m != "power"]
VARIANT_CI = ("save-keep2", "rollback-keep2", "incremental-keep1", "single-file-save", "first-save-new-directory",
              "dcp-lazyckpt", "dcp-dcp", "save-keepNone-auto")
VARIANT_EVERY = 5


def _variant_cases():
    for name in PROGRAMS:
        for mode in VARIANTS:
            yield pytest.param(name, mode, 1, 1, marks=[pytest.mark.slow], id=f"{name}-{mode}")
            if name in VARIANT_CI:
                first = 1 + 2 * VARIANTS.index(mode)
                yield pytest.param(name, mode, VARIANT_EVERY, first, id=f"{name}-{mode}-every{VARIANT_EVERY}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,mode,every,first", list(_variant_cases()))
def test_every_crash_point_with_a_torn_tail(name, mode, every, first, tmp_path, request):
    """The power loss leaves each file's un-fsynced tail zero-filled
    (``power-zero``) or half kept (``power-partial``) instead of cut."""
    program = PROGRAMS[name]
    s3 = _s3(request) if program.persist else None
    outcome = cp.enumerate_program(program, mode, str(tmp_path), s3, every=every, always_last=3, first=first)
    _SUMMARY.append((name if every == 1 else f"{name}/{every}", mode, outcome.points, outcome.checked,
                     len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)


# ----------------------------------------------------------------------------- with replicas= (2 nodes)

import _crashreplicas as cr  # noqa: E402

DIST_PROGRAMS = {p.name: p for p in cr.dist_programs()}
#: CI's sample of the replica programs (about 3 s a point: the crash job and three restarts).
#: Their local commits are save-keepNone's and rollback-keepNone's (every point in CI, both
#: modes); replicas-rollback's job-wide commit refused, failing after the round and finished
#: at the next open are tests/test_job_commit.py's and tests/test_error_paths.py's; the
#: replica round's data (received, verified, restored) tests/test_replicas.py's.
REPLICAS_EVERY = 16


def _dist_cases():
    for name in DIST_PROGRAMS:
        for mode in cp.MODES:
            # Every point: slow (about 3 s a point here: the crash job and three restarted jobs).
            yield pytest.param(name, mode, 1, marks=[pytest.mark.slow], id=f"{name}-{mode}-every")
            # CI: every REPLICAS_EVERY-th point, in both modes (kill from the first, power from
            # half-way between: together an eighth of the points; replicas-restore every 4th,
            # half of them, while its finding below waits on clean CI runs).
            marks, every = [], REPLICAS_EVERY
            if name == "replicas-restore":
                # RELIABILITY.md §6, finding 22: twice in CI (2026-12-04) both ranks' load() refused
                # step 2 ("the replicas of node(s) [0] do not match their manifest"). Its probable
                # cause (a held replica's deletion cut short with its COMPLETE marker left) was
                # fixed the next day; still run and reported (XPASS/XFAIL), not strict until clean
                # CI runs confirm it.
                marks.append(pytest.mark.xfail(strict=False, reason="intermittent violation, probable cause "
                                               "fixed: RELIABILITY.md finding 22"))
                every = 4
            yield pytest.param(name, mode, every, marks=marks, id=f"{name}-{mode}-every{every}")
        for mode in VARIANTS:
            # A torn tail on node 0 (zeros, or half of it kept) instead of a cut one: every
            # point, slow only (the "power" cases above sample the same points in CI).
            yield pytest.param(name, mode, 1, marks=[pytest.mark.slow], id=f"{name}-{mode}-every")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name,mode,every", list(_dist_cases()))
def test_every_crash_point_with_replicas(name, mode, every, tmp_path, monkeypatch):
    """Two ranks, one per node, replicas=1: rank 0 crashed before each of its
    mutating calls (rank 1 killed with it), the whole job restarted, each node
    lost in turn (tests/_crashreplicas.py)."""
    program = DIST_PROGRAMS[name]
    points = None
    first = 1 if every == 1 or mode == "kill" else 1 + every // 2
    if cp.is_power(mode):
        # Every point and #end (n + 1): the operation returned on both ranks, then node 0 lost
        # power; what it reported done must survive, as with the local programs. CI's sample
        # trades its first point (early: nothing durable changed yet, the kill sample's
        # neighbourhood) for #end, so it costs what it did. One dry run: enumerate_program's
        # is this one's.
        n, descriptions = cr.dry_run(program, str(tmp_path))
        monkeypatch.setattr(cr, "dry_run", lambda *_args: (n, descriptions))
        points = list(range(1, n + 2)) if every == 1 else list(range(first, n + 1, every))[1:] + [n + 1]
    outcome = cr.enumerate_program(program, mode, str(tmp_path), points=points, every=every, first=first)
    _SUMMARY.append((f"{name}/{every}", mode, outcome.points, outcome.checked, len(outcome.violations),
                     outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)


def test_the_replicas_program_replicates_within_its_operation(tmp_path):
    """Not vacuous: rank 0's points include its local commit and the replica it
    receives from node 1 (COMPLETE), and the prepared nodes hold each other's step 2."""
    n, descriptions = cr.dry_run(cr.replicas_save_program(), str(tmp_path))
    text = "\n".join(descriptions)
    assert "node0/history.json" in text and "node0/step_0000000003" in text, text
    assert ".replicas/node_00001/rank_00000/step_0000000003/COMPLETE" in text, text
    for rank in (0, 1):
        held = tmp_path / "prepared" / f"node{rank}" / ".replicas" / f"node_{1 - rank:05d}" / "rank_00000"
        assert os.listdir(held) == ["step_0000000002"]


def test_the_restore_program_restores_within_its_operation(tmp_path):
    """Not vacuous: rank 0's points are the restore's (its file received, node 0's
    record and the step renamed in) and the replica of node 1's step received anew."""
    n, descriptions = cr.dry_run(cr.replicas_restore_program(), str(tmp_path))
    text = "\n".join(descriptions)
    assert ".incoming-0" in text and "node0/history.json" in text, text
    assert "-> node0/step_0000000002" in text, text
    assert ".replicas/node_00001/rank_00000/step_0000000002/COMPLETE" in text, text


# ----------------------------------------------------------------------------- the harness itself

def _ops(root):
    """A hand-made operation: one file durable, one written but not fsynced, one
    whose directory entry is not durable, a rename not fsynced over an old file."""
    os.makedirs(os.path.join(root, "d"))
    with open(os.path.join(root, "old"), "wb") as f:
        f.write(b"old content")

    def run(icp):
        with icp.operation():
            fd = os.open(os.path.join(root, "a"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"x" * 100)
            os.fsync(fd)
            os.write(fd, b"y" * 50)           # after the fsync: lost
            os.close(fd)
            fd = os.open(os.path.join(root, "d", "b"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"z" * 10)           # never fsynced
            os.close(fd)
            dfd = os.open(root, os.O_RDONLY)
            os.fsync(dfd)                     # "a" and "d" durable, not d/b's entry
            os.close(dfd)
            fd = os.open(os.path.join(root, "new"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"new")
            os.fsync(fd)
            os.close(fd)
            os.replace(os.path.join(root, "new"), os.path.join(root, "old"))   # parent not fsynced
            with open(os.path.join(root, "c"), "w") as f:          # builtins.open counts too
                f.write("c")
    return run


def test_the_interceptor_numbers_calls_and_crashes_before_the_kth(tmp_path):
    def child(root, k, mode):
        os.makedirs(root)
        run = _ops(root)
        icp = cp.Interceptor(root, k, str(tmp_path / "side"), mode)
        icp.install()
        os.write(os.open(os.path.join(root, "setup"), os.O_WRONLY | os.O_CREAT), b"s")   # not armed: not counted
        run(icp)
        return icp.count, icp.descriptions
    status, (count, descriptions) = cp.run_forked(lambda: child(str(tmp_path / "dry"), cp.INFINITY, "kill"))
    assert status == "ok"
    kinds = [d.split("] ", 1)[1].split(" ")[0] for d in descriptions]
    assert kinds == ["os.open", "os.write", "os.fsync", "os.write", "os.open", "os.write", "os.fsync",
                     "os.open", "os.write", "os.fsync", "os.replace", "open"], descriptions
    assert count == 12
    root = str(tmp_path / "root")
    status, value = cp.run_forked(lambda: child(root, 5, "kill"))
    assert status == "killed"
    record = (tmp_path / "side").read_text()
    assert "os.open root/d/b" in record
    assert not os.path.exists(os.path.join(root, "d", "b"))       # killed before the open
    assert os.path.getsize(os.path.join(root, "a")) == 150        # the page cache survives a kill


def test_the_power_loss_model_drops_what_was_not_fsynced(tmp_path):
    import json
    root = str(tmp_path / "root")
    os.makedirs(root)
    run = _ops(root)

    def child():
        icp = cp.Interceptor(root, 12, str(tmp_path / "side"), "power")
        icp.install()
        run(icp)
    status, _ = cp.run_forked(child)
    assert status == "killed"
    record = json.loads((tmp_path / "side").read_text())
    dropped = cp.apply_power_loss(record["journal"], root)
    assert os.path.getsize(os.path.join(root, "a")) == 100, dropped       # cut to its fsynced size
    assert os.path.isdir(os.path.join(root, "d"))                         # mkdir before the operation
    assert not os.path.exists(os.path.join(root, "d", "b")), dropped      # d never fsynced
    assert open(os.path.join(root, "old"), "rb").read() == b"old content", dropped   # rename undone
    assert not os.path.exists(os.path.join(root, "new")), dropped   # its creation was never durable either
    assert not os.path.exists(os.path.join(root, "c")), dropped     # the crash came before its open


def test_the_power_loss_model_restores_a_replaced_hard_link_as_a_link(tmp_path):
    """Lightning's last.ckpt is a hard link to a top-k file, later replaced by a
    rename: a power loss before the directory's fsync brings the link back (a
    journaled file system keeps the old entry), not nothing, which the model
    did before (found by the lightning-persist-rotation program)."""
    import json
    root = str(tmp_path / "root")
    os.makedirs(root)
    topk, last = os.path.join(root, "topk"), os.path.join(root, "last")

    def child_after():
        icp = cp.Interceptor(root, 8, str(tmp_path / "side"), "power")
        icp.install()
        with icp.operation():
            fd = os.open(topk, os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"top-k")
            os.fsync(fd)
            os.close(fd)
            os.link(topk, last)
            dfd = os.open(root, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)
            fd = os.open(last + ".tmp", os.O_WRONLY | os.O_CREAT, 0o644)
            os.close(fd)
            os.replace(last + ".tmp", last)                    # the new last, not yet durable
            dfd = os.open(root, os.O_RDONLY)
            os.fsync(dfd)                                      # 8: the crash comes before it
    status, _ = cp.run_forked(child_after)
    assert status == "killed"
    record = json.loads((tmp_path / "side").read_text())
    dropped = cp.apply_power_loss(record["journal"], root)
    assert os.path.exists(last), dropped
    assert os.stat(last).st_ino == os.stat(topk).st_ino and open(last, "rb").read() == b"top-k", dropped


def _power_cut(tmp_path, root, k, ops, tail="cut"):
    """Run ``ops(root)`` armed in a power-mode child crashed at call ``k`` (None: at
    the point after its last), apply the power loss; returns what it dropped."""
    import json
    side = str(tmp_path / f"side-{tail}")

    def child():
        icp = cp.Interceptor(root, cp.INFINITY if k is None else k, side, "power")
        icp.install()
        with icp.operation():
            ops(root)
            if k is None:
                icp.crash_at = icp.count + 1
    status, value = cp.run_forked(child)
    assert status == "killed", value
    record = json.loads(open(side).read())
    return cp.apply_power_loss(record["journal"], root, tail)


def _dir_fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def test_the_power_loss_model_undoes_unlinks_and_rmdirs_not_fsynced(tmp_path):
    """An unlink or an rmdir whose directory was not fsynced after it comes
    back after a power loss (the file as its own inode and bytes, a tree that
    shutil.rmtree removed whole); one whose directory was fsynced stays done;
    a rename over an empty directory is undone with that directory back."""
    import shutil
    root = str(tmp_path / "root")
    os.makedirs(os.path.join(root, "tree", "sub"))
    os.makedirs(os.path.join(root, "gone", "inner"))
    os.makedirs(os.path.join(root, "empty"))
    os.makedirs(os.path.join(root, "moving"))
    for name, data in [("keep", b"kept bytes"), ("tree/a", b"a" * 5000), ("tree/sub/b", b"b"),
                       ("gone/c", b"c"), ("gone/inner/d", b"d"), ("moving/e", b"e")]:
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
    os.symlink("keep", os.path.join(root, "link"))
    inode = os.stat(os.path.join(root, "keep")).st_ino

    def ops(root):
        os.unlink(os.path.join(root, "keep"))
        os.unlink(os.path.join(root, "link"))
        shutil.rmtree(os.path.join(root, "tree"))             # no fsync after: all of it comes back
        shutil.rmtree(os.path.join(root, "gone"))
        os.rename(os.path.join(root, "moving"), os.path.join(root, "empty"))    # over an empty directory
        _dir_fsync(os.path.join(root, "empty"))                # its content, not its entry
        os.unlink(os.path.join(root, "empty", "e"))
        _dir_fsync(os.path.join(root, "empty"))                # e's unlink is durable
    # Power lost after the last call: every change above but e's unlink was in root, never fsynced.
    dropped = _power_cut(tmp_path, root, None, ops)
    assert open(os.path.join(root, "keep"), "rb").read() == b"kept bytes", dropped
    assert os.stat(os.path.join(root, "keep")).st_ino == inode, dropped      # the same file, not a copy
    assert os.stat(os.path.join(root, "keep")).st_nlink == 1, dropped
    assert os.readlink(os.path.join(root, "link")) == "keep", dropped
    assert open(os.path.join(root, "tree", "a"), "rb").read() == b"a" * 5000, dropped
    assert open(os.path.join(root, "tree", "sub", "b"), "rb").read() == b"b", dropped
    assert sorted(os.listdir(os.path.join(root, "gone"))) == ["c", "inner"], dropped
    assert os.listdir(os.path.join(root, "gone", "inner")) == ["d"], dropped
    assert os.listdir(os.path.join(root, "empty")) == [], dropped             # the replaced directory, back
    assert os.listdir(os.path.join(root, "moving")) == [], dropped            # e's unlink was durable
    assert "undo rmdir root/tree/sub" in dropped and "undo unlink root/tree/sub/b" in dropped, dropped


def test_the_power_loss_model_keeps_an_unlink_whose_directory_was_fsynced(tmp_path):
    """A deletion made durable (the directory fsynced after it) is not undone,
    nor is an rmdir whose parent was fsynced after it (its inner unlinks then
    have nowhere to come back to); the crash at the fsync undoes it."""
    import shutil
    for k, back in ((None, False), (3, True)):
        root = str(tmp_path / f"root{k}")
        os.makedirs(os.path.join(root, "d"))
        with open(os.path.join(root, "d", "f"), "wb") as f:
            f.write(b"f")

        def ops(root):
            shutil.rmtree(os.path.join(root, "d"))             # 1: unlink d/f, 2: rmdir d
            _dir_fsync(root)                                   # 3
        dropped = _power_cut(tmp_path, root, k, ops)
        assert os.path.exists(os.path.join(root, "d", "f")) == back, (k, dropped)


def test_the_power_loss_tail_variants(tmp_path):
    """An un-fsynced tail: "cut" to the last fsynced size, "zero" (the size kept,
    zeros past the fsynced bytes: XFS), "partial" (a prefix of it kept: ext4's
    writeback); a never-fsynced new file the same from 0 bytes."""
    fsynced, tail = b"s" * 4096, b"t" * 6000
    expected = {"cut": (fsynced, b""),
                "zero": (fsynced + bytes(len(tail)), bytes(3000)),
                "partial": (fsynced + tail[:2560], b"u" * 1024)}       # half, in whole sectors: 2560 of 6000, 1024 of 3000
    for variant, (want_a, want_b) in expected.items():
        root = str(tmp_path / variant)
        os.makedirs(root)
        with open(os.path.join(root, "b"), "wb"):
            pass

        def ops(root):
            fd = os.open(os.path.join(root, "a"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, fsynced)
            os.fsync(fd)
            os.write(fd, tail)
            os.close(fd)
            _dir_fsync(root)
            fd = os.open(os.path.join(root, "b"), os.O_WRONLY)     # an old file, never fsynced: ...
            os.write(fd, b"u" * 3000)
            os.close(fd)
        dropped = _power_cut(tmp_path, root, None, ops, variant)
        assert open(os.path.join(root, "a"), "rb").read() == want_a, (variant, dropped)
        assert open(os.path.join(root, "b"), "rb").read() == want_b, (variant, dropped)   # ... its old 0 B, then the tail


def test_calls_below_python_are_points(tmp_path):
    """sync_file_range (called through ctypes by storage/iomode.py) and the
    os calls that move bytes between descriptors (os.sendfile: shutil.copyfile
    on Linux) are numbered like the other calls."""
    import shutil
    from lazyckpt.storage import iomode
    root = str(tmp_path / "root")
    os.makedirs(root)
    with open(str(tmp_path / "src"), "wb") as f:
        f.write(b"x" * 10000)

    def child():
        icp = cp.Interceptor(root, cp.INFINITY, str(tmp_path / "side"), "kill")
        icp.install()
        with icp.operation():
            shutil.copyfile(str(tmp_path / "src"), os.path.join(root, "copy"))
            fd = os.open(os.path.join(root, "wb"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"y" * 8192)
            iomode.write_back(fd, 0, 8192)
            os.close(fd)
        return icp.descriptions
    status, descriptions = cp.run_forked(child)
    assert status == "ok", descriptions
    text = "\n".join(descriptions)
    if iomode._sync_file_range is not None:
        assert "sync_file_range root/wb 8192 B at 0" in text, text
    if hasattr(os, "sendfile") and os.uname().sysname == "Linux":
        assert "os.sendfile root/copy" in text, text


def test_torch_save_to_a_path_is_a_point_and_journaled(tmp_path):
    """torch.save(obj, path) writes through torch's C++ writer, no Python call:
    it is one point, and its file, never fsynced, is gone after a power loss
    (convert --to torch saves so, then fsyncs and renames)."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    with open(os.path.join(root, "old.pt"), "wb") as f:
        f.write(b"old")

    def ops(root):
        torch.save({"w": torch.ones(3)}, os.path.join(root, "new.pt"))
        torch.save({"w": torch.ones(3)}, os.path.join(root, "old.pt"))
        _dir_fsync(root)
    dropped = _power_cut(tmp_path, root, None, ops)
    assert not os.path.exists(os.path.join(root, "new.pt")) or os.path.getsize(os.path.join(root, "new.pt")) == 0, \
        dropped
    assert open(os.path.join(root, "old.pt"), "rb").read() == b"old", dropped

    def child():
        icp = cp.Interceptor(root, cp.INFINITY, str(tmp_path / "side2"), "kill")
        icp.install()
        with icp.operation():
            ops(root)
        return icp.descriptions
    status, descriptions = cp.run_forked(child)
    assert status == "ok", descriptions
    assert "torch.save root/new.pt" in descriptions[0], descriptions


def test_a_removed_lightning_checkpoint_stays_removed_after_a_power_loss(tmp_path):
    """LazyCheckpointIO.remove_checkpoint of a local file (ModelCheckpoint's
    top-k rotation) has returned: a power loss must not bring the file back
    (found by lightning-persist-rotation's #end point once unlinks not
    followed by their directory's fsync were undone: the old top-k file came
    back, an orphan neither ModelCheckpoint nor the store's mirror knows)."""
    pytest.importorskip("lightning")
    from lazyckpt.integrations.lightning import LazyCheckpointIO
    root = str(tmp_path / "root")
    os.makedirs(root)
    old = os.path.join(root, "epoch=0-step=1.ckpt")
    plugin = LazyCheckpointIO(**cp.KNOBS)
    plugin.save_checkpoint({"w": torch.ones(3)}, old)
    plugin.teardown()

    def ops(root):
        io = LazyCheckpointIO(**cp.KNOBS)
        io.remove_checkpoint(old)
        io.teardown()
    dropped = _power_cut(tmp_path, root, None, ops)
    assert not os.path.exists(old), dropped


def test_the_auto_programs_write_back_below_python(tmp_path):
    """Not vacuous: the o_direct="auto" programs' saves write a chunk buffered
    and write it back with sync_file_range, and the rest O_DIRECT."""
    from lazyckpt.storage import iomode
    if iomode._sync_file_range is None or not getattr(os, "O_DIRECT", 0):
        pytest.skip("no sync_file_range or O_DIRECT here: the auto mode has nothing to choose")
    n, descriptions = cp.dry_run(PROGRAMS["save-keepNone-auto"], str(tmp_path))
    text = "\n".join(descriptions)
    assert "sync_file_range" in text and "O_DIRECT" in text, text


def test_the_checks_catch_a_commit_that_skips_the_data_fsync(tmp_path):
    """Not vacuous: the same save program with the data file's fsync removed
    (a mutant of the library) shows violations under power loss, none under kill."""
    good = save_program(None)

    def run(ctx, icp):
        from lazyckpt.storage import fileio
        fileio.OutputFile.finish = lambda self, size: os.ftruncate(self.fd, size)
        good.run(ctx, icp)
    mutant = cp.Program("save-without-data-fsync", good.prepare, run, good.worlds, kwargs=good.kwargs)
    killed = cp.enumerate_program(mutant, "kill", str(tmp_path / "kill"))
    power = cp.enumerate_program(mutant, "power", str(tmp_path / "power"))
    assert not killed.violations, cp.summarize(killed)
    assert power.violations, cp.summarize(power)
    assert any("rank_00000.lzc: never fsynced" in " ".join(v["dropped"]) for v in power.violations)


def test_the_single_file_program_sees_both_files(tmp_path):
    """The oracle of a file program tells the old file from the new one."""
    program = file_program()
    n, descriptions = cp.dry_run(program, str(tmp_path))
    assert any("os.replace" in d for d in descriptions) and n == len(descriptions)


@pytest.mark.parametrize("keep_last", [None, 1])
def test_the_incremental_program_refers_to_an_earlier_step(tmp_path, keep_last):
    """Not vacuous: the step the incremental program's operation commits refers to step 2's bytes."""
    import json
    from _crashprograms import incremental_program
    cp.dry_run(incremental_program(keep_last), str(tmp_path))
    manifest = json.loads((tmp_path / "dry" / "run" / "step_0000000003" / "manifest.json").read_text())
    assert manifest.get("references") == [2], manifest.get("references")


def test_the_leftovers_program_has_leftovers_to_clean(tmp_path):
    """Not vacuous: the prepared directory holds every kind of leftover, and the
    operation (opening a Checkpointer) removes the dead ones."""
    from _crashprograms import leftovers_program
    n, descriptions = cp.dry_run(leftovers_program(), str(tmp_path))
    prepared = sorted(os.listdir(tmp_path / "prepared" / "run"))
    assert [x for x in prepared if x.startswith(".")] == [
        ".abandoned-step_0000000007-aaaaaaaaaaaa", ".deleting-step_0000000000-fedcba987654",
        ".tmp-step_0000000004-0123456789ab", ".writer"], prepared
    left = sorted(os.listdir(tmp_path / "dry" / "run"))
    assert ".tmp-step_0000000004-0123456789ab" not in left and "latest.tmp-bbbbbbbbbbbb" not in left, left
    assert any("rmdir" in d for d in descriptions), descriptions


def test_a_hung_job_is_killed_with_its_stacks():
    """The harness of the replica programs: a job past its timeout is killed, and
    reports where each rank was."""
    def fn(rank, peers):
        if rank == 1:
            time.sleep(600)
        return rank
    results = cr.run_job(fn, timeout=5)
    assert results[0][0] == "timeout" and results[1][0] == "timeout", results
    assert "sleep" in results[1][1] or "fn" in results[1][1], results[1]


# ----------------------------------------------------------------------------- error mode: the call fails, the process goes on

import _crasherrors as ce  # noqa: E402

#: CI's sample of each program's points in error mode (every N-th from the first, and
#: the last: the lease's release), under a minute in all; every point is slow. The HF
#: Trainer (a Trainer a point) runs only there; a persistent tier's point costs 4-5
#: local ones (its requests), so those programs are sampled more thinly (every 48th).
ERROR_EVERY = {"dir": 12, "file": 4, "dcp": 8, "objects": 8, "hf": 0}


#: Open findings of the error mode (RELIABILITY.md §4), program -> reason: strict
#: xfails, so that a fix shows as XPASS.
ERROR_OPEN: dict = {}


def _error_cases():
    for name, program in PROGRAMS.items():
        known = [pytest.mark.xfail(strict=True, reason=ERROR_OPEN[name])] if name in ERROR_OPEN else []
        yield pytest.param(name, 1, marks=[pytest.mark.slow] + known, id=f"{name}-error")
        every = ERROR_EVERY.get(program.kind, 0) * (4 if program.persist and program.kind == "dir" else 1)
        if every and not name.endswith("-auto"):        # the o_direct="auto" twins: slow only
            yield pytest.param(name, every, marks=known, id=f"{name}-error-every{every}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,every", list(_error_cases()))
def test_every_error_point(name, every, tmp_path, request):
    """The durable call at each point fails (EIO; ENOSPC for writes and creates)
    and the process goes on (tests/_crasherrors.py): the error raised is the
    library's and names the cause; what is committed agrees with what was
    reported; the same process's next save and a fresh process's restart work."""
    program = PROGRAMS[name]
    s3 = _s3(request) if program.persist else None
    outcome = ce.enumerate_program(program, str(tmp_path), s3, every=every, always_last=1)
    _SUMMARY.append((name if every == 1 else f"{name}/{every}", "error", outcome.points, outcome.checked,
                     len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", list(DIST_PROGRAMS))
def test_every_error_point_with_replicas(name, tmp_path):
    """Error mode with replicas= (2 nodes): rank 0's call at each point fails, both
    ranks go on; what each raised, what loads, the next save on both ranks
    (replicated), then the three restarted jobs of tests/_crashreplicas.py
    (``_crasherrors.enumerate_dist_program``). 6 to 25 s a point here: slow only
    (``python tests/_crasherrors.py NAME [--points K,..]`` prints each point as it ends)."""
    program = DIST_PROGRAMS[name]
    outcome = ce.enumerate_dist_program(program, str(tmp_path))
    _SUMMARY.append((f"{name}", "error", outcome.points, outcome.checked, len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)


# ----------------------------------------------------------------------------- Megatron-Core's save strategy

from _crashmegatron import megatron_program  # noqa: E402

MEGATRON = megatron_program()
#: CI: every MEGATRON_EVERY-th point per mode (each mode from another first point);
#: every point (17, about 5 s a mode here) is slow.
MEGATRON_EVERY = 3


def _megatron_cases():
    for i, mode in enumerate(cp.MODES + tuple(VARIANTS)):
        yield pytest.param(mode, 1, 1, marks=[pytest.mark.slow], id=f"megatron-lazyckpt-{mode}")
        if mode in cp.MODES:
            yield pytest.param(mode, MEGATRON_EVERY, 1 + i, id=f"megatron-lazyckpt-{mode}-every{MEGATRON_EVERY}")


def _require_megatron():
    from _megatron import stub_triton_kernels
    stub_triton_kernels()
    from _frameworks import require
    require("megatron.core.dist_checkpointing")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,every,first", list(_megatron_cases()))
def test_every_crash_point_of_a_megatron_save(mode, every, first, tmp_path):
    """Megatron's ``dist_checkpointing.save`` through ``LazySaveStrategy``, async,
    then finalized (tests/_crashmegatron.py): crashed before each of its calls,
    the previous iteration loads bit-exact with plain Megatron and the new one
    loads bit-exact or is refused as no checkpoint. The power loss after the
    finalize returned (the ``#end`` point) is the next test's."""
    _require_megatron()
    n, _ = cp.dry_run(MEGATRON, str(tmp_path))
    points = list(range(first, n + 1, every)) if every > 1 else list(range(1, n + 1))
    outcome = cp.enumerate_program(MEGATRON, mode, str(tmp_path), points=points)
    _SUMMARY.append((MEGATRON.name if every == 1 else f"{MEGATRON.name}/{every}", mode, outcome.points,
                     outcome.checked, len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0 and points
    assert not outcome.violations, cp.summarize(outcome)


#: CI's sample in error mode: every MEGATRON_ERROR_EVERY-th point and the last (the finalize's
#: durability calls); every point is slow.
MEGATRON_ERROR_EVERY = 4


@pytest.mark.timeout(900)
@pytest.mark.parametrize("every", [pytest.param(1, marks=[pytest.mark.slow], id="megatron-lazyckpt-error"),
                                   pytest.param(MEGATRON_ERROR_EVERY,
                                                id=f"megatron-lazyckpt-error-every{MEGATRON_ERROR_EVERY}")])
def test_every_error_point_of_a_megatron_save(every, tmp_path):
    """The Megatron program's call at each point fails and the process goes on
    (tests/_crasherrors.py): what the save raised is the library's (in Megatron's
    chain) and names the cause; iter1 still loads with plain Megatron, iter2
    loads where the save returned and is refused as no checkpoint where it
    raised; saving iter2 again in the same process works; then a fresh
    process's checks of tests/_crashmegatron.py."""
    _require_megatron()
    outcome = ce.enumerate_program(MEGATRON, str(tmp_path), every=every, always_last=1)
    _SUMMARY.append((MEGATRON.name if every == 1 else f"{MEGATRON.name}/{every}", "error", outcome.points,
                     outcome.checked, len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)


@pytest.mark.parametrize("mode", list(cp.POWER_TAILS))
def test_a_finalized_megatron_save_survives_a_power_loss(mode, tmp_path):
    """LazySaveStrategy's finalize promises a durable checkpoint once it returns
    on every rank: a power loss right after it must leave iter2 loadable. It did
    not: neither iter2's entry in its parent nor Megatron's metadata.json was
    fsynced (found by this program; fixed by the fsyncs run right after
    metadata.json is written, before Megatron-LM's tracker file)."""
    _require_megatron()
    cp.preload(MEGATRON)
    n, _ = cp.dry_run(MEGATRON, str(tmp_path))
    result = cp.run_case(MEGATRON, str(tmp_path), n + 1, mode)
    assert result["op"].startswith(cp.END_POINT), result
    assert not result["problems"], result


# ----------------------------------------------------------------------------- DeepSpeed's checkpoint engine

from _crashdeepspeed import deepspeed_program  # noqa: E402

DEEPSPEED = deepspeed_program()
#: CI's samples (every point of every mode is slow): every DEEPSPEED_EVERY-th point and
#: the last (the directory's fsync after latest's rename), the error mode from the first
#: point (so the two part files' directory fsyncs, points 17 and 25 of 30), the kill mode
#: from the fifth: 10 cases, about 3 s here plus the fork server's DeepSpeed imports (3 s).
#: The power modes' every point and #end are slow.
DEEPSPEED_EVERY = 8


def _deepspeed_cases():
    for mode in ("error",) + cp.MODES + tuple(VARIANTS):
        yield pytest.param(mode, 1, 1, marks=[pytest.mark.slow], id=f"deepspeed-lazyckpt-{mode}")
        if mode in ("error", "kill"):
            yield pytest.param(mode, DEEPSPEED_EVERY, 1 if mode == "error" else 5,
                               id=f"deepspeed-lazyckpt-{mode}-every{DEEPSPEED_EVERY}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,every,first", list(_deepspeed_cases()))
def test_every_crash_point_of_a_deepspeed_save(mode, every, first, tmp_path):
    """DeepSpeed's ``save_checkpoint`` of tag step2 beside committed step1 through
    ``LazyCheckpointEngine`` (tests/_crashdeepspeed.py: ZeRO 1, two part files,
    each renamed in and its directory fsynced, then ``latest``): crashed before
    each call (or, in error mode, the call failing and the process going on),
    ``latest`` names a committed tag whose files ``torch.load`` reads with its
    weights, and a fresh engine's ``load_checkpoint`` and save work."""
    from _frameworks import require
    require("deepspeed")
    if mode == "error":
        outcome = ce.enumerate_program(DEEPSPEED, str(tmp_path), every=every, always_last=1)
    else:
        outcome = cp.enumerate_program(DEEPSPEED, mode, str(tmp_path), every=every, always_last=1, first=first)
    _SUMMARY.append((DEEPSPEED.name if every == 1 else f"{DEEPSPEED.name}/{every}", mode, outcome.points,
                     outcome.checked, len(outcome.violations), outcome.seconds))
    print(cp.summarize(outcome))
    assert outcome.points > 0
    assert not outcome.violations, cp.summarize(outcome)
