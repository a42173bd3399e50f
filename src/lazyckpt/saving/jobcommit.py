"""One decision for the whole job when each node commits on its own (``replicas=``).

With replicas the Checkpointer's directory is node-local and each node's ranks
commit their own step directory (the node is the commit group: node-local
disks share nothing). A rollback saves a step number again, so a crash after
one node committed the new step 3 and before another did would leave the new
save on one node and the abandoned run's step 3 on the other, and a restore
that matches steps by number would load the mix (docs/RELIABILITY.md §5).

Two phases, as a distributed commit does it (Gray's two-phase commit; the
coordinator's log is replaced by every node's own record, so no node's disk is
a single point of failure):

1. **Prepare.** Each node's coordinator makes its save durable in its
   temporary directory (data, manifest) and writes ``DIR/prepared.json``
   naming it; the node's line is unchanged. It then tells the job (a key in
   the rendezvous store) and waits until every node has, or one refused.
2. **Commit.** Only then does any node write its record (its commit point)
   and move the step in; the marker goes after.

So a save one node committed is prepared on every node. Opening the
Checkpointers again (collective, :func:`resolve_prepared`) finishes what a
crash interrupted: a prepared save that some node's record holds is committed
on every node that still has it prepared (roll forward); one that no node
committed is discarded everywhere (the line before it stands). A node whose
commit fails in a live process after every node voted (an I/O error) keeps its
prepared save likewise, and raises saying so (``saving/commit.py``): the next
open finishes it there too.

Only a save that may supersede a committed step takes the round: one whose
step is at most the highest step any node had when the job opened or any save
of this job asked for since (:meth:`JobCommit.needs_round`: the same answer on
every node, from what every node knows). Any other save commits on each node
alone, as before: a crash between two nodes' commits then leaves a step that
only some nodes have, which a restore never chooses (the newest step *every*
node has), and saving that step again is a rollback, with the round. A save
with the round costs one store round trip and waits for the slowest node; a
node that dies fails it on every node (at the deadline), where a save without
it lets the others commit and train on.

Save ids are job-wide (``job-<run>-c<call>``, the same on every node), so the
nodes can tell which save each of them holds, and a restore never takes two
different saves of one step number for one step (``tiers/replicas.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional

from lazyckpt.distributed import RankInfo
from lazyckpt.errors import CheckpointError, CorruptCheckpointError

log = logging.getLogger("lazyckpt")

#: Save ids of job-wide commits begin with this (older ones never do: a uuid, or a run id).
JOB_SAVE = "job-"


def is_job_wide(save_id: Optional[str]) -> bool:
    return bool(save_id) and save_id.startswith(JOB_SAVE)


class JobCommit:
    """The job-wide round between a node's prepared save and its commit point.

    ``world``: the whole job's store namespace (every rank); ``nodes``: how many
    node commit groups vote; ``node``: this rank's."""

    def __init__(self, world: RankInfo, nodes: int, node: int):
        self.world, self.nodes, self.node = world, nodes, node
        self._lock = threading.Lock()
        #: call -> whether this rank published its node's vote as ok.
        self._voted: Dict[int, bool] = {}
        #: The highest step any node had at open or any save() of this job asked for
        #: (-1: none): a save at or below it may supersede a committed step somewhere.
        self.high = -1

    def needs_round(self, step: int) -> bool:
        """Called once per save() call with its step, on every rank (the calls
        and their steps are the same everywhere, so is the answer)."""
        needed = step <= self.high
        self.high = max(self.high, step)
        return needed

    def save_id(self, call: int) -> str:
        """The same on every node for one save() call."""
        return f"{JOB_SAVE}{self.world.run_id}-c{call}"

    def _key(self, call: int, node: int) -> str:
        return f"jc{call}/{node}"

    def prepared(self, call: int, step: int) -> None:
        """Node coordinator, once its save is prepared: vote yes, then wait for
        every node's vote. Raises ``CheckpointError`` if a node refused or the
        deadline passed (then this node's own vote is turned into a refusal
        first, so a node that reads the votes later does not commit either)."""
        with self._lock:
            self._voted[call] = True
        self.world.publish(self._key(call, self.node), {"ok": True})
        keys = [self._key(call, n) for n in range(self.nodes)]
        try:
            votes = self.world.wait_for(keys, "every node's prepared save", step)
        except CheckpointError as exc:
            self._publish_refusal(call, exc)
            raise
        # Every node voted on this call: all of them are done reading earlier calls' votes.
        self._forget_before(call)
        refused = {n: votes[k].get("error") for n, k in enumerate(keys) if not votes[k].get("ok")}
        if refused:
            raise CheckpointError(f"step {step}: not committed on any node: " + "; ".join(
                f"node {n} failed: {e}" for n, e in sorted(refused.items())), step=step)

    def refuse(self, call: int, error: BaseException) -> None:
        """This node will not prepare ``call``'s save: every node learns it now
        (none commits it). A vote already cast yes is left alone: after it, the
        others may have committed. Never raises."""
        with self._lock:
            if self._voted.get(call):
                return
            self._voted[call] = False
        self._publish_refusal(call, error)

    def _publish_refusal(self, call: int, error: BaseException) -> None:
        try:
            self.world.publish(self._key(call, self.node),
                               {"ok": False, "error": f"{type(error).__name__}: {error}"})
        except Exception as exc:        # the store may be gone; the others' deadline still bounds them
            log.warning("lazyckpt: could not publish a refused save to the other nodes: %s", exc)

    def _forget_before(self, call: int) -> None:
        with self._lock:
            old = [c for c in self._voted if c < call]
            for c in old:
                del self._voted[c]
        self.world.delete([self._key(c, self.node) for c in old])


