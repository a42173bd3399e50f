"""Megatron-Core's ``dist_checkpointing`` saves written by lazyckpt (megatron-core 0.19).

:class:`LazySaveStrategy` is a ``TorchDistSaveShardedStrategy`` (Megatron 0.19 has no
strategy registry: ``dist_checkpointing.save`` replaces any other kind of
strategy with its own). Megatron keeps translating its ``ShardedTensor`` /
``ShardedObject`` state into DCP and planning the save (``MCoreSavePlanner``,
the same collectives as its own save); lazyckpt moves the bytes:

* ``async_save`` returns once the plan is agreed, **before** a byte of a tensor
  is copied: the copy into a reused, page-aligned (pinned under CUDA) staging
  buffer runs on lazyckpt's save engine while the next forward/backward runs,
  and every optimizer's ``step()`` waits for it first (a global step pre-hook:
  Megatron's optimizers wrap torch optimizers, whose steps are the only
  in-place change of the saved state during an iteration).
* The write runs on a thread of the training process through lazyckpt's
  writers (several threads, O_DIRECT where the file system allows it), each
  rank's file fsynced, in DCP's own layout: ``__<rank>_0.distcp`` +
  ``.metadata``, committed last by the coordinator through a rename, then
  Megatron's ``metadata.json``. Plain Megatron (``TorchDistLoadShardedStrategy``)
  loads it without lazyckpt.
* The returned ``AsyncRequest`` is Megatron's own: ``AsyncCallsQueue`` schedules
  it and finalizes it as usual. Its ``async_fn`` is a small function that only
  waits (in the process Megatron's caller starts) for this rank's write to be
  durable, so Megatron's "is the save done on all ranks" check keeps its
  meaning; ``finalize_fns`` gather the write results and commit.

Usage with ``dist_checkpointing``::

    from lazyckpt.integrations.megatron import LazySaveStrategy
    strategy = LazySaveStrategy()                         # one per run: its buffers are reused
    request = dist_checkpointing.save(sharded_sd, ckpt_dir, strategy,
                                      async_sharded_save=True, async_strategy="mcore")
    queue.schedule_async_request(request)                 # megatron's AsyncCallsQueue
    ...
    queue.maybe_finalize_async_calls(blocking=False)      # commits what is durable everywhere

With Megatron-LM's trainer (``megatron.training``), call :func:`install` once
before training: its checkpointing then builds :class:`LazySaveStrategy` where
it built ``TorchDistSaveShardedStrategy`` (``--ckpt-format torch_dist``; with
``--async-save``, use ``--async-strategy mcore`` unless nvidia-resiliency-ext
is installed). ``latest_checkpointed_iteration.txt`` is still written by
Megatron's finalize, after the commit.

:class:`LazyLoadStrategy` reads the same directories (lazyckpt's or Megatron's)
with lazyckpt's DCP reader: every record's span and CRC-32 checked, DCP's
metadata unpickled with an allow-list.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import functools
import os
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (save_state_dict_async_finalize,
                                                                          save_state_dict_async_plan)
from megatron.core.dist_checkpointing.strategies.torch import (MCoreLoadPlanner, MCoreSavePlanner,
                                                               TorchDistLoadShardedStrategy,
                                                               TorchDistSaveShardedStrategy,
                                                               _replace_sharded_keys_with_state_dict_keys,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               _restore_dict_types, _unwrap_pyt_sharded_tensor,
                                                               mcore_to_pyt_state_dict)
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.utils import _wrap_exception

from lazyckpt.errors import CheckpointWriteError
from lazyckpt.interop.dcp_source import LazyStorageReader
from lazyckpt.saving.capture import record_events
from lazyckpt.storage.fileio import fsync_dir, fsync_file
from lazyckpt.saving.engine import CopyPart, NoCommit

from .dcp import LazyStorageWriter, _aligned

__all__ = ["LazySaveStrategy", "LazyLoadStrategy", "install", "uninstall"]

#: The waiting function in Megatron's checkpoint process polls this often.
_POLL_S = 0.005
#: staging waits at most this long for a buffer (an earlier save's write to end).
_STAGING_WAIT_S = 600.0


def wait_for_write(marker: str, parent_pid: int, timeout_s: float) -> None:
    """The ``async_fn`` of lazyckpt's requests: runs in the process Megatron's
    ``AsyncCallsQueue`` starts (forked or persistent) and returns once the
    training process has written ``marker`` (this rank's write ended, well or
    not: the finalize reports which), or once that process is gone."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker):
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        if time.monotonic() > deadline:
            return
        time.sleep(_POLL_S)


