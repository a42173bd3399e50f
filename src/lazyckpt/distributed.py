"""Multi-rank coordination: who is this rank, and the two-phase commit.

Coordination goes through the torch.distributed *store* (the key-value store
every process group is built on), never through a process group: commits
run on a background thread and must not issue collectives that could
interleave with (or deadlock against) the training's own NCCL/gloo calls.
Every wait has a deadline, so a dead rank turns into a ``CheckpointError`` on
the others instead of a hang.

Keys. Every collective call (``Checkpointer.save``, a DeepSpeed tag) gets a
*call key*: a counter that advances on every call, accepted or refused, so it
is the same on every rank as long as every rank makes the same calls in the
same order -- even when an argument check refuses a call on one rank only.
A refused call publishes its failure under its key at once, so the step it
was for fails on every rank without waiting for a deadline, and the next call
commits normally.

Two-phase commit of one call (:func:`agree`)::

    all ranks:    write and fsync their data (into a shared temporary place)
                  set  <key>/done/<rank> = {"ok": true, ...report} (or the error)
    coordinator:  wait for every done/<rank> (deadline), check them,
                  make the checkpoint visible (``on_all_done``: manifest,
                  rename, fsyncs), then set <key>/outcome = {"ok": true}
                  (or the error; nothing becomes visible)
    other ranks:  wait for <key>/outcome (deadline); ok -> committed
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

from .errors import CheckpointError

_instances: Dict[str, int] = {}
#: Longest single blocking store request (see RankInfo.wait_for).
WAIT_SLICE_S = 0.25


@dataclass
class RankInfo:
    rank: int = 0
    world_size: int = 1
    store: Any = None           # a PrefixStore private to this checkpointer, or None
    run_id: str = ""
    timeout_s: float = 600.0
    departed: bool = False      # depart() ran: a second close of the same owner does nothing

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- store helpers

    def publish(self, key: str, value: Dict[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def wait_for(self, keys: List[str], what: str, step: Any) -> Dict[str, Dict[str, Any]]:
        """Wait (bounded by ``timeout_s``) until every key is set; return their values.

        Blocking ``store.wait`` calls for all keys at once: the store answers
        when the last one arrives, so the coordinator sends O(1) requests per
        slice, not a poll per rank. Slices of ``WAIT_SLICE_S``: a store client
        serializes its requests, and one long wait would hold up every other
        thread of this process using the store (the commit of the next save
        and the persistent tier's drain wait for each other's keys).
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            t0 = time.monotonic()
            left = deadline - t0
            try:
                self.store.wait(keys, timedelta(seconds=max(0.001, min(WAIT_SLICE_S, left))))
                return self._get_all(keys)
            except Exception as exc:    # the store raises on timeout (its own error types)
                if time.monotonic() < deadline:
                    # An immediate failure (not a timeout) must not become a busy loop.
                    time.sleep(max(0.0, WAIT_SLICE_S / 4 - (time.monotonic() - t0)))
                    continue
                missing = [k for k in keys if not self.store.check([k])]
                if not missing:
                    return self._get_all(keys)
                raise CheckpointError(f"{_what(step)}: timed out after {self.timeout_s:.0f} s waiting for "
                                      f"{what} ({len(missing)} of {len(keys)} missing: {missing[:4]}); "
                                      f"a rank may have died ({type(exc).__name__})", step=_step(step)) from None

    def _get_all(self, keys: List[str]) -> Dict[str, Dict[str, Any]]:
        raw = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else \
            [self.store.get(k) for k in keys]
        return dict(zip(keys, parse_values(raw)))

    def delete(self, keys: List[str] = (), after: Optional[str] = None,
               through: Optional[str] = None, before: Optional[str] = None) -> None:
        """Delete ``keys`` from the store now (one request each); or, with
        ``after`` (a call key such as ``"c12"`` or ``"persist/3"``, or ``"*"``),
        remember them to delete once that call is finished wherever they are
        read. ``through``/``before`` (a call key): also delete now the keys
        remembered under calls of the same sequence (the key without its
        number) numbered up to and including / below that one, and every
        ``"*"`` key. What is safe when is decided by the callers (:func:`agree`,
        :func:`refuse`): deletes stay O(1) per call and rank, never N on one."""
        import re
        import threading

        def seq(key: str):
            m = re.fullmatch(r"(.*?)(\d+)", key)
            return (m.group(1), int(m.group(2))) if m else (key, None)

        state = self.__dict__
        with state.setdefault("_deferred_lock", threading.Lock()):
            deferred: Dict[str, Any] = state.setdefault("_deferred", {})
            now = list(dict.fromkeys(keys)) if after is None else []
            if after is not None:
                for k in keys:
                    deferred[k] = ("*", None) if after == "*" else seq(after)
            for k in now:
                deferred.pop(k, None)
            bound = through if through is not None else before
            if bound is not None:
                prefix, n = seq(bound)
                last = None if n is None else (n if through is not None else n - 1)
                for k, (p, m) in list(deferred.items()):
                    if p == "*" or (p == prefix and m is not None and last is not None and m <= last):
                        del deferred[k]
                        now.append(k)
        for k in now:
            try:
                self.store.delete_key(k)
            except Exception:   # some stores cannot delete; the keys are tiny
                pass


