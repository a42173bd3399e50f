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
    engine.load_checkpoint(save_dir)          # reads torch.save zips and lazyckpt files
    lazyckpt.integrations.deepspeed.wait(engine)   # optional: everything durable now

``enable`` also hooks the engine's methods that end a save or change saved
tensors in place outside the optimizer step (see :func:`_hook_engine`);
changes it cannot see need :func:`wait_for_snapshot` first.

Files keep DeepSpeed's names (``mp_rank_00_model_states.pt`` ...) and, with
``file_format="torch"`` (the default), DeepSpeed's own content: the zip of
``torch.save(clone_tensors_for_torch_save(state))``, which ``torch.load``,
``zero_to_fp32`` and ``ds_to_universal`` read, written from the live tensors
without the clone (:mod:`.deepspeed_files`). ``file_format="lazyckpt"``:
lazyckpt's format (read by ``load_checkpoint`` and ``lazyckpt.load_file``,
not by DeepSpeed's tools). Every save of a tag runs on lazyckpt's one save engine
(:mod:`lazyckpt.saving.engine`): one job per tag, its files written in order through
the bounded host cache, each renamed into place once durable; the tag is
committed across ranks through the store (keyed by the call, so a failure on
one rank fails that tag only) and ``latest`` is written after that.

**Pickles.** DeepSpeed's state holds a few objects that are not tensors or
containers (the ZeRO stage enum, the loss scaler, the fp32 partition map's
``fragment_address`` records). Torch-format files pickle them as torch.save
does and are loaded with ``weights_only=True`` plus exactly those classes.
For lazyckpt's format this module registers safe providers for those types,
so its files contain no pickle and load with
``allow_pickle=False``, the default, like any lazyckpt file. An object of a
type nobody registered is still pickled (logged once at save time); loading
such a file needs ``allow_pickle=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import weakref
from typing import Any, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from lazyckpt.distributed import RankInfo, agree, depart, rank_info, refuse
from lazyckpt.errors import CheckpointError, CheckpointWriteError
from lazyckpt.knobs import Options, resolve
from lazyckpt.loading.loader import _find_pickle, load_file
from lazyckpt.loading.request import LoadRequest
from lazyckpt.saving.capture import record_events
from lazyckpt.saving.engine import CommitStrategy, FilePart, Job, SaveEngine
from lazyckpt.state.providers import flatten, register_provider
from lazyckpt.storage.fileio import (fsync_dir, make_dirs_durable, remove_quietly, replace_releasing_later,
                                     write_file_atomic)
from lazyckpt.storage.sidefiles import sibling_temp
from lazyckpt.storage.stores import for_path
from ._async import is_lazyckpt_file
from .deepspeed_files import ClonedTorchZipLayout

log = logging.getLogger("lazyckpt.deepspeed")

# Every LazyCheckpointEngine of this process: a load waits for all their saves,
# since the engine that loads is often not the one that saved (a fresh engine).
_LIVE_ENGINES: "weakref.WeakSet[LazyCheckpointEngine]" = weakref.WeakSet()


