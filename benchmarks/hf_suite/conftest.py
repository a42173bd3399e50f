"""Swap ``transformers.Trainer`` for ``LazyCheckpointTrainer`` when
LAZYCKPT_HF_SWAP=1, before transformers' test modules import it, and log
every ``_save_checkpoint`` call with the test that made it (both runs), so
run_hf_suite.py can prove the swap: a lazyckpt-run test that saved must have
saved through the lazyckpt mixin."""

import json
import os
import sys

import transformers

_LOG = os.environ.get("LAZYCKPT_HF_SAVE_LOG")
_current = {"nodeid": None}


def _counting(cls, kind):
    original = cls._save_checkpoint

    def _save_checkpoint(self, *args, **kwargs):
        if _LOG:
            with open(_LOG, "a", encoding="utf-8") as f:
                f.write(json.dumps({"test": _current["nodeid"], "kind": kind,
                                    "class": type(self).__name__}) + "\n")
        return original(self, *args, **kwargs)

    cls._save_checkpoint = _save_checkpoint


# The plain Trainer's own save is counted in both runs: in the lazyckpt run a
# "plain" entry means the mixin fell back to it (_lazyckpt_supported() False).
_counting(transformers.Trainer, "plain")  # also resolves the lazy attribute

if os.environ.get("LAZYCKPT_HF_SWAP") == "1":
    from lazyckpt.integrations.huggingface import LazyCheckpointMixin, LazyCheckpointTrainer

    _counting(LazyCheckpointMixin, "lazyckpt")
    # Resolving ``Trainer`` makes transformers 5.24 put a new lazy module in
    # sys.modules["transformers"]; patch the one ``from transformers import``
    # reads from now on (and the first one, and the submodule).
    for module in {id(m): m for m in (transformers, sys.modules["transformers"])}.values():
        module.Trainer = LazyCheckpointTrainer
    sys.modules["transformers.trainer"].Trainer = LazyCheckpointTrainer


def pytest_runtest_setup(item):
    _current["nodeid"] = item.nodeid
