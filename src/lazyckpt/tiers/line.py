"""The line of history of one Checkpointer across its tiers: numbers its
commits and answers which saves are live, from the local record, the local
manifests and the persistent tier's events (the rules: :mod:`lazyckpt.history`)."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, MAX_SEQ
from lazyckpt.history import Event, manifest_event, max_seq
from lazyckpt.storage.fileio import read_small_file
from lazyckpt.storage.record import LocalRecord

log = logging.getLogger("lazyckpt")


class History:
    """The line of history of one Checkpointer: numbers its commits and
    answers which saves are live, from the local record, the local manifests
    and (``remote``) the persistent tier's events."""

    def __init__(self, layout: Any, remote: Any = None):
        #: A local CheckpointDir (None: the directory is itself on an object store).
        self.layout = layout
        #: An ObjectCheckpointDir whose events count too (persist_to=, or the directory itself).
        self.remote = remote
        self.record = LocalRecord(layout.path) if layout is not None else None
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
        the store (issue 34); None when either cannot tell -- the caller builds
        the whole line. Why the newest commit by ``seq`` is the newest live save:
        a commit of S supersedes every save >= S, so after the last one nothing
        is above it; each tier's tail is its own newest commit."""
        local = self.local_tail()
        if local is False:
            return None
        try:
            remote = self.remote.tail()
        except CheckpointError:
            return None
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
