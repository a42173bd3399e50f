"""Directory layout: how checkpoints are named, listed, committed, retired and
cleaned up on a file system. This module knows checkpoints, not bytes; it is
the one place the Checkpointer, the CLI tools and the integrations use for
names, `latest`, retention, leftovers and pending saves (docs/FORMAT.md §11).

It decides what a process may delete: a temporary file or directory is
removed only when it is *provably dead* (``locks.is_live`` is false: no file
of it locked by anyone, none modified within ``lease_expiry_s``); retention
skips a step whose manifest a reader holds (``locks.StepDir.reading``) and
retries at its next pass. Who holds what is ``storage/locks.py``; the names
are ``formats/names.py``; the bytes are ``storage/fileio.py``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple, Union

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import ABANDONED_PREFIX, DELETING_PREFIX, LATEST, MANIFEST, PREPARED, SMALL_TEMP, STEP_DIR, TEMP_PREFIX, WRITER, rank_filename, step_dirname
from lazyckpt.lineage import Committing, Event, event_problem, manifest_event
from lazyckpt.retention import Plan, Policy, as_policy, keeps_superseded, need, plan, saved_metadata
from lazyckpt.storage.record import LocalRecord
from .scan import BackgroundScan
from .base import Leftover, StepRecord
from .fileio import (free_later, fsync_dir, make_dirs_durable, read_small_file, remove_quietly, remove_tree,
                     replace_releasing_later, write_file_atomic)
from .iomode import open_local_output
from .sidefiles import sibling_temp
from . import locks
from .locks import DEFAULT_EXPIRY_S, Lease, WriterLease, is_live, lock_for_delete, new_token

log = logging.getLogger("lazyckpt")


# --------------------------------------------------------------------------- leftovers


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (or of the file itself)."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _step_in(name: str) -> Optional[int]:
    m = re.search(r"step_(\d{10})", name)
    return int(m.group(1)) if m else None


def _flock(fd: int, operation: int) -> None:
    locks._flock(fd, operation)         # the one seam tests patch to play a file system without locks


def _lock_dir(fd: int, timeout_s: Optional[float]) -> bool:
    """Exclusive flock on a directory fd; False if another holder kept it past ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True             # no locks on this file system
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


#: Leftover kinds :meth:`CheckpointDir.tidy` watches while they are live (a save
#: in progress, a trash a reader holds); abandoned steps stay until retention.
_WATCHED = ("saving",)


# --------------------------------------------------------------------------- a Checkpointer directory


