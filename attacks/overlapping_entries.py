"""Attack: memory amplification. One 256 KiB data region, 64 entries that
all cover it, each referenced by its own tensor node. Every range is valid,
every checksum matches; a reader that reads each entry into its own buffer
allocates 64 x 256 KiB = 16 MiB for a 280 KiB file. With the default
256 MiB footer limit the factor reaches millions (a few-MB file asking for
terabytes).

Safe outcome: the loader reads each byte of the file at most a bounded
number of times (the test allows read buffers of 2 x the file size + 1 MiB),
or refuses overlapping entries (``CorruptCheckpointError``).
"""

from __future__ import annotations

import os

from _attack_common import base_file, demo, footer_doc, top, with_doc, write

COPIES = 64


def make(directory: str):
    import torch
    data = base_file(directory, {"w": torch.zeros(65536)}, "overlap_base.lzc")
    doc = footer_doc(data)
    entry, node = doc["entries"][0], top(doc, "w")
    doc["entries"] = [dict(entry, name=f"e{i}") for i in range(COPIES)]
    doc["tree"] = {"$": "dict", "k": [f"t{i}" for i in range(COPIES)],
                   "v": [dict(node, e=i) for i in range(COPIES)]}
    return [{"name": f"overlapping entries x{COPIES}", "expect": "CorruptCheckpointError", "may_load": True,
             "path": write(os.path.join(directory, "overlapping.lzc"), with_doc(data, doc))}]


if __name__ == "__main__":
    demo(make)
