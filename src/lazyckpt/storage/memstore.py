"""``mem://BUCKET/PREFIX``: an object store held in this process's memory.

What it is for: tests and examples that need an object store without a
server (the unit layer runs the object-store layout, its commit, leases and
retention through it), and the proof that a new store is one module. It is
an object store like S3 to everything above it: the URL rules, the layout
of a Checkpointer directory (``s3layout``), the leases (``s3leases``), the
files (``ObjectOutput``/``ObjectInput``) are the ones S3 uses; this module
only answers the client's requests (:class:`lazyckpt.storage.s3.ObjectStore`'s
public methods) from a dictionary, and registers the ``mem://`` scheme.

Semantics kept from S3, since the layout relies on them: an object appears
whole when its PUT or its multipart upload completes (never in part), a
listing is ordered by key and starts after ``start_after``, every object
carries the time it was stamped (``LastModified``, the "server's" clock:
this process's), an open multipart upload is listed until completed or
aborted. Buckets exist from their first use; their contents live until the
process ends or :func:`clear` is called. Not durable, not shared between
processes: a ``mem://`` checkpoint dies with its process.
"""

from __future__ import annotations

import bisect
import threading
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from .base import register_store
from .s3 import ObjectURL, register_client
from .s3store import S3Store

SCHEME = "mem://"


class _Bucket:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: key -> (bytes, when it was stamped); ``keys``: the same keys, sorted.
        self.objects: Dict[str, Tuple[bytes, datetime]] = {}
        self.keys: List[str] = []
        #: upload id -> (key, when it started, part number -> bytes).
        self.uploads: Dict[str, Tuple[str, datetime, Dict[int, bytes]]] = {}

    def store(self, key: str, data: bytes) -> None:
        with self.lock:
            if key not in self.objects:
                bisect.insort(self.keys, key)
            self.objects[key] = (data, _now())


_buckets: Dict[Tuple[str, str], _Bucket] = {}
_buckets_lock = threading.Lock()


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _bucket(scheme: str, name: str) -> _Bucket:
    with _buckets_lock:
        if (scheme, name) not in _buckets:
            _buckets[(scheme, name)] = _Bucket()
        return _buckets[(scheme, name)]


def clear() -> None:
    """Forget every ``mem://`` bucket (tests)."""
    with _buckets_lock:
        _buckets.clear()