class TagCommit(CommitStrategy):
    """The files of one ``save_checkpoint`` call (one tag): each written under a
    leased hidden sibling and renamed into place once durable; the tag is
    committed when every rank's files are, and then ``latest`` is written."""

    def __init__(self, info: CheckpointCommitInfo, seq: int, dist: RankInfo, heartbeat_s: float):
        self.info = info
        self.path = os.path.abspath(info.save_dir)
        #: Where the tag's files go (a local directory: DeepSpeed's layout renames).
        self.store = for_path(self.path)
        self.seq = seq
        self.key = f"ds{seq}"
        self.dist = dist
        self.heartbeat_s = heartbeat_s
        self._reported = False

    def part_path(self, job: Job, part: FilePart) -> str:
        tmp = sibling_temp(part.final_path)
        make_dirs_durable(os.path.dirname(tmp))
        job.lease(tmp, self.heartbeat_s)
        return tmp

    def part_output(self, path: str, options: Options, block_bytes: int) -> Any:
        return self.store.open_output(path, options, block_bytes)

    def part_done(self, job: Job, part: FilePart) -> None:
        replace_releasing_later(part.path, part.final_path)     # a tag saved again: its old file freed off this path
        fsync_dir(os.path.dirname(part.final_path))

    def commit(self, job: Job) -> None:
        self._reported = True
        if self.dist.distributed:
            agree(self.dist, self.key, {"ok": True}, f"DeepSpeed checkpoint {self.info.tag!r}",
                  lambda done: self._write_latest(), forget=[f"ds{self.seq - 1}/outcome"])
        else:
            self._write_latest()

    def _write_latest(self) -> None:
        if not self.info.save_latest:
            return
        path = os.path.join(self.info.save_dir, "latest")
        tag = str(self.info.tag).encode()
        try:
            with open(path, "rb") as f:
                before: Optional[bytes] = f.read()
        except FileNotFoundError:
            before = None
        try:
            write_file_atomic(path, tag)
        except OSError as exc:
            _take_back_latest(path, tag, before, exc)
            raise

    def abort(self, job: Job, error: BaseException) -> None:
        for part in job.parts:
            path = getattr(part, "path", None)
            if path is not None and path != part.final_path and os.path.exists(path):
                remove_quietly(path)
        if self.dist.distributed and not self._reported:
            refuse(self.dist, self.key, error)

    def failure_message(self, job: Job, cause: str) -> str:
        return f"DeepSpeed checkpoint {self.info.tag!r} in {self.info.save_dir} failed: {cause}"


def _take_back_latest(path: str, tag: bytes, before: Optional[bytes], exc: OSError) -> None:
    """``latest`` could not be written durably (its write, its rename or the
    directory's fsync failed). Where the rename had already made it name the
    new tag, it is put back to what it named before (removed if there was
    none): a tag whose commit failed is never the one ``load_checkpoint``
    resumes from, since a power loss may take that ``latest`` back. Raises the
    error that says so, chained to ``exc``; returns where ``latest`` is as
    before."""
    try:
        with open(path, "rb") as f:
            now: Optional[bytes] = f.read()
    except OSError:
        now = None
    if now != tag or before == tag:
        return                          # not renamed over (or it named this tag already): nothing to undo
    what = f"writing {path} durably failed ({exc})"
    try:
        if before is None:
            os.unlink(path)
            try:
                fsync_dir(os.path.dirname(path))
            except OSError:
                pass                    # an unlink a power loss takes back leaves the new latest: the next save fixes it
        else:
            write_file_atomic(path, before)
    except OSError as undo:
        raise CheckpointWriteError(
            f"{what}, and putting it back failed ({undo}): it names tag {tag.decode()!r}, whose commit "
            f"failed; write the previous tag's name into it, or save again", path=path) from exc
    named = f"tag {before.decode(errors='replace')!r}" if before is not None else "no tag (it is removed)"
    raise CheckpointWriteError(f"{what}: it is put back and names {named} as before; the new tag's files are in "
                               f"place but not committed; save again", path=path) from exc


