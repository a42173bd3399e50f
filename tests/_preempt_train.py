"""A small training run that tests/test_preemption.py preempts with a real signal.

    python _preempt_train.py run DIR          # train until preempted (SIGTERM), saving with interval=Every(steps=1000)
    python _preempt_train.py resume DIR EXTRA # the latest step + EXTRA steps: resumed from DIR, and from scratch

Under torchrun (``python -m torch.distributed.run --nproc_per_node 2``) each rank
trains on its own batch and the gradients are averaged over gloo. A model and
AdamW; the batch of a step depends on the step (and rank) only, so a resumed run
must end bit-exact with an uninterrupted one. Every rank writes what it did to
DIR/../rank<r>.json; the user's own SIGTERM handler (installed before the
Checkpointer) writes DIR/../user_handler_rank<r> when lazyckpt chains it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import lazyckpt

torch.set_num_threads(1)
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step * WORLD + RANK)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if WORLD > 1:
        import torch.distributed as dist
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= WORLD
    opt.step()


def state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def run(directory: str, sleep_s: float) -> None:
    here = os.path.dirname(directory)

    def user_handler(signum, frame):
        with open(os.path.join(here, f"user_handler_rank{RANK}"), "w") as f:
            f.write(str(signum))
    signal.signal(signal.SIGTERM, user_handler)
    model, opt = build()
    ckpt = lazyckpt.Checkpointer(directory, interval=lazyckpt.Every(steps=1000), preemption=True)
    ckpt.attach(opt)
    with open(os.path.join(here, f"pid_rank{RANK}"), "w") as f:
        f.write(str(os.getpid()))
    saved = []
    step = 0
    for step in range(1, 100_000):
        train_step(model, opt, step)
        print(f"rank {RANK} step {step}", flush=True)
        if ckpt.should_save(step):
            t0 = time.monotonic()
            h = ckpt.save(state(model, opt), step)
            saved.append({"step": step, "committed_on_return": h.done(), "blocked_s": time.monotonic() - t0})
        if ckpt.preempted:
            break
        time.sleep(sleep_s)
    user_ran_before_close = os.path.exists(os.path.join(here, f"user_handler_rank{RANK}"))
    t0 = time.monotonic()
    ckpt.close()
    with open(os.path.join(here, f"rank{RANK}.json"), "w") as f:
        json.dump({"rank": RANK, "last_step": step, "saved": saved, "preempted": ckpt.preempted,
                   "user_ran_before_close": user_ran_before_close, "close_s": time.monotonic() - t0}, f)


def resume(directory: str, extra: int) -> None:
    here = os.path.dirname(directory)
    ckpt = lazyckpt.Checkpointer(directory)
    latest = ckpt.latest_step()
    target = latest + extra
    model, opt = build()
    loaded = ckpt.load()
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    for step in range(latest + 1, target + 1):
        train_step(model, opt, step)
    ckpt.close()
    ref, ref_opt = build()
    for step in range(1, target + 1):
        train_step(ref, ref_opt, step)
    equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    with open(os.path.join(here, f"resume_rank{RANK}.json"), "w") as f:
        json.dump({"rank": RANK, "latest": latest, "target": target, "equal": equal}, f)


if __name__ == "__main__":
    if WORLD > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "run":
        run(directory, float(sys.argv[3]) if len(sys.argv) > 3 else 0.01)
    else:
        resume(directory, int(sys.argv[3]))
    if WORLD > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
