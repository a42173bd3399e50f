"""The package's own imports, read from the source without running it.

A move of a module must not leave an ``ImportError`` waiting on a path the
suite rarely runs (replica restore, S3, DTensor assembly): every import of a
``lazyckpt`` module, relative or absolute, at the top of a module or inside a
function, must name a module that exists and names that module defines. The
modules must also form no cycle, counting the imports made inside functions
(a cycle held together by a function-level import is still a cycle), and a
function-level import of a lazyckpt module must say why on its line
(``# lazy: ...``).
"""

import ast
import os
import pathlib
import re
from typing import Dict, Iterator, List, Optional, Set, Tuple

import lazyckpt

ROOT = os.path.dirname(os.path.abspath(lazyckpt.__file__))


def _modules() -> Dict[str, str]:
    mods = {}
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(top, name), ROOT)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            mods[".".join(["lazyckpt"] + rel)] = os.path.join(top, name)
    return mods


MODULES = _modules()
_TREES: Dict[str, ast.Module] = {}


def _tree(mod: str) -> ast.Module:
    if mod not in _TREES:
        with open(MODULES[mod], encoding="utf-8") as f:
            _TREES[mod] = ast.parse(f.read(), MODULES[mod])
    return _TREES[mod]


def _is_package(mod: str) -> bool:
    return MODULES[mod].endswith("__init__.py")


def _defined_names(mod: str) -> Set[str]:
    """Names bound at module level (also under if/try/with at module level)."""
    names: Set[str] = set()

    def visit(body: List[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []) or [])
                for h in getattr(node, "handlers", []) or []:
                    visit(h.body)
    visit(_tree(mod).body)
    return names


def _in_functions(tree: ast.Module) -> Set[int]:
    inside: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if sub is not node:
                    inside.add(id(sub))
    return inside


