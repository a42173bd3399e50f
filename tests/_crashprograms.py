"""The short programs of the crash-point test (tests/_crashpoints.py): one per
path that changes durable state, each with its oracle (the worlds a crash may
leave). Add a program by writing ``prepare``/``run`` and its worlds.

Every program starts from a directory prepared once (``prepare``, in a
child) and copied for each crash point; ``run`` opens what it needs (not
counted) and performs the operation under test inside ``icp.operation()``.
The states are deterministic (``make_state(seed)``): the oracle knows each
save's exact values.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

from _crashpoints import KNOBS, Ctx, Interceptor, Program, World, make_state

S = {i: make_state(i) for i in range(1, 6)}        # the prepared line: step i holds make_state(i)
NEW = make_state(33)                                # the operation's save
BIG = {i: make_state(i, big=True) for i in range(1, 4)}    # incremental: a frozen 48 KiB part, shared


def _ck(ctx: Ctx, persist: bool = False, takeover: bool = False, **kw: Any) -> Any:
    import lazyckpt
    from _groups import groups
    args = dict(KNOBS)
    args.update(kw)
    if persist:
        args["persist"] = lazyckpt.Persist(ctx.persist_to, storage_options=ctx.storage_options)
    if takeover:
        args["distributed"] = lazyckpt.Distributed(takeover=True)
    return lazyckpt.Checkpointer(os.path.join(ctx.case, "run"), **groups(args))


def _prepare_line(n: int, persist: bool = False, states: Optional[Dict[int, Any]] = None, **kw: Any):
    def prepare(ctx: Ctx) -> None:
        with _ck(ctx, persist, **kw) as ck:
            for i in range(1, n + 1):
                h = ck.save((states or S)[i], step=i)
                h.wait(**({"persisted": True} if persist else {}))
    return prepare


def _save_run(step: int, values: Any, persist: bool = False, load_step: Optional[int] = None, **kw: Any):
    def run(ctx: Ctx, icp: Interceptor) -> None:
        ck = _ck(ctx, persist, **kw)
        with icp.operation():
            if load_step is not None:
                ck.load(step=load_step)            # the rollback: resume from an older step
            h = ck.save(values, step=step)
            h.wait(**({"persisted": True} if persist else {}))
            ck.close()
    return run


def _line(n: int, states: Optional[Dict[int, Any]] = None) -> Dict[int, Any]:
    return {i: (states or S)[i] for i in range(1, n + 1)}


#: The default I/O mode, ``o_direct="auto"`` (storage/iomode.py: each write in the
#: mode its file system's tracker picks, a buffered one written back with
#: sync_file_range), with chunks of 2 MiB: the operation's save (``WIDE``, a
#: 2.5 MiB tensor more) writes its first chunk (over 1 MiB, the smallest transfer
#: measured) as a measure of buffered writes (a second descriptor, pwrite,
#: sync_file_range over it), the rest (under 1 MiB) O_DIRECT; the same every run
#: (a measure is judged against the transfers of 1 MiB or more beside or after
#: it, and there are none, so the mode in use never changes).
AUTO = dict(o_direct="auto", chunk_bytes=2 << 20, host_cache_bytes=4 << 20)


def _wide(seed: int) -> Dict[str, Any]:
    import torch
    state = make_state(seed)
    state["wide"] = torch.randn(640 * 1024, generator=torch.Generator().manual_seed(seed))
    return state


WIDE = _wide(33)


def save_program(keep_last: Optional[int], persist: bool = False, auto: bool = False) -> Program:
    new, io = (WIDE, AUTO) if auto else (NEW, {})
    before = World("before", 2, _line(2), (1, 2))
    after = World("after", 3, {**_line(2), 3: new}, (1, 2, 3) if keep_last is None else (2, 3))
    name = f"save-keep{keep_last}" + ("-persist" if persist else "") + ("-auto" if auto else "")
    return Program(name, _prepare_line(2, persist, keep=keep_last, **io),
                   _save_run(3, new, persist, keep=keep_last, **io),
                   [before, after], kwargs={"keep": keep_last, **io}, persist=persist)


def rollback_program(keep_last: Optional[int], persist: bool = False, auto: bool = False) -> Program:
    new, io = (WIDE, AUTO) if auto else (NEW, {})
    before = World("before", 5, _line(5), (1, 2, 3, 4, 5))
    after = World("after", 3, {**_line(2), 3: new}, (1, 2, 3) if keep_last is None else (2, 3))
    name = f"rollback-keep{keep_last}" + ("-persist" if persist else "") + ("-auto" if auto else "")
    return Program(name, _prepare_line(5, persist, **io), _save_run(3, new, persist, load_step=2, keep=keep_last, **io),
                   [before, after], kwargs={"keep": keep_last, **io}, persist=persist)


def incremental_program(keep_last: Optional[int]) -> Program:
    """A run whose frozen part never changes: step 1 prepared; step 2 saved by
    the Checkpointer before the operation (the first save of a process is
    full); the operation saves step 3, which refers to step 2's bytes.
    keep_last=1: the retention of the operation deletes nothing referred to
    (step 2 stays: step 3 refers to it; step 1 went at step 2's commit)."""
    new = make_state(33, big=True)

    def run(ctx: Ctx, icp: Interceptor) -> None:
        ck = _ck(ctx, incremental=True, keep=keep_last)
        ck.save(BIG[2], step=2).wait()
        with icp.operation():
            ck.save(new, step=3).wait()
            ck.close()
    before = World("before", 2, _line(2, BIG), (1, 2) if keep_last is None else (2,))
    after = World("after", 3, {**_line(2, BIG), 3: new}, (1, 2, 3) if keep_last is None else (2, 3))
    return Program(f"incremental-keep{keep_last}", _prepare_line(1, False, BIG, incremental=True), run,
                   [before, after], kwargs={"keep": keep_last, "incremental": True})


#: The losses the policy programs' saves record (metadata={"loss": ...}); NEW's is LOSS_NEW.
LOSSES = {1: 0.5, 2: 3.0, 3: 1.0, 4: 4.0, 5: 5.0}
LOSS_NEW = 2.0


def policy_program(which: str) -> Program:
    """A line of 5 steps saved without retention (keep=None); the operation opens
    the directory with a retention policy and saves step 6, whose retention
    deletes what the policy does not keep, newest first: ``"last-every"``,
    ``keep=KeepLast(2) | KeepEvery(3)``, keeps 3, 5 and 6 (deletes 4, 2, 1);
    ``"best"``, ``keep=KeepBest(2)`` over the saves' ``loss``, keeps 1 and 3
    (the best) and 6 (the newest), deleting 5, 4 and 2; ``"best-rollback"``:
    the same policy, the run resumed from step 2 saves step 3 (loss -1),
    superseding 3, 4 and 5, and its retention deletes 2."""
    from lazyckpt.retention import KeepBest, KeepEvery, KeepLast
    policy = KeepLast(2) | KeepEvery(3) if which == "last-every" else KeepBest(2)
    step, kept = {"last-every": (6, (3, 5)), "best": (6, (1, 3)), "best-rollback": (3, (1,))}[which]
    loss = -1.0 if which == "best-rollback" else LOSS_NEW

    def prepare(ctx: Ctx) -> None:
        with _ck(ctx, keep=None) as ck:
            for i in range(1, 6):
                ck.save(S[i], step=i, metadata={"loss": LOSSES[i]}).wait()

    def run(ctx: Ctx, icp: Interceptor) -> None:
        ck = _ck(ctx, keep=policy)
        with icp.operation():
            if which == "best-rollback":
                ck.load(step=2)
            ck.save(NEW, step=step, metadata={"loss": loss}).wait()
            ck.close()
    before = World("before", 5, _line(5), (1, 2, 3, 4, 5))
    after = World("after", step, {**_line(step - 1), step: NEW}, kept + (step,))
    return Program(f"policy-{which}", prepare, run, [before, after], kwargs={"keep": policy},
                   restart_metadata={"loss": 9.0})


def prune_program(keep: int = 2) -> Program:
    def run(ctx: Ctx, icp: Interceptor) -> None:
        from lazyckpt.cli.prune import prune
        with icp.operation():
            prune(os.path.join(ctx.case, "run"), keep)
    world = World("prune", 5, _line(5), tuple(range(6 - keep, 6)))
    return Program(f"prune-keep{keep}", _prepare_line(5), run, [world])


def leftovers_program() -> Program:
    """A directory with what dead processes left (an interrupted save, an
    interrupted delete, an abandoned step, a small temporary, a dead writer
    lease), all an hour old; the operation opens a Checkpointer, which cleans
    them (its scan waited for), and closes it."""
    def prepare(ctx: Ctx) -> None:
        import shutil
        _prepare_line(3)(ctx)
        d = os.path.join(ctx.case, "run")
        shutil.copytree(os.path.join(d, "step_0000000003"), os.path.join(d, ".tmp-step_0000000004-0123456789ab"))
        os.unlink(os.path.join(d, ".tmp-step_0000000004-0123456789ab", "manifest.json"))
        shutil.copytree(os.path.join(d, "step_0000000001"), os.path.join(d, ".deleting-step_0000000000-fedcba987654"))
        shutil.copytree(os.path.join(d, "step_0000000002"), os.path.join(d, ".abandoned-step_0000000007-aaaaaaaaaaaa"))
        with open(os.path.join(d, "latest.tmp-bbbbbbbbbbbb"), "w") as f:
            f.write("9\n")
        with open(os.path.join(d, ".writer"), "w") as f:
            f.write('{"pid": 1, "host": "elsewhere", "id": "x", "since": 0}')
        old = time.time() - 3600
        for root, dirs, files in os.walk(d, topdown=False):
            for name in dirs + files:
                os.utime(os.path.join(root, name), (old, old))

    def run(ctx: Ctx, icp: Interceptor) -> None:
        with icp.operation():
            ck = _ck(ctx)
            ck.layout.tidy()            # waits for the scan opening starts (close() cancels it)
            ck.close()
    world = World("open", 3, _line(3), (1, 2, 3))
    return Program("clean-leftovers-on-open", prepare, run, [world])


def file_program(auto: bool = False) -> Program:
    """``lazyckpt.save(state, path)`` over an existing file (``auto``: with ``AUTO``'s I/O)."""
    new, knobs = (WIDE, dict(KNOBS, **AUTO)) if auto else (NEW, KNOBS)

    def prepare(ctx: Ctx) -> None:
        import lazyckpt
        lazyckpt.save(S[1], os.path.join(ctx.case, "model.lzc"), **knobs)

    def run(ctx: Ctx, icp: Interceptor) -> None:
        import lazyckpt
        with icp.operation():
            lazyckpt.save(new, os.path.join(ctx.case, "model.lzc"), **knobs)
    return Program("single-file-save" + ("-auto" if auto else ""), prepare, run,
                   [World("old", 1, {1: S[1]}), World("new", 2, {2: new})], kind="file")


def first_save_program() -> Program:
    """A Checkpointer made on a directory that does not exist yet, its first save
    waited for: after it returns, a power loss must leave the step (the new
    directory's entry in its parent made durable too, not only its contents)."""
    def run(ctx: Ctx, icp: Interceptor) -> None:
        with icp.operation():
            ck = _ck(ctx)
            ck.save(S[1], step=1).wait()
            ck.close()
    return Program("first-save-new-directory", lambda ctx: None, run,
                   [World("nothing", None, {}), World("first", 1, {1: S[1]}, (1,))])


def takeover_program() -> Program:
    """``Checkpointer(takeover=True)`` saves step 3 into a directory whose
    ``.writer`` names another holder (left by a process that died): the
    takeover's own durable operations (the new ``.writer`` written and renamed
    over the old one, under the commit lock), then the commit."""
    def prepare(ctx: Ctx) -> None:
        _prepare_line(2)(ctx)
        with open(os.path.join(ctx.case, "run", ".writer"), "w") as f:
            f.write('{"pid": 1, "host": "elsewhere", "id": "x", "since": 0}')

    before = World("before", 2, _line(2), (1, 2))
    after = World("after", 3, {**_line(2), 3: NEW}, (1, 2, 3))
    return Program("takeover-save", prepare, _save_run(3, NEW, takeover=True), [before, after])


def preempted_save_program() -> Program:
    """A loop saving with ``interval=Every(steps=2)`` and ``preemption=True`` gets
    SIGTERM at step 3: ``should_save(3)`` says save (the interval would not),
    the ``save()`` of step 3 returns once it is committed, and the loop stops.
    The operation is that loop: after it returns (power mode's last point), step 3
    must be there; the close is not counted."""
    def run(ctx: Ctx, icp: Interceptor) -> None:
        import signal
        import lazyckpt
        ck = _ck(ctx, interval=lazyckpt.Every(steps=2), preemption=True)
        with icp.operation():
            for step in (3, 4):
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
                if ck.should_save(step):
                    ck.save(NEW, step=step)
                if ck.preempted:
                    break
        ck.close()
    before = World("before", 2, _line(2), (1, 2))
    after = World("after", 3, {**_line(2), 3: NEW}, (1, 2, 3))
    return Program("preempted-save", _prepare_line(2), run, [before, after])


def lightning_s3_program() -> Program:
    """``LazyCheckpointIO`` on an ``s3://`` dirpath as ``ModelCheckpoint(save_top_k=1,
    save_last=True)`` drives it for a new step: the new top-k object, last.ckpt's
    server-side copy at its completion, last.ckpt's own save, the old top-k
    object's removal (issue 35, 8). ``kind="objects"``: every object left loads
    whole, last.ckpt exists and names the old or the new step, and the new one
    once the old one is gone (``_check_objects``)."""
    def plugin(ctx: Ctx) -> Any:
        from lazyckpt.integrations.lightning import LazyCheckpointIO
        return LazyCheckpointIO(storage_options=ctx.storage_options, **KNOBS)

    def prepare(ctx: Ctx) -> None:
        io = plugin(ctx)
        io.save_checkpoint(S[1], f"{ctx.persist_to}/{TOPK.format(1)}")
        io.save_checkpoint(S[1], f"{ctx.persist_to}/last.ckpt")
        io.teardown()

    def run(ctx: Ctx, icp: Interceptor) -> None:
        io = plugin(ctx)
        new, last = f"{ctx.persist_to}/{TOPK.format(2)}", f"{ctx.persist_to}/last.ckpt"
        with icp.operation():
            io.save_checkpoint(NEW, new)
            io.stand_in(new, last)
            io.save_checkpoint(NEW, last)
            io.remove_checkpoint(f"{ctx.persist_to}/{TOPK.format(1)}")
            io.teardown()
    return Program("lightning-s3-rotation", prepare, run, [World("old", 1, {1: S[1]}), World("new", 2, {2: NEW})],
                   kind="objects", persist=True, preload=_import_lightning)


def lightning_persist_program() -> Program:
    """The same rotation in a local directory with ``persist_to``: the local
    commits, last.ckpt's hard link, the removal, and the persistent tier's
    uploads, copy and delete, in that order. Both sides are checked, and the
    restart's first save must bring the store level with the directory."""
    def plugin(ctx: Ctx) -> Any:
        from lazyckpt.integrations.lightning import LazyCheckpointIO
        return LazyCheckpointIO(storage_options=ctx.storage_options, persist=ctx.persist_to,
                                local_root=ctx.case, **KNOBS)

    def prepare(ctx: Ctx) -> None:
        io = plugin(ctx)
        io.save_checkpoint(S[1], os.path.join(ctx.case, "ck", TOPK.format(1)))
        io.save_checkpoint(S[1], os.path.join(ctx.case, "ck", "last.ckpt"))
        io.teardown()

    def run(ctx: Ctx, icp: Interceptor) -> None:
        io = plugin(ctx)
        new, last = os.path.join(ctx.case, "ck", TOPK.format(2)), os.path.join(ctx.case, "ck", "last.ckpt")
        with icp.operation():
            io.save_checkpoint(NEW, new)
            io.stand_in(new, last)
            io.save_checkpoint(NEW, last)
            io.remove_checkpoint(os.path.join(ctx.case, "ck", TOPK.format(1)))
            io.teardown()
    return Program("lightning-persist-rotation", prepare, run,
                   [World("old", 1, {1: S[1]}), World("new", 2, {2: NEW})],
                   kind="objects", persist=True, preload=_import_lightning, mirror_dir="ck")


def hf_persist_program() -> Program:
    """The HF Trainer with ``lazyckpt_persist_to``: resumed from checkpoint-2, it
    trains steps 3-4, saves checkpoint-4 (the local commit, then its files
    uploaded, trainer_state.json last) and rotates checkpoint-2 away
    (save_total_limit=1: locally, then on the store, trainer_state.json first).
    ``kind="hf"`` (``_check_hf``): each side's newest complete checkpoint loads
    and is step 2 or 4, every complete one on the store is whole, and a restart
    with the local directory deleted resumes from the store."""
    def prepare(ctx: Ctx) -> None:
        hf_train(ctx, stop_at=2)

    def run(ctx: Ctx, icp: Interceptor) -> None:
        trainer = hf_trainer(ctx)
        with icp.operation():
            trainer.train(resume_from_checkpoint=True)
    return Program("hf-persist-rotation", prepare, run, [World("old", 2, {}), World("new", 4, {})],
                   kind="hf", persist=True, preload=_import_transformers)


def hf_trainer(ctx: Ctx, stop_at: Optional[int] = None) -> Any:
    """A tiny Llama on CPU, checkpoints every 2 steps into ``ctx.case/out``, kept 1,
    mirrored to ``ctx.persist_to`` (its lazyckpt format: three files a checkpoint)."""
    import torch
    import transformers
    import lazyckpt
    from lazyckpt.integrations.huggingface import LazyCheckpointTrainer

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> Dict[str, Any]:
            ids = torch.arange(i, i + 8) % 64
            return {"input_ids": ids, "labels": ids}

    class StopAt(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if stop_at is not None and state.global_step == stop_at:
                control.should_training_stop = True

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, vocab_size=64, max_position_embeddings=8)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(ctx.case, "out"), max_steps=4, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=2, save_total_limit=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0, logging_strategy="no")
    return LazyCheckpointTrainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=Data(),
                                 callbacks=[StopAt()], lazyckpt_checkpoint_format="lazyckpt",
                                 lazyckpt_persist=lazyckpt.Persist(ctx.persist_to, storage_options=ctx.storage_options),
                                 lazyckpt_options=dict(KNOBS, chunk_bytes=1 << 20, host_cache_bytes=2 << 20))


