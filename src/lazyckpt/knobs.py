"""All tunables in one place.

Precedence: an explicit argument, then an environment variable
(``LAZYCKPT_<NAME>``), then the default below. Tests flip these to run each
code path (O_DIRECT on/off, one writer thread or several).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Dict, Optional, Tuple, Union

from .sizes import parse_size as parse_size_of

MiB = 1 << 20
#: "content" (True) compares the bytes; "version-counters" trusts torch's version
#: counters, which many in-place writers do not bump (lazyckpt/saving/incremental.py).
INCREMENTAL_MODES = ("off", "content", "version-counters")
#: Bounds of the automatically sized host cache.
AUTO_CACHE_MIN = 64 * MiB
AUTO_CACHE_MAX = 4096 * MiB


#: storage_options keys the object store understands (besides these, nothing: a typo is an error).
OPTION_KEYS = ("endpoint_url", "access_key_id", "secret_access_key", "session_token", "region",
               "profile", "max_attempts", "connect_timeout", "read_timeout", "max_pool_connections",
               "addressing_style", "checksums")


def normalize_options(storage_options: Any) -> Tuple[Tuple[str, Any], ...]:
    """``storage_options`` as a sorted tuple (hashable, for Options), checked."""
    if storage_options is None or storage_options == ():
        return ()
    if isinstance(storage_options, str):        # LAZYCKPT_STORAGE_OPTIONS='{"endpoint_url": ...}'
        storage_options = json.loads(storage_options)
    items = dict(storage_options)
    unknown = sorted(set(items) - set(OPTION_KEYS))
    if unknown:
        raise ValueError(f"unknown storage_options {unknown}; known: {list(OPTION_KEYS)}")
    return tuple(sorted(items.items()))


@dataclasses.dataclass(frozen=True)
class Options:
    #: Threads that write host-cache chunks to disk.
    writer_threads: int = 4
    #: Threads that read entries on load.
    reader_threads: int = 4
    #: O_DIRECT (True), buffered I/O (False), or "auto": each read and write
    #: in whichever mode recent transfers on its file system measured faster
    #: (see lazyckpt/storage/iomode.py). O_DIRECT falls back to buffered where refused.
    o_direct: Union[bool, str] = "auto"
    #: Size of one host-cache chunk: the unit of copy, write and checksum.
    chunk_bytes: int = 32 * MiB
    #: A load of some entries (``keys=``, ``into=``) reads a gap between two of
    #: them up to this size through, in the same request, rather than issuing
    #: one request per entry (0: never; see docs/ARCHITECTURE.md, "the load path").
    read_through_bytes: int = 256 * 1024
    #: Size of the reused host cache that stages data on its way to disk. 0 (the
    #: default) sizes it once, at the first save, to that state's bytes clamped to
    #: [AUTO_CACHE_MIN, AUTO_CACHE_MAX] and a quarter of the machine's memory: a
    #: cache that holds the whole state lets the capture finish at memory speed.
    host_cache_bytes: int = 0
    #: Verify per-block checksums when loading.
    verify_checksums: bool = True
    #: A reader refuses a footer larger than this (hostile-file guard).
    max_footer_bytes: int = 256 * MiB
    #: Saves that may wait in the queue behind the one in flight (so at most
    #: max_pending_saves + 1 checkpoints are pending at once).
    max_pending_saves: int = 2
    #: What save() does when the queue is full: "block" or "skip" (warns).
    queue_policy: str = "block"
    #: What happens to saves still pending when the interpreter exits: "drain"
    #: (wait until they are committed) or "warn" (cancel them and warn, naming them).
    exit_policy: str = "drain"
    #: Incremental checkpoints (Checkpointer): "off", "content" (True: a tensor
    #: whose bytes hash to the previous committed step's block checksums is
    #: referenced, not written; sound for every writer) or "version-counters"
    #: (opt-in, free, but misses every writer that does not bump torch's
    #: version counter -- fused optimizers, BatchNorm statistics, collectives,
    #: .data, numpy views -- and then saves stale bytes; "version" is its old
    #: name). See lazyckpt/saving/incremental.py.
    incremental: str = "off"
    #: With incremental checkpoints, every full_every-th save writes everything
    #: (0: only the first), bounding how far back references reach.
    full_every: int = 0
    #: A temporary file whose lease is unlocked and whose heartbeat is older than
    #: this (seconds) is an interrupted save and may be removed. Saves refresh
    #: their heartbeat every twelfth of it. Must exceed the clock skew between
    #: hosts that share the file system.
    lease_expiry_s: float = 60.0
    #: Object stores (s3:// paths, persist_to=): overrides of the standard AWS
    #: configuration (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    #: AWS_REGION, profiles), as a dict; OPTION_KEYS above names the keys.
    #: LAZYCKPT_STORAGE_OPTIONS takes it as JSON.
    storage_options: Any = ()
    #: Upload bandwidth cap of the persistent tier's background drain, bytes/s
    #: (0: none), so that draining does not starve the training's own traffic.
    persist_bandwidth: float = 0.0
    #: The job's mean time between failures ("8h"; a number is seconds; "" or 0: none).
    #: With it, a Checkpointer logs (INFO, logger "lazyckpt") the checkpoint interval
    #: that minimises the expected lost time, once it has measured a few saves
    #: (lazyckpt/cli/advise.py; ``lazyckpt advise`` gives the same from the manifests).
    advise_mtbf: Any = ""

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            object.__setattr__(self, name, parse_size_of(getattr(self, name), name))
        if isinstance(self.lease_expiry_s, str):
            object.__setattr__(self, "lease_expiry_s", _duration_of(self.lease_expiry_s, "lease_expiry_s"))
        for name in ("writer_threads", "reader_threads", "max_pending_saves"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {self.chunk_bytes}")
        if self.read_through_bytes < 0:
            raise ValueError(f"read_through_bytes must be >= 0 (0: never read a gap), got {self.read_through_bytes}")
        if self.host_cache_bytes != 0 and self.host_cache_bytes < 2 * 4096:
            raise ValueError(f"host_cache_bytes must be 0 (auto) or at least 8192, "
                             f"got {self.host_cache_bytes}")
        o_direct = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                    "off": False, "auto": "auto"}.get(
            self.o_direct.strip().lower() if isinstance(self.o_direct, str) else None, self.o_direct)
        if o_direct not in (True, False, "auto"):
            raise ValueError(f"o_direct must be True, False or 'auto', got {self.o_direct!r}")
        object.__setattr__(self, "o_direct", o_direct)
        if self.queue_policy not in ("block", "skip"):
            raise ValueError(f"queue_policy must be 'block' or 'skip', got {self.queue_policy!r}")
        if self.exit_policy not in ("drain", "warn"):
            raise ValueError(f"exit_policy must be 'drain' or 'warn', got {self.exit_policy!r}")
        # True means content digests: version counters miss writes, so they
        # are only ever chosen by name ("version" is the name they had before).
        mode = {True: "content", False: "off", None: "off", "1": "content", "true": "content", "yes": "content",
                "on": "content", "0": "off", "false": "off", "no": "off", "version": "version-counters"}.get(
            self.incremental.lower() if isinstance(self.incremental, str) else self.incremental, self.incremental)
        if mode not in INCREMENTAL_MODES:
            raise ValueError(f"incremental must be True (= 'content'), False or one of {INCREMENTAL_MODES}, "
                             f"got {self.incremental!r}")
        object.__setattr__(self, "incremental", mode)
        if type(self.full_every) is not int or self.full_every < 0:
            raise ValueError(f"full_every must be an int >= 0, got {self.full_every!r}")
        if not self.lease_expiry_s > 0:
            raise ValueError(f"lease_expiry_s must be > 0, got {self.lease_expiry_s}")
        object.__setattr__(self, "storage_options", normalize_options(self.storage_options))
        if not self.persist_bandwidth >= 0:
            raise ValueError(f"persist_bandwidth must be >= 0 (bytes/s, 0: no cap), got {self.persist_bandwidth}")
        if self.advise_mtbf not in ("", None, 0, 0.0):
            try:
                object.__setattr__(self, "advise_mtbf", parse_duration(self.advise_mtbf))
            except ValueError as exc:
                raise ValueError(f"advise_mtbf: {exc}") from None
        else:
            object.__setattr__(self, "advise_mtbf", 0.0)

    @property
    def lease_heartbeat_s(self) -> float:
        return self.lease_expiry_s / 12

    def cache_bytes_for(self, state_bytes: int) -> int:
        """The host cache size to allocate, given the first state saved."""
        if self.host_cache_bytes:
            return self.host_cache_bytes
        try:
            quarter_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        except (ValueError, OSError, AttributeError):
            quarter_ram = AUTO_CACHE_MAX
        wanted = max(AUTO_CACHE_MIN, min(state_bytes, AUTO_CACHE_MAX, quarter_ram))
        return -(-wanted // self.chunk_bytes) * self.chunk_bytes

    def chunk_bytes_for(self, cache_bytes: int) -> int:
        """The chunk size actually used: at most half the cache, so two chunks
        are always in flight (one being copied while the other is written)."""
        half = (cache_bytes // 2) // 4096 * 4096
        return max(4096, min(self.chunk_bytes, half))


_FIELDS = {f.name for f in dataclasses.fields(Options)}


#: Options fields that are sizes: an int, or a string with a unit (lazyckpt/sizes.py).
SIZE_FIELDS = ("host_cache_bytes", "chunk_bytes", "read_through_bytes", "max_footer_bytes", "persist_bandwidth")
#: A field's variable is LAZYCKPT_<FIELD>; these fields also take the name of
#: their option group's field (lazyckpt/options.py IO), which wins when both are set.
ENV_ALIASES = {"queue_policy": "WHEN_FULL", "exit_policy": "AT_EXIT", "lease_expiry_s": "LEASE_EXPIRY"}


def _duration_of(value: Any, name: str) -> float:
    try:
        return float(value)          # a bare number is seconds, as it always was here
    except ValueError:
        pass
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _env_value(name: str, default: Any) -> Any:
    variable = "LAZYCKPT_" + name.upper()
    if name in ENV_ALIASES and "LAZYCKPT_" + ENV_ALIASES[name] in os.environ:
        variable = "LAZYCKPT_" + ENV_ALIASES[name]
    raw = os.environ.get(variable)
    if raw is None:
        return default
    if name in SIZE_FIELDS:
        return parse_size_of(raw, variable)
    if name == "lease_expiry_s":
        return _duration_of(raw, variable)
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


def resolve(options: Optional[Options] = None, **overrides: Any) -> Options:
    """Build Options: keyword overrides > ``options`` > environment > defaults."""
    values = {}
    for field in dataclasses.fields(Options):
        value = overrides.get(field.name)
        if value is None:
            if options is not None:
                value = getattr(options, field.name)
            else:
                value = _env_value(field.name, field.default)
        values[field.name] = value
    unknown = set(overrides) - _FIELDS
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    return Options(**values)


def resolve_for(integration: str, refused: Dict[str, str], **knobs: Any) -> Options:
    """Options for an integration, refusing, with the reason, every knob it
    would accept and then ignore. ``refused`` maps a knob (an Options field or a
    Checkpointer argument) to why this integration cannot act on it. A refused
    Options field given its default value ("off", 0) asks for nothing, and passes."""
    defaults = Options()
    for name, why in refused.items():
        if name not in knobs or knobs[name] is None:
            continue
        if hasattr(defaults, name) and getattr(resolve(None, **{name: knobs[name]}), name) == \
                getattr(defaults, name):
            continue
        raise ValueError(f"{integration}: {name}={knobs[name]!r} is not supported: {why}")
    return resolve(None, **{k: v for k, v in knobs.items() if not (k in refused and k not in _FIELDS)})


def parse_size(text: Any, name: str = "size") -> int:
    """'256M', '1.5GiB', '4096' -> bytes, at least 1 (lazyckpt.sizes.parse_size:
    a unit alone or with iB is binary, with B alone decimal: '5GB' is 5e9)."""
    return parse_size_of(text, name, minimum=1)


_UNITS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "mins": 60,
          "minute": 60, "minutes": 60, "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
          "d": 86400, "day": 86400, "days": 86400, "w": 604800, "week": 604800, "weeks": 604800}


_TERM = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*", re.IGNORECASE)


def parse_duration(text: Any) -> float:
    """'8h', '30min', '1h30m', '2d', '90s' -> seconds; a Python number is seconds.
    A string needs a unit: '8' could be seconds or hours."""
    if type(text) in (int, float):
        seconds = float(text)
    else:
        s = str(text).strip()
        pos, seconds, terms = 0, 0.0, 0
        while pos < len(s):
            m = _TERM.match(s, pos)
            if not m or m.group(2).lower() not in _UNITS:
                hint = " (a unit is required: s, min, h, d, w)" if re.fullmatch(r"\s*[\d.]+\s*", s) else ""
                raise ValueError(f"bad duration {text!r}{hint}; examples: 8h, 30min, 1h30m, 2d")
            seconds += float(m.group(1)) * _UNITS[m.group(2).lower()]
            pos, terms = m.end(), terms + 1
        if not terms:
            raise ValueError(f"bad duration {text!r}; examples: 8h, 30min, 1h30m, 2d")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"a duration must be positive and finite, got {text!r}")
    return seconds
