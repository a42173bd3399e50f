"""lazyckpt demo: train a small transformer with a checkpoint at EVERY step,
then "crash", restore and check that nothing was lost.

Three runs of the same training (same seed, same data):
  1. no checkpoints (the baseline),
  2. torch.save + fsync every step (what most training scripts do),
  3. lazyckpt: save() every step, returning at once; the copy runs while the
     next forward/backward runs.
Then a fresh model and optimizer are restored from lazyckpt's latest
checkpoint, compared bit for bit with the state at that step, and trained on:
the losses must equal those of the run that never stopped.

    python examples/demo.py [--steps 12] [--dim 512] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.nn as nn

import lazyckpt


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight            # tied embeddings: saved once
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.norm(self.blocks(self.embed(tokens), mask=mask, is_causal=True)))


def batch(step: int, args) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)


def build(args):
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    return model, opt


def train_step(model, opt, step, args) -> float:
    tokens = batch(step, args)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def state_of(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "rng": torch.get_rng_state()}


def run(mode: str, args, workdir: str):
    model, opt = build(args)
    times, blocking, durable, losses = [], [], [], []
    ckpt = None
    if mode == "lazyckpt":
        ckpt = lazyckpt.Checkpointer(os.path.join(workdir, "lazy"), keep=2)
        ckpt.attach(opt)                      # the barrier before each optimizer step
    handles = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses.append(train_step(model, opt, step, args))
        if mode == "torch.save":
            t1 = time.perf_counter()
            path = os.path.join(workdir, f"torch_{step % 2}.pt")
            torch.save(state_of(model, opt, step), path)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            blocking.append(time.perf_counter() - t1)
            durable.append(blocking[-1])
        elif mode == "lazyckpt":
            handle = ckpt.save(state_of(model, opt, step), step=step)
            blocking.append(handle.blocking_s)
            handles.append(handle)
        times.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.wait()
        durable = [h.flush_s for h in handles]
        ckpt.close()
    steady = times[1:] or times
    return {"iter_s": sum(steady) / len(steady), "blocking_s": blocking, "durable_s": durable,
            "losses": losses, "model": model, "opt": opt}


def main() -> None:
    p = argparse.ArgumentParser(description="lazyckpt demo")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    workdir = args.dir or tempfile.mkdtemp(prefix="lazyckpt-demo-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    model, opt = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f} M parameters; checkpoint (model + AdamW) every step for "
          f"{args.steps} steps; torch {torch.__version__}; {os.cpu_count()} CPU cores")
    results = {}
    for mode in ("no checkpoint", "torch.save", "lazyckpt"):
        print(f"  training with {mode} ...", flush=True)
        results[mode] = run(mode, args, workdir)

    base = results["no checkpoint"]["iter_s"]
    print()
    print(f"{'mode':<15} {'s/iter':>8} {'overhead':>9} {'save() blocks':>14} {'durable after':>14}")
    for mode, r in results.items():
        blk = f"{1e3 * sum(r['blocking_s']) / len(r['blocking_s']):.1f} ms" if r["blocking_s"] else "-"
        dur = f"{1e3 * sum(r['durable_s']) / len(r['durable_s']):.0f} ms" if r["durable_s"] else "-"
        print(f"{mode:<15} {r['iter_s']:>8.3f} {100 * (r['iter_s'] / base - 1):>8.1f}% {blk:>14} {dur:>14}")
    ts, lz = results["torch.save"], results["lazyckpt"]
    print(f"\nlazyckpt's save() blocked {sum(ts['blocking_s']) / max(sum(lz['blocking_s']), 1e-9):.0f}x "
          f"less than torch.save's; training ran {ts['iter_s'] / lz['iter_s']:.2f}x faster than with torch.save.")

    # ---- crash and restore: a fresh model and optimizer from the latest checkpoint.
    ckpt = lazyckpt.Checkpointer(os.path.join(workdir, "lazy"))
    last = ckpt.latest_step()
    t0 = time.perf_counter()
    restored = ckpt.load()
    load_s = time.perf_counter() - t0
    model2, opt2 = build(args)
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["optim"])
    torch.set_rng_state(restored["rng"])
    ckpt.close()
    # The lazyckpt run's live model is exactly at step `last`: compare bit for bit.
    live = lz["model"].state_dict()
    exact = all(torch.equal(live[k], v) for k, v in model2.state_dict().items())
    exact &= all(torch.equal(a, b) for s1, s2 in zip(lz["opt"].state.values(), opt2.state.values())
                 for a, b in zip(s1.values(), s2.values()))
    tied = model2.head.weight.data_ptr() == model2.embed.weight.data_ptr()
    print(f"\nrestored step {last} in {load_s * 1e3:.0f} ms: bit-exact with the live state: {exact}; "
          f"tied embedding still shared: {tied}")
    # Continue both and compare losses.
    cont_live = [train_step(lz["model"], lz["opt"], s, args) for s in range(last + 1, last + 4)]
    cont_rest = [train_step(model2, opt2, s, args) for s in range(last + 1, last + 4)]
    same = cont_live == cont_rest
    print(f"losses after resuming {['%.6f' % x for x in cont_rest]} equal the uninterrupted run's: {same}")
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    if not (exact and same and tied):
        raise SystemExit("demo FAILED: restored state differs")
    print("demo OK")


if __name__ == "__main__":
    main()
