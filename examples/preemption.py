"""Preemption: the scheduler's SIGTERM becomes a committed checkpoint of the
current step, and the restarted job resumes from it.

``interval=lazyckpt.Every(steps=5)`` saves every 5 steps; ``preemption=True``
turns SIGTERM or SIGUSR1 into a save at the next step boundary, committed
before ``save()`` returns, after which ``ckpt.preempted`` tells the loop to
stop. Here the job signals itself at step 7 (as SLURM, Kubernetes or a spot
instance would), stops with step 7 committed, and a second run resumes from
step 7 and ends with the same weights as a run that was never interrupted.

    python examples/preemption.py
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import torch

import lazyckpt

STEPS = 12


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step):
    torch.manual_seed(step)                          # the batch of this step
    x = torch.randn(8, 16)
    (model(x) - x[:, :1]).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def run(directory, signal_at=None):
    """One job: resume from the latest step if there is one, train, stop when preempted."""
    model, optimizer = make()
    ckpt = lazyckpt.Checkpointer(directory, keep=2, interval=lazyckpt.Every(steps=5), preemption=True)
    ckpt.attach(optimizer)
    start = 1
    if ckpt.latest_step() is not None:
        state = ckpt.load()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = state["step"] + 1
        print(f"resumed from step {state['step']}")
    for step in range(start, STEPS + 1):
        train_step(model, optimizer, step)
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)     # the scheduler wants the node back
        if ckpt.should_save(step):
            ckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, step)
        if ckpt.preempted:
            print(f"preempted at step {step}: committed steps {ckpt.steps()}")
            break
    ckpt.close()
    return model


def main() -> None:
    root = tempfile.mkdtemp(prefix="lazyckpt-preemption-example-")
    try:
        uninterrupted = run(os.path.join(root, "reference"))
        run(os.path.join(root, "job"), signal_at=7)    # stops with step 7 committed
        resumed = run(os.path.join(root, "job"))       # the restarted job
        a, b = uninterrupted.state_dict(), resumed.state_dict()
        if not all(torch.equal(a[k], b[k]) for k in a):
            raise SystemExit("the resumed job's weights differ from the uninterrupted run's")
        print(f"restored step 7 bit-exact after the preemption: the final weights equal the uninterrupted run's")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
