"""Load options as one typed value: LoadRequest is checked once where a load
is called, and every public load lists exactly its fields."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import lazyckpt
from lazyckpt.integrations._async import AsyncFileWriter
from lazyckpt.loading.request import LoadRequest

PUBLIC_LOADS = {
    "lazyckpt.load": lazyckpt.load,
    "lazyckpt.load_async": lazyckpt.load_async,
    "Checkpointer.load": lazyckpt.Checkpointer.load,
    "Checkpointer.load_async": lazyckpt.Checkpointer.load_async,
    "AsyncFileWriter.load": AsyncFileWriter.load,
}


@pytest.mark.parametrize("name", list(PUBLIC_LOADS))
def test_public_load_parameters_are_load_request_fields(name):
    params = [p for p in inspect.signature(PUBLIC_LOADS[name]).parameters.values() if p.name != "self"]
    fields = dataclasses.fields(LoadRequest)
    # First what is loaded (path or step), then the request's fields, in order, with its defaults.
    got = [(p.name, p.default) for p in params[1:1 + len(fields)]]
    assert got == [(f.name, f.default) for f in fields], name
    rest = {p.name for p in params[1 + len(fields):]}
    assert not rest & {f.name for f in fields}
    assert rest <= {"options", "knobs"}, rest


def test_keys_normalized_once():
    assert LoadRequest(keys="model").keys == (("model",),)
    assert LoadRequest(keys=("optim", "state", 0)).keys == (("optim", "state", 0),)
    assert LoadRequest(keys=["model", ("optim", "state")]).keys == (("model",), ("optim", "state"))
    assert LoadRequest(keys=iter(["a", "b"])).keys == (("a",), ("b",))
    assert LoadRequest(keys=[]).keys == ()
    assert LoadRequest().keys is None


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(keys=5), TypeError, "keys must be"),
    (dict(keys=["model", ["optim", "state"]]), TypeError, "is a tuple"),
    (dict(keys=[()]), ValueError, "empty key path"),
    (dict(keys=[("a", {})]), TypeError, "unhashable"),
    (dict(map_location="gpu0"), ValueError, "'cuda:0'"),
    (dict(map_location={"cuda:0": 3.5}), TypeError, "maps saved location"),
    (dict(map_location={"cuda:1": "nonsense"}), ValueError, "not a device"),
    (dict(map_location=3.5), TypeError, "map_location must be"),
    (dict(allow_pickle="false"), TypeError, "True or False"),
    (dict(strict=None), TypeError, "True or False"),
    (dict(into=torch.nn.Linear(2, 2)), TypeError, "state_dict()"),
])
def test_wrong_arguments_refused_at_construction(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        LoadRequest(**kwargs)


@pytest.mark.parametrize("good", [None, "cpu", "meta", torch.device("cpu"), {"cuda:0": "cpu"},
                                  {"cpu": torch.device("cpu")}, lambda storage, location: storage])
def test_map_location_forms_accepted(good):
    assert LoadRequest(map_location=good).map_location is good


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LoadRequest().strict = False


def test_bad_arguments_refused_before_the_load_starts(tmp_path):
    """load_async refuses bad arguments at the call, not at the barrier, and
    Checkpointer.load before it looks at any step."""
    lazyckpt.save({"a": torch.ones(2)}, tmp_path / "m.lzc")
    with pytest.raises(TypeError, match="True or False"):
        lazyckpt.load_async(tmp_path / "m.lzc", allow_pickle="yes")
    with pytest.raises(ValueError, match="not a device"):
        lazyckpt.load(tmp_path / "m.lzc", map_location="cpu0")
    with lazyckpt.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save({"a": torch.ones(2)}, step=1).wait()
        with pytest.raises(TypeError, match="keys must be"):
            ckpt.load_async(keys=1)
        assert ckpt.load_async(keys="a").wait()["a"].tolist() == [1.0, 1.0]
        assert ckpt.load(keys=["a"])["a"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("load", [lazyckpt.load, lazyckpt.load_async])
def test_a_misspelled_load_parameter_names_the_right_one(tmp_path, load):
    """It was "unknown options: ['mapp_location']" (read as an option of the I/O)."""
    lazyckpt.save({"a": torch.ones(2)}, tmp_path / "m.lzc")
    with pytest.raises(TypeError, match="did you mean map_location="):
        load(tmp_path / "m.lzc", mapp_location="cpu")
    with pytest.raises(TypeError, match="did you mean allow_pickle="):
        load(tmp_path / "m.lzc", allow_pickles=True)


def test_a_load_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    """A load holds the cyclic collector off until its reads are submitted:
    after it, ended or failed, the collector is on again, or still off where
    the caller had turned it off."""
    import gc
    path = str(tmp_path / "s.lzc")
    lazyckpt.save({f"t{i}": torch.full((3,), float(i)) for i in range(50)}, path)
    assert gc.isenabled()
    try:
        assert lazyckpt.load(path)["t7"][0] == 7
        assert gc.isenabled()
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            lazyckpt.load(str(tmp_path / "missing.lzc"))
        assert gc.isenabled()
        damaged = str(tmp_path / "damaged.lzc")
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[-100] ^= 0xFF                      # inside the footer: its checksum fails
        with open(damaged, "wb") as f:
            f.write(data)
        with pytest.raises(lazyckpt.CorruptCheckpointError):
            lazyckpt.load(damaged)
        assert gc.isenabled()
        gc.disable()
        try:
            assert lazyckpt.load(path)["t3"][0] == 3
            assert not gc.isenabled()
        finally:
            gc.enable()
        handles = [lazyckpt.load_async(path) for _ in range(4)]   # holds that overlap
        assert all(h.wait()["t9"][0] == 9 for h in handles)
        assert gc.isenabled()
    finally:
        gc.enable()
