"""``checkpoint-<step>/`` in the Hugging Face Trainer's own layout, written by lazyckpt.

What a plain ``transformers.Trainer`` (5.x) writes in ``_save_checkpoint``,
file for file, so that the plain Trainer, ``from_pretrained``, accelerate,
evaluation scripts and the Hub read it unchanged:

* ``model.safetensors`` (or ``model-0000K-of-0000N.safetensors`` and
  ``model.safetensors.index.json`` above ``max_shard_size``): the state dict
  after ``save_pretrained``'s own steps (ignored keys dropped, tied weights
  removed, weight conversions reverted, ``split_torch_state_dict_into_shards``);
  written by the engine from the host cache (``file_format="safetensors"``);
* ``optimizer.pt``: ``optimizer.state_dict()`` as the zip ``torch.save``
  writes, by the engine (``file_format="torch"``);
* ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth`` (``rng_state_<rank>.pth``
  with several processes), ``training_args.bin``: ``torch.save`` in the
  background of deep copies taken at the save (a few KB: copying costs ~1/20
  of ``torch.save``; to the file's own name, since ``torch.save`` names the
  zip's records after the file, so the bytes are the plain Trainer's);
* ``config.json``, ``generation_config.json``: ``save_pretrained`` on copies
  taken at the save (``dtype`` and ``architectures`` set on the live config
  first, as ``save_pretrained`` does), written in the background (building
  their diff against a default config takes tens of milliseconds);
* ``trainer_state.json``: as ``TrainerState.save_to_json``, at the commit;
* tokenizer / processor files: ``processing_class.save_pretrained``, on the
  training thread as the plain Trainer writes them (a tokenizer is not a
  value that can be copied cheaply).

Everything lands in a hidden staging directory; the background commit fsyncs
every file and renames it to ``checkpoint-<step>`` once all of them are
durable (``benchmarks/bench_hf_trainer.py`` prints what stays on the
training thread).

Models whose files only ``save_pretrained`` itself knows how to write (PEFT
adapters, quantized, offloaded, tensor-parallel or remote-code models) keep
``Trainer._save`` for the model files, on the training thread, with a warning
once; the optimizer still goes through the engine.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, MissingKeyError
from lazyckpt.storage.fileio import fsync_dir, fsync_file

log = logging.getLogger("lazyckpt")

__all__ = ["CHECKPOINT_FORMATS", "rng_state", "queue_hf_checkpoint", "read_hf_checkpoint", "HF_CHECKPOINT_FILES"]

#: ``lazyckpt_checkpoint_format`` values: HF's own layout (default) or one lazyckpt file.
CHECKPOINT_FORMATS = ("hf", "lazyckpt")
#: The files a plain Trainer's checkpoint holds (besides tokenizer files and shards).
HF_CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                       "trainer_state.json", "training_args.bin", "config.json")
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def check_format(checkpoint_format: str) -> None:
    """Refuse an unknown format, and the HF layout where this transformers lacks
    what it reproduces ``save_pretrained`` with (transformers 4.x)."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"lazyckpt_checkpoint_format must be one of {CHECKPOINT_FORMATS}, "
                         f"got {checkpoint_format!r}")
    if checkpoint_format == "hf":
        try:
            from transformers.modeling_utils import remove_tied_weights_from_state_dict  # noqa: F401
        except ImportError as exc:
            import transformers
            raise ValueError(f"lazyckpt_checkpoint_format='hf' needs transformers>=5 (installed: "
                             f"{transformers.__version__}): upgrade it, or pass "
                             "lazyckpt_checkpoint_format='lazyckpt'") from exc


# --------------------------------------------------------------------------- small files


def rng_state(args: Any) -> Dict[str, Any]:
    """This process's RNG states exactly as ``Trainer._save_rng_state`` builds them
    (the plain Trainer's ``_load_rng_state`` reads the ``cuda`` entry by parallel mode)."""
    import random

    import numpy as np
    from transformers.training_args import ParallelMode
    states: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        if args.parallel_mode == ParallelMode.DISTRIBUTED:
            states["cuda"] = torch.cuda.random.get_rng_state_all()
        else:
            states["cuda"] = torch.cuda.random.get_rng_state()
    return states


def _torch_save(obj: Any, path: str) -> None:
    # To the path itself, not to bytes: torch.save names the zip's records after the
    # file, so this gives the plain Trainer's bytes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the scheduler's "please also save the optimizer state"
        torch.save(obj, path)