class CheckpointDir:
    """A directory of committed steps (docs/FORMAT.md §11).

    Invariant: the committed steps form one line of history, so the step
    order *is* the commit order and the latest step is the most recently
    committed one. Committing step S supersedes every committed step >= S
    (a run resumed from an older step abandons the newer ones).

    The commit point is one atomic write: ``history.json`` recording the
    commit and naming its complete temporary directory. The renames that
    follow (the superseded steps aside, the new step in) are cleanup that
    :meth:`recover` replays after a crash, and until they are done the
    committed steps are what :meth:`step_paths` computes from the record:
    the steps below S and S itself, still in its temporary directory. So a
    crash at any instant leaves either the line before the commit or the
    line with S, never an abandoned step (docs/RELIABILITY.md). Superseded
    steps are kept aside as ``.abandoned-*`` when retention is off, deleted
    otherwise. Commits, recovery and takeovers of the writer lease hold an
    exclusive lock on the directory itself (:meth:`commit_lock`): a writer
    displaced by a takeover checks its lease under that lock, so it can
    never publish after the takeover.
    """

    def __init__(self, path: str, lease_expiry_s: float = DEFAULT_EXPIRY_S):
        self.path = os.path.abspath(os.fspath(path))
        self.lease_expiry_s = lease_expiry_s
        #: (step, the manifest's inode, mtime, ctime, size) -> (its references, its save's
        #: metadata): a committed manifest never changes in place, so retention parses each
        #: one once, not every kept step's at every commit (a policy keeping K steps would
        #: cost K parses a commit). Bounded by the steps present (:meth:`_plan`).
        self._manifests: Dict[Tuple[int, int, int, int, int], Tuple[Optional[List[int]], Dict[str, Any]]] = {}
        #: The writer lease this process holds here (``WriterLease``), checked at every commit.
        self.writer: Optional["WriterLease"] = None
        self._lock_depth = 0
        self._lock_mutex = threading.RLock()
        self._lock_fd = -1
        #: Leftovers to look at again after a commit (:meth:`tidy`): what the last full scan
        #: found still live, and this writer's own trash a reader kept it from removing.
        #: Bounded by the crashes and busy readers, not by the steps kept.
        self._watch: set = set()
        self._watch_mutex = threading.Lock()
        #: The full leftover scan started at open (:meth:`start_tidy`).
        self._scan = BackgroundScan(self._scan_all, self.path)
        #: Removals of steps retention renamed aside, running on the release thread
        #: (:meth:`apply_retention`); the finished ones are dropped at each new one.
        self._frees: List[Any] = []

    # ---------------------------------------------------------------- names

    def step_path(self, step: int) -> str:
        return os.path.join(self.path, step_dirname(step))

    def temp_path(self, step: int, token: str) -> str:
        return os.path.join(self.path, f"{TEMP_PREFIX}{step_dirname(step)}-{token}")

    # ---------------------------------------------------------------- listing

    def _present(self, stats: Optional[Dict[int, os.stat_result]] = None) -> Dict[int, str]:
        """step -> path of every ``step_*`` directory holding a manifest (the names
        alone). ``stats``: filled with each manifest's ``stat`` (taken anyway)."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: no such directory", path=self.path) from None
        out = {}
        for name in names:
            m = STEP_DIR.match(name)
            if not m:
                continue
            try:
                st = os.stat(os.path.join(self.path, name, MANIFEST))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                step = int(m.group(1))
                out[step] = os.path.join(self.path, name)
                if stats is not None:
                    stats[step] = st
        return dict(sorted(out.items()))

    def _interrupted(self) -> Optional[Committing]:
        """The record's last commit if its renames have not run yet: its
        temporary directory still holds the complete step (one ``stat`` when
        there is none)."""
        committing = LocalRecord(self.path).committing()
        if committing is None:
            return None
        tmp = os.path.join(self.path, committing.tmp)
        if not os.path.isfile(os.path.join(tmp, MANIFEST)):
            return None                 # renamed in: that commit is complete
        return committing

    def step_paths(self) -> Dict[int, str]:
        """The committed steps and where each one is, oldest first. Between a
        commit point and the end of its renames (a commit in progress, or
        interrupted by a crash until :meth:`recover` runs) the line is the
        record's: the steps below S, and S from its temporary directory."""
        return self._step_paths(None)

    def _step_paths(self, stats: Optional[Dict[int, os.stat_result]]) -> Dict[int, str]:
        """:meth:`step_paths`; ``stats``: filled with the ``stat`` of the manifests
        under their step names (``step_*``), as the listing found them."""
        present = self._present(stats)
        committing = self._interrupted()
        if committing is None:
            return present
        step = committing.event.step
        for s in [s for s in (stats or {}) if s >= step]:
            del stats[s]                # superseded, or not under its name yet
        out = {s: p for s, p in present.items() if s < step}
        out[step] = os.path.join(self.path, committing.tmp)
        return out

    def steps(self) -> List[int]:
        """Committed steps, oldest (= first committed) first."""
        return list(self.step_paths())

    def superseded_by_record(self, step_path: str) -> bool:
        """Whether a ``step_*`` directory here is no longer on the line: a
        commit recorded after it superseded it and its renames have not run."""
        committing = self._interrupted()
        m = STEP_DIR.match(os.path.basename(step_path))
        return committing is not None and m is not None and int(m.group(1)) >= committing.event.step

    def tail(self) -> Optional[Tuple[int, str]]:
        """The latest committed step and where it is, from the index -- the
        record's last commit, when ``DIR/latest`` names the same step and that
        step is complete -- in a few ``stat`` calls whatever the number of
        steps kept; None when the index cannot be trusted (no record, a crash
        between the commit point and ``latest``, the step deleted by hand or
        by ``prune``, a commit that kept no line of history): then the caller
        lists. Why it is right: a commit of S supersedes every step >= S, so
        the last commit's step is the newest one on the line until something
        deletes it; every commit writes ``latest`` last and a commit without a
        record removes ``latest`` first (FORMAT.md §11.10)."""
        committing = LocalRecord(self.path).committing()
        if committing is None:
            return None
        step = committing.event.step
        tmp = os.path.join(self.path, committing.tmp)
        if os.path.isfile(os.path.join(tmp, MANIFEST)):
            return step, tmp            # committed, renames pending: the record's line
        if self.latest_file() != step:
            return None
        path = self.step_path(step)
        return (step, path) if os.path.isfile(os.path.join(path, MANIFEST)) else None

    def latest(self) -> Optional[int]:
        tail = self.tail()
        if tail is not None:
            return tail[0]
        steps = self.steps()
        return steps[-1] if steps else None

    def index_mark(self) -> bytes:
        """Nothing: a lookup here is a few ``stat`` calls, not worth sharing."""
        return b""

    def locate_step(self, step: Optional[int], mark: Optional[bytes] = None) -> Optional[Tuple[int, str]]:
        """(step, where it is) for a committed step (None: the latest), or None
        if it is not committed: the view of :meth:`step_paths` for one step,
        in a few ``stat`` calls, listing only when the index cannot be trusted."""
        if step is None:
            tail = self.tail()
            if tail is not None:
                return tail
            paths = self.step_paths()
            return (max(paths), paths[max(paths)]) if paths else None
        committing = self._interrupted()
        if committing is not None and step >= committing.event.step:
            return (step, os.path.join(self.path, committing.tmp)) if step == committing.event.step else None
        path = self.step_path(step)
        return (step, path) if os.path.isfile(os.path.join(path, MANIFEST)) else None

    def latest_file(self) -> Optional[int]:
        """What ``DIR/latest`` says (advisory: readers trust the listing)."""
        raw = read_small_file(os.path.join(self.path, LATEST), 64)
        try:
            return int(raw.decode().strip()) if raw is not None else None
        except (UnicodeDecodeError, ValueError):
            return None

    # ---------------------------------------------------------------- commit

    @contextlib.contextmanager
    def commit_lock(self, timeout_s: Optional[float] = None) -> Iterator[bool]:
        """An exclusive ``flock`` on the directory itself, held by a commit, a
        recovery and a takeover of the writer lease (reentrant within this
        object). Yields False, holding nothing, if another holder kept it past
        ``timeout_s`` (``0``: do not wait); True otherwise (also where the file
        system has no locks: there the writer lease alone orders writers)."""
        with self._lock_mutex:
            if self._lock_depth:
                self._lock_depth += 1
                try:
                    yield True
                finally:
                    self._lock_depth -= 1
                return
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            try:
                if not _lock_dir(fd, timeout_s):
                    yield False
                    return
                self._lock_depth = 1
                try:
                    yield True
                finally:
                    self._lock_depth = 0
            finally:
                os.close(fd)            # drops the lock

    def commit(self, tmp: str, step: int, keep_superseded: bool, event: Any = None) -> List[int]:
        """Make the complete, fsynced temporary directory ``tmp`` the committed
        ``step``; returns the steps it superseded (>= step). With ``event``
        (the commit's line-of-history event), the record written under the
        commit lock is the commit point and the renames are replayed by
        :meth:`recover` after a crash; without it (no line of history is kept)
        the rename is."""
        with self.commit_lock():
            if self.writer is not None:
                self.writer.check()     # displaced by a takeover: commit nothing (fenced by the lock)
            self._recover_locked()      # an earlier commit's renames first (a crash, or an error)
            name = self.step_path(step)
            if os.path.lexists(name) and not os.path.isfile(os.path.join(name, MANIFEST)):
                # Checked before the commit point: the rename could never land.
                raise CheckpointError(f"{name} is in the way of step {step}: it is not a committed step (no "
                                      f"{MANIFEST}); move it away", path=name, step=step)
            # Before the commit point (after it the index names the new step).
            superseded = self._superseded(step)
            if event is None:
                # No record names this commit: the index must not outlive it (tail()).
                remove_quietly(os.path.join(self.path, LATEST))
                fsync_dir(self.path)
                return self._move_in(tmp, step, keep_superseded, undo=True, superseded=superseded)
            record = LocalRecord(self.path)
            before = read_small_file(record.path, 16 << 20)
            try:
                # The record's own write is inside: an fsync of it that fails leaves the
                # commit point's durability unknown, and the save is undone as below.
                record.add(event, tmp=os.path.basename(tmp))
                return self._move_in(tmp, step, keep_superseded, undo=True, superseded=superseded)
            except BaseException:
                # This process is alive to undo it: the failed save changes nothing (the
                # superseded steps are back, the record as it was). If the undo of the
                # renames failed, the step stays committed (the record says so) and
                # recovery finishes it.
                back = os.path.isfile(os.path.join(tmp, MANIFEST)) and \
                    all(os.path.isfile(os.path.join(self.step_path(s), MANIFEST)) for s in superseded)
                if back and read_small_file(record.path, 16 << 20) != before:
                    if before is None:
                        remove_quietly(record.path)
                    else:
                        write_file_atomic(record.path, before)
                raise

    def recover(self, wait: bool = True) -> List[int]:
        """Finish a commit whose renames a crash interrupted (roll forward: its
        record is the commit point); returns the steps it superseded. Without
        ``wait``, skipped while another process holds the commit lock (a live
        commit finishes its own renames)."""
        with self.commit_lock(None if wait else 0) as held:
            if not held and not wait:
                return []
            return self._recover_locked()

    def _recover_locked(self) -> List[int]:
        committing = self._interrupted()
        if committing is None:
            return []
        log.warning("lazyckpt: %s: finishing the commit of step %d that a crash interrupted", self.path,
                    committing.event.step)
        return self._move_in(os.path.join(self.path, committing.tmp), committing.event.step, keep_superseded=True)

    def _superseded(self, step: int) -> List[int]:
        """The committed steps >= ``step``. A commit past the latest step (every
        commit but a rollback's) supersedes nothing and needs no listing."""
        tail = self.tail()
        if tail is not None and step > tail[0]:
            return []
        return [s for s in self._present() if s >= step]

    def _move_in(self, tmp: str, step: int, keep_superseded: bool, undo: bool = False,
                 superseded: Optional[List[int]] = None) -> List[int]:
        """The renames after a commit point. ``undo``: if one fails, or the
        fsync of the directory after the new step's rename does, the new step
        goes back to ``tmp`` and the steps already moved aside are put back
        before the error propagates. An fsync that failed leaves the rename's
        durability unknown: the save is then undone, not reported committed,
        so the caller (which puts the record back) sees the line before, the
        listing agrees with it and a retry of the step finds its name free.
        Without ``undo`` (recovery: the record says committed) the error
        propagates with the renames done; the record and the listing agree.
        ``superseded``: the steps >= ``step`` (listed when not given)."""
        if superseded is None:
            superseded = [s for s in self._present() if s >= step]
        retired = []
        moved_in = False
        try:
            for s in sorted(superseded, reverse=True):
                trash = self._retire(s, ABANDONED_PREFIX if keep_superseded else DELETING_PREFIX, force=True)
                if trash is not None:
                    retired.append((s, trash))
            if retired:
                fsync_dir(self.path)    # the old line is gone before the new step appears
                log.warning("lazyckpt: %s: step %d supersedes step(s) %s of an abandoned run (%s)", self.path,
                            step, superseded, "kept as .abandoned-*" if keep_superseded else "deleted")
            os.rename(tmp, self.step_path(step))
            moved_in = True
            fsync_dir(self.path)
        except BaseException:
            if undo:
                if moved_in:
                    os.rename(self.step_path(step), tmp)
                for s, trash in reversed(retired):
                    os.rename(trash, self.step_path(s))
                try:
                    fsync_dir(self.path)
                except OSError as exc:  # the renames back are visible: the line before, as reported
                    log.warning("lazyckpt: %s: fsync after undoing the commit of step %d failed: %s",
                                self.path, step, exc)
            raise
        retired = [trash for _s, trash in retired]
        if not keep_superseded:
            for trash in retired:
                self._remove_trash(trash)
        return superseded

    def pending(self, step: int, save_id: str, token: str) -> "PendingStepDir":
        return PendingStepDir(self, step, save_id, token)

    def listing(self) -> Tuple[Dict[int, str], List[Any]]:
        # The save ids are in the manifests (one small read per step); the events in DIR/history.json.
        committed = {}
        for step in self.steps():
            event = manifest_event(read_small_file(os.path.join(self.step_path(step), MANIFEST),
                                                   manifests.MAX_MANIFEST_BYTES))
            if event is not None and event.step == step:
                committed[step] = event.save_id
        return committed, LocalRecord(self.path).read()[1]

    def save_path(self, step: int, save_id: str) -> str:
        return self.step_path(step)         # one save per step name here: the committed one

    def record_event(self, event: Any) -> None:
        """The local record of the line of history (``DIR/history.json``)."""
        LocalRecord(self.path).add(event)

    def write_latest(self, step: int) -> None:
        write_file_atomic(os.path.join(self.path, LATEST), f"{step}\n".encode())

    def acquire_writer(self, heartbeat_s: float, expiry_s: float, takeover: bool = False,
                       fence: Optional[str] = None) -> "WriterLease":
        # ``fence`` is for stores that fence by save id; here the commit lock fences.
        if not takeover:
            return WriterLease(self.path, heartbeat_s, expiry_s, commit_lock=self.commit_lock)
        # Under the commit lock: a displaced writer inside its commit finishes it first (its
        # commit precedes the takeover), and any later commit of it checks its lease under
        # the same lock and is refused (fencing).
        with self.commit_lock(expiry_s) as held:
            if not held:
                raise CheckpointError(f"{self.path}: cannot take over the writer lease: a commit in another "
                                      f"process has held this directory's commit lock for over {expiry_s:.0f} s",
                                      path=self.path)
            return WriterLease(self.path, heartbeat_s, expiry_s, takeover=True, commit_lock=self.commit_lock)

    # ---------------------------------------------------------------- retention

    def apply_retention(self, policy: Union[None, int, Policy]) -> List[int]:
        """Delete the steps ``policy`` does not keep (None: keep every step) --
        never the newest, never a step a kept step refers to (incremental
        checkpoints) -- and, unless the policy keeps superseded steps
        (``retention.keeps_superseded``), those a rollback set aside. A step
        another process is reading is kept until a later pass. The deleted
        steps leave the listing before this returns (renamed aside, durably);
        their bytes are freed after, on the release thread (:meth:`_free_later`)."""
        policy = as_policy(policy)
        if policy is None:
            return []
        deleted, _kept = self.retire_old(policy, free=self._free_later)
        if not keeps_superseded(policy):
            for leftover in self.leftovers():
                if leftover.kind == "abandoned":
                    self._free_later(os.path.join(self.path, leftover.name))
        return deleted

    def _free_later(self, trash: str) -> None:
        """Remove ``trash`` (a step renamed aside, durably) on the release
        thread: a commit's retention returns once the step is out of the
        listing, not once its bytes are freed (for a 0.8 GB step, a tree
        removal and, on a ``discard`` mount, a synchronous TRIM: 0.2-0.4 s
        here). A crash before the removal ends leaves a ``.deleting-*``
        leftover that the scan at the next open removes; it is never listed
        as a step. :meth:`wait_for_frees` waits for these removals."""
        job = free_later(self._remove_trash, trash)
        with self._watch_mutex:
            self._frees = [f for f in self._frees if not f.done()] + [job]

    def wait_for_frees(self, timeout: Optional[float] = None) -> bool:
        """Block until every step retention moved aside so far is removed
        (its space freed; one a reader holds is left to :meth:`tidy`); False
        if ``timeout`` ran out first."""
        with self._watch_mutex:
            frees = list(self._frees)
        _done, left = cf.wait(frees, timeout)
        return not left

    def _manifest_facts(self, step: int, st: Optional[os.stat_result] = None
                        ) -> Tuple[Optional[List[int]], Dict[str, Any]]:
        """(the earlier steps ``step`` refers to, or None if its manifest cannot be
        read; its save's metadata), parsed once per manifest (``_manifests``).
        ``st``: the manifest's ``stat`` if just taken."""
        if st is None:
            try:
                st = os.stat(os.path.join(self.step_path(step), MANIFEST))
            except FileNotFoundError:
                return [], {}                          # gone meanwhile: needs nothing
        key = (step, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        found = self._manifests.get(key)
        if found is not None:
            return found
        path = os.path.join(self.step_path(step), MANIFEST)
        raw = read_small_file(path, manifests.MAX_MANIFEST_BYTES)
        if raw is None:
            return [], {}
        try:
            parsed = manifests.parse(raw, self.step_path(step))
            facts: Tuple[Optional[List[int]], Dict[str, Any]] = (manifests.references(parsed),
                                                                 saved_metadata(parsed))
        except Exception:                              # unreadable: assume it needs everything older
            facts = (None, {})
        self._manifests[key] = facts
        return facts

    def references(self, step: int) -> Optional[List[int]]:
        """The earlier steps whose files hold bytes of ``step`` (its manifest);
        None if the manifest cannot be read (then it may need any of them)."""
        return self._manifest_facts(step)[0]

    def step_metadata(self, step: int) -> Dict[str, Any]:
        """The ``metadata=`` the save of committed ``step`` recorded ({} if unreadable)."""
        return self._manifest_facts(step)[1]

    def retention_plan(self, policy: Union[None, int, Policy]) -> Tuple[List[int], List[int]]:
        """(steps to delete, newest first; older steps kept because a kept step
        refers to them). Deleting newest first never leaves a remaining step
        referring to a deleted one, whatever instant a crash hits."""
        found = self._plan(as_policy(policy))
        return found.doomed, found.referred

    def _plan(self, policy: Optional[Policy]) -> Plan:
        """:func:`lazyckpt.retention.plan` over every step, from one listing (whose
        ``stat`` of each manifest keys the parsed ones: a step is looked at once)."""
        stats: Dict[int, os.stat_result] = {}
        steps = list(self._step_paths(stats))
        if len(self._manifests) > len(steps):
            present = set(steps)
            for key in [k for k in self._manifests if k[0] not in present]:
                del self._manifests[key]               # bounded by the steps present
        facts: Dict[int, Tuple[Optional[List[int]], Dict[str, Any]]] = {}

        def of(step: int) -> Tuple[Optional[List[int]], Dict[str, Any]]:
            if step not in facts:
                facts[step] = self._manifest_facts(step, stats.get(step))
            return facts[step]
        return plan(policy, steps, lambda s: of(s)[1], lambda s: of(s)[0])

    def _need(self, step: int, needed: set, steps: List[int]) -> None:
        need([step], needed, steps, self.references)

    def retire_old(self, policy: Union[None, int, Policy], line: Optional[List[int]] = None,
                   free: Optional[Callable[[str], None]] = None) -> Tuple[List[int], List[int]]:
        """Apply ``retention_plan``: returns (deleted, kept because referred to
        or being read). ``line``: filled with the committed steps this left
        (a commit after it is not among them). ``free``: removes each step
        renamed aside (default: here, before returning).

        Decided and acted on under the commit lock: deletions go by step
        number, and a commit in another process (a rollback) can put a new
        save under a number planned for deletion; under the lock the plan is
        of the line as it is when the renames run. Only the renames aside are
        under it; the trash is removed after."""
        deleted, kept, trash = [], [], []
        with self.commit_lock():
            steps, _kept, needed, doomed, referred = self._plan(as_policy(policy))
            needed = set(needed)
            kept = list(referred)
            for step in doomed:                        # newest first
                if step in needed:                     # a busy step below needs it
                    kept.append(step)
                    continue
                moved = self._retire(step, DELETING_PREFIX, force=False)
                if moved is not None:
                    deleted.append(step)
                    trash.append(moved)
                else:
                    log.info("lazyckpt: %s: step %d is being read; deleting it later", self.path, step)
                    kept.append(step)
                    needed.add(step)
                    self._need(step, needed, steps)    # it stays, so must what it refers to
            if trash:
                fsync_dir(self.path)
            if line is not None:
                line[:] = [s for s in steps if s not in deleted]
        for moved in trash:
            (free or self._remove_trash)(moved)
        if referred:
            log.info("lazyckpt: %s: keeping step(s) %s: kept steps refer to their bytes", self.path, referred)
        return deleted, sorted(kept)

    def reading(self, step: int) -> ContextManager[Any]:
        """Hold committed ``step`` against deletion while it is read or sent
        (a shared lock on its manifest; not entered yet)."""
        return locks.StepDir(self.step_path(step), step).reading()

    def record(self) -> LocalRecord:
        """This directory's record of commits (``history.json``, the commit point)."""
        return LocalRecord(self.path)

    def delete_step(self, step: int, even_if_read: bool = False) -> bool:
        """Rename the step to ``.deleting-*``, fsync, then remove it (FORMAT.md §11.4).
        Returns False (and leaves it) if a reader holds it, unless ``even_if_read``.
        The rename is under the commit lock: between a caller's decision and
        this act no commit puts another save under that number."""
        with self.commit_lock():
            trash = self._retire(step, DELETING_PREFIX, force=even_if_read)
            if trash is None:
                return False
            fsync_dir(self.path)
        self._remove_trash(trash)
        return True

    def _retire(self, step: int, prefix: str, force: bool) -> Optional[str]:
        path = self.step_path(step)
        fd, busy = lock_for_delete(path)
        if busy and not force:
            return None
        trash = os.path.join(self.path, f"{prefix}{step_dirname(step)}-{new_token()}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return None                 # removed meanwhile (a prune in another process)
        finally:
            if fd is not None:
                os.close(fd)
        for key in [k for k in list(self._manifests) if k[0] == step]:
            del self._manifests[key]    # a step committed again under this number is parsed anew
        return trash

    def _remove_trash(self, trash: str) -> None:
        fd, busy = lock_for_delete(trash)
        if fd is not None:
            os.close(fd)
        if busy:
            with self._watch_mutex:
                self._watch.add(os.path.basename(trash))    # a reader still holds it: tidy() retries
            return
        shutil.rmtree(trash, ignore_errors=True)

    # ---------------------------------------------------------------- leftovers

    def leftovers(self, expiry_s: Optional[float] = None, names: Optional[List[str]] = None,
                  writer: bool = True, stop: Optional[Callable[[], bool]] = None) -> List[Leftover]:
        """What interrupted saves, deletes and superseded steps left here
        (``names``: only among those, without listing the directory; without
        ``writer``, the writer lease is not looked at; ``stop``: asked before
        each name, True ends the look there, with what was found so far)."""
        expiry = self.lease_expiry_s if expiry_s is None else expiry_s
        out = []
        now = time.time()
        committing = self._interrupted()
        prepared = self._prepared_name()
        if names is None:
            # Read incrementally, the cancel looked at between names: closing does not
            # wait for a listing that grows with the steps kept (storage/scan.py).
            names = []
            with os.scandir(self.path) as entries:
                for entry in entries:
                    if stop is not None and stop():
                        return out
                    names.append(entry.name)
        for name in sorted(names):
            if stop is not None and stop():
                break
            path = os.path.join(self.path, name)
            if names is not None and not os.path.lexists(path):
                continue
            if committing is not None and name == committing.tmp:
                continue                # a committed step whose rename is pending (recover): not a leftover
            if name.startswith(TEMP_PREFIX + "step_") and prepared in (name, "*"):
                kind = "prepared"       # the job's decision commits or removes it (saving/jobcommit.py)
            elif name.startswith(TEMP_PREFIX + "step_"):
                kind = "saving" if is_live(path, expiry, now) else "interrupted-save"
            elif name.startswith(DELETING_PREFIX + "step_"):
                kind = "deleting"
            elif name.startswith(ABANDONED_PREFIX + "step_"):
                kind = "abandoned"
            elif SMALL_TEMP.match(name):
                kind = "saving" if is_live(path, expiry, now) else "small-tmp"
            elif name == WRITER:
                if not writer or is_live(path, expiry, now):
                    continue            # a live writer's lease: not a leftover
                kind = "dead-writer"
            elif STEP_DIR.match(name) and os.path.isdir(path) and \
                    not os.path.isfile(os.path.join(path, MANIFEST)):
                kind = "incomplete-step"
            else:
                continue
            out.append(Leftover(name, kind, tree_bytes(path), _step_in(name)))
        return out

    def clean_leftovers(self, names: Optional[List[str]] = None, writer: bool = True,
                        stop: Optional[Callable[[], bool]] = None) -> List[str]:
        """Remove what is provably dead: expired saves, interrupted deletes (not
        being read), stale small temporaries. Never a live save, never data.
        The leftovers still live are watched (:meth:`tidy` looks at them again).
        ``names``: only among those (no listing). ``stop``: asked before each
        name and each removal (a scan cancelled by close)."""
        removed = []
        found = self.leftovers(names=names, writer=writer, stop=stop)
        with self._watch_mutex:
            if names is not None:
                self._watch.difference_update(names)
            self._watch.update(x.name for x in found if not x.removable and x.kind in _WATCHED)
        for leftover in found:
            if not leftover.removable:
                continue
            if stop is not None and stop():
                break
            path = os.path.join(self.path, leftover.name)
            if leftover.kind == "deleting":
                self._remove_trash(path)
            elif leftover.kind == "dead-writer":
                self._remove_dead_writer()
            else:
                remove_tree(path)
            if not os.path.lexists(path):
                removed.append(leftover.name)
        if removed:
            log.info("lazyckpt: %s: removed leftovers of interrupted saves: %s", self.path, removed)
        return removed

    def _remove_dead_writer(self) -> Optional[str]:
        """Remove ``.writer`` if its holder is dead, judged on the file unlinked
        (locks.remove_dead_lease): between a listing that found it dead and the
        unlink, a restarted run may have taken it. Under the commit lock, so no
        takeover renames a new lease over it meanwhile; a lock held by a commit
        leaves it for a later cleanup. None when gone, else why it stays."""
        with self.commit_lock(0) as held:
            if not held:
                return "a commit in another process holds the directory; left for a later cleanup"
            return locks.remove_dead_lease(os.path.join(self.path, WRITER), self.lease_expiry_s)

    # ---------------------------------------------------------------- a save waiting for the job (replicas=)

    def prepare(self, tmp: str, event: Event, keep_superseded: bool) -> None:
        """Mark the complete, fsynced temporary directory ``tmp`` (its manifest
        written) *prepared*: from here on no cleanup removes it, only the job's
        decision commits or discards it (lazyckpt/saving/jobcommit.py). One
        marker, ``DIR/prepared.json``: a node commits its saves one at a time,
        and opening reads one small file, not a listing."""
        doc = {"prepared": [event.step, event.save_id, event.seq, os.path.basename(tmp)],
               "keep_superseded": bool(keep_superseded)}
        write_file_atomic(os.path.join(self.path, PREPARED), json.dumps(doc).encode())

    def prepared(self) -> Optional[Tuple[Committing, bool]]:
        """The prepared save (its event and temporary directory) and whether its
        commit keeps the steps it supersedes; None without one. A damaged
        marker is ``CorruptCheckpointError``: guessing could commit or drop the
        wrong save."""
        path = os.path.join(self.path, PREPARED)
        raw = read_small_file(path, 1 << 16)
        if raw is None:
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))
            step, sid, seq, tmp = doc["prepared"]
            keep = doc["keep_superseded"]
            if event_problem(step, sid, seq, seq_optional=False) or not isinstance(tmp, str) or os.sep in tmp \
                    or not tmp.startswith(TEMP_PREFIX + "step_") or type(keep) is not bool:
                raise ValueError(doc)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(f"{path}: not a valid record of a prepared save ({exc}); the job "
                                         f"cannot decide whether to commit it", path=path) from None
        return Committing(Event(step, sid, seq), tmp), keep

    def _prepared_name(self) -> Optional[str]:
        """The name of the prepared temporary directory; "*" (every one) when the
        marker is damaged: nothing is removed that the job may still need."""
        try:
            found = self.prepared()
        except CorruptCheckpointError:
            return "*"
        return found[0].tmp if found is not None else None

    def forget_prepared(self, tmp: str) -> None:
        """The job decided on ``tmp``: its marker goes (before the directory is
        removed, so a crash between never leaves a marker naming nothing that
        the job may roll forward)."""
        if self._prepared_name() == os.path.basename(tmp):
            remove_quietly(os.path.join(self.path, PREPARED))

    def discard_prepared(self, tmp: str) -> None:
        """The job decided against ``tmp``: the marker, then the directory."""
        self.forget_prepared(tmp)
        remove_tree(tmp)

    def start_tidy(self) -> None:
        """At open: a dead writer's lease is removed now (one name, before this
        Checkpointer's first save can take the lease: removed later, it could
        be the new lease), then the full leftover scan (one listing of the
        directory, which grows with the steps kept) runs in the background
        (storage/scan.py), leaving ``.writer`` alone."""
        self.clean_leftovers([WRITER])
        self._scan.start()

    def _scan_all(self) -> List[str]:
        return self.clean_leftovers(writer=False, stop=self._scan.cancelled.is_set)

    def tidy(self) -> List[str]:
        """After a commit: the leftovers known to need another look (those the
        scan at open found live, this writer's trash a reader held), not a
        listing of the directory: a commit costs the same whatever the number
        of steps kept. Leftovers that appear later from another process (a
        writer displaced by a takeover) wait for the next open, an explicit
        :meth:`clean_leftovers` or ``lazyckpt prune``."""
        self._scan.join()
        with self._watch_mutex:
            names = sorted(self._watch)
        return self.clean_leftovers(names) if names else []

    def close(self) -> None:
        """Cancel the scan started at open: it stops at its next name (a
        listing grows with the steps kept, closing must not: storage/scan.py)."""
        self._scan.cancel()

    # ---------------------------------------------------------------- the read side (base.Directory)

    def step_records(self) -> List[StepRecord]:
        return [StepRecord(step, os.path.basename(path), path, tree_bytes(path))
                for step, path in self.step_paths().items()]

    def remove_leftovers(self, leftovers: List[Leftover]) -> Dict[str, Optional[str]]:
        """What ``leftovers()`` listed goes as it is (prune asked for it); locks
        were checked when it was listed."""
        out: Dict[str, Optional[str]] = {}
        for leftover in leftovers:
            try:
                if leftover.kind == "dead-writer":
                    out[leftover.name] = self._remove_dead_writer()
                    continue
                if leftover.kind == "abandoned":
                    out[leftover.name] = self._remove_abandoned(leftover.name)
                    continue
                remove_tree(os.path.join(self.path, leftover.name))
                out[leftover.name] = None
            except OSError as exc:
                out[leftover.name] = f"{exc.strerror or exc}"
        return out

    def _remove_abandoned(self, name: str) -> Optional[str]:
        """A step set aside by a rollback is abandoned only once that commit
        holds: one that fails puts it back under its step name. So it is moved
        to the trash under the commit lock (a commit in progress ends first),
        if it is still there, and removed after. None when removed, else why
        it stays."""
        path = os.path.join(self.path, name)
        with self.commit_lock():
            if not os.path.lexists(path):
                return "no longer there (a failed commit put it back, or another process removed it); kept"
            trash = os.path.join(self.path, DELETING_PREFIX + name[len(ABANDONED_PREFIX):])
            os.rename(path, trash)
            fsync_dir(self.path)
        self._remove_trash(trash)
        return None


