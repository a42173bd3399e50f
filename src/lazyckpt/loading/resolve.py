"""What a path designates -- a data file, a committed step, a Checkpointer
directory (its latest step), on whichever store holds it -- and the data
files to look at (:class:`Target`). The store decides (``Store.locate``);
this module adds the manifest and the files it names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lazyckpt.knobs import Options, resolve as resolve_options
from lazyckpt.storage.base import Store


@dataclass
class Target:
    """What a user-given path designates."""
    path: str                               # as given (absolute)
    kind: str                               # "file", "step" or "directory"
    files: List[Tuple[Optional[int], str]]  # (rank or None for a lone file, path)
    step_dir: Optional[str] = None
    manifest: Optional[Dict[str, Any]] = None
    steps: List[int] = field(default_factory=list)   # committed steps ("directory" only)
    #: The store it is on (looked up once, by :func:`resolve`).
    store: Optional[Store] = None

    @property
    def step(self) -> Optional[int]:
        if self.manifest is not None and type(self.manifest.get("step")) is int:
            return self.manifest["step"]
        return None


def read_manifest(store: Store, step_dir: str, options: Optional[Options] = None) -> Dict[str, Any]:
    """The parsed manifest of the committed step at ``step_dir`` on ``store``."""
    return store.read_manifest(step_dir, options or resolve_options())


def resolve(path: str, options: Optional[Options] = None, all_steps: bool = False, *, store: Store) -> Target:
    """Resolve a file, a step or a Checkpointer directory (-> its latest step),
    local or on an object store (``all_steps``: a directory's steps listed too)."""
    options = options or resolve_options()
    located = store.locate(path, options, all_steps=all_steps)
    if located.kind == "file":
        return Target(located.path, "file", [(None, located.path)], store=store)
    manifest = store.read_manifest(located.step_path, options)
    return Target(located.path, located.kind, manifest_files(store, located.step_path, manifest), located.step_path,
                  manifest, located.steps, store)


def manifest_files(store: Store, step_dir: str, manifest: Dict[str, Any]) -> List[Tuple[Optional[int], str]]:
    return [(f["rank"], store.join(step_dir, f["name"]))
            for f in sorted(manifest["files"], key=lambda f: f["rank"])]
