"""``verify``: read every byte of every entry of a checkpoint (a file, a step,
a Checkpointer directory, or the same on an object store) and check every
checksum and the footer's tree, continuing past damage to report all of it.
Used by ``lazyckpt verify``, ``Checkpointer(verify=...)`` and the replica
tier's restore. Reads only; deletes nothing."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import mmap
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from lazyckpt.errors import CheckpointError
from lazyckpt.formats import datafile as fmt
from lazyckpt.knobs import Options, resolve as resolve_options
from lazyckpt.state.walk import Leaf, itemsize, walk
from lazyckpt.storage.base import Store
from lazyckpt.storage.fileio import anonymous_buffer
from .reader import CheckpointFile, RefResolver, resolver_for
from .resolve import Target, resolve

# --------------------------------------------------------------------------- targets


# --------------------------------------------------------------------------- tree walk




# --------------------------------------------------------------------------- inspect


# --------------------------------------------------------------------------- listing


# --------------------------------------------------------------------------- verify


@dataclass
class Problem:
    file: str
    what: str                    # "entry", "file", "tree", "manifest"
    message: str
    entry: Optional[str] = None  # entry name (state path)
    index: Optional[int] = None
    offsets: List[int] = field(default_factory=list)   # damaged block offsets

    def to_json(self) -> Dict[str, Any]:
        doc = {"file": self.file, "what": self.what, "message": self.message}
        if self.entry is not None:
            doc["entry"] = self.entry
        if self.index is not None:
            doc["index"] = self.index
        if self.offsets:
            doc["offsets"] = self.offsets
        return doc


@dataclass
class VerifyReport:
    target: Target
    files: int = 0
    entries: int = 0
    bytes_checked: int = 0
    blocks_checked: int = 0
    problems: List[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> Dict[str, Any]:
        return {"path": self.target.path, "ok": self.ok, "files": self.files, "entries": self.entries,
                "bytes_checked": self.bytes_checked, "blocks_checked": self.blocks_checked,
                "problems": [p.to_json() for p in self.problems]}


def _aligned_buffer(n: int) -> mmap.mmap:
    return anonymous_buffer(max(fmt.ALIGNMENT, fmt.align_up(n)))


def verify(path: str, options: Optional[Options] = None,
           progress: Optional[Callable[[int], None]] = None,
           on_total: Optional[Callable[[int], None]] = None, *, store: Store) -> VerifyReport:
    """Read every entry of every data file and check every checksum.

    Unlike a load, it does not stop at the first damaged block: every damaged
    entry (with the offsets of its damaged blocks), every file whose footer or
    header is unusable and every inconsistency between the tree, the entries
    and the manifest is reported. ``progress(n)`` is called with the bytes
    checked since the last call; ``on_total(n)`` once with the total.
    """
    options = options or resolve_options()
    target = resolve(path, options, store=store)
    report = VerifyReport(target)
    # A step is held while it is verified, as while it is loaded: prune and
    # retention in another process keep it, and one deleted anyway is reported
    # as deleted (CheckpointNotFoundError), not as damage.
    hold = (store.reading_step(target.step_dir, options, target.step) if target.step_dir is not None
            else contextlib.nullcontext(None))
    # Only a store that holds incremental steps resolves references; elsewhere
    # a "ref" entry is reported as unresolvable.
    with hold as held, (resolver_for(target.files[0][1], options) if store.holds_references
                        else contextlib.nullcontext(None)) as refs:
        _verify(target, report, options, refs, progress, on_total)
        if held is not None and not report.ok and not held.still_there():
            raise held.deleted()
    return report


def _verify(target: Target, report: VerifyReport, options: Options, refs: Optional[RefResolver],
            progress: Optional[Callable[[int], None]], on_total: Optional[Callable[[int], None]]) -> None:
    opened: Dict[Optional[int], CheckpointFile] = {}
    for rank, fpath in target.files:
        try:
            opened[rank] = CheckpointFile(fpath, options, refs, store=target.store)
        except CheckpointError as exc:
            report.problems.append(Problem(fpath, "file", str(exc)))
        report.files += 1
    if target.manifest is not None:
        for f in target.manifest["files"]:
            fpath = target.store.join(target.step_dir, f["name"])
            cf_ = opened.get(f["rank"])
            if cf_ is not None and type(f.get("bytes")) is int and f["bytes"] != cf_.size:
                report.problems.append(Problem(fpath, "manifest", f"{fpath}: manifest says {f['bytes']} bytes, "
                                               f"the file has {cf_.size}"))
    if on_total is not None:
        on_total(sum(e.size for f in opened.values() for e in f.entries if e.kind != "remote"))
    threads = max(1, options.reader_threads)
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="lazyckpt-verify") as pool:
        for rank, f in opened.items():
            _check_tree(f, opened, rank, report)
            _verify_file(f, options, pool, threads, report, progress)
            # Incremental: the ranges this file refers to, in the earlier steps' files.
            referred: Dict[str, Tuple[CheckpointFile, List[int]]] = {}
            for i, e in enumerate(f.entries):
                if e.kind != "ref":
                    continue
                try:
                    other, j = f.resolve(i)
                except CheckpointError as exc:
                    report.problems.append(Problem(f.path, "entry", str(exc), e.name, i))
                    continue
                referred.setdefault(other.path, (other, []))[1].append(j)
            for other, indices in referred.values():
                _verify_file(other, options, pool, threads, report, progress, indices, f)


def _verify_file(f: CheckpointFile, options: Options, pool: cf.ThreadPoolExecutor, threads: int,
                 report: VerifyReport, progress: Optional[Callable[[int], None]],
                 only: Optional[List[int]] = None, referrer: Optional[CheckpointFile] = None) -> None:
    """Check every block of ``f``'s entries (or of the entries ``only``, those a
    later step's ``referrer`` refers to)."""
    block = f.footer.block_bytes
    jobs: List[Tuple[int, int, int]] = []          # (entry index, lo, hi)
    for i, e in enumerate(f.entries):
        if e.kind in ("remote", "ref") or (only is not None and i not in only):
            continue
        report.entries += 1
        jobs.extend((i, lo, hi) for lo, hi in fmt.block_spans(e.offset, e.length, block))
    damaged: Dict[int, List[int]] = {}
    errors: Dict[int, str] = {}
    try:
        source = f.store.open_input(f.path, options, threads)
    except OSError as exc:
        report.problems.append(Problem(f.path, "file", f"{f.path}: cannot open: {exc.strerror or exc}"))
        return

    def read(view: memoryview, lo: int, n: int) -> int:
        # O_DIRECT reads whole pages (the buffer is page-aligned and padded); other
        # inputs read exactly the bytes wanted (an object: no ranged GET past them).
        return source.read_into(view[:fmt.align_up(n)] if source.direct else view[:n], lo)

    # Block pieces that follow each other in the file (separated by alignment
    # padding at most) are read in one request of up to chunk_bytes and
    # checked piece by piece: 2,000 small entries are a few dozen reads, not
    # 2,000. Each thread reads into one buffer of its own, reused for every
    # request (no fresh pages to fault in and zero per block).
    limit = max(block, options.chunk_bytes)
    groups: List[List[Tuple[int, int, int]]] = []
    for job in sorted(jobs, key=lambda j: j[1]):
        if groups:
            first, last = groups[-1][0], groups[-1][-1]
            if last[2] <= job[1] <= fmt.align_up(last[2]) and job[2] - first[1] <= limit:
                groups[-1].append(job)
                continue
        groups.append([job])
    buffers: Dict[int, mmap.mmap] = {}

    def buffer_for(n: int) -> memoryview:
        me = threading.get_ident()
        buf = buffers.get(me)
        if buf is None or len(buf) < fmt.align_up(n):
            if buf is not None:
                buf.close()
            buf = buffers[me] = _aligned_buffer(n)
        return memoryview(buf)

    def check(group: List[Tuple[int, int, int]]) -> List[Tuple[int, int, int, Optional[str]]]:
        lo, hi = group[0][1], group[-1][2]
        view = buffer_for(hi - lo)
        try:
            try:
                got = read(view, lo, hi - lo)
            except OSError as exc:
                return [(i, a, b, f"read error: {exc.strerror or exc}") for i, a, b in group]
            except CheckpointError as exc:      # an object store's error (after its retries)
                return [(i, a, b, f"read error: {exc}") for i, a, b in group]
            out = []
            for i, a, b in group:
                e = f.entries[i]
                if got < b - lo:
                    out.append((i, a, b, f"truncated: {max(0, got - (a - lo))} of {b - a} bytes at offset {a}"))
                elif fmt.checksum(view[a - lo:b - lo]) != e.checksums[a // block - e.offset // block]:
                    out.append((i, a, b, "checksum mismatch"))
                else:
                    out.append((i, a, b, None))
            return out
        finally:
            view.release()

    try:
        # At most 2 requests per thread in flight.
        window = 2 * threads
        for start in range(0, len(groups), window):
            for results in pool.map(check, groups[start:start + window]):
                for i, lo, hi, error in results:
                    report.blocks_checked += 1
                    report.bytes_checked += hi - lo
                    if error is not None:
                        damaged.setdefault(i, []).append(lo)
                        errors.setdefault(i, error)
                    if progress is not None:
                        progress(hi - lo)
    finally:
        source.close()
        for buf in buffers.values():
            buf.close()
    users: Dict[int, List[str]] = {}
    if damaged:
        for leaf in walk(f.footer.tree):
            if leaf.entry in damaged:
                users.setdefault(leaf.entry, []).append(leaf.name)
    for i in sorted(damaged):
        e = f.entries[i]
        others = [n for n in users.get(i, []) if n != e.name]
        also = f" (also used by {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
        if referrer is not None:
            also += f" (referred to by step {referrer.step}, {referrer.path})"
        report.problems.append(Problem(
            f.path, "entry", f"{f.path}: entry {i} {e.name!r}{also}: {errors[i]} in {len(damaged[i])} of "
            f"{len(e.checksums)} block(s), at file offset(s) {', '.join(map(str, damaged[i][:8]))}"
            f"{', ...' if len(damaged[i]) > 8 else ''}", e.name, i, damaged[i]))


_KNOWN_TAGS = {"float", "complex", "seq", "dict", "torch", "tensor", "numpy", "bytes", "pickle", "custom",
               "dtensor"}


def _check_tree(f: CheckpointFile, opened: Dict[Optional[int], CheckpointFile], rank: Optional[int],
                report: VerifyReport) -> None:
    """Structural checks a load would make: references, kinds, geometry."""
    def problem(leaf: Leaf, why: str) -> None:
        report.problems.append(Problem(f.path, "tree", f"{f.path}: {leaf.name}: {why}", leaf.name, leaf.entry))

    entries = f.entries
    for leaf in walk(f.footer.tree):
        if leaf.type == "unknown":
            tag = leaf.node.get("$") if isinstance(leaf.node, dict) else None
            problem(leaf, f"unknown node {tag!r}" if tag else "malformed node")
            continue
        node = leaf.node
        if leaf.type == "tensor" and node.get("e") is None:
            continue                              # meta tensor
        if leaf.type == "dtensor" and node.get("local") is None:
            continue
        if leaf.type not in ("tensor", "dtensor", "numpy", "bytes", "pickle") or \
                (leaf.type == "numpy" and node.get("t") != "array"):
            continue
        e = leaf.entry
        if e is None or not 0 <= e < len(entries):
            problem(leaf, f"refers to a missing entry {e!r}")
            continue
        entry = entries[e]
        if entry.kind == "remote":
            other = opened.get(entry.rank)
            if other is None:
                if report.target.kind != "file" and entry.rank not in opened:
                    problem(leaf, f"entry {e} is held by rank {entry.rank}, whose file is missing or "
                                  f"unreadable")
                continue
            if e >= len(other.entries) or other.entries[e].kind == "remote":
                problem(leaf, f"entry {e} should be in rank {entry.rank}'s file, which does not hold it")
                continue
            entry = other.entries[e]
        expected_kind = "pickle" if leaf.type == "pickle" else "data"
        if entry.content_kind != expected_kind:
            problem(leaf, f"entry {e} is {entry.kind!r}, expected {expected_kind!r}")
            continue
        if leaf.type in ("tensor", "dtensor"):
            t = node if leaf.type == "tensor" else node.get("local")
            size = itemsize(t.get("dtype")) if isinstance(t, dict) else None
            shape, stride, offset = (t.get("shape"), t.get("stride"), t.get("offset")) if isinstance(t, dict) \
                else (None, None, None)
            if size is None:
                problem(leaf, f"unknown dtype {t.get('dtype') if isinstance(t, dict) else None!r}")
            elif not (_ints(shape) and _ints(stride) and len(shape) == len(stride) and type(offset) is int
                      and offset >= 0 and all(x >= 0 for x in shape + stride)):
                problem(leaf, "bad tensor geometry")
            else:
                needed = 0 if any(s == 0 for s in shape) else \
                    (offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * size
                if needed > entry.size:
                    problem(leaf, f"tensor needs {needed} bytes, entry {e} has {entry.size}")
        elif leaf.type == "numpy":
            try:
                import numpy as np
                dtype = np.dtype(node.get("dtype"))
                shape = node.get("shape")
                if not _ints(shape) or math.prod(shape) * dtype.itemsize != entry.size:
                    problem(leaf, f"array of {node.get('dtype')} {shape} does not match entry {e} "
                                  f"({entry.size} bytes)")
            except (TypeError, ValueError):
                problem(leaf, f"bad numpy dtype {node.get('dtype')!r}")


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


# --------------------------------------------------------------------------- prune


