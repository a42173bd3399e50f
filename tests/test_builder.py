"""The builder that assembles a Checkpointer (issue 36: ``lazyckpt/builder.py``),
without a Checkpointer: what it is made of for a local directory and for one
with a persistent tier on ``mem://``, and the combinations refused before
anything is created."""

from __future__ import annotations

import os
import uuid

import pytest

from lazyckpt.builder import assemble
from lazyckpt.storage.stores import LOCAL, for_path
from lazyckpt.tiers.persistent import PersistentTier


def _close(parts) -> None:
    if parts.persistent is not None:
        parts.persistent.close()
    parts.engine.close()


def test_a_local_directory_is_one_store_lookup_and_one_tier(tmp_path):
    parts = assemble(str(tmp_path / "run"), keep_last=2, chunk_bytes=1 << 20)
    try:
        assert parts.store is LOCAL and not parts.on_object_store
        assert parts.directory == os.path.abspath(tmp_path / "run") and os.path.isdir(parts.directory)
        assert parts.layout.path == parts.directory
        assert parts.keep_last == 2 and parts.options.chunk_bytes == 1 << 20
        assert parts.persistent is None and parts.replicas is None and parts.job is None
        assert parts.incremental is None and parts.auto is None          # one rank: no "auto" round
        assert parts.replicated == [] and not parts.dist.distributed
        assert parts.history.record is not None and parts.history.remote is None
    finally:
        _close(parts)


def test_a_persistent_tier_gets_its_store_and_joins_the_line(tmp_path):
    url = f"mem://b{uuid.uuid4().hex[:10]}/persist"
    parts = assemble(str(tmp_path / "run"), persist_to=url, persist_keep_last=3, replicated="auto")
    try:
        assert isinstance(parts.persistent, PersistentTier)
        assert parts.persistent.store is for_path(url) and parts.persistent.store.is_remote
        assert parts.history.remote is parts.persistent.dir      # the line spans both tiers
        assert parts.replicated == "auto"
    finally:
        _close(parts)


@pytest.mark.parametrize("kwargs,match", [
    (dict(keep_last=0), "keep_last must be an int >= 1"),
    (dict(persist_to="/elsewhere"), "persist_to must be an s3:// URL"),
    (dict(storage_options={"region": "x"}), "storage_options=.* does not apply"),
    (dict(incremental=True, persist_to="mem://bkt/x"), "not supported on object stores"),
    (dict(replicated="first"), "replicated must be a list"),
    (dict(node_size=2), "node_size=2 does not apply"),
])
def test_what_does_not_apply_is_refused_before_anything_is_created(tmp_path, kwargs, match):
    target = tmp_path / "never"
    with pytest.raises(ValueError, match=match):
        assemble(str(target), **kwargs)
    assert not target.exists()
