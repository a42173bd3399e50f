"""``python -m lazyckpt.cli``: the command line, as ``python -m lazyckpt``."""

from . import entry_point

entry_point()