def hf_train(ctx: Ctx, stop_at: Optional[int] = None, resume: Any = None) -> Any:
    trainer = hf_trainer(ctx, stop_at)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _import_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from _frameworks import require
    require("transformers")
    require("accelerate")
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM, Trainer  # noqa: F401  (lazy submodules, imported now)
    import lazyckpt.integrations.huggingface  # noqa: F401


def dcp_program(file_format: str, on_store: bool = False) -> Program:
    """``dcp.save`` through ``LazyStorageWriter`` (``file_format`` "lazyckpt" or
    "dcp", DCP's own layout) of a new checkpoint next to an older one, locally
    or on the object store (``on_store``). A DCP checkpoint exists once its
    ``.metadata`` is written, last. ``kind="dcp"`` (``_check_dcp``): the old one
    loads as it was; the new one loads whole or is not a checkpoint at all."""
    def place(ctx: Ctx, name: str) -> str:
        return f"{ctx.persist_to}/{name}" if on_store else os.path.join(ctx.case, name)

    def save(ctx: Ctx, values: Any, name: str) -> None:
        import torch.distributed.checkpoint as dcp
        from lazyckpt.integrations.dcp import LazyStorageWriter
        writer = LazyStorageWriter(place(ctx, name), file_format=file_format,
                                   **dict(KNOBS, storage_options=ctx.storage_options) if on_store else KNOBS)
        dcp.save(values, storage_writer=writer, no_dist=True)

    def run(ctx: Ctx, icp: Interceptor) -> None:
        with icp.operation():
            save(ctx, NEW, "step2")
    program = Program(f"dcp-{file_format}{'-s3' if on_store else ''}", lambda ctx: save(ctx, S[1], "step1"), run,
                      [World("old", 1, {1: S[1]}), World("new", 2, {2: NEW})], kind="dcp", persist=on_store,
                      preload=_import_dcp)
    program.kwargs = {"place": place, "save": save, "file_format": file_format, "old": S[1]}
    return program


def _import_dcp() -> None:
    import torch.distributed.checkpoint  # noqa: F401
    import lazyckpt.integrations.dcp  # noqa: F401


def _import_lightning() -> None:
    from lazyckpt.integrations.lightning import LazyCheckpointIO  # noqa: F401  (imports lightning.pytorch)


#: ModelCheckpoint's file name for step i (epoch 0).
TOPK = "epoch=0-step={}.ckpt"


def local_programs() -> List[Program]:
    return [save_program(None), save_program(2), rollback_program(None), rollback_program(2),
            incremental_program(None), incremental_program(1), policy_program("last-every"), policy_program("best"),
            policy_program("best-rollback"), prune_program(2), leftovers_program(),
            file_program(), takeover_program(), first_save_program(), preempted_save_program(),
            dcp_program("lazyckpt"), dcp_program("dcp"),
            save_program(None, auto=True), rollback_program(2, auto=True), file_program(auto=True)]


def persist_programs() -> List[Program]:
    return [save_program(None, persist=True), rollback_program(None, persist=True), lightning_s3_program(),
            lightning_persist_program(), hf_persist_program(), dcp_program("lazyckpt", on_store=True)]


def all_programs() -> List[Program]:
    return local_programs() + persist_programs()