class _Writer(LazyStorageWriter):
    """lazyckpt's DCP writer (DCP's own file layout) with the two calls that
    Megatron's ``save_state_dict_async_plan`` / ``..._finalize`` add:
    ``prepare_write_data`` (start the write, return at once) and
    ``retrieve_write_results``. Its engine, host cache and staging buffers serve
    every save of the strategy that owns it."""

    def __init__(self, path: str, **knobs: Any):
        super().__init__(path, file_format="dcp", **knobs)
        self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazyckpt-megatron-write")
        self._save: Optional["_Save"] = None

    def _current_path(self) -> str:
        save = getattr(self._local, "save", None)
        return save.path if save is not None else self.path

    def _release_staging(self, planner: Any, pointers: List[int]) -> None:
        """The save's own arena is given back by the save (it knows which)."""

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        save = self._save
        assert save is not None

        def write() -> Any:
            self._local.save = save
            try:
                save.staged.result()            # the copy out of the live state is complete
                results = self.write_data(plan, planner).wait()
            except BaseException as exc:        # reported to every rank by the finalize
                results = _wrap_exception(exc)
            finally:
                self._local.save = None
                save.release()
                save.mark_done()
            return results
        save.results = self._thread.submit(write)

    def retrieve_write_results(self) -> Any:
        save = getattr(self._local, "save", None) or self._save
        assert save is not None and save.results is not None
        return save.results.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        super().close()


class _Save:
    """One save in flight: where it goes, its staging arena, its marker."""

    def __init__(self, path: str, marker: str):
        self.path = path
        self.marker = marker
        self.staged: cf.Future = cf.Future()
        self.results: Optional[cf.Future] = None
        self.arena: Any = None
        self.arenas: Any = None

    def release(self) -> None:
        if self.arena is not None:
            self.arenas.release(self.arena)
            self.arena = None

    def mark_done(self) -> None:
        with open(self.marker, "wb"):
            pass


class LazySaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` save strategy with lazyckpt's capture and writers.

    Takes ``TorchDistSaveShardedStrategy``'s arguments (so that Megatron-LM can
    build it where it built that class) and lazyckpt's knobs in ``lazyckpt=``
    (``host_cache_bytes``, ``writer_threads``, ``o_direct``...).
    ``thread_count``, ``separation_hint``, ``cached_metadata`` and
    ``cpu_shm_mode`` tune Megatron's own writer and are accepted and not used:
    lazyckpt's ``writer_threads`` sets the write parallelism, plans are not
    cached (each save agrees on its plan), and staging is in this process.

    What ``async_save`` promises: the checkpoint holds the values the state had
    when it was called, provided nothing but an optimizer step modifies the
    saved tensors before :meth:`wait_for_snapshot` returns (every optimizer's
    ``step()`` calls it). What the finalize promises: once it returns on every
    rank, the checkpoint is durable and committed (``.metadata``, then
    ``metadata.json``); a crash before that leaves no ``.metadata``, and
    Megatron does not load such a directory.
    """

    def __init__(self, *args: Any, lazyckpt: Optional[Dict[str, Any]] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazyckpt_knobs = dict(lazyckpt or {})
        self._writer: Optional[_Writer] = None
        self._markers = tempfile.mkdtemp(prefix="lazyckpt-megatron-")
        weakref.finalize(self, shutil.rmtree, self._markers, True)
        self._lock = threading.Lock()

    def _get_writer(self, path: str) -> _Writer:
        with self._lock:
            if self._writer is None:
                self._writer = _Writer(path, **self.lazyckpt_knobs)
                self._writer._get_engine().barrier.guard_all_optimizers()
            return self._writer

    def wait_for_snapshot(self) -> None:
        """Block until every pending save has copied the live state (it may then change)."""
        if self._writer is not None and self._writer._engine is not None:
            self._writer._engine.wait_for_snapshot()

    def close(self) -> None:
        """Wait for the writes in flight and free the buffers (the strategy can still be used)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    # -- staging
    def _stage(self, writer: _Writer, save: _Save, flat: Dict[str, List[Any]]) -> Dict[str, List[Any]]:
        """The same state with every ShardedTensor's data replaced by a view of a
        staging buffer; the copies into it are queued on the engine
        (``save.staged`` completes when they are done)."""
        tensors = [sh for shards in flat.values() for sh in shards
                   if isinstance(sh, ShardedTensor) and sh.data is not None]
        nbytes = sum(_aligned(sh.data.numel() * sh.data.element_size()) for sh in tensors)
        engine = writer._get_engine()
        engine.raise_errors()
        if nbytes:
            save.arenas = writer._get_arenas(nbytes)
            save.arena = save.arenas.acquire(nbytes, _STAGING_WAIT_S)
        base = save.arena.buffer.tensor if save.arena is not None else None
        pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
        cursor = 0
        staged_of: Dict[int, Any] = {}
        for sh in tensors:
            data = sh.data.detach()
            n = data.numel() * data.element_size()
            if n:
                view = base[cursor:cursor + n].view(data.dtype).view(data.shape)
                pairs.append((view, data))
                cursor += _aligned(n)
            else:
                view = torch.empty(data.shape, dtype=data.dtype)
            copied = copy.copy(sh)
            copied.data = view
            staged_of[id(sh)] = copied

        def on_end(job: Any) -> None:
            if job.handle.error is not None:
                job.handle.reported = True      # delivered through the finalize, once
                save.staged.set_exception(job.handle.error)
            else:
                save.staged.set_result(None)
        part = CopyPart(pairs, record_events(src for _, src in pairs))
        engine.submit(NoCommit(), [part], name=f"Megatron staging of {save.path}", on_end=on_end)
        return {key: [staged_of.get(id(sh), sh) for sh in shards] for key, shards in flat.items()}

    # -- the save
    def async_save(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: Path,
                   async_strategy: str = "mcore") -> AsyncRequest:
        """Plan (collectives, on every rank), queue the capture and the write,
        and return Megatron's ``AsyncRequest`` before the state is copied.
        ``async_strategy`` is Megatron's queue kind: ``"mcore"`` gives its own
        ``AsyncRequest``; ``"nvrx"`` nvidia-resiliency-ext's, where installed."""
        path = os.fspath(checkpoint_dir)
        writer = self._get_writer(path)
        save = _Save(path, os.path.join(self._markers, uuid.uuid4().hex))
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica)
        staged = self._stage(writer, save, flat)
        try:
            pyt_state_dict = mcore_to_pyt_state_dict(staged, False)
            writer.reset(path)
            writer._save = save
            writer._local.save = save
            ret = save_state_dict_async_plan(
                pyt_state_dict, writer, None, 0,
                planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                         flatten_state_dict=False, flatten_sharded_tensors=False))
        except BaseException:
            if save.results is None:            # the write never started: nothing else frees it
                try:
                    save.staged.result()
                except BaseException:
                    pass
                save.release()
            raise
        finally:
            writer._local.save = None
        storage_writer, global_metadata, dist_wrapper = ret[0]

        def finalize() -> None:
            writer._local.save = save
            try:
                save_state_dict_async_finalize(storage_writer, global_metadata, dist_wrapper)
            except CheckpointException as exc:
                raise CheckpointWriteError(
                    f"Megatron checkpoint {path}: a rank's write failed, so it was not committed "
                    f"(no .metadata); the previous checkpoint is intact. Causes by rank: {exc.failures}",
                    path=path) from exc
            finally:
                writer._local.save = None
                try:
                    os.unlink(save.marker)
                except FileNotFoundError:
                    pass

        request_cls = AsyncRequest
        fns = _FinalizeFns([finalize], functools.partial(_make_durable, path))
        if async_strategy == "nvrx":
            from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy
            request_cls = get_async_strategy("nvrx")[1]["AsyncRequest"]
        return request_cls(wait_for_write, (save.marker, os.getpid(), _WAIT_TIMEOUT_S), fns)


class _FinalizeFns(list):
    """The request's finalize functions, with ``durable`` run right after the
    first one appended to lazyckpt's commit. ``dist_checkpointing.save`` appends
    the writing of ``metadata.json`` (what makes a directory a checkpoint to
    Megatron) to the list at once, unsynced; Megatron-LM appends the tracker
    file (``latest_checkpointed_iteration.txt``) after it: so the checkpoint is
    durable before the tracker names it."""

    def __init__(self, fns: List[Any], durable: Any):
        super().__init__(fns)
        self._durable: Optional[Any] = durable

    def append(self, fn: Any) -> None:
        super().append(fn)
        durable, self._durable = self._durable, None
        if durable is not None:
            super().append(durable)


def _make_durable(path: str) -> None:
    """fsync ``metadata.json``, the checkpoint directory and its entry in the
    parent (a power loss would otherwise take back a finalized checkpoint
    whole), on the rank that wrote ``metadata.json``; then every rank agrees.

    Where one of those fsyncs fails, ``metadata.json`` is taken back before every
    rank raises: the directory is then no checkpoint to Megatron, as the error
    says (a failed fsync may have dropped its pages, and a checkpoint a power
    loss can take back must not be reported, nor named by the tracker file
    Megatron-LM writes after this)."""
    error: Optional[str] = None
    cause: Optional[BaseException] = None
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        config = os.path.join(path, "metadata.json")
        try:
            if os.path.exists(config):
                fsync_file(config)
            fsync_dir(path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        except OSError as exc:
            cause, error = exc, _take_back_config(path, config, exc)
    if torch.distributed.is_initialized():
        # Rank 0's outcome to every rank (the others wait for it here, as at a barrier).
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointWriteError(error, path=path) from cause


def _take_back_config(path: str, config: str, exc: OSError) -> str:
    """Remove ``metadata.json`` after a failed fsync; the error's message."""
    what = f"Megatron checkpoint {path}: making it durable failed ({exc})"
    try:
        os.unlink(config)
    except FileNotFoundError:
        pass
    except OSError as unlink_exc:
        return (f"{what}, and its metadata.json could not be taken back ({unlink_exc}): it may read as a "
                f"checkpoint whose data a power loss can drop; delete the directory and save again")
    try:
        fsync_dir(path)
    except OSError:
        pass            # the next save of this directory fsyncs it again
    return (f"{what}: its metadata.json is taken back, so it is no checkpoint (the previous one is intact); "
            f"save again")


#: The waiting process gives up after this long (the finalize then reports the write's state).
_WAIT_TIMEOUT_S = 24 * 3600.0


class LazyLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's ``torch_dist`` load strategy reading through lazyckpt's DCP reader
    (every record's span and CRC-32 checked; DCP's metadata unpickled with an
    allow-list). Reads checkpoints written by Megatron or by :class:`LazySaveStrategy`."""

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: Path,
             async_strategy: str = "mcore") -> Dict[str, Any]:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from torch.distributed import checkpoint
        values = list(nested_values(sharded_state_dict))
        flexible = [t for t in values if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in values if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        original = sharded_state_dict
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        checkpoint.load(pyt_state_dict, LazyStorageReader(os.fspath(checkpoint_dir)),
                        planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=flexible,
                                                 allow_shape_mismatch_sharded_tensors=mismatch,
                                                 stream_ckpt_dequant=self.stream_ckpt_dequant,
                                                 flatten_state_dict=False, flatten_sharded_tensors=False),
                        no_dist=True)
        state = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = _replace_sharded_keys_with_state_dict_keys(state, flat_mapping, rename_mapping)
        _restore_dict_types(state, original)
        return state


# --------------------------------------------------------------------------- Megatron-LM


_installed: Dict[str, Any] = {}


def install(**knobs: Any) -> None:
    """Make ``megatron.training``'s checkpointing save through lazyckpt.

    Its ``save_checkpoint`` builds ``TorchDistSaveShardedStrategy(...)`` by the
    name it imported; after this call that name is a :class:`LazySaveStrategy`
    with ``knobs`` (lazyckpt's: ``host_cache_bytes``, ``writer_threads``...).
    Megatron keeps the rest: ``FullyParallelSaveStrategyWrapper`` around it,
    ``--async-save``'s queue and finalize, ``latest_checkpointed_iteration.txt``
    written after the commit. Idempotent; :func:`uninstall` undoes it."""
    import megatron.training.checkpointing as checkpointing
    lazy_knobs = dict(knobs)

    class _Installed(LazySaveStrategy):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.setdefault("lazyckpt", lazy_knobs)
            super().__init__(*args, **kwargs)
    _Installed.__name__ = _Installed.__qualname__ = "LazySaveStrategy"
    if "strategy" not in _installed:
        _installed["strategy"] = checkpointing.TorchDistSaveShardedStrategy
    checkpointing.TorchDistSaveShardedStrategy = _Installed


def uninstall() -> None:
    """Give ``megatron.training`` its own save strategy back."""
    if "strategy" in _installed:
        import megatron.training.checkpointing as checkpointing
        checkpointing.TorchDistSaveShardedStrategy = _installed.pop("strategy")
