# Why one module of ~660 lines (a module above 600 lines says why): one tier, both of its sides.
# The save side and the restore side share the topology, the on-disk layout of held replicas
# (.replicas/node_N/rank_L/step_S, COMPLETE) and the wire format of a transfer, which change together.
"""Replica tier: each committed rank file copied to partner ranks on other nodes.

The failure this tier is for: one node lost (its node-local checkpoint
directory with it) while the rest of the job is healthy. Re-reading that
node's files from shared or object storage is the slow path; keeping a copy
of every rank file on ``replicas`` partner nodes lets the replacement node
get its files from its partners' local disks (Gemini, NVIDIA's local
checkpoints, Orbax's emergency checkpoints do the same).

Layout of the job (``Topology``): ranks are grouped into nodes of
``node_size`` consecutive ranks (``node_size=``, else ``LAZYCKPT_NODE_SIZE``,
else ``LOCAL_WORLD_SIZE`` as torchrun sets it). With replicas, the
Checkpointer's directory is **node-local**: each node's ranks commit their
own step directory in their own node's directory (the node is the commit
group), and rank ``(node, l)`` sends its file and its node's manifest to the
rank with the same local rank ``l`` on nodes ``node + 1 .. node + k``
(mod the number of nodes): partners on k different nodes, and the ranks of
one node spread over k other nodes' disks.

Save side (``ReplicaTier``): a committed local step is queued; a background
thread replicates the newest queued one (older ones are superseded: the
newest-wins queue of :mod:`lazyckpt.tiers.drain`, as on the persistent
tier), over point-to-point messages on a dedicated gloo group, in chunks
(rate-limited by ``replica_bandwidth``), while training goes on. The
receiver checks the bytes against the sender's xxh3 and the file's footer
against the manifest, writes them under a temporary name and renames them
into ``<dir>/.replicas/node_NNNNN/rank_LLLLL/step_S/``. Every rank then
reports through the store; only when every replica of the step is complete
on every rank does each holder mark its copies ``COMPLETE`` and drop its
older replicas of that source rank (one step per source rank is kept:
bounded at ``k`` rank files per rank).

Restore side (``restore``): collective. Every rank reports its node's
local steps, the complete replicas it holds and (with a persistent tier)
the steps persisted for its node; the newest step that every node can get
from some tier is chosen; the ranks of a node that lacks it receive their
files from the first partner holding a complete replica, which become a
committed local step again; a node with no complete replica left loads
from the persistent tier; with neither, the load fails with a clear error
(or an older step every node has is chosen).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple, Union

import torch

from lazyckpt.distributed import agree
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from lazyckpt.formats import datafile as fmt
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import MANIFEST, rank_filename
from lazyckpt.lineage import Event, line, manifest_event
from lazyckpt.knobs import Options
from lazyckpt.loading.reader import CheckpointFile
from lazyckpt.loading.verify import verify
from lazyckpt.saving.jobcommit import is_job_wide
from lazyckpt.saving.tierstate import REPLICA
from lazyckpt.storage.fileio import fsync_dir, read_small_file
from lazyckpt.storage.stores import LOCAL
from .drain import NewestWinsDrain, RateLimit, Waiting

log = logging.getLogger("lazyckpt")

REPLICAS_DIR = ".replicas"
COMPLETE = "COMPLETE"
#: Bytes per point-to-point message.
CHUNK_BYTES = 4 << 20
#: A header's size when the sender has no file to send.
NOTHING = -1


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: node = rank // node_size, local rank = rank % node_size."""
    rank: int
    world_size: int
    node_size: int

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    @property
    def node(self) -> int:
        return self.rank // self.node_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.node_size

    def rank_of(self, node: int, local_rank: int) -> int:
        return (node % self.nodes) * self.node_size + local_rank

    def partners(self, k: int) -> List[int]:
        """The ranks this rank's file is replicated to: same local rank, the next k nodes."""
        return [self.rank_of(self.node + i, self.local_rank) for i in range(1, k + 1)]

    def sources(self, k: int) -> List[int]:
        """The ranks whose files this rank holds replicas of."""
        return [self.rank_of(self.node - i, self.local_rank) for i in range(1, k + 1)]


