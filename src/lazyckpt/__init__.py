"""lazyckpt: checkpoint PyTorch training state without stopping training.

Public surface::

    lazyckpt.save(state, path)            # one file, synchronous, durable on return
    lazyckpt.load(path, map_location=None, keys=None, into=None, allow_pickle=False, strict=True)
    lazyckpt.load_async(...) -> RestoreHandle   # the same in the background; handle.wait() is the barrier
    lazyckpt.Checkpointer(directory, keep=None, host_cache_bytes=None, interval=None, preemption=False,
                          persist=None, replicas=None, incremental=False, distributed=None, io=None)
    lazyckpt.Persist, Replicas, Incremental, Distributed, IO   # the option groups
    lazyckpt.register_provider(cls, to_state, from_state)
    lazyckpt.export_hf(step_or_run_dir, out_dir, ...)   # -> a Hugging Face model directory
    lazyckpt.import_hf(hf_dir, out_file)                  # <- one, loadable into= any sharding
    lazyckpt.diff(a, b, keys=None, top=None) -> DiffReport  # tensor by tensor change, reading pieces
    lazyckpt.trajectory(run, keys=None, fn="norm")        # (step, key, value) over every kept step
"""

from lazyckpt.formats.datafile import FORMAT_VERSION, SUPPORTED_VERSIONS
from lazyckpt.interop.hf import export_hf, import_hf
from lazyckpt.loading.restore import RestoreHandle
from lazyckpt.saving.engine import SaveHandle
from lazyckpt.state.providers import register_provider
from .api import load, load_async, save
from .checkpointer import Checkpointer
from .errors import (CheckpointError, CheckpointNotFoundError, CheckpointReadError, CheckpointWriteError,
                     CorruptCheckpointError, MissingKeyError, StateMismatchError,
                     UnsafeObjectError, UnsupportedVersionError)
from .knobs import Options
from .options import IO, Distributed, Incremental, Persist, Replicas
from .preemption import Preemption
from .retention import KeepBest, KeepEvery, KeepLast
from .schedule import Auto, Every
from .study import diff, trajectory

__version__ = "0.1.0"

__all__ = [
    "save", "load", "load_async", "RestoreHandle", "diff", "trajectory", "Checkpointer", "export_hf", "import_hf", "SaveHandle", "Options", "register_provider",
    "CheckpointError", "CorruptCheckpointError", "CheckpointNotFoundError",
    "UnsupportedVersionError", "UnsafeObjectError", "CheckpointWriteError", "CheckpointReadError",
    "MissingKeyError", "StateMismatchError", "FORMAT_VERSION", "SUPPORTED_VERSIONS",
    "Every", "Auto", "Preemption",
    "KeepLast", "KeepEvery", "KeepBest",
    "Persist", "Replicas", "Incremental", "Distributed", "IO",
]
