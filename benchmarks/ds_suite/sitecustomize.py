"""Imported by every Python process of a DeepSpeed unit-test run (the harness
puts this directory first on PYTHONPATH), including the ranks DeepSpeed's
``DistributedTest`` forks from its forkserver, where a conftest patch would
not reach.

Always: skip building DeepSpeed's CPU shared-memory all-reduce op (a JIT
compile of minutes on 2 cores; gloo is what both runs use).

With ``LAZYCKPT_DS_SWAP=1``: every engine ``deepspeed.initialize`` returns
gets ``lazyckpt.integrations.deepspeed.enable(engine)``, as a user would call
it (``file_format=$LAZYCKPT_DS_FORMAT`` when set), and every file the lazyckpt engine saves is appended to
``$LAZYCKPT_DS_LOG`` with the test that was running (read from
``$LAZYCKPT_DS_CURRENT``, written by the harness's conftest): the proof that
the swap happened. Without it, the saves of DeepSpeed's own engine are
logged the same way (which tests save at all).
"""

import importlib.abc
import importlib.util
import os
import sys


def _patch_deepspeed(ds):
    import deepspeed.comm.torch as _unused  # noqa: F401  (the module, not torch)
    importlib_comm = sys.modules["deepspeed.comm.torch"]
    importlib_comm.build_shm_op = lambda: None
    if os.environ.get("LAZYCKPT_DS_SWAP") != "1":
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        TorchCheckpointEngine.save = _logged(TorchCheckpointEngine.save)
        return
    original = ds.initialize

    def initialize(*args, **kwargs):
        result = original(*args, **kwargs)
        import lazyckpt.integrations.deepspeed as lds
        file_format = os.environ.get("LAZYCKPT_DS_FORMAT")       # unset: the engine's default ("torch")
        lds.enable(result[0], **({"file_format": file_format} if file_format else {}))
        return result

    ds.initialize = initialize

    import lazyckpt.integrations.deepspeed as lds
    lds.LazyCheckpointEngine.save = _logged(lds.LazyCheckpointEngine.save)


def _logged(save):
    def logged_save(self, state_dict, path):
        save(self, state_dict, path)
        log = os.environ.get("LAZYCKPT_DS_LOG")
        if log:
            try:
                with open(os.environ.get("LAZYCKPT_DS_CURRENT", ""), encoding="utf-8") as f:
                    test = f.read().strip()
            except OSError:
                test = "?"
            with open(log, "a", encoding="utf-8") as f:   # one short line per write: O_APPEND keeps lines whole
                f.write(f"{test}\t{os.getpid()}\t{path}\n")

    return logged_save


class _AfterDeepSpeedImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs _patch_deepspeed once ``import deepspeed`` has finished."""

    def find_spec(self, name, path, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch_deepspeed(module)


sys.meta_path.insert(0, _AfterDeepSpeedImport())
