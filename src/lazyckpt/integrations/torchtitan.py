"""torchtitan's checkpoints written by lazyckpt (torchtitan 0.3.0).

torchtitan's ``CheckpointManager`` saves through DCP; :class:`LazyCheckpointManager`
keeps all of it (when to save, what, ``keep_latest_k``, the HF export, loading,
``initial_load_path``) and hands DCP lazyckpt's storage writer,
:class:`~lazyckpt.integrations.dcp.LazyStorageWriter`, with
``file_format="dcp"``: the checkpoint directories are DCP's own
(``.metadata`` + ``__<rank>_0.distcp``), read by torchtitan's unchanged
``dcp.load`` -- and by DCP or torchtitan without lazyckpt installed.

What changes is how the bytes move:

* ``async_mode="async_with_pinned_mem"``: the copy into a reused page-aligned
  (pinned under CUDA) staging buffer runs on lazyckpt's save engine while the
  next forward/backward runs; torchtitan's trainer already waits for it before
  ``optimizers.step()`` (``maybe_wait_for_staging``). DCP's planning and the
  write run on a thread of this process (torchtitan uses a separate process
  for its own stager), through several O_DIRECT writers, fsynced, with
  ``.metadata`` committed last through a rename.
* ``async_mode="async"``: the same, but ``save()`` returns once the copy is
  staged (torchtitan's meaning of ``async``: no capture overlapping the step).
* ``async_mode="disabled"``: a synchronous ``dcp.save`` through lazyckpt's writer.

Use it with one flag on torchtitan's command line (torchtitan's own override
mechanism; every ``--checkpoint.*`` flag still applies)::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --checkpoint.enable --checkpoint.async_mode async_with_pinned_mem \\
        --override.imports lazyckpt.integrations.torchtitan.lazy_checkpoint

or in a config function: ``checkpoint=LazyCheckpointManager.Config(...)``.
lazyckpt knobs (``host_cache_bytes``, ``writer_threads``, ``storage_options``
for an ``s3://`` dump folder...) go in ``LazyCheckpointManager.Config.lazyckpt``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.config import derive, override

from .dcp import LazyStorageWriter

__all__ = ["LazyCheckpointManager", "lazy_checkpoint"]


class LazyCheckpointManager(CheckpointManager):
    """torchtitan's DCP ``CheckpointManager`` with lazyckpt's storage writer (module docstring)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        # A Config of its own: torchtitan's Config.build() constructs the class that owns it.
        lazyckpt: Dict[str, Any] = dataclasses.field(default_factory=dict)
        """lazyckpt knobs for the storage writer (e.g. host_cache_bytes, writer_threads)."""

    def __init__(self, config: "LazyCheckpointManager.Config", **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._writer: Optional[LazyStorageWriter] = None
        if not self.enable:
            return
        # One writer for the run: its engine, host cache and staging buffers are reused by
        # every save. It is DCP's AsyncStager too: as torchtitan's stager, _save does not
        # build torch's DefaultStager (pinned shared memory in a separate process), and
        # close() closes it.
        self._writer = LazyStorageWriter(self.folder, file_format="dcp", **dict(config.lazyckpt))
        self.stager = self._writer

    @torch.no_grad()
    def dcp_save(self, state_dict: Dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf or self._writer is None:           # the HF safetensors export stays torchtitan's
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=self._writer, checkpoint_id=checkpoint_id)
            return None
        # A thread, not a process: the writer (its engine, buffers and their reuse) stays here.
        response = dcp.async_save(state_dict, storage_writer=self._writer, checkpoint_id=checkpoint_id,
                                  process_group=self.pg, async_checkpointer_type=AsyncCheckpointerType.THREAD,
                                  async_stager=self._writer)
        if async_mode == AsyncMode.ASYNC:
            # torchtitan's "async": staged before save() returns, written in the background;
            # its _save takes the write's future.
            if isinstance(response, AsyncSaveResponse):
                response.staging_completion.result()
                return response.upload_completion
            return response
        return response         # staging_completion: waited for before optimizers.step()


@override(target=CheckpointManager.Config, exact=True, description="checkpoints written by lazyckpt")
def lazy_checkpoint(cfg: CheckpointManager.Config) -> LazyCheckpointManager.Config:
    """``--override.imports lazyckpt.integrations.torchtitan.lazy_checkpoint``: the
    run's checkpoint config, every field kept, built as a :class:`LazyCheckpointManager`."""
    return derive(cfg, LazyCheckpointManager.Config)
