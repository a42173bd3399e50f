"""The error mode of the crash-point harness (tests/_crashpoints.py): at point
``k`` the durable call *fails* and the process goes on.

* :class:`FaultInterceptor` -- the interceptor of ``_crashpoints`` with mode
  ``"error"``: the ``k``-th counted call raises ``OSError`` instead of being
  made (ENOSPC for writes and for calls that create: an open with a create
  flag, ``mkdir``, ``link``, ``symlink``; EIO for everything else, ``fsync``
  and ``fdatasync`` included); every other call is made. An object-store
  request answers HTTP 500 ``InternalError`` without reaching the server
  (the case's client makes one attempt, so the library sees it).
  The strerror of an injected error starts with :data:`MARK`.
* ``fsync`` EIO is modelled as Linux does it: the pages written since the
  file's last good ``fsync`` are marked clean and may be gone, and the next
  ``fsync`` succeeds. The interceptor keeps, per inode, the byte ranges
  written since its last good ``fsync`` (``os.write``/``pwrite``/``writev``/
  ``pwritev``; a file opened with ``open()`` whose writes are not seen counts
  as written whole); when the operation ends, every range the failed
  ``fsync`` covered and that no later write rewrote is overwritten with
  :data:`POISON` bytes on disk. A library that takes such data as durable
  commits garbage, which the checks then load (or fail to).
* :func:`run_case` runs, in one forked child: the program's operation with
  the fault at ``k`` (what it raised is *the report*), the poisoning, then
  three checks: **the report** (an error is of the library's family or an
  ``OSError``, and names the injected fault in its chain or its message: not
  swallowed, not replaced); **what is committed** right then, read without a
  lease (a save reported failed is not loaded as that save; one reported done
  loads its exact values); **the next save** in the same process (the
  Checkpointer the program made, unless it was closed: a retry of the same
  step after a failure, the next step after a success; a file program saves
  the file again) succeeds and loads. Then a fresh process runs the
  kill mode's checks (``_crashpoints.check_case``) against the one world that
  next save left, including a restart's save.
  Kinds "objects" and "hf" (Lightning, the HF Trainer) get the report check
  and the fresh process's checks against the program's own worlds; they
  have no next save in the same process. Kind "megatron" (tests/_crashmegatron.py)
  is read with plain Megatron's load: iter1 whole, iter2 whole where the save
  returned and refused as no checkpoint where it raised; its next save is iter2
  again. Kind "deepspeed" (tests/_crashdeepspeed.py) is read as DeepSpeed reads
  a directory: ``latest`` names step1 where the save raised, step2 where it
  returned, and that tag's files hold its weights; its next save is tag step2
  again with the same engine.
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import json
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import _crashpoints as cp
from _crashpoints import INFINITY, Ctx, Interceptor, Program, World, differs, make_state

#: Starts the strerror of every injected error: how the report check finds it in a chain or a message.
MARK = "injected fault"
#: What a range lost to a failed fsync reads as after the operation.
POISON = b"\xa5"
#: The values of the next save after the operation (same process).
NEXT = make_state(777)


def fault_errno(op: str) -> int:
    """The errno an injected failure of the call described by ``op`` carries."""
    if op.startswith(("os.write ", "os.pwrite ", "os.writev ", "os.pwritev ", "os.sendfile ",
                      "os.copy_file_range ", "os.posix_fallocate ", "os.mkdir ", "os.link ", "os.symlink ")):
        return errno_mod.ENOSPC
    if op.startswith("os.open ") and "O_CREAT" in op:
        return errno_mod.ENOSPC
    if op.startswith("open ") and any(c in op.rsplit(" ", 1)[-1] for c in "wax"):
        return errno_mod.ENOSPC
    return errno_mod.EIO


class _Injected(OSError):
    """An injected failure (an OSError: the library sees nothing else)."""


class FaultInterceptor(Interceptor):
    """The ``k``-th counted call fails (see the module's docstring)."""

    def __init__(self, root: str, fail_at: int, side_file: str):
        super().__init__(root, fail_at, side_file, mode="error")
        self.fault: Optional[Dict[str, Any]] = None
        self.injected: Optional[BaseException] = None
        self.dirty: Dict[int, List[Tuple[int, int]]] = {}      # ino -> ranges written since its last good fsync
        self.lost: Dict[int, List[Tuple[int, int]]] = {}       # ino -> ranges a failed fsync may have dropped
        self.whole: set = set()                                # inodes written through open(): ranges unknown
        self.checkpointers: List[Any] = []                     # made in this process, newest last

    # ---------------------------------------------------------------- the fault

    def _crash(self, desc: str) -> None:
        op = desc.split("] ", 1)[1]
        code = fault_errno(op)
        self.fault = {"point": self.crash_at, "op": desc, "tag": self.tag,
                      "errno": "HTTP 500" if op.startswith("s3 ") else errno_mod.errorcode[code]}
        if op.startswith("s3 "):
            raise _S3Fault(desc)
        exc = _Injected(code, f"{MARK}: {os.strerror(code)} ({op})")
        self.injected = exc
        raise exc

    # ---------------------------------------------------------------- fsync EIO: the pages it may have lost

    def _ino(self, fd: int) -> Optional[int]:
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        return st.st_ino if not (st.st_mode & 0o170000 == 0o040000) else None

    def _wrap_fd_op(self, name: str, fn: Callable, kind: str) -> Callable:
        inner = super()._wrap_fd_op(name, fn, kind)
        if kind not in ("write", "sync"):
            return inner
        me = self

        def wrapper(fd: int, *args: Any, **kwargs: Any) -> Any:
            if me._busy() or not me.armed or not me._under(me._fdpath(fd)):
                return inner(fd, *args, **kwargs)
            ino = me._ino(fd)
            start = None
            if kind == "write" and ino is not None:
                if name in ("pwrite", "pwritev") and len(args) > 1:
                    start = args[1]
                else:
                    try:
                        start = os.lseek(fd, 0, os.SEEK_CUR)
                    except OSError:
                        start = None
            try:
                result = inner(fd, *args, **kwargs)
            except _Injected as exc:
                if kind == "sync" and exc is me.injected and ino is not None:
                    with me._lock:
                        ranges = me.dirty.pop(ino, [])
                        if ino in me.whole:
                            ranges = [(0, 1 << 62)]
                        me.lost.setdefault(ino, []).extend(ranges)
                raise
            if ino is None:
                return result
            with me._lock:
                if kind == "write" and start is not None and isinstance(result, int) and result > 0:
                    me.dirty.setdefault(ino, []).append((start, start + result))
                    if ino in me.lost:
                        me.lost[ino] = _subtract(me.lost[ino], (start, start + result))
                elif kind == "sync":
                    me.dirty.pop(ino, None)
            return result
        return wrapper

    def _open_common(self, p: str, creates: bool, truncates: bool, desc: str, do_open: Callable) -> Any:
        result = super()._open_common(p, creates, truncates, desc, do_open)
        if desc.startswith("open "):
            try:
                self.whole.add(os.stat(p).st_ino)
            except OSError:
                pass
        return result

    def apply_lost(self) -> List[str]:
        """Overwrite on disk what a failed fsync may have dropped and nothing rewrote."""
        done: List[str] = []
        if not any(self.lost.values()):
            return done
        self._local.busy = True
        try:
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    p = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(p)
                    except OSError:
                        continue
                    ranges = self.lost.get(st.st_ino)
                    if not ranges or not os.path.isfile(p) or os.path.islink(p):
                        continue
                    fd = os.open(p, os.O_WRONLY)
                    try:
                        for a, b in ranges:
                            b = min(b, st.st_size)
                            if b > a:
                                os.pwrite(fd, POISON * (b - a), a)
                                done.append(f"{self._rel(p)}: bytes {a}-{b} lost with the failed fsync")
                    finally:
                        os.close(fd)
        finally:
            self._local.busy = False
        return done

    # ---------------------------------------------------------------- the object store: an HTTP 500

    def _install_s3_hook(self) -> None:
        try:
            from lazyckpt.storage import s3
        except Exception:
            return
        me = self
        s3._stores.clear()

        def before_send(request: Any = None, **_kw: Any) -> Any:
            method = getattr(request, "method", "")
            if me.armed and not me._busy() and method in ("PUT", "POST", "DELETE"):
                url = getattr(request, "url", "")
                try:
                    me.point(f"s3 {method} {url.split('://', 1)[-1].split('/', 1)[-1]}")
                except _S3Fault:
                    return _error_response(url)
            return None
        original = s3.ObjectStore.__init__

        def init(self_store: Any, *args: Any, **kwargs: Any) -> None:
            original(self_store, *args, **kwargs)
            self_store.client.meta.events.register("before-send.s3", before_send)
        s3.ObjectStore.__init__ = init

    # ---------------------------------------------------------------- the Checkpointers the program makes

    def install(self) -> None:
        super().install()
        track_checkpointers(self.checkpointers)


def track_checkpointers(made: List[Any]) -> None:
    """Append every Checkpointer this process makes to ``made`` (newest last);
    one closed is marked ``_crasherrors_closed``."""
    import lazyckpt
    init, close = lazyckpt.Checkpointer.__init__, lazyckpt.Checkpointer.close

    def tracked_init(self_ck: Any, *args: Any, **kwargs: Any) -> None:
        init(self_ck, *args, **kwargs)
        made.append(self_ck)

    def tracked_close(self_ck: Any, *args: Any, **kwargs: Any) -> None:
        try:
            close(self_ck, *args, **kwargs)
        finally:
            self_ck._crasherrors_closed = True
    lazyckpt.Checkpointer.__init__ = tracked_init
    lazyckpt.Checkpointer.close = tracked_close


class _S3Fault(Exception):
    pass


def _error_response(url: str) -> Any:
    from botocore.awsrequest import AWSResponse
    body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
            f"<Message>{MARK}: the server failed</Message></Error>").encode()

    class Raw:
        def stream(self, **_kw: Any) -> Any:
            yield body
    return AWSResponse(url, 500, {"Content-Type": "application/xml", "Content-Length": str(len(body))}, Raw())


