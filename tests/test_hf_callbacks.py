"""The Hugging Face Trainer's contract around asynchronous checkpoints (issue 24):
on_save and rotation see committed checkpoints only, in-place swaps outside
the optimizer step (schedule-free's optimizer.train()/eval(), model.train()/
eval() transforms) wait for the capture, a JIT checkpoint killed at any
instant leaves resume_from_checkpoint=True working, and what cannot be
checkpointed asynchronously is refused, not silently made synchronous.

Every test runs the real transformers Trainer on CPU; the plain Trainer is
the reference wherever the contract is "what the plain Trainer does"."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _env import child_env  # noqa: E402
from _frameworks import require  # noqa: E402

transformers = require("transformers")
require("accelerate")

from lazyckpt.errors import CheckpointNotFoundError  # noqa: E402
from lazyckpt.integrations import huggingface as lzhf  # noqa: E402
from lazyckpt.integrations.hf_callbacks import INCOMPLETE_MARKER, last_complete_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SEQ = 16


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=48, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(seed=0, hidden=32, layers=2):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                      intermediate_size=2 * hidden, vocab_size=128, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def _args(out, **kw):
    base = dict(output_dir=str(out), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                save_strategy="steps", save_steps=1, logging_steps=1, report_to=[], dataloader_num_workers=0,
                seed=42, use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trainer(kind, out, model=None, callbacks=(), cls_extra=None, fmt="hf", **kw):
    """kind: "plain" (transformers.Trainer) or "lazy" (LazyCheckpointTrainer)."""
    base = transformers.Trainer if kind == "plain" else lzhf.LazyCheckpointTrainer
    cls = type("T", (cls_extra, base) if cls_extra else (base,), {})
    extra = {} if kind == "plain" else {"lazyckpt_options": {"host_cache_bytes": 8 << 20},
                                        "lazyckpt_checkpoint_format": fmt}
    train_kw = {k: kw.pop(k) for k in list(kw) if k == "eval_dataset"}
    return cls(model=model if model is not None else _model(), args=_args(out, **kw), train_dataset=_Data(),
               callbacks=list(callbacks), **train_kw, **extra)


def _checkpoint_dirs(out):
    return sorted((d for d in os.listdir(out) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))


def _listing(path):
    return {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}


# --------------------------------------------------------------------------- callbacks after the commit

class _SeesCommittedDirectory(transformers.TrainerCallback):
    """Reads checkpoint-<state.global_step> in on_save, as W&B, MLflow, ClearML and Flyte do."""

    def __init__(self):
        self.seen = {}
        self.problems = []

    def on_save(self, args, state, control, **kw):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        try:
            assert os.path.isdir(path), f"{path} does not exist"
            assert not os.path.exists(os.path.join(path, INCOMPLETE_MARKER))
            with open(os.path.join(path, "trainer_state.json")) as f:
                assert json.load(f)["global_step"] == state.global_step
            self.seen[state.global_step] = _listing(path)
        except (AssertionError, OSError) as exc:
            self.problems.append((state.global_step, repr(exc)))


@pytest.mark.parametrize("kind,fmt", [("plain", None), ("lazy", "hf"), ("lazy", "lazyckpt")])
def test_on_save_sees_the_committed_complete_directory(tmp_path, kind, fmt, no_leaked_threads):
    seer = _SeesCommittedDirectory()
    trainer = _trainer(kind, tmp_path, callbacks=[seer], fmt=fmt)
    trainer.train()
    assert seer.problems == []
    assert sorted(seer.seen) == list(range(1, 9))                       # 8 of 8 calls
    for step, listing in seer.seen.items():                             # complete then = as it stays
        assert listing == _listing(tmp_path / f"checkpoint-{step}")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]    # no staging left


@pytest.mark.parametrize("kind", ["plain", "lazy"])
def test_rotation_runs_before_on_save_and_keeps_the_limit(tmp_path, kind):
    """save_total_limit=2: on_save(N) sees its own directory (never rotated away
    before its callbacks ran) and the run ends with the plain Trainer's two."""
    seer = _SeesCommittedDirectory()
    trainer = _trainer(kind, tmp_path, callbacks=[seer], save_total_limit=2)
    trainer.train()
    assert seer.problems == [] and sorted(seer.seen) == list(range(1, 9))
    assert _checkpoint_dirs(tmp_path) == ["checkpoint-7", "checkpoint-8"]


