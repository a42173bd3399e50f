"""Fuzzing the loader (short CI run; benchmarks/fuzz_long.py runs >= 10,000 inputs),
and at the end every other format lazyckpt reads (tests/format_fuzz.py).

Property, for every mutated file: ``lazyckpt.load`` (whole file, or selected
keys) returns or raises a ``lazyckpt.CheckpointError`` subclass. Never another
exception type, never a hang (SIGALRM per example), never an allocation
driven by a claimed size (Python-heap peak under tracemalloc < 4 MiB and the
reader's buffers < 2 x the file size + 1 MiB, for files under 64 KiB).

Three mutators (tests/lzc_fuzz.py): raw byte damage anywhere; byte damage of
the footer with the trailer checksum recomputed (xxh3-64) so that it reaches
the parser; structured changes of the footer JSON (types, huge/negative
ints, NaN, deep nesting, missing keys, wrong tags), trailer recomputed.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lazyckpt
import lzc_fuzz as fz

pytestmark = [pytest.mark.timeout(240),
              # st.randoms() values print as long reprs; harmless.
              pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")]

def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return fz.make_base_files(str(tmp_path_factory.mktemp("fuzz")))


@pytest.fixture
def scratch(tmp_path):
    return str(tmp_path / "mutated.lzc")


def _assert_safe(outcome, detail, what):
    assert outcome not in fz.FAILURES, f"{what}: {outcome}: {detail}"


def test_unmutated_bases_load_within_budget(bases):
    for path, data in bases:
        outcome, detail = fz.check(path, len(data), keys=["model"])
        assert outcome == "ok", detail
    outcome, detail = fz.check(bases[0][0], len(bases[0][1]))
    assert outcome == "ok", detail
    outcome, detail = fz.check(bases[1][0], len(bases[1][1]))
    assert outcome == "library" and "UnsafeObjectError" in detail      # the pickled entry is refused


def test_the_harness_catches_other_exceptions_hangs_and_allocations(bases, scratch, monkeypatch):
    """The property can fail: each failure class is detected."""
    path, data = bases[0]
    import lazyckpt.api

    def boom(*a, **k):
        raise KeyError("boom")
    monkeypatch.setattr(lazyckpt, "load", boom)
    assert fz.check(path, len(data))[0] == "other"

    def slow(*a, **k):
        import time
        while True:
            time.sleep(0.01)
    monkeypatch.setattr(lazyckpt, "load", slow)
    assert fz.check(path, len(data), time_limit=0.3)[0] == "hang"

    def greedy(*a, **k):
        return [bytearray(1 << 20) for _ in range(8)]
    monkeypatch.setattr(lazyckpt, "load", greedy)
    assert fz.check(path, len(data))[0] == "memory"
    monkeypatch.undo()

    def big_buffer(*a, **k):
        from lazyckpt.storage.fileio import anonymous_buffer
        anonymous_buffer(64 << 20)
    monkeypatch.setattr(lazyckpt, "load", big_buffer)
    assert fz.check(path, len(data))[0] == "memory"


@fuzz(100)
@given(r=st.randoms(use_true_random=False))
def test_fuzz_raw_bytes(bases, scratch, r):
    mutated = fz.mutate_raw(bases[0][1], r)
    with open(scratch, "wb") as f:
        f.write(mutated)
    _assert_safe(*fz.check(scratch, len(mutated)), "raw mutation")


@fuzz(100)
@given(r=st.randoms(use_true_random=False), select=st.booleans())
def test_fuzz_footer_bytes_with_valid_checksum(bases, scratch, r, select):
    mutated = fz.mutate_footer_bytes(bases[0][1], r)
    with open(scratch, "wb") as f:
        f.write(mutated)
    _assert_safe(*fz.check(scratch, len(mutated)), "footer bytes")
    if select:
        _assert_safe(*fz.check(scratch, len(mutated), keys=["model"]), "footer bytes, keys=['model']")


@fuzz(120)
@given(r=st.randoms(use_true_random=False), base=st.sampled_from([0, 0, 0, 1]),
       keys=st.sampled_from([None, None, ["model"], [("model", "w")], ["misc", "opt"], ["nope"]]))
def test_fuzz_footer_structure(bases, scratch, r, base, keys):
    mutated = fz.mutate_footer_doc(bases[base][1], r)
    with open(scratch, "wb") as f:
        f.write(mutated)
    _assert_safe(*fz.check(scratch, len(mutated), keys=keys), f"footer structure, keys={keys}")


# Hand-picked structured cases the random search may take long to reach.

def _doc(bases):
    return json.loads(fz.footer_of(bases[0][1]))


def _dict_node(doc, key):
    tree = doc["tree"]
    return tree["v"][tree["k"].index(key)]


SELECTION_CASES = {
    "dict-without-k": lambda d: d["tree"].pop("k"),
    "dict-without-v": lambda d: d["tree"].pop("v"),
    "k-not-a-list": lambda d: d["tree"].update(k=5),
    "unhashable-key": lambda d: d["tree"]["k"].__setitem__(0, {"$": "seq", "t": "list", "v": [1]}),
    "nested-dict-without-k": lambda d: _dict_node(d, "model").pop("k"),
}


@pytest.mark.parametrize("keys", [["model"], [("model", "w")]])
@pytest.mark.parametrize("mutate", list(SELECTION_CASES.values()), ids=list(SELECTION_CASES))
def test_key_selection_on_a_hostile_tree(bases, scratch, mutate, keys):
    """Partial loads walk the tree before the decoder does; a hostile dict node
    must be a CorruptCheckpointError there too, as it is for a full load."""
    doc = _doc(bases)
    mutate(doc)
    with open(scratch, "wb") as f:
        f.write(fz.with_footer(bases[0][1], json.dumps(doc).encode()))
    with pytest.raises(lazyckpt.CorruptCheckpointError):
        lazyckpt.load(scratch)
    try:
        lazyckpt.load(scratch, keys=keys)
    except lazyckpt.CheckpointError:
        pass
    except BaseException as exc:        # noqa: BLE001
        pytest.fail(f"keys={keys}: {type(exc).__name__} escaped: {exc}")


@pytest.mark.parametrize("seed", range(40))
def test_seeded_inputs_of_the_long_run(bases, tmp_path, seed):
    """A slice of benchmarks/fuzz_long.py's input sequence (same seeds)."""
    name, outcome, detail = fz.one_input(bases, random.Random(seed), str(tmp_path / "m.lzc"))
    assert outcome not in fz.FAILURES, f"seed {seed} ({name}): {outcome}: {detail}"


# --------------------------------------------------------------------------- every other format
# tests/format_fuzz.py: step directories, torch zips and safetensors through convert, DCP in
# both layouts through LazyStorageReader and convert. The property: the saved values (where a
# checksum covers the damage), or an error of lazyckpt's family; never another exception type,
# a hang, or a write outside the input's directory.


def _format_fuzz(seed, count=None, seconds=None):
    import format_fuzz as ff
    counts, failures = ff.run(seed, count=count, seconds=seconds)
    assert sum(counts.values()) > 0
    assert not failures, "\n".join(d for _, d in failures[:20])
    return counts


def test_format_fuzz_sample():
    """A few seconds of inputs of a fixed seed, every format among them (the long run:
    tests/test_fuzz_long.py, marked slow, outside the unit layer)."""
    counts = _format_fuzz(seed=0, count=80)
    import format_fuzz as ff
    assert {fmt for fmt, _, _ in counts} == set(ff.FORMATS)
    assert any(outcome == "library" for _, _, outcome in counts)
