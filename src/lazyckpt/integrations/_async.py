"""A background writer of whole checkpoint files, shared by the integrations
whose frameworks hand over one file path per checkpoint (Lightning, the
Hugging Face Trainer, DeepSpeed).

``AsyncFileWriter.save(state, path)`` walks the state on the caller's thread
and returns; one background thread runs lazyckpt's single-file pipeline
(bounded host cache, O_DIRECT writer threads, checksums) into a hidden
temporary name next to ``path``, fsyncs, renames it into place and fsyncs the
directory. Until a capture is done, a global optimizer step pre-hook (and,
optionally, a forward pre-hook of training-mode modules that own persistent
buffers, e.g. BatchNorm) waits for it. It is local to the process: no
collective, whatever ``torch.distributed`` says.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from ..engine import Resources
from ..errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from ..fileio import fsync_dir, pid_alive, remove_quietly
from ..format import MAGIC
from ..knobs import Options, resolve
from ..loader import _find_pickle, load_file
from ..providers import flatten
from ..writer import FileWriteJob

log = logging.getLogger("lazyckpt")

__all__ = ["AsyncFileWriter", "PendingFile", "is_lazyckpt_file", "temp_name", "clean_temp_files"]


def is_lazyckpt_file(path: str) -> bool:
    """True if ``path`` is a file that starts with lazyckpt's magic."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


_HOST = socket.gethostname().replace("/", "_")
_TMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temp_name(path: str) -> str:
    """A hidden sibling of ``path`` that names this host and process."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def clean_temp_files(directory: str) -> List[str]:
    """Remove temporaries (``temp_name``) left in ``directory`` by dead
    processes of this host. Files of live processes and of other hosts (a
    shared file system) are left alone."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TMP_RE.match(name)
        if not m or m.group("host") != _HOST:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                import shutil
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("lazyckpt: removed leftovers of interrupted saves in %s: %s", directory, removed)
    return removed




class PendingFile:
    """One queued file. ``wait()`` returns once it is committed and durable."""

    def __init__(self, path: str, flat: Any, metadata: Dict[str, Any],
                 on_commit: Optional[Callable[["PendingFile"], None]], event: Any,
                 final_path: Optional[str] = None):
        self.path = path
        #: Where the checkpoint appears once committed, if ``on_commit`` moves it.
        self.final_path = final_path or path
        self.flat = flat
        self.metadata = metadata
        self.on_commit = on_commit
        self.event = event
        self.started = threading.Event()      # the capture thread took it (or it ended)
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.reported = False                 # its error was raised to the caller
        self.job: Optional[FileWriteJob] = None
        self.t0 = time.perf_counter()
        self.capture_s = 0.0
        self.flush_s = 0.0
        self.bytes = 0

    def captured(self) -> bool:
        """Its data no longer needs the live state (copied, or the save ended)."""
        job = self.job
        return self.done.is_set() or (job is not None and job.snapshot_done.is_set())

    def wait_for_snapshot(self) -> None:
        self.started.wait()
        job = self.job
        if job is not None:
            job.snapshot_done.wait()

    def wait(self, timeout: Optional[float] = None) -> "PendingFile":
        if not self.done.wait(timeout):
            raise CheckpointError(f"{self.path}: not committed within {timeout} s", path=self.path)
        if self.error is not None:
            self.reported = True      # raised here: the writer will not raise it again
            raise self.error
        return self

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.done.is_set() else "pending"
        return f"PendingFile({self.path!r}, {state})"


