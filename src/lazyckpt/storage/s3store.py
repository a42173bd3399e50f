"""S3-compatible object stores as a :class:`lazyckpt.storage.base.Store`:
multipart uploads and ranged GETs (``s3``), Checkpointer directories
committed by a manifest object (``s3layout``)."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Optional

from lazyckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, STEP_DIR
from lazyckpt.knobs import Options
from .base import HeldStep, Located, Store, register_store
from .s3 import SCHEME, ObjectInput, ObjectOutput, ObjectURL, store_for
from .s3layout import ObjectCheckpointDir, PendingObject, read_manifest
from .s3leases import reading_object_step


class S3Store(Store):
    name = "s3"
    scheme = SCHEME
    is_remote = True

    def claims(self, path: str) -> bool:
        if not path.startswith(self.scheme):
            return False
        ObjectURL.parse(path)           # a malformed URL is an error, never a local path
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

    def write_whole(self, path: str, data: bytes, options: Options) -> None:
        """One PUT: an object store shows the whole object or the previous one."""
        store, key = store_for(self.normalize(path), options.storage_options)
        store.put(key, data)

    def list_files(self, directory: str, options: Options, recursive: bool = False) -> List[str]:
        store, key = store_for(self.normalize(directory), options.storage_options)
        prefix = f"{key}/" if key else ""
        return sorted(n for n in (o["Key"][len(prefix):] for o in store.list(prefix))
                      if n and (recursive or "/" not in n))

    def exists(self, path: str, options: Options) -> bool:
        store, key = store_for(self.normalize(path), options.storage_options)
        return store.size(key) is not None

    def delete_file(self, path: str, options: Options) -> None:
        store, key = store_for(self.normalize(path), options.storage_options)
        store.delete([key])

    def copy_file(self, source: str, dest: str, options: Options) -> None:
        """A server-side copy: the object at ``dest`` is replaced whole."""
        src, dst = ObjectURL.parse(self.normalize(source)), ObjectURL.parse(self.normalize(dest))
        store, key = store_for(str(dst), options.storage_options)
        store.copy(src.bucket, src.key, key)

    def read_whole(self, path: str, options: Options, limit: int) -> bytes:
        url = self.normalize(path)
        store, key = store_for(url, options.storage_options)
        data = store.get(key, limit=limit)
        if data is None:
            raise CheckpointNotFoundError(f"{url}: no such object", path=url)
        if len(data) > limit:
            raise CorruptCheckpointError(f"{url}: larger than {limit} bytes", path=url)
        return data

    # ---------------------------------------------------------------- the read side

    def locate(self, path: str, options: Options, empty_ok: bool = False, all_steps: bool = False) -> Located:
        """An object, a committed save prefix (``.../step_X/<save_id>`` or
        ``.../step_X``) or a Checkpointer directory prefix (-> its latest step).
        Objects and prefixes: nothing to stat, so a HEAD per candidate."""
        url = self.normalize(path)
        store, key = store_for(url, options.storage_options)
        store.check()           # wrong credentials, a missing bucket: one clear error first
        if key and store.size(key) is not None:
            return Located("file", url)
        u = ObjectURL.parse(url)
        m = STEP_DIR.match(u.name) if u.key else None
        if store.size(f"{key}/{MANIFEST}" if key else MANIFEST) is not None:
            return Located("step", url, url)
        if m is not None:                           # DIR/step_X: its committed save
            parent = ObjectCheckpointDir(str(ObjectURL(u.bucket, u.key.rpartition("/")[0], u.scheme)), options)
            committed = parent.committed()
            if int(m.group(1)) in committed:
                return Located("step", url, f"{url}/{committed[int(m.group(1))]}", int(m.group(1)))
        directory = ObjectCheckpointDir(url, options)
        if all_steps:
            paths = directory.step_paths()
        else:
            # head.json and one page of events; where they cannot tell,
            # locate_step lists the prefix itself, so None means no committed step.
            found = directory.locate_step(None)
            if found is not None:
                return Located("directory", url, found[1], found[0])
            paths = {}
        if not paths:
            if empty_ok and (not key or next(iter(store.list(f"{key}/")), None) is not None):
                return Located("directory", url)
            if empty_ok:
                raise CheckpointNotFoundError(f"{url}: no such prefix (no object under it)", path=url)
            raise CheckpointNotFoundError(f"{url}: no checkpoint object, committed save or committed checkpoint "
                                          f"under this prefix", path=url)
        steps = sorted(paths)
        return Located("directory", url, paths[steps[-1]], steps[-1], steps)

    def read_manifest(self, step_path: str, options: Options) -> Dict[str, Any]:
        return read_manifest(step_path, options)

    def reading_step(self, step_path: str, options: Options,
                     step: Optional[int] = None) -> ContextManager[HeldStep]:
        """A reader lease under the save prefix (``s3leases.reading_object_step``)."""
        return reading_object_step(step_path, options)


register_store(S3Store())