def _absolute(mod: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str) -> Iterator[Tuple[ast.stmt, str, Optional[str], bool]]:
    """(node, target module, imported name or None, inside a function)."""
    tree = _tree(mod)
    inside = _in_functions(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(mod, node)
            if target != "lazyckpt" and not target.startswith("lazyckpt."):
                continue
            for a in node.names:
                yield node, target, a.name, id(node) in inside
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "lazyckpt" or a.name.startswith("lazyckpt."):
                    yield node, a.name, None, id(node) in inside


def _edges(mod: str) -> Set[str]:
    """Modules this module's imports load: each target and the packages above it
    that are not above ``mod`` itself (importing ``lazyckpt.cli.inspect`` runs
    ``lazyckpt/cli/__init__.py`` first); the root package is left out (it only
    re-exports the public surface and nothing below imports it at the top)."""
    out = set()
    for _, target, name, _ in _imports(mod):
        if name is not None and f"{target}.{name}" in MODULES:
            target = f"{target}.{name}"
        if target not in MODULES:
            continue
        out.add(target)
        parts = target.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if not (mod == parent or mod.startswith(parent + ".")):
                out.add(parent)
    out.discard(mod)
    out.discard("lazyckpt")
    return out


def test_every_lazyckpt_import_resolves():
    problems = []
    for mod in sorted(MODULES):
        for node, target, name, _ in _imports(mod):
            where = f"{os.path.relpath(MODULES[mod], ROOT)}:{node.lineno}"
            if target not in MODULES:
                problems.append(f"{where}: no module {target}")
            elif name not in (None, "*") and f"{target}.{name}" not in MODULES \
                    and name not in _defined_names(target):
                problems.append(f"{where}: {target} defines no {name}")
    assert not problems, "\n".join(problems)


def _cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    # The root package's __init__ re-exports the public surface; no module imports it
    # except the command line and the integrations' lazy paths, which are not part of a cycle
    # unless __init__ reaches back to them.
    graph = {m: _edges(m) for m in MODULES}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _folder(mod: str) -> str:
    """The layer a module belongs to: its folder under the package
    (``lazyckpt.storage.s3`` and ``lazyckpt.storage`` are "storage"), or the
    top-level module itself (``lineage``, ``knobs``: each a layer of one)."""
    return mod.split(".")[1]


def test_no_cycle_between_folders():
    # Issue 36: the layers (formats < storage < saving, loading < tiers < the facade < ...)
    # hold only if no folder reaches back into one that imports it, even through a
    # top-level module (storage -> history, now lineage, -> storage.fileio was one such loop).
    graph: Dict[str, Set[str]] = {}
    why: Dict[Tuple[str, str], str] = {}
    for mod in MODULES:
        if mod == "lazyckpt":
            continue
        for target in _edges(mod):
            a, b = _folder(mod), _folder(target)
            if a != b:
                graph.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{mod} -> {target}")
    cycle = _cycle(graph)
    assert cycle is None, "folder cycle: " + "; ".join(why[(a, b)] for a, b in zip(cycle, cycle[1:]))


def test_formats_does_no_io_and_no_distribution():
    # The format modules are pure (bytes in, structures out): they import nothing
    # of the package that touches files, stores or process groups.
    allowed = {"formats", "errors"}
    bad = sorted(f"{mod} -> {target}" for mod in MODULES if _folder_or_none(mod) == "formats"
                 for target in _edges(mod) if _folder(target) not in allowed)
    assert not bad, bad


#: What the rest of the package may import from ``storage/`` (issue 36): the interface
#: (``base``), the entry that picks a store for a path (``stores``), the POSIX primitives
#: (``fileio``) and a framework's own files beside ours (``sidefiles``). Everything else
#: there is one store's implementation, reached only through those.
STORAGE_SURFACE = {"lazyckpt.storage", "lazyckpt.storage.base", "lazyckpt.storage.stores",
                   "lazyckpt.storage.fileio", "lazyckpt.storage.sidefiles"}


def test_no_module_outside_storage_imports_a_store_implementation():
    bad = sorted(f"{mod} -> {target}" for mod in MODULES if _folder_or_none(mod) not in (None, "storage")
                 for target in _edges(mod) if target.startswith("lazyckpt.storage.") and target not in STORAGE_SURFACE)
    assert not bad, bad
    # Not vacuous: the surface is imported, and implementation modules exist to be refused.
    assert any(t in STORAGE_SURFACE for mod in MODULES if _folder_or_none(mod) == "saving" for t in _edges(mod))
    assert {"lazyckpt.storage.layout", "lazyckpt.storage.s3layout", "lazyckpt.storage.locks"} <= set(MODULES)


#: Where a path enters lazyckpt (issue 36): the facade, the Checkpointer (and the builder
#: that assembles it, and the option group Persist whose URL it checks), the cli, the framework
#: integrations, the converters and the study tools look a path's store up once and pass it
#: down; the engine, the planner, the loader and the tiers never do.
PATH_ENTRIES = {None, "api", "checkpointer", "builder", "options", "cli", "integrations", "interop", "study",
                "storage"}


def test_for_path_is_called_only_where_a_path_enters():
    calls = {}
    for mod in MODULES:
        for node in ast.walk(_tree(mod)):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "for_path"
                                               or getattr(node.func, "attr", None) == "for_path"):
                calls.setdefault(_folder_or_none(mod), []).append(f"{mod}:{node.lineno}")
    bad = sorted(c for folder, found in calls.items() if folder not in PATH_ENTRIES for c in found)
    assert not bad, bad
    assert calls.get("integrations") and calls.get("api")     # not vacuous: the entries do call it


#: The store classes: outside storage/ nothing asks which one it has.
STORE_CLASSES = {"LocalStore", "S3Store", "MemoryStore", "ObjectStore", "CheckpointDir", "ObjectCheckpointDir"}


