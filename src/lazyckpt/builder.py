"""Assembling a Checkpointer from its options.

``Checkpointer(...)`` is what users call; this module is what it is made of,
decided from the arguments in one place: the arguments in their groups
(lazyckpt/options.py, where a combination that cannot apply cannot be
written) resolved into the internal Options, the real conflicts between
groups refused before anything is created, the directory's store looked up
once and the directory made durable, the commit group (the node's ranks with ``replicas=``, else the
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

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from lazyckpt.saving.autorep import AutoReplication
from lazyckpt.saving.costs import SaveCosts
from lazyckpt.saving.engine import SaveEngine
from lazyckpt.saving.incremental import IncrementalIndex
from lazyckpt.saving.jobcommit import JobCommit
from lazyckpt.storage.base import Directory, Store
from lazyckpt.storage.fileio import make_dirs_durable
from lazyckpt.storage.stores import for_path
from lazyckpt.tiers.line import Line
from lazyckpt.tiers.persistent import PersistentTier
from lazyckpt.tiers.replicas import ReplicaTier, Topology, node_group, topology as replica_topology
from .distributed import RankInfo, rank_info
from .errors import CheckpointError
from .knobs import Options
from .options import Groups, resolved_options
from .retention import Policy


@dataclass
class Parts:
    """What one Checkpointer is made of (see the module docstring)."""
    #: The arguments, checked and in their groups (lazyckpt/options.py).
    groups: Groups
    options: Options
    #: The retention policy (``keep=``), or None: every step is kept.
    keep: Optional[Policy]
    #: The store the directory is on (its one lookup) and the directory, normalized, on it.
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
    line: Line


def assemble(directory: Any, groups: Optional[Groups] = None) -> Parts:
    """The parts of a Checkpointer of ``directory`` from its arguments in their
    groups (:func:`lazyckpt.options.settle`; none: every default). Raises
    ``ValueError`` for a combination that conflicts, ``CheckpointError`` for a
    directory that cannot be used."""
    groups = groups if groups is not None else Groups()
    directory = os.fspath(directory)
    options = resolved_options(groups)
    store = for_path(directory)
    on_object_store = store.is_remote
    persist, dist_args = groups.persist, groups.distributed
    persist_to = persist.url if persist is not None else None
    if persist is not None and on_object_store:
        raise ValueError(f"persist= adds an object store tier under a local directory, and the directory "
                         f"{directory!r} is already on an object store: give a local directory")
    if groups.io.storage_options is not None and not on_object_store and persist is None:
        # The one setting a group can still hold where nothing reads it (a site-wide
        # LAZYCKPT_STORAGE_OPTIONS is a default, not a request, and is not refused).
        raise ValueError("IO(storage_options={...}) does not apply here: it configures an object store, and "
                         "neither the directory nor persist= is an s3:// URL")
    if (on_object_store or persist is not None) and options.incremental != "off":
        raise ValueError("incremental checkpoints are not supported on object stores yet: their "
                         "references name local step directories")
    if groups.replicas is not None:
        if on_object_store or dist_args.process_group is not None:
            raise ValueError("replicas= needs a node-local directory and the default process group: "
                             "drop distributed=Distributed(process_group=...) or the s3:// directory")
        if options.incremental != "off":
            raise ValueError("replicas= cannot be combined with incremental checkpoints yet")
    # "auto": found by content (lazyckpt/saving/autorep.py); unset: a warning names them.
    keys = dist_args.identical_keys
    chosen: Any = "auto" if keys == "auto" else list(keys or [])
    directory = store.normalize(directory)
    if on_object_store:
        store.check(directory, options)     # wrong credentials, a missing bucket: one clear error, now
    else:
        if os.path.isfile(directory):
            raise CheckpointError(f"{directory} is a file, and a Checkpointer keeps a directory of steps: "
                                  f"give a directory path; to read this file use lazyckpt.load({directory!r})",
                                  path=directory)
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
    process_group, timeout = dist_args.process_group, dist_args.commit_timeout
    replicas = groups.replicas
    if replicas is not None:
        topology = replica_topology(replicas.node_size, replicas.k)
        process_group = node_group(topology)
        if persist_to is not None:       # each node's steps persist under their own prefix
            persist_to = f"{persist_to.rstrip('/')}/node_{topology.node:05d}"
    dist = rank_info(directory, process_group, timeout)
    replica_tier = job = None
    if replicas is not None:
        # The world's namespace cannot come from the directory: node-local paths may differ.
        world = rank_info("lazyckpt-replicas", None, timeout)
        replica_tier = ReplicaTier(directory, topology, replicas.k, world, float(replicas.bandwidth), timeout)
        job = JobCommit(world, topology.nodes, topology.node)
    auto = None
    if dist.distributed and (chosen == "auto" or not chosen):
        auto = AutoReplication("auto" if chosen == "auto" else "hint")
    if (dist.distributed or replica_tier is not None) and options.queue_policy == "skip":
        raise ValueError("IO(when_full='skip') cannot be used with several ranks: a save skipped on "
                         "one rank and not on another would never commit; use when_full='block'")
    incremental = IncrementalIndex(options.incremental, options.full_every) if options.incremental != "off" \
        else None
    engine = SaveEngine(options, guard_buffers=groups.io.guard_buffers)
    persistent = None
    if persist is not None:
        # The tier's own store settings, else the directory's (io=, LAZYCKPT_STORAGE_OPTIONS).
        persist_options = options if persist.storage_options is None else \
            dataclasses.replace(options, storage_options=persist.storage_options)
        persistent = PersistentTier(for_path(persist_to), persist_to, persist_options, dist, persist.keep)
    # The line of history (lazyckpt/tiers/line.py): numbers commits, tells live from abandoned
    # saves across the local record, the manifests and the persistent tier's events.
    line = Line(None if on_object_store else layout,
                layout if on_object_store else (persistent.dir if persistent is not None else None))
    return Parts(groups=groups, options=options, keep=groups.keep, store=store, directory=directory,
                 on_object_store=on_object_store, layout=layout, replicated=chosen, dist=dist, topology=topology,
                 replicas=replica_tier, job=job, auto=auto, incremental=incremental, engine=engine,
                 costs=SaveCosts(options.advise_mtbf), persistent=persistent, line=line)


__all__ = ["Parts", "assemble"]