class _StopsInOnSave(transformers.TrainerCallback):
    """Sets control flags in on_save at the steps ``at``, as early-stopping or budget callbacks do."""

    def __init__(self, at, **flags):
        self.at, self.flags = at, flags or {"should_training_stop": True}
        self.on_save_steps = []
        self.evaluated, self.logged_steps = [], []

    def on_save(self, args, state, control, **kw):
        self.on_save_steps.append(state.global_step)
        if state.global_step in self.at:
            for name, value in self.flags.items():
                setattr(control, name, value)
        return control

    def on_evaluate(self, args, state, control, **kw):
        self.evaluated.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kw):
        self.logged_steps.append(state.global_step)


def _bigger_model():
    # Its commit takes several steps on CPU: on_save of a checkpoint not yet committed
    # would run steps late (2 to 3 steps with the small model).
    return _model(hidden=256, layers=4)


@pytest.mark.parametrize("kind", ["plain", "lazy"])
def test_should_training_stop_set_in_on_save_stops_at_that_step(tmp_path, kind):
    stopper = _StopsInOnSave(at=(2,))
    trainer = _trainer(kind, tmp_path, model=_bigger_model(), callbacks=[stopper], max_steps=12)
    trainer.train()
    assert trainer.state.global_step == 2
    assert _checkpoint_dirs(tmp_path) == ["checkpoint-1", "checkpoint-2"]
    assert stopper.on_save_steps == [1, 2]                               # once per checkpoint


def _flags_in_on_save_run(kind, out):
    # 24 samples, batch 4: an epoch is 6 steps. on_save(2) is mid-epoch, on_save(6) ends epoch 1.
    flags = dict(should_save=True, should_evaluate=True, should_log=True)
    seer = _StopsInOnSave(at=(2, 6), **flags)
    trainer = _trainer(kind, out, model=_bigger_model(), callbacks=[seer], max_steps=8, save_steps=2,
                       logging_steps=100, per_device_eval_batch_size=4, eval_dataset=_Data(4, seed=1))
    trainer.train_dataset = _Data(24)
    trainer.train()
    return {"on_save": seer.on_save_steps, "evaluated": seer.evaluated, "logged": seer.logged_steps,
            "dirs": _checkpoint_dirs(out)}


def test_flags_set_in_on_save_act_as_in_the_plain_trainer(tmp_path):
    """should_save/should_evaluate/should_log set in on_save: the plain Trainer's
    next on_step_begin clears them mid-epoch, its epoch-end check acts on them."""
    plain = _flags_in_on_save_run("plain", tmp_path / "plain")
    # Epoch end at step 6: saved again, evaluated (and logged) once; step 2's flags cleared.
    assert plain["on_save"] == [2, 4, 6, 6, 8] and plain["evaluated"] == [6]
    assert _flags_in_on_save_run("lazy", tmp_path / "lazy") == plain


class _SeesRotation(transformers.TrainerCallback):
    """The checkpoint directories on disk in each on_save."""

    def __init__(self):
        self.seen = {}

    def on_save(self, args, state, control, **kw):
        self.seen[state.global_step] = _checkpoint_dirs(args.output_dir)


def _rotated_up_to(step, limit=2):
    return [f"checkpoint-{s}" for s in range(max(1, step - limit + 1), step + 1)]


@pytest.fixture
def slow_commit(monkeypatch):
    """A commit slower than a training step (a slow file system): checkpoints queue
    up, and several commit between two callback events (all the last ones at the end)."""
    commit = lzhf._commit_directory

    def slow(*args):
        time.sleep(0.3)
        commit(*args)
    monkeypatch.setattr(lzhf, "_commit_directory", slow)


@pytest.mark.parametrize("kind", ["plain", "lazy"])
def test_on_save_sees_the_checkpoints_up_to_its_own_after_rotation(tmp_path, kind, slow_commit):
    """The plain Trainer's order per checkpoint: push, rotate, on_save; on_save(N)
    sees the checkpoints up to N after rotation, as the plain Trainer shows them."""
    seer = _SeesRotation()
    trainer = _trainer(kind, tmp_path, callbacks=[seer], save_total_limit=2, max_steps=12)
    trainer.train()
    assert seer.seen == {step: _rotated_up_to(step) for step in range(1, 13)}
    assert _checkpoint_dirs(tmp_path) == _rotated_up_to(12)


class _ReportsLikeWandb(_SeesRotation):
    """Stands in for transformers' reporting callbacks (W&B, MLflow, ...): their on_save
    reads checkpoint-<step>/ and sets no control flag, so lazyckpt defers it."""

    def on_save(self, args, state, control, **kw):
        super().on_save(args, state, control, **kw)

    on_save.__module__ = "transformers.integrations.integration_utils"


