"""Error paths, one durable call failing while the process goes on: each test
makes the first call whose description matches a pattern fail (EIO; ENOSPC
for writes and creates) in one program of tests/_crashprograms.py, with the
crash-point harness's error mode (tests/_crasherrors.py), and asserts what
that mode checks: the error raised is the library's (or an OSError) and names
the cause; what is committed agrees with what was reported; the same process's
next save and a fresh process's restart work. Each is a failure the error
mode found, kept as a focused test of its own."""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch

import _crasherrors as ce
import _crashpoints as cp
from _crashprograms import dcp_program, file_program, lightning_persist_program, save_program

torch.set_num_threads(1)

pytestmark = pytest.mark.timeout(300)


def fail_first(program, pattern, tmp_path, after=None, s3=None):
    """The fault at the first of ``program``'s points matching ``pattern`` (after
    the first matching ``after``); the case's result (``_crasherrors.run_case``)."""
    cp.preload(program)
    n, descriptions = cp.dry_run(program, str(tmp_path), s3)
    start = 0 if after is None else next(i for i, d in enumerate(descriptions, 1) if re.search(after, d))
    k = next((i for i, d in enumerate(descriptions, 1) if i > start and re.search(pattern, d)), None)
    assert k is not None, f"no point matches {pattern!r}: {descriptions}"
    result = ce.run_case(program, str(tmp_path), k, s3)
    assert result["op"] and re.search(pattern, result["op"]), result["op"]
    return result


def test_a_failed_write_of_the_writer_lease_lets_the_next_save_take_it(tmp_path):
    """The first save takes ``.writer``; its write fails (ENOSPC). Before the
    fix the lease stayed registered as held by this process (the flock too):
    every later save of the same Checkpointer, or of a new one, was refused as
    "another Checkpointer on this directory is still open"."""
    result = fail_first(save_program(None), r"os\.pwrite \S+/\.writer", tmp_path)
    assert result["raised"], result
    assert not result["problems"], result["problems"]


def test_a_failed_cut_of_the_writer_lease_lets_the_next_save_take_it(tmp_path):
    result = fail_first(save_program(None), r"os\.ftruncate \S+/\.writer", tmp_path)
    assert not result["problems"], result["problems"]


def test_a_failed_directory_fsync_after_a_lone_file_is_published_says_it_is_in_place(tmp_path):
    """``lazyckpt.save`` over a file: the rename has put the new file in place
    when the directory's fsync fails (EIO). The file it replaced has no name
    left, so there is nothing to undo to; the error says the save is in place
    but not durable (``committed``), and the next save makes it durable. Before,
    the error said "save failed" while the new file was what loaded."""
    result = fail_first(file_program(), r"os\.fsync (dry|case-error-\d+)( |$)", tmp_path)
    assert "the new file is in place" in (result["raised"] or ""), result
    assert not result["problems"], result["problems"]


@pytest.mark.parametrize("file_format", ["lazyckpt", "dcp"])
def test_a_failed_directory_fsync_after_dcp_metadata_leaves_no_checkpoint(tmp_path, file_format):
    """``dcp.save`` through ``LazyStorageWriter``: ``.metadata`` (the commit) is
    renamed in, then the directory's fsync fails (EIO). dcp.save raises; before
    the fix the checkpoint was complete and loaded all the same, so the report
    and the disk disagreed. ``.metadata`` is taken back: no checkpoint, and the
    retry saves it."""
    result = fail_first(dcp_program(file_format), r"os\.fsync (dry|case-error-\d+)/step2( |$)", tmp_path,
                        after=r"os\.replace \S+/step2/\.metadata\.tmp")
    assert result["raised"], result
    assert not result["problems"], result["problems"]


