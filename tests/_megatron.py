"""Megatron-Core on this CPU-only machine: the shims its tests need, and a tiny model.

The shims live here, in the tests only (lazyckpt itself installs none):

* ``stub_triton_kernels()``: ``import megatron.core`` imports
  ``megatron.core.transformer.moe.ops.paged_stash``, Triton kernels of one MoE
  feature, and Triton is a CUDA-only package. Without Triton that module is
  replaced by an empty stand-in (no test uses MoE paged stash). Stubbing
  ``triton`` itself is not an option: torch's dynamo then takes the stub for
  Triton.
* ``cpu_shims()``, in each rank only (never in the pytest process, where other
  tests see torch.cuda): Megatron's save and finalize call
  ``torch.cuda.synchronize()`` (a no-op here: nothing runs on a device) and
  build the tensors of their all-reduces on ``torch.cuda.current_device()``
  (``"cpu"`` here: gloo reduces CPU tensors). The ranks of tests/_dist.py are
  daemonic processes; Megatron's own async caller and writer start processes,
  which a daemonic process may not, so the rank stops being marked daemonic
  (run_ranks still kills it on a timeout).
* ``allow_typing_override()``: megatron-core 0.19 declares Python >= 3.12 and
  ``megatron.training`` imports ``typing.override`` (new in 3.12); on 3.11 it is
  the identity decorator it is at run time.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def stub_triton_kernels() -> None:
    if PAGED_STASH in sys.modules or "triton" in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = None
    sys.modules[PAGED_STASH] = stub


def allow_typing_override() -> None:
    import typing
    if not hasattr(typing, "override"):
        typing.override = lambda fn: fn


def cpu_shims() -> None:
    import multiprocessing

    import torch
    stub_triton_kernels()
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    multiprocessing.current_process()._config["daemon"] = False
    import warnings
    warnings.filterwarnings("ignore")           # Megatron's deprecation notices, per rank


def init_tp(tp: int = 2) -> None:
    """Megatron's model-parallel groups on the gloo ranks (tensor parallel ``tp``)."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def tiny_gpt(seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = 128, max_seq: int = 16):
    """A tiny GPTModel (CPU initialization, float32) of the current tensor-parallel rank."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                               use_cpu_initialization=True, params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=max_seq)


def tensors(model) -> dict:
    """The model's tensors (copies), by name: what a bit-exact comparison compares."""
    import torch
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def same(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def make_dir(path: str) -> None:
    """Megatron's save wants the directory to exist (Megatron-LM's trainer makes it on rank 0)."""
    import torch
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
