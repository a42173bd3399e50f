"""Enumerated crash points with the replica tier (issue 33 item 4, "with
replicas= (2 nodes)"): the harness of tests/_crashpoints.py for a job of two
gloo ranks, one per node (``replicas=1, node_size=1``), each node with its
own local directory ``CASE/node0``, ``CASE/node1``.

* Every job is two ``fork()``s of the fork server (torch and lazyckpt
  imported once; the server never initializes torch.distributed), a gloo
  process group over a fresh TCP port per job.
* The operation under test runs on both ranks; only rank 0's mutating calls
  under ``CASE/node0`` are numbered (the interceptor is installed in rank 0
  alone). At point ``k`` rank 0 SIGKILLs rank 1, then itself: a job whose
  rank died is dead (the fork server also kills whatever rank outlives a
  dead one). Rank 1 dies wherever it was: its own commit or replica round
  may be ahead of rank 0's or behind it.
* ``power`` mode: node 0 loses power (the journal of rank 0's calls is
  applied to ``CASE/node0``); node 1 is only killed (its page cache kept).
* The checks restart the whole job (two fresh ranks) three times:
  A: both nodes as they are: ``load()`` (collective) returns, on both ranks,
  the same step, the line's latest before the operation or the new step,
  bit-exact for that rank; ``steps()`` lists only steps of that line and
  keeps the ones committed before; each listed step loads its own save
  bit-exact; ``verify(node dir)`` passes. Then B0 and B1: node 0's, resp.
  node 1's, local directory deleted (a lost node; B1 on a copy of the
  directories after A): ``load()`` on both ranks returns the same step of
  the line (before or after, never an abandoned or partial save), bit-exact,
  the lost node's from its partner's replica; then a new ``save().wait()``
  and ``wait()`` on both ranks, replicated, and ``load()`` returns it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pickle
import select
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import _crashpoints as cp
from _crashpoints import INFINITY, KNOBS, Interceptor, differs, make_state

RANKS = 2


def state(rank: int, step: int) -> Any:
    """Step ``step`` of rank ``rank`` on the prepared line (seed 100 r + step)."""
    return make_state(100 * rank + step)


def new_state(rank: int) -> Any:
    """The operation's save on rank ``rank``."""
    return make_state(100 * rank + 33)


def restart_state(rank: int) -> Any:
    return make_state(100 * rank + 999)


def node_dir(case: str, rank: int) -> str:
    return os.path.join(case, f"node{rank}")


#: How long a rank waits for its partner (the error mode lowers it in its ranks: see _crasherrors).
COMMIT_TIMEOUT = 60.0


def _ck(case: str, rank: int) -> Any:
    import lazyckpt
    from _groups import groups
    return lazyckpt.Checkpointer(node_dir(case, rank), **groups(KNOBS, replicas=lazyckpt.Replicas(1, node_size=1),
                                                                distributed=lazyckpt.Distributed(
                                                                    commit_timeout=COMMIT_TIMEOUT)))


@dataclasses.dataclass
class DistProgram:
    """``prepare(case, rank)`` and ``run(case, rank, icp)`` (``icp`` None on rank 1)
    run on both ranks; ``before``/``after``: per rank, step -> state of the line
    before and after the operation (its latest is the max)."""
    name: str
    prepare: Callable[[str, int], None]
    run: Callable[[str, int, Optional[Interceptor]], None]
    before: Callable[[int], Dict[int, Any]]
    after: Callable[[int], Dict[int, Any]]


# ----------------------------------------------------------------------------- jobs of forked ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_child(rank: int, port: int, w: int, fn: Callable[[int], Any], stacks: str) -> None:
    code = 0
    try:
        import faulthandler
        # A job past its timeout: the parent asks every rank for its threads' stacks first.
        faulthandler.register(signal.SIGUSR1, file=open(os.path.join(stacks, f"rank{rank}"), "w"),
                              all_threads=True)
        from datetime import timedelta
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(RANKS), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS,
                                timeout=timedelta(seconds=60))
        value = fn(rank)
        dist.barrier()          # rank 0 holds the store: no rank leaves while another still needs it
        payload = ("ok", value)
    except BaseException:
        payload = ("error", traceback.format_exc())
        code = 1
    cp.report_and_exit(w, payload, code)


