"""Store and file-system operations of one multi-rank save (docs/SCALING.md,
"What one save does, as a function of N ranks"): O(1) store requests on the
coordinator (no N deletes), one ``mkdir`` of the temporary step directory
(by the coordinator; the others wait for its ``ready`` key), and a store that
stays bounded over many saves, refused and failed calls included."""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch

import lazyckpt
from _dist import run_ranks

pytestmark = pytest.mark.timeout(600)


class _CountingStore:
    """Forwards to the checkpointer's store; counts each request by method."""

    def __init__(self, store):
        self._store = store
        self.calls = collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)
        return call


def _record_step_mkdirs():
    """Record every mkdir of a temporary step directory in this process
    (os.makedirs goes through os.mkdir), attempts that fail included."""
    made = []
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if ".tmp-step_" in os.fspath(path):
            made.append(os.fspath(path))
        return real(path, *args, **kwargs)
    os.mkdir = mkdir
    return made


def _ops_per_save(rank, world, directory, saves):
    made = _record_step_mkdirs()
    with lazyckpt.Checkpointer(directory, keep=2, distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        ckpt.save({"w": torch.full((64,), float(rank))}, step=0).wait()     # warm-up
        proxy = _CountingStore(ckpt._dist.store)
        ckpt._dist.store = proxy
        for step in range(1, saves + 1):
            ckpt.save({"w": torch.full((64,), float(rank + step))}, step=step).wait()
        steps = ckpt.steps()
        counts = dict(proxy.calls)          # the saves' requests (close adds a constant few: depart)
    return {"counts": counts, "mkdirs": made, "steps": steps}


def test_store_requests_and_mkdirs_per_save_do_not_grow_with_ranks(tmp_path):
    saves = 5
    runs = {world: run_ranks(world, _ops_per_save, str(tmp_path / f"w{world}"), saves, timeout=300)
            for world in (2, 4)}
    coordinator = {}
    for world, results in runs.items():
        assert results[0]["steps"] == [saves - 1, saves], results[0]
        for rank, r in enumerate(results):
            c = r["counts"]
            # Temporary step directories: one mkdir per save, on the coordinator only.
            if rank == 0:
                assert len(r["mkdirs"]) == saves + 1 and len(set(r["mkdirs"])) == saves + 1, r["mkdirs"]
            else:
                assert r["mkdirs"] == [], (world, rank, r["mkdirs"])
            if rank != 0:
                # Its own report, deleted once it read the outcome.
                assert c.get("delete_key", 0) == saves, (world, rank, c)
        c = results[0]["counts"]
        # The outcome and ready keys of the call before: 2, whatever the number of ranks.
        assert c.get("delete_key", 0) == 2 * saves, (world, c)
        # Everything but the blocking waits (slices of 0.25 s: their number depends on
        # how long the others take) is a fixed number of requests per save.
        coordinator[world] = {k: v for k, v in c.items() if k not in ("wait", "check")}
        assert c.get("wait", 0) >= saves, (world, c)
    assert coordinator[2] == coordinator[4], coordinator
    assert coordinator[2] == {"set": 2 * saves, "multi_get": saves, "delete_key": 2 * saves}, coordinator


def _many_saves(rank, world, directory, schedule):
    import torch.distributed as dist
    base = dist.distributed_c10d._get_default_store()
    dist.barrier()
    before = base.num_keys()
    keys, outcomes, elapsed = [], [], []
    with lazyckpt.Checkpointer(directory, keep=2, distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        for step, who in enumerate(schedule):
            refused_here = who == "all" or who == rank
            t0 = time.monotonic()
            try:
                handle = ckpt.save({"w": torch.full((64,), float(rank + step))}, step=step,
                                   metadata={"bad": object()} if refused_here else None)
                handle.wait()
                outcomes.append("ok")
            except (ValueError, lazyckpt.CheckpointError) as exc:
                outcomes.append(type(exc).__name__)
            elapsed.append(time.monotonic() - t0)
            dist.barrier()
            keys.append(base.num_keys())
            # No rank moves on before both counted: after the last call the other one would
            # close, and its departure key (distributed.depart) raced this count (CI: 3 > 2).
            dist.barrier()
        steps = ckpt.steps()
    dist.barrier()
    return {"before": before, "keys": keys, "after": base.num_keys(), "outcomes": outcomes,
            "elapsed": elapsed, "steps": steps}


def test_store_stays_bounded_over_many_saves_refused_and_failed_ones_included(tmp_path):
    # 30 calls on 2 ranks: refused on rank 1 only, on the coordinator only, on both.
    schedule = [None] * 30
    for i in (4, 17):
        schedule[i] = 1
    for i in (9, 22):
        schedule[i] = 0
    for i in (13, 26):
        schedule[i] = "all"
    r0, r1 = run_ranks(2, _many_saves, str(tmp_path), schedule, timeout=400)
    for i, who in enumerate(schedule):
        if who is None:
            assert r0["outcomes"][i] == r1["outcomes"][i] == "ok", (i, r0, r1)
        else:
            refused = [r0, r1] if who == "all" else [(r0, r1)[who]]
            others = [r for r in (r0, r1) if all(r is not x for x in refused)]
            assert all(r["outcomes"][i] == "ValueError" for r in refused), (i, r0, r1)
            assert all(r["outcomes"][i] == "CheckpointWriteError" for r in others), (i, r0, r1)
    # No refused call waited for a deadline (a refused coordinator fails the
    # others' wait for its ready key at once).
    assert max(r0["elapsed"] + r1["elapsed"]) < 20, (r0["elapsed"], r1["elapsed"])
    assert r0["steps"] == [28, 29], r0["steps"]
    # Keys of this checkpointer's namespace: a few (this call's outcome and ready,
    # a refused report not yet known to be read), never one per call or per rank.
    extra = [k - r0["before"] for k in r0["keys"]]
    print("extra keys after each call:", extra, "after close:", r0["after"] - r0["before"])
    assert max(extra) <= 6, extra
    assert extra[-1] <= 2 and max(extra[10:]) <= max(extra[:10]) + 1, extra
    assert r0["after"] - r0["before"] <= 2, (r0["before"], r0["after"])


def test_manifest_bytes_do_not_grow_with_ranks(tmp_path):
    """Issue 12: the files are listed as run-length sizes, and multi-rank
    files are padded to a multiple of 4 KiB, so ranks holding the same amount
    of state share one size: the manifest is the same size at 4 and 4,096 ranks."""
    import json

    from lazyckpt.formats import manifest
    run_ranks(4, _ops_per_save, str(tmp_path), 1, timeout=300)
    step = tmp_path / "step_0000000001"
    doc = json.loads((step / "manifest.json").read_text())
    assert "files" not in doc and len(doc["file_bytes"]) == 1, doc
    (size, count), = doc["file_bytes"]
    assert count == 4 and size % 4096 == 0
    assert all((step / f"rank_{r:05d}.lzc").stat().st_size == size for r in range(4))
    assert lazyckpt.load(str(tmp_path))["w"].eq(1.0).all()     # rank 0 + step 1

    def build(world):
        done = {r: {"ok": True, "step": 1, "bytes": size, "digest": None, "references": []}
                for r in range(world)}
        return manifest.build(1, done, "run-c1", {"step": 1}, [])
    small, large = build(4), build(4096)
    assert len(large) - len(small) <= 8, (len(small), len(large))     # the world_size digits
    parsed = manifest.parse(large, "m")
    assert len(parsed["files"]) == 4096 and parsed["files"][4095] == {
        "rank": 4095, "name": "rank_04095.lzc", "bytes": size}
