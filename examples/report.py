"""A run you would rather look at than read: the report page of a run's
checkpoints, and the history plot that shows what changed.

Trains a small MLP with AdamW for 60 steps, saving every 5 steps with the
loss in ``metadata=``, then writes

* ``history.png`` (``lazyckpt trajectory RUN --png``): the loss in a panel of
  its own, one panel per group (model, optimizer), AdamW's ``step`` counters
  left out, a log axis where the norms span decades;
* ``report.html`` (``lazyckpt report RUN -o report.html``): one page with the
  line of history, the metrics, the norms, the biggest movers between the
  first and the last step and the save costs; plotly.js is inside, so it
  opens with no network.

    python examples/report.py                 # in a temporary directory, removed at the end
    python examples/report.py --out /tmp/r    # keep the run, the PNG and the page there

Needs matplotlib and plotly: ``pip install 'lazyckpt[plot,report]'``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import torch

import lazyckpt
from lazyckpt.study import write_report


def train(run: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        ckpt.attach(optimizer)
        for step in range(60):
            x = torch.randn(64, 16)
            loss = (model(x) - x[:, :1].sin()).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 5 == 0:
                ckpt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step,
                          metadata={"loss": loss.item()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="keep the run, history.png and report.html in this directory")
    args = parser.parse_args()
    root = args.out or tempfile.mkdtemp(prefix="lazyckpt-report-example-")
    os.makedirs(root, exist_ok=True)
    run = os.path.join(root, "run")
    try:
        shutil.rmtree(run, ignore_errors=True)
        train(run)
        png = os.path.join(root, "history.png")
        subprocess.run([sys.executable, "-m", "lazyckpt", "trajectory", run, "--png", png, "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        page = os.path.join(root, "report.html")
        report = write_report(run, page)                     # the same as: lazyckpt report RUN -o report.html
        loss = report.metrics["loss"]
        moved = report.diff.compared[0]
        print(f"loss {loss[report.kept[0]]:.3f} at step {report.kept[0]} -> {loss[report.kept[-1]]:.3f} at step "
              f"{report.kept[-1]}; moved most: {moved.key} (||a-b||/||a|| = {moved.rel_change:.2f})")
        print(f"wrote the report of {len(report.kept)} steps: {os.path.getsize(page) / 1e6:.1f} MB, "
              f"{len(report.rows)} manifests read" + (f", in {root}" if args.out else ""))
    finally:
        if not args.out:
            shutil.rmtree(root)


if __name__ == "__main__":
    main()
