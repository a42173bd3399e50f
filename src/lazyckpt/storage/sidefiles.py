"""A framework's own files in a local directory, written beside it the way
lazyckpt writes its own: a save goes to a hidden sibling temporary named for
its holder (``.NAME.tmp-<holder token>``), made durable, then renamed over
the name; a temporary is removed only once its holder is provably dead
(``locks.is_live`` false, or the holder was this host's process and died).

The integrations (Lightning, the HF Trainer, DeepSpeed, converters) use
these instead of a store's implementation modules: with ``fileio`` (the
POSIX primitives) and ``base``/``stores`` (the interface and the entry), this
is the storage package's surface for the rest of lazyckpt
(``tests/test_imports.py`` checks it)."""

from __future__ import annotations

import logging
import os
import time
from typing import List

from lazyckpt.formats.names import SIBLING_TEMP
from .fileio import remove_tree
from .locks import DEFAULT_EXPIRY_S, Lease, holder_died_here, holder_token, is_live, new_token

__all__ = ["sibling_temp", "clean_sibling_temps", "file_lease", "new_token", "Lease"]

log = logging.getLogger("lazyckpt")


def sibling_temp(path: str) -> str:
    """A hidden sibling of ``path`` for a save in progress (renamed over ``path`` once durable)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{holder_token()}")


def file_lease(path: str, heartbeat_s: float) -> Lease:
    """A lease on ``path`` (a temporary being written): while held, no cleaner
    removes it; :meth:`Lease.release` ends it."""
    return Lease(path, heartbeat_s)


def clean_sibling_temps(directory: str, expiry_s: float = DEFAULT_EXPIRY_S) -> List[str]:
    """Remove provably dead ``sibling_temp`` files and directories in ``directory``."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        m = SIBLING_TEMP.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        # A killed process's save is over at once: the resumed run must
        # not carry its temporary for a lease expiry; any other waits for the expiry.
        if is_live(path, expiry_s, now) and not holder_died_here(m.group("token"), path):
            continue
        try:
            remove_tree(path)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("lazyckpt: %s: removed leftovers of interrupted saves: %s", directory, removed)
    return removed
