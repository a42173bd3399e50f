"""The line of history of one Checkpointer across its tiers: numbers its
commits and answers which saves are live, from the local record, the local
manifests and the persistent tier's events (the rules: :mod:`lazyckpt.lineage`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, MAX_SEQ
from lazyckpt.lineage import Event, line, manifest_event, max_seq
from lazyckpt.storage.fileio import read_small_file

log = logging.getLogger("lazyckpt")


class Line:
    """The line of history of one Checkpointer: numbers its commits and
    answers which saves are live, from the local record, the local manifests
    and (``remote``) the persistent tier's events."""

    def __init__(self, layout: Any, remote: Any = None):
        #: A local CheckpointDir (None: the directory is itself on an object store).
        self.layout = layout
        #: An ObjectCheckpointDir whose events count too (persist_to=, or the directory itself).
        self.remote = remote
        self.record = layout.record() if layout is not None else None
        self._top: Optional[int] = None

    # ------------------------------------------------------------ numbering

    def next_seq(self) -> int:
        """1 + the largest seq known (read once, then counted here)."""
        if self._top is None:
            top = 0
            if self.record is not None:
                top = self.record.read()[0]
                tail = self.layout.tail() if top else None
                if tail is not None:
                    # The record holds the largest seq; the newest step's manifest too, in
                    # case a copy brought it in without the record (no listing either way).
                    e = manifest_event(read_small_file(os.path.join(tail[1], MANIFEST), 1 << 30))
                    top = max(top, e.seq or 0) if e is not None else top
                else:
                    top = max(top, max_seq(self.local_events()))     # no record, or no index: every manifest
            if self.remote is not None:
                try:
                    top = max(top, self.remote.top_seq())
                except Exception as exc:        # unreachable now: local numbering still orders locally
                    log.warning("lazyckpt: %s: its history cannot be read (%s); numbering commits from the "
                                "local tier", getattr(self.remote, "url", self.remote), exc)
            self._top = top
        if self._top >= MAX_SEQ:
            where = self.record.path if self.record is not None else getattr(self.remote, "url", "its history")
            raise CorruptCheckpointError(
                f"{where}: the line of history is numbered up to seq {self._top} (history.json, a manifest or an "
                f"event says so), the largest an event key holds is {MAX_SEQ}: no commit can be numbered after "
                f"it. A damaged or hand-edited record? Fix or remove the field that says so",
                path=where if isinstance(where, str) else None)
        self._top += 1
        return self._top

    def saw(self, seq: Optional[int]) -> None:
        """A save numbered elsewhere (a replica restored here) keeps the numbering above it."""
        if seq is not None and self._top is not None:
            self._top = max(self._top, seq)

    # ------------------------------------------------------------ the indexes of both tiers

    def local_tail(self) -> Any:
        """The local tier's newest commit as an Event, from its index (a few
        ``stat`` calls and its manifest); None when the tier holds no step;
        False when its index cannot tell (then only every manifest can)."""
        tail = self.layout.tail()
        if tail is None:
            return None if not self.layout.step_paths() else False
        e = manifest_event(read_small_file(os.path.join(tail[1], MANIFEST), 1 << 30))
        return e if e is not None and e.step == tail[0] and e.seq is not None else False

    def newest_save(self) -> Optional[Tuple[Optional[Event], Event, Event]]:
        """(the local tail or None, the persistent tail, the newest live save) from
        the two tiers' indexes alone, without reading every manifest or listing
        the store; None when either cannot tell -- the caller builds
        the whole line. Why the newest commit by ``seq`` is the newest live save:
        a commit of S supersedes every save >= S, so after the last one nothing
        is above it; each tier's tail is its own newest commit. The store's
        tail None, its newest event the local tail's (or older): an upload not
        done (cut by a crash, or another process's commit in progress), so the
        newest save is the local one and the store holds no copy of it yet
        (``(local, None, local)``)."""
        local = self.local_tail()
        if local is False:
            return None
        try:
            # One read of the store's index answers both: its newest event, and whether
            # that save is there (its tail) or its upload is not done (pending).
            newest_there = self.remote.newest_event()
            remote = newest_there if newest_there is not None and self.remote.holds(newest_there) else None
            pending = newest_there if remote is None and local is not None else None
        except CheckpointError:
            return None
        if pending is not None and pending.seq is not None and local.seq is not None and \
                (pending == local or local.seq > pending.seq):
            return local, None, local
        if remote is None or remote.seq is None:
            return None             # no index there (an empty store, one from before it): list it
        if local is not None and local.seq == remote.seq and local != remote:
            return None             # two saves numbered alike: not one line, let the line decide
        newest = local if local is not None and local.seq > remote.seq else remote
        return local, remote, newest

    def local_events_above(self, seq: int) -> Optional[List[Event]]:
        """The local events numbered above ``seq``, from the record alone (it
        keeps the newest ones), or None when it may not hold them all."""
        events = self.record.read()[1] if self.record is not None else []
        if not events:
            return None if self.layout.step_paths() else []     # (no record, no step: nothing here)
        if min(e.seq for e in events) > seq + 1:
            return None
        return [e for e in events if e.seq > seq]

    # ------------------------------------------------------------ the local tier

    def local_saves(self) -> Dict[int, Event]:
        """step -> its event, for every step present locally (from its manifest,
        else from the record; save_id None where neither tells)."""
        out: Dict[int, Event] = {}
        recorded: Dict[int, Event] = {}
        if self.record is not None:
            for e in sorted(self.record.read()[1], key=lambda e: e.seq):
                recorded[e.step] = e
        for step, path in self.layout.step_paths().items():
            e = manifest_event(read_small_file(os.path.join(path, MANIFEST), 1 << 30))
            if e is None or e.step != step:
                e = recorded.get(step, Event(step, None, None))     # type: ignore[arg-type]
            out[step] = e
        return out

    def local_events(self) -> List[Event]:
        events = [e for e in self.local_saves().values() if e.save_id is not None]
        if self.record is not None:
            events += self.record.read()[1]
        return events

    # ------------------------------------------------------------ which copy to load (both tiers)

    def line_and_listing(self) -> Any:
        """(the live saves [(step, save_id)], oldest first; local step -> Event;
        persistent step -> save_id; the persistent tier's listing ``(steps,
        events)`` they came from, None where it could not be listed): one line
        of history over both tiers."""
        local = self.local_saves()
        events = self.local_events()
        remote: Dict[int, str] = {}
        listing = None
        try:
            listing = self.remote.listing()
            remote, remote_events = listing
            events += remote_events + [Event(s, sid, None) for s, sid in remote.items()]
        except CheckpointError as exc:
            if not local:
                raise
            log.warning("lazyckpt: the persistent tier %s cannot be listed (%s); loading from the local "
                        "tier only", getattr(self.remote, "url", self.remote), exc)
        # A local step whose manifest and record say nothing still counts (its load reports the damage).
        events += [Event(s, f"?unreadable-{s}", None) for s, e in local.items() if e.save_id is None]
        return line(events), local, remote, listing

    def candidates(self, step: Optional[int]) -> Iterable[Tuple[int, str, str]]:
        """(step, "local" | "persistent", path) of the copies to try for ``step``
        (None: the newest), best first: newer steps first, the local copy
        before the persistent one. Only the live save of a step is a copy of it
        (the same save id), so neither an abandoned step nor another run's save
        of the same number is ever offered; asking for an abandoned step raises
        ``CheckpointNotFoundError``. For the newest step the two indexes answer
        first (a few requests); the whole line only if neither copy
        loads or they cannot tell. Lazy: the line is built when asked for."""
        if step is None:
            newest = self._newest_copies()
            if newest:
                return _then(newest, lambda: [c for c in self._line_candidates(None) if c not in newest])
        return self._line_candidates(step)

    def _newest_copies(self) -> List[Tuple[int, str, str]]:
        """The newest live save's copies, local first, from the two tiers'
        indexes; [] when they cannot tell."""
        found = self.newest_save()
        if found is None:
            return []
        local, remote, newest = found
        out = []
        here = self.layout.locate_step(newest.step)     # (its temporary directory: renames pending)
        if local == newest and here is not None:
            out.append((newest.step, "local", here[1]))
        elif here is not None:
            return []               # that step here, another save of it: the line tells
        if remote == newest:
            out.append((newest.step, "persistent", self.remote.save_path(newest.step, newest.save_id)))
        return out

    def _line_candidates(self, step: Optional[int]) -> List[Tuple[int, str, str]]:
        live, local, remote, _ = self.line_and_listing()
        if step is not None:
            live = [(s, sid) for s, sid in live if s == step]
            if not live and (step in local or step in remote):
                raise CheckpointNotFoundError(
                    f"{self.layout.path}: step {step} was abandoned (a later save of an older step superseded "
                    f"it: a run resumed from an earlier step); it is not loaded", path=self.layout.path, step=step)
        out = []
        # Where each local save is: under its name, or in its temporary directory while another
        # process's commit renames it in (under the name, until then, is the step it supersedes).
        paths = self.layout.step_paths() if local else {}
        for s, sid in reversed(live):
            if s in local and (local[s].save_id in (sid, None) or sid.startswith("?unreadable-")):
                out.append((s, "local", paths.get(s, self.layout.step_path(s))))
            if remote.get(s) == sid:
                out.append((s, "persistent", self.remote.save_path(s, sid)))
        return out


def _then(first: List[Any], rest: Any) -> Any:
    """``first``, then what ``rest()`` returns (computed only if asked for)."""
    yield from first
    yield from rest()