def test_deferred_on_save_runs_after_its_own_rotation(tmp_path, slow_commit):
    """Deferred on_save(N) may run once N+1 is committed too (it is not hidden), but
    rotation has run per checkpoint, in order: the ones up to N are the plain Trainer's."""
    seer = _ReportsLikeWandb()
    trainer = _trainer("lazy", tmp_path, callbacks=[seer], save_total_limit=2, max_steps=12)
    trainer.train()
    up_to_own = {step: [d for d in dirs if int(d.split("-")[1]) <= step] for step, dirs in seer.seen.items()}
    assert up_to_own == {step: _rotated_up_to(step) for step in range(1, 13)}
    assert any(len(dirs) > len(up_to_own[step]) for step, dirs in seer.seen.items())    # deferred indeed
    assert _checkpoint_dirs(tmp_path) == _rotated_up_to(12)


def test_on_save_of_committed_checkpoints_runs_when_train_raises(tmp_path):
    class Fails(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                raise RuntimeError("boom at step 3")

    seer = _SeesCommittedDirectory()
    trainer = _trainer("lazy", tmp_path, callbacks=[seer, Fails()])
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.train()
    assert seer.problems == [] and sorted(seer.seen) == [1, 2]         # as the plain Trainer ran them


# --------------------------------------------------------------------------- in-place swaps

def _clone_state(model, optimizer):
    opt = optimizer.state_dict()
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {i: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for i, s in opt["state"].items()},
            [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]])


class _SyncCopyAtSave:
    """Takes a synchronous copy of the model and optimizer at each save (the reference)."""

    def _save_checkpoint(self, model, trial):
        self.sync_copies[self.state.global_step] = _clone_state(self.model, self.optimizer)
        return super()._save_checkpoint(model, trial)


def _read_checkpoint(path, fmt):
    if fmt == "lazyckpt":
        state = lzhf.load_checkpoint_state(path, keys=["model", "optimizer"])
        return state["model"], state["optimizer"]
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors")), torch.load(os.path.join(path, "optimizer.pt"),
                                                                          weights_only=True)


def _mismatches(path, fmt, copy):
    model, optimizer = _read_checkpoint(path, fmt)
    ref_model, ref_opt, ref_groups = copy
    bad = [k for k in model if not torch.equal(model[k], ref_model[k])]
    for i, s in optimizer["state"].items():
        bad += [(i, k) for k, v in s.items() if not torch.equal(torch.as_tensor(v), torch.as_tensor(ref_opt[i][k]))]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
    if [g.get("train_mode") for g in groups] != [g.get("train_mode") for g in ref_groups]:
        bad.append("train_mode")
    return bad


class _Losses:
    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.losses.append(loss.item())
        return loss


def _schedule_free_run(kind, out, fmt="hf", resume=None, **kw):
    # Evaluation before every save: the save captures eval-mode weights, and the next
    # training_step's optimizer.train() swaps every parameter back in place.
    trainer = _trainer(kind, out, model=_model(hidden=64), cls_extra=type("X", (_SyncCopyAtSave, _Losses), {}),
                       fmt=fmt, optim="schedule_free_adamw", lr_scheduler_type="constant", warmup_steps=0,
                       max_steps=12, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                       eval_dataset=_Data(4, seed=1), **kw)
    trainer.sync_copies, trainer.losses = {}, []
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def plain_schedule_free(tmp_path_factory):
    """The plain Trainer's run and its resume from checkpoint-6 (the reference trajectory)."""
    require("schedulefree")
    out = tmp_path_factory.mktemp("plain_schedule_free")
    plain = _schedule_free_run("plain", out / "plain")
    plain_resumed = _schedule_free_run("plain", out / "plain2", resume=str(out / "plain" / "checkpoint-6"))
    return plain, plain_resumed


