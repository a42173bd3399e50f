"""What makes Lightning see a lazyckpt checkpoint only once it is committed.

A ``CheckpointIO`` is told "save", "remove" and nothing else, while
``ModelCheckpoint`` checks names, removes the old top-k file, links
``last.ckpt`` and notifies the loggers right after ``save_checkpoint``
returns: with an asynchronous save, before the file exists. Lightning has no
hook for this, so the first use of a plugin class wraps a few methods of that
tree's classes. Every wrapper first asks whether the trainer's
``CheckpointIO`` is a lazyckpt plugin and otherwise calls the original
unchanged, so trainers with another plugin behave exactly as before.

* ``ModelCheckpoint.file_exists``: a name with a pending save or link is
  taken; a name whose removal is pending is free (as it is at once with the
  default plugin), so ``-vN`` names match the default's.
* ``ModelCheckpoint._link_checkpoint``: ``last.ckpt`` is re-pointed (atomic
  symlink replace, directory fsync) once its target is durable.
* ``ModelCheckpoint._save_checkpoint``: the loggers' ``after_save_checkpoint``
  (``log_model``) runs once the file is durable, on the training thread, with
  the callback's state as it was at the save.
* ``best_model_path``, ``last_model_path``, ``best_k_models`` and the scores
  read outside ``ModelCheckpoint``'s own methods are the newest state whose
  files are all durable (inside them, the real state: the bookkeeping and the
  saved ``callbacks`` state are the default's).
* ``trainer.call._call_callback_hooks`` / ``_call_lightning_module_hook`` /
  ``_call_strategy_hook("training_step")``: the safe points. Each runs the
  deferred actions that are due (removals, links, notifications: in the order
  ``ModelCheckpoint`` asked for them) and, while a capture is pending, waits
  for it before a hook that user code overrides (callbacks other than
  Lightning's read-only ones, every overridden ``LightningModule`` hook but
  the evaluation steps, ``training_step`` under manual optimization).
* ``Trainer.save_checkpoint``: tells the plugin which trainer asks, so a save
  inside a running ``fit``/``validate``/``test`` is asynchronous and one after
  it is durable when it returns.
* ``pl_load`` of ``core.saving`` (``load_from_checkpoint``) and of fabric's
  ``TorchCheckpointIO`` (a Trainer without the plugin): only when it fails on
  a ``file_format="lazyckpt"`` file, whose header torch.load reads as a legacy
  pickle and then advises ``weights_only=False`` (no help), the error names
  what reads it: the plugin, or ``lazyckpt.load``.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import re
import threading
import weakref
from typing import Any, Dict, Tuple

from lazyckpt.errors import WrongReaderError
from ._async import is_lazyckpt_file

# ModelCheckpoint attributes that name files (with their scores): one view.
VIEW_ATTRS = ("best_model_path", "last_model_path", "best_k_models", "kth_best_model_path", "kth_value",
              "best_model_score", "current_score")
_NO_WAIT_MODULE_HOOKS = frozenset({"validation_step", "test_step", "predict_step"})

_installed: set = set()
_install_lock = threading.Lock()


def install(tree: str, impl: type) -> None:
    """Wrap the methods of the ``tree`` package (``lightning.pytorch`` or ``pytorch_lightning``) once."""
    with _install_lock:
        if tree in _installed:
            return
        _installed.add(tree)
        mc_cls = importlib.import_module(f"{tree}.callbacks.model_checkpoint").ModelCheckpoint
        call = importlib.import_module(f"{tree}.trainer.call")
        trainer_cls = importlib.import_module(f"{tree}.trainer.trainer").Trainer
        callbacks = importlib.import_module(f"{tree}.callbacks")
        module_cls = importlib.import_module(tree).LightningModule
        read_only = tuple(getattr(callbacks, n) for n in (
            "Checkpoint", "ProgressBar", "ModelSummary", "LearningRateMonitor", "Timer", "EarlyStopping",
            "DeviceStatsMonitor", "ThroughputMonitor") if hasattr(callbacks, n))
        callback_base = callbacks.Callback

        def plugin_of(trainer: Any) -> Any:
            io = getattr(getattr(trainer, "strategy", None), "_checkpoint_io", None)
            return io if isinstance(io, impl) else None

        _wrap_trainer(trainer_cls, plugin_of)
        _wrap_calls(call, plugin_of, read_only, callback_base, module_cls)
        _wrap_model_checkpoint(mc_cls, plugin_of)
        fabric = "lightning.fabric" if tree == "lightning.pytorch" else "lightning_fabric"
        plugin = "LazyCheckpointIO" if tree == "lightning.pytorch" else "PLLazyCheckpointIO"
        for name in (f"{tree}.core.saving", f"{fabric}.plugins.io.torch_io"):
            module = importlib.import_module(name)
            if hasattr(module, "pl_load"):
                module.pl_load = _naming_lazyckpt_files(module.pl_load, plugin)


# --------------------------------------------------------------------------- torch.load of a lazyckpt file


class TorchLoadOfLazyckptError(WrongReaderError, pickle.UnpicklingError):
    """Lightning's loader (torch.load) was given a lazyckpt file; an
    UnpicklingError too, which is what torch.load raised for it."""


def _naming_lazyckpt_files(load: Any, plugin: str) -> Any:
    """``load`` (Lightning's ``pl_load``) whose failure on a lazyckpt file says
    what reads it; every other call and failure is the original's."""
    if getattr(load, "_lazyckpt_names_files", False):
        return load

    @functools.wraps(load)
    def pl_load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return load(path_or_url, *args, **kwargs)
        except Exception as exc:
            if not isinstance(path_or_url, (str, os.PathLike)) or not _is_lazyckpt(os.fspath(path_or_url)):
                raise
            path = os.fspath(path_or_url)
            raise TorchLoadOfLazyckptError(
                f"{path} is a lazyckpt file (written by lazyckpt's Lightning plugin with "
                f"file_format='lazyckpt'): torch.load cannot read it, whatever weights_only says. Read it "
                f"through the plugin, trainer = Trainer(plugins=[{plugin}()]) then trainer.fit/validate/"
                f"test(model, ckpt_path=...), or as a dict with lazyckpt.load({path!r}) "
                f"(model.load_state_dict(lazyckpt.load(path)['state_dict'])). For checkpoints that "
                f"load_from_checkpoint and torch.load read, save with {plugin}(file_format='torch') "
                f"(the default)", path=path) from exc
    pl_load._lazyckpt_names_files = True        # type: ignore[attr-defined]
    return pl_load


def _is_lazyckpt(path: str) -> bool:
    try:
        return is_lazyckpt_file(path)
    except Exception:
        return False


# --------------------------------------------------------------------------- safe points


def _note_trainer(plugin: Any, trainer: Any) -> None:
    ref = plugin._last_trainer
    if ref is None or ref() is not trainer:
        plugin._last_trainer = weakref.ref(trainer)


def _wrap_trainer(trainer_cls: type, plugin_of: Any) -> None:
    original = trainer_cls.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        plugin = plugin_of(self)
        if plugin is None:
            return original(self, *args, **kwargs)
        _note_trainer(plugin, self)
        plugin.run_due_actions()
        plugin._trainer_call.trainer = self
        try:
            return original(self, *args, **kwargs)
        finally:
            plugin._trainer_call.trainer = None

    trainer_cls.save_checkpoint = save_checkpoint


def _wrap_calls(call: Any, plugin_of: Any, read_only: Tuple[type, ...], callback_base: type,
                module_cls: type) -> None:
    overrides: Dict[Tuple[type, str], bool] = {}

    def overridden(obj: Any, hook: str, base: type) -> bool:
        key = (type(obj), hook)
        if key not in overrides:
            overrides[key] = getattr(type(obj), hook, None) is not getattr(base, hook, None)
        return overrides[key]

    def safe_point(trainer: Any, may_mutate: Any) -> None:
        plugin = plugin_of(trainer)
        if plugin is None:
            return
        _note_trainer(plugin, trainer)
        plugin.run_due_actions()
        if plugin._writer is not None and may_mutate() and plugin.capturing():
            plugin.wait_for_snapshot()

    original_callbacks = call._call_callback_hooks
    original_module = call._call_lightning_module_hook
    original_strategy = call._call_strategy_hook

    @functools.wraps(original_callbacks)
    def _call_callback_hooks(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        safe_point(trainer, lambda: any(not isinstance(cb, read_only) and overridden(cb, hook_name, callback_base)
                                        for cb in trainer.callbacks))
        return original_callbacks(trainer, hook_name, *args, **kwargs)

    @functools.wraps(original_module)
    def _call_lightning_module_hook(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        def may_mutate() -> bool:
            module = kwargs.get("pl_module") or trainer.lightning_module
            return hook_name not in _NO_WAIT_MODULE_HOOKS and module is not None and \
                overridden(module, hook_name, module_cls)
        safe_point(trainer, may_mutate)
        return original_module(trainer, hook_name, *args, **kwargs)

    @functools.wraps(original_strategy)
    def _call_strategy_hook(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
        if hook_name == "training_step":
            # Under automatic optimization training_step runs inside optimizer.step(),
            # after the step pre-hook waited; manual optimization calls it directly.
            safe_point(trainer, lambda: not trainer.lightning_module.automatic_optimization)
        return original_strategy(trainer, hook_name, *args, **kwargs)

    call._call_callback_hooks = _call_callback_hooks
    call._call_lightning_module_hook = _call_lightning_module_hook
    call._call_strategy_hook = _call_strategy_hook


# --------------------------------------------------------------------------- ModelCheckpoint


class _ViewAttr:
    """A ModelCheckpoint attribute: the real value inside its own methods (and
    while no lazyckpt save is pending), the committed view outside them."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        d = obj.__dict__
        view = d.get("_lazyckpt_view")
        if view is not None and not d.get("_lazyckpt_inside"):
            return view[self.name]
        try:
            return d[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value


def _snapshot(mc: Any) -> Dict[str, Any]:
    d = mc.__dict__
    out = {a: d.get(a) for a in VIEW_ATTRS}
    if isinstance(out["best_k_models"], dict):
        out["best_k_models"] = dict(out["best_k_models"])
    return out


def _paths(view: Dict[str, Any]) -> set:
    out = {view["best_model_path"], view["last_model_path"], view["kth_best_model_path"]}
    out.update(view["best_k_models"] or ())
    return {p for p in out if p}


def _abs(paths: set, plugin: Any) -> set:
    return {plugin.location(p) for p in paths}


def refresh_view(mc: Any, plugin: Any) -> None:
    """Advance the committed view of ``mc`` past every snapshot whose files are durable."""
    d = mc.__dict__
    queue = d.get("_lazyckpt_queue")
    if not queue and d.get("_lazyckpt_view") is None:
        return
    pending = plugin.pending_paths()
    while queue and not (_abs(_paths(queue[0]), plugin) & pending):
        d["_lazyckpt_view"] = queue.pop(0)
    if not queue and not (_abs(_paths(_snapshot(mc)), plugin) & pending):
        d.pop("_lazyckpt_view", None)          # nothing pending: outside readers see the real state


def _enter(mc: Any) -> None:
    d = mc.__dict__
    d["_lazyckpt_inside"] = d.get("_lazyckpt_inside", 0) + 1


def _exit(mc: Any) -> None:
    d = mc.__dict__
    d["_lazyckpt_inside"] -= 1
    if d["_lazyckpt_inside"]:
        return
    plugin = _plugin_of_mc.get(mc)
    if plugin is None:
        return
    real = _snapshot(mc)
    if _abs(_paths(real), plugin) & plugin.pending_paths():
        d.setdefault("_lazyckpt_queue", []).append(real)
        if d.get("_lazyckpt_view") is None:
            d["_lazyckpt_view"] = d.pop("_lazyckpt_outside", None) or real
        plugin._views.add(mc)
    refresh_view(mc, plugin)


def _inside(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        d = self.__dict__
        if not d.get("_lazyckpt_inside"):
            d["_lazyckpt_outside"] = d.get("_lazyckpt_view") or _snapshot(self)   # what outside readers saw
        _enter(self)
        try:
            return fn(self, *args, **kwargs)
        finally:
            _exit(self)
    return wrapper


# ModelCheckpoint -> its trainer's plugin, weak both ways and outside the
# callback's __dict__: a weakref there made a fitted Trainer unpicklable
# (torch.save(trainer), ddp_spawn).
class _WeakValueOf(weakref.WeakKeyDictionary):
    """A WeakKeyDictionary whose values are weak too: it keeps neither the callback nor the plugin alive."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, weakref.ref(value))

    def get(self, key: Any, default: Any = None) -> Any:
        ref = super().get(key)
        return ref() if ref is not None else default


_plugin_of_mc = _WeakValueOf()


def _attach(mc: Any, plugin: Any) -> None:
    if _plugin_of_mc.get(mc) is not plugin:
        _plugin_of_mc[mc] = plugin


def _wrap_model_checkpoint(mc_cls: type, plugin_of: Any) -> None:
    for name, value in list(vars(mc_cls).items()):
        if callable(value) and not isinstance(value, (staticmethod, classmethod, type)) \
                and not name.startswith("__") and name not in ("file_exists", "_link_checkpoint"):
            setattr(mc_cls, name, _inside(value))
    for name in VIEW_ATTRS:
        setattr(mc_cls, name, _ViewAttr(name))

    original_exists = mc_cls.file_exists

    @functools.wraps(original_exists)
    def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
        plugin = plugin_of(trainer)
        if plugin is None:
            return original_exists(self, filepath, trainer)
        _attach(self, plugin)
        local = plugin.path_taken(str(filepath), lambda: self._fs.exists(filepath)) if trainer.is_global_zero \
            else False
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    original_link = mc_cls.__dict__["_link_checkpoint"].__func__

    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        plugin = plugin_of(trainer)
        if plugin is None:
            return original_link(trainer, filepath, linkpath)
        if trainer.is_global_zero and plugin.location(filepath) != plugin.location(linkpath):
            plugin.link_checkpoint(filepath, linkpath)
        trainer.strategy.barrier()

    original_save = mc_cls._save_checkpoint      # already wrapped by _inside

    @_inside
    def _save_checkpoint(self: Any, trainer: Any, filepath: str) -> None:
        plugin = plugin_of(trainer)
        if plugin is None:
            return original_save(self, trainer, filepath)
        _attach(self, plugin)
        # Lightning 2.x's ModelCheckpoint._save_checkpoint, the loggers deferred.
        trainer.save_checkpoint(filepath, self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero and self.save_last and not self.__dict__.get("_lazyckpt_saving_last"):
            # A top-k file: last.ckpt names it from the instant it is published,
            # before Lightning asks (after save_checkpoint returns: a kill in between, with
            # the file committed, would resume from the step before).
            last = self.last_model_path or self.format_checkpoint_name(self._monitor_candidates(trainer),
                                                                       self.CHECKPOINT_NAME_LAST)
            plugin.stand_in(filepath, last, new_name=not self.last_model_path)
        if trainer.is_global_zero and trainer.loggers:
            plugin.after_pending_saves(functools.partial(_notify_loggers, self, trainer, _snapshot(self)))

    original_save_last = mc_cls._save_last_checkpoint      # already wrapped by _inside

    @functools.wraps(original_save_last)
    def _save_last_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
        d = self.__dict__
        d["_lazyckpt_saving_last"] = d.get("_lazyckpt_saving_last", 0) + 1
        try:
            return original_save_last(self, *args, **kwargs)
        finally:
            d["_lazyckpt_saving_last"] -= 1

    original_find_last = mc_cls._find_last_checkpoints      # already wrapped by _inside

    @functools.wraps(original_find_last)
    def _find_last_checkpoints(self: Any, trainer: Any) -> set:
        found = original_find_last(self, trainer)
        plugin = plugin_of(trainer)
        if found or plugin is None or plugin.mirror is None:
            return found
        # ckpt_path="last" with no local last file: the persistent tier's (a lost node).
        directory = self._ModelCheckpoint__resolve_ckpt_dir(trainer)
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?{re.escape(self.FILE_EXTENSION)}$")
        return plugin.fetch_from_store(str(directory), pattern.match)

    mc_cls._find_last_checkpoints = _find_last_checkpoints
    mc_cls._save_last_checkpoint = _save_last_checkpoint
    mc_cls.file_exists = file_exists
    mc_cls._link_checkpoint = staticmethod(_link_checkpoint)
    mc_cls._save_checkpoint = _save_checkpoint


def _notify_loggers(mc: Any, trainer: Any, view: Dict[str, Any]) -> None:
    """``logger.after_save_checkpoint`` as the default plugin calls it, with the
    callback's state as it was at that save; its files are durable now."""
    d = mc.__dict__
    saved_view, saved_inside = d.get("_lazyckpt_view"), d.get("_lazyckpt_inside", 0)
    d["_lazyckpt_view"], d["_lazyckpt_inside"] = view, 0
    try:
        for logger in trainer.loggers:
            logger.after_save_checkpoint(weakref.proxy(mc))
    finally:
        d["_lazyckpt_inside"] = saved_inside
        if saved_view is None:
            d.pop("_lazyckpt_view", None)
        else:
            d["_lazyckpt_view"] = saved_view
