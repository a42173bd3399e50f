"""The old name of :mod:`lazyckpt.interop.dcp_source` (DCP checkpoint
directories, read side).

Kept because files on disk name it: DCP ``.metadata`` written while
``LazyStorageInfo`` lived here pickles it as
``lazyckpt.interop.dcp.LazyStorageInfo``, and DCP's own readers unpickle with
plain pickle, which imports this module. It re-exports the classes such files
and DCP's planning may name, and warns nothing (a user cannot change a file
already written). New code imports :mod:`lazyckpt.interop.dcp_source`."""

from lazyckpt.interop.dcp_source import (ALLOWED, METADATA, SUFFIX, DCPReaderError, LazyStorageInfo,  # noqa: F401
                                         LazyStorageReader, MetadataUnpickler)

__all__ = ["LazyStorageInfo", "LazyStorageReader", "DCPReaderError", "MetadataUnpickler"]
