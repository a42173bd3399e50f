"""Replica tier (issue 16): recovery after a lost node, and what replicas cost.

``--nodes`` "nodes" x ``--node-size`` ranks (real gloo processes on this
machine, each node with its own directory), each rank training a small MLP
with AdamW (``--mib`` MiB of parameters per rank; the checkpoint holds the
model and optimizer state, ~3x that).

Overhead: ``--iters`` iterations with a save every ``--every`` iterations,
with ``replicas=0`` and ``replicas=1`` (interleaved, ``--reps`` each):
median seconds per iteration (the slowest rank), and the ratio.

Recovery: one run saves with ``replicas=1`` and ``persist_to`` a SeaweedFS
server started here (tests/_s3server.py). Then, for each mode, a copy of the
node directories is restarted in fresh processes, timed from the start of
each rank's work (imports done) to its first optimizer step after the load:

``local``       nothing lost: every node loads its own directory
``replica``     node 1's directory deleted: its ranks get their files from
                their partners' replicas
``persistent``  node 1's directory and its replicas deleted: its ranks load
                from the persistent tier

Printed: the slowest rank's time to first step, and the replaced node's, as
medians of ``--reps`` interleaved repetitions, with ratios.

    python benchmarks/bench_replicas.py [--nodes 4 --node-size 2 --mib 16 --reps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world, port, out, fn, args):
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        payload = ("ok", fn(rank, world, *args))
    except BaseException:
        payload = ("error", traceback.format_exc())
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run(world, fn, *args, timeout=600):
    ctx = mp.get_context("spawn")
    port = _port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_child, args=(r, world, port, out, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r}:\n{value}")
            results.append(value)
        return results


def _model(mib: float, seed: int):
    import torch
    torch.manual_seed(seed)
    width = 512
    layers = max(1, int(mib * (1 << 20) / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(32, 512, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _node_dir(base, rank, node_size):
    return os.path.join(base, f"node{rank // node_size}")


def train(rank, world, base, cfg, replicas, persist_to):
    import lazyckpt
    model, opt = _model(cfg["mib"], rank)
    times = []
    if replicas:
        kwargs = {"replicas": lazyckpt.Replicas(replicas, node_size=cfg["node_size"])}
    else:
        # The same node-local directories, each node committing its own steps, without replicas.
        from lazyckpt.tiers.replicas import Topology, node_group
        group = node_group(Topology(rank, world, cfg["node_size"]))
        kwargs = {"distributed": lazyckpt.Distributed(process_group=group)}
    with lazyckpt.Checkpointer(_node_dir(base, rank, cfg["node_size"]), keep=2, persist=persist_to,
                               **kwargs) as ckpt:
        ckpt.attach(opt)
        for i in range(cfg["iters"]):
            t0 = time.perf_counter()
            _step(model, opt, i)
            if i % cfg["every"] == cfg["every"] - 1:
                ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=i)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckpt.wait()
        drain = time.perf_counter() - t0
    return {"iter_s": statistics.median(times[1:]), "drain_s": drain}


def resume(rank, world, base, cfg, persist_to):
    import lazyckpt
    t0 = time.perf_counter()
    model, opt = _model(cfg["mib"], 12345)
    _step(model, opt, 0)          # the optimizer state exists before it is loaded into
    with lazyckpt.Checkpointer(_node_dir(base, rank, cfg["node_size"]),
                               replicas=lazyckpt.Replicas(1, node_size=cfg["node_size"]), persist=persist_to) as ckpt:
        ckpt.load(into={"model": model.state_dict(), "optim": opt.state_dict()})
        where = dict(ckpt.loaded_from)
    _step(model, opt, 999)
    return {"ready_s": time.perf_counter() - t0, "tier": where["tier"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--node-size", type=int, default=2)
    ap.add_argument("--mib", type=float, default=16.0, help="parameters per rank, MiB")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from _common import machine_line
    from _s3server import SeaweedServer
    import torch
    print(machine_line())
    world = a.nodes * a.node_size
    cfg = {"mib": a.mib, "node_size": a.node_size, "iters": a.iters, "every": a.every}
    print(f"{a.nodes} nodes x {a.node_size} ranks, {a.mib:g} MiB of parameters per rank "
          f"(checkpoint ~{3 * a.mib:g} MiB per rank with AdamW), torch {torch.__version__}")
    tmp = tempfile.mkdtemp(prefix="bench-replicas-", dir="/tmp")
    try:
        # ---- overhead
        per = {0: [], 1: []}
        drain = {0: [], 1: []}
        for _ in range(a.reps):
            for k in (0, 1):
                base = os.path.join(tmp, f"train-{k}")
                shutil.rmtree(base, ignore_errors=True)
                res = run(world, train, base, cfg, k, None)
                per[k].append(max(r["iter_s"] for r in res))
                drain[k].append(max(r["drain_s"] for r in res))
        m0, m1 = statistics.median(per[0]), statistics.median(per[1])
        print(f"\ntraining, save every {a.every} iterations (median of the slowest rank's median s/iter):")
        print("| replicas | s/iter | vs replicas=0 | wait() at the end s |\n|---|---|---|---|")
        print(f"| 0 | {m0:.4f} | 1.00 | {statistics.median(drain[0]):.2f} |")
        print(f"| 1 | {m1:.4f} | {m1 / m0:.2f} | {statistics.median(drain[1]):.2f} |")
        # ---- recovery
        with SeaweedServer(os.path.join(tmp, "server")) as server:
            for k, v in server.env().items():
                os.environ[k] = v
            bucket = server.make_bucket()
            url = f"s3://{bucket}/run"
            saved = os.path.join(tmp, "saved")
            run(world, train, saved, cfg, 1, url)
            ready = {m: [] for m in ("local", "replica", "persistent")}
            replaced = {m: [] for m in ready}
            for _ in range(a.reps):
                for mode in ready:
                    base = os.path.join(tmp, f"restart-{mode}")
                    shutil.rmtree(base, ignore_errors=True)
                    shutil.copytree(saved, base)
                    if mode != "local":
                        shutil.rmtree(os.path.join(base, "node1"))
                    if mode == "persistent":
                        shutil.rmtree(os.path.join(base, "node2", ".replicas", "node_00001"))
                    res = run(world, resume, base, cfg, url)
                    got = {r["tier"] for r in res[a.node_size:2 * a.node_size]}
                    assert got == {mode}, (mode, got)
                    ready[mode].append(max(r["ready_s"] for r in res))
                    replaced[mode].append(max(r["ready_s"] for r in res[a.node_size:2 * a.node_size]))
        print("\nrestart to the first optimizer step after the load (s, median; node 1 is the replaced one):")
        print("| restore of node 1 from | slowest rank | node 1's ranks | vs replicas (node 1) |\n|---|---|---|---|")
        base_r = statistics.median(replaced["replica"])
        for mode in ready:
            r = statistics.median(replaced[mode])
            print(f"| {mode} | {statistics.median(ready[mode]):.2f} | {r:.2f} | {r / base_r:.2f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