def _snapshot(obj: Any, path: str) -> Optional[Tuple[str, Any]]:
    """``(path, copy of obj)`` to ``torch.save`` in the background: a deep copy of
    these few-KB values takes ~1/20 of ``torch.save`` here (0.5 vs 6 ms for
    ``TrainingArguments``). An object that cannot be deep-copied is saved now."""
    try:
        return path, copy.deepcopy(obj)
    except Exception:                       # e.g. a custom args subclass holding a lock
        _torch_save(obj, path)
        return None


def _small_files(trainer: Any, staging: str, rngs: Dict[int, Any], model_sync: bool) -> List[Tuple[str, Any]]:
    """On the training thread: what ``Trainer._save`` (beyond the weights and
    configs), ``_save_optimizer_and_scheduler`` (beyond the optimizer),
    ``_save_scaler`` and ``_save_rng_state`` write, as ``(path, value as at the
    save)`` for ``torch.save`` in the background. The tokenizer files are
    written into ``staging`` now, as ``Trainer._save`` writes them."""
    args = trainer.args
    out = []
    if not model_sync:                      # else Trainer._save wrote these
        processing = trainer.processing_class
        if processing is None:
            collator = getattr(trainer, "data_collator", None)
            processing = getattr(collator, "tokenizer", None)
        if processing is not None:
            processing.save_pretrained(staging)
        out.append(_snapshot(args, os.path.join(staging, "training_args.bin")))
    if not args.save_only_model:
        if trainer.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scheduler = trainer.lr_scheduler.state_dict()
            out.append(_snapshot(scheduler, os.path.join(staging, "scheduler.pt")))
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            out.append(_snapshot(scaler.state_dict(), os.path.join(staging, "scaler.pt")))
        for index, states in sorted(rngs.items()):      # fresh copies already
            name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{index}.pth"
            out.append((os.path.join(staging, name), states))
    return [item for item in out if item is not None]


# --------------------------------------------------------------------------- model files


def _sync_model_reason(model: Any) -> Optional[str]:
    """Why ``save_pretrained``'s steps cannot be reproduced here for ``model`` (None: they can)."""
    if getattr(model, "_hf_peft_config_loaded", False):
        return "a model with PEFT adapters"
    if getattr(model, "hf_quantizer", None) is not None:
        return "a quantized model"
    device_map = getattr(model, "hf_device_map", None)
    if device_map and ("cpu" in device_map.values() or "disk" in device_map.values()):
        return "a model with offloaded modules"
    if getattr(model, "_tp_size", None) is not None or getattr(getattr(model, "config", None),
                                                                 "distributed_config", None):
        return "a tensor- or expert-parallel model"
    if getattr(model, "is_remote_code", lambda: False)():
        return "a model with remote code"
    return None


def _config_copies(model: Any, model_to_save: Any) -> List[Any]:
    """Copies of the config (and generation config) as ``save_pretrained`` would
    write them now; ``save_pretrained`` on them runs in the background (it
    builds a default config to diff against: tens of ms, not worth blocking for)."""
    # save_pretrained records these on the live config before writing it.
    model_to_save.config.dtype = str(model_to_save.dtype).split(".")[1]
    model_to_save.config.architectures = [model_to_save.__class__.__name__.removeprefix("FSDP")]
    configs = [copy.deepcopy(model_to_save.config)]
    if model.can_generate():
        configs.append(copy.deepcopy(model_to_save.generation_config))
    return configs


def _unwrap(model: Any) -> Any:
    """DDP / DataParallel / torch.compile wrappers off, as accelerate's
    ``unwrap_model(keep_torch_compile=False)`` for the cases the lazyckpt
    Trainer accepts (DeepSpeed and FSDP are refused), without its per-call
    package-metadata lookups (~30 ms each here)."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


@dataclass
class _ModelFiles:
    """The model's part of a checkpoint: safetensors files as ``(name, {key:
    live tensor})``, small files as bytes, config copies to ``save_pretrained``."""
    shards: List[Tuple[str, Dict[str, torch.Tensor]]] = field(default_factory=list)
    files: Dict[str, bytes] = field(default_factory=dict)
    configs: List[Any] = field(default_factory=list)


def _pretrained_files(model: Any, state_dict: Dict[str, torch.Tensor], max_shard_size: Any) -> _ModelFiles:
    """``PreTrainedModel.save_pretrained``'s steps up to the shard writes."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    try:
        from transformers.modeling_utils import revert_weight_conversion
    except ImportError:                     # older 5.x / 4.x: no weight conversions
        revert_weight_conversion = None

    out = _ModelFiles(configs=_config_copies(model, model))
    ignored = model._keys_to_ignore_on_save or ()
    state_dict = {k: v for k, v in state_dict.items() if k not in ignored}
    state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    if revert_weight_conversion is not None:
        state_dict = revert_weight_conversion(model, state_dict)
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    out.shards = [(name, {t: state_dict[t].contiguous() for t in names})
                  for name, names in split.filename_to_tensors.items()]
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        out.files[SAFE_WEIGHTS_INDEX_NAME] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    return out


