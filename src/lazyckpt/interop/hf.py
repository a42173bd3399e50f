"""Hugging Face model directories <-> lazyckpt checkpoints.

``export_hf`` turns a committed step (one rank or many: DTensor shards of any
layout are assembled, replicated keys read once, incremental references
followed) into what ``AutoModel*.from_pretrained`` loads: safetensors shards
no larger than ``max_shard_size`` (``model.safetensors`` when one suffices,
else ``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json``
with ``weight_map`` and ``metadata.total_size``), and ``config.json`` plus the
tokenizer and generation files of a ``config`` directory.

Memory is bounded by the largest tensor, not the model: whole tensors are
read ahead by a few threads (a DTensor assembled from only the rows of the
pieces that hold it, every block checksum verified) while the previous ones
are written, and the tensors read but not yet written never exceed twice the
largest one (once, plus its converted copy, with a ``dtype`` cast). The
output is built in a hidden sibling directory and renamed into place, so an
interrupted export leaves nothing half-visible.

``import_hf`` goes the other way: the shards are memory-mapped and written by
``lazyckpt.save`` into one file holding the flat ``{name: tensor}`` state (or
``{key: {...}}``), which ``load(..., into=model.state_dict())`` fills, FSDP2
models included: a plain saved tensor loaded into a DTensor reads only the
rows of that rank's shard.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from lazyckpt import api
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, StateMismatchError
from lazyckpt.knobs import Options, resolve as resolve_options
from lazyckpt.loading.reader import CheckpointFile, RefResolver, resolver_for
from lazyckpt.loading.resolve import Target, resolve as resolve_target
from lazyckpt.loading.stepfiles import StepFiles, plain_tensor_entry
from lazyckpt.state.providers import LoadContext
from lazyckpt.state.walk import Leaf, walk
from lazyckpt.storage.fileio import fsync_dir, remove_tree
from lazyckpt.storage.sidefiles import new_token
from lazyckpt.storage.stores import for_path
from .convert import write_safetensors
from .sources import ST_CODES, SafetensorsSource, TensorSpec, itemsize, read_safetensors_header

#: Where training states usually keep the model (autodetected in this order).
MODEL_KEYS = ("model", "module", "state_dict")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Copied from ``config`` when present: what from_pretrained and the tokenizer read.
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "vocab.txt",
                "merges.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json")

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_shard_size(value: Union[int, str]) -> int:
    """``5GB`` -> 5 * 10**9 (decimal, as transformers reads it), ``2GiB`` ->
    2 * 2**30, or a number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(i?)b?\s*", str(value), re.IGNORECASE)
        if not m:
            raise CheckpointError(f"bad shard size {value!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
        unit = m.group(2).lower()
        scale = (1 << (10 * " kmgt".index(unit))) if m.group(3) and unit else _DECIMAL[unit]
        size = int(float(m.group(1)) * scale)
    if size < 1:
        raise CheckpointError(f"shard size must be at least 1 byte, got {value!r}")
    return size


@dataclass
class ExportResult:
    src: str
    out_dir: str
    step: Optional[int]
    key: Tuple[str, ...]
    files: List[str] = field(default_factory=list)
    tensors: int = 0
    tensor_bytes: int = 0
    seconds: float = 0.0
    copied: List[str] = field(default_factory=list)


@dataclass
class _Tensor:
    name: str                   # output name
    leaf: Leaf
    dtype: torch.dtype          # as saved
    out_dtype: torch.dtype      # as written
    shape: List[int]
    rank: Optional[int] = None  # whose tree holds it (None: a lone file)

    @property
    def nbytes(self) -> int:
        """Bytes as written."""
        return math.prod(self.shape) * itemsize(self.out_dtype)

    @property
    def saved_bytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


# --------------------------------------------------------------------------- export


def export_hf(src: str, out_dir: str, *, key: Optional[str] = None, prefix: str = "", strip: str = "",
              dtype: Union[None, str, torch.dtype] = None, max_shard_size: Union[int, str] = "5GB",
              config: Optional[str] = None, overwrite: bool = False,
              progress: Optional[Callable[[int], None]] = None,
              on_total: Optional[Callable[[int], None]] = None, **knobs: Any) -> ExportResult:
    """Write the model of the committed step ``src`` (a step directory, a
    Checkpointer directory: its latest step, or one checkpoint file) as a
    Hugging Face model directory ``out_dir``.

    ``key`` is the path of the model state in the checkpoint ("model",
    "a/b"; default: the first of model/module/state_dict present, else the
    whole state if it holds only tensors). Names are the state's keys joined
    with ``.``; ``strip`` removes a leading prefix where present and
    ``prefix`` adds one. ``dtype`` casts floating-point tensors (and the
    config's ``torch_dtype``). ``config`` is a directory whose config.json
    (required) and tokenizer/generation files are copied; with transformers
    installed, the weights are checked against the architecture it names.
    ``knobs`` are lazyckpt's read knobs (``o_direct``, ``reader_threads``, ...)."""
    t0 = time.perf_counter()
    limit = parse_shard_size(max_shard_size)
    out_dtype = _parse_dtype(dtype)
    out_dir = os.path.abspath(os.fspath(out_dir))
    _check_destination(out_dir, overwrite)
    if config is not None and not os.path.isfile(os.path.join(config, "config.json")):
        raise CheckpointError(f"{config}: no config.json there (--config takes a Hugging Face model or "
                              f"config directory)", path=config)
    options = resolve_options(None, **knobs)
    target = resolve_target(src, options, store=for_path(src))
    # Hold the step for the whole export: retention elsewhere must not delete it between batches.
    with (target.store.reading_step(target.step_dir, options, target.step) if target.step_dir
          else contextlib.nullcontext()):
        chosen, tensors = _model_tensors(target, key, prefix, strip, out_dtype, options)
        if config is not None:
            _check_against_config(config, tensors)
        shards = _plan_shards(tensors, limit)
        if on_total is not None:
            on_total(sum(t.nbytes for t in tensors))
        tmp = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp-{new_token()}")
        os.makedirs(tmp)
        reader = _StepReader(target, options)
        try:
            # Tensors read ahead and not yet written: twice the largest, or once if
            # a cast adds a converted copy of the one being written.
            largest = max(t.saved_bytes for t in tensors)
            budget = largest if out_dtype is not None else 2 * largest
            names = _shard_names(len(shards))
            weight_map: Dict[str, str] = {}
            for name, shard in zip(names, shards):
                # Largest elements first inside a file: every tensor stays aligned to its element size.
                order = sorted(shard, key=lambda t: -itemsize(t.out_dtype))
                specs = [TensorSpec(t.name, t.out_dtype, t.shape) for t in order]
                write_safetensors(os.path.join(tmp, name), specs, _read(reader, order, budget),
                                  {"format": "pt"}, progress)
                weight_map.update((t.name, name) for t in shard)
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                         "weight_map": {t.name: weight_map[t.name] for t in tensors}}
                _write_json(os.path.join(tmp, INDEX_FILE), index)
            copied = _copy_config(config, tmp, out_dtype) if config is not None else []
            fsync_dir(tmp)
            _install(tmp, out_dir, overwrite)
        except BaseException:
            remove_tree(tmp)
            raise
        finally:
            reader.close()
    return ExportResult(os.path.abspath(src), out_dir, target.step, chosen, names, len(tensors),
                        sum(t.nbytes for t in tensors), time.perf_counter() - t0, copied)