def _subtract(ranges: List[Tuple[int, int]], cut: Tuple[int, int]) -> List[Tuple[int, int]]:
    out = []
    for a, b in ranges:
        if cut[1] <= a or cut[0] >= b:
            out.append((a, b))
            continue
        if a < cut[0]:
            out.append((a, cut[0]))
        if cut[1] < b:
            out.append((cut[1], b))
    return out


# ----------------------------------------------------------------------------- the report

def _chain(exc: BaseException) -> List[BaseException]:
    seen: List[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen) or len(seen) > 50:
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        # DCP's CheckpointException: failures = {rank: (exception, its traceback)}.
        for v in (getattr(e, "failures", None) or {}).values():
            todo += [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, BaseException)]
        todo += [v for v in (getattr(e, "exceptions", None) or ()) if isinstance(v, BaseException)]
    return seen


def report_problems(raised: Optional[BaseException], fault: Optional[Dict[str, Any]], kind: str) -> List[str]:
    """What the operation raised, against the fault: of the family, naming its cause."""
    from lazyckpt.errors import CheckpointError
    if raised is None:
        return []
    what = f"{type(raised).__name__}: {str(raised)[:300]}"
    if fault is None:
        return [f"the operation raised with no fault injected: {what}"]
    problems = []
    chain = _chain(raised)
    if kind in ("dcp", "hf", "megatron", "deepspeed"):
        # A framework wraps what the storage layer raised (DCP: CheckpointException).
        family = any(isinstance(e, (CheckpointError, OSError)) for e in chain)
    else:
        family = isinstance(raised, (CheckpointError, OSError))
    if not family:
        problems.append(f"raised outside the library's family (and not an OSError): {what}")
    named = any(MARK in str(e) or (isinstance(e, OSError) and MARK in str(e.strerror or "")) for e in chain)
    if not named:
        problems.append(f"the error neither chains nor names the injected fault ({fault['op']}): {what}")
    return problems