def run_job(fn: Callable[[int, List[int]], Any], timeout: float = 120.0) -> List[Tuple[str, Any]]:
    """``fn(rank, peers)`` in two forked gloo ranks (rank 1 forked first: ``peers``
    of rank 0 is [rank 1's pid]). Per rank ("ok", value) / ("error", traceback) /
    ("killed", signal) / ("timeout", None). A rank that dies or fails kills the
    other (the job is dead)."""
    port = _free_port()
    stacks = tempfile.mkdtemp(prefix="lazyckpt-crash-stacks-")
    pids: List[int] = []
    pipes: List[int] = []
    for rank in (1, 0):
        r, w = os.pipe()
        peers = list(pids)
        pid = os.fork()
        if pid == 0:
            os.close(r)
            for fd in pipes:
                os.close(fd)
            _rank_child(rank, port, w, lambda rk, peers=peers: fn(rk, peers), stacks)
        os.close(w)
        pids.insert(0, pid)
        pipes.insert(0, r)
    chunks: List[List[bytes]] = [[] for _ in range(RANKS)]
    results: List[Optional[Tuple[str, Any]]] = [None] * RANKS
    open_fds = {fd: i for i, fd in enumerate(pipes)}
    deadline = time.monotonic() + timeout

    def kill_all() -> None:
        for i, pid in enumerate(pids):
            if results[i] is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                for fd, i in open_fds.items():
                    try:
                        os.kill(pids[i], signal.SIGUSR1)
                    except OSError:
                        pass
                time.sleep(1.0)
                kill_all()
                for fd, i in open_fds.items():
                    try:
                        with open(os.path.join(stacks, f"rank{i}")) as f:
                            dump = f.read()
                    except OSError:
                        dump = ""
                    results[i] = results[i] or ("timeout", dump[-6000:])
                break
            ready, _, _ = select.select(list(open_fds), [], [], left)
            for fd in ready:
                i = open_fds[fd]
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    chunks[i].append(chunk)
                    continue
                del open_fds[fd]
                _, status = os.waitpid(pids[i], 0)
                if os.WIFSIGNALED(status):
                    results[i] = ("killed", os.WTERMSIG(status))
                elif not chunks[i]:
                    results[i] = ("error", f"exited {os.waitstatus_to_exitcode(status)} without a result")
                else:
                    results[i] = pickle.loads(b"".join(chunks[i]))
                if results[i][0] != "ok":
                    kill_all()          # a job whose rank died is dead
    finally:
        for fd in open_fds:
            os.close(fd)
        for fd in pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        for i, pid in enumerate(pids):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        shutil.rmtree(stacks, ignore_errors=True)
    return [r if r is not None else ("killed", None) for r in results]


# ----------------------------------------------------------------------------- the checks