class MemoryObjectStore:
    """The client of one ``mem://`` bucket: :class:`ObjectStore`'s methods."""

    scheme = SCHEME

    def __init__(self, bucket: str, storage_options: Tuple[Tuple[str, Any], ...] = ()):
        self.bucket = bucket

    @property
    def _b(self) -> _Bucket:
        # Looked up at every call, not kept: clients are cached (s3.store_for) and
        # clear() must empty what they see too.
        return _bucket(self.scheme, self.bucket)

    def url(self, key: str) -> str:
        return str(ObjectURL(self.bucket, key, self.scheme))

    def check(self) -> None:
        pass                            # a bucket exists from its first use

    # ---------------------------------------------------------------- small objects

    def _object(self, key: str) -> Optional[Tuple[bytes, datetime]]:
        bucket = self._b
        with bucket.lock:
            return bucket.objects.get(key)

    def put(self, key: str, data: bytes) -> None:
        self._b.store(key, bytes(data))

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        found = self._object(key)
        if found is None:
            return None
        return found[0] if limit is None else found[0][:limit + 1]

    def size(self, key: str) -> Optional[int]:
        found = self._object(key)
        return None if found is None else len(found[0])

    def read_into(self, key: str, view: memoryview, offset: int) -> int:
        found = self._object(key)
        if found is None:
            raise CheckpointNotFoundError(f"{self.url(key)}: not found (reading bytes at {offset})",
                                          path=self.url(key))
        piece = found[0][offset:offset + len(view)]
        view[:len(piece)] = piece
        return len(piece)

    # ---------------------------------------------------------------- listings

    def list(self, prefix: str, start_after: Optional[str] = None) -> Iterator[Dict[str, Any]]:
        bucket = self._b
        with bucket.lock:
            i = bisect.bisect_right(bucket.keys, start_after) if start_after and start_after >= prefix \
                else bisect.bisect_left(bucket.keys, prefix)
            out = []
            for key in bucket.keys[i:]:
                if not key.startswith(prefix):
                    break
                data, stamp = bucket.objects[key]
                out.append({"Key": key, "Size": len(data), "LastModified": stamp})
        yield from out

    def listing(self, prefix: str, stop: Optional[Callable[[], bool]] = None
                ) -> Tuple[List[Dict[str, Any]], datetime]:
        now = _now()            # (one page: ``stop`` has nothing to end early)
        return list(self.list(prefix)), now

    def server_time(self, near: str) -> datetime:
        return _now()

    # ---------------------------------------------------------------- changes

    def copy(self, source_bucket: str, source_key: str, key: str) -> None:
        source = type(self)(source_bucket)
        data = source.get(source_key)
        if data is None:
            raise CheckpointNotFoundError(f"{source.url(source_key)}: not found (copying to {self.url(key)})",
                                          path=source.url(source_key))
        self.put(key, data)

    def delete(self, keys: List[str]) -> None:
        bucket = self._b
        with bucket.lock:
            for key in keys:
                if bucket.objects.pop(key, None) is not None:
                    bucket.keys.pop(bisect.bisect_left(bucket.keys, key))

    # ---------------------------------------------------------------- multipart uploads

    def uploads(self, prefix: str) -> Iterator[Dict[str, Any]]:
        bucket = self._b
        with bucket.lock:
            found = [{"Key": key, "UploadId": upload_id, "Initiated": started}
                     for upload_id, (key, started, _) in bucket.uploads.items() if key.startswith(prefix)]
        yield from sorted(found, key=lambda u: (u["Key"], u["Initiated"]))

    def start_upload(self, key: str) -> str:
        upload_id = uuid.uuid4().hex
        bucket = self._b
        with bucket.lock:
            bucket.uploads[upload_id] = (key, _now(), {})
        return upload_id

    def _parts(self, bucket: _Bucket, key: str, upload_id: str) -> Dict[int, bytes]:
        """The parts of an open upload of ``key`` (under ``bucket.lock``)."""
        found = bucket.uploads.get(upload_id)
        if found is None or found[0] != key:
            raise CheckpointNotFoundError(f"{self.url(key)}: no such upload {upload_id}", path=self.url(key))
        return found[2]

    def put_part(self, key: str, upload_id: str, number: int, data: memoryview) -> str:
        part = bytes(data)
        bucket = self._b
        with bucket.lock:
            self._parts(bucket, key, upload_id)[number] = part
        return f'"{number}-{len(part)}"'

    def complete_upload(self, key: str, upload_id: str, etags: List[str]) -> None:
        bucket = self._b
        with bucket.lock:
            parts = self._parts(bucket, key, upload_id)
            if sorted(parts) != list(range(1, len(etags) + 1)):
                raise CheckpointError(f"{self.url(key)}: upload {upload_id} completed with parts "
                                      f"{sorted(parts)[:8]}, not 1..{len(etags)}", path=self.url(key))
            data = b"".join(parts[n] for n in range(1, len(etags) + 1))
            del bucket.uploads[upload_id]
        bucket.store(key, data)

    def abort_upload(self, key: str, upload_id: str) -> None:
        bucket = self._b
        with bucket.lock:
            bucket.uploads.pop(upload_id, None)


class MemoryStore(S3Store):
    """``mem://`` paths: the object-store Store over :class:`MemoryObjectStore`."""
    name = "memory"
    scheme = SCHEME


register_client(SCHEME, MemoryObjectStore)
register_store(MemoryStore())
