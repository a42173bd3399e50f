"""Assembling a Checkpointer from its options (issue 36).

``Checkpointer(...)`` is what users call; this module is what it is made of,
decided from the arguments in one place: the options resolved and checked
(a combination that nothing would read is refused here, before anything is
created), the directory's store looked up once and the directory made
durable, the commit group (the node's ranks with ``replicas=``, else the
process group), the tiers (replicas, the persistent tier), the save engine,
and the line of history over the tiers. :func:`assemble` returns them as
:class:`Parts`; the Checkpointer then opens the directory (recovery, the
latest step, a drain to resume), which reads and writes it.

The order is the ranks' order: the node groups and the rendezvous are
collective, so every rank assembles the same parts in the same order (as
the constructor always did; only where the code lives moved). What needs
the Checkpointer itself (its callbacks) is wired by the Checkpointer after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from lazyckpt.saving.autorep import AutoReplication
from lazyckpt.saving.costs import SaveCosts
from lazyckpt.saving.engine import SaveEngine
from lazyckpt.saving.incremental import IncrementalIndex
from lazyckpt.saving.jobcommit import JobCommit
from lazyckpt.storage.base import Directory, Store
from lazyckpt.storage.fileio import make_dirs_durable
from lazyckpt.storage.stores import for_path
from lazyckpt.tiers.line import History
from lazyckpt.tiers.persistent import PersistentTier
from lazyckpt.tiers.replicas import ReplicaTier, Topology, node_group, topology as replica_topology
from .distributed import RankInfo, rank_info
from .errors import CheckpointError
from .knobs import Options, resolve


@dataclass
class Parts:
    """What one Checkpointer is made of (see the module docstring)."""
    options: Options
    keep_last: Optional[int]
    #: The directory's store (its one lookup) and the directory, normalized, on it.
    store: Store
    directory: str
    #: Whether the directory is itself on an object store (no local tier).
    on_object_store: bool
    layout: Directory
    #: Top-level keys identical on every rank (DDP), ``"auto"``, or [].
    replicated: Any
    #: The commit group: this process's ranks (the node's with replicas=).
    dist: RankInfo
    topology: Optional[Topology]
    replicas: Optional[ReplicaTier]
    #: With replicas=: every node's save commits once every node has it prepared.
    job: Optional[JobCommit]
    auto: Optional[AutoReplication]
    incremental: Optional[IncrementalIndex]
    engine: SaveEngine
    costs: SaveCosts
    persistent: Optional[PersistentTier]
    history: History


def assemble(directory: str, keep_last: Optional[int] = None, host_cache_bytes: Optional[int] = None, *,
             options: Optional[Options] = None, replicated: Union[None, str, List[Any]] = None,
             process_group: Any = None, commit_timeout_s: float = 600.0, guard_buffers: bool = True,
             persist_to: Optional[str] = None, persist_keep_last: Optional[int] = None,
             storage_options: Optional[Dict[str, Any]] = None, replicas: int = 0,
             node_size: Optional[int] = None, replica_bandwidth: float = 0.0, **knobs: Any) -> Parts:
    """The parts of a Checkpointer of ``directory`` (the Checkpointer's own
    arguments, documented there). Raises ``ValueError`` for a combination that
    does not apply, ``CheckpointError`` for a directory that cannot be used."""
    for name, value in (("keep_last", keep_last), ("persist_keep_last", persist_keep_last)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
    directory = os.fspath(directory)
    options = resolve(options, host_cache_bytes=host_cache_bytes, storage_options=storage_options, **knobs)
    store = for_path(directory)
    on_object_store = store.is_remote
    persist_store = for_path(persist_to) if persist_to is not None else None
    if persist_store is not None and (on_object_store or not persist_store.is_remote):
        raise ValueError(f"persist_to must be an s3:// URL and the directory a local one, got "
                         f"directory={directory!r}, persist_to={persist_to!r}")
    refuse_options_that_do_not_apply(
        object_store=on_object_store or persist_to is not None, persist_to=persist_to,
        incremental=options.incremental, replicas=replicas, storage_options=storage_options,
        persist_keep_last=persist_keep_last, persist_bandwidth=knobs.get("persist_bandwidth"),
        full_every=knobs.get("full_every"), node_size=node_size, replica_bandwidth=replica_bandwidth)
    if (on_object_store or persist_to is not None) and options.incremental != "off":
        raise ValueError("incremental checkpoints are not supported on object stores yet: their "
                         "references name local step directories")
    # "auto": found by content (lazyckpt/saving/autorep.py); unset: a warning names them.
    if replicated == "auto":
        chosen: Any = "auto"
    elif isinstance(replicated, str):
        raise ValueError(f"replicated must be a list of top-level keys or 'auto', got {replicated!r}")
    else:
        chosen = list(replicated or [])
    directory = store.normalize(directory)
    if on_object_store:
        store.check(directory, options)     # wrong credentials, a missing bucket: one clear error, now
    else:
        try:
            make_dirs_durable(directory)     # its entry survives a power loss after a commit
        except OSError as exc:
            raise CheckpointError(f"{directory}: cannot create checkpoint directory: {exc}",
                                  path=directory) from exc
        if not os.access(directory, os.W_OK | os.X_OK):
            raise CheckpointError(f"{directory}: directory is not writable", path=directory)
    layout = store.checkpoint_dir(directory, options)
    # Replicas on partner nodes (lazyckpt/tiers/replicas.py): the directory is node-local and
    # each node's ranks commit their own steps in it (the node is the commit group).
    topology = None
    if replicas:
        if on_object_store or process_group is not None:
            raise ValueError("replicas= needs a node-local directory and the default process group")
        if options.incremental != "off":
            raise ValueError("replicas= cannot be combined with incremental checkpoints yet")
        topology = replica_topology(node_size, replicas)
        process_group = node_group(topology)
        if persist_to is not None:       # each node's steps persist under their own prefix
            persist_to = f"{persist_to.rstrip('/')}/node_{topology.node:05d}"
    dist = rank_info(directory, process_group, commit_timeout_s)
    replica_tier = job = None
    if replicas:
        # The world's namespace cannot come from the directory: node-local paths may differ.
        world = rank_info("lazyckpt-replicas", None, commit_timeout_s)
        replica_tier = ReplicaTier(directory, topology, replicas, world, replica_bandwidth, commit_timeout_s)
        job = JobCommit(world, topology.nodes, topology.node)
    auto = None
    if dist.distributed and (chosen == "auto" or not chosen):
        auto = AutoReplication("auto" if chosen == "auto" else "hint")
    if (dist.distributed or replica_tier is not None) and options.queue_policy == "skip":
        raise ValueError("queue_policy='skip' cannot be used with several ranks: a save skipped on "
                         "one rank and not on another would never commit")
    incremental = IncrementalIndex(options.incremental, options.full_every) if options.incremental != "off" \
        else None
    engine = SaveEngine(options, guard_buffers=guard_buffers)
    persistent = PersistentTier(persist_store, persist_to, options, dist, persist_keep_last) \
        if persist_to is not None else None
    # The line of history (lazyckpt/tiers/line.py): numbers commits, tells live from abandoned
    # saves across the local record, the manifests and the persistent tier's events.
    history = History(None if on_object_store else layout,
                      layout if on_object_store else (persistent.dir if persistent is not None else None))
    return Parts(options=options, keep_last=keep_last, store=store, directory=directory,
                 on_object_store=on_object_store, layout=layout, replicated=chosen, dist=dist, topology=topology,
                 replicas=replica_tier, job=job, auto=auto, incremental=incremental, engine=engine,
                 costs=SaveCosts(options.advise_mtbf), persistent=persistent, history=history)


def refuse_options_that_do_not_apply(*, object_store: bool, persist_to: Optional[str], incremental: str,
                                     replicas: int, **passed: Any) -> None:
    """An option passed to this Checkpointer that nothing would read is a
    mistake (a typo'd combination, a forgotten ``persist_to``): refused, with
    the option and the reason. Only explicit arguments: a LAZYCKPT_* variable
    or an ``Options`` object is a site-wide default, not a request to this one."""
    needs = {"storage_options": (object_store, "it configures the object store, and neither the directory "
                                               "nor persist_to is an s3:// URL"),
             "persist_keep_last": (persist_to is not None, "it is the persistent tier's retention, and "
                                                           "persist_to is not set"),
             "persist_bandwidth": (persist_to is not None, "it caps the persistent tier's upload, and "
                                                           "persist_to is not set"),
             "full_every": (incremental != "off", "it spaces the full saves of incremental checkpoints, "
                                                  "and incremental is off"),
             "node_size": (bool(replicas), "it groups ranks into nodes for replicas, and replicas=0"),
             "replica_bandwidth": (bool(replicas), "it caps the replica transfer, and replicas=0")}
    defaults = {"replica_bandwidth": 0.0, "full_every": 0, "persist_bandwidth": 0.0}   # the default changes nothing
    for name, (applies, why) in needs.items():
        value = passed[name]
        if value is not None and value != defaults.get(name) and not applies:
            shown = "{...}" if name == "storage_options" else repr(value)     # it may hold credentials
            raise ValueError(f"{name}={shown} does not apply here: {why}")


__all__ = ["Parts", "assemble", "refuse_options_that_do_not_apply"]