def describe(exc: Optional[BaseException]) -> Optional[str]:
    if exc is None:
        return None
    return " <- ".join(f"{type(e).__name__}: {str(e)[:200]}" for e in _chain(exc)[:4])


# ----------------------------------------------------------------------------- what is committed, the next save

def _is_the_save(program: Program, world: World) -> bool:
    """Whether ``world`` is the operation's save done (programs list it last)."""
    return len(program.worlds) > 1 and world is program.worlds[-1]


def committed_dir(ctx: Ctx, program: Program, raised: bool) -> Tuple[Optional[World], List[str]]:
    """Right after the operation, without a lease: the latest step and its values."""
    import lazyckpt
    from lazyckpt.errors import CheckpointNotFoundError
    from lazyckpt.storage.layout import CheckpointDir
    directory = os.path.join(ctx.case, "run")
    step, got = None, None
    if os.path.isdir(directory):
        try:
            step = CheckpointDir(directory).latest()
            if step is not None:
                got = lazyckpt.load(directory)
        except CheckpointNotFoundError:
            step = None
        except Exception as exc:
            return None, [f"right after the operation: load(): {type(exc).__name__}: {exc}"]
    world, why = cp._world_of(program.worlds, step, got)
    if world is None:
        return None, [f"right after the operation: {why}"]
    if raised and _is_the_save(program, world):
        return world, [f"the operation raised, yet its save is committed and loads (step {step}, "
                       f"world '{world.name}')"]
    if not raised and len(program.worlds) > 1 and not _is_the_save(program, world):
        return world, [f"the operation returned, yet its save is not what loads (step {step}, world "
                       f"'{world.name}')"]
    return world, []


