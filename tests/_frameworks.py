"""Importing an integration's framework in a test.

Outside CI a missing framework skips the test (a developer may not have
installed every extra); under CI (``CI=true``) it fails: CI installs every
framework, so a missing one is a broken install step, not a test to pass.
"""

from __future__ import annotations

import importlib
import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


#: Test modules that required a framework when they were imported (tests/conftest.py
#: marks their tests ``frameworks``).
REQUIRED_BY: set = set()


def require(module: str):
    """The imported module, or skip (fail under CI) if it is missing."""
    import sys
    REQUIRED_BY.add(sys._getframe(1).f_globals.get("__name__", "").rsplit(".", 1)[-1])
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if under_ci():
            pytest.fail(f"{module} is not installed, but CI must test its integration: {exc}",
                        pytrace=False)
        pytest.skip(f"{module} is not installed: {exc}", allow_module_level=True)
