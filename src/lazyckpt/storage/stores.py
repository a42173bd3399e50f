"""Which store a path belongs to: the one place that decides it.

Every place that takes "a path or a URL" asks :func:`for_path`; nothing else
looks at a path's spelling. A new store is one module: it implements
:class:`lazyckpt.storage.base.Store` and registers an instance for its URL
scheme when imported (``base.register_store``); the built-in ones are
imported below. An object store reuses the object layout and needs only a
client (``s3.register_client``; ``memstore.py`` is the example).
"""

from __future__ import annotations

import os
import re
from typing import Any

from . import memstore, s3store
from .base import URL_STORES, Store
from .localstore import LocalStore
from .s3 import InvalidURLError

#: The built-in URL stores: importing their modules registered them.
BUILT_IN = (s3store.S3Store, memstore.MemoryStore)
#: Everything that does not look like a URL.
LOCAL: Store = LocalStore()

#: Something that starts like a URL: ``scheme:`` (RFC 3986) -- ``s3:/b``, ``S3://b``,
#: ``gs://b``, ``file:///x``, ``s3:b`` -- as opposed to a local path.
_URL_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


def for_path(path: Any) -> Store:
    """The store ``path`` names. A registered scheme's well-formed URL is that
    store; a malformed one, or anything else that looks like a URL (another
    scheme, ``S3://``, ``s3:/``), raises :class:`InvalidURLError` before
    anything is written: such a path never silently becomes a local directory.
    A local path (absolute, or relative and not starting with ``scheme:``) is
    the local file system."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str):
        return LOCAL
    for store in URL_STORES:
        if store.claims(path):
            return store
    if _URL_LIKE.match(path):
        scheme = path.partition(":")[0]
        schemes = " or ".join(store.scheme for store in URL_STORES)
        raise InvalidURLError(f"{path!r}: unsupported URL ({scheme + ':'!r}): only {schemes} URLs (lowercase, two "
                              f"slashes) name an object store; to mean a local directory of this name, "
                              f"write it as ./{path}", path=path)
    return LOCAL


def join(base: str, *names: str) -> str:
    """``base``/names in the separator of ``base``'s store."""
    return for_path(base).join(base, *names)
