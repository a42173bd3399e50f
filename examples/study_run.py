"""Study a run from its checkpoints: what changed between two steps, and a
statistic of every tensor over every kept step, reading only the pieces it needs.

Trains a small MLP for 10 steps with a checkpoint at each, then asks:
``lazyckpt.diff`` (which tensors moved most between step 1 and step 10) and
``lazyckpt.trajectory`` (the norm of each weight at every step), and the same
from the command line (``lazyckpt diff``, ``lazyckpt trajectory``).

    python examples/study_run.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import torch

import lazyckpt


def main() -> None:
    root = tempfile.mkdtemp(prefix="lazyckpt-study-example-")
    run = os.path.join(root, "run")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with lazyckpt.Checkpointer(run) as ckpt:
            ckpt.attach(optimizer)
            for step in range(1, 11):
                x = torch.randn(16, 32)
                loss = (model(x) - x[:, :1]).square().mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                ckpt.save({"model": model.state_dict()}, step, metadata={"loss": loss.item()})

        report = lazyckpt.diff(f"{run}@1", f"{run}@10", keys="model/*")
        print(f"diff step 1 -> 10 ({report.bytes_read} bytes read):")
        for row in report.compared:
            print(f"  {row.key:16s} ||a-b||/||a|| = {row.rel_change:.4f}")

        norms = lazyckpt.trajectory(run, keys="model/*weight", fn="norm").table()
        for key, by_step in norms.items():
            print(f"  norm of {key}: " + " ".join(f"{v:.3f}" for _, v in sorted(by_step.items())))
        assert all(len(by_step) == 10 for by_step in norms.values())

        cli = [sys.executable, "-m", "lazyckpt"]
        subprocess.run(cli + ["diff", f"{run}@1", f"{run}@10", "--top", "2"], check=True)
        subprocess.run(cli + ["trajectory", run, "--keys", "model/0.weight", "--stat", "std"], check=True)
        print(f"studied {len(norms)} weights over 10 steps from the checkpoints alone")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
