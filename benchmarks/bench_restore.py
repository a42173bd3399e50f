"""Restore (and save) against the disk, on a noisy disk: every method in every
repetition, interleaved, page cache dropped before every read (issue 38).

The states (``--states``, each run in turn with its own table): ``N`` is N
tensors of about equal size (dtypes cycled); ``llama`` is a Llama-like
training state of the same total size: embeddings, per layer the attention
q/k/v/o and MLP gate/up/down matrices and two RMSNorm weights, a final norm
and the LM head, in bf16; AdamW's ``exp_avg`` and ``exp_avg_sq`` in fp32 and
a 4-byte fp32 ``step`` per parameter (thousands of tensors from 4 bytes to
tens of MB, as a real model's checkpoint holds).

Reads, each into fresh memory, of the same bytes:

- the raw methods: O_DIRECT preads of 32 MiB from lazyckpt's reader thread
  count, buffered sequential read() of 32 MiB (default readahead), and mmap
  with one byte of every page touched;
- ``lazyckpt.load`` with and without checksum verification,
  ``lazyckpt.load(into=)`` (verified) into preallocated tensors, ``keys=``
  (every other tensor; its time scaled to the whole state's bytes),
  ``load_async().wait()`` and the load of a Checkpointer's committed step;
- the peers: ``torch.load`` (weights_only, ``mmap=False``), safetensors
  ``load_file`` and DCP's ``FileSystemReader`` into preallocated tensors.

Writes, each durable (fsynced) before the clock stops: raw O_DIRECT pwrite
from lazyckpt's writer thread count, raw buffered write() + fsync,
``lazyckpt.save`` (of a new file, and over the file its last save wrote)
and a Checkpointer's save up to its commit point and up to ``wait()``
(the superseded step renamed aside; ``wait(freed=True)``: its space freed too); one Checkpointer for the run, its
cache allocated before the clock. A replaced file's blocks are freed on
lazyckpt's release thread after the save returns; the bench waits for that,
untimed, before the next method.

The order of the methods is shuffled in every repetition (seeded): a load
right after a method that freed huge pages runs faster than one after a
method that freed none (storage/fileio.py read_buffer), so a fixed order
would credit a method with its neighbour's effect. The one exception: the
unverified load runs right beside the verified one (before it in every other
repetition), and verification's cost is the median of those pairs' ratios.
Each figure is the median of the
repetitions with its half-range; every ratio divides two medians of the same
run. The ceiling is the best raw method of the run (per direction); "of
mmap" is against mmap-touch. The disk's speed drifts by 1.5x from minute to
minute: read the ratios, not the GB/s.

    python benchmarks/bench_restore.py --gib 0.75 --states 64,2000,llama --reps 5 --dir /work/bench-restore
    python benchmarks/bench_restore.py --gib 0.5 --states 64,2000,llama --reps 3 --only issue55
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
from _common import machine_line, median_spread, print_table  # noqa: E402
from lazyckpt.cli import bench as raw  # noqa: E402  (the raw methods, shared with `lazyckpt bench`)
from lazyckpt.storage import fileio as release  # noqa: E402


def _dcp_load(path: str, like: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    target = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in like.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return target


def like_state(state: Dict[str, torch.Tensor]) -> Dict[str, list]:
    """What a reading process needs to know of the state: names, shapes, dtypes."""
    return {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in state.items()}


LLAMA_LAYERS = 16
LLAMA_VOCAB = 32000


def llama_state(size: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A Llama-like model and AdamW state of about ``size`` bytes: bf16
    weights (10 bytes a parameter with the two fp32 moments), 16 layers, a
    hidden size (a multiple of 64) for a 32,000-word vocabulary, then the
    vocabulary that fills ``size``, the MLP
    at 8/3 of the hidden size; keys as ``model.state_dict()`` and a flattened
    ``optimizer.state_dict()["state"]`` (by parameter index) name them."""
    g = torch.Generator().manual_seed(seed)
    params, layers, vocab = size // 10, LLAMA_LAYERS, LLAMA_VOCAB
    # 12 L d^2 (attention 4 d^2, MLP 3 * 8/3 d^2) + 2 V d (embeddings, head) = params
    a, b = 12 * layers, 2 * vocab
    hidden = max(64, round((-b + (b * b + 4 * a * params) ** 0.5) / (2 * a) / 64) * 64)
    mlp = (8 * hidden // 3 + 63) // 64 * 64
    # The vocabulary takes up what the rounded hidden size left (at least 256 words).
    vocab = max(256, (params - layers * (4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden) - hidden)
                // (2 * hidden))
    shapes: List[tuple] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes += [(pre + f"self_attn.{m}_proj.weight", (hidden, hidden)) for m in "qkvo"]
        shapes += [(pre + "mlp.gate_proj.weight", (mlp, hidden)), (pre + "mlp.up_proj.weight", (mlp, hidden)),
                   (pre + "mlp.down_proj.weight", (hidden, mlp)),
                   (pre + "input_layernorm.weight", (hidden,)), (pre + "post_attention_layernorm.weight", (hidden,))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    state: Dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        state[name] = (torch.ones(shape) if len(shape) == 1 else
                       torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    for i, (name, shape) in enumerate(shapes):
        state[f"optimizer.state.{i}.step"] = torch.tensor(1000.0)
        state[f"optimizer.state.{i}.exp_avg"] = torch.randn(shape, generator=g) * 1e-3
        state[f"optimizer.state.{i}.exp_avg_sq"] = torch.rand(shape, generator=g) * 1e-6
    return state


def make_state(spec: str, size: int, dtypes: str) -> Dict[str, torch.Tensor]:
    """The state a ``--states`` item names: ``llama`` or a tensor count."""
    if spec == "llama":
        return llama_state(size)
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"--states: {spec!r} is neither a tensor count nor 'llama'")
    return raw.make_state(size, int(spec), raw.parse_dtypes(dtypes))


def describe(spec: str, state: Dict[str, torch.Tensor], dtypes: str) -> str:
    if spec != "llama":
        return f"{len(state)} tensors ({dtypes})"
    hidden = state["model.norm.weight"].numel()
    vocab = state["lm_head.weight"].shape[0]
    sizes = sorted(t.numel() * t.element_size() for t in state.values())
    return (f"a Llama-like state, {len(state)} tensors ({LLAMA_LAYERS} layers, hidden {hidden}, vocabulary "
            f"{vocab}; bf16 weights, fp32 AdamW moments and steps; {sizes[0]} B to {sizes[-1] / 1e6:.1f} MB)")


def read_methods(path: Callable[[str], str], like: Dict[str, list], opts: Any,
                 only: str = None) -> Dict[str, Callable[[], object]]:
    """Every read method, by name, over the files the parent wrote. Their
    setup (into='s tensors, faulted in; imports) is done here, before any
    clock; ``only``: the one method a fresh process runs (nothing else set up)."""
    import safetensors.torch as st
    shapes = {k: torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for k, (shape, dtype) in like.items()}
    nbytes = sum(t.numel() * t.element_size() for t in shapes.values())
    # into= fills memory the caller already has (faulted in, as a built model's).
    into = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in shapes.items()} \
        if only in (None, "lazyckpt.load(into=)") else None
    half = sorted(like)[::2]                # keys=: every other tensor
    half_bytes = sum(shapes[k].numel() * shapes[k].element_size() for k in half)

    def load_keys() -> float:
        # Timed per byte read: scaled to the whole state, so that it compares.
        t = time.perf_counter()
        lazyckpt.load(path("read.lzc"), keys=half)
        return (time.perf_counter() - t) * nbytes / half_bytes

    return {
        "raw O_DIRECT": lambda: raw.raw_read(path("raw.bin"), nbytes, opts.reader_threads),
        "raw buffered": lambda: raw.raw_read_buffered(path("raw.bin"), nbytes),
        "raw mmap-touch": lambda: raw.raw_read_mmap(path("raw.bin"), nbytes),
        "lazyckpt.load": lambda: lazyckpt.load(path("read.lzc")),
        "lazyckpt.load, no verify": lambda: lazyckpt.load(path("read.lzc"), verify_checksums=False),
        "lazyckpt.load(into=)": lambda: lazyckpt.load(path("read.lzc"), into=into),
        "lazyckpt.load(keys=half), per byte": load_keys,
        "lazyckpt.load_async().wait()": lambda: lazyckpt.load_async(path("read.lzc")).wait(),
        "lazyckpt.load(step directory)": lambda: lazyckpt.load(path("ckpt-read")),
        "torch.load": lambda: torch.load(path("read.pt"), map_location="cpu", weights_only=True),
        "safetensors": lambda: st.load_file(path("read.safetensors")),
        "dcp.load": lambda: _dcp_load(path("read.dcp"), shapes),
    }


def child(args: argparse.Namespace) -> None:
    """--fresh-process: one read method, timed once, in this new interpreter."""
    with open(os.path.join(args.dir, "like.json")) as f:
        like = json.load(f)
    fn = read_methods(lambda name: os.path.join(args.dir, name), like, lazyckpt.Options(), args.child)[args.child]
    t = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t
    print(json.dumps(result if isinstance(result, float) else elapsed))


def run_fresh(name: str, args: argparse.Namespace) -> float:
    """Seconds of one read method in a new interpreter (imports and setup untimed)."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--dir", args.dir],
                          check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


VERIFY_PAIR = ("lazyckpt.load", "lazyckpt.load, no verify")


def only_methods(only: str = None):
    """The method names ``--only`` selects (None: every one)."""
    if not only:
        return None
    # Commas inside a name ("lazyckpt.load, no verify") are followed by a space.
    return set(ISSUE_55_ROWS) if only == "issue55" else set(re.split(r",(?! )", only))

#: ``--only issue55``: the rows issue 55's targets are about (with the raw
#: methods, which always run).
ISSUE_55_ROWS = ("lazyckpt.load", "lazyckpt.load, no verify", "lazyckpt.load(into=)",
                 "lazyckpt.load(keys=half), per byte", "torch.load", "safetensors", "dcp.load",
                 "lazyckpt.save", "Checkpointer.save().wait()")


def _pair_verified_with_unverified(order: list, rep: int) -> list:
    """The unverified load runs right beside the verified one, first in every
    other repetition: verification's cost (a few %) is then the median of
    per-repetition ratios, not a ratio of two medians each as noisy as the
    cost itself (the disk drifts by more between two places in the order)."""
    names = [name for _d, name, _f in order]
    if not all(n in names for n in VERIFY_PAIR):
        return order
    unverified = order.pop(names.index(VERIFY_PAIR[1]))
    at = [name for _d, name, _f in order].index(VERIFY_PAIR[0])
    order.insert(at + (rep % 2), unverified)
    return order


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=0.75, help="state size in GiB (issue 38: 0.81 GB)")
    p.add_argument("--tensors", type=int, default=64, help="the state's tensor count (without --states)")
    p.add_argument("--states", default=None,
                   help="comma-separated states, each run in turn: a tensor count or 'llama' (e.g. 64,2000,llama)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-restore"))
    p.add_argument("--json", default=None, help="also write the medians and ratios here (by state)")
    p.add_argument("--only", default=None,
                   help="comma-separated method names (the raw ones always run), or 'issue55': the rows issue "
                        "55's targets name (the loads, verification's pair, into=, keys=, the three peers, "
                        "lazyckpt.save and Checkpointer.save().wait())")
    p.add_argument("--fresh-process", action="store_true",
                   help="a restart: every read in a new interpreter (the first load of a process); no writes")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    os.makedirs(args.dir, exist_ok=True)
    if not raw.drop_caches_global():
        sys.exit("bench_restore needs to drop the page cache (root): without it every read is a memory copy")
    specs = [x.strip() for x in (args.states or str(args.tensors)).split(",") if x.strip()]
    for spec in specs:
        make_state(spec, 1 << 12, args.dtypes)      # a bad name fails before any state is run
    print(machine_line())
    results = {}
    for spec in specs:
        results[spec] = run_state(spec, args)
    if len(specs) > 1:
        print("JSON " + json.dumps({k: {x: v[x] for x in v if x not in ("times_s", "orders")}
                                    for k, v in results.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(specs) > 1 else results[specs[0]], f, indent=1)


def run_state(spec: str, args: argparse.Namespace) -> Dict[str, Any]:
    """Every method over one state, ``args.reps`` interleaved repetitions; prints its table."""
    state = make_state(spec, int(args.gib * (1 << 30)), args.dtypes)
    nbytes = raw.state_bytes(state)
    opts = lazyckpt.Options()
    path = lambda name: os.path.join(args.dir, name)  # noqa: E731

    # Files the read methods read: written once, untimed.
    raw.raw_write(path("raw.bin"), nbytes, opts.writer_threads)
    lazyckpt.save(state, path("read.lzc"))
    torch.save(state, path("read.pt"))
    import safetensors.torch as st
    st.save_file(state, path("read.safetensors"))
    import torch.distributed.checkpoint as dcp
    raw.remove(path("read.dcp"))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path("read.dcp")), no_dist=True)
    with open(path("like.json"), "w") as f:
        json.dump(like_state(state), f)

    keep = only_methods(args.only)

    def wanted(name: str) -> bool:
        # Files only an unselected method reads are not written (--only: a shorter run).
        return keep is None or name in keep

    raw.remove(path("ckpt-read"))
    if wanted("lazyckpt.load(step directory)"):
        with lazyckpt.Checkpointer(path("ckpt-read"), keep=1) as ckpt:
            ckpt.save(state, step=1).wait()

    def save_lazy() -> None:
        lazyckpt.save(state, path("save.lzc"))

    # The same save over the file the last one wrote (a job saving to one path
    # every epoch): the old file's blocks are freed off the save's path.
    if wanted("lazyckpt.save, over the last one"):
        lazyckpt.save(state, path("again.lzc"))

    def save_lazy_again() -> None:
        lazyckpt.save(state, path("again.lzc"))

    # One Checkpointer for the whole run, as in training: its host cache is
    # allocated at its first (untimed) save, not in every repetition.
    raw.remove(path("save.ckpt"))
    writer = lazyckpt.Checkpointer(path("save.ckpt"), keep=1)
    writer.save(state, step=0).wait()
    steps = iter(range(1, 1 << 30))

    def save_checkpointer() -> float:
        # From save() to its commit point (data and manifest durable, renamed into
        # place): a committed step, as a training job's Checkpointer makes it.
        handle = writer.save(state, step=next(steps))
        handle.wait()
        return handle.flush_s

    def save_checkpointer_wait() -> None:
        # The same up to wait()'s return: after the commit, the retention of the
        # step it supersedes (keep=1: a 0.8 GB step renamed aside, freed on the
        # release thread after wait() returns: untimed, as for a replaced file), ``latest``.
        writer.save(state, step=next(steps)).wait()

    def save_checkpointer_wait_freed() -> None:
        # The same, with the superseded step's space freed before it returns.
        writer.save(state, step=next(steps))
        writer.wait(freed=True)

    # One untimed load first: a process's first load reads into small pages and
    # later ones (and the raw methods, which allocate as lazyckpt's reader does)
    # into huge pages (storage/fileio.py read_buffer); without it the first
    # repetition's methods before the first load would run on small pages. The
    # restart, a process's only load, is --fresh-process.
    lazyckpt.load(path("read.lzc"))
    reads = read_methods(path, like_state(state), opts)
    writes: Dict[str, Callable[[], object]] = {
        "raw O_DIRECT": lambda: raw.raw_write(path("save.bin"), nbytes, opts.writer_threads),
        "raw buffered": lambda: raw.raw_write_buffered(path("save.bin"), nbytes),
        "lazyckpt.save": save_lazy,
        "lazyckpt.save, over the last one": save_lazy_again,
        "Checkpointer.save(), committed": save_checkpointer,
        "Checkpointer.save().wait()": save_checkpointer_wait,
        "Checkpointer.save().wait(freed=True)": save_checkpointer_wait_freed,
    }
    raw_reads = [k for k in reads if k.startswith("raw")]
    raw_writes = [k for k in writes if k.startswith("raw")]
    if keep is not None:
        unknown = keep - set(reads) - set(writes)
        if unknown:
            sys.exit(f"--only: no method {sorted(unknown)}; methods: {sorted(set(reads) | set(writes))}")
        reads = {k: v for k, v in reads.items() if k in raw_reads or k in keep}
        writes = {k: v for k, v in writes.items() if k in raw_writes or k in keep}
    tasks = [("read", k, f) for k, f in reads.items()] + \
        ([] if args.fresh_process else [("write", k, f) for k, f in writes.items()])

    print(f"\nstate {spec}: {nbytes / 1e9:.3f} GB in {describe(spec, state, args.dtypes)}, {args.reps} interleaved "
          f"repetitions, page cache dropped before every read"
          f"{', every read in a new process' if args.fresh_process else ''}; lazyckpt {opts.reader_threads} reader / "
          f"{opts.writer_threads} writer threads, o_direct={opts.o_direct!r}; dir {args.dir} "
          f"({raw.filesystem_of(args.dir)})")
    times: Dict[tuple, List[float]] = {}
    orders: List[List[str]] = []
    for rep in range(args.reps):
        # A new order every repetition: what ran just before a method (memory it
        # freed, the disk's state) changes a load's time as much as the method does.
        order = list(tasks)
        random.Random(rep).shuffle(order)
        order = _pair_verified_with_unverified(order, rep)
        orders.append([f"{d}:{n}" for d, n, _fn in order])
        for direction, name, fn in order:
            if direction == "write":
                raw.remove(path("save.bin"))
                raw.remove(path("save.lzc"))
                os.sync()
            else:
                raw.drop_caches_global()
            if direction == "read" and args.fresh_process:
                times.setdefault((direction, name), []).append(run_fresh(name, args))
                continue
            t = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - t
            # The raw methods time themselves (their allocation and fsync included, setup not).
            times.setdefault((direction, name), []).append(result if isinstance(result, float) else elapsed)
            del result
            # A replaced file's blocks are freed on lazyckpt's release thread after
            # its save returns: untimed, and ended before the next method starts.
            release.wait_for_releases()
        print(f"state {spec}: repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    best_read = max(raw_reads, key=lambda k: gbps[("read", k)])
    best_write = max(raw_writes, key=lambda k: gbps[("write", k)]) if not args.fresh_process else None
    peers = [k for k in ("torch.load", "safetensors", "dcp.load") if ("read", k) in gbps]
    fastest_peer = max(peers, key=lambda k: gbps[("read", k)]) if peers else None
    rows = []
    of_best: Dict[str, float] = {}
    for direction, name, _fn in tasks:          # the table in a fixed order, whatever ran first
        values = times[(direction, name)]
        ceiling = gbps[(direction, best_read if direction == "read" else best_write)]
        of_best[f"{direction}:{name}"] = gbps[(direction, name)] / ceiling
        row = [direction, name, median_spread(values), f"{gbps[(direction, name)]:.2f}",
               f"{gbps[(direction, name)] / ceiling:.2f}"]
        row.append(f"{gbps[(direction, name)] / gbps[('read', 'raw mmap-touch')]:.2f}" if direction == "read" else "-")
        rows.append(row)
    print_table(["", "method", "s (median ±half-range)", "GB/s", "of best raw", "of mmap-touch"], rows)
    summary = {"state": spec, "tensors": len(state), "bytes": nbytes, "reps": args.reps, "fresh_process": args.fresh_process,
               "best_raw_read": best_read, "best_raw_write": best_write,
               "fastest_peer": fastest_peer, "of_best_raw": of_best,
               "medians_s": {f"{d}:{n}": med[(d, n)] for d, n, _fn in tasks},
               "times_s": {f"{d}:{n}": times[(d, n)] for d, n, _fn in tasks},
               "orders": orders}
    lines = [f"best raw read: {best_read} {gbps[('read', best_read)]:.2f} GB/s"
             + (f"; best raw write: {best_write} {gbps[('write', best_write)]:.2f} GB/s" if best_write else
                " (every read the first of a new process)")]
    if ("read", "lazyckpt.load") in gbps:
        load = gbps[("read", "lazyckpt.load")]
        summary["load_of_best_raw"] = load / gbps[("read", best_read)]
        summary["load_of_mmap_touch"] = load / gbps[("read", "raw mmap-touch")]
        lines.append(f"lazyckpt.load: {summary['load_of_best_raw']:.2f} of the best raw read (target >= 0.90), "
                     f"{summary['load_of_mmap_touch']:.2f} of mmap-touch (target >= 0.85 in the median)")
        if fastest_peer:
            summary["load_vs_fastest_peer"] = load / gbps[("read", fastest_peer)]
            lines.append(f"lazyckpt.load vs the fastest peer ({fastest_peer}): "
                         f"{summary['load_vs_fastest_peer']:.2f}x (target >= 1.10x)")
        if ("read", "lazyckpt.load, no verify") in med:
            summary["verify_cost"] = med[("read", "lazyckpt.load")] / med[("read", "lazyckpt.load, no verify")] - 1
            pairs = [v / u for v, u in zip(times[("read", VERIFY_PAIR[0])], times[("read", VERIFY_PAIR[1])])]
            summary["verify_cost_paired"] = statistics.median(pairs) - 1
            lines.append(f"verification costs {summary['verify_cost_paired']:+.1%} of the load's time, the median "
                         f"of {len(pairs)} side-by-side pairs (target <= 5 %; ratio of the two medians: "
                         f"{summary['verify_cost']:+.1%})")
    if ("write", "lazyckpt.save") in gbps:
        summary["save_of_best_raw"] = gbps[("write", "lazyckpt.save")] / gbps[("write", best_write)]
        lines.append(f"lazyckpt.save (durable): {summary['save_of_best_raw']:.2f} of the best raw write "
                     f"(target >= 0.90)")
    if ("write", "lazyckpt.save, over the last one") in gbps:
        summary["save_again_of_best_raw"] = gbps[("write", "lazyckpt.save, over the last one")] / \
            gbps[("write", best_write)]
        lines.append(f"lazyckpt.save over the last one: {summary['save_again_of_best_raw']:.2f} of the best raw "
                     f"write of a new file")
    if ("write", "Checkpointer.save(), committed") in gbps:
        summary["commit_of_best_raw"] = gbps[("write", "Checkpointer.save(), committed")] / \
            gbps[("write", best_write)]
    from lazyckpt.storage import iomode
    for c in iomode.choices():
        lines.append("I/O mode (o_direct='auto'): " + iomode.Choice(**c).describe())
    for line in lines:
        print(line)
    print("JSON " + json.dumps(summary))
    writer.close()
    for name in ("raw.bin", "save.bin", "read.lzc", "save.lzc", "again.lzc", "read.pt", "read.safetensors", "read.dcp",
                 "ckpt-read", "save.ckpt", "like.json"):
        raw.remove(path(name))
    return summary


if __name__ == "__main__":
    main()