def _check_rank(case: str, rank: int, program: DistProgram, lost: Optional[int],
                may_be_empty: bool = False, a_world: Optional[str] = None) -> Dict[str, Any]:
    """One rank of a restarted job (A: ``lost`` None; B: node ``lost`` was deleted;
    ``may_be_empty``: its partner holds no replica of a live save of the lost node,
    so finding nothing is the right answer)."""
    import lazyckpt
    import torch.distributed as dist
    from lazyckpt.errors import CheckpointNotFoundError
    from lazyckpt.loading import verify as lzverify
    from lazyckpt.storage.stores import LOCAL
    cp.quiet()
    where = "A" if lost is None else f"B{lost}"
    before, after = program.before(rank), program.after(rank)
    union = {**before, **after}
    problems: List[str] = []
    out: Dict[str, Any] = {"problems": problems, "step": None, "tier": None}
    ck = _ck(case, rank)
    try:
        try:
            got = ck.load()
            step = out["step"] = ck.loaded_from["step"]
            out["tier"] = ck.loaded_from["tier"]
            if step == max(before) and not differs(before[step], got):
                out["world"] = "before"
            elif step == max(after) and not differs(after[step], got):
                out["world"] = "after"
            else:
                known = [n for n, w in (("before", before), ("after", after)) if step in w and not differs(w[step], got)]
                problems.append(f"{where} rank {rank}: load() returned step {step} "
                                + (f"of the line {known[0]}, not its latest" if known else
                                   "of no line (an abandoned or unknown save)")
                                + f" (loaded_from {ck.loaded_from})")
            line_a = {"before": before, "after": after}.get(a_world or "")
            if line_a is not None and not (step in line_a and not differs(line_a[step], got)):
                problems.append(f"{where} rank {rank}: load() returned step {step}, not a save of the line the "
                                f"job resumed in before the node was lost ('{a_world}': an abandoned save)")
        except CheckpointNotFoundError as exc:
            out["tier"] = "none"
            if not may_be_empty:
                problems.append(f"{where} rank {rank}: load(): nothing, though the partner of node {lost} holds "
                                f"a replica of a live save of it ({exc})")
        except Exception as exc:
            problems.append(f"{where} rank {rank}: load(): {type(exc).__name__}: {exc}")
        if lost == rank and out["tier"] not in (None, "replica", "none"):
            problems.append(f"{where} rank {rank}: the lost node loaded from the {out['tier']} tier")
        if lost is None:
            listed = ck.steps()
            out["listed"] = listed
            world = after if out.get("world") == "after" else before
            for s in world:
                if out.get("world") and s not in listed and s < max(world):
                    problems.append(f"{where} rank {rank}: step {s} of the line '{out['world']}' is lost "
                                    f"(steps() = {listed})")
            paths = ck.layout.step_paths()
            for s in listed:
                if s not in union:
                    problems.append(f"{where} rank {rank}: steps() lists step {s}, on no line ({listed})")
                    continue
                try:
                    v = lazyckpt.load(paths[s])
                except Exception as exc:
                    problems.append(f"{where} rank {rank}: load(step {s} dir): {type(exc).__name__}: {exc}")
                    continue
                if not any(s in w and not differs(w[s], v) for w in (before, after)):
                    problems.append(f"{where} rank {rank}: step {s} loads other values than its save")
            if listed:
                report = lzverify.verify(store=LOCAL, path=node_dir(case, rank))
                if not report.ok:
                    problems.append(f"{where} rank {rank}: verify: {[p.message for p in report.problems][:3]}")
        elif out["tier"] != "none":
            # The run goes on: a new save, replicated, round-trips (the step agreed: every rank saves).
            steps: List[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(steps, out["step"] or 0)
            new_step = max(steps) + 1
            values = restart_state(rank)
            try:
                h = ck.save(values, step=new_step)
                h.wait()
                ck.wait()
                if h.replica_state != "replicated":
                    problems.append(f"{where} rank {rank}: the restart's save(step={new_step}): replica state "
                                    f"{h.replica_state!r}")
                got = ck.load()
                if ck.loaded_from["step"] != new_step or differs(values, got):
                    problems.append(f"{where} rank {rank}: restart: save(step={new_step}).wait() then load() "
                                    f"returned step {ck.loaded_from['step']} / other values")
            except Exception as exc:
                problems.append(f"{where} rank {rank}: restart: save(step={new_step}): {type(exc).__name__}: {exc}")
    finally:
        try:
            ck.close()
        except Exception as exc:
            problems.append(f"{where} rank {rank}: close(): {type(exc).__name__}: {exc}")
    return out


def _job_problems(results: List[Tuple[str, Any]], where: str, loaded: Optional[List[str]] = None
                  ) -> Tuple[List[str], List[Dict[str, Any]]]:
    problems, outs = [], []
    for rank, (status, value) in enumerate(results):
        if status != "ok":
            problems.append(f"{where} rank {rank}: {status}: {str(value)[-4000:]}")
        else:
            problems += value["problems"]
            outs.append(value)
    if len(outs) == RANKS and outs[0]["step"] != outs[1]["step"]:
        problems.append(f"{where}: the ranks loaded different steps: {[o['step'] for o in outs]}")
    if len(outs) == RANKS and len({o.get("world") for o in outs}) > 1 and outs[0]["step"] == outs[1]["step"]:
        problems.append(f"{where}: the ranks loaded step {outs[0]['step']} of different lines: "
                        f"{[o.get('world') for o in outs]}")
    if loaded is not None:
        loaded.append(f"{where}:" + "/".join(f"{o['step']}{(o.get('tier') or '-')[0]}" for o in outs))
    return problems, outs


def _partner_holds_live(case: str, lost: int, program: DistProgram, world: Optional[str]) -> bool:
    """Whether node ``lost``'s partner holds a complete replica of a save of the
    line job A resumed in (``world``; None: of either line). Without one (the
    window after a rollback, before its step is replicated: the replica held is
    of an abandoned step), a lost node has nothing to restore from: no step is
    the right answer (no persistent tier here)."""
    import lazyckpt
    held = os.path.join(node_dir(case, 1 - lost), ".replicas", f"node_{lost:05d}", "rank_00000")
    lines = [w for n, w in (("before", program.before(lost)), ("after", program.after(lost))) if world in (None, n)]
    for name in (os.listdir(held) if os.path.isdir(held) else []):
        d = os.path.join(held, name)
        if not (name.startswith("step_") and os.path.exists(os.path.join(d, "COMPLETE"))):
            continue
        step = int(name[5:])
        try:
            values = lazyckpt.load(os.path.join(d, "rank_00000.lzc"))
        except Exception:
            continue
        if any(step in w and not differs(w[step], values) for w in lines):
            return True
    return False


def check_case(case: str, program: DistProgram, loaded: Optional[List[str]] = None) -> List[str]:
    """A, then B0 on ``case`` and B1 on a copy of it (after A). ``loaded`` gets,
    per job, the step each rank loaded and its tier's initial (l: local, r: replica)."""
    results = run_job(lambda rank, peers: _check_rank(case, rank, program, None))
    problems, outs = _job_problems(results, "A", loaded)
    worlds = {o.get("world") for o in outs}
    world = worlds.pop() if len(worlds) == 1 else None
    copy = case + ".lose1"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(case, copy, symlinks=True)
    try:
        for lost, where in ((0, case), (1, copy)):
            # In a fork: the fork server never loads (no reader threads inherited by later forks).
            status, live = cp.run_forked(lambda: _partner_holds_live(where, lost, program, world))
            if status != "ok":
                problems.append(f"B{lost}: the replica held for node {lost}: {status}: {live}")
            shutil.rmtree(node_dir(where, lost))
            results = run_job(lambda rank, peers: _check_rank(where, rank, program, lost, not live, world))
            problems += _job_problems(results, f"B{lost}", loaded)[0]
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return problems


# ----------------------------------------------------------------------------- one case, one program

def _crash_rank(program: DistProgram, case: str, rank: int, peers: List[int], k: int, side: str,
                mode: str) -> Any:
    cp.quiet()
    icp = None
    if rank == 0:
        icp = Interceptor(node_dir(case, 0), k, side, mode)
        icp.peers = peers
        icp.install()
    program.run(case, rank, icp)
    return {"count": icp.count, "descriptions": icp.descriptions} if icp is not None else {}


def _prepare(program: DistProgram, work: str) -> str:
    base = os.path.join(work, "prepared")
    if not os.path.isdir(base):
        os.makedirs(base)
        results = run_job(lambda rank, peers: (cp.quiet(), program.prepare(base, rank))[1], timeout=300)
        if any(s != "ok" for s, _ in results):
            raise RuntimeError(f"{program.name}: prepare failed: {results}")
    return base


def dry_run(program: DistProgram, work: str) -> Tuple[int, List[str]]:
    base = _prepare(program, work)
    case = os.path.join(work, "dry")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(base, case, symlinks=True)
    results = run_job(lambda rank, peers: _crash_rank(program, case, rank, peers, INFINITY, case + ".side",
                                                     "kill"), timeout=300)
    if any(s != "ok" for s, _ in results):
        raise RuntimeError(f"{program.name}: dry run failed: {results}")
    return results[0][1]["count"], results[0][1]["descriptions"]


def run_case(program: DistProgram, work: str, k: int, mode: str,
             seen: Optional[Dict[str, List[str]]] = None) -> Dict[str, Any]:
    case = os.path.join(work, f"case-{mode}-{k}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    side = case + ".side"
    results = run_job(lambda rank, peers: _crash_rank(program, case, rank, peers, k, side, mode), timeout=300)
    out: Dict[str, Any] = {"k": k, "op": None, "status": results[0][0], "problems": [], "dropped": [],
                           "duplicate": False, "rank1": results[1][0]}
    status, value = results[0]
    if status == "killed" and os.path.exists(side):
        record = json.loads(open(side).read())
        out["op"] = record["op"]
        if cp.is_power(mode):
            out["dropped"] = cp.apply_power_loss(record["journal"], node_dir(case, 0), cp.POWER_TAILS[mode])
    elif status == "ok" and results[1][0] == "ok":
        out["op"] = f"(no point {k}: rank 0 made {value['count']} calls this time)"
    else:
        out["problems"].append(f"the crash job: {results}"[-3000:])
        cp._cleanup(case, side)
        return out
    fp = cp.fingerprint(case)
    if seen is not None and fp in seen:
        out["duplicate"] = True
        out["problems"] = list(seen[fp])
    else:
        loaded: List[str] = []
        try:
            out["problems"] = check_case(case, program, loaded)
        except Exception:
            out["problems"] = [f"the check: {traceback.format_exc()[-2000:]}"]
        out["loaded"] = " ".join(loaded)
        if seen is not None:
            seen[fp] = out["problems"]
    cp._cleanup(case, side)
    return out


def enumerate_program(program: DistProgram, mode: str, work: str, points: Optional[List[int]] = None,
                      every: int = 1, first: int = 1, log: Optional[Callable[[str], None]] = None) -> cp.Outcome:
    """Dry run, then a crash at every point (or at ``points``, or at every
    ``every``-th from ``first``) and the checks."""
    t0 = time.monotonic()
    n, descriptions = dry_run(program, work)
    seen: Dict[str, List[str]] = {}
    violations, checked, loaded = [], 0, collections.Counter()
    for k in (points if points is not None else range(first, n + 1, every)):
        result = run_case(program, work, k, mode, seen)
        checked += not result["duplicate"]
        if result.get("loaded"):
            loaded[result["loaded"]] += 1
        if result["problems"]:
            violations.append(result)
            if log:
                log(f"{program.name} {mode} k={k}/{n} {result['op']}: {result['problems']}")
    outcome = cp.Outcome(program.name, mode, n, descriptions, violations, checked, time.monotonic() - t0, [])
    #: How often each combination of restored steps was seen ("A:2l/2l B0:2r/2l B1:2l/2r": 3 jobs, 2 ranks).
    outcome.loaded = loaded          # type: ignore[attr-defined]
    return outcome


# ----------------------------------------------------------------------------- the programs

def _line(rank: int, n: int) -> Dict[int, Any]:
    return {i: state(rank, i) for i in range(1, n + 1)}


def _prepare_line(n: int) -> Callable[[str, int], None]:
    def prepare(case: str, rank: int) -> None:
        with _ck(case, rank) as ck:
            for i in range(1, n + 1):
                ck.save(state(rank, i), step=i).wait()
                ck.wait()               # replicated before the next
            assert ck.replica_stats()["holds"] == [(1 - rank, 0, n)], ck.replica_stats()
    return prepare


def _save_run(load_step: Optional[int]) -> Callable[[str, int, Optional[Interceptor]], None]:
    def run(case: str, rank: int, icp: Optional[Interceptor]) -> None:
        ck = _ck(case, rank)
        with (icp.operation() if icp is not None else contextlib.nullcontext()):
            if load_step is not None:
                ck.load(step=load_step)            # collective: the rollback
            h = ck.save(new_state(rank), step=3)
            h.wait()
            ck.wait()                              # the replica round: each node's file to its partner
            ck.close()
    return run


def replicas_save_program() -> DistProgram:
    """Steps 1-2 committed and replicated on both nodes; both ranks ``save(3)``,
    ``wait()`` (the replica round), ``close()``."""
    return DistProgram("replicas-save", _prepare_line(2), _save_run(None),
                       lambda r: _line(r, 2), lambda r: {**_line(r, 2), 3: new_state(r)})


def replicas_rollback_program() -> DistProgram:
    """Steps 1-5 committed, step 5 replicated; both ranks ``load(step=2)``
    (collective), ``save(3)``, ``wait()``, ``close()``."""
    return DistProgram("replicas-rollback", _prepare_line(5), _save_run(2),
                       lambda r: _line(r, 5), lambda r: {**_line(r, 2), 3: new_state(r)})


def _prepare_lost_node0(case: str, rank: int) -> None:
    _prepare_line(2)(case, rank)
    if rank == 0:
        shutil.rmtree(node_dir(case, 0))        # node 0 lost: its replacement starts empty


def _restore_run(case: str, rank: int, icp: Optional[Interceptor]) -> None:
    ck = _ck(case, rank)
    with (icp.operation() if icp is not None else contextlib.nullcontext()):
        ck.load()       # collective: node 0's file from node 1's replica, committed in node 0 again
        ck.wait()       # the restored step replicated anew (node 0 lost the replica it held)
        ck.close()


def _restored_line(rank: int) -> Dict[int, Any]:
    # Node 0 lost step 1 with its directory; the restore brings back the newest step (2).
    return {2: state(0, 2)} if rank == 0 else _line(rank, 2)


def replicas_restore_program() -> DistProgram:
    """Steps 1-2 committed and replicated, then node 0's directory lost: both
    ranks ``load()`` (the restore: rank 0 receives its file from rank 1's
    replica, verifies it and commits it as step 2), ``wait()`` (step 2
    replicated anew), ``close()``. Rank 0's points are the restore's writes."""
    return DistProgram("replicas-restore", _prepare_lost_node0, _restore_run, _restored_line, _restored_line)


def dist_programs() -> List[DistProgram]:
    return [replicas_save_program(), replicas_rollback_program(), replicas_restore_program()]
