"""Errors that say what to do: the wrong inputs a new user gives, each
answered by the library's own error family (or TypeError/ValueError for a bad
argument) with a message naming the fix, never by an error from deep inside
torch, pickle, json or struct. One process, no server, no framework (the
cases that need the S3 server or Lightning: test_errors_actionable_integrations.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import lazyckpt
from lazyckpt.errors import CheckpointError
from lazyckpt.integrations.dcp import LazyStorageWriter


# --------------------------------------------------------------------------- DCP's default reader


def _dcp_failure(exc: CheckpointException) -> BaseException:
    (error, _trace), = exc.failures.values()
    return error


def _assert_names_the_reader(info: pytest.ExceptionInfo) -> None:
    error = _dcp_failure(info.value)
    assert isinstance(error, CheckpointError), repr(error)
    text = str(info.value)
    assert "lazyckpt.integrations.dcp.LazyStorageReader" in text, text
    assert 'file_format="dcp"' in text, text


def test_plain_dcp_load_of_a_lazyckpt_format_dcp_checkpoint_names_the_reader(tmp_path):
    """dcp.load with its default FileSystemReader of what LazyStorageWriter wrote in
    lazyckpt's format: the error names LazyStorageReader and file_format="dcp"
    instead of "'LazyStorageInfo' object has no attribute 'offset'"."""
    dcp.save({"w": torch.ones(4), "b": torch.zeros(2)}, storage_writer=LazyStorageWriter(tmp_path / "ck"),
             no_dist=True)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.empty(4), "b": torch.empty(2)}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    _assert_names_the_reader(info)
    # The readers that can read it still do.
    target = {"w": torch.empty(4), "b": torch.empty(2)}
    from lazyckpt.integrations.dcp import LazyStorageReader
    dcp.load(target, storage_reader=LazyStorageReader(tmp_path / "ck"), no_dist=True)
    assert target["w"].tolist() == [1.0] * 4


def test_plain_dcp_load_under_a_process_group_names_the_reader(tmp_path):
    """The same under a 1-process gloo group (DCP gathers each rank's error by pickling it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        dcp.save({"w": torch.ones(4)}, storage_writer=LazyStorageWriter(tmp_path / "ck"))
        with pytest.raises(CheckpointException) as info:
            dcp.load({"w": torch.empty(4)}, checkpoint_id=str(tmp_path / "ck"))
        _assert_names_the_reader(info)
    finally:
        dist.destroy_process_group()


def test_file_format_dcp_still_reads_with_plain_dcp_load(tmp_path):
    dcp.save({"w": torch.ones(4)}, storage_writer=LazyStorageWriter(tmp_path / "ck", file_format="dcp"),
             no_dist=True)
    target = {"w": torch.empty(4)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert target["w"].tolist() == [1.0] * 4


# --------------------------------------------------------------------------- the obvious wrong inputs


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "good.lzc"
    lazyckpt.save({"model": {"w": torch.ones(3, 4), "b": torch.zeros(4)}, "step": 3}, path)
    return path


def test_a_map_location_callable_returning_no_storage_is_the_callers_error_not_damage(saved):
    """It was reported as a corrupt entry ('int' object has no attribute 'nbytes')."""
    with pytest.raises(TypeError, match=r"map_location.*returned int.*storage") as info:
        lazyckpt.load(saved, map_location=lambda storage, location: 5)
    assert not isinstance(info.value, lazyckpt.CorruptCheckpointError)

    def fails(storage, location):
        raise RuntimeError("out of device memory")
    with pytest.raises(TypeError, match=r"map_location callable raised RuntimeError.*out of device memory") as info:
        lazyckpt.load(saved, map_location=fails)
    assert not isinstance(info.value, lazyckpt.CorruptCheckpointError)


@pytest.mark.parametrize("value,kind", [((i for i in range(3)), "generator"), (lambda: 1, "function")])
def test_a_value_that_cannot_be_saved_names_its_entry_and_what_to_do(tmp_path, value, kind):
    """It was "save failed: TypeError: cannot pickle 'generator' object": which entry, and what then?"""
    with pytest.raises(lazyckpt.CheckpointWriteError) as info:
        lazyckpt.save({"model": {"w": torch.ones(2)}, "extra": {"it": value}}, tmp_path / "x.lzc")
    text = str(info.value)
    assert "extra/it" in text and kind in text, text
    assert "remove it" in text.lower() and "tensors" in text, text
    assert not os.path.exists(tmp_path / "x.lzc")


def test_saving_to_a_directory_says_to_name_a_file_or_use_a_checkpointer(tmp_path, saved):
    """It was "save failed: IsADirectoryError: [Errno 21] Is a directory: '.x.tmp-...' -> 'x'"."""
    (tmp_path / "run").mkdir()
    with pytest.raises(lazyckpt.CheckpointError, match=r"is a directory.*lazyckpt\.Checkpointer") as info:
        lazyckpt.save({"w": torch.ones(2)}, tmp_path / "run")
    assert "tmp-" not in str(info.value)
    assert os.listdir(tmp_path / "run") == []


def test_a_checkpointer_on_a_file_says_it_is_a_file_and_how_to_read_it(saved):
    """It was "cannot create checkpoint directory: [Errno 20] Not a directory"."""
    with pytest.raises(lazyckpt.CheckpointError, match=r"is a file.*lazyckpt\.load"):
        lazyckpt.Checkpointer(saved)


@pytest.mark.parametrize("content", [b'{"a": 1}', b"hello\n", b"\x00" * 100])
def test_a_short_foreign_file_is_not_called_a_truncated_checkpoint(tmp_path, content):
    """A JSON or text file given to lazyckpt.load was "truncated file (8 bytes)"."""
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="not a lazyckpt file") as info:
        lazyckpt.load(path)
    assert "truncated" not in str(info.value)


def test_a_truncated_checkpoint_says_so_and_what_to_do(tmp_path, saved):
    data = saved.read_bytes()
    for cut in (10, 4096, len(data) - 40):
        path = tmp_path / f"cut{cut}.lzc"
        path.write_bytes(data[:cut])
        with pytest.raises(lazyckpt.CorruptCheckpointError, match=r"truncated.*(copy it again|earlier)"):
            lazyckpt.load(path)


def test_an_into_shape_mismatch_says_what_to_do(saved):
    with pytest.raises(lazyckpt.StateMismatchError, match=r"model/w.*\(3, 4\).*\(4, 3\).*(same|configuration)"):
        lazyckpt.load(saved, into={"model": {"w": torch.empty(4, 3), "b": torch.empty(4)}})


def test_lazy_storage_reader_given_a_lazyckpt_file_or_checkpointer_directory_says_what_reads_it(tmp_path, saved):
    """A .lzc file was "[Errno 20] Not a directory: '.../good.lzc/.metadata'"."""
    from lazyckpt.integrations.dcp import LazyStorageReader
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.empty(4)}, storage_reader=LazyStorageReader(saved), no_dist=True)
    assert "is a file, not a DCP checkpoint directory" in str(info.value) and "lazyckpt.load(" in str(info.value)
    with lazyckpt.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1).wait()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.empty(4)}, storage_reader=LazyStorageReader(tmp_path / "run"), no_dist=True)
    assert "Checkpointer directory" in str(info.value) and "lazyckpt.load(" in str(info.value)