def next_step(program: Program, raised: bool, world: Optional[World]) -> int:
    """A retry of the operation's step after a failure; the step after it after a success."""
    target = program.worlds[-1].latest or 0
    if len(program.worlds) == 1:
        return target + 1
    return target if raised else target + 1


def next_world(program: Program, world: Optional[World], step: int) -> World:
    base = world if world is not None else program.worlds[0]
    allowed = {s: v for s, v in base.allowed.items() if s < step}
    required: Tuple[int, ...] = (step,)
    if program.kwargs.get("keep") is None and world is not None:
        required = tuple(s for s in world.required if s < step) + (step,)
    return World("next save", step, {**allowed, step: NEXT}, required)


def next_save_dir(ctx: Ctx, program: Program, icp: FaultInterceptor, step: int) -> List[str]:
    directory = os.path.join(ctx.case, "run")
    own = [c for c in icp.checkpointers if os.path.realpath(str(c.directory)) == os.path.realpath(directory)]
    ck = own[-1] if own and not getattr(own[-1], "_crasherrors_closed", False) else None
    fresh = ck is None
    problems: List[str] = []
    try:
        if fresh:
            ck = cp._checkpointer(ctx, program)
        bad = cp.save_and_reload(ck, program, NEXT, step)
        if bad:
            problems.append(f"next save in the same process: {bad}")
    except Exception as exc:
        problems.append(f"next save in the same process ({'a fresh' if fresh else 'the same'} Checkpointer, "
                        f"step {step}): {type(exc).__name__}: {str(exc)[:500]}")
    finally:
        if ck is not None:
            try:
                ck.close()
            except Exception as exc:
                problems.append(f"next save in the same process: close(): {type(exc).__name__}: {exc}")
    return problems


def reported_committed(raised: Optional[BaseException]) -> bool:
    """Whether the error says its save is in place though not durable
    (``committed``: a lone file whose directory's fsync failed after its rename)."""
    return raised is not None and any(getattr(e, "committed", False) for e in _chain(raised))


def committed_file(ctx: Ctx, program: Program, raised: Optional[BaseException]) -> List[str]:
    import lazyckpt
    path = os.path.join(ctx.case, "model.lzc")
    try:
        got = lazyckpt.load(path)
    except Exception as exc:
        return [f"right after the operation: load(model.lzc): {type(exc).__name__}: {exc}"]
    old, new = program.worlds[0], program.worlds[-1]
    if not differs(new.allowed[new.latest], got):
        return ["the operation raised, yet the file holds its save"] if raised and not reported_committed(raised) \
            else []
    if not differs(old.allowed[old.latest], got):
        if reported_committed(raised):
            return ["the error says the new file is in place, yet the file holds the old values"]
        return [] if raised else ["the operation returned, yet the file holds the old values"]
    return ["right after the operation: the file holds neither the old nor the new values"]


def committed_dcp(ctx: Ctx, program: Program, raised: bool) -> List[str]:
    import torch.distributed.checkpoint as dcp
    from lazyckpt.integrations.dcp import LazyStorageReader
    place = program.kwargs["place"]
    options = {"storage_options": ctx.storage_options} if ctx.storage_options else {}
    into = make_state(0)
    try:
        dcp.load(into, storage_reader=LazyStorageReader(place(ctx, "step2"), **options), no_dist=True)
    except BaseException as exc:
        return [f"the operation returned, yet step2 does not load: {type(exc).__name__}: {str(exc)[:300]}"] \
            if not raised else []
    if differs(program.worlds[-1].allowed[2], into):
        return ["right after the operation: step2 loads other values than its save"]
    return ["the operation raised, yet step2 is a checkpoint and loads"] if raised else []


