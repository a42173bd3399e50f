"""The pools kept for the process (lazyckpt/keptpools.py): the checksum and
release threads end when idle and start again at the next save or load; a
leak check that stops daemon threads (Lightning's) can stop them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import lazyckpt
from lazyckpt import checksums, keptpools
from lazyckpt.keptpools import KeptPool
from lazyckpt.storage import fileio


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(8)}


def _kept_alive():
    return {t for t in keptpools.threads() if t.is_alive()}


def _save_replace_and_load(directory, seed):
    """A Checkpointer that keeps one step (the superseded step is freed on the
    release thread), a verified load (the checksum threads), then closed."""
    with lazyckpt.Checkpointer(directory, keep=1) as ck:
        for step in (seed, seed + 1):
            ck.save(_state(step), step).wait()
        loaded = ck.load(seed + 1)
    for key, value in _state(seed + 1).items():
        assert torch.equal(loaded[key], value), key
    fileio.wait_for_releases(timeout=10)


def _wait_until_none_alive(deadline_s):
    end = time.monotonic() + deadline_s
    while _kept_alive() and time.monotonic() < end:
        time.sleep(0.05)
    return _kept_alive()


def test_after_the_idle_time_no_lazyckpt_thread_remains(tmp_path):
    before = set(threading.enumerate())
    _save_replace_and_load(tmp_path / "run", 1)
    names = {t.name for t in _kept_alive()}
    assert any(n.startswith("lazyckpt-checksum_") for n in names), names
    assert any(n.startswith("lazyckpt-release_") for n in names), names
    assert _wait_until_none_alive(keptpools.IDLE_S + 3) == set()
    started = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("lazyckpt-")]
    assert not started, started
    # The next save and load start them again and see the same values.
    _save_replace_and_load(tmp_path / "again", 5)
    assert {t.name.rsplit("_", 1)[0] for t in _kept_alive()} >= {"lazyckpt-checksum", "lazyckpt-release"}


def test_a_leak_check_that_stops_daemon_threads_stops_the_kept_ones(tmp_path):
    """Lightning's check after every test (tests_pytorch/conftest.py,
    thread_police_duuu_daaa_duuu_daaa): a new daemon thread with a callable
    stop() is stopped and must not be alive right after; any other new thread
    is an error ("Test left zombie thread")."""
    assert _wait_until_none_alive(keptpools.IDLE_S + 3) == set()
    before = set(threading.enumerate())
    _save_replace_and_load(tmp_path / "run", 1)
    new = [t for t in set(threading.enumerate()) - before if t.name.startswith("lazyckpt-")]
    assert new
    for thread in new:
        stop = getattr(thread, "stop", None) or getattr(thread, "exit", None)
        assert thread.daemon and callable(stop), thread
        stop()
        assert not thread.is_alive(), thread
    _save_replace_and_load(tmp_path / "after", 3)


def test_tasks_run_in_order_on_one_thread_and_on_at_most_size_threads():
    one = KeptPool(1, "lazyckpt-test-one", idle_s=0.2)
    seen = []
    futures = [one.submit(seen.append, i) for i in range(200)]
    futures[-1].result(timeout=10)
    assert seen == list(range(200))
    two = KeptPool(2, "lazyckpt-test-two", idle_s=0.2)
    running, peak, lock = [0], [0], threading.Lock()

    def task():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
    for f in [two.submit(task) for _ in range(20)]:
        f.result(timeout=10)
    assert peak[0] == 2 and len({t for t in two.threads() if t.is_alive()}) <= 2
    with pytest.raises(ZeroDivisionError):
        two.submit(lambda: 1 / 0).result(timeout=10)
    end = time.monotonic() + 5
    while any(t.is_alive() for t in one.threads() | two.threads()) and time.monotonic() < end:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in one.threads() | two.threads())
    assert one.submit(lambda: "again").result(timeout=10) == "again"


def test_stopping_the_only_thread_while_tasks_wait_still_runs_them():
    pool = KeptPool(1, "lazyckpt-test-stop", idle_s=5)
    gate = threading.Event()
    first = pool.submit(gate.wait, 10)
    queued = [pool.submit(lambda i=i: i) for i in range(5)]
    (worker,) = [t for t in pool.threads() if t.is_alive()]
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not worker.is_alive() and first.result(timeout=10) is True
    assert [f.result(timeout=10) for f in queued] == list(range(5))
    assert checksums.pool() is checksums._pool       # the executor callers get is the kept pool itself


def test_the_functional_apis_pools_end_when_idle_and_start_again(tmp_path):
    """lazyckpt.save/load keep their writer, reader and serializer pools for the
    process (one set per Options): their threads end after the idle time like
    the checksum and release threads, and the next save and load start them again."""
    from lazyckpt import api
    from lazyckpt.knobs import resolve

    def functional_alive():
        return {t for t in _kept_alive()
                if t.name.rsplit("_", 1)[0] in ("lazyckpt-writer", "lazyckpt-reader", "lazyckpt-serializer")}

    state = {**_state(7), "meta": {"step": 7}}          # a pickled entry: the serializer thread
    lazyckpt.save(state, tmp_path / "a.lzc")
    loaded = lazyckpt.load(tmp_path / "a.lzc")
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k != "meta") and loaded["meta"] == {"step": 7}
    names = {t.name.rsplit("_", 1)[0] for t in functional_alive()}
    assert {"lazyckpt-writer", "lazyckpt-reader"} <= names, names
    res = api._resources(resolve(None))
    assert all(isinstance(p, KeptPool) for p in (res.writers, res.readers, res.serializer))
    end = time.monotonic() + keptpools.IDLE_S + 3
    while functional_alive() and time.monotonic() < end:
        time.sleep(0.05)
    assert functional_alive() == set()
    # The same pools serve the next save and load.
    state = {**_state(8), "meta": {"step": 8}}
    lazyckpt.save(state, tmp_path / "b.lzc")
    loaded = lazyckpt.load(tmp_path / "b.lzc")
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if k != "meta") and loaded["meta"] == {"step": 8}
    assert {t.name.rsplit("_", 1)[0] for t in functional_alive()} >= {"lazyckpt-writer", "lazyckpt-reader"}
