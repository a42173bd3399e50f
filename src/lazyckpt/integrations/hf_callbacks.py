"""When the Hugging Face Trainer sees a lazyckpt checkpoint, and what waits for its capture.

:class:`~lazyckpt.integrations.huggingface.LazyCheckpointMixin` queues a
checkpoint and returns; this module keeps the plain ``Trainer``'s contract
around that:

* **Callbacks after the commit.** ``Trainer`` calls ``callback_handler.on_save``
  right after ``_save_checkpoint``. :class:`CommittedSaveEvents` holds that
  call back until ``checkpoint-<step>/`` is committed and durable. When a
  callback overrides ``on_save`` (other than transformers' own reporting
  callbacks, whose ``on_save`` sets no flag), it may set control flags
  (``should_training_stop``, ``should_save``, ...) that the training loop
  checks right after, so the call waits there for the commit and runs then,
  where the plain ``Trainer`` runs it: the flags act at the same step (a
  failed save is raised there). Otherwise nothing waits: the call runs on the
  training thread at the next safe point, before the next callback event
  (``on_step_begin``, ``on_pre_optimizer_step``, ..., ``on_train_end``) or at
  the end of training, whichever comes first. The callbacks get the
  ``TrainerState`` as it was at the save (``state.global_step`` names the
  directory, as W&B, MLflow, ClearML, Flyte and DVCLive read it); the
  ``TrainerControl`` they change is the live one. A save that failed fires no
  ``on_save``: its error is raised at the next checkpoint or when ``train()``
  ends, if not already.
* **Rotation** (``save_total_limit``) runs there too, on the training thread,
  per committed checkpoint in order, as the plain ``Trainer`` does: push,
  rotate, ``on_save``. Only committed checkpoints are counted or deleted, and
  the rotation of checkpoint N leaves out this trainer's later ones, so
  ``on_save(N)`` finds the checkpoints up to N that the plain ``Trainer``
  keeps (when it waited, exactly those; when deferred, later committed ones
  may be there too), and a checkpoint is never deleted before its own
  ``on_save`` has run.
* **In-place changes outside ``optimizer.step``** (:func:`guard_in_place_changes`):
  ``optimizer.train()`` / ``optimizer.eval()`` (schedule-free optimizers swap
  every parameter in place; ``Trainer`` calls them in ``training_step`` and in
  the evaluation loop), ``model.train()`` / ``model.eval()`` (modules whose
  ``train(mode)`` re-parameterizes weights) and LOMO's ``fused_backward``
  (updates the weights during backward, with no ``optimizer.step``) wait for
  a pending capture. Only an actual mode switch waits, so the per-step
  ``model.train()`` / ``optimizer.train()`` calls cost nothing.
* **JIT checkpoints** (``enable_jit_checkpoint=True``): transformers creates
  ``checkpoint-<step>/`` with ``checkpoint-is-incomplete.txt`` in it, calls
  ``_save_checkpoint`` and removes the marker when it returns. Here that save
  returns only once committed (the commit replaces the marked directory, so
  the marker goes with it), and ``train(resume_from_checkpoint=True)`` skips
  checkpoint directories that are marked incomplete or have no
  ``trainer_state.json`` (:func:`last_complete_checkpoint`): a kill at any
  instant resumes from the last complete checkpoint.
* **Refusals** (:func:`refuse_unsupported`): DeepSpeed, FSDP, XLA, SageMaker
  model parallelism and ``push_to_hub`` with the ``"lazyckpt"`` format raise a
  ``ValueError`` that says why and what to use, instead of quietly falling
  back to synchronous saves.

Whatever else changes checkpointed tensors in place between a save and the
next optimizer step (an EMA or SWA swap in a callback's ``on_step_begin``, a
custom ``training_step``) must call ``trainer.lazyckpt_wait_for_snapshot()``
first. Changes made after the optimizer step (``on_optimizer_step``,
``on_step_end``) need nothing: the optimizer step already waited.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import re
import shutil
import weakref
from typing import AbstractSet, Any, Deque, List, Optional

from lazyckpt.errors import CheckpointNotFoundError

log = logging.getLogger("lazyckpt")

__all__ = ["CommittedSaveEvents", "guard_in_place_changes", "last_complete_checkpoint", "refuse_unsupported",
           "INCOMPLETE_MARKER"]

#: transformers' JIT checkpoint marker (trainer_jit_checkpoint.py).
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


# --------------------------------------------------------------------------- on_save after the commit

@dataclasses.dataclass(eq=False, slots=True)     # eq=False: events are told apart by identity
class _SaveEvent:
    """One queued checkpoint: what to do on the training thread once it is committed."""

    handle: Any                         # None: committed before _save_checkpoint returned
    output_dir: str
    run_dir: str
    state: Any
    limit: Optional[int]
    best: Optional[str]
    push: bool
    args: Any = None
    on_save: bool = False               # Trainer asked for on_save for it
    flushed: bool = False

    def done(self) -> bool:
        return self.handle is None or self.handle.done()

    def failed(self) -> bool:
        return self.handle is not None and self.handle.error is not None


class CommittedSaveEvents:
    """Defers ``on_save`` and rotation of a trainer's queued checkpoints until
    they are committed; see the module docstring."""

    def __init__(self, trainer: Any):
        self._trainer = weakref.ref(trainer)
        self._queue: Deque[_SaveEvent] = collections.deque()
        self._just_queued: Optional[_SaveEvent] = None
        self._flushing = False
        handler = trainer.callback_handler
        # Instance attributes: CallbackHandler's on_* methods call self.call_event.
        self._on_save, self._call_event = handler.on_save, handler.call_event
        handler.on_save = self._deferred_on_save
        handler.call_event = self._call_event_at_safe_point

    def queued(self, handle: Any, output_dir: str, run_dir: str, limit: Optional[int],
               best: Optional[str], push: bool = False) -> None:
        """``_save_checkpoint`` queued ``output_dir`` (``handle`` is its last save;
        ``push``: push it to the Hub once committed, as ``args.push_to_hub`` asks)."""
        trainer = self._trainer()
        # A shallow copy: global_step, epoch, best_metric as at the save (callbacks name the
        # directory from state.global_step); log_history and the rest stay shared.
        event = _SaveEvent(handle, output_dir, run_dir, copy.copy(trainer.state), limit, best, push)
        self._queue.append(event)
        self._just_queued = event

    def pending(self) -> int:
        return len(self._queue)

    def flush(self, wait: bool = False) -> None:
        """Run rotation and ``on_save`` of the committed checkpoints, in order
        (``wait``: wait for every queued one first). Training thread only."""
        if self._flushing:
            return
        self._flushing = True
        try:
            if wait:
                for event in list(self._queue):
                    if event.handle is not None:
                        event.handle._done.wait()
            batch: List[_SaveEvent] = []
            while self._queue and self._queue[0].done():
                batch.append(self._queue.popleft())
            committed = [e for e in batch if not e.failed()]     # a failure is raised by the writer
            for event in batch:
                event.flushed = True
            if not committed:
                return
            trainer = self._trainer()
            for i, event in enumerate(committed):    # the plain Trainer's order: push, rotate, on_save
                if event.push:
                    trainer._push_from_checkpoint(event.output_dir)
                # Rotate as the plain Trainer did when this one was the newest: the ones saved
                # after it (committed or not) are neither counted nor deleted.
                later = {os.path.abspath(e.output_dir) for e in committed[i + 1:] + list(self._queue)}
                rotate(trainer, event.run_dir, event.limit, event.best,
                       hidden=later - {os.path.abspath(event.output_dir)})
                self._fire(event)
        finally:
            self._flushing = False

    def flush_after_error(self) -> None:
        """``train()`` is raising: run what the committed checkpoints are owed
        (the plain Trainer ran their ``on_save`` already); log, do not raise,
        a failure here, so that the original error is the one raised."""
        try:
            self.flush()
        except Exception as exc:
            log.error("lazyckpt: on_save or rotation after a failed train() raised %s: %s",
                      type(exc).__name__, exc)
        self._queue.clear()
        self._just_queued = None

    def _callbacks(self) -> List[Any]:
        return self._trainer().callback_handler.callbacks

    def _fire(self, event: _SaveEvent) -> None:
        if not event.on_save:
            return
        trainer = self._trainer()
        trainer.control = self._call_event("on_save", event.args, event.state, trainer.control)

    def _deferred_on_save(self, args: Any, state: Any, control: Any) -> Any:
        event, self._just_queued = self._just_queued, None
        if event is None or event.flushed:
            # Nothing queued by lazyckpt on this process (a rank that does not save), or
            # already committed and rotated: the plain Trainer's call, now.
            return self._on_save(args, state, control)
        control.should_save = False                 # as CallbackHandler.on_save, at once
        event.on_save, event.args = True, args
        trainer = self._trainer()
        if any(_may_set_control_flags(cb) for cb in self._callbacks()):
            # Its control flags (should_training_stop, ...) must reach the loop's checks of
            # this step, as the plain Trainer's: wait for the commit, then run it here.
            trainer.lazyckpt_wait()
        self.flush()                                # committed: run it now
        return trainer.control

    def _call_event_at_safe_point(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._queue and not self._flushing:
            self.flush()
        return self._call_event(event, args, state, control, **kwargs)


def _may_set_control_flags(callback: Any) -> bool:
    """Whether ``callback.on_save`` may set control flags: it overrides ``on_save`` and
    is not one of transformers' reporting callbacks (W&B, MLflow, ClearML, ...), whose
    ``on_save`` reads ``checkpoint-<step>/`` and returns no flag."""
    from transformers import TrainerCallback
    on_save = getattr(type(callback), "on_save", TrainerCallback.on_save)
    if on_save is TrainerCallback.on_save:
        return False
    return getattr(on_save, "__module__", "").split(".")[0] != "transformers"


def rotate(trainer: Any, run_dir: str, limit: Optional[int], best: Optional[str],
           hidden: AbstractSet[str] = frozenset()) -> None:
    """The plain Trainer's ``save_total_limit`` rotation of ``run_dir``, without the
    checkpoints in ``hidden`` (absolute paths): neither counted nor deleted. What it
    removed is removed from the persistent tier too (``lazyckpt_persist``)."""
    if not trainer.args.should_save:
        return
    before = _checkpoint_dirs(run_dir)
    try:
        _rotate(trainer, run_dir, limit, best, hidden)
    finally:
        rotated = getattr(trainer, "_lazyckpt_rotated", None)
        if rotated is not None:
            rotated(run_dir, before - _checkpoint_dirs(run_dir), limit, best)


def _checkpoint_dirs(run_dir: str) -> set:
    try:
        return {n for n in os.listdir(run_dir) if CHECKPOINT_DIR.match(n)}
    except FileNotFoundError:
        return set()


def _rotate(trainer: Any, run_dir: str, limit: Optional[int], best: Optional[str],
            hidden: AbstractSet[str]) -> None:
    try:
        from transformers.trainer_utils import rotate_checkpoints, sort_checkpoints
    except ImportError:                             # transformers 4.x: a Trainer method
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        return
    if not hidden:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best,
                           use_mtime=True)
        return
    # rotate_checkpoints' rule, on the checkpoints it would have seen then.
    if limit is None or limit <= 0:
        return
    checkpoints = [c for c in sort_checkpoints(run_dir, use_mtime=True) if os.path.abspath(c) not in hidden]
    protected = {os.path.abspath(c) for c in checkpoints[-1:] + ([best] if best else [])}
    remaining = len(checkpoints)
    for checkpoint in checkpoints:
        if remaining <= max(limit, len(protected)):
            break
        if os.path.abspath(checkpoint) not in protected:
            shutil.rmtree(checkpoint, ignore_errors=True)
            remaining -= 1


# --------------------------------------------------------------------------- resume and JIT

def last_complete_checkpoint(folder: str) -> Optional[str]:
    """The newest ``checkpoint-<step>`` in ``folder`` that is complete: holds
    ``trainer_state.json`` (written last by the plain Trainer, renamed in with
    the whole directory by lazyckpt) and no JIT incomplete marker. Logs the
    newer ones it skips; None when there is no complete one."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return None
    steps = sorted(((int(m.group(1)), n) for n in names if (m := CHECKPOINT_DIR.match(n))
                    and os.path.isdir(os.path.join(folder, n))), reverse=True)
    for _, name in steps:
        path = os.path.join(folder, name)
        if os.path.isfile(os.path.join(path, "trainer_state.json")) \
                and not os.path.exists(os.path.join(path, INCOMPLETE_MARKER)):
            return path
        log.warning("lazyckpt: skipping %s: incomplete (no trainer_state.json, or %s in it)", path,
                    INCOMPLETE_MARKER)
    return None


