"""The neighbour mode of the crash-point harness (tests/_crashpoints.py): at
durable point ``k`` of a program the child does not die, it *pauses*; a second
process (a neighbour) runs one operation to completion on the same directory;
then the child goes on and finishes. Then the checks, in a fresh fork.

Neighbours (:data:`NEIGHBOURS`), each a fork of the fork server:

* ``prune``: ``lazyckpt prune DIR --keep 2`` (``cli.prune.prune``);
* ``verify``: ``verify(DIR)`` (the latest step, every checksum);
* ``inspect``: ``list_directory(DIR)`` and ``describe(DIR)`` (``lazyckpt ls``/``inspect``);
* ``clean``: a Checkpointer opened on DIR, its ``clean_leftovers()``, closed;
* ``takeover``: ``Checkpointer(DIR, takeover=True)``: ``load()``, then a save of
  step :data:`TAKEOVER_STEP` waited for, closed (the first writer is displaced:
  its later commit must be refused, and reported failed);
* ``load``: ``lazyckpt.load(DIR)``.

And the other way round (:data:`COMMITS`, for the programs that are tools
themselves: ``prune-keep2`` and ``clean-leftovers-on-open``): the neighbour
is a writer's commit: ``commit`` (the next step) or ``rollback`` (a run resumed
from three steps back saves the step after it, superseding the newer ones).

Pausing: :class:`PauseInterceptor` overrides ``Interceptor._crash`` (what
happens at call ``k``): it writes the call's description to the parent over a
pipe and blocks reading a second pipe (holding the interceptor's lock: the
child's other threads stop at their next durable call too). A neighbour that
meets a lock the paused child holds would wait forever: in the neighbour the
lock primitive (``locks._flock``) tells the parent when a non-blocking lock
attempt is refused twice on one descriptor (it waits; a liveness probe is
refused once); if the neighbour has not finished ``GRACE_S`` later, the
parent lets the child go on and the two run at once (the outcome says
``blocked``: both orders are then allowed by the checks). A neighbour still
running after ``PAUSE_LIMIT_S`` (a loaded machine) also lets the child go on
(``blocked == "slow"``): the same checks, a concurrent interleaving.

The checks (:func:`check_neighbour_case`), on what each process reported and
what the directory holds afterwards (the oracle: the program's worlds, and
the neighbour's own save, whose values are known):

* every process's outcome is success or an error of lazyckpt's family; only
  a writer displaced by a takeover may fail (and nobody else fails);
* every listed step loads as exactly one of the saves made under that number
  (never a mix, never a half step); ``verify`` of the latest passes;
* the latest is the save that committed last among those reported done
  (prune and cleanup never delete the newest); with no save reported done,
  the latest of one of the program's worlds;
* no committed step is lost unless a process said it removed it: prune's
  report (``done``), the program's own retention (a step its last world does
  not require), a rollback's supersede;
* a ``load`` (or the takeover's) returned the old or the new latest, whole;
  ``verify`` beside a commit reported no problem; ``inspect`` listed only
  steps with a known save; prune's ``kept`` steps are on the line it left,
  the newest among them;
* a restart (a fresh Checkpointer, no manual step) saves and loads a new step,
  and the index agrees with the listing (``index_problems``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import select
import shutil
import signal
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import _crashpoints as cp
from _crashpoints import INFINITY, KNOBS, Ctx, Interceptor, Program, differs, make_state

#: The operations run beside a program.
NEIGHBOURS = ("prune", "verify", "inspect", "clean", "takeover", "load")
#: The writers run beside the tools' own programs.
COMMITS = ("commit", "rollback")
#: The programs that are tools (their own operations get a commit beside them).
TOOL_PROGRAMS = ("prune-keep2", "clean-leftovers-on-open")
#: The step the takeover saves (past every program's steps) and its values' seed.
TAKEOVER_STEP = 100
PRUNE_KEEP = 2
#: After a neighbour met a lock of the paused child: how long it may take to give up on its own.
GRACE_S = 0.5
#: A neighbour still running after this long with the child paused: the child goes on anyway.
PAUSE_LIMIT_S = 30.0


def neighbour_programs() -> List[Program]:
    """The programs of tests/_crashprograms.py on one local Checkpointer
    directory: the tools of :data:`NEIGHBOURS` apply to each."""
    from _crashprograms import local_programs
    return [p for p in local_programs() if p.kind == "dir" and not p.persist]


#: The neighbours of the programs that are not one local Checkpointer directory
#: (:func:`other_programs`), by the program's kind (``persist``: a Checkpointer
#: directory with a persistent tier on the object store):
#:
#: * a lone file (``single-file-save``): ``load``, ``verify`` and ``inspect``
#:   (``describe``) of the file, and ``writer``: a second ``lazyckpt.save`` of
#:   other values to the same path (last rename wins; both report done);
#: * DCP: ``load`` (``dcp.load`` through ``LazyStorageReader`` of the old and the
#:   new checkpoint), ``dcp-load`` (DCP's own ``FileSystemReader``, DCP's layout
#:   only), ``verify``/``inspect`` of each checkpoint's lazyckpt data file
#:   (lazyckpt's layout only: DCP's ``.distcp`` files are not lazyckpt files);
#: * a persistent tier: ``store-load`` (``lazyckpt.load`` of the ``s3://``
#:   prefix), ``store-prune`` (``lazyckpt prune`` of the prefix, ``--keep 2``),
#:   ``takeover`` of the local directory (the same tier), ``open``: a
#:   Checkpointer on the directory and the same tier that only loads (an
#:   evaluation job: no lease taken), ``verify`` of the directory and of the
#:   prefix, and ``load``/``prune`` of the directory;
#: * Lightning's rotation: ``load`` of ``last.ckpt`` through ``LazyCheckpointIO``
#:   (from the directory, and for the mirrored program ``store-load``: the
#:   store's ``last.ckpt``);
#: * the HF Trainer's: ``store-load``, the store's newest complete
#:   ``checkpoint-<step>`` (what a restart with the node lost resumes from);
#: * Megatron: ``megatron-load`` (plain Megatron) and ``lazy-load``
#:   (``LazyLoadStrategy``) of the previous and of the new iteration.
OTHER_NEIGHBOURS = {
    "file": ("load", "verify", "inspect", "writer"),
    "dcp-lazyckpt": ("load", "verify", "inspect"),
    "dcp-dcp": ("load", "dcp-load"),
    "dcp-lazyckpt-s3": ("load",),
    "persist": ("store-load", "store-prune", "takeover", "open", "verify", "load", "prune"),
    "lightning-s3-rotation": ("load",),
    "lightning-persist-rotation": ("load", "store-load"),
    "hf": ("store-load",),
    "megatron": ("megatron-load", "lazy-load"),
}


def neighbours_for(program: Program) -> Tuple[str, ...]:
    """The neighbours run beside ``program``."""
    if program.kind == "dir" and not program.persist:
        return NEIGHBOURS + (COMMITS if program.name in TOOL_PROGRAMS else ())
    if program.kind == "dir":
        return OTHER_NEIGHBOURS["persist"]
    if program.kind in ("dcp", "objects"):
        return OTHER_NEIGHBOURS[program.name]
    return OTHER_NEIGHBOURS[program.kind]


def other_programs(megatron: bool = True) -> List[Program]:
    """The programs :func:`neighbour_programs` leaves out: the lone file, DCP,
    the persistent tier and the frameworks' (Megatron's when ``megatron``)."""
    from _crashprograms import local_programs, persist_programs
    out = [p for p in local_programs() if p.kind != "dir"] + persist_programs()
    if megatron:
        from _crashmegatron import megatron_program
        out.append(megatron_program())
    return out


def all_programs(megatron: bool = True) -> List[Program]:
    return neighbour_programs() + other_programs(megatron)


def pairs(programs: Optional[List[Program]] = None) -> List[Tuple[str, str]]:
    """(program, neighbour) for ``programs`` (the local directory programs by default)."""
    return [(p.name, n) for p in (neighbour_programs() if programs is None else programs)
            for n in neighbours_for(p)]


# ----------------------------------------------------------------------------- the paused child

class PauseInterceptor(Interceptor):
    """At call ``k``: tell the parent (the call's description on ``pause_w``), wait
    for its word on ``go_r``, then make the call: nothing is killed."""

    def __init__(self, root: str, pause_at: int, side_file: str, pause_w: int, go_r: int):
        super().__init__(root, pause_at, side_file, "kill")
        self.pause_w, self.go_r = pause_w, go_r
        self.paused_at: Optional[str] = None

    def _crash(self, desc: str) -> None:
        self._local.busy = True
        try:
            self.paused_at = desc
            self._orig["write"](self.pause_w, (json.dumps({"op": desc, "tag": self.tag}) + "\n").encode())
            while True:
                try:
                    if os.read(self.go_r, 1) is not None:
                        break
                except InterruptedError:
                    continue
        finally:
            self._local.busy = False


def _outcome(fn: Callable[[], Any]) -> Dict[str, Any]:
    """Run ``fn``; its result, or the error it raised (type, message, whether of lazyckpt's family)."""
    from lazyckpt.errors import CheckpointError
    try:
        return {"ok": True, "result": fn()}
    except BaseException as exc:            # reported, judged by the checks
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:1500],
                "family": isinstance(exc, (CheckpointError, ValueError, TypeError)),
                "trace": traceback.format_exc()[-3000:]}


