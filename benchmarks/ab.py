"""A/B of one measurement: this tree's lazyckpt against a baseline tree, interleaved.

    .venv/bin/python benchmarks/ab.py METRIC --baseline BASE [--this THIS] [--rounds N] [--dir D] [--set key=value ...]
    .venv/bin/python benchmarks/ab.py --list

BASE is a git commit (checked out with ``git worktree add`` into a temporary
folder, removed afterwards), a worktree or clone of the repository, or its
``src`` folder; THIS (the same forms) defaults to this working tree, so a
recorded before/after reruns as ``--this AFTER --baseline BEFORE``. Each round runs one child process per tree with that tree's
``src`` first on ``PYTHONPATH`` (same state, same disk, same server), in ABBA
order (which tree goes first alternates, so a drift during the run favours
neither); the parent prints the medians per tree and the ratio this/baseline.
The parent imports neither torch nor lazyckpt: it only orchestrates.

The children use only the public API, spelled so that it works before and
after the 0.2 option groups (``_checkpointer`` below), so any two trees of
this repository compare. Metrics that read cold need to drop the page cache
(root); without it they say so and measure warm reads, for both trees alike.
Absolute figures on a shared VM drift between runs: compare the ratio.

The registry (``METRICS``) holds what the one-off ``ab_*.py`` scripts measured;
BENCHMARKS.md ("A/B between trees") says which figure each reproduced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
THIS_SRC = os.path.join(ROOT, "src")


# --- what every child may use -------------------------------------------------------------------

def _drop_caches() -> bool:
    """Drop the page cache (root only). Not the package's helper: its module
    path may differ between the trees compared."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _raw_read(path: str, direct: bool, threads: int = 4, chunk: int = 32 << 20) -> float:
    """Seconds to read ``path`` (its size rounded down to 4 KiB) in ``chunk``
    pieces from ``threads`` threads into fresh page-aligned memory: O_DIRECT
    or buffered. The same code for both trees, so the ceiling is one method."""
    nbytes = os.path.getsize(path) // 4096 * 4096
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    try:
        t0 = time.perf_counter()
        buf = mmap.mmap(-1, nbytes)
        view = memoryview(buf)

        def one(offset: int) -> None:
            end = min(offset + chunk, nbytes)
            while offset < end:
                offset += os.preadv(fd, [view[offset:end]], offset)

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(0, nbytes, chunk)))
        seconds = time.perf_counter() - t0
        view.release()
        buf.close()
        return seconds
    finally:
        os.close(fd)


def _best_raw_read(path: str) -> float:
    """The faster of the raw O_DIRECT and buffered reads, each cold."""
    _drop_caches()
    direct = _raw_read(path, True)
    _drop_caches()
    return min(direct, _raw_read(path, False))


def _checkpointer(directory: str, keep: Optional[int] = None, **kw: Any) -> Any:
    """A Checkpointer spelled for the tree on PYTHONPATH: the 0.2 groups
    (``keep=``, ``Replicas``, ``Distributed``) where it has them, else the flat
    keywords of 0.1. ``kw``: replicas, node_size, commit_timeout."""
    import inspect

    import lazyckpt
    params = inspect.signature(lazyckpt.Checkpointer).parameters
    if "keep" in params:
        args: Dict[str, Any] = {"keep": keep}
        if "replicas" in kw:
            args["replicas"] = lazyckpt.Replicas(kw["replicas"], node_size=kw.get("node_size"))
        if "commit_timeout" in kw:
            args["distributed"] = lazyckpt.Distributed(commit_timeout=kw["commit_timeout"])
    else:
        args = {"keep_last": keep}
        if "replicas" in kw:
            args.update(replicas=kw["replicas"], node_size=kw.get("node_size"))
        if "commit_timeout" in kw:
            args["commit_timeout_s"] = kw["commit_timeout"]
    return lazyckpt.Checkpointer(directory, **args)