def test_a_failed_top_k_save_keeps_the_previous_top_k_file(tmp_path, s3_bucket, s3_server):
    """Lightning's rotation through ``LazyCheckpointIO`` (with a persistent tier):
    the new top-k file's save fails (fsync EIO), last.ckpt's save after it
    succeeds, then ``remove_checkpoint`` of the old top-k file. Before the fix
    the removal waited for the newest save only (last.ckpt's) and deleted the
    old file: no top-k file was left. Every save queued before now counts."""
    s3 = {"bucket": s3_bucket,
          "storage_options": {"endpoint_url": s3_server.endpoint, "access_key_id": s3_server.access_key,
                              "secret_access_key": s3_server.secret_key, "region": s3_server.region}}
    result = fail_first(lightning_persist_program(), r"os\.fsync \S+/ck/\.epoch=0-step=2\.ckpt\.tmp", tmp_path,
                        s3=s3)
    assert result["raised"], result
    assert not result["problems"], result["problems"]


def _require_megatron():
    from _megatron import stub_triton_kernels
    stub_triton_kernels()
    from _frameworks import require
    require("megatron.core.dist_checkpointing")


@pytest.mark.parametrize("pattern,after", [
    (r"os\.fsync \S+/iter2/metadata\.json", None),
    (r"os\.fsync (dry|case-error-\d+)/iter2( |$)", r"os\.fsync \S+/iter2/metadata\.json"),
    (r"os\.fsync (dry|case-error-\d+)( |$)", r"os\.fsync \S+/iter2/metadata\.json")],
    ids=["metadata.json", "the-checkpoint-directory", "its-entry-in-the-parent"])
def test_a_failed_fsync_after_megatron_metadata_json_leaves_no_checkpoint(tmp_path, pattern, after):
    """Megatron's ``dist_checkpointing.save`` through ``LazySaveStrategy``: after
    Megatron writes ``metadata.json`` (what makes the directory a checkpoint to
    Megatron), the strategy fsyncs it, the directory and its entry in the
    parent; one of those fails (EIO). The finalize raises; before the fix
    ``metadata.json`` stayed and iter2 loaded all the same (or, its pages lost
    with the failed fsync, failed to load with a ``UnicodeDecodeError``).
    ``metadata.json`` is taken back: no checkpoint, and saving again works."""
    _require_megatron()
    from _crashmegatron import megatron_program
    result = fail_first(megatron_program(), pattern, tmp_path, after=after)
    assert result["raised"], result
    assert not result["problems"], result["problems"]


def _megatron_rank_whose_metadata_fsync_fails(rank, world, root):
    """Both ranks save iter2 with Megatron through ``LazySaveStrategy``; rank 0's
    fsync of ``metadata.json`` fails (EIO). What each rank's finalize raised,
    and whether Megatron then reads iter2 as a checkpoint."""
    import errno
    import _crashmegatron as cm
    from _megatron import cpu_shims
    cpu_shims()
    import lazyckpt.integrations.megatron as lm
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    path = os.path.join(root, "iter2")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        real = lm.fsync_file

        def fsync_file(p, *args):
            if os.path.basename(p) == "metadata.json":
                raise OSError(errno.EIO, "injected fault: EIO (fsync metadata.json)")
            return real(p, *args)
        lm.fsync_file = fsync_file
    torch.distributed.barrier()
    values = cm.values(2)
    state = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=rank) for k, v in values.items()}
    strategy = lm.LazySaveStrategy(lazyckpt={"writer_threads": 1})
    raised = None
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")

    def write_tracker():            # Megatron-LM's finalize, appended after the save's
        if rank == 0:
            with open(tracker, "w") as f:
                f.write("2")
    try:
        request = dist_checkpointing.save(state, path, strategy, async_sharded_save=True, async_strategy="mcore")
        request.add_finalize_fn(write_tracker)
        request.execute_sync()
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        strategy.close()
    torch.distributed.barrier()
    return {"raised": raised, "metadata.json": os.path.exists(os.path.join(path, "metadata.json")),
            "tracker": os.path.exists(tracker)}


