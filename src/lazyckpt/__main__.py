"""``python -m lazyckpt``: the command line (see :mod:`lazyckpt.cli`)."""

from lazyckpt.cli import entry_point

entry_point()
