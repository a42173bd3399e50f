"""A small Lightning run that tests/test_preemption_lightning.py preempts with SIGTERM.

    python _preempt_lightning.py run DIR            # fit until SIGTERM; SaveOnPreemption(dirpath=DIR)
    python _preempt_lightning.py resume DIR EXTRA    # from DIR's preempted checkpoint, EXTRA more steps; and from scratch

LazyCheckpointIO saves; the batch of a step depends on the global step only (a
resumed epoch re-reads its loader from the start), so a resumed run must end
bit-exact with an uninterrupted one. What each run did goes to DIR/../*.json.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)

import lightning.pytorch as L  # noqa: E402

from lazyckpt.integrations.lightning import LazyCheckpointIO  # noqa: E402
from lazyckpt.integrations.lightning_preemption import SaveOnPreemption  # noqa: E402


class Model(L.LightningModule):
    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.sleep_s = sleep_s

    def training_step(self, batch, batch_idx):
        g = torch.Generator().manual_seed(self.global_step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        print(f"rank 0 step {self.global_step}", flush=True)
        time.sleep(self.sleep_s)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(100_000)), batch_size=1)


def trainer(max_steps: int, callbacks=()):
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, max_steps=max_steps, plugins=[LazyCheckpointIO()],
                     callbacks=list(callbacks))


def run(directory: str) -> None:
    cb = SaveOnPreemption(dirpath=directory)
    t = trainer(100_000, [cb])
    stopped_by = None
    try:
        t.fit(Model(sleep_s=0.01))
    except SystemExit as exc:           # Lightning's SIGTERMException, after the save
        stopped_by = type(exc).__name__
        raise
    finally:
        with open(os.path.join(os.path.dirname(directory), "run.json"), "w") as f:
            json.dump({"saved": cb.saved_path, "global_step": t.global_step, "stopped_by": stopped_by}, f)


def resume(directory: str, extra: int) -> None:
    (path,) = glob.glob(os.path.join(directory, "preempted-step=*.ckpt"))
    step = int(path.rsplit("=", 1)[1].split(".")[0])
    resumed = Model()
    trainer(step + extra).fit(resumed, ckpt_path=path)
    ref = Model()
    trainer(step + extra).fit(ref)
    equal = all(torch.equal(a, b) for a, b in zip(resumed.parameters(), ref.parameters()))
    with open(os.path.join(os.path.dirname(directory), "resume.json"), "w") as f:
        json.dump({"step": step, "equal": equal}, f)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        resume(sys.argv[2], int(sys.argv[3]))