def test_a_failed_fsync_after_megatron_metadata_json_fails_the_save_on_every_rank(tmp_path):
    """Two ranks: rank 0 makes ``metadata.json`` durable and fails (EIO). Every
    rank's finalize must report the save failed, and none may write Megatron-LM's
    tracker file (appended after the save's finalize): it would name an
    iteration that is not a checkpoint. Before the fix rank 0 raised a bare
    OSError and left metadata.json, and rank 1, waiting for rank 0 at a
    barrier after the fsyncs, failed with gloo's "connection closed"."""
    _require_megatron()
    from _dist import run_ranks
    results = run_ranks(2, _megatron_rank_whose_metadata_fsync_fails, str(tmp_path), timeout=120,
                        allow_failure=True)
    assert all(status == "ok" for status, _ in results), results
    for rank, (_, out) in enumerate(results):
        assert out["raised"] and "CheckpointWriteError" in out["raised"], results
        assert "injected fault" in out["raised"], results
        assert not out["metadata.json"] and not out["tracker"], results


@pytest.mark.parametrize("pattern", [r"os\.write node0/history\.json\.tmp", r"os\.fsync node0$"],
                         ids=["the-record", "the-directory-after-it"])
def test_an_io_error_on_one_node_after_the_job_wide_round_leaves_one_line(tmp_path, pattern, monkeypatch):
    """``replicas-rollback``: two nodes, steps 1-5, both ranks ``load(step=2)``
    then ``save(3)``: a save that supersedes, so the nodes decide in the job-wide
    round. Every node voted for it, then node 0's local commit fails (ENOSPC
    writing its record; EIO from the directory's fsync after it). Node 1 has
    committed step 3 and its rank reports the save done. Before the fix node 0
    discarded its prepared save and raised; reopened (collective), the job
    loaded step 2 on both ranks: neither the line before (5) nor the save rank 1
    was told is done (3). Node 0 now keeps it prepared, its error says the job
    committed it (``committed``), and the reopen rolls it forward: step 3 on
    both nodes."""
    import _crashreplicas as cr
    program = {p.name: p for p in cr.dist_programs()}["replicas-rollback"]
    n, descriptions = cr.dry_run(program, str(tmp_path))
    start = next(i for i, d in enumerate(descriptions, 1) if re.search(r"os\.open node0/history\.json\.tmp", d))
    k = next(i for i, d in enumerate(descriptions, 1) if i >= start and re.search(pattern, d))
    # Node 1's replica round of step 3 waits for node 0 (whose commit failed) until the
    # commit timeout: most of the test's time. The ranks are forked from here and take it.
    monkeypatch.setattr(ce, "DIST_COMMIT_TIMEOUT", 6.0)
    result = ce.run_dist_case(program, str(tmp_path), k)
    assert result["op"] and re.search(pattern, result["op"].split(" -> ")[0]), result["op"]
    assert not result["problems"], result["problems"]


@pytest.mark.parametrize("pattern", [r"os\.mkdir node0/\.tmp-step_\d+-restore", r"open node0/\S+/\.incoming-0"],
                         ids=["its-directory", "the-received-file"])
def test_a_restore_failing_to_write_on_the_receiving_node_fails_the_same_on_every_rank(tmp_path, pattern):
    """``replicas-restore``: node 0 lost its directory; the collective ``load()``
    receives node 0's file from node 1's replica. Node 0's write fails (ENOSPC
    making the restore's directory or opening the received file). Before the
    fix rank 0 raised the bare OSError at once, and rank 1, left in the
    transfer (gloo's send or receive), raised gloo's ``RuntimeError: Timed out
    waiting ...`` after the commit timeout, outside the library's family. The
    receiver now drains the transfer and every rank raises the same
    ``CheckpointWriteError``; the reopened job restores."""
    import _crashreplicas as cr
    program = {p.name: p for p in cr.dist_programs()}["replicas-restore"]
    n, descriptions = cr.dry_run(program, str(tmp_path))
    k = next(i for i, d in enumerate(descriptions, 1) if re.search(pattern, d))
    result = ce.run_dist_case(program, str(tmp_path), k)
    assert not result["problems"], result["problems"]