def parse_values(raw: List[bytes]) -> List[Any]:
    """Store values (JSON, one per key) parsed in one ``json.loads`` call: at
    16,384 ranks the coordinator's commit CPU was mostly per-call overhead of
    16,384 small parses (73 ms against 27-37 ms joined, benchmarks/bench_metadata.py)."""
    if not raw:
        return []
    import gc
    # Thousands of small dicts at once would trigger the cyclic collector's full
    # passes (measured: 37 ms median, 126-144 ms with a collection); they hold no cycles.
    paused = len(raw) > 1000 and gc.isenabled()
    if paused:
        gc.disable()
    try:
        values = json.loads(b"[" + b",".join(bytes(v) for v in raw) + b"]")
    finally:
        if paused:
            gc.enable()
    if len(values) != len(raw):         # a value that was not one JSON document
        raise CheckpointError(f"the store returned {len(raw)} values that parse as {len(values)}")
    return values


def agree(d: RankInfo, key: str, report: Dict[str, Any], step: Any,
          on_all_done: Callable[[Dict[int, Dict[str, Any]]], Optional[Dict[str, Any]]],
          forget: List[str] = ()) -> Dict[str, Any]:
    """Publish this rank's ``report`` for ``key``; the coordinator waits for
    every rank's, calls ``on_all_done`` with them (rank -> report) and publishes
    the outcome (with what ``on_all_done`` returned added); the others wait for
    it. Returns the outcome on every rank. Raises ``CheckpointError`` if any
    rank failed, the coordinator's action failed, or a deadline passed.

    Store keys are deleted O(1) per rank and call, never N by the coordinator:
    each other rank deletes its own report once it has read the outcome (the
    coordinator has read every report by then), and the coordinator's own
    report never goes through the store. The coordinator deletes its keys of
    earlier calls of the same sequence (outcomes, ``ready``; and ``forget``)
    once every rank has reported on this call through ``agree``: each rank
    runs its calls of a sequence in order, so all of them are past those."""
    if not d.coordinator:
        mine = f"{key}/done/{d.rank}"
        d.publish(mine, report)
        outcome = d.wait_for([f"{key}/outcome"], "the coordinator's commit", step)[f"{key}/outcome"]
        # Published by agree: the coordinator has read this call's reports and is past
        # every earlier call, so this rank's reports of earlier refused calls can go too.
        # Refused there: nobody reads this call's reports.
        d.delete([mine], through=None if outcome.get("refused") else key)
        if not outcome.get("ok"):
            raise CheckpointError(f"{_what(step)}: not committed: {outcome.get('error')}", step=_step(step))
        return outcome
    keys = [f"{key}/done/{r}" for r in range(1, d.world_size)]
    outcome = f"{key}/outcome"
    try:
        values = d.wait_for(keys, "every rank's data", step) if keys else {}
        done = {0: json.loads(json.dumps(report))}     # as the others' arrive: a JSON copy
        done.update((r, values[k]) for r, k in enumerate(keys, 1))
        failed = {r: v.get("error") for r, v in done.items() if not v.get("ok")}
        if failed:
            raise CheckpointError(f"{_what(step)}: " + "; ".join(f"rank {r} failed: {e}"
                                                                 for r, e in sorted(failed.items())),
                                  step=_step(step))
        value = {**(on_all_done(done) or {}), "ok": True}
    except BaseException as exc:
        d.publish(outcome, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        d.delete([outcome], after=key)
        raise
    d.publish(outcome, value)
    # Every rank reported through agree (a refused call's report is never ok): the
    # outcomes and ready keys of earlier calls have been read by all who read them.
    d.delete(list(forget), before=key)
    d.delete([outcome], after=key)
    return value


def refuse(d: RankInfo, key: str, error: BaseException) -> None:
    """A call refused on this rank: fail its key on every rank now (never raises).

    On the coordinator: the outcome, and ``<key>/ready`` (which ranks wait for
    before they write, see ``StepCommit.begin``), so the others fail this call
    at once. On another rank: its report, deleted at once if the coordinator
    has already published this call's outcome (then it never reads it), else
    with this rank's next outcome read through :func:`agree`."""
    value = {"ok": False, "refused": True, "error": f"refused: {type(error).__name__}: {error}"}
    try:
        if d.coordinator:
            # The outcome first: a rank that sees ``ready`` failed finds it already there.
            d.publish(f"{key}/outcome", value)
            d.publish(f"{key}/ready", value)
            d.delete([f"{key}/outcome", f"{key}/ready"], after=key)
        else:
            mine = f"{key}/done/{d.rank}"
            d.publish(mine, value)
            if d.store.check([f"{key}/outcome"]):
                d.delete([mine])
            else:
                d.delete([mine], after=key)
    except Exception as exc:            # the store may be gone; the deadline still bounds the wait
        import logging
        logging.getLogger("lazyckpt").warning("lazyckpt: could not publish a refused call: %s", exc)


def depart(d: RankInfo, bound_s: Optional[float] = None) -> None:
    """This rank is done with the store (the last act of a collective close).

    The coordinator returns only once every rank has called it (bounded by
    ``bound_s``, else ``d.timeout_s``): with ``init_method="env://"`` or
    ``tcp://`` the store lives in global rank 0's process, and once that
    process exits every request of the others fails. A rank descheduled
    between the coordinator's last outcome and its own read of it would wait
    for the dead store until its deadline and report a committed step as
    failed. One counter key: O(1) requests per rank; the rank that brings it
    to ``world_size`` sets the key the coordinator waits on.

    A rank that never departs (it died, or closes much later) costs the
    coordinator the bound and a warning, not an error: its own close did all
    it had to. Once per RankInfo: a second call (a second close) does nothing."""
    if not d.distributed or d.departed:
        return
    d.departed = True
    import dataclasses
    import logging
    try:
        if d.store.add("departed", 1) == d.world_size:
            d.publish("all_departed", {})
        if d.coordinator:
            bounded = d if bound_s is None else dataclasses.replace(d, timeout_s=min(bound_s, d.timeout_s))
            bounded.wait_for(["all_departed"], "every rank's close", "close")
            d.delete(["departed", "all_departed"])
    except Exception as exc:            # the store may be gone (a rank 0 that exited first)
        logging.getLogger("lazyckpt").warning("lazyckpt: close: not every rank was seen closing: %s", exc)


def _what(step: Any) -> str:
    return f"step {step}" if isinstance(step, int) else str(step)


def _step(step: Any) -> Any:
    return step if isinstance(step, int) else None


def rank_info(directory: str, process_group: Any = None, timeout_s: float = 600.0,
              namespace: str = "") -> RankInfo:
    """This process's place in the job, and a store namespace agreed by all ranks.

    Collective when a process group is initialized: every rank must create
    its Checkpointer for the same directory in the same order. Pass
    ``process_group=False`` for a checkpointer local to this process (e.g. one
    used on rank 0 only): no coordination at all.
    """
    if process_group is False:
        return RankInfo()
    try:
        import torch.distributed as dist
    except ImportError:
        return RankInfo()
    if not (dist.is_available() and dist.is_initialized()):
        return RankInfo()
    group = process_group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        return RankInfo(rank=0, world_size=1)
    base = dist.distributed_c10d._get_default_store()
    key = hashlib.sha1(directory.encode()).hexdigest()[:16]
    if group is not None and world != dist.get_world_size():
        # Sub-groups (one per node, for node-local directories) may name the same path
        # on every node: the group's first global rank keeps their keys apart.
        key += f"-g{dist.get_global_rank(group, 0)}"
    key += namespace
    count = _instances.get(key, 0)
    _instances[key] = count + 1
    store = dist.PrefixStore(f"lazyckpt/{key}/{count}/", base)
    if rank == 0:
        run_id = uuid.uuid4().hex[:12]
        store.set("run_id", run_id)
    else:
        run_id = store.get("run_id").decode()
    info = RankInfo(rank=rank, world_size=world, store=store, run_id=run_id, timeout_s=timeout_s)
    if rank == 0:
        info.delete(["run_id"], after="*")      # every rank has read it once any call agreed
    return info

