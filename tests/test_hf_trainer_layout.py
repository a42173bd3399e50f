"""The lazyckpt Trainer writes ``checkpoint-<step>/`` in the plain
``transformers.Trainer``'s own layout (issue 24): what transformers' own
Trainer checkpoint tests check (tests/trainer/test_trainer_checkpointing.py:
the files of a checkpoint, resume reproducing the run with dropout and a
shuffled sampler, sharded checkpoints, frozen parameters, tied weights,
rotation, best model, non-PreTrainedModel models, tokenizer files), each run
with the plain Trainer and with the lazyckpt Trainer; and the two reading each
other's checkpoints bit for bit. Tiny models built from configs, offline."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _frameworks import require  # noqa: E402
from lzc_tools import assert_same_model_and_optim  # noqa: E402

transformers = require("transformers")
require("accelerate")
safetensors_torch = require("safetensors.torch")

from lazyckpt.integrations import huggingface as lzhf  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEQ, N, VOCAB = 16, 48, 128


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=N):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                      attention_dropout=0.1)        # dropout: the RNG state matters
    return transformers.LlamaForCausalLM(config)


def _gpt2(seed=0):
    """Tied input and output embeddings (``lm_head.weight`` is ``wte.weight``)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
    return transformers.GPT2LMHeadModel(config)


class _Regression(torch.nn.Module):
    """Not a PreTrainedModel: Trainer._save writes its bare state dict."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.drop(self.emb(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return {"loss": loss, "logits": logits}


def _snapshot(model, optimizer):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {i: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in optimizer.state_dict()["state"].items()})


class _Record(transformers.TrainerCallback):
    """Weights and optimizer state after every step, at the start of training,
    and the batches each step saw (the order a resume must repeat)."""

    def __init__(self):
        self.at = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.at["begin"] = _snapshot(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.at[state.global_step] = _snapshot(model, optimizer)


def _recording(cls):
    class Recording(cls):
        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            self.losses.append((self.state.global_step + 1, loss.item(), inputs["input_ids"][:, 0].tolist()))
            return loss
    return Recording


PLAIN = _recording(transformers.Trainer)
LAZY = _recording(lzhf.LazyCheckpointTrainer)
TRAINERS = {"plain": PLAIN, "lazyckpt": LAZY}


def _train(kind, out, model, resume=None, callbacks=(), trainer_kw=None, **kw):
    args = dict(output_dir=str(out), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=4,
                logging_steps=1, report_to=[], dataloader_num_workers=0, seed=42, use_cpu=True,
                disable_tqdm=True)
    args.update(kw)
    extra = dict(trainer_kw or {})
    if kind == "lazyckpt":
        extra.setdefault("lazyckpt_options", {"host_cache_bytes": 4 << 20})
    record = _Record()
    trainer = TRAINERS[kind](model=model, args=transformers.TrainingArguments(**args), train_dataset=_Data(),
                             callbacks=[record, *callbacks], **extra)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


# The plain Trainer's runs of the stand-alone tests below check transformers' own
# behaviour, which the lazyckpt runs assert too: kept out of CI (slow) to keep it short.
BOTH = [pytest.param("plain", marks=pytest.mark.slow), "lazyckpt"]


def _files(path):
    return sorted(os.listdir(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted 8-step run per Trainer (checkpoints at 4 and 8), shared:
    {kind: (trainer, record, output directory)}. Tests that change a checkpoint copy it."""
    out = {}
    for kind in TRAINERS:
        path = tmp_path_factory.mktemp(f"full-{kind}")
        trainer, rec = _train(kind, path, _llama(0))
        out[kind] = (trainer, rec, path)
    return out


EXPECTED = ["config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "rng_state.pth",
            "scheduler.pt", "trainer_state.json", "training_args.bin"]


