"""Training-loop overhead of checkpointing: lazyckpt vs torch.save vs torch.distributed.checkpoint.

Trains a Llama-architecture model (transformers.LlamaForCausalLM built from a
LlamaConfig, random weights, no download) with AdamW on random tokens, and in
ONE invocation runs these modes in sequence, each on a freshly built model with
the same config, seed and batches:

    none              no checkpointing (the baseline; run again at the end as
                      "none#2" to show drift; overheads are against their mean)
    torch_save        torch.save({model, optim, step}) + fsync, blocking
    dcp_save          torch.distributed.checkpoint.save(no_dist=True), blocking
    dcp_async         dcp.async_save, default stager (staging copy inside the call),
                      thread executor; the previous future is awaited before each save
    dcp_async_stager  dcp.async_save + DefaultStager(use_async_staging=True): the copy
                      runs in a background thread; an optimizer pre-step hook waits
                      for staging_completion before the weights are updated
    dcp_async_proc    dcp.async_save(async_checkpointer_type=PROCESS) + DefaultStager
                      (async staging, shared memory); needs a 1-rank gloo group; the
                      daemon process is spawned by a warm-up save outside the timing
    lazyckpt          Checkpointer(keep=2).attach(optimizer); ckpt.save(state, step)
    torch_checkpointing
                      torch-checkpointing's CheckpointManager, asynchronous saver (its
                      default): save() stages in a background thread (shared memory
                      on CPU) and a spawned process writes; the optimizer step runs
                      under manager.lock() (a pre-step hook takes it, a post-step hook
                      releases it: the wait is the stall); the writer process is
                      spawned by a warm-up save outside the timing. It does not
                      fsync: "to durable" includes an fsync of its files, taken when
                      its write future completes. Its storage is probed as in
                      `lazyckpt bench` (O_DIRECT writes, its default, fail on ext4:
                      buffered writes there). Needs the `bench` extra.

Not measurable on a CPU-only machine (printed as notes): pinned staging memory
(StagingOptions.use_pinned_memory is ignored without CUDA; torch-checkpointing's
stager turns it off without CUDA) and
BlockingAsyncStager(cache_staged_state_dict=True) (it pins memory and raises).

A checkpoint is taken after the optimizer step of every --every'th iteration;
each mode keeps the 2 newest committed checkpoints on disk (lazyckpt:
keep_last=2; others: older ones deleted, the deletion time excluded from the
timing) and its directory is removed at the end unless --keep. Per mode:

    s/iter          mean seconds per iteration, the first (warm-up) excluded
    overhead %      vs the mean of the two baselines
    blocking s      mean time in the save call, state_dict() included (dcp_async*:
                    also the wait for the previous save, which DCP requires)
    stall s/step    mean wait in the optimizer pre-step hook (lazyckpt's
                    wait_for_snapshot, DCP's staging_completion)
    to durable s    from the save call until fsynced on disk (lazyckpt: h.flush_s
                    after h.wait(); DCP async: upload future's completion, taken by a
                    done-callback; blocking modes: = blocking)
    final drain s   waiting for the last checkpoint after the loop

Means are over the saves after the first. With --repeat R the modes run R times
interleaved and each figure is the median of the R per-round means (the machine
is shared: repeat to average out other load). At the end the last lazyckpt
(and torch-checkpointing) checkpoint is loaded and compared bit-exactly with the model/optimizer state at
that step (OK/FAIL), and the final losses of all modes are compared
(checkpointing must not change training).

Full size (~106M params, ~1.3 GB checkpoint per save), from the repository root:

    cd /work/main && HF_HUB_OFFLINE=1 /work/main/.venv/bin/python benchmarks/bench_training.py \\
        --hidden 768 --layers 8 --seq 128 --batch 1 --iters 8 --every 1 --repeat 2 \\
        --dir ./bench-out/training --json bench-out/training.json

With ``--persist-to s3`` a SeaweedFS S3 server (tests/_s3server.py) is started
and the mode ``lazyckpt_persist`` runs after ``lazyckpt``: the same Checkpointer
with ``persist_to="s3://<bucket>/run"`` (a fresh bucket per run; incremental
off), so the table shows the same training with the local tier only and with
the persistent tier draining in the background; "final drain s" then includes
the drain to the store, and a line under the table gives the seconds from
save() until each step was on the store (``stats()["tiers"]["persistent"]``)
and how many steps the drain skipped as superseded by a newer one:

    cd /work/main && HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_training.py \\
        --modes none,lazyckpt --persist-to s3 --repeat 2 --alternate

Tiny smoke run (< 60 s):

    cd /work/main && HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_training.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lazyckpt  # noqa: E402
from _common import emit_json, fsync_file, machine_line, print_table, remove, state_bytes  # noqa: E402
from lazyckpt.cli.bench import fsync_path  # noqa: E402
from lazyckpt.storage.layout import tree_bytes  # noqa: E402

MODES = ["none", "torch_save", "dcp_save", "dcp_async", "dcp_async_stager", "dcp_async_proc",
         "torch_checkpointing", "lazyckpt", "lazyckpt_incr", "none#2"]
PERSIST_MODE = "lazyckpt_persist"   # only with --persist-to: lazyckpt + persist_to=
VERIFIED = ("lazyckpt", "lazyckpt_incr", "torch_checkpointing", PERSIST_MODE)   # last checkpoint compared bit-exactly
KEEP = 2


# ----------------------------------------------------------------------------- model

def build(args) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM
    heads = args.heads or max(1, args.hidden // 64)
    inter = args.intermediate or (int(args.hidden * 8 / 3) + 63) // 64 * 64
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=inter, num_hidden_layers=args.layers,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
                      attention_dropout=0.0)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.train()
    if args.frozen_fraction > 0:
        # Fine-tuning: freeze the embeddings and the output head, then the lowest
        # layers, skipping a tensor that would overshoot the wanted fraction.
        params = sorted(model.named_parameters(),
                        key=lambda np_: (0 if "embed" in np_[0] or "lm_head" in np_[0] else 1))
        total, frozen = sum(p.numel() for _, p in params), 0
        for _name, p in params:
            if frozen + p.numel() <= args.frozen_fraction * total:
                p.requires_grad_(False)
                frozen += p.numel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(4)]
    return model, opt, batches


def train_state(model, opt, step: int) -> Dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def snapshot(state: Any) -> Any:
    """A deep copy of the tensors of a state (for bit-exact verification)."""
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def bit_equal(a: Any, b: Any, path: str = "") -> Optional[str]:
    """None if equal bit for bit, else the first differing path."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)):
            return f"{path}: values differ"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys differ ({sorted(map(str, set(a) ^ set(b)))[:5]})"
        for k in a:
            why = bit_equal(a[k], b[k], f"{path}/{k}")
            if why:
                return why
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            why = bit_equal(x, y, f"{path}/{i}")
            if why:
                return why
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