def committed_megatron(ctx: Ctx, program: Program, raised: bool) -> List[str]:
    """Right after the operation, with plain Megatron: iter1 loads bit-exact; iter2
    loads its values where the save returned, and is refused as no checkpoint where
    it raised (tests/_crashmegatron.py)."""
    import _crashmegatron as cm
    problems: List[str] = []
    old = program.worlds[0].allowed[1]
    try:
        if differs(old, cm.load(os.path.join(ctx.case, "iter1"))):
            problems.append("right after the operation: iter1 loads other values")
    except Exception as exc:
        problems.append(f"right after the operation: iter1: {type(exc).__name__}: {str(exc)[:300]}")
    try:
        got = cm.load(os.path.join(ctx.case, "iter2"))
    except Exception as exc:
        if raised:
            return problems + ([] if cm.refused_as_no_checkpoint(exc) else
                               [f"the operation raised; iter2 is neither refused as no checkpoint nor loaded: "
                                f"{type(exc).__name__}: {str(exc)[:300]}"])
        return problems + [f"the operation returned, yet iter2 does not load: {type(exc).__name__}: "
                           f"{str(exc)[:300]}"]
    if differs(program.worlds[-1].allowed[2], got):
        return problems + ["right after the operation: iter2 loads other values than its save"]
    return problems + (["the operation raised, yet iter2 is a checkpoint and loads"] if raised else [])


def committed_deepspeed(ctx: Ctx, program: Program, raised: bool) -> List[str]:
    """Right after the operation, read as DeepSpeed reads a directory: ``latest``
    names step1 where the save raised, step2 where it returned, and that tag's
    files hold its weights (tests/_crashdeepspeed.py)."""
    import _crashdeepspeed as cd
    world = program.worlds[0] if raised else program.worlds[-1]
    told = "the operation raised" if raised else "the operation returned"
    return [f"{told}; {p}" for p in cd.committed_problems(os.path.join(ctx.case, "ds"),
                                                          dataclasses.replace(program, worlds=[world]),
                                                          "right after the operation")]


# ----------------------------------------------------------------------------- one case

def _error_child(program: Program, ctx: Ctx, k: int, side: str) -> Dict[str, Any]:
    cp.quiet()
    if program.persist:
        cp._copy_prefix(ctx)
    icp = FaultInterceptor(ctx.case, k, side)
    icp.install()
    raised: Optional[BaseException] = None
    try:
        program.run(ctx, icp)
    except BaseException as exc:      # what the API reported (DCP's CheckpointException is a BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raised = exc
    finally:
        icp.armed = False
    out: Dict[str, Any] = {"count": icp.count, "descriptions": icp.descriptions, "tag": icp.tag,
                           "fault": icp.fault, "raised": describe(raised), "problems": [], "world": None}
    out["lost"] = icp.apply_lost()
    problems = out["problems"]
    problems += report_problems(raised, icp.fault, program.kind)
    if program.kind == "dir":
        world, found = committed_dir(ctx, program, raised is not None)
        problems += found
        step = next_step(program, raised is not None, world)
        failed = next_save_dir(ctx, program, icp, step)
        problems += failed
        # A next save that failed leaves what the operation left: the fresh process checks that.
        out["world"] = next_world(program, world, step) if not failed else None
    elif program.kind == "file":
        problems += committed_file(ctx, program, raised)
        import lazyckpt
        try:
            path = os.path.join(ctx.case, "model.lzc")
            lazyckpt.save(NEXT, path, **cp.KNOBS)
            if differs(NEXT, lazyckpt.load(path)):
                problems.append("next save in the same process: save() then load() differs")
            else:
                out["world"] = World("next save", 1, {1: NEXT})
        except Exception as exc:
            problems.append(f"next save in the same process: {type(exc).__name__}: {exc}")
    elif program.kind == "megatron":
        problems += committed_megatron(ctx, program, raised is not None)
        import _crashmegatron as cm
        values = cm.values(777)
        try:
            iter2 = os.path.join(ctx.case, "iter2")
            cm.save(iter2, values)
            if differs(values, cm.load(iter2)):
                problems.append("next save in the same process: iter2 saved again, then loaded, differs")
            else:
                out["world"] = World("next save", 2, {2: values})
        except BaseException as exc:
            problems.append(f"next save in the same process: iter2 again: {type(exc).__name__}: "
                            f"{str(exc)[:500]}")
    elif program.kind == "deepspeed":
        problems += committed_deepspeed(ctx, program, raised is not None)
        import _crashdeepspeed as cd
        try:
            directory = os.path.join(ctx.case, "ds")
            cd.save(cd.LAST[0], directory, "step2")
            if cd.read_latest(directory) != "step2" or differs(cd.values(2), cd.read_tag(directory, "step2")):
                problems.append(f"next save in the same process: step2 saved again, then latest names "
                                f"{cd.read_latest(directory)!r} / other weights")
            else:
                out["world"] = World("next save", 2, {2: cd.values(2)})
        except BaseException as exc:
            problems.append(f"next save in the same process: step2 again: {type(exc).__name__}: "
                            f"{str(exc)[:500]}")
    elif program.kind == "dcp":
        problems += committed_dcp(ctx, program, raised is not None)
        try:
            program.kwargs["save"](ctx, NEXT, "step2")
            out["world"] = World("next save", 2, {2: NEXT})
        except BaseException as exc:
            problems.append(f"next save in the same process: dcp.save(step2) again: {type(exc).__name__}: "
                            f"{str(exc)[:500]}")
    return out


