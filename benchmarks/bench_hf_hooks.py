"""What the HF Trainer hooks of issue 24 cost on the training thread when no
capture is pending (the common case: every step but the one after a save).

Measures, in one run, interleaved, median of --reps repetitions of --calls calls:

* ``model.train()`` (the Trainer calls it every ``training_step``): plain
  ``nn.Module.train`` versus the guarded one;
* ``optimizer.train()`` of a schedule-free optimizer (called every step too);
* one callback event (``callback_handler.on_step_begin``): plain
  ``CallbackHandler`` versus the one that runs committed ``on_save`` first;
* what ``_save_checkpoint`` adds per save (installing the guards, recording
  the event with a copy of the state).

    HF_HUB_OFFLINE=1 python benchmarks/bench_hf_hooks.py --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _common import machine_line  # noqa: E402


def _per_call_us(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()

    import torch
    import transformers
    from lazyckpt.integrations import hf_callbacks
    from lazyckpt.integrations.huggingface import LazyCheckpointTrainer

    def build(cls, out, **extra):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=128)
        args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_steps=1,
                                              optim="schedule_free_adamw", disable_tqdm=True)
        trainer = cls(model=transformers.LlamaForCausalLM(config), args=args, **extra)
        trainer.create_optimizer()
        return trainer

    with tempfile.TemporaryDirectory() as out:
        plain = build(transformers.Trainer, out)
        lazy = build(LazyCheckpointTrainer, out, lazyckpt_options={"host_cache_bytes": 1 << 20})
        _ = lazy.lazyckpt_writer                     # a writer, no capture pending
        hf_callbacks.guard_in_place_changes(lazy)
        lazy.model.train()
        plain.model.train()
        lazy.optimizer.train()
        plain.optimizer.train()
        cases = {
            "model.train()": (plain.model.train, lazy.model.train),
            "optimizer.train()": (plain.optimizer.train, lazy.optimizer.train),
            "on_step_begin event": (
                lambda: plain.callback_handler.on_step_begin(plain.args, plain.state, plain.control),
                lambda: lazy.callback_handler.on_step_begin(lazy.args, lazy.state, lazy.control)),
        }
        events = lazy._lazyckpt_events

        def per_save():
            hf_callbacks.guard_in_place_changes(lazy)
            events.queued(None, os.path.join(out, "checkpoint-1"), out, None, None)
            events._just_queued = None
            events._queue.clear()
        results = {name: ([], []) for name in cases}
        save_us = []
        for _ in range(a.reps):                      # interleaved
            for name, (fn_plain, fn_lazy) in cases.items():
                results[name][0].append(_per_call_us(fn_plain, a.calls))
                results[name][1].append(_per_call_us(fn_lazy, a.calls))
            save_us.append(_per_call_us(per_save, a.calls))
        lazy.lazyckpt_close()

    print(machine_line())
    print(f"median of {a.reps} interleaved repetitions of {a.calls} calls, no capture pending")
    print(f"{'call':24s} {'plain us':>10s} {'lazyckpt us':>12s} {'added us':>10s}")
    for name, (p_us, l_us) in results.items():
        mp, ml = statistics.median(p_us), statistics.median(l_us)
        print(f"{name:24s} {mp:10.2f} {ml:12.2f} {ml - mp:10.2f}")
    print(f"{'per save (guards+event)':24s} {'':10s} {statistics.median(save_us):12.2f}")


if __name__ == "__main__":
    main()
