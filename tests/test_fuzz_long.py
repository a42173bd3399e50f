"""The long run of tests/format_fuzz.py (``-m slow``): every format lazyckpt
reads, twenty minutes of one seed. Its own module, so that the unit layer
(``pytest -m unit``, which takes test_fuzz.py whole) does not run it; the CI
sample is tests/test_fuzz.py::test_format_fuzz_sample."""

from __future__ import annotations

import pytest

import format_fuzz as ff


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_format_fuzz_long():
    """Twenty minutes of inputs of a seed of its own (``python tests/format_fuzz.py --minutes N`` by hand)."""
    counts, failures = ff.run(seed=20261206, seconds=1200)
    assert sum(counts.values()) > 0
    assert not failures, "\n".join(d for _, d in failures[:20])
