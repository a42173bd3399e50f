"""The fuzzer of every format lazyckpt reads besides a lone ``.lzc`` file
(tests/lzc_fuzz.py fuzzes that one): a Checkpointer step directory (manifest,
data files, ``history.json``, ``latest``), ``torch.save`` zips and
safetensors files through ``convert``, and DCP checkpoints in both layouts
(DCP's own ``.distcp`` records, lazyckpt's ``.lzc`` files) through
``LazyStorageReader`` and through ``convert``.

Seeded: input ``i`` of seed ``s`` is made by ``random.Random(f"{s}:{i}")``,
so every failure is reproducible from its two numbers. Mutations: byte flips,
sets, truncation, insertion, deletion and garbage anywhere in one of the
checkpoint's files; huge and negative length and offset fields (zip records,
the safetensors header length); structural changes of the JSON documents
(manifest, ``history.json``, a safetensors header: lzc_fuzz.mutate_doc) and
of DCP's pickled ``.metadata`` (offsets, lengths, paths, chunk geometry,
dtypes); a torch zip's ``data.pkl`` damaged with the CRCs recomputed, so the
bytes reach the unpickler; a file replaced by a symlink (to ``/dev/zero``,
a directory, a dangling path, a file outside the checkpoint) or a FIFO.

Outcomes: ``ok`` (read, with the saved values wherever the format checksums
what was damaged: a data record, a data file), ``ok-other-values`` (read,
other values, where the format has nothing that could tell: a safetensors
file, DCP's unchecksummed ``.metadata``, a resealed pickle), ``library`` (an
error of lazyckpt's family), ``target-mismatch`` (DCP's planner: the
metadata's shape of a key differs from the caller's target, as for an
intact checkpoint of other shapes) or a failure: ``other`` (another exception type),
``wrong`` (other values where a checksum covered the damage), ``hang`` (over
the time limit), ``outside`` (a file outside the input's directory written).

Run it long: ``python tests/format_fuzz.py --minutes 10 --seed 1``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import warnings
import zipfile
import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import lazyckpt
from lazyckpt.errors import CheckpointError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lzc_fuzz as fz  # noqa: E402

TIME_LIMIT_S = 20.0
FAILURES = ("other", "wrong", "hang", "outside")
FORMATS = ("stepdir", "torchzip", "safetensors", "dcp_fs", "dcp_lzc")


def base_state() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(24, 40, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "i": torch.arange(-50, 50, dtype=torch.int16), "e": torch.empty(0, 3)}


def step_state(step: int) -> Dict[str, Any]:
    return {"w": torch.full((5, 3), float(step)), "v": torch.arange(step * 10, dtype=torch.int64), "step": step}


# --------------------------------------------------------------------------- bases


def make_bases(root: str) -> Dict[str, str]:
    """One checkpoint of each format under ``root``: format -> path."""
    warnings.simplefilter("ignore")
    import torch.distributed.checkpoint as dcp
    from lazyckpt.integrations.dcp import LazyStorageWriter
    out = {}
    out["stepdir"] = os.path.join(root, "stepdir")
    with lazyckpt.Checkpointer(out["stepdir"]) as ckpt:
        for step in (1, 2):
            ckpt.save(step_state(step), step=step).wait(60)
    out["torchzip"] = os.path.join(root, "state.pt")
    torch.save(base_state(), out["torchzip"])
    out["safetensors"] = os.path.join(root, "state.safetensors")
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in base_state().items()}, out["safetensors"])
    out["dcp_fs"] = os.path.join(root, "dcp_fs")
    dcp.save(base_state(), checkpoint_id=out["dcp_fs"], no_dist=True)
    out["dcp_lzc"] = os.path.join(root, "dcp_lzc")
    dcp.save(base_state(), storage_writer=LazyStorageWriter(out["dcp_lzc"]), no_dist=True)
    return out


def _files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        found += [os.path.join(dirpath, n) for n in sorted(filenames)]
    return found


# --------------------------------------------------------------------------- mutations


def _raw(data: bytes, r) -> bytes:
    return bytes(fz._byte_ops(bytearray(data), r, 0, len(data), r.choice([1, 1, 2, 3, 8])))


def _json(data: bytes, r) -> bytes:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return _raw(data, r)
    try:
        return fz.encode(fz.mutate_doc(doc if isinstance(doc, dict) else {"_": doc}, r), r)
    except (RecursionError, ValueError):
        return b"[" * 100000


def _safetensors_header(data: bytes, r) -> bytes:
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    if r.random() < 0.2:
        return struct.pack("<Q", r.choice([0, 1, n - 1, n + 1, 2**40, 2**63, 2**64 - 1])) + data[8:]
    try:
        raw = fz.encode(fz.mutate_doc(header, r), r)
    except (RecursionError, ValueError):
        raw = b"[" * 100000
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


_HUGE = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]


def _zip_fields(data: bytes, r) -> bytes:
    """A size, offset or name length of a local header, a central entry or the
    end record set to a hostile value."""
    raw = bytearray(data)
    places = []
    for sig, fields in ((b"PK\x03\x04", [(18, "I"), (22, "I"), (26, "H"), (28, "H")]),
                        (b"PK\x01\x02", [(20, "I"), (24, "I"), (28, "H"), (30, "H"), (42, "I")]),
                        (b"PK\x05\x06", [(8, "H"), (10, "H"), (12, "I"), (16, "I")]),
                        (b"PK\x06\x06", [(24, "Q"), (32, "Q"), (40, "Q"), (48, "Q")])):
        at = raw.find(sig)
        while at >= 0:
            places += [(at + off, fmt) for off, fmt in fields]
            at = raw.find(sig, at + 4)
    for _ in range(r.randrange(1, 3)):
        if not places:
            break
        at, fmt = r.choice(places)
        if at + struct.calcsize("<" + fmt) > len(raw):
            continue
        old = struct.unpack_from("<" + fmt, raw, at)[0]
        limit = (1 << (8 * struct.calcsize(fmt))) - 1
        value = r.choice(_HUGE + [old + 1, old - 1, old + 4096, limit, old // 2])
        struct.pack_into("<" + fmt, raw, at, max(0, min(limit, value)))
    return bytes(raw)


def _resealed_pickle(data: bytes, r) -> bytes:
    """The zip rewritten with its data.pkl damaged and every CRC recomputed."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = [(i.filename, archive.read(i)) for i in archive.infolist()]
    except (zipfile.BadZipFile, OSError, ValueError):
        return _raw(data, r)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, payload in records:
            if name.endswith("data.pkl"):
                payload = _raw(payload, r)
            archive.writestr(name, payload)
    return out.getvalue()