def _child(program: Program, ctx: Ctx, k: int, pause_w: int, go_r: int) -> Dict[str, Any]:
    cp.quiet()
    if program.persist:
        cp._copy_prefix(ctx)                    # the prepared object-store prefix, this case's own
    icp = PauseInterceptor(ctx.case, k, ctx.case + ".side", pause_w, go_r)
    icp.install()
    run = program.run
    if program.name.startswith("prune-keep"):
        keep = int(program.name[len("prune-keep"):])

        def run(ctx: Ctx, icp: Interceptor) -> Dict[str, Any]:      # the program, its report kept
            from lazyckpt.cli.prune import prune
            with icp.operation():
                return _prune_summary(prune(os.path.join(ctx.case, "run"), keep))
    out = _outcome(lambda: run(ctx, icp))
    out.update(count=icp.count, paused_at=icp.paused_at, descriptions=icp.descriptions, tag=icp.tag)
    return out


# ----------------------------------------------------------------------------- the neighbours

def _watch_locks(blocked_w: int) -> None:
    """In a neighbour: tell the parent (once) when it waits for a lock (the paused
    child may hold it: waiting for it there would never end). Waiting is a
    second refusal on the same descriptor (a commit lock is polled); one refusal
    is a probe (is this save alive?), which goes on at once."""
    from lazyckpt.storage import locks
    real = locks._flock
    refused: Dict[int, int] = {}
    told = []

    def flock(fd: int, operation: int) -> None:
        try:
            real(fd, operation)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                refused[fd] = refused.get(fd, 0) + 1
                if refused[fd] >= 2 and not told:
                    told.append(True)
                    os.write(blocked_w, b"b")
            raise
        refused.pop(fd, None)
    locks._flock = flock


def _seed_of(values: Any) -> Any:
    return values.get("step") if isinstance(values, dict) else None


def _match(values: Any, candidates: Dict[str, Any]) -> Optional[str]:
    for name, v in candidates.items():
        if not differs(v, values):
            return name
    return None


def latest_candidates(program: Program) -> Dict[str, Any]:
    """The old or the new latest: what a reader beside the program may get (by world)."""
    return {w.name: w.allowed[w.latest] for w in program.worlds if w.latest is not None}


def store_lag_step(program: Program) -> Optional[int]:
    """A rollback's resumed-from step (the new line's newest below its new step),
    which the store alone returns while the new step uploads; else None. The
    programs' step ``s`` holds ``make_state(s)``: its seed is its step."""
    before, after = program.worlds[0], program.worlds[-1]
    if after.latest is None or before.latest is None or after.latest >= before.latest:
        return None
    below = [s for s in after.allowed if s < after.latest]
    return max(below) if below else None


def commit_plan(program: Program, neighbour: str) -> Tuple[int, Any, Optional[int]]:
    """A commit neighbour's (step, values, step it resumes from)."""
    top = max(program.worlds[0].allowed)
    if neighbour == "commit":
        return top + 1, make_state(60 + top + 1), None
    return top - 2, make_state(70 + top - 2), top - 3


def _ck(ctx: Ctx, **kw: Any) -> Any:
    from _crashprograms import _ck as ck
    return ck(ctx, **kw)


def _prune_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    return {"kept": report["kept"],
            "deleted": sorted(a["step"] for a in report["actions"] if a["what"] == "step" and a["done"]),
            "removed": sorted(a["name"] for a in report["actions"] if a["what"] != "step" and a["done"])}


