"""The checkpoint-file fuzzer shared by tests/test_fuzz.py (hypothesis, short)
and benchmarks/fuzz_long.py (>= 10,000 inputs).

Mutators take a ``random.Random``-like object: hypothesis passes one it
controls (``st.randoms()``), so failing inputs shrink; the long run passes
seeded ones, so every input is reproducible from its seed.

* ``mutate_raw``: bit flips, byte sets, truncations, insertions, deletions and
  overwrites anywhere in the file (header, data, footer, trailer).
* ``mutate_footer_bytes``: the same byte-level damage confined to the footer,
  with the trailer (length, xxh3-64) recomputed so the damage reaches the JSON
  parser and the validation behind it.
* ``mutate_footer_doc``: structured changes of the footer JSON (types swapped,
  huge and negative integers, NaN/Infinity, deep nesting, missing and unknown
  keys, wrong tags and kinds, nodes swapped or duplicated), trailer recomputed.

``check`` loads a mutated file and classifies the outcome: ``ok`` (loaded),
``library`` (a lazyckpt.CheckpointError), or a failure: ``other`` (any other
exception), ``hang`` (over the time limit), ``memory`` (a Python-heap peak
or a read buffer over budget: allocation driven by a claimed size).
"""

from __future__ import annotations

import collections
import copy
import json
import mmap as _mmap
import os
import signal
import struct
import tracemalloc
import types
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import xxhash

import lazyckpt
import lazyckpt.loading.reader

TRAILER = struct.Struct("<QQQ8s")
FOOTER_MAGIC = b"LZCKFOOT"
SMALL_KNOBS = dict(chunk_bytes=8192, host_cache_bytes=32768)

#: Python-heap peak allowed while loading one tiny (< 64 KiB) file.
HEAP_BUDGET = 4 << 20
#: Read buffers (anonymous mmaps) allowed, as a multiple of the file size, plus slack.
BUFFER_FACTOR = 2
BUFFER_SLACK = 1 << 20
TIME_LIMIT_S = 10.0


# --------------------------------------------------------------------------- base files


def base_state(with_pickle: bool = False) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 100, generator=g)                       # 9600 bytes: straddles 8 KiB blocks
    state: Dict[str, Any] = {
        "model": collections.OrderedDict([("w", w), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
                                          ("w_row", w[3]), ("w_t", w.t()[1:5])]),
        "emb": torch.randint(-5, 5, (301,), generator=g, dtype=torch.int16),
        "mask": torch.tensor([[True, False], [False, True]]),
        "empty": torch.empty(0, 3),
        "arr": np.arange(12, dtype=np.float64).reshape(3, 4),
        "scalar": np.float32(2.5),
        "blob": bytes(range(256)) * 3,
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "misc": [1, -2, 3.5, float("nan"), float("-inf"), None, True, "text", 2**80, complex(1, -2),
                 (1, (2, 3)), {4, 5}, frozenset({6}), torch.Size([2, 3]), torch.float16, torch.device("cpu")],
        "step": 12,
    }
    if with_pickle:
        state["obj"] = slice(1, 9, 2)
    return state


def make_base_files(directory: str) -> List[Tuple[str, bytes]]:
    out = []
    for with_pickle in (False, True):
        path = os.path.join(directory, f"base{int(with_pickle)}.lzc")
        lazyckpt.save(base_state(with_pickle), path, **SMALL_KNOBS)
        with open(path, "rb") as f:
            out.append((path, f.read()))
    return out


# --------------------------------------------------------------------------- byte mutations


def _random_bytes(r, n: int) -> bytes:
    kind = r.randrange(4)
    if kind == 0:
        return bytes(r.getrandbits(8) for _ in range(n))
    if kind == 1:
        return b"\0" * n
    if kind == 2:
        return b"\xff" * n
    return bytes(r.choice(b'{}[]",:0123456789-.eE$ntfalsruNI') for _ in range(n))


