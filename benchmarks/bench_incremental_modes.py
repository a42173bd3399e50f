"""What sound change detection costs: incremental off / "version-counters" / "content" (issue 22).

One run, two states of a small Llama trained with (non-fused) AdamW -- the
case where version counters are still right, so the comparison is of cost
alone:

* ``frozen``: fine-tuning, 90% of the parameters frozen (embeddings, head,
  lowest layers), as in BENCHMARKS section 9;
* ``full``: full training, every tensor changes between saves.

Per state, one Checkpointer per mode (each attached to the optimizer, its
own directory, keep_last=2), after one warm-up save each. Each repetition
runs, for every mode in a rotated order plus a ``none`` baseline: a
training step + ``save()``, a second training step (which overlaps the
background capture and write and waits in ``optimizer.step()`` for the
capture), then ``handle.wait()`` outside the timed window. Reported, as
medians over the repetitions:

* blocking: seconds inside ``save()``;
* check: the change check (``IncrementalIndex.plan``: version counters, or
  sample digests + hashing what may be unchanged), part of "captured";
* captured: save() -> every byte of the save copied out of (or, content
  mode, hashed in) the live state; an ``optimizer.step()`` waits for this;
* stall: how long the next ``optimizer.step()`` waited for that capture;
* durable: save() -> committed and durable (``handle.flush_s``);
* overhead: (the two timed training steps) - (the two of the ``none`` round
  of the same repetition), i.e. what one checkpoint costs the training loop
  (also the background threads' use of the cores: noisy on a shared machine);
* MB: bytes written per checkpoint.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_incremental_modes.py [--reps 5]
        [--hidden 256 --layers 4 --seq 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lazyckpt  # noqa: E402
from _common import emit_json, machine_line, print_table  # noqa: E402

MODES = ("off", "version-counters", "content")


def build(hidden: int, layers: int, vocab: int, frozen_fraction: float, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    heads = max(1, hidden // 64)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=(int(hidden * 8 / 3) + 63) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      vocab_size=vocab, max_position_embeddings=max(seq, 128), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    if frozen_fraction:
        # As bench_training.py: embeddings and head first, then the lowest layers.
        params = sorted(model.named_parameters(), key=lambda np_: 0 if "embed" in np_[0] or "lm_head" in np_[0] else 1)
        total, frozen = sum(p.numel() for _, p in params), 0
        for _name, p in params:
            if frozen + p.numel() <= frozen_fraction * total:
                p.requires_grad_(False)
                frozen += p.numel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.1)
    x = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    return model, opt, x


def run_state(label: str, args, frozen_fraction: float) -> dict:
    model, opt, x = build(args.hidden, args.layers, args.vocab, frozen_fraction, args.seq)

    def train():
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state(step):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
    train()                                                   # the moments exist
    # The stall: time between a pre-step hook registered before the Checkpointers'
    # (which wait for pending captures) and one registered after them.
    marks = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("before", time.perf_counter()))
    root = tempfile.mkdtemp(prefix="lzc-incr-modes-", dir=args.dir)
    ckpts = {}
    try:
        for mode in MODES:
            ckpts[mode] = lazyckpt.Checkpointer(os.path.join(root, mode), keep=2, incremental=mode,
                                                host_cache_bytes=args.cache_mib << 20)
            ckpts[mode].attach(opt)
            ckpts[mode].save(state(0), step=0).wait()         # the first save of a Checkpointer is full
        stalls = []
        # The change check itself (IncrementalIndex.plan, on the capture thread), timed per save.
        checks = []
        for mode in MODES[1:]:
            index = ckpts[mode]._incremental

            def timed_plan(*a, _real=index.plan, **kw):
                t0 = time.perf_counter()
                try:
                    return _real(*a, **kw)
                finally:
                    checks.append(time.perf_counter() - t0)
            index.plan = timed_plan
        opt.register_step_pre_hook(lambda *_: stalls.append(time.perf_counter() - marks["before"]))
        rows = {m: {k: [] for k in ("blocking", "check", "captured", "stall", "durable", "overhead", "bytes")}
                for m in MODES}
        step = 0
        order = ("none",) + MODES
        for rep in range(args.reps):
            k = rep % len(order)
            base = None
            for mode in order[k:] + order[:k]:                # rotated: no mode always follows another
                step += 1
                t = time.perf_counter()
                train()
                del checks[:]
                h = ckpts[mode].save(state(step), step=step) if mode != "none" else None
                del stalls[:]
                train()
                elapsed = time.perf_counter() - t
                if h is None:
                    base = elapsed
                    continue
                h.wait()
                r = rows[mode]
                r["blocking"].append(h.blocking_s)
                r["captured"].append(h.capture_s)
                r["check"].append(sum(checks))
                r["stall"].append(sum(stalls))
                r["durable"].append(h.flush_s)
                r["bytes"].append(h.bytes)
                r["overhead"].append(elapsed)
            for mode in MODES:                                # vs the baseline of this repetition
                rows[mode]["overhead"][-1] -= base
        # An incremental save of the content mode loads as the live state, bit for bit.
        ckpts["content"].save(state(step + 1), step=step + 1).wait()
        loaded = ckpts["content"].load()["model"]
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    finally:
        for c in ckpts.values():
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"label": label, "params": params, "trainable": trainable,
            "medians": {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cache-mib", type=int, default=256)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temp dir)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = [run_state("frozen 90%", args, 0.9), run_state("full training", args, 0.0)]
    print(machine_line())
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq}, AdamW; "
          f"medians of {args.reps} interleaved repetitions; times in ms")
    rows = []
    for res in results:
        for mode in MODES:
            m = res["medians"][mode]
            rows.append([f"{res['label']} ({res['trainable'] / 1e6:.1f}M of {res['params'] / 1e6:.1f}M trained)",
                         mode, f"{m['blocking'] * 1e3:.2f}", f"{m['check'] * 1e3:.1f}",
                         f"{m['captured'] * 1e3:.1f}", f"{m['stall'] * 1e3:.1f}", f"{m['durable'] * 1e3:.1f}", f"{m['overhead'] * 1e3:+.1f}", f"{m['bytes'] / 1e6:.1f}"])
    print_table(["state", "incremental", "save() blocking", "check", "captured", "step stall", "durable",
                 "step overhead", "MB"], rows)
    emit_json({"machine": machine_line(), "args": vars(args), "results": results}, args.json)


if __name__ == "__main__":
    main()
