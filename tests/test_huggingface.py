"""Hugging Face Trainer integration: a tiny Llama trained on CPU with
LazyCheckpointMixin, checkpoints written asynchronously through lazyckpt,
resume with train(resume_from_checkpoint=...) reproducing the uninterrupted
run's losses and final state bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from lzc_tools import assert_same_model_and_optim

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _frameworks import require  # noqa: E402

transformers = require("transformers")
require("accelerate")

import lazyckpt  # noqa: E402
from lazyckpt.integrations import huggingface as lzhf  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEQ, N = 16, 48


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (N, SEQ), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=128, max_position_embeddings=SEQ,
                                      attention_dropout=0.1)       # dropout: the RNG state matters
    return transformers.LlamaForCausalLM(config)


def _snapshot(model, optimizer):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {i: {k: v.detach().clone() for k, v in s.items()}
             for i, s in optimizer.state_dict()["state"].items()})


_assert_same = assert_same_model_and_optim


class _Record(transformers.TrainerCallback):
    def __init__(self):
        self.at = {}

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        self.at[state.global_step] = _snapshot(model, optimizer)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.at["begin"] = _snapshot(model, optimizer)


class _Trainer(lzhf.LazyCheckpointMixin, transformers.Trainer):
    """Records every training step's exact loss."""

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.losses.append((self.state.global_step + 1, loss.item()))
        return loss


def _train(out, seed, resume=None, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", logging_steps=1,
        report_to=[], dataloader_num_workers=0, seed=42, use_cpu=True, disable_tqdm=True, **kw)
    record = _Record()
    trainer = _Trainer(model=_model(seed), args=args, train_dataset=_Data(), callbacks=[record],
                       lazyckpt_options={"host_cache_bytes": 1 << 20},
                       lazyckpt_checkpoint_format="lazyckpt")     # the HF layout: test_hf_trainer_layout.py
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


def test_trainer_checkpoint_and_resume_reproduce_the_uninterrupted_run(tmp_path, no_leaked_threads):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full, rec_full = _train(full_dir, seed=0, save_steps=4)
    assert [s for s, _ in full.losses] == list(range(1, 9))
    # train() returned: both checkpoints are committed; nothing half-written is left.
    assert sorted(os.listdir(full_dir)) == ["checkpoint-4", "checkpoint-8"]
    assert sorted(os.listdir(full_dir / "checkpoint-4")) == ["config.json", "lazyckpt.lzc", "trainer_state.json"]
    assert transformers.trainer_utils.get_last_checkpoint(str(full_dir)).endswith("checkpoint-8")

    # The file holds the state right after step 4's optimizer step, although
    # training went on while it was written; nothing in it needs pickle.
    saved = lazyckpt.load(str(full_dir / "checkpoint-4" / "lazyckpt.lzc"))
    assert saved["global_step"] == 4 and set(saved) >= {"model", "optimizer", "scheduler", "rng",
                                                        "trainer_state"}
    _assert_same((saved["model"], saved["optimizer"]["state"]), rec_full.at[4])
    _assert_same((lzhf.load_model_state(str(full_dir / "checkpoint-8")), {}), (rec_full.at[8][0], {}))

    # Resume from step 4 with a differently initialized model, in a new Trainer.
    resumed, rec = _train(resumed_dir, seed=1, resume=str(full_dir / "checkpoint-4"),
                          save_steps=2, save_total_limit=1)
    _assert_same(rec.at["begin"], rec_full.at[4])                        # weights + AdamW moments
    assert resumed.losses == full.losses[4:]                             # steps 5..8, bit for bit
    _assert_same(_snapshot(resumed.model, resumed.optimizer), _snapshot(full.model, full.optimizer))
    assert resumed.lr_scheduler.state_dict()["_last_lr"] == full.lr_scheduler.state_dict()["_last_lr"]
    assert resumed.state.global_step == 8
    assert sorted(os.listdir(resumed_dir)) == ["checkpoint-8"]           # save_total_limit=1 rotation


def test_plain_trainer_checkpoint_still_resumes(tmp_path):
    """A checkpoint directory written by plain Trainer (no lazyckpt.lzc) goes to
    Trainer's own loaders."""
    args = dict(output_dir=str(tmp_path / "plain"), max_steps=2, per_device_train_batch_size=4,
                save_strategy="steps", save_steps=2, report_to=[], dataloader_num_workers=0, use_cpu=True,
                disable_tqdm=True)
    plain = transformers.Trainer(model=_model(0), args=transformers.TrainingArguments(**args),
                                 train_dataset=_Data())
    plain.train()
    args["max_steps"] = 3
    args["output_dir"] = str(tmp_path / "lazy")
    record = _Record()
    lazy = lzhf.LazyCheckpointTrainer(model=_model(1), args=transformers.TrainingArguments(**args),
                                      train_dataset=_Data(), callbacks=[record],
                                      lazyckpt_checkpoint_format="lazyckpt")
    lazy.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    _assert_same(record.at["begin"], _snapshot(plain.model, plain.optimizer))
    assert lazy.state.global_step == 3
    assert (tmp_path / "lazy" / "checkpoint-3" / lzhf.CHECKPOINT_FILE).is_file()     # saved the lazy way
