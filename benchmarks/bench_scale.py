"""How lazyckpt's multi-rank commit scales with the number of ranks.

Parts, each optional (``--parts``; default scale,throughput,merge,store):

``scale``       For each world size in ``--worlds``, that many real processes
                (spawn, gloo process group, tcp init on a free port, one thread
                each) save ``--saves`` checkpoints of ``--mib`` MiB per rank
                through ``Checkpointer(dir, keep=2)``, ``handle.wait()``
                after each. Phases per save are taken from monotonic
                timestamps (CLOCK_MONOTONIC, comparable across processes on
                one machine) recorded by a forwarding proxy around the
                checkpointer's store and timing wrappers around the coordinator
                instance's ``_commit``/``_apply_retention``; no library code is
                changed. Before each world the memory it needs is predicted
                from the per-process memory measured in the previous one; the
                sweep stops at the largest world that fits ``--mem-budget-gib``.
``throughput``  1, 2 and 4 ranks each writing ``--throughput-mib`` MiB (scaled
                so the total stays <= 2 GiB): aggregate GB/s against one
                process writing the same total with raw O_DIRECT, 4 threads.
``merge``       In-process, no ranks: the coordinator's JSON work for a
                DTensor-sharded state of R ranks x T tensors (Llama-7B-like
                names and shapes, FSDP Shard(0)): parsing the done values,
                ``lazyckpt.formats.manifest.shard_index``, dumping the manifest, and
                parsing it again (what every rank does to load).
``store``       One real TCPStore (server + one client, in-process): wait,
                multi_get and N delete_key calls for N done values of the sizes
                above, as the coordinator issues them.
``limit``       Two reproductions: a rank's done value over the libuv store's
                8 MiB message limit; a manifest over MAX_MANIFEST_BYTES that
                commits (and lets retention delete the older step) but cannot
                be loaded.

    python benchmarks/bench_scale.py                       # the default parts
    python benchmarks/bench_scale.py --parts scale --worlds 1,2,4 --saves 3
    python benchmarks/bench_scale.py --parts scale --state dtensor --worlds 2,8
    python benchmarks/bench_scale.py --parts merge --merge-ranks 8,1024 --merge-tensors 300
    python benchmarks/bench_scale.py --parts limit

Timings on an oversubscribed machine (64 processes on 2 cores) are dominated
by scheduling; the CPU-independent columns (store requests, bytes through the
store, manifest bytes, the coordinator thread's CPU time) are printed apart.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GiB = 1 << 30
MiB = 1 << 20


def _checkpoint_file(cls, path, options):
    """A CheckpointFile on the local store (older trees took no store)."""
    try:
        from lazyckpt.storage.stores import LOCAL
        return cls(path, options, store=LOCAL)
    except (ImportError, TypeError):
        return cls(path, options)


def now() -> float:
    """Monotonic seconds, the same clock in every process of this machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def proc_memory() -> Dict[str, int]:
    """This process's memory, bytes: rss, pss, uss (private), hwm (peak rss)."""
    out = {"rss": 0, "pss": 0, "uss": 0, "hwm": 0}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if not parts or not parts[0].isdigit():
                    continue
                kb = int(parts[0]) * 1024
                if name == "Rss":
                    out["rss"] = kb
                elif name == "Pss":
                    out["pss"] = kb
                elif name in ("Private_Clean", "Private_Dirty"):
                    out["uss"] += kb
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    out["hwm"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


# ============================================================================ instrumentation


class StoreProbe:
    """Forwards every call to the checkpointer's store; records what it sent.

    Each event: (op, keys, t_start, t_end, bytes_sent, bytes_received,
    thread_cpu_at_end). The checkpointer sees the store's behaviour unchanged.
    """

    def __init__(self, store: Any):
        self._store = store
        self.events: List[Tuple] = []
        self._lock = threading.Lock()

    def _rec(self, op: str, keys: List[str], t0: float, sent: int = 0, recv: int = 0) -> None:
        t1 = now()
        with self._lock:
            self.events.append((op, tuple(keys), t0, t1, sent, recv, time.thread_time()))

    def set(self, key, value):
        t0 = now()
        self._store.set(key, value)
        self._rec("set", [key], t0, sent=len(value) + len(key))

    def get(self, key):
        t0 = now()
        value = self._store.get(key)
        self._rec("get", [key], t0, sent=len(key), recv=len(value))
        return value

    def multi_get(self, keys):
        t0 = now()
        values = self._store.multi_get(keys)
        self._rec("multi_get", list(keys), t0, sent=sum(map(len, keys)), recv=sum(len(v) for v in values))
        return values

    def wait(self, keys, *args):
        t0 = now()
        self._store.wait(keys, *args)
        self._rec("wait", list(keys), t0, sent=sum(map(len, keys)))

    def check(self, keys):
        t0 = now()
        ok = self._store.check(keys)
        self._rec("check", list(keys), t0, sent=sum(map(len, keys)))
        return ok

    def delete_key(self, key):
        t0 = now()
        ok = self._store.delete_key(key)
        self._rec("delete_key", [key], t0, sent=len(key))
        return ok

    def __getattr__(self, name):
        return getattr(self._store, name)

    def take(self, seq: int) -> List[Tuple]:
        """The events of save ``seq`` (keys ``<seq>/...``), removed from the log."""
        prefix = f"{seq}/"
        with self._lock:
            mine = [e for e in self.events if e[1] and all(k.startswith(prefix) for k in e[1])]
            self.events = [e for e in self.events if e not in mine]
        return mine


def _timed_class_method(cls: Any, name: str, log: List[Tuple]) -> None:
    """Like _timed_method, for a method of every instance of ``cls`` (the
    commit strategy is made per save)."""
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t0, c0 = now(), time.thread_time()
        try:
            return inner(self, *args, **kwargs)
        finally:
            log.append((name, t0, now(), c0, time.thread_time()))
    setattr(cls, name, wrapper)


def _timed_method(obj: Any, name: str, log: List[Tuple]) -> None:
    """Shadow ``obj.name`` by an instance attribute recording (name, t0, t1, cpu0, cpu1)."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0, c0 = now(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            log.append((name, t0, now(), c0, time.thread_time()))
    setattr(obj, name, wrapper)


# ============================================================================ states

def llama7b_specs(n_tensors: int = 291) -> List[Tuple[List[str], List[int]]]:
    """(key path, global shape) of a Llama-7B-like model: 32 layers x 9 + 3 = 291
    tensors; more than 291 adds AdamW moments (exp_avg, exp_avg_sq) per parameter."""
    params: List[Tuple[str, List[int]]] = [("model.embed_tokens.weight", [32000, 4096])]
    for i in range(32):
        p = f"model.layers.{i}."
        params += [(p + "self_attn.q_proj.weight", [4096, 4096]), (p + "self_attn.k_proj.weight", [4096, 4096]),
                   (p + "self_attn.v_proj.weight", [4096, 4096]), (p + "self_attn.o_proj.weight", [4096, 4096]),
                   (p + "mlp.gate_proj.weight", [11008, 4096]), (p + "mlp.up_proj.weight", [11008, 4096]),
                   (p + "mlp.down_proj.weight", [4096, 11008]), (p + "input_layernorm.weight", [4096]),
                   (p + "post_attention_layernorm.weight", [4096])]
    params += [("model.norm.weight", [4096]), ("lm_head.weight", [32000, 4096])]
    specs = [(["model", name], shape) for name, shape in params]
    for moment in ("exp_avg", "exp_avg_sq"):
        specs += [(["optim", "state", name, moment], shape) for name, shape in params]
    if n_tensors > len(specs):
        raise ValueError(f"at most {len(specs)} Llama-like tensors")
    return specs[:n_tensors]


def shard0(shape: List[int], rank: int, world: int) -> Tuple[List[int], List[int]]:
    """Local shape and global offsets of ``rank``'s Shard(0) piece (torch's chunking)."""
    rows = shape[0]
    chunk = math.ceil(rows / world)
    start = min(rows, chunk * rank)
    n = max(0, min(rows, start + chunk) - start)
    return [n] + shape[1:], [start if n else 0] + [0] * (len(shape) - 1)


def synthetic_done(rank: int, world: int, specs: List[Tuple[List[str], List[int]]]) -> Dict[str, Any]:
    """The ``done`` value rank ``rank`` publishes for a state of FSDP Shard(0)
    DTensors, in the format ``DTensorProvider.save`` produces."""
    shards = []
    for e, (path, shape) in enumerate(specs):
        local_shape, offsets = shard0(shape, rank, world)
        stride = [int(math.prod(local_shape[i + 1:])) for i in range(len(local_shape))]
        local = {"$": "tensor", "dtype": "float32", "shape": local_shape, "stride": stride, "offset": 0,
                 "device": "cpu", "e": e}
        shards.append({"path": path, "global_shape": shape, "offsets": offsets, "local": local})
    return {"ok": True, "bytes": 123456789, "shards": shards, "digest": ""}


def manifest_like_commit(world: int, done: Dict[int, Dict[str, Any]], index: Dict[str, Any],
                         replicated: Optional[List[str]] = None, checksum: bool = True) -> Dict[str, Any]:
    """The manifest ``Checkpointer._commit`` builds (same keys, same order). Follows
    the installed lazyckpt (``formats.manifest.checksum``, with ``save_id``)."""
    from lazyckpt.formats import datafile as fmt
    from lazyckpt.formats import manifest as manifests
    from lazyckpt.formats.names import rank_filename
    manifest = {"format_version": fmt.FORMAT_VERSION, "step": 1000, "world_size": world,
                "files": [{"rank": r, "name": rank_filename(r), "bytes": done[r]["bytes"]}
                          for r in range(world)],
                "created_unix": time.time()}
    manifest["save_id"] = "0123456789ab-1"
    manifest["metadata"] = {}
    if index:
        manifest["shards"] = index
    if replicated:
        manifest["replicated"] = replicated
    if checksum:
        manifest["checksum"] = manifests.checksum(manifest)
    return manifest


def scale_specs(mib: float, tensors: int) -> List[Tuple[List[str], List[int]]]:
    """``tensors`` float32 tensors of [rows, 256] totalling ``mib`` MiB (per rank)."""
    per = max(1, int(mib * MiB / 4 / tensors / 256))
    return [(["model", f"layers.{i}.weight"], [per, 256]) for i in range(tensors)]


def make_state(mode: str, rank: int, world: int, mib: float, tensors: int) -> Tuple[Dict[str, Any], List[str]]:
    """(state, replicated keys) of ``mib`` MiB of float32 tensors on this rank."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    specs = scale_specs(mib, tensors)
    if mode == "plain":         # every rank its own tensors (weak scaling)
        return {"model": {p[1]: torch.rand(s, generator=g) for p, s in specs}, "rank": rank}, []
    if mode == "replicated":    # DDP: the same model everywhere, each entry written by one rank
        g0 = torch.Generator().manual_seed(7)
        return {"model": {p[1]: torch.rand(s, generator=g0) for p, s in specs},
                "rank_rng": torch.rand(16, generator=g)}, ["model"]
    if mode == "dtensor":       # FSDP-like: every tensor Shard(0) over all ranks, mib MiB local per rank
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        mesh = init_device_mesh("cpu", (world,))
        model = {}
        for p, s in specs:
            local = torch.rand(s, generator=g)
            model[p[1]] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                             shape=torch.Size([s[0] * world] + s[1:]),
                                             stride=tuple(local.stride()))
        return {"model": model}, []
    raise ValueError(mode)


