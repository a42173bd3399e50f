"""Lightning's Trainer with lazyckpt's CheckpointIO plugin (CPU, one process).

``Trainer(plugins=[LazyCheckpointIO()])``: every ``ModelCheckpoint`` save
returns at once and is written while training goes on; Lightning's callbacks
see a file only once it is committed. The files are ``torch.save``'s zip, so
``Trainer.fit(ckpt_path=...)`` resumes from them with or without lazyckpt;
here the resumed run's losses equal those of the run that never stopped.
(With ``import pytorch_lightning as pl`` use ``PLLazyCheckpointIO``.)

    python examples/lightning_example.py
"""

from __future__ import annotations

import os
import shutil
import tempfile

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lazyckpt.integrations.lightning import LazyCheckpointIO


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.global_step, loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)          # 4 steps an epoch


def trainer(dirpath):
    return L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0,
                     plugins=[LazyCheckpointIO(host_cache_bytes=8 << 20)],
                     callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)])


def main() -> None:
    root = tempfile.mkdtemp(prefix="lazyckpt-lightning-example-")
    try:
        torch.manual_seed(0)
        full = Tiny()
        trainer(os.path.join(root, "ckpts")).fit(full, data())     # when fit returns, every save is durable
        names = sorted(os.listdir(os.path.join(root, "ckpts")))
        print("checkpoints:", names)

        torch.manual_seed(123)                                      # other weights: they must be replaced
        resumed = Tiny()
        path = os.path.join(root, "ckpts", "epoch=0-step=4.ckpt")   # an epoch boundary: same batches next
        trainer(os.path.join(root, "resumed")).fit(resumed, data(), ckpt_path=path)
        expected = [x for x in full.losses if x[0] >= 4]
        if resumed.losses != expected:
            raise SystemExit(f"losses after resuming differ: {resumed.losses} != {expected}")
        print(f"restored step 4 bit-exact: the {len(expected)} losses after resuming equal the "
              f"uninterrupted run's (last {expected[-1][1]:.6f})")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
