"""A Lightning ``CheckpointIO`` that saves through lazyckpt, asynchronously.

Lightning ships two class trees that reject each other's plugins, so there are
two classes over one implementation, each created on first access (importing
this module imports neither framework)::

    from lazyckpt.integrations.lightning import LazyCheckpointIO      # import lightning.pytorch as L
    from lazyckpt.integrations.lightning import PLLazyCheckpointIO    # import pytorch_lightning as pl

    trainer = L.Trainer(plugins=[LazyCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="path/to/epoch=0-step=10.ckpt")      # resume

**Storage.** Every path Lightning passes (``.../epoch=0-step=10.ckpt``) becomes
one file at exactly that path, written under a hidden temporary name in the
same directory and renamed into place once durable (fsync of the file and of
the directory). ``file_format="torch"`` (default): a ``torch.save`` zip written
through the engine, which ``load_from_checkpoint``, the default
``TorchCheckpointIO`` and ``torch.load`` read; ``"lazyckpt"``: lazyckpt's own
format. A path that holds an ordinary ``torch.save`` checkpoint always loads.

**Commit ordering** (:mod:`._lightning_order`, docs/integrations.md):
``ModelCheckpoint``'s name checks, top-k removals, ``last`` links and logger
notifications see a checkpoint only once it is durable; removals, links and
notifications run on the training thread at the next safe point after the
commit, in the order asked, and are dropped if the save failed. A save inside
a running Trainer is asynchronous; ``trainer.save_checkpoint()`` outside a run
is durable on return; a direct ``save_checkpoint()`` returns once captured.

**Asynchronous semantics** (like Lightning's ``AsyncCheckpointIO``, without
its full clone of the state on the training thread).
``save_checkpoint()`` walks the checkpoint dict (no tensor data copied, about
a millisecond per few hundred tensors), queues it and returns. A background
thread copies the tensors' bytes into lazyckpt's bounded host cache while
training goes on; writer threads flush it. Lightning calls
``save_checkpoint()`` after an optimizer step (batch / epoch / validation
end), and the first thing that modifies those tensors in place afterwards is
either the next ``optimizer.step()`` or, in a training-mode module with
persistent buffers (``BatchNorm``'s running statistics), the next forward.
The plugin therefore installs, while a capture is pending (and also waits
before any Lightning hook that user code overrides, see ``_lightning_order``):

* a global optimizer step pre-hook (``torch.optim.optimizer.
  register_optimizer_step_pre_hook``: every optimizer, whatever wraps it,
  manual optimization included) that waits for the capture, and
* a global module forward pre-hook that waits before the forward of a module
  in training mode that owns persistent buffers (``guard_buffers=True``, the
  default). It is removed as soon as no capture is in progress, so a module
  call costs nothing extra the rest of the time.

The forward/backward of the next step (without buffer updates) and the whole
disk write overlap with training. Scalars (epoch, step, loop counters) are
copied during the walk. Anything else you modify in place between a save and
the next optimizer step (an EMA of the weights updated before the step, a
tensor in a callback's state) must be preceded by
``checkpoint_io.wait_for_snapshot()``.

**Errors** of a background save are raised at the next ``save_checkpoint()``
or at ``teardown()`` (the end of ``fit``), as ``AsyncCheckpointIO`` does, as a
``lazyckpt.CheckpointWriteError`` naming the path and the cause. A failed save
leaves whatever was at the path before (nothing, or the previous complete
file). ``teardown()`` drains every pending save: when ``fit`` returns, every
checkpoint is committed and durable. ``remove_checkpoint()`` and
``load_checkpoint()`` of a path with a save in flight wait for that save first.

**Pickles (allow_pickle).** lazyckpt stores tensors, containers, scalars,
strings, numpy arrays and RNG states natively; only other objects are
pickled, and loading a pickle runs code from the file. A Lightning checkpoint
of an ordinary module has no pickle at all (hyper-parameters are a plain dict
of scalars; loop, callback, optimizer and scheduler states are plain state),
so the default refuses pickles at load, the way ``torch.load`` defaults to
``weights_only=True``. Objects that do end up pickled (an
``argparse.Namespace`` or a custom class in ``save_hyperparameters()``) are
logged once at save time with the entry's name; loading such a file needs one
of ``Trainer.fit(..., weights_only=False)`` (the caller vouches for this
file, exactly the ``torch.load`` contract) or ``LazyCheckpointIO(allow_pickle
=True)`` (the plugin trusts every file it loads). ``weights_only=True`` always
refuses. We do not enable pickles for "files this plugin wrote": nothing
stored next to a checkpoint proves who wrote it (a resumed job is a new
process; an attacker who can replace the file can replace any marker too).

**Distributed.** Lightning calls ``save_checkpoint``/``remove_checkpoint`` on
global rank 0 only (DDP state is replicated) and ``load_checkpoint`` on every
rank. Each call here is local to its process: no collective, which is why
this uses lazyckpt's single-file pipeline (``FileWriteJob``, the engine of
``lazyckpt.save``) on a background thread rather than a ``Checkpointer``
(whose saves are collective once ``torch.distributed`` is initialized).
Strategies that do not route checkpoints through ``CheckpointIO`` (FSDP with
sharded state, DeepSpeed) are not affected by this plugin.

``AsyncFileWriter`` (the background single-file writer with its snapshot
barrier) is shared with :mod:`lazyckpt.integrations.huggingface`.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import weakref
from typing import Any, Dict, List, Optional


log = logging.getLogger("lazyckpt")

__all__ = ["AsyncFileWriter", "LazyCheckpointIO", "PLLazyCheckpointIO", "is_lazyckpt_file"]  # noqa: F822

from lazyckpt.saving.engine import SaveHandle
from . import _lightning_order
from ._lazyclass import lazy_classes
from lazyckpt.storage.fileio import replace_with_link as _replace_with_link
from lazyckpt.storage.stores import for_path
from lazyckpt.tiers.files import FileMirror, check_mirror_target
from ._async import AsyncFileWriter, file_writer_options, is_lazyckpt_file, persist_tier, tier_options
from ._async import file_location as _store_location


# --------------------------------------------------------------------------- CheckpointIO


class _LazyCheckpointIOImpl:
    """The implementation shared by both class trees (see the module docstring).

    Args:
        file_format: ``"torch"`` (default where the engine supports it): each
            ``.ckpt`` is a ``torch.save``-compatible zip written through the
            engine, so ``load_from_checkpoint``, ``Trainer.fit(ckpt_path=...)``
            and the default ``TorchCheckpointIO`` read it without lazyckpt.
            ``"lazyckpt"``: lazyckpt's own format (read back by this plugin or
            ``lazyckpt.load``).
        allow_pickle: ``None`` (default): follow ``weights_only`` of the load
            call, refusing pickles when it is ``None`` or ``True``. ``True``:
            allow unless ``weights_only=True``. ``False``: always refuse.
        guard_buffers: also wait for a pending capture before the forward of a
            training-mode module that owns persistent buffers (BatchNorm).
        persist: the persistent tier, an object store URL (``s3://bucket/prefix``)
            or ``lazyckpt.Persist(url, bandwidth=..., storage_options=...)``:
            every file committed under ``local_root`` is uploaded there in the
            background, removals are applied there too, and
            ``fit(ckpt_path="last")`` with the local directory gone fetches
            ``last.ckpt`` back from it (:mod:`lazyckpt.tiers.files`). The
            Persist's bandwidth caps the uploads; its storage_options default to
            the plugin's. (``persist_to=`` and ``persist_bandwidth=`` are its
            deprecated spellings.)
        local_root: the local directory mirrored under ``persist`` (default:
            the working directory when the plugin is made); every checkpoint
            directory must be under it.
        **knobs: lazyckpt options (``host_cache_bytes``, ``writer_threads``,
            ``o_direct``, ``chunk_bytes``, ``max_pending_saves``, and
            ``storage_options`` for ``s3://`` checkpoint paths ...).
    """

    _torch_io_path = ""     # module of the tree's TorchCheckpointIO, set per tree

    def __init__(self, file_format: Optional[str] = None, allow_pickle: Optional[bool] = None,
                 guard_buffers: bool = True, persist: Any = None, local_root: Optional[str] = None,
                 **knobs: Any) -> None:
        super().__init__()
        if file_format not in (None, "torch", "lazyckpt"):
            raise ValueError(f"file_format={file_format!r}: expected 'torch' (torch.load-compatible .ckpt) "
                             f"or 'lazyckpt'")
        self.file_format = file_format or "torch"
        self.allow_pickle = allow_pickle
        self.guard_buffers = guard_buffers
        self.knobs = dict(knobs)
        #: The persistent tier (a lazyckpt.Persist), or None.
        self.persist = persist_tier(type(self).__name__, persist, self.knobs, new="persist", old="persist_to",
                                    old_url=self.knobs.pop("persist_to", None))
        # Unknown knobs, and those a file writer would ignore, are refused now, not at the first save.
        self.options = file_writer_options(type(self).__name__, self.knobs, object_stores=True,
                                           persist=self.persist is not None)
        if local_root is not None and self.persist is None:
            raise ValueError("local_root= names what persist= mirrors; without persist it does nothing")
        #: The persistent tier's URL, or None.
        self.persist_to = self.persist.url if self.persist is not None else None
        self.local_root = os.path.abspath(local_root or os.getcwd())
        self._mirror: Optional[FileMirror] = None
        self._writer: Optional[AsyncFileWriter] = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        # Commit ordering (see _lightning_order): side effects that need a committed
        # file, run on the training thread at the next safe point after the commit.
        self._actions: "collections.deque[_Action]" = collections.deque()
        self._removals: Dict[str, "_Action"] = {}        # path -> its pending removal
        self._links: Dict[str, "_Action"] = {}           # link path -> its pending link
        self._running_actions = False
        self._trainer_call = threading.local()           # .trainer during Trainer.save_checkpoint
        self._last_trainer: Any = None                   # weakref to the trainer seen last
        self._views: Any = weakref.WeakSet()             # ModelCheckpoints showing a committed view
        self._last_save: Optional[SaveHandle] = None
        self._since_removal: List[SaveHandle] = []       # saves queued since the last removal
        self.saves = 0                                   # saves queued (proves the plugin is in use)
        # Links also run on the writer's thread, the moment the save they wait for is
        # durable: last.ckpt then names the newest committed file at once,
        # not at the next safe point, which a kill may never reach. _action_lock makes each
        # action run once, whichever thread gets to it first.
        self._action_lock = threading.Lock()
        self._at_commit: "list[tuple[SaveHandle, _Action]]" = []
        self._commit_errors: "list[BaseException]" = []
        self._stand_ins: set = set()                     # last paths made by stand_in, not yet Lightning's
        self._publishing: Dict[str, Optional[str]] = {}  # a save not yet published -> its stand-in last path
        self._copy_at_commit: Dict[str, str] = {}        # an object just published -> its stand-in last path
        self._stood_in: Dict[str, str] = {}              # a file just published -> the last path linked to it

    # Runtime state (threads, locks, pending actions) does not travel to ddp_spawn children.
    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_actions", "_removals", "_links", "_running_actions", "_trainer_call",
                              "_last_trainer", "_views", "_last_save", "_since_removal", "_action_lock", "_at_commit",
                              "_commit_errors", "_stand_ins", "_publishing", "_copy_at_commit", "_stood_in")}
        state["_writer"] = None
        state["_mirror"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def mirror(self) -> Optional[FileMirror]:
        """The persistent tier (``persist``), made at first use; None without one."""
        if self._mirror is None and self.persist is not None:
            self._mirror = FileMirror(for_path(self.persist.url), self.persist.url, self.local_root,
                                      tier_options(self.options, self.persist))
        return self._mirror

    @property
    def writer(self) -> AsyncFileWriter:
        if self._writer is None:
            self._writer = AsyncFileWriter(guard_buffers=self.guard_buffers, options=self.options)
        return self._writer

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Queue ``checkpoint`` for ``path``; see the module docstring for when it returns."""
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                            f"{type(self).__name__}")
        local = file_location(path)
        self.run_due_actions()
        mirror = self.mirror
        if mirror is not None:
            check_mirror_target(for_path(local), local)
            mirror.raise_errors()
            mirror.key(local)                       # outside local_root: refused before a byte moves
            mirror.sync(os.path.dirname(local), lambda name: not name.startswith("."))
        self._stand_ins.discard(local)
        self._cancel_pending_removal(local)
        kwargs = {"file_format": self.file_format} if self.file_format == "torch" else {}
        with self._action_lock:
            self._publishing[local] = None
        handle = self.writer.save(checkpoint, local, on_commit=self._committed,
                                  before_publish=functools.partial(self._before_publish, local), **kwargs)
        self._last_save = handle
        self._since_removal.append(handle)
        self.saves += 1
        mode = self._save_mode()
        if mode == "durable":
            # Outside a run nothing calls teardown() later: drain and close the
            # writer now, so its threads do not outlive the save.
            try:
                handle.wait()
            finally:
                self.teardown()
        elif mode == "captured":
            self.writer.wait_for_snapshot()

    def _save_mode(self) -> str:
        """``async`` inside a running Trainer (whose hooks the barrier covers),
        ``durable`` for ``Trainer.save_checkpoint`` outside a run (after ``fit``),
        ``captured`` for a direct call (nothing guards the caller's next line)."""
        trainer = getattr(self._trainer_call, "trainer", None)
        if trainer is None:
            return "captured"
        return "async" if _trainer_running(trainer) else "durable"

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        local = file_location(path)
        if self._writer is not None:
            self._writer.wait(local, raise_errors=False)
        store = for_path(local)
        if not store.exists(local, self.options):
            mirror = self.mirror if not store.is_remote else None
            if mirror is not None and mirror.store.exists(mirror.key(local), self.options):
                # The local copy is gone (a lost node): the persistent tier's.
                return self.load_checkpoint(mirror.key(local), map_location, weights_only)
            raise FileNotFoundError(f"Checkpoint file not found: {local}")
        if not is_lazyckpt_file(local, self.options):
            # A torch zip: written by this plugin with file_format="torch", or by torch.save.
            kwargs: Dict[str, Any] = {"weights_only": self._torch_weights_only(weights_only)}
            if map_location is not None:
                kwargs["map_location"] = map_location
            if store.is_remote:
                # Through lazyckpt's client (its storage_options), not fsspec's: one GET.
                import io
                import torch
                return torch.load(io.BytesIO(store.read_whole(local, self.options, limit=1 << 62)), **kwargs)
            return self._torch_io().load_checkpoint(local, **kwargs)
        created = self._writer is None
        try:
            return self.writer.load(local, map_location=map_location if map_location is not None else "cpu",
                                    allow_pickle=self._allow_pickle(weights_only))
        finally:
            trainer = _active_trainer(self)
            if created and (trainer is None or not _trainer_running(trainer)):
                # A load outside a run (ddp_spawn's launcher reading the workers' weights):
                # nothing calls teardown() later, so its reader threads must not outlive it.
                self.teardown()

    def remove_checkpoint(self, path: Any) -> None:
        """Remove ``path`` once every save queued before this call is durable.

        Inside a running Trainer the removal is deferred to the training
        thread's next safe point after that commit (and dropped if the save
        failed, so the previous checkpoint stays); otherwise it waits."""
        local = file_location(path)
        # Every save queued before, not only the newest: the new top-k file's save failing
        # and last.ckpt's succeeding after it must keep the old top-k file.
        earlier, self._since_removal = self._since_removal, []
        failed = next((h for h in earlier if h.done() and (h.error is not None or h.cancelled)), None)
        if failed is not None:
            log.warning("lazyckpt: %s: not removed: the save of %s failed (the previous checkpoint is kept)",
                        local, failed.name)
            return
        last = self._last_save
        if not self._actions and (last is None or (last.done() and last.error is None)):
            self._remove(local)             # nothing pending, nothing failed: as the default does
            return
        trainer = getattr(self._trainer_call, "trainer", None) or _active_trainer(self)
        action = self._defer(lambda: self._remove(local), kind="remove", path=local)
        self._removals[local] = action
        # Not also at the commit (as links are): a callback that reads best_model_path in
        # its hook must find the file, as with the default plugin; only the training
        # thread moves that view and removes what it named.
        if trainer is None or not _trainer_running(trainer):
            self.run_due_actions(block=True)

    def link_checkpoint(self, target: str, linkpath: str) -> None:
        """``ModelCheckpoint(save_last="link")``: point ``linkpath`` at ``target``
        once ``target`` is durable, replacing the old link atomically."""
        target, linkpath = file_location(target), file_location(linkpath)
        self._stand_ins.discard(linkpath)
        self._cancel_pending_removal(linkpath)
        action = self._defer(lambda: self._link(target, linkpath), kind="link", path=linkpath)
        self._links[linkpath] = action
        self._also_at_commit(action)
        self.run_due_actions()

    def stand_in(self, source: str, path: str, new_name: bool = False) -> None:
        """``save_last``: ``path`` (last.ckpt) names ``source`` (a top-k file just
        queued) from the instant ``source`` becomes visible: a hard link to its
        durable temporary is put in place atomically just before the rename that
        publishes it (a file of its own; with ``"link"`` Lightning's own link then
        replaces it with a symlink, with ``True`` last.ckpt's own save). Lightning
        asks for that link or save only after ``save_checkpoint`` returns; a kill
        in between, the file committed, would leave last.ckpt a step behind.
        ``new_name``: the callback has no last file yet; ``path`` is the name it
        will choose, and is left alone if something already has it.

        On an object store nothing is visible before it is complete and nothing
        links: ``path`` becomes a server-side copy of ``source`` right after
        ``source``'s upload completes (Lightning's own save of last.ckpt follows).
        A kill between the two leaves last.ckpt naming the previous checkpoint,
        which is complete: an object store publishes one object at a time."""
        source, path = file_location(source), file_location(path)
        store = for_path(path)
        if new_name and (store.exists(path, self.options) or self.path_taken(path, lambda: False)):
            return
        with self._action_lock:
            if source in self._publishing:          # not published yet: at its publication
                self._publishing[source] = path
                if new_name:
                    self._stand_ins.add(path)       # still free for the callback's own choice of name
                return
        if store.exists(source, self.options):     # already visible (a fast commit): at once
            store.copy_file(source, path, self.options)
            if self._mirror is not None:
                self._mirror.copied(source, path)

    def _before_publish(self, final: str, temporary: str) -> None:
        """On the writer's thread: ``final``'s bytes are durable at ``temporary``."""
        with self._action_lock:
            last = self._publishing.pop(final, None)
            if last and for_path(final).is_remote:      # an upload is not readable before it completes
                self._copy_at_commit[final] = last
                last = None
        if last:
            _replace_with_link(temporary, last, hard=True)
            with self._action_lock:
                self._stood_in[final] = last

    def _also_at_commit(self, action: "_Action") -> None:
        if action.after is not None and not action.after.done():
            with self._action_lock:
                self._at_commit.append((action.after, action))

    def _committed(self, handle: SaveHandle) -> None:
        """On the writer's thread, ``handle``'s file just durable: the links waiting for it."""
        with self._action_lock:
            copy_to = self._copy_at_commit.pop(handle.path, None)
            stood_in = self._stood_in.pop(handle.path, None)
        if self._mirror is not None:
            # In the order it happened here: the file, then last.ckpt naming it.
            self._mirror.uploaded(handle.path)
            if stood_in:
                self._mirror.copied(handle.path, stood_in)
        if copy_to:
            try:
                for_path(copy_to).copy_file(handle.path, copy_to, self.options)
            except BaseException as exc:        # raised on the training thread at its next safe point
                with self._action_lock:
                    self._commit_errors.append(exc)
        with self._action_lock:
            due = [a for h, a in self._at_commit if h is handle]
            self._at_commit = [(h, a) for h, a in self._at_commit if h is not handle and not h.done()]
        for action in due:
            if not self._claim(action):
                continue
            try:
                action.fn()
            except BaseException as exc:        # raised on the training thread at its next safe point
                with self._action_lock:
                    self._commit_errors.append(exc)

    def _claim(self, action: "_Action") -> bool:
        """Whether this thread runs ``action`` (once, and not once cancelled)."""
        with self._action_lock:
            if action.cancelled or action.ran:
                return False
            action.ran = True
            return True

    def after_pending_saves(self, fn: Any) -> None:
        """Run ``fn()`` on this thread at the first safe point after every save
        queued so far is durable (dropped if one of them failed)."""
        self._defer(fn, kind="call", path="")
        self.run_due_actions()

    def path_taken(self, path: str, exists: Any) -> bool:
        """Whether a new checkpoint may not use ``path``: a save or link to it is
        pending, or it exists and is not about to be removed."""
        path = file_location(path)
        if path in self._stand_ins:
            return False                # a stand-in for the name Lightning is about to choose
        if path in self._links:
            return True
        if self._writer is not None and self._writer.pending(path):
            return True
        return path not in self._removals and bool(exists())

    def pending_paths(self) -> set:
        """Paths not yet durable: pending saves and links."""
        out = set(self._links)
        if self._writer is not None:
            out.update(h.path for h in self._writer.pending())
        return out

    def run_due_actions(self, block: bool = False) -> None:
        """Run, in order, the deferred actions whose saves are durable (all, if ``block``)."""
        with self._action_lock:
            errors, self._commit_errors = self._commit_errors, []
        if errors:
            raise errors[0]
        if self._running_actions or not (self._actions or self._views):
            return
        self._running_actions = True
        try:
            while self._actions:
                head = self._actions[0]
                if head.after is not None and not head.after.done():
                    if not block:
                        return
                    head.after._done.wait()
                due = []
                while self._actions and (self._actions[0].after is None or self._actions[0].after.done()):
                    due.append(self._actions.popleft())
                # Links first: last.ckpt moves to the new durable file before the old
                # file it may point at is removed, so a kill never leaves it dangling.
                due.sort(key=lambda a: a.kind != "link")
                for i, action in enumerate(due):
                    self._forget(action)
                    if action.cancelled or action.ran:
                        continue
                    if action.after is not None and (action.after.error is not None or action.after.cancelled):
                        log.warning("lazyckpt: %s failed: not running the %s of %s that waited for it (the "
                                    "previous checkpoint is kept)", action.after.name, action.kind,
                                    action.path or "the loggers")
                        continue
                    if not self._claim(action):
                        continue
                    try:
                        action.fn()
                    except BaseException:
                        self._actions.extendleft(reversed(due[i + 1:]))
                        raise
        finally:
            self._running_actions = False
            for mc in list(self._views):
                _lightning_order.refresh_view(mc, self)
                if mc.__dict__.get("_lazyckpt_view") is None:
                    self._views.discard(mc)

    def teardown(self) -> None:
        """Drain every pending save (durable on return), run the deferred
        removals, links and logger notifications, and raise a background failure."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.wait(raise_errors=False)
            self.run_due_actions(block=True)
        finally:
            if writer is not None:
                writer.close()
            if self._mirror is not None:
                self._mirror.close()            # every upload, copy and removal asked so far is on the store
        if self._mirror is not None:
            self._mirror.raise_errors()

    def wait_for_snapshot(self) -> None:
        """Block until pending saves have copied their data; then state may be modified in place."""
        if self._writer is not None:
            self._writer.wait_for_snapshot()

    def capturing(self) -> bool:
        """Whether a pending save still reads the live tensors."""
        return self._writer is not None and self._writer._engine.capturing_anything()

    def wait(self) -> None:
        """Block until every pending save is durable and its deferred actions ran; raise a failure."""
        if self._writer is not None:
            self._writer.wait(raise_errors=False)
            self.run_due_actions(block=True)
            self._writer.raise_errors()
        if self._mirror is not None:
            self._mirror.wait()
            self._mirror.raise_errors()

    # ------------------------------------------------------------------ helpers

    def _defer(self, fn: Any, kind: str, path: str) -> "_Action":
        # The newest save queued before this action, finished or not: one that
        # already failed must still cancel what waited for it.
        last = self._last_save
        action = _Action(fn, kind, path, last if last is not None and not (last.done() and last.error is None)
                         else None)
        self._actions.append(action)
        return action

    @staticmethod
    def location(path: Any) -> str:
        """How the plugin keys ``path`` (:func:`file_location`)."""
        return file_location(path)

    def fetch_from_store(self, directory: str, wanted: Any) -> set:
        """Download the files of ``directory`` whose names ``wanted`` accepts from
        the persistent tier (each whole, then renamed into place); their local paths."""
        mirror = self.mirror
        directory = file_location(directory)
        if mirror is None or for_path(directory).is_remote:
            return set()
        out = set()
        for name in mirror.names(directory):
            if wanted(name):
                local = os.path.join(directory, name)
                mirror.fetch(local)
                log.info("lazyckpt: %s: fetched from the persistent tier %s", local, mirror.key(local))
                out.add(os.path.normpath(local))
        return out

    def _remove(self, path: str) -> None:
        for_path(path).delete_file(path, self.options)
        if self._mirror is not None:
            self._mirror.removed(path)

    def _link(self, target: str, linkpath: str) -> None:
        _replace_with_link(target, linkpath)
        if self._mirror is not None:
            self._mirror.copied(target, linkpath)

    def _forget(self, action: "_Action") -> None:
        for table in (self._removals, self._links):
            if table.get(action.path) is action:
                del table[action.path]

    def _cancel_pending_removal(self, path: str) -> None:
        # A new file at a path whose removal is pending replaces it atomically.
        action = self._removals.pop(path, None)
        if action is not None:
            with self._action_lock:
                action.cancelled = True

    def _allow_pickle(self, weights_only: Optional[bool]) -> bool:
        if weights_only is not None:
            return not weights_only and self.allow_pickle is not False
        return bool(self.allow_pickle)

    def _torch_weights_only(self, weights_only: Optional[bool]) -> bool:
        return not self._allow_pickle(weights_only)

    def _torch_io(self) -> Any:
        import importlib
        module = importlib.import_module(self._torch_io_path)
        return module.TorchCheckpointIO()


class _Action:
    """A side effect that needs the saves queued before it to be durable."""

    __slots__ = ("fn", "kind", "path", "after", "cancelled", "ran")

    def __init__(self, fn: Any, kind: str, path: str, after: Optional[SaveHandle]):
        self.fn, self.kind, self.path, self.after, self.cancelled, self.ran = fn, kind, path, after, False, False


def file_location(path: Any) -> str:
    """A path Lightning passes, as the plugin keys it: fsspec's ``file://`` is the
    local path; then an absolute path or a normalized ``s3://`` URL."""
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://"):]
    return _store_location(path)


