"""Attack: a checkpoint whose pickled entry runs ``os.system`` when unpickled.

The payload is a real ``lazyckpt.save`` of an object whose ``__reduce__``
returns ``(os.system, ("touch MARKER",))`` (and one using ``exec``). Also
crafted by hand: the same pickle stream behind a ``pickle`` node hidden in a
dict key, inside a tuple, and inside a ``custom`` node.

Safe outcome: ``UnsafeObjectError`` without ``allow_pickle=True`` (for the
whole file, for ``keys=`` selecting the payload, with checksums off), and the
marker file is never created. Loading other keys works.
"""

from __future__ import annotations

import os
import pickle

from _attack_common import base_file, demo, footer_doc, with_doc, write


class OsSystem:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Exec:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def make(directory: str):
    import torch
    import lazyckpt
    marker = os.path.join(directory, "PWNED-pickle")
    cases = []
    for cls in (OsSystem, Exec):
        path = os.path.join(directory, f"pickle_{cls.__name__}.lzc")
        lazyckpt.save({"weights": torch.arange(4.0), "payload": cls(marker)}, path)
        for label, kwargs in (("", {}), ("-keys", {"keys": ["payload"]}),
                              ("-nochecksums", {"verify_checksums": False})):
            cases.append({"name": f"pickle {cls.__name__}{label}", "path": path, "kwargs": kwargs,
                          "expect": "UnsafeObjectError", "marker": marker})
    # The stream by hand: a bytes entry re-tagged as a pickle node in odd places.
    stream = pickle.dumps(Exec(marker))
    data = base_file(directory, {"payload": stream, "ok": 1}, "plain.lzc")
    hiding = {
        "dict-key": lambda d: d["tree"].update(k=[{"$": "pickle", "type": "builtins.str", "e": 0}, "ok"], v=[1, 1]),
        "in-tuple": lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "seq", "t": "tuple", "v": [1, {"$": "pickle", "type": "x", "e": 0}]}),
        "in-custom": lambda d: d["tree"]["v"].__setitem__(
            0, {"$": "custom", "name": "x", "v": {"$": "pickle", "type": "x", "e": 0}}),
    }
    for name, hide in hiding.items():
        doc = footer_doc(data)
        doc["entries"][0]["kind"] = "pickle"
        hide(doc)
        cases.append({"name": f"pickle hidden {name}", "path": write(os.path.join(directory, f"hidden_{name}.lzc"),
                                                                      with_doc(data, doc)),
                      "expect": "UnsafeObjectError", "marker": marker})
    # Inside a tensor node, which is decoded without decoding anything in it (the
    # loader's pickle check skips tensor nodes for speed): never unpickled, so
    # the load may succeed; or the tensor's own entry is the pickle one: a
    # tensor's bytes must be a data entry.
    inside_tensor = {
        "in-tensor-field": ({"$": "tensor", "dtype": "float32", "shape": [2], "stride": [1], "offset": 0,
                             "device": "meta", "e": None, "x": {"$": "pickle", "type": "x", "e": 0}},
                            {"expect": "UnsafeObjectError", "may_load": True}),
        "as-tensor-bytes": ({"$": "tensor", "dtype": "uint8", "shape": [1], "stride": [1], "offset": 0,
                             "device": "cpu", "e": 0}, {"expect": "CorruptCheckpointError"}),
    }
    for name, (node, outcome) in inside_tensor.items():
        doc = footer_doc(data)
        doc["entries"][0]["kind"] = "pickle"
        doc["tree"]["v"][0] = node
        cases.append({"name": f"pickle hidden {name}", "path": write(os.path.join(directory, f"hidden_{name}.lzc"),
                                                                      with_doc(data, doc)),
                      "marker": marker, **outcome})
    return cases


if __name__ == "__main__":
    demo(make)
