"""Hugging Face ``Trainer`` checkpoints through lazyckpt, asynchronously.

Use the mixin in front of ``Trainer`` (or any subclass of it), or the
ready-made ``LazyCheckpointTrainer``::

    from transformers import Trainer
    from lazyckpt.integrations.huggingface import LazyCheckpointMixin

    class MyTrainer(LazyCheckpointMixin, Trainer):
        pass

    trainer = MyTrainer(model=model, args=args, train_dataset=ds,
                        lazyckpt_options={"host_cache_bytes": 2 << 30})
    trainer.train()                                   # checkpoints every save_steps, asynchronously
    trainer.train(resume_from_checkpoint=True)        # or a path: ".../checkpoint-500"

**Why a mixin and not only a callback.** ``Trainer._save_checkpoint`` writes
model, optimizer, scheduler and RNG files with ``torch.save`` and only then
calls ``on_save``: a callback can add a second copy but cannot remove the
synchronous one, and it cannot change how ``train(resume_from_checkpoint=...)``
reads them back. The mixin overrides these methods of ``transformers.Trainer``
(checked against transformers 5.x; 4.4x has the same names):

* ``_save_checkpoint``: the checkpoint's files (see Layout), queued and written
  in the background (see below);
* ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``,
  ``_load_scaler``, ``_load_rng_state``, ``_load_best_model``: wait for a
  pending save of that checkpoint, then read its ``lazyckpt.lzc`` if it has
  one; any other directory (the HF layout, written by this mixin or by a plain
  ``Trainer``) goes to ``Trainer``'s own loaders;
* ``_finalize_training`` and ``train``: drain pending saves (errors raised).

**Layout.** By default (``lazyckpt_checkpoint_format="hf"``)
``output_dir/checkpoint-<step>/`` holds the plain ``Trainer``'s files
(``model.safetensors`` or its shards and index, ``optimizer.pt``,
``scheduler.pt``, ``scaler.pt``, ``rng_state*.pth``, ``trainer_state.json``,
``training_args.bin``, config, generation config and tokenizer files), the
large ones written by the engine in the background (:mod:`.hf_layout` says
which file is written where): the plain ``Trainer``, ``from_pretrained`` and
the Hub read it, and the mixin reads it back with ``Trainer``'s own loaders.
With ``lazyckpt_checkpoint_format="lazyckpt"`` it holds ``lazyckpt.lzc``
(model state dict, optimizer, scheduler, grad scaler, the RNG states of every
process, the trainer state), ``trainer_state.json`` and ``config.json``.
:func:`load_model_state` and :func:`load_checkpoint_state` read either
layout. Either way the directory is
assembled under a hidden temporary name and renamed into place only once
every file is durable, so ``get_last_checkpoint``,
``resume_from_checkpoint=True`` and ``save_total_limit`` rotation only ever
see complete checkpoints, and a crash mid-save leaves the previous ones
intact.

**Asynchronous semantics.** ``_save_checkpoint`` runs after the optimizer
and scheduler steps of a training step; it walks the state (no tensor data
copied), queues it and returns, and the training continues. A background
thread copies the tensors into lazyckpt's host cache and writer threads
flush it; the capture is guaranteed complete before anything modifies those
tensors in place: a global optimizer step pre-hook (and, for training-mode
modules with persistent buffers, a forward pre-hook) waits for it (see
:mod:`lazyckpt.integrations.lightning`, whose ``AsyncFileWriter`` this
uses); so do the Trainer's other in-place paths (``optimizer.train()`` /
``eval()`` of schedule-free optimizers, ``model.train()`` / ``eval()``), and
code of yours that swaps weights before the next optimizer step (EMA, SWA)
must call ``trainer.lazyckpt_wait_for_snapshot()``. ``on_save`` callbacks,
rotation and ``push_to_hub`` run once the checkpoint is committed and
durable, on the training thread at the next callback event; when a callback
of yours overrides ``on_save`` (it may set control flags), the step that
saved waits for the commit and runs them where the plain ``Trainer`` does
(see :mod:`.hf_callbacks`). A background failure is raised
at the next checkpoint or at the end of ``train()``; when ``train()`` returns
every checkpoint is committed and durable.

**Pickles.** Everything saved here is plain state (tensors, numbers,
strings, lists, numpy arrays), so loading uses ``allow_pickle=False`` and
runs no code from the file, like ``Trainer``'s own ``torch.load(...,
weights_only=True)``. Pass ``lazyckpt_allow_pickle=True`` only if a custom
scheduler or optimizer puts arbitrary objects into its state dict and you
trust the checkpoints.

**Distributed.** With several processes (DDP), every process calls
``_save_checkpoint``; the RNG states of all processes are gathered (one small
collective) and the process that ``Trainer`` lets save (``args.should_save``)
writes the file, as ``Trainer`` itself saves model and optimizer from the
main process only. Each process restores its own RNG state. DeepSpeed, FSDP,
XLA and SageMaker model parallelism are refused by the constructor, with an
error that names what to use (:func:`.hf_callbacks.refuse_unsupported`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import warnings
from typing import Any, Dict, Optional

import numpy as np
import torch

from lazyckpt import api
from lazyckpt.errors import MissingKeyError
from lazyckpt.storage.fileio import fsync_dir, make_dirs_durable, write_file_atomic
from lazyckpt.storage.sidefiles import clean_sibling_temps, sibling_temp
from lazyckpt.storage.stores import for_path
from lazyckpt.tiers.files import FileMirror
from ._async import AsyncFileWriter, file_writer_options, persist_tier, tier_options
from ._lazyclass import lazy_classes
from .hf_layout import queue_hf_checkpoint, read_hf_checkpoint, rng_state
from . import hf_callbacks
from .hf_layout import check_format

log = logging.getLogger("lazyckpt")

__all__ = [  # noqa: F822 (LazyCheckpointTrainer: module __getattr__, needs transformers)
           "LazyCheckpointMixin", "LazyCheckpointTrainer", "CHECKPOINT_FILE", "load_model_state",
           "load_checkpoint_state"]

#: What makes a checkpoint-<step> directory complete (lazyckpt renames the whole
#: directory in; the plain Trainer writes it last): on the persistent tier, uploaded
#: last and deleted first.
_MARKER = "trainer_state.json"

#: The lazyckpt file inside each ``checkpoint-<step>`` directory.
CHECKPOINT_FILE = "lazyckpt.lzc"
FORMAT_TAG = "lazyckpt-hf-trainer/1"


def load_checkpoint_state(checkpoint_dir: str, keys: Optional[list] = None, map_location: Any = "cpu",
                          allow_pickle: bool = False, **knobs: Any) -> Dict[str, Any]:
    """The state saved in ``checkpoint_dir`` (or only its ``keys``: ``"model"``,
    ``"optimizer"``, ``"scheduler"``, ``"scaler"``, ``"rng"``, ``"trainer_state"``),
    whichever layout it holds: ``lazyckpt.lzc``, or the plain Trainer's files
    (the default layout, :func:`.hf_layout.read_hf_checkpoint`)."""
    path = os.path.join(checkpoint_dir, CHECKPOINT_FILE)
    if os.path.isfile(path):
        return api.load(path, map_location=map_location, keys=keys, allow_pickle=allow_pickle, **knobs)
    return read_hf_checkpoint(checkpoint_dir, keys=keys, map_location=map_location, allow_pickle=allow_pickle)


def load_model_state(checkpoint_dir: str, map_location: Any = "cpu") -> Dict[str, torch.Tensor]:
    """The model's state dict saved in ``checkpoint_dir``, in either layout (reads only
    those bytes; the HF layout holds it as ``save_pretrained`` wrote it: tied weights once)."""
    return load_checkpoint_state(checkpoint_dir, keys=["model"], map_location=map_location)["model"]


class LazyCheckpointMixin:
    """Put in front of ``transformers.Trainer``: ``class T(LazyCheckpointMixin, Trainer)``.

    Extra keyword arguments of the constructor:

    * ``lazyckpt_options``: lazyckpt knobs (``host_cache_bytes``,
      ``writer_threads``, ``o_direct``, ``chunk_bytes``, ``max_pending_saves``).
    * ``lazyckpt_allow_pickle``: allow pickled objects when loading (default False).
    * ``lazyckpt_guard_buffers``: also wait for a pending capture before the
      forward of a training-mode module with persistent buffers (default True).
    * ``lazyckpt_checkpoint_format``: ``"hf"`` (default: ``checkpoint-<step>/``
      holds the plain Trainer's files, see :mod:`.hf_layout`) or
      ``"lazyckpt"`` (one ``lazyckpt.lzc`` per checkpoint).
    * ``lazyckpt_max_shard_size``: ``max_shard_size`` of ``model.safetensors``
      in the ``"hf"`` format (default ``"50GB"``, ``save_pretrained``'s).
    * ``lazyckpt_persist``: the persistent tier, an object store URL
      (``s3://bucket/prefix``) or ``lazyckpt.Persist(url, bandwidth=...,
      storage_options=...)``: ``args.output_dir`` is mirrored under it
      (``lazyckpt_persist_to=``, and ``persist_bandwidth``/``storage_options``
      in ``lazyckpt_options``, are its deprecated spellings).
    """

    def __init__(self, *args: Any, lazyckpt_options: Optional[Dict[str, Any]] = None,
                 lazyckpt_allow_pickle: bool = False, lazyckpt_guard_buffers: bool = True,
                 lazyckpt_checkpoint_format: str = "hf", lazyckpt_max_shard_size: Any = "50GB",
                 lazyckpt_persist: Any = None, lazyckpt_persist_to: Optional[str] = None, **kwargs: Any) -> None:
        check_format(lazyckpt_checkpoint_format)
        self.lazyckpt_checkpoint_format = lazyckpt_checkpoint_format
        self.lazyckpt_max_shard_size = lazyckpt_max_shard_size
        self.lazyckpt_options = dict(lazyckpt_options or {})
        #: The persistent tier (a lazyckpt.Persist), or None.
        self.lazyckpt_persist = persist_tier(type(self).__name__, lazyckpt_persist, self.lazyckpt_options,
                                             new="lazyckpt_persist", old="lazyckpt_persist_to",
                                             old_url=lazyckpt_persist_to,
                                             moved=("persist_bandwidth", "storage_options"))
        # Unknown or invalid knobs, and those a file writer would ignore, fail here.
        self._lazyckpt_resolved = file_writer_options("lazyckpt_options", self.lazyckpt_options,
                                                      persist=self.lazyckpt_persist is not None)
        #: The persistent tier's URL, or None.
        self.lazyckpt_persist_to = self.lazyckpt_persist.url if self.lazyckpt_persist is not None else None
        self._lazyckpt_mirror: Optional[FileMirror] = None
        self.lazyckpt_allow_pickle = lazyckpt_allow_pickle
        self.lazyckpt_guard_buffers = lazyckpt_guard_buffers
        self._lazyckpt_writer: Optional[AsyncFileWriter] = None
        self._lazyckpt_warned = False
        self._lazyckpt_in_jit = False
        # hf_callbacks: refuse what would silently be synchronous; on_save after the commit.
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            hf_callbacks.refuse_unsupported(training_args, lazyckpt_checkpoint_format)
        super().__init__(*args, **kwargs)
        hf_callbacks.refuse_after_init(self)
        self._lazyckpt_events = hf_callbacks.CommittedSaveEvents(self)
        hf_callbacks.wrap_jit_checkpoint(self)

    # ------------------------------------------------------------------ public

    @property
    def lazyckpt_writer(self) -> AsyncFileWriter:
        if getattr(self, "_lazyckpt_writer", None) is None:
            options = getattr(self, "_lazyckpt_resolved", None) or \
                file_writer_options("lazyckpt_options", getattr(self, "lazyckpt_options", {}))
            self._lazyckpt_writer = AsyncFileWriter(guard_buffers=getattr(self, "lazyckpt_guard_buffers", True),
                                                    options=options)
        return self._lazyckpt_writer

    @property
    def lazyckpt_mirror(self) -> Optional[FileMirror]:
        """The persistent tier (``lazyckpt_persist``): ``args.output_dir`` mirrored
        under it; None without one."""
        persist = getattr(self, "lazyckpt_persist", None)
        if getattr(self, "_lazyckpt_mirror", None) is None and persist is not None:
            self._lazyckpt_mirror = FileMirror(for_path(persist.url), persist.url, self.args.output_dir,
                                               tier_options(self.lazyckpt_writer.options, persist))
        return getattr(self, "_lazyckpt_mirror", None)

    def lazyckpt_wait(self) -> None:
        """Block until every queued checkpoint is committed and durable; raise a failure."""
        writer = getattr(self, "_lazyckpt_writer", None)
        if writer is not None:
            writer.wait()

    def lazyckpt_close(self, raise_errors: bool = True) -> None:
        """Drain, then release the host cache, the threads and the hooks; with a
        persistent tier, wait until every checkpoint and removal asked is on it."""
        try:
            self._lazyckpt_close_writer(raise_errors)
        finally:
            self._lazyckpt_close_mirror(raise_errors)

    def _lazyckpt_close_writer(self, raise_errors: bool) -> None:
        writer, self._lazyckpt_writer = getattr(self, "_lazyckpt_writer", None), None
        if writer is not None:
            writer.close(raise_errors=raise_errors)

    def _lazyckpt_close_mirror(self, raise_errors: bool) -> None:
        mirror = getattr(self, "_lazyckpt_mirror", None)
        if mirror is not None:
            mirror.close()
            if raise_errors:
                mirror.raise_errors()

    def lazyckpt_wait_for_snapshot(self) -> None:
        """Block until every queued checkpoint has copied the live state: call it
        before changing checkpointed tensors in place outside the optimizer step
        (an EMA swap in ``on_step_begin``, ...)."""
        writer = getattr(self, "_lazyckpt_writer", None)
        if writer is not None:
            writer.wait_for_snapshot()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # resume_from_checkpoint=True: the last *complete* checkpoint (a JIT or killed save
        # can leave a newer, incomplete checkpoint-<step>/ behind).
        if kwargs.get("resume_from_checkpoint") is True:
            kwargs["resume_from_checkpoint"] = self._lazyckpt_resume_path()
        elif args and args[0] is True:
            args = (self._lazyckpt_resume_path(),) + args[1:]
        else:
            given = kwargs.get("resume_from_checkpoint", args[0] if args else None)
            if isinstance(given, (str, os.PathLike)) and not os.path.isdir(given) and self.lazyckpt_mirror:
                self._lazyckpt_fetch(os.fspath(given))      # the local copy is gone: the store's
        try:
            output = super().train(*args, **kwargs)
        except BaseException:
            self._lazyckpt_close_writer(raise_errors=False)     # drain, but keep the original error
            self._lazyckpt_events.flush_after_error()   # the committed ones' on_save, as plain ran them
            self._lazyckpt_close_mirror(raise_errors=False)     # after the rotation it may delete
            raise
        failed = True
        try:
            self._lazyckpt_close_writer(raise_errors=True)
            self._lazyckpt_events.flush()
            failed = False
        finally:
            # Last: the final rotation's removals go to the persistent tier before it closes
            # (its own failure is raised unless another one is on its way already).
            self._lazyckpt_close_mirror(raise_errors=not failed)
        return output

    def _lazyckpt_resume_path(self) -> str:
        """``resume_from_checkpoint=True``: the newest complete local checkpoint; with
        a persistent tier and none here (a lost node), the store's newest, fetched."""
        mirror = self.lazyckpt_mirror
        if mirror is not None and hf_callbacks.last_complete_checkpoint(self.args.output_dir) is None:
            steps = {int(m.group(1)): n for n in mirror.complete_dirs(self.args.output_dir, _MARKER)
                     if (m := hf_callbacks.CHECKPOINT_DIR.match(n))}
            if steps:
                return self._lazyckpt_fetch(os.path.join(self.args.output_dir, steps[max(steps)]))
        return hf_callbacks.resolve_resume(self.args.output_dir)

    def _lazyckpt_fetch(self, checkpoint_dir: str) -> str:
        mirror = self.lazyckpt_mirror
        checkpoint_dir = os.path.abspath(checkpoint_dir)
        if os.path.basename(checkpoint_dir) not in mirror.complete_dirs(os.path.dirname(checkpoint_dir), _MARKER):
            return checkpoint_dir           # not on the store either: Trainer's own error follows
        mirror.fetch_dir(checkpoint_dir)
        log.info("lazyckpt: %s: fetched from the persistent tier %s", checkpoint_dir, mirror.key(checkpoint_dir))
        return checkpoint_dir

    def _lazyckpt_rotated(self, run_dir: str, removed: set, limit: Optional[int], best: Optional[str]) -> None:
        """Rotation removed ``removed`` from ``run_dir``: from the persistent tier too.
        After a resume from the store, the store also holds checkpoints this
        directory never had again (only the one resumed from was fetched): with
        a ``save_total_limit``, those older than every checkpoint kept here (the
        best one excepted) go too, as they would have gone here."""
        mirror = getattr(self, "_lazyckpt_mirror", None)
        if mirror is None:
            return
        for name in sorted(removed):
            mirror.removed_dir(os.path.join(run_dir, name), _MARKER)
        kept = [int(m.group(1)) for n in os.listdir(run_dir) if (m := hf_callbacks.CHECKPOINT_DIR.match(n))]
        if limit and limit > 0 and kept:
            oldest, best_name = min(kept), os.path.basename(best) if best else None

            def doomed(name: str) -> bool:
                m = hf_callbacks.CHECKPOINT_DIR.match(name)
                return m is not None and int(m.group(1)) < oldest and name != best_name
            mirror.removed_dirs_where(run_dir, _MARKER, doomed)

    # ------------------------------------------------------------------ saving

    def _lazyckpt_supported(self) -> bool:
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
        unsupported = (getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
                       or is_torch_xla_available() or is_sagemaker_mp_enabled())
        if unsupported:                     # refused in __init__; set later by hand: refuse here too
            hf_callbacks.refuse_after_init(self)
        return True

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if not self._lazyckpt_supported():
            return super()._save_checkpoint(model, trial)
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        try:
            from transformers.trainer_utils import SaveStrategy
            strategies = [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST]
        except ImportError:
            from transformers.trainer_utils import IntervalStrategy
            strategies = [IntervalStrategy.STEPS, IntervalStrategy.EPOCH]

        writer = self.lazyckpt_writer
        writer.raise_errors()                    # a failed earlier checkpoint stops the run here
        hf_callbacks.guard_in_place_changes(self)  # optimizer.train()/eval(), model.train()/eval() wait
        args, state = self.args, self.state
        folder = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if getattr(self, "hp_search_backend", None) is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, folder)

        best_step = getattr(state, "best_global_step", None)
        if args.save_strategy in strategies and best_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            # The checkpoint queued now (or earlier) counts although it is not committed yet.
            if best_step == state.global_step or os.path.exists(best_dir) \
                    or writer.pending(best_dir):
                state.best_model_checkpoint = best_dir

        # Layout: "hf" writes the plain Trainer's files (hf_layout), "lazyckpt" one file.
        hf_format = getattr(self, "lazyckpt_checkpoint_format", "hf") == "hf"
        rng = rng_state(args) if hf_format else _rng_state()
        if args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, rng)
            rngs = {i: s for i, s in enumerate(gathered)}
        else:
            rngs = {args.process_index: rng}

        if not args.should_save:
            return
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks[name], list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"

        files = {"trainer_state.json": trainer_state}
        if not hf_format:
            payload: Dict[str, Any] = {"format": FORMAT_TAG, "global_step": state.global_step,
                                       "model": self.model.state_dict(), "rng": rngs,
                                       "trainer_state": trainer_state}
            if not args.save_only_model:
                payload["optimizer"] = self.optimizer.state_dict()
                if self.lr_scheduler is not None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")     # "please also save the optimizer state"
                        payload["scheduler"] = self.lr_scheduler.state_dict()
                scaler = getattr(self.accelerator, "scaler", None)
                if scaler is not None:
                    payload["scaler"] = scaler.state_dict()
            config = getattr(self.model, "config", None)
            if config is not None and hasattr(config, "to_json_string"):
                files["config.json"] = config.to_json_string()

        make_dirs_durable(run_dir)             # output_dir's own entry survives a power loss too
        if run_dir not in getattr(self, "_lazyckpt_cleaned", set()):
            self._lazyckpt_cleaned = getattr(self, "_lazyckpt_cleaned", set()) | {run_dir}
            clean_sibling_temps(run_dir, writer.options.lease_expiry_s)
        # Created by the save itself when it starts, with its leased data file in it.
        staging = sibling_temp(output_dir)
        best = state.best_model_checkpoint
        limit = args.save_total_limit

        mirror = self.lazyckpt_mirror if args.should_save else None
        if mirror is not None:
            mirror.raise_errors()
            mirror.sync_dirs(run_dir, _MARKER, hf_callbacks.CHECKPOINT_DIR.match)

        def on_commit(_pending: Any) -> None:
            # Rotation, push_to_hub and on_save run later, on the training thread (hf_callbacks).
            _commit_directory(staging, output_dir, files)
            if mirror is not None:
                mirror.uploaded_dir(output_dir, _MARKER)    # trainer_state.json last: complete there

        if hf_format:                           # every file of it through the engine but the small ones
            pending = queue_hf_checkpoint(self, writer, staging, output_dir, rngs,
                                          getattr(self, "lazyckpt_max_shard_size", "50GB"), on_commit)
        else:
            pending = writer.save(payload, os.path.join(staging, CHECKPOINT_FILE),
                                  metadata={"global_step": state.global_step, "format": FORMAT_TAG},
                                  on_commit=on_commit, final_path=output_dir)
        self._lazyckpt_events.queued(pending, output_dir, run_dir, limit, best, push=bool(args.push_to_hub))
        if self._lazyckpt_in_jit:
            # transformers removes the JIT "incomplete" marker when this returns, and training
            # stops right after: commit first (the commit replaces the marked directory).
            self.lazyckpt_wait()
            self._lazyckpt_events.flush()

    # ------------------------------------------------------------------ loading

    def _lazyckpt_file(self, checkpoint: Optional[str]) -> Optional[str]:
        if checkpoint is None or not self._lazyckpt_supported():
            return None
        writer = getattr(self, "_lazyckpt_writer", None)
        if writer is not None:
            writer.wait(raise_errors=False)       # resuming from a checkpoint still being written
        path = os.path.join(checkpoint, CHECKPOINT_FILE)
        return path if os.path.isfile(path) else None

    def _lazyckpt_read(self, path: str, keys: list) -> Dict[str, Any]:
        return self.lazyckpt_writer.load(path, keys=keys, map_location="cpu",
                                         allow_pickle=getattr(self, "lazyckpt_allow_pickle", False))

    def _lazyckpt_load_model(self, path: str, model: Any) -> None:
        state = self._lazyckpt_read(path, ["model"])["model"]
        result = model.load_state_dict(state, strict=False)
        self._issue_warnings_after_load(result)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = self._lazyckpt_file(resume_from_checkpoint)
        if path is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        log.info("lazyckpt: loading model from %s", path)
        self._lazyckpt_load_model(path, self.model if model is None else model)

    def _load_best_model(self) -> None:
        path = self._lazyckpt_file(self.state.best_model_checkpoint)
        if path is None:
            return super()._load_best_model()
        log.info("lazyckpt: loading best model from %s (score: %s)", path, self.state.best_metric)
        self._lazyckpt_load_model(path, self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        path = self._lazyckpt_file(checkpoint)
        if path is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        try:
            state = self._lazyckpt_read(path, ["optimizer"])
        except MissingKeyError:
            return                                  # saved with save_only_model
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            try:
                scheduler = self._lazyckpt_read(path, ["scheduler"])["scheduler"]
            except MissingKeyError:
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.lr_scheduler.load_state_dict(scheduler)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        path = self._lazyckpt_file(checkpoint)
        if path is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None:
            return
        try:
            scaler.load_state_dict(self._lazyckpt_read(path, ["scaler"])["scaler"])
        except MissingKeyError:
            pass

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        path = self._lazyckpt_file(checkpoint)
        if path is None:
            return super()._load_rng_state(checkpoint)
        index = self.args.process_index
        try:
            rng = self._lazyckpt_read(path, [("rng", index)])["rng"][index]
        except MissingKeyError:
            log.info("lazyckpt: %s has no RNG state for process %d; reproducibility is not guaranteed",
                     path, index)
            return
        from transformers.training_args import ParallelMode
        _set_rng_state(rng, self.args.parallel_mode == ParallelMode.DISTRIBUTED)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # Best-model loading and the final rotation below need committed checkpoints, and
        # the last on_save calls (hf_callbacks) run here, on the training thread, before them.
        self.lazyckpt_wait()
        self._lazyckpt_events.flush()
        return super()._finalize_training(*args, **kwargs)


def _rng_state() -> Dict[str, Any]:
    """This process's RNG states, as ``Trainer._save_rng_state`` collects them."""
    states: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _set_rng_state(states: Dict[str, Any], distributed: bool) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if distributed or len(cuda) == torch.cuda.device_count():
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda[0])


def _commit_directory(staging: str, final: str, files: Dict[str, str]) -> None:
    """Runs in the background once the data file is durable: add the JSON files,
    then make the complete staging directory ``checkpoint-<step>``."""
    for name, text in files.items():
        write_file_atomic(os.path.join(staging, name), text.encode("utf-8"))
    fsync_dir(staging)
    parent = os.path.dirname(final)
    old = None
    if os.path.lexists(final):              # the same step saved again: replace it
        old = sibling_temp(final + "-replaced")
        os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _make_trainer_class(name: str) -> type:
    try:
        from transformers import Trainer
    except ImportError as exc:
        raise ImportError("lazyckpt.integrations.huggingface.LazyCheckpointTrainer needs "
                          "transformers (pip install 'lazyckpt[hf]')") from exc
    return type(name, (LazyCheckpointMixin, Trainer),
                {"__module__": __name__, "__qualname__": name,
                 "__doc__": "``transformers.Trainer`` with asynchronous lazyckpt "
                            "checkpoints (see :class:`LazyCheckpointMixin`)."})


__getattr__ = lazy_classes(__name__, ["LazyCheckpointTrainer"], _make_trainer_class)
