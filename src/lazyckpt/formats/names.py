"""The names of a checkpoint's files and directories, on any store: what a
step directory, a rank's data file, the manifest, ``latest`` and the
leftovers of interrupted work are called (docs/FORMAT.md). Pure: no I/O."""

from __future__ import annotations

import re

STEP_DIR = re.compile(r"^step_(\d{10})$")
MANIFEST = "manifest.json"
LATEST = "latest"
TEMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
ABANDONED_PREFIX = ".abandoned-"
#: A hidden sibling of a file or directory written by an integration (``sibling_temp``).
SIBLING_TEMP = re.compile(r"^\.(?P<base>.+)\.tmp-(?P<token>[0-9a-f]{12}|.+-\d+-[0-9a-f]{8})$")
#: Temporaries of ``write_file_atomic`` (``latest``, ``manifest.json``, ``history.json``).
SMALL_TEMP = re.compile(r"^(latest|manifest\.json|history\.json|prepared\.json|\.writer)\.tmp-[0-9A-Za-z]+$")
#: A node's save prepared and waiting for the job's decision (``replicas=``,
#: lazyckpt/saving/jobcommit.py): names the temporary directory it keeps.
PREPARED = "prepared.json"
#: The writer lease of a Checkpointer directory (``WriterLease``).
WRITER = ".writer"

#: The ranges a step, a commit's ``seq`` and a save id are read in (a record,
#: a manifest, an object-store event key ``history/<seq:12>-<step:10>-<save_id>``
#: must hold them all): anything else is damage, never trusted.
MAX_STEP = 10 ** 10 - 1
MAX_SEQ = 10 ** 12 - 1
SAVE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: Ranks are named with 5 digits (``rank_filename``).
MAX_WORLD = 100_000


def step_dirname(step: int) -> str:
    return f"step_{step:010d}"


def rank_filename(rank: int) -> str:
    return f"rank_{rank:05d}.lzc"
