"""Attack: a tiny file whose trailer claims an enormous footer, so that a
naive reader allocates (or reads) the claimed size before checking anything.

Claims: 2^64-1 bytes, 2^63, 255 MiB (just under the default 256 MiB limit but
inconsistent with the file size), the exact file size minus one page, and a
footer offset past the end of the file.

Safe outcome: ``CorruptCheckpointError`` at once, with a Python-heap peak of
a few KiB (the length is checked against ``max_footer_bytes`` and the file
size before any read or allocation).
"""

from __future__ import annotations

import os

from _attack_common import TRAILER, base_file, demo, with_trailer, write


def make(directory: str):
    import torch
    data = base_file(directory, {"w": torch.arange(8.0)}, "huge_footer_base.lzc")
    offset = TRAILER.unpack(data[-32:])[0]
    claims = {
        "length-2^64-1": (offset, 2**64 - 1),
        "length-2^63": (offset, 2**63),
        "length-255MiB": (offset, 255 << 20),
        "length-256MiB+1": (offset, (256 << 20) + 1),
        "offset-past-eof": (1 << 40, 100),
        "offset-2^64-4096": (2**64 - 4096, 100),
    }
    return [{"name": f"huge footer {name}", "expect": "CorruptCheckpointError",
             "path": write(os.path.join(directory, f"huge_footer_{name}.lzc"), with_trailer(data, o, n))}
            for name, (o, n) in claims.items()]


if __name__ == "__main__":
    demo(make)