class NoCheckpointToResumeError(CheckpointNotFoundError, ValueError):
    """The plain Trainer raises ``ValueError("No valid checkpoint found in output directory ...")``
    here; code that catches it to start fresh must keep working with lazyckpt."""


def resolve_resume(output_dir: str) -> str:
    """``resume_from_checkpoint=True``: the last complete checkpoint, or a clear error."""
    path = last_complete_checkpoint(output_dir)
    if path is None:
        raise NoCheckpointToResumeError(f"No valid checkpoint found in output directory ({output_dir}): "
                                        f"resume_from_checkpoint=True found no complete checkpoint-<step> "
                                        f"directory", path=output_dir)
    return path


def wrap_jit_checkpoint(trainer: Any) -> None:
    """Make transformers' JIT checkpoint wait for the commit (see the module docstring)."""
    for callback in trainer.callback_handler.callbacks:
        manager = getattr(callback, "jit_manager", None)
        if manager is None or getattr(manager, "_lazyckpt_wrapped", False):
            continue
        original = manager.execute_jit_checkpoint

        def execute_jit_checkpoint(original: Any = original) -> None:
            trainer._lazyckpt_in_jit = True
            try:
                original()
            finally:
                trainer._lazyckpt_in_jit = False
        manager.execute_jit_checkpoint = execute_jit_checkpoint
        manager._lazyckpt_wrapped = True


