"""Hugging Face model directories: export a training step (FSDP2 on several
gloo ranks) to what from_pretrained loads, import one back and load it into
an FSDP2 model on any number of ranks (each reading only its rows)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

import lazyckpt
from lazyckpt import cli
from _dist import run_ranks
from _frameworks import require

transformers = require("transformers")

VOCAB, HIDDEN = 256, 64


def tiny_config(layers: int = 2, hidden: int = HIDDEN):
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                    max_position_embeddings=64, attn_implementation="eager")


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def shard(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_and_save(rank, world, run_dir, cfg_dir):
    """Two AdamW steps of a tiny Llama under FSDP2, a checkpoint of the whole
    training state; returns the live model's logits on a fixed batch."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = shard(transformers.LlamaForCausalLM(tiny_config()), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(100 + step)
        x = torch.randint(0, VOCAB, (2, 12))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    with lazyckpt.Checkpointer(run_dir) as ckpt:
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}, step=2).wait()
    if rank == 0:
        model.config.save_pretrained(cfg_dir)
    with torch.no_grad():
        logits = model(batch()).logits
    from torch.distributed.tensor import DTensor
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    dist.barrier()
    return logits, full


def _safetensors(out_dir):
    from safetensors import safe_open
    out = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _file_tensor_bytes(path):
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return sum(f.get_tensor(n).nbytes for n in f.keys())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_an_fsdp2_step_exports_to_a_directory_from_pretrained_loads_bit_exact(tmp_path, world):
    run_dir, cfg_dir, out = tmp_path / "run", tmp_path / "cfg", tmp_path / "hf"
    logits, live = run_ranks(world, _train_and_save, str(run_dir), str(cfg_dir), timeout=300)[0]
    limit = 100_000
    result = lazyckpt.export_hf(str(run_dir), str(out), config=str(cfg_dir), max_shard_size=limit)
    assert result.step == 2 and result.key == ("model",) and result.copied == ["config.json"]
    names = sorted(os.listdir(out))
    assert "config.json" in names and "model.safetensors.index.json" in names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) == len(result.files) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = _safetensors(str(out))
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for name in shards:
        held = _file_tensor_bytes(str(out / name))
        # The limit holds unless one tensor alone is larger (transformers does the same).
        assert held <= limit or sum(1 for f in index["weight_map"].values() if f == name) == 1
    assert set(tensors) == set(live) and all(torch.equal(tensors[k], live[k]) for k in live)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32,
                                                          attn_implementation="eager")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # the ranks' numerics: bit-exact needs the same kernels
    try:
        with torch.no_grad():
            again = loaded(batch()).logits
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(again, logits), (again - logits).abs().max()


def _random_model_state(dtype=torch.float32, hidden=HIDDEN):
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(tiny_config(hidden=hidden))
    return model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}


def test_hf_to_lazyckpt_to_hf_is_byte_identical(tmp_path):
    model, state = _random_model_state(torch.bfloat16)
    src = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(str(src), max_shard_size="200KB")
    assert os.path.isfile(src / "model.safetensors.index.json")
    imported = lazyckpt.import_hf(str(src), str(tmp_path / "w.lzc"))
    assert imported.tensors == len(state) and len(imported.files) > 1
    back = lazyckpt.load(str(tmp_path / "w.lzc"))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    lazyckpt.export_hf(str(tmp_path / "w.lzc"), str(tmp_path / "out"), config=str(src),
                       max_shard_size="200KB")
    a, b = _safetensors(str(src)), _safetensors(str(tmp_path / "out"))
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
        assert a[name].contiguous().view(torch.uint8).equal(b[name].contiguous().view(torch.uint8)), name
    # What from_pretrained reads of the copied config is unchanged.
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())


def test_dtype_cast_prefix_strip_and_a_single_file(tmp_path):
    model, state = _random_model_state()
    wrapped = {f"_orig_mod.{k}": v for k, v in state.items()}
    wrapped["_orig_mod.counter"] = torch.arange(4)                   # integers are never cast
    lazyckpt.save({"module": wrapped, "epoch": 3}, str(tmp_path / "c.lzc"))
    result = lazyckpt.export_hf(str(tmp_path / "c.lzc"), str(tmp_path / "out"), strip="_orig_mod.",
                                prefix="base.", dtype="bf16")
    assert result.key == ("module",) and result.files == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    got = _safetensors(str(tmp_path / "out"))
    assert set(got) == {f"base.{k}" for k in state} | {"base.counter"}
    assert got["base.counter"].dtype == torch.int64
    for k, v in state.items():
        assert got[f"base.{k}"].dtype == torch.bfloat16 and torch.equal(got[f"base.{k}"], v.to(torch.bfloat16))


