"""DeepSpeed's checkpoint files as its own engine writes them, without the copy.

DeepSpeed's default engine saves ``torch.save(clone_tensors_for_torch_save(state))``:
every tensor cloned to the CPU first, so each is its own storage holding just
its elements (a parameter that is a view of a ZeRO flat buffer does not drag
the whole buffer into the file; tied weights become two tensors; Parameters
become plain tensors, ``requires_grad=False``). :class:`ClonedTorchZipLayout`
writes that same file -- what ``torch.load``, ``zero_to_fp32`` and
``ds_to_universal`` read -- with no clone: the pickle describes each tensor as
the clone would be, and its record's bytes are a flat view of the live
tensor's own elements, captured through the host cache by lazyckpt's engine.

Only contiguous, strided, plain tensors take that path (all of DeepSpeed's
state here); any other tensor is cloned on the calling thread exactly as
DeepSpeed does, and written from the clone.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import torch
from torch.serialization import location_tag, normalize_storage_type

from lazyckpt.saving.torchzip import PICKLE_PROTOCOL, TorchZipLayout


class _ClonedStorage:
    """Stands in the pickle for the storage a clone would have."""

    __slots__ = ("key", "storage_type", "numel")

    def __init__(self, key: str, storage_type: Any, numel: int):
        self.key, self.storage_type, self.numel = key, storage_type, numel


def _elements(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's own elements (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    return torch.empty((0,), dtype=torch.uint8, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (nbytes,))


def pickle_state_as_cloned(state: Any) -> Tuple[bytes, Dict[str, Any]]:
    """``data.pkl`` and the records of ``torch.save(clone_tensors_for_torch_save(state))``."""
    records: Dict[str, Any] = {}
    clones: List[torch.Tensor] = []           # kept alive until their records are planned
    v3_dtypes = torch.storage._new_dtypes()

    def persistent_id(obj: Any) -> Any:
        if isinstance(obj, _ClonedStorage):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):     # a real clone (the fallback)
            key = str(len(records))
            records[key] = obj._untyped_storage
            return ("storage", getattr(torch, obj._pickle_storage_type()), key,
                    location_tag(obj._untyped_storage), obj._size())
        if torch.is_storage(obj):
            key = str(len(records))
            records[key] = obj
            return ("storage", normalize_storage_type(type(obj)), key, location_tag(obj), obj.nbytes())
        return None

    def reduce_tensor(t: torch.Tensor) -> Any:
        if (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.is_contiguous()
                and not t.is_quantized and t.device.type != "meta"
                and not torch._utils.get_tensor_metadata(t)):
            key = str(len(records))
            records[key] = _elements(t)
            if t.dtype in v3_dtypes:
                storage = _ClonedStorage(key, torch.UntypedStorage, t.numel() * t.element_size())
                args: tuple = (storage, 0, tuple(t.size()), t.stride(), False, OrderedDict(), t.dtype)
                return torch._utils._rebuild_tensor_v3, args
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[t.dtype])
            storage = _ClonedStorage(key, storage_type, t.numel())
            return torch._utils._rebuild_tensor_v2, (storage, 0, tuple(t.size()), t.stride(), False, OrderedDict())
        # Anything else: the copy DeepSpeed makes (clone_tensors_for_torch_save), then torch's own reduce.
        clone = t.detach().clone() if t.device.type == "cpu" else t.detach().to("cpu")
        clones.append(clone)
        return clone.__reduce_ex__(PICKLE_PROTOCOL)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return persistent_id(obj)

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return reduce_tensor(obj)
            return NotImplemented

    buf = io.BytesIO()
    _Pickler(buf, protocol=PICKLE_PROTOCOL).dump(state)
    return buf.getvalue(), records


class ClonedTorchZipLayout(TorchZipLayout):
    """The file ``torch.save(clone_tensors_for_torch_save(state))`` writes."""

    pickle_state = staticmethod(pickle_state_as_cloned)