class LazyCheckpointEngine(CheckpointEngine):
    """Asynchronous, decoupled DeepSpeed checkpoint engine backed by lazyckpt."""

    def __init__(self, config_params: Any = None, *, file_format: str = "torch", allow_pickle: bool = False,
                 commit_timeout_s: float = 600.0, **knobs: Any):
        super().__init__(config_params)
        self.name = "LazyCheckpointEngine"
        if file_format not in ("torch", "lazyckpt"):
            raise ValueError(f"file_format={file_format!r}: expected 'torch' (the files DeepSpeed's own engine "
                             f"writes, read by torch.load, zero_to_fp32, ds_to_universal) or 'lazyckpt'")
        #: "torch" (default): DeepSpeed's own files, written asynchronously; "lazyckpt": lazyckpt's format.
        self.file_format = file_format
        self.allow_pickle = allow_pickle
        self.options = resolve(None, **knobs)
        _register_deepspeed_providers()
        self._engine = SaveEngine(self.options, guard_buffers=True)
        # DeepSpeed steps through its own optimizer wrappers: guard every optimizer.
        self._engine.barrier.guard_all_optimizers()
        self._dist = rank_info("lazyckpt-deepspeed", None, commit_timeout_s)
        self._job: Optional[Job] = None
        self._seq = 0
        self._warned_pickles = False
        self._export = False            # inside save_16bit_model: plain torch.save files
        _LIVE_ENGINES.add(self)

    # ------------------------------------------------------------------ DeepSpeed API

    def create(self, info: CheckpointCommitInfo) -> None:
        self._engine.raise_errors()
        self._seal()
        self._seq += 1
        strategy = TagCommit(info, self._seq, self._dist, self.options.lease_heartbeat_s)
        self._job = self._engine.submit(strategy, [], name=f"DeepSpeed checkpoint {info.tag!r}",
                                        sealed=False)

    def save(self, state_dict: Any, path: str) -> None:
        self._engine.raise_errors()
        if self._export:
            self._torch_save(state_dict, os.path.abspath(os.fspath(path)))
            return
        if self._job is None:             # a save outside save_checkpoint (e.g. save_16bit_model)
            self.create(CheckpointCommitInfo(tag="", save_dir=os.path.dirname(os.fspath(path)),
                                             save_latest=False))
        final_path = os.path.abspath(os.fspath(path))
        if self.file_format == "torch":
            # What DeepSpeed's engine writes (torch.save of its clones), without the clone.
            layout = ClonedTorchZipLayout(state_dict)
            part = layout.part(record_events(s.data for s in layout.sources))
            part.final_path = final_path
            self._engine.add_part(self._job, part)
            return
        flat = flatten(state_dict)
        if not self._warned_pickles and _find_pickle(flat.tree, []) is not None:
            self._warned_pickles = True
            node, trail = _find_pickle(flat.tree, [])
            log.warning("lazyckpt: %s: entry %s is a pickled %s; loading it will need allow_pickle=True. "
                        "Logged once.", path, "/".join(trail), node.get("type", "object"))
        self._engine.add_part(self._job, FilePart(flat, {"user": {}}, record_events(s.data for s in flat.sources),
                                                  final_path=final_path))

    def load(self, path: str, map_location: Any = None) -> Any:
        self.wait()                         # read-your-writes: this engine's pending tags first
        if is_lazyckpt_file(path):
            request = LoadRequest(map_location=map_location, allow_pickle=self.allow_pickle)
            return load_file(path, self.options, self._engine.resources.readers, for_path(path), request)
        # torch.save zips (this engine's default format, or DeepSpeed's own engine's):
        # weights_only, with DeepSpeed's few state classes allowed (the loss scaler, the
        # ZeRO stage enum, fragment_address) unless allow_pickle.
        if self.allow_pickle:
            return torch.load(path, map_location=map_location, weights_only=False)
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Block until the checkpoint of ``info`` is committed (not called by
        DeepSpeed's step path, which gets no commit info from this engine)."""
        self._seal()
        for job in self._engine.pending_jobs():
            if isinstance(job.strategy, TagCommit) and job.strategy.info == info:
                job.handle.wait()          # raises its error, once
        return True

    def get_commit_info(self) -> None:
        """Called by DeepSpeed before each optimizer step: the consistency barrier.

        Hands the current checkpoint to the background commit, waits until every
        pending capture has copied its data (so the step may update the
        tensors), and returns None so that DeepSpeed does not write ``latest``
        itself (this engine writes it once the checkpoint is durable).
        """
        self._seal()
        self._engine.wait_for_snapshot()
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
        self.wait()

    # ------------------------------------------------------------------ extras

    def wait_for_snapshot(self) -> None:
        self._engine.wait_for_snapshot()

    def wait(self) -> None:
        """Block until every checkpoint handed over so far is committed and durable."""
        self._seal()
        self._engine.wait()

    def close(self) -> None:
        try:
            self._seal()
            self._engine.close()
        finally:
            depart(self._dist)            # rank 0 may host the store (distributed.depart)

    def _export_next_saves(self, on: bool) -> None:
        self._export = on

    def _torch_save(self, state_dict: Any, path: str) -> None:
        """torch.save under a hidden sibling, fsync, rename: never a torn export."""
        tmp = sibling_temp(path)
        make_dirs_durable(os.path.dirname(path))
        try:
            with open(tmp, "wb") as f:
                torch.save(state_dict, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            remove_quietly(tmp)
            raise
        fsync_dir(os.path.dirname(path))

    def _seal(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            self._engine.seal(job)

    def _abandon(self) -> None:
        """``save_checkpoint`` raised: the open tag is cancelled, never committed
        (``latest`` keeps naming the previous tag); its files already in place
        stay, as DeepSpeed's own engine leaves them. The caller has DeepSpeed's
        error; on other ranks the tag fails through the store."""
        job, self._job = self._job, None
        if job is not None:
            job.cancel()
            self._engine.seal(job)


def enable(engine: Any, **kwargs: Any) -> LazyCheckpointEngine:
    """Make ``engine`` (a ``deepspeed.DeepSpeedEngine``) save and load through lazyckpt.

    Collective: call it on every rank, after ``deepspeed.initialize``.
    Keyword arguments go to :class:`LazyCheckpointEngine` (``file_format``:
    ``"torch"``, the default, or ``"lazyckpt"``; ``host_cache_bytes``,
    ``writer_threads``, ``allow_pickle``, ``commit_timeout_s`` ...).
    """
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, LazyCheckpointEngine):
        return old
    new = LazyCheckpointEngine(getattr(engine, "_config", None), **kwargs)
    engine.checkpoint_engine = new
    _hook_engine(engine, new)
    _hook_zero_to_fp32()
    return new


@functools.cache                    # once per process: a second call would wrap the wrappers
def _hook_zero_to_fp32() -> None:
    """DeepSpeed's ``zero_to_fp32`` readers, called in a process that saved with
    lazyckpt, first wait for that process's pending checkpoints (read-your-writes,
    as ``load_checkpoint``): its glob of the tag directory (every reader goes
    through ``get_checkpoint_files``, also when the caller bound the public
    function before :func:`enable`) and the ``latest`` lookup of
    ``get_fp32_state_dict_from_zero_checkpoint(tag=None)`` (when called through
    the module, as its ``convert_*`` and ``load_*`` functions do)."""
    try:
        from deepspeed.utils import zero_to_fp32
    except ImportError:             # pragma: no cover (moved in another DeepSpeed release)
        return
    for name in ("get_checkpoint_files", "get_fp32_state_dict_from_zero_checkpoint"):
        function = getattr(zero_to_fp32, name, None)
        if function is not None:
            setattr(zero_to_fp32, name, _waiting_first(function))


def _waiting_first(function: Any) -> Any:
    def waits_first(*args: Any, **kwargs: Any) -> Any:
        _wait_all_in_process()
        return function(*args, **kwargs)

    waits_first.__wrapped__ = function          # type: ignore[attr-defined]
    waits_first.__doc__ = function.__doc__
    return waits_first


def wait_for_snapshot(engine: Any) -> None:
    """Block until every checkpoint ``engine`` saved has copied its data out of
    the live tensors: call it before changing weights or optimizer state in
    place outside the paths :func:`enable` hooks (see docs/frameworks/deepspeed.md)."""
    _lazy_engine(engine).wait_for_snapshot()


def _hook_engine(engine: Any, ckpt: LazyCheckpointEngine) -> None:
    """Wrap, on this engine instance only, DeepSpeed's methods that end a save or
    change saved tensors in place outside the optimizer step.

    - ``save_checkpoint``: the tag's job is sealed when it returns, so it commits
      (and ``latest`` is written) without waiting for the next step; DeepSpeed
      has no end-of-save call for a decoupled engine. If it raises, the tag is
      cancelled instead: a failed tag is never committed nor named by ``latest``.
    - ``load_checkpoint``: waits until every checkpoint this process handed to
      lazyckpt is committed, before DeepSpeed reads ``latest`` or globs the
      tag's files itself (read-your-writes, also from another engine) and before
      it copies loaded values into tensors a capture may still read.
    - ``_take_model_step``: the consistency barrier, where every DeepSpeed
      optimizer update starts (``engine.step()`` and the pipeline engine's
      ``train_batch()``, which never calls ``get_commit_info``): the loss
      scaler, the fp32 master -> fp16/bf16 copy, the LR scheduler.
    - ``save_16bit_model``: the consolidated weights are an export that other
      tools read with ``torch.load`` (``from_pretrained`` reads the
      ``pytorch_model.bin`` the HF Trainer writes with it), and DeepSpeed
      waits for it anyway: it is written with ``torch.save``, synchronously.
    - ``eval``/``train``/``generate`` where the engine's class overrides them:
      DeepSpeed's hybrid engine fuses LoRA weights and swaps inference
      containers in place there.
    """
    def wrap(name: str, before: Any = None, after: Any = None, finally_: Any = None,
             on_error: Any = None) -> None:
        method = getattr(engine, name, None)
        if method is None or getattr(method, "_lazyckpt_hooked", False):
            return

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(*args, **kwargs)
            try:
                result = method(*args, **kwargs)
            except BaseException:
                if on_error is not None:
                    on_error()
                raise
            finally:
                if finally_ is not None:
                    finally_()
            if after is not None:          # on success only: a failed save is not committed here
                after()
            return result

        hooked._lazyckpt_hooked = True          # type: ignore[attr-defined]
        hooked.__wrapped__ = method             # type: ignore[attr-defined]
        hooked.__doc__ = method.__doc__
        setattr(engine, name, hooked)

    wrap("save_checkpoint", after=ckpt._seal, on_error=ckpt._abandon)
    wrap("save_16bit_model", before=lambda *a, **k: ckpt._export_next_saves(True),
         finally_=lambda: ckpt._export_next_saves(False))
    wrap("load_checkpoint", before=lambda *a, **k: _wait_all_in_process())
    wrap("_take_model_step", before=lambda *a, **k: ckpt.get_commit_info())
    # Only where a subclass overrides them (the hybrid engine): the base engine's
    # eval()/train() change nothing, and the HF Trainer calls train() every step,
    # where a wait would stop the capture from overlapping the forward.
    from deepspeed.runtime.engine import DeepSpeedEngine
    for name in ("eval", "train", "generate"):
        if getattr(type(engine), name, None) is not getattr(DeepSpeedEngine, name, None):
            wrap(name, before=lambda *a, **k: ckpt.wait_for_snapshot())


def _wait_all_in_process() -> None:
    for ckpt in list(_LIVE_ENGINES):
        if not ckpt._engine.closed:
            ckpt.wait()


def _lazy_engine(engine: Any) -> LazyCheckpointEngine:
    ckpt = getattr(engine, "checkpoint_engine", None)
    if not isinstance(ckpt, LazyCheckpointEngine):
        raise CheckpointError("this DeepSpeed engine does not use lazyckpt; call enable(engine) first")
    return ckpt


def wait(engine: Any) -> None:
    """Block until every checkpoint ``engine`` saved is committed and durable."""
    _lazy_engine(engine).wait()


# --------------------------------------------------------------------------- safe providers

@functools.cache                    # once per process, at the first engine
def _register_deepspeed_providers() -> None:
    """Save DeepSpeed's few non-tensor objects as safe state instead of pickles."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    except ImportError:             # pragma: no cover (moved in another DeepSpeed release)
        LossScaler = DynamicLossScaler = None
    for cls in (LossScaler, DynamicLossScaler):
        if cls is not None:
            register_provider(cls, _object_to_state, _object_from_state(cls))
    try:
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:             # pragma: no cover
        fragment_address = None
    if fragment_address is not None and dataclasses.is_dataclass(fragment_address):
        register_provider(fragment_address, lambda obj: dataclasses.asdict(obj),
                          lambda state: fragment_address(**state))
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError:             # pragma: no cover
        ZeroStageEnum = None
    if ZeroStageEnum is not None:
        register_provider(ZeroStageEnum, lambda e: e.value, ZeroStageEnum)


def _deepspeed_safe_globals() -> list:
    """The classes of DeepSpeed's checkpoint state that are not tensors or containers,
    for ``torch.load(weights_only=True)`` of the torch-format files."""
    import importlib
    out = []
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",)),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:         # pragma: no cover (moved in another DeepSpeed release)
            continue
        out += [getattr(mod, name) for name in names if hasattr(mod, name)]
    return out


def _object_to_state(obj: Any) -> Any:
    return dict(vars(obj))


def _object_from_state(cls: type):
    def build(state: Any) -> Any:
        obj = cls.__new__(cls)
        obj.__dict__.update(state)
        return obj
    return build