def model_files(trainer: Any, staging: str, max_shard_size: Any) -> Optional[_ModelFiles]:
    """What ``Trainer._save`` writes for the model, to be written in the
    background; None when ``Trainer._save`` wrote the model files into
    ``staging`` itself (synchronously: see the module's docstring)."""
    from transformers import PreTrainedModel
    model = trainer.model
    unwrapped = _unwrap(model)
    reason = _sync_model_reason(unwrapped) if isinstance(unwrapped, PreTrainedModel) else None
    if reason is None and not isinstance(unwrapped, PreTrainedModel):
        try:
            from peft import PeftModel
            if isinstance(unwrapped, PeftModel):
                reason = "a PEFT model"
        except ImportError:
            pass
    if reason is not None:
        if not getattr(trainer, "_lazyckpt_warned_sync_model", False):
            trainer._lazyckpt_warned_sync_model = True
            warnings.warn(f"lazyckpt: {reason}: its weights are written by Trainer._save on the training "
                          "thread (synchronously); the optimizer state is still written in the background",
                          RuntimeWarning, stacklevel=4)
        from transformers import Trainer
        Trainer._save(trainer, staging)
        return None
    # Trainer._save: a wrapper's own state_dict, written by the wrapped PreTrainedModel's save_pretrained.
    state_dict = model.state_dict()
    if isinstance(unwrapped, PreTrainedModel):
        return _pretrained_files(unwrapped, state_dict, max_shard_size)
    # Not a PreTrainedModel: safetensors.torch.save_file(state_dict, "model.safetensors").
    # Tensors whose bytes overlap are refused by the safetensors writer, as by that call.
    return _ModelFiles(shards=[(SAFE_WEIGHTS_NAME, dict(state_dict))])


# --------------------------------------------------------------------------- queueing


def _queue_file(writer: Any, state: Any, path: str, file_format: str, final_path: str,
                on_commit: Optional[Callable[[Any], None]]) -> Any:
    """Queue one file of ``file_format`` (``"safetensors"`` or ``"torch"``) through the engine."""
    metadata = {"format": "pt"} if file_format == "safetensors" else None   # what save_pretrained writes
    return writer.save(state, path, file_format=file_format, metadata=metadata, on_commit=on_commit,
                       final_path=final_path)