def test_no_module_outside_storage_branches_on_which_store_it_has():
    """A store is asked for its declared properties (``is_remote``,
    ``holds_references``) and its methods, never for its identity: no
    ``isinstance`` against a store class and no comparison of a store's
    ``name`` or ``scheme`` (``mem://`` joined with no edit outside storage/)."""
    bad = []
    for mod in MODULES:
        if _folder_or_none(mod) in (None, "storage"):
            continue
        for node in ast.walk(_tree(mod)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | \
                        {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & STORE_CLASSES:
                    bad.append(f"{mod}:{node.lineno}: isinstance against {sorted(names & STORE_CLASSES)}")
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    if isinstance(side, ast.Attribute) and side.attr in ("name", "scheme") \
                            and "store" in ast.unparse(side.value).lower():
                        bad.append(f"{mod}:{node.lineno}: compares {ast.unparse(side)}")
    assert not bad, bad


def _folder_or_none(mod: str) -> Optional[str]:
    return _folder(mod) if mod != "lazyckpt" else None


def test_function_level_imports_say_why():
    problems = []
    for mod in sorted(MODULES):
        with open(MODULES[mod], encoding="utf-8") as f:
            lines = f.read().splitlines()
        for node, target, _, inside in _imports(mod):
            if inside and "# lazy:" not in lines[node.lineno - 1]:
                problems.append(f"{os.path.relpath(MODULES[mod], ROOT)}:{node.lineno}: "
                                f"import of {target} inside a function, with no '# lazy: <why>'")
    assert not problems, "\n".join(sorted(set(problems)))


def test_the_checker_sees_what_it_checks():
    """The walk finds the package and its in-function imports (a vacuous pass would hide moves)."""
    assert "lazyckpt.api" in MODULES and "lazyckpt.integrations.dcp" in MODULES
    assert any(inside for m in MODULES for *_, inside in _imports(m))


def test_no_package_name_hides_its_submodule():
    """``from .prune import prune`` in a package's __init__ rebinds ``package.prune``
    to the function, and ``from package import prune`` then yields the function."""
    problems = []
    for pkg in sorted(m for m in MODULES if _is_package(m)):
        subs = {m.rsplit(".", 1)[1] for m in MODULES if m.rsplit(".", 1)[0] == pkg and m != pkg}
        for node in _tree(pkg).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in subs:
                problems.append(f"{pkg}: def/class {node.name} hides {pkg}.{node.name}")
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(pkg, node)
                for a in node.names:
                    bound = a.asname or a.name
                    if bound in subs and f"{target}.{a.name}" != f"{pkg}.{bound}":
                        problems.append(f"{pkg}:{node.lineno}: {bound} hides {pkg}.{bound}")
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id in subs:
                        problems.append(f"{pkg}:{node.lineno}: {t.id} hides {pkg}.{t.id}")
    assert not problems, "\n".join(problems)


MODULE_PATH = re.compile(r"\b(?:lazyckpt/)?((?:saving|loading|storage|state|formats|tiers|interop|integrations|"
                         r"study|cli)/[A-Za-z_0-9]+\.py)\b|\blazyckpt/([A-Za-z_0-9]+\.py)\b")


def test_docstrings_and_docs_name_modules_that_exist():
    """A module named by its path (``lazyckpt/storage/iomode.py``,
    ``saving/commit.py``) in the package's docstrings and comments, the docs
    and the README is a file that exists: moving a module updates its mentions."""
    src = pathlib.Path(ROOT)                    # src/lazyckpt
    repo = src.parent.parent
    texts = list(src.rglob("*.py")) + [repo / "README.md"] + sorted((repo / "docs").glob("*.md"))
    stale = []
    for path in texts:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in MODULE_PATH.finditer(line):
                named = m.group(1) or m.group(2)
                if not (src / named).is_file():
                    stale.append(f"{path.relative_to(repo)}:{n}: {m.group(0)}")
    assert not stale, "\n".join(stale)
