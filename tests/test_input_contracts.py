"""Issue 22, cases 6, 8 and 10: bad input gets a clear error.

* case 8: malformed or unsupported object URLs, options that do not apply;
* case 10: a step directory whose name disagrees with its manifest;
* case 6: one writer per directory (the writer lease, docs/FORMAT.md §11).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError, CorruptCheckpointError
from lazyckpt.storage.s3 import InvalidURLError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(v=0.0):
    return {"w": torch.full((1000,), float(v)), "b": torch.arange(10) + int(v)}


@pytest.fixture
def s3env(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


# ---------------------------------------------------------------------- case 8: URLs

BAD_S3 = ["s3://{b}/a//b", "s3://{b}/a\\b", "s3://{b}/./a", "s3://{b}/a/../b", "s3://{b}/a/.",
          "s3:///a", "s3://{b}//a", "s3://{b}/a\x00b"]
UNSUPPORTED = ["S3://{b}/r", "s3:/{b}/r", "s3a://{b}/r", "gs://{b}/r", "file:///tmp/x", "s3:{b}/r",
               "https://{b}.s3.amazonaws.com/r"]


def _objects(server, bucket):
    page = server.client().list_objects_v2(Bucket=bucket)
    return [o["Key"] for o in page.get("Contents", [])]


def test_a_double_slash_prefix_is_refused_before_anything_is_written(s3env, s3_bucket):
    """On main this committed every save, while steps() stayed empty and
    load() found nothing (SeaweedFS collapses the empty component)."""
    url = f"s3://{s3_bucket}/a//b"
    with pytest.raises(InvalidURLError, match="empty path component"):
        with lazyckpt.Checkpointer(url) as ck:
            ck.save(_state(1), 1).wait()
    assert _objects(s3env, s3_bucket) == []


@pytest.mark.parametrize("template", BAD_S3 + UNSUPPORTED)
def test_malformed_or_unsupported_urls_are_refused_everywhere(template, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = template.format(b="bucket-x")
    for call in (lambda: lazyckpt.Checkpointer(url),
                 lambda: lazyckpt.Checkpointer(tmp_path / "local", persist=url),
                 lambda: lazyckpt.save(_state(), url),
                 lambda: lazyckpt.load(url),
                 lambda: lazyckpt.load_async(url)):
        with pytest.raises(InvalidURLError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, CheckpointError)
    assert sorted(os.listdir(tmp_path)) in ([], ["local"])   # no directory named like the URL
    assert not os.path.exists(tmp_path / "local" / "step_0000000001")
    if template in ("s3://{b}/a//b", "s3a://{b}/r", "s3:/{b}/r"):       # the CLI decides the same way
        out = subprocess.run([sys.executable, "-m", "lazyckpt", "ls", url], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
        assert out.returncode != 0 and "URL" in out.stderr, out.stderr
        assert os.listdir(tmp_path) in ([], ["local"])


def test_an_unsupported_scheme_says_how_to_name_a_local_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidURLError, match=r"only s3:// .*\./s3a:"):
        lazyckpt.Checkpointer("s3a://bucket-x/run")
    # The escape hatch the message names: a relative path that starts with ./
    with lazyckpt.Checkpointer("./s3a:odd") as ck:
        ck.save(_state(1), 1).wait()
    assert os.listdir(tmp_path / "s3a:odd")


def test_well_formed_urls_still_parse():
    from lazyckpt.storage.s3 import ObjectURL
    assert str(ObjectURL.parse("s3://bucket-x/a/b/")) == "s3://bucket-x/a/b"
    assert str(ObjectURL.parse("s3://bucket-x")) == "s3://bucket-x"
    assert str(ObjectURL.parse("s3://bucket-x/")) == "s3://bucket-x"
    assert ObjectURL.parse("s3://bucket.x-1/run.v2/..a/b..").key == "run.v2/..a/b.."


# ---------------------------------------------------------------------- case 8: options

@pytest.mark.parametrize("kwargs, name", [
    (dict(storage_options={"region": "x"}), "storage_options"),
    (dict(persist_keep_last=2), "persist_keep_last"),
    (dict(persist_bandwidth=1e6), "persist_bandwidth"),
    (dict(full_every=3), "full_every"),
    (dict(node_size=2), "node_size"),
    (dict(replica_bandwidth=1e6), "replica_bandwidth"),
])
def test_options_that_do_not_apply_are_refused(kwargs, name, tmp_path):
    # The old flat spellings: the groups cannot express these combinations at all.
    with pytest.warns(DeprecationWarning, match=name), pytest.raises(ValueError, match=name):
        lazyckpt.Checkpointer(tmp_path / "d", **kwargs)
    assert not os.path.exists(tmp_path / "d")


def test_options_that_apply_are_accepted_and_environment_knobs_are_not_refused(tmp_path, monkeypatch):
    lazyckpt.Checkpointer(tmp_path / "a", incremental=lazyckpt.Incremental(full_every=3)).close()
    # A knob from the environment or an Options object is a site default, not a
    # request to this Checkpointer: it is not refused where it does not apply.
    monkeypatch.setenv("LAZYCKPT_FULL_EVERY", "3")
    monkeypatch.setenv("LAZYCKPT_PERSIST_BANDWIDTH", "1000000")
    lazyckpt.Checkpointer(tmp_path / "b").close()
    with pytest.warns(DeprecationWarning, match="options="):      # the deprecated spelling of a site default
        lazyckpt.Checkpointer(tmp_path / "c", options=lazyckpt.Options(storage_options={"region": "x"})).close()


# ---------------------------------------------------------------------- case 10: step name vs manifest

def test_a_step_directory_restored_under_another_name_does_not_load_as_that_step(tmp_path):
    d = tmp_path / "run"
    with lazyckpt.Checkpointer(d) as ck:
        ck.save(_state(1), 1).wait()
        ck.save(_state(2), 2).wait()
    # A backup of step_2 restored as step_1.
    shutil.rmtree(d / "step_0000000001")
    shutil.copytree(d / "step_0000000002", d / "step_0000000001")
    with lazyckpt.Checkpointer(d) as ck:
        with pytest.raises(CorruptCheckpointError, match=r"step_0000000001.*step 2.*not step 1|step 1.*step 2"):
            ck.load(step=1)
        assert torch.equal(ck.load()["w"], _state(2)["w"])      # the real step 2 is unaffected
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        lazyckpt.load(d / "step_0000000001")
    from lazyckpt.cli import inspect as lzinspect
    from lazyckpt.cli import prune as lzprune
    from lazyckpt.loading import resolve as lzresolve
    from lazyckpt.storage.stores import LOCAL
    from lazyckpt.loading import verify as lzverify
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        lzresolve.resolve(str(d / "step_0000000001"), store=LOCAL)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    out = subprocess.run([sys.executable, "-m", "lazyckpt", "verify", str(d / "step_0000000001")], capture_output=True, text=True,
                         env=env)
    assert out.returncode != 0 and "step 2" in out.stdout + out.stderr, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "lazyckpt", "inspect", str(d / "step_0000000001")],
                         capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "step 2" in out.stderr, out.stderr


# ---------------------------------------------------------------------- case 6: one writer per directory

def test_a_second_writer_is_refused_and_the_first_keeps_a_loadable_line(tmp_path):
    """On main the second Checkpointer re-saved step 2, and the first one's
    next incremental save referred to the old step 2: committed, never loadable."""
    d = tmp_path / "run"
    first = lazyckpt.Checkpointer(d, incremental=True)
    state = _state(1)
    first.save(state, 1).wait()
    state["b"] += 1
    first.save(state, 2).wait()
    second = lazyckpt.Checkpointer(d)
    with pytest.raises(CheckpointError, match=rf"pid {os.getpid()} on {socket.gethostname()}.*takeover=True"):
        second.save(_state(9), 2)
    assert torch.equal(second.load()["w"], state["w"])         # loading needs no lease
    state["b"] += 1
    first.save(state, 3).wait()
    first.close()
    with lazyckpt.Checkpointer(d) as ck:
        assert ck.steps() == [1, 2, 3]
        for s in (2, 3):
            assert torch.equal(ck.load(step=s)["b"], torch.arange(10) + s)
    second.close()


def test_takeover_displaces_the_first_writer_whose_next_save_fails(tmp_path):
    d = tmp_path / "run"
    first = lazyckpt.Checkpointer(d)
    first.save(_state(1), 1).wait()
    second = lazyckpt.Checkpointer(d, distributed=lazyckpt.Distributed(takeover=True))
    second.save(_state(2), 2).wait()
    with pytest.raises(CheckpointError, match="took over"):
        first.save(_state(3), 3)
    first.close()
    second.save(_state(4), 4).wait()
    assert second.steps() == [1, 2, 4]
    second.close()


def test_close_and_collection_release_the_lease(tmp_path):
    d = tmp_path / "run"
    first = lazyckpt.Checkpointer(d)
    first.save(_state(1), 1).wait()
    first.close()
    second = lazyckpt.Checkpointer(d)
    second.save(_state(2), 2).wait()
    del second                                    # dropped without close(): a notebook's stale object
    gc.collect()
    with lazyckpt.Checkpointer(d) as third:
        third.save(_state(3), 3).wait()
        assert third.steps() == [1, 2, 3]


_WRITER = textwrap.dedent("""
    import sys, time, torch, lazyckpt
    ck = lazyckpt.Checkpointer(sys.argv[1])
    ck.save({"w": torch.zeros(10)}, 1).wait()
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_writer_in_another_process_is_refused_until_it_dies(tmp_path):
    d = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(d)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        ck = lazyckpt.Checkpointer(d)
        with pytest.raises(CheckpointError, match=rf"pid {child.pid} on {socket.gethostname()}"):
            ck.save(_state(2), 2)
        child.send_signal(signal.SIGKILL)
        child.wait()
        # The flock died with the process: a restart is never blocked.
        ck.save(_state(2), 2).wait()
        assert ck.steps() == [1, 2]
        ck.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _two_ranks_then_a_stray_writer(rank, world, directory):
    import json
    import torch.distributed as dist
    ck = lazyckpt.Checkpointer(directory)
    ck.save({"w": torch.full((10,), float(rank))}, 1).wait()
    holder = json.load(open(os.path.join(directory, ".writer")))
    refused = None
    if rank == 1:       # not the coordinator: it holds no lease, and a local writer of its own is refused
        try:
            lazyckpt.Checkpointer(directory,
                                  distributed=lazyckpt.Distributed(process_group=False)).save({"w": torch.zeros(1)}, 2)
        except CheckpointError as exc:
            refused = str(exc)
    dist.barrier()
    ck.save({"w": torch.full((10,), float(rank))}, 3).wait()     # the group saves on
    ck.close()
    return os.getpid(), holder["pid"], refused