def _state(mib: float, tensors: int) -> Dict[str, Any]:
    import torch
    torch.manual_seed(0)
    n = max(1, int(mib * (1 << 20)) // 4 // tensors)
    return {f"layer{i}.weight": torch.randn(n) for i in range(tensors)}


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- the measurements: each returns {figure: value} for one round -----------------------------

def m_trees(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """lazyckpt.save (durable on return) and its cold load; a Checkpointer step
    saved until committed and its cold load; the same on the S3 server when
    the parent started one. Every load checked bit-exact."""
    import torch

    import lazyckpt
    state = _state(o["mib"], o["tensors"])
    state["step"] = 7
    out: Dict[str, float] = {}

    def same(loaded: Any) -> None:
        assert loaded["step"] == 7 and all(torch.equal(loaded[k], v) for k, v in state.items() if k != "step")

    path = os.path.join(work, "state.lzc")
    out["file_save_s"] = _timed(lambda: lazyckpt.save(state, path))
    _drop_caches()
    t0 = time.perf_counter()
    same(lazyckpt.load(path))
    out["file_load_s"] = time.perf_counter() - t0
    places = [("step", os.path.join(work, "run"))]
    if os.environ.get("AB_S3_URL"):
        places.append(("s3", os.environ["AB_S3_URL"]))
    for key, directory in places:
        with _checkpointer(directory) as ck:
            out[f"{key}_save_s"] = _timed(lambda: ck.save(state, step=1).wait())
        _drop_caches()
        with _checkpointer(directory) as ck:
            t0 = time.perf_counter()
            same(ck.load(step=1))
            out[f"{key}_load_s"] = time.perf_counter() - t0
    return out


def m_commit(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """What a commit's bookkeeping costs, the disk's share made small (4 KiB):
    save() blocking and save().wait() keeping 3 steps (saves 11..110), every
    step kept (1..100), a rollback (steps 1..5, load 2, save 3: ten times),
    and opening the 100-step directory plus loading its latest step."""
    import torch
    state = {"w": torch.randn(1024), "step": 0}
    blocking, commit, keepall, rollback = [], [], [], []
    with _checkpointer(os.path.join(work, "keep3"), keep=3) as ck:
        for step in range(1, 111):
            t0 = time.perf_counter()
            handle = ck.save(state, step=step)
            t1 = time.perf_counter()
            handle.wait()
            if step > 10:
                blocking.append((t1 - t0) * 1e3)
                commit.append((time.perf_counter() - t0) * 1e3)
    directory = os.path.join(work, "keepall")
    with _checkpointer(directory) as ck:
        for step in range(1, 101):
            keepall.append(_timed(lambda: ck.save(state, step=step).wait()) * 1e3)
    t0 = time.perf_counter()
    with _checkpointer(directory) as ck:
        ck.load()
    open_load = (time.perf_counter() - t0) * 1e3
    for i in range(10):
        with _checkpointer(os.path.join(work, f"rollback{i}")) as ck:
            for step in range(1, 6):
                ck.save(state, step=step).wait()
            ck.load(step=2)
            rollback.append(_timed(lambda: ck.save(state, step=3).wait()) * 1e3)
    return {"blocking_ms": statistics.median(blocking), "commit_ms": statistics.median(commit),
            "commit_keepall_ms": statistics.median(keepall), "rollback_ms": statistics.median(rollback),
            "open_load_ms": open_load}


def m_save_cpu(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """What a save costs the process: the first lazyckpt.save of a fresh process
    (512 MiB; bimodal on this VM, read it over many rounds), the median of
    saves 2..8, and a Checkpointer step of a model-like state (192 weights, 96
    optimizer entries with Python objects, 48 MiB): user+system CPU of every
    thread and wall time until committed, median of saves 5..24."""
    import resource

    import torch

    import lazyckpt

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    big = _state(512, 32)
    torch.manual_seed(0)
    model = {"model": {f"layers.{i}.{k}": torch.randn(256, 256) for i in range(48) for k in "qkvo"},
             "optim": {"state": {i: {"exp_avg": torch.randn(256, 256), "step": i} for i in range(96)}, "lr": 1e-3},
             "step": 0}
    saves = []
    for i in range(8):
        saves.append(_timed(lambda: lazyckpt.save(big, os.path.join(work, f"s{i}.lzc"))))
        if i >= 2:
            os.unlink(os.path.join(work, f"s{i - 2}.lzc"))
    cpus, walls = [], []
    with _checkpointer(os.path.join(work, "run"), keep=2) as ck:
        for step in range(1, 25):
            c0, t0 = cpu(), time.perf_counter()
            ck.save(model, step=step).wait()
            cpus.append((cpu() - c0) * 1e3)
            walls.append((time.perf_counter() - t0) * 1e3)
    return {"first_save_s": saves[0], "warm_save_s": statistics.median(saves[1:]),
            "step_cpu_ms": statistics.median(cpus[4:]), "step_wall_ms": statistics.median(walls[4:])}


def m_load_trees(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """A load's fixed costs per tensor: cold lazyckpt.load in a warm process (one
    untimed load, then 5 cold ones, each beside the best raw read of the same
    file), for the same bytes in ``tensors`` tensors. ``of_raw`` = raw/load."""
    import lazyckpt
    state = _state(o["gib"] * 1024, o["tensors"])
    path = os.path.join(work, "trees.lzc")
    lazyckpt.save(state, path)
    del state
    lazyckpt.load(path)
    loads, raws = [], []
    for _ in range(5):
        _drop_caches()
        loads.append(_timed(lambda: lazyckpt.load(path)))
        raws.append(_best_raw_read(path))
    return {"load_s": statistics.median(loads), "raw_s": statistics.median(raws),
            "of_raw": statistics.median(r / x for r, x in zip(raws, loads))}


def m_load_into(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """Cold load(into=) of an existing state of the same shapes (the restart of
    a built model), beside a plain cold load and the best raw read; ``reps``
    of each, interleaved."""
    import lazyckpt
    state = _state(o["gib"] * 1024, o["tensors"])
    path = os.path.join(work, "into.lzc")
    lazyckpt.save(state, path)
    into = {k: v.clone().zero_() for k, v in state.items()}
    del state
    times: Dict[str, List[float]] = {"into_s": [], "load_s": [], "raw_s": []}
    for _ in range(o["reps"]):
        _drop_caches()
        times["into_s"].append(_timed(lambda: lazyckpt.load(path, into=into)))
        _drop_caches()
        times["load_s"].append(_timed(lambda: lazyckpt.load(path)))
        times["raw_s"].append(_best_raw_read(path))
    return {k: statistics.median(v) for k, v in times.items()}


def m_save_over(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """lazyckpt.save over the file the previous save wrote (a job saving to one
    path every epoch) against a save to a new name, durable on return; the
    old file's release is waited for, untimed, before the next save."""
    import lazyckpt
    state = _state(o["gib"] * 1024, o["tensors"])
    over = os.path.join(work, "over.lzc")
    lazyckpt.save(state, over)
    times: Dict[str, List[float]] = {"over_s": [], "new_s": []}
    for i in range(o["reps"]):
        os.sync()
        times["over_s"].append(_timed(lambda: lazyckpt.save(state, over)))
        time.sleep(1.0)     # the release thread frees the replaced file
        os.sync()
        fresh = os.path.join(work, f"new{i}.lzc")
        times["new_s"].append(_timed(lambda: lazyckpt.save(state, fresh)))
        os.unlink(fresh)
    return {k: statistics.median(v) for k, v in times.items()}


def m_verify(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """What verifying every block's checksum costs a cold load: loads with
    verification (the default) and with LAZYCKPT_VERIFY_CHECKSUMS=0,
    alternating, each cold."""
    import lazyckpt
    path = os.path.join(work, "verify.lzc")
    lazyckpt.save(_state(o["gib"] * 1024, o["tensors"]), path)
    times: Dict[str, List[float]] = {"verified_s": [], "unverified_s": []}
    for i in range(o["reps"]):
        for key in (("verified_s", "unverified_s") if i % 2 == 0 else ("unverified_s", "verified_s")):
            os.environ["LAZYCKPT_VERIFY_CHECKSUMS"] = "1" if key == "verified_s" else "0"
            _drop_caches()
            times[key].append(_timed(lambda: lazyckpt.load(path)))
    os.environ.pop("LAZYCKPT_VERIFY_CHECKSUMS", None)
    return {k: statistics.median(v) for k, v in times.items()}


def m_threads(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """lazyckpt's reader and writer thread counts, 4 (the default) against 8
    (LAZYCKPT_READER_THREADS / LAZYCKPT_WRITER_THREADS): cold loads and durable
    saves of the same state, alternating."""
    import lazyckpt
    state = _state(o["gib"] * 1024, o["tensors"])
    path = os.path.join(work, "threads.lzc")
    times: Dict[str, List[float]] = {f"{op}_{n}_s": [] for op in ("save", "load") for n in (4, 8)}
    for i in range(o["reps"]):
        for n in ((4, 8) if i % 2 == 0 else (8, 4)):
            os.environ["LAZYCKPT_WRITER_THREADS"] = os.environ["LAZYCKPT_READER_THREADS"] = str(n)
            if os.path.exists(path):
                os.unlink(path)
            os.sync()
            times[f"save_{n}_s"].append(_timed(lambda: lazyckpt.save(state, path)))
            _drop_caches()
            times[f"load_{n}_s"].append(_timed(lambda: lazyckpt.load(path)))
    return {k: statistics.median(v) for k, v in times.items()}


def _job_rank(rank: int, port: int, base: str, mib: int, saves: int, out: str, path: List[str]) -> None:
    sys.path[:0] = path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    state = {"w": torch.randn(mib << 18), "step": 0}
    figures: Dict[str, List[float]] = {f"{kind}_{what}_ms": [] for kind in ("forward", "rollback")
                                       for what in ("block", "commit")}
    with _checkpointer(os.path.join(base, f"node{rank}"), keep=2, replicas=1, node_size=1,
                       commit_timeout=120) as ckpt:
        for step in range(1, 4):
            ckpt.save(state, step=step).wait()
        ckpt.wait()
        for kind, step in [("forward", 4 + i) for i in range(saves)] + [("rollback", 3 + saves)] * saves:
            state["w"].add_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save(state, step=step)
            t1 = time.perf_counter()
            handle.wait()
            figures[f"{kind}_block_ms"].append((t1 - t0) * 1e3)
            figures[f"{kind}_commit_ms"].append((time.perf_counter() - t0) * 1e3)
            ckpt.wait()         # the replica round: each save measured on its own
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: statistics.median(v) for k, v in figures.items()}, f)
    dist.destroy_process_group()


def m_job_commit(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """The job-wide round of a rollback with replicas: 2 gloo ranks, one per
    node (replicas=1, node_size=1), ``mib`` MiB each; 3 warm-up saves, then
    ``saves`` forward saves (no round) and ``saves`` rollbacks (each takes the
    round). Rank 0's medians of save() blocking and save().wait()."""
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(work, "figures.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_job_rank, args=(r, port, work, o["mib"], o["saves"], out, sys.path[:3]))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise SystemExit(f"a rank failed ({p.exitcode})")
    with open(out) as f:
        return json.load(f)


def m_training(o: Dict[str, Any], work: str) -> Dict[str, float]:
    """benchmarks/bench_training.py --modes none,lazyckpt (the tree's own copy
    where it has one: the script imports helpers whose paths a refactor may
    move) with ``args``; its summary for lazyckpt: s/iter, overhead against
    that run's own no-checkpoint loop, save() blocking, optimizer stall, time
    to durable. Fails unless the saved checkpoint loads bit-exact."""
    tree = os.environ["AB_TREE"]
    own = os.path.join(tree, "benchmarks", "bench_training.py")
    script = own if os.path.exists(own) else os.path.join(HERE, "bench_training.py")
    out = os.path.join(work, "training.json")
    subprocess.run([sys.executable, script, "--modes", "none,lazyckpt", "--json", out, *o["args"].split()],
                   check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    if doc.get("verify") not in (None, "OK"):
        raise SystemExit(f"bench_training: the checkpoint did not load bit-exact ({doc['verify']})")
    s = doc["summary"]["lazyckpt"]
    return {k: s[k] for k in ("iter_s", "overhead_pct", "blocking_s", "stall_s", "durable_s")}


@dataclass(frozen=True)
class Metric:
    run: Callable[[Dict[str, Any], str], Dict[str, float]]
    defaults: Dict[str, Any]
    #: The ab_*.py script(s) it replaces, and the BENCHMARKS.md section holding their figures.
    replaces: str
    rounds: int = 4
    higher_is_better: Sequence[str] = ()
    needs_s3: bool = False
    cold: bool = False


METRICS: Dict[str, Metric] = {
    "trees": Metric(m_trees, {"mib": 512, "tensors": 32}, "ab_trees.py", needs_s3=True, cold=True),
    "commit": Metric(m_commit, {}, "ab_commit.py", rounds=8),
    "save_cpu": Metric(m_save_cpu, {}, "ab_save_cpu.py, ab_warm_save.py", rounds=8),
    "load_trees": Metric(m_load_trees, {"gib": 0.75, "tensors": 2000}, "ab_load_trees.py",
                         higher_is_better=("of_raw",), cold=True),
    "load_into": Metric(m_load_into, {"gib": 0.75, "tensors": 64, "reps": 5},
                        "ab_staged_into.py, ab_streaming_fill.py", cold=True),
    "save_over": Metric(m_save_over, {"gib": 0.75, "tensors": 64, "reps": 5}, "ab_replace.py"),
    "verify": Metric(m_verify, {"gib": 0.75, "tensors": 64, "reps": 6}, "ab_verify_checksums.py", cold=True),
    "threads": Metric(m_threads, {"gib": 0.75, "tensors": 64, "reps": 5}, "ab_thread_counts.py", cold=True),
    "job_commit": Metric(m_job_commit, {"mib": 16, "saves": 8}, "ab_job_commit.py", rounds=5),
    "training": Metric(m_training, {"args": "--hidden 768 --layers 8 --seq 512 --batch 2 --iters 8 --every 1"},
                       "ab_training.py", rounds=2),
}


# --- the parent --------------------------------------------------------------------------------

@contextlib.contextmanager
def baseline_tree(spec: str) -> Iterator[str]:
    """A tree's repository root: ``spec`` as a path (a worktree, a clone,
    or its src/), else a commit checked out into a temporary worktree."""
    path = os.path.abspath(spec)
    for root in (path, os.path.dirname(path)):
        if os.path.isdir(os.path.join(root, "src", "lazyckpt")):
            yield root
            return
    tmp = tempfile.mkdtemp(prefix="ab-baseline-")
    tree = os.path.join(tmp, "tree")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, spec], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def run_child(name: str, opts: Dict[str, Any], tree: str, work_dir: Optional[str], env: Dict[str, str]) -> Dict:
    src = os.path.join(tree, "src")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--opts", json.dumps(opts),
                           "--dir", work_dir or ""],
                          env=dict(env, PYTHONPATH=src, AB_TREE=tree), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the child for {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_sets(pairs: Sequence[str], defaults: Dict[str, Any]) -> Dict[str, Any]:
    opts = dict(defaults)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in defaults:
            raise SystemExit(f"--set {pair!r}: this metric takes {sorted(defaults) or 'no options'}")
        opts[key] = type(defaults[key])(value)
    return opts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metric", nargs="?", choices=sorted(METRICS))
    ap.add_argument("--baseline", help="a commit, a worktree or clone, or its src/")
    ap.add_argument("--this", dest="this", default=None, help="the tree measured against the baseline (default: this one)")
    ap.add_argument("--rounds", type=int, help="rounds (each runs both trees); default per metric")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a metric's option")
    ap.add_argument("--list", action="store_true", help="list the metrics and their options")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--opts", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        work = tempfile.mkdtemp(prefix=f"ab-{args.child}-", dir=args.dir or None)
        try:
            print(json.dumps(METRICS[args.child].run(json.loads(args.opts), work)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    if args.list or not args.metric:
        for name, m in sorted(METRICS.items()):
            doc = " ".join((m.run.__doc__ or "").split())
            print(f"{name}  (replaces {m.replaces}; options {m.defaults or 'none'})\n    {doc}\n")
        return
    if not args.baseline:
        ap.error("--baseline is required")
    metric = METRICS[args.metric]
    opts = parse_sets(args.set, metric.defaults)
    rounds = args.rounds or metric.rounds
    if metric.cold and not _drop_caches():
        print("note: cannot drop the page cache (not root): loads may read from memory, for both trees alike")
    with contextlib.ExitStack() as stack:
        env = dict(os.environ)
        if metric.needs_s3:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from _s3server import SeaweedServer, find_weed
            if find_weed():
                server = stack.enter_context(SeaweedServer(stack.enter_context(tempfile.TemporaryDirectory())))
                env.update(server.env())
                env["AB_S3_URL"] = f"s3://{server.make_bucket()}/run"
            else:
                print("note: no SeaweedFS binary (weed): the S3 figures are left out")
        base = stack.enter_context(baseline_tree(args.baseline))
        this = stack.enter_context(baseline_tree(args.this)) if args.this else ROOT
        trees = {"this": this, "baseline": base}
        results: Dict[str, List[Dict[str, float]]] = {name: [] for name in trees}
        for r in range(rounds):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                if metric.needs_s3 and "AB_S3_URL" in env:
                    env["AB_S3_URL"] = f"s3://{server.make_bucket()}/run"
                results[name].append(run_child(args.metric, opts, trees[name], args.dir, env))
                print(f"round {r + 1} {name}: " + " ".join(f"{k}={v:.4g}" for k, v in results[name][-1].items()),
                      flush=True)
    figures = list(results["this"][0])
    med = {name: {k: statistics.median(run[k] for run in runs) for k in figures} for name, runs in results.items()}
    print(f"\n{args.metric} {opts or ''}: medians of {rounds} rounds (ABBA), this {args.this or 'tree'}, "
          f"baseline {args.baseline}")
    print(f"{'figure':<20}{'baseline':>12}{'this':>12}{'this/baseline':>15}")
    for k in figures:
        ratio = med["this"][k] / med["baseline"][k] if med["baseline"][k] else float("nan")
        better = "higher is better" if k in metric.higher_is_better else ""
        print(f"{k:<20}{med['baseline'][k]:>12.4g}{med['this'][k]:>12.4g}{ratio:>15.3f}  {better}")


if __name__ == "__main__":
    main()