# 9 to 11 of 12 checkpoints held wrong or half-swapped weights before optimizer.train()/eval() waited.
@pytest.mark.parametrize("fmt", ["hf", pytest.param("lazyckpt", marks=pytest.mark.slow)])
def test_schedule_free_checkpoints_are_the_state_at_save_time(tmp_path, fmt, plain_schedule_free):
    lazy = _schedule_free_run("lazy", tmp_path / "lazy", fmt=fmt)
    assert sorted(lazy.sync_copies) == list(range(1, 13))
    bad = {step: _mismatches(str(tmp_path / "lazy" / f"checkpoint-{step}"), fmt, copy)
           for step, copy in lazy.sync_copies.items()}
    assert {s: b for s, b in bad.items() if b} == {}                    # 12 of 12 bit-exact

    # Resuming lands on the plain Trainer's trajectory, bit for bit.
    plain, plain_resumed = plain_schedule_free
    lazy_resumed = _schedule_free_run("lazy", tmp_path / "lazy2", fmt=fmt,
                                      resume=str(tmp_path / "lazy" / "checkpoint-6"))
    assert lazy.losses == plain.losses
    assert lazy_resumed.losses == plain_resumed.losses
    for k, v in plain_resumed.model.state_dict().items():
        assert torch.equal(v, lazy_resumed.model.state_dict()[k]), k


class _FoldsScaleOnEval(torch.nn.Module):
    """A model whose eval() folds a scale into its weight in place and whose
    train() unfolds it (re-parameterized layers do this)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 128))
        self.scale = 3.0

    def train(self, mode=True):
        if self.training and not mode:
            with torch.no_grad():
                self.net[0].weight.mul_(self.scale)
        elif not self.training and mode:
            with torch.no_grad():
                self.net[0].weight.div_(self.scale)
        return super().train(mode)

    def forward(self, input_ids, labels=None):
        x = torch.nn.functional.one_hot(input_ids, 512).float().mean(1) * (1 if self.training else 1 / self.scale)
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 0])
        return {"loss": loss, "logits": logits}


def test_model_eval_time_transform_waits_for_the_capture(tmp_path):
    trainer = _trainer("lazy", tmp_path, model=_FoldsScaleOnEval(), cls_extra=_SyncCopyAtSave, fmt="lazyckpt",
                       max_steps=12, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                       eval_dataset=_Data(4, seed=1), learning_rate=1e-2)
    trainer.sync_copies = {}
    trainer.train()
    bad = {step: _mismatches(str(tmp_path / f"checkpoint-{step}"), "lazyckpt", copy)
           for step, copy in trainer.sync_copies.items()}
    assert len(bad) == 12 and {s: b for s, b in bad.items() if b} == {}


# --------------------------------------------------------------------------- JIT checkpoint + SIGKILL

_CHILD = r"""
import os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, {tests!r})
import torch, transformers
import test_hf_callbacks as t
from lazyckpt.integrations import huggingface as lzhf

