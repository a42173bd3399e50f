"""Checkpointer: a directory of committed checkpoints, saved asynchronously.

Directory layout (see docs/FORMAT.md)::

    DIR/step_0000000100/rank_00000.lzc   data files, one per rank
    DIR/step_0000000100/manifest.json    written last, before the rename
    DIR/latest                           the newest committed step (advisory)
    DIR/.tmp-step_0000000100-<pid>-<id>  a save in progress (never listed)
    DIR/.deleting-step_...               a checkpoint being removed (never listed)

A step directory appears under its final name only by an atomic rename of a
complete, fsynced temporary directory: it exists only once committed.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from typing import Any, Dict, List, Optional

import torch

from . import format as fmt
from .engine import Resources
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from .fileio import NotARegularFile, fsync_dir, pid_alive, read_small_file, write_file_atomic
from .knobs import Options, resolve
from .loader import KeySpec, MapLocation, StepFiles, load_tree
from .distributed import rank_info, shard_index
from .providers import flatten
from .writer import Aborted, FileWriteJob

log = logging.getLogger("lazyckpt")

STEP_DIR = re.compile(r"^step_(\d{10})$")
MANIFEST = "manifest.json"
LATEST = "latest"
#: A reader refuses larger manifests (hostile-file guard); writers refuse to commit them.
MAX_MANIFEST_BYTES = 1 << 30


def step_dirname(step: int) -> str:
    return f"step_{step:010d}"


def rank_filename(rank: int) -> str:
    return f"rank_{rank:05d}.lzc"


class SaveHandle:
    """One requested checkpoint. ``wait()`` returns once it is committed and durable."""

    def __init__(self, step: int, checkpointer: "Checkpointer"):
        self.step = step
        self._checkpointer = checkpointer
        self._done = threading.Event()
        self.snapshot_done = threading.Event()
        self.error: Optional[CheckpointError] = None
        self.skipped = False
        self.cancelled = False
        self._job: Optional[FileWriteJob] = None
        self._error_reported = False
        #: Seconds the caller spent inside save().
        self.blocking_s = 0.0
        #: Seconds from save() until every byte was copied out of the live state.
        self.capture_s = 0.0
        #: Seconds from save() until committed and durable.
        self.flush_s = 0.0
        #: Bytes in the checkpoint's data file(s).
        self.bytes = 0
        self._t0 = time.perf_counter()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def gbps(self) -> float:
        return self.bytes / self.flush_s / 1e9 if self.flush_s else 0.0

    def wait(self, timeout: Optional[float] = None) -> "SaveHandle":
        """Block until committed and durable; raise its error if it failed."""
        if not self._done.wait(timeout):
            raise CheckpointError(f"step {self.step}: not committed within {timeout} s", step=self.step)
        if self.error is not None:
            self._error_reported = True
            raise self.error
        return self

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> None:
        if not self.snapshot_done.wait(timeout):
            raise CheckpointError(f"step {self.step}: capture not finished within {timeout} s", step=self.step)

    def stats(self) -> Dict[str, Any]:
        return {"step": self.step, "blocking_s": self.blocking_s, "capture_s": self.capture_s,
                "flush_s": self.flush_s, "bytes": self.bytes, "gbps": self.gbps}

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.done() else "pending"
        return f"SaveHandle(step={self.step}, {state})"


class Checkpointer:
    """Saves checkpoints of a training run into ``directory``, asynchronously.

    ``save()`` returns at once: it walks the state (no data copied) and queues
    it. A background thread copies the state's bytes into a bounded host
    cache, writer threads flush it to disk, and the checkpoint is committed
    (fsync, rename) when complete. ``wait_for_snapshot()`` -- installed before
    every optimizer step by ``attach(optimizer)`` -- blocks until the pending
    captures have copied their data, so the optimizer may then update the
    tensors in place. See docs/ARCHITECTURE.md for the contract.

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
                 commit_timeout_s: float = 600.0, **knobs: Any):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
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
        #: Top-level keys identical on every rank (DDP): each entry written by one rank.
        self.replicated = list(replicated or [])
        self._dist = rank_info(self.directory, process_group, commit_timeout_s)
        if self._dist.distributed and self.options.queue_policy == "skip":
            raise ValueError("queue_policy='skip' cannot be used with several ranks: a save skipped on "
                             "one rank and not on another would never commit")
        self._seq = 0
        self._resources = Resources(self.options)
        self._lock = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._inflight: List[SaveHandle] = []
        self._unreported: List[CheckpointError] = []
        self._closed = False
        self._hooks: list = []
        self._thread: Optional[threading.Thread] = None
        if self._dist.coordinator:
            self.clean_leftovers()
            # A crash between a commit and its retention deletes leaves one step too
            # many: the newest is committed, so the extras can go now.
            self._apply_retention()

    # ------------------------------------------------------------------ saving

    def save(self, state: Any, step: int, metadata: Optional[Dict[str, Any]] = None) -> SaveHandle:
        """Queue a checkpoint of ``state`` as it is now; return at once.

        The checkpoint holds the values ``state`` had at this call, provided
        nothing modifies its tensors in place before ``wait_for_snapshot()``
        returns (``attach(optimizer)`` calls it before every step). Python
        objects that are pickled must not be mutated before then either.
        """
        t0 = time.perf_counter()
        self._check_open()
        self._raise_unreported()
        if type(step) is not int or not 0 <= step < 10 ** 10:
            raise ValueError(f"step must be an int in [0, 1e10), got {step!r}")
        metadata = _check_metadata(metadata)
        flat = flatten(state, self._dist.rank, self._dist.world_size, self.replicated)
        sources = flat.sources
        handle = SaveHandle(step, self)
        self._seq += 1
        handle._t0 = t0
        event = None
        if torch.cuda.is_available() and any(isinstance(s.data, torch.Tensor) and s.data.is_cuda
                                             for s in sources):
            # Order the capture after everything the training stream has queued so far.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        job = (handle, flat, self._seq, metadata, event)
        with self._lock:
            # The save in flight plus max_pending_saves waiting behind it.
            while len(self._queue) > self.options.max_pending_saves:
                if self.options.queue_policy == "skip":
                    warnings.warn(f"lazyckpt: step {step} skipped: {len(self._queue)} saves already "
                                  f"queued (queue_policy='skip')", RuntimeWarning, stacklevel=2)
                    handle.skipped = True
                    handle.snapshot_done.set()
                    handle._done.set()
                    handle.blocking_s = time.perf_counter() - t0
                    return handle
                self._lock.wait(0.1)
                self._raise_unreported_locked()
            self._queue.append(job)
            self._inflight.append(handle)
            self._ensure_thread()
            self._lock.notify_all()
        handle.blocking_s = time.perf_counter() - t0
        return handle

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until every pending save has copied its data out of the live state."""
        for handle in self._pending():
            handle.wait_for_snapshot(timeout)
        self._raise_unreported()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every pending save is committed and durable; raise the first failure."""
        for handle in self._pending():
            if not handle._done.wait(timeout):
                raise CheckpointError(f"step {handle.step}: not committed within {timeout} s",
                                      step=handle.step)
        self._raise_unreported()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Call ``wait_for_snapshot()`` before every ``optimizer.step()`` (removed on close)."""
        def pre_step(_opt, _args, _kwargs):
            self.wait_for_snapshot()
        self._hooks.append(optimizer.register_step_pre_hook(pre_step))

    def _pending(self) -> List[SaveHandle]:
        with self._lock:
            return list(self._inflight)

    def _raise_unreported(self) -> None:
        with self._lock:
            self._raise_unreported_locked()

    def _raise_unreported_locked(self) -> None:
        while self._unreported:
            error = self._unreported.pop(0)
            handle = getattr(error, "_handle", None)
            if handle is not None and handle._error_reported:
                continue
            if handle is not None:
                handle._error_reported = True
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self.directory}: checkpointer is closed", path=self.directory)

    # ------------------------------------------------------------------ background

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lazyckpt-capture", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                handle, flat, seq, metadata, event = self._queue[0]
            try:
                if handle.cancelled and not self._dist.distributed:
                    raise Aborted("cancelled by close()")
                self._save_one(handle, flat, seq, metadata, event)
            except BaseException as exc:
                self._record_failure(handle, exc)
            finally:
                del flat
                handle.snapshot_done.set()
                if not handle.flush_s:
                    handle.flush_s = time.perf_counter() - handle._t0
                with self._lock:
                    self._queue.popleft()
                    if handle in self._inflight:
                        self._inflight.remove(handle)
                    handle._done.set()
                    self._lock.notify_all()
                if handle.error is None and not handle.cancelled:
                    log.info("lazyckpt: step %d committed: %.1f MB, blocking %.2f ms, capture %.3f s, "
                             "durable %.3f s (%.2f GB/s)", handle.step, handle.bytes / 1e6,
                             handle.blocking_s * 1e3, handle.capture_s, handle.flush_s, handle.gbps)

    def _record_failure(self, handle: SaveHandle, exc: BaseException) -> None:
        if isinstance(exc, Aborted) or handle.cancelled:
            handle.cancelled = True
            handle.error = CheckpointError(f"step {handle.step}: save cancelled by close()",
                                           step=handle.step, path=self.directory)
            handle._error_reported = True  # a cancellation the caller asked for is not a failure
            return
        cause = f"{type(exc).__name__}: {exc}"
        error = CheckpointWriteError(f"{self.directory}: checkpoint of step {handle.step} failed: {cause}",
                                     step=handle.step, path=self.directory)
        error.__cause__ = exc
        error._handle = handle  # type: ignore[attr-defined]
        handle.error = error
        with self._lock:
            self._unreported.append(error)
        log.error("lazyckpt: %s", error)

    def _save_one(self, handle: SaveHandle, flat: Any, seq: int, metadata: Dict[str, Any],
                  event: Any) -> None:
        d = self._dist
        final = os.path.join(self.directory, step_dirname(handle.step))
        if d.distributed:
            tmp = os.path.join(self.directory, f".tmp-{step_dirname(handle.step)}-r{d.run_id}-{seq}")
        else:
            tmp = os.path.join(self.directory,
                               f".tmp-{step_dirname(handle.step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        filename = rank_filename(d.rank)
        save_id = f"{d.run_id}-{seq}" if d.distributed else uuid.uuid4().hex
        # Ties each data file to this save and rank: a file copied from another
        # step or swapped with another rank's is refused at load.
        metadata = {"step": handle.step, **metadata,
                    "lazyckpt": {"save_id": save_id, "rank": d.rank, "world_size": d.world_size}}
        try:
            if os.path.exists(final):
                raise CheckpointError(f"step {handle.step} is already committed in {self.directory}")
            os.makedirs(tmp, exist_ok=d.distributed)
            job = FileWriteJob(os.path.join(tmp, filename), flat.tree, flat.sources, metadata, self.options,
                               self._resources.cache_for(flat.sources), self._resources.writers,
                               self._resources.serializer, capture_event=event)
            handle._job = job
            watcher = threading.Thread(target=self._watch_snapshot, args=(handle, job), daemon=True)
            watcher.start()
            try:
                stats = job.run()
            finally:
                watcher.join()
            handle.bytes = stats.file_bytes
        except BaseException as exc:
            if d.distributed:
                # Tell the coordinator at once rather than let it wait for the deadline.
                d.publish(f"{seq}/done/{d.rank}", {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            else:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not d.distributed:
            try:
                self._commit(handle, tmp, final, {0: {"bytes": stats.file_bytes, "shards": flat.shards}},
                             metadata)
            except BaseException:
                if os.path.isdir(tmp):      # not renamed: nothing of this step may remain
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            return
        done_value = {"ok": True, "bytes": stats.file_bytes, "digest": flat.replicated_digest}
        if flat.shards:
            # The store refuses large values (about 8 MiB): shard geometry travels
            # through a side file in the temporary directory instead.
            side = os.path.join(tmp, f".shards_{d.rank:05d}.json")
            with open(side, "w") as f:
                json.dump(flat.shards, f, separators=(",", ":"))
            done_value["shards_file"] = os.path.basename(side)
        d.publish(f"{seq}/done/{d.rank}", done_value)
        if d.coordinator:
            keys = [f"{seq}/done/{r}" for r in range(d.world_size)]
            try:
                values = d.wait_for(keys, "every rank's data", handle.step)
                done = {r: values[k] for r, k in enumerate(keys)}
                failed = {r: v["error"] for r, v in done.items() if not v.get("ok")}
                if failed:
                    raise CheckpointError(f"step {handle.step}: rank(s) failed: {failed}", step=handle.step)
                if len({v["digest"] for v in done.values()}) > 1:
                    raise CheckpointError(f"step {handle.step}: the replicated keys {self.replicated} differ "
                                          f"between ranks; they cannot be written once", step=handle.step)
                for v in done.values():
                    name = v.pop("shards_file", None)
                    if name is not None:
                        with open(os.path.join(tmp, name)) as f:
                            v["shards"] = json.load(f)
                        os.unlink(os.path.join(tmp, name))
                self._commit(handle, tmp, final, done, metadata)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                d.publish(f"{seq}/outcome", {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            # Committed: let the other ranks go on before tidying up.
            d.publish(f"{seq}/outcome", {"ok": True})
            self._after_commit(handle)
            d.delete(keys + [f"{seq - 1}/outcome"])     # every rank has read the previous outcome
        else:
            outcome = d.wait_for([f"{seq}/outcome"], "the coordinator's commit", handle.step)
            result = outcome[f"{seq}/outcome"]
            if not result.get("ok"):
                raise CheckpointError(f"step {handle.step}: not committed: {result.get('error')}",
                                      step=handle.step)

    def _commit(self, handle: SaveHandle, tmp: str, final: str, done: Dict[int, Dict[str, Any]],
                metadata: Dict[str, Any]) -> None:
        """Make the complete temporary directory the committed step (coordinator only)."""
        world = self._dist.world_size
        manifest = {"format_version": fmt.FORMAT_VERSION, "step": handle.step, "world_size": world,
                    "files": [{"rank": r, "name": rank_filename(r), "bytes": done[r]["bytes"]}
                              for r in range(world)],
                    "created_unix": time.time(), "save_id": metadata["lazyckpt"]["save_id"],
                    "metadata": {k: v for k, v in metadata.items() if k != "lazyckpt"}}
        index = shard_index(done)
        if index:
            manifest["shards"] = index
        if self.replicated:
            manifest["replicated"] = [str(k) for k in self.replicated]
        manifest["checksum"] = manifest_checksum(manifest)
        raw = json.dumps(manifest, separators=(",", ":")).encode()
        if len(raw) > MAX_MANIFEST_BYTES:
            # Never commit what the loader would refuse (and let retention delete the
            # previous, loadable step).
            raise CheckpointError(f"step {handle.step}: the manifest would be {len(raw)} bytes, over the "
                                  f"loader's limit of {MAX_MANIFEST_BYTES}", step=handle.step)
        write_file_atomic(os.path.join(tmp, MANIFEST), raw)
        fsync_dir(tmp)
        if handle.cancelled and world == 1:
            raise Aborted("cancelled by close()")
        if os.path.exists(final):
            raise CheckpointError(f"step {handle.step} is already committed in {self.directory}")
        os.rename(tmp, final)
        fsync_dir(self.directory)
        handle.flush_s = time.perf_counter() - handle._t0      # committed and durable
        if world == 1:
            self._after_commit(handle)

    def _after_commit(self, handle: SaveHandle) -> None:
        """Retention and the `latest` marker, once the step is committed."""
        try:
            self._apply_retention()
            # The newest committed step, which need not be this one (a lower step saved late).
            write_file_atomic(os.path.join(self.directory, LATEST), f"{self.latest_step()}\n".encode())
        except OSError as exc:
            # The step is committed; failing to tidy up must not report it as lost.
            log.warning("lazyckpt: step %d committed, but retention/latest failed: %s", handle.step, exc)

    def _watch_snapshot(self, handle: SaveHandle, job: FileWriteJob) -> None:
        job.snapshot_done.wait()
        handle.capture_s = time.perf_counter() - handle._t0
        if job.failed:
            return      # released by _run once the failure is recorded, so the barrier raises it
        handle.snapshot_done.set()

    def _apply_retention(self) -> None:
        if self.keep_last is None:
            return
        steps = self.steps()
        for step in steps[:-self.keep_last]:
            self._delete_step(step)

    def _delete_step(self, step: int) -> None:
        path = os.path.join(self.directory, step_dirname(step))
        trash = os.path.join(self.directory, f".deleting-{step_dirname(step)}-{uuid.uuid4().hex[:8]}")
        # Rename first: a crash mid-delete must not leave a half-deleted "committed" step.
        os.rename(path, trash)
        fsync_dir(self.directory)
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ listing

    def steps(self) -> List[int]:
        """Committed steps, oldest first."""
        out = []
        for name in os.listdir(self.directory):
            m = STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.directory, name, MANIFEST)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, step_dirname(step))

    def clean_leftovers(self) -> List[str]:
        """Remove what interrupted saves and deletes left behind (by dead processes)."""
        removed = []
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-step_"):
                parts = name.split("-")
                pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
                if pid is not None and (pid == os.getpid() or pid_alive(pid)):
                    continue
                if self._dist.distributed and f"-r{self._dist.run_id}-" in name:
                    continue        # this job's own save in progress
            elif not name.startswith(".deleting-step_") and not name.startswith(LATEST + ".tmp-"):
                continue
            path = os.path.join(self.directory, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            removed.append(name)
        if removed:
            log.info("lazyckpt: removed leftovers of interrupted saves: %s", removed)
        return removed

    # ------------------------------------------------------------------ loading

    def load(self, step: Optional[int] = None, map_location: MapLocation = None,
             keys: Optional[List[KeySpec]] = None, into: Any = None, allow_pickle: bool = False) -> Any:
        """Load a committed checkpoint (the latest when ``step`` is None)."""
        self._check_open()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"{self.directory}: no committed checkpoint",
                                              path=self.directory)
        return load_step_dir(self.step_path(step), self.options, self._resources.readers,
                             rank=self._dist.rank, map_location=map_location, keys=keys, into=into,
                             allow_pickle=allow_pickle)

    # ------------------------------------------------------------------ closing

    def close(self, cancel: bool = False) -> None:
        """Drain pending saves (or cancel them with ``cancel=True``), stop every
        thread, release the cache. Raises the first unreported failure."""
        if self._closed:
            return
        try:
            if cancel:
                for handle in self._pending():
                    if handle.done():
                        continue
                    handle.cancelled = True
                    if handle._job is not None:
                        handle._job.cancel()
            for handle in self._pending():
                handle._done.wait()
        finally:
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            if self._thread is not None:
                self._thread.join()
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._resources.close()
        self._raise_unreported()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close(cancel=True)
            except Exception:
                pass


def load_step_dir(path: str, options: Options, pool, rank: Optional[int] = None, **kwargs: Any) -> Any:
    """Load a committed step directory through its manifest.

    With several saving ranks, rank ``r`` loads the state of saving rank
    ``r % world_size`` (replicated entries and DTensor shards are gathered from
    whichever files hold them). ``rank`` defaults to this process's rank.
    """
    manifest_path = os.path.join(path, MANIFEST)
    try:
        raw = read_small_file(manifest_path, MAX_MANIFEST_BYTES)
    except NotARegularFile:
        raise CorruptCheckpointError(f"{manifest_path}: not a regular file", path=manifest_path) from None
    if raw is None:
        raise CheckpointNotFoundError(f"{path}: no committed checkpoint (no {MANIFEST})", path=path)
    manifest = parse_manifest(raw, manifest_path)
    if rank is None:
        rank = _current_rank()
    step = StepFiles(path, manifest, options)
    return load_tree(step.file(rank % manifest["world_size"]), step, pool, **kwargs)


def _current_rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except ImportError:
        return 0


def parse_manifest(raw: bytes, path: str) -> Dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes", path=path)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError(f"{path}: manifest is not valid JSON", path=path) from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{path}: manifest is not a JSON object", path=path)
    fmt.check_version(manifest.get("format_version"), path)
    files = manifest.get("files")
    world = manifest.get("world_size")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and re.fullmatch(r"rank_\d{5}\.lzc", f["name"])
            and type(f.get("rank")) is int and f["name"] == rank_filename(f["rank"]) for f in files):
        raise CorruptCheckpointError(f"{path}: manifest lists no valid data files", path=path)
    if type(world) is not int or world != len(files) or \
            sorted(f["rank"] for f in files) != list(range(world)):
        raise CorruptCheckpointError(f"{path}: manifest world_size {world!r} does not match its files",
                                     path=path)
    expected = manifest.pop("checksum", None)
    if expected != manifest_checksum(manifest):
        raise CorruptCheckpointError(f"{path}: manifest checksum mismatch (file damaged)", path=path)
    return manifest


def manifest_checksum(manifest: Dict[str, Any]) -> int:
    """xxh3-64 of the manifest's canonical JSON, without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return fmt.checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())




def _check_metadata(metadata: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """User metadata goes into the footer and manifest as JSON: refuse what would
    not round-trip, on the caller's thread rather than after the data is written."""
    metadata = dict(metadata or {})
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serializable: {exc}") from None
    if json.loads(text) != metadata:
        raise ValueError("metadata must round-trip through JSON (string keys, no tuples)")
    for reserved in ("step", "lazyckpt"):
        if reserved in metadata:
            raise ValueError(f"metadata key {reserved!r} is reserved (the Checkpointer records it)")
    return metadata
