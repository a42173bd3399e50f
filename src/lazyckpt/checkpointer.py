"""Checkpointer: a directory of committed checkpoints, saved asynchronously.

A thin public class over the save engine (:mod:`lazyckpt.engine`: queue,
capture thread, barrier, errors), the step-directory commit
(:class:`lazyckpt.commit.StepCommit`, two-phase across ranks) and the
directory layout (:mod:`lazyckpt.layout`: names, listing, ``latest``,
retention, leftovers, leases). See docs/FORMAT.md §11 for the layout.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

import torch

from .capture import record_events
from .commit import StepCommit
from .distributed import rank_info, refuse
from .engine import FilePart, SaveEngine, SaveHandle
from .errors import CheckpointError, CheckpointNotFoundError
from .incremental import IncrementalIndex
from .knobs import Options, resolve
from .layout import CheckpointDir
from .loader import KeySpec, MapLocation, load_step_dir
from .manifest import check_metadata
from .providers import flatten
from .restore import RestoreHandle


class Checkpointer:
    """Saves checkpoints of a training run into ``directory``, asynchronously.

    ``save()`` returns at once: it walks the state (no data copied) and queues
    it. A background thread copies the state's bytes into a bounded host
    cache, writer threads flush it to disk, and the checkpoint is committed
    (fsync, rename) when complete. ``attach(optimizer)`` makes every
    ``optimizer.step()`` wait until the pending captures have copied their
    data; with ``guard_buffers`` (default) a training-mode forward of a module
    whose persistent buffers are being captured (BatchNorm) waits too. See
    docs/ARCHITECTURE.md for the contract.

    With ``incremental=True`` (a knob: also ``"content"``, and ``full_every``)
    a tensor storage unchanged since the previous committed step is not
    written again: the new step refers to the earlier bytes, and retention
    keeps every step a kept step refers to (see lazyckpt/incremental.py).

    Steps form one line of history: saving step S supersedes every committed
    step >= S (a run resumed from an older step abandons the newer ones; they
    are deleted under ``keep_last``, kept aside as ``.abandoned-*`` otherwise),
    so the latest step is always the most recently committed one.

    Under torch.distributed (an initialized default group) creating it and
    every ``save()`` are collective: each rank writes its own file and the
    step commits when all have (``commit_timeout_s`` bounds the wait for a
    dead rank). ``replicated`` names top-level keys identical on every rank
    (DDP), written once. ``process_group=False`` makes it local to this
    process.
    """

    def __init__(self, directory: str, keep_last: Optional[int] = None,
                 host_cache_bytes: Optional[int] = None, *, options: Optional[Options] = None,
                 replicated: Optional[List[Any]] = None, process_group: Any = None,
                 commit_timeout_s: float = 600.0, guard_buffers: bool = True, **knobs: Any):
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep_last = keep_last
        self.options = resolve(options, host_cache_bytes=host_cache_bytes, **knobs)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{self.directory}: cannot create checkpoint directory: {exc}",
                                  path=self.directory) from exc
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise CheckpointError(f"{self.directory}: directory is not writable", path=self.directory)
        self.layout = CheckpointDir(self.directory, self.options.lease_expiry_s)
        #: Top-level keys identical on every rank (DDP): each entry written by one rank.
        self.replicated = list(replicated or [])
        self._dist = rank_info(self.directory, process_group, commit_timeout_s)
        if self._dist.distributed and self.options.queue_policy == "skip":
            raise ValueError("queue_policy='skip' cannot be used with several ranks: a save skipped on "
                             "one rank and not on another would never commit")
        self._calls = 0
        #: Incremental checkpoints: what this rank's last committed step holds.
        self._incremental = IncrementalIndex(self.options.incremental, self.options.full_every) \
            if self.options.incremental != "off" else None
        self._engine = SaveEngine(self.options, guard_buffers=guard_buffers)
        if self._dist.coordinator:
            # Only what is provably dead (leases expired): never another process's live save.
            self.layout.clean_leftovers()

    # ------------------------------------------------------------------ saving

    def save(self, state: Any, step: int, metadata: Optional[Dict[str, Any]] = None) -> SaveHandle:
        """Queue a checkpoint of ``state`` as it is now; return at once.

        The checkpoint holds the values ``state`` had at this call, provided
        nothing modifies its tensors in place before ``wait_for_snapshot()``
        returns (``attach(optimizer)`` calls it before every step; the forward
        guard covers persistent buffers). Python objects that are pickled must
        not be mutated before then either. With several ranks, a call refused
        here (bad argument, an earlier failure raised) fails this step on
        every rank at once; the next call commits normally.
        """
        t0 = time.perf_counter()
        call = self._calls
        self._calls += 1                 # every call, accepted or refused: the same on every rank
        try:
            self._check_open()
            self._engine.raise_errors()
            if type(step) is not int or not 0 <= step < 10 ** 10:
                raise ValueError(f"step must be an int in [0, 1e10), got {step!r}")
            metadata = check_metadata(metadata)
            flat = flatten(state, self._dist.rank, self._dist.world_size, self.replicated)
            strategy = StepCommit(self.layout, self._dist, step, call, keep_last=self.keep_last,
                                  replicated=self.replicated, metadata=metadata,
                                  heartbeat_s=self.options.lease_heartbeat_s, incremental=self._incremental)
            part = FilePart(flat, strategy.footer_metadata(),
                            record_events(s.data for s in flat.sources))
            job = self._engine.submit(strategy, [part], name=f"step {step}", step=step, t0=t0)
        except BaseException as exc:
            if self._dist.distributed:
                refuse(self._dist, f"c{call}", exc)
            raise
        return job.handle

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until every pending save has copied its data out of the live state."""
        self._engine.wait_for_snapshot(timeout)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every pending save is committed and durable; raise the first failure."""
        self._engine.wait(timeout)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Call ``wait_for_snapshot()`` before every ``optimizer.step()`` (removed on close)."""
        self._engine.barrier.attach(optimizer)

    def _check_open(self) -> None:
        if self._engine.closed:
            raise CheckpointError(f"{self.directory}: checkpointer is closed", path=self.directory)

    # ------------------------------------------------------------------ listing

    def steps(self) -> List[int]:
        """Committed steps, oldest first (the order they were committed in)."""
        return self.layout.steps()

    def latest_step(self) -> Optional[int]:
        """The most recently committed step, or None."""
        return self.layout.latest()

    def step_path(self, step: int) -> str:
        return self.layout.step_path(step)

    def clean_leftovers(self) -> List[str]:
        """Remove what interrupted saves and deletes left behind, once provably
        dead (their lease expired); never a save in progress, never data."""
        return self.layout.clean_leftovers()

    # ------------------------------------------------------------------ loading

    def load(self, step: Optional[int] = None, map_location: MapLocation = None,
             keys: Optional[List[KeySpec]] = None, into: Any = None, allow_pickle: bool = False,
             strict: bool = True) -> Any:
        """Load a committed checkpoint (the latest when ``step`` is None). With
        ``into``, every tensor of ``into`` must be filled unless ``strict=False``."""
        step = self._step_to_load(step)
        return load_step_dir(self.step_path(step), self.options, self._engine.resources.readers,
                             rank=self._dist.rank, map_location=map_location, keys=keys, into=into,
                             allow_pickle=allow_pickle, strict=strict)

    def load_async(self, step: Optional[int] = None, map_location: MapLocation = None,
                   keys: Optional[List[KeySpec]] = None, into: Any = None, allow_pickle: bool = False,
                   strict: bool = True) -> RestoreHandle:
        """``load()`` on a background thread (the step is chosen now): returns a
        :class:`RestoreHandle`; ``handle.wait()`` is the barrier before first use
        (``handle.attach(optimizer)``, ``handle.guard(model)`` make it a hook)."""
        step = self._step_to_load(step)
        return RestoreHandle(lambda: self.load(step, map_location, keys, into, allow_pickle, strict),
                             self.step_path(step))

    def _step_to_load(self, step: Optional[int]) -> int:
        self._check_open()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"{self.directory}: no committed checkpoint",
                                              path=self.directory)
        return step

    # ------------------------------------------------------------------ closing

    def close(self, cancel: bool = False) -> None:
        """Drain pending saves (or cancel them with ``cancel=True``), stop every
        thread, release the cache. Raises the first unreported failure."""
        self._engine.close(cancel=cancel)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)