def test_an_incremental_step_exports_through_its_references(tmp_path):
    model, state = _random_model_state()
    with lazyckpt.Checkpointer(str(tmp_path / "run"), incremental=True) as ckpt:
        ckpt.save({"model": state}, step=1).wait()
        state["lm_head.weight"].add_(1.0)                  # the rest is referred to in step 1
        ckpt.save({"model": state}, step=2).wait()
    manifest = json.loads((tmp_path / "run" / "step_0000000002" / "manifest.json").read_text())
    assert manifest["references"] == [1]
    lazyckpt.export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    got = _safetensors(str(tmp_path / "out"))
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


def _pipeline_stages(rank, world, run_dir):
    """Two pipeline stages: each rank holds other layers of the model (and both the step)."""
    import torch.distributed as dist
    torch.manual_seed(rank)
    layers = {f"layers.{rank * 2 + i}.weight": torch.randn(8, 4) for i in range(2)}
    if rank == 1:
        layers["head.weight"] = torch.randn(3, 4)
    with lazyckpt.Checkpointer(run_dir) as ckpt:
        ckpt.save({"model": layers, "step": 1}, step=1).wait()
    dist.barrier()
    return layers


def test_a_step_of_pipeline_stages_exports_every_rank_s_keys(tmp_path):
    stages = run_ranks(2, _pipeline_stages, str(tmp_path / "run"), timeout=120)
    lazyckpt.export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    got = _safetensors(str(tmp_path / "out"))
    expected = {**stages[0], **stages[1]}
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())


def _leftovers(directory):
    return [n for n in os.listdir(directory) if n.startswith(".")]


