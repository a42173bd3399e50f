"""Multi-rank coordination: who is this rank, and the two-phase commit.

Coordination goes through the torch.distributed *store* (the key-value store
every process group is built on), never through a process group: commits
run on a background thread and must not issue collectives that could
interleave with (or deadlock against) the training's own NCCL/gloo calls.
Every wait polls with a deadline, so a dead rank turns into a
``CheckpointError`` on the others instead of a hang.

Commit protocol for one save (sequence number ``seq``, the same on every
rank because every rank calls ``save()`` in the same order)::

    all ranks:    write and fsync DIR/.tmp-step_N-<run>/rank_<r>.lzc
                  set  <seq>/done/<r> = {"ok": true, bytes, shards, digest} (or the error)
    coordinator:  wait for every done/<r> (deadline); check digests agree
                  write manifest.json (with the global shard index), fsync,
                  rename the directory to DIR/step_N, fsync DIR, retention, latest
                  set  <seq>/outcome = "committed"   (or "failed: why", and remove the directory)
    other ranks:  wait for <seq>/outcome (deadline); committed -> handle done
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List

from .errors import CheckpointError

_instances: Dict[str, int] = {}


@dataclass
class RankInfo:
    rank: int = 0
    world_size: int = 1
    store: Any = None           # a PrefixStore private to this checkpointer, or None
    run_id: str = ""
    timeout_s: float = 600.0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- store helpers

    def publish(self, key: str, value: Dict[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def wait_for(self, keys: List[str], what: str, step: int) -> Dict[str, Dict[str, Any]]:
        """Wait (bounded by ``timeout_s``) until every key is set; return their values.

        One blocking ``store.wait`` for all keys: the store answers when the last
        one arrives, so the coordinator sends O(1) requests, not a poll per rank.
        """
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as exc:        # the store raises on timeout (its own error types)
            missing = [k for k in keys if not self.store.check([k])]
            if not missing:
                return self._get_all(keys)
            raise CheckpointError(f"step {step}: timed out after {self.timeout_s:.0f} s waiting for "
                                  f"{what} ({len(missing)} of {len(keys)} missing: {missing[:4]}); "
                                  f"a rank may have died ({type(exc).__name__})", step=step) from None
        return self._get_all(keys)

    def _get_all(self, keys: List[str]) -> Dict[str, Dict[str, Any]]:
        raw = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else \
            [self.store.get(k) for k in keys]
        return {k: json.loads(bytes(v).decode()) for k, v in zip(keys, raw)}

    def delete(self, keys: List[str]) -> None:
        for k in keys:
            try:
                self.store.delete_key(k)
            except Exception:   # some stores cannot delete; the keys are tiny
                pass


def rank_info(directory: str, process_group: Any = None, timeout_s: float = 600.0) -> RankInfo:
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
    count = _instances.get(key, 0)
    _instances[key] = count + 1
    store = dist.PrefixStore(f"lazyckpt/{key}/{count}/", base)
    if rank == 0:
        run_id = uuid.uuid4().hex[:12]
        store.set("run_id", run_id)
    else:
        run_id = store.get("run_id").decode()
    return RankInfo(rank=rank, world_size=world, store=store, run_id=run_id, timeout_s=timeout_s)


def shard_index(done: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """Merge every rank's DTensor shards into the manifest's global index:
    logical tensor (its key path as JSON) -> global shape, dtype, pieces."""
    index: Dict[str, Any] = {}
    for rank in sorted(done):
        for shard in done[rank].get("shards", []):
            key = json.dumps(shard["path"])
            local = shard["local"]
            entry = index.setdefault(key, {"global_shape": shard["global_shape"],
                                           "dtype": local["dtype"], "pieces": []})
            if entry["global_shape"] != shard["global_shape"]:
                raise CheckpointError(f"DTensor {key} has global shape {entry['global_shape']} on one rank "
                                      f"and {shard['global_shape']} on rank {rank}")
            entry["pieces"].append({"rank": rank, "offsets": shard["offsets"], "tensor": local})
    return index
