"""Focused reproducers of what the model-based test (tests/_model.py) found while
issue 33 item 5 was added (its faults, knobs and rules)."""

from __future__ import annotations

import os

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointNotFoundError


def test_a_step_pruned_right_after_the_reader_saw_it_is_not_found(tmp_path, monkeypatch):
    """soak_model.py --seed 23 --faults, incFalse-local-rep0-auto-2r program-seed 814293600: a
    reader of every listed step during `lazyckpt prune --keep 1` got a plain CheckpointError
    "step_0000000003: not a regular file or directory": the step directory was renamed to
    .deleting-* between locate()'s exists() and its isdir(). A step deleted under a reader
    is CheckpointNotFoundError (the prune rule's contract), never another error."""
    from lazyckpt.storage import localstore
    with lazyckpt.Checkpointer(str(tmp_path), keep=None) as ck:
        ck.save({"w": torch.ones(4)}, 1).wait()
        ck.save({"w": torch.ones(4) * 2}, 2).wait()
        path = ck.step_path(1)
    real_stat, moved = os.stat, []

    def stat_then_pruned(p, *args, **kwargs):
        found = real_stat(p, *args, **kwargs)
        if p == path and not moved:         # prune's rename lands right after the reader's first look
            os.rename(path, os.path.join(str(tmp_path), ".deleting-step_0000000001-model"))
            moved.append(p)
        return found
    monkeypatch.setattr(localstore.os, "stat", stat_then_pruned)
    with pytest.raises(CheckpointNotFoundError):
        lazyckpt.load(path)
    assert moved