# ============================================================================ the ranks

def _child(rank: int, world: int, port: int, out_dir: str, cfg: Dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    payload: Tuple[str, Any]
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        t_import = now()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg["timeout"]))
        body = _limit_child if cfg.get("body") == "limit" else _rank_main
        payload = ("ok", body(rank, world, cfg, t_import))
    except BaseException:
        payload = ("error", traceback.format_exc())
    path = os.path.join(out_dir, f"{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(path + ".tmp", path)
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _rank_main(rank: int, world: int, cfg: Dict[str, Any], t_import: float) -> Dict[str, Any]:
    import torch.distributed as dist
    import lazyckpt
    from lazyckpt.saving.commit import StepCommit
    state, replicated = make_state(cfg["state"], rank, world, cfg["mib"], cfg["tensors"])
    ckpt = lazyckpt.Checkpointer(cfg["dir"], keep=2, distributed=lazyckpt.Distributed(identical_keys=replicated),
                                 **cfg["knobs"])
    probe = None
    if ckpt._dist.distributed:
        probe = StoreProbe(ckpt._dist.store)
        ckpt._dist.store = probe
    calls: List[Tuple] = []
    if rank == 0:
        _timed_class_method(StepCommit, "_commit", calls)
        _timed_method(ckpt.layout, "apply_retention", calls)
    records = []
    mem_after_first = None
    for k in range(cfg["warmup"] + cfg["saves"]):
        dist.barrier()
        del calls[:]
        t0 = now()
        handle = ckpt.save(state, step=k)
        handle.wait()
        t1 = now()
        seq = f"c{ckpt._calls - 1}"
        rec: Dict[str, Any] = {"k": k, "t0": t0, "t1": t1, "capture_s": handle.capture_s,
                               "flush_s": handle.flush_s, "blocking_s": handle.blocking_s,
                               "bytes": handle.bytes, "warmup": k < cfg["warmup"]}
        if probe is not None:
            ev = probe.take(seq)
            rec["events"] = ev
            done_set = [e for e in ev if e[0] == "set" and e[1][0].endswith(f"/done/{rank}")]
            rec["done_t"] = (done_set[0][2], done_set[0][3]) if done_set else None
            if rank == 0 and rec["done_t"] is None:
                # The coordinator's own report does not go through the store: it is
                # done when it starts waiting for the others'.
                first = min((e[2] for e in ev), default=t1)
                rec["done_t"] = (first, first)
            rec["done_value_bytes"] = done_set[0][4] if done_set else 0
            rec["requests"] = len(ev)
            rec["sent"] = sum(e[4] for e in ev)
            rec["recv"] = sum(e[5] for e in ev)
            if rank == 0:
                mg = [e for e in ev if e[0] == "multi_get" and len(e[1]) == world - 1]
                out = [e for e in ev if e[0] == "set" and e[1][0].endswith("/outcome")]
                dels = [e for e in ev if e[0] == "delete_key"]
                rec["all_done_t"] = mg[0][3] if mg else None
                rec["all_done_cpu"] = mg[0][6] if mg else None
                rec["outcome_t"] = (out[0][2], out[0][3]) if out else None
                rec["outcome_cpu"] = out[0][6] if out else None
                rec["delete_s"] = sum(e[3] - e[2] for e in dels)
                rec["deletes"] = len(dels)
                rec["ops"] = {op: sum(1 for e in ev if e[0] == op) for op in sorted({e[0] for e in ev})}
        if rank == 0:
            commit = [c for c in calls if c[0] == "_commit"]
            ret = [c for c in calls if c[0] == "apply_retention"]
            rec["commit_t"] = (commit[0][1], commit[0][2]) if commit else None
            rec["commit_cpu"] = (commit[0][4] - commit[0][3]) if commit else None
            rec["retention_s"] = (ret[0][2] - ret[0][1]) if ret else 0.0
            rec["manifest_bytes"] = os.path.getsize(os.path.join(ckpt.step_path(k), "manifest.json"))
            rec.update(step_bytes(ckpt.step_path(k)))
            if k == cfg["warmup"] and cfg.get("keep_manifest"):
                with open(os.path.join(ckpt.step_path(k), "manifest.json"), "rb") as f:
                    rec["manifest"] = f.read()
        records.append(rec)
        if mem_after_first is None:
            mem_after_first = proc_memory()
    ckpt.close()
    return {"rank": rank, "records": records, "mem": mem_after_first, "mem_end": proc_memory(),
            "t_import": t_import}


class MemoryWatch(threading.Thread):
    """Samples MemAvailable; calls ``on_low`` once if it falls below ``floor``."""

    def __init__(self, floor: int, on_low):
        super().__init__(daemon=True)
        self.floor, self.on_low = floor, on_low
        self.start_avail = mem_available()
        self.min_avail = self.start_avail
        self.tripped = False
        self._halt = threading.Event()

    def run(self):
        while not self._halt.wait(0.2):
            avail = mem_available()
            self.min_avail = min(self.min_avail, avail)
            if avail < self.floor and not self.tripped:
                self.tripped = True
                self.on_low()

    def stop(self):
        self._halt.set()
        self.join()

    @property
    def peak_used(self) -> int:
        return self.start_avail - self.min_avail


def run_world(world: int, cfg: Dict[str, Any], floor: int) -> Dict[str, Any]:
    """Start ``world`` ranks, run ``_child`` in each, return results by rank (or why not)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lzc-scale-out-") as out_dir:
        procs = [ctx.Process(target=_child, args=(r, world, port, out_dir, cfg), daemon=True)
                 for r in range(world)]

        def kill_all():
            for p in procs:
                if p.is_alive():
                    p.kill()
        watch = MemoryWatch(floor, kill_all)
        watch.start()
        t_spawn = now()
        for p in procs:
            p.start()
        deadline = time.monotonic() + cfg["timeout"]
        try:
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
        finally:
            kill_all()
            for p in procs:
                p.join(5)
            watch.stop()
        results, errors = [], []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r} died (exit {p.exitcode})")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            else:
                results.append(value)
        if watch.tripped:
            errors.insert(0, f"killed: MemAvailable fell below {floor / GiB:.1f} GiB")
        if hung:
            errors.insert(0, f"ranks {hung[:8]}... still running after {cfg['timeout']} s")
        return {"world": world, "results": results, "errors": errors, "peak_used": watch.peak_used,
                "wall_s": now() - t_spawn,
                "startup_s": (max(r.get("t_import", t_spawn) for r in results) - t_spawn) if results else None}


# ============================================================================ analysis

def med(xs: List[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def analyse(run: Dict[str, Any]) -> Dict[str, Any]:
    """Per save, across ranks; then the median over the measured saves."""
    world = run["world"]
    by_rank = {r["rank"]: r["records"] for r in run["results"]}
    n_saves = len(by_rank[0])
    rows = []
    for k in range(n_saves):
        recs = [by_rank[r][k] for r in range(world)]
        if recs[0]["warmup"]:
            continue
        r0 = recs[0]
        t0 = min(r["t0"] for r in recs)
        row = {"total": max(r["t1"] - r["t0"] for r in recs),
               "span": max(r["t1"] for r in recs) - t0,
               "bytes": sum(r["bytes"] for r in recs),
               "capture": max(r["capture_s"] for r in recs),
               "manifest_bytes": r0["manifest_bytes"], "footer_bytes": r0["footer_bytes"],
               "metadata_bytes": r0["metadata_bytes"]}
        if world == 1:
            c0, c1 = r0["commit_t"]
            row.update(local=c0 - r0["t0"], coord=0.0, after_last=c1 - c0, skew=0.0,
                       coord_commit=c1 - c0, commit=c1 - c0, commit_cpu=r0["commit_cpu"],
                       retention=r0["retention_s"], deletes_s=0.0, deletes=0, fanout=0.0,
                       req_coord=0, req_other=0, sent_coord=0, recv_coord=0, sent_other=0, recv_other=0,
                       done_value_bytes=0, ops={})
        else:
            done_end = [r["done_t"][1] for r in recs]
            row.update(
                local=max(r["done_t"][0] - r["t0"] for r in recs),
                coord=max(r["t1"] - r["done_t"][1] for r in recs),
                skew=max(done_end) - min(done_end),
                after_last=max(r["t1"] for r in recs) - max(done_end),
                wait_all=r0["all_done_t"] - max(done_end),
                coord_commit=r0["outcome_t"][0] - r0["all_done_t"],
                commit=r0["commit_t"][1] - r0["commit_t"][0],
                commit_cpu=r0["outcome_cpu"] - r0["all_done_cpu"],
                retention=r0["retention_s"], deletes_s=r0["delete_s"], deletes=r0["deletes"],
                fanout=max(r["t1"] for r in recs) - r0["outcome_t"][1],
                req_coord=r0["requests"], req_other=max(r["requests"] for r in recs[1:]),
                sent_coord=r0["sent"], recv_coord=r0["recv"],
                sent_other=max(r["sent"] for r in recs[1:]), recv_other=max(r["recv"] for r in recs[1:]),
                done_value_bytes=max(r["done_value_bytes"] for r in recs), ops=r0["ops"])
        rows.append(row)
    out = {k: med([r[k] for r in rows]) for k in rows[0] if k != "ops"}
    out["ops"] = rows[0]["ops"]
    out["world"] = world
    out["saves"] = len(rows)
    mems = [r["mem"] for r in run["results"]]
    out["rss"] = max(m["rss"] for m in mems)
    out["uss"] = max(m["uss"] for m in mems)
    out["pss"] = max(m["pss"] for m in mems)
    out["hwm"] = max(m["hwm"] for m in mems)
    out["shared"] = max(m["rss"] - m["uss"] for m in mems)
    out["peak_used"] = run["peak_used"]
    out["startup_s"] = run["startup_s"]
    for r in run["results"]:
        for rec in r["records"]:
            if "manifest" in rec:
                out["manifest_raw"] = rec["manifest"]
    return out


def fmt_s(x: float) -> str:
    if x != x:
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f} us"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def predict_bytes(world: int, per_proc: int, shared: int) -> int:
    return world * per_proc + shared + 256 * MiB     # + the parent


# ============================================================================ parts

def part_scale(args, worlds: List[int], base_dir: str) -> List[Dict[str, Any]]:
    from _common import print_table
    budget = min(int(args.mem_budget_gib * GiB), mem_available() - GiB)
    floor = max(GiB, mem_available() - budget)
    print(f"\n## scale: state={args.state}, {args.mib} MiB/rank in {args.tensors} tensors, "
          f"{args.warmup} warm-up + {args.saves} measured saves, keep_last=2")
    print(f"memory budget {budget / GiB:.1f} GiB (MemAvailable {mem_available() / GiB:.1f} GiB; "
          f"children killed if it drops below {floor / GiB:.1f} GiB)")
    results = []
    per_proc, shared = None, None
    for world in worlds:
        if per_proc is not None:
            need = predict_bytes(world, per_proc, shared)
            if need > budget:
                print(f"world {world}: predicted {need / GiB:.1f} GiB ({per_proc / MiB:.0f} MiB private "
                      f"per process) > budget {budget / GiB:.1f} GiB: stopping at {results[-1]['world']}")
                break
        directory = os.path.join(base_dir, f"scale-{args.state}-w{world}")
        shutil.rmtree(directory, ignore_errors=True)
        cfg = {"dir": directory, "state": args.state, "mib": args.mib, "tensors": args.tensors,
               "saves": args.saves, "warmup": args.warmup, "timeout": args.timeout_base + 6 * world,
               "knobs": {}, "keep_manifest": True}
        run = run_world(world, cfg, floor)
        shutil.rmtree(directory, ignore_errors=True)
        if run["errors"]:
            print(f"world {world}: FAILED: " + "\n".join(run["errors"][:3]))
            break
        a = analyse(run)
        results.append(a)
        per_proc = max(a["uss"], a["hwm"] - a["shared"])
        shared = a["shared"]
        print(f"  world {world:3d}: {a['total']:.3f} s/save (median), spawn+import+init {a['startup_s']:.1f} s, "
              f"private {a['uss'] / MiB:.0f} MiB/proc, peak used {a['peak_used'] / GiB:.2f} GiB", flush=True)
    if not results:
        return results
    ref = next((r for r in results if r["world"] == 2), None)
    print("\nTime per save (median over saves; 'max' = slowest rank):")
    rows = []
    for a in results:
        ratio_after = a["after_last"] / ref["after_last"] if ref else float("nan")
        ratio_commit = a["coord_commit"] / ref["coord_commit"] if ref else float("nan")
        rows.append([str(a["world"]), f"{args.mib:g} MiB", fmt_s(a["total"]), fmt_s(a["local"]),
                     fmt_s(a["skew"]), fmt_s(a["coord"]), fmt_s(a["after_last"]), fmt_s(a["coord_commit"]),
                     fmt_s(a["commit"]), fmt_s(a["retention"]), fmt_s(a["deletes_s"]),
                     fmt_s(a["commit_cpu"]), fmt_s(a["fanout"]),
                     f"{ratio_after:.2f}" if a["world"] > 1 else "-",
                     f"{ratio_commit:.2f}" if a["world"] > 1 else "-"])
    print_table(["world", "state/rank", "total (max)", "local write (max)", "done skew", "coord (max)",
                 "after last done", "coord commit", "_commit", "retention", "key deletes",
                 "commit CPU", "fan-out", "after-last x vs 2", "coord commit x vs 2"], rows)
    print("\nCPU-independent, per save:")
    rows = []
    for a in results:
        w = a["world"]
        rows.append([str(w), str(int(a["manifest_bytes"])),
                     f"{(a['manifest_bytes'] - (results[0]['manifest_bytes'] if w > 1 else 0)) / max(1, w - 1):.0f}"
                     if w > 1 else "-",
                     str(int(a["footer_bytes"])), str(int(a["metadata_bytes"])),
                     str(int(a["done_value_bytes"])),
                     " ".join(f"{op}={n}" for op, n in a["ops"].items()) or "-",
                     str(int(a["req_other"])), str(int(a["req_coord"] + (w - 1) * a["req_other"])),
                     str(int(a["recv_coord"])), f"{a['rss'] / MiB:.0f}/{a['uss'] / MiB:.0f}",
                     f"{a['peak_used'] / GiB:.2f}"])
    print_table(["world", "manifest B", "B per extra rank", "footer B per rank", "non-data B of the step",
                 "done value B", "coordinator store requests",
                 "per other rank", "total requests", "coord recv B", "RSS/private MiB per proc",
                 "peak used GiB"], rows)
    return results


def step_bytes(step_dir: str) -> Dict[str, int]:
    """A committed step's bytes that are not tensor data: the manifest, and in
    every rank's file the header, footer, trailer and the padding that aligns
    entries (file size minus its entries' bytes)."""
    from lazyckpt.formats import datafile as fmt
    from lazyckpt.knobs import Options
    from lazyckpt.loading.reader import CheckpointFile
    manifest = os.path.getsize(os.path.join(step_dir, "manifest.json"))
    overhead, footers = 0, []
    for name in sorted(os.listdir(step_dir)):
        if name.endswith(".lzc"):
            f = _checkpoint_file(CheckpointFile, os.path.join(step_dir, name), Options())     # holds no descriptor
            overhead += f.size - sum(e.length for e in f.footer.entries if e.kind in ("data", "pickle"))
            with open(os.path.join(step_dir, name), "rb") as raw:
                raw.seek(-fmt.TRAILER_BYTES, os.SEEK_END)
                footers.append(fmt.parse_trailer(raw.read(), f.size, name, 1 << 30).footer_length)
    return {"metadata_bytes": manifest + overhead, "footer_bytes": int(statistics.median(footers))}


def part_throughput(args, base_dir: str) -> None:
    from _common import print_table, raw_write, remove
    print(f"\n## aggregate throughput: {args.throughput_saves} saves (+{args.warmup} warm-up), "
          f"total <= 2 GiB, O_DIRECT default knobs")
    floor = max(GiB, mem_available() - min(int(args.mem_budget_gib * GiB), mem_available() - GiB))
    rows = []
    for world in (1, 2, 4):
        mib = min(args.throughput_mib, 2048 // world)
        directory = os.path.join(base_dir, f"tput-w{world}")
        shutil.rmtree(directory, ignore_errors=True)
        cfg = {"dir": directory, "state": "plain", "mib": mib, "tensors": 16,
               "saves": args.throughput_saves, "warmup": args.warmup, "timeout": 600, "knobs": {},
               "keep_manifest": False}
        run = run_world(world, cfg, floor)
        shutil.rmtree(directory, ignore_errors=True)
        if run["errors"]:
            print(f"world {world}: FAILED: " + "\n".join(run["errors"][:3]))
            break
        a = analyse(run)
        os.sync()
        raw_path = os.path.join(base_dir, "raw.bin")
        raws = []
        for _ in range(args.throughput_saves):
            raws.append(raw_write(raw_path, int(a["bytes"]), threads=4))
            remove(raw_path)
        raw = statistics.median(raws)
        rows.append([str(world), f"{mib} MiB", f"{a['bytes'] / GiB:.2f} GiB", f"{a['span']:.2f} s",
                     f"{a['bytes'] / a['span'] / 1e9:.2f}", f"{a['local']:.2f} s", f"{a['after_last'] * 1e3:.1f} ms",
                     f"{a['retention'] * 1e3:.1f} ms",
                     f"{raw:.2f} s", f"{a['bytes'] / raw / 1e9:.2f}", f"{raw / a['span']:.2f}"])
        print(f"  world {world}: done", flush=True)
    print_table(["ranks", "per rank", "total", "save (first start -> last commit)", "aggregate GB/s",
                 "local write (max)", "commit after last done", "of which retention (rmtree old step)", "raw O_DIRECT 4 thr", "raw GB/s",
                 "lazyckpt / raw"], rows)


def _best(fn, reps: int, cpu: bool = False) -> Tuple[float, Any]:
    """Minimum seconds over ``reps`` calls, and the value. With ``cpu`` the
    calling thread's CPU time, which other processes on a shared machine do
    not inflate (the merge is single-threaded pure Python)."""
    clock = time.thread_time if cpu else now
    best, value = float("inf"), None
    for _ in range(reps):
        t = clock()
        value = fn()
        best = min(best, clock() - t)
    return best, value


def part_merge(args) -> None:
    from _common import print_table
    from lazyckpt.formats.manifest import MAX_MANIFEST_BYTES
    from lazyckpt.formats.manifest import checksum as manifest_checksum
    from lazyckpt.formats.manifest import parse as parse_manifest
    try:
        from lazyckpt.formats.manifest import shard_index
    except ImportError:             # a tree from before it moved out of distributed.py
        from lazyckpt.distributed import shard_index
    print("\n## coordinator merge cost, in-process, synthetic Llama-7B-like FSDP Shard(0) state "
          f"(simulated: no ranks, no store). CPU seconds of this thread, best of {args.merge_reps} "
          f"below 100k pieces, else 1 run")
    rows = []
    for tensors in [int(t) for t in args.merge_tensors.split(",")]:
        specs = llama7b_specs(tensors)
        for ranks in [int(r) for r in args.merge_ranks.split(",")]:
            pieces = ranks * tensors
            reps = args.merge_reps if pieces < 100_000 else 1
            raw_done = [json.dumps(synthetic_done(r, ranks, specs)).encode() for r in range(ranks)]
            t_loads, done = _best(lambda: {r: json.loads(v.decode()) for r, v in enumerate(raw_done)},
                                  reps, cpu=True)
            t_index, index = _best(lambda: shard_index(done), reps, cpu=True)
            manifest = manifest_like_commit(ranks, done, index, checksum=False)
            t_sum, manifest["checksum"] = _best(lambda: manifest_checksum(manifest), reps, cpu=True)
            t_dump, text = _best(lambda: json.dumps(manifest, indent=1).encode(), reps, cpu=True)
            t_compact, compact = _best(lambda: json.dumps(manifest).encode(), reps, cpu=True)

            def parse():
                try:
                    parse_manifest(text, "synthetic")
                    return "ok"
                except Exception as exc:
                    return type(exc).__name__
            parsed = parse()
            t_parse, _ = _best(lambda: json.loads(text), reps, cpu=True)
            t_parse_compact, _ = _best(lambda: json.loads(compact), reps, cpu=True)
            rows.append([str(ranks), str(tensors), str(pieces), f"{sum(map(len, raw_done)) / ranks / 1e3:.1f} kB",
                         f"{sum(map(len, raw_done)) / 1e6:.1f} MB", fmt_s(t_loads), fmt_s(t_index),
                         fmt_s(t_sum), fmt_s(t_dump), f"{len(text) / 1e6:.2f} MB", f"{len(text) / pieces:.0f}",
                         fmt_s(t_compact), f"{len(compact) / 1e6:.2f} MB", fmt_s(t_parse),
                         fmt_s(t_parse_compact), "yes" if len(text) > MAX_MANIFEST_BYTES else "no", parsed])
            raw_done = done = index = manifest = text = compact = None     # free before the next size
            print(f"  {ranks} ranks x {tensors} tensors done", flush=True)
    rep = []
    for ranks in [int(r) for r in args.merge_ranks.split(",")]:
        done = {r: {"bytes": 123456789} for r in range(ranks)}
        text = json.dumps(manifest_like_commit(ranks, done, {}, ["model"]), indent=1).encode()
        rep.append([str(ranks), f"{len(text)}", f"{len(text) / ranks:.0f}"])
    print_table(["ranks", "tensors", "pieces", "done value/rank", "all done values", "json.loads done values",
                 "shard_index", "manifest_checksum (commit, and each load)", "dumps indent=1 (as _commit)", "manifest", "B/piece", "dumps compact",
                 "compact", "json.loads manifest (each loading rank)", "loads compact",
                 f"> MAX_MANIFEST_BYTES ({MAX_MANIFEST_BYTES >> 20} MiB)", "parse_manifest result"], rows)
    print("\nReplicated (DDP) state, no shard index: manifest bytes")
    print_table(["ranks", "manifest B", "B per rank"], rep)


def part_store(args) -> None:
    """One real TCPStore (libuv server) and one client in this process: the
    coordinator's store operations at N ranks, without N processes."""
    import torch.distributed as dist
    from _common import print_table
    print("\n## TCPStore, measured in-process: one server, one client (the coordinator's side of a save)")
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store = dist.PrefixStore("lazyckpt/bench/0/", client)
    t_rtt, _ = _best(lambda: [store.check(["x"]) for _ in range(1000)], 3)
    rtt = t_rtt / 1000
    rows = []
    value_sizes = {"replicated (66 B)": 66, "7B FSDP, 300 tensors (~72 kB)": 72_000,
                   "7B FSDP + AdamW, 873 tensors (~210 kB)": 210_000}
    for label, size in value_sizes.items():
        value = b"x" * size
        for ranks in [int(r) for r in args.merge_ranks.split(",")]:
            keys = [f"1/done/{r}" for r in range(ranks)]
            t_set = now()
            for k in keys:
                store.set(k, value)
            t_set = now() - t_set
            t_wait, _ = _best(lambda: store.wait(keys, timedelta(seconds=60)), 3)
            t_mget, vals = _best(lambda: store.multi_get(keys), 3)
            t_del = now()
            for k in keys:
                store.delete_key(k)
            t_del = now() - t_del
            rows.append([label, str(ranks), f"{ranks * size / 1e6:.2f} MB", fmt_s(t_set / ranks),
                         fmt_s(t_wait), fmt_s(t_mget), fmt_s(t_del), f"{t_del / ranks * 1e6:.0f} us"])
    print(f"round trip of one request (check): {rtt * 1e6:.0f} us")
    print_table(["done values", "ranks", "bytes", "set (per rank, 1 client)", "wait(all keys)",
                 "multi_get(all)", "delete_key x ranks (as _save_one)", "per delete"], rows)
    store = client = None
    del server          # the server last


def _limit_child(rank: int, world: int, cfg: Dict[str, Any], t_import: float) -> Dict[str, Any]:
    import torch
    import lazyckpt
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(1, 1)
    state = {"model": {f"t{i}": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                   shape=torch.Size([world, 1]), stride=(1, 1))
                       for i in range(cfg["tensors"])}}
    ckpt = lazyckpt.Checkpointer(cfg["dir"], keep=1)
    ckpt.save({"model": {"t0": state["model"]["t0"]}}, step=1).wait()     # small: loads fine
    out = {"rank": rank, "step1_load": _try_load(ckpt, 1)}
    t = now()
    try:
        ckpt.save(state, step=2).wait()                                      # large shard index
        out["step2_save"] = f"committed in {now() - t:.1f} s"
    except Exception as exc:
        out["step2_save"] = f"{type(exc).__name__}: {exc}"[:300]
        return out
    out["committed_steps"] = ckpt.steps()
    if rank == 0:
        out["step2_manifest_bytes"] = os.path.getsize(os.path.join(ckpt.step_path(2), "manifest.json"))
    out["step2_load"] = _try_load(ckpt, 2)[:300]
    ckpt.close()
    return out


def _try_load(ckpt: Any, step: int) -> str:
    try:
        ckpt.load(step)
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def part_limit(args, base_dir: str) -> None:
    """Reproductions of two size limits a DTensor state reaches as tensors x ranks grow.

    (a) a rank's ``done`` value (its whole shard list) above the libuv TCPStore's
        8 MiB message limit: the store drops the connection, the save fails;
    (b) a manifest above MAX_MANIFEST_BYTES: the save commits, retention
        (keep_last=1) deletes the older loadable step, and loading fails.
    """
    from lazyckpt.formats.manifest import MAX_MANIFEST_BYTES
    cases = [("a: done value > 8 MiB store limit", 2, args.limit_store_tensors),
             (f"b: manifest > MAX_MANIFEST_BYTES ({MAX_MANIFEST_BYTES} B)", 8, args.limit_tensors)]
    floor = max(GiB, mem_available() - min(int(args.mem_budget_gib * GiB), mem_available() - GiB))
    for label, world, tensors in cases:
        print(f"\n## limit {label}: {world} ranks x {tensors} tiny Shard(0) DTensors "
              f"({world * tensors} pieces)", flush=True)
        directory = os.path.join(base_dir, "limit")
        shutil.rmtree(directory, ignore_errors=True)
        cfg = {"dir": directory, "tensors": tensors, "timeout": 900, "body": "limit"}
        run = run_world(world, cfg, floor)
        for e in run["errors"]:
            print(e[-1500:])
        for r in sorted(run["results"], key=lambda r: r["rank"]):
            print(f"rank {r['rank']}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "rank"))
        shutil.rmtree(directory, ignore_errors=True)


def part_validate(results: List[Dict[str, Any]], args) -> None:
    """Compare the measured DTensor manifests with what the synthetic generator
    of benchmarks/bench_metadata.py assumes (issue 12): no listed pieces, one
    placement-derived layout per tensor, the files as run-length sizes."""
    from _common import print_table
    rows = []
    for a in results:
        raw = a.get("manifest_raw")
        if raw is None:
            continue
        world = a["world"]
        real = json.loads(raw)
        mesh = {"shape": [world], "start": 0, "strides": [1]}
        specs = [(p, [s[0] * world] + s[1:]) for p, s in scale_specs(args.mib, args.tensors)]
        predicted = {json.dumps(list(p), separators=(",", ":")): {
            "global_shape": shape, "dtype": "float32", "layout": {"mesh": mesh, "placements": [["S", 0]]}}
            for p, shape in specs}
        got = {json.dumps(json.loads(k), separators=(",", ":")): v for k, v in real.get("layouts", {}).items()}
        rows.append([str(world), str(len(raw)), "yes" if "shards" in real else "no", str(len(real.get("file_bytes", []))),
                     "yes" if got == predicted else "no"])
    if rows:
        print("\nDTensor manifests: measured against the synthetic generator of bench_metadata.py")
        print_table(["world", "measured B", "lists pieces", "file size runs", "layouts as predicted"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="scale,throughput,merge,store",
                   help="any of scale,throughput,merge,store,limit")
    p.add_argument("--worlds", default="1,2,4,8,16,32,64")
    p.add_argument("--mib", type=float, default=1.0, help="state per rank, MiB (scale part)")
    p.add_argument("--tensors", type=int, default=8, help="tensors per rank (scale part)")
    p.add_argument("--state", choices=["plain", "replicated", "dtensor"], default="plain")
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured saves first")
    p.add_argument("--throughput-mib", type=int, default=512)
    p.add_argument("--throughput-saves", type=int, default=3)
    p.add_argument("--merge-ranks", default="8,64,256,1024")
    p.add_argument("--merge-tensors", default="300,873")
    p.add_argument("--merge-reps", type=int, default=3)
    p.add_argument("--limit-store-tensors", type=int, default=60_000,
                   help="DTensors per rank, limit reproduction (a), 2 ranks")
    p.add_argument("--limit-tensors", type=int, default=30_000,
                   help="DTensors per rank, limit reproduction (b), 8 ranks")
    p.add_argument("--mem-budget-gib", type=float, default=20.0)
    p.add_argument("--timeout-base", type=float, default=180.0, help="seconds per world, + 6 s per rank")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    worlds = [int(w) for w in args.worlds.split(",")]
    from _common import machine_line
    print(machine_line())
    print(f"load average {os.getloadavg()[0]:.2f}, MemAvailable {mem_available() / GiB:.1f} GiB")
    base = args.dir or tempfile.mkdtemp(prefix="lzc-scale-")
    os.makedirs(base, exist_ok=True)
    try:
        if "scale" in parts:
            results = part_scale(args, worlds, base)
            if args.state == "dtensor":
                part_validate(results, args)
        if "throughput" in parts:
            part_throughput(args, base)
        if "merge" in parts:
            part_merge(args)
        if "store" in parts:
            part_store(args)
        if "limit" in parts:
            part_limit(args, base)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