# --------------------------------------------------------------------------- saves in progress

class PendingStepDir:
    """A save of one step into a :class:`CheckpointDir` (``base.PendingStep``):
    a temporary directory ``.tmp-step_X-<token>`` that the commit renames into
    place once every rank's file and the manifest are durable."""

    needs_create = True

    def __init__(self, directory: CheckpointDir, step: int, save_id: str, token: str):
        self.directory, self.step, self.save_id = directory, step, save_id
        self.path = directory.temp_path(step, token)

    def create(self) -> None:
        os.makedirs(self.path, exist_ok=False)

    def file_path(self, rank: int) -> str:
        return os.path.join(self.path, rank_filename(rank))

    def open_output(self, path: str, options: Any, block_bytes: int) -> Any:
        return open_local_output(path, options)

    def hold(self, rank: int, heartbeat_s: float) -> "Lease":
        # On the data file itself: cleanup sees it locked (and its mtime fresh).
        return Lease(self.file_path(rank), heartbeat_s)

    def put_side(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.path, name), "wb") as f:
            f.write(data)

    def take_side(self, name: str) -> bytes:
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: a rank's shard report is missing", path=path, step=self.step) from None
        os.unlink(path)
        return data

    def read_ends(self, rank: int, options: Any, parse: Callable[[int, Callable[[int, int], bytes]], Any]) -> Any:
        fd = os.open(self.file_path(rank), os.O_RDONLY)
        try:
            return parse(os.fstat(fd).st_size, lambda offset, n: os.pread(fd, n, offset))
        finally:
            os.close(fd)

    #: Whether :meth:`prepare` ran (its manifest is written; a marker keeps it).
    prepared = False

    def _write_manifest(self, manifest_raw: bytes) -> None:
        write_file_atomic(os.path.join(self.path, MANIFEST), manifest_raw)
        fsync_dir(self.path)

    def prepare(self, manifest_raw: bytes, event: Any, keep_superseded: bool) -> None:
        """The first phase of a job-wide commit (saving/jobcommit.py): the step
        complete and durable here, marked prepared, the line unchanged."""
        self._write_manifest(manifest_raw)
        self.directory.prepare(self.path, event, keep_superseded)
        self.prepared = True

    def publish(self, manifest_raw: bytes, event: Optional[Any], keep_superseded: bool) -> List[int]:
        if not self.prepared:
            self._write_manifest(manifest_raw)
        # The record (written under the commit lock) is the commit point; the renames follow.
        superseded = self.directory.commit(self.path, self.step, keep_superseded, event)
        if self.prepared:
            self.directory.forget_prepared(self.path)
        return superseded

    def discard(self) -> None:
        committing = LocalRecord(self.directory.path).committing()
        if committing is not None and committing.tmp == os.path.basename(self.path):
            # Failed after its commit point (a rename): committed all the same. The next
            # commit or Checkpointer finishes its renames; never remove what the record names.
            log.warning("lazyckpt: %s: step %d is committed (its record was written) though its commit "
                        "failed after that; it is finished when the directory is next opened",
                        self.directory.path, self.step)
            return
        if self.prepared:
            self.directory.discard_prepared(self.path)
        elif os.path.isdir(self.path):     # not committed: nothing of this step may remain
            remove_tree(self.path)


