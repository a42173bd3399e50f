"""A Lightning ``CheckpointIO`` that saves through lazyckpt, asynchronously.

Lightning ships two class trees that reject each other's plugins, so there are
two classes over one implementation, each created on first access (importing
this module imports neither framework)::

    from lazyckpt.integrations.lightning import LazyCheckpointIO      # import lightning.pytorch as L
    from lazyckpt.integrations.lightning import PLLazyCheckpointIO    # import pytorch_lightning as pl

    trainer = L.Trainer(plugins=[LazyCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="path/to/epoch=0-step=10.ckpt")      # resume

**Storage.** Every path Lightning passes (``.../epoch=0-step=10.ckpt``) becomes
one lazyckpt file at exactly that path, written under a hidden temporary name
in the same directory and renamed into place once durable (fsync of the file
and of the directory). ``ModelCheckpoint``'s naming, top-k removal, ``last``
links and ``Trainer(ckpt_path=...)`` therefore work unchanged. A path that
holds an ordinary ``torch.save`` checkpoint still loads (through Lightning's
``TorchCheckpointIO``), so a run can switch to this plugin and resume from its
old checkpoints.

**Asynchronous semantics** (like Lightning's ``AsyncCheckpointIO``, without
its full clone of the state on the training thread).
``save_checkpoint()`` walks the checkpoint dict (no tensor data copied, about
a millisecond per few hundred tensors), queues it and returns. A background
thread copies the tensors' bytes into lazyckpt's bounded host cache while
training goes on; writer threads flush it. Lightning calls
``save_checkpoint()`` after an optimizer step (batch / epoch / validation
end), and the first thing that modifies those tensors in place afterwards is
either the next ``optimizer.step()`` or, in a training-mode module with
persistent buffers (``BatchNorm``'s running statistics), the next forward.
The plugin therefore installs, while a capture is pending:

* a global optimizer step pre-hook (``torch.optim.optimizer.
  register_optimizer_step_pre_hook``: every optimizer, whatever wraps it,
  manual optimization included) that waits for the capture, and
* a global module forward pre-hook that waits before the forward of a module
  in training mode that owns persistent buffers (``guard_buffers=True``, the
  default). It is removed as soon as no capture is in progress, so a module
  call costs nothing extra the rest of the time.

The forward/backward of the next step (without buffer updates) and the whole
disk write overlap with training. Scalars (epoch, step, loop counters) are
copied during the walk. Anything else you modify in place between a save and
the next optimizer step (an EMA of the weights updated before the step, a
tensor in a callback's state) must be preceded by
``checkpoint_io.wait_for_snapshot()``.

**Errors** of a background save are raised at the next ``save_checkpoint()``
or at ``teardown()`` (the end of ``fit``), as ``AsyncCheckpointIO`` does, as a
``lazyckpt.CheckpointWriteError`` naming the path and the cause. A failed save
leaves whatever was at the path before (nothing, or the previous complete
file). ``teardown()`` drains every pending save: when ``fit`` returns, every
checkpoint is committed and durable. ``remove_checkpoint()`` and
``load_checkpoint()`` of a path with a save in flight wait for that save first.

**Pickles (allow_pickle).** lazyckpt stores tensors, containers, scalars,
strings, numpy arrays and RNG states natively; only other objects are
pickled, and loading a pickle runs code from the file. A Lightning checkpoint
of an ordinary module has no pickle at all (hyper-parameters are a plain dict
of scalars; loop, callback, optimizer and scheduler states are plain state),
so the default refuses pickles at load, the way ``torch.load`` defaults to
``weights_only=True``. Objects that do end up pickled (an
``argparse.Namespace`` or a custom class in ``save_hyperparameters()``) are
logged once at save time with the entry's name; loading such a file needs one
of ``Trainer.fit(..., weights_only=False)`` (the caller vouches for this
file, exactly the ``torch.load`` contract) or ``LazyCheckpointIO(allow_pickle
=True)`` (the plugin trusts every file it loads). ``weights_only=True`` always
refuses. We do not enable pickles for "files this plugin wrote": nothing
stored next to a checkpoint proves who wrote it (a resumed job is a new
process; an attacker who can replace the file can replace any marker too).

**Distributed.** Lightning calls ``save_checkpoint``/``remove_checkpoint`` on
global rank 0 only (DDP state is replicated) and ``load_checkpoint`` on every
rank. Each call here is local to its process: no collective, which is why
this uses lazyckpt's single-file pipeline (``FileWriteJob``, the engine of
``lazyckpt.save``) on a background thread rather than a ``Checkpointer``
(whose saves are collective once ``torch.distributed`` is initialized).
Strategies that do not route checkpoints through ``CheckpointIO`` (FSDP with
sharded state, DeepSpeed) are not affected by this plugin.

``AsyncFileWriter`` (the background single-file writer with its snapshot
barrier) is shared with :mod:`lazyckpt.integrations.huggingface`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, Optional

from lazyckpt.knobs import resolve

log = logging.getLogger("lazyckpt")

__all__ = ["AsyncFileWriter", "LazyCheckpointIO", "PLLazyCheckpointIO", "is_lazyckpt_file"]  # noqa: F822

from ._async import AsyncFileWriter, is_lazyckpt_file


# --------------------------------------------------------------------------- CheckpointIO


class _LazyCheckpointIOImpl:
    """The implementation shared by both class trees (see the module docstring).

    Args:
        allow_pickle: ``None`` (default): follow ``weights_only`` of the load
            call, refusing pickles when it is ``None`` or ``True``. ``True``:
            allow unless ``weights_only=True``. ``False``: always refuse.
        guard_buffers: also wait for a pending capture before the forward of a
            training-mode module that owns persistent buffers (BatchNorm).
        **knobs: lazyckpt options (``host_cache_bytes``, ``writer_threads``,
            ``o_direct``, ``chunk_bytes``, ``max_pending_saves`` ...).
    """

    _torch_io_path = ""     # module of the tree's TorchCheckpointIO, set per tree

    def __init__(self, allow_pickle: Optional[bool] = None, guard_buffers: bool = True,
                 **knobs: Any) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.guard_buffers = guard_buffers
        self.knobs = dict(knobs)
        resolve(None, **self.knobs)          # reject unknown knobs now, not at the first save
        self._writer: Optional[AsyncFileWriter] = None

    # Runtime state (threads, locks) does not travel to ddp_spawn children.
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_writer"] = None
        return state

    @property
    def writer(self) -> AsyncFileWriter:
        if self._writer is None:
            self._writer = AsyncFileWriter(guard_buffers=self.guard_buffers, **self.knobs)
        return self._writer

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Queue ``checkpoint`` for ``path`` and return; see the module docstring."""
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                            f"{type(self).__name__}")
        self.writer.save(checkpoint, _local_path(path))

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        local = _local_path(path)
        if self._writer is not None:
            self._writer.wait(local, raise_errors=False)
        if not os.path.exists(local):
            raise FileNotFoundError(f"Checkpoint file not found: {local}")
        if not is_lazyckpt_file(local):
            # An ordinary torch.save checkpoint (e.g. written before switching to this plugin).
            torch_io = self._torch_io()
            kwargs: Dict[str, Any] = {"weights_only": self._torch_weights_only(weights_only)}
            if map_location is not None:
                kwargs["map_location"] = map_location
            return torch_io.load_checkpoint(local, **kwargs)
        return self.writer.load(local, map_location=map_location if map_location is not None else "cpu",
                                allow_pickle=self._allow_pickle(weights_only))

    def remove_checkpoint(self, path: Any) -> None:
        local = _local_path(path)
        if self._writer is not None:
            self._writer.wait(local, raise_errors=False)
        if os.path.islink(local) or os.path.isfile(local):
            os.unlink(local)
        elif os.path.isdir(local):
            import shutil
            shutil.rmtree(local)

    def teardown(self) -> None:
        """Drain every pending save (durable on return) and raise a background failure."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def wait_for_snapshot(self) -> None:
        """Block until pending saves have copied their data; then state may be modified in place."""
        if self._writer is not None:
            self._writer.wait_for_snapshot()

    def wait(self) -> None:
        """Block until every pending save is durable; raise a background failure."""
        if self._writer is not None:
            self._writer.wait()

    # ------------------------------------------------------------------ helpers

    def _allow_pickle(self, weights_only: Optional[bool]) -> bool:
        if weights_only is not None:
            return not weights_only and self.allow_pickle is not False
        return bool(self.allow_pickle)

    def _torch_weights_only(self, weights_only: Optional[bool]) -> bool:
        return not self._allow_pickle(weights_only)

    def _torch_io(self) -> Any:
        import importlib
        module = importlib.import_module(self._torch_io_path)
        return module.TorchCheckpointIO()


def _local_path(path: Any) -> str:
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        raise NotImplementedError(f"{path}: lazyckpt writes local (or mounted) file systems only; use "
                                  f"Lightning's TorchCheckpointIO for remote URLs")
    return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)


_TREES = {
    # class name: (module of CheckpointIO, module of TorchCheckpointIO)
    "LazyCheckpointIO": ("lightning.pytorch.plugins.io", "lightning.fabric.plugins.io.torch_io"),
    "PLLazyCheckpointIO": ("pytorch_lightning.plugins.io", "lightning_fabric.plugins.io.torch_io"),
}
_classes: Dict[str, type] = {}
_classes_lock = threading.Lock()


def _make_class(name: str) -> type:
    import importlib
    io_module, torch_io = _TREES[name]
    try:
        base = importlib.import_module(io_module).CheckpointIO
    except ImportError as exc:
        package = io_module.split(".")[0]
        raise ImportError(f"lazyckpt.integrations.lightning.{name} needs the `{package}` package "
                          f"(pip install 'lazyckpt[lightning]')") from exc
    doc = (f"Asynchronous lazyckpt ``CheckpointIO`` for ``{io_module.split('.')[0]}`` "
           f"(see :mod:`lazyckpt.integrations.lightning`).\n\n" + (_LazyCheckpointIOImpl.__doc__ or ""))
    cls = type(name, (_LazyCheckpointIOImpl, base), {"__module__": __name__, "__qualname__": name,
                                                     "__doc__": doc, "_torch_io_path": torch_io})
    return cls


def __getattr__(name: str) -> Any:
    if name in _TREES:
        with _classes_lock:
            if name not in _classes:
                _classes[name] = _make_class(name)
            return _classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
