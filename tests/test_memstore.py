"""``mem://``: an object store in this process's memory (lazyckpt/storage/memstore.py).

Issue 36: a new store is one module. This one registers a client for its
scheme and reuses the object layout S3 uses (commit by manifest and event,
``head.json``, leases, retention, multipart files), so the object-store
paths run here without a server: in the unit layer, in seconds. What S3
itself does differently (its clock, its errors, a real network) stays in the
SeaweedFS tests.
"""

from __future__ import annotations

import io
import uuid

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.storage import memstore, stores
from lazyckpt.storage.base import register_store
from lazyckpt.storage.s3 import InvalidURLError, register_client, store_for


def _url(name: str = "run") -> str:
    return f"mem://b{uuid.uuid4().hex[:10]}/{name}"


def _state(step: int, n: int = 50_000):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(7, dtype=torch.bfloat16) * step, "step": step}


def _same(a, b) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])


def test_a_mem_url_is_an_object_store_and_a_malformed_one_is_refused():
    store = stores.for_path("mem://bucket/run")
    assert isinstance(store, memstore.MemoryStore) and store.is_remote
    for bad in ("mem://b", "mem://bucket//x", "mem://bucket/./x", "MEM://bucket/x"):
        with pytest.raises(InvalidURLError):
            stores.for_path(bad)


def test_a_checkpointer_on_mem_saves_loads_rolls_back_and_retains():
    url = _url()
    with lazyckpt.Checkpointer(url, keep=3) as ckpt:
        for step in range(1, 6):
            ckpt.save(_state(step), step=step).wait()
        assert ckpt.steps() == [3, 4, 5] and ckpt.latest_step() == 5
        assert _same(ckpt.load(), _state(5)) and _same(ckpt.load(step=4), _state(4))
        # A rollback: step 4 again supersedes 4 and 5 (one line of history).
        ckpt.save(_state(40), step=4).wait()
        assert ckpt.steps() == [3, 4]
        assert ckpt.load()["step"] == 40
        with pytest.raises(CheckpointNotFoundError):
            ckpt.load(step=5)
    # Another process's view of the directory: the same line, from the index.
    assert lazyckpt.load(url)["step"] == 40
    with lazyckpt.Checkpointer(url, keep=3) as again:
        assert again.latest_step() == 4 and again.steps() == [3, 4]
        assert _same(again.load(step=3), _state(3))


def test_the_index_names_the_latest_step_and_the_objects_are_the_object_layout():
    url = _url()
    with lazyckpt.Checkpointer(url, keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step, 1000), step=step).wait()
    client, prefix = store_for(url)
    keys = [o["Key"][len(prefix) + 1:] for o in client.list(prefix + "/")]
    assert "head.json" in keys and "latest" in keys
    assert sum(k.endswith("/manifest.json") for k in keys) == 3
    assert sum(k.startswith("history/") for k in keys) == 3
    # The latest step without a listing: a directory whose listing would fail.
    listed = []
    real = client.list

    def counting(p, start_after=None):
        listed.append((p, start_after))
        return real(p, start_after)
    client.list = counting
    try:
        assert lazyckpt.load(url)["step"] == 3
    finally:
        del client.list
    # Only the events after head.json's and the fences: never the whole run prefix.
    assert all(start_after is not None or not p.rstrip("/").endswith(prefix) for p, start_after in listed), listed


def test_a_file_in_foreign_formats_and_the_lazyckpt_format_round_trip_on_mem():
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"w": torch.randn(3, 1000), "n": torch.arange(10)}
    readers = {"lazyckpt": lambda url, raw: lazyckpt.load(url),
               "torch": lambda url, raw: torch.load(io.BytesIO(raw)),          # torch.save's zip
               "safetensors": lambda url, raw: safetensors_torch.load(raw)}
    for fmt, read in readers.items():
        url = _url(f"one.{fmt}")
        lazyckpt.save(state, url, file_format=fmt)
        client, key = store_for(url)
        got = read(url, client.get(key))
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["n"], state["n"]), fmt


def test_persist_to_mem_restores_a_node_that_lost_its_directory(tmp_path):
    url = _url("persist")
    with lazyckpt.Checkpointer(str(tmp_path / "a"), keep=2, persist=url) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step=step).wait()
        ckpt.wait()
    # A new node: an empty local directory, the persistent tier on mem://.
    with lazyckpt.Checkpointer(str(tmp_path / "b"), keep=2, persist=url) as fresh:
        assert _same(fresh.load(), _state(3))
        assert fresh.loaded_from["tier"] == "persistent"