def _metadata(data: bytes, r) -> bytes:
    """DCP's .metadata with hostile offsets, lengths, paths, chunk geometry or dtypes."""
    metadata = pickle.loads(data)
    infos = list(metadata.storage_data.items())
    tensors = [(k, v) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")]
    hostile_ints = [-1, -4096, 2**31, 2**40, 10**12, 2**63, 2**64, 1.5, "0", None, True]
    for _ in range(r.randrange(1, 3)):
        what = r.randrange(6)
        if what <= 1 and infos:
            index, info = r.choice(infos)
            fields = [f.name for f in dataclasses.fields(info)]
            name = r.choice(fields)
            old = getattr(info, name)
            if name == "relative_path":
                value = r.choice(["../outside.bin", "/dev/zero", "missing.distcp", "", ".metadata", "a/b",
                                  old + "x", 7])
            elif isinstance(old, int):
                value = r.choice(hostile_ints + [old + 1, old - 1, old + 4096, old * 2])
            else:
                value = fz.hostile_value(r)
            try:
                metadata.storage_data[index] = dataclasses.replace(info, **{name: value})
            except (TypeError, ValueError):
                pass
        elif what == 2 and tensors:
            fqn, meta = r.choice(tensors)
            chunk = r.choice(meta.chunks)
            attr = r.choice(["offsets", "sizes"])
            dims = list(getattr(chunk, attr))
            if dims and r.random() < 0.7:
                dims[r.randrange(len(dims))] = r.choice(hostile_ints[:6] + [0, 3])
            else:
                dims = dims + [1] if r.random() < 0.5 else dims[:-1]
            object.__setattr__(chunk, attr, torch.Size([d if isinstance(d, int) else 0 for d in dims])
                               if r.random() < 0.5 else dims)
        elif what == 3 and tensors:
            fqn, meta = r.choice(tensors)
            choice = r.randrange(3)
            if choice == 0:
                object.__setattr__(meta.properties, "dtype", r.choice([torch.float64, torch.int8, torch.bool,
                                                                      "float32", None]))
            elif choice == 1:
                object.__setattr__(meta, "size", torch.Size([r.choice([0, 1, 10**9, 2**40])]))
            else:
                meta.chunks.append(copy.deepcopy(r.choice(meta.chunks)) if meta.chunks else None)
        elif what == 4:
            keys = list(metadata.state_dict_metadata)
            if keys:
                value = metadata.state_dict_metadata.pop(r.choice(keys))
                if r.random() < 0.5:
                    metadata.state_dict_metadata[r.choice(["w", "", "x.y", "b"])] = value
        else:
            if infos:
                index, _ = r.choice(infos)
                del metadata.storage_data[index]
    return pickle.dumps(metadata)


def _symlink(path: str, r, scratch: str) -> None:
    """Replace ``path`` by a symlink (or a FIFO)."""
    os.remove(path)
    kind = r.randrange(6)
    if kind == 0:
        os.symlink("/dev/zero", path)
    elif kind == 1:
        os.symlink("/dev/null", path)
    elif kind == 2:
        target = os.path.join(scratch, "a_dir")
        os.makedirs(target, exist_ok=True)
        os.symlink(target, path)
    elif kind == 3:
        os.symlink(os.path.join(scratch, "no_such_file"), path)
    elif kind == 4:
        os.symlink(os.path.join(os.path.dirname(scratch), "outside.bin"), path)
    else:
        os.mkfifo(path)


def mutate(fmt: str, case: str, r, scratch: str) -> Tuple[str, str, bool]:
    """Damage the checkpoint copied to ``case``: (mutator, file, checked) where
    ``checked``: the damaged bytes are covered by a checksum the reader must verify."""
    files = _files(case)
    target = r.choice(files)
    name = os.path.basename(target)
    with open(target, "rb") as f:
        data = f.read()
    choices: List[Tuple[str, Callable[[bytes, Any], bytes]]] = [("raw", _raw)]
    if name.endswith(".json") or name in ("latest",):
        choices += [("json", _json)] * 2
    if fmt == "safetensors":
        choices += [("header", _safetensors_header)] * 2
    if fmt == "torchzip" or name.endswith(".distcp"):
        choices += [("zipfields", _zip_fields), ("pickle", _resealed_pickle)]
    if name == ".metadata":
        choices += [("metadata", _metadata)] * 3
    choices.append(("symlink", None))           # type: ignore[arg-type]
    mutator, fn = r.choice(choices)
    if fn is None:
        _symlink(target, r, scratch)
        return mutator, name, False
    try:
        mutated = fn(data, r)
    except Exception:                           # noqa: BLE001 - a base the mutator cannot parse
        mutator, mutated = "raw", _raw(data, r)
    with open(target, "wb") as f:
        f.write(mutated)
    # What a checksum covers: a torch zip's records (CRC-32), a data file of a step or of
    # DCP's lazyckpt layout (xxh3 blocks and footer), DCP's records (CRC-32).
    checked = mutator in ("raw", "zipfields") and (
        fmt == "torchzip" or name.endswith(".distcp") or name.endswith(".lzc")
        or (fmt == "stepdir" and not name.endswith(".json") and name != "latest"))
    return mutator, name, checked


# --------------------------------------------------------------------------- reading


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def read(fmt: str, case: str, r, work: str) -> Tuple[Any, List[Any]]:
    """Read the case as its format's readers do: (value read, the values it may be)."""
    if fmt == "stepdir":
        if r.random() < 0.5:
            return lazyckpt.load(case), [step_state(1), step_state(2)]
        steps = sorted(n for n in os.listdir(case) if n.startswith("step_"))
        if steps:       # one step directory read as itself
            return lazyckpt.load(os.path.join(case, r.choice(steps))), [step_state(1), step_state(2)]
        return lazyckpt.load(case), [step_state(1), step_state(2)]
    if fmt in ("torchzip", "safetensors") or (fmt.startswith("dcp") and r.random() < 0.3):
        from lazyckpt.interop.convert import convert
        dst = os.path.join(work, "out.lzc")
        convert(case, dst)
        out = lazyckpt.load(dst)
        return out, [base_state()]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from lazyckpt.interop.dcp_source import LazyStorageReader
    # DCP's loader turns any error of read_metadata into an AssertionError carrying its
    # text: the reader's own refusal is what this checks, as a direct call.
    LazyStorageReader(case).read_metadata()
    target = {k: torch.zeros_like(v) for k, v in base_state().items()}
    # A key the (unchecksummed) metadata lost is DCP's "Missing key" for any checkpoint
    # saved without it: read what is there; other values are then expected.
    dcp.load(target, storage_reader=LazyStorageReader(case), planner=DefaultLoadPlanner(allow_partial_load=True),
             no_dist=True)
    return target, [base_state()]


class Hang(BaseException):
    pass


def _on_alarm(signum, frame):
    raise Hang()


def _family(exc: BaseException) -> Optional[CheckpointError]:
    """The library's error in ``exc`` or, when DCP wrapped a rank's error in its
    CheckpointException, inside it."""
    from lazyckpt.interop.sources import _exception_chain
    if isinstance(exc, CheckpointError):
        return exc
    if type(exc).__name__ == "CheckpointException":
        for inner in _exception_chain(exc):
            if isinstance(inner, CheckpointError):
                return inner
    return None


def _target_mismatch(exc: BaseException) -> Optional[str]:
    """DCP's planner comparing the caller's target with the checkpoint's metadata
    ("Size mismatch between saved ... and current ..."): what it raises for an intact
    checkpoint saved with other shapes. Metadata that renamed one tensor's entry to
    another's name (no checksum covers .metadata) is such a checkpoint as far as any
    reader can tell before reading the record; counted apart, not as a failure."""
    from lazyckpt.interop.sources import _exception_chain
    if type(exc).__name__ != "CheckpointException":
        return None
    for inner in _exception_chain(exc):
        if isinstance(inner, ValueError) and str(inner).startswith("Size mismatch between saved"):
            return f"{type(inner).__name__}: {inner}"
    return None


def _digest(paths: List[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(p.encode() + f.read())
    return h.hexdigest()


def one_input(bases: Dict[str, str], seed: int, i: int, scratch: str) -> Tuple[str, str, str, str]:
    """Make input ``i`` of ``seed`` and read it: (format, mutator, outcome, detail)."""
    r = random.Random(f"{seed}:{i}")
    fmt = r.choice(FORMATS)
    work = os.path.join(scratch, "case")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    base = bases[fmt]
    case = os.path.join(work, os.path.basename(base))
    if os.path.isdir(base):
        shutil.copytree(base, case, symlinks=True)
    else:
        shutil.copy(base, case)
    mutator, name, checked = mutate(fmt, case, r, work)
    before = sorted(os.listdir(scratch))
    outside = os.path.join(scratch, "outside.bin")
    outside_digest = _digest([outside])
    old = signal.signal(signal.SIGALRM, _on_alarm)
    outcome, detail = "ok", ""
    try:
        signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
        try:
            value, expected = read(fmt, case, r, work)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if not any(_same(value, e) for e in expected):
            outcome = "wrong" if checked else "ok-other-values"
            detail = f"{name}: read other values"
    except Hang:
        outcome, detail = "hang", f"{name}: did not finish within {TIME_LIMIT_S} s"
    except BaseException as exc:        # noqa: BLE001 - what the fuzzer looks for
        if isinstance(exc, KeyboardInterrupt):
            raise
        mine = _family(exc)
        target = _target_mismatch(exc)
        if mine is not None:
            outcome, detail = "library", f"{type(mine).__name__}: {mine}"[:300]
        elif target is not None:
            outcome, detail = "target-mismatch", f"{name}: {target}"[:300]
        else:
            from lazyckpt.interop.sources import _exception_chain
            inner = [e for e in _exception_chain(exc) if type(e).__name__ != "CheckpointException"]
            cause = inner[-1] if inner else exc
            outcome, detail = "other", f"{name}: {type(cause).__name__}: {cause}"[:400]
    finally:
        signal.signal(signal.SIGALRM, old)
    if sorted(os.listdir(scratch)) != before or _digest([outside]) != outside_digest:
        outcome, detail = "outside", f"{name}: the scratch directory or a file outside the input changed"
    return fmt, mutator, outcome, detail


def prepare(scratch: str) -> Tuple[Dict[str, str], str]:
    """The bases (in a directory beside the inputs' scratch directory, which holds
    the file ``outside.bin`` a symlink may point at)."""
    logging.disable(logging.CRITICAL)        # DCP logs every failure it then raises
    bases = make_bases(os.path.join(scratch, "bases"))
    inputs = os.path.join(scratch, "inputs")
    os.makedirs(inputs)
    with open(os.path.join(inputs, "outside.bin"), "wb") as f:
        f.write(b"outside" * 100)
    return bases, inputs


def run(seed: int, count: Optional[int] = None, seconds: Optional[float] = None,
        report: Optional[Callable[[str], None]] = None) -> Tuple[collections.Counter, List[Tuple[int, str]]]:
    """Inputs 0.. of ``seed`` until ``count`` inputs or ``seconds`` have passed:
    (counts by (format, mutator, outcome), failures as (input, detail))."""
    counts: collections.Counter = collections.Counter()
    failures: List[Tuple[int, str]] = []
    with tempfile.TemporaryDirectory(prefix="lazyckpt-fuzz-") as scratch:
        bases, inputs = prepare(scratch)
        digest = _digest([p for b in bases.values() for p in _files(b)])
        start = time.monotonic()
        i = 0
        while (count is None or i < count) and (seconds is None or time.monotonic() - start < seconds):
            fmt, mutator, outcome, detail = one_input(bases, seed, i, inputs)
            counts[(fmt, mutator, outcome)] += 1
            if outcome in FAILURES:
                failures.append((i, f"{fmt}/{mutator}: {outcome}: {detail}"))
                if report:
                    report(f"input {seed}:{i}: {fmt}/{mutator}: {outcome}: {detail}")
            i += 1
        if _digest([p for b in bases.values() for p in _files(b)]) != digest:
            failures.append((-1, "a base checkpoint changed"))
    return counts, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=None)
    args = parser.parse_args()
    counts, failures = run(args.seed, args.count, args.minutes * 60, report=lambda s: print(s, flush=True))
    by_format: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (fmt, mutator, outcome), n in counts.items():
        by_format[fmt][outcome] += n
    total = sum(counts.values())
    print(f"seed {args.seed}: {total} inputs, {len(failures)} failures")
    for fmt in FORMATS:
        print(f"  {fmt}: {dict(sorted(by_format[fmt].items()))}")
    mutators: collections.Counter = collections.Counter()
    for (fmt, mutator, outcome), n in counts.items():
        mutators[mutator] += n
    print(f"  by mutator: {dict(sorted(mutators.items()))}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
