"""Thin adapters for training frameworks. Each module imports its framework
lazily and lives behind an optional extra; the core never imports them.

- ``lazyckpt.integrations.deepspeed``: a DeepSpeed ``CheckpointEngine`` (extra ``deepspeed``)
- ``lazyckpt.integrations.dcp``: torch.distributed.checkpoint storage writer/reader
- ``lazyckpt.integrations.lightning``: a Lightning ``CheckpointIO`` (extra ``lightning``)
- ``lazyckpt.integrations.huggingface``: a Hugging Face Trainer callback (extra ``hf``)
"""