# --------------------------------------------------------------------------- in-place changes

def guard_in_place_changes(trainer: Any) -> None:
    """Before queueing a capture: make the Trainer's in-place mode switches of
    the current model and optimizer wait for it (idempotent)."""
    ref = weakref.ref(trainer)

    def wait_for_capture() -> None:
        owner = ref()
        writer = getattr(owner, "_lazyckpt_writer", None) if owner is not None else None
        if writer is not None and writer.capturing():
            writer.wait_for_snapshot()

    def capturing() -> bool:
        owner = ref()
        writer = getattr(owner, "_lazyckpt_writer", None) if owner is not None else None
        return writer is not None and writer.capturing()
    wait_for_capture.capturing = capturing          # type: ignore[attr-defined]

    optimizer = trainer.optimizer
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:     # AcceleratedOptimizer -> the real one
        seen.add(id(optimizer))
        _guard_optimizer(optimizer, wait_for_capture)
        optimizer = getattr(optimizer, "optimizer", None)
    model = trainer.model
    if model is not None and not getattr(model, "_lazyckpt_mode_guard", False):
        _guard_model(model, wait_for_capture)


def _guard_optimizer(optimizer: Any, wait_for_capture: Any) -> None:
    if getattr(optimizer, "_lazyckpt_mode_guard", False) or not hasattr(optimizer, "param_groups"):
        return
    for name, train_mode in (("train", True), ("eval", False)):
        method = getattr(optimizer, name, None)
        if not callable(method):
            continue

        def switch(*args: Any, _method: Any = method, _train_mode: bool = train_mode, **kwargs: Any) -> Any:
            groups = optimizer.param_groups
            # schedule-free keeps its mode in each group; an optimizer that does not is
            # assumed to change something whenever it is called.
            if any(g.get("train_mode", not _train_mode) != _train_mode for g in groups):
                wait_for_capture()
            return _method(*args, **kwargs)
        setattr(optimizer, name, switch)
    fused_backward = getattr(optimizer, "fused_backward", None)      # LOMO / AdaLOMO
    if callable(fused_backward):
        def guarded_fused_backward(*args: Any, **kwargs: Any) -> Any:
            wait_for_capture()
            return fused_backward(*args, **kwargs)
        optimizer.fused_backward = guarded_fused_backward
    optimizer._lazyckpt_mode_guard = True


