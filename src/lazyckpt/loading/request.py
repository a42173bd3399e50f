"""What a load is asked to do, as one typed value.

Every public load (``lazyckpt.load``, ``lazyckpt.load_async``,
``Checkpointer.load``, ``Checkpointer.load_async``) keeps its explicit keyword
parameters, so that they show in help() and in editors, and turns them into
one :class:`LoadRequest` where it is called: the arguments are checked there,
once, before any file is opened or any thread started, and the one value is
what travels down to the loader (``loader.load_path`` -> ``load_step`` /
``load_file`` -> ``load_tree``). A test asserts that those public signatures
list exactly this dataclass's fields, in order and with its defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

__all__ = ["LoadRequest", "MapLocation", "KeySpec", "normalize_keys"]

MapLocation = Union[None, str, torch.device, Dict[str, str], Callable[..., Any]]
KeySpec = Union[str, Tuple[Any, ...]]

_MAP_LOCATION_FORMS = ("None, a device ('cpu', 'cuda:0', torch.device('cpu')), a dict mapping saved "
                       "locations to devices ({'cuda:1': 'cuda:0'}) or a callable (storage, location)")


def _check_device(value: Any, what: str) -> None:
    if isinstance(value, torch.device):
        return
    try:
        torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{what}={value!r} is not a device: {exc}. Give a device such as 'cpu', "
                         f"'cuda', 'cuda:0' or 'meta'") from None


def check_map_location(map_location: Any) -> None:
    """Refuse what ``torch.load`` would not take as ``map_location``; strings
    must parse as devices (a typo fails here, not after the file was read)."""
    if map_location is None or callable(map_location):
        return
    if isinstance(map_location, (str, torch.device)):
        _check_device(map_location, "map_location")
        return
    if isinstance(map_location, dict):
        for saved, target in map_location.items():
            if not isinstance(saved, str) or not isinstance(target, (str, torch.device)):
                raise TypeError(f"map_location={map_location!r}: a dict maps saved location strings to "
                                f"devices, e.g. {{'cuda:1': 'cuda:0'}}; got {saved!r}: {target!r}")
            _check_device(target, f"map_location[{saved!r}]")
        return
    raise TypeError(f"map_location must be {_MAP_LOCATION_FORMS}; got {type(map_location).__name__}")


def normalize_keys(keys: Any) -> Tuple[Tuple[Any, ...], ...]:
    """``keys=`` as key paths: a top-level key ``"model"`` or a path into nested
    dicts ``("optim", "state", 0)``, alone or in a list."""
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    elif isinstance(keys, (bytes, dict)) or not isinstance(keys, Iterable):
        raise TypeError(f"keys must be a key (keys='model'), a key path (keys=('optim', 'state')) or a list "
                        f"of them (keys=['model', ('optim', 'state')]); got {type(keys).__name__}")
    paths = []
    for key in keys:
        if isinstance(key, list):
            raise TypeError(f"keys: {key!r} is a list; a key path into nested dicts is a tuple, "
                            f"e.g. {tuple(key)!r}")
        path = tuple(key) if isinstance(key, tuple) else (key,)
        if not path:
            raise ValueError("keys: an empty key path () selects nothing; name a top-level key or a "
                             "path such as ('optim', 'state')")
        for part in path:
            try:
                hash(part)
            except TypeError:
                raise TypeError(f"keys: {path!r} holds an unhashable {type(part).__name__}; "
                                f"a key path holds dict keys (str, int, ...)") from None
        paths.append(path)
    return tuple(paths)


def _check_into(into: Any) -> None:
    # A module or an optimizer is not filled by into= (only tensors in dicts and lists
    # are); the load would return the state and leave them as they were.
    if isinstance(into, torch.nn.Module):
        raise TypeError(f"into= got a {type(into).__name__} module; pass its state: "
                        f"into=model.state_dict() (filled in place), or "
                        f"model.load_state_dict(lazyckpt.load(path))")
    if isinstance(into, torch.optim.Optimizer):
        raise TypeError(f"into= got a {type(into).__name__}; an optimizer's state is loaded with "
                        f"optimizer.load_state_dict(lazyckpt.load(path, keys=...)[...])")


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What one load reads and how (see ``lazyckpt.load``): ``map_location``
    as in ``torch.load``; ``keys``, the entries to read, normalized to a tuple
    of key paths; ``into``, a state filled in place; ``allow_pickle``, whether
    pickled objects may be unpickled; ``strict``, whether every tensor of
    ``into`` must get a value. Checked when built: a wrong type is a
    TypeError, a wrong value a ValueError, each saying what to pass."""

    map_location: MapLocation = None
    keys: Optional[Iterable[KeySpec]] = None
    into: Any = None
    allow_pickle: bool = False
    strict: bool = True

    def __post_init__(self) -> None:
        check_map_location(self.map_location)
        if self.keys is not None:
            object.__setattr__(self, "keys", normalize_keys(self.keys))
        if self.into is not None:
            _check_into(self.into)
        for name in ("allow_pickle", "strict"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                # A string such as "false" is truthy: taking it as True would unpickle.
                raise TypeError(f"{name} must be True or False, not {value!r}")

    @property
    def paths(self) -> Optional[Tuple[Tuple[Any, ...], ...]]:
        """The normalized key paths (None: everything)."""
        return self.keys  # type: ignore[return-value]


def refuse_misspelled(knobs: Dict[str, Any], where: str) -> None:
    """A keyword close to one of the load's own parameters (``mapp_location=``)
    is a typo of it: said so here, before it reaches the options, whose error
    would only call it an unknown option."""
    fields = [f.name for f in dataclasses.fields(LoadRequest)]
    for name in knobs:
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.75)
        if close:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}; did you mean {close[0]}=?")


#: The request of a load that was given no options.
DEFAULT = LoadRequest()
