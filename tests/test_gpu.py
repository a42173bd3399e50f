"""The CUDA path (marked ``gpu``: CI has no GPU; run with ``pytest -m gpu`` on a
machine with one). Model, optimizer state and persistent buffers captured
bit-exact while training goes on; several devices; the side stream
synchronized before a chunk is reused after a cancel; pinned host memory."""

from __future__ import annotations

import pytest
import torch

import lazyckpt
from lzc_tools import assert_same, clone_state

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]




def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024),
                               torch.nn.BatchNorm1d(1024)).to(device)


def test_model_optimizer_and_buffers_are_captured_bit_exact(tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    model = _model(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs = {}
    with lazyckpt.Checkpointer(tmp_path, host_cache_bytes=4 << 20, io=lazyckpt.IO(chunk_bytes=1 << 20)) as ckpt:
        ckpt.attach(opt)
        for step in range(6):
            x = torch.randn(64, 1024, device=dev)
            model(x).square().mean().backward()
            opt.step()                            # waits for the previous capture
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            refs[step] = clone_state(state, "cpu")
            ckpt.save(state, step=step)
            model(x)                              # BatchNorm buffers: the forward guard waits
        ckpt.wait()
        for step, ref in refs.items():
            assert_same(clone_state(ckpt.load(step=step, map_location="cuda"), "cpu"), ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_state_on_several_devices(tmp_path):
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    state = {"a": torch.randn(1 << 20, device=a), "b": torch.randn(1 << 20, device=b)}
    expected = clone_state(state, "cpu")
    with lazyckpt.Checkpointer(tmp_path, host_cache_bytes=1 << 20, io=lazyckpt.IO(chunk_bytes=1 << 18)) as ckpt:
        # Work queued on each device's stream before save() must be in the checkpoint.
        with torch.cuda.device(b):
            state["b"].mul_(2.0)
        expected["b"].mul_(2.0)
        ckpt.save(state, step=1)
        ckpt.wait_for_snapshot()
        state["a"].add_(1.0)
        state["b"].add_(1.0)
        ckpt.wait()
        out = ckpt.load(map_location={"cuda:0": "cuda:0", "cuda:1": "cuda:1"})
    assert out["a"].device == a and out["b"].device == b
    assert_same(clone_state(out, "cpu"), expected)


def test_cancel_mid_capture_then_reuse_is_clean(tmp_path):
    dev = torch.device("cuda")
    big = {"w": torch.randn(64 << 20, device=dev)}
    ckpt = lazyckpt.Checkpointer(tmp_path / "a", host_cache_bytes=2 << 20, io=lazyckpt.IO(chunk_bytes=1 << 20))
    ckpt.save(big, step=1)
    ckpt.close(cancel=True)                       # copies in flight are waited for, not abandoned
    torch.cuda.synchronize()
    small = {"w": torch.randn(1 << 20, device=dev)}
    with lazyckpt.Checkpointer(tmp_path / "b", host_cache_bytes=2 << 20, io=lazyckpt.IO(chunk_bytes=1 << 20)) as c2:
        c2.save(small, step=1).wait()
        assert torch.equal(c2.load()["w"], small["w"].cpu())


def test_host_memory_is_pinned(tmp_path):
    from lazyckpt.saving.hostcache import HostCache, StagingArenas
    cache = HostCache(4 << 20, 1 << 20)
    arenas = StagingArenas(8 << 20)
    arena = arenas.acquire(4 << 20, 10)
    try:
        assert cache.pinned and arena.buffer.pinned
        assert cache.tensor.data_ptr() % 4096 == 0 and arena.start % 4096 == 0
    finally:
        cache.close()
        arenas.release(arena)
        arenas.close()


def test_dcp_staging_of_cuda_state(tmp_path):
    import torch.distributed.checkpoint as dcp
    from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
    state = {"w": torch.randn(1 << 20, device="cuda")}
    expected = clone_state(state, "cpu")
    writer = LazyStorageWriter(str(tmp_path), host_cache_bytes=64 << 20)
    try:
        response = dcp.async_save(state, storage_writer=writer, no_dist=True)
        writer.wait_for_staging()
        state["w"].add_(1.0)
        response.upload_completion.result(timeout=120)
    finally:
        writer.close()
    out = {"w": torch.empty(1 << 20)}
    dcp.load(out, storage_reader=LazyStorageReader(str(tmp_path)), no_dist=True)
    assert_same(out, expected)
