"""Classes made at first access, for a module's ``__getattr__`` (PEP 562).

An integration's public class subclasses a framework's class, which the
integration cannot import with itself: the framework may be absent, and
Lightning ships two package trees whose plugins reject each other's. Each
named class is made once, under a lock, on first access, and kept.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterable


def lazy_classes(module: str, names: Iterable[str], make: Callable[[str], type]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that returns ``make(name)`` for each of
    ``names``, made at the first access and kept; any other name is an
    ``AttributeError``, as for a module without one. ``make``'s ImportError
    (the framework missing) reaches the importer, and the next access tries
    again."""
    known = frozenset(names)
    made: Dict[str, type] = {}
    lock = threading.Lock()

    def __getattr__(name: str) -> Any:
        if name in known:
            with lock:
                if name not in made:
                    made[name] = make(name)
                return made[name]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__
