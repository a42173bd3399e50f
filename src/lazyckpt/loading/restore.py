"""Asynchronous restore: a load that returns at once and runs in the background.

A restart spends its first seconds building the model, the optimizer and the
data pipeline, none of which needs the checkpoint's bytes; a synchronous load
before or after them adds its whole duration. ``lazyckpt.load_async`` (and
``Checkpointer.load_async``) start the same load on a background thread --
the parallel block reads, their checksum verification and, with a
``map_location`` device, the host-to-device copies all run there -- and
return a :class:`RestoreHandle`.

With ``into=``, each tensor is filled as soon as its own entry has been read
and every block of it verified, on the reader thread that finished it,
while later entries are still being read (a device target gets its
host-to-device copy there too, so those copies overlap the reads). If the
load fails part way (a damaged block found late), every tensor of ``into``
holds either its previous value or its checkpoint value -- never bytes
that failed their checksum -- and the error names the damage; restore
again from another step or copy before training.

There is one barrier, before first use: ``handle.wait()`` returns the state
(``into`` itself when given) or raises the load's error. With ``into=``, the
tensors being filled must not be used before it; ``handle.attach(optimizer)``
and ``handle.guard(module)`` put that barrier in an optimizer pre-step hook
and a module forward pre-hook, as the save side does, so a loop that starts
early waits exactly as long as it must and sees the load's error there.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, List, Optional

import torch

from lazyckpt.errors import CheckpointError


class RestoreHandle:
    """A load in progress. ``wait()`` is the barrier; errors surface there (and
    in the hooks), every time they are asked for."""

    def __init__(self, load: Callable[[], Any], name: str):
        self.name = name
        self._load = load
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._hooks: List[Any] = []
        self._started = time.perf_counter()
        self.seconds: Optional[float] = None       # how long the load took, once done
        self._thread = threading.Thread(target=self._run, name="lazyckpt-restore", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._load()
        except BaseException as exc:     # delivered at the barrier, never lost
            self._error = exc
        finally:
            self._load = None
            self.seconds = time.perf_counter() - self._started
            self._done.set()
            _RUNNING.discard(self)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the load is complete; return the state or raise its error.
        Also removes the hooks this handle installed."""
        self._barrier(timeout)
        self.remove_hooks()
        return self._result

    def _barrier(self, timeout: Optional[float] = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name}: restore still running after {timeout} s")
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"{self.name}: restore failed: {type(self._error).__name__}: "
                                  f"{self._error}") from self._error

    def attach(self, optimizer: torch.optim.Optimizer) -> "RestoreHandle":
        """``optimizer.step()`` waits for the restore (and raises its error)."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self._barrier()))
        return self

    def guard(self, module: torch.nn.Module) -> "RestoreHandle":
        """A forward of ``module`` waits for the restore (and raises its error)."""
        self._hooks.append(module.register_forward_pre_hook(lambda *_: self._barrier()))
        return self

    def remove_hooks(self) -> None:
        # Not from inside a hook: torch iterates over its hook dicts while calling them.
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"RestoreHandle({self.name!r}, {state})"


#: Restores whose thread is running. At interpreter exit they are waited for:
#: a daemon thread still running torch code while the interpreter finalizes
#: can abort the process.
_RUNNING: "weakref.WeakSet[RestoreHandle]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    for handle in list(_RUNNING):
        handle._thread.join()


try:
    threading._register_atexit(_finish_at_exit)     # type: ignore[attr-defined]
except AttributeError:                              # pragma: no cover (CPython < 3.9)
    import atexit
    atexit.register(_finish_at_exit)
