"""Runs to report on, shared by tests/test_report.py, benchmarks/bench_report.py
and examples/report.py's screenshot in the docs.

* :func:`train_mlp`: a small MLP trained with AdamW, a save every ``every``
  steps with ``metadata={"loss": ...}`` -- the case a new user tries first.
* :func:`build_long_run`: a run of ``steps`` kept steps in a few seconds.
  ``real`` steps are saved by a Checkpointer (each from a different point of
  a training run); the others are **clones** of them: their data file is a
  hard link to a real save's (so its footer's save id is that save's, and
  the clone's manifest carries the same id: every check of a read holds),
  and their manifest is rewritten with the clone's own step, ``seq``, commit
  time and metadata (a loss that goes down with the step). ``history.json``
  and ``latest`` say what a Checkpointer would have written. Saving 10,000
  steps for real would take minutes; what the report reads -- the listing,
  the manifests, the tensors of the sampled steps -- is the same kind of
  bytes either way.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from typing import Dict, List

import torch

import lazyckpt


def train_mlp(run: str, steps: int = 60, every: int = 5, seed: int = 0, frozen: bool = False,
              **checkpointer) -> List[int]:
    """The saved steps of an MLP + AdamW run of ``steps`` steps into ``run``.
    ``frozen``: the state also holds a table that never changes (what an
    incremental save refers to instead of writing it again)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = []
    with lazyckpt.Checkpointer(run, keep=None, **checkpointer) as ckpt:
        ckpt.attach(opt)
        for step in range(steps):
            x = torch.randn(64, 16)
            loss = (model(x) - x[:, :1].sin()).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % every == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                if frozen:
                    state["data"] = {"table": torch.arange(4096, dtype=torch.float32)}
                ckpt.save(state, step,
                          metadata={"loss": loss.item(), "lr": opt.param_groups[0]["lr"]})
                saved.append(step)
    return saved


def build_long_run(run: str, steps: int, real: int = 20) -> Dict[str, int]:
    """``steps`` kept steps (0 .. steps-1) in ``run``: ``real`` saved, the rest
    cloned from them (module docstring). Returns counts of what was made."""
    from lazyckpt.formats import manifest as manifests
    from lazyckpt.lineage import RECENT_EVENTS
    scratch = run + ".real"
    real = max(1, min(real, steps))
    train_mlp(scratch, steps=real, every=1)
    sources = []
    for s in range(real):
        src = os.path.join(scratch, f"step_{s:010d}")
        with open(os.path.join(src, "manifest.json"), "rb") as f:
            doc = json.loads(f.read())
        doc.pop("checksum")
        sources.append((src, doc))
    os.makedirs(run, exist_ok=True)
    events = []
    t0 = sources[0][1]["created_unix"]
    links: Dict[str, str] = {}
    for k in range(steps):
        src, template = sources[k * real // steps]
        d = os.path.join(run, f"step_{k:010d}")
        os.mkdir(d)
        for name in os.listdir(src):
            if name == "manifest.json":
                continue
            origin = links.get(os.path.join(src, name), os.path.join(src, name))
            try:
                os.link(origin, os.path.join(d, name))
            except OSError as exc:          # ext4 allows 65,000 links per file: a fresh copy
                if exc.errno != errno.EMLINK:
                    raise
                shutil.copyfile(origin, os.path.join(d, name))
                links[os.path.join(src, name)] = os.path.join(d, name)
        loss = 0.05 + 0.5 * math.exp(-k / (steps / 8)) + 0.01 * math.sin(k / 7.0)
        doc = dict(template, step=k, seq=k + 1, created_unix=t0 + k,
                   metadata={"step": k, "loss": loss, "lr": 1e-2})
        doc["checksum"] = manifests.checksum(doc)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")))
        events.append([k, doc["save_id"], k + 1])
    last = events[-1]
    record = {"seq": steps, "events": events[-RECENT_EVENTS:],
              "commit": [last[0], last[1], last[2], ".tmp-step_%010d-000000000000" % last[0]]}
    with open(os.path.join(run, "history.json"), "w") as f:
        f.write(json.dumps(record, separators=(",", ":")))
    with open(os.path.join(run, "latest"), "w") as f:
        f.write(f"{steps - 1}\n")
    return {"steps": steps, "real": real}