def _guard_model(model: Any, wait_for_capture: Any) -> None:
    train = model.train            # nn.Module.eval() calls self.train(False): one hook for both

    def guarded_train(mode: bool = True) -> Any:
        # DDP's train() recurses into this module's train(), so wrapping the inner model suffices.
        # Trainer calls model.train() every step: look at the modules only while a capture runs.
        if wait_for_capture.capturing() and any(m.training != bool(mode) for m in model.modules()):
            wait_for_capture()
        return train(mode)
    model.train = guarded_train
    model._lazyckpt_mode_guard = True


# --------------------------------------------------------------------------- refusals

_USE_INSTEAD = ("Use transformers.Trainer (synchronous checkpoints), or drive the engine yourself with "
                "lazyckpt's {alt}")


def refuse_unsupported(args: Any, checkpoint_format: str) -> None:
    """Refuse, from the ``TrainingArguments`` alone (before the Trainer builds
    anything), what the lazyckpt Trainer cannot checkpoint itself."""
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        refuse_backend("DeepSpeed")
    if getattr(args, "fsdp", None) and args.fsdp not in ("", [], False):
        refuse_backend("FSDP")
    if getattr(args, "push_to_hub", False) and checkpoint_format != "hf":
        raise ValueError(
            "lazyckpt: push_to_hub=True with lazyckpt_checkpoint_format='lazyckpt' would push checkpoints "
            "without their weights (the Hub reads model.safetensors, which this format does not write). "
            "Use lazyckpt_checkpoint_format='hf' (each checkpoint is pushed once it is committed), or "
            "push_to_hub=False and call trainer.push_to_hub() after train().")


