"""Copying bytes out of live tensors: the capture.

On the caller's thread, ``save()`` records one CUDA event per device the
state lives on, on that device's current stream (:func:`record_events`).
Later, on the capture thread, :class:`DeviceCopier` copies each piece into
host memory: CPU tensors with one numpy memcpy (single-threaded, GIL
released: torch's ``copy_`` would start an intra-op thread team that fights
the training's threads for the cores), CUDA tensors with
``copy_(non_blocking=True)`` on a side stream per device that first waits for
that device's event, so the copy reads the values as they were at
``save()``. Every CUDA call runs under a device guard (on a multi-GPU node
each rank's threads work in their own device's context), and
:meth:`DeviceCopier.synchronize` is called on every exit path before a
destination buffer may be reused or unpinned.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

#: (device, event): an event recorded after a device-to-host copy into a buffer.
CopyEvent = Tuple[torch.device, Any]


def as_numpy(data: Any) -> np.ndarray:
    """A flat uint8 numpy view of a CPU tensor or a buffer (no copy)."""
    if isinstance(data, torch.Tensor):
        return data.numpy()
    return np.frombuffer(data, dtype=np.uint8)


def cuda_devices(sources: Iterable[Any]) -> List[torch.device]:
    devices = {s.device for s in sources if isinstance(s, torch.Tensor) and s.is_cuda}
    return sorted(devices, key=lambda d: d.index or 0)


def record_events(tensors: Iterable[Any]) -> Dict[torch.device, Any]:
    """One event per CUDA device on that device's current stream: the point in
    the training's work that the capture must see (called in ``save()``)."""
    events = {}
    if not torch.cuda.is_available():
        return events
    for device in cuda_devices(tensors):
        with torch.cuda.device(device):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        events[device] = event
    return events


def device_guard(device: Optional[torch.device]):
    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def wait_copies(events: Iterable[CopyEvent]) -> None:
    """Block until the device-to-host copies behind ``events`` are complete."""
    for device, event in events:
        with device_guard(device):
            event.synchronize()


class DeviceCopier:
    """Copies flat byte views into host memory, ordered after the events of ``save()``."""

    def __init__(self, events: Optional[Dict[torch.device, Any]] = None):
        self._events = dict(events or {})
        self._streams: Dict[torch.device, Any] = {}

    def copy(self, dst: np.ndarray, dst_tensor: Optional[torch.Tensor], src: Any) -> Optional[CopyEvent]:
        """Copy ``src`` (a flat uint8 tensor or buffer) into ``dst`` (host bytes;
        ``dst_tensor`` is the same memory as a tensor, needed for device copies).
        Returns the copy's (device, event) when it is asynchronous."""
        if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
            dst[:] = as_numpy(src)
            return None
        if src.device.type != "cuda":
            dst_tensor.copy_(src)               # another accelerator: synchronous copy
            return None
        device = src.device
        with torch.cuda.device(device):
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
                if device in self._events:
                    stream.wait_event(self._events[device])
            with torch.cuda.stream(stream):
                dst_tensor.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        return device, event

    def synchronize(self) -> None:
        """Wait for every copy issued so far (before buffers are reused or unpinned)."""
        for device, stream in self._streams.items():
            with torch.cuda.device(device):
                stream.synchronize()


def hash_through_host(digest: Any, data: torch.Tensor, copy_buffer: Any, copier: DeviceCopier) -> None:
    """Feed the bytes of a flat device tensor ``data`` to ``digest`` piece by
    piece through ``copy_buffer`` (a host chunk: (numpy view, tensor view)),
    each piece copied by ``copier`` (after its events) and waited for."""
    buf_np, buf_t = copy_buffer
    piece = len(buf_np)
    n = data.numel()
    for a in range(0, n, piece):
        b = min(n, a + piece)
        copier.copy(buf_np[:b - a], buf_t[:b - a], data[a:b])
        copier.synchronize()
        digest.update(buf_np[:b - a])