def run_neighbour(name: str, program: Program, ctx: Ctx) -> Dict[str, Any]:
    """One neighbour's operation on ``ctx.case/run``; returns what it reported."""
    if program.kind != "dir":
        return run_other_neighbour(name, program, ctx)
    d = os.path.join(ctx.case, "run")
    if name == "prune":
        from lazyckpt.cli.prune import prune
        return _prune_summary(prune(d, PRUNE_KEEP))
    if name == "store-prune":
        from lazyckpt.cli.prune import prune
        _store_env(ctx)
        return _prune_summary(prune(ctx.persist_to, PRUNE_KEEP))
    if name == "verify":
        from lazyckpt.loading.verify import verify
        from lazyckpt.storage.stores import LOCAL
        report = verify(d, store=LOCAL)
        problems = [p.message for p in report.problems][:5]
        if program.persist:             # and the persistent tier's copy of its latest save
            from lazyckpt.knobs import resolve
            from lazyckpt.storage.stores import for_path
            remote = verify(ctx.persist_to, resolve(storage_options=ctx.storage_options),
                            store=for_path(ctx.persist_to))
            problems += [f"store: {p.message}" for p in remote.problems][:5]
            return {"ok": report.ok and remote.ok, "problems": problems}
        return {"ok": report.ok, "problems": problems}
    if name == "store-load":
        import lazyckpt
        got = lazyckpt.load(ctx.persist_to, storage_options=ctx.storage_options)
        candidates = latest_candidates(program)
        # The store may lag a rollback (RELIABILITY §1.6): the rollback's supersede reaches it
        # before its new step, and in between a reader of the store alone gets the step the
        # run resumed from, whole (the world "lag").
        lag = store_lag_step(program)
        if lag is not None:
            candidates["lag"] = program.worlds[-1].allowed[lag]
        return {"world": _match(got, candidates), "seed": _seed_of(got)}
    if name == "inspect":
        from lazyckpt.cli.inspect import describe, list_directory
        listing = list_directory(d)
        info = describe(d)
        return {"steps": [r["step"] for r in listing["steps"]], "latest": listing["latest"],
                "described": info.get("step")}
    if name == "clean":
        with _ck(ctx, keep=None) as ck:
            removed = ck.clean_leftovers()
        return {"removed": removed}
    if name == "load":
        import lazyckpt
        got = lazyckpt.load(d)
        return {"world": _match(got, latest_candidates(program)), "seed": _seed_of(got)}
    if name == "takeover":
        from lazyckpt.errors import CheckpointNotFoundError
        # With a persistent tier, the run that takes over uses the same tier.
        with _ck(ctx, persist=program.persist, keep=None, takeover=True) as ck:
            try:
                got = ck.load()
                world, seed = _match(got, latest_candidates(program)), _seed_of(got)
            except CheckpointNotFoundError:
                world, seed = None, None
            ck.save(make_state(TAKEOVER_STEP), step=TAKEOVER_STEP).wait(
                **({"persisted": True} if program.persist else {}))
        return {"world": world, "seed": seed, "saved": TAKEOVER_STEP}
    if name == "open":
        with _ck(ctx, persist=program.persist, keep=None) as ck:
            got = ck.load()
        return {"world": _match(got, latest_candidates(program)), "seed": _seed_of(got)}
    if name in COMMITS:
        step, values, resume = commit_plan(program, name)
        with _ck(ctx, keep=None) as ck:
            if resume is not None and resume in ck.steps():
                ck.load(step=resume)            # resumed from an older step (a tool may have deleted it)
            ck.save(values, step=step).wait()
        return {"saved": step}
    raise ValueError(f"unknown neighbour {name!r}")


def _store_env(ctx: Ctx) -> None:
    """The object store's endpoint and keys in the environment: ``lazyckpt prune``
    of an ``s3://`` prefix takes them from there, as the command line does."""
    o = ctx.storage_options or {}
    for var, key in (("AWS_ENDPOINT_URL", "endpoint_url"), ("AWS_ACCESS_KEY_ID", "access_key_id"),
                     ("AWS_SECRET_ACCESS_KEY", "secret_access_key"), ("AWS_REGION", "region"),
                     ("AWS_DEFAULT_REGION", "region")):
        if o.get(key):
            os.environ[var] = o[key]


def _refused(exc: BaseException) -> bool:
    """A DCP load's refusal of a checkpoint not (yet) there: no file, or lazyckpt's
    own refusal (DCP without a process group re-raises the reader's error inside a
    CheckpointException, whose ``failures`` hold it)."""
    from lazyckpt.errors import CheckpointError
    causes = [exc] + list(getattr(exc, "failures", {}).values())
    causes += [c[0] for c in causes if isinstance(c, tuple) and c]     # (the exception, its frames)
    # DCP's own reader finds no .metadata: "metadata is None; global metadata read failed: [Errno 2] ...".
    return any(isinstance(c, (FileNotFoundError, CheckpointError)) or "no committed DCP checkpoint" in str(c)
               or "global metadata read failed: [Errno 2]" in str(c) for c in causes)


def _verdict(read: Callable[[], Any], allowed: Dict[str, Any], refused: Callable[[BaseException], bool]) -> str:
    """Which of ``allowed`` (name: values) ``read()`` returned whole, "refused" (no
    checkpoint there), or what else happened (judged by the checks)."""
    try:
        got = read()
    except BaseException as exc:        # DCP's CheckpointException is a BaseException
        return "refused" if refused(exc) else f"error: {type(exc).__name__}: {str(exc)[:500]}"
    return _match(got, allowed) or f"other values (seed {_seed_of(got)})"


