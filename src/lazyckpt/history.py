"""Deprecated: the rules of the line of history are :mod:`lazyckpt.lineage`.

This module kept its old name for one more release; importing it warns and
gives the same objects."""

import warnings

from lazyckpt.lineage import *  # noqa: F401,F403
from lazyckpt.lineage import (RECENT_EVENTS, RECORD, EVENTS_PREFIX, Committing, Event, abandoned,  # noqa: F401
                              event_key, event_problem, line, manifest_event, max_seq, parse_event_key, prunable)
from lazyckpt.options import LazyckptDeprecationWarning

warnings.warn("lazyckpt.history is deprecated: use lazyckpt.lineage", LazyckptDeprecationWarning, stacklevel=2)
