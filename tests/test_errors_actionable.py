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
