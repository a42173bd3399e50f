"""S3-compatible object stores as a :class:`lazyckpt.storage.base.Store`:
multipart uploads and ranged GETs (``s3``), Checkpointer directories
committed by a manifest object (``s3layout``)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from lazyckpt.errors import CheckpointNotFoundError
from lazyckpt.knobs import Options
from .base import Store
from .s3 import SCHEME, ObjectInput, ObjectOutput, ObjectURL, store_for
from .s3layout import ObjectCheckpointDir, PendingObject


class S3Store(Store):
    name = "s3"
    scheme = SCHEME
    is_remote = True

    def claims(self, path: str) -> bool:
        if not path.startswith(SCHEME):
            return False
        ObjectURL.parse(path)           # a malformed s3:// URL is an error, never a local path
        return True

    def normalize(self, path: str) -> str:
        return str(ObjectURL.parse(path))

    def join(self, base: str, *names: str) -> str:
        return "/".join([base] + list(names))

    def check(self, path: str, options: Options) -> None:
        store_for(path, options.storage_options)[0].check()

    def open_output(self, path: str, options: Options, block_bytes: int) -> ObjectOutput:
        return ObjectOutput(path, options.storage_options, block_bytes)

    def open_input(self, path: str, options: Options, threads: Optional[int] = None) -> ObjectInput:
        return ObjectInput(path, options.storage_options)

    def read_ends(self, path: str, options: Options, parse: Callable[[int, Callable[[int, int], bytes]], Any]) -> Any:
        """A HEAD for the size, then ranged GETs for the ends."""
        store, key = store_for(path, options.storage_options)
        size = store.size(key)
        if size is None:
            raise CheckpointNotFoundError(f"{path}: no such checkpoint object", path=path)

        def read(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            return bytes(buf[:store.read_into(key, memoryview(buf), offset)])
        return parse(size, read)

    def checkpoint_dir(self, path: str, options: Options) -> ObjectCheckpointDir:
        return ObjectCheckpointDir(path, options)

    def pending_file(self, final: str, options: Options, make_parents: bool = False,
                     beside: Optional[str] = None) -> PendingObject:
        return PendingObject(self.normalize(final))
