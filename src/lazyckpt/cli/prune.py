"""``lazyckpt prune``: delete older committed steps (rename, fsync, then delete,
as the library does), abandoned steps and the leftovers of dead saves, on a
local directory or an object-store prefix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lazyckpt.errors import CheckpointError
from lazyckpt.knobs import resolve as resolve_options
from lazyckpt.loading.resolve import object_dir
from lazyckpt.storage.layout import CheckpointDir, remove_tree
from lazyckpt.storage.stores import for_path
from .inspect import list_directory, list_url


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
    the leftovers of interrupted saves and deletes. Saves in progress (their
    lease is held or fresh) are kept; ``force`` also removes those whose lease
    is not held by anyone, however fresh. A step being read is kept."""
    if type(keep) is not int or keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    if for_path(directory).is_remote:
        return _prune_url(directory, keep, dry_run)
    listing = list_directory(directory)
    directory = listing["directory"]
    layout = CheckpointDir(directory, 0.0 if force else resolve_options().lease_expiry_s)
    rows = {r["step"]: r for r in listing["steps"]}
    doomed, referred = layout.retention_plan(keep)       # newest first; referred-to steps stay
    actions: List[PruneAction] = [PruneAction(rows[s]["name"], "step", rows[s]["bytes"], s)
                                  for s in doomed if s in rows]
    kept_leftovers = []
    for leftover in layout.leftovers():
        lo = {"name": leftover.name, "kind": leftover.kind, "bytes": leftover.bytes,
              "description": leftover.describe()}
        if not (leftover.removable or leftover.kind == "abandoned"):
            kept_leftovers.append(lo)
            continue
        actions.append(PruneAction(leftover.name, leftover.kind, leftover.bytes))
    if not dry_run and doomed:
        # The library's own retention: newest first, a step being read stays and
        # so does every step it refers to.
        deleted, _kept = layout.retire_old(keep)
        for action in actions:
            if action.what == "step":
                action.done = action.step in deleted
                if not action.done:
                    action.error = "being read by another process, or referred to by one; kept"
    for action in actions:
        if dry_run or action.what == "step":
            continue
        try:
            remove_tree(os.path.join(directory, action.name))
            action.done = True
        except FileNotFoundError:
            action.done = True               # removed concurrently: the outcome wanted
        except OSError as exc:
            action.error = f"{exc.strerror or exc}"
    kept = sorted(set(rows) - {a.step for a in actions if a.what == "step" and (a.done or dry_run)})
    return {"directory": directory, "kept": kept, "kept_for_references": referred, "dry_run": dry_run,
            "actions": [a.__dict__ for a in actions], "kept_leftovers": kept_leftovers,
            "freed_bytes": sum(a.bytes for a in actions if a.done)}


def _prune_url(url: str, keep: int, dry_run: bool) -> Dict[str, Any]:
    """``prune`` on an object store: older committed steps (each one's manifest
    first, then its data) and the leftovers older than the lease expiry. A
    step with a live reader lease is kept, as a locked one is locally; there
    are no references (incremental steps are local only), and ``force`` has
    nothing to act on (it never deletes a step being read, here or locally)."""
    listing = list_url(url)
    url = listing["directory"]
    directory = object_dir(url, resolve_options())
    rows = {r["step"]: r for r in listing["steps"]}
    doomed = sorted(rows)[:-keep]
    actions: List[PruneAction] = [PruneAction(rows[s]["name"], "step", rows[s]["bytes"], s) for s in doomed]
    left = [PruneAction(lo["name"], lo["kind"], lo["bytes"], lo["step"]) for lo in listing["leftovers"]]
    actions += left
    if not dry_run:
        for action in actions[:len(doomed)]:
            try:
                if directory.delete_step(action.step) or action.step not in directory.committed():
                    action.done = True                  # (or deleted concurrently: the outcome wanted)
                else:
                    action.error = "being read by another process (a live reader lease); kept"
            except CheckpointError as exc:
                action.error = str(exc)
        if doomed:
            try:
                directory.prune_events()        # the history events of deleted steps (FORMAT.md §11.10)
            except CheckpointError as exc:
                import logging
                logging.getLogger("lazyckpt").warning("lazyckpt: %s: pruning history events failed: %s", url, exc)
        if left:
            # The library's own cleanup (it lists again: what was written to
            # since our listing is young again and stays).
            try:
                removed = {u.rstrip("/") for u in directory.clean_leftovers()}
            except CheckpointError as exc:
                removed = set()
                for action in left:
                    action.error = str(exc)
            base = f"{directory.prefix}/" if directory.prefix else ""
            for action in left:
                if action.error is not None:
                    continue
                if directory.store.url(f"{base}{action.name}") in removed \
                        or next(iter(directory.store.list(f"{base}{action.name}/")), None) is None:
                    action.done = True          # removed (by us, or concurrently: the outcome wanted)
                else:
                    action.error = "written to since it was listed (a save may be in progress); kept"
    kept = sorted(set(rows) - {a.step for a in actions if a.what == "step" and (a.done or dry_run)})
    return {"directory": url, "kept": kept, "kept_for_references": [], "dry_run": dry_run,
            "actions": [a.__dict__ for a in actions], "kept_leftovers": [],
            "freed_bytes": sum(a.bytes for a in actions if a.done)}
