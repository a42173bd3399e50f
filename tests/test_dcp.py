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


def _fsdp_save(rank, world, directory, use_async):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _fsdp(world)
    for i in range(2):
        torch.manual_seed(i)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    writer = LazyStorageWriter(directory)
    if use_async:
        response = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer)
        response.upload_completion.result()
    else:
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    writer.close()
    return _full(msd)


def _fsdp_load(rank, world, directory):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _fsdp(world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=LazyStorageReader(directory))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(get_state_dict(model, opt)[0])


@pytest.mark.parametrize("use_async", [False, True])
def test_fsdp2_two_ranks_and_reshard_on_load(tmp_path, use_async):
    ref = run_ranks(2, _fsdp_save, str(tmp_path), use_async)[0]
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0.lzc", "__1.lzc"]
    for world in ((2, 3) if not use_async else (1,)):
        for got in run_ranks(world, _fsdp_load, str(tmp_path)):
            assert all(torch.equal(ref[k], got[k]) for k in ref), f"2 -> {world} ranks"


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
    """Issue 23 moved LazyStorageInfo to lazyckpt.interop.dcp; lazyckpt before the move
    can unpickle it only as lazyckpt.integrations.dcp.LazyStorageInfo (its allow-list,
    and it has no lazyckpt.interop). New .metadata keeps naming that path, and loads:
    with lazyckpt's reader, the command line's converter, plain pickle (DCP's own
    readers) and the allow-list of lazyckpt before the move."""
    from lazyckpt.integrations.dcp import LazyStorageInfo
    from lazyckpt.interop import dcp as interop_dcp
    assert LazyStorageInfo is interop_dcp.LazyStorageInfo
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
    pickle path name lazyckpt.interop.dcp.LazyStorageInfo: they load too."""
    model, _ = _plain_model()
    dcp.save({"model": model.state_dict()}, storage_writer=LazyStorageWriter(tmp_path), no_dist=True)
    meta = tmp_path / ".metadata"
    raw = pickle.dumps(pickle.loads(meta.read_bytes()), protocol=2)    # GLOBAL opcodes: paths as text lines
    old_path = b"clazyckpt.integrations.dcp\nLazyStorageInfo\n"
    assert old_path in raw
    meta.write_bytes(raw.replace(old_path, b"clazyckpt.interop.dcp\nLazyStorageInfo\n"))
    assert ("lazyckpt.interop.dcp", "LazyStorageInfo") in _pickled_globals(meta.read_bytes())
    _load_and_compare(tmp_path, model)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_dcp_checkpoint_on_s3_is_whole_on_the_store_and_loads_from_any_working_directory(
        tmp_path, monkeypatch, s3_server, s3_bucket, use_async):
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
    writer = LazyStorageWriter(url, storage_options=options)
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
    assert keys == ["run/step1/.metadata", "run/step1/__0.lzc"]

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
