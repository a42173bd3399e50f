"""The model of issue 22's model-based test: a training run driven by rules,
checked against an oracle that is the line of history.

Shared by tests/test_model_based.py (hypothesis state machine for one rank,
seeded random programs for several ranks) and scripts/soak_model.py.

The oracle knows, for every step of the current line, the exact tensor values
the state had at ``save()``, and every abandoned save ``(step, values)``: a
rollback to step k followed by a save of k+1 abandons the line's steps >= k+1.
Invariants (``Run.check``): ``load()`` returns the line's latest state
bit-exact; every listed step (local tier, persistent tier) loads exactly its
own state or is refused as not found; no abandoned save is ever returned;
``lazyckpt verify`` passes on the directory. After a wait or a rollback and at
the end of a program, ``Run.check_study``: ``lazyckpt.trajectory``/``diff``
(issue 26) on a few keys equal the oracle's norms and differences.

Issue 33 item 5 adds faults: with persist_to the URL goes through the fault
proxy of tests/_s3proxy.py (``Faults``; rules fail_next, outage, heal; what the
oracle accepts under them is in docs/RELIABILITY.md 2.1), the persistent tier
alone is read directly after a wait (``_check_store_alone``), and rules damage
metadata (corrupt_meta), prune during a save (prune_in_flight), change the
state's keys and dtypes (reshape) and let a stalled writer's lease expire
(lease_expiry). The state holds a 64 KiB tensor that the "sparse" train kind
changes only between the windows of incremental's sample digest; keep_last
and full_every are drawn per run (``run_knobs``).

When to save (one rank, local tier: ``schedule_knobs_allowed``): with the knob
``interval`` k the run's Checkpointer has ``interval=Every(steps=k)`` and
rule_save saves only when ``should_save(step)`` says so (the model: step % k
== 0, never step 0); with ``preemption`` it has ``Preemption(signals=(SIGUSR1,))``
and rule_preempt sends the process a real SIGUSR1 (its checks: rule_preempt).

A run is driven through ``Run.apply(rule, arg)``: rules are plain names with
one int argument, so a program is a list of ``(rule, arg)`` that replays the
same on every rank (``random_program``) and prints as a reproducer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

import lazyckpt
from lazyckpt.cli import inspect as lzinspect
from lazyckpt.cli import prune as lzprune
from lazyckpt.loading import resolve as lzresolve
from lazyckpt.loading import verify as lzverify
from lazyckpt.storage.stores import LOCAL
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from lazyckpt.saving.costs import problems as cost_problems
from lazyckpt.knobs import INCREMENTAL_MODES, resolve
from lazyckpt.retention import KeepBest, KeepEvery, KeepLast, as_policy, plan

from _crashpoints import index_problems, remote_index_problems, tiers_index_problems

# ----------------------------------------------------------------- configurations

#: incremental= values to drive: off, True (the default mode's alias) and every
#: named mode of this version of the library (read from knobs, so a renamed or
#: added mode is picked up), one value per distinct resolved mode.
def incremental_settings() -> List[Any]:
    out, seen = [], set()
    for value in [False, True] + [m for m in INCREMENTAL_MODES if m != "off"]:
        mode = resolve(incremental=value).incremental
        if mode not in seen:
            seen.add(mode)
            out.append(value)
    return out


@dataclasses.dataclass(frozen=True)
class Config:
    incremental: Any = False
    persist: bool = False
    replicas: int = 0
    replicated: Optional[str] = None      # None, "named" (replicated=["shared"]) or "auto"
    ranks: int = 1

    @property
    def id(self) -> str:
        """e.g. ``incTrue-persist-rep0-named-2r`` (usable in pytest -k and --config)."""
        return (f"inc{self.incremental}-{'persist' if self.persist else 'local'}-rep{self.replicas}"
                f"-{self.replicated or 'unset'}-{self.ranks}r")

    @staticmethod
    def parse(text: str) -> "Config":
        inc, tier, rep, replicated, ranks = text.rsplit("-", 4)     # a mode's name may hold a dash
        inc = {"False": False, "True": True}.get(inc[3:], inc[3:])
        return Config(inc, tier == "persist", int(rep[3:]), None if replicated == "unset" else replicated,
                      int(ranks[:-1]))


def all_configs() -> List[Config]:
    return [Config(inc, persist, replicas, replicated, ranks)
            for inc in incremental_settings() for persist in (False, True) for replicas in (0, 1)
            for replicated in (None, "named", "auto") for ranks in (1, 2)]


#: Combinations the library refuses today: the words one of which the ValueError
#: must contain (where several reasons apply, the library names one). Update
#: this when a combination becomes supported: the test fails both ways (a
#: listed one accepted, an unlisted one refused).
def expected_refusal(cfg: Config) -> List[str]:
    reasons = []
    if cfg.replicas and cfg.ranks < 2:
        reasons.append("replicas")        # the partners are other ranks (other nodes)
    incremental = resolve(incremental=cfg.incremental).incremental != "off"
    if incremental and cfg.replicas:
        reasons.append("incremental")
    if incremental and cfg.persist:
        reasons.append("incremental")
    return reasons


def checkpointer_kwargs(cfg: Config, persist_url: Optional[str], *, takeover: bool = False,
                        lease_expiry: float = 30.0, **knobs: Any) -> Dict[str, Any]:
    """The Checkpointer's keyword arguments for ``cfg``; ``knobs`` (a run's draw, see
    ``run_knobs``: keep -- or its old name keep_last --, full_every) override the
    defaults. A child process gets the same from the MODEL_KNOBS variable (repr
    of the dict). ``takeover``, ``lease_expiry``: a writer that takes the directory
    over, one whose lease lapses sooner."""
    if not knobs and os.environ.get("MODEL_KNOBS"):
        knobs = eval(os.environ["MODEL_KNOBS"])
    knobs = {("keep" if k == "keep_last" else k): v for k, v in knobs.items()
             if k in ("keep", "keep_last", "full_every", "interval", "preemption")}
    identical = {"named": ["shared"], "auto": "auto"}.get(cfg.replicated)
    kw: Dict[str, Any] = dict(keep=knobs.get("keep", 3),
                              distributed=lazyckpt.Distributed(identical_keys=identical, commit_timeout=60,
                                                               takeover=takeover),
                              io=lazyckpt.IO(lease_expiry=lease_expiry))
    mode = resolve(incremental=cfg.incremental).incremental
    if mode != "off":
        kw["incremental"] = lazyckpt.Incremental(mode, full_every=knobs.get("full_every"))
    if cfg.persist:
        # Two attempts per request (botocore's standard backoff, <= 1 s): an injected
        # fault (tests/_s3proxy.py) is retried once, an outage fails in about a second.
        kw["persist"] = lazyckpt.Persist(persist_url, keep=6, storage_options={
            "max_attempts": 2, "connect_timeout": 2, "read_timeout": 10})
    if cfg.replicas:
        kw["replicas"] = lazyckpt.Replicas(cfg.replicas, node_size=1)
    if knobs.get("interval"):
        kw["interval"] = lazyckpt.Every(steps=knobs["interval"])
    if knobs.get("preemption"):
        # SIGUSR1, not SIGTERM: a stray SIGTERM to the test process must still end it.
        kw["preemption"] = lazyckpt.Preemption(signals=(signal.SIGUSR1,))
    return kw


def run_knobs(seed: int, cfg: Config) -> Dict[str, Any]:
    """A run's draw of the knobs that are not Config dimensions (not to multiply the
    CI matrix): keep None (abandoned steps kept as .abandoned-*), 1, 3 or one of
    POLICIES, and for incremental configurations full_every 0 or 2."""
    rng = random.Random(seed * 7919 + 17)
    knobs: Dict[str, Any] = {"keep": rng.choice([None, 1, 3] + POLICIES)}
    if resolve(incremental=cfg.incremental).incremental != "off":
        knobs["full_every"] = rng.choice([0, 2])
    return knobs


#: The retention policies the model drives besides keep=None/int (each save records
#: metadata={"loss": loss_of(step)}, which KeepBest ranks by).
POLICIES = [KeepLast(1) | KeepEvery(3), KeepBest(2) | KeepLast(1), KeepBest(1, mode="max") | KeepEvery(4)]


def loss_of(step: int) -> float:
    """The loss a save of ``step`` records (a function of the step: a child process
    saving for the model records the same)."""
    return float((step * 37) % 23)


def step_metadata(step: int) -> Dict[str, Any]:
    return {"loss": loss_of(step)}


def schedule_knobs_allowed(cfg: Config, world: int = 1) -> bool:
    """Whether a run of ``cfg`` may draw the knobs ``interval`` (an int k: the Checkpointer
    has ``interval=Every(steps=k)`` and rule_save saves only when ``should_save`` says so)
    and ``preemption`` (True: ``Preemption(signals=(SIGUSR1,))``, and rule_preempt sends it):
    one rank on the local tier alone (signal handlers need the main thread, which a
    one-rank run has; the collective should_save of several ranks is tests/test_preemption.py's)."""
    return world == 1 and cfg.ranks == 1 and not cfg.persist and not cfg.replicas


# ----------------------------------------------------------------- the live state

class Trainee:
    """A small model (Linear + BatchNorm1d + Linear) with a plain AdamW, a
    second Linear with a fused AdamW, and a buffer identical on every rank
    ("shared": the replicated key). About 40 KB in all."""

    def __init__(self, rank: int):
        g = torch.Generator().manual_seed(1234 + rank)
        torch.manual_seed(1234 + rank)
        self.rank = rank
        self.a = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
        self.b = torch.nn.Linear(16, 8)
        self.opt_a = torch.optim.AdamW(self.a.parameters(), lr=1e-2)
        try:
            self.opt_b = torch.optim.AdamW(self.b.parameters(), lr=1e-2, fused=True)
        except (RuntimeError, ValueError):      # a torch without fused CPU kernels
            self.opt_b = torch.optim.AdamW(self.b.parameters(), lr=1e-2)
        self.shared = torch.zeros(64)
        #: 64 KiB: above the 16 KiB of incremental's sample digest (1024 windows of 16 bytes,
        #: one every 64 bytes here), so the sampled path of content hashing runs; the
        #: "sparse" kind changes it only between the sampled windows.
        self.big = torch.randn(16384, generator=g)
        #: Keys added, removed and re-typed by rule_reshape (path -> tensor).
        self.extra: Dict[str, torch.Tensor] = {}
        self.gen = g
        # One step each, so the optimizers' state (moments, step counters) exists from the start.
        self.train("plain")
        self.train("fused")

    def state(self) -> Dict[str, Any]:
        return {"a": self.a.state_dict(), "b": self.b.state_dict(), "opt_a": self.opt_a.state_dict(),
                "opt_b": self.opt_b.state_dict(), "shared": {"buf": self.shared}, "big": self.big,
                **({"extra": self.extra} if self.extra else {})}

    def _batch(self) -> torch.Tensor:
        return torch.randn(8, 16, generator=self.gen)

    def train(self, kind: str) -> None:
        """One in-place update through one kind of writer."""
        if kind == "plain":                  # AdamW (foreach), eval-mode BatchNorm: no stats update
            self.a.eval()
            self.opt_a.zero_grad()
            self.a(self._batch()).square().mean().backward()
            self.opt_a.step()
        elif kind == "fused":                # fused AdamW: weights, moments, step
            self.opt_b.zero_grad()
            self.b(self._batch()).square().mean().backward()
            self.opt_b.step()
        elif kind == "batchnorm":            # training-mode forward: running_mean/var, num_batches_tracked
            self.a.train()
            with torch.no_grad():
                self.a(self._batch())
        elif kind == "data":                 # .data: a different version counter
            self.a[0].weight.data.mul_(0.5).add_(0.25)
        elif kind == "numpy":                # a numpy view of the storage
            self.b.bias.detach().numpy()[:] += 1.0
            self.shared.numpy()[::3] += 0.5   # the same on every rank
        elif kind == "collective":           # an in-place collective (identical result on every rank)
            import torch.distributed as dist
            self.shared.numpy()[1::3] += 1.0
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(self.shared)
                self.shared.numpy()[:] /= dist.get_world_size()
        elif kind == "sparse":               # a few elements of the big tensor, all outside the sample
            n = int(torch.randint(1, 4, (), generator=self.gen))
            for _ in range(n):
                # float j*16 + 4..15: bytes 16..63 of a 64-byte stride, between two sampled windows
                i = 16 * int(torch.randint(0, 1023, (), generator=self.gen)) + int(torch.randint(4, 16, (), generator=self.gen))
                self.big[i] += 1.0           # an in-place op: the version counter moves too
            for t in self.extra.values():
                t.add_(1)
        else:
            raise ValueError(kind)

    def reshape(self, arg: int) -> None:
        """Change the state's structure or dtypes: add a key, remove one, or change a
        tensor's dtype (float32 <-> bfloat16), a new tensor (not in place)."""
        what = arg % 3
        if what == 0 or not self.extra:
            name = f"t{arg % 5}"
            self.extra[name] = torch.randn(64 + arg % 7, generator=self.gen)
        elif what == 1:
            del self.extra[sorted(self.extra)[arg % len(self.extra)]]
        else:
            name = sorted(self.extra)[arg % len(self.extra)]
            t = self.extra[name]
            self.extra[name] = t.to(torch.float32 if t.dtype == torch.bfloat16 else torch.bfloat16)

    def shape_like(self, values: Dict[str, Any]) -> None:
        """Give the live state the structure of a saved one (its "extra" keys and
        dtypes), so that load(into=) of that save fills every tensor."""
        self.extra = {k[len("/extra/"):]: torch.empty_like(v) for k, v in values.items()
                      if k.startswith("/extra/") and isinstance(v, torch.Tensor)}


TRAIN_KINDS = ("plain", "fused", "batchnorm", "data", "numpy", "collective", "sparse")

#: The writers an incremental mode documents that it misses (knobs.Options.incremental):
#: outside its contract, so the model does not use them in that mode (a "plain" step instead).
MISSED_WRITERS = {"version-counters": {"fused", "batchnorm", "data", "numpy", "collective"}}


def flat(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """path -> leaf; tensors cloned, so a snapshot does not follow the live state."""
    out: Dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}/{i}"))
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree.detach().clone()
    else:
        out[prefix] = tree
    return out


def tensor_diff(expected: Dict[str, Any], got: Dict[str, Any]) -> List[str]:
    """The paths whose tensors differ (bit-exact: torch.equal; the states hold no NaN)."""
    bad = []
    for k, v in expected.items():
        if not isinstance(v, torch.Tensor):
            continue
        w = got.get(k)
        if not isinstance(w, torch.Tensor) or w.dtype != v.dtype or w.shape != v.shape or not torch.equal(w, v):
            bad.append(k)
    missing = [k for k, v in got.items() if isinstance(v, torch.Tensor) and k not in expected]
    return bad + [f"{k} (unexpected)" for k in missing]


def same(expected: Dict[str, Any], got: Dict[str, Any]) -> bool:
    return not tensor_diff(expected, got)


# ----------------------------------------------------------------- the oracle

@dataclasses.dataclass
class Line:
    """The line of history: committed steps in commit order, and the abandoned saves."""
    steps: "OrderedDict[int, Dict[str, Any]]" = dataclasses.field(default_factory=OrderedDict)
    abandoned: List[Tuple[int, Dict[str, Any]]] = dataclasses.field(default_factory=list)

    def commit(self, step: int, values: Dict[str, Any]) -> None:
        for s in [s for s in self.steps if s >= step]:
            self.abandoned.append((s, self.steps.pop(s)))
        self.steps[step] = values

    def latest(self) -> Optional[Tuple[int, Dict[str, Any]]]:
        if not self.steps:
            return None
        s = next(reversed(self.steps))
        return s, self.steps[s]

    def copy(self) -> "Line":
        return Line(OrderedDict(self.steps), list(self.abandoned))


#: The process rule_kill kills: argv = directory, state file, step, repr(Config), repr(persist url).
_KILLED_SAVER = """
import sys, time, torch, lazyckpt
from _model import Config, checkpointer_kwargs, step_metadata
directory, state_file, step, cfg, url = sys.argv[1:]
ckpt = lazyckpt.Checkpointer(directory, **checkpointer_kwargs(eval(cfg), eval(url)))
handle = ckpt.save(torch.load(state_file, weights_only=False), step=int(step), metadata=step_metadata(int(step)))
print("saving", flush=True)
ckpt.wait()
time.sleep(60)          # killed before
"""


# A save killed inside its commit: SIGKILL just before the rename number KILL_AT of a step
# directory (the superseded steps' moves, then the new step's), after the commit point.
_KILLED_IN_COMMIT = """
import os, signal, sys, torch, lazyckpt
from _model import Config, checkpointer_kwargs, step_metadata
directory, state_file, step, cfg, url, kill_at = sys.argv[1:]
ckpt = lazyckpt.Checkpointer(directory, **checkpointer_kwargs(eval(cfg), eval(url)))
renames, real_rename = [0], os.rename
def rename(src, dst, *a, **k):
    if os.path.basename(str(src)).startswith((".tmp-step_", "step_")):
        renames[0] += 1
        if renames[0] == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(src, dst, *a, **k)
os.rename = rename
ckpt.save(torch.load(state_file, weights_only=False), step=int(step), metadata=step_metadata(int(step))).wait()
os.rename = real_rename
ckpt.close()
"""

# Another Checkpointer takes the directory over (takeover=True) and commits a step.
_TAKER = """
import sys, torch, lazyckpt
from _model import Config, checkpointer_kwargs, step_metadata
directory, state_file, step, cfg, url = sys.argv[1:]
with lazyckpt.Checkpointer(directory, **checkpointer_kwargs(eval(cfg), eval(url), takeover=True)) as ckpt:
    ckpt.save(torch.load(state_file, weights_only=False), step=int(step), metadata=step_metadata(int(step))).wait()
print("committed", flush=True)
"""


@contextlib.contextmanager
def no_file_locks():
    """A file system without locks (flock raises ENOLCK, as on some NFS mounts): the
    writer lease's heartbeat alone orders writers there (docs/RELIABILITY.md 1.2.1
    "Fencing"), so a lease can expire. With locks a stalled holder keeps its flock,
    and only a takeover displaces it (rule_takeover)."""
    from lazyckpt.storage import locks

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks on this file system (model)")
    real, locks._flock = locks._flock, no_locks
    try:
        yield
    finally:
        locks._flock = real


# A writer whose lease expires (no file locks): it commits a step with a short lease expiry, prints
# "committed", is stopped (SIGSTOP) by the model past its expiry while a new writer takes
# the directory and commits, then is continued, told "go", and tries another save: it
# must be refused (prints "refused"), never commit.
_STALLED_WRITER = """
import sys, torch, lazyckpt
from _model import Config, checkpointer_kwargs, no_file_locks, step_metadata
directory, state_file, step, cfg, url, expiry = sys.argv[1:]
no_file_locks().__enter__()
ckpt = lazyckpt.Checkpointer(directory, **checkpointer_kwargs(eval(cfg), eval(url), lease_expiry=float(expiry)))
state = torch.load(state_file, weights_only=False)
ckpt.save(state, step=int(step), metadata=step_metadata(int(step))).wait()
print("committed", flush=True)
sys.stdin.readline()
try:
    ckpt.save(state, step=int(step) + 2, metadata=step_metadata(int(step) + 2)).wait()
except lazyckpt.CheckpointError as exc:
    print("refused", type(exc).__name__, str(exc)[:300], flush=True)
else:
    print("committed-again", flush=True)
try:
    ckpt.close(cancel=True)
except lazyckpt.CheckpointError:
    pass
"""


class Faults:
    """The fault-injecting proxy (tests/_s3proxy.py S3FaultProxy) the run's persist URL
    goes through (AWS_ENDPOINT_URL points at it), and the server's own endpoint, which
    the model uses to read the store alone (never faulted)."""

    def __init__(self, proxy: Any, direct_endpoint: str):
        self.proxy, self.direct = proxy, direct_endpoint

    def armed(self) -> bool:
        return self.proxy.armed()

    def hits(self) -> int:
        """Requests the proxy failed so far (an injected 5xx, or a dropped connection)."""
        return sum(1 for _, _, status in list(self.proxy.requests) if status is None or status >= 500)

    def clear(self) -> None:
        self.proxy.reset()

    def options(self) -> Any:
        return lazyckpt.Options(storage_options={"endpoint_url": self.direct, "max_attempts": 3})


class InvariantError(AssertionError):
    pass


# ----------------------------------------------------------------- a run

class Run:
    """One rank's training run, its Checkpointer and its oracle."""

    def __init__(self, cfg: Config, base: str, persist_url: Optional[str], rank: int = 0, world: int = 1,
                 log: Optional[List[str]] = None, knobs: Optional[Dict[str, Any]] = None,
                 faults: Optional["Faults"] = None):
        self.cfg, self.base, self.persist_url, self.rank, self.world = cfg, base, persist_url, rank, world
        #: keep_last / full_every of this run (run_knobs), also given to its child processes.
        self.knobs = dict(knobs or {})
        #: The fault-injecting proxy the persist URL goes through (one rank, persist_to), or None.
        self.faults = faults if (cfg.persist and world == 1 and not cfg.replicas) else None
        #: Rules left in the current outage window (rule_outage); 0: none.
        self.outage_left = 0
        #: Faults were injected since the store last caught up (rule_heal): the store alone
        #: may lag, even show steps a rollback abandoned since (it could not be told).
        self.dirty = False
        self.local = os.path.join(base, f"node{rank}") if cfg.replicas else os.path.join(base, "run")
        self.trainee = Trainee(rank)
        self.line = Line()
        self.next_step = 1
        #: Saves not known committed: after a crash, any prefix of them may have committed.
        self.uncertain: List[Tuple[int, Dict[str, Any]]] = []
        self.pending: List[Tuple[Any, int, Dict[str, Any]]] = []
        self.log = log if log is not None else []
        #: The retention policy of this run, and the local steps it must leave: the model
        #: applies retention.plan at each commit, as the library does (None: a rule the
        #: model does not follow ran since; the next check takes the listing from there).
        self.policy = as_policy(checkpointer_kwargs(cfg, persist_url, **self.knobs)["keep"])
        self.expected: Optional[List[int]] = []
        #: When to save (schedule_knobs_allowed): Every(steps=interval) or None; preemption on.
        self.interval: Optional[int] = self.knobs.get("interval") or None
        self.preemption = bool(self.knobs.get("preemption"))
        if (self.interval or self.preemption) and not schedule_knobs_allowed(cfg, world):
            raise ValueError(f"{cfg.id} (world {world}): the interval/preemption knobs are for one-rank "
                             f"local configurations only (schedule_knobs_allowed)")
        self._sigusr1_before = signal.getsignal(signal.SIGUSR1) if self.preemption else None
        self.ckpt = self._open()

    # -- helpers
    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def predicts_steps(self) -> bool:
        """Whether the model says which steps the local tier holds: one rank, no
        other tier (their holds defer retention to a later pass), no incremental
        references (they keep steps the model does not follow)."""
        return not (self.cfg.persist or self.cfg.replicas or self.distributed) and \
            resolve(incremental=self.cfg.incremental).incremental == "off"

    def _retain(self, step: int) -> None:
        """The commit of ``step`` as retention sees it: the steps >= step superseded,
        then what the policy does not keep deleted."""
        if self.expected is None:
            return
        present = [s for s in self.expected if s < step] + [step]
        doomed = set(plan(self.policy, present, step_metadata).doomed)
        self.expected = [s for s in present if s not in doomed]

    def _barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            dist.barrier()

    def _listed_everywhere(self) -> list:
        """The line's steps that every rank lists. load(step=) is collective, so
        every rank must pick the same step, and node-local listings differ after
        a lost node (soak seed 2212, program-seed 907128806; seed 3301,
        program-seed 594096308: ranks rolled back to different steps)."""
        listed = [s for s in self.ckpt.steps() if s in self.line.steps]
        if not self.distributed:
            return listed
        import torch.distributed as dist
        every: list = [None] * self.world
        dist.all_gather_object(every, listed)
        return sorted(set.intersection(*(set(x) for x in every)))

    def _open(self, **over: Any) -> lazyckpt.Checkpointer:
        ckpt = lazyckpt.Checkpointer(self.local, **checkpointer_kwargs(self.cfg, self.persist_url, **self.knobs,
                                                                       **over))
        if self.interval and ckpt.should_save(0):
            self.fail(f"interval=Every(steps={self.interval}): should_save(0) is True (step 0 is never due)")
        if ckpt.preempted:
            self.fail("a new Checkpointer says preempted before any signal reached it")
        return ckpt

    def _store_down(self) -> bool:
        """Faults are armed on the proxy now (requests to the store may fail)."""
        return self.faults is not None and self.faults.armed()

    def _hits(self) -> int:
        return self.faults.hits() if self.faults is not None else 0

    def _excused(self, hits_before: int) -> bool:
        """A store error is the injected faults' doing: armed now, or some hit since."""
        return self._store_down() or self._hits() > hits_before

    def _persist_error(self, exc: BaseException) -> bool:
        """A failure of the persistent tier the faults explain (the local commit held)."""
        return (self.dirty and isinstance(exc, CheckpointError) and self.persist_url is not None
                and self.persist_url in str(exc))

    def _wait(self) -> None:
        """ckpt.wait(); under faults a persist failure is accepted: the local commit
        holds and the store catches up after the outage (rule_heal checks it)."""
        try:
            self.ckpt.wait()
        except CheckpointError as exc:
            if not self._persist_error(exc):
                raise
            self.log.append(f"  (persist failed: {type(exc).__name__})")

    def _close(self) -> None:
        """ckpt.close(), a persist failure under faults accepted (as _wait)."""
        ckpt, self.ckpt = self.ckpt, None
        try:
            ckpt.close()
        except CheckpointError as exc:
            if not self._persist_error(exc):
                raise

    def fail(self, message: str) -> None:
        raise InvariantError(f"[rank {self.rank}] {message}")

    def _settle(self) -> None:
        """Every save handed to the live Checkpointer is committed: the oracle records it."""
        for handle, step, values in self.pending:
            try:
                handle.wait(timeout=120)
            except Exception as exc:
                self.fail(f"save of step {step} failed: {type(exc).__name__}: {exc}")
            self.line.commit(step, values)
            self._retain(step)
        self.pending = []

    # -- rules
    def apply(self, rule: str, arg: int = 0) -> None:
        self.log.append(f"{rule}({arg})")
        if rule not in FOLLOWED:
            self.expected = None
        if self.outage_left:
            self.outage_left -= 1
            if not self.outage_left:            # the window is over: the store answers again
                self.faults.clear()
        getattr(self, "rule_" + rule)(arg)

    def rule_train(self, arg: int) -> None:
        kind = TRAIN_KINDS[arg % len(TRAIN_KINDS)]
        if kind in MISSED_WRITERS.get(resolve(incremental=self.cfg.incremental).incremental, ()):
            kind = "plain"
        self.ckpt.wait_for_snapshot()        # the save contract: no in-place write before the capture
        self.trainee.train(kind)

    def rule_save(self, arg: int) -> None:
        """A save of the next step; with ``interval``, a step boundary of the loop
        ``if ckpt.should_save(step): ckpt.save(...)``: saved exactly when step % k == 0."""
        step = self.next_step
        if self.interval:
            due = self.ckpt.should_save(step)
            if due != (step % self.interval == 0):
                self.fail(f"interval=Every(steps={self.interval}): should_save({step}) is {due}")
            if not due:
                self.next_step = step + 1
                return
        state = self.trainee.state()
        values = flat(state)
        handle = self.ckpt.save(state, step=step, metadata=step_metadata(step))
        self.pending.append((handle, step, values))
        self.next_step = step + 1

    def rule_wait(self, arg: int) -> None:
        self._wait()
        self._settle()

    def rule_burst(self, arg: int) -> None:
        """A long history quickly (issue 34): many saves of the same state in a
        row, past the record's bounded window (history.RECENT_EVENTS), so that
        the index, retention and later rollbacks meet a run of hundreds of steps."""
        n = BURST_STEPS if not (self.cfg.persist or self.cfg.replicas or self.distributed) else BURST_STEPS_TIERS
        for _ in range(n):
            self.rule_save(0)
            if len(self.pending) >= 16:
                self._wait()
                self._settle()
        self._wait()
        self._settle()

    def rule_rollback(self, arg: int) -> None:
        """Load step k of the line into the live state; the next save is k+1."""
        self._wait()
        self._settle()
        listed = self._listed_everywhere()
        if not listed:
            return
        k = listed[arg % len(listed)]
        self.trainee.shape_like(self.line.steps[k])     # its keys and dtypes (rule_reshape)
        self.ckpt.load(step=k, into=self.trainee.state())
        diff = tensor_diff(self.line.steps[k], flat(self.trainee.state()))
        if diff:
            self.fail(f"load(step={k}, into=) filled the live state with other values: {diff[:5]}")
        self.next_step = k + 1

    def rule_crash(self, arg: int) -> None:
        """Drop the Checkpointer without closing it, then a new one on the directory."""
        if self.distributed:
            # Its threads could still run collectives against the new one's: the local commits
            # end first (drains to the other tiers are cut short by the drop).
            self._settle()
        else:
            self.uncertain = [(step, values) for _, step, values in self.pending]
        handles = [h for h, _, _ in self.pending]
        self.pending = []
        ckpt, self.ckpt = self.ckpt, None
        tier = ckpt.persistent
        del ckpt
        gc.collect()
        # The dropped object's threads are not killed: the "dead process" is the one whose
        # saves have ended, committed or not (which of them did, the next load() tells).
        for h in handles:
            try:
                h.wait(timeout=120)
            except Exception:
                pass
        if tier is not None:
            # Its drain thread keeps the dropped object (and its writer lease) alive while it
            # retries uploads (an outage): the "dead process" is also the one whose drain ended.
            try:
                tier.wait(timeout=120, raise_errors=False)
            except CheckpointError:
                pass
            del tier
            gc.collect()
        self._barrier()
        self.ckpt = self._open()
        self._resolve_uncertain()

    def rule_kill(self, arg: int) -> None:
        """Another process (the same run, after a restart) saves the next step and is
        killed with SIGKILL at a random instant of that save; then a Checkpointer
        here again. One rank only (the others would wait for it in a collective)."""
        if self.distributed:
            return
        self._store_up_for_child()
        self._close()
        self._settle()
        step = self.next_step
        state = self.trainee.state()
        values = flat(state)
        state_file = os.path.join(self.base, "kill-state.pt")
        torch.save(state, state_file)
        child = subprocess.Popen(
            [sys.executable, "-c", _KILLED_SAVER, self.local, state_file, str(step), repr(self.cfg),
             repr(self.persist_url)],
            stdout=subprocess.PIPE, env=self._child_env())
        try:
            child.stdout.readline()               # "saving": save() was called
            time.sleep(random.Random(arg).uniform(0, 0.05))   # mostly mid-save, some after it
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
        self.next_step = step + 1
        self.uncertain = [(step, values)]
        self.ckpt = self._open()
        self._resolve_uncertain()

    def _child_env(self) -> Dict[str, str]:
        return {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
                "MODEL_KNOBS": repr(self.knobs)}

    def _child(self, script: str, step: int, *extra: str) -> "subprocess.CompletedProcess":
        state_file = os.path.join(self.base, "child-state.pt")
        torch.save(self.trainee.state(), state_file)
        return subprocess.run(
            [sys.executable, "-c", script, self.local, state_file, str(step), repr(self.cfg), repr(self.persist_url),
             *extra], capture_output=True, text=True, timeout=300,
            env=self._child_env())

    def rule_kill_in_commit(self, arg: int) -> None:
        """Another process of the run saves the next step and is SIGKILLed inside
        its commit, between two of its renames (after a rollback, the commit moves
        the superseded steps aside first): issue 33's crash inside a commit. One rank."""
        if self.distributed:
            return
        self._store_up_for_child()
        self._close()
        self._settle()
        step, values = self.next_step, flat(self.trainee.state())
        proc = self._child(_KILLED_IN_COMMIT, step, str(1 + arg % 4))
        if proc.returncode not in (0, -signal.SIGKILL):
            self.fail(f"the save killed inside its commit failed otherwise: {proc.stderr[-2000:]}")
        self.next_step = step + 1
        self.uncertain = [(step, values)]
        self.ckpt = self._open()
        self._resolve_uncertain()

    def rule_takeover(self, arg: int) -> None:
        """Another Checkpointer takes the directory over (takeover=True) while this
        one is open, and commits the next step; this one's next save is refused,
        and a new Checkpointer goes on from the other one's step. One rank."""
        if self.distributed:
            return
        self._store_up_for_child()
        self._wait()
        self._settle()
        step, values = self.next_step, flat(self.trainee.state())
        proc = self._child(_TAKER, step)
        if proc.returncode != 0 or "committed" not in proc.stdout:
            self.fail(f"the takeover's save failed: {proc.stderr[-2000:]}")
        self.line.commit(step, values)
        self.next_step = step + 1
        if self.ckpt._writer is not None:           # this one had saved: it held the lease
            try:
                self.ckpt.save(self.trainee.state(), step=self.next_step, metadata=step_metadata(self.next_step)).wait()
            except lazyckpt.CheckpointError:
                pass
            else:
                self.fail("a Checkpointer displaced by a takeover still committed a save")
        self._close()
        self.ckpt = self._open()

    def _resolve_uncertain(self) -> None:
        """After a crash: the new latest says which of the uncertain saves committed."""
        if not self.uncertain:
            return
        candidates = []
        for i in range(len(self.uncertain), -1, -1):
            line = self.line.copy()
            for step, values in self.uncertain[:i]:
                line.commit(step, values)
            candidates.append(line)
        try:
            got = self.ckpt.load()
            step = self.ckpt.loaded_from["step"]
        except CheckpointNotFoundError:
            got, step = None, None
        for line in candidates:
            latest = line.latest()
            if (latest is None and got is None) or (latest is not None and got is not None and latest[0] == step
                                                    and same(latest[1], flat(got))):
                self.line = line
                self.uncertain = []
                return
        self.fail(f"after a crash with saves {[s for s, _ in self.uncertain]} in flight, load() returned "
                  f"step {step}, which is none of the possible latest states "
                  f"{[(l.latest() or (None,))[0] for l in candidates]}")

    def rule_preempt(self, arg: int) -> None:
        """A real preemption signal (SIGUSR1 to this process, preemption=): the next
        should_save is True whatever the interval, that step's save() returns only once
        it is committed (listed and loadable with no wait()), ``preempted`` is True;
        the loop ends (close) and a resumed run (a new Checkpointer) loads that step
        bit-exact and is not preempted. A no-op without the preemption knob."""
        if not self.preemption:
            return
        if self.ckpt.preempted:
            self.fail("preempted before the signal")
        os.kill(os.getpid(), signal.SIGUSR1)    # Python runs the handler on this (the main) thread before returning
        if not self.ckpt.preempted:
            self.fail("a SIGUSR1 (preemption=Preemption(signals=(SIGUSR1,))) did not set preempted")
        step = self.next_step
        if not self.ckpt.should_save(step):
            self.fail(f"should_save({step}) after the preemption signal is False")
        state = self.trainee.state()
        values = flat(state)
        handle = self.ckpt.save(state, step=step, metadata=step_metadata(step))
        # Committed before save() returned: no wait() between.
        if step not in self.ckpt.steps():
            self.fail(f"the preempted save of step {step} returned but the step is not listed "
                      f"({self.ckpt.steps()})")
        got = flat(self.ckpt.load(step=step))
        if not same(values, got):
            self.fail(f"the preempted save of step {step}, loaded right after save() returned"
                      + self._which(step, got))
        if not self.ckpt.preempted:
            self.fail("preempted went back to False after the preempted save")
        self.pending.append((handle, step, values))
        self.next_step = step + 1
        # The loop stops; the job is resumed later from the same directory.
        self._close()
        self._settle()
        self.ckpt = self._open()
        got = self.ckpt.load()
        if self.ckpt.loaded_from["step"] != step or not same(values, flat(got)):
            self.fail(f"the resumed run loads step {self.ckpt.loaded_from['step']}, not the preempted step {step}"
                      + self._which(self.ckpt.loaded_from["step"], flat(got)))

    def rule_restart(self, arg: int) -> None:
        self._close()
        self._settle()
        self._barrier()
        self.ckpt = self._open()

    def rule_lose_local(self, arg: int) -> None:
        """The node-local directory is gone (a replaced node). With persist_to or
        replicas the latest committed step comes back, else nothing is left.
        Not while faults kept the store behind (``dirty``): the commits it never
        got are lost with the node by design (a restart instead)."""
        if self.dirty:
            self.rule_restart(arg)
            return
        self._close()
        self._settle()
        self._barrier()
        if self.cfg.replicas:
            lost = self.rank == (arg % self.world)       # one node's directory
            if lost:
                shutil.rmtree(self.local, ignore_errors=True)
        else:
            lost = True
            if self.rank == 0:
                shutil.rmtree(self.local, ignore_errors=True)
        self._barrier()
        self.ckpt = self._open()
        if lost and not self.cfg.persist and not self.cfg.replicas:
            self.line = Line(OrderedDict(), self.line.abandoned + list(self.line.steps.items()))

    def rule_corrupt(self, arg: int) -> None:
        """Flip one byte of this rank's file of a listed step: load(step) must raise
        CorruptCheckpointError or return that same save (an intact copy on another
        tier, or an unchecked padding byte), never other values. Undone afterwards."""
        self._wait()
        self._settle()
        listed = self._listed_everywhere()
        if not listed:
            return
        step = listed[arg % len(listed)]
        path = os.path.join(self.ckpt.step_path(step), f"rank_{self.rank:05d}.lzc")
        if not os.path.exists(path):          # replicated/auto: the file may be another rank's
            path = os.path.join(self.ckpt.step_path(step), "rank_00000.lzc")
        size = os.path.getsize(path)
        offset = random.Random(arg).randrange(size)
        self._barrier()
        if self.rank == 0 or path.endswith(f"rank_{self.rank:05d}.lzc"):
            with open(path, "r+b") as f:
                f.seek(offset)
                old = f.read(1)
                f.seek(offset)
                f.write(bytes([old[0] ^ 0x5A]))
        else:
            old = None
        self._barrier()
        try:
            for s in ([step] if self.cfg.replicas else [step, None]):
                try:
                    got = self.ckpt.load(step=s)
                except CorruptCheckpointError:
                    continue
                loaded = self.ckpt.loaded_from["step"]
                expected = self.line.steps.get(loaded)
                if expected is None or not same(expected, flat(got)):
                    self.fail(f"with byte {offset} of {path} flipped, load(step={s}) returned step {loaded} "
                              f"with other values than its save"
                              + (f" ({tensor_diff(expected, flat(got))[:5]})" if expected else ""))
        finally:
            self._barrier()
            if old is not None:
                with open(path, "r+b") as f:
                    f.seek(offset)
                    f.write(old)
            self._barrier()

    def rule_prune(self, arg: int) -> None:
        """`lazyckpt prune --keep N` on the directory while another thread reads every
        listed step: each read gets that step's exact state or CheckpointNotFoundError."""
        self._settle_if_quiet()
        keep = 1 + arg % 2
        targets = [(s, self.ckpt.step_path(s)) for s in self.ckpt.steps()]
        problems: List[str] = []
        stop = threading.Event()

        def reader() -> None:
            rounds = 0
            while not stop.is_set() or rounds < 1:
                rounds += 1
                for s, path in targets:
                    try:
                        got = lazyckpt.load(path)
                    except CheckpointNotFoundError:
                        continue
                    except Exception as exc:
                        problems.append(f"step {s}: {type(exc).__name__}: {exc}")
                        continue
                    expected = self.line.steps.get(s)
                    if self.world == 1 and (expected is None or not same(expected, flat(got))):
                        problems.append(f"step {s}: read other values than its save")

        t = threading.Thread(target=reader, name="model-reader")
        t.start()
        try:
            self._barrier()
            if self.rank == 0 or self.cfg.replicas:        # a shared directory, or each node's own
                lzprune.prune(self.local, keep)
        finally:
            stop.set()
            t.join()
        self._barrier()
        if problems:
            self.fail(f"a reader during prune --keep {keep}: {problems[:3]}")

    # -- faults of the persistent tier (one rank, persist_to: a no-op elsewhere)
    def rule_fail_next(self, arg: int) -> None:
        """The next 1-4 requests to the store fail (503 or 500): retried once by the client,
        so a few become failed requests of whatever runs next."""
        if self.faults is None:
            return
        self.faults.proxy.fail_next(1 + arg % 4, status=(503, 500)[(arg >> 2) % 2])
        self.dirty = True

    def rule_outage(self, arg: int) -> None:
        """An outage window: for this rule's check and the next 1-3 rules every request
        fails (503), or its connection is dropped unanswered, or (no failure) every
        request is delayed; then the store answers again. Saves commit locally; their
        uploads and events fail (wait() may raise a persist error: accepted, see _wait)."""
        if self.faults is None:
            return
        kind, window = arg % 3, 2 + (arg >> 2) % 3
        self.faults.clear()
        if kind == 0:
            self.faults.proxy.fail_matching(lambda *a: True, status=503)
        elif kind == 1:
            self.faults.proxy.delay(0.01, drop=True)
        else:
            self.faults.proxy.delay(0.03)
        self.dirty = self.dirty or kind != 2
        self.outage_left = window

    def _store_up_for_child(self) -> None:
        """A child process opens its own Checkpointer, which checks the bucket once
        (wrong credentials, a missing bucket): the outage ends before one starts."""
        if self._store_down():
            self.faults.clear()
            self.outage_left = 0

    def rule_heal(self, arg: int) -> None:
        """The faults end; after a restart and a wait() that raises nothing, the store
        alone (read directly, not through the proxy) holds the line's latest step:
        the outbox published every event the outage kept back, the latest was
        uploaded again (docs/RELIABILITY.md 1.6)."""
        if self.faults is None:
            return
        self.faults.clear()
        self.outage_left = 0
        was_dirty = self.dirty
        self._close()
        self._settle()
        self.ckpt = self._open()
        self.dirty = False
        self.ckpt.wait()        # must not raise now
        self._check_store_alone(strict=True, why=f"after the faults ended{'' if was_dirty else ' (none)'}")

    def _check_store_alone(self, strict: bool, why: str) -> None:
        """The persistent tier alone (a reader with nothing local, as another machine):
        every step it lists loads that step's own save, never an abandoned one -- unless
        faults kept a rollback's event from it (not ``strict`` while dirty: then a
        listed step may be an abandoned save, bit-exact, never other values); with
        ``strict`` its latest is the line's latest."""
        if self.faults is None or self.persist_url is None:
            return
        from lazyckpt.storage.s3layout import ObjectCheckpointDir
        opts = self.faults.options()
        paths = ObjectCheckpointDir(self.persist_url, opts).step_paths()
        for s, path in sorted(paths.items()):
            try:
                values = flat(lazyckpt.load(path, options=opts))
            except CheckpointNotFoundError:
                continue                        # retention since the listing
            on_line = s in self.line.steps and same(self.line.steps[s], values)
            if on_line:
                continue
            abandoned = any(a == s and same(v, values) for a, v in self.line.abandoned)
            if abandoned and not strict and self.dirty:
                continue
            self.fail(f"{why}: the persistent tier alone ({self.persist_url}) lists step {s}, "
                      + ("an ABANDONED save" if abandoned else "not a save of the line") + self._which(s, values))
        latest = self.line.latest()
        if strict and latest is not None and (not paths or max(paths) != latest[0]):
            self.fail(f"{why}: the persistent tier alone lists {sorted(paths)}, not the line's latest step "
                      f"{latest[0]}")

    # -- metadata corruption, prune during a save, structure changes, an expired lease
    def rule_corrupt_meta(self, arg: int) -> None:
        """Damage a step's manifest.json, the directory's history.json, or (persist_to)
        the store's commit event objects (a body where there is none, malformed keys);
        loads must raise CorruptCheckpointError/CheckpointNotFoundError or return a
        save of the line bit-exact (that same step from the other tier, or -- for
        load() of the latest -- an earlier step of the line), never an abandoned save
        or other values. A damaged history.json (a byte flipped, truncated, ``{}``):
        load() and lazyckpt.load(DIR) return the line's latest or raise
        CorruptCheckpointError (docs/RELIABILITY.md 2.1). Undone afterwards. One rank."""
        if self.distributed:
            return
        self._wait()
        self._settle()
        what = ("manifest", "history", "event")[arg % 3]
        if what == "event" and self.faults is None:
            what = "manifest"
        undo: List[Any] = []
        rng = random.Random(arg)
        try:
            if what == "event":
                from lazyckpt.storage.s3layout import ObjectCheckpointDir
                d = ObjectCheckpointDir(self.persist_url, self.faults.options())
                keys = [o["Key"] for o in d.store.list(d._key("history", ""))]
                for key in keys[:1]:
                    d.store.put(key, b"\x00garbage" * 7)
                    undo.append(lambda key=key: d.store.put(key, b""))
                for bogus in ("history/not-an-event", "history/00000000", f"history/{'9' * 12}-x-y"):
                    d.store.put(d._key(bogus), b"{")
                    undo.append(lambda bogus=bogus: d.store.delete([d._key(bogus)]))
                target = "the store's events"
            else:
                if what == "manifest":
                    listed = self._listed_everywhere()
                    if not listed:
                        return
                    path = os.path.join(self.ckpt.step_path(listed[(arg >> 2) % len(listed)]), "manifest.json")
                else:
                    path = os.path.join(self.local, "history.json")
                    if not os.path.exists(path):
                        return
                with open(path, "rb") as f:
                    old = f.read()
                undo.append(lambda: open(path, "wb").write(old))
                how = (arg >> 4) % 3
                if how == 0:
                    i = rng.randrange(len(old))
                    new = old[:i] + bytes([old[i] ^ 0x5A]) + old[i + 1:]
                elif how == 1:
                    new = old[:rng.randrange(len(old))]
                else:
                    new = b"{}" if what == "history" else b"not json"
                with open(path, "wb") as f:
                    f.write(new)
                target = f"{path} ({('a byte flipped', 'truncated', 'replaced')[how]})"
            latest = self.line.latest()
            for s in [None] + sorted(self._listed_quietly()):
                try:
                    got = self.ckpt.load(step=s)
                except (CorruptCheckpointError, CheckpointNotFoundError):
                    continue
                loaded = self.ckpt.loaded_from["step"]
                expected = self.line.steps.get(loaded)
                # A damaged history.json: the step directories' names still tell the line (a
                # rollback moved the abandoned steps aside), so load() is the line's latest. With
                # persist_to the store's events outrank a local step whose event is unreadable:
                # load() may lag there (the store's latest, a step of the line; soak seed 23
                # program-seed 30227908), never return an abandoned one.
                strict = what == "history" and s is None and latest is not None and not self.cfg.persist
                if ((s is not None and loaded != s) or expected is None or not same(expected, flat(got))
                        or (strict and loaded != latest[0])):
                    self.fail(f"with {target} damaged, load(step={s}) returned step {loaded} from the "
                              f"{self.ckpt.loaded_from['tier']} tier" + self._which(loaded, flat(got))
                              + (f" (the line's latest is {latest[0]})" if strict else ""))
            if what == "history" and latest is not None and self.ckpt.steps():
                # A reader of the directory alone (no Checkpointer, nothing written).
                try:
                    got = flat(lazyckpt.load(self.local))
                except CorruptCheckpointError:
                    got = None
                if got is not None and not same(latest[1], got):
                    self.fail(f"with {target} damaged, lazyckpt.load({self.local}) is not the line's latest "
                              f"step {latest[0]}" + self._which(latest[0], got))
        finally:
            for u in reversed(undo):
                u()

    def _listed_quietly(self) -> set:
        try:
            return set(self.ckpt.steps())
        except CheckpointError:
            return set()

    def rule_prune_in_flight(self, arg: int) -> None:
        """`lazyckpt prune --keep 1|2` on the directory while a save is pending (its
        capture or write in progress): the save commits (then it is the line's
        latest, whatever prune removed) or fails with a CheckpointError (then
        nothing of it is visible); a committed save never refers to pruned bytes."""
        if self.distributed:
            return
        step = self.next_step
        state = self.trainee.state()
        values = flat(state)
        handle = self.ckpt.save(state, step=step, metadata=step_metadata(step))
        self.next_step = step + 1
        try:
            lzprune.prune(self.local, 1 + arg % 2)
        except CheckpointError as exc:
            self.fail(f"prune during the save of step {step} failed: {type(exc).__name__}: {exc}")
        self._commit_or_uncertain(handle, step, values)

    def _commit_or_uncertain(self, handle: Any, step: int, values: Any) -> None:
        """The line after a save a neighbour (prune) ran beside: committed, or, where
        the save reported a failure, every pending save uncertain until a load tells."""
        try:
            handle.wait(timeout=120)
        except CheckpointError:
            self.uncertain = self.uncertain + [(s, v) for _, s, v in self.pending] + [(step, values)]
            self.pending = []
            self._resolve_uncertain()
            return
        self._settle()
        self.line.commit(step, values)

    def rule_prune_beside_commit(self, arg: int) -> None:
        """`lazyckpt prune --keep 1|2` with this writer's pending save (a rollback's,
        after rule_rollback) forced between prune's plan and its act: a hook at
        prune's first rename aside waits (up to 0.5 s) for the save to commit. A
        prune that acts by step number outside the commit lock deletes the new step
        it never planned on; the save must commit and stay the line's latest."""
        if self.distributed or self.cfg.replicas:
            return
        from lazyckpt.storage.layout import CheckpointDir
        self._wait()                        # the gate below holds back this save's commit alone
        self._settle()
        step = self.next_step
        state = self.trainee.state()
        values = flat(state)
        mine = self.ckpt.layout
        gate, committed = threading.Event(), threading.Event()
        commit = mine.commit

        def gated(*a: Any, **k: Any) -> Any:
            gate.wait(30)                   # the save commits once prune has planned
            try:
                return commit(*a, **k)
            finally:
                committed.set()
        mine.commit = gated
        handle = self.ckpt.save(state, step=step, metadata=step_metadata(step))
        self.next_step = step + 1
        real = CheckpointDir._retire
        fired: List[int] = []

        def retire(layout: Any, s: int, prefix: str, force: bool) -> Any:
            if layout is not mine and not fired and prefix.startswith(".deleting"):
                fired.append(s)
                gate.set()
                committed.wait(0.5)         # done here unless prune holds the commit lock
            return real(layout, s, prefix, force)
        CheckpointDir._retire = retire      # (the writer's own renames pass through)
        try:
            lzprune.prune(self.local, 1 + arg % 2)
        except CheckpointError as exc:
            self.fail(f"prune beside the commit of step {step} failed: {type(exc).__name__}: {exc}")
        finally:
            CheckpointDir._retire = real
            gate.set()
            del mine.commit                 # the class's again
        self._commit_or_uncertain(handle, step, values)

    def rule_reshape(self, arg: int) -> None:
        """The state's structure or dtypes change (a key added or removed, a tensor
        float32 <-> bfloat16) before the next save."""
        self.ckpt.wait_for_snapshot()
        self.trainee.reshape(arg)

    def rule_lease_expiry(self, arg: int) -> None:
        """A writer whose lease expires, on a file system without locks (where the
        heartbeat alone orders writers): another process commits step S with a short
        lease_expiry_s and is stopped (SIGSTOP) past it; a new writer here commits
        S+1; the stalled one continues and tries S+2: it must be refused (the line
        is S, S+1). One rank; a process start (LAZYCKPT_MODEL_KILLS)."""
        if self.distributed:
            return
        self._store_up_for_child()
        self._close()
        self._settle()
        expiry = 1.0
        step, values = self.next_step, flat(self.trainee.state())
        state_file = os.path.join(self.base, "child-state.pt")
        torch.save(self.trainee.state(), state_file)
        child = subprocess.Popen(
            [sys.executable, "-c", _STALLED_WRITER, self.local, state_file, str(step), repr(self.cfg),
             repr(self.persist_url), str(expiry)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self._child_env())
        try:
            line = child.stdout.readline()
            if "committed" not in line:
                child.kill()
                self.fail(f"the writer to be stalled did not commit: {child.stderr.read()[-2000:]}")
            self.line.commit(step, values)
            child.send_signal(signal.SIGSTOP)
            time.sleep(expiry * 1.5)
            self.trainee.train("plain")
            mine, mine_values = step + 1, flat(self.trainee.state())
            with no_file_locks():
                self.ckpt = self._open(lease_expiry=expiry)
                try:
                    self.ckpt.save(self.trainee.state(), step=mine, metadata=step_metadata(mine)).wait()
                except CheckpointError as exc:
                    self.fail(f"a new writer after the old one's lease expired could not commit: {exc}")
                self.line.commit(mine, mine_values)
                self.next_step = mine + 1
                child.send_signal(signal.SIGCONT)
                out, err = child.communicate("go\n", timeout=120)
                self._close()
        finally:
            if child.returncode is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
                child.wait()
        self.ckpt = self._open()
        self.log.append(f"  (stalled writer: {out.strip()[:200]})")
        if "refused" not in out:
            self.fail(f"the writer whose lease expired (no file locks), continued after a new writer "
                      f"committed step {mine}, was not refused its save of step {mine + 1}: it said {out!r} "
                      f"{err[-1500:]}")

    def _settle_if_quiet(self) -> None:
        self._wait()
        self._settle()

    RULES = ("train", "save", "wait", "burst", "rollback", "crash", "kill", "kill_in_commit", "takeover", "restart",
             "lose_local", "corrupt", "prune", "fail_next", "outage", "heal", "corrupt_meta", "prune_in_flight",
             "prune_beside_commit", "reshape", "lease_expiry", "preempt")
    #: Rules that start a process (seconds each): under LAZYCKPT_MODEL_KILLS in the hypothesis machine.
    SPAWNING = ("kill", "kill_in_commit", "takeover", "lease_expiry")

    # -- invariants
    def check(self) -> None:
        if self.distributed or self.cfg.replicas:
            self._wait()                 # collective loads need the same listing on every rank
        self._settle()
        if self.predicts_steps:
            listed_now = self.ckpt.steps()
            if self.expected is None:
                self.expected = listed_now
            elif listed_now != self.expected:
                self.fail(f"keep={self.policy!r}: the directory holds steps {listed_now}, the policy leaves "
                          f"{self.expected} (missing {sorted(set(self.expected) - set(listed_now))}, not deleted "
                          f"{sorted(set(listed_now) - set(self.expected))}); losses "
                          f"{ {s: loss_of(s) for s in sorted(set(listed_now) | set(self.expected))} }")
        latest = self.line.latest()
        hits = self._hits()
        try:
            got = self.ckpt.load()
        except CheckpointNotFoundError:
            got = None
        except CheckpointError as exc:
            # The latest only on the store (after lose_local), its read failed by a fault.
            if isinstance(exc, CorruptCheckpointError) or not self._excused(hits):
                raise
            return
        if latest is None:
            if got is not None:
                self.fail(f"load() returned step {self.ckpt.loaded_from['step']} but nothing is on the line "
                          f"(abandoned or lost: {[s for s, _ in self.line.abandoned]})")
        else:
            if got is None:
                self.fail(f"load() found nothing; the line's latest is step {latest[0]}")
            step = self.ckpt.loaded_from["step"]
            if step != latest[0] or not same(latest[1], flat(got)):
                self.fail(f"load() returned step {step} from the {self.ckpt.loaded_from['tier']} tier, "
                          f"the line's latest is step {latest[0]}"
                          + self._which(step, flat(got)))
        listed = self._listed()
        if self.cfg.replicas:
            # load() is collective there: every rank asks for the same step. A node that lost its
            # directory holds only what was restored (the latest): the steps every node lists.
            import torch.distributed as dist
            everyone: List[Any] = [None] * self.world
            dist.all_gather_object(everyone, sorted(listed))
            listed = set.intersection(*map(set, everyone))
        for s in sorted(listed):
            hits = self._hits()
            try:
                got = self.ckpt.load(step=s)
            except CheckpointError as exc:
                if isinstance(exc, CheckpointNotFoundError):
                    pass
                elif not isinstance(exc, CorruptCheckpointError) and self._excused(hits):
                    continue            # a step only on the store, its read failed by a fault
                else:
                    raise
                # Retention may be running since the listing (keep_last once drained,
                # persist_keep_last): once it has ended, a step still listed must load.
                if s in self.line.steps and not self.cfg.replicas:
                    self._wait()
                    if s in self._listed():
                        try:
                            got = self.ckpt.load(step=s)
                        except CheckpointNotFoundError:
                            if self._excused(hits):
                                continue        # the store's listing failed by a fault: local only
                            self.fail(f"step {s} is listed and on the line but load(step={s}) finds nothing")
                    else:
                        continue
                else:
                    continue
            values = flat(got)
            expected = self.line.steps.get(s)
            if expected is None or not same(expected, values):
                self.fail(f"load(step={s}) from the {self.ckpt.loaded_from['tier']} tier"
                          + self._which(s, values))
        if (self.rank == 0 or self.cfg.replicas) and os.path.isdir(self.local):
            # The index (latest step in a few stats) says what the listing says (issue 34).
            for problem in index_problems(self.local, f"after {self.log[-1] if self.log else 'the start'}"):
                self.fail(problem)
            if self.cfg.persist and not self._store_down():
                self._wait()            # the drain has published what it will
                persist = checkpointer_kwargs(self.cfg, self.persist_url, **self.knobs)["persist"]
                for problem in remote_index_problems(persist.url, dict(persist.storage_options),
                                                     f"after {self.log[-1] if self.log else 'the start'}"):
                    self.fail(problem)
                for problem in tiers_index_problems(self.ckpt, f"after {self.log[-1] if self.log else 'the start'}"):
                    self.fail(problem)
        if (self.rank == 0 or self.cfg.replicas) and self.ckpt.steps():
            report = lzverify.verify(store=LOCAL, path=self.local)
            if not report.ok:
                self.fail(f"lazyckpt verify {self.local}: {[p.message for p in report.problems][:3]}")
            for s in self.ckpt.steps():
                # Every commit records what its save cost (issue 26), well-formed.
                try:
                    cost = lzresolve.read_manifest(LOCAL, self.ckpt.step_path(s)).get("cost")
                except CheckpointNotFoundError:
                    continue                # retention ran since the listing
                if cost is None or cost_problems(cost):
                    self.fail(f"step {s}: its manifest's save costs are {cost!r}: {cost_problems(cost)}")
        last = self.log[-1].split("(")[0] if self.log else ""
        if last in STORE_ALONE_AFTER and not self._store_down():
            self._check_store_alone(strict=False, why=f"after {last}")
        if last in STUDY_AFTER:
            self.check_study()

    def check_study(self) -> None:
        """The study (issue 26) against the oracle, on STUDY_KEYS only (cheap):
        ``lazyckpt.trajectory(fn="norm")`` over the kept steps (both tiers) lists
        only the line's steps, every kept step of the line, each with the norms of
        that step's save; ``lazyckpt.diff`` of the latest against earlier kept
        steps (the previous, the oldest, the newest held only by the persistent
        tier) gives the model's max|a-b|, fraction changed and relative change,
        and reports unchanged by reference only tensors that are equal. Read on
        rank 0 (a plain tensor's value is rank 0's), the others wait."""
        self._wait()
        self._settle()
        if self._store_down():
            return                      # the study lists the store: not during an outage
        problems: List[str] = []
        if self.rank == 0:
            hits = self._hits()
            try:
                problems = self._study_problems()
            except CheckpointError as exc:
                problems = [] if self._excused(hits) else [f"{type(exc).__name__}: {exc}"]
            except Exception as exc:
                problems = [f"{type(exc).__name__}: {exc}"]
        self._barrier()
        if problems:
            self.fail(f"study (diff/trajectory) of {self.local}: {problems[:4]}")

    def _study_problems(self) -> List[str]:
        from lazyckpt.study import run_steps
        # With replicas= a node's steps persist under persist_url/node_NNNNN: the tier's own URL.
        persist = self.ckpt.persistent.dir.url if self.ckpt.persistent is not None else None
        kept_on_line = self._listed() & set(self.line.steps)
        located = run_steps(self.local, persist_to=persist) if self.ckpt.steps() or persist else []
        if not located:
            return [f"no kept step, but the line's steps {sorted(kept_on_line)} are listed"] if kept_on_line else []
        problems: List[str] = []
        table = lazyckpt.trajectory(self.local, keys=list(STUDY_KEYS), fn="norm", persist_to=persist).table()
        steps = sorted({s for per_step in table.values() for s in per_step})
        if steps != sorted(s for s, _, _ in located):
            problems.append(f"trajectory steps {steps} != run_steps {[s for s, _, _ in located]}")
        if sorted(table) != sorted(STUDY_KEYS):
            problems.append(f"trajectory keys {sorted(table)}")
        if not kept_on_line <= set(steps):
            problems.append(f"trajectory misses kept steps of the line {sorted(kept_on_line - set(steps))} "
                            f"(it has {steps})")
        for s in steps:
            expected = self.line.steps.get(s)
            if expected is None:
                problems.append(f"trajectory has step {s}, not on the line "
                                f"({'abandoned' if any(a == s for a, _ in self.line.abandoned) else 'never saved'})")
                continue
            for key in STUDY_KEYS:
                want = float(torch.linalg.vector_norm(expected["/" + key].double()))
                got = table.get(key, {}).get(s)
                if got is None or not _close(got, want):
                    stale = [a for a, v in self.line.abandoned
                             if a == s and _close(got, float(torch.linalg.vector_norm(v["/" + key].double())))]
                    problems.append(f"trajectory step {s} {key}: norm {got}, its save's is {want}"
                                    + (" (an ABANDONED save's)" if stale else ""))
        latest = steps[-1]
        where = {s: loc for s, _, loc in located}
        earlier = [steps[-2]] if len(steps) > 1 else []
        earlier += [steps[0]] if steps[0] not in earlier and steps[0] != latest else []
        only_persistent = [s for s, tier, _ in located if tier == "persistent" and s != latest]
        earlier += [only_persistent[-1]] if only_persistent and only_persistent[-1] not in earlier else []
        for s in earlier:
            if s not in self.line.steps or latest not in self.line.steps:
                continue                      # reported above
            report = lazyckpt.diff(where[s], where[latest], keys=list(STUDY_KEYS))
            rows = {r.key: r for r in report.rows}
            if sorted(rows) != sorted(STUDY_KEYS) or report.skipped:
                problems.append(f"diff {s} {latest}: rows {sorted(rows)}, skipped {report.skipped}")
                continue
            for key in STUDY_KEYS:
                problems += _diff_row_problems(f"diff {s} {latest} {key}", rows[key],
                                               self.line.steps[s]["/" + key], self.line.steps[latest]["/" + key])
        return problems

    def _listed(self) -> set:
        listed = set(self.ckpt.steps())
        if self.ckpt.persistent is not None:
            hits = self._hits()
            try:
                listed |= set(self.ckpt.persistent.dir.committed())
            except CheckpointError:
                if not self._excused(hits):
                    raise               # only the injected faults excuse it
        return listed

    def _which(self, step: int, values: Dict[str, Any]) -> str:
        for s, v in self.line.abandoned:
            if s == step and same(v, values):
                return f": an ABANDONED save of step {step}"
        expected = self.line.steps.get(step)
        if expected is None:
            return f": step {step} is not on the line (abandoned or never saved)"
        return f": values differ from step {step}'s save in {tensor_diff(expected, values)[:6]}"

    def close(self) -> None:
        try:
            if self.ckpt is not None:
                self._close()
                self.ckpt = None
        finally:
            if self._sigusr1_before is not None:
                # A crashed (dropped, never closed) Checkpointer leaves its handler installed:
                # the process's handler as it was before this run.
                signal.signal(signal.SIGUSR1, self._sigusr1_before)


#: The rules after which the model still knows which steps retention left (Run.expected).
FOLLOWED = ("train", "save", "wait", "burst", "rollback", "restart", "reshape", "preempt")

#: The tensors check_study follows: one per kind of writer (AdamW, BatchNorm stats and
#: counter, fused AdamW's step, numpy/collective writes, the replicated buffer).
STUDY_KEYS = ("a/0.weight", "a/1.running_mean", "a/1.num_batches_tracked", "b/bias", "opt_a/state/0/exp_avg",
              "opt_b/state/0/step", "shared/buf")
#: check() runs check_study after these rules (they wait anyway: no wait is added) and at the end.
STUDY_AFTER = ("wait", "rollback")
#: check() reads the persistent tier alone (through the server, not the proxy) after these
#: (it drained the tier; and rule_heal, strictly).
STORE_ALONE_AFTER = ("wait",)


def _close(got: float, want: float) -> bool:
    return got == want or abs(got - want) <= 1e-9 * max(abs(got), abs(want))


def _diff_row_problems(where: str, row: Any, a: torch.Tensor, b: torch.Tensor) -> List[str]:
    """A diff row against the two saves' values (float64, as the study computes)."""
    x, y = a.double(), b.double()
    equal = torch.equal(a, b)
    changed = int((a != b).sum())
    max_abs = float((x - y).abs().max()) if a.numel() else 0.0
    norm_a = float(torch.linalg.vector_norm(x))
    norm_d = float(torch.linalg.vector_norm(x - y))
    rel = 0.0 if equal else (norm_d / norm_a if norm_a > 0 else float("inf"))
    out = []
    if row.shape != list(a.shape) or row.dtype != str(a.dtype).replace("torch.", ""):
        out.append(f"{where}: shape/dtype {row.shape} {row.dtype}")
    if row.by_reference and not equal:
        out.append(f"{where}: reported unchanged by reference, but {changed} elements differ")
    if row.changed != changed or not _close(row.frac_changed, changed / a.numel() if a.numel() else 0.0):
        out.append(f"{where}: {row.changed} changed ({row.frac_changed}), the saves differ in {changed}")
    if not _close(row.max_abs_diff, max_abs):
        out.append(f"{where}: max|a-b| {row.max_abs_diff}, the saves' is {max_abs}")
    if not (rel == row.rel_change or _close(row.rel_change, rel)):
        out.append(f"{where}: relative change {row.rel_change}, the saves' is {rel}")
    return out


# ----------------------------------------------------------------- random programs

#: Saves in one ``burst`` (past history.RECENT_EVENTS = 256), and with tiers or
#: several ranks (each save there costs an upload or a round).
BURST_STEPS = 300
BURST_STEPS_TIERS = 24

#: Relative weights of the rules in a random program.
WEIGHTS = {"train": 6, "save": 6, "wait": 2, "burst": 1, "rollback": 2, "crash": 1, "kill": 1, "kill_in_commit": 1,
           "takeover": 1, "restart": 1, "lose_local": 1, "corrupt": 1, "prune": 1,
           "corrupt_meta": 1, "prune_in_flight": 1, "prune_beside_commit": 1, "reshape": 1, "lease_expiry": 1}
#: The fault rules (persist_to, one rank): in random programs with ``faults=True``
#: (scripts/soak_model.py --faults); elsewhere they are no-ops.
FAULT_WEIGHTS = {"fail_next": 1, "outage": 1, "heal": 1}


def random_program(seed: int, length: int, cfg: Config, faults: bool = False) -> List[Tuple[str, int]]:
    rng = random.Random(seed)
    weights_of = {**WEIGHTS, **(FAULT_WEIGHTS if faults and cfg.persist and cfg.ranks == 1 else {})}
    rules = [r for r in weights_of if r != "lose_local" or cfg.persist or cfg.replicas or rng.random() < 0.5]
    weights = [weights_of[r] for r in rules]
    return [(rng.choices(rules, weights)[0], rng.randrange(1 << 16)) for _ in range(length)]


def run_program(cfg: Config, base: str, persist_url: Optional[str], program: List[Tuple[str, int]],
                rank: int = 0, world: int = 1, knobs: Optional[Dict[str, Any]] = None,
                faults: Optional[Faults] = None) -> List[str]:
    """Run ``program`` with an invariant check after every rule; raise InvariantError
    naming the rule index and the program prefix that reproduces it. ``knobs``:
    run_knobs' draw; ``faults``: the proxy the persist URL goes through (then the
    program ends with a ``heal``: the store must catch up)."""
    log: List[str] = []
    run = Run(cfg, base, persist_url, rank, world, log, knobs=knobs, faults=faults)
    if run.faults is not None:
        program = list(program) + [("heal", 0)]
    try:
        run.check()
        for i, (rule, arg) in enumerate(program):
            try:
                run.apply(rule, arg)
                run.check()
            except Exception as exc:
                raise InvariantError(f"{cfg.id}: rule {i} {rule}({arg}) of program {program[:i + 1]}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        try:
            run.check_study()
        except Exception as exc:
            raise InvariantError(f"{cfg.id}: the final study check after program {program}: "
                                 f"{type(exc).__name__}: {exc}") from exc
    finally:
        try:
            run.close()
        except Exception:
            pass
    return log
