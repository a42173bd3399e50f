"""The builder that assembles a Checkpointer (issue 36: ``lazyckpt/builder.py``),
without a Checkpointer: what it is made of for a local directory and for one
with a persistent tier on ``mem://``, and the combinations refused before
anything is created."""

from __future__ import annotations

import os
import uuid

import pytest

from lazyckpt.builder import assemble
from lazyckpt.knobs import resolve
from lazyckpt.options import IO, Distributed, Groups, Incremental, Persist, Replicas
from lazyckpt.retention import KeepLast
from lazyckpt.storage.stores import LOCAL, for_path
from lazyckpt.tiers.persistent import PersistentTier


def _close(parts) -> None:
    if parts.persistent is not None:
        parts.persistent.close()
    parts.engine.close()


def test_a_local_directory_is_one_store_lookup_and_one_tier(tmp_path):
    parts = assemble(str(tmp_path / "run"), Groups(keep=KeepLast(2), io=IO(chunk_bytes="1M")))
    try:
        assert parts.store is LOCAL and not parts.on_object_store
        assert parts.directory == os.path.abspath(tmp_path / "run") and os.path.isdir(parts.directory)
        assert parts.layout.path == parts.directory
        assert parts.keep == KeepLast(2) and parts.options.chunk_bytes == 1 << 20
        assert parts.persistent is None and parts.replicas is None and parts.job is None
        assert parts.incremental is None and parts.auto is None          # one rank: no "auto" round
        assert parts.replicated == [] and not parts.dist.distributed
        assert parts.line.record is not None and parts.line.remote is None
    finally:
        _close(parts)


def test_no_groups_is_every_default(tmp_path):
    parts = assemble(tmp_path / "run")
    try:
        assert parts.keep is None and parts.options == resolve()
    finally:
        _close(parts)


def test_a_persistent_tier_gets_its_store_and_joins_the_line(tmp_path):
    url = f"mem://b{uuid.uuid4().hex[:10]}/persist"
    parts = assemble(str(tmp_path / "run"), Groups(persist=Persist(url, keep=3, bandwidth="1MB"),
                                                   distributed=Distributed(identical_keys="auto")))
    try:
        assert isinstance(parts.persistent, PersistentTier)
        assert parts.persistent.store is for_path(url) and parts.persistent.store.is_remote
        assert parts.persistent.keep == KeepLast(3) and parts.options.persist_bandwidth == 10 ** 6
        assert parts.line.remote is parts.persistent.dir      # the line spans both tiers
        assert parts.replicated == "auto"
    finally:
        _close(parts)


def test_the_persistent_tier_has_its_own_storage_options_else_the_directorys(tmp_path):
    url = f"mem://b{uuid.uuid4().hex[:10]}/persist"
    parts = assemble(tmp_path / "a", Groups(persist=Persist(url, storage_options={"region": "p"}),
                                            io=IO(storage_options={"region": "d"})))
    try:
        assert parts.options.storage_options == (("region", "d"),)
        assert parts.persistent.options.storage_options == (("region", "p"),)
    finally:
        _close(parts)
    parts = assemble(tmp_path / "b", Groups(persist=Persist(url), io=IO(storage_options={"region": "d"})))
    try:
        assert parts.persistent.options.storage_options == (("region", "d"),)
    finally:
        _close(parts)


@pytest.mark.parametrize("groups,match", [
    (lambda: Groups(incremental=Incremental(), persist=Persist("mem://bkt/x")), "not supported on object stores"),
    (lambda: Groups(incremental=Incremental()), None),        # (the s3:// directory below)
    (lambda: Groups(replicas=Replicas(1), distributed=Distributed(process_group=False)),
     "replicas= needs a node-local directory and the default process group"),
])
def test_the_real_conflicts_are_refused_before_anything_is_created(tmp_path, groups, match):
    target = tmp_path / "never"
    if match is None:           # incremental on an object store directory
        with pytest.raises(ValueError, match="not supported on object stores"):
            assemble("mem://bkt/never", groups())
        return
    with pytest.raises(ValueError, match=match):
        assemble(str(target), groups())
    assert not target.exists()


def test_a_persistent_tier_under_an_object_store_directory_is_refused():
    with pytest.raises(ValueError, match="already on an object store"):
        assemble("mem://bkt/run", Groups(persist=Persist("mem://bkt/other")))
