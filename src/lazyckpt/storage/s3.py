"""S3-compatible object storage: the client, and files on it.

A checkpoint file on an object store is written and read through the same
interfaces as a local one (:class:`lazyckpt.storage.fileio.OutputFile`,
:class:`lazyckpt.storage.fileio.InputFile`), so the writer's pipeline and the
reader's verified block reads do not know where the bytes go:

* :class:`ObjectOutput` turns the writer's ``pwrite_all(window, offset)``
  calls into the parts of one multipart upload. A part is ``part_bytes``
  (the host-cache chunk, or a multiple of it reaching S3's 5 MiB minimum);
  a write that covers a whole part is uploaded straight from the cache chunk
  by the writer thread that holds it (no copy, the memory bound unchanged),
  a part assembled from several writes (the header, a region boundary, the
  footer) is copied into a part buffer until complete. ``finish`` completes
  the upload: only then does the object exist. ``close`` without ``finish``
  aborts it, so a failed save leaves no object and no billed parts.
* :class:`ObjectInput` serves the reader's ``read_into(view, offset)`` with
  ranged GETs straight into its aligned buffers.

The client is boto3 (see docs/STORAGE.md for the measured choice): explicit
multipart calls fit a library that uploads parts from its own writer
threads, its credential chain is the standard one (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, profiles,
instance roles), and its "standard" retry mode retries throttling, 5xx and
connection errors with backoff. ``storage_options`` override any of it.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import io
import re
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError
from .scan import ScanCancelled

MiB = 1 << 20
#: S3 refuses parts smaller than this, except the last.
MIN_PART_BYTES = 5 * MiB
SCHEME = "s3://"
#: URL scheme -> the factory of its clients (register_client): S3's, and what registers.
_CLIENTS: Dict[str, Callable[[str, Tuple[Tuple[str, Any], ...]], Any]] = {}

class StorageConfigError(CheckpointError):
    """The object store refuses us for a reason no retry fixes: wrong
    credentials, a missing bucket, no permission, a malformed URL."""


class InvalidURLError(StorageConfigError, ValueError):
    """A path that is a malformed ``s3://`` URL, or a URL of a scheme lazyckpt
    does not support. Raised before anything is written: such a path never
    silently becomes a local directory, nor a prefix the store rewrites."""


#: S3 bucket names (legacy ones included: capitals and "_" are refused by S3 today).
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{1,253}[A-Za-z0-9]$")


@dataclass(frozen=True)
class ObjectURL:
    bucket: str
    key: str            # no leading or trailing "/"
    #: The object store's URL scheme (a registered client's, :func:`register_client`).
    scheme: str = SCHEME

    @classmethod
    def parse(cls, url: str) -> "ObjectURL":
        """``s3://BUCKET[/PREFIX][/]``, strictly: S3 keys are opaque strings, but
        stores differ on ``a//b``, ``./..`` and backslashes (SeaweedFS rewrites
        them, so listings no longer find what was written): refused here, once,
        instead of losing every step later."""
        scheme = next((s for s in _CLIENTS if isinstance(url, str) and url.startswith(s)), None)
        if scheme is None:
            raise InvalidURLError(f"{url!r}: not an {' or '.join(_CLIENTS)} URL", path=str(url))
        bucket, _, key = url[len(scheme):].partition("/")
        def malformed(reason: str) -> InvalidURLError:
            return InvalidURLError(f"{url}: malformed {scheme} URL: {reason}", path=url)
        if not bucket:
            raise malformed(f"no bucket name ({scheme}BUCKET/PREFIX)")
        if len(bucket) < 3:
            raise malformed(f"bucket name {bucket!r} is too short (S3 bucket names have 3 to 63 characters)")
        if not _BUCKET.match(bucket):
            raise malformed(f"{bucket!r} is not a valid bucket name (letters, digits, '.', '-', '_'; starting "
                            f"and ending with a letter or digit)")
        if key.endswith("/") and len(key) > 1:
            key = key[:-1]                      # one trailing slash: "s3://b/run/" is "s3://b/run"
        if key:
            for part in key.split("/"):
                if part == "":
                    raise malformed("empty path component ('//', or a leading or doubled trailing '/') in "
                                    "the prefix")
                if part in (".", ".."):
                    raise malformed(f"{part!r} path component in the prefix (object stores do not resolve "
                                    f"it; spell the prefix out)")
            bad = sorted({c for c in key if c == "\\" or ord(c) < 32 or ord(c) == 127})
            if bad:
                raise malformed(f"the prefix holds {', '.join(map(repr, bad))} (a backslash or a control "
                                f"character), which object stores rewrite or refuse")
        return cls(bucket, key, scheme)

    def join(self, *names: str) -> "ObjectURL":
        parts = [self.key] if self.key else []
        return ObjectURL(self.bucket, "/".join(parts + [n.strip("/") for n in names]), self.scheme)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return f"{self.scheme}{self.bucket}/{self.key}" if self.key else f"{self.scheme}{self.bucket}"


def join(url: str, *names: str) -> str:
    return str(ObjectURL.parse(url).join(*names))


# ---------------------------------------------------------------------- client

class ObjectStore:
    """One bucket on an S3-compatible endpoint. Thread-safe (boto3 clients are).

    What the object layout (``s3layout``), the leases and the files above ask
    of an object store is this class's public methods; another object store
    is a class with the same methods, registered for its URL scheme
    (:func:`register_client`; ``storage/memstore.py`` is one)."""

    scheme = SCHEME

    def __init__(self, bucket: str, storage_options: Tuple[Tuple[str, Any], ...] = ()):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:      # pragma: no cover (the "s3" extra)
            raise StorageConfigError("s3:// paths need boto3: pip install 'lazyckpt[s3]'") from exc
        o = dict(storage_options)
        self.bucket = bucket
        try:
            self.client = self._client(boto3, Config, o)
        except Exception as exc:
            # botocore's own (ValueError "Invalid endpoint: ...", ProfileNotFound) names no setting.
            raise StorageConfigError(
                f"s3://{bucket}: cannot set up the object store client: {type(exc).__name__}: {exc}; check "
                f"{_ENDPOINT_SETTINGS} (a URL such as http://host:8333) and the profile (AWS_PROFILE or "
                f"storage_options['profile'])", path=f"s3://{bucket}") from exc
        self._checked = False

    @staticmethod
    def _client(boto3: Any, Config: Any, o: Dict[str, Any]) -> Any:
        session = boto3.session.Session(profile_name=o.get("profile"))
        config = Config(
            retries={"mode": "standard", "max_attempts": int(o.get("max_attempts", 5))},
            connect_timeout=float(o.get("connect_timeout", 10)),
            read_timeout=float(o.get("read_timeout", 60)),
            max_pool_connections=int(o.get("max_pool_connections", 32)),
            s3={"addressing_style": o.get("addressing_style", "path")},
            # Every block carries our own xxh3, verified on read: S3's extra CRC
            # of every part would only cost CPU on the two cores we have.
            request_checksum_calculation=o.get("checksums", "when_required"),
            response_checksum_validation=o.get("checksums", "when_required"),
        )
        return session.client(
            "s3", endpoint_url=o.get("endpoint_url"), region_name=o.get("region"),
            aws_access_key_id=o.get("access_key_id"), aws_secret_access_key=o.get("secret_access_key"),
            aws_session_token=o.get("session_token"), config=config)

    def url(self, key: str) -> str:
        return str(ObjectURL(self.bucket, key, self.scheme))

    # ---------------------------------------------------------------- errors

    def error(self, exc: BaseException, key: str, doing: str) -> CheckpointError:
        """A client error as the library's: configuration problems (no retry
        helps) as StorageConfigError, a missing object as not found, the rest
        as a read error with the cause."""
        url = self.url(key)
        code, status = _error_code(exc)
        if code in ("NoSuchBucket",) or (status == 404 and not key):
            return StorageConfigError(f"{self.url('')}: no such bucket ({doing}) at "
                                      f"{self.client.meta.endpoint_url}; correct the bucket name in the URL, "
                                      f"or create it (aws s3 mb {self.url('')})", path=url)
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden",
                    "InvalidToken", "ExpiredToken") or status == 403:
            return StorageConfigError(f"{url}: the object store refused our credentials or permissions "
                                      f"while {doing} ({code or status}); check AWS_ACCESS_KEY_ID / "
                                      f"AWS_SECRET_ACCESS_KEY / AWS_PROFILE or storage_options", path=url)
        if code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound") or status == 404:
            return CheckpointNotFoundError(f"{url}: not found ({doing})", path=url)
        if type(exc).__name__ == "NoCredentialsError":
            return StorageConfigError(f"{url}: no credentials found for the object store ({doing}); set "
                                      f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, or "
                                      f"storage_options", path=url)
        if type(exc).__name__ in _CONNECTION_ERRORS:
            return CheckpointReadError(f"{url}: cannot reach the object store at {self.client.meta.endpoint_url} "
                                       f"while {doing} ({type(exc).__name__}: {exc}); check {_ENDPOINT_SETTINGS} "
                                       f"(http:// or https://, as the server speaks) and that the server is "
                                       f"up", path=url)
        return CheckpointReadError(f"{url}: object store error while {doing}: {type(exc).__name__}: {exc}",
                                   path=url)

    def check(self) -> None:
        """One cheap request that fails clearly on wrong credentials or a missing
        bucket, before any data moves (HEAD bucket is not retried on 403/404)."""
        if self._checked:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            # The client keeps the credentials and endpoint it was made with: the next
            # call makes a new one, which sees what the user has fixed meanwhile.
            _forget(self)
            raise self.error(exc, "", "checking the bucket") from exc
        self._checked = True

    # ---------------------------------------------------------------- small objects

    def put(self, key: str, data: bytes) -> None:
        """One object, whole or not at all. ``Content-MD5`` makes the server
        refuse a body that is not all there: SeaweedFS stores an EMPTY object
        when the client dies after its ``100 Continue`` and before the body
        (RELIABILITY.md finding 23; a signed payload hash does not stop it).
        MD5 is what every S3-compatible server checks; it costs ~1.4 ms a MiB
        here (700 MB/s), and only small objects come through this call."""
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentMD5=md5)
        except Exception as exc:
            raise self.error(exc, key, "writing") from exc

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        """The object's bytes (at most ``limit + 1``), or None if there is none."""
        try:
            kwargs = {"Range": f"bytes=0-{limit}"} if limit is not None else {}
            return self.client.get_object(Bucket=self.bucket, Key=key, **kwargs)["Body"].read()
        except Exception as exc:
            err = self.error(exc, key, "reading")
            if isinstance(err, CheckpointNotFoundError):
                return None
            if _error_code(exc)[1] == 416:      # a range on an empty object
                return b""
            raise err from exc

    def size(self, key: str) -> Optional[int]:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except Exception as exc:
            err = self.error(exc, key, "looking up")
            if isinstance(err, CheckpointNotFoundError):
                return None
            raise err from exc

    def read_into(self, key: str, view: memoryview, offset: int) -> int:
        """Ranged GET of ``len(view)`` bytes at ``offset`` into ``view``; returns
        the bytes read (fewer at the end of the object)."""
        if not len(view):
            return 0
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key,
                                          Range=f"bytes={offset}-{offset + len(view) - 1}")["Body"]
        except Exception as exc:
            if _error_code(exc)[1] == 416:      # the range starts past the end
                return 0
            raise self.error(exc, key, f"reading bytes at {offset}") from exc
        try:
            raw = getattr(body, "_raw_stream", None)
            # From the socket straight into the aligned buffer; else urllib3's readinto
            # (a bytes object, then a copy); else the whole body, then a copy.
            socket_reader = _socket_reader(raw)
            reader = socket_reader if socket_reader is not None else \
                raw if raw is not None and hasattr(raw, "readinto") else None
            if reader is None:
                data = body.read()
                view[:len(data)] = data
                return len(data)
            done = 0
            while done < len(view):
                n = reader.readinto(view[done:])
                if not n:
                    break
                done += n
            if socket_reader is not None:
                _consumed(raw, done)
            return done
        except Exception as exc:
            raise self.error(exc, key, f"reading bytes at {offset}") from exc
        finally:
            body.close()

    def list(self, prefix: str, start_after: Optional[str] = None) -> Iterator[Dict[str, Any]]:
        """Every object under ``prefix`` (``Key``, ``Size``, ``LastModified``);
        with ``start_after``, only keys after it (the listing starts there:
        its cost is what it returns, not what the prefix holds)."""
        extra = {"StartAfter": start_after} if start_after else {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix,
                                                                           **extra)
            for page in pages:
                yield from page.get("Contents", [])
        except Exception as exc:
            raise self.error(exc, prefix, "listing") from exc

    def listing(self, prefix: str, stop: Optional[Callable[[], bool]] = None
                ) -> Tuple[List[Dict[str, Any]], datetime]:
        """Every object under ``prefix`` and the server's clock when it listed
        them (the ``Date`` header of the first page). Lease ages are this
        reference minus ``LastModified``: both stamped by the server, so a
        host whose own clock is skewed can neither expire a live lease nor keep
        a dead one (a later page's objects only look younger: the safe side).
        ``stop``: asked before each page; True ends the listing unfinished
        (``ScanCancelled``: a partial listing is never taken as the whole)."""
        objects: List[Dict[str, Any]] = []
        now: Optional[datetime] = None
        cancelled = False
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                if stop is not None and stop():
                    cancelled = True
                    break
                now = now or _server_date(page)
                objects += page.get("Contents", [])
        except Exception as exc:
            raise self.error(exc, prefix, "listing") from exc
        if cancelled:
            raise ScanCancelled(f"{self.url(prefix)}: listing cancelled")
        return objects, now or self.server_time(prefix)

    def server_time(self, near: str) -> datetime:
        """The server's clock from an object it stamps (for servers that send no
        ``Date`` header): PUT a probe, read its ``LastModified``, delete it."""
        key = f"{near.rstrip('/')}/.clock-{uuid.uuid4().hex}" if near else f".clock-{uuid.uuid4().hex}"
        self.put(key, b"")
        try:
            return self.client.head_object(Bucket=self.bucket, Key=key)["LastModified"]
        except Exception as exc:
            raise self.error(exc, key, "reading the server's clock") from exc
        finally:
            self.delete([key])

    def copy(self, source_bucket: str, source_key: str, key: str) -> None:
        """Server-side copy of an object (up to 5 GB in one request; larger ones
        part by part, as boto3's managed copy does)."""
        try:
            self.client.copy({"Bucket": source_bucket, "Key": source_key}, self.bucket, key)
        except Exception as exc:
            raise self.error(exc, key, f"copying s3://{source_bucket}/{source_key} to") from exc

    def delete(self, keys: List[str]) -> None:
        for i in range(0, len(keys), 1000):      # the API's batch limit
            batch = [{"Key": k} for k in keys[i:i + 1000]]
            try:
                out = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as exc:
                raise self.error(exc, keys[i], "deleting") from exc
            if out.get("Errors"):
                first = out["Errors"][0]
                raise CheckpointError(f"{self.url(first.get('Key', ''))}: delete refused: "
                                      f"{first.get('Code')} {first.get('Message')}", path=self.url(keys[i]))

    def uploads(self, prefix: str) -> Iterator[Dict[str, Any]]:
        """Open multipart uploads under ``prefix`` (``Key``, ``UploadId``, ``Initiated``)."""
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                   Prefix=prefix):
                yield from page.get("Uploads", [])
        except Exception as exc:
            raise self.error(exc, prefix, "listing uploads") from exc

    # -- multipart uploads: an object visible only once complete (ObjectOutput)

    def start_upload(self, key: str) -> str:
        try:
            return self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        except Exception as exc:
            raise self.error(exc, key, "starting an upload") from exc

    def put_part(self, key: str, upload_id: str, number: int, data: memoryview) -> str:
        """Upload part ``number`` (from 1) straight from ``data``; its ETag."""
        try:
            return self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                           Body=_ViewBody(data), ContentLength=len(data))["ETag"]
        except Exception as exc:
            raise self.error(exc, key, f"uploading part {number}") from exc

    def complete_upload(self, key: str, upload_id: str, etags: List[str]) -> None:
        """The object exists from here on: parts 1..len(etags), in order."""
        parts = [{"PartNumber": n + 1, "ETag": etag} for n, etag in enumerate(etags)]
        try:
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
        except Exception as exc:
            raise self.error(exc, key, "completing the upload") from exc

    def abort_upload(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            err = self.error(exc, key, "aborting an upload")
            if not isinstance(err, CheckpointNotFoundError):
                raise err from exc


def _server_date(response: Dict[str, Any]) -> Optional[datetime]:
    """A response's ``Date`` header (the server's clock, 1 s resolution), or None."""
    raw = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return email.utils.parsedate_to_datetime(raw) if raw else None
    except (TypeError, ValueError):
        return None


def _error_code(exc: BaseException) -> Tuple[Optional[str], Optional[int]]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code, status


_stores: Dict[Tuple[str, str, Tuple], ObjectStore] = {}
_stores_lock = threading.Lock()
#: Where the endpoint comes from, for the messages.
_ENDPOINT_SETTINGS = "the endpoint (storage_options['endpoint_url'] or AWS_ENDPOINT_URL)"
#: botocore's errors of a request that never reached a server (by name: botocore is an extra).
_CONNECTION_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "SSLError", "ProxyConnectionError",
                      "ConnectionClosedError"}