def _byte_ops(data: bytearray, r, lo: int, hi: int, ops: int) -> bytearray:
    """``ops`` random edits of ``data`` restricted to [lo, hi) (hi may move)."""
    for _ in range(ops):
        if hi <= lo:
            break
        op = r.randrange(6)
        pos = r.randrange(lo, hi)
        if op == 0:                                      # flip one bit
            data[pos] ^= 1 << r.randrange(8)
        elif op == 1:                                    # set one byte
            data[pos] = r.getrandbits(8)
        elif op == 2:                                    # truncate
            del data[pos:hi]
            hi = pos
        elif op == 3:                                    # insert
            chunk = _random_bytes(r, r.choice([1, 2, 4, 8, 33, 4096]))
            data[pos:pos] = chunk
            hi += len(chunk)
        elif op == 4:                                    # delete a run
            n = min(hi - pos, r.choice([1, 3, 8, 64, 4096]))
            del data[pos:pos + n]
            hi -= n
        else:                                            # overwrite a run
            n = min(hi - pos, r.choice([1, 4, 8, 16, 100]))
            data[pos:pos + n] = _random_bytes(r, n)
    return data


def _regions(data: bytes) -> Dict[str, Tuple[int, int]]:
    size = len(data)
    offset, length, _, _ = TRAILER.unpack(data[-32:])
    return {"header": (0, 16), "data": (4096, offset), "footer": (offset, offset + length),
            "trailer": (size - 32, size), "anywhere": (0, size)}


def mutate_raw(data: bytes, r) -> bytes:
    """Byte-level damage anywhere: the trailer checksum is NOT fixed, so most
    footer damage is caught by it; header, trailer and data damage is direct."""
    regions = _regions(data)
    name = r.choice(sorted(regions))
    lo, hi = regions[name]
    return bytes(_byte_ops(bytearray(data), r, lo, max(lo + 1, hi), r.randrange(1, 4)))


def with_footer(data: bytes, footer: bytes, footer_offset: Optional[int] = None) -> bytes:
    """``data`` with its footer replaced and a consistent trailer."""
    offset = TRAILER.unpack(data[-32:])[0]
    at = offset if footer_offset is None else footer_offset
    return data[:offset] + footer + TRAILER.pack(at, len(footer), xxhash.xxh3_64_intdigest(footer), FOOTER_MAGIC)


def footer_of(data: bytes) -> bytes:
    offset, length, _, _ = TRAILER.unpack(data[-32:])
    return data[offset:offset + length]


def mutate_footer_bytes(data: bytes, r) -> bytes:
    footer = bytearray(footer_of(data))
    footer = _byte_ops(footer, r, 0, len(footer), r.randrange(1, 4))
    return with_footer(data, bytes(footer))


# --------------------------------------------------------------------------- structured mutations


HOSTILE_INTS = [0, 1, -1, 2, 7, 4095, 4096, 4097, 8192, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62,
                2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**64, 10**30, -10**30, 10**300]
HOSTILE_STRINGS = ["", "$", "float32", "float64", "bfloat16", "int64", "bool", "complex128", "uint64",
                   "float8_e4m3fn", "qint8", "object", "O", "V8", "<f8", "|S3", "(2,)f8", "f8,i4", "M8[ns]",
                   "cpu", "meta", "cuda", "cuda:7", "xla", "nan", "inf", "-inf", "1e309", "tensor", "numpy",
                   "pickle", "bytes", "seq", "dict", "torch", "float", "complex", "custom", "dtensor",
                   "data", "remote", "list", "tuple", "set", "frozenset", "size", "dtype", "device",
                   "scalar", "array", "little", "big", "xxh3_64", "\u0000", "\udcff", "a" * 5000,
                   "builtins.eval", "os.system"]
TAGS = ["float", "complex", "seq", "dict", "torch", "tensor", "numpy", "bytes", "pickle", "custom",
        "dtensor", "Tensor", "", "unknown"]


