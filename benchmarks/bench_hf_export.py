"""Export of a 4-rank FSDP2 Llama checkpoint to a Hugging Face safetensors
directory: ``lazyckpt.export_hf`` versus DCP's HF consolidation.

Setup (once): 4 gloo ranks build a ``LlamaForCausalLM`` with random fp32
weights (default hidden 1024, 16 layers, vocab 32000, intermediate 2816:
~271M parameters, ~1.08 GB), shard it with ``fully_shard`` (per decoder layer,
then the root) and save the same ``model.state_dict()`` twice:

* lazyckpt: ``Checkpointer(dir).save({"model": sd}, step=1).wait()``;
* DCP: ``dcp.save(sd, storage_writer=HuggingFaceStorageWriter(dir,
  save_distributed=True))``, one sharded safetensors file per rank.

Measured (each run in a fresh subprocess, page cache dropped before it unless
--no-drop-caches; rounds interleaved AB BA AB ...):

* ``lazyckpt``: ``lazyckpt.export_hf(step_dir, out, max_shard_size=N)``;
* ``dcp_consolidate``: ``torch.distributed.checkpoint._consolidate_hf_safetensors.
  consolidate_safetensors_files(sharded_dir, out, fqn_to_index_mapping, num_threads)``.
  DCP has no size limit: the mapping is built here by packing the tensors, in
  state-dict order, into files of at most N bytes (computed in setup, not timed).
  (``HuggingFaceStorageWriter(enable_consolidation=True)`` would run the same
  function at the end of ``dcp.save``; the standalone step is measured so both
  sides start from an already saved checkpoint.)

Figures: wall time of the export call; "durable" adds an fsync of the output
files afterwards (DCP does not fsync); peak extra memory = peak RSS during the
call (VmHWM, reset just before it) minus RSS just before it. Both outputs are
compared once, tensor by tensor (names, dtypes, shapes, bytes).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_hf_export.py --repeat 3
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_hf_export.py --hidden 256 --layers 2 --repeat 1
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import drop_caches, emit_json, fsync_file, machine_line, print_table, remove

WORLD = 4
#: lazyckpt_buffered: the same export reading without O_DIRECT (which read mode is
#: faster depends on the disk and its day; see BENCHMARKS.md).
METHODS = ("lazyckpt", "lazyckpt_buffered", "dcp_consolidate")


# ----------------------------------------------------------------------------- setup (4 ranks)

def _save_rank(rank, world, cfg, lzc_dir, dcp_dir):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import lazyckpt
    torch.manual_seed(0)      # same full weights on every rank before sharding
    config = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=max(1, cfg["hidden"] // 64),
                         vocab_size=cfg["vocab"], tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    ckpt = lazyckpt.Checkpointer(lzc_dir)
    ckpt.save({"model": sd}, step=1).wait()
    ckpt.close()
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(dcp_dir, save_distributed=True,
                                                         enable_consolidation=False))
    # Global (unsharded) names, dtypes and sizes, in state-dict order.
    return [(k, str(v.dtype), v.numel() * v.element_size()) for k, v in sd.items()] if rank == 0 else None


def pack(tensors, max_bytes):
    """fqn -> 1-based file index: files of at most max_bytes, in order (a bigger tensor gets its own)."""
    mapping, index, used = {}, 1, 0
    for name, _dtype, nbytes in tensors:
        if used and used + nbytes > max_bytes:
            index, used = index + 1, 0
        mapping[name] = index
        used += nbytes
    return mapping


# ----------------------------------------------------------------------------- one measured run (child)

def child(args) -> None:
    # Every import before the RSS baseline, so the peak is the call's own.
    import gc

    from bench_memory import Sampler, proc_status, reset_peak
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    import lazyckpt
    if args.child.startswith("lazyckpt"):
        o_direct = args.child == "lazyckpt"
        call = lambda: lazyckpt.export_hf(args.src, args.out, max_shard_size=args.max_shard_bytes,
                                          o_direct=o_direct)
    else:
        with open(args.mapping) as f:
            mapping = json.load(f)
        call = lambda: consolidate_safetensors_files(args.src, args.out, fqn_to_index_mapping=mapping,
                                                     num_threads=args.dcp_threads)
        os.makedirs(args.out, exist_ok=True)   # DCP expects the output directory to exist
    gc.collect()
    before = proc_status()["VmRSS"]
    sampler = None
    if not reset_peak():                       # where clear_refs is refused, sample VmRSS instead
        sampler = Sampler()
        sampler.start()
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    peak = proc_status()["VmHWM"]
    if sampler:
        sampler.stop.set()
        sampler.join()
        peak = sampler.peak
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(args.out, "*.safetensors")))
    for name in os.listdir(args.out):
        fsync_file(os.path.join(args.out, name))
    fsync_file(args.out)
    print("RESULT " + json.dumps({"seconds": seconds, "durable": time.perf_counter() - t0,
                                  "peak_extra": peak - before, "files": files,
                                  "peak_by": "sampler" if sampler else "VmHWM"}))


def measure(method, args, src, out, mapping_path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--src", src, "--out", out,
           "--max-shard-bytes", str(args.max_shard_bytes), "--dcp-threads", str(args.dcp_threads),
           "--mapping", mapping_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{method} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def compare(dir_a, dir_b):
    """Differences between two safetensors directories (empty: identical)."""
    import torch
    from safetensors import safe_open

    def index(d):
        return {k: p for p in glob.glob(os.path.join(d, "*.safetensors"))
                for k in safe_open(p, "pt").keys()}  # noqa: SIM118  (not a dict)
    a, b = index(dir_a), index(dir_b)
    diffs = [f"only in {os.path.basename(d)}: {k}" for d, x, y in ((dir_a, a, b), (dir_b, b, a))
             for k in sorted(set(x) - set(y))]
    for k in sorted(set(a) & set(b)):
        with safe_open(a[k], "pt") as fa, safe_open(b[k], "pt") as fb:
            ta, tb = fa.get_tensor(k), fb.get_tensor(k)
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            diffs.append(f"{k}: {ta.dtype}{list(ta.shape)} vs {tb.dtype}{list(tb.shape)}")
        elif not torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)):
            diffs.append(f"{k}: values differ")
    return diffs, len(a)


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=None, help="default hidden*11/4 (2816 at 1024)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-shard-size", default="512MiB", help="both outputs' file size limit")
    p.add_argument("--dcp-threads", type=int, default=os.cpu_count(), help="consolidation num_threads")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--dir", default=None, help="work directory (default: a fresh one under /tmp)")
    p.add_argument("--reuse", action="store_true", help="with --dir: keep the checkpoints a previous run "
                   "saved there (same model options) instead of saving them again")
    p.add_argument("--json", default=os.path.join(HERE, "..", "bench-out", "hf_export.json"))
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    for hidden in ("--src", "--out", "--mapping"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--max-shard-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    from _dist import run_ranks

    from lazyckpt.interop.hf import parse_shard_size       # transformers' reading: 5GB = 5 * 10**9
    args.max_shard_bytes = parse_shard_size(args.max_shard_size)
    cfg = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
           "intermediate": args.intermediate or args.hidden * 11 // 4}
    work = args.dir or tempfile.mkdtemp(prefix="bench_hf_export_", dir="/tmp")
    lzc_dir, dcp_dir = os.path.join(work, "lazyckpt"), os.path.join(work, "dcp_sharded")
    listing = os.path.join(work, "tensors.json")
    methods = list(METHODS)
    t0 = time.perf_counter()
    if args.reuse and args.dir and os.path.isfile(listing):
        with open(listing) as f:
            saved = json.load(f)
        if saved["model"] != cfg:
            raise SystemExit(f"--reuse: {work} holds a {saved['model']} model, not {cfg}")
        tensors = saved["tensors"]
    else:
        for d in (lzc_dir, dcp_dir):
            remove(d)
        tensors = run_ranks(WORLD, _save_rank, cfg, lzc_dir, dcp_dir, timeout=3600)[0]
        with open(listing, "w") as f:
            json.dump({"model": cfg, "tensors": tensors}, f)
    setup_s = time.perf_counter() - t0
    mapping_path = os.path.join(work, "fqn_to_index.json")
    with open(mapping_path, "w") as f:
        json.dump(pack(tensors, args.max_shard_bytes), f)
    nbytes = sum(n for _k, _d, n in tensors)
    dropped = not args.no_drop_caches and drop_caches()
    print(machine_line())
    print(f"model: Llama {cfg}, {nbytes // 4:,} parameters (fp32), state {nbytes:,} bytes "
          f"({nbytes / 1e9:.3f} GB) in {len(tensors)} tensors; {WORLD} gloo ranks, FSDP2; setup {setup_s:.1f} s")
    print(f"max shard size {args.max_shard_size} ({args.max_shard_bytes:,} B); DCP num_threads={args.dcp_threads}; "
          f"repeat={args.repeat}; page cache dropped before each run: "
          f"{'yes' if dropped else 'no (--no-drop-caches)' if args.no_drop_caches else 'no (not permitted)'}")

    step_dir = os.path.join(lzc_dir, "step_0000000001")
    src = {"lazyckpt": step_dir, "lazyckpt_buffered": step_dir, "dcp_consolidate": dcp_dir}
    runs = {m: [] for m in methods}
    verified = None
    for r in range(args.repeat):
        order = methods if r % 2 == 0 else methods[::-1]
        outs = {}
        for m in order:
            outs[m] = os.path.join(work, f"out_{m}_{r}")
            if dropped:
                drop_caches()
            runs[m].append(measure(m, args, src[m], outs[m], mapping_path))
            if verified is not None:
                remove(outs[m])
        if verified is None:                           # once, while the outputs of round 0 exist
            diffs, count = compare(outs["lazyckpt"], outs["dcp_consolidate"])
            more, _ = compare(outs["lazyckpt_buffered"], outs["dcp_consolidate"])
            diffs += more
            verified = {"identical": not diffs, "tensors": count, "differences": diffs[:20]}
            print(f"outputs compared: {'OK, ' + str(count) + ' tensors bit-identical' if not diffs else 'DIFFER'}")
            for d in diffs[:20]:
                print("   ", d)
            for o in outs.values():
                remove(o)

    summary, rows = {}, []
    for m, rs in runs.items():
        secs = [x["seconds"] for x in rs]
        summary[m] = {"median_s": statistics.median(secs), "min_s": min(secs), "max_s": max(secs),
                      "median_durable_s": statistics.median(x["durable"] for x in rs),
                      "median_peak_extra_bytes": statistics.median(x["peak_extra"] for x in rs),
                      "files": rs[0]["files"], "runs": rs}
        s = summary[m]
        rows.append([m, f"{s['median_s']:.3f}", f"{s['min_s']:.3f} / {s['max_s']:.3f}",
                     f"{s['median_durable_s']:.3f}", f"{s['median_peak_extra_bytes'] / 2**20:.1f}",
                     f"{nbytes / s['median_s'] / 1e9:.2f}", f"{len(s['files'])}: {', '.join(s['files'])}"])
    print_table(["method", "median s", "min / max s", "durable s", "peak extra MiB", "GB/s", "output files"], rows)
    ratios = {}
    b = summary["dcp_consolidate"]
    largest = max(n for _k, _d, n in tensors)
    for m in ("lazyckpt", "lazyckpt_buffered"):
        a = summary[m]
        ratios[m] = {"time": a["median_s"] / b["median_s"], "durable": a["median_durable_s"] / b["median_durable_s"],
                     "peak_extra": a["median_peak_extra_bytes"] / max(1, b["median_peak_extra_bytes"]),
                     "peak_extra_per_largest_tensor": a["median_peak_extra_bytes"] / largest}
        r = ratios[m]
        print(f"{m} / dcp: time {r['time']:.2f}x, durable {r['durable']:.2f}x, peak extra memory "
              f"{r['peak_extra']:.2f}x ({r['peak_extra_per_largest_tensor']:.2f}x the largest tensor, "
              f"{largest / 2**20:.1f} MiB)")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    emit_json({"machine": machine_line(), "model": cfg, "state_bytes": nbytes, "tensors": len(tensors),
               "world": WORLD, "max_shard_bytes": args.max_shard_bytes, "dcp_threads": args.dcp_threads,
               "caches_dropped": dropped, "setup_s": setup_s, "methods": summary, "ratios": ratios,
               "verified": verified}, args.json)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
