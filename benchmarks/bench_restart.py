"""Restart time with a synchronous and an asynchronous restore.

The training benchmark's model (a transformers Llama built from a config,
random weights; default hidden 768, 8 layers, vocab 32000: 105.8 M
parameters, AdamW, a ~1.27 GB checkpoint) is trained one step and saved with
a Checkpointer once. Then each measured restart runs in a fresh process, the
page cache dropped before it (unless --no-drop-caches), modes interleaved
(A B B A ...):

* ``sync``: build the model and the optimizer, ``ckpt.load()``,
  ``load_state_dict`` both;
* ``async``: ``ckpt.load_async()`` first, build the model and the optimizer
  while it reads, then ``handle.wait()`` and ``load_state_dict`` both.

Measured from just before the first line above (every import done before, in
both modes) to:
"ready" (the state is restored: the first forward may start) and "first
step" (one forward/backward on a fixed batch and the first optimizer step
done). The loss of that step must equal, bit for bit, the loss the saved
model gave in the process that saved it: a restart that restored anything
else fails the run.

    HF_HUB_OFFLINE=1 python benchmarks/bench_restart.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import drop_caches, emit_json, machine_line, print_table  # noqa: E402

MODES = ("sync", "async")


def model_args(args) -> argparse.Namespace:
    """What bench_training.build() reads."""
    return argparse.Namespace(hidden=args.hidden, layers=args.layers, seq=args.seq, batch=args.batch,
                              vocab=args.vocab, heads=0, intermediate=0, seed=0, frozen_fraction=0.0)


def setup(args) -> float:
    """Train one step, checkpoint it; return the loss of the next step's forward."""
    import torch

    import lazyckpt
    from bench_training import build, train_state
    torch.set_num_threads(args.threads)
    model, opt, batches = build(model_args(args))
    model(batches[0], labels=batches[0]).loss.backward()
    opt.step()
    opt.zero_grad()
    with lazyckpt.Checkpointer(args.dir, keep=1) as ckpt:
        ckpt.save(train_state(model, opt, 1), step=1).wait()
    return model(batches[1], labels=batches[1]).loss.item()


def child(args) -> None:
    import torch

    import lazyckpt
    from bench_training import build
    from lazyckpt.storage import iomode
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401  (imported by build(): not timed)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ckpt = lazyckpt.Checkpointer(args.dir)
    handle = ckpt.load_async() if args.child == "async" else None
    model, opt, batches = build(model_args(args))
    t_built = time.perf_counter()
    state = handle.wait() if handle is not None else ckpt.load()
    t_loaded = time.perf_counter()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    del state
    t_ready = time.perf_counter()
    loss = model(batches[1], labels=batches[1]).loss
    loss.backward()
    opt.step()
    t_step = time.perf_counter()
    ckpt.close()
    print("RESULT " + json.dumps({
        "ready_s": t_ready - t0, "first_step_s": t_step - t0, "build_s": t_built - t0,
        "load_s": handle.seconds if handle is not None else t_loaded - t_built,
        "waited_s": t_loaded - t_built, "loss": loss.item(), "iomode": iomode.choices()}))


def measure(mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--dir", args.dir,
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq),
           "--batch", str(args.batch), "--vocab", str(args.vocab), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in every process")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out", "restart"))
    p.add_argument("--json", default=os.path.join(os.getcwd(), "bench-out", "restart.json"))
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    import shutil
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    reference = setup(args)
    setup_s = time.perf_counter() - t0
    dropped = not args.no_drop_caches and drop_caches()
    ckpt_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(args.dir) for f in fs)
    print(machine_line())
    print(f"model: Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq} "
          f"batch={args.batch}, AdamW; checkpoint {ckpt_bytes / 1e9:.2f} GB; torch threads {args.threads}; "
          f"setup {setup_s:.1f} s; page cache dropped before each run: {'yes' if dropped else 'no'}")
    runs = {m: [] for m in MODES}
    for r in range(args.repeat):
        for m in (MODES if r % 2 == 0 else MODES[::-1]):
            if dropped:
                drop_caches()
            res = measure(m, args)
            if res["loss"] != reference:
                raise SystemExit(f"{m}: the restored model's loss {res['loss']!r} differs from the saved "
                                 f"model's {reference!r}: the restore is wrong")
            runs[m].append(res)
    summary, rows = {}, []
    for m, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("ready_s", "first_step_s", "build_s",
                                                                "load_s", "waited_s")}
        summary[m] = dict(med, runs=rs)
        rows.append([m, f"{med['ready_s']:.2f}", f"{min(x['ready_s'] for x in rs):.2f} / "
                     f"{max(x['ready_s'] for x in rs):.2f}", f"{med['first_step_s']:.2f}", f"{med['build_s']:.2f}",
                     f"{med['load_s']:.2f}", f"{med['waited_s']:.2f}"])
    print_table(["restore", "ready s", "min / max", "first step s", "build s", "load s", "waited for load s"],
                rows)
    ratio_ready = summary["sync"]["ready_s"] / summary["async"]["ready_s"]
    ratio_step = summary["sync"]["first_step_s"] / summary["async"]["first_step_s"]
    print(f"sync / async: ready {ratio_ready:.2f}x, first optimizer step {ratio_step:.2f}x "
          f"(every restored loss equal to the saved model's: {reference:.6f})")
    print("I/O mode chosen:", "; ".join(f"{c['direction']} {'O_DIRECT' if c['o_direct'] else 'buffered'} "
                                        f"({c['reason']})" for c in runs["sync"][0]["iomode"]))
    emit_json({"machine": machine_line(), "checkpoint_bytes": ckpt_bytes, "reference_loss": reference,
               "caches_dropped": dropped, "modes": summary,
               "ratios": {"ready": ratio_ready, "first_step": ratio_step}}, args.json)


if __name__ == "__main__":
    main()