def resolve_prepared(layout: Any, local_rank: int, group: Any, history: Any = None) -> int:
    """Collective, on every rank when a job's Checkpointers open (after each
    node's own recovery): decide the saves a crash left prepared. Returns the
    highest step any node had committed (-1: none), for :attr:`JobCommit.high`.

    One small round on ``group`` (the job's); two more only when some node has
    a prepared save, i.e. after a crash."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    mine: Dict[str, Any] = {"prepared": None, "error": None, "tail": -1}
    found = None
    if local_rank == 0:
        try:
            found = layout.prepared()
            tail = layout.latest()
            mine["tail"] = -1 if tail is None else tail
        except CheckpointError as exc:
            mine["error"] = str(exc)
        if found is not None:
            mine["prepared"] = found[0].event.save_id
    infos: List[Any] = [None] * world
    dist.all_gather_object(infos, mine, group=group)
    errors = [i["error"] for i in infos if i["error"]]
    if errors:      # every rank raises the same (none is left waiting in the next round)
        raise CorruptCheckpointError(errors[0])
    # Before the decision: committing a prepared save (a rollback) only lowers a tail.
    high = max(i["tail"] for i in infos)
    ids = {i["prepared"] for i in infos if i["prepared"]}
    if not ids:
        return high
    # Which of them each node committed: its record, written at its commit point,
    # holds the newest commits (nothing commits on a node after a save it prepared).
    committed_here: List[str] = []
    if local_rank == 0:
        record = layout.record()
        known = {e.save_id for e in record.read()[1]}
        committing = record.committing()
        if committing is not None:
            known.add(committing.event.save_id)
        committed_here = sorted(ids & known)
    votes: List[Any] = [None] * world
    dist.all_gather_object(votes, committed_here, group=group)
    committed = set().union(*map(set, votes))
    error = None
    if found is not None:
        prepared, keep = found
        tmp = os.path.join(layout.path, prepared.tmp)
        try:
            if prepared.event.save_id in committed:
                if os.path.isdir(tmp):
                    if history is not None:
                        history.saw(prepared.event.seq)
                    layout.commit(tmp, prepared.event.step, keep, event=prepared.event)
                    log.warning("lazyckpt: %s: step %d was committed on another node before a crash; "
                                "committed here too", layout.path, prepared.event.step)
                layout.forget_prepared(tmp)
            else:
                layout.discard_prepared(tmp)
                log.warning("lazyckpt: %s: step %d was prepared but no node committed it before a crash; "
                            "discarded", layout.path, prepared.event.step)
        except (OSError, CheckpointError) as exc:
            error = f"{layout.path}: finishing the prepared save of step {prepared.event.step}: " \
                    f"{type(exc).__name__}: {exc}"
    done: List[Any] = [None] * world
    dist.all_gather_object(done, error, group=group)
    failed = [e for e in done if e]
    if failed:
        raise CheckpointError(failed[0])
    return high