def _forget(store: Any) -> None:
    """Drop ``store`` from the shared clients (it failed its check)."""
    with _stores_lock:
        for key in [k for k, v in _stores.items() if v is store]:
            del _stores[key]


def register_client(scheme: str, factory: Callable[[str, Tuple[Tuple[str, Any], ...]], Any]) -> None:
    """Make ``scheme`` URLs (``"mem://"``) name buckets of another object store:
    ``factory(bucket, storage_options)`` returns its client, an object with
    :class:`ObjectStore`'s public methods. The URL rules, the layout of a
    Checkpointer directory, its leases and files are this module's and
    ``s3layout``'s, the same for every object store."""
    _CLIENTS[scheme] = factory


register_client(SCHEME, ObjectStore)


def store_for(url: str, storage_options: Tuple[Tuple[str, Any], ...] = ()) -> Tuple[ObjectStore, str]:
    """(the client for the URL's bucket, the URL's key); one client per bucket
    and options, shared (its connection pool is)."""
    u = ObjectURL.parse(url)
    with _stores_lock:
        store = _stores.get((u.scheme, u.bucket, storage_options))
        if store is None:
            store = _stores[(u.scheme, u.bucket, storage_options)] = _CLIENTS[u.scheme](u.bucket, storage_options)
    return store, u.key


