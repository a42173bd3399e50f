"""Files the frameworks read, written by lazyckpt's engine: ``file_format="torch"``
(torch.save's zip) and ``"safetensors"``. Every file is read back by the
foreign readers themselves (torch.load with weights_only True/False and mmap,
safetensors.torch.load_file, transformers' from_pretrained, zipfile and
Info-ZIP's unzip -t), bit-exact."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import zipfile
import zlib

import pytest
import torch

import lazyckpt
from lazyckpt.api import _resources
from lazyckpt.saving.commit import FileCommit
from lazyckpt.saving.engine import run_now
from lazyckpt.errors import CheckpointWriteError
from lazyckpt.integrations._async import AsyncFileWriter
from lazyckpt.knobs import resolve
from lazyckpt.saving.torchzip import TorchZipLayout
from lazyckpt.storage.stores import for_path
from test_disk_faults import leftovers, tmpfs  # noqa: F401  (fixture)

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.timeout(120)

#: A 8 KiB cache of 4 KiB chunks: every tensor spans several chunks, and record
#: headers share blocks with the bytes around them.
KNOBS = {"small-cache-direct": dict(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=2, o_direct=True),
         "buffered-1writer": dict(o_direct=False, writer_threads=1),
         "defaults": {}}

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def same(a, b) -> bool:
    """Bit-exact, dtype and shape included (float8 compared as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)) \
        if a.numel() else True


def flat_tensors():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=g)
    out = {"w": torch.randn(300, 257, generator=g),             # spans many 4 KiB chunks
           "bias": torch.randn(33, generator=g).double(),
           "bf16": torch.randn(1000, generator=g).bfloat16(),
           "half": torch.randn(17, generator=g).half(),
           "ids": torch.arange(-5, 1234, dtype=torch.int64),
           "i16": torch.arange(99, dtype=torch.int16),
           "u8": torch.arange(200, dtype=torch.uint8),
           "mask": torch.rand(77, generator=g) > 0.5,
           "empty": torch.empty(0, 5),
           "scalar": torch.tensor(3.5),
           "transposed": torch.randn(9, 31, generator=g).t(),   # non-contiguous
           "rows_a": base[:10], "rows_b": base[20:30]}          # views of one storage that do not overlap
    for dtype in FLOAT8:
        out[str(dtype)] = torch.randn(50, generator=g).to(dtype)
    return out


def nested_state():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(128, 65, generator=g)
    return {"model": collections.OrderedDict(w=w, view=w[3:9, 1:], b=torch.randn(65, generator=g).bfloat16()),
            "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(128, 65, generator=g)}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "name": None}]},
            "epoch": 3, "loss": float("inf"), "tag": "run-1", "flags": [True, False], "none": None,
            "empty": torch.empty(0), "column": w[:, 5], "int_list": torch.arange(10)[::3],
            "f8": [torch.randn(40, generator=g).to(d) for d in FLOAT8],
            "param": torch.nn.Parameter(torch.randn(4, generator=g))}


def assert_same_tree(got, ref, where="<root>"):
    assert type(got) is type(ref), (where, type(got), type(ref))
    if isinstance(ref, torch.Tensor):
        assert same(got, ref), where
        assert got.stride() == ref.stride() and got.requires_grad == ref.requires_grad, where
    elif isinstance(ref, dict):
        assert list(got) == list(ref), where
        for k in ref:
            assert_same_tree(got[k], ref[k], f"{where}/{k}")
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref)):
            assert_same_tree(a, b, f"{where}/{i}")
    else:
        assert got == ref, where


# --------------------------------------------------------------------------- safetensors


@pytest.mark.parametrize("knobs", list(KNOBS.values()), ids=list(KNOBS))
def test_safetensors_file_is_read_bit_exact_by_safetensors(tmp_path, knobs):
    state = flat_tensors()
    path = tmp_path / "model.safetensors"
    size = lazyckpt.save(state, path, file_format="safetensors", metadata={"format": "pt", "step": "9"}, **knobs)
    assert size == os.path.getsize(path)
    got = safetensors_torch.load_file(str(path))
    assert sorted(got) == sorted(state)
    for k, v in state.items():
        assert same(got[k], v), k
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "9"}
    # The data begins page-aligned: the header is padded with spaces.
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert (8 + header_len) % 4096 == 0


