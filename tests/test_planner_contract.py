"""The save planner's contract (issue 36): the engine and a step's commit call
only what the planner base classes declare, so a new planner is written
against ``SavePlanner``/``StepSavePlanner`` alone, not against what
``StepPlanner`` happens to have. Read from the source, nothing runs."""

import ast
import inspect

from lazyckpt.saving import commit, engine
from lazyckpt.saving.planner import SavePlanner, StepPlanner, StepSavePlanner


def _planner_uses(module, names=("planner",)) -> set:
    """Attributes read on a local named ``planner`` or on ``job.planner``."""
    used = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in names:
            used.add(node.attr)
        elif isinstance(owner, ast.Attribute) and owner.attr == "planner":
            used.add(node.attr)
    return used


def _declared(cls) -> set:
    return {n for klass in cls.__mro__ if klass is not object for n in vars(klass) if not n.startswith("__")}


def test_the_commit_calls_only_what_the_step_planner_base_declares():
    used = _planner_uses(commit) - {"StepPlanner", "StepSavePlanner"}
    assert {"check_references", "report", "check", "layouts_index", "outcome", "learned"} <= used   # not vacuous
    assert used <= _declared(StepSavePlanner), sorted(used - _declared(StepSavePlanner))


def test_the_engine_calls_only_what_the_planner_base_declares():
    used = _planner_uses(engine) - {"SavePlanner"}
    assert {"plan", "abort", "committed"} <= used
    assert used <= _declared(SavePlanner), sorted(used - _declared(SavePlanner))


def test_the_step_planner_implements_every_declared_call():
    for name in _declared(StepSavePlanner) - {"replicated"}:
        mine = inspect.getattr_static(StepPlanner, name)
        base = inspect.getattr_static(StepSavePlanner, name)
        assert mine is not base or name in vars(SavePlanner), f"StepPlanner does not implement {name}"
