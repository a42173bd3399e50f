"""Helpers for the attack generators: write a valid checkpoint, then rewrite
its footer (with a consistent trailer: offset, length, xxh3-64) or trailer.

Every generator module defines ``make(directory) -> list of cases``; a case is
a dict with ``name``, ``path`` (what to load), ``expect`` (the name of the
lazyckpt.CheckpointError subclass a safe loader raises), optionally
``kwargs`` (passed to lazyckpt.load), ``marker`` (a file that exists only if
code from the payload ran), ``via`` ("load", or "checkpointer" to use
``Checkpointer(dir).load(step=...)``) and ``step``.

Run a generator on its own to write its payloads and see what the loader does:

    cd /work/main && .venv/bin/python attacks/pickle_os_system.py /tmp/attack-out
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from typing import Any, Dict, Optional

import xxhash

TRAILER = struct.Struct("<QQQ8s")
FOOTER_MAGIC = b"LZCKFOOT"


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def footer_doc(data: bytes) -> Dict[str, Any]:
    offset, length, _, _ = TRAILER.unpack(data[-32:])
    return json.loads(data[offset:offset + length])


def with_footer(data: bytes, footer: bytes) -> bytes:
    """The same data region, a new footer, a trailer that matches it."""
    offset = TRAILER.unpack(data[-32:])[0]
    return data[:offset] + footer + TRAILER.pack(offset, len(footer), xxhash.xxh3_64_intdigest(footer),
                                                FOOTER_MAGIC)


def with_doc(data: bytes, doc: Any) -> bytes:
    return with_footer(data, json.dumps(doc, separators=(",", ":")).encode())


def with_trailer(data: bytes, offset: int, length: int, digest: Optional[int] = None) -> bytes:
    d = digest if digest is not None else TRAILER.unpack(data[-32:])[2]
    return data[:-32] + TRAILER.pack(offset, length, d, FOOTER_MAGIC)


def base_file(directory: str, state: Any, name: str = "base.lzc", **knobs: Any) -> bytes:
    import lazyckpt
    path = os.path.join(directory, name)
    lazyckpt.save(state, path, **knobs)
    return read(path)


def top(doc: Dict[str, Any], key: str) -> Dict[str, Any]:
    """The node of top-level key ``key`` in a footer document."""
    tree = doc["tree"]
    return tree["v"][tree["k"].index(key)]


def demo(make) -> None:
    """``python attacks/X.py [DIR]``: write the payloads, load each, print the outcome."""
    import lazyckpt
    directory = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.getcwd(), "attack-out")
    os.makedirs(directory, exist_ok=True)
    import signal

    class Hang(BaseException):
        pass

    def alarm(signum, frame):
        raise Hang()
    signal.signal(signal.SIGALRM, alarm)
    for case in make(directory):
        t = time.monotonic()
        signal.alarm(10)
        try:
            if case.get("via") == "checkpointer":
                with lazyckpt.Checkpointer(case["path"]) as ckpt:
                    ckpt.load(step=case["step"], **case.get("kwargs", {}))
            else:
                lazyckpt.load(case["path"], **case.get("kwargs", {}))
            outcome = "LOADED"
        except Hang:
            outcome = "HANG (no outcome within 10 s)"
        except lazyckpt.CheckpointError as exc:
            outcome = f"{type(exc).__name__}: {str(exc)[:160]}"
        except BaseException as exc:        # noqa: BLE001
            outcome = f"UNSAFE {type(exc).__name__}: {str(exc)[:160]}"
        finally:
            signal.alarm(0)
        ran = case.get("marker") and os.path.exists(case["marker"])
        print(f"{case['name']:40s} expect {case['expect']:24s} -> {outcome} ({time.monotonic() - t:.2f} s)"
              + ("  CODE RAN!" if ran else ""))
