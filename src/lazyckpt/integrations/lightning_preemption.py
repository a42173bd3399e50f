"""Preemption for Lightning: save the step at which SIGTERM arrived, then stop.

Lightning installs its own SIGTERM handler (``trainer.received_sigterm``) and
stops a run with ``SIGTERMException`` -- at the end of the epoch in one
process, at the next batch with several -- without saving. This callback
uses that flag: at the end of the batch during which the signal arrived it
saves a checkpoint through the trainer's ``CheckpointIO`` (``LazyCheckpointIO``:
asynchronous, so it then waits until the file is durable, bounded by
``grace``), and sets ``trainer.should_stop`` so that the run ends right after
it (Lightning then raises its ``SIGTERMException``, a ``SystemExit``, as on any
SIGTERM; ``teardown`` drains the saves)::

    from lazyckpt.integrations.lightning import LazyCheckpointIO
    from lazyckpt.integrations.lightning_preemption import SaveOnPreemption    # PLSaveOnPreemption: pytorch_lightning

    trainer = L.Trainer(plugins=[LazyCheckpointIO()],
                        callbacks=[ModelCheckpoint(...), SaveOnPreemption(dirpath="ckpt")])
    trainer.fit(model)                       # ends after the preempted step is saved
    # next job: trainer.fit(model, ckpt_path="ckpt/preempted-step=1234.ckpt")

With several ranks the flag is agreed on at every batch end (one
``strategy.reduce_boolean_decision``: a signal on any rank saves the same step
on all of them). The user's own SIGTERM handler, if installed before the
Trainer, is Lightning's to chain (it does). See docs/preemption.md.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Union

from lazyckpt.knobs import parse_duration
from ._lazyclass import lazy_classes

log = logging.getLogger("lazyckpt")


class _SaveOnPreemptionImpl:
    """``dirpath``: where the checkpoint goes (default: the trainer's ``default_root_dir``);
    ``filename``: its name, ``{step}`` the global step; ``grace``: how long to wait
    for it to be durable (seconds or "60s")."""

    def __init__(self, dirpath: Optional[str] = None, filename: str = "preempted-step={step}.ckpt",
                 grace: Union[float, str] = "60s"):
        super().__init__()
        if "{step}" not in filename:
            raise ValueError(f"filename must contain {{step}} (each preempted step its own file), got {filename!r}")
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        try:
            self.grace = parse_duration(grace)
        except ValueError as exc:
            raise ValueError(f"grace: {exc}") from None
        #: The checkpoint saved on preemption, once saved.
        self.saved_path: Optional[str] = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.saved_path is not None:
            return
        flag = bool(getattr(trainer, "received_sigterm", False))
        if trainer.world_size > 1:
            flag = bool(trainer.strategy.reduce_boolean_decision(flag, all=False))
        if not flag:
            return
        t0 = time.monotonic()
        path = os.path.join(self.dirpath or trainer.default_root_dir, self.filename.format(step=trainer.global_step))
        log.warning("lazyckpt: SIGTERM: saving %s, then stopping the run", path)
        trainer.save_checkpoint(path)
        self.saved_path = path
        self._wait_durable(trainer, t0)
        trainer.should_stop = True

    def _wait_durable(self, trainer: Any, t0: float) -> None:
        """LazyCheckpointIO: the save just queued, waited for within the grace (its
        deferred links and removals run at the next safe point, as always)."""
        handle = getattr(trainer.strategy.checkpoint_io, "_last_save", None)
        if handle is None:
            return                          # a synchronous CheckpointIO: durable on return
        if not handle._done.wait(max(0.0, self.grace - (time.monotonic() - t0))):
            log.warning("lazyckpt: %s not durable within the grace (%.0f s); teardown goes on waiting for it",
                        self.saved_path, self.grace)
            return
        handle.wait()                       # its failure, if it failed
        log.info("lazyckpt: %s durable", self.saved_path)


_TREES = {"SaveOnPreemption": "lightning.pytorch", "PLSaveOnPreemption": "pytorch_lightning"}


def _make_class(name: str) -> type:
    import importlib
    root = _TREES[name]
    try:
        base = importlib.import_module(root).Callback
    except ImportError as exc:
        raise ImportError(f"lazyckpt.integrations.lightning_preemption.{name} needs the `{root.split('.')[0]}` "
                          f"package (pip install 'lazyckpt[lightning]')") from exc
    doc = f"Save on SIGTERM, then stop (``{root}``; see :mod:`lazyckpt.integrations.lightning_preemption`)."
    return type(name, (_SaveOnPreemptionImpl, base), {"__module__": __name__, "__qualname__": name,
                                                       "__doc__": doc + "\n\n" + (_SaveOnPreemptionImpl.__doc__ or "")})


__getattr__ = lazy_classes(__name__, _TREES, _make_class)
