"""Sizes: one parser for every size the library takes (arguments, option
groups, ``Options`` fields, ``LAZYCKPT_*`` variables, the CLI).

A number is bytes. A unit letter alone, or with ``iB``, is binary: ``64M``,
``64m`` and ``64MiB`` are 64 * 2**20. A unit with ``B`` and no ``i`` is
decimal (SI): ``5GB`` is 5 * 10**9, ``5kB`` 5000 -- what disks and network
links are sold in. Fractions are allowed (``1.5GiB``); the result is rounded
down to whole bytes.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["parse_size", "EXAMPLES"]

EXAMPLES = '4096 (bytes), "64M" or "64MiB" (64 * 2**20), "1.5GiB", "5GB" (5 * 10**9), "100MB"'

_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?b)?|(b))?\s*", re.IGNORECASE)


def parse_size(value: Any, name: str = "size", *, minimum: int = 0) -> int:
    """``value`` (an int, a float, or a string such as ``"64M"``, ``"5GB"``,
    ``"1.5GiB"``, ``"4096"``) as a whole number of bytes, at least ``minimum``.
    A bad value raises ``ValueError`` naming ``name`` and giving examples."""
    if isinstance(value, bool) or value is None:
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float):
        number = value if math.isfinite(value) else None
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is None:
            number = None
        else:
            letter, suffix = (m.group(2) or "").lower(), (m.group(3) or "").lower()
            base = 1000 if suffix == "b" else 1024         # "MB": decimal; "M", "MiB": binary
            number = float(m.group(1)) * base ** _POWER[letter]
            if "." not in m.group(1) and number < 2 ** 53:
                number = int(m.group(1)) * base ** _POWER[letter]
    else:
        number = None
    if number is None or number < 0:
        raise ValueError(f"{name}: bad size {value!r}; a size is a number of bytes or a string with a unit; "
                         f"examples: {EXAMPLES}")
    size = int(number)
    if size < minimum:
        raise ValueError(f"{name}: a size must be at least {minimum} byte{'s' if minimum != 1 else ''}, "
                         f"got {value!r} (examples: {EXAMPLES})")
    return size
