"""The neighbour mode of the crash-point harness (tests/_crashneighbours.py):
each program of tests/_crashprograms.py is paused before one of its durable
calls while a second process runs prune, verify, inspect, the leftovers
cleanup, a takeover or a load to completion (and, beside prune's and the
cleanup's own operations, a writer's commit or rollback); then the program
goes on, and what both reported is checked against the directory and a
restart.

The programs that are not one local Checkpointer directory (the lone file,
DCP, the persistent tier's on the S3 server fixture, Lightning's, the HF
Trainer's and Megatron's) get the neighbours that apply to them
(``_crashneighbours.OTHER_NEIGHBOURS``).

CI runs one point of each (program, neighbour) pair (the point differs by pair);
every point is under ``slow``. By hand, every point of every pair:

    .venv/bin/python tests/_crashneighbours.py --out neighbours.json
    .venv/bin/python tests/_crashneighbours.py --all --out all.json   # every program
"""

from __future__ import annotations

import os

import pytest
import torch

import _crashneighbours as cn
import _crashpoints as cp

torch.set_num_threads(1)

PROGRAMS = {p.name: p for p in cn.neighbour_programs()}
#: The lone file, DCP, the persistent tier's, Lightning's, the HF Trainer's and Megatron's programs.
OTHERS = {p.name: p for p in cn.other_programs()}
#: Points a pair in CI.
CI_POINTS = 1

_SUMMARY: list = []


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request):
    yield
    if not _SUMMARY:
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n\nneighbours per program (program, neighbour, points, run, met a lock, violations, seconds):")
        for row in _SUMMARY:
            print("  %-26s %-9s %4d %4d %4d %3d %6.1f" % row)


def _neighbours(program):
    return cn.NEIGHBOURS + (cn.COMMITS if program in cn.TOOL_PROGRAMS else ())


def _run(program, neighbours, work, how_many, s3=None):
    """The dry run once for the program, then ``how_many`` points (None: all) of each neighbour."""
    prog = PROGRAMS.get(program) or OTHERS[program]
    cp.preload(prog)
    n, _ = cp.dry_run(prog, work, s3)
    assert n > 0
    failures = []
    for neighbour in neighbours:
        points = None if how_many is None else cn.sample(n, how_many, f"{program}+{neighbour}")
        outcome = cn.enumerate_pair(prog, neighbour, work, points=points, s3=s3)
        _SUMMARY.append((program, neighbour, outcome.points, outcome.checked, outcome.blocked,
                         len(outcome.violations), outcome.seconds))
        if outcome.violations:
            failures.append(cn.summarize(outcome))
    assert not failures, "\n".join(failures)


def _ci_programs():
    for name in sorted(PROGRAMS):
        # The o_direct="auto" twins differ from their programs in how bytes reach the disk, which
        # the power model looks at, not the neighbours: every point of theirs is slow.
        marks = [pytest.mark.slow] if name.endswith("-auto") else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.timeout(600)         # about 5-10 s each on a quiet machine
@pytest.mark.parametrize("program", list(_ci_programs()))
def test_neighbours_at_sampled_points(program, tmp_path):
    _run(program, _neighbours(program), str(tmp_path), CI_POINTS)


def _all_pairs():
    for program, neighbour in cn.pairs():
        yield pytest.param(program, neighbour, id=f"{program}-{neighbour}")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("program,neighbour", list(_all_pairs()))
def test_neighbour_at_every_point(program, neighbour, tmp_path):
    _run(program, (neighbour,), str(tmp_path), None)


# ----------------------------------------------------------------------------- the other programs

#: CI's sample of the other programs (one point a pair, about 20 s in all here): these programs'
#: every neighbour, and the persistent tier's own neighbours (the store's load and prune) beside
#: rollback-keepNone-persist (whose takeover and open at the point they failed are the two tests
#: above the harness's). The rest is slow: the o_direct="auto" twin (how bytes reach the disk: the
#: power model's business), Lightning's (seconds to import a point), the HF Trainer's (a Trainer a
#: point and another in its check), save-keepNone-persist (the rollback makes the same calls and more).
OTHERS_CI = {"single-file-save": None, "dcp-lazyckpt": None, "dcp-dcp": None, "dcp-lazyckpt-s3": None,
             "megatron-lazyckpt": None, "rollback-keepNone-persist": ("store-load", "store-prune")}


