"""Megatron-Core's dist_checkpointing with lazyckpt's save strategy, on 2 gloo
ranks with a tiny GPTModel under tensor parallel 2.

``LazySaveStrategy`` goes where Megatron takes a ``TorchDistSaveShardedStrategy``;
Megatron's own ``AsyncCallsQueue`` schedules and finalizes the saves. The save
returns before the state is copied (the optimizer step waits for the copy),
and the checkpoint is DCP's own layout: this script loads it back with plain
Megatron (no lazyckpt on the load path) and compares every tensor.

    python examples/megatron_example.py                          # starts 2 ranks itself
    torchrun --nproc_per_node 2 examples/megatron_example.py

Megatron-LM's trainer (``megatron.training``) needs one call instead, before
``pretrain(...)``: ``lazyckpt.integrations.megatron.install()``.

On a machine without a GPU, three CPU shims (``cpu_shims`` below) let Megatron
run: they are for this demo, not needed on a GPU machine.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import launch  # noqa: E402

FOLDER = os.path.join(tempfile.gettempdir(), f"lazyckpt-megatron-example-{os.getppid()}")


def cpu_shims() -> None:
    """Megatron without a GPU: Triton (imported by one MoE module) is CUDA-only, so that
    module gets an empty stand-in; torch.cuda.synchronize does nothing and
    torch.cuda.current_device is "cpu" (Megatron's save and finalize call them)."""
    if torch.cuda.is_available():
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        name = "megatron.core.transformer.moe.ops.paged_stash"
        stub = types.ModuleType(name)
        stub.GLOBAL_BLOCK_SIZE, stub.paged_stash_copy_kernel, stub.paged_stash_pop_kernel = 1024, None, None
        sys.modules[name] = stub
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"


def build():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                    max_sequence_length=16)


def tensors(model):
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def main(rank: int, world: int) -> None:
    cpu_shims()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from lazyckpt.integrations.megatron import LazySaveStrategy
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy, queue = LazySaveStrategy(), AsyncCallsQueue()
    saved = {}
    for iteration in range(1, 4):
        for p in model.parameters():                 # a stand-in for forward/backward
            p.grad = torch.full_like(p, 0.01 * iteration)
        optimizer.step()                             # waits for a pending capture first
        path = os.path.join(FOLDER, f"iter_{iteration:07d}")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        saved[iteration] = tensors(model)
        request = dist_checkpointing.save(model.sharded_state_dict(), path, strategy,
                                          async_sharded_save=True, async_strategy="mcore")
        queue.schedule_async_request(request)        # returns before the state is copied
        queue.maybe_finalize_async_calls(blocking=False)
    queue.maybe_finalize_async_calls(blocking=True)  # every save committed
    strategy.close()

    restored = build()                               # a restarted job, plain Megatron's load
    restored.load_state_dict(dist_checkpointing.load(restored.sharded_state_dict(),
                                                     os.path.join(FOLDER, "iter_0000003")))
    got = tensors(restored)
    same = torch.tensor(int(all(torch.equal(got[k], saved[3][k]) for k in saved[3])))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("iter_0000003:", sorted(os.listdir(os.path.join(FOLDER, "iter_0000003"))))
        if not same.item():
            raise SystemExit("the restored model differs from the saved one")
        print(f"restored step 3 on {world} ranks bit-exact with plain Megatron's load")
        shutil.rmtree(FOLDER)


if __name__ == "__main__":
    launch(main, world=2)