def _fsync_files(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            _fsync_files(path)
            continue
        fsync_file(path)
    fsync_dir(directory)


def _finish(staging: str, files: Dict[str, bytes], saves: List[Tuple[str, Any]], configs: List[Any]) -> None:
    """In the background, before the rename: the small files, the configs, all fsynced."""
    for name, data in files.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    for path, value in saves:
        _torch_save(value, path)
    for config in configs:
        config.save_pretrained(staging)
    _fsync_files(staging)


def queue_hf_checkpoint(trainer: Any, writer: Any, staging: str, output_dir: str, rngs: Dict[int, Any],
                        max_shard_size: Any, on_commit: Callable[[Any], None]) -> Any:
    """Fill ``staging`` with a plain Trainer's ``checkpoint-<step>`` files: the
    weights and the optimizer state through ``writer``, the small files from
    copies taken now; ``on_commit(handle)`` runs in the background once all of
    them are durable (it renames ``staging`` to ``output_dir``). Returns the
    last save's handle (None if nothing was left to write in the background)."""
    os.makedirs(staging, exist_ok=True)
    model = model_files(trainer, staging, max_shard_size)
    saves = _small_files(trainer, staging, rngs, model_sync=model is None)
    model = model or _ModelFiles()
    files = model.files
    large: List[Tuple[str, Any, str]] = [(name, tensors, "safetensors") for name, tensors in model.shards]
    if not trainer.args.save_only_model:
        large.append(("optimizer.pt", trainer.optimizer.state_dict(), "torch"))
    handles: List[Any] = []

    def commit_all(handle: Any) -> None:
        # Saves run one at a time, in order: the earlier files of this checkpoint are done.
        failed = [h for h in handles if h is not handle and getattr(h, "error", None) is not None]
        if failed:
            raise CheckpointError(f"{output_dir}: not committed: an earlier file of it failed "
                                  f"({failed[0].error})", path=output_dir)
        _finish(staging, files, saves, model.configs)
        on_commit(handle)

    if not large:                           # save_only_model with a synchronously saved model
        _finish(staging, files, saves, model.configs)
        on_commit(None)
        return None
    for i, (name, state, file_format) in enumerate(large):
        last = i == len(large) - 1
        handles.append(_queue_file(writer, state, os.path.join(staging, name), file_format, output_dir,
                                   commit_all if last else None))
    return handles[-1]


# --------------------------------------------------------------------------- reading it back

_RNG_FILE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


def read_hf_checkpoint(checkpoint_dir: str, keys: Optional[list] = None, map_location: Any = "cpu",
                       allow_pickle: bool = False) -> Dict[str, Any]:
    """``load_checkpoint_state`` of a directory in this layout: the entries a
    ``lazyckpt.lzc`` holds (``"model"``: the weights as ``save_pretrained``
    wrote them, ``"optimizer"``, ``"scheduler"``, ``"scaler"``, ``"rng"``:
    ``{process index: states}``, ``"trainer_state"``: the JSON text), read from
    the plain Trainer's files; only the files of ``keys`` (a name, or a tuple
    path into one) are read."""
    readers = _hf_entries(checkpoint_dir, map_location, allow_pickle)
    if not readers:
        raise CheckpointNotFoundError(f"{checkpoint_dir}: neither a lazyckpt.lzc nor the Hugging Face "
                                      f"Trainer's checkpoint files", path=checkpoint_dir)
    out: Dict[str, Any] = {}
    loaded: Dict[str, Any] = {}
    for key in (list(readers) if keys is None else keys):
        path = (key,) if isinstance(key, str) else tuple(key)
        if path[0] not in readers:
            raise MissingKeyError(f"{checkpoint_dir}: no {path[0]!r} in this checkpoint (it holds "
                                  f"{sorted(readers)})", missing=[path[0]])
        if path[0] not in loaded:
            loaded[path[0]] = readers[path[0]]()
        value, into = loaded[path[0]], out
        for i, part in enumerate(path[1:], 1):
            if not isinstance(value, dict) or part not in value:
                raise MissingKeyError(f"{checkpoint_dir}: no {'/'.join(map(str, path[:i + 1]))!r} in this "
                                      f"checkpoint", missing=["/".join(map(str, path[:i + 1]))])
            value, into = value[part], into.setdefault(path[i - 1], {})
        into[path[-1]] = value
    return out


def _hf_entries(checkpoint_dir: str, map_location: Any, allow_pickle: bool) -> Dict[str, Callable[[], Any]]:
    """What the directory holds: entry name -> how to read it."""
    try:
        names = set(os.listdir(checkpoint_dir))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{checkpoint_dir}: no such checkpoint directory",
                                      path=checkpoint_dir) from None

    def load(name: str) -> Callable[[], Any]:
        # As Trainer's own loaders: weights_only, numpy allowed for the RNG states.
        def read() -> Any:
            from transformers.trainer_pt_utils import safe_globals
            with safe_globals():
                return torch.load(os.path.join(checkpoint_dir, name), map_location=map_location,
                                  weights_only=not allow_pickle)
        return read

    entries: Dict[str, Callable[[], Any]] = {}
    weights = _weight_files(checkpoint_dir, names)
    if weights:
        entries["model"] = lambda: _read_weights(weights, map_location)
    for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"), ("scaler", "scaler.pt")):
        if name in names:
            entries[key] = load(name)
    rng_files = {int(m.group(1) or 0): n for n in names if (m := _RNG_FILE.match(n))}
    if rng_files:
        entries["rng"] = lambda: {index: load(name)() for index, name in sorted(rng_files.items())}
    if "trainer_state.json" in names:
        def trainer_state() -> str:
            with open(os.path.join(checkpoint_dir, "trainer_state.json"), encoding="utf-8") as f:
                return f.read()
        entries["trainer_state"] = trainer_state
    return entries


def _weight_files(checkpoint_dir: str, names: set) -> List[str]:
    """The weight files, as ``from_pretrained`` looks for them: safetensors first,
    one file or the shards its index names; then ``pytorch_model.bin`` likewise."""
    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if single in names:
            return [os.path.join(checkpoint_dir, single)]
        if index in names:
            with open(os.path.join(checkpoint_dir, index), encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(checkpoint_dir, shard) for shard in shards]
    return []


def _read_weights(files: List[str], map_location: Any) -> Dict[str, torch.Tensor]:
    state: Dict[str, torch.Tensor] = {}
    for path in files:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            if not isinstance(map_location, (str, torch.device)):
                raise ValueError(f"map_location={map_location!r}: safetensors files take a device "
                                 f"(\"cpu\", \"cuda:0\", a torch.device)")
            state.update(load_file(path, device=str(map_location)))
        else:
            state.update(torch.load(path, map_location=map_location, weights_only=True))
    return state
