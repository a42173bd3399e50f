"""The Checkpointer's options, in groups.

``Checkpointer(directory, *, keep, host_cache_bytes, interval, preemption,
persist, replicas, incremental, distributed, io)``: what is used together is
given together, so a combination that cannot apply (a persistent tier's
retention without a persistent tier, a replica bandwidth without replicas)
cannot be written. Each group is a frozen dataclass, validated when it is
made: a bad value raises ``ValueError`` naming the field.

A field that a ``LAZYCKPT_<NAME>`` variable can set defaults to ``None``: the
variable when set (a site default), else the library default the field's
comment gives. An argument beats the variable, which beats the default.

:func:`settle` turns the constructor's arguments -- and, for one more
release, the flat spellings they replace (``keep_last=``, ``persist_to=``,
``writer_threads=``, ...), each with a ``DeprecationWarning`` naming its new
spelling -- into one :class:`Groups` value that the builder assembles.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from lazyckpt.storage.stores import for_path
from .knobs import Options, normalize_options, parse_duration, resolve
from .retention import Policy, as_policy
from .preemption import as_preemption
from .schedule import as_interval
from .sizes import parse_size

__all__ = ["Persist", "Replicas", "Incremental", "Distributed", "IO", "Groups", "settle", "DEPRECATED",
           "LazyckptDeprecationWarning"]


class LazyckptDeprecationWarning(DeprecationWarning):
    """A spelling of lazyckpt's own that still works for one more release (an old
    keyword, attribute, module path or CLI command): the message names the new
    one. Its own class, so a test suite can make exactly these an error
    (``filterwarnings = error::lazyckpt.options.LazyckptDeprecationWarning``)
    without failing on other libraries' deprecations."""