def hostile_value(r, depth: int = 0) -> Any:
    k = r.randrange(12)
    if k == 0:
        return r.choice(HOSTILE_INTS)
    if k == 1:
        return r.randrange(-2**70, 2**70)
    if k == 2:
        return r.choice([float("nan"), float("inf"), float("-inf"), -0.0, 0.5, 1.0, 1e308, 4096.0])
    if k == 3:
        return r.choice([True, False, None])
    if k == 4:
        return r.choice(HOSTILE_STRINGS)
    if k == 5:
        return [r.choice(HOSTILE_INTS) for _ in range(r.randrange(0, 5))]
    if k == 6:
        return [r.randrange(-3, 10) for _ in range(r.randrange(0, 5))]
    if k == 7 and depth < 3:
        return {r.choice(["$", "t", "v", "k", "e", "dtype", "shape", "x"]): hostile_value(r, depth + 1)
                for _ in range(r.randrange(0, 4))}
    if k == 8 and depth < 3:
        return {"$": r.choice(TAGS), "t": r.choice(HOSTILE_STRINGS), "v": hostile_value(r, depth + 1),
                "e": r.choice(HOSTILE_INTS)}
    if k == 9:
        return deep(r.choice([10, 100, 500, 990, 2000, 20000]), r.randrange(3))
    if k == 10:
        return {}
    return []


def deep(depth: int, kind: int) -> Any:
    """Nesting without recursion (building it must not itself overflow)."""
    node: Any = 1
    for _ in range(depth):
        if kind == 0:
            node = [node]
        elif kind == 1:
            node = {"$": "seq", "t": "list", "v": [node]}
        else:
            node = {"$": "dict", "k": ["a"], "v": [node]}
    return node


def _slots(doc: Any) -> List[Tuple[Any, Any]]:
    """(container, key) of every value in the document (iteratively)."""
    out = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            out.append((node, key))
            if isinstance(value, (dict, list)):
                stack.append(value)
    return out


def mutate_doc(doc: Dict[str, Any], r) -> Dict[str, Any]:
    doc = copy.deepcopy(doc)
    for _ in range(r.randrange(1, 4)):
        slots = _slots(doc)
        if not slots:
            break
        container, key = r.choice(slots)
        op = r.randrange(9)
        if op <= 2:                                          # replace with a hostile value
            container[key] = hostile_value(r)
        elif op == 3:                                        # drop it
            if isinstance(container, dict):
                del container[key]
            else:
                container.pop(key)
        elif op == 4 and isinstance(container, dict):        # an unknown member next to it
            container[r.choice(["x", "shard", "rank", "$$", "e"])] = hostile_value(r)
        elif op == 5:                                        # another tag / kind
            target = container[key]
            if isinstance(target, dict):
                target["$" if "$" in target or r.random() < 0.5 else "kind"] = r.choice(TAGS + ENTRY_KINDS)
            else:
                container[key] = {"$": r.choice(TAGS)}
        elif op == 6:                                        # swap with another value
            other_c, other_k = r.choice(slots)
            try:
                container[key], other_c[other_k] = copy.deepcopy(other_c[other_k]), copy.deepcopy(container[key])
            except (KeyError, IndexError):
                pass
        elif op == 7:                                        # duplicate inside a list
            if isinstance(container, list):
                container.insert(key, copy.deepcopy(container[key]))
            else:
                container[key] = [container[key], copy.deepcopy(container[key])]
        else:                                                # nudge a number
            value = container[key]
            if isinstance(value, int) and not isinstance(value, bool):
                container[key] = value + r.choice([-4097, -4096, -1, 1, 4096, 2**32, 2**63, -2 * value - 1])
            elif isinstance(value, float):
                container[key] = r.choice([float("nan"), -value, value * 1e300])
            else:
                container[key] = hostile_value(r)
    return doc


ENTRY_KINDS = ["data", "pickle", "remote", "Data", ""]


def encode(doc: Any, r) -> bytes:
    text = json.dumps(doc, separators=(",", ":"), allow_nan=True, check_circular=False)
    if r.random() < 0.1:
        text = text.replace("1", "1" * r.choice([2, 20, 400]), 1)    # a long digit run somewhere
    return text.encode("utf-8", "surrogatepass")


def mutate_footer_doc(data: bytes, r) -> bytes:
    doc = json.loads(footer_of(data))
    try:
        footer = encode(mutate_doc(doc, r), r)
    except (RecursionError, ValueError):
        footer = b"[" * 100000
    return with_footer(data, footer)


MUTATORS = {"raw": mutate_raw, "footer-bytes": mutate_footer_bytes, "footer-doc": mutate_footer_doc}


# --------------------------------------------------------------------------- the property