def test_safetensors_refuses_what_it_cannot_hold_naming_the_key(tmp_path):
    path = str(tmp_path / "x.safetensors")
    w = torch.randn(4, 4)
    cases = [({"a": {"nested": w}}, TypeError, "'a' is a dict, not a tensor"),
             ({"a": w, "n": 3}, TypeError, "'n' is a int"),
             ([w], TypeError, "flat dict of tensors"),
             ({1: w}, TypeError, "key 1"),
             ({"c": torch.zeros(2, dtype=torch.complex128)}, TypeError, "'c' has dtype torch.complex128"),
             ({"s": w.to_sparse()}, TypeError, "dense tensors only"),
             ({"embed": w, "lm_head": w}, ValueError, "'embed' and 'lm_head'"),            # tied weights
             ({"all": w, "part": w[1:3]}, ValueError, "share memory")]
    for state, error, words in cases:
        with pytest.raises(error, match=words.replace("(", r"\(")):
            lazyckpt.save(state, path, file_format="safetensors")
    with pytest.raises(TypeError, match="metadata must map str to str"):
        lazyckpt.save({"w": w}, path, file_format="safetensors", metadata={"step": 3})
    with pytest.raises(ValueError, match="file_format='pickle'"):
        lazyckpt.save({"w": w}, path, file_format="pickle")
    assert not os.path.exists(path) and not leftovers(tmp_path)


def test_safetensors_file_loads_with_transformers_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    config.save_pretrained(tmp_path)
    state = model.state_dict()
    del state["lm_head.weight"]             # tied to the embedding: save_pretrained drops it too
    lazyckpt.save(state, tmp_path / "model.safetensors", file_format="safetensors", metadata={"format": "pt"})
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


# --------------------------------------------------------------------------- torch zip


def unzip_test(path) -> None:
    if shutil.which("unzip"):
        r = subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "No errors detected" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("knobs", list(KNOBS.values()), ids=list(KNOBS))
@pytest.mark.parametrize("crc", ["installed", "zlib"])
def test_torch_file_is_read_bit_exact_by_torch_load(tmp_path, knobs, crc, monkeypatch):
    if crc == "zlib":               # the fallback where isal is not installed
        monkeypatch.setattr(TorchZipLayout, "span_checksum", staticmethod(zlib.crc32))
    state = nested_state()
    path = tmp_path / "last.ckpt"
    size = lazyckpt.save(state, path, file_format="torch", **knobs)
    assert size == os.path.getsize(path)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None                  # every record's CRC-32 checks
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    unzip_test(path)
    ref_path = tmp_path / "ref.pt"
    torch.save(state, ref_path)
    for kwargs in (dict(weights_only=True), dict(weights_only=False), dict(weights_only=True, mmap=True)):
        got, ref = torch.load(path, **kwargs), torch.load(ref_path, **kwargs)
        assert_same_tree(got, ref)
        assert_same_tree(got, state)
        # Storage sharing as torch.save gives it: the views share the weight's storage.
        w = got["model"]["w"].untyped_storage().data_ptr()
        assert got["model"]["view"].untyped_storage().data_ptr() == w
        assert got["column"].untyped_storage().data_ptr() == w


def test_torch_file_takes_what_torch_save_takes(tmp_path):
    """Objects weights_only refuses are pickled as torch.save pickles them:
    weights_only=False reads them, weights_only=True refuses them alike."""
    state = {"w": torch.ones(3), "counter": collections.Counter("aab"), "fn": os.path.join}
    path, ref_path = tmp_path / "a.pt", tmp_path / "ref.pt"
    lazyckpt.save(state, path, file_format="torch")
    torch.save(state, ref_path)
    got = torch.load(path, weights_only=False)
    assert got["counter"] == state["counter"] and got["fn"] is os.path.join and torch.equal(got["w"], state["w"])
    for p in (path, ref_path):
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(p, weights_only=True)
    with pytest.raises(ValueError, match="no place for metadata"):
        lazyckpt.save(state, path, file_format="torch", metadata={"a": 1})


