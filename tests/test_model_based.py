"""Model-based test of issue 22 ("The test that keeps it true").

The features are driven together by rules (train through every kind of
in-place writer, save, wait, roll back, crash, restart, lose the local tier,
corrupt a byte, prune with a concurrent reader) over the configuration matrix
incremental x persist_to x replicas x replicated x ranks, and checked after
every rule against the line of history (tests/_model.py).

* One rank: a hypothesis RuleBasedStateMachine per configuration (failures
  shrink to a minimal rule sequence; the reproduction blob is printed).
* Two ranks: a seeded random program, the same on every rank (tests/_dist.py);
  the failing seed and program are in the message. Which two-rank
  configurations run is drawn from LAZYCKPT_MODEL_SEED (printed; random when
  unset) to fit CI; scripts/soak_model.py runs the whole matrix for longer.
* Issue 33 item 5: with persist_to the hypothesis machine reaches SeaweedFS
  through the fault proxy (tests/_s3proxy.py) and draws fail_next / outage /
  heal; every machine draws corrupt_meta, prune_in_flight and reshape, and
  keep (3, None, 1, or a policy of KeepLast, KeepEvery, KeepBest: _model.POLICIES;
  one rank, local only: the model predicts which steps retention leaves) and
  full_every (0, 2) per example; lease_expiry
  starts a process (LAZYCKPT_MODEL_KILLS). Fixed short programs run each new
  rule in CI (test_faults_corruption_and_prune_in_flight_..., test_a_writer_
  whose_lease_expired_...). One-rank local machines also draw interval
  (Every(steps=k): the run saves when should_save says so, the model predicts
  step % k == 0) and preemption (a real SIGUSR1: rule preempt); fixed program:
  test_an_interval_and_preemption_save_the_steps_the_model_predicts.
* Combinations the library refuses are asserted to be refused with a
  ValueError naming the reason (tests/_model.py: expected_refusal).
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import uuid

import pytest
import torch

import lazyckpt
from _dist import run_ranks
from _model import (POLICIES, TRAIN_KINDS, Config, Faults, InvariantError, Run, all_configs, checkpointer_kwargs,
                    expected_refusal, random_program, run_knobs, run_program, schedule_knobs_allowed)
from lazyckpt.retention import KeepBest, KeepEvery, KeepLast

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

pytestmark = pytest.mark.timeout(600)

CONFIGS = all_configs()
ONE_RANK = [c for c in CONFIGS if c.ranks == 1 and not expected_refusal(c)]
TWO_RANKS = [c for c in CONFIGS if c.ranks == 2 and not expected_refusal(c)]
REFUSED_ONE_RANK = [c for c in CONFIGS if c.ranks == 1 and expected_refusal(c)]
REFUSED_TWO_RANKS = [c for c in CONFIGS if c.ranks == 2 and expected_refusal(c)]

#: The seed that picks the two-rank configurations and their programs of this run.
MODEL_SEED = int(os.environ.get("LAZYCKPT_MODEL_SEED") or random.SystemRandom().randrange(1 << 30))
#: How many two-rank configurations one CI run drives (the soak script runs them all).
TWO_RANK_SAMPLE = int(os.environ.get("LAZYCKPT_MODEL_TWO_RANK_CONFIGS", "2"))
TWO_RANK_LENGTH = int(os.environ.get("LAZYCKPT_MODEL_TWO_RANK_LENGTH", "12"))
CHOSEN_TWO_RANKS = sorted(random.Random(MODEL_SEED).sample(range(len(TWO_RANKS)),
                                                           min(TWO_RANK_SAMPLE, len(TWO_RANKS))))
#: Hypothesis budget per one-rank configuration.
EXAMPLES = int(os.environ.get("LAZYCKPT_MODEL_EXAMPLES", "2"))
STEPS = int(os.environ.get("LAZYCKPT_MODEL_STEPS", "15"))
KILLS = os.environ.get("LAZYCKPT_MODEL_KILLS", "") not in ("", "0")
SHRINK = os.environ.get("LAZYCKPT_MODEL_SHRINK", "") not in ("", "0")


@pytest.fixture(autouse=True)
def _quiet_lazyckpt():
    # Rollbacks and fallbacks log warnings by design: hundreds of them per run.
    logger = logging.getLogger("lazyckpt")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture
def model_store(request):
    """(an s3:// prefix on the session's SeaweedFS, the Faults of the proxy in front of it),
    or (None, None) when the config has no persist_to. The Checkpointers (and their child
    processes) reach the server through the fault-injecting proxy (AWS_ENDPOINT_URL)."""
    cfg = request.node.callspec.params["cfg"]
    if not cfg.persist:
        return None, None
    from _s3proxy import S3FaultProxy
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    mp = request.getfixturevalue("monkeypatch")
    proxy = S3FaultProxy(server.endpoint)
    request.addfinalizer(proxy.close)
    for k, v in server.env().items():
        mp.setenv(k, v)
    mp.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return f"s3://{bucket}/model", Faults(proxy, server.endpoint)


@pytest.fixture
def persist_url(request):
    """An s3:// prefix on the session's SeaweedFS, reached directly (no proxy: the
    tests without fault rules), or None when the config has no persist_to."""
    cfg = request.node.callspec.params["cfg"]
    if not cfg.persist:
        return None
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    mp = request.getfixturevalue("monkeypatch")
    for k, v in server.env().items():
        mp.setenv(k, v)
    return f"s3://{bucket}/model"


# ----------------------------------------------------------------- one rank: hypothesis

def machine_for(cfg: Config, base: str, persist_url, faults=None):
    class LineOfHistory(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.dir = tempfile.mkdtemp(dir=base)
            self.url = f"{persist_url}/{uuid.uuid4().hex[:12]}" if persist_url else None
            self.run = None

        # keep (an int, None or a policy: KeepEvery, KeepBest), full_every, and on one-rank
        # local configurations interval (Every(steps=k): rule save asks should_save) and
        # preemption (rule preempt sends SIGUSR1): drawn per run, not Config dimensions (CI time).
        @initialize(keep=st.sampled_from([3, None, 1] + POLICIES), full_every=st.sampled_from([0, 2]),
                    interval=st.sampled_from([None, 2, 3]), preemption=st.booleans())
        def start(self, keep, full_every, interval, preemption):
            if faults is not None:
                faults.clear()
            knobs = {"keep": keep}
            if lazyckpt.Options(incremental=cfg.incremental).incremental != "off":
                knobs["full_every"] = full_every
            if schedule_knobs_allowed(cfg):
                knobs.update(interval=interval, preemption=preemption)
            self.run = Run(cfg, self.dir, self.url, knobs=knobs, faults=faults)

        @rule(kind=st.sampled_from(range(len(TRAIN_KINDS))))
        def train(self, kind):
            self.run.apply("train", kind)

        @rule()
        def save(self):
            self.run.apply("save")

        @rule()
        def wait(self):
            self.run.apply("wait")

        @rule(k=st.integers(0, 7))
        def rollback(self, k):
            self.run.apply("rollback", k)

        @rule()
        def crash(self):
            self.run.apply("crash")

        # A killed process costs a Python start (seconds): a separate test below in CI,
        # here with LAZYCKPT_MODEL_KILLS=1 (scripts/soak_model.py always).
        @precondition(lambda self: KILLS)
        @rule(when=st.integers(0, 1 << 16))
        def kill(self, when):
            self.run.apply("kill", when)

        @precondition(lambda self: KILLS)
        @rule(at=st.integers(0, 7))
        def kill_in_commit(self, at):
            self.run.apply("kill_in_commit", at)

        @precondition(lambda self: KILLS)
        @rule()
        def takeover(self):
            self.run.apply("takeover")

        @rule()
        def restart(self):
            self.run.apply("restart")

        @precondition(lambda self: self.run is not None and self.run.preemption)
        @rule()
        def preempt(self):
            self.run.apply("preempt")

        @rule()
        def lose_local(self):
            self.run.apply("lose_local")

        @rule(where=st.integers(0, 1 << 16))
        def corrupt(self, where):
            self.run.apply("corrupt", where)

        @rule(keep=st.integers(0, 1))
        def prune(self, keep):
            self.run.apply("prune", keep)

        @rule(arg=st.integers(0, 1 << 16))
        def corrupt_meta(self, arg):
            self.run.apply("corrupt_meta", arg)

        @rule(keep=st.integers(0, 1))
        def prune_in_flight(self, keep):
            self.run.apply("prune_in_flight", keep)

        @rule(keep=st.integers(0, 1))
        def prune_beside_commit(self, keep):
            self.run.apply("prune_beside_commit", keep)

        @rule(arg=st.integers(0, 1 << 16))
        def reshape(self, arg):
            self.run.apply("reshape", arg)

        @precondition(lambda self: KILLS)
        @rule()
        def lease_expiry(self):
            self.run.apply("lease_expiry")

        # Faults of the store (persist_to): the proxy between the Checkpointer and SeaweedFS.
        @precondition(lambda self: faults is not None)
        @rule(arg=st.integers(0, 7))
        def fail_next(self, arg):
            self.run.apply("fail_next", arg)

        @precondition(lambda self: faults is not None)
        @rule(arg=st.integers(0, 1 << 8))
        def outage(self, arg):
            self.run.apply("outage", arg)

        @precondition(lambda self: faults is not None)
        @rule()
        def heal(self):
            self.run.apply("heal")

        @invariant()
        def line_of_history_holds(self):
            if self.run is None:
                return
            self.run.check()
            self.checked = len(self.run.log)

        def teardown(self):
            if self.run is None:
                return
            try:
                # The final checks, only after a run that passed (not to mask its failure):
                # the store catches up once the faults end, then the study.
                if getattr(self, "checked", -1) == len(self.run.log):
                    self.run.apply("heal")
                    self.run.check()
                    self.run.check_study()
            finally:
                if faults is not None:
                    faults.clear()
                self.run.close()

    LineOfHistory.__name__ = f"LineOfHistory[{cfg.id}]"
    return LineOfHistory


@pytest.mark.parametrize("cfg", ONE_RANK, ids=[c.id for c in ONE_RANK])
def test_one_rank_follows_the_line_of_history(cfg, model_store, tmp_path):
    machine = machine_for(cfg, str(tmp_path), *model_store)
    # Shrinking replays dozens of whole runs: minutes, off in CI (LAZYCKPT_MODEL_SHRINK=1 turns it on).
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    # A server round trip per rule: fewer examples with persist_to.
    examples = max(1, EXAMPLES // 2) if cfg.persist else EXAMPLES
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                                         print_blob=True, database=None, phases=phases,
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()


MEM_CONFIGS = [c for c in ONE_RANK if c.persist]


@pytest.mark.parametrize("cfg", MEM_CONFIGS, ids=[c.id for c in MEM_CONFIGS])
def test_one_rank_follows_the_line_of_history_with_persist_to_on_mem(cfg, tmp_path):
    """The same machine with the persistent tier on ``mem://`` (issue 36: a new store
    joins the model): the object layout through another client, no server. The
    rules that start processes are off here as in CI (a mem:// bucket is this
    process's), and so are the proxy's store faults (tests/test_memstore.py fails
    a mem:// store's uploads instead)."""
    machine = machine_for(cfg, str(tmp_path), f"mem://model{uuid.uuid4().hex[:8]}/run")
    machine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                         print_blob=True, database=None,
                                         phases=[Phase.explicit, Phase.reuse, Phase.generate],
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()


# ----------------------------------------------------------------- two ranks: seeded programs

def _two_rank_program(rank, world, cfg, base, persist_url, program, knobs=None):
    logging.getLogger("lazyckpt").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    try:
        return ("ok", run_program(cfg, base, persist_url, program, rank, world, knobs=knobs))
    except InvariantError as exc:
        return ("invariant", str(exc))


def run_two_ranks(cfg: Config, seed: int, base: str, persist_url, length: int = 25, timeout: float = 300):
    program = random_program(seed, length, cfg)
    knobs = run_knobs(seed, cfg)
    url = f"{persist_url}/{uuid.uuid4().hex[:12]}" if persist_url else None
    where = f"{cfg.id} seed={seed} knobs={knobs} (replay: LAZYCKPT_MODEL_SEED / scripts/soak_model.py " \
            f"--config {cfg.id} --length {length} --knobs \"{knobs}\" --program \"{program}\")"
    try:
        results = run_ranks(cfg.ranks, _two_rank_program, cfg, base, url, program, knobs, timeout=timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise AssertionError(f"{where}: a rank failed outside the invariants: {exc}\nprogram: {program}") from exc
    failed = [r[1] for r in results if r[0] != "ok"]
    assert not failed, f"{where}: {failed}"


@pytest.mark.parametrize("cfg", TWO_RANKS, ids=[c.id for c in TWO_RANKS])
def test_two_ranks_follow_the_line_of_history(cfg, persist_url, tmp_path):
    i = TWO_RANKS.index(cfg)
    if i not in CHOSEN_TWO_RANKS:
        pytest.skip(f"not drawn by LAZYCKPT_MODEL_SEED={MODEL_SEED} (runs {TWO_RANK_SAMPLE} of "
                    f"{len(TWO_RANKS)}; scripts/soak_model.py runs all)")
    seed = random.Random(MODEL_SEED * 1000 + i).randrange(1 << 30)
    print(f"LAZYCKPT_MODEL_SEED={MODEL_SEED}: {cfg.id} program seed {seed}")
    run_two_ranks(cfg, seed, str(tmp_path), persist_url, TWO_RANK_LENGTH)


@pytest.mark.parametrize("incremental", [False, True])
def test_a_save_killed_at_a_random_instant_leaves_the_line_of_history(incremental, tmp_path):
    """SIGKILL during (or just after) a save by another process of the run: the
    restarted Checkpointer loads either that save or the one before, exactly."""
    cfg = Config(incremental=incremental)
    seed = random.Random(MODEL_SEED).randrange(1 << 16)
    program = [("save", 0), ("wait", 0), ("train", 1), ("train", 2), ("save", 0), ("kill", seed),
               ("train", 3), ("save", 0), ("kill", seed + 1), ("save", 0)]
    print(f"LAZYCKPT_MODEL_SEED={MODEL_SEED}: {cfg.id} program {program}")
    run_program(cfg, str(tmp_path), None, program)


@pytest.mark.parametrize("cfg", [Config(), Config(incremental=True), Config(persist=True)],
                         ids=lambda c: c.id)
def test_kills_inside_rollback_commits_and_takeovers_keep_the_line_of_history(cfg, persist_url, tmp_path):
    """Issue 33: the model stops a process inside a commit (between the renames of a
    rollback that supersedes steps) at every rename, and displaces a live writer."""
    program = [("save", 0), ("save", 0), ("train", 1), ("save", 0), ("save", 0), ("wait", 0)]
    for at in range(3):
        program += [("rollback", at), ("train", at), ("kill_in_commit", at), ("save", 0), ("wait", 0)]
    program += [("save", 0), ("takeover", 0), ("train", 2), ("save", 0), ("rollback", 1), ("takeover", 0),
                ("save", 0), ("wait", 0)]
    url = f"{persist_url}/{uuid.uuid4().hex[:12]}" if persist_url else None
    run_program(cfg, str(tmp_path), url, program)


@pytest.mark.parametrize("cfg,keep_last", [
    # Both keep-all variants are slow (about 40 s each in CI): the same program, whose saves
    # go through the same index and listing with every step kept (incremental-keep-all adds
    # the deltas). CI runs keep-3, the same program's index on a long line with pruning;
    # the index with every step kept is tests/test_long_history.py's (keep=None, case by
    # case), the deltas tests/test_incremental*.py's and the incremental model programs'.
    pytest.param(Config(), None, marks=[pytest.mark.slow], id="keep-all"),
    pytest.param(Config(), 3, id="keep-3"),
    pytest.param(Config(incremental=True), None, marks=[pytest.mark.slow], id="incremental-keep-all")])
def test_a_long_history_keeps_the_index_on_the_line(cfg, keep_last, tmp_path):
    """Issue 34: hundreds of steps (past the record's bounded window), rollbacks
    into them and kills inside their commits: the index (the latest step in a few
    stats) answers what the listing answers after every rule (Run.check)."""
    program = [("save", 0), ("burst", 0), ("train", 1), ("rollback", 7), ("save", 0), ("burst", 0),
               ("kill_in_commit", 0), ("rollback", 1 << 15), ("train", 2), ("kill_in_commit", 1),
               ("save", 0), ("crash", 0), ("burst", 0), ("restart", 0), ("save", 0), ("wait", 0)]
    run_program(cfg, str(tmp_path), None, program, knobs={"keep": keep_last})


#: Saves, a long burst, rollbacks into what the policy kept, a restart and a crash: the
#: model predicts, after every rule, which steps the directory holds (Run.check).
POLICY_PROGRAM = [("save", 0), ("save", 0), ("wait", 0), ("train", 1), ("save", 0), ("burst", 0),
                  ("rollback", 5), ("train", 3), ("save", 0), ("save", 0), ("wait", 0), ("restart", 0),
                  ("rollback", 1), ("train", 2), ("save", 0), ("wait", 0), ("crash", 0), ("save", 0),
                  ("save", 0), ("wait", 0)]


@pytest.mark.parametrize("keep", [KeepLast(2) | KeepEvery(25), KeepBest(3), KeepBest(1, mode="max") | KeepLast(1)],
                         ids=["last-every", "best", "best-max"])
def test_retention_policies_leave_the_steps_the_model_predicts(keep, tmp_path):
    run_program(Config(), str(tmp_path), None, POLICY_PROGRAM, knobs={"keep": keep})


#: A loop that saves when should_save says so (interval=Every(steps=k)): saves,
#: rollbacks (the steps due restart from the step loaded), a restart and a crash, a
#: preemption signal (its step saved and committed before save() returns, then a resumed
#: run), and the steps due after it again.
SCHEDULE_PROGRAM = [("save", 0), ("save", 0), ("save", 0), ("train", 1), ("save", 0), ("wait", 0), ("save", 0),
                    ("save", 0), ("save", 0), ("save", 0), ("rollback", 1), ("train", 2), ("save", 0), ("save", 0),
                    ("preempt", 0), ("save", 0), ("save", 0), ("restart", 0), ("save", 0), ("save", 0), ("save", 0),
                    ("crash", 0), ("save", 0), ("rollback", 0), ("preempt", 0), ("save", 0), ("save", 0),
                    ("wait", 0)]


@pytest.mark.parametrize("cfg,knobs", [(Config(), {"keep": 3, "interval": 3, "preemption": True}),
                                       (Config(), {"keep": KeepBest(2) | KeepLast(1), "interval": 4}),
                                       (Config(incremental=True), {"keep": None, "full_every": 2, "interval": 2,
                                                                   "preemption": True}),
                                       (Config(), {"keep": 2, "preemption": True})],
                         ids=["every3-preempt", "every4-best", "incremental-every2-preempt", "preempt"])
def test_an_interval_and_preemption_save_the_steps_the_model_predicts(cfg, knobs, tmp_path):
    """interval=Every(steps=k): should_save(step) is True exactly when step % k == 0 (never
    step 0); preemption= and a real SIGUSR1: the next step is saved and committed before
    save() returns, preempted is True, and a resumed run loads it bit-exact (Run.rule_preempt)."""
    log = run_program(cfg, str(tmp_path), None, SCHEDULE_PROGRAM, knobs=knobs)
    assert log.count("preempt(0)") == 2, log


# ----------------------------------------------------------------- refused combinations

def test_the_matrix_is_the_issue_matrix():
    modes = {lazyckpt.Options(incremental=c.incremental).incremental for c in CONFIGS}
    assert "off" in modes and len(modes) >= 3, modes
    assert len(CONFIGS) == len(modes) * 2 * 2 * 3 * 2


def _open(rank, world, cfg, base, persist_url):
    """None when a Checkpointer of ``cfg`` opens, else the ValueError's message."""
    try:
        kw = checkpointer_kwargs(cfg, persist_url)
        if cfg.replicas:
            base = os.path.join(base, f"node{rank}")
        lazyckpt.Checkpointer(base, **kw).close()
        return None
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("cfg", REFUSED_ONE_RANK, ids=[c.id for c in REFUSED_ONE_RANK])
def test_refused_combinations_say_why(cfg, persist_url, tmp_path):
    """Refused with a ValueError that names the reason -- and not silently
    accepted; when a combination becomes supported, move it out of
    tests/_model.py:expected_refusal so the model drives it."""
    error = _open(0, 1, cfg, str(tmp_path), persist_url)
    assert error is not None, f"{cfg.id} is accepted now: update expected_refusal in tests/_model.py"
    assert any(word in error for word in expected_refusal(cfg)), (cfg.id, error)


def _open_all(rank, world, configs, base, persist_url):
    return [_open(rank, world, cfg, os.path.join(base, cfg.id), persist_url) for cfg in configs]


def test_refused_two_rank_combinations_say_why(s3_server, s3_bucket, monkeypatch, tmp_path):
    """The same on two ranks, every refused configuration in one pair of processes."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    errors = run_ranks(2, _open_all, REFUSED_TWO_RANKS, str(tmp_path), f"s3://{s3_bucket}/refused", timeout=300)
    for rank_errors in errors:
        for cfg, error in zip(REFUSED_TWO_RANKS, rank_errors):
            assert error is not None, f"{cfg.id} is accepted now: update expected_refusal in tests/_model.py"
            assert any(word in error for word in expected_refusal(cfg)), (cfg.id, error)


def test_accepted_combinations_are_not_refused(tmp_path):
    """The other way round for the one-rank configurations without a server:
    what the model drives must open."""
    for cfg in ONE_RANK:
        if not cfg.persist:
            assert _open(0, 1, cfg, str(tmp_path / cfg.id), None) is None, cfg.id


# ----------------------------------------------------------------- issue 33 item 5: faults

#: Fixed short programs exercising each rule of issue 33 item 5. Locally (incremental,
#: full_every=3, keep_last=2): metadata corruption (manifest.json, history.json: a byte
#: flipped, truncated, replaced), prune during a save, keys added/removed and a dtype
#: changed, sparse changes of the 64 KiB tensor that its sample digest misses.
LOCAL_FAULT_PROGRAM = [("save", 0), ("train", 6), ("save", 0), ("wait", 0), ("corrupt_meta", 0), ("corrupt_meta", 1),
                       ("corrupt_meta", 17), ("corrupt_meta", 33), ("corrupt_meta", 4), ("reshape", 0),
                       ("train", 6), ("save", 0), ("prune_in_flight", 0), ("reshape", 2), ("train", 6), ("save", 0),
                       ("reshape", 3), ("save", 0), ("rollback", 1), ("train", 6), ("save", 0),
                       ("prune_in_flight", 1), ("corrupt_meta", 49), ("wait", 0)]
#: With persist_to through the proxy: the store's event objects damaged, a few failed
#: requests, an outage across a rollback, its save and a restart (the store never learns
#: of the rollback until it ends), the catch-up (heal: the store alone holds the line's
#: latest), dropped connections, a slow store; run_program ends with another heal.
PERSIST_FAULT_PROGRAM = [("save", 0), ("save", 0), ("wait", 0), ("corrupt_meta", 2), ("fail_next", 3), ("train", 6),
                         ("save", 0), ("wait", 0), ("outage", 8), ("rollback", 0), ("save", 0), ("restart", 0),
                         ("heal", 0), ("outage", 1), ("train", 0), ("save", 0), ("outage", 2), ("save", 0),
                         ("wait", 0)]


@pytest.mark.parametrize("cfg", [Config(incremental=True), Config(persist=True)], ids=lambda c: c.id)
def test_faults_corruption_and_prune_in_flight_keep_the_line_of_history(cfg, model_store, tmp_path):
    persist_url, faults = model_store
    url = f"{persist_url}/{uuid.uuid4().hex[:12]}" if persist_url else None
    knobs = {"keep": 2, **({"full_every": 3} if cfg.incremental else {})}
    program = PERSIST_FAULT_PROGRAM if cfg.persist else LOCAL_FAULT_PROGRAM
    run_program(cfg, str(tmp_path), url, program, knobs=knobs, faults=faults)


def test_prune_beside_a_rollback_commit_keeps_the_line_of_history(tmp_path):
    """prune plans on steps 1..5, the rollback's save of step 3 commits in between
    (forced by a hook at prune's first rename), then prune acts: the new step 3
    stays the latest, whatever prune deleted."""
    program = [("save", 0), ("save", 0), ("save", 0), ("save", 0), ("save", 0), ("wait", 0), ("rollback", 1),
               ("train", 1), ("prune_beside_commit", 0), ("save", 0), ("wait", 0), ("rollback", 0),
               ("prune_beside_commit", 1), ("wait", 0)]
    run_program(Config(), str(tmp_path), None, program, knobs={"keep": None})


def test_a_writer_whose_lease_expired_never_commits_again(tmp_path):
    """A stalled writer (SIGSTOPped past lease_expiry_s) and a new writer: nothing is
    lost, and the displaced one's next save is refused (also after a rollback)."""
    program = [("save", 0), ("train", 1), ("save", 0), ("rollback", 0), ("lease_expiry", 0), ("save", 0),
               ("wait", 0)]
    run_program(Config(), str(tmp_path), None, program, knobs={"keep": None})