# ----------------------------------------------------------------------------- savers

class Saver:
    """One checkpointing mode. save() is timed by the caller as the blocking time."""
    name = "none"
    uses_stall_hook = False

    def __init__(self, directory: str, args):
        self.dir = directory
        self.args = args
        self.excluded = 0.0                 # seconds to drop from the current iteration
        self.durable: Dict[int, float] = {}  # step -> seconds from save() to durable
        self.stall: List[float] = []
        self.extra: Dict[str, Any] = {}
        self.paths: List[str] = []
        self.bytes: Dict[int, int] = {}      # step -> bytes written for that checkpoint

    def attach(self, opt) -> None:
        pass

    def save(self, model, opt, step: int, t0: float) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Wait until every checkpoint is durable (timed as the final drain)."""

    def close(self) -> None:
        """Release resources (untimed)."""

    def latest_path(self) -> str:
        return self.paths[-1]

    def load_latest(self) -> Any:
        """The last checkpoint, loaded back (for the bit-exact check)."""
        return lazyckpt.load(self.latest_path())

    def _retire_old(self) -> None:
        """Delete checkpoints beyond the newest KEEP; the time is excluded from the iteration."""
        t = time.perf_counter()
        while len(self.paths) > KEEP:
            remove(self.paths.pop(0))
        self.excluded += time.perf_counter() - t


class TorchSave(Saver):
    name = "torch_save"

    def save(self, model, opt, step, t0):
        path = os.path.join(self.dir, f"step_{step:010d}.pt")
        torch.save(train_state(model, opt, step), path)
        fsync_file(path)
        self.durable[step] = time.perf_counter() - t0
        self.bytes[step] = os.path.getsize(path)
        self.paths.append(path)
        self._retire_old()


class DcpSave(Saver):
    name = "dcp_save"

    def save(self, model, opt, step, t0):
        import torch.distributed.checkpoint as dcp
        path = os.path.join(self.dir, f"step_{step:010d}")
        dcp.save(train_state(model, opt, step), checkpoint_id=path, no_dist=True)
        self.durable[step] = time.perf_counter() - t0
        self.bytes[step] = tree_bytes(path)
        self.paths.append(path)
        self._retire_old()


class DcpAsync(Saver):
    """dcp.async_save; the previous upload is awaited before the next save (DCP allows one)."""
    name = "dcp_async"

    def __init__(self, directory, args):
        super().__init__(directory, args)
        self.prev = None            # upload future of the previous save
        self.staging = None         # staging future (AsyncSaveResponse only)
        self.stager = None
        self.kwargs: Dict[str, Any] = {"no_dist": True}

    def _call(self, state, path):
        import torch.distributed.checkpoint as dcp
        return dcp.async_save(state, checkpoint_id=path, **self.kwargs)

    def save(self, model, opt, step, t0):
        if self.prev is not None:
            self.prev.result()
            self._retire_old()      # the previous upload is done: nothing is in flight now
        path = os.path.join(self.dir, f"step_{step:010d}")
        result = self._call(train_state(model, opt, step), path)
        if hasattr(result, "upload_completion"):        # AsyncSaveResponse (async staging)
            self.staging, upload = result.staging_completion, result.upload_completion
        else:
            upload = result

        def done(_f, step=step, t0=t0, path=path):
            self.durable[step] = time.perf_counter() - t0
            self.bytes[step] = tree_bytes(path)
        upload.add_done_callback(done)
        self.prev = upload
        self.paths.append(path)

    def attach(self, opt):
        if not self.uses_stall_hook:
            return

        def pre_step(_opt, _args, _kwargs):
            if self.staging is not None:
                t = time.perf_counter()
                self.staging.result()
                self.stall.append(time.perf_counter() - t)
                self.staging = None
        opt.register_step_pre_hook(pre_step)

    def finish(self):
        if self.staging is not None:
            self.staging.result()
        if self.prev is not None:
            self.prev.result()

    def close(self):
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class DcpAsyncStager(DcpAsync):
    name = "dcp_async_stager"
    uses_stall_hook = True

    def __init__(self, directory, args):
        super().__init__(directory, args)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))
        self.kwargs["async_stager"] = self.stager


class DcpAsyncProcess(DcpAsync):
    name = "dcp_async_proc"
    uses_stall_hook = True

    def __init__(self, directory, args):
        super().__init__(directory, args)
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        # The spawned daemon does not inherit warning filters; silence DCP's single-process warning.
        os.environ.setdefault("PYTHONWARNINGS", "ignore:torch.distributed is disabled")
        self.own_group = not dist.is_initialized()
        if self.own_group:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=False))
        self.kwargs.update(async_stager=self.stager, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        # Spawn the checkpoint daemon process with a tiny save, outside the timed loop.
        import torch.distributed.checkpoint as dcp
        t = time.perf_counter()
        warm = os.path.join(directory, "warmup")
        dcp.async_save({"x": torch.zeros(1)}, checkpoint_id=warm, no_dist=True,
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        self.extra["daemon_spawn_s"] = time.perf_counter() - t
        remove(warm)

    def close(self):
        super().close()
        import torch.distributed as dist
        from torch.distributed.checkpoint import _async_process_executor as ape
        with contextlib.suppress(Exception):
            ape._CHECKPOINT_PROCESS = None     # its __del__ tells the daemon to exit
            gc.collect()
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()


class TorchCheckpointing(Saver):
    """torch-checkpointing (meta-pytorch): CheckpointManager with its asynchronous saver."""
    name = "torch_checkpointing"

    def __init__(self, directory, args):
        super().__init__(directory, args)
        import threading
        from lazyckpt.cli.bench import tc_manager, tc_staging_note, tc_storage
        self._threading = threading
        storage, self.extra["storage"] = tc_storage(directory)
        self.manager = tc_manager(True, storage)
        self.extra["staging"] = tc_staging_note(self.manager)
        self.lock = self.manager.lock()      # the read side of its staging lock
        self.synced: List[Any] = []          # one Event per save: fsynced after its write future
        self.prev = None
        self.pending = False                 # a save since the last optimizer step
        self._held = False
        # Spawn the writer process with a tiny save, outside the timed loop.
        t = time.perf_counter()
        warm = os.path.join(directory, "warmup")
        self.manager.save(warm, {"warmup": {"x": torch.zeros(1)}}).result()
        self.extra["daemon_spawn_s"] = time.perf_counter() - t
        remove(warm)

    def attach(self, opt):
        def pre_step(_opt, _args, _kwargs):
            t = time.perf_counter()
            self.lock.acquire_or_raise()        # waits while a save is still staging the state
            self._held = True
            if self.pending:
                self.stall.append(time.perf_counter() - t)
                self.pending = False

        def post_step(_opt, _args, _kwargs):
            if self._held:
                self._held = False
                self.lock.release()
        opt.register_step_pre_hook(pre_step)
        opt.register_step_post_hook(post_step)

    def save(self, model, opt, step, t0):
        path = os.path.join(self.dir, f"step_{step:010d}")
        # save() itself waits for the previous write (its staging buffer is reused).
        future = self.manager.save(path, train_state(model, opt, step))
        self.pending = True
        event = self._threading.Event()
        self.synced.append(event)

        def done(f, step=step, t0=t0, path=path, event=event):
            try:
                if f.exception() is None:
                    fsync_path(path)           # it does not fsync: durable only after this
                    self.durable[step] = time.perf_counter() - t0
                    self.bytes[step] = tree_bytes(path)
            finally:
                event.set()
        future.add_done_callback(done)
        self.prev = future
        self.paths.append(path)
        # Every earlier write has finished (save() waited for it): retire the oldest.
        t = time.perf_counter()
        while len(self.paths) > KEEP:
            old = self.paths.pop(0)
            self.synced[0].wait()
            self.synced.pop(0)
            remove(old)
        self.excluded += time.perf_counter() - t

    def finish(self):
        if self.prev is not None:
            self.prev.result()
        for event in self.synced:
            event.wait()

    def load_latest(self):
        loaded = self.manager.load(self.latest_path(), into={"model": None, "optim": None, "step": None})
        return dict(loaded)

    def close(self):
        if self.manager is not None:
            self.manager.close()
            self.manager = None


class Lazy(Saver):
    name = "lazyckpt"
    incremental = False

    def __init__(self, directory, args):
        super().__init__(directory, args)
        self.ckpt = lazyckpt.Checkpointer(directory, keep=KEEP, io=lazyckpt.IO(writer_threads=args.writer_threads),
                                          host_cache_bytes=args.cache_mib << 20,
                                          incremental=self.incremental)
        self.handles: List[Any] = []
        self._t = 0.0

    def attach(self, opt):
        # Time lazyckpt's own pre-step hook (wait_for_snapshot) by bracketing it.
        def before(*_):
            self._t = time.perf_counter()

        def after(*_):
            self.stall.append(time.perf_counter() - self._t)
        opt.register_step_pre_hook(before)
        self.ckpt.attach(opt)
        opt.register_step_pre_hook(after)

    def save(self, model, opt, step, t0):
        self.handles.append(self.ckpt.save(train_state(model, opt, step), step=step))

    def finish(self):
        self.ckpt.wait()
        for h in self.handles:
            h.wait()
            self.durable[h.step] = h.flush_s
            self.bytes[h.step] = h.bytes
        self.extra["lib_blocking_s"] = [h.blocking_s for h in self.handles]
        self.extra["capture_s"] = [h.capture_s for h in self.handles]

    def close(self):
        self.ckpt.close()

    def latest_path(self):
        return self.ckpt.step_path(self.handles[-1].step)


class LazyPersist(Lazy):
    """Checkpointer(persist="s3://..."): committed locally, drained to the
    object store in the background (--persist-to)."""
    name = PERSIST_MODE

    def __init__(self, directory, args):
        Saver.__init__(self, directory, args)
        server = args.s3_server
        bucket = server.make_bucket()
        self.ckpt = lazyckpt.Checkpointer(
            directory, keep=KEEP, host_cache_bytes=args.cache_mib << 20,
            persist=lazyckpt.Persist(f"s3://{bucket}/run", storage_options=args.s3_options),
            io=lazyckpt.IO(writer_threads=args.writer_threads))
        self.handles = []
        self._t = 0.0

    def finish(self):
        super().finish()              # ckpt.wait(): every step committed locally and drained
        self.extra["persisted_s"] = [h.persisted_s for h in self.handles]
        self.extra["persist_state"] = [h.persist_state for h in self.handles]


class LazyIncremental(Lazy):
    """Checkpointer(incremental=True): unchanged tensors (frozen parameters) are
    referred to in the step that holds them, not written again."""
    name = "lazyckpt_incr"
    incremental = True


SAVERS = {"torch_save": TorchSave, "dcp_save": DcpSave, "dcp_async": DcpAsync,
          "dcp_async_stager": DcpAsyncStager, "dcp_async_proc": DcpAsyncProcess,
          "torch_checkpointing": TorchCheckpointing, "lazyckpt": Lazy, "lazyckpt_incr": LazyIncremental,
          PERSIST_MODE: LazyPersist}


# ----------------------------------------------------------------------------- run

def run_mode(mode: str, args, verify: bool) -> Dict[str, Any]:
    model, opt, batches = build(args)
    directory = os.path.join(args.dir, mode.replace("#", "_"))
    saver = None
    if mode in SAVERS:
        remove(directory)
        os.makedirs(directory, exist_ok=True)
        saver = SAVERS[mode](directory, args)
    if saver is not None:
        saver.attach(opt)
    try:
        return _loop(saver, model, opt, batches, args, verify, directory)
    except BaseException:
        if saver is not None:
            with contextlib.suppress(BaseException):
                saver.finish()
            with contextlib.suppress(BaseException):
                saver.close()
        raise
    finally:
        del model, opt, saver
        gc.collect()


def _loop(saver, model, opt, batches, args, verify: bool, directory: str) -> Dict[str, Any]:
    save_steps = [i + 1 for i in range(args.iters) if (i + 1) % args.every == 0]
    reference = None
    iter_s, blocking, losses = [], [], []
    gc.collect()
    os.sync()
    t_loop = time.perf_counter()
    for i in range(args.iters):
        t = time.perf_counter()
        x = batches[i % len(batches)]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        excluded = 0.0
        step = i + 1
        if saver is not None and step in save_steps:
            saver.excluded = 0.0
            t0 = time.perf_counter()
            saver.save(model, opt, step, t0)
            blocking.append(time.perf_counter() - t0 - saver.excluded)
            excluded = saver.excluded
            if verify and step == save_steps[-1] and step != args.iters:
                tc = time.perf_counter()
                reference = snapshot(train_state(model, opt, step))
                excluded += time.perf_counter() - tc
        iter_s.append(time.perf_counter() - t - excluded)
    t_drain = time.perf_counter()
    if saver is not None:
        saver.finish()
    drain = time.perf_counter() - t_drain
    wall = time.perf_counter() - t_loop

    out: Dict[str, Any] = {"iter_s": iter_s, "blocking_s": blocking, "final_loss": losses[-1],
                           "drain_s": drain, "wall_s": wall}
    if saver is not None:
        out["durable_s"] = [saver.durable.get(s) for s in save_steps]
        out["bytes"] = [saver.bytes.get(s) for s in save_steps]
        out["stall_s"] = saver.stall
        out.update(saver.extra)
        if verify:
            if reference is None:
                reference = train_state(model, opt, save_steps[-1])
            try:
                why = bit_equal(saver.load_latest(), reference)
                # Every step still on disk, not only the last (incremental: across references).
                for path in getattr(saver, "ckpt", None) and [saver.ckpt.step_path(s)
                                                             for s in saver.ckpt.steps()] or []:
                    lazyckpt.load(path)
            except Exception as exc:
                why = f"load failed: {type(exc).__name__}: {exc}"
            out["verify"] = "OK" if why is None else f"FAIL ({why})"
        saver.close()
        if not args.keep:
            remove(directory)
    return out


def mean_after_first(values: List[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    vals = vals[1:] if len(vals) > 1 else vals
    return statistics.fmean(vals)


def aggregate(rs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One mode over --repeat rounds: per-round means, then the median across rounds."""
    ok = [r for r in rs if "error" not in r]
    if not ok:
        return rs[-1] if rs else {"error": "not run"}

    def med(key: str, drop_first: bool = True) -> Optional[float]:
        vals = [mean_after_first(r[key]) if drop_first else r[key] for r in ok if r.get(key) is not None]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    out = {"iter": med("iter_s"), "blocking": med("blocking_s"), "stall": med("stall_s"),
           "durable": med("durable_s"), "bytes": med("bytes"), "drain": med("drain_s", False), "final_loss": ok[-1]["final_loss"],
           "losses": sorted({r["final_loss"] for r in ok}), "rounds": ok, "failed_rounds": len(rs) - len(ok)}
    verifies = [r["verify"] for r in ok if "verify" in r]
    if verifies:
        bad = [v for v in verifies if v != "OK"]
        out["verify"] = bad[0] if bad else "OK"
    spawn = [r["daemon_spawn_s"] for r in ok if "daemon_spawn_s" in r]
    if spawn:
        out["daemon_spawn_s"] = statistics.median(spawn)
    for key in ("storage", "staging"):            # torch_checkpointing's configuration notes
        if any(key in r for r in ok):
            out[key] = next(r[key] for r in ok if key in r)
    return out


