"""A flat knob set as a Checkpointer's keywords.

lazyckpt.save/load and the integrations take the flat knobs (``writer_threads=``,
``chunk_bytes=``, ...); a Checkpointer takes them in its option groups
(``io=lazyckpt.IO(...)``). The tests that drive both with one knob set convert it
here, so no test passes a Checkpointer a deprecated flat spelling."""

from __future__ import annotations

from typing import Any, Dict, Optional

import lazyckpt

#: Flat knob -> its field in lazyckpt.IO.
_IO_FIELDS = {"writer_threads": "writer_threads", "reader_threads": "reader_threads", "o_direct": "o_direct",
              "chunk_bytes": "chunk_bytes", "verify_checksums": "verify_checksums",
              "max_footer_bytes": "max_footer_bytes", "max_pending_saves": "max_pending_saves",
              "guard_buffers": "guard_buffers", "storage_options": "storage_options",
              "queue_policy": "when_full", "exit_policy": "at_exit", "lease_expiry_s": "lease_expiry",
              "when_full": "when_full", "at_exit": "at_exit", "lease_expiry": "lease_expiry"}


def groups(knobs: Optional[Dict[str, Any]] = None, **more: Any) -> Dict[str, Any]:
    """``knobs`` (and ``more``) as Checkpointer keywords: the I/O knobs (flat, or
    named as lazyckpt.IO's fields) in one ``io=lazyckpt.IO(...)``, the rest (``host_cache_bytes``, ``incremental``, the
    Checkpointer's own parameters) as they are."""
    out: Dict[str, Any] = {}
    io: Dict[str, Any] = {}
    for name, value in {**(knobs or {}), **more}.items():
        if name in _IO_FIELDS:
            io[_IO_FIELDS[name]] = value
        else:
            out[name] = value
    if io:
        if "io" in out:
            raise TypeError(f"groups(): io= given together with the flat I/O knobs {sorted(io)}")
        out["io"] = lazyckpt.IO(**io)
    return out