def _fresh_program(program: Program, world: Optional[World]) -> Program:
    if world is None:
        return program
    return dataclasses.replace(program, worlds=[world], worlds_at=None)


def run_case(program: Program, work: str, k: int, s3: Optional[Dict[str, Any]] = None,
             seen: Optional[Dict[str, List[str]]] = None) -> Dict[str, Any]:
    """The fault at point ``k``, the same process's checks, then a fresh process's.
    Returns {"k", "op", "status", "problems", "dropped", "duplicate", "raised"}."""
    case = os.path.join(work, f"case-error-{k}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    ctx = cp._ctx(program, case, s3, f"error-{k}")
    side = case + ".side"
    # The faulted process makes one attempt per request (the injected 500 reaches the
    # library); the fresh process keeps botocore's retries (a slow server is no fault).
    faulted = cp._ctx(program, case, _error_s3(s3), f"error-{k}")
    status, value = cp.run_forked(lambda: _error_child(program, faulted, k, side), timeout=300)
    out: Dict[str, Any] = {"k": k, "op": None, "status": status, "problems": [], "dropped": [], "duplicate": False,
                           "raised": None}
    if status != "ok":
        out["problems"].append(f"the faulted process: {status}: {str(value)[-2000:]}")
        cp._cleanup(case, side)
        return out
    fault = value["fault"]
    out["op"] = fault["op"] + f" -> {fault['errno']}" if fault else \
        f"(no point {k}: the program made {value['count']} calls this time)"
    out["raised"] = value["raised"]
    out["dropped"] = value["lost"]
    out["problems"] = list(value["problems"])
    program = _fresh_program(program, value["world"])
    fp = None
    if seen is not None and not program.persist and program.kind in ("dir", "file"):
        fp = cp.fingerprint(ctx.case) + repr(sorted(program.worlds[0].allowed))
        if fp in seen:
            out["duplicate"] = True
            out["problems"] += seen[fp]
            cp._cleanup(case, side)
            return out
    status, checked = cp.run_forked(lambda: (cp.quiet(), cp.check_case(ctx, program))[1], timeout=300)
    fresh = [f"the check: {status}: {str(checked)[-2000:]}"] if status != "ok" else \
        [f"fresh process: {p}" for p in checked]
    if fp is not None:
        seen[fp] = fresh
    out["problems"] += fresh
    cp._cleanup(case, side)
    return out


def _error_s3(s3: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """One attempt per request: the injected 500 reaches the library, not botocore's retry."""
    if s3 is None:
        return None
    return {**s3, "storage_options": {**s3["storage_options"], "max_attempts": 1}}


def enumerate_program(program: Program, work: str, s3: Optional[Dict[str, Any]] = None,
                      points: Optional[List[int]] = None, log: Optional[Callable[[str], None]] = None,
                      every: int = 1, always_last: int = 0) -> cp.Outcome:
    """Dry run, then the fault at every point (or at ``points``; ``every``: every
    ``every``-th from 1, plus the last ``always_last``) and the checks."""
    t0 = time.monotonic()
    cp.preload(program)
    n, descriptions = cp.dry_run(program, work, s3)
    if points is None:
        points = sorted(set(range(1, n + 1, every)) | set(range(max(1, n - always_last + 1), n + 1)))
    seen: Dict[str, List[str]] = {}
    violations, checked = [], 0
    for k in points:
        result = run_case(program, work, k, s3, seen)
        checked += not result["duplicate"]
        if result["problems"]:
            violations.append(result)
            if log:
                log(f"{program.name} error k={k}/{n} {result['op']} raised {result['raised']}: "
                    f"{result['problems']}")
    return cp.Outcome(program.name, "error", n, descriptions, violations, checked, time.monotonic() - t0, [])


def main() -> None:
    """``python tests/_crasherrors.py [PROGRAM...] [--every N] [--first F] [--points K,K..]``:
    every point of the local programs (or those named; a replica program of
    tests/_crashreplicas.py by its name, each point's result printed as it ends),
    the counts and violations printed."""
    import argparse
    import sys
    import tempfile
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _crashprograms import local_programs
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--first", type=int, default=1, help="replica programs: the first point")
    parser.add_argument("--points", default=None, help="comma-separated points (instead of --every)")
    args = parser.parse_args()
    points = [int(k) for k in args.points.split(",")] if args.points else None
    import _crashreplicas as cr
    for program in [p for p in cr.dist_programs() if p.name in args.names]:
        with tempfile.TemporaryDirectory(prefix="lazyckpt-errors-") as work:
            outcome = enumerate_dist_program(program, work, points=points, every=args.every, first=args.first,
                                             log=lambda s: print(s, flush=True), progress=True)
            print(cp.summarize(outcome), flush=True)
            print(json.dumps({"program": program.name, "points": outcome.points, "checked": outcome.checked,
                              "violations": len(outcome.violations)}), flush=True)
    programs = [p for p in local_programs() if not args.names or p.name in args.names]
    for program in programs:
        with tempfile.TemporaryDirectory(prefix="lazyckpt-errors-") as work:
            outcome = enumerate_program(program, work, every=args.every, points=points,
                                        log=lambda s: print(s, flush=True))
            print(cp.summarize(outcome), flush=True)
            print(json.dumps({"program": program.name, "points": outcome.points, "checked": outcome.checked,
                              "violations": len(outcome.violations)}), flush=True)



# ----------------------------------------------------------------------------- with replicas= (2 nodes)

#: The commit timeout of the faulted job's ranks (seconds): long enough for a loaded machine's rounds.
DIST_COMMIT_TIMEOUT = 15.0


def _dist_rank(program: Any, case: str, rank: int, k: int, side: str) -> Dict[str, Any]:
    """One rank of the faulted job (tests/_crashreplicas.py): rank 0's ``k``-th call
    fails; both ranks report what they raised, open the directory anew (collective,
    so on both: the same Checkpointer is kept by neither), check what loads, make
    the next save (a retry of step 3 where any rank raised, else step 4), wait for
    its replica round and load it."""
    import torch.distributed as dist
    import _crashreplicas as cr
    from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
    cp.quiet()
    # Rank 0's save failing before the replica round never joins it: rank 1's round waits
    # the commit timeout for it, then fails (its step stays unreplicated; the next save's
    # round is checked). 60 s of waiting a point: bounded here, in this job's ranks only.
    cr.COMMIT_TIMEOUT = DIST_COMMIT_TIMEOUT
    icp = FaultInterceptor(cr.node_dir(case, 0), k, side) if rank == 0 else None
    made: List[Any] = []        # the program's Checkpointers, on either rank
    if icp is not None:
        icp.install()
        made = icp.checkpointers
    else:
        track_checkpointers(made)
    raised: Optional[BaseException] = None
    try:
        program.run(case, rank, icp)
    except Exception as exc:
        raised = exc
    finally:
        if icp is not None:
            icp.armed = False
    out: Dict[str, Any] = {"problems": [], "raised": describe(raised), "fault": icp.fault if icp else None,
                           "count": icp.count if icp else None, "descriptions": icp.descriptions if icp else [],
                           "lost": icp.apply_lost() if icp else [], "world": None, "step": None}
    problems = out["problems"]
    if icp is not None:
        problems += report_problems(raised, icp.fault, "dir")
    elif raised is not None and not isinstance(raised, (CheckpointError, OSError)):
        problems.append(f"rank 1 raised outside the library's family: {describe(raised)}")
    # A program that raised left its Checkpointer open (its writer lease held): closed
    # here on each rank, as a caller would before opening the directory again.
    for ck in made:
        if not getattr(ck, "_crasherrors_closed", False):
            try:
                ck.close(cancel=True)
            except Exception:
                pass
    flags: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, raised is not None)
    step = 3 if any(flags) else 4
    before, after = program.before(rank), program.after(rank)
    values = make_state(100 * rank + 777)
    ck = None
    try:
        ck = cr._ck(case, rank)
        try:
            got = ck.load()
            s = ck.loaded_from["step"]
            is_before = s == max(before) and not differs(before[s], got)
            is_after = s == max(after) and not differs(after[s], got)
            # A program whose lines end alike (the restore: the same step 2 before and after)
            # cannot tell them apart, and either report agrees with it.
            world = "same" if is_before and is_after else "before" if is_before else \
                "after" if is_after else None
            if world is None:
                problems.append(f"rank {rank}: right after the operation: load() returned step {s}, neither "
                                f"line's latest")
            elif world == "after" and any(flags) and rank == 0 and raised is not None \
                    and not reported_committed(raised):
                problems.append(f"rank {rank}: the operation raised, yet its save (step {s}) loads")
            elif world == "before" and not any(flags):
                problems.append(f"rank {rank}: the operation returned, yet step {s} of the line before loads")
            out["world"] = world
        except CheckpointNotFoundError:
            problems.append(f"rank {rank}: right after the operation: nothing loads")
        h = ck.save(values, step=step)
        h.wait()
        ck.wait()
        got = ck.load()
        if ck.loaded_from["step"] != step or differs(values, got):
            problems.append(f"rank {rank}: next save: save(step={step}) then load() returned step "
                            f"{ck.loaded_from['step']} / other values")
        if h.replica_state != "replicated":
            problems.append(f"rank {rank}: next save (step {step}): replica state {h.replica_state!r}")
        out["step"] = step
    except Exception as exc:
        problems.append(f"rank {rank}: reopen and next save (step {step}): {type(exc).__name__}: {str(exc)[:500]}")
    finally:
        if ck is not None:
            try:
                ck.close()
            except Exception as exc:
                problems.append(f"rank {rank}: close(): {type(exc).__name__}: {exc}")
    return out


def run_dist_case(program: Any, work: str, k: int) -> Dict[str, Any]:
    import _crashreplicas as cr
    case = os.path.join(work, f"case-error-{k}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    side = case + ".side"
    results = cr.run_job(lambda rank, peers: _dist_rank(program, case, rank, k, side), timeout=300)
    out: Dict[str, Any] = {"k": k, "op": None, "status": results[0][0], "problems": [], "dropped": [],
                           "duplicate": False, "raised": None}
    if any(s != "ok" for s, _ in results):
        out["problems"].append(f"the faulted job: {results}"[-3000:])
        cp._cleanup(case, side)
        return out
    r0, r1 = results[0][1], results[1][1]
    fault = r0["fault"]
    out["op"] = fault["op"] + f" -> {fault['errno']}" if fault else f"(no point {k}: {r0['count']} calls)"
    out["raised"] = f"rank 0: {r0['raised']}; rank 1: {r1['raised']}"
    out["dropped"] = r0["lost"]
    out["problems"] = r0["problems"] + r1["problems"]
    if r0["step"] is not None and r1["step"] is not None and not out["problems"]:
        step = r0["step"]
        worlds = [r0["world"], r1["world"]]

        def line(rank: int) -> Dict[int, Any]:
            base = program.after(rank) if worlds[rank] == "after" else program.before(rank)
            return {**{s: v for s, v in base.items() if s < step}, step: make_state(100 * rank + 777)}
        fresh = dataclasses.replace(program, before=line, after=line)
        try:
            out["problems"] += [f"fresh job: {p}" for p in cr.check_case(case, fresh)]
        except Exception as exc:
            out["problems"].append(f"the check: {type(exc).__name__}: {exc}")
    cp._cleanup(case, side)
    shutil.rmtree(case + ".lose1", ignore_errors=True)
    return out


def enumerate_dist_program(program: Any, work: str, points: Optional[List[int]] = None, every: int = 1,
                           first: int = 1, log: Optional[Callable[[str], None]] = None,
                           progress: bool = False) -> cp.Outcome:
    """Dry run, then the fault at every point (or at ``points``; or every ``every``-th
    from ``first``). ``progress``: ``log`` each point's outcome as it ends too."""
    import _crashreplicas as cr
    t0 = time.monotonic()
    n, descriptions = cr.dry_run(program, work)
    violations = []
    pts = points if points is not None else list(range(first, n + 1, every))
    for k in pts:
        result = run_dist_case(program, work, k)
        if progress and log:
            log(f"{program.name} error k={k}/{n} {'VIOLATION' if result['problems'] else 'ok'} "
                f"({time.monotonic() - t0:.0f} s)")
        if result["problems"]:
            violations.append(result)
            if log:
                log(f"{program.name} error k={k}/{n} {result['op']} raised {result['raised']}: "
                    f"{result['problems']}")
    return cp.Outcome(program.name, "error", n, descriptions, violations, len(pts), time.monotonic() - t0, [])


if __name__ == "__main__":
    main()
