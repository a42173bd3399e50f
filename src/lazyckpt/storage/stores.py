"""Which store a path belongs to: the one place that decides it.

Every place that takes "a path or a URL" asks :func:`for_path`; nothing else
looks at a path's spelling. A new store is a module implementing
:class:`lazyckpt.storage.base.Store` and one line in ``REMOTE`` below.
"""

from __future__ import annotations

import os
import re
from typing import Any, List

from .base import Store
from .localstore import LocalStore
from .s3 import InvalidURLError
from .s3store import S3Store

#: Stores named by a URL scheme, asked in this order. Register a new store here.
REMOTE: List[Store] = [S3Store()]
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
    for store in REMOTE:
        if store.claims(path):
            return store
    if _URL_LIKE.match(path):
        scheme = path.partition(":")[0]
        schemes = " or ".join(store.scheme for store in REMOTE)
        raise InvalidURLError(f"{path!r}: unsupported URL ({scheme + ':'!r}): only {schemes} URLs (lowercase, two "
                              f"slashes) name an object store; to mean a local directory of this name, "
                              f"write it as ./{path}", path=path)
    return LOCAL


def join(base: str, *names: str) -> str:
    """``base``/names in the separator of ``base``'s store."""
    return for_path(base).join(base, *names)