def test_bad_input_is_refused_and_leaves_nothing(tmp_path):
    model, state = _random_model_state()
    cfg = tmp_path / "cfg"
    model.config.save_pretrained(str(cfg))
    lazyckpt.save({"model": {**state, "note": "hello"}}, str(tmp_path / "obj.lzc"))
    with pytest.raises(lazyckpt.CheckpointError, match="not tensors.*note"):
        lazyckpt.export_hf(str(tmp_path / "obj.lzc"), str(tmp_path / "o1"))
    lazyckpt.save({"model": {"a.w": torch.ones(2), "module.a.w": torch.zeros(2)}}, str(tmp_path / "dup.lzc"))
    with pytest.raises(lazyckpt.CheckpointError, match="both map to the name 'a.w'"):
        lazyckpt.export_hf(str(tmp_path / "dup.lzc"), str(tmp_path / "o2"), strip="module.")
    lazyckpt.save({"model": state}, str(tmp_path / "ok.lzc"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(lazyckpt.CheckpointError, match="no config.json"):
        lazyckpt.export_hf(str(tmp_path / "ok.lzc"), str(tmp_path / "o3"), config=str(tmp_path / "empty"))
    other = tmp_path / "other"
    tiny_config(layers=3).save_pretrained(str(other))
    with pytest.raises(lazyckpt.StateMismatchError, match="missing .*model.layers.2"):
        lazyckpt.export_hf(str(tmp_path / "ok.lzc"), str(tmp_path / "o4"), config=str(other))
    wide = tmp_path / "wide"
    tiny_config(hidden=128).save_pretrained(str(wide))
    with pytest.raises(lazyckpt.StateMismatchError, match="other shapes"):
        lazyckpt.export_hf(str(tmp_path / "ok.lzc"), str(tmp_path / "o5"), config=str(wide))
    for n in ("o1", "o2", "o3", "o4", "o5"):
        assert not os.path.exists(tmp_path / n)
    assert _leftovers(tmp_path) == []

    # An existing directory is kept unless overwrite; then it is replaced whole.
    (tmp_path / "o6").mkdir()
    (tmp_path / "o6" / "stale.safetensors").write_bytes(b"x")
    with pytest.raises(lazyckpt.CheckpointError, match="already exists"):
        lazyckpt.export_hf(str(tmp_path / "ok.lzc"), str(tmp_path / "o6"))
    lazyckpt.export_hf(str(tmp_path / "ok.lzc"), str(tmp_path / "o6"), config=str(cfg), overwrite=True)
    assert sorted(os.listdir(tmp_path / "o6")) == ["config.json", "model.safetensors"]
    assert _leftovers(tmp_path) == []


def test_an_export_interrupted_by_damage_leaves_nothing_half_visible(tmp_path):
    _, state = _random_model_state()
    lazyckpt.save({"model": state}, str(tmp_path / "c.lzc"))
    info = lazyckpt_entries(tmp_path / "c.lzc")
    last = max(info, key=lambda e: e["offset"])            # a tensor the export reads late
    with open(tmp_path / "c.lzc", "r+b") as f:
        f.seek(last["offset"] + 5)
        byte = f.read(1)
        f.seek(last["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(lazyckpt.CorruptCheckpointError):
        lazyckpt.export_hf(str(tmp_path / "c.lzc"), str(tmp_path / "out"), max_shard_size="100KB")
    assert not os.path.exists(tmp_path / "out") and _leftovers(tmp_path) == []


def lazyckpt_entries(path):
    from lazyckpt.cli.inspect import describe
    return [e for e in describe(str(path))["files"][0]["entries"] if e["kind"] == "data"]


def test_import_refuses_a_directory_whose_index_lies(tmp_path):
    model, _ = _random_model_state()
    src = tmp_path / "src"
    model.save_pretrained(str(src), max_shard_size="200KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    os.remove(src / index["weight_map"][name])
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="listed in model.safetensors.index.json"):
        lazyckpt.import_hf(str(src), str(tmp_path / "w.lzc"))
    assert not os.path.exists(tmp_path / "w.lzc")
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="neither model.safetensors"):
        lazyckpt.import_hf(str(tmp_path), str(tmp_path / "w.lzc"))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _load_into_fsdp(rank, world, lzc, hidden):
    """Load an imported (plain, one-process) checkpoint into an FSDP2 model;
    returns its full state, logits and the bytes this process read."""
    from torch.distributed.tensor import DTensor
    torch.manual_seed(1000 + rank)                     # other values than the checkpoint's
    model = shard(transformers.LlamaForCausalLM(tiny_config(hidden=hidden)), world)
    # One fixed mode: the measure counts the bytes this load reads, whichever mode reads them.
    os.environ["LAZYCKPT_O_DIRECT"] = "false"
    before = _rchar()
    lazyckpt.load(lzc, into=model.state_dict())
    read = _rchar() - before
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(batch()).logits
    return full, logits, read


@pytest.mark.timeout(600)
def test_an_imported_directory_loads_into_fsdp2_on_any_number_of_ranks_reading_only_its_rows(tmp_path):
    hidden = 128
    model, state = _random_model_state(hidden=hidden)
    src = tmp_path / "src"
    model.save_pretrained(str(src))
    # Small checksum blocks: a partial read reads whole blocks, and this model is small.
    lazyckpt.import_hf(str(src), str(tmp_path / "w.lzc"), chunk_bytes=4096)
    with torch.no_grad():
        expected = transformers.LlamaForCausalLM.from_pretrained(
            str(src), attn_implementation="eager")(batch()).logits
    total = sum(v.nbytes for v in state.values())
    before = _rchar()
    lazyckpt.load(str(tmp_path / "w.lzc"))
    whole = _rchar() - before
    assert whole >= total                         # the measure sees the reads
    for world in (3,):                            # uneven shards
        for full, logits, read in run_ranks(world, _load_into_fsdp, str(tmp_path / "w.lzc"), hidden,
                                              timeout=300):
            assert set(full) == set(state) and all(torch.equal(full[k], state[k]) for k in state)
            assert torch.equal(logits, expected)
            if world == 3:                    # a third of the bytes, plus partly read blocks
                assert read < 0.5 * whole, (read, whole)


def test_cli_export_and_import(tmp_path, capsys):
    model, state = _random_model_state()
    model.config.save_pretrained(str(tmp_path / "cfg"))
    with lazyckpt.Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save({"model": state, "step": 5}, step=5).wait()
    code = cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--hf", "--config",
                     str(tmp_path / "cfg"), "--max-shard-size", "150KB", "--no-progress"])
    out = capsys.readouterr()
    assert code == 0 and "(step 5)" in out.out and "copied from" in out.out
    assert len(glob.glob(str(tmp_path / "hf" / "model-*-of-*.safetensors"))) > 1
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "w.lzc"), "--key", "model"]) == 0
    back = lazyckpt.load(str(tmp_path / "w.lzc"))
    assert set(back) == {"model"} and all(torch.equal(back["model"][k], v) for k, v in state.items())