def _trainer_running(trainer: Any) -> bool:
    status = getattr(getattr(trainer, "state", None), "status", None)
    return getattr(status, "value", status) == "running"


def _active_trainer(plugin: Any) -> Any:
    ref = getattr(plugin, "_last_trainer", None)
    return ref() if ref is not None else None


_TREES = {
    # class name: (module of CheckpointIO, module of TorchCheckpointIO)
    "LazyCheckpointIO": ("lightning.pytorch.plugins.io", "lightning.fabric.plugins.io.torch_io"),
    "PLLazyCheckpointIO": ("pytorch_lightning.plugins.io", "lightning_fabric.plugins.io.torch_io"),
}


def _make_class(name: str) -> type:
    import importlib
    io_module, torch_io = _TREES[name]
    try:
        base = importlib.import_module(io_module).CheckpointIO
    except ImportError as exc:
        package = io_module.split(".")[0]
        raise ImportError(f"lazyckpt.integrations.lightning.{name} needs the `{package}` package "
                          f"(pip install 'lazyckpt[lightning]')") from exc
    doc = (f"Asynchronous lazyckpt ``CheckpointIO`` for ``{io_module.split('.')[0]}`` "
           f"(see :mod:`lazyckpt.integrations.lightning`).\n\n" + (_LazyCheckpointIOImpl.__doc__ or ""))
    cls = type(name, (_LazyCheckpointIOImpl, base), {"__module__": __name__, "__qualname__": name,
                                                     "__doc__": doc, "_torch_io_path": torch_io})
    _lightning_order.install(io_module.rsplit(".plugins", 1)[0], _LazyCheckpointIOImpl)
    return cls


__getattr__ = lazy_classes(__name__, _TREES, _make_class)
