"""Names that say one thing: each renamed module, class, attribute and command
answers under its new name, and its old name keeps working for one more
release with a LazyckptDeprecationWarning (or, for the command line, a note on
stderr) naming the new one."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

import lazyckpt
from lazyckpt.cli import build_parser
from lazyckpt.options import LazyckptDeprecationWarning


def _fresh_import(name):
    """Import ``name`` as a first import does (its module-level warning included)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_the_rules_of_the_line_are_lazyckpt_lineage_and_the_old_module_warns():
    from lazyckpt import lineage
    from lazyckpt.tiers import line
    assert lineage.RECORD == "history.json" and callable(lineage.line)
    assert line.Line.__name__ == "Line" and not hasattr(line, "History")
    with pytest.warns(LazyckptDeprecationWarning, match="lazyckpt.history is deprecated: use lazyckpt.lineage"):
        old = _fresh_import("lazyckpt.history")
    for name in lineage.__all__:
        assert getattr(old, name) is getattr(lineage, name), name


def test_checkpointer_line_and_the_deprecated_history_attribute(tmp_path):
    from lazyckpt.tiers.line import Line
    with lazyckpt.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1).wait()
        assert isinstance(ckpt.line, Line) and list(ckpt.line.local_saves()) == [1]
        with pytest.warns(LazyckptDeprecationWarning, match="Checkpointer.history is deprecated: use "
                                                            "Checkpointer.line"):
            assert ckpt.history is ckpt.line
        with warnings.catch_warnings():
            warnings.simplefilter("error")               # the library itself never goes through the alias
            ckpt.save({"w": torch.ones(3) * 2}, step=2).wait()
            assert ckpt.load()["w"][0] == 2


def test_the_trajectory_command_is_listed_and_history_is_its_unlisted_old_name(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    listing = capsys.readouterr().out
    assert "trajectory" in listing and "history" not in listing
    new, old = parser.parse_args(["trajectory", "run"]), parser.parse_args(["history", "run"])
    assert vars(new).keys() == vars(old).keys() and new.run == old.run == "run"
    assert new.func.__name__ == "cmd_trajectory" and old.func.__name__ == "cmd_history"