@pytest.mark.parametrize("kind", ["plain", "lazyckpt"])
def test_checkpoint_holds_the_plain_trainers_files_and_from_pretrained_loads_them(runs, kind):
    trainer, rec, out = runs[kind]
    assert _files(out) == ["checkpoint-4", "checkpoint-8"]
    for step in (4, 8):
        ckpt = out / f"checkpoint-{step}"
        assert _files(ckpt) == EXPECTED
        config = json.loads((ckpt / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
        # Exactly the weights after that step's optimizer step, although training went on.
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt))
        assert_same_model_and_optim((loaded.state_dict(), {}), (rec.at[step][0], {}))
        optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
        assert_same_model_and_optim(({}, optim["state"]), ({}, rec.at[step][1]))
        state = transformers.TrainerState.load_from_json(str(ckpt / "trainer_state.json"))
        assert state.global_step == step
        assert torch.load(ckpt / "training_args.bin", weights_only=False).save_steps == 4
        assert set(torch.load(ckpt / "rng_state.pth", weights_only=False)) >= {"python", "numpy", "cpu"}
    assert transformers.trainer_utils.get_last_checkpoint(str(out)).endswith("checkpoint-8")


def test_the_same_files_as_the_plain_trainer_with_the_same_values(runs):
    """File for file: equal tensors, equal small files (training_args.bin holds
    the output directory, so compare it loaded)."""
    for step in (4, 8):
        a, b = (runs[kind][2] / f"checkpoint-{step}" for kind in ("plain", "lazyckpt"))
        assert _files(a) == _files(b)
        for name in ("config.json", "generation_config.json", "scheduler.pt", "rng_state.pth",
                     "trainer_state.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
        wa, wb = (safetensors_torch.load_file(p / "model.safetensors") for p in (a, b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        oa, ob = (torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b))
        assert oa["param_groups"] == ob["param_groups"]
        assert_same_model_and_optim(({}, oa["state"]), ({}, ob["state"]))
        ta, tb = (torch.load(p / "training_args.bin", weights_only=False) for p in (a, b))
        assert dataclasses.replace(ta, output_dir="x").to_dict() == dataclasses.replace(tb, output_dir="x").to_dict()


@pytest.mark.parametrize("writer,reader", [("plain", "plain"), ("plain", "lazyckpt"), ("lazyckpt", "plain"),
                                           ("lazyckpt", "lazyckpt")])
def test_resume_reproduces_the_uninterrupted_run_whoever_wrote_the_checkpoint(runs, tmp_path, writer, reader,
                                                                              no_leaked_threads):
    """Mid-epoch resume with dropout and a shuffled sampler: the same batches in
    the same order, the same losses bit for bit, the same final state."""
    full, rec_full, out = runs[writer]
    resumed, rec = _train(reader, tmp_path / "resumed", _llama(1), resume=str(out / "checkpoint-4"))
    assert_same_model_and_optim(rec.at["begin"], rec_full.at[4])                   # weights + AdamW moments
    assert resumed.losses == full.losses[4:]                        # batches, order and losses
    assert_same_model_and_optim(_snapshot(resumed.model, resumed.optimizer), _snapshot(full.model, full.optimizer))
    assert resumed.lr_scheduler.state_dict()["_last_lr"] == full.lr_scheduler.state_dict()["_last_lr"]
    assert resumed.state.global_step == 8
    assert _files(tmp_path / "resumed" / "checkpoint-8") == EXPECTED


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_sharded_like_save_pretrained_and_the_plain_trainer_resumes_it(runs, tmp_path):
    """lazyckpt_max_shard_size shards as save_pretrained(max_shard_size=) does:
    the same file names and weight map; from_pretrained and the plain Trainer read it."""
    full, rec_full, _ = runs["lazyckpt"]
    _, rec_sharded = _train("lazyckpt", tmp_path / "run", _llama(0), max_steps=8,
                            trainer_kw={"lazyckpt_max_shard_size": "40KB"})
    ckpt = tmp_path / "run" / "checkpoint-4"
    full.model.save_pretrained(tmp_path / "reference", max_shard_size="40KB")
    shards = sorted(n for n in _files(tmp_path / "reference") if n.endswith(".safetensors"))
    assert len(shards) > 1
    assert sorted(n for n in _files(ckpt) if n.endswith(".safetensors")) == shards
    assert "model.safetensors" not in _files(ckpt)
    assert _index(ckpt) == _index(tmp_path / "reference")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert_same_model_and_optim((loaded.state_dict(), {}), (rec_full.at[4][0], {}))
    resumed, rec = _train("plain", tmp_path / "resumed", _llama(1), resume=str(ckpt))
    assert_same_model_and_optim(rec.at["begin"], rec_full.at[4])
    assert resumed.losses == full.losses[4:]


@pytest.mark.parametrize("kind", BOTH)
def test_sharded_checkpoint_from_save_pretrained_resumes(runs, tmp_path, kind):
    """transformers' test_resume_training_with_shard_checkpoint: a checkpoint
    whose weights were re-saved sharded still resumes bit for bit."""
    full, rec_full, out = runs[kind]
    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(out / "checkpoint-4", ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt))
    os.remove(ckpt / "model.safetensors")
    model.save_pretrained(ckpt, max_shard_size="40KB")
    assert (ckpt / "model.safetensors.index.json").is_file()
    resumed, rec = _train(kind, tmp_path / "resumed", _llama(1), resume=str(ckpt))
    assert_same_model_and_optim(rec.at["begin"], rec_full.at[4])
    assert resumed.losses == full.losses[4:]


@pytest.mark.parametrize("kind", BOTH)
def test_tied_weights_and_frozen_parameters(tmp_path, kind):
    """GPT-2 ties lm_head to the input embedding: the file holds it once, as
    save_pretrained writes it; frozen parameters stay frozen and exact on resume."""
    def frozen_gpt2(seed):
        model = _gpt2(seed)
        model.transformer.h[0].requires_grad_(False)
        return model
    full, rec_full = _train(kind, tmp_path / "full", frozen_gpt2(0))
    ckpt = tmp_path / "full" / "checkpoint-4"
    full.model.save_pretrained(tmp_path / "reference")
    keys = set(safetensors_torch.load_file(ckpt / "model.safetensors"))
    assert keys == set(safetensors_torch.load_file(tmp_path / "reference" / "model.safetensors"))
    assert "lm_head.weight" not in keys
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert_same_model_and_optim((loaded.state_dict(), {}), (rec_full.at[4][0], {}))
    resumed, rec = _train(kind, tmp_path / "resumed", frozen_gpt2(1), resume=str(ckpt))
    assert not any(p.requires_grad for p in resumed.model.transformer.h[0].parameters())
    assert_same_model_and_optim(rec.at["begin"], rec_full.at[4])
    assert resumed.losses == full.losses[4:]


@pytest.mark.parametrize("kind", BOTH)
def test_a_model_that_is_not_a_pretrained_model(tmp_path, kind):
    """Trainer._save's other branch: model.safetensors of the bare state dict, no config."""
    full, rec_full = _train(kind, tmp_path / "full", _Regression(0))
    ckpt = tmp_path / "full" / "checkpoint-4"
    assert _files(ckpt) == ["model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
                            "trainer_state.json", "training_args.bin"]
    assert_same_model_and_optim((safetensors_torch.load_file(ckpt / "model.safetensors"), {}), (rec_full.at[4][0], {}))
    resumed, rec = _train(kind, tmp_path / "resumed", _Regression(1), resume=str(ckpt))
    assert_same_model_and_optim(rec.at["begin"], rec_full.at[4])
    assert resumed.losses == full.losses[4:]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.mark.parametrize("kind", BOTH)
def test_tokenizer_files_are_saved_with_the_checkpoint(tmp_path, kind):
    tokenizer = _tokenizer()
    tokenizer.add_tokens(["<NEW_TOKEN1>", "<NEW_TOKEN2>"])
    _train(kind, tmp_path, _llama(), max_steps=4, trainer_kw={"processing_class": tokenizer,
                                                           "data_collator": transformers.default_data_collator})
    ckpt = tmp_path / "checkpoint-4"
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(_files(ckpt))
    loaded = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    assert len(loaded) == len(tokenizer) and loaded("t3 t5")["input_ids"] == tokenizer("t3 t5")["input_ids"]


@pytest.mark.parametrize("kind", BOTH)
def test_rotation_and_best_model_at_end(tmp_path, kind):
    """save_total_limit keeps the newest checkpoints and the best one;
    load_best_model_at_end loads the best checkpoint's weights."""
    class Eval(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return _Data()[i]

    args = dict(eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=2,
                load_best_model_at_end=True, metric_for_best_model="loss")
    trainer, rec = _train(kind, tmp_path, _llama(), trainer_kw={"eval_dataset": Eval()}, **args)
    best = trainer.state.best_model_checkpoint
    kept = _files(tmp_path)
    assert len(kept) == 2 and os.path.basename(best) in kept and "checkpoint-8" in kept
    best_step = int(best.rsplit("-", 1)[1])
    assert_same_model_and_optim((trainer.model.state_dict(), {}), (rec.at[best_step][0], {}))
    for name in kept:
        assert _files(tmp_path / name) == EXPECTED


def test_save_only_model_writes_no_optimizer(tmp_path):
    _train("lazyckpt", tmp_path, _llama(), max_steps=4, save_only_model=True)
    assert _files(tmp_path / "checkpoint-4") == ["config.json", "generation_config.json", "model.safetensors",
                                                 "trainer_state.json", "training_args.bin"]


def test_lazyckpt_format_stays_available_and_a_bad_format_is_refused(runs, tmp_path):
    trainer, rec = _train("lazyckpt", tmp_path / "lzc", _llama(), max_steps=8,
                          trainer_kw={"lazyckpt_checkpoint_format": "lazyckpt"})
    ckpt = tmp_path / "lzc" / "checkpoint-4"
    assert _files(tmp_path / "lzc") == ["checkpoint-4", "checkpoint-8"]
    assert _files(ckpt) == ["config.json", "lazyckpt.lzc", "trainer_state.json"]
    assert_same_model_and_optim((lzhf.load_model_state(str(ckpt)), {}), (rec.at[4][0], {}))
    # A lazyckpt-format checkpoint resumes in a Trainer that writes the HF layout.
    full, rec_full, _ = runs["lazyckpt"]
    resumed, rec = _train("lazyckpt", tmp_path / "resumed", _llama(1), resume=str(ckpt))
    assert_same_model_and_optim(rec.at["begin"], rec_full.at[4])
    assert resumed.losses == full.losses[4:]
    assert _files(tmp_path / "resumed" / "checkpoint-8") == EXPECTED
    with pytest.raises(ValueError, match="lazyckpt_checkpoint_format"):
        lzhf.LazyCheckpointTrainer(model=_llama(), args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "bad"), report_to=[], use_cpu=True), lazyckpt_checkpoint_format="safetensors")



