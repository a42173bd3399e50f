"""Plans (lazyckpt/state/plancache.py): a save of a state with the structure of the
previous one walks it along the previous skeleton; the result must be what a
full flatten() of the same state gives, and every difference that matters
must make it a full walk."""

from __future__ import annotations

import collections
import copy
import json
import math

import numpy as np
import pytest
import torch

import lazyckpt
from lazyckpt.saving.engine import storage_pointers
from lazyckpt.state.plancache import PendingFlat, PlanCache
from lazyckpt.state.providers import flatten


def _training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _state(model, opt, step=0):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": torch.get_rng_state(),
            "note": "x", "scale": 1.5, "nothing": None, "pair": (1, [2.0, "3"])}


def _storage(t):
    return t.untyped_storage()._cdata


def assert_same(flat, ref, same_pointers=True):
    """``flat`` is what ``ref`` (a fresh flatten of the same state) is."""
    assert json.dumps(flat.tree) == json.dumps(ref.tree)
    assert flat.replicated_digest == ref.replicated_digest
    assert flat.shards == ref.shards
    assert len(flat.sources) == len(ref.sources)
    for a, b in zip(flat.sources, ref.sources):
        assert (a.kind, a.name, a.length, a.owner, a.ref, a.make_bytes) == (b.kind, b.name, b.length, b.owner,
                                                                              b.ref, b.make_bytes)
        if b.data is None:
            assert a.data is None
        elif not isinstance(b.data, torch.Tensor):
            assert bytes(a.data) == bytes(b.data)
        elif not same_pointers:             # the full walk's own temporaries (resolve_conj)
            assert torch.equal(a.data, b.data)
        else:
            assert (a.data.dtype, a.data.shape, a.data.stride(), a.data.storage_offset(), a.data.device) == \
                (b.data.dtype, b.data.shape, b.data.stride(), b.data.storage_offset(), b.data.device)
            assert a.data.data_ptr() == b.data.data_ptr() and _storage(a.data) == _storage(b.data)
        if same_pointers:
            # The tensors whose version counters the incremental mode reads: the same ones.
            assert [_storage(t) for t in a.tensors] == [_storage(t) for t in b.tensors]
            assert [t._version for t in a.tensors] == [t._version for t in b.tensors]


def check(cache, state, expect, **kw):
    hits = cache.hits
    flat = cache.flatten(state, **kw)
    assert_same(flat, flatten(state, **kw), same_pointers=expect != "uncacheable")
    assert cache.last == expect, (cache.last, expect)
    assert cache.hits == hits + (expect == "hit")
    return flat


def test_repeated_saves_hit_and_equal_a_full_walk():
    model, opt = _training()
    cache = PlanCache()
    check(cache, _state(model, opt), "miss")
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)                   # values change in place: the plan still holds
        check(cache, _state(model, opt, step), "hit")
    assert cache.hits == 3 and cache.misses == 1


def _mutations():
    """(name, mutate(state) -> state, what the next save must be)."""
    def set_(path, value):
        def f(s):
            d = s
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = value(d[path[-1]]) if callable(value) else value
            return s
        return f

    def untie(s):
        s["tied"] = s["tied"].clone()
        return s

    def tie(s):
        s["other"] = s["model"]["2.bias"]          # same geometry as the clone it replaces
        return s

    def view_of_other(s):
        big = torch.zeros(1000)
        s["model"]["0.bias"] = big[: s["model"]["0.bias"].numel()]   # same shape, a larger storage
        return s

    def view_offset(s):
        big = torch.zeros(1000)
        s["model"]["0.bias"] = big[10: 10 + s["model"]["0.bias"].numel()]
        return s

    def resize(s):
        s["model"]["0.bias"].untyped_storage().resize_(4096)
        return s

    def lr(s):
        s["optim"]["param_groups"][0]["lr"] = 0.5
        return s

    def opt_step_count(s):
        first = next(iter(s["optim"]["state"].values()))
        first["step"] = torch.tensor(7.0)              # a new tensor object, same geometry
        return s

    return [
        ("scalar", set_(["step"], 41), "hit"),
        ("lr", lr, "hit"),
        ("nan", set_(["scale"], float("nan")), "hit"),
        ("inf", set_(["scale"], float("-inf")), "hit"),
        ("int becomes float", set_(["step"], 2.5), "hit"),
        ("str", set_(["note"], "y" * 100), "hit"),
        ("new tensor, same geometry", set_(["model", "0.weight"], lambda t: t.clone() + 1), "hit"),
        ("optimizer replaced a state tensor", opt_step_count, "hit"),
        ("shape", set_(["model", "0.weight"], lambda t: torch.zeros(t.shape[0] + 1, t.shape[1])), "miss"),
        ("dtype", set_(["model", "0.weight"], lambda t: t.double()), "miss"),
        ("non-contiguous", set_(["model", "0.weight"], lambda t: t.t().contiguous().t()), "miss"),
        ("requires_grad", set_(["model", "0.weight"], lambda t: t.detach().requires_grad_(True)), "miss"),
        ("parameter", set_(["model", "0.weight"], lambda t: torch.nn.Parameter(t.detach())), "miss"),
        ("view of a larger storage", view_of_other, "miss"),
        ("view at an offset", view_offset, "miss"),
        ("storage resized", resize, "miss"),
        ("tied weights untied", untie, "miss"),
        ("untied weights tied", tie, "miss"),
        ("added key", set_(["extra"], 1), "miss"),
        ("removed key", lambda s: (s.pop("note"), s)[1], "miss"),
        ("key order", lambda s: dict(reversed(list(s.items()))), "miss"),
        ("int key becomes str", lambda s: (s["optim"]["state"].__setitem__("0", s["optim"]["state"].pop(0)), s)[1],
         "miss"),
        ("int key becomes bool", lambda s: {**{k: v for k, v in s.items() if k != "pair"}, "pair": {True: 1}},
         "uncacheable"),
        ("dict becomes OrderedDict", lambda s: collections.OrderedDict(s), "miss"),
        ("tuple becomes list", set_(["pair"], lambda p: list(p)), "miss"),
        ("list grows", set_(["pair"], lambda p: (p[0], p[1] + [4])), "miss"),
        ("scalar becomes tensor", set_(["step"], torch.tensor(3)), "miss"),
        ("tensor becomes scalar", set_(["rng"], 3), "miss"),
        ("scalar becomes container", set_(["nothing"], {"a": 1}), "miss"),
        ("numpy", set_(["nothing"], np.arange(3)), "uncacheable"),
        ("conj", set_(["model", "2.bias"], lambda t: torch.randn(4, dtype=torch.complex64).conj()), "uncacheable"),
        ("meta", set_(["model", "2.bias"], lambda t: torch.empty(4, device="meta")), "uncacheable"),
    ]


