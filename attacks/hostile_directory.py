"""Attack: a hostile checkpoint *directory* (a downloaded or shared run).

* ``manifest.json`` is a FIFO: opening it blocks forever (a reader must not
  open a non-regular file);
* ``manifest.json`` is a symlink to ``/dev/zero`` (endless input);
* a data file is a FIFO / a symlink to ``/dev/zero``;
* the manifest names ``../../outside.lzc`` or an absolute path, to make the
  loader read a file outside the step directory.

Safe outcome: a ``CheckpointError`` quickly (never a hang, never a read
outside the directory), through both ``lazyckpt.load(step_dir)`` and
``Checkpointer(dir).load(step=N)``. Memory: a manifest is read up to its
64 MiB limit (the reader reserves that much for every manifest read), so these
cases allow an 80 MiB Python-heap peak.
"""

from __future__ import annotations

import json
import os
import shutil

from _attack_common import demo


def _step(directory: str, name: str, state) -> str:
    import lazyckpt
    run = os.path.join(directory, f"hostile_dir_{name}")
    shutil.rmtree(run, ignore_errors=True)
    with lazyckpt.Checkpointer(run) as ckpt:
        ckpt.save(state, step=7).wait()
    return run


HEAP = 80 << 20


def make(directory: str):
    import torch
    state = {"w": torch.arange(6.0)}
    cases = []

    run = _step(directory, "fifo_manifest", state)
    manifest = os.path.join(run, "step_0000000007", "manifest.json")
    os.unlink(manifest)
    os.mkfifo(manifest)
    cases.append({"name": "manifest is a FIFO (Checkpointer)", "path": run, "via": "checkpointer", "step": 7,
                  "expect": "CheckpointError", "time_limit": 3.0})
    cases.append({"name": "manifest is a FIFO (load)", "path": os.path.join(run, "step_0000000007"),
                  "expect": "CheckpointError"})

    run = _step(directory, "zero_manifest", state)
    manifest = os.path.join(run, "step_0000000007", "manifest.json")
    os.unlink(manifest)
    os.symlink("/dev/zero", manifest)
    cases.append({"name": "manifest -> /dev/zero (Checkpointer)", "path": run, "via": "checkpointer",
                  "step": 7, "expect": "CheckpointError"})

    for kind in ("fifo", "zero"):
        run = _step(directory, f"{kind}_data", state)
        data = os.path.join(run, "step_0000000007", "rank_00000.lzc")
        os.unlink(data)
        if kind == "fifo":
            os.mkfifo(data)
        else:
            os.symlink("/dev/zero", data)
        cases.append({"name": f"data file is {kind}", "path": os.path.join(run, "step_0000000007"),
                      "expect": "CorruptCheckpointError"})

    for name, target in (("parent", "../../outside.lzc"), ("absolute", "/etc/passwd"),
                         ("sibling-step", "../step_0000000001/rank_00000.lzc")):
        run = _step(directory, f"traversal_{name}", state)
        path = os.path.join(run, "step_0000000007", "manifest.json")
        with open(path) as f:
            doc = json.load(f)
        # New manifests derive the names (file_bytes); the older form lists them,
        # and still loads, so the traversal is tried on that form.
        (size, _), = doc.pop("file_bytes")
        doc["files"] = [{"rank": 0, "name": target, "bytes": size}]
        with open(path, "w") as f:
            json.dump(doc, f)
        cases.append({"name": f"manifest names {name}", "path": os.path.join(run, "step_0000000007"),
                      "expect": "CorruptCheckpointError"})
    for case in cases:
        case["heap_budget"] = HEAP
    return cases


if __name__ == "__main__":
    demo(make)
