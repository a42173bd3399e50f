"""Lightning training with ModelCheckpoint every K steps (issue 27), in one run:
the default TorchCheckpointIO, Lightning's AsyncCheckpointIO, and lazyckpt's
LazyCheckpointIO writing torch zips (the default, read by torch.load) and
lazyckpt files. Interleaved repetitions; medians.

Reported per variant: wall time of fit (checkpoint durable at its end),
overhead against fit without checkpoints, and the training thread's blocking
time per save (time inside CheckpointIO.save_checkpoint plus the waits the
plugin's barriers add, measured as fit time minus the no-checkpoint fit time
divided by saves, and the time inside save_checkpoint alone).

    .venv/bin/python benchmarks/bench_lightning.py [--mb 200] [--steps 40] [--every 10] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200, help="model parameters in MB (x3 with AdamW states)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from lazyckpt.integrations.lightning import LazyCheckpointIO

    width = int((args.mb * 1e6 / 4 / 4) ** 0.5)          # 4 square layers of width^2 float32

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])

        def training_step(self, batch, i):
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(args.steps * 8, width)),
                                       batch_size=8)

    inside = {}

    def timed(plugin, name):
        original = plugin.save_checkpoint

        def save(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                inside[name] = inside.get(name, 0.0) + time.perf_counter() - t0
        plugin.save_checkpoint = save
        return plugin

    variants = {
        "no checkpoint": lambda: None,
        "default TorchCheckpointIO": lambda: TorchCheckpointIO(),
        "Lightning AsyncCheckpointIO": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "lazyckpt, torch format": lambda: LazyCheckpointIO(file_format="torch"),
        "lazyckpt, lazyckpt format": lambda: LazyCheckpointIO(file_format="lazyckpt"),
    }
    root = tempfile.mkdtemp(prefix="bench_lightning_", dir=os.environ.get("BENCH_DIR"))
    times = {name: [] for name in variants}
    blocking = {name: [] for name in variants}
    saves = args.steps // args.every
    try:
        for rep in range(args.reps):
            for name, make in variants.items():
                plugin = make()
                if plugin is not None:
                    plugin = timed(plugin, name)
                inside[name] = 0.0
                dirpath = os.path.join(root, f"{rep}-{len(times[name])}-{name.split()[0]}")
                callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=-1)] \
                    if plugin is not None else []
                trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", logger=False,
                                    enable_progress_bar=False, enable_model_summary=False,
                                    enable_checkpointing=plugin is not None,
                                    plugins=[plugin] if plugin is not None else None, callbacks=callbacks)
                torch.manual_seed(0)
                model = Model()
                t0 = time.perf_counter()
                trainer.fit(model, data)
                times[name].append(time.perf_counter() - t0)
                blocking[name].append(inside[name] / saves)
                if plugin is not None:
                    assert len(os.listdir(dirpath)) == saves, os.listdir(dirpath)
                shutil.rmtree(dirpath, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ckpt_mb = sum(p.numel() for p in Model().parameters()) * 4 * 3 / 1e6
    base = statistics.median(times["no checkpoint"])
    print(f"model {ckpt_mb / 3:.0f} MB params, checkpoint ~{ckpt_mb:.0f} MB, {args.steps} steps, "
          f"save every {args.every} ({saves} saves), {args.reps} interleaved reps, medians")
    print(f"{'variant':30s} {'fit s':>8s} {'overhead s':>11s} {'overhead/save s':>16s} {'in save() s':>12s}")
    for name in variants:
        t = statistics.median(times[name])
        over = t - base
        print(f"{name:30s} {t:8.2f} {over:11.2f} {over / saves if name != 'no checkpoint' else 0:16.3f} "
              f"{statistics.median(blocking[name]):12.4f}")
    default_over = statistics.median(times["default TorchCheckpointIO"]) - base
    for name in ("Lightning AsyncCheckpointIO", "lazyckpt, torch format", "lazyckpt, lazyckpt format"):
        over = statistics.median(times[name]) - base
        print(f"overhead ratio {name} / default: {over / default_over:.2f}")


if __name__ == "__main__":
    main()