def refuse_backend(name: str) -> None:
    alternatives = {
        "DeepSpeed": "DeepSpeed engine (lazyckpt.integrations.deepspeed.enable(engine)) in your own loop",
        "FSDP": "torch.distributed.checkpoint storage (lazyckpt.integrations.dcp) in your own loop",
        "XLA": "Checkpointer on CPU copies of the state",
        "SageMaker model parallelism": "Checkpointer on each rank's state",
    }
    why = {
        "DeepSpeed": "the engine owns the sharded optimizer state and writes it with its own "
                     "engine.save_checkpoint",
        "FSDP": "the state is sharded across ranks and gathered by accelerate's FSDP save path",
    }.get(name, "the state lives outside this process's tensors")
    raise ValueError(f"lazyckpt: LazyCheckpointTrainer does not checkpoint {name} training ({why}; its "
                     f"checkpoints would silently be the plain Trainer's synchronous ones). "
                     + _USE_INSTEAD.format(alt=alternatives[name]) + ".")


def refuse_after_init(trainer: Any) -> None:
    """What only the built Trainer knows (an accelerate config file, the platform)."""
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
    if getattr(trainer, "is_deepspeed_enabled", False):
        refuse_backend("DeepSpeed")
    if getattr(trainer, "is_fsdp_enabled", False):
        refuse_backend("FSDP")
    if is_torch_xla_available():
        refuse_backend("XLA")
    if is_sagemaker_mp_enabled():
        refuse_backend("SageMaker model parallelism")