def run_other_neighbour(name: str, program: Program, ctx: Ctx) -> Dict[str, Any]:
    """The neighbours of a lone file, DCP, Lightning, the HF Trainer and Megatron
    (:data:`OTHER_NEIGHBOURS`): each returns a verdict per checkpoint it read."""
    import lazyckpt
    if program.kind == "file":
        path = os.path.join(ctx.case, "model.lzc")
        if name == "load":
            got = lazyckpt.load(path)
            return {"world": _match(got, latest_candidates(program)), "seed": _seed_of(got)}
        if name == "verify":
            from lazyckpt.loading.verify import verify
            from lazyckpt.storage.stores import LOCAL
            report = verify(path, store=LOCAL)
            return {"ok": report.ok, "problems": [p.message for p in report.problems][:5]}
        if name == "inspect":
            from lazyckpt.cli.inspect import describe
            info = describe(path)
            return {"kind": info["kind"], "leaves": len(info["files"][0]["leaves"])}
        if name == "writer":
            lazyckpt.save(make_state(TAKEOVER_STEP), path, **KNOBS)
            return {"saved": TAKEOVER_STEP}
    if program.kind == "dcp":
        import torch.distributed.checkpoint as dcp
        from lazyckpt.integrations.dcp import LazyStorageReader
        place = program.kwargs["place"]
        old, new = program.kwargs["old"], program.worlds[-1].allowed[2]
        options = {"storage_options": ctx.storage_options} if ctx.storage_options else {}
        if name in ("load", "dcp-load"):
            def read(where: str) -> Any:
                into = make_state(0)
                reader = dcp.FileSystemReader(place(ctx, where)) if name == "dcp-load" else \
                    LazyStorageReader(place(ctx, where), **options)
                dcp.load(into, storage_reader=reader, no_dist=True)
                return into
            return {"step1": _verdict(lambda: read("step1"), {"old": old}, _refused),
                    "step2": _verdict(lambda: read("step2"), {"new": new}, _refused)}
        if name in ("verify", "inspect"):
            from lazyckpt.cli.inspect import describe
            from lazyckpt.errors import CheckpointNotFoundError
            from lazyckpt.loading.verify import verify
            from lazyckpt.storage.stores import LOCAL
            out = {}
            for where in ("step1", "step2"):
                path = os.path.join(place(ctx, where), "__0.lzc")
                try:
                    out[where] = verify(path, store=LOCAL).ok if name == "verify" else describe(path)["kind"] == "file"
                except (CheckpointNotFoundError, FileNotFoundError):
                    out[where] = "absent"
            return out
    if program.kind == "objects":
        from lazyckpt.integrations.lightning import LazyCheckpointIO
        allowed = latest_candidates(program)
        if program.mirror_dir is None or name == "store-load":
            where = f"{ctx.persist_to}/{program.mirror_dir}/last.ckpt" if program.mirror_dir else \
                f"{ctx.persist_to}/last.ckpt"
            plugin = LazyCheckpointIO(storage_options=ctx.storage_options, **KNOBS)
        else:
            where = os.path.join(ctx.case, program.mirror_dir, "last.ckpt")
            plugin = LazyCheckpointIO(**KNOBS)
        got = plugin.load_checkpoint(where)
        plugin.teardown()
        return {"world": _match(got, allowed), "seed": _seed_of(got)}
    if program.kind == "hf":
        from lazyckpt.integrations.hf_callbacks import CHECKPOINT_DIR
        from lazyckpt.knobs import resolve
        from lazyckpt.storage.stores import for_path
        names = for_path(ctx.persist_to).list_files(ctx.persist_to, resolve(storage_options=ctx.storage_options),
                                                    recursive=True)
        complete = sorted({n.split("/")[0] for n in names if n.endswith("/trainer_state.json")},
                          key=lambda n: int(CHECKPOINT_DIR.match(n).group(1)))
        if not complete:
            return {"newest": None}
        saved = lazyckpt.load(f"{ctx.persist_to}/{complete[-1]}/lazyckpt.lzc", storage_options=ctx.storage_options)
        return {"newest": complete[-1], "global_step": saved["global_step"],
                "step": int(CHECKPOINT_DIR.match(complete[-1]).group(1))}
    if program.kind == "megatron":
        import _crashmegatron as cm
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.core import CheckpointingException
        cm._init()

        def read(where: str) -> Any:
            strategy = None
            if name == "lazy-load":
                from lazyckpt.integrations.megatron import LazyLoadStrategy
                strategy = LazyLoadStrategy()
            return dist_checkpointing.load(cm.sharded({k: torch.zeros(s) for k, s in cm.SHAPES.items()}),
                                           os.path.join(ctx.case, where), strategy)

        def refused(exc: BaseException) -> bool:      # absent, or no metadata.json: not a checkpoint
            return isinstance(exc, CheckpointingException) and (
                "is not a distributed checkpoint" in str(exc) or "does not exist" in str(exc))
        return {"iter1": _verdict(lambda: read("iter1"), {"old": cm.values(1)}, refused),
                "iter2": _verdict(lambda: read("iter2"), {"new": program.worlds[-1].allowed[2]}, refused)}
    raise ValueError(f"unknown neighbour {name!r} of {program.name}")


def _neighbour_child(name: str, program: Program, ctx: Ctx, blocked_w: int) -> Dict[str, Any]:
    cp.quiet()
    from lazyckpt.storage import s3
    s3._stores.clear()
    _watch_locks(blocked_w)
    return _outcome(lambda: run_neighbour(name, program, ctx))


# ----------------------------------------------------------------------------- forks

class _Fork:
    """A forked child whose pickled result comes back on a pipe (``cp.report_and_exit``)."""

    def __init__(self, fn: Callable[[], Any], close_in_child: Tuple[int, ...] = ()):
        self.r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.r)
            for fd in close_in_child:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                payload, code = ("ok", fn()), 0
            except BaseException:
                payload, code = ("error", traceback.format_exc()), 1
            cp.report_and_exit(w, payload, code)
        os.close(w)
        self.chunks: List[bytes] = []
        self.done = False
        self.result: Tuple[str, Any] = ("running", None)

    def pump(self) -> bool:
        """Read what is there; True once the child's pipe is closed."""
        if self.done:
            return True
        chunk = os.read(self.r, 1 << 16)
        if chunk:
            self.chunks.append(chunk)
            return False
        self._reap()
        return True

    def _reap(self) -> None:
        import pickle
        os.close(self.r)
        self.done = True
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status):
            self.result = ("killed", os.WTERMSIG(status))
        elif not self.chunks:
            self.result = ("error", f"exited {os.waitstatus_to_exitcode(status)} without a result")
        else:
            self.result = pickle.loads(b"".join(self.chunks))

    def kill(self) -> None:
        if not self.done:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
            os.close(self.r)
            os.waitpid(self.pid, 0)
            self.done = True
            self.result = ("timeout", None)


def _wait(fds: List[int], timeout: float) -> List[int]:
    ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
    return ready