class Hang(BaseException):
    """Raised by SIGALRM in the main thread: a load took too long. A
    BaseException so that no `except Exception` in the library swallows it."""


class OverBudget(BaseException):
    """A read buffer larger than the budget was requested."""


class _BufferWatch:
    """Stands in for the ``mmap`` module inside lazyckpt.storage.fileio (where every
    read buffer is allocated): records every anonymous buffer, refuses those
    over budget."""

    def __init__(self, budget: int):
        self.budget = budget
        self.total = 0
        self.largest = 0
        self.module = types.SimpleNamespace(**{k: getattr(_mmap, k) for k in dir(_mmap) if not k.startswith("__")})
        self.module.mmap = self._mmap

    def _mmap(self, fileno, length, *args, **kwargs):
        self.total += length
        self.largest = max(self.largest, length)
        if self.total > self.budget:
            raise OverBudget(f"read buffers total {self.total} bytes, budget {self.budget}")
        return _mmap.mmap(fileno, length, *args, **kwargs)


def _on_alarm(signum, frame):
    raise Hang()


def run_guarded(fn, size: int, time_limit: float = TIME_LIMIT_S, heap_budget: int = HEAP_BUDGET):
    """Call ``fn()`` under the guards; return (outcome, detail, exception or None).
    ``size`` is the input's size: read buffers may total 2 x size + 1 MiB."""
    watch = _BufferWatch(BUFFER_FACTOR * size + BUFFER_SLACK)
    real_mmap = lazyckpt.storage.fileio.mmap
    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start()
    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    lazyckpt.storage.fileio.mmap = watch.module
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    outcome, detail, error = "ok", "", None
    try:
        signal.setitimer(signal.ITIMER_REAL, time_limit)
        try:
            value = fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        del value
    except Hang:
        outcome, detail = "hang", f"did not finish within {time_limit} s"
    except OverBudget as exc:
        outcome, detail = "memory", str(exc)
    except lazyckpt.CheckpointError as exc:
        outcome, detail, error = "library", f"{type(exc).__name__}: {exc}"[:300], exc
    except BaseException as exc:        # noqa: BLE001 - what the fuzzer looks for
        outcome, detail, error = "other", f"{type(exc).__name__}: {exc}"[:300], exc
    finally:
        lazyckpt.storage.fileio.mmap = real_mmap
        signal.signal(signal.SIGALRM, old_handler)
        peak = tracemalloc.get_traced_memory()[1] - base
        if started_tracing:
            tracemalloc.stop()
    if outcome in ("ok", "library") and peak > heap_budget:
        outcome, detail = "memory", f"Python heap peak {peak} bytes for a {size}-byte input ({detail})"
    if outcome == "ok" and watch.total > 0:
        detail = f"read buffers {watch.total} bytes"
    return outcome, detail, error


def check(path: str, size: int, keys: Optional[list] = None, time_limit: float = TIME_LIMIT_S,
          heap_budget: int = HEAP_BUDGET) -> Tuple[str, str]:
    """Load ``path``; return (outcome, detail). Outcomes: ok, library, other, hang, memory."""
    def load():
        return lazyckpt.load(path) if keys is None else lazyckpt.load(path, keys=keys)
    outcome, detail, _ = run_guarded(load, size, time_limit, heap_budget)
    return outcome, detail


def one_input(bases: List[Tuple[str, bytes]], r, scratch: str) -> Tuple[str, str, str]:
    """Make one mutated file from a random base and check it (with a random key
    selection half the time). Returns (mutator, outcome, detail)."""
    _, data = bases[0] if r.random() < 0.85 else bases[1]
    name = r.choice(sorted(MUTATORS))
    mutated = MUTATORS[name](data, r)
    with open(scratch, "wb") as f:
        f.write(mutated)
    keys = None
    if r.random() < 0.5:
        keys = [r.choice(["model", "emb", "arr", "misc", "opt", "step", "nope", ("model", "w"),
                          ("opt", "state", 0), ("opt", "param_groups")])]
    outcome, detail = check(scratch, len(mutated), keys)
    return name, outcome, f"keys={keys}: {detail}" if keys else detail


FAILURES = ("other", "hang", "memory")
