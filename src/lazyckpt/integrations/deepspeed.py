"""DeepSpeed: a decoupled ``CheckpointEngine`` that saves lazily.

``engine.save_checkpoint(dir, tag)`` returns as soon as every file's state
has been walked (no data copied); the bytes are captured and written in the
background while the next forward/backward runs. The consistency barrier is
hooked where DeepSpeed steps: DeepSpeed 0.19 calls
``checkpoint_engine.get_commit_info()`` at each gradient-accumulation boundary
right before ``_take_model_step`` (for decoupled engines), and this engine
waits there until every pending capture is done. The ``latest`` file is
written by this engine, by the coordinator, only after every rank's files are
durable (store-based agreement, as in :mod:`lazyckpt.distributed`); DeepSpeed
itself never writes it for a decoupled engine that reports no commit info, so
``latest`` can never name a checkpoint that is not on disk.

DeepSpeed has no config key for a custom engine class, so enable it with one
call after ``deepspeed.initialize``::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    lazyckpt.integrations.deepspeed.enable(engine, host_cache_bytes=1 << 30)
    ...
    engine.save_checkpoint(save_dir)          # returns quickly
    engine.load_checkpoint(save_dir)          # reads lazyckpt files (and torch.save ones)
    lazyckpt.integrations.deepspeed.wait(engine)   # optional: everything durable now

Files keep DeepSpeed's names (``mp_rank_00_model_states.pt`` ...) but hold
lazyckpt's format. DeepSpeed's checkpoints contain pickled objects (the loss
scaler, its config); they load with ``allow_pickle=True``, the engine's
default, since these are files this engine wrote for you -- pass
``allow_pickle=False`` to refuse them.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, List, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from ..distributed import rank_info
from ..errors import CheckpointError, CheckpointWriteError
from ..fileio import write_file_atomic
from ..knobs import resolve
from ._async import AsyncFileWriter, PendingFile, is_lazyckpt_file

log = logging.getLogger("lazyckpt.deepspeed")


class _Group:
    """The files of one ``save_checkpoint`` call (one tag)."""

    def __init__(self, info: CheckpointCommitInfo, seq: int):
        self.info, self.seq = info, seq
        self.files: List[PendingFile] = []
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.started = time.perf_counter()


class LazyCheckpointEngine(CheckpointEngine):
    """Asynchronous, decoupled DeepSpeed checkpoint engine backed by lazyckpt."""

    def __init__(self, config_params: Any = None, *, allow_pickle: bool = True,
                 commit_timeout_s: float = 600.0, **knobs: Any):
        super().__init__(config_params)
        self.name = "LazyCheckpointEngine"
        self.allow_pickle = allow_pickle
        self.options = resolve(None, **knobs)
        # Files are written by the shared single-file writer (its optimizer and
        # buffer-owning-module pre-hooks also guard the capture); this engine
        # adds the per-tag commit across ranks and the `latest` file.
        self._writer = AsyncFileWriter(options=self.options)
        self._dist = rank_info("lazyckpt-deepspeed", None, commit_timeout_s)
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._errors: List[BaseException] = []
        self._group: Optional[_Group] = None
        self._groups: List[_Group] = []
        self._seq = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lazyckpt-deepspeed", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ DeepSpeed API

    def create(self, info: CheckpointCommitInfo) -> None:
        self._raise_errors()
        self._seal()
        self._seq += 1
        self._group = _Group(info, self._seq)

    def save(self, state_dict: Any, path: str) -> None:
        self._raise_errors()
        if self._group is None:             # a save outside save_checkpoint (e.g. save_16bit_model)
            self.create(CheckpointCommitInfo(tag="", save_dir=os.path.dirname(os.fspath(path)),
                                             save_latest=False))
        self._group.files.append(self._writer.save(state_dict, path))

    def load(self, path: str, map_location: Any = None) -> Any:
        if is_lazyckpt_file(path):
            return self._writer.load(path, map_location=map_location, allow_pickle=self.allow_pickle)
        # A checkpoint written by DeepSpeed's own engine (torch.save): keep loading it.
        return torch.load(path, map_location=map_location, weights_only=not self.allow_pickle)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Block until the checkpoint of ``info`` is committed (not called by
        DeepSpeed's step path, which gets no commit info from this engine)."""
        self._seal()
        for group in list(self._groups):
            if group.info == info:
                group.done.wait()
                if group.error is not None:
                    with self._cond:        # raised here: not again at the next call
                        if group.error in self._errors:
                            self._errors.remove(group.error)
                    raise group.error
        return True

    def get_commit_info(self) -> None:
        """Called by DeepSpeed before each optimizer step: the consistency barrier.

        Waits until every pending capture has copied its data (so the step may
        update the tensors), hands the current checkpoint to the background
        commit, and returns None so that DeepSpeed does not write ``latest``
        itself (this engine writes it once the checkpoint is durable).
        """
        self.wait_for_snapshot()
        self._seal()
        return None

    def is_decoupled(self) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        # False: DeepSpeed then does not clone tensors before save() -- a clone on
        # the training thread is exactly the stall lazy capture removes. lazyckpt
        # writes each storage once and keeps views of it as views.
        return False

    def cleanup(self) -> None:
        """Drain: every pending checkpoint committed (or its error raised)."""
        self._seal()
        self.wait()

    # ------------------------------------------------------------------ extras

    def wait_for_snapshot(self) -> None:
        self._writer.wait_for_snapshot()
        self._raise_errors()

    def wait(self) -> None:
        """Block until every checkpoint handed over so far is committed and durable."""
        self._seal()
        for group in list(self._groups):
            group.done.wait()
        self._raise_errors()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.cleanup()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join()
            self._writer.close(raise_errors=False)

    # ------------------------------------------------------------------ background

    def _seal(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        with self._cond:
            self._groups = [g for g in self._groups if not g.done.is_set()] + [group]
            self._queue.append(("commit", group))
            self._cond.notify_all()

    def _raise_errors(self) -> None:
        with self._cond:
            if not self._errors:
                return
            error = self._errors.pop(0)
        raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                _, group = self._queue.popleft()
            self._commit_group(group)

    def _commit_group(self, group: _Group) -> None:
        d = self._dist
        try:
            for f in group.files:
                f.done.wait()
            failed = [f for f in group.files if f.error is not None]
            for f in failed:
                f.reported = True           # reported through this group's error, once
            local_error = (f"{failed[0].path}: {type(failed[0].error).__name__}: {failed[0].error}"
                           if failed else None)
            if d.distributed:
                d.publish(f"ds/{group.seq}/done/{d.rank}", {"ok": local_error is None, "error": local_error})
                if d.coordinator:
                    keys = [f"ds/{group.seq}/done/{r}" for r in range(d.world_size)]
                    values = d.wait_for(keys, "every rank's files", group.seq)
                    errors = {k: v["error"] for k, v in values.items() if not v["ok"]}
                    outcome = {"ok": not errors, "error": str(errors) if errors else None}
                    if not errors and group.info.save_latest:
                        self._write_latest(group.info)
                    d.publish(f"ds/{group.seq}/outcome", outcome)
                    d.delete(keys)
                else:
                    outcome = d.wait_for([f"ds/{group.seq}/outcome"], "the coordinator's commit",
                                         group.seq)[f"ds/{group.seq}/outcome"]
                if not outcome["ok"]:
                    raise CheckpointError(f"checkpoint {group.info.tag!r} not committed: {outcome['error']}")
            else:
                if local_error:
                    raise CheckpointError(local_error)
                if group.info.save_latest:
                    self._write_latest(group.info)
            log.info("lazyckpt: DeepSpeed checkpoint %r durable (%d files, %.1f MB) after %.2f s",
                     group.info.tag, len(group.files), sum(f.bytes for f in group.files) / 1e6,
                     time.perf_counter() - group.started)
        except BaseException as exc:
            error = CheckpointWriteError(f"DeepSpeed checkpoint {group.info.tag!r} in {group.info.save_dir} "
                                         f"failed: {type(exc).__name__}: {exc}", path=group.info.save_dir)
            error.__cause__ = exc
            group.error = error
            with self._cond:
                self._errors.append(error)
            log.error("lazyckpt: %s", error)
        finally:
            group.done.set()

    def _write_latest(self, info: CheckpointCommitInfo) -> None:
        write_file_atomic(os.path.join(info.save_dir, "latest"), str(info.tag).encode())


def enable(engine: Any, **kwargs: Any) -> LazyCheckpointEngine:
    """Make ``engine`` (a ``deepspeed.DeepSpeedEngine``) save and load through lazyckpt.

    Collective: call it on every rank, after ``deepspeed.initialize``.
    Keyword arguments go to :class:`LazyCheckpointEngine` (``host_cache_bytes``,
    ``writer_threads``, ``allow_pickle``, ``commit_timeout_s`` ...).
    """
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, LazyCheckpointEngine):
        return old
    new = LazyCheckpointEngine(getattr(engine, "_config", None), **kwargs)
    engine.checkpoint_engine = new
    return new


def wait(engine: Any) -> None:
    """Block until every checkpoint ``engine`` saved is committed and durable."""
    ckpt = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ckpt, LazyCheckpointEngine):
        raise CheckpointError("this DeepSpeed engine does not use lazyckpt; call enable(engine) first")
    ckpt.wait()