class _FailFirstMatching(ce.FaultInterceptor):
    """Fails the first call whose description matches ``pattern``, whatever its
    number (the replica round's thread and the commit's interleave)."""

    def __init__(self, root, pattern, side):
        super().__init__(root, cp.INFINITY, side)
        self.pattern = re.compile(pattern)

    def point(self, description):
        import threading
        with self._lock:
            self.count += 1
            desc = f"#{self.count} [{threading.current_thread().name}] {cp._mask(description)}"
            if self.fault is None and self.pattern.search(desc):
                self.crash_at = self.count
                self._crash(desc)


def _save_whose_replica_write_fails(case, rank, side):
    """replicas-save's operation (the default 60 s commit timeout) with rank 0's
    creation of the replica it receives failing: each rank's replica state and
    the seconds its ``wait()`` took."""
    import time
    import _crashreplicas as cr
    cp.quiet()
    icp = None
    if rank == 0:
        icp = _FailFirstMatching(cr.node_dir(case, 0), r"open node0/\.replicas/\S+/data\.lzc", side)
        icp.install()
    with cr._ck(case, rank) as ck:
        with (icp.operation() if icp is not None else contextlib.nullcontext()):
            h = ck.save(cr.new_state(rank), step=3)
            h.wait()
            t0 = time.monotonic()
            ck.wait()
            seconds = time.monotonic() - t0
        return {"state": h.replica_state, "seconds": seconds, "fault": icp.fault["op"] if icp and icp.fault else None}


def test_a_replica_round_whose_receiver_cannot_write_fails_at_once_on_every_rank(tmp_path):
    """The same cause in the replica round: node 0 cannot create the replica of
    node 1's step 3 it receives (ENOSPC). Before, rank 0 left the transfer at
    once and the round waited the commit timeout (60 s here) for it, then
    failed as "timed out ... a rank may have died". Now the receiver drains
    the transfer: the round fails on both ranks at once, naming the write."""
    import shutil
    import _crashreplicas as cr
    program = {p.name: p for p in cr.dist_programs()}["replicas-save"]
    cr.dry_run(program, str(tmp_path))
    case = str(tmp_path / "case")
    shutil.copytree(str(tmp_path / "prepared"), case, symlinks=True)
    results = cr.run_job(lambda rank, peers: _save_whose_replica_write_fails(case, rank, case + ".side"),
                         timeout=300)
    assert all(status == "ok" for status, _ in results), results
    assert results[0][1]["fault"], results
    for _, out in results:
        assert out["state"].startswith("failed"), results
        assert out["seconds"] < 30, results
    assert "cannot be written here" in results[0][1]["state"], results


def _rollback_then_go_on(case, rank, k, side):
    """replicas-rollback's operation with rank 0's call ``k`` failing, then the same
    Checkpointers save step 4 (no reopen) and close; then a reopened job loads."""
    import _crashreplicas as cr
    from lazyckpt.errors import CheckpointError
    cp.quiet()
    icp = None
    if rank == 0:
        icp = ce.FaultInterceptor(cr.node_dir(case, 0), k, side)
        icp.install()
    ck = cr._ck(case, rank)
    raised = None
    with (icp.operation() if icp is not None else contextlib.nullcontext()):
        ck.load(step=2)
        try:
            ck.save(cr.new_state(rank), step=3).wait()
        except Exception as exc:
            raised = ce.describe(exc)
    four = cp.make_state(100 * rank + 4444)
    went_on = None
    try:
        ck.save(four, step=4).wait()
        ck.wait()
        ck.close()
    except Exception as exc:
        went_on = f"{type(exc).__name__}: {exc}"
        ck.close(cancel=True)
    with cr._ck(case, rank) as again:
        got = again.load()
        loaded = again.loaded_from["step"]
        steps = again.steps()
        try:
            three = again.load(step=3)
        except CheckpointError as exc:
            three = f"{type(exc).__name__}: {exc}"
    return {"raised": raised, "went_on": went_on, "loaded": loaded, "four": not cp.differs(four, got),
            "steps": steps, "three": three if isinstance(three, str) else
            "new" if not cp.differs(cr.new_state(rank), three) else "other"}


