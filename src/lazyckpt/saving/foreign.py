"""Which layout a foreign file (``file_format="torch"`` or ``"safetensors"``) gets: the
choice made on the caller's thread, before the engine moves any byte. The layouts'
common base is lazyckpt/saving/foreign_formats.py, a module of its own because the
layouts (torchzip, safetensors_file, dcp_file) subclass it and this choice imports them."""

from __future__ import annotations

from typing import Any, Dict, Optional

from .foreign_formats import FileLayout
from .safetensors_file import SafetensorsLayout
from .torchzip import TorchZipLayout


def plan_layout(state: Any, file_format: str, metadata: Optional[Dict[str, Any]] = None) -> FileLayout:
    """Plan ``state`` as a ``"torch"`` or ``"safetensors"`` file, on the caller's thread."""
    if file_format == "safetensors":
        return SafetensorsLayout(state, metadata)
    if file_format == "torch":
        if metadata:
            raise ValueError("file_format='torch' has no place for metadata (torch.save writes none); put it "
                             "in the state, or use file_format='lazyckpt' or 'safetensors'")
        return TorchZipLayout(state)
    raise ValueError(f"file_format={file_format!r}: no foreign layout of that name "
                     f"(expected 'torch' or 'safetensors')")