def test_load_model_state_and_load_checkpoint_state_read_the_hf_layout(runs, tmp_path):
    """The default layout is the plain Trainer's files: the public readers read them
    (model.safetensors, or its shards), as they read the lazyckpt layout."""
    _, rec, out = runs["lazyckpt"]
    ckpt = out / "checkpoint-4"
    assert_same_model_and_optim((lzhf.load_model_state(str(ckpt)), {}), (rec.at[4][0], {}))
    state = lzhf.load_checkpoint_state(str(ckpt))
    assert sorted(state) == ["model", "optimizer", "rng", "scheduler", "trainer_state"]   # no scaler on CPU
    assert_same_model_and_optim((state["model"], state["optimizer"]["state"]), rec.at[4])
    assert state["scheduler"] == torch.load(ckpt / "scheduler.pt", weights_only=True)
    assert list(state["rng"]) == [0] and set(state["rng"][0]) >= {"python", "numpy", "cpu"}
    assert json.loads(state["trainer_state"])["global_step"] == 4
    # keys= reads only those; a key the checkpoint lacks is refused, as for lazyckpt.lzc.
    assert list(lzhf.load_checkpoint_state(str(ckpt), keys=["scheduler"])) == ["scheduler"]
    rng = lzhf.load_checkpoint_state(str(ckpt), keys=[("rng", 0)])["rng"][0]
    assert torch.equal(rng["cpu"], state["rng"][0]["cpu"])
    with pytest.raises(KeyError, match="scaler"):
        lzhf.load_checkpoint_state(str(ckpt), keys=["scaler"])
    # Sharded, as save_pretrained(max_shard_size=) and lazyckpt_max_shard_size write it.
    sharded = tmp_path / "checkpoint-4"
    shutil.copytree(ckpt, sharded)
    os.remove(sharded / "model.safetensors")
    transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert_same_model_and_optim((lzhf.load_model_state(str(sharded)), {}), (rec.at[4][0], {}))
