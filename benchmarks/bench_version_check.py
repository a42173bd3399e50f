"""What incremental checkpoints cost when nothing can be skipped (full training).

On the training benchmark's Llama state (weights + AdamW moments, every
tensor changed by an optimizer step between saves), in one run, medians of
interleaved repetitions:

* save()'s walk of the state (``flatten``) as lazyckpt does it -- keeping,
  per storage, the tensors whose version counters the capture thread will
  read -- against the same walk with that bookkeeping stubbed out: the part of
  ``save()``'s blocking time the version check adds;
* ``IncrementalIndex.plan`` after a step that changed everything (it runs on
  the capture thread, not in ``save()``), and after one that changed nothing;
* ``save()``'s whole blocking time with ``incremental="version-counters"`` for scale
  (the sound default, ``incremental=True`` = "content", is measured by
  bench_incremental_modes.py).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_version_check.py [--hidden 768 --layers 8] [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lazyckpt  # noqa: E402
from lazyckpt.state import providers  # noqa: E402
from lazyckpt.saving.incremental import IncrementalIndex  # noqa: E402
from _common import emit_json, machine_line  # noqa: E402


def build(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=(int(hidden * 8 / 3) + 63) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 64), vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 32000, (1, 32))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def step(model, opt) -> None:
    with torch.no_grad():               # an optimizer-like in-place update of everything
        for p in model.parameters():
            p.mul_(1.0)
        for s in opt.state.values():
            s["exp_avg"].mul_(1.0)
            s["exp_avg_sq"].mul_(1.0)
            s["step"].add_(1)


class _NoTensorList(list):
    def append(self, _item):        # the bookkeeping stubbed out
        pass


class _UntrackedSource(providers.Source):
    def __post_init__(self):
        self.tensors = _NoTensorList()


def walk_without_versions(state):
    """providers.flatten without the per-storage tensor list (the baseline)."""
    real, providers.Source = providers.Source, _UntrackedSource
    try:
        return providers.flatten(state)
    finally:
        providers.Source = real


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model, opt = build(args.hidden, args.layers)

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    tensors = len(providers.flatten(state()).sources)
    with_v, without_v = [], []
    for _ in range(args.reps):                          # interleaved
        with_v.append(timed(lambda: providers.flatten(state())))
        without_v.append(timed(lambda: walk_without_versions(state())))
    index = IncrementalIndex("version-counters")

    def commit(plan, step_no, flat):
        entries = [lazyckpt.formats.datafile.Entry("data", 4096, s.length or 0, [0] *
                                         lazyckpt.formats.datafile.block_count(4096, s.length or 0, 1 << 25))
                   for s in flat.sources]
        index.commit(plan, step_no, 0, "x", entries, 1 << 25)
    flat = providers.flatten(state())
    commit(index.plan(flat.sources, 1), 1, flat)
    changed, unchanged, referred = [], [], 0
    for i in range(args.reps):
        step(model, opt)                                # everything changes
        flat = providers.flatten(state())
        t = time.perf_counter()
        plan = index.plan(flat.sources, 2 + 2 * i)
        changed.append(time.perf_counter() - t)
        commit(plan, 2 + 2 * i, flat)
        flat = providers.flatten(state())               # nothing changed since
        t = time.perf_counter()
        plan = index.plan(flat.sources, 3 + 2 * i)
        unchanged.append(time.perf_counter() - t)
        referred = len(plan.refs)
        commit(plan, 3 + 2 * i, flat)
    blocking = []
    with tempfile.TemporaryDirectory() as d:
        with lazyckpt.Checkpointer(d, keep=1, incremental="version-counters",
                                   host_cache_bytes=256 << 20) as ckpt:
            for i in range(max(3, args.reps // 3)):
                step(model, opt)
                h = ckpt.save(state(), step=i)
                blocking.append(h.blocking_s)
                h.wait()
    med = statistics.median
    added = med(with_v) - med(without_v)
    print(machine_line())
    print(f"state: Llama hidden={args.hidden} layers={args.layers}, {tensors} storages; medians of {args.reps}")
    print(f"  walk (save()'s work on the caller's thread) with version recording:    {med(with_v) * 1e3:7.3f} ms")
    print(f"  walk with the recording stubbed out:                                  {med(without_v) * 1e3:7.3f} ms")
    print(f"  added by the version check:                                           {added * 1e3:7.3f} ms "
          f"({added / med(blocking) * 100:.2f}% of save()'s blocking time, {med(blocking) * 1e3:.2f} ms)")
    print(f"  plan on the capture thread, everything changed:                       {med(changed) * 1e3:7.3f} ms")
    print(f"  plan on the capture thread, nothing changed ({referred} referred):     {med(unchanged) * 1e3:7.3f} ms")
    emit_json({"machine": machine_line(), "storages": tensors, "walk_with_s": med(with_v),
               "walk_without_s": med(without_v), "added_s": added, "save_blocking_s": med(blocking),
               "added_fraction_of_blocking": added / med(blocking), "plan_all_changed_s": med(changed),
               "plan_nothing_changed_s": med(unchanged)}, args.json)


if __name__ == "__main__":
    main()