def _other_setup(program, request):
    """The object store of a persistent tier's program; Megatron-Core, required."""
    prog = OTHERS[program]
    if prog.kind == "megatron":
        from _megatron import stub_triton_kernels
        stub_triton_kernels()
        from _frameworks import require
        require("megatron.core.dist_checkpointing")
    return _s3(request) if prog.persist else None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("program", list(OTHERS_CI))
def test_other_programs_neighbours_at_sampled_points(program, tmp_path, request):
    """The lone file, DCP, the persistent tier and Megatron, each neighbour of
    theirs (_crashneighbours.OTHER_NEIGHBOURS) at one point."""
    s3 = _other_setup(program, request)
    _run(program, OTHERS_CI[program] or cn.neighbours_for(OTHERS[program]), str(tmp_path), CI_POINTS, s3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("program,neighbour", [pytest.param(p, n, id=f"{p}-{n}")
                                               for p, n in cn.pairs(list(OTHERS.values()))])
def test_other_programs_neighbour_at_every_point(program, neighbour, tmp_path, request):
    s3 = _other_setup(program, request)
    _run(program, (neighbour,), str(tmp_path), None, s3)


# ----------------------------------------------------------------------------- with replicas (2 nodes)

def _replica_pairs():
    import _crashreplicas as cr
    for program in cr.dist_programs():
        for neighbour in cn.REPLICA_NEIGHBOURS:
            yield pytest.param(program.name, neighbour, id=f"{program.name}-{neighbour}")


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("program,neighbour", list(_replica_pairs()))
def test_replica_neighbour_at_every_point(program, neighbour, tmp_path):
    """Rank 0 of a replicated job (two gloo ranks, one node each) paused at each
    of its points while node 0's directory is verified or loaded; then the
    replica harness's three restarts. Several seconds a point: slow only."""
    import _crashreplicas as cr
    prog = {p.name: p for p in cr.dist_programs()}[program]
    outcome = cn.enumerate_replica_pair(prog, neighbour, str(tmp_path))
    _SUMMARY.append((program, neighbour, outcome.points, outcome.checked, outcome.blocked,
                     len(outcome.violations), outcome.seconds))
    assert outcome.checked > 0
    assert not outcome.violations, cn.summarize(outcome)


# ----------------------------------------------------------------------------- the harness itself

def test_the_program_pauses_and_the_neighbour_runs_in_between(tmp_path):
    """Not vacuous: paused before its commit point (the record's write), a load
    beside the program returns the old latest; paused before the new step's
    rename (after the commit point), the new one; the program then finishes,
    and the checks pass."""
    program = PROGRAMS["save-keepNone"]
    n, descriptions = cp.dry_run(program, str(tmp_path))
    record = next(i for i, d in enumerate(descriptions, 1) if "history.json" in d)
    rename = next(i for i, d in enumerate(descriptions, 1) if "os.rename" in d
                  and d.endswith("-> dry/run/step_0000000003"))
    assert record < rename
    for k, world in ((record, "before"), (rename, "after")):
        result = cn.run_neighbour_case(program, "load", str(tmp_path), k)
        assert result["problems"] == [], result
        assert result["neighbour"][1]["result"]["world"] == world, result
        assert result["child"][1]["ok"], result


def test_a_neighbour_meeting_the_paused_programs_lock_lets_it_go_on(tmp_path):
    """A takeover needs the commit lock the paused program holds inside its
    commit: the parent is told, lets the program finish, and the takeover ends."""
    program = PROGRAMS["save-keepNone"]
    n, descriptions = cp.dry_run(program, str(tmp_path))
    k = next(i for i, d in enumerate(descriptions, 1) if "history.json" in d)
    result = cn.run_neighbour_case(program, "takeover", str(tmp_path), k)
    assert result["blocked"] is True, result
    assert result["problems"] == [], result
    assert result["neighbour"][1]["ok"], result


def _prune_without_the_lock():
    """prune with the commit lock taken away (the library before retire_old
    planned and acted under it): its deletions go by a plan's step numbers."""
    good = PROGRAMS["prune-keep2"]

    def run(ctx, icp):
        import contextlib
        from lazyckpt.cli.prune import prune
        from lazyckpt.storage.layout import CheckpointDir

        @contextlib.contextmanager
        def no_lock(self, timeout_s=None):
            yield True
        CheckpointDir.commit_lock = no_lock
        with icp.operation():
            return cn._prune_summary(prune(os.path.join(ctx.case, "run"), 2))
    return cp.Program("prune-without-lock", good.prepare, run, good.worlds, kwargs=good.kwargs)


def test_the_checks_catch_a_prune_that_deletes_by_a_stale_plan(tmp_path):
    """Not vacuous: the mutant prune beside a rollback deletes the rollback's new
    step 3 at some point (the newest, reported done), and the checks say so."""
    mutant = _prune_without_the_lock()
    n, descriptions = cp.dry_run(mutant, str(tmp_path))
    points = [i for i, d in enumerate(descriptions, 1) if "os.rename" in d and "step_0000000003 ->" in d]
    assert len(points) == 1, descriptions
    outcome = cn.enumerate_pair(mutant, "rollback", str(tmp_path), points=points)
    assert outcome.violations, cn.summarize(outcome)
    assert any("newest save reported done is step [3]" in p for v in outcome.violations for p in v["problems"]), \
        cn.summarize(outcome)


# ----------------------------------------------------------------------------- found

def _s3(request):
    return request.getfixturevalue("s3_server").crash_store()


@pytest.mark.parametrize("neighbour", ["takeover", "open"])
def test_a_checkpointer_opens_beside_a_persisted_rollback_moving_its_old_steps(neighbour, tmp_path, request):
    """A rollback with a persistent tier, paused after its commit point while it
    moves the superseded steps aside (the record names the new step 3, the
    directory step_0000000003 still holds the old one): a Checkpointer opened
    beside it on the same tier (a takeover, or one that only loads) opens and
    loads the new step 3. Two causes, found in turn: the open re-uploads the
    latest local step the store lacks and verified that step under its name
    first, found the old step 3 and raised "step 3 was abandoned" (the commit in
    progress is the other process's to upload); then load() tried step 3 under
    its name, not in its temporary directory (the line over both tiers took the
    name for every local save), waited for the old step's lock and, told it was
    deleted, returned step 2, neither the old nor the new latest."""
    program = OTHERS["rollback-keepNone-persist"]
    s3 = _s3(request)
    cp.preload(program)
    n, descriptions = cp.dry_run(program, str(tmp_path), s3)
    k = next(i for i, d in enumerate(descriptions, 1) if "os.rename" in d and "run/step_0000000003 ->" in d)
    result = cn.run_neighbour_case(program, neighbour, str(tmp_path), k, s3=s3)
    assert result["problems"] == [], result
    assert result["neighbour"][1]["ok"], result


def test_a_reader_beside_a_lone_file_or_dcp_save_sees_the_old_then_the_new(tmp_path):
    """Not vacuous for the other programs: paused before the lone file's rename,
    a load beside returns the old file, right after it the new one; a DCP
    checkpoint paused before its .metadata's rename is refused as not there,
    right after it loads whole, while the previous one loads as it was."""
    for name, neighbour, field, before, after in (("single-file-save", "load", "world", "old", "new"),
                                                  ("dcp-lazyckpt", "load", "step2", "refused", "new")):
        program = OTHERS[name]
        work = str(tmp_path / name)
        cp.preload(program)
        n, descriptions = cp.dry_run(program, work)
        rename = next(i for i, d in enumerate(descriptions, 1) if "os.replace" in d
                      and d.endswith(("-> dry/model.lzc", "-> dry/step2/.metadata")))
        for k, want in ((rename, before), (rename + 1, after)):
            result = cn.run_neighbour_case(program, neighbour, work, k)
            assert result["problems"] == [], result
            got = result["neighbour"][1]["result"]
            assert got[field] == want, (name, k, result)
            if name.startswith("dcp"):
                assert got["step1"] == "old", result