def test_torch_zip64_fields_are_read(tmp_path):
    """Records over 4 GiB need zip64 fields; written here whatever the size
    (forced) so that the readers' handling of them is tested in CI."""
    state = {"w": torch.randn(70_000), "small": [torch.arange(3)], "empty": torch.empty(0)}
    options = resolve(None, host_cache_bytes=16384, chunk_bytes=8192)
    path = tmp_path / "z64.pt"
    run_now(FileCommit(for_path(str(path)), str(path), options.lease_heartbeat_s), [TorchZipLayout(state, force_zip64=True).part()],
            _resources(options), options, name=str(path))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None and all(i.extract_version == 45 for i in z.infolist())
    unzip_test(path)
    for mmap in (False, True):
        assert_same_tree(torch.load(path, weights_only=True, mmap=mmap), state)


# --------------------------------------------------------------------------- the async writer


@pytest.mark.parametrize("file_format", ["torch", "safetensors"])
def test_async_save_holds_the_values_of_save_time(tmp_path, file_format):
    """A slow capture (8 KiB cache, one writer); the optimizer changes every
    weight in place right after save() returns: its pre-step hook waits for the
    capture, so each file holds the values of its save()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    writer = AsyncFileWriter(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=1)
    expected, paths = [], []
    try:
        for i in range(3):
            if file_format == "torch":
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "i": i}
            else:
                state = model.state_dict()
            expected.append(torch.load(_torch_copy(state, tmp_path / f"ref{i}.pt"), weights_only=True))
            paths.append(tmp_path / f"s{i}.{'pt' if file_format == 'torch' else 'safetensors'}")
            writer.save(state, str(paths[-1]), file_format=file_format)
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()                          # in place, right after save()
            opt.zero_grad()
        writer.wait()
    finally:
        writer.close()
    for path, ref in zip(paths, expected):
        if file_format == "torch":
            assert_same_tree(torch.load(path, weights_only=True), ref)
        else:
            got = safetensors_torch.load_file(str(path))
            assert sorted(got) == sorted(ref) and all(same(got[k], ref[k]) for k in ref)
    assert not torch.equal(expected[0]["0.weight"] if file_format == "safetensors"
                           else expected[0]["model"]["0.weight"], model.state_dict()["0.weight"])


def _torch_copy(state, path):
    torch.save(state, path)
    return path


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize("file_format", ["torch", "safetensors"])
@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_full_disk_keeps_the_previous_file(tmpfs, file_format, how):  # noqa: F811
    """ENOSPC mid-write on a real 8 MiB tmpfs: the error is raised, the
    previous file is intact and read by the foreign reader, no temporary is
    left."""
    path = str(tmpfs / ("model.safetensors" if file_format == "safetensors" else "last.ckpt"))
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    big = {"w": torch.randn(3_000_000)}                       # 12 MB: does not fit
    lazyckpt.save(small, path, file_format=file_format)
    if how == "sync":
        with pytest.raises(CheckpointWriteError, match="No space left on device"):
            lazyckpt.save(big, path, file_format=file_format, host_cache_bytes=1 << 20)
    else:
        writer = AsyncFileWriter(host_cache_bytes=1 << 20)
        try:
            handle = writer.save(big, path, file_format=file_format)
            with pytest.raises(CheckpointWriteError, match="No space left on device"):
                handle.wait(timeout=60)
        finally:
            writer.close(raise_errors=False)
    got = torch.load(path, weights_only=True) if file_format == "torch" else safetensors_torch.load_file(path)
    assert torch.equal(got["w"], small["w"])
    assert not leftovers(tmpfs)


# --------------------------------------------------------------------------- lazyckpt.load


@pytest.mark.parametrize("file_format,reader", [("torch", "torch.load"), ("safetensors", "safetensors.torch.load_file")])
def test_lazyckpt_load_refuses_foreign_files_naming_their_reader(tmp_path, file_format, reader):
    """lazyckpt.load does not read these files (their own loaders do); it says which loader does."""
    path = tmp_path / "x.bin"
    lazyckpt.save({"w": torch.ones(3)}, path, file_format=file_format)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match=f"read it with {reader}"):
        lazyckpt.load(path)