def _parse_dtype(dtype: Union[None, str, torch.dtype]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
    value = getattr(torch, aliases.get(str(dtype).lower(), str(dtype).lower()), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise CheckpointError(f"bad dtype {dtype!r} (a floating-point dtype: bfloat16, float16, float32, ...)")
    return value


def _check_destination(out_dir: str, overwrite: bool) -> None:
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise CheckpointNotFoundError(f"{out_dir}: directory {parent} does not exist", path=out_dir)
    if os.path.lexists(out_dir) and not overwrite:
        raise CheckpointError(f"{out_dir}: already exists (pass overwrite=True / --force to replace it)",
                              path=out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: exists and is not a directory", path=out_dir)


def _split_key(key: Optional[str]) -> Optional[Tuple[str, ...]]:
    if key is None:
        return None
    return tuple(k for k in str(key).split("/") if k) if key not in ("", "/") else ()


def _model_tensors(target: Target, key: Optional[str], prefix: str, strip: str,
                   out_dtype: Optional[torch.dtype], options: Options) -> Tuple[Tuple[str, ...], List[_Tensor]]:
    """The model's tensors as they will be written (name, dtype, shape), in state
    order: the union over the saving ranks' trees (pipeline stages hold
    different keys; a key several ranks hold is read from the first)."""
    first = CheckpointFile(target.files[0][1], options, store=target.store)
    chosen = _split_key(key)
    if chosen is None:
        chosen = _detect_key(first)
    where = "/".join(chosen) or "<root>"
    out: List[_Tensor] = []
    by_name: Dict[str, _Tensor] = {}
    for rank, path in target.files:
        f = first if rank == target.files[0][0] else CheckpointFile(path, options, store=target.store)
        under = [leaf for leaf in walk(f.footer.tree) if leaf.path[:len(chosen)] == chosen]
        bad = [leaf.name for leaf in under if leaf.type not in ("tensor", "dtensor")
               or (leaf.type == "tensor" and leaf.node.get("e") is None)]
        if bad:
            raise CheckpointError(f"{f.path}: {len(bad)} value(s) under {where!r} are not tensors "
                                  f"(a model state holds only tensors): {', '.join(bad[:8])}"
                                  f"{', ...' if len(bad) > 8 else ''}; pass another key= / --key", path=f.path)
        mine: Dict[str, str] = {}
        for leaf in under:
            t = _describe(f, leaf, chosen, prefix, strip, out_dtype, rank)
            if t.name in mine:
                raise CheckpointError(f"{f.path}: {mine[t.name]} and {leaf.name} both map to the name "
                                      f"{t.name!r}", path=f.path)
            mine[t.name] = leaf.name
            known = by_name.get(t.name)
            if known is None:
                by_name[t.name] = t
                out.append(t)
            elif (known.dtype, known.shape) != (t.dtype, t.shape):
                raise CheckpointError(f"{target.step_dir}: {leaf.name} is {known.dtype} {known.shape} in rank "
                                      f"{known.rank}'s file but {t.dtype} {t.shape} in rank {rank}'s (a shard "
                                      f"saved as a plain tensor?)", path=target.step_dir)
    if not out:
        raise CheckpointError(f"{first.path}: the checkpoint has nothing under {where!r}", path=first.path)
    return chosen, out


def _detect_key(f: CheckpointFile) -> Tuple[str, ...]:
    leaves = list(walk(f.footer.tree))
    tops = {leaf.path[0] for leaf in leaves if leaf.path}
    chosen = next(((k,) for k in MODEL_KEYS if k in tops), None)
    if chosen is not None:
        return chosen
    if leaves and all(leaf.type in ("tensor", "dtensor") for leaf in leaves):
        return ()
    raise CheckpointError(f"{f.path}: no model state found (none of the top-level keys "
                          f"{sorted(tops)[:10]} is {'/'.join(MODEL_KEYS)}): pass key= / --key", path=f.path)


def _describe(f: CheckpointFile, leaf: Leaf, chosen: Tuple[str, ...], prefix: str, strip: str,
              out_dtype: Optional[torch.dtype], rank: Optional[int]) -> _Tensor:
    name = ".".join(leaf.path[len(chosen):])
    if strip and name.startswith(strip):
        name = name[len(strip):]
    name = prefix + name
    if not name:
        raise CheckpointError(f"{f.path}: {leaf.name} maps to an empty name", path=f.path)
    node = leaf.node
    saved = getattr(torch, str(node.get("dtype")), None)
    shape = node.get("global_shape" if leaf.type == "dtensor" else "shape")
    if not isinstance(saved, torch.dtype) or not isinstance(shape, list):
        raise CheckpointError(f"{f.path}: {leaf.name}: bad dtype or shape", path=f.path)
    written = out_dtype if out_dtype is not None and saved.is_floating_point else saved
    if ST_CODES.get(str(written).replace("torch.", "")) is None:
        raise CheckpointError(f"{f.path}: {leaf.name}: safetensors cannot hold {written}", path=f.path)
    return _Tensor(name, leaf, saved, written, list(shape), rank)


def _plan_shards(tensors: List[_Tensor], limit: int) -> List[List[_Tensor]]:
    """Consecutive tensors fill a shard up to ``limit`` (a larger tensor gets one alone), as transformers does."""
    shards: List[List[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _shard_names(n: int) -> List[str]:
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


class _StepReader:
    """Reads whole tensors of one committed step (or file), footers and manifest
    parsed once, from several threads: a DTensor is assembled from the rows of
    the pieces that hold it, a plain tensor read from the file that holds it
    (another rank's for a replicated entry, an earlier step's for a reference)."""

    def __init__(self, target: Target, options: Options):
        self.options = options
        self.pool = api._resources(self.options).readers
        self.path = target.step_dir or target.path
        if target.step_dir is not None:
            self.refs = RefResolver(os.path.dirname(target.step_dir), self.options)
            self.step: Optional[StepFiles] = StepFiles(target.step_dir, target.manifest, self.options, self.refs,
                                                       store=target.store)
            self.files = {rank: self.step.file(rank) for rank, _ in target.files}   # opened here, not racing
        else:
            self.refs = resolver_for(target.path, self.options)
            self.step = None
            self.files = {None: CheckpointFile(target.path, self.options, self.refs, store=target.store)}

    def close(self) -> None:
        self.refs.close()

    def tensor(self, t: _Tensor) -> torch.Tensor:
        leaf, node = t.leaf, t.leaf.node
        ctx = LoadContext(entry_value=_no_entry, storage=_no_entry, allow_pickle=False, path=self.path,
                          trail=list(leaf.path))
        if leaf.type == "dtensor":
            info = self.step.shard_info(json.dumps(list(leaf.path)), ctx) if self.step is not None else None
            if info is None:
                raise ctx.corrupt("no shard index for this DTensor (load it from its step directory)")
            return self.step._assemble(info, node, None, ctx, self.pool)
        holder, e = plain_tensor_entry(self.files[t.rank], self.step, node, t.dtype, ctx)
        storage = holder.read_entries([e], self.pool)[e]
        return torch.empty((0,), dtype=t.dtype).set_(storage, node["offset"], node["shape"], node["stride"])


def _no_entry(*_: Any) -> Any:
    raise AssertionError("the export reads entries itself")


def _read(reader: _StepReader, tensors: List[_Tensor], budget: int,
          workers: int = 4) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, tensor as written) in ``tensors`` order. Up to ``workers``
    tensors are read ahead concurrently while the caller writes, as long as
    the tensors read and not yet written stay within ``budget`` bytes (one is
    always allowed, whatever its size)."""
    pending: collections.deque = collections.deque()
    held = 0
    upcoming = iter(tensors)
    nxt = next(upcoming, None)
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lazyckpt-export") as ex:
        try:
            while pending or nxt is not None:
                while nxt is not None and len(pending) < workers and (not pending or held + nxt.saved_bytes <= budget):
                    pending.append((nxt, ex.submit(reader.tensor, nxt)))
                    held += nxt.saved_bytes
                    nxt = next(upcoming, None)
                t, job = pending.popleft()
                value = job.result()
                yield t.name, value.to(t.out_dtype) if value.dtype != t.out_dtype else value
                value = None
                held -= t.saved_bytes
        finally:
            for _, job in pending:
                job.cancel()


def _check_against_config(config: str, tensors: List[_Tensor]) -> None:
    """With transformers installed: the architecture config.json names must
    expect exactly these names and shapes (tied weights may be absent)."""
    try:
        import transformers
    except ImportError:
        return
    try:
        cfg = transformers.AutoConfig.from_pretrained(config)
    except Exception as exc:
        raise CheckpointError(f"{config}: config.json is not a valid Hugging Face config: {exc}",
                              path=config) from None
    archs = getattr(cfg, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    try:
        with torch.device("meta"):
            model = cls(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:             # an architecture this transformers cannot build: no check
        import warnings
        warnings.warn(f"{config}: cannot build {archs[:1] or cfg.model_type} to check the weights ({exc}); "
                      f"exported without that check")
        return
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    tied = set()
    for k in (getattr(model, "_tied_weights_keys", None) or []):
        tied.update(n for n in expected if re.fullmatch(k, n) or n == k)
    got = {t.name: t.shape for t in tensors}
    missing = sorted(set(expected) - set(got) - tied)
    extra = sorted(set(got) - set(expected))
    shapes = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:5])}")
        if extra:
            parts.append(f"not in the model {len(extra)}: {', '.join(extra[:5])}")
        if shapes:
            parts.append("other shapes: " + ", ".join(f"{n} {got[n]} vs {expected[n]}" for n in shapes[:5]))
        raise StateMismatchError(f"{config}: the weights do not match the {type(model).__name__} its "
                                 f"config.json describes ({'; '.join(parts)}); check --key, --strip, "
                                 f"--prefix or --config", path=config)


def _copy_config(config: str, tmp: str, out_dtype: Optional[torch.dtype]) -> List[str]:
    copied = []
    for name in CONFIG_FILES:
        path = os.path.join(config, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(tmp, name))
            copied.append(name)
    if out_dtype is not None:
        path = os.path.join(tmp, "config.json")
        with open(path) as fh:
            cfg = json.load(fh)
        cfg["torch_dtype"] = str(out_dtype).replace("torch.", "")
        _write_json(path, cfg)
    return copied


def _write_json(path: str, value: Any) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _install(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Rename the finished directory into place (replacing ``out_dir`` only if asked)."""
    old = None
    if os.path.lexists(out_dir):
        if not overwrite:
            raise CheckpointError(f"{out_dir}: appeared while exporting", path=out_dir)
        old = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.old-{new_token()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(os.path.dirname(out_dir))
    if old is not None:
        remove_tree(old)


# --------------------------------------------------------------------------- import


@dataclass
class ImportResult:
    src: str
    out: str
    files: List[str]
    tensors: int
    tensor_bytes: int
    file_bytes: int
    seconds: float


def hf_weight_files(hf_dir: str) -> List[Tuple[str, List[str]]]:
    """The safetensors files of a Hugging Face model directory with the names
    each one must hold (from the index), checked against the files' headers."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(hf_dir) and hf_dir.endswith(".safetensors"):
        return [(hf_dir, _header_names(hf_dir))]
    if not os.path.isdir(hf_dir):
        raise CheckpointNotFoundError(f"{hf_dir}: no such directory", path=hf_dir)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as fh:
                weight_map = json.load(fh)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc})", path=index_path) from None
        files: Dict[str, List[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or os.path.basename(fname) != fname:
                raise CheckpointError(f"{index_path}: {name} maps to a bad file name {fname!r}", path=index_path)
            files.setdefault(fname, []).append(name)
        out = []
        for fname, names in files.items():
            path = os.path.join(hf_dir, fname)
            if not os.path.isfile(path):
                raise CheckpointNotFoundError(f"{path}: listed in {INDEX_FILE} but missing", path=path)
            held = set(_header_names(path))
            lacking = [n for n in names if n not in held]
            if lacking:
                raise CheckpointError(f"{path}: lacks {len(lacking)} tensor(s) the index puts there: "
                                      f"{', '.join(lacking[:5])}", path=path)
            out.append((path, names))
        return out
    if os.path.isfile(single):
        return [(single, _header_names(single))]
    raise CheckpointNotFoundError(f"{hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                                  f"model directories are read)", path=hf_dir)


def _header_names(path: str) -> List[str]:
    header, _ = read_safetensors_header(path)
    return [n for n in header if n != "__metadata__"]


def import_hf(hf_dir: str, out: str, *, key: Optional[str] = None, overwrite: bool = False,
              **knobs: Any) -> ImportResult:
    """Write the weights of a Hugging Face model directory (one safetensors file
    or sharded) as one lazyckpt file holding ``{name: tensor}`` (nested under
    ``key`` if given). The shards are memory-mapped: nothing is copied in
    memory beyond the host cache lazyckpt.save writes through. ``knobs`` go to
    ``lazyckpt.save`` (``chunk_bytes`` is also the checksum block: the unit a
    rank loading only its rows reads)."""
    t0 = time.perf_counter()
    out = os.path.abspath(os.fspath(out))
    if os.path.isdir(out):
        raise CheckpointError(f"{out}: is a directory; give a file name", path=out)
    if os.path.lexists(out) and not overwrite:
        raise CheckpointError(f"{out}: already exists (pass overwrite=True / --force to replace it)", path=out)
    files = hf_weight_files(hf_dir)
    state: Dict[str, torch.Tensor] = {}
    for path, names in files:
        tensors = SafetensorsSource(path, allow_pickle=False).state()
        for n in names:
            if n in state:
                raise CheckpointError(f"{hf_dir}: tensor {n} is in two files", path=hf_dir)
            state[n] = tensors[n]
    nested: Any = state
    for k in reversed(_split_key(key) or ()):
        nested = {k: nested}
    size = api.save(nested, out, metadata={"imported_from": "huggingface",
                                           "files": [os.path.basename(p) for p, _ in files]}, **knobs)
    return ImportResult(os.path.abspath(hf_dir), out, [os.path.basename(p) for p, _ in files], len(state),
                        sum(t.numel() * t.element_size() for t in state.values()), size,
                        time.perf_counter() - t0)

