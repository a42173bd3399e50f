"""Attack: tensor and entry geometry that points outside the bytes it owns,
so that a naive loader reads or writes memory it does not own (``set_`` with
an unchecked size/stride/offset), reads past the data region (the footer,
other files' memory), or allocates what the geometry claims.

Tensor nodes: shape or stride beyond the storage, a huge storage offset, an
element count that overflows int64, negative strides, a dtype wider than the
storage. Entries: offset/length reaching into the footer, past the end of the
file, unaligned, negative; checksum lists of the wrong length.

Safe outcome: ``CorruptCheckpointError`` (checked against the storage size
before ``set_``; entry ranges checked against ``[4096, footer_offset)``
before any read); no allocation beyond the file's size.
"""

from __future__ import annotations

import os

from _attack_common import base_file, demo, footer_doc, top, with_doc, write


def make(directory: str):
    import torch
    data = base_file(directory, {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "n": 1},
                     "oob_base.lzc", chunk_bytes=8192, host_cache_bytes=32768)
    doc0 = footer_doc(data)
    footer_offset = doc0["entries"][0]["offset"] + 4096     # the data region is one page
    tensor = {
        "shape-beyond-storage": {"shape": [9, 8]},
        "stride-beyond-storage": {"stride": [9, 1]},
        "offset-beyond-storage": {"offset": 1},
        "huge-offset": {"offset": 2**62},
        "int64-overflow": {"shape": [2**62, 2**62], "stride": [1, 1]},
        "negative-stride": {"stride": [-8, 1]},
        "negative-shape": {"shape": [-8, 8]},
        "wider-dtype": {"dtype": "float64"},
        "complex-dtype": {"dtype": "complex128"},
        "shape-stride-rank-mismatch": {"stride": [8]},
    }
    entry = {
        "length-into-footer": {"length": 4096 + 16},
        "offset-at-footer": {"offset": footer_offset, "length": 256},
        "past-eof": {"offset": 1 << 40},
        "unaligned": {"offset": 4097},
        "negative-length": {"length": -256},
        "offset-in-header": {"offset": 0},
        "too-few-checksums": {"checksums": []},
        "checksum-2^64": {"checksums": [2**64]},
    }
    cases = []
    for name, change in tensor.items():
        doc = footer_doc(data)
        top(doc, "w").update(change)
        cases.append({"name": f"tensor {name}", "expect": "CorruptCheckpointError",
                      "path": write(os.path.join(directory, f"oob_tensor_{name}.lzc"), with_doc(data, doc))})
    for name, change in entry.items():
        doc = footer_doc(data)
        doc["entries"][0].update(change)
        cases.append({"name": f"entry {name}", "expect": "CorruptCheckpointError",
                      "path": write(os.path.join(directory, f"oob_entry_{name}.lzc"), with_doc(data, doc))})
    return cases


if __name__ == "__main__":
    demo(make)
