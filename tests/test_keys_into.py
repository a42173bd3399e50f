"""Partial loads (keys=), in-place loads (into=) and map_location."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import lazyckpt
import lazyckpt.storage.fileio
from lzc_tools import assert_same, entry_by_name, parse


def training_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 12,
            "extra": {"big": torch.randn(20_000), "note": "hello"}}


@pytest.fixture
def saved(tmp_path):
    state = training_state()
    path = tmp_path / "train.lzc"
    lazyckpt.save(state, path, chunk_bytes=8192, host_cache_bytes=32768)
    return path, state


# --------------------------------------------------------------------------- keys=


def test_top_level_string_keys(saved):
    path, state = saved
    out = lazyckpt.load(path, keys=["step", "model"])
    assert set(out) == {"model", "step"}
    assert_same(state["model"], out["model"])
    assert type(out["model"]) is collections.OrderedDict and out["step"] == 12
    assert lazyckpt.load(path, keys="step") == {"step": 12}


def test_tuple_paths_with_int_keys(saved):
    path, state = saved
    out = lazyckpt.load(path, keys=[("optim", "state", 0, "exp_avg"), ("extra", "note"), ("model", "2.bias")])
    assert set(out) == {"model", "optim", "extra"}
    assert list(out["optim"]) == ["state"] and list(out["optim"]["state"]) == [0]
    assert list(out["optim"]["state"][0]) == ["exp_avg"]
    assert torch.equal(out["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert out["extra"] == {"note": "hello"}
    assert list(out["model"]) == ["2.bias"] and torch.equal(out["model"]["2.bias"], state["model"]["2.bias"])
    # A single tuple is one path.
    single = lazyckpt.load(path, keys=("optim", "param_groups"))
    assert single["optim"]["param_groups"] == state["optim"]["param_groups"]


def test_overlapping_paths(saved):
    path, state = saved
    out = lazyckpt.load(path, keys=[("extra",), ("extra", "note")])
    assert out["extra"]["note"] == "hello" and torch.equal(out["extra"]["big"], state["extra"]["big"])


def _corrupt_entry_bytes(path, name):
    e = entry_by_name(parse(path).doc, name)
    with open(path, "r+b") as f:
        f.seek(e["offset"])
        f.write(os.urandom(e["length"]))
    return e


def test_partial_load_ignores_damage_elsewhere(saved):
    path, state = saved
    _corrupt_entry_bytes(path, "extra/big")
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="extra/big"):
        lazyckpt.load(path)
    out = lazyckpt.load(path, keys=["model", "optim", ("extra", "note")])
    assert_same(state["model"], out["model"])
    assert_same(state["optim"], out["optim"])


def test_partial_load_reads_only_the_selected_bytes(saved, monkeypatch):
    path, _ = saved
    doc = parse(path).doc
    big = entry_by_name(doc, "extra/big")
    wanted = entry_by_name(doc, "model/0.weight")
    reads = []
    real_preadv, real_pread = os.preadv, os.pread

    def recording_preadv(fd, buffers, offset, *args):
        n = real_preadv(fd, buffers, offset, *args)
        reads.append((offset, n))
        return n

    def recording_pread(fd, length, offset):
        data = real_pread(fd, length, offset)
        reads.append((offset, len(data)))
        return data

    monkeypatch.setattr(lazyckpt.storage.fileio.os, "preadv", recording_preadv)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "pread", recording_pread)
    out = lazyckpt.load(path, keys=[("model", "0.weight")])
    assert out["model"]["0.weight"].shape == (16, 8)
    assert reads, "no data read at all?"
    assert any(o <= wanted["offset"] < o + n for o, n in reads)
    big_lo, big_hi = big["offset"], big["offset"] + big["length"]
    for o, n in reads:
        assert o + n <= big_lo or o >= big_hi, f"read [{o}, {o + n}) overlaps the unselected entry"
    total = sum(n for _, n in reads)
    assert total < 64 * 1024 < big["length"]


def test_missing_keys(saved):
    path, _ = saved
    with pytest.raises(lazyckpt.MissingKeyError) as info:
        lazyckpt.load(path, keys=["nope"])
    assert isinstance(info.value, KeyError) and isinstance(info.value, lazyckpt.CheckpointError)
    assert "nope" in str(info.value)
    with pytest.raises(lazyckpt.MissingKeyError, match="zzz"):
        lazyckpt.load(path, keys=[("model", "zzz")])
    with pytest.raises(lazyckpt.MissingKeyError):
        lazyckpt.load(path, keys=[("optim", "state", 99)])
    with pytest.raises(lazyckpt.MissingKeyError):
        lazyckpt.load(path, keys=[("step", "inside_an_int")])
    with pytest.raises(lazyckpt.MissingKeyError):
        lazyckpt.load(path, keys=["step", "missing_too"])
    with pytest.raises(lazyckpt.MissingKeyError):       # "0" is not 0
        lazyckpt.load(path, keys=[("optim", "state", "0")])


# --------------------------------------------------------------------------- into=


def test_into_fills_a_state_dict_in_place(saved):
    path, state = saved
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params_before = {n: p for n, p in model.named_parameters()}
    target = model.state_dict()
    before = {k: (v, v.data_ptr()) for k, v in target.items()}
    result = lazyckpt.load(path, keys=["model"], into={"model": target})
    assert result["model"] is target
    for k, (tensor, ptr) in before.items():
        assert target[k] is tensor and tensor.data_ptr() == ptr
        assert torch.equal(tensor, state["model"][k])
    # The model's own parameters were updated (state_dict tensors share their memory).
    for name, p in model.named_parameters():
        assert p is params_before[name] and type(p) is torch.nn.Parameter and p.requires_grad
        assert torch.equal(p.detach(), state["model"][name])


def test_into_nested_optimizer_state_and_scalars(saved):
    path, state = saved
    target = {"optim": {"state": {i: {k: torch.zeros_like(v) for k, v in s.items()}
                                  for i, s in state["optim"]["state"].items()},
                        "param_groups": [{"lr": 0.0}]},
              "step": 0, "untouched": "keep me"}
    objs = {(i, k): v for i, s in target["optim"]["state"].items() for k, v in s.items()}
    out = lazyckpt.load(path, into=target)
    assert out is target
    for (i, k), v in objs.items():
        assert target["optim"]["state"][i][k] is v
        assert torch.equal(v, state["optim"]["state"][i][k])
    assert target["step"] == 12 and target["untouched"] == "keep me"
    assert target["optim"]["param_groups"][0]["lr"] == state["optim"]["param_groups"][0]["lr"]
    assert torch.equal(target["extra"]["big"], state["extra"]["big"])      # absent keys are added


def test_into_parameters_directly(tmp_path):
    src = {"w": torch.nn.Parameter(torch.randn(3, 3)), "b": torch.arange(3.0)}
    lazyckpt.save(src, tmp_path / "p.lzc")
    dst = {"w": torch.nn.Parameter(torch.zeros(3, 3)), "b": torch.zeros(3)}
    w, b = dst["w"], dst["b"]
    lazyckpt.load(tmp_path / "p.lzc", into=dst)
    assert dst["w"] is w and type(w) is torch.nn.Parameter and w.requires_grad and w.grad is None
    assert torch.equal(w.detach(), src["w"].detach()) and dst["b"] is b and torch.equal(b, src["b"])


@pytest.mark.parametrize("bad", [torch.zeros(16, 9), torch.zeros(16), torch.zeros(8, 16),
                                 torch.zeros(16, 8, dtype=torch.float64)],
                         ids=["shape", "rank", "transposed", "dtype"])
def test_into_mismatch(saved, bad):
    path, _ = saved
    target = {"model": {"0.weight": bad}}
    original = bad.clone()
    with pytest.raises(lazyckpt.StateMismatchError) as info:
        lazyckpt.load(path, keys=["model"], into=target)
    assert "0.weight" in str(info.value) and isinstance(info.value, lazyckpt.CheckpointError)
    assert torch.equal(bad, original)


# --------------------------------------------------------------------------- map_location


MAP_LOCATIONS = {
    "none": None, "str": "cpu", "device": torch.device("cpu"), "dict": {"cpu": "cpu"},
    "callable": lambda storage, location: storage,
    "callable-none": lambda storage, location: None,
}


@pytest.mark.parametrize("map_location", list(MAP_LOCATIONS.values()), ids=list(MAP_LOCATIONS))
def test_map_location_forms(saved, map_location):
    path, state = saved
    out = lazyckpt.load(path, map_location=map_location)
    assert_same(state, out)
    assert all(t.device.type == "cpu" for t in out["model"].values())


def test_map_location_callable_sees_storage_and_location(tmp_path):
    base = torch.arange(6.0)
    lazyckpt.save({"a": base, "view": base[2:], "b": torch.ones(2)}, tmp_path / "m.lzc")
    calls = []

    def mapper(storage, location):
        calls.append((type(storage), location))
        return storage
    out = lazyckpt.load(tmp_path / "m.lzc", map_location=mapper)
    assert calls == [(torch.UntypedStorage, "cpu")] * 2          # once per storage, not per tensor
    assert out["view"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()


def test_map_location_to_meta(tmp_path):
    lazyckpt.save({"a": torch.arange(4.0).reshape(2, 2)}, tmp_path / "m.lzc")
    out = lazyckpt.load(tmp_path / "m.lzc", map_location="meta")
    assert out["a"].device.type == "meta" and out["a"].shape == (2, 2) and out["a"].dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure mode")
def test_map_location_to_cuda_without_cuda(tmp_path):
    lazyckpt.save({"a": torch.ones(2)}, tmp_path / "m.lzc")
    with pytest.raises(lazyckpt.CheckpointError, match="(?i)cuda"):
        lazyckpt.load(tmp_path / "m.lzc", map_location="cuda")


# --------------------------------------------------------------------------- into= through reused buffers


def _count_buffers(monkeypatch):
    """Bytes of every read buffer the reader allocates from here on."""
    import lazyckpt.loading.reader as reader
    sizes = []
    real = reader.read_buffer

    def counting(nbytes, remote=False):
        sizes.append(nbytes)
        return real(nbytes, remote)
    monkeypatch.setattr(reader, "read_buffer", counting)
    return sizes


def test_into_reads_through_a_bounded_set_of_reused_buffers(tmp_path, monkeypatch):
    """Entries copied into into= as they arrive are read into buffers reused
    from run to run: the memory allocated for reading stays within two chunks
    per reader however large the state, where a plain load allocates it all."""
    state = {f"t{i}": torch.randn(16_384) for i in range(40)}          # 64 KiB each, 2.5 MiB in all
    path = tmp_path / "s.lzc"
    lazyckpt.save(state, path)
    knobs = dict(chunk_bytes=128 << 10, reader_threads=2)
    sizes = _count_buffers(monkeypatch)
    lazyckpt.load(path, **knobs)
    assert sum(sizes) >= 40 * 65536
    sizes.clear()
    into = {k: torch.zeros(16_384) for k in state}
    assert lazyckpt.load(path, into=into, **knobs) is into
    assert all(torch.equal(into[k], state[k]) for k in state)
    assert 0 < sum(sizes) <= 2 * 2 * (128 << 10), sizes


def test_an_entry_that_into_fills_and_another_tensor_views_is_not_reused(tmp_path):
    """A storage shared by a tensor into= fills and a view into= does not hold
    must still be there when the view is built after the read."""
    base = torch.arange(50_000, dtype=torch.float32)
    state = {"w": base, "head": base[:100], **{f"t{i}": torch.randn(20_000) for i in range(6)}}
    path = tmp_path / "s.lzc"
    lazyckpt.save(state, path, chunk_bytes=64 << 10)
    into = {k: torch.zeros_like(v) for k, v in state.items() if k != "head"}
    out = lazyckpt.load(path, into=into, chunk_bytes=64 << 10, reader_threads=1, strict=False)
    assert torch.equal(out["w"], base) and torch.equal(out["head"], base[:100])
    assert all(torch.equal(out[f"t{i}"], state[f"t{i}"]) for i in range(6))


@pytest.mark.timeout(60)
def test_a_damaged_block_fails_a_load_into_waiting_for_a_reused_buffer(tmp_path):
    """One reader, buffers for a few runs only, a damaged block in the first
    run: the runs waiting for a buffer are not started, the load raises (no
    hang), and each tensor holds its old value or its checkpoint value."""
    state = {f"t{i}": torch.full((40_000,), float(i)) for i in range(24)}
    path = tmp_path / "s.lzc"
    lazyckpt.save(state, path, chunk_bytes=64 << 10)
    first = entry_by_name(parse(path).doc, "t0")
    with open(path, "r+b") as f:
        f.seek(first["offset"] + 1000)
        f.write(b"\x00\x01\x02\x03")
    into = {k: torch.full((40_000,), -1.0) for k in state}
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="checksum"):
        lazyckpt.load(path, into=into, chunk_bytes=64 << 10, reader_threads=1)
    assert torch.equal(into["t0"], torch.full((40_000,), -1.0))
    for k, t in into.items():
        assert torch.equal(t, state[k]) or torch.equal(t, torch.full((40_000,), -1.0)), k


def test_into_byte_copies_and_the_decoded_fills_agree(tmp_path):
    """Contiguous CPU tensors are filled by a copy of the entry's bytes; a
    non-contiguous target, a saved view with an offset and a tensor subclass
    go through the decode: all end equal to the saved values, and autograd
    sees each target written (its version moves, as with copy_)."""
    base = torch.randn(64, 32)
    state = {"plain": torch.randn(1000), "bf16": torch.randn(300, 7).to(torch.bfloat16),
             "view": base[5:9], "transposed": torch.randn(16, 24), "empty": torch.zeros(0, 3),
             "param": torch.nn.Parameter(torch.randn(12, 12))}
    path = tmp_path / "mixed.lzc"
    lazyckpt.save(state, path)
    into = {"plain": torch.zeros(1000), "bf16": torch.zeros(300, 7, dtype=torch.bfloat16),
            "view": torch.zeros(4, 32), "transposed": torch.zeros(24, 16).t(), "empty": torch.zeros(0, 3),
            "param": torch.nn.Parameter(torch.zeros(12, 12))}
    versions = {k: v._version for k, v in into.items()}
    got = lazyckpt.load(path, into=into)
    assert got is into
    for k in state:
        assert torch.equal(into[k].detach(), state[k].detach()), k
    assert into["param"].requires_grad and type(into["param"]) is torch.nn.Parameter
    assert all(into[k]._version > versions[k] for k in into if into[k].numel()), \
        {k: (versions[k], into[k]._version) for k in into}


def test_into_byte_copy_refuses_a_short_entry(tmp_path):
    """An entry shorter than its tensor (a damaged footer) is not copied
    past its end: the decode reports the file corrupt."""
    path = tmp_path / "s.lzc"
    lazyckpt.save({"t": torch.randn(1000)}, path)
    from lazyckpt.loading import into as into_mod
    data = torch.UntypedStorage(100)
    target = torch.zeros(1000)
    plan = into_mod.byte_copy_plan([({"shape": [1000], "stride": [1], "offset": 0}, target)])
    assert plan is not None and not into_mod.copy_bytes(data, plan)
    assert torch.equal(target, torch.zeros(1000))
