"""``lazyckpt prune``: delete older committed steps (rename, fsync, then delete,
as the library does), abandoned steps and the leftovers of dead saves, on a
local directory or an object-store prefix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lazyckpt.errors import CheckpointError
from lazyckpt.knobs import resolve as resolve_options
from lazyckpt.retention import KeepLast
from lazyckpt.storage.stores import for_path
from lazyckpt.formats.names import step_dirname
from .inspect import list_directory


@dataclass
class PruneAction:
    name: str
    what: str          # "step" or a Leftover kind
    bytes: int
    step: Optional[int] = None
    done: bool = False
    error: Optional[str] = None


def prune(directory: str, keep: int, dry_run: bool = False, force: bool = False) -> Dict[str, Any]:
    """Delete every committed step but the ``keep`` newest, abandoned steps, and
    the leftovers of interrupted saves and deletes, on any store. Saves in
    progress (their lease is held or fresh) are kept; ``force`` also removes
    those whose lease is not held by anyone, however fresh. A step being read
    is kept (a shared lock locally, a live reader lease on an object store)."""
    if type(keep) is not int or keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    listing = list_directory(directory)
    directory = listing["directory"]
    store = for_path(directory)
    options = resolve_options()
    if not dry_run:
        # A commit a crash interrupted is finished first: retention then plans on the line's
        # own step directories (a superseded one is never kept, nor its references followed).
        store.checkpoint_dir(directory, options).recover()
        listing = list_directory(directory)
    if force and not store.is_remote:
        # Only a lock says a fresh save is alive where there is one; an object
        # store has none, so there its age alone decides and force changes nothing.
        options = dataclasses.replace(options, lease_expiry_s=0.0)
    layout = store.checkpoint_dir(directory, options)
    rows = {r["step"]: r for r in listing["steps"]}
    policy = KeepLast(keep)
    doomed, referred = layout.retention_plan(policy)     # newest first; referred-to steps stay
    actions: List[PruneAction] = [PruneAction(rows[s]["name"], "step", rows[s]["bytes"], s)
                                  for s in doomed if s in rows]
    kept_leftovers, removable = [], []
    for leftover in layout.leftovers():
        if not (leftover.removable or leftover.kind == "abandoned"):
            kept_leftovers.append({"name": leftover.name, "kind": leftover.kind, "bytes": leftover.bytes,
                                   "description": leftover.describe()})
            continue
        removable.append(leftover)
        actions.append(PruneAction(leftover.name, leftover.kind, leftover.bytes, leftover.step))
    left: Optional[List[int]] = None
    if not dry_run and doomed:
        left = []
        # The library's own retention: newest first, a step being read stays and
        # so does every step it refers to.
        # It plans again under the commit lock and acts on that plan: a commit in another
        # process since the listing above (a rollback) may have changed the line.
        try:
            deleted = set(layout.retire_old(policy, line=left)[0])     # (a set: one lookup per step)
        except CheckpointError as exc:
            deleted, left = set(), None
            for action in actions:
                if action.what == "step":
                    action.error = str(exc)
        planned = {a.step for a in actions if a.what == "step"}
        for step in sorted(deleted - planned, reverse=True):
            actions.insert(0, PruneAction(step_dirname(step), "step", rows[step]["bytes"] if step in rows else 0,
                                          step))
        for action in actions:
            if action.what == "step" and action.error is None:
                action.done = action.step in deleted
                if not action.done:
                    action.error = "being read by another process, referred to by one, or no longer " \
                                   "doomed (another process committed meanwhile); kept"
    if not dry_run and removable:
        outcome = layout.remove_leftovers(removable)
        for action in actions:
            if action.what != "step" and action.name in outcome:
                action.error = outcome[action.name]
                action.done = action.error is None
    if dry_run or left is None:
        kept = sorted(set(rows) - {a.step for a in actions if a.what == "step" and (a.done or dry_run)})
    else:
        kept = sorted(left)     # the line prune's deletions left (a commit after them is not its doing)
    return {"directory": directory, "kept": kept, "kept_for_references": referred, "dry_run": dry_run,
            "actions": [a.__dict__ for a in actions], "kept_leftovers": kept_leftovers,
            "freed_bytes": sum(a.bytes for a in actions if a.done)}
