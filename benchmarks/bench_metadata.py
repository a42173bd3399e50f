"""Metadata at 1,024 / 4,096 / 16,384 ranks with the placement-derived index
(issue 12), from a synthetic generator: every rank's commit report as the
store hands it to the coordinator (JSON), the coordinator's work for one
commit (parse the reports, group keysets, build the manifest), the root
manifest's bytes, and what a loading rank must read.

The reports and manifest are produced by lazyckpt's own code
(``manifest.build``, ``manifest.group_keysets``) from reports shaped exactly
like ``StepCommit.commit``'s; the DTensor footer nodes are real
``DTensorProvider`` nodes of an FSDP ``Shard(0)`` layout (their JSON size is
measured, not guessed). What is not simulated: the store's own latency
(O(1) requests: one ``wait`` and one ``multi_get`` per commit) and the
footer read of one rank per distinct layout (O(tensors), once).

    python benchmarks/bench_metadata.py [--ranks 1024,4096,16384] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from lazyckpt.formats import datafile as fmt
from lazyckpt.formats import manifest as manifests
from lazyckpt.distributed import parse_values

#: (name, parameters, AdamW: x3 tensors): a Llama-7B-like and a 70B-like model.
MODELS = {"7B-like": (291, 4096, 11008, 32), "70B-like": (723, 8192, 28672, 80)}


def param_shapes(name):
    n_params, hidden, ffn, layers = MODELS[name]
    shapes = [[32000, hidden]]
    for _ in range(layers):
        shapes += [[hidden, hidden]] * 4 + [[ffn, hidden], [ffn, hidden], [hidden, ffn], [hidden], [hidden]]
    shapes += [[hidden], [32000, hidden]]
    return shapes


def layouts_for(shapes, ranks):
    mesh = {"shape": [ranks], "start": 0, "strides": [1]}     # what _describe_mesh gives for init_device_mesh
    out = {}
    for i, shape in enumerate(shapes):
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            out[json.dumps([kind, str(i)])] = {"global_shape": shape, "dtype": "float32",
                                                "layout": {"mesh": mesh, "placements": [["S", 0]]}}
    return out


def footer_node_bytes(shape, ranks):
    """JSON bytes of one rank's DTensor node in its footer (as written; the
    footer's padding to a 4 KiB file size, at most 4 KiB, is not counted)."""
    rows = -(-shape[0] // ranks)
    node = {"$": "dtensor", "dtype": "float32", "global_shape": shape, "offsets": [0] * len(shape),
            "local_shape": [rows] + shape[1:], "local": {"$": "tensor", "dtype": "float32",
                                                         "shape": [rows] + shape[1:],
                                                         "stride": ([shape[1], 1] if len(shape) == 2 else [1]),
                                                         "offset": 0, "device": "cpu", "e": 123},
            "layout": {"mesh": {"shape": [ranks], "start": 0, "strides": [1]}, "placements": [["S", 0]]}}
    return len(json.dumps(node, separators=(",", ":")))


def report(rank, nbytes):
    """One rank's commit report, as the store holds it (bytes)."""
    return json.dumps({"ok": True, "step": 1000, "bytes": nbytes, "digest": None, "version": 1,
                       "references": [], "keyset": "5d41402abc4b2a76", "layouts": "7d793037a0760186"}).encode()


def one_commit(raw_reports, layouts):
    t0 = time.process_time()
    done = dict(enumerate(parse_values(raw_reports)))      # as RankInfo.wait_for parses them
    raw = manifests.build(1000, done, "run-c17", {"step": 1000}, [], layouts=layouts)
    return time.process_time() - t0, raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1024,4096,16384")
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print("| model | tensors | ranks | store bytes to the coordinator | coordinator CPU ms (median) | root manifest bytes "
          "| per added rank B | footer bytes per rank | read by a loading rank, same world (manifest + 1 footer) "
          "| resharded (manifest + 3 footers) | "
          "4 KiB padding share of a rank's file |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        shapes = param_shapes(model)
        tensors = 3 * len(shapes)
        previous = None
        for ranks in [int(x) for x in a.ranks.split(",")]:
            shard_bytes = [4 * (-(-s[0] // ranks)) * (1 if len(s) == 1 else s[1]) for s in shapes] * 3
            data = sum(fmt.align_up(b) for b in shard_bytes)
            padding = sum(fmt.align_up(b) - b for b in shard_bytes)
            raw_reports = [report(r, data + 4096) for r in range(ranks)]
            layouts = layouts_for(shapes, ranks)
            cpu = []
            for _ in range(a.reps):
                seconds, raw = one_commit(raw_reports, layouts)
                cpu.append(seconds)
            footer = sum(footer_node_bytes(s, ranks) for s in shapes) * 3
            added = "" if previous is None else f"{(len(raw) - previous[1]) / (ranks - previous[0]):.0f}"
            previous = (ranks, len(raw))
            print(f"| {model} | {tensors} | {ranks} | {sum(map(len, raw_reports)):,} | "
                  f"{statistics.median(cpu) * 1e3:.1f} | {len(raw):,} | {added} | {footer:,} | "
                  f"{len(raw) + footer:,} | {len(raw) + 3 * footer:,} | {padding / (data + footer):.1%} |")


if __name__ == "__main__":
    main()
