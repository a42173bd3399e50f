"""torchtitan's trainer on CPU, 2 gloo ranks, FSDP2, its llama3 debug model, a
checkpoint every step: DCP's own modes against lazyckpt's writer, side by side.

Each repetition runs every mode once (interleaved, order reversed on odd
repetitions), each a fresh ``torchrun`` of ``cpu_train.py`` (torchtitan's
``torchtitan.train`` with the CPU patches its docstring explains) for
``--steps`` steps. Rank 0 records the wall time of every ``train_step``
(forward, backward, the wait for staging, the optimizer step) and of every
``checkpointer.save()`` call; the first step (warm-up) and the last save
(torchtitan's synchronous last-step save) are left out. Printed: medians
over the steps of all repetitions, and the overhead of checkpointing every
step against the same run without checkpoints.

Modes (``--checkpoint.async_mode``; "lazy" adds ``--override.imports
lazyckpt.integrations.torchtitan.lazy_checkpoint``):

  none            no checkpoint
  dcp-disabled    DCP's FileSystemWriter, synchronous
  dcp-async       DCP, staged on the training thread, written on a thread
  dcp-pinned      DCP async_with_pinned_mem (torch's DefaultStager: needs an accelerator,
                  fails on a CPU-only build; reported, not timed)
  lazy-pinned     lazyckpt, async_with_pinned_mem: staged on lazyckpt's engine during the
                  next forward/backward, waited for before the optimizer step
  lazy-async      lazyckpt, staged before save() returns, written in the background

Needs a venv with torchtitan 0.3.0 and its full requirements (``setup_venv.sh``);
lazyckpt is taken from this checkout's ``src``. The tokenizer under ``assets/``
is torchtitan's test tokenizer (tests/assets/tokenizer, BSD-3-Clause); the
c4_test data is generated (synthetic text, seeded).

    bash benchmarks/torchtitan/setup_venv.sh /work/ttvenv
    /work/ttvenv/bin/python benchmarks/torchtitan/bench_torchtitan.py --venv /work/ttvenv --reps 2 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.abspath(os.path.join(HERE, "..", "..", "src"))
MODES = {
    "none": None,
    "dcp-disabled": ("disabled", False),
    "dcp-async": ("async", False),
    "dcp-pinned": ("async_with_pinned_mem", False),
    "lazy-pinned": ("async_with_pinned_mem", True),
    "lazy-async": ("async", True),
}


def _assets(root: str) -> None:
    """torchtitan's debug config reads ./tests/assets/{tokenizer,c4_test} from the working directory."""
    shutil.copytree(os.path.join(HERE, "assets", "tokenizer"), os.path.join(root, "tests", "assets", "tokenizer"))
    c4 = os.path.join(root, "tests", "assets", "c4_test")
    os.makedirs(c4)
    rng = random.Random(0)
    words = ("time year people way day man thing woman life child world school state family student group "
             "country problem hand part place case week company system program question work government "
             "number night point home water room mother area money story fact month lot right study book "
             "eye job word business issue side kind head house service friend father power hour game line").split()
    with open(os.path.join(c4, "data.json"), "w") as f:
        for i in range(2000):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(150, 400)))
            f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:00:00Z",
                                "url": f"https://example.com/{i}"}) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(venv: str, root: str, mode: str, steps: int) -> dict:
    dump = os.path.join(root, "out", mode)
    shutil.rmtree(dump, ignore_errors=True)
    times = os.path.join(root, f"times-{mode}.json")
    cmd = [os.path.join(venv, "bin", "torchrun"), "--nproc_per_node", "2", "--master_port", str(_free_port()),
           os.path.join(HERE, "cpu_train.py"), "--module", "llama3", "--config", "llama3_debugmodel",
           "--training.steps", str(steps), "--training.seq_len", "256", "--training.local_batch_size", "2",
           "--parallelism.spmd_backend", "partial_dtensor", "--dump_folder", dump]
    if MODES[mode] is not None:
        async_mode, lazy = MODES[mode]
        cmd += ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2",
                "--checkpoint.async_mode", async_mode]
        if lazy:
            cmd += ["--override.imports", "lazyckpt.integrations.torchtitan.lazy_checkpoint"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TT_TIMES=times, OMP_NUM_THREADS="1",
               PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        lines = [line for line in done.stdout.splitlines() + done.stderr.splitlines()
                 if "Error" in line or "error" in line]
        return {"error": (lines[-1] if lines else done.stderr[-300:]).strip()[:300]}
    with open(times) as f:
        got = json.load(f)
    ckpt = os.path.join(dump, "checkpoint")
    kept = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    files = sorted(os.listdir(os.path.join(ckpt, kept[-1]))) if kept else []
    return {"step_s": got["step_s"][1:], "save_s": got["save_s"][1:-1], "wait_s": got.get("wait_s", [])[1:],
            "wall_s": wall, "kept": kept, "files": files, "bytes": _tree_bytes(os.path.join(ckpt, kept[-1])) if kept else 0}


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", required=True, help="a venv with torchtitan 0.3.0 and its requirements")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="lazyckpt-titan-")
    try:
        _assets(root)
        results = {m: [] for m in args.modes}
        for rep in range(args.reps):
            order = args.modes if rep % 2 == 0 else list(reversed(args.modes))
            for mode in order:
                got = run_mode(args.venv, root, mode, args.steps)
                results[mode].append(got)
                if "error" in got:
                    print(f"rep {rep + 1} {mode:>13}: FAILED: {got['error']}", flush=True)
                else:
                    print(f"rep {rep + 1} {mode:>13}: step {statistics.median(got['step_s']) * 1e3:7.1f} ms, "
                          f"save() {statistics.median(got['save_s'] or [0]) * 1e3:7.1f} ms, staging wait "
                          f"{statistics.median(got['wait_s'] or [0]) * 1e3:6.1f} ms, wall {got['wall_s']:.1f} s, "
                          f"kept {got['kept']}, last step {got['bytes'] / 1e6:.1f} MB {got['files']}",
                          flush=True)
        print(f"\nmedians over {args.reps} repetition(s) x {args.steps - 1} steps (ms); checkpoint every step")
        print(f"{'mode':>13} {'train_step':>11} {'save()':>9} {'step+save':>10} {'overhead':>9}")
        base = None
        rows = {}
        for mode in args.modes:
            ok = [r for r in results[mode] if "error" not in r]
            if not ok:
                print(f"{mode:>13}   failed: {results[mode][0]['error']}")
                continue
            step = statistics.median(s for r in ok for s in r["step_s"])
            save = statistics.median(s for r in ok for s in r["save_s"]) if any(r["save_s"] for r in ok) else 0.0
            rows[mode] = step + save
            if mode == "none":
                base = step + save
            over = f"{(step + save) / base - 1:+9.1%}" if base else f"{'-':>9}"
            print(f"{mode:>13} {step * 1e3:11.1f} {save * 1e3:9.1f} {(step + save) * 1e3:10.1f} {over}")
        for lazy, peer in (("lazy-pinned", "dcp-async"), ("lazy-async", "dcp-async"), ("lazy-pinned", "dcp-disabled")):
            if lazy in rows and peer in rows:
                print(f"{lazy} / {peer}, step+save: {rows[lazy] / rows[peer]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
