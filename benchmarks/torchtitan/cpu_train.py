"""Run torchtitan.train (0.3.0) on a CPU-only torch build, 2 ranks, gloo
(benchmarks/torchtitan/bench_torchtitan.py starts it under torchrun).

Timing: with TT_TIMES=<path>, rank 0 writes the wall time of every train_step
(forward, backward, the wait for staging, the optimizer step) and of every
checkpointer.save() call (what the step loop blocks on) to <path> as JSON.

Why each patch is needed, found while making it run:

1. torchtitan/tools/utils.py:55 picks `_get_available_device_type() or "cuda"`: on a CPU-only
   machine that is "cuda", and trainer.py:301 then calls torch.cuda.set_device ->
   AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'. Reporting "cpu" here,
   before torchtitan is imported, gives device_type="cpu", device_module=torch.cpu, and
   init_distributed's backend becomes default_device_backend_map["cpu"] == "gloo".
2. components/metrics.py:37-50 (DeviceMemoryMonitor) calls CUDA-only memory APIs that
   torch.cpu lacks (get_device_name, get_device_properties, reset_peak_memory_stats,
   empty_cache, memory_stats): give torch.cpu inert stand-ins.
3. FlexAttention (the only LM attention of the debug model; "sdpa" is refused for language
   models, models/common/config_utils.py:97) raises "FlexAttention does not support backward
   on CPU": replace FlexAttention.compiled_flex_attn (models/common/attention.py:287) by the
   same attention computed densely: the BlockMask's mask_mod materialized with create_mask,
   then F.scaled_dot_product_attention. Fine for seq_len of a few hundred.
4. FSDP2 gradient reduce-scatter: torchtitan sets gradient_divide_factor=1.0
   (distributed/fsdp.py:27-41, called at :316), for which FSDP2 picks
   ReduceOp.PREMUL_SUM(1.0) (torch fsdp/_fully_shard/_fsdp_collectives.py:850) ->
   "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo". Also force sum-only
   reductions (FSDPModule.set_force_sum_reduction_for_comms(True)): plain SUM, factor 1.
5. After step 1, trainer.py:1062 -> distributed/utils.py:586 set_pg_timeouts calls
   barrier(device_ids=[device_module.current_device()]); torch.cpu.current_device() returns
   the string "cpu" -> "TypeError: incompatible function arguments ... ['cpu']". Report 0.
6. NOT CPU-specific: distributed/utils.py:595 calls torch.distributed.set_timeout, which torch
   2.13.0 does not have (only the private distributed_c10d._set_pg_timeout) ->
   "AttributeError: module 'torch.distributed' has no attribute 'set_timeout'" after step 1.
"""
import os
import types

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"   # must run before torchtitan is imported

_cpu = torch.cpu
_stand_ins = {
    "get_device_name": lambda device=None: "cpu",
    "get_device_properties": lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    "reset_peak_memory_stats": lambda device=None: None,
    "empty_cache": lambda: None,
    "memory_stats": lambda device=None: {},
}
_cpu.current_device = lambda: 0
if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
for _name, _fn in _stand_ins.items():
    if not hasattr(_cpu, _name):
        setattr(_cpu, _name, _fn)

from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402


def _dense_flex_attn(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    assert score_mod is None and not getattr(return_aux, "lse", False), "CPU shim: plain masked attention only"
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, None


FlexAttention.compiled_flex_attn = staticmethod(_dense_flex_attn)

import torchtitan.distributed.fsdp as _tt_fsdp  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

_disable_division = _tt_fsdp.disable_fsdp_gradient_division


def _disable_division_sum_only(model):
    _disable_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


_tt_fsdp.disable_fsdp_gradient_division = _disable_division_sum_only

import atexit  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from torchtitan.components.checkpointer.base import BaseCheckpointManager  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

_times = {"step_s": [], "save_s": [], "wait_s": []}


def _timed(cls, name, into):
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            _times[into].append(time.perf_counter() - t)
    setattr(cls, name, wrapper)


_timed(Trainer, "train_step", "step_s")
_timed(BaseCheckpointManager, "save", "save_s")
_timed(BaseCheckpointManager, "maybe_wait_for_staging", "wait_s")


@atexit.register
def _write_times():
    path = os.environ.get("TT_TIMES")
    if path and os.environ.get("RANK", "0") == "0":
        with open(path, "w") as f:
            json.dump(_times, f)


from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    main()
