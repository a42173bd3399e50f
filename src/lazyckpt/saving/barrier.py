"""The capture barrier: where training must wait for a pending capture.

A capture copies the live state in the background while the next
forward/backward runs. Two things modify that state in place before the
next checkpoint could be taken, and both wait here until the pending
captures have copied what they need:

* the optimizer step: a step pre-hook on the optimizers handed to
  ``attach()`` (or, for the integrations, which do not see the optimizer, a
  global hook on every optimizer);
* a training-mode forward of a module whose persistent buffers are being
  captured (BatchNorm's running statistics, any module buffer updated in
  ``forward``): a global forward pre-hook, installed only while a capture is
  pending and removed as soon as none is, so a module call costs nothing
  extra the rest of the time. It waits only for modules whose buffers are
  part of a pending capture: evaluation forwards and unrelated modules go on.

Every hook refers to its engine weakly: an engine dropped without ``close()``
is collected, and its hooks then do nothing until they are removed.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, List, Optional

import torch


class CaptureBarrier:
    def __init__(self, engine: Any, guard_buffers: bool):
        self._engine = weakref.ref(engine)
        self.guard_buffers = guard_buffers
        self._lock = threading.Lock()
        self._step_hooks: List[Any] = []
        self._global_step_hook: Any = None
        self._forward_hook: Any = None

    # ---------------------------------------------------------------- optimizer steps

    def attach(self, optimizer: torch.optim.Optimizer, after_wait: Optional[Callable[[], None]] = None) -> None:
        """Wait for pending captures before every ``optimizer.step()``; then call
        ``after_wait`` (the iteration clock of lazyckpt/saving/costs.py), in the same hook."""
        ref = self._engine

        def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            engine = ref()
            if engine is not None and not engine.closed:
                engine.wait_for_snapshot()
                if after_wait is not None:
                    after_wait()
        with self._lock:
            self._step_hooks.append(optimizer.register_step_pre_hook(before_step))

    def guard_all_optimizers(self) -> None:
        """Wait for pending captures before the step of every optimizer of the
        process (for integrations that never see the optimizer object)."""
        with self._lock:
            if self._global_step_hook is not None:
                return
            ref = self._engine

            def before_any_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                engine = ref()
                if engine is not None and not engine.closed and engine.capturing_anything():
                    engine.wait_for_snapshot(raise_errors=False)
            import torch.optim.optimizer as optimizer_module     # a submodule, not an attribute
            self._global_step_hook = optimizer_module.register_optimizer_step_pre_hook(before_any_step)

    # ---------------------------------------------------------------- forward guard

    def arm(self) -> None:
        """A capture is pending: guard forwards until it is done."""
        if not self.guard_buffers or self._forward_hook is not None:
            return
        with self._lock:
            if self._forward_hook is not None:
                return
            ref = self._engine
            barrier = weakref.ref(self)

            def before_forward(module: torch.nn.Module, _args: Any) -> None:
                engine = ref()
                pointers = engine.capturing if engine is not None else None
                if not pointers:
                    this = barrier()
                    if this is not None:
                        this.disarm()       # safe: torch iterates a copy of the global forward hooks
                    return
                if module.training and _mutable_buffers_in(module, pointers):
                    engine.wait_for_snapshot(raise_errors=False)
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)

    def disarm(self) -> None:
        with self._lock:
            if self._forward_hook is not None:
                self._forward_hook.remove()
                self._forward_hook = None

    def close(self) -> None:
        """Remove every hook (the global step hook too: only here, since torch
        iterates the live dict of global step hooks and a hook may not remove
        itself)."""
        self.disarm()
        with self._lock:
            for hook in self._step_hooks:
                hook.remove()
            self._step_hooks.clear()
            if self._global_step_hook is not None:
                self._global_step_hook.remove()
                self._global_step_hook = None


def _mutable_buffers_in(module: torch.nn.Module, pointers: frozenset) -> bool:
    """Whether a persistent buffer of ``module`` is among the storages being captured."""
    buffers = module._buffers
    if not buffers:
        return False
    skip = module._non_persistent_buffers_set
    for name, buffer in buffers.items():
        if buffer is not None and name not in skip and buffer.untyped_storage().data_ptr() in pointers:
            return True
    return False
