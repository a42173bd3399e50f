"""torch.distributed.checkpoint with lazyckpt's storage writer/reader:
dcp.save / dcp.async_save / dcp.load in 1 and 2 gloo processes with FSDP2,
and a reshard on load (DCP's planner does the resharding)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lazyckpt
from _dist import fsdp_model, full_state, run_ranks
from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter

pytestmark = pytest.mark.timeout(600)


def _plain_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def _train(model, opt, steps, seed=0):
    losses = []
    for i in range(steps):
        torch.manual_seed(seed + i)
        loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("use_async", [False, True])
def test_single_process_save_load_resumes_identically(tmp_path, use_async):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _plain_model()
    _train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 3}}
    writer = LazyStorageWriter(tmp_path)
    if use_async:
        writer.attach(opt)
        response = dcp.async_save(state, storage_writer=writer, no_dist=True)
        reference = _train(model, opt, 2, seed=100)      # the pre-hook waits for staging first
        response.upload_completion.result()
        writer.close()
    else:
        dcp.save(state, storage_writer=writer, no_dist=True)
        reference = _train(model, opt, 2, seed=100)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0.lzc"]
    assert lazyckpt.load(str(tmp_path / "__0.lzc"))          # a plain lazyckpt file underneath

    model2, opt2 = _plain_model()
    msd2, osd2 = get_state_dict(model2, opt2)
    state2 = {"model": msd2, "optim": osd2, "extra": {"epoch": 0}}
    dcp.load(state2, storage_reader=LazyStorageReader(tmp_path), no_dist=True)
    set_state_dict(model2, opt2, model_state_dict=state2["model"], optim_state_dict=state2["optim"])
    assert state2["extra"]["epoch"] == 3
    assert _train(model2, opt2, 2, seed=100) == reference


def test_async_staging_is_a_consistent_snapshot(tmp_path):
    """Tensors mutated right after staging completes do not leak into the checkpoint."""
    model, opt = _plain_model()
    state = {"model": {k: v for k, v in model.state_dict().items()}}
    before = {k: v.clone() for k, v in state["model"].items()}
    writer = LazyStorageWriter(tmp_path)
    response = dcp.async_save(state, storage_writer=writer, no_dist=True)
    response.staging_completion.result()
    with torch.no_grad():
        for t in state["model"].values():
            t.add_(1.0)
    response.upload_completion.result()
    writer.close()
    target = {"model": {k: torch.zeros_like(v) for k, v in before.items()}}
    dcp.load(target, storage_reader=LazyStorageReader(tmp_path), no_dist=True)
    assert all(torch.equal(target["model"][k], v) for k, v in before.items())


def test_metadata_is_not_unpickled_blindly(tmp_path):
    model, _ = _plain_model()
    dcp.save({"model": model.state_dict()}, storage_writer=LazyStorageWriter(tmp_path), no_dist=True)

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(BaseException) as info:     # DCP's CheckpointException is a BaseException
        dcp.load({"model": model.state_dict()}, storage_reader=LazyStorageReader(tmp_path), no_dist=True)
    # DCP wraps each rank's error in a CheckpointException carrying the originals.
    assert "not plain checkpoint metadata" in str(info.value)
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------- FSDP2, 2 ranks


def _fsdp(world):
    return fsdp_model(world, hidden=37, out=5)


_full = full_state


def _fsdp_save(rank, world, directory, use_async, file_format="lazyckpt"):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _fsdp(world)
    for i in range(2):
        torch.manual_seed(i)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    writer = LazyStorageWriter(directory, file_format=file_format)
    if use_async:
        response = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer)
        response.upload_completion.result()
    else:
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    writer.close()
    return _full(msd)


def _fsdp_load(rank, world, directory, reader="lazy"):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _fsdp(world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if reader == "lazy":
        dcp.load(state, storage_reader=LazyStorageReader(directory))
    else:                                   # DCP's own FileSystemReader
        dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(get_state_dict(model, opt)[0])


@pytest.mark.parametrize("use_async", [False, True])
def test_fsdp2_two_ranks_and_reshard_on_load(tmp_path, use_async):
    ref = run_ranks(2, _fsdp_save, str(tmp_path), use_async)[0]
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0.lzc", "__1.lzc"]
    for world in ((2, 3) if not use_async else (1,)):
        for got in run_ranks(world, _fsdp_load, str(tmp_path)):
            assert all(torch.equal(ref[k], got[k]) for k in ref), f"2 -> {world} ranks"


@pytest.mark.parametrize("use_async", [False, True])
def test_fsdp2_in_dcp_file_format_reshards_through_dcp_own_reader_and_lazyckpt(tmp_path, use_async):
    """``file_format="dcp"`` (torchtitan's checkpoints, issue 35): DCP's own
    ``__<rank>_0.distcp`` files, loaded by plain ``dcp.load(checkpoint_id=)`` on
    another world size, and by LazyStorageReader."""
    ref = run_ranks(2, _fsdp_save, str(tmp_path), use_async, "dcp")[0]
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for world, reader in (((3, "dcp"), (1, "lazy")) if not use_async else ((1, "dcp"),)):
        for got in run_ranks(world, _fsdp_load, str(tmp_path), reader):
            assert all(torch.equal(ref[k], got[k]) for k in ref), f"2 -> {world} ranks, {reader} reader"


_LOAD_WITHOUT_LAZYCKPT = r"""
import sys
sys.modules["lazyckpt"] = None          # any import of lazyckpt (an unpickled class of it) fails
import torch, torch.distributed.checkpoint as dcp
state = torch.load(sys.argv[2], weights_only=True)
target = {{k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}}
target["epoch"] = 0
dcp.load(target, checkpoint_id=sys.argv[1], no_dist=True)
assert target["epoch"] == 3, target["epoch"]
assert all(torch.equal(target[k], state[k]) for k in state if isinstance(state[k], torch.Tensor))
print("loaded without lazyckpt")
"""


@pytest.mark.parametrize("use_async", [False, True])
def test_dcp_file_format_loads_with_dcp_alone_and_every_record_is_checked(tmp_path, use_async):
    """What ``file_format="dcp"`` writes needs nothing of lazyckpt to load (a process
    where ``import lazyckpt`` fails reads it with ``dcp.load``); lazyckpt's reader
    checks each record's CRC-32, which ``torch.load`` does not: a flipped byte is a
    CorruptCheckpointError there, where DCP's own reader loads it silently."""
    import subprocess
    import sys
    torch.manual_seed(0)
    state = {"w": torch.randn(300, 64), "b": torch.randn(7).to(torch.bfloat16), "view": torch.randn(9, 4)[:, 1],
             "empty": torch.empty(0), "epoch": 3}
    ckpt = tmp_path / "ckpt"
    writer = LazyStorageWriter(ckpt, file_format="dcp")
    if use_async:
        dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result()
    else:
        dcp.save(state, storage_writer=writer, no_dist=True)
    writer.close()
    assert sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp"]
    expected = tmp_path / "expected.pt"
    torch.save({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, expected)
    done = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_LAZYCKPT.format(), str(ckpt), str(expected)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "loaded without lazyckpt" in done.stdout, done.stderr[-3000:]

    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()}
    dcp.load(target, storage_reader=LazyStorageReader(ckpt), no_dist=True)
    assert target["epoch"] == 3 and all(torch.equal(target[k], state[k]) for k in ("w", "b", "view", "empty"))

    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "w")
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[info.offset + info.length // 2] ^= 0xFF                 # inside w's bytes
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    silently = {"w": torch.zeros(300, 64)}
    dcp.load(silently, checkpoint_id=str(ckpt), no_dist=True)     # DCP's reader: no check
    assert not torch.equal(silently["w"], state["w"])
    from torch.distributed.checkpoint.api import CheckpointException      # (a BaseException)
    with pytest.raises((CheckpointException, lazyckpt.CorruptCheckpointError)) as raised:   # DCP wraps it
        dcp.load({"w": torch.zeros(300, 64)}, storage_reader=LazyStorageReader(ckpt), no_dist=True)
    causes = [exc for exc, _ in getattr(raised.value, "failures", {}).values()] or [raised.value]
    assert any(isinstance(c, lazyckpt.CorruptCheckpointError) and "fails its CRC-32" in str(c) for c in causes)


def test_lazyckpt_reader_loads_a_checkpoint_of_dcp_own_writer(tmp_path):
    """LazyStorageReader reads what DCP's FileSystemWriter wrote (a checkpoint from
    before a switch to lazyckpt, or torchtitan's initial_load_path)."""
    model, opt = _plain_model()
    _train(model, opt, 2)
    dcp.save({"model": model.state_dict(), "epoch": 5}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    target = {"model": fresh.state_dict(), "epoch": 0}
    dcp.load(target, storage_reader=LazyStorageReader(tmp_path), no_dist=True)
    assert target["epoch"] == 5
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())


def _pickled_globals(raw: bytes):
    """(module, name) of every class a pickle names (GLOBAL, or STACK_GLOBAL after two strings)."""
    import pickletools
    found, strings, memo, last = set(), [], {}, None
    for op, arg, _ in pickletools.genops(raw):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
        elif op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
            memo[len(memo) if op.name == "MEMOIZE" else arg] = last
            continue
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            strings.append(memo.get(arg))
            last = memo.get(arg)
            continue
        elif isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
        last = arg if isinstance(arg, str) and "UNICODE" in op.name else None
    return found


class _UnpicklerBeforeTheMove(pickle.Unpickler):
    """The metadata allow-list of lazyckpt before issue 23 (integrations/dcp.py's _ALLOWED):
    it names LazyStorageInfo only at lazyckpt.integrations.dcp."""
    ALLOWED = {"torch.distributed.checkpoint.metadata": None, "lazyckpt.integrations.dcp": {"LazyStorageInfo"},
               "collections": {"OrderedDict"}, "builtins": {"set", "frozenset", "slice", "complex"},
               "torch": {"Size"}, "torch.serialization": {"_get_layout"}}

    def find_class(self, module, name):
        allowed = self.ALLOWED.get(module, set())
        if module in self.ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise AssertionError(f"lazyckpt before issue 23 refuses {module}.{name}")


def _load_and_compare(tmp_path, model):
    fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    target = {"model": fresh.state_dict()}
    dcp.load(target, storage_reader=LazyStorageReader(tmp_path), no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v)
    from lazyckpt.interop.sources import load_dcp
    state = load_dcp(str(tmp_path), allow_pickle=False)
    assert torch.equal(state["model"]["0.weight"], model.state_dict()["0.weight"])


def test_new_metadata_names_lazystorageinfo_at_its_old_path_and_loads(tmp_path):
    """Issue 23 moved LazyStorageInfo to lazyckpt.interop (now dcp_source); lazyckpt before the move
    can unpickle it only as lazyckpt.integrations.dcp.LazyStorageInfo (its allow-list,
    and it has no lazyckpt.interop). New .metadata keeps naming that path, and loads:
    with lazyckpt's reader, the command line's converter, plain pickle (DCP's own
    readers) and the allow-list of lazyckpt before the move."""
    from lazyckpt.integrations.dcp import LazyStorageInfo
    from lazyckpt.interop import dcp_source
    assert LazyStorageInfo is dcp_source.LazyStorageInfo
    model, _ = _plain_model()
    dcp.save({"model": model.state_dict()}, storage_writer=LazyStorageWriter(tmp_path), no_dist=True)
    raw = (tmp_path / ".metadata").read_bytes()
    names = _pickled_globals(raw)
    assert ("lazyckpt.integrations.dcp", "LazyStorageInfo") in names
    assert not any(m.startswith("lazyckpt.") and m != "lazyckpt.integrations.dcp" for m, _ in names), names
    assert b"lazyckpt.interop" not in raw
    infos = [v for v in pickle.loads(raw).storage_data.values()]
    assert infos and all(type(v) is LazyStorageInfo for v in infos)
    import io
    before = _UnpicklerBeforeTheMove(io.BytesIO(raw)).load()
    assert [type(v) for v in before.storage_data.values()] == [LazyStorageInfo] * len(infos)
    _load_and_compare(tmp_path, model)


def test_metadata_naming_lazystorageinfo_at_interop_still_loads(tmp_path):
    """Files written on the redesign branch before LazyStorageInfo kept its old
    pickle path name lazyckpt.interop.dcp.LazyStorageInfo: they load too, with
    lazyckpt's readers and with plain pickle (DCP's own readers), although that
    module is lazyckpt.interop.dcp_source now (its old name re-exports it)."""
    model, _ = _plain_model()
    dcp.save({"model": model.state_dict()}, storage_writer=LazyStorageWriter(tmp_path), no_dist=True)
    meta = tmp_path / ".metadata"
    raw = pickle.dumps(pickle.loads(meta.read_bytes()), protocol=2)    # GLOBAL opcodes: paths as text lines
    old_path = b"clazyckpt.integrations.dcp\nLazyStorageInfo\n"
    assert old_path in raw
    meta.write_bytes(raw.replace(old_path, b"clazyckpt.interop.dcp\nLazyStorageInfo\n"))
    assert ("lazyckpt.interop.dcp", "LazyStorageInfo") in _pickled_globals(meta.read_bytes())
    _load_and_compare(tmp_path, model)
    from lazyckpt.integrations.dcp import LazyStorageInfo
    infos = list(pickle.loads(meta.read_bytes()).storage_data.values())
    assert infos and all(type(v) is LazyStorageInfo for v in infos)


@pytest.mark.parametrize("use_async,file_format", [(False, "lazyckpt"), (True, "lazyckpt"), (True, "dcp")])
def test_a_dcp_checkpoint_on_s3_is_whole_on_the_store_and_loads_from_any_working_directory(
        tmp_path, monkeypatch, s3_server, s3_bucket, use_async, file_format):
    """Issue 35 (7): the data files and DCP's .metadata both go to the bucket (the
    metadata last: it is what makes the checkpoint exist), nothing is written under
    the working directory, and another working directory loads it bit-exact."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    options = {"endpoint_url": s3_server.endpoint, "access_key_id": s3_server.access_key,
               "secret_access_key": s3_server.secret_key, "region": s3_server.region}
    url = f"s3://{s3_bucket}/run/step1"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    model, opt = _plain_model()
    _train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    writer = LazyStorageWriter(url, storage_options=options, file_format=file_format)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 3}}
    if use_async:
        writer.attach(opt)
        dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result()
        writer.close()
    else:
        dcp.save(state, storage_writer=writer, no_dist=True)
    reference = _train(model, opt, 2, seed=100)
    assert os.listdir(first) == []                                # nothing written locally
    keys = sorted(o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert keys == ["run/step1/.metadata", "run/step1/__0.lzc" if file_format == "lazyckpt" else "run/step1/__0_0.distcp"]

    monkeypatch.chdir(second)
    model2, opt2 = _plain_model()
    msd2, osd2 = get_state_dict(model2, opt2)
    state2 = {"model": msd2, "optim": osd2, "extra": {"epoch": 0}}
    dcp.load(state2, storage_reader=LazyStorageReader(url, storage_options=options), no_dist=True)
    set_state_dict(model2, opt2, model_state_dict=state2["model"], optim_state_dict=state2["optim"])
    assert state2["extra"]["epoch"] == 3
    assert _train(model2, opt2, 2, seed=100) == reference


def test_a_dcp_checkpoint_on_s3_without_metadata_is_not_a_checkpoint(tmp_path, s3_server, s3_bucket):
    """A save that died before finish() left data objects only: loading names the
    missing commit instead of reading half a checkpoint."""
    options = {"endpoint_url": s3_server.endpoint, "access_key_id": s3_server.access_key,
               "secret_access_key": s3_server.secret_key, "region": s3_server.region}
    s3_server.client().put_object(Bucket=s3_bucket, Key="run/step2/__0.lzc", Body=b"half")
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="no committed DCP checkpoint"):
        LazyStorageReader(f"s3://{s3_bucket}/run/step2", storage_options=options).read_metadata()


def test_dcp_file_format_of_a_staged_state_holds_each_tensor_once(tmp_path):
    """dcp.async_save stages the state into one arena, so every item DCP hands the
    writer is a view of that arena, and torch.save writes a view's whole storage:
    each tensor's record must hold its own bytes only (the first torchtitan run
    wrote 24 GB for a 40 MB state)."""
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(64, 256) for i in range(24)}
    state["strided"] = torch.randn(64, 64)[:, ::2]
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values())
    writer = LazyStorageWriter(tmp_path, file_format="dcp")
    dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result()
    writer.close()
    size = os.path.getsize(tmp_path / "__0_0.distcp")
    assert size < tensor_bytes + 2 * 4096 * len(state), (size, tensor_bytes)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def _save_where_a_file_is(rank, world, directory, file_format):
    from torch.distributed.checkpoint.api import CheckpointException
    writer = LazyStorageWriter(os.path.join(directory, "a-file", "ckpt"), file_format=file_format)
    try:
        dcp.save({"w": torch.ones(8) * rank}, storage_writer=writer)
    except CheckpointException as exc:
        return {r: (type(e).__name__, str(e)) for r, (e, _) in exc.failures.items()}
    finally:
        writer.close()
    return None


@pytest.mark.parametrize("file_format", ["lazyckpt", "dcp"])
def test_a_failed_write_reaches_every_rank_as_the_error_itself(tmp_path, file_format):
    """DCP gathers each rank's error to every rank by pickling it: a lazyckpt error
    carrying its save's handle (locks) could not be pickled, and every rank saw
    "TypeError: cannot pickle '_thread.lock' object" instead of the cause (a
    full disk, in the first torchtitan run)."""
    (tmp_path / "a-file").write_text("not a directory")
    for got in run_ranks(2, _save_where_a_file_is, str(tmp_path), file_format):
        assert got is not None and set(got) == {0, 1}, got
        for name, message in got.values():
            assert name == "CheckpointWriteError" and "Not a directory" in message, (name, message)
