"""HF Trainer training with a checkpoint every K steps, in one run (issue 24):

* ``no checkpoint``: ``save_strategy="no"``, the baseline;
* ``plain Trainer``: ``transformers.Trainer``'s own synchronous checkpoint
  (``save_pretrained`` + ``torch.save``; it does not fsync);
* ``lazyckpt, HF layout``: ``LazyCheckpointTrainer`` (default), the same
  files as the plain Trainer, written in the background, durable at commit;
* ``lazyckpt, lazyckpt layout``: ``lazyckpt_checkpoint_format="lazyckpt"``,
  one ``lazyckpt.lzc`` per checkpoint.

Per variant, medians over ``--reps`` interleaved repetitions (variants in a
rotating order): wall time of ``train()`` (for lazyckpt it ends once every
checkpoint is durable), overhead over the baseline per checkpoint, time
``_save_checkpoint`` blocks the training loop (median of all its calls), and
for the HF layout the part of it spent on the small files on the training
thread (pickling ``training_args.bin``, scheduler and RNG states:
``hf_layout._small_files``; copying the configs: ``hf_layout._config_copies``).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_hf_trainer.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from _common import machine_line, print_table  # noqa: E402
from lazyckpt.integrations import hf_layout  # noqa: E402
from lazyckpt.integrations.huggingface import LazyCheckpointMixin  # noqa: E402

VARIANTS = ["no checkpoint", "plain Trainer", "lazyckpt, HF layout", "lazyckpt, lazyckpt layout"]


class Data(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def timed(cls):
    class Timed(cls):
        def _save_checkpoint(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._save_checkpoint(*args, **kwargs)
            finally:
                self.blocking.append(time.perf_counter() - t0)
    return Timed


PLAIN = timed(transformers.Trainer)
LAZY = timed(type("LazyTrainer", (LazyCheckpointMixin, transformers.Trainer), {}))

small_files_s = []


def _timed(fn):
    def timed_fn(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            small_files_s.append(time.perf_counter() - t0)
    return timed_fn


# Instrumentation only: the same functions, timed (summed per checkpoint below).
hf_layout._small_files = _timed(hf_layout._small_files)
hf_layout._config_copies = _timed(hf_layout._config_copies)


def run(variant, out, a):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=8,
                                      intermediate_size=a.hidden * 8 // 3, vocab_size=a.vocab,
                                      max_position_embeddings=a.seq)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=a.steps, per_device_train_batch_size=a.batch, learning_rate=1e-4,
        save_strategy="no" if variant == "no checkpoint" else "steps", save_steps=a.every, report_to=[],
        dataloader_num_workers=0, use_cpu=True, disable_tqdm=True, logging_strategy="no")
    kw = {}
    cls = PLAIN
    if variant.startswith("lazyckpt"):
        cls = LAZY
        kw = {"lazyckpt_options": {"host_cache_bytes": a.cache_mib << 20},
              "lazyckpt_checkpoint_format": "hf" if "HF" in variant else "lazyckpt"}
    trainer = cls(model=model, args=args, train_dataset=Data(a.batch * a.steps, a.seq, a.vocab), **kw)
    trainer.blocking = []
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs)
    return wall, trainer.blocking, nbytes, sum(p.numel() for p in model.parameters())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4, help="checkpoint every K steps")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cache-mib", type=int, default=512)
    p.add_argument("--dir", default="/tmp/bench_hf_trainer")
    a = p.parse_args()
    transformers.logging.set_verbosity_error()
    results = {v: {"wall": [], "blocking": [], "small": []} for v in VARIANTS}
    info = {}
    for rep in range(a.reps):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
        for variant in order:
            out = os.path.join(a.dir, variant.replace(" ", "_").replace(",", ""))
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            del small_files_s[:]
            wall, blocking, nbytes, params = run(variant, out, a)
            results[variant]["wall"].append(wall)
            results[variant]["blocking"].extend(blocking)
            if blocking and small_files_s:      # two timed calls per checkpoint
                results[variant]["small"].extend(
                    small_files_s[i] + small_files_s[i + 1] for i in range(0, len(small_files_s) - 1, 2))
            info[variant] = nbytes
            info["params"] = params
            print(f"rep {rep} {variant}: {wall:.2f} s, {len(blocking)} saves, "
                  f"blocking median {statistics.median(blocking) * 1e3 if blocking else 0:.1f} ms", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    saves = a.steps // a.every
    base = statistics.median(results["no checkpoint"]["wall"])
    rows = []
    for v in VARIANTS:
        r = results[v]
        wall = statistics.median(r["wall"])
        blocking = statistics.median(r["blocking"]) * 1e3 if r["blocking"] else 0.0
        small = f"{statistics.median(r['small']) * 1e3:.1f}" if r["small"] else "-"
        over = (wall - base) / saves if v != "no checkpoint" else 0.0
        rows.append([v, f"{wall:.2f}", f"{over:.2f}" if v != "no checkpoint" else "-",
                     f"{blocking:.1f}" if r["blocking"] else "-", small,
                     f"{info[v] / 1e6:.0f}" if v != "no checkpoint" else "-"])
    print()
    print(machine_line())
    print(f"Llama {info['params'] / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}), "
          f"AdamW, {a.steps} steps of batch {a.batch}x{a.seq}, a checkpoint every {a.every} steps ({saves} per run); "
          f"medians of {a.reps} interleaved repetitions")
    print_table(["variant", "train() s", "overhead s / checkpoint", "blocking ms / checkpoint",
                 "of it small files ms", "MB on disk at the end"], rows)
    plain = statistics.median(results["plain Trainer"]["blocking"])
    for v in VARIANTS[2:]:
        print(f"{v}: blocks {statistics.median(results[v]['blocking']) / plain:.3f}x the plain Trainer's save; "
              f"overhead {(statistics.median(results[v]['wall']) - base) / max(1e-9, statistics.median(results['plain Trainer']['wall']) - base):.2f}x")


if __name__ == "__main__":
    main()