class PendingSiblingFile:
    """A save of one file (``base.PendingFile``): written as a hidden sibling
    (``.NAME.tmp-<token>``, which cleanup recognizes) of ``final`` -- or of
    ``beside``, the directory a framework is assembling around it --
    fsynced, renamed over the final path, the directory fsynced."""

    def __init__(self, final: str, make_parents: bool, beside: Optional[str] = None):
        self.final = os.path.abspath(os.fspath(final))
        near = os.path.abspath(os.fspath(beside)) if beside else self.final
        if make_parents:
            make_dirs_durable(os.path.dirname(near))
        elif not os.path.isdir(os.path.dirname(self.final)):
            raise CheckpointNotFoundError(f"{final}: directory {os.path.dirname(self.final)} does not exist",
                                          path=final)
        self.path = sibling_temp(near)

    def hold(self, heartbeat_s: float) -> "Lease":
        return Lease(self.path, heartbeat_s)

    def publish(self) -> None:
        # A save over the last one (the same path every epoch) frees the old
        # file's blocks off the save's path.
        replace_releasing_later(self.path, self.final)
        try:
            fsync_dir(os.path.dirname(self.final))
        except OSError as exc:
            # Past the rename there is nothing to undo to: the file it replaced has no
            # name left (only an orphan held for its blocks' release). The new file is
            # whole and in place, but a power loss may still bring the old one back:
            # reported as exactly that (``committed``), never as a save that did not
            # happen, nor as a durable one. Saving again makes it durable.
            error = CheckpointWriteError(
                f"{self.final}: the new file is in place and loads, but the fsync of its directory failed "
                f"({exc}): until the directory is synced, a power loss may bring back the file it replaced; "
                f"save again", path=self.final)
            error.committed = True      # type: ignore[attr-defined]
            raise error from exc

    def discard(self) -> None:
        remove_quietly(self.path)