def _socket_reader(raw: Any) -> Any:
    """The ``http.client`` response under a botocore body, when its bytes can be
    read straight into the caller's buffer, or None. urllib3's ``readinto``
    reads into a new bytes object and copies it: a fresh allocation (page
    faults) and a memcpy per ranged GET, which made 8 ranks restoring 256 MiB
    each at once 1.7x slower than a raw ``get_object().read()`` here
    (benchmarks/bench_restart_storm.py --data-mb). Only for a plain body (no
    content encoding to undo) and the urllib3 2.x response whose byte counters
    :func:`_consumed` keeps right; anything else takes urllib3's path."""
    fp = getattr(raw, "_fp", None)
    if fp is None or not hasattr(fp, "readinto") or not hasattr(fp, "isclosed") or getattr(fp, "chunked", True):
        return None
    headers = getattr(raw, "headers", None) or {}
    if headers.get("content-encoding") or not hasattr(raw, "_fp_bytes_read") or not hasattr(raw, "release_conn") \
            or not hasattr(raw, "length_remaining"):
        return None
    return fp


def _consumed(raw: Any, n: int) -> None:
    """Tell urllib3 the body's bytes were read (as its own read does) and, once
    they all were, return the connection to the pool (else closing the body
    closes the connection: a new one, a TLS handshake on a real store, per GET)."""
    raw._fp_bytes_read += n
    if raw.length_remaining is not None:
        raw.length_remaining -= n
    if raw._fp.isclosed():
        raw.release_conn()


