"""Attack: nesting deep enough to overflow a recursive parser or decoder
(RecursionError, or a C stack overflow that kills the process).

The footer JSON nested 200,000 levels deep (for the JSON parser); trees of
490 nested ``seq`` nodes, ``dict`` nodes, dict *keys* and ``custom`` nodes,
shallow enough (< 1000 JSON levels) to pass the JSON parser and reach the
tree decoder and the pickle scan; each with the trailer checksum made valid.

Safe outcome: ``CorruptCheckpointError`` (never RecursionError, never a
crash), quickly, with bounded memory.
"""

from __future__ import annotations

import json
import os

from _attack_common import base_file, demo, footer_doc, with_footer, write


def _nested(depth: int, open_: str, close: str, leaf: str = "1") -> str:
    return open_ * depth + leaf + close * depth


def make(directory: str):
    import torch
    data = base_file(directory, {"w": torch.ones(4), "n": 1}, "deep_base.lzc")
    doc = footer_doc(data)
    doc["tree"] = "PLACEHOLDER"
    skeleton = json.dumps(doc, separators=(",", ":"))
    # name: (tree, expected on a full load, expected with keys=["n"]); None: may load.
    # Whether the JSON parser or the decoder gives up first depends on the
    # caller's stack depth, so partial loads expect any CheckpointError.
    trees = {
        "json-200k": (_nested(200_000, "[", "]"), "CorruptCheckpointError", "CorruptCheckpointError"),
        "seq-490": (_nested(490, '{"$":"seq","t":"list","v":[', "]}"), "CorruptCheckpointError",
                    "CheckpointError"),
        # 490 nested dicts is a legitimate (if odd) state: loading it is fine, crashing is not.
        "dict-490": (_nested(490, '{"$":"dict","k":["a"],"v":[', "]}"), None, "CheckpointError"),
        "dict-key-490": (_nested(490, '{"$":"dict","v":[1],"k":[', "]}", '"a"'), "CorruptCheckpointError",
                         "CorruptCheckpointError"),
        "custom-980": (_nested(980, '{"$":"custom","name":"x","v":', "}"), "CheckpointError",
                       "CheckpointError"),
    }
    cases = []
    for name, (tree, full, selected) in trees.items():
        path = write(os.path.join(directory, f"deep_{name}.lzc"),
                     with_footer(data, skeleton.replace('"PLACEHOLDER"', tree).encode()))
        for kwargs, expect in (({}, full), ({"keys": ["n"]}, selected)):
            cases.append({"name": f"deep {name}{' keys=n' if kwargs else ''}", "path": path, "kwargs": kwargs,
                          "expect": expect or "CheckpointError", "may_load": expect is None})
    return cases


if __name__ == "__main__":
    demo(make)