def test_several_ranks_the_coordinator_holds_the_lease(tmp_path):
    from _dist import run_ranks
    (pid0, holder0, _), (_pid1, holder1, refused) = run_ranks(2, _two_ranks_then_a_stray_writer, str(tmp_path))
    assert holder0 == holder1 == pid0
    assert refused is not None and f"pid {pid0}" in refused
    assert lazyckpt.Checkpointer(tmp_path).steps() == [1, 3]


def test_the_step_a_location_names():
    from lazyckpt.formats.manifest import step_named_by
    assert step_named_by("/r/step_0000000002/manifest.json") == 2
    assert step_named_by("/r/step_0000000002") == 2
    assert step_named_by("s3://b/r/step_0000000002/0123abcd/manifest.json") == 2
    assert step_named_by("/r/backup/manifest.json") is None
    assert step_named_by("/r/step_0000000002/copy/manifest.json") is None


def test_without_file_locks_the_heartbeat_alone_decides(tmp_path, monkeypatch):
    """A file system without locks (the existing seam raises ENOLCK): a live
    holder is one whose heartbeat is younger than lease_expiry_s."""
    import errno
    import json
    from lazyckpt.storage import locks

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "no locks")
    monkeypatch.setattr(locks, "_flock", no_locks)
    d = tmp_path / "run"
    first = lazyckpt.Checkpointer(d, io=lazyckpt.IO(lease_expiry=30))
    first.save(_state(1), 1).wait()
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        lazyckpt.Checkpointer(d, io=lazyckpt.IO(lease_expiry=30)).save(_state(2), 2)
    first.close()
    # A holder in another process (on another host) whose heartbeat is fresh is live...
    writer = d / ".writer"
    writer.write_text(json.dumps({"pid": 1, "host": "elsewhere", "id": "x", "since": 0}))
    with pytest.raises(CheckpointError, match="pid 1 on elsewhere"):
        lazyckpt.Checkpointer(d, io=lazyckpt.IO(lease_expiry=30)).save(_state(2), 2)
    # ... and dead once its heartbeat is older than lease_expiry_s.
    os.utime(writer, (1, 1))
    with lazyckpt.Checkpointer(d, io=lazyckpt.IO(lease_expiry=30)) as ck:
        ck.save(_state(2), 2).wait()
        assert ck.steps() == [1, 2]