# ---------------------------------------------------------------------- files

class _ViewBody(io.RawIOBase):
    """A memoryview as a seekable request body: botocore rewinds it to retry,
    and nothing copies the chunk first."""

    def __init__(self, view: memoryview):
        self._view = view.cast("B") if view.format != "B" else view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        data = bytes(self._view[self._pos:end])
        self._pos = end
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


class ObjectOutput:
    """A checkpoint file written as one object (see the module docstring)."""

    direct = False
    rewrites_in_place = False

    def __init__(self, url: str, storage_options: Tuple[Tuple[str, Any], ...], block_bytes: int):
        self.path = url
        self.store, self.key = store_for(url, storage_options)
        self.store.check()
        # Parts are whole writer windows, at least S3's minimum.
        self.part_bytes = -(-MIN_PART_BYTES // block_bytes) * block_bytes
        self._lock = threading.Lock()
        self._upload_id: Optional[str] = None
        self._etags: Dict[int, str] = {}
        self._buffers: Dict[int, bytearray] = {}
        self._covered: Dict[int, int] = {}
        #: Parts that will be written again before finish (will_rewrite): buffered, uploaded at finish.
        self._held: set = set()
        self._finished = False
        self.bytes_uploaded = 0

    def _upload(self) -> str:
        with self._lock:
            if self._upload_id is None:
                self._upload_id = self.store.start_upload(self.key)
            return self._upload_id

    def _put_part(self, number: int, data: memoryview) -> None:
        upload_id = self._upload()
        etag = self.store.put_part(self.key, upload_id, number + 1, data)
        with self._lock:
            self._etags[number] = etag
            self.bytes_uploaded += len(data)

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        """Write ``data`` at ``offset``: whole parts are uploaded now, from
        ``data`` itself; pieces of parts wait in a part buffer. A part is
        uploaded once: writing into one already uploaded (and not announced by
        :meth:`will_rewrite`) is refused, never a part re-sent from a buffer
        holding only the new piece."""
        q = self.part_bytes
        end = offset + len(data)
        pos = offset
        while pos < end:
            number = pos // q
            part_end = min(end, (number + 1) * q)
            piece = data[pos - offset:part_end - offset]
            if number in self._etags:
                raise CheckpointError(f"{self.path}: internal error: part {number + 1} written again after its "
                                      f"upload (offset {pos})")
            if pos == number * q and part_end - pos == q and number not in self._held:
                self._put_part(number, piece)
            else:
                complete = None
                with self._lock:
                    buf = self._buffers.get(number)
                    if buf is None:
                        buf = self._buffers[number] = bytearray(q)
                    buf[pos - number * q:part_end - number * q] = piece
                    self._covered[number] = self._covered.get(number, 0) + (part_end - pos)
                    if self._covered[number] >= q and number not in self._held:
                        complete = self._buffers.pop(number)
                if complete is not None:
                    self._put_part(number, memoryview(complete))
            pos = part_end

    def will_rewrite(self, offsets: List[int]) -> None:
        """The parts holding these offsets stay in memory until :meth:`finish`
        (a part is uploaded once): at most one part per offset, and a foreign
        layout asks for few (its trailing index) on an object store."""
        self._held.update(offset // self.part_bytes for offset in offsets)

    def finish(self, size: int) -> None:
        """Upload what is buffered (the last part cut to ``size``) and complete
        the upload: the object exists from here on, whole."""
        q = self.part_bytes
        last = max(0, size - 1) // q
        with self._lock:
            leftovers = sorted(self._buffers.items())
            self._buffers.clear()
        for number, buf in leftovers:
            if number > last:
                continue                       # page padding past the end
            length = min(q, size - number * q)
            if number != last and self._covered.get(number, 0) < q:
                raise CheckpointError(f"{self.path}: internal error: part {number + 1} incomplete at finish")
            if number == 0 and last == 0 and self._upload_id is None:
                self.store.put(self.key, bytes(memoryview(buf)[:length]))   # a small file: one PUT
                self._finished = True
                return
            self._put_part(number, memoryview(buf)[:length])
        missing = [n for n in range(last + 1) if n not in self._etags]
        if missing:
            raise CheckpointError(f"{self.path}: internal error: parts {missing[:5]} never written")
        self.store.complete_upload(self.key, self._upload(), [self._etags[n] for n in range(last + 1)])
        self._finished = True

    def close(self) -> None:
        """Abort the upload unless it was completed (a failed or cancelled save)."""
        self._buffers.clear()
        if self._finished or self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        for attempt in range(3):
            try:
                self.store.abort_upload(self.key, upload_id)
                return
            except Exception:           # the server may be gone; prune aborts leftovers later
                time.sleep(0.2 * (attempt + 1))


class ObjectInput:
    """A checkpoint object read at explicit offsets by several threads."""

    direct = False

    def __init__(self, url: str, storage_options: Tuple[Tuple[str, Any], ...]):
        self.path = url
        self.store, self.key = store_for(url, storage_options)

    def read_into(self, buf: memoryview, offset: int) -> int:
        return self.store.read_into(self.key, buf, offset)

    def close(self) -> None:
        pass