@pytest.mark.parametrize("name,mutate,expect", _mutations(), ids=[m[0] for m in _mutations()])
def test_a_mutated_state_is_what_a_full_walk_makes_of_it(name, mutate, expect):
    model, opt = _training()

    def base():
        s = _state(model, opt)
        s["tied"] = s["model"]["2.weight"]
        s["other"] = s["model"]["2.bias"].clone()
        return s

    cache = PlanCache()
    check(cache, base(), "miss")
    check(cache, base(), "hit")
    check(cache, mutate(base()), expect)
    if expect == "hit":
        check(cache, mutate(base()), "hit")
    # Back to the original structure: correct whatever the cache holds now.
    state = base()
    assert_same(cache.flatten(state), flatten(state), same_pointers=expect != "uncacheable")


def test_an_unplannable_state_backs_off_and_stays_correct():
    cache = PlanCache()
    state = {"a": torch.ones(3), "n": np.arange(4)}
    for _ in range(10):
        assert_same(cache.flatten(state), flatten(state), same_pointers=False)
        assert cache.last == "uncacheable" and cache.hits == 0
    assert cache._backoff == 4              # planned at saves 1, 3 and 6 only, not at every save


def test_empty_tensors_and_shared_storages():
    base = torch.arange(10.0)
    cache = PlanCache()

    def state():
        return {"e1": torch.empty(0), "e2": torch.empty(0, 3), "a": base[:5], "b": base[5:], "c": base,
                "s": torch.tensor(1.0)}

    check(cache, state(), "miss")
    check(cache, state(), "hit")
    s = state()
    s["e2"] = s["e1"].view(0, 3)            # empty storages: one entry per tensor, shared or not
    check(cache, s, "hit")


def test_replicated_keys_across_ranks():
    model, opt = _training()
    for rank in (0, 1):
        cache = PlanCache()
        kw = dict(rank=rank, world_size=2, replicated=["model"])
        check(cache, _state(model, opt), "miss", **kw)
        flat = check(cache, _state(model, opt, 5), "hit", **kw)
        assert {s.kind for s in flat.sources} == {"data", "remote"}
        s = _state(model, opt, 6)
        s["model"]["0.weight"] = s["model"]["0.weight"] + 1     # a new storage of the same geometry
        check(cache, s, "hit", **kw)
        s = _state(model, opt, 6)
        s["model"]["new"] = torch.ones(2)
        check(cache, s, "miss", **kw)
        # Other ranks / world sizes / replicated keys: never the plan of another.
        check(cache, _state(model, opt), "miss", rank=rank, world_size=2, replicated=[])
        check(cache, _state(model, opt), "miss", rank=rank, world_size=2, replicated=["model"])
        check(cache, _state(model, opt), "miss", rank=rank, world_size=4, replicated=["model"])


def test_a_registered_provider_invalidates_the_plan():
    class Thing:
        pass

    model, opt = _training()
    cache = PlanCache()
    check(cache, _state(model, opt), "miss")
    lazyckpt.register_provider(Thing, lambda t: {}, lambda s: Thing(), name="test_plan_cache.Thing")
    check(cache, _state(model, opt), "miss")
    check(cache, _state(model, opt), "hit")


