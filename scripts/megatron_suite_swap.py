"""pytest plugin for scripts/run_megatron_suite.sh: Megatron-Core's own
dist_checkpointing unit tests on CPU (2 gloo ranks under torchrun), with
lazyckpt's LazySaveStrategy swapped in for every torch_dist save
(LAZYCKPT_SWAP=1; unset: no swap, the baseline run).

CPU shims (Megatron's tests assume one GPU per rank and NCCL): process groups
are gloo; torch.cuda.set_device / synchronize / empty_cache do nothing;
current_device is "cpu"; device_count is the world size (the tests compute
rank % device_count); a tensor put on "cuda" (device=, .to(), .cuda()) stays on
the CPU; MoE's Triton kernels get a stand-in module; Python 3.11
gets typing.override (megatron-core 0.19 declares 3.12). What still needs
CUDA (streams, Transformer Engine, NCCL-only features) fails: those tests are
what cannot run on CPU.

The swap: Megatron's save() replaces any strategy that is not a
TorchDistSaveShardedStrategy with its own, built by the name
megatron.core.dist_checkpointing.serialization imported; that name, and the
one test modules import from strategies.torch, become LazySaveStrategy, so an
explicit TorchDistSaveShardedStrategy(...) and the default both write through
lazyckpt. The saves through it are counted and printed at the end, which
proves the swap took effect.
"""

import os
import sys
import types

SWAP = os.environ.get("LAZYCKPT_SWAP", "")
_counts = {"lazyckpt_async_saves": 0}


def _shims():
    import typing

    import torch
    import torch.distributed as dist
    if not hasattr(typing, "override"):
        typing.override = lambda fn: fn
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if "triton" not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            stub = types.ModuleType(name)
            stub.GLOBAL_BLOCK_SIZE = 1024
            stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = None
            sys.modules[name] = stub
    if not torch.cuda.is_available():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        torch.cuda.set_device = lambda *a, **k: None
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.device_count = lambda: world
        torch.cuda.memory.empty_cache = torch.cuda.empty_cache = lambda: None
        original = dist.init_process_group

        def init_process_group(*args, **kwargs):
            kwargs["backend"] = "gloo"
            args = args[1:] if args else args
            return original(*args, **kwargs)
        dist.init_process_group = init_process_group
        original_new_group = dist.new_group

        def new_group(*args, **kwargs):
            if kwargs.get("backend") == "nccl":
                kwargs["backend"] = "gloo"
            return original_new_group(*args, **kwargs)
        dist.new_group = new_group
        _cuda_is_cpu()


def _cuda_is_cpu():
    """Tensors the tests put on "cuda" go to the CPU: a torch function mode that
    rewrites a CUDA device argument (factories, .to()), and Tensor.cuda() as the
    identity."""
    import torch
    from torch.overrides import TorchFunctionMode

    def host(value):
        if isinstance(value, torch.device) and value.type == "cuda":
            return torch.device("cpu")
        if isinstance(value, str) and value.startswith("cuda"):
            return "cpu"
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return value

    class CudaIsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = host(kwargs["device"])
            if func in (torch.Tensor.to,) and args:
                args = (args[0],) + tuple(host(a) for a in args[1:])
            return func(*args, **kwargs)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    CudaIsCpu().__enter__()


# At import: the suite's conftest files import megatron.core before pytest_configure.
_shims()


def pytest_configure(config):
    if not SWAP:
        return
    import megatron.core.dist_checkpointing.serialization as serialization
    import megatron.core.dist_checkpointing.strategies.torch as torch_strategies

    from lazyckpt.integrations.megatron import LazySaveStrategy
    original = LazySaveStrategy.async_save

    def counted(self, *args, **kwargs):
        _counts["lazyckpt_async_saves"] += 1
        return original(self, *args, **kwargs)
    LazySaveStrategy.async_save = counted
    serialization.TorchDistSaveShardedStrategy = LazySaveStrategy
    torch_strategies.TorchDistSaveShardedStrategy = LazySaveStrategy


_outcomes = {}


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.nodeid not in _outcomes or report.outcome != "passed":
            _outcomes[report.nodeid] = report.outcome + ("" if report.when == "call" else f" ({report.when})")


def pytest_terminal_summary(terminalreporter):
    """Each rank's outcome per test, in $SUITE_RESULTS-<rank>.json (compared across modes)."""
    import json
    if SWAP:
        terminalreporter.write_line(f"lazyckpt swap (rank {os.environ.get('RANK')}): {_counts}")
    target = os.environ.get("SUITE_RESULTS")
    if target:
        with open(f"{target}-{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump({"outcomes": _outcomes, "counts": _counts}, f, indent=0)