def test_a_checkpointer_going_on_after_a_commit_failing_after_the_job_wide_round(tmp_path):
    """The same cause, without the reopen the error asks for: node 0's commit of
    the agreed step 3 fails (ENOSPC writing its record); both ranks save step 4
    with the same Checkpointers. Step 4 commits on both nodes, and a reopened
    job loads it; ``load(step=3)`` is the rollback's new save or refused (node 0
    never committed it), never the abandoned step 3 nor a mix of the two."""
    import shutil
    import _crashreplicas as cr
    program = {p.name: p for p in cr.dist_programs()}["replicas-rollback"]
    n, descriptions = cr.dry_run(program, str(tmp_path))
    k = next(i for i, d in enumerate(descriptions, 1) if re.search(r"os\.write node0/history\.json\.tmp", d))
    case = str(tmp_path / "case")
    shutil.copytree(str(tmp_path / "prepared"), case, symlinks=True)
    results = cr.run_job(lambda rank, peers: _rollback_then_go_on(case, rank, k, case + ".side"), timeout=300)
    assert all(status == "ok" for status, _ in results), results
    (_, r0), (_, r1) = results
    assert r0["raised"] and "every node voted to commit it" in r0["raised"], results
    assert r1["raised"] is None, results
    for out in (r0, r1):
        assert out["went_on"] is None and out["loaded"] == 4 and out["four"], results
        # Node 0 never committed step 3 (the reopen that finishes it came after step 4):
        # refused as a step not every node holds, never the old step 3 nor a mix.
        assert out["three"] == "new" or "cannot be restored on every node" in out["three"], results


# ----------------------------------------------------------------------------- the error mode itself

def test_the_error_mode_catches_a_library_that_swallows_a_failed_fsync(tmp_path):
    """Not vacuous: a mutant of the library that ignores an EIO from the data
    file's fsync commits a step whose pages the failure dropped (the error mode
    overwrites them): the check finds it, where the real library fails the save."""
    import os
    from lazyckpt.storage import fileio
    good = save_program(None)

    def run(ctx, icp):
        def finish(self, size):
            os.ftruncate(self.fd, size)
            try:
                os.fsync(self.fd)
            except OSError:
                pass                        # the mutant: the error swallowed
        fileio.OutputFile.finish = finish
        good.run(ctx, icp)
    mutant = cp.Program("save-swallowing-fsync-eio", good.prepare, run, good.worlds, kwargs=good.kwargs)
    result = fail_first(mutant, r"os\.fsync \S+/rank_00000\.lzc", tmp_path / "mutant")
    assert result["raised"] is None, result
    assert any("lost with the failed fsync" in d for d in result["dropped"]), result["dropped"]
    assert result["problems"], result
    real = fail_first(good, r"os\.fsync \S+/rank_00000\.lzc", tmp_path / "real")
    assert real["raised"] and not real["problems"], real


def test_only_the_kth_call_fails(tmp_path):
    """One fault per point: the calls after it are made (a retry succeeds)."""
    import os

    def child():
        root = str(tmp_path / "root")
        os.makedirs(root)
        icp = ce.FaultInterceptor(root, 2, str(tmp_path / "side"))
        icp.install()
        outcomes = []
        with icp.operation():
            fd = os.open(os.path.join(root, "a"), os.O_WRONLY | os.O_CREAT, 0o644)
            for _ in range(2):
                try:
                    os.write(fd, b"x")
                    outcomes.append("ok")
                except OSError as exc:
                    outcomes.append(os.strerror(exc.errno))
            try:
                os.fsync(fd)
                outcomes.append("ok")
            except OSError as exc:
                outcomes.append(exc.errno)
            os.close(fd)
        return outcomes, icp.fault["errno"]
    status, value = cp.run_forked(child)
    assert status == "ok", value
    assert value == (["No space left on device", "ok", "ok"], "ENOSPC"), value
