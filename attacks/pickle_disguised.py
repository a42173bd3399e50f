"""Attack: get a pickle stream unpickled without the ``pickle`` tag.

* a ``bytes`` node over an entry whose kind says ``pickle``;
* a ``numpy`` node with an object dtype (``O``) over the stream: object arrays
  hold raw PyObject pointers and would be unpickled or dereferenced;
* a ``tensor`` node over the pickle entry;
* a ``custom`` node naming ``os.system`` / ``builtins.eval`` as its provider,
  hoping the loader imports a provider by name.

Safe outcome: the bytes come back as bytes (never an object) or the file is
refused (``CorruptCheckpointError`` / ``CheckpointError`` for an unregistered
provider); the marker is never created, even with ``allow_pickle=True``.
"""

from __future__ import annotations

import os
import pickle

from _attack_common import base_file, demo, footer_doc, with_doc, write
from pickle_os_system import Exec


def make(directory: str):
    marker = os.path.join(directory, "PWNED-disguised")
    stream = pickle.dumps(Exec(marker))
    data = base_file(directory, {"payload": stream, "ok": 1}, "disguised_base.lzc")
    variants = {
        "bytes-node-pickle-entry": ("CorruptCheckpointError", lambda d: None),
        "numpy-object-dtype": ("CorruptCheckpointError", lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "numpy", "t": "array", "dtype": "|O", "shape": [1], "e": 0})),
        "numpy-object-scalar": ("CorruptCheckpointError", lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "numpy", "t": "scalar", "dtype": "|O", "v": "00" * 8})),
        "tensor-over-pickle": ("CorruptCheckpointError", lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "tensor", "dtype": "uint8", "shape": [4], "stride": [1], "offset": 0, "device": "cpu",
                "e": 0})),
        "custom-os-system": ("CheckpointError", lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "custom", "name": "os.system", "v": f"touch {marker}"})),
        "custom-eval": ("CheckpointError", lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "custom", "name": "builtins.eval", "v": f"open({marker!r}, 'w')"})),
    }
    cases = []
    for name, (expect, mutate) in variants.items():
        doc = footer_doc(data)
        doc["entries"][0]["kind"] = "pickle"
        mutate(doc)
        path = write(os.path.join(directory, f"disguised_{name}.lzc"), with_doc(data, doc))
        for allow in (False, True):
            cases.append({"name": f"{name}{' allow_pickle' if allow else ''}", "path": path,
                          "kwargs": {"allow_pickle": allow}, "expect": expect, "marker": marker,
                          # a bytes node may legitimately return the raw bytes
                          "may_load": name == "bytes-node-pickle-entry"})
    return cases


if __name__ == "__main__":
    demo(make)