class _FailingClient(memstore.MemoryObjectStore):
    """A mem:// bucket whose uploads of data files fail (a whole small file's PUT
    or a large one's parts): a store going away mid-save."""
    scheme = "memfail://"
    fail = False

    def put(self, key, data):
        if _FailingClient.fail and key.endswith(".lzc"):
            raise CheckpointError(f"{self.url(key)}: injected failure writing the data file")
        return super().put(key, data)

    def put_part(self, key, upload_id, number, data):
        if _FailingClient.fail:
            raise CheckpointError(f"{self.url(key)}: injected failure uploading part {number}")
        return super().put_part(key, upload_id, number, data)


class _FailingStore(memstore.MemoryStore):
    name, scheme = "memfail", "memfail://"


def test_a_save_whose_upload_fails_commits_nothing_and_keeps_the_previous_step():
    from lazyckpt.storage import base
    saved = list(base.URL_STORES)
    register_client("memfail://", _FailingClient)
    register_store(_FailingStore())
    try:
        url = f"memfail://b{uuid.uuid4().hex[:10]}/run"
        for n in (1000, 20 << 20):     # one PUT; a multipart upload (80 MiB: several parts)
            big = {"w": torch.randn(n), "step": 1}
            with lazyckpt.Checkpointer(url, keep=None) as ckpt:
                ckpt.save(big, step=1).wait()
                _FailingClient.fail = True
                with pytest.raises(CheckpointError, match="injected failure"):
                    ckpt.save({**big, "step": 2}, step=2).wait()
                _FailingClient.fail = False
                assert ckpt.steps() == [1] and ckpt.load()["step"] == 1
            client, prefix = store_for(url)
            assert not list(client.uploads(prefix + "/")), "a failed save left an open upload"
    finally:
        _FailingClient.fail = False
        base.URL_STORES[:] = saved


def test_the_client_keeps_the_object_store_semantics_the_layout_relies_on():
    client, _ = store_for(_url())
    for key in ("p/b", "p/a", "p/c/d", "q/x"):
        client.put(key, key.encode())
    assert [o["Key"] for o in client.list("p/")] == ["p/a", "p/b", "p/c/d"]          # ordered by key
    assert [o["Key"] for o in client.list("p/", start_after="p/a")] == ["p/b", "p/c/d"]
    assert [o["Key"] for o in client.list("p/", start_after="a")] == ["p/a", "p/b", "p/c/d"]
    assert client.get("p/c/d", limit=2) == b"p/c" and client.get("nope") is None and client.size("q/x") == 3
    # A multipart upload is invisible until complete, listed as open until then.
    upload = client.start_upload("p/big")
    etags = [client.put_part("p/big", upload, n, memoryview(bytes([n]) * 10)) for n in (1, 2)]
    assert client.size("p/big") is None and [u["Key"] for u in client.uploads("p/")] == ["p/big"]
    client.complete_upload("p/big", upload, etags)
    assert client.get("p/big") == bytes([1]) * 10 + bytes([2]) * 10 and not list(client.uploads("p/"))
    view = memoryview(bytearray(8))
    assert client.read_into("p/big", view, 6) == 8 and bytes(view) == bytes([1]) * 4 + bytes([2]) * 4
    aborted = client.start_upload("p/gone")
    client.abort_upload("p/gone", aborted)
    assert client.size("p/gone") is None and not list(client.uploads("p/"))
    client.delete(["p/a", "p/missing"])
    assert [o["Key"] for o in client.list("p/")] == ["p/b", "p/big", "p/c/d"]
    stamps = [o["LastModified"] for o in client.list("p/")]
    assert all(s <= client.server_time("p") for s in stamps)
    # clear() empties what every client sees, cached ones included (s3.store_for caches them).
    client.copy(client.bucket, "p/b", "p/b2")
    assert client.get("p/b2") == b"p/b"
    memstore.clear()
    assert client.get("p/b") is None and not list(client.list(""))
    client.put("p/n", b"new")
    fresh = memstore.MemoryObjectStore(client.bucket)
    assert fresh.get("p/n") == b"new"
    client.copy(client.bucket, "p/n", "p/n2")
    assert fresh.get("p/n2") == b"new"