def test_disabled():
    cache = PlanCache(enabled=False)
    state = {"a": torch.ones(2)}
    for _ in range(3):
        assert_same(cache.flatten(state), flatten(state))
    assert cache.hits == 0 and cache.last == "off"


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("incremental", [False, True])
def test_checkpointer_saves_through_the_plan_load_exactly(tmp_path, incremental):
    model, opt = _training()
    saved = {}
    with lazyckpt.Checkpointer(str(tmp_path), incremental=incremental) as ckpt:
        ckpt.attach(opt)
        for step in range(6):
            state = _state(model, opt, step)
            if step == 3:
                state["model"]["0.weight"] = state["model"]["0.weight"][:, :4]     # a structure change
            saved[step] = copy.deepcopy(state)
            ckpt.save(state, step=step).wait()
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            opt.param_groups[0]["lr"] *= 0.5
        assert ckpt._plans.hits >= 3 and ckpt._plans.misses == 3    # steps 0, 3 and 4 walk in full
        for step, expected in saved.items():
            assert _equal(expected, ckpt.load(step))


def test_the_tensors_are_checked_when_resolved_not_when_gathered():
    """save() only gathers (containers and leaf types); the tensors' geometry is
    checked when the capture thread resolves the save: a changed shape is found
    there, and the result is the full walk of the state as it was gathered."""
    model, opt = _training()
    cache = PlanCache()
    check(cache, _state(model, opt), "miss")
    state = _state(model, opt, 1)
    state["model"]["0.weight"] = torch.zeros(3, 3)          # same type, another geometry
    expected = flatten(state)
    pending = cache.gather(state)
    assert isinstance(pending, PendingFlat) and cache.last == "hit"
    assert_same(pending.resolve(), expected)
    assert cache.last == "miss" and cache.hits == 0 and cache.misses == 2
    check(cache, state, "hit")                              # planned again from the late walk


def _mutate_everything(state):
    state["step"] = 99
    state.pop("note")
    state["extra"] = torch.ones(2)
    state["model"]["0.weight"] = torch.zeros(1)
    state["model"].pop("2.bias")
    state["optim"]["param_groups"][0]["lr"] = 123.0
    state["pair"][1].append("more")


@pytest.mark.parametrize("late_miss", [False, True])
def test_containers_changed_after_the_gather_do_not_change_the_save(late_miss):
    """The gather snapshots every container: what the caller does to its dicts
    and lists after save() returned is not in the checkpoint (a late miss
    rebuilds the state as gathered, not as it is now)."""
    model, opt = _training()
    cache = PlanCache()
    check(cache, _state(model, opt), "miss")
    state = _state(model, opt, 1)
    if late_miss:
        state["model"]["2.weight"] = torch.zeros(2, 2)
    expected = flatten(state)
    pending = cache.gather(state)
    assert isinstance(pending, PendingFlat)
    _mutate_everything(state)
    assert_same(pending.resolve(), expected)
    assert cache.last == ("miss" if late_miss else "hit")


def test_checkpointer_saves_queued_with_changing_geometry_load_exactly(tmp_path):
    """Saves queued back to back (the capture thread resolves one while the
    caller gathers the next), every other one with a tensor of another shape
    (a late miss each time, replanning on the capture thread), and the
    caller's dicts changed as soon as save() returns: every step loads as it
    was saved."""
    model, opt = _training()
    saved = {}
    with lazyckpt.Checkpointer(str(tmp_path), io=lazyckpt.IO(max_pending_saves=4)) as ckpt:
        handles = []
        for step in range(10):
            state = _state(model, opt, step)
            state["model"]["0.weight"] = torch.full((2 + step % 2, 3), float(step))
            saved[step] = copy.deepcopy(state)
            handles.append(ckpt.save(state, step=step))
            _mutate_everything(state)
        for h in handles:
            h.wait()
        assert ckpt._plans.hits + ckpt._plans.misses == 10 and ckpt._plans.misses >= 5
        for step, expected in saved.items():
            assert _equal(expected, ckpt.load(step))


def test_a_sparse_tensor_where_a_dense_one_was_never_breaks_the_forward_guard():
    """The forward guard asks a gathered save for its storage addresses on the
    training thread, before the capture thread resolved it: a tensor without
    a storage (sparse, where the plan had a dense one) must not raise there;
    the resolve walks it in full."""
    cache = PlanCache()
    check(cache, {"w": torch.zeros(3, 3), "b": torch.ones(2)}, "miss")
    state = {"w": torch.zeros(3, 3).to_sparse(), "b": torch.ones(2)}
    pending = cache.gather(state)
    assert isinstance(pending, PendingFlat)
    assert storage_pointers(pending.live_tensors()) == {state["b"].untyped_storage().data_ptr()}
    flat, ref = pending.resolve(), flatten(state)
    assert json.dumps(flat.tree) == json.dumps(ref.tree)
    assert [(s.kind, s.name) for s in flat.sources] == [(s.kind, s.name) for s in ref.sources] == \
        [("pickle", "w"), ("data", "b")]             # the full walk's pickled sparse tensor
    assert cache.last == "uncacheable"