class AsyncFileWriter:
    """Writes whole checkpoint files in the background, one at a time, in order.

    ``save(state, path)`` walks ``state`` on the caller's thread, queues it and
    returns a :class:`PendingFile`. One background thread runs lazyckpt's
    single-file pipeline (bounded host cache, O_DIRECT writer threads,
    checksums), writes to a hidden temporary name next to ``path``, fsyncs,
    renames it over ``path``, fsyncs the directory and then runs
    ``on_commit`` (still in the background). While a capture is pending, a
    global optimizer step pre-hook and (``guard_buffers``) a forward pre-hook
    of training-mode modules with persistent buffers wait for it; see the
    module docstring. Failures are kept and raised once, at the next
    ``save()``, ``wait()``, ``raise_errors()`` or ``close()``.

    Local to this process: no collective, whatever ``torch.distributed`` says.
    """

    def __init__(self, *, guard_buffers: bool = True, options: Optional[Options] = None, **knobs: Any):
        self.options = resolve(options, **knobs)
        if self.options.queue_policy != "block":
            raise ValueError("AsyncFileWriter supports queue_policy='block' only: a framework that "
                             "asked for a checkpoint must not silently miss it")
        self.guard_buffers = guard_buffers
        self._resources: Optional[Resources] = None
        self._lock = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending: List[PendingFile] = []
        self._errors: List[BaseException] = []
        self._thread: Optional[threading.Thread] = None
        self._step_hook: Any = None
        self._forward_hook: Any = None
        self._cleaned: set = set()
        self._warned_pickles = False

    # ------------------------------------------------------------------ saving

    def save(self, state: Any, path: str, *, metadata: Optional[Dict[str, Any]] = None,
             on_commit: Optional[Callable[[PendingFile], None]] = None,
             final_path: Optional[str] = None) -> PendingFile:
        """Queue ``state`` (as it is now) for ``path``; return at once.

        ``on_commit(pending)`` runs in the background once the file is durable
        (e.g. to move it into place); ``final_path`` names where it ends up, for
        ``pending()`` and ``wait()`` by path.
        """
        self.raise_errors()
        path = os.path.abspath(os.fspath(path))
        flat = flatten(state)
        self._warn_pickles(flat.tree, path)
        event = None
        if torch.cuda.is_available() and any(isinstance(s.data, torch.Tensor) and s.data.is_cuda
                                             for s in flat.sources):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        pending = PendingFile(path, flat, dict(metadata or {}), on_commit, event,
                              os.path.abspath(final_path) if final_path else None)
        with self._lock:
            while len(self._queue) > self.options.max_pending_saves:
                self._lock.wait(0.1)
            self._queue.append(pending)
            self._pending.append(pending)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lazyckpt-async-file", daemon=True)
                self._thread.start()
            self._lock.notify_all()
        self._arm()
        return pending

    def pending(self, path: Optional[str] = None) -> List[PendingFile]:
        """Saves not yet finished (of ``path`` only, if given)."""
        with self._lock:
            out = list(self._pending)
        if path is not None:
            path = os.path.abspath(os.fspath(path))
            out = [p for p in out if any(q == path or q.startswith(path + os.sep)
                                         for q in (p.path, p.final_path))]
        return out

    def wait_for_snapshot(self) -> None:
        """Block until every pending save has copied its data out of the live state."""
        for p in self.pending():
            p.wait_for_snapshot()

    def wait(self, path: Optional[str] = None, raise_errors: bool = True) -> None:
        """Block until the pending saves (of ``path``, if given) are durable."""
        for p in self.pending(path):
            p.done.wait()
        if raise_errors:
            self.raise_errors()

    def raise_errors(self) -> None:
        """Raise the oldest failure not yet raised (by this or by ``PendingFile.wait``)."""
        with self._lock:
            while self._errors:
                error = self._errors.pop(0)
                if not getattr(error, "_pending").reported:
                    error._pending.reported = True
                    raise error

    def close(self, raise_errors: bool = True) -> None:
        """Drain every pending save, stop the thread, free the cache and remove the hooks."""
        try:
            self.wait(raise_errors=False)
        finally:
            with self._lock:
                thread = self._thread
            if thread is not None:
                thread.join()
            self._disarm(step_hook=True)
            if self._resources is not None:
                self._resources.close()
                self._resources = None
        if raise_errors:
            self.raise_errors()

    def load(self, path: str, **kwargs: Any) -> Any:
        """Load a file this (or any) writer produced, waiting for its pending save."""
        path = os.fspath(path)
        self.wait(path, raise_errors=False)
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{path}: no such checkpoint file", path=path)
        return load_file(path, self.options, self._get_resources().readers, **kwargs)

    # ------------------------------------------------------------------ background

    def _get_resources(self) -> Resources:
        with self._lock:
            if self._resources is None:
                self._resources = Resources(self.options)
            return self._resources

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:         # idle: exit; the next save() starts a new thread
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                pending = self._queue[0]
            try:
                self._write(pending)
            except BaseException as exc:
                cause = f"{type(exc).__name__}: {exc}"
                error = CheckpointWriteError(f"{pending.path}: checkpoint save failed: {cause}",
                                             path=pending.path)
                error.__cause__ = exc
                error._pending = pending      # type: ignore[attr-defined]
                pending.error = error
                with self._lock:
                    self._errors.append(error)
                log.error("lazyckpt: %s", error)
            finally:
                pending.started.set()
                pending.flat = None
                pending.flush_s = time.perf_counter() - pending.t0
                with self._lock:
                    self._queue.popleft()
                    self._pending.remove(pending)
                    pending.done.set()
                    self._lock.notify_all()

    def _write(self, pending: PendingFile) -> None:
        directory = os.path.dirname(pending.path)
        os.makedirs(directory, exist_ok=True)
        if directory not in self._cleaned:
            self._cleaned.add(directory)
            clean_temp_files(directory)
        res = self._get_resources()
        tmp = temp_name(pending.path)
        job = FileWriteJob(tmp, pending.flat.tree, pending.flat.sources, {"user": pending.metadata},
                           self.options, res.cache_for(pending.flat.sources), res.writers, res.serializer,
                           capture_event=pending.event)
        pending.job = job
        pending.started.set()
        try:
            stats = job.run()
            pending.capture_s = stats.capture_s
            pending.bytes = stats.file_bytes
            os.replace(tmp, pending.path)
        except BaseException:
            remove_quietly(tmp)
            raise
        fsync_dir(directory)
        if pending.on_commit is not None:
            pending.on_commit(pending)
        log.info("lazyckpt: %s committed: %.1f MB, capture %.3f s, durable %.3f s", pending.path,
                 pending.bytes / 1e6, pending.capture_s, time.perf_counter() - pending.t0)

    def _warn_pickles(self, tree: Any, path: str) -> None:
        if self._warned_pickles:
            return
        found = _find_pickle(tree, [])
        if found is not None:
            self._warned_pickles = True
            node, trail = found
            log.warning("lazyckpt: %s: entry %s is a %s and is pickled; loading this checkpoint will need "
                        "allow_pickle=True (or weights_only=False). Logged once.", path,
                        "/".join(trail) or "<root>", node.get("type", "object"))

    # ------------------------------------------------------------------ barrier

    def _arm(self) -> None:
        # The hooks hold the writer weakly: a writer dropped without close() is
        # collected, and its __del__ removes them.
        ref = weakref.ref(self)
        if self._step_hook is None:
            def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
                writer = ref()
                if writer is not None:
                    writer._before_step()
            self._step_hook = _optimizer_module().register_optimizer_step_pre_hook(before_step)
        if self.guard_buffers and self._forward_hook is None:
            def before_forward(module: torch.nn.Module, _args: Any) -> None:
                writer = ref()
                if writer is not None:
                    writer._before_forward(module)
            self._forward_hook = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)

    def _disarm(self, step_hook: bool = False) -> None:
        # The optimizer hook is only removed by close(): torch iterates the live
        # dict of global step hooks, so a hook may not remove itself.
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if step_hook and self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _capturing(self) -> bool:
        return any(not p.captured() for p in self.pending())

    def _before_step(self) -> None:
        if self._pending:
            self.wait_for_snapshot()
            self._disarm()          # every capture is done; save() arms again

    def _before_forward(self, module: torch.nn.Module) -> None:
        if not self._capturing():
            self._disarm()          # safe here: torch iterates a copy of the forward hooks
            return
        if module.training and _owns_persistent_buffers(module):
            self.wait_for_snapshot()

    def __del__(self) -> None:
        try:
            self._disarm(step_hook=True)
            if self._resources is not None:
                self._resources.close()
        except Exception:
            pass


def _optimizer_module() -> Any:
    import torch.optim.optimizer as optimizer     # a submodule: not an attribute of torch.optim
    return optimizer


def _owns_persistent_buffers(module: torch.nn.Module) -> bool:
    buffers = module._buffers
    if not buffers:
        return False
    skip = module._non_persistent_buffers_set
    return any(b is not None and name not in skip for name, b in buffers.items())