def _run_paused(k: int, start_child: Callable[[int, int], Any], start_neighbour: Callable[[int], Any],
                timeout: float) -> Tuple[Dict[str, Any], _Fork, Optional[_Fork]]:
    """Fork the program (``start_child(pause_w, go_r)``), wait for it to pause,
    fork the neighbour (``start_neighbour(blocked_w)``), let the program go on
    when the neighbour ends (or meets its lock, or is slow), both to the end."""
    pause_r, pause_w = os.pipe()
    go_r, go_w = os.pipe()
    out: Dict[str, Any] = {"k": k, "op": None, "blocked": False, "child": None, "neighbour": None, "problems": []}
    child = _Fork(lambda: start_child(pause_w, go_r), close_in_child=(pause_r, go_w))
    os.close(pause_w)
    os.close(go_r)
    deadline = time.monotonic() + timeout
    nb: Optional[_Fork] = None
    released = False
    try:
        # Until the child pauses (or ends: no point k this time).
        buf = b""
        while not child.done and out["op"] is None:
            for fd in _wait([child.r, pause_r], deadline - time.monotonic()):
                if fd == child.r:
                    child.pump()
                elif fd == pause_r:
                    data = os.read(pause_r, 1 << 16)
                    buf += data
                    if b"\n" in buf:
                        out["op"] = json.loads(buf.split(b"\n", 1)[0])["op"]
            if time.monotonic() > deadline:
                raise TimeoutError("the child neither paused nor ended")
        if out["op"] is not None:
            blocked_r, blocked_w = os.pipe()
            nb = _Fork(lambda: start_neighbour(blocked_w),
                       close_in_child=(pause_r, go_w, child.r, blocked_r))
            os.close(blocked_w)
            limit = time.monotonic() + PAUSE_LIMIT_S
            while not nb.done:
                fds = [nb.r] + ([blocked_r] if blocked_r >= 0 else [])
                ready = _wait(fds, limit - time.monotonic())
                if not ready:
                    break                               # still running: the child goes on anyway
                if nb.r in ready:
                    nb.pump()
                    continue
                if blocked_r in ready:
                    os.read(blocked_r, 16)
                    os.close(blocked_r)
                    blocked_r = -1
                    grace = time.monotonic() + GRACE_S
                    while not nb.done and _wait([nb.r], grace - time.monotonic()):
                        nb.pump()
                    if not nb.done:
                        out["blocked"] = True
                        break
            if blocked_r >= 0:
                os.close(blocked_r)
            if not nb.done and not out["blocked"]:
                out["blocked"] = "slow"
            os.write(go_w, b"g")
            released = True
        # Both to the end.
        while not child.done or (nb is not None and not nb.done):
            fds = [f.r for f in (child, nb) if f is not None and not f.done]
            ready = _wait(fds, deadline - time.monotonic())
            if not ready:
                raise TimeoutError("the child or the neighbour did not end")
            for f in (child, nb):
                if f is not None and not f.done and f.r in ready:
                    f.pump()
    except TimeoutError as exc:
        out["problems"].append(f"harness: {exc} (paused before {out['op']})")
        for f in (child, nb):
            if f is not None:
                f.kill()
    finally:
        if not released:
            try:
                os.write(go_w, b"g")
            except OSError:
                pass
        os.close(go_w)
        os.close(pause_r)
    return out, child, nb