def _int(name: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _bool(name: str, value: Any) -> None:
    if type(value) is not bool:
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _duration(name: str, value: Any) -> float:
    if type(value) is bool:
        raise ValueError(f"{name} must be a duration (seconds, or a string such as '10min'), got {value!r}")
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _storage_options(name: str, value: Any) -> Optional[Tuple[Tuple[str, Any], ...]]:
    if value is None:
        return None
    if not isinstance(value, (dict, tuple, list)):
        raise ValueError(f"{name} must be a dict of object store settings, got {type(value).__name__}")
    try:
        return normalize_options(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None


@dataclass(frozen=True)
class Persist:
    """A persistent tier: committed steps are drained in the background to the
    object store at ``url`` (``s3://bucket/prefix``); the directory stays the
    local, fast tier.

    ``keep``: the persistent tier's retention (None: every step; an int: the
    last n; a retention policy). ``bandwidth``: upload cap in bytes/s, an int
    or a string such as ``"100MB"`` (None: ``LAZYCKPT_PERSIST_BANDWIDTH``,
    else 0 = no cap). ``storage_options``: the store's settings (endpoint,
    credentials; ``lazyckpt.knobs.OPTION_KEYS``), else those of ``io=``, else
    the standard AWS configuration."""
    url: str
    keep: Any = None
    bandwidth: Any = None
    #: Normalized to a sorted tuple of (key, value); never shown (it may hold credentials).
    storage_options: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            url = os.fspath(self.url)
        except TypeError:
            raise ValueError(f"Persist.url must be an object store URL such as 's3://bucket/run', "
                             f"got {self.url!r}") from None
        if not isinstance(url, str) or not for_path(url).is_remote:
            raise ValueError(f"Persist.url must be an object store URL such as 's3://bucket/run' (the directory "
                             f"is the local tier), got {self.url!r}")
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "keep", as_policy(self.keep, "Persist.keep"))
        if self.bandwidth is not None:
            object.__setattr__(self, "bandwidth", parse_size(self.bandwidth, "Persist.bandwidth"))
        object.__setattr__(self, "storage_options", _storage_options("Persist.storage_options",
                                                                     self.storage_options))


@dataclass(frozen=True)
class Replicas:
    """Copies of each committed step on the next ``k`` nodes, so the loss of a
    node loses no step (the directory must be node-local).

    ``node_size``: ranks per node (None: ``LAZYCKPT_NODE_SIZE``,
    ``LOCAL_WORLD_SIZE``, else found from host names). ``bandwidth``: transfer
    cap in bytes/s, an int or a string such as ``"1GB"`` (0: no cap)."""
    k: int = 1
    node_size: Optional[int] = None
    bandwidth: Any = 0

    def __post_init__(self) -> None:
        _int("Replicas.k", self.k, 1)
        if self.node_size is not None:
            _int("Replicas.node_size", self.node_size, 1)
        object.__setattr__(self, "bandwidth", parse_size(self.bandwidth, "Replicas.bandwidth"))


#: The modes of incremental checkpoints ("version" is the old name of "version-counters").
_MODES = {"content": "content", "version-counters": "version-counters", "version": "version-counters"}


@dataclass(frozen=True)
class Incremental:
    """Incremental checkpoints: a tensor unchanged since the previous committed
    step is referenced, not written again.

    ``mode``: ``"content"`` (compares the bytes; sound for every writer) or
    ``"version-counters"`` (trusts torch's version counters, which fused
    optimizers and more do not bump: opt-in). ``full_every``: every n-th save
    writes everything, bounding how far back references reach (None:
    ``LAZYCKPT_FULL_EVERY``, else 0 = only the first)."""
    mode: str = "content"
    full_every: Optional[int] = None

    def __post_init__(self) -> None:
        mode = _MODES.get(self.mode) if isinstance(self.mode, str) else None
        if mode is None:
            raise ValueError(f"Incremental.mode must be 'content' or 'version-counters', got {self.mode!r}")
        object.__setattr__(self, "mode", mode)
        if self.full_every is not None:
            _int("Incremental.full_every", self.full_every, 0)


@dataclass(frozen=True)
class Distributed:
    """How the Checkpointer works under torch.distributed.

    ``process_group``: the group whose ranks commit each step together (None:
    the default group when initialized; False: this process alone).
    ``identical_keys``: top-level keys whose values are identical on every rank
    (DDP), written once; ``"auto"`` finds them by content (None: a warning names
    any it finds). ``commit_timeout``: how long a commit waits for a dead rank
    (seconds, or a string such as ``"10min"``). ``takeover``: take the
    directory's writer lease from another live Checkpointer."""
    process_group: Any = None
    identical_keys: Any = None
    commit_timeout: Any = 600.0
    takeover: bool = False

    def __post_init__(self) -> None:
        keys = self.identical_keys
        if isinstance(keys, str):
            if keys != "auto":
                raise ValueError(f"Distributed.identical_keys must be a list of top-level keys or 'auto', "
                                 f"got {keys!r}")
        elif keys is not None:
            if not isinstance(keys, (list, tuple, set, frozenset)):
                raise ValueError(f"Distributed.identical_keys must be a list of top-level keys or 'auto', "
                                 f"got {type(keys).__name__}")
            object.__setattr__(self, "identical_keys", tuple(keys))
        object.__setattr__(self, "commit_timeout", _duration("Distributed.commit_timeout", self.commit_timeout))
        _bool("Distributed.takeover", self.takeover)


_O_DIRECT = {True: True, False: False, "auto": "auto", "1": True, "true": True, "yes": True, "on": True,
             "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True)
class IO:
    """How checkpoints are written and read. Every field but ``guard_buffers``
    defaults to None: ``LAZYCKPT_<FIELD>`` when set, else the default named.

    ``writer_threads``, ``reader_threads`` (4 each; reads under 1 MiB, such as a
    ``keys=`` selection of small tensors, go 4 x ``reader_threads`` at a time). ``o_direct``: True, False
    or "auto" (each transfer in whichever mode measured faster; default).
    ``chunk_bytes``: the unit of copy, write and checksum, a multiple of 4096
    ("32M"). ``verify_checksums`` (True). ``max_footer_bytes``: a reader refuses
    a larger footer ("256M"). ``max_pending_saves``: saves that may wait behind
    the one in flight (2). ``when_full``: what save() does when they are all
    taken, "block" (default) or "skip" (warns). ``at_exit``: pending saves at
    interpreter exit, "drain" (default) or "warn" (cancel them, naming them).
    ``lease_expiry``: when an interrupted save's leftovers may be removed
    ("60s"; LAZYCKPT_LEASE_EXPIRY or LAZYCKPT_LEASE_EXPIRY_S). ``guard_buffers``:
    a training-mode forward of a module whose persistent buffers are being
    captured (BatchNorm) waits for the capture (True). ``storage_options``: an
    ``s3://`` directory's store settings (and a Persist tier's, unless it has
    its own; LAZYCKPT_STORAGE_OPTIONS as JSON)."""
    writer_threads: Optional[int] = None
    reader_threads: Optional[int] = None
    o_direct: Any = None
    chunk_bytes: Any = None
    verify_checksums: Optional[bool] = None
    max_footer_bytes: Any = None
    max_pending_saves: Optional[int] = None
    when_full: Optional[str] = None
    at_exit: Optional[str] = None
    lease_expiry: Any = None
    guard_buffers: bool = True
    storage_options: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("writer_threads", "reader_threads", "max_pending_saves"):
            if getattr(self, name) is not None:
                _int(f"IO.{name}", getattr(self, name), 1)
        if self.o_direct is not None:
            key = self.o_direct.strip().lower() if isinstance(self.o_direct, str) else self.o_direct
            if type(key) not in (bool, str) or key not in _O_DIRECT:
                raise ValueError(f"IO.o_direct must be True, False or 'auto', got {self.o_direct!r}")
            object.__setattr__(self, "o_direct", _O_DIRECT[key])
        if self.chunk_bytes is not None:
            chunk = parse_size(self.chunk_bytes, "IO.chunk_bytes", minimum=4096)
            if chunk % 4096:
                raise ValueError(f"IO.chunk_bytes must be a multiple of 4096, got {self.chunk_bytes!r}")
            object.__setattr__(self, "chunk_bytes", chunk)
        if self.max_footer_bytes is not None:
            object.__setattr__(self, "max_footer_bytes",
                               parse_size(self.max_footer_bytes, "IO.max_footer_bytes", minimum=1))
        if self.verify_checksums is not None:
            _bool("IO.verify_checksums", self.verify_checksums)
        for name, allowed in (("when_full", ("block", "skip")), ("at_exit", ("drain", "warn"))):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise ValueError(f"IO.{name} must be {allowed[0]!r} or {allowed[1]!r}, got {getattr(self, name)!r}")
        if self.lease_expiry is not None:
            object.__setattr__(self, "lease_expiry", _duration("IO.lease_expiry", self.lease_expiry))
        _bool("IO.guard_buffers", self.guard_buffers)
        object.__setattr__(self, "storage_options", _storage_options("IO.storage_options", self.storage_options))


# --------------------------------------------------------------------------- the constructor's arguments


@dataclass(frozen=True)
class Groups:
    """A Checkpointer's arguments, checked and in their groups: what
    :func:`lazyckpt.builder.assemble` builds from. ``options`` and
    ``advise_mtbf`` carry the deprecated ``options=`` and ``advise_mtbf=``."""
    keep: Optional[Policy] = None
    host_cache_bytes: Optional[int] = None
    interval: Any = None
    preemption: Any = False
    persist: Optional[Persist] = None
    replicas: Optional[Replicas] = None
    incremental: Optional[Incremental] = None
    distributed: Distributed = Distributed()
    io: IO = IO()
    options: Optional[Options] = None
    advise_mtbf: Any = None


#: The Checkpointer's named parameters, in order.
PARAMETERS = ("directory", "keep", "host_cache_bytes", "interval", "preemption", "persist", "replicas",
              "incremental", "distributed", "io")

#: Each flat spelling of the previous release: (its group, its field there, the new spelling).
DEPRECATED: Dict[str, Tuple[str, str, str]] = {
    "keep_last": ("keep", "", "keep={value}"),
    "persist_to": ("persist", "url", "persist=lazyckpt.Persist(url, ...)"),
    "persist_keep_last": ("persist", "keep", "persist=lazyckpt.Persist(url, keep={value})"),
    "persist_bandwidth": ("persist", "bandwidth", "persist=lazyckpt.Persist(url, bandwidth={value})"),
    "storage_options": ("io", "storage_options", "persist=lazyckpt.Persist(url, storage_options={{...}}), or for "
                                                 "an s3:// directory io=lazyckpt.IO(storage_options={{...}})"),
    "node_size": ("replicas", "node_size", "replicas=lazyckpt.Replicas(k, node_size={value})"),
    "replica_bandwidth": ("replicas", "bandwidth", "replicas=lazyckpt.Replicas(k, bandwidth={value})"),
    "replicated": ("distributed", "identical_keys", "distributed=lazyckpt.Distributed(identical_keys={value})"),
    "process_group": ("distributed", "process_group", "distributed=lazyckpt.Distributed(process_group=...)"),
    "commit_timeout_s": ("distributed", "commit_timeout", "distributed=lazyckpt.Distributed(commit_timeout={value})"),
    "takeover": ("distributed", "takeover", "distributed=lazyckpt.Distributed(takeover={value})"),
    "full_every": ("incremental", "full_every", "incremental=lazyckpt.Incremental(full_every={value})"),
    "advise_mtbf": ("interval", "", "interval=lazyckpt.Auto(mtbf={value})"),
    "options": ("io", "", "the option groups: io=lazyckpt.IO(...), host_cache_bytes=, "
                          "incremental=lazyckpt.Incremental(...), persist=lazyckpt.Persist(url, bandwidth=...)"),
    "queue_policy": ("io", "when_full", "io=lazyckpt.IO(when_full={value})"),
    "exit_policy": ("io", "at_exit", "io=lazyckpt.IO(at_exit={value})"),
    "lease_expiry_s": ("io", "lease_expiry", "io=lazyckpt.IO(lease_expiry={value})"),
    **{name: ("io", name, f"io=lazyckpt.IO({name}={{value}})")
       for name in ("guard_buffers", "writer_threads", "reader_threads", "o_direct", "chunk_bytes",
                    "verify_checksums", "max_footer_bytes", "max_pending_saves")},
}

#: What each group's fields are called, for the suggestion after a misspelled keyword.
_FIELD_SPELLINGS = {
    **{f.name: f"io=lazyckpt.IO({f.name}=...)" for f in dataclasses.fields(IO)},
    **{f"persist_{f.name}": f"persist=lazyckpt.Persist(url, {f.name}=...)" for f in dataclasses.fields(Persist)
       if f.name != "url"},
    **{f"replica_{f.name}": f"replicas=lazyckpt.Replicas(k, {f.name}=...)" for f in dataclasses.fields(Replicas)
       if f.name != "k"},
    "persist_url": "persist=lazyckpt.Persist(url)",
    "identical_keys": "distributed=lazyckpt.Distributed(identical_keys=...)",
    "commit_timeout": "distributed=lazyckpt.Distributed(commit_timeout=...)",
    "mode": "incremental=lazyckpt.Incremental(mode=...)",
    "mtbf": "interval=lazyckpt.Auto(mtbf=...)",
}


def _unknown(name: str) -> TypeError:
    spellings = {**_FIELD_SPELLINGS, **{old: new.format(value="...") for old, (_g, _f, new) in DEPRECATED.items()},
                 **{p: f"{p}=" for p in PARAMETERS}}
    close = difflib.get_close_matches(name, list(spellings), n=1, cutoff=0.6)
    hint = f" (did you mean {spellings[close[0]]}?)" if close else ""
    return TypeError(f"Checkpointer() got an unexpected keyword argument {name!r}{hint}; its parameters are "
                     f"{', '.join(PARAMETERS)} (the rest live in the groups lazyckpt.Persist, Replicas, "
                     f"Incremental, Distributed and IO)")


def _shown(name: str, value: Any) -> str:
    return "{...}" if name == "storage_options" else repr(value)      # it may hold credentials


def settle(*, keep: Any = None, host_cache_bytes: Any = None, interval: Any = None,
           preemption: Any = False, persist: Any = None, replicas: Any = None, incremental: Any = False,
           distributed: Any = None, io: Any = None, deprecated: Dict[str, Any], stacklevel: int = 3) -> Groups:
    """The Checkpointer's arguments as one checked :class:`Groups`. Each old flat
    spelling in ``deprecated`` warns once (at ``stacklevel``: the user's call),
    naming its new spelling; an old spelling together with its new one, or any
    other keyword, is a ``TypeError``."""
    for name in deprecated:
        if name not in DEPRECATED:
            raise _unknown(name)
    given = {"keep": keep is not None, "persist": persist is not None, "distributed": distributed is not None,
             "io": io is not None, "interval": interval is not None,
             "incremental": isinstance(incremental, Incremental),
             "replicas": isinstance(replicas, Replicas)}
    for name, value in deprecated.items():
        group, _field, new = DEPRECATED[name]
        spelling = new.format(value=_shown(name, value))
        if given.get(group):
            raise TypeError(f"{name}= and {group}= were both given: {name}= is the old spelling; pass "
                            f"{spelling} only")
        warnings.warn(f"{name}={_shown(name, value) if '{value}' in new else ''} is deprecated: use {spelling}",
                      LazyckptDeprecationWarning, stacklevel=stacklevel)
    old = deprecated

    # The retention, the host cache.
    keep = as_policy(old.get("keep_last") if "keep_last" in old else keep,
                     "keep_last" if "keep_last" in old else "keep")
    if host_cache_bytes is not None:
        host_cache_bytes = parse_size(host_cache_bytes, "host_cache_bytes")
        if host_cache_bytes and host_cache_bytes < 2 * 4096:
            raise ValueError(f"host_cache_bytes must be 0 (auto) or at least 8192, got {host_cache_bytes}")

    # The persistent tier.
    if "persist_to" in old and old["persist_to"] is not None:
        persist = old["persist_to"]
    if isinstance(persist, (str, os.PathLike)):
        persist = Persist(persist)
    elif persist is not None and not isinstance(persist, Persist):
        raise TypeError(f"persist must be None, an object store URL or lazyckpt.Persist(url, ...), "
                        f"got {type(persist).__name__}")
    for name, field_name, unset in (("persist_keep_last", "keep", (None,)),
                                    ("persist_bandwidth", "bandwidth", (None, 0, 0.0))):
        if name in old and old[name] not in unset:
            if persist is None:
                raise ValueError(f"{name}={old[name]!r} does not apply here: it is the persistent tier's, and no "
                                 f"persistent tier was given; use persist=lazyckpt.Persist(url, "
                                 f"{field_name}={old[name]!r})")
            persist = dataclasses.replace(persist, **{field_name: old[name]})

    # Replicas.
    if type(replicas) is int:
        if replicas < 0:
            raise ValueError(f"replicas must be an int >= 0 or lazyckpt.Replicas(k, ...), got {replicas}")
        replicas = Replicas(replicas) if replicas else None
    elif replicas is not None and not isinstance(replicas, Replicas):
        raise TypeError(f"replicas must be None, an int or lazyckpt.Replicas(k, ...), got {type(replicas).__name__}")
    for name, field_name, unset in (("node_size", "node_size", (None,)),
                                    ("replica_bandwidth", "bandwidth", (None, 0, 0.0))):
        if name in old and old[name] not in unset:
            if replicas is None:
                raise ValueError(f"{name}={old[name]!r} does not apply here: it is the replicas', and "
                                 f"replicas=0; use replicas=lazyckpt.Replicas(k, {field_name}={old[name]!r})")
            replicas = dataclasses.replace(replicas, **{field_name: old[name]})

    # Incremental checkpoints. False leaves LAZYCKPT_INCREMENTAL (a site default) its say.
    if incremental is True:
        incremental = Incremental()
    elif incremental in (False, None, "off"):
        incremental = None
    elif isinstance(incremental, str):
        if incremental not in _MODES:
            raise ValueError(f"incremental must be False, True (= 'content'), 'content', 'version-counters' or "
                             f"lazyckpt.Incremental(mode, full_every=...), got {incremental!r}")
        incremental = Incremental(incremental)
    elif not isinstance(incremental, Incremental):
        raise TypeError(f"incremental must be a bool, a mode or lazyckpt.Incremental(...), "
                        f"got {type(incremental).__name__}")
    if old.get("full_every") not in (None, 0):
        if incremental is None:
            raise ValueError(f"full_every={old['full_every']!r} does not apply here: it spaces the full saves of "
                             f"incremental checkpoints, and incremental is off; use "
                             f"incremental=lazyckpt.Incremental(full_every={old['full_every']!r})")
        incremental = dataclasses.replace(incremental, full_every=old["full_every"])

    # Distributed.
    if distributed is None:
        moved = {"process_group": "process_group", "replicated": "identical_keys",
                 "commit_timeout_s": "commit_timeout", "takeover": "takeover"}
        distributed = Distributed(**{moved[k]: v for k, v in old.items() if k in moved})
    elif not isinstance(distributed, Distributed):
        raise TypeError(f"distributed must be None or lazyckpt.Distributed(...), got {type(distributed).__name__}")

    # I/O.
    if io is None:
        renamed = {"queue_policy": "when_full", "exit_policy": "at_exit", "lease_expiry_s": "lease_expiry"}
        fields = {f.name for f in dataclasses.fields(IO)}
        io = IO(**{renamed.get(k, k): v for k, v in old.items() if renamed.get(k, k) in fields})
    elif not isinstance(io, IO):
        raise TypeError(f"io must be None or lazyckpt.IO(...), got {type(io).__name__}")
    options = old.get("options")
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be a lazyckpt.Options, got {type(options).__name__}")
    # Checked here, before the directory is opened (the schedule installs its handlers last).
    return Groups(keep=keep, host_cache_bytes=host_cache_bytes, interval=as_interval(interval),
                  preemption=as_preemption(preemption), persist=persist, replicas=replicas, incremental=incremental,
                  distributed=distributed, io=io,
                  options=options, advise_mtbf=old.get("advise_mtbf"))


def resolved_options(groups: Groups) -> Options:
    """The internal flat :class:`lazyckpt.knobs.Options` of ``groups``: each field
    from its argument, else the deprecated ``options=`` value, else its
    ``LAZYCKPT_*`` variable, else the default (``knobs.resolve``)."""
    io, persist, inc = groups.io, groups.persist, groups.incremental
    return resolve(groups.options, host_cache_bytes=groups.host_cache_bytes,
                   writer_threads=io.writer_threads, reader_threads=io.reader_threads, o_direct=io.o_direct,
                   chunk_bytes=io.chunk_bytes, verify_checksums=io.verify_checksums,
                   max_footer_bytes=io.max_footer_bytes, max_pending_saves=io.max_pending_saves,
                   queue_policy=io.when_full, exit_policy=io.at_exit, lease_expiry_s=io.lease_expiry,
                   storage_options=io.storage_options,
                   incremental=inc.mode if inc is not None else None,
                   full_every=inc.full_every if inc is not None else None,
                   persist_bandwidth=persist.bandwidth if persist is not None else None,
                   advise_mtbf=groups.advise_mtbf)