class Progress(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        with open(os.path.join(args.output_dir, "..", "progress"), "w") as f:
            f.write(str(state.global_step))

args = t._args({out!r}, max_steps=100000, save_steps=3, logging_steps=1000, enable_jit_checkpoint=True)
trainer = lzhf.LazyCheckpointTrainer(model=t._model(hidden=256, layers=4), args=args, train_dataset=t._Data(),
                                     callbacks=[Progress()], lazyckpt_options={{"host_cache_bytes": 64 << 20}})
for cb in trainer.callback_handler.callbacks:          # transformers' grace period before the JIT save
    if getattr(cb, "jit_manager", None) is not None:
        cb.jit_manager.kill_wait = 0
trainer.train()
"""


def _jit_trial(tmp_path, trial, delay_s):
    out = tmp_path / f"trial{trial}" / "out"
    out.mkdir(parents=True)
    progress = out / ".." / "progress"
    script = _CHILD.format(tests=os.path.dirname(__file__), out=str(out))
    env = child_env(HF_HUB_OFFLINE="1")
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        # Wait for a committed regular checkpoint and a few steps past it.
        def steps_done():           # one read: the child rewrites the file (empty for an instant)
            text = progress.read_text().strip() if progress.exists() else ""
            return int(text) if text else 0
        # steps_done() alone is not enough: the save of step 3 commits in the background and
        # may still be in flight at step 5 on a slow machine (CI saw exactly that).
        while steps_done() < 5 or last_complete_checkpoint(str(out)) is None:
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)                # transformers saves a JIT checkpoint and stops
        if delay_s is None:                              # the instant the JIT directory appears
            regular = set(_checkpoint_dirs(out))
            while child.poll() is None and not (set(_checkpoint_dirs(out)) - regular):
                pass
        else:
            time.sleep(delay_s)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    return out, child.returncode


def _resume_after_kill(out):
    expected = last_complete_checkpoint(str(out))
    assert expected is not None
    steps = []

    class OneStep(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            steps.append(state.global_step)

        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = True

    trainer = lzhf.LazyCheckpointTrainer(model=_model(seed=1, hidden=256, layers=4),
                                         args=_args(out, max_steps=100000, save_strategy="no"),
                                         train_dataset=_Data(), callbacks=[OneStep()])
    trainer.train(resume_from_checkpoint=True)
    resumed_from = int(os.path.basename(expected).split("-")[1])
    assert trainer.state.global_step == resumed_from + 1
    # Every complete checkpoint left is whole: it loads into the plain Trainer's state.
    with open(os.path.join(expected, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == resumed_from


def _jit_trials(tmp_path, seed, n):
    rng = random.Random(seed)
    delays = [None] + [rng.uniform(0.0, 0.4) for _ in range(n - 1)]
    killed = []
    for trial, delay in enumerate(delays):
        out, returncode = _jit_trial(tmp_path, trial, delay)
        killed.append(returncode == -signal.SIGKILL)
        _resume_after_kill(out)
    assert killed[0]                # the kill at the instant the JIT directory appeared landed


def test_jit_checkpoint_killed_at_any_instant_resumes(tmp_path):
    _jit_trials(tmp_path, seed=24, n=2)


@pytest.mark.slow
def test_jit_checkpoint_killed_at_any_instant_resumes_many(tmp_path):
    _jit_trials(tmp_path, seed=2424, n=12)


def test_resume_true_skips_incomplete_directories_and_says_when_none_is_left(tmp_path):
    trainer = _trainer("lazy", tmp_path, max_steps=2, save_steps=2)
    trainer.train()
    (tmp_path / "checkpoint-3").mkdir()                                           # JIT's makedirs
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / INCOMPLETE_MARKER).write_text("in progress")
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    os.rename(tmp_path / "checkpoint-2", tmp_path / "old")
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        _trainer("lazy", tmp_path, max_steps=3).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("kind", ["plain", "lazy"])
def test_resume_true_without_checkpoint_raises_what_the_plain_trainer_raises(tmp_path, kind):
    # transformers' test_can_resume_training (benchmarks/hf_suite) and user code that falls back to a fresh
    # start catch ValueError with this message; lazyckpt's error must still be one.
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory") as info:
        _trainer(kind, tmp_path, max_steps=2).train(resume_from_checkpoint=True)
    if kind == "lazy":
        assert isinstance(info.value, CheckpointNotFoundError)


# --------------------------------------------------------------------------- no silent fallback

def test_deepspeed_under_the_trainer_is_refused(tmp_path, monkeypatch):
    require("deepspeed")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")     # TrainingArguments sets it: undone after
    config = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 4,
              "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError, match="does not checkpoint DeepSpeed.*lazyckpt.integrations.deepspeed"):
        _trainer("lazy", tmp_path, deepspeed=config)
    # The plain Trainer accepts the same arguments on this machine: the refusal is lazyckpt's.
    from accelerate.state import AcceleratorState
    try:
        assert _trainer("plain", tmp_path, deepspeed=config).is_deepspeed_enabled
        # accelerate's state is process-wide: a Trainer built now would use DeepSpeed too.
        with pytest.raises(ValueError, match="does not checkpoint DeepSpeed"):
            _trainer("lazy", tmp_path)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()


def test_fsdp_under_the_trainer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not checkpoint FSDP.*lazyckpt.integrations.dcp"):
        _trainer("lazy", tmp_path, fsdp=True, fsdp_config={"version": 2})


def test_push_to_hub_without_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="push_to_hub=True with lazyckpt_checkpoint_format='lazyckpt'"):
        _trainer("lazy", tmp_path, fmt="lazyckpt", push_to_hub=True, hub_model_id="me/x")


class _RecordsPushes:
    """The Hub upload itself needs the network: record what would be pushed, when."""

    def init_hf_repo(self, token=None):
        self.hub_model_id = self.args.hub_model_id
        self.pushed = []

    def _push_from_checkpoint(self, checkpoint_folder):
        self.pushed.append((os.path.basename(checkpoint_folder), _listing(checkpoint_folder)))


@pytest.mark.parametrize("kind", ["plain", "lazy"])
def test_push_to_hub_pushes_each_committed_checkpoint(tmp_path, kind):
    trainer = _trainer(kind, tmp_path, cls_extra=_RecordsPushes, push_to_hub=True, hub_model_id="me/x",
                       max_steps=4, save_steps=2)
    trainer.train()
    assert [name for name, _ in trainer.pushed] == ["checkpoint-2", "checkpoint-4"]
    for name, listing in trainer.pushed:
        assert "model.safetensors" in listing and listing == _listing(tmp_path / name)