def run_neighbour_case(program: Program, neighbour: str, work: str, k: int,
                       timeout: float = 300.0, s3: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Pause the program at point ``k``, run ``neighbour`` to completion (or until
    it meets the child's lock), let the program finish, then check.
    Returns {"k", "op", "blocked", "child", "neighbour", "problems"}."""
    case = os.path.join(work, f"case-{neighbour}-{k}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    ctx = cp._ctx(program, case, s3, f"nb-{neighbour}-{k}")
    out, child, nb = _run_paused(k, lambda pause_w, go_r: _child(program, ctx, k, pause_w, go_r),
                                 lambda blocked_w: _neighbour_child(neighbour, program, ctx, blocked_w), timeout)
    out["child"] = child.result
    out["neighbour"] = nb.result if nb is not None else None
    if out["problems"]:
        return out
    if child.result[0] != "ok":
        out["problems"].append(f"the program's child: {child.result[0]}: {str(child.result[1])[-2000:]}")
        return out
    if out["op"] is None:
        out["op"] = f"(no point {k}: the program made {child.result[1]['count']} calls this time)"
        _cleanup(case)
        return out
    if nb.result[0] != "ok":
        out["problems"].append(f"the neighbour's child: {nb.result[0]}: {str(nb.result[1])[-2000:]}")
        return out
    c, n = child.result[1], nb.result[1]
    check = check_neighbour_case if program.kind == "dir" else check_other_case
    status, value = cp.run_forked(lambda: (cp.quiet(), check(ctx, program, neighbour, c, n, out["blocked"]))[1],
                                  timeout=300)
    out["problems"] = value if status == "ok" else [f"the check: {status}: {str(value)[-2000:]}"]
    _cleanup(case)
    return out


# ----------------------------------------------------------------------------- with replicas (2 nodes)

#: Beside a replicated job (tests/_crashreplicas.py: two gloo ranks, one node each, rank 0 paused
#: at its node's point k, rank 1 waiting for it in the job's collectives): ``verify`` and
#: ``load`` of node 0's directory (an ordinary Checkpointer directory of rank 0's files).
REPLICA_NEIGHBOURS = ("verify", "load")


def _paused_rank(program: Any, case: str, rank: int, k: int, pause_w: int, go_r: int) -> Dict[str, Any]:
    import _crashreplicas as cr
    cp.quiet()
    icp = None
    if rank == 0:
        icp = PauseInterceptor(cr.node_dir(case, 0), k, case + ".side", pause_w, go_r)
        icp.install()
    program.run(case, rank, icp)
    return {"count": icp.count, "paused_at": icp.paused_at} if icp is not None else {}


def _replica_neighbour(name: str, program: Any, case: str, blocked_w: int) -> Dict[str, Any]:
    import _crashreplicas as cr
    cp.quiet()
    _watch_locks(blocked_w)

    def run() -> Dict[str, Any]:
        d = cr.node_dir(case, 0)
        if name == "verify":
            from lazyckpt.loading.verify import verify
            from lazyckpt.storage.stores import LOCAL
            report = verify(d, store=LOCAL)
            return {"ok": report.ok, "problems": [p.message for p in report.problems][:5]}
        import lazyckpt
        got = lazyckpt.load(d)
        before, after = program.before(0), program.after(0)
        world = "before" if not differs(before[max(before)], got) else \
            "after" if not differs(after[max(after)], got) else None
        return {"world": world, "seed": _seed_of(got)}
    return _outcome(run)


def run_replica_neighbour_case(program: Any, neighbour: str, work: str, k: int,
                               timeout: float = 300.0, nothing_until: int = 0) -> Dict[str, Any]:
    """Pause rank 0 of the replicated job at its point ``k``, run ``neighbour`` on
    node 0's directory, let the job finish; then the neighbour's report and the
    replica harness's restarts (A, B0, B1: ``_crashreplicas.check_case``).
    ``nothing_until``: node 0 held no step before the operation (a lost node being
    restored) and its record is replaced at that point: up to it, a reader of
    node 0 alone rightly finds no checkpoint."""
    import _crashreplicas as cr
    case = os.path.join(work, f"case-{neighbour}-{k}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    out, child, nb = _run_paused(
        k, lambda pause_w, go_r: cr.run_job(lambda rank, peers: _paused_rank(program, case, rank, k, pause_w, go_r),
                                            timeout=timeout),
        lambda blocked_w: _replica_neighbour(neighbour, program, case, blocked_w), timeout)
    out["child"] = child.result
    out["neighbour"] = nb.result if nb is not None else None
    if out["problems"]:
        return out
    ranks = child.result[1] if child.result[0] == "ok" else None
    if ranks is None or any(status != "ok" for status, _ in ranks):
        out["problems"].append(f"the job: {str(child.result)[-3000:]}")
        return out
    if out["op"] is None:
        out["op"] = f"(no point {k}: rank 0 made {ranks[0][1]['count']} calls this time)"
        _cleanup(case)
        return out
    if nb.result[0] != "ok":
        out["problems"].append(f"the neighbour's child: {nb.result[0]}: {str(nb.result[1])[-2000:]}")
        return out
    n = nb.result[1]
    if not n["ok"] and k <= nothing_until and "CheckpointNotFoundError" in n["error"]:
        pass                    # node 0 holds nothing yet: the restore's commit point is still ahead
    elif not n["ok"]:
        out["problems"].append(f"the neighbour ({neighbour}) failed: {n['error']}")
    elif neighbour == "verify" and not n["result"]["ok"]:
        out["problems"].append(f"verify of node 0 beside the job reported problems: {n['result']['problems']}")
    elif neighbour == "load" and n["result"]["world"] is None:
        out["problems"].append(f"load of node 0 beside the job returned seed {n['result']['seed']}, neither "
                               f"rank 0's old nor its new latest")
    try:
        out["problems"] += cr.check_case(case, program)
    except Exception:
        out["problems"].append(f"the check: {traceback.format_exc()[-2000:]}")
    _cleanup(case)
    cp._cleanup(case + ".lose1", case + ".lose1.side")
    return out


def enumerate_replica_pair(program: Any, neighbour: str, work: str, points: Optional[List[int]] = None,
                           log: Optional[Callable[[str], None]] = None) -> Outcome:
    import _crashreplicas as cr
    t0 = time.monotonic()
    n, descriptions = cr.dry_run(program, work)
    nothing_until = 0
    node0 = cr.node_dir(os.path.join(work, "prepared"), 0)
    if not any(name.startswith("step_") for name in (os.listdir(node0) if os.path.isdir(node0) else [])):
        nothing_until = next((i for i, d in enumerate(descriptions, 1)
                              if "os.replace" in d and "history.json" in d), 0)
    return _run_points(program, neighbour, n, points, t0, log,
                       lambda k: run_replica_neighbour_case(program, neighbour, work, k, nothing_until=nothing_until))


def _cleanup(case: str) -> None:
    shutil.rmtree(case, ignore_errors=True)
    for extra in (case + ".side", case + ".side.backups"):
        shutil.rmtree(extra, ignore_errors=True)
        try:
            os.unlink(extra)
        except OSError:
            pass


# ----------------------------------------------------------------------------- the checks

def check_neighbour_case(ctx: Ctx, program: Program, neighbour: str, child: Dict[str, Any],
                         nb: Dict[str, Any], blocked: Any) -> List[str]:
    """What each process reported against what the directory holds, then a restart."""
    import lazyckpt
    from lazyckpt.errors import CheckpointNotFoundError
    problems: List[str] = []
    d = os.path.join(ctx.case, "run")
    saver = len(program.worlds) > 1            # the program commits a save (its last world's latest)
    c_step = program.worlds[-1].latest if saver else None
    c_values = program.worlds[-1].allowed[c_step] if saver else None
    n_step, n_values = None, None
    if neighbour == "takeover":
        n_step, n_values = TAKEOVER_STEP, make_state(TAKEOVER_STEP)
    elif neighbour in COMMITS:
        n_step, n_values, _ = commit_plan(program, neighbour)
    c_ok, n_ok = child["ok"], nb["ok"]
    # -- the reports themselves
    for who, o in (("the program", child), (f"the neighbour ({neighbour})", nb)):
        if not o["ok"] and not o["family"]:
            problems.append(f"{who} raised outside lazyckpt's family: {o['error']}\n{o['trace']}")
    if not c_ok and neighbour != "takeover":
        problems.append(f"the program failed beside {neighbour}: {child['error']}\n{child['trace'][-1500:]}")
    if not n_ok:
        first_save = not program.worlds[0].allowed
        # A writer resuming from a step that prune (paused) holds for its deletion is told it
        # was deleted while read, and saves nothing: the documented answer of a load racing prune.
        resume_deleted = neighbour == "rollback" and "was deleted while it was being read" in nb.get("error", "")
        if not (first_save and "CheckpointNotFound" in nb.get("error", "")) and not resume_deleted:
            problems.append(f"the neighbour ({neighbour}) failed: {nb['error']}")
    # -- the saves made under each step number (the oracle of "no mix, no half step")
    known: Dict[int, List[Any]] = {}
    for w in program.worlds:
        for s, v in w.allowed.items():
            known.setdefault(s, []).append(v)
    if n_step is not None:
        known.setdefault(n_step, []).append(n_values)
    try:
        ck = cp._checkpointer(ctx, program)
    except Exception as exc:
        return problems + [f"Checkpointer(dir) after both: {type(exc).__name__}: {exc}"]
    problems += cp.index_problems(d, "after both, at the restart's open")
    try:
        listed = ck.steps()
        values: Dict[int, Any] = {}
        for s in listed:
            try:
                values[s] = ck.load(step=s)
            except Exception as exc:
                problems.append(f"load(step={s}) of a listed step: {type(exc).__name__}: {exc}")
                continue
            if not any(not differs(v, values[s]) for v in known.get(s, [])):
                problems.append(f"step {s} is listed but holds no save made under that number (a mix, a half "
                                f"step or an abandoned save; steps() = {listed})")
        try:
            ck.load()
            latest = ck.loaded_from["step"]
        except CheckpointNotFoundError:
            latest = None
        if listed and latest != listed[-1]:
            problems.append(f"load() returned step {latest}, the listing's newest is {listed[-1]}")
        # -- the newest: the save that committed last among those reported done
        c_done = saver and c_ok
        n_done = n_step is not None and n_ok
        # The program's commit point may come before the pause or after it: with both
        # reported done, either may be the newest (and the other on the line or superseded).
        newest = [s for s, done in ((c_step, c_done), (n_step, n_done)) if done] or None
        if newest:
            if latest not in newest:
                problems.append(f"the newest save reported done is step {newest}, load() returns step {latest} "
                                f"(listed {listed})")
            else:
                want = c_values if latest == c_step and c_done else n_values
                if latest in values and differs(want, values[latest]):
                    problems.append(f"step {latest}, reported done, loads other values")
        elif newest is None:
            worlds = {w.latest for w in program.worlds}
            if latest not in worlds:
                problems.append(f"no save was reported done, yet the latest is step {latest} (the worlds' "
                                f"latest steps: {sorted(worlds, key=str)})")
        if n_step is not None and not n_ok and n_step in values and not differs(n_values, values[n_step]):
            problems.append(f"the {neighbour}'s save of step {n_step} was reported failed, yet it is listed")
        if saver and not c_ok and latest == c_step and c_step in values and not differs(c_values, values[c_step]):
            if not (n_done and blocked):
                problems.append(f"the program's save of step {c_step} was reported failed ({child['error']}), "
                                f"yet it is the latest and loads as that save")
        # -- no committed step lost unless someone said it removed it
        required = set(program.worlds[0].required)
        if n_done:
            required.add(n_step)
        if c_done:
            required.add(c_step)
        excused = set()
        if saver:
            excused |= set(program.worlds[0].required) - set(program.worlds[-1].required)   # its own retention
        for name, o in (("program", child), ("neighbour", nb)):
            res = o.get("result")
            if o["ok"] and isinstance(res, dict) and "deleted" in res:
                excused |= set(res["deleted"])
        for s, done in ((c_step, c_done), (n_step, n_done)):
            if done:                             # a rollback supersedes the steps above it
                excused |= {t for t in required if t > s}
        lost = sorted(required - excused - set(listed))
        if lost:
            problems.append(f"committed step(s) {lost} are gone and no process said it removed them "
                            f"(steps() = {listed}; program: {_short(child)}; {neighbour}: {_short(nb)})")
        # -- what the neighbour (and prune as the program) reported
        res = nb.get("result") if n_ok else None
        if neighbour in ("load", "takeover", "store-load", "open") and res is not None:
            allowed = set(latest_candidates(program))
            if res["world"] is None and \
                    not (res["seed"] is None and any(w.latest is None for w in program.worlds)):
                problems.append(f"{neighbour}: load() beside the program returned step seed {res['seed']}, "
                                f"neither the old nor the new latest ({sorted(allowed)})")
        if neighbour == "verify" and res is not None and not res["ok"]:
            problems.append(f"verify beside the program reported problems: {res['problems']}")
        if neighbour == "inspect" and res is not None:
            unknown = [s for s in res["steps"] if s not in known]
            if unknown:
                problems.append(f"inspect listed step(s) {unknown}, which no save made")
        if program.name.startswith("prune") and c_ok:
            kept = child["result"]["kept"] if isinstance(child.get("result"), dict) else None
            if kept is not None:
                # The line prune left; a rollback beside it that committed later supersedes its top.
                gone = [s for s in kept if s not in listed and not (n_done and s > n_step)]
                if gone:
                    problems.append(f"prune reported keeping {kept}; {gone} are not on the line ({listed})")
        # -- a restart keeps going
        if verify_problems := _verify(d, listed):
            problems.append(verify_problems)
        new_step = (latest or 0) + 1
        restart = make_state(999)
        try:
            ck.save(restart, step=new_step, metadata=program.restart_metadata).wait()
            got = ck.load()
            if ck.loaded_from["step"] != new_step or differs(restart, got):
                problems.append(f"restart: save(step={new_step}).wait() then load() returned step "
                                f"{ck.loaded_from['step']} / other values")
        except Exception as exc:
            problems.append(f"restart: save(step={new_step}): {type(exc).__name__}: {exc}")
        problems += cp.index_problems(d, "after the restart's save")
        if program.persist:
            problems += _store_problems(ctx, program, known)
    finally:
        try:
            ck.close()
        except Exception as exc:
            problems.append(f"close(): {type(exc).__name__}: {exc}")
    return problems


def _store_problems(ctx: Ctx, program: Program, known: Dict[int, List[Any]]) -> List[str]:
    """With a persistent tier, after both and the restart: the store's index
    names its newest live save, and the store alone (a Checkpointer on an empty
    directory) loads a save made under the step it names."""
    problems = cp.remote_index_problems(ctx.persist_to, ctx.storage_options, "after both and the restart")
    try:
        with cp._checkpointer(ctx, program, os.path.join(ctx.case, "alone")) as alone:
            got = alone.load()
            s = alone.loaded_from["step"]
            if not any(not differs(v, got) for v in known.get(s, [])) and differs(make_state(999), got):
                problems.append(f"the store alone loads step {s}, which holds no save made under that number")
    except Exception as exc:
        problems.append(f"the store alone: {type(exc).__name__}: {exc}")
    return problems


def check_other_case(ctx: Ctx, program: Program, neighbour: str, child: Dict[str, Any],
                     nb: Dict[str, Any], blocked: Any) -> List[str]:
    """A lone file, DCP, Lightning, the HF Trainer, Megatron: both processes
    succeed; what the neighbour read was the old or the new checkpoint, whole,
    or (a checkpoint the program is writing) refused as not there; then the
    program's own checks (tests/_crashpoints.py) on what it left, with only its
    last world allowed (it reported done), and a restart."""
    problems: List[str] = []
    for who, o in (("the program", child), (f"the neighbour ({neighbour})", nb)):
        if not o["ok"]:
            problems.append(f"{who} failed beside the other: {o['error']}\n{o['trace'][-1500:]}")
    res = nb.get("result") if nb["ok"] else None
    if res is not None:
        if "world" in res and res["world"] is None:
            problems.append(f"{neighbour} beside the program returned seed {res['seed']}, neither the old nor "
                            f"the new checkpoint ({sorted(latest_candidates(program))})")
        if "ok" in res and not res["ok"]:
            problems.append(f"{neighbour} beside the program reported problems: {res['problems']}")
        if neighbour == "inspect" and program.kind == "file" and res["kind"] != "file":
            problems.append(f"inspect beside the program: {res}")
        for before, after in (("step1", "step2"), ("iter1", "iter2")):
            if before in res:
                if res[before] not in ("old", True):
                    problems.append(f"{neighbour}: {before}, committed before the program, read as {res[before]}")
                if res[after] not in ("new", "refused", "absent", True):
                    problems.append(f"{neighbour}: {after}, the program's, neither whole nor refused as no "
                                    f"checkpoint: {res[after]}")
        if program.kind == "hf" and res.get("newest") is not None and (
                res["step"] not in {w.latest for w in program.worlds} or res["global_step"] != res["step"]):
            problems.append(f"store-load: the store's newest complete checkpoint {res['newest']} holds step "
                            f"{res['global_step']}")
        if program.kind == "hf" and res.get("newest") is None:
            problems.append("store-load: no complete checkpoint on the store beside the program")
    done = dataclasses.replace(program, worlds=program.worlds[-1:], worlds_at=None)
    if program.kind == "file":
        if neighbour == "writer":           # both reported done: the last rename's values
            done = dataclasses.replace(done, worlds=done.worlds + [
                cp.World("writer", TAKEOVER_STEP, {TAKEOVER_STEP: make_state(TAKEOVER_STEP)})])
        left = [n for n in os.listdir(ctx.case) if n != "model.lzc"]
        if left:
            problems.append(f"after both saves returned, the directory holds more than the file: {left}")
    problems += cp.check_case(ctx, done)
    return problems


def _verify(d: str, listed: List[int]) -> Optional[str]:
    if not listed:
        return None
    from lazyckpt.loading.verify import verify
    from lazyckpt.storage.stores import LOCAL
    report = verify(d, store=LOCAL)
    return None if report.ok else f"verify after both: {[p.message for p in report.problems][:3]}"


def _short(o: Dict[str, Any]) -> str:
    if not o["ok"]:
        return f"failed: {o['error'][:300]}"
    res = o.get("result")
    return f"done: {res}" if isinstance(res, dict) else "done"


# ----------------------------------------------------------------------------- one pair

@dataclasses.dataclass
class Outcome:
    program: str
    neighbour: str
    points: int
    checked: int
    blocked: int
    violations: List[Dict[str, Any]]
    seconds: float


def enumerate_pair(program: Program, neighbour: str, work: str, points: Optional[List[int]] = None,
                   log: Optional[Callable[[str], None]] = None, s3: Optional[Dict[str, Any]] = None) -> Outcome:
    """A dry run (its point count), then the neighbour at each point (or ``points``);
    ``s3`` (bucket, storage_options): the object store of a program with ``persist``."""
    t0 = time.monotonic()
    cp.preload(program)
    n, _ = cp.dry_run(program, work, s3)
    return _run_points(program, neighbour, n, points, t0, log,
                       lambda k: run_neighbour_case(program, neighbour, work, k, s3=s3))


def _run_points(program: Program, neighbour: str, n: int, points: Optional[List[int]], t0: float,
                log: Optional[Callable[[str], None]], run_case: Callable[[int], Dict[str, Any]]) -> Outcome:
    """``run_case(k)`` at each point of ``points`` (None: 1..n; those past n left out), tallied."""
    violations, checked, blocked = [], 0, 0
    for k in (points if points is not None else range(1, n + 1)):
        if k > n:
            continue
        result = run_case(k)
        checked += 1
        blocked += bool(result["blocked"])
        if result["problems"]:
            violations.append(result)
            if log:
                log(f"{program.name} + {neighbour} k={k}/{n} {result['op']}: {result['problems']}")
    return Outcome(program.name, neighbour, n, checked, blocked, violations, time.monotonic() - t0)


def sample(n: int, how_many: int, salt: str) -> List[int]:
    """``how_many`` points of 1..n, spread, with an offset that differs by pair."""
    import zlib
    if n <= how_many:
        return list(range(1, n + 1))
    off = zlib.crc32(salt.encode()) % n
    return sorted({(off + i * n // how_many) % n + 1 for i in range(how_many)})


def summarize(o: Outcome) -> str:
    lines = [f"{o.program} + {o.neighbour}: {o.points} points, {o.checked} run, {o.blocked} met a lock of "
             f"the paused program, {len(o.violations)} with violations, {o.seconds:.1f} s"]
    for v in o.violations:
        lines.append(f"  k={v['k']} paused before {v['op']}: " + " | ".join(v["problems"])[:2000])
    return "\n".join(lines)


def megatron_available() -> bool:
    try:
        from _megatron import stub_triton_kernels
        stub_triton_kernels()
        import megatron.core.dist_checkpointing  # noqa: F401
    except Exception:
        return False
    return True


def s3_server(work: str) -> Tuple[Any, Dict[str, Any]]:
    """A SeaweedFS server (tests/_s3server.py), started, and a bucket on it."""
    from _s3server import SeaweedServer
    server = SeaweedServer(os.path.join(work, "seaweedfs"))
    return server, server.crash_store()


def main() -> None:
    """python tests/_crashneighbours.py [--out FILE] [--shard I/N] [--skip ROWS.json] [--every N [--offset O]]
    [--all] [PROGRAM[+NEIGHBOUR] ...]: every point of every pair of the local
    directory programs (``--all``: of every program, the persistent tier's on a
    SeaweedFS server started here, the replica programs' first); ``--shard``:
    the pairs I, I+N, ...; ``--skip``: pairs a saved run has; ``--every N``:
    every N-th point from 1 + O (a sample)."""
    import argparse
    import sys
    import tempfile
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--shard", default="0/1")
    parser.add_argument("--skip", default=None)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--offset", type=int, default=0, help="with --every: start at point 1 + OFFSET")
    parser.add_argument("--all", action="store_true")
    parser.add_argument("only", nargs="*")
    args = parser.parse_args()
    listed = all_programs(megatron_available()) if args.all or args.only else neighbour_programs()
    programs = {p.name: p for p in listed}
    shard, shards = (int(x) for x in args.shard.split("/"))
    done = set()
    if args.skip:
        with open(args.skip) as f:
            done = {(r["program"], r["neighbour"]) for r in json.load(f)}
    rows = []
    server, s3 = None, None
    top = tempfile.mkdtemp(prefix="nb-")
    import _crashreplicas as cr
    replicated = {p.name: p for p in cr.dist_programs()}
    try:
        for name, neighbour in [(p, n) for p in replicated for n in REPLICA_NEIGHBOURS]:
            if not (args.all and not args.only) and name not in args.only and f"{name}+{neighbour}" not in args.only:
                continue
            if (name, neighbour) in done:
                continue
            with tempfile.TemporaryDirectory(prefix="nb-", dir=top) as work:
                points = None
                if args.every > 1:
                    n, _ = cr.dry_run(replicated[name], work)
                    points = list(range(1 + args.offset, n + 1, args.every))
                o = enumerate_replica_pair(replicated[name], neighbour, work, points=points,
                                           log=lambda m: print(m, file=sys.stderr, flush=True))
            print(summarize(o), flush=True)
            rows.append({"program": o.program, "neighbour": o.neighbour, "points": o.points, "checked": o.checked,
                         "blocked": o.blocked, "violations": len(o.violations), "seconds": round(o.seconds, 1),
                         "details": [{"k": v["k"], "op": v["op"], "problems": v["problems"]} for v in o.violations]})
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
        for i, (name, neighbour) in enumerate(pairs(listed)):
            if args.only and name not in args.only and f"{name}+{neighbour}" not in args.only:
                continue
            if i % shards != shard or (name, neighbour) in done:
                continue
            program = programs[name]
            if program.persist and server is None:
                server, s3 = s3_server(top)
            with tempfile.TemporaryDirectory(prefix="nb-", dir=top) as work:
                points = None
                if args.every > 1:
                    n, _ = cp.dry_run(program, work, s3 if program.persist else None)
                    points = list(range(1 + args.offset, n + 1, args.every))
                o = enumerate_pair(program, neighbour, work, points=points, s3=s3 if program.persist else None,
                                   log=lambda m: print(m, file=sys.stderr, flush=True))
            print(summarize(o), flush=True)
            rows.append({"program": o.program, "neighbour": o.neighbour, "points": o.points, "checked": o.checked,
                         "blocked": o.blocked, "violations": len(o.violations), "seconds": round(o.seconds, 1),
                         "details": [{"k": v["k"], "op": v["op"], "problems": v["problems"]} for v in o.violations]})
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys_path = os.path.dirname(os.path.abspath(__file__))
    import sys
    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    main()