def topology(node_size: Optional[int], replicas: int) -> Topology:
    """This rank's topology (collective when ``node_size`` must be found from host names)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("replicas= needs torch.distributed initialized (the partners are other ranks)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if node_size is None:
        env = os.environ.get("LAZYCKPT_NODE_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")
        if env:
            node_size = int(env)
        else:
            hosts: List[Any] = [None] * world
            dist.all_gather_object(hosts, socket.gethostname())
            node_size = hosts.count(hosts[0])
    if type(node_size) is not int or node_size < 1 or world % node_size:
        raise ValueError(f"node_size must divide the world size {world}, got {node_size!r}")
    topo = Topology(rank, world, node_size)
    if type(replicas) is not int or not 1 <= replicas < topo.nodes:
        raise ValueError(f"replicas must be an int in [1, nodes - 1] = [1, {topo.nodes - 1}] with {topo.nodes} "
                         f"node(s) of {node_size} rank(s), got {replicas!r}")
    return topo


def node_group(topo: Topology) -> Any:
    """This rank's node as a process group (collective: every rank creates every node's group)."""
    import torch.distributed as dist
    mine = None
    for n in range(topo.nodes):
        g = dist.new_group([n * topo.node_size + i for i in range(topo.node_size)], backend="gloo")
        if n == topo.node:
            mine = g
    return mine


# --------------------------------------------------------------------------- holdings


def _replica_dir(root: str, node: int, local_rank: int) -> str:
    return os.path.join(root, f"node_{node:05d}", f"rank_{local_rank:05d}")


def _step_name(step: int) -> str:
    return f"step_{step:010d}"


def remove_replica(path: str) -> None:
    """Delete a held replica's directory, its ``COMPLETE`` marker first and
    durably: a deletion cut short (a kill, a power loss) leaves a directory no
    restore trusts, never a marked one whose data file is already gone (which a
    restore would choose and then refuse: RELIABILITY.md finding 22)."""
    try:
        os.unlink(os.path.join(path, COMPLETE))
        fsync_dir(path)
    except (FileNotFoundError, NotADirectoryError):
        pass                            # gone already, or not a replica's directory
    shutil.rmtree(path, ignore_errors=True)


def held_replicas(root: str) -> List[Tuple[int, int, int]]:
    """(source node, source local rank, step) of every complete replica under ``root``."""
    out = []
    if not os.path.isdir(root):
        return out
    for n in sorted(os.listdir(root)):
        if not n.startswith("node_"):
            continue
        for r in sorted(os.listdir(os.path.join(root, n))):
            if not r.startswith("rank_"):
                continue
            base = os.path.join(root, n, r)
            for s in os.listdir(base):
                if s.startswith("step_") and os.path.exists(os.path.join(base, s, COMPLETE)):
                    out.append((int(n[5:]), int(r[5:]), int(s[5:])))
    return out


def _open_source(path: Union[str, int]) -> Any:
    """A file to send, by path or by a descriptor opened when its step was queued
    (read from its start; the step may have been moved or deleted since)."""
    if isinstance(path, int):
        f = os.fdopen(os.dup(path), "rb")
        f.seek(0)
        return f
    return open(path, "rb")


def _file_digest(path: Union[str, int]) -> Tuple[int, int]:
    import xxhash
    h = xxhash.xxh3_64()
    size = 0
    with _open_source(path) as f:
        while True:
            block = f.read(CHUNK_BYTES)
            if not block:
                break
            h.update(block)
            size += len(block)
    return size, h.intdigest()


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


# --------------------------------------------------------------------------- transfer


class _Sender:
    """A file and its manifest going to ``dst``: header, manifest, then the file in chunks."""

    def __init__(self, dst: int, group: Any, step: int, local_rank: int, node: int, path: Optional[str],
                 manifest: bytes, limit: Any):
        self.dst, self.group, self.limit = dst, group, limit
        # path None: this rank has nothing to send (its step could not be read). It still
        # sends a header (size -1) so that the partner's receive never waits for bytes.
        self.size, digest = _file_digest(path) if path is not None else (NOTHING, 0)
        self.header = torch.tensor([step, node, local_rank, self.size, len(manifest), _signed(digest)],
                                   dtype=torch.int64)
        self.manifest = torch.frombuffer(bytearray(manifest), dtype=torch.uint8) if manifest else None
        self.path = path


class _Receiver:
    def __init__(self, src: int, group: Any):
        self.src, self.group = src, group
        self.header = torch.zeros(6, dtype=torch.int64)


def exchange(group: Any, sends: List[_Sender], recvs: List[_Receiver], into: Any) -> List[Dict[str, Any]]:
    """Run the sends and receives of one round concurrently (every send has a
    matching receive on its peer); ``into(receiver, header)`` returns the
    path to write a received file to. Returns one dict per receiver."""
    import torch.distributed as dist
    pending = [dist.isend(s.header, s.dst, group=group) for s in sends]
    for r in recvs:
        dist.irecv(r.header, r.src, group=group).wait()
    for w in pending:
        w.wait()
    sends = [s for s in sends if s.size != NOTHING]
    empty = [r for r in recvs if int(r.header[3]) == NOTHING]
    recvs = [r for r in recvs if int(r.header[3]) != NOTHING]
    pending = [dist.isend(s.manifest, s.dst, group=group) for s in sends if s.manifest is not None]
    manifests = []
    for r in recvs:
        n = int(r.header[4])
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            dist.irecv(buf, r.src, group=group).wait()
        manifests.append(bytes(buf.numpy()))
    for w in pending:
        w.wait()
    # The files, chunk by chunk: a send of chunk i and the receives of chunk i in flight together.
    files = [_open_source(s.path) for s in sends]
    outs, hashes = [], []
    # A receiver whose file cannot be written (ENOSPC, EIO) still receives every chunk, so
    # no sender is left waiting; its result says why (``error``) and has no path.
    errors: Dict[int, str] = {}
    import xxhash
    try:
        for j, r in enumerate(recvs):
            path = into(r, r.header)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                outs.append(open(path, "wb"))
            except OSError as exc:
                outs.append(None)
                errors[j] = f"{path}: {exc}"
            hashes.append(xxhash.xxh3_64())
        sizes = [s.size for s in sends] + [int(r.header[3]) for r in recvs]
        chunks = max([-(-n // CHUNK_BYTES) for n in sizes] + [0])
        for i in range(chunks):
            work = []
            for s, f in zip(sends, files):
                n = min(CHUNK_BYTES, s.size - i * CHUNK_BYTES)
                if n > 0:
                    s.limit.take(n)
                    data = f.read(n)
                    if len(data) != n:
                        raise CheckpointError(f"{s.path}: file shrank while being replicated")
                    work.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), s.dst,
                                           group=group))
            for j, (r, h) in enumerate(zip(recvs, hashes)):
                n = min(CHUNK_BYTES, int(r.header[3]) - i * CHUNK_BYTES)
                if n > 0:
                    buf = torch.empty(n, dtype=torch.uint8)
                    dist.irecv(buf, r.src, group=group).wait()
                    data = buf.numpy().tobytes()
                    h.update(data)
                    if outs[j] is not None and j not in errors:
                        try:
                            outs[j].write(data)
                        except OSError as exc:
                            errors[j] = f"{outs[j].name}: {exc}"
            for w in work:
                w.wait()
        results = [{"src": r.src, "step": int(r.header[0]), "node": int(r.header[1]),
                    "local_rank": int(r.header[2]), "bytes": 0, "path": None, "manifest": b"", "ok": False,
                    "nothing": True} for r in empty]
        for j, (r, out, h, manifest) in enumerate(zip(recvs, outs, hashes, manifests)):
            if j not in errors:
                try:
                    out.flush()
                    os.fsync(out.fileno())
                except OSError as exc:
                    errors[j] = f"{out.name}: {exc}"
            ok = _signed(h.intdigest()) == int(r.header[5]) and j not in errors
            results.append({"src": r.src, "step": int(r.header[0]), "node": int(r.header[1]),
                            "local_rank": int(r.header[2]), "bytes": int(r.header[3]),
                            "path": out.name if out is not None else None, "manifest": manifest, "ok": ok,
                            **({"error": errors[j]} if j in errors else {})})
        return results
    finally:
        for f in files + outs:
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


def check_replica(path: str, manifest_raw: bytes, local_rank: int) -> None:
    """A replica must be the file its manifest committed: size, footer, save and rank."""
    doc = manifests.parse(manifest_raw, path)
    listed = next((f for f in doc["files"] if f["rank"] == local_rank), None)
    if listed is None:
        raise CorruptCheckpointError(f"{path}: its manifest lists no rank {local_rank}", path=path)
    f = CheckpointFile(path, Options(), store=LOCAL)      # a replica is a node-local file
    if listed.get("bytes") not in (None, f.size):
        raise CorruptCheckpointError(f"{path}: {f.size} bytes, the manifest says {listed['bytes']}", path=path)
    mine = f.footer.metadata.get("lazyckpt")
    if not isinstance(mine, dict) or mine.get("save_id") != doc.get("save_id") or mine.get("rank") != local_rank:
        raise CorruptCheckpointError(f"{path}: belongs to another save or rank than its manifest's", path=path)


# --------------------------------------------------------------------------- save side


class ReplicaTier(NewestWinsDrain):
    """Replicates committed node-local steps to partner nodes in the background,
    on the newest-wins queue of :mod:`lazyckpt.tiers.drain`."""

    tier = REPLICA
    thread_name = "lazyckpt-replicas"
    round_prefix = "rep"
    choice_what = "the choice of step to replicate"
    choice_of = "replicas"

    def __init__(self, directory: str, topo: Topology, replicas: int, world: Any, bandwidth: float,
                 timeout_s: float):
        import torch.distributed as dist
        super().__init__(world, "replicas")
        self.root = os.path.join(directory, REPLICAS_DIR)
        self.topo, self.k = topo, replicas
        #: A group of its own: replica traffic never interleaves with training collectives.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._limit = RateLimit(bandwidth)
        #: Replicas this rank holds (source node, local rank, step) and their bytes.
        self.held_bytes = 0
        #: Whether a save was superseded on this node since it was queued (the Checkpointer's).
        self.abandoned: Callable[[int, str], bool] = lambda step, save_id: False

    def holds(self) -> List[Tuple[int, int, int]]:
        """(source node, source local rank, step) of the complete replicas this rank
        holds (its node's directory also holds its node-mates')."""
        return [h for h in held_replicas(self.root) if h[1] == self.topo.local_rank]

    def enqueue(self, handle: Any, step: int, call: int, local_path: str, *, reading: ContextManager[Any]) -> None:
        """Queue a step just committed (called before the commit's retention):
        ``reading`` (the local directory's hold on it, not entered) keeps
        retention from deleting it until it is replicated or superseded (the
        node's coordinator catches up later)."""
        hold = contextlib.ExitStack()
        opened = None
        try:
            hold.enter_context(reading)
            # Opened now, on the commit's thread (no later commit can supersede it before):
            # a rollback that moves the step away while it waits or replicates cannot fail
            # the round -- which every rank would fail, dropping the rollback's own step.
            with open(os.path.join(local_path, MANIFEST), "rb") as f:
                manifest_raw = f.read()
            fd = os.open(os.path.join(local_path, rank_filename(self.topo.local_rank)), os.O_RDONLY)
            hold.callback(os.close, fd)
            opened = (manifest_raw, fd)
        except (CheckpointError, OSError) as exc:      # gone already; the round sends nothing for it
            log.warning("lazyckpt: step %d cannot be held for replication: %s", step, exc)
        self._queue(handle, step, call, local_path, hold, opened=opened)

    def _round_failed(self, exc: BaseException) -> None:
        log.warning("lazyckpt: replicating a step failed (training goes on, the step is not "
                    "replicated): %s", exc)
        # What was queued cannot be replicated with a broken round.
        self._drop_waiting(lambda q: q.state.failed(exc, f"failed: {exc}"))

    def _send(self, item: Waiting, key: str) -> None:
        w, topo = self.world, self.topo
        report: Dict[str, Any] = {"ok": True}
        received: List[Dict[str, Any]] = []
        try:
            mine: Union[None, str, int] = os.path.join(item.local_path, rank_filename(topo.local_rank))
            try:
                if item.opened is not None:
                    manifest_raw, mine = item.opened
                else:
                    with open(os.path.join(item.local_path, MANIFEST), "rb") as f:
                        manifest_raw = f.read()
            except OSError as exc:
                # Still take part in the exchange (an empty header), so no partner waits
                # for bytes that never come; the agreement below fails the round.
                report = {"ok": False, "error": f"step {item.step} cannot be read here: {exc}"}
                mine, manifest_raw = None, b""
            sends = [_Sender(p, self.group, item.step, topo.local_rank, topo.node, mine, manifest_raw, self._limit)
                     for p in topo.partners(self.k)]
            recvs = [_Receiver(s, self.group) for s in topo.sources(self.k)]
            token = uuid.uuid4().hex[:8]

            def into(r: _Receiver, header: torch.Tensor) -> str:
                base = _replica_dir(self.root, int(header[1]), int(header[2]))
                return os.path.join(base, f".tmp-{_step_name(int(header[0]))}-{token}", "data.lzc")
            received = exchange(self.group, sends, recvs, into)
            for r in received:
                if r.get("nothing"):
                    raise CheckpointError(f"rank {r['src']} could not read its step {r['step']} to send it")
                if r.get("error"):
                    raise CheckpointError(f"replica of rank {r['src']} step {r['step']} cannot be written here: "
                                          f"{r['error']}")
                if not r["ok"]:
                    raise CorruptCheckpointError(f"replica of rank {r['src']} step {r['step']}: bytes differ from "
                                                 f"the sender's checksum", path=r["path"])
                check_replica(r["path"], r["manifest"], r["local_rank"])
        except BaseException as exc:
            report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            agree(w, key, report, item.step, lambda done: None)
        except BaseException as exc:
            for r in received:
                if r["path"] is not None:
                    shutil.rmtree(os.path.dirname(r["path"]), ignore_errors=True)
            item.state.failed(exc, f"failed: {exc}")
            raise
        # Every replica of the step is complete on every rank: mark them, drop older ones.
        for r in received:
            tmp = os.path.dirname(r["path"])
            base = os.path.dirname(tmp)
            with open(os.path.join(tmp, MANIFEST), "wb") as f:
                f.write(r["manifest"])
                f.flush()           # before the fsync: else it syncs an empty file
                os.fsync(f.fileno())
            os.rename(r["path"], os.path.join(tmp, rank_filename(r["local_rank"])))
            final = os.path.join(base, _step_name(r["step"]))
            remove_replica(final)
            os.rename(tmp, final)
            # The new replica durable under its name before the older ones go (a power loss
            # could otherwise keep their deletion and lose this rename: no replica at all).
            fsync_dir(base)
            with open(os.path.join(final, COMPLETE), "wb") as f:
                os.fsync(f.fileno())
            fsync_dir(final)
            for other in os.listdir(base):
                if other != _step_name(r["step"]):
                    remove_replica(os.path.join(base, other))
            fsync_dir(base)
        self.held_bytes = sum(os.path.getsize(os.path.join(dp, f)) for n, lr, _ in self.holds()
                              for dp, _, fs in os.walk(_replica_dir(self.root, n, lr)) for f in fs)
        if self._abandoned(item):
            # A rollback on this node superseded it while it was sent: its replicas are
            # never restored (the line says abandoned) and the rollback's step replaces them.
            item.state.abandoned()
            log.info("lazyckpt: step %d was abandoned by a rollback while it was replicated", item.step)
            return
        item.state.done("replicated")
        log.info("lazyckpt: step %d replicated to ranks %s", item.step, topo.partners(self.k))

    def _abandoned(self, item: Waiting) -> bool:
        try:
            return item.opened is not None and self.abandoned(item.step, manifest_event(item.opened[0]).save_id)
        except Exception:
            return False


# --------------------------------------------------------------------------- restore side


def _held_event(root: str, node: int, local_rank: int, step: int) -> Optional[List[Any]]:
    """[step, save_id, seq] of a held replica (from the manifest it carries)."""
    e = manifest_event(read_small_file(os.path.join(_replica_dir(root, node, local_rank), _step_name(step),
                                                    MANIFEST), 1 << 30))
    return list(e) if e is not None else None


def restore(directory: str, layout: Any, topo: Topology, k: int, group: Any, step: Optional[int],
            persistent_steps: List[int], history: Any = None) -> Dict[str, Any]:
    """Collective: choose the step to load and bring each node's missing rank
    files back from partners' replicas into ``layout`` (the node-local
    directory). Returns {"step", "tier", "from_rank"} for this rank.

    Only live saves are candidates (lazyckpt/lineage.py): each node's line is
    computed from its local record and manifests and from the manifests its
    partners' replicas carry, so a replica of a step its node abandoned (a run
    resumed from an older step, then a crash before the new step was
    replicated) is never restored nor re-committed above the resumed step."""
    import torch.distributed as dist
    root = os.path.join(directory, REPLICAS_DIR)
    events = history.local_events() if history is not None else []
    own_line = set(line(events))
    saves = history.local_saves() if history is not None else {}
    # This node's local steps that are live in its own line (a local copy of another save is not one).
    live_local = [s for s in layout.steps() if s not in saves or saves[s].save_id is None
                  or (s, saves[s].save_id) in own_line]
    held = [h for h in held_replicas(root) if h[1] == topo.local_rank]
    mine = {"rank": topo.rank, "node": topo.node, "local": live_local,
            "held": [(n, lr, s, _held_event(root, n, lr, s)) for n, lr, s in held],
            "events": [list(e) for e in events],
            "ids": {s: saves[s].save_id for s in live_local if s in saves and saves[s].save_id},
            "persistent": persistent_steps, "token": uuid.uuid4().hex[:8], "asked": step}
    infos: List[Any] = [None] * topo.world_size
    dist.all_gather_object(infos, mine, group=group)
    asked = {info["asked"] for info in infos}
    if len(asked) > 1:
        # Every rank raises the same error (none is left waiting in an exchange).
        raise CheckpointError("load() with replicas is collective and the ranks asked for different steps: "
                              + ", ".join(f"rank {i['rank']} step {i['asked']}" for i in infos), step=step)
    local = collections.defaultdict(set)
    persisted = collections.defaultdict(set)
    holders: Dict[Tuple[int, int, int], List[int]] = collections.defaultdict(list)
    node_events: Dict[int, List[Any]] = collections.defaultdict(list)
    for info in infos:
        node_events[info["node"]] += [Event(*e) for e in info["events"]]
        for n, lr, s, e in info["held"]:
            if e is not None:
                node_events[n].append(Event(*e))
    node_lines = {n: set(line(evs)) for n, evs in node_events.items()}
    #: step -> the job-wide save ids of the copies the nodes would restore it from.
    save_ids: Dict[int, set] = collections.defaultdict(set)
    for info in infos:
        local[info["node"]].update(info["local"])
        persisted[info["node"]].update(info["persistent"])
        for s, sid in info["ids"].items():
            if is_job_wide(sid):
                save_ids[s].add(sid)
        for n, lr, s, e in info["held"]:
            # A replica counts only as the live save of its step on its source node.
            if e is not None and (s, e[1]) in node_lines.get(n, set()):
                holders[(n, lr, s)].append(info["rank"])
                if is_job_wide(e[1]):
                    save_ids[s].add(e[1])
    # A node-local directory is only trusted when every rank of the node reports it the same way.
    for info in infos:
        local[info["node"]] &= set(info["local"])

    def available(node: int) -> set:
        full = {s for (n, lr, s) in holders if n == node
                and all((node, l2, s) in holders for l2 in range(topo.node_size))}
        return local[node] | full | persisted[node]
    common = set.intersection(*(available(n) for n in range(topo.nodes)))
    # Two different saves of one step number are never one step (a rollback that one
    # node failed after the others committed it, lazyckpt/saving/jobcommit.py).
    common = {s for s in common if len(save_ids[s]) <= 1}
    if step is not None:
        if step not in common:
            raise CheckpointError(f"step {step} cannot be restored on every node from any tier "
                                  f"(steps every node can get: {sorted(common)})", step=step)
        target = step
    elif not common:
        raise CheckpointNotFoundError(f"{directory}: no step that every node can restore from its local tier, "
                                      f"its partners' replicas or the persistent tier", path=directory)
    else:
        target = max(common)
    # Who sends what: the first holder of each missing (node, local rank) file.
    plan = []
    for n in range(topo.nodes):
        if target in local[n]:
            continue
        for lr in range(topo.node_size):
            h = holders.get((n, lr, target))
            if h and all((n, l2, target) in holders for l2 in range(topo.node_size)):
                plan.append((h[0], topo.rank_of(n, lr), n, lr))
    # A node that lost its directory lost the replicas it held for its partners too:
    # once every node holds the newest step again, it is replicated anew (decided from
    # what every rank reported, so every rank takes part in that round or none does).
    lost_replicas = any(target not in local[n] for n in range(topo.nodes))
    every_node_gets_it = all(target in local[n] or all((n, lr, target) in holders for lr in range(topo.node_size))
                             for n in range(topo.nodes))
    replicate_again = lost_replicas and every_node_gets_it and target == max(common)
    where = {"step": target, "tier": "local", "from_rank": topo.rank}
    if target not in local[topo.node]:
        where = {"step": target, "tier": "persistent", "from_rank": None}
    sends = []
    for holder, dst, n, lr in plan:
        if holder == topo.rank:
            base = os.path.join(_replica_dir(root, n, lr), _step_name(target))
            try:
                with open(os.path.join(base, MANIFEST), "rb") as f:
                    raw = f.read()
                sends.append(_Sender(dst, group, target, lr, n, os.path.join(base, rank_filename(lr)), raw,
                                     _NoLimit()))
            except OSError as exc:
                # Gone or unreadable since it was reported: an empty header, so the
                # receiver refuses this replica instead of waiting for its bytes.
                log.warning("lazyckpt: the replica of node %d rank %d step %d cannot be read here: %s",
                            n, lr, target, exc)
                sends.append(_Sender(dst, group, target, lr, n, None, b"", _NoLimit()))
    recvs = [_Receiver(h, group) for h, dst, _, _ in plan if dst == topo.rank]
    # One temporary step directory per receiving node, the same name on its ranks.
    tmp = layout.temp_path(target, f"restore-{infos[0]['token']}")
    # A local write failing on a receiving rank (ENOSPC, EIO) is this rank's refusal: it
    # still takes part in every exchange and agreement, and every rank raises the same error.
    write_error: Optional[str] = None
    if recvs and topo.local_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
        except OSError as exc:
            write_error = f"rank {topo.rank}: {tmp}: {exc}"
    dist.barrier(group=group)
    results = exchange(group, sends, recvs, lambda r, header: os.path.join(tmp, f".incoming-{topo.local_rank}"))
    manifest_raw = b""
    ok = write_error is None
    why: Optional[str] = write_error   # this rank's first refusal, named in the error every rank raises
    for r in results:
        try:
            if r.get("error"):
                raise OSError(r["error"])
            if r.get("nothing"):
                raise CorruptCheckpointError(f"rank {r['src']} could not read its replica", path=directory)
            if not r["ok"]:
                raise CorruptCheckpointError("bytes differ from the holder's checksum", path=r["path"])
            check_replica(r["path"], r["manifest"], topo.local_rank)
            # Every block against its checksum before it becomes a committed local step
            # again: a replica damaged at rest on its holder is refused here, not loaded.
            report = verify(r["path"], store=LOCAL)
            if not report.ok:
                raise CorruptCheckpointError(f"{r['path']}: {report.problems[0].message}", path=r["path"])
            os.rename(r["path"], os.path.join(tmp, rank_filename(topo.local_rank)))
        except OSError as exc:
            ok = False
            write_error = write_error or f"rank {topo.rank} from rank {r['src']}: {exc}"
            why = why or write_error
        except CheckpointError as exc:
            log.warning("lazyckpt: the replica of rank %d step %d from rank %d is refused: %s",
                        topo.rank, target, r["src"], exc)
            ok = False
            why = why or f"rank {topo.rank} from rank {r['src']}: {exc}"
        else:
            where = {"step": target, "tier": "replica", "from_rank": r["src"]}
            manifest_raw = r["manifest"]
    # The node's ranks agree before its step directory is committed again.
    gathered: List[Any] = [None] * topo.world_size
    dist.all_gather_object(gathered, (ok, why, write_error), group=group)
    failed_writes = [g[2] for g in gathered if g[2]]
    if failed_writes:
        if recvs and topo.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"{directory}: restoring step {target} from the replicas failed writing it "
                                   f"({'; '.join(failed_writes)}); nothing was committed: load again once the "
                                   f"disk is fixed", path=directory, step=target)
    flags = [g[0] for g in gathered]
    node_ok = all(flags[topo.rank_of(topo.node, lr)] for lr in range(topo.node_size))
    hopeless = sorted({i // topo.node_size for i, f in enumerate(flags) if not f
                       and target not in persisted[i // topo.node_size]})
    if hopeless:
        # Every rank fails the same way (none is left waiting for the others).
        if recvs and topo.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        reasons = "; ".join(g[1] for g in gathered if g[1])
        raise CorruptCheckpointError(f"step {target}: the replicas of node(s) {hopeless} do not match their "
                                     f"manifest and no persistent copy exists ({reasons})", path=directory)
    commit_error: Optional[str] = None
    if recvs and node_ok and topo.local_rank == 0:
        try:
            with open(os.path.join(tmp, MANIFEST), "wb") as f:
                f.write(manifest_raw)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            event = None
            if history is not None:
                event = manifest_event(manifest_raw)
                if event is not None and event.seq is not None:
                    history.saw(event.seq)
                else:
                    event = None
            # The restored save is the node's latest commit again (its record is the commit point).
            layout.commit(tmp, target, keep_superseded=True, event=event)
            layout.write_latest(target)
        except (OSError, CheckpointError) as exc:
            commit_error = f"rank {topo.rank}: committing the restored step {target}: {exc}"
    elif recvs and not node_ok:
        if topo.local_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        where = {"step": target, "tier": "persistent", "from_rank": None}
    # Every rank learns whether every node committed its restored step (as at a barrier).
    outcomes: List[Any] = [None] * topo.world_size
    dist.all_gather_object(outcomes, commit_error, group=group)
    if any(outcomes):
        raise CheckpointWriteError(f"{directory}: restoring step {target} from the replicas failed "
                                   f"({'; '.join(o for o in outcomes if o)}): load again once the disk is fixed",
                                   path=directory, step=target)
    # ``flags`` is the same on every rank: all restored files passed their checks.
    where["replicate_again"] = replicate_again and all(flags)
    return where


class _NoLimit:
    def take(self, nbytes: int) -> None:
        pass


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


__all__ = ["Topology", "ReplicaTier", "restore", "topology", "node_group", "held_replicas", "remove_replica",
           "check_replica", "fmt"]