def _persist_lines(results, summary, ratios) -> None:
    """--persist-to: the same run with the local tier only and with the
    persistent tier, per iteration (median, max) and per save (blocking, stall)."""
    print("local only vs persist_to (per round, then the median over rounds; iterations after the first):")
    for mode in ("none", "lazyckpt", PERSIST_MODE):
        rounds = results.get(mode, {}).get("rounds")
        if not rounds:
            continue
        it_med = statistics.median(statistics.median(r["iter_s"][1:]) for r in rounds)
        it_max = statistics.median(max(r["iter_s"][1:]) for r in rounds)
        line = f"  {mode:17s} iter median {it_med:.3f} s, max {it_max:.3f} s"
        if mode != "none":
            blk = [b for r in rounds for b in r["blocking_s"]]
            stl = [x for r in rounds for x in r["stall_s"]]
            line += (f"; blocking median {statistics.median(blk) * 1e3:.1f} ms, max {max(blk) * 1e3:.1f} ms; "
                     f"stall median {statistics.median(stl) * 1e3:.2f} ms, max {max(stl) * 1e3:.2f} ms; "
                     f"final drain {statistics.median(r['drain_s'] for r in rounds):.2f} s")
        print(line)
    rounds = results[PERSIST_MODE]["rounds"]
    persisted = [x for r in rounds for x in r.get("persisted_s", []) if x is not None]
    states = [x for r in rounds for x in r.get("persist_state", [])]
    superseded = sum(1 for x in states if x and x.startswith("superseded"))
    local = [x for r in rounds for x in r.get("durable_s", []) if x is not None]
    print(f"  {PERSIST_MODE}: {len(states)} saves, {len(persisted)} uploaded, {superseded} superseded in the "
          f"drain queue by a newer step; save() -> local commit median {statistics.median(local):.2f} s, "
          f"-> on the store median {statistics.median(persisted) if persisted else float('nan'):.2f} s "
          f"(max {max(persisted) if persisted else float('nan'):.2f} s)")
    a, b = summary.get("lazyckpt"), summary.get(PERSIST_MODE)
    if a and b:
        ratios[f"iter_{PERSIST_MODE}/lazyckpt"] = b["iter_s"] / a["iter_s"]
        print(f"  s/iter {PERSIST_MODE} / lazyckpt: {b['iter_s'] / a['iter_s']:.3f}; blocking "
              f"{b['blocking_s'] * 1e3:.1f} vs {a['blocking_s'] * 1e3:.1f} ms; stall "
              f"{(b['stall_s'] or 0) * 1e3:.2f} vs {(a['stall_s'] or 0) * 1e3:.2f} ms per step")


def fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=0, help="default hidden/64")
    p.add_argument("--intermediate", type=int, default=0, help="default 8/3*hidden rounded to 64")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--every", type=int, default=1, help="checkpoint every k iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-mib", type=int, default=512, help="lazyckpt host_cache_bytes in MiB")
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--frozen-fraction", type=float, default=0.0,
                   help="freeze this fraction of the parameters (fine-tuning): lazyckpt_incr then writes "
                        "only what changes")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out", "training"))
    p.add_argument("--json", default=None, help="also write the JSON result to this file")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over all modes (interleaved); figures are medians across rounds")
    p.add_argument("--keep", action="store_true", help="keep the last checkpoints of each mode")
    p.add_argument("--alternate", action="store_true",
                   help="reverse the order of the checkpointing modes every other round (ABBA)")
    p.add_argument("--persist-to", choices=["s3"], default=None,
                   help="also run lazyckpt with persist_to= an S3 bucket on a SeaweedFS server started "
                        f"here (mode {PERSIST_MODE}, right after lazyckpt)")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: hidden 128, 2 layers, seq 32, vocab 1000, 4 iters")
    args = p.parse_args()
    if args.quick:
        args.hidden, args.layers, args.seq, args.vocab, args.iters = 128, 2, 32, 1000, 4
        args.cache_mib = min(args.cache_mib, 4)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES + ([PERSIST_MODE] if args.persist_to else [])]
    if bad:
        p.error(f"unknown modes {bad}; choose from {MODES}"
                + (f" + {PERSIST_MODE}" if args.persist_to else f" ({PERSIST_MODE} needs --persist-to)"))
    if args.persist_to and PERSIST_MODE not in modes:
        at = modes.index("lazyckpt") + 1 if "lazyckpt" in modes else len(modes)
        modes.insert(at, PERSIST_MODE)
    if args.repeat < 1 or args.iters < 2 or args.every < 1 or args.every > args.iters:
        p.error("need --repeat >= 1, --iters >= 2 and 1 <= --every <= --iters")
    os.makedirs(args.dir, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*Ignoring pin_memory.*")
    import logging
    logging.getLogger().setLevel(logging.WARNING)

    with contextlib.ExitStack() as stack:
        if args.persist_to:
            stack.enter_context(_s3_server(args))
        _main(args, modes)


@contextlib.contextmanager
def _s3_server(args):
    """A SeaweedFS S3 server for --persist-to s3 (args.s3_server, args.s3_options)."""
    import shutil
    import tempfile
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from _s3server import SeaweedServer
    tmp = tempfile.mkdtemp(prefix="bench-training-s3-", dir=args.dir)
    try:
        with SeaweedServer(tmp) as server:
            args.s3_server = server
            args.s3_options = {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
                               "secret_access_key": server.secret_key, "region": server.region}
            print(f"persistent tier: SeaweedFS S3 at {server.endpoint} (same machine, data under {tmp})")
            yield server
    finally:
        args.s3_server = args.s3_options = None
        shutil.rmtree(tmp, ignore_errors=True)


def _main(args, modes) -> None:
    model, opt, batches = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    # What changes at every step: trainable parameters, their two AdamW moments, the step counters.
    trainable = [p for p in model.parameters() if p.requires_grad]
    changed = sum(p.numel() * p.element_size() * 3 + 4 for p in trainable)
    # AdamW state exists after the first step; size it without training.
    ckpt_bytes = state_bytes({"m": model.state_dict()}) + (changed - sum(p.numel() * p.element_size()
                                                                          for p in trainable))
    del model, opt, batches
    print(machine_line())
    print(f"model: Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq} "
          f"batch={args.batch}: {n_params / 1e6:.1f}M params, checkpoint ~{ckpt_bytes / 1e9:.2f} GB "
          f"(fp32 weights + AdamW moments); {args.iters} iters, save every {args.every}; "
          f"torch threads={torch.get_num_threads()}; lazyckpt cache {args.cache_mib} MiB, "
          f"{args.writer_threads} writers"
          + (f"; {args.frozen_fraction:.0%} of the parameters frozen "
             f"({sum(p.numel() for p in trainable) / 1e6:.1f}M trainable)" if args.frozen_fraction else ""))
    print("notes: pinned staging memory needs CUDA (ignored on CPU; torch-checkpointing's stager turns it off "
          "without CUDA and stages into shared memory); "
          "BlockingAsyncStager(cache_staged_state_dict=True) pins memory and raises on CPU: not run.")

    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in modes}
    for rnd in range(args.repeat):
        order = list(modes)
        if args.alternate and rnd % 2:
            # ABBA: the checkpointing modes run in the reverse order every other
            # round, so a disk slowed by the previous mode's writes favours none.
            savers = [m for m in modes if m in SAVERS]
            flipped = iter(reversed(savers))
            order = [next(flipped) if m in SAVERS else m for m in modes]
        for mode in order:
            t = time.perf_counter()
            try:
                r = run_mode(mode, args, verify=mode in VERIFIED)
            except Exception as exc:  # keep going: one broken peer must not lose the others
                runs[mode].append({"error": f"{type(exc).__name__}: {exc}"})
                print(f"[{mode}] FAILED: {runs[mode][-1]['error']}", flush=True)
                continue
            runs[mode].append(r)
            print(f"[{mode}{f' round {rnd + 1}' if args.repeat > 1 else ''}] done in "
                  f"{time.perf_counter() - t:.1f} s, iter {statistics.fmean(r['iter_s'][1:]):.3f} s, "
                  f"final loss {r['final_loss']:.6f}", flush=True)
    results: Dict[str, Dict[str, Any]] = {m: aggregate(rs) for m, rs in runs.items()}

    base_runs = [results[m]["iter"] for m in ("none", "none#2") if m in results and "iter" in results[m]]
    base = statistics.fmean(base_runs) if base_runs else None
    rows, summary = [], {}
    for mode, r in results.items():
        if "error" in r:
            rows.append([mode, "error", "-", "-", "-", "-", "-", "-", "-"])
            continue
        it = r["iter"]
        s = {"iter_s": it, "overhead_pct": (it / base - 1) * 100 if base else None,
             "blocking_s": r["blocking"], "stall_s": r["stall"], "durable_s": r["durable"],
             "bytes": r.get("bytes"), "drain_s": r["drain"] if mode in SAVERS else None,
             "final_loss": r["final_loss"]}
        summary[mode] = s
        rows.append([mode, f"{it:.3f}", fmt(s["overhead_pct"], "+.1f"), fmt(s["blocking_s"], ".4f"),
                     fmt(s["stall_s"], ".4f"), fmt(s["durable_s"]),
                     fmt(s["bytes"] / 1e6 if s["bytes"] else None, ".1f"), fmt(s["drain_s"]),
                     f"{r['final_loss']:.6f}"])
    print()
    print_table(["mode", "s/iter", "overhead %", "blocking s", "stall s/step", "to durable s",
                 "MB/ckpt", "final drain s", "final loss"], rows)
    if len(base_runs) == 2:
        print(f"baseline drift: none {base_runs[0]:.3f} s/iter, none#2 {base_runs[1]:.3f} s/iter "
              f"({(base_runs[1] / base_runs[0] - 1) * 100:+.1f}%)")

    ratios = {}
    lz = summary.get("lazyckpt")
    if lz and lz["blocking_s"]:
        for peer in ("torch_save", "dcp_save", "dcp_async", "dcp_async_stager", "dcp_async_proc",
                     "torch_checkpointing"):
            if peer in summary and summary[peer]["blocking_s"]:
                ratios[f"blocking_lazyckpt/{peer}"] = lz["blocking_s"] / summary[peer]["blocking_s"]
                pause_lz = lz["blocking_s"] + (lz["stall_s"] or 0)
                pause_peer = summary[peer]["blocking_s"] + (summary[peer]["stall_s"] or 0)
                ratios[f"pause_lazyckpt/{peer}"] = pause_lz / pause_peer
        for key in ("torch_save", "dcp_async"):
            k = f"blocking_lazyckpt/{key}"
            if k in ratios:
                print(f"lazyckpt blocking / {key} blocking: {ratios[k]:.4f} "
                      f"({1 / ratios[k]:.0f}x less)")
        pauses = [f"{k.split('/')[1]}: {v:.3f}" for k, v in ratios.items() if k.startswith("pause")]
        if pauses:
            print("lazyckpt pause (blocking + stall) / peer pause: " + ", ".join(pauses))
    inc, full = summary.get("lazyckpt_incr"), summary.get("lazyckpt")
    if inc and full and inc["bytes"] and full["bytes"]:
        ratios["bytes_incr/full"] = inc["bytes"] / full["bytes"]
        ratios["durable_full/incr"] = full["durable_s"] / inc["durable_s"] if inc["durable_s"] else None
        ratios["changed_bytes"] = changed
        print(f"incremental: {inc['bytes'] / 1e6:.1f} MB per checkpoint against {full['bytes'] / 1e6:.1f} MB full "
              f"({ratios['bytes_incr/full']:.3f}); the tensors that change (trainable parameters and their "
              f"AdamW state) are {changed / 1e6:.1f} MB, + 1% of a full checkpoint = "
              f"{(changed + 0.01 * full['bytes']) / 1e6:.1f} MB; durable {ratios['durable_full/incr']:.2f}x "
              f"sooner; blocking {inc['blocking_s'] * 1e3:.1f} vs {full['blocking_s'] * 1e3:.1f} ms")
    if args.persist_to and "rounds" in results.get(PERSIST_MODE, {}):
        _persist_lines(results, summary, ratios)
    losses = {m: r["losses"] for m, r in results.items() if "losses" in r}
    same_loss = len({x for v in losses.values() for x in v}) <= 1
    print(f"final losses identical across modes: {'yes' if same_loss else 'NO ' + json.dumps(losses)}")
    verify = results.get("lazyckpt", {}).get("verify")
    if verify is not None:
        print(f"lazyckpt last checkpoint bit-exact vs live state at that step: {verify}")
    if "verify" in results.get("lazyckpt_incr", {}):
        print(f"lazyckpt_incr last checkpoint bit-exact (through its references): "
              f"{results['lazyckpt_incr']['verify']}")
    tc = results.get("torch_checkpointing", {})
    if "verify" in tc:
        print(f"torch_checkpointing last checkpoint bit-exact vs live state at that step (loaded with its "
              f"CheckpointManager): {tc['verify']}")
    for mode in ("dcp_async_proc", "torch_checkpointing"):
        if mode in results and "daemon_spawn_s" in results[mode]:
            print(f"{mode}: daemon spawn (warm-up, untimed) {results[mode]['daemon_spawn_s']:.2f} s")
    for key in ("storage", "staging"):
        if tc.get(key):
            print(f"torch_checkpointing {key}: {tc[key]}")

    blob = {"machine": machine_line(),
            "config": {k: v for k, v in vars(args).items() if k not in ("s3_server", "s3_options")},
            "params": n_params, "checkpoint_bytes_est": ckpt_bytes, "summary": summary,
            "ratios": ratios, "verify": verify, "same_final_loss": same_loss, "raw": results}
    emit_json(blob, args.json, default=float)


if __name__ == "__main__":
    main()
