"""The Checkpointer's surface: at most 10 named parameters, the options in
groups (lazyckpt/options.py), each old flat spelling still working with one
DeprecationWarning naming its new spelling, and any other keyword refused."""

from __future__ import annotations

import dataclasses
import inspect
import uuid
import warnings

import pytest
import torch

import lazyckpt
from lazyckpt import IO, Distributed, Incremental, Persist, Replicas
from lazyckpt.options import DEPRECATED, PARAMETERS, Groups, settle
from lazyckpt.retention import KeepLast
from lazyckpt.schedule import SaveSchedule

MiB = 1 << 20


def _url() -> str:
    return f"mem://b{uuid.uuid4().hex[:10]}/persist"


def _state(v: float = 0.0):
    return {"w": torch.full((256,), float(v)), "b": torch.arange(8) + int(v)}


# ---------------------------------------------------------------------- the signature


def test_the_checkpointer_has_at_most_ten_named_parameters():
    sig = inspect.signature(lazyckpt.Checkpointer.__init__)
    named = [p for p in sig.parameters.values() if p.name != "self" and p.kind != p.VAR_KEYWORD]
    assert len(named) <= 10
    assert tuple(p.name for p in named) == PARAMETERS
    assert named[0].kind == named[0].POSITIONAL_OR_KEYWORD
    assert all(p.kind == p.KEYWORD_ONLY for p in named[1:])
    assert [p.kind for p in sig.parameters.values()][-1] == inspect.Parameter.VAR_KEYWORD


def test_the_groups_are_exported():
    for name in ("Persist", "Replicas", "Incremental", "Distributed", "IO"):
        assert getattr(lazyckpt, name) is getattr(lazyckpt.options, name) and name in lazyckpt.__all__


# ---------------------------------------------------------------------- every old flat spelling

def _opt(name, value):
    return lambda ck: getattr(ck.options, name) == value


#: old keyword -> (the keywords to pass, the new spelling its warning names, a check of its effect)
OLD = {
    "keep_last": (dict(keep_last=3), "use keep=3", lambda ck: ck.keep == KeepLast(3)),
    "persist_to": (lambda: dict(persist_to=_url()), "use persist=lazyckpt.Persist(url, ...)",
                   lambda ck: ck.persistent is not None),
    "persist_keep_last": (lambda: dict(persist_to=_url(), persist_keep_last=2),
                          "use persist=lazyckpt.Persist(url, keep=2)",
                          lambda ck: ck.persistent.keep == KeepLast(2)),
    "persist_bandwidth": (lambda: dict(persist_to=_url(), persist_bandwidth=1e6),
                          "use persist=lazyckpt.Persist(url, bandwidth=1000000.0)",
                          _opt("persist_bandwidth", 10 ** 6)),
    "storage_options": (lambda: dict(persist_to=_url(), storage_options={"region": "x"}),
                        "use persist=lazyckpt.Persist(url, storage_options={...}), or for an s3:// directory "
                        "io=lazyckpt.IO(storage_options={...})", _opt("storage_options", (("region", "x"),))),
    "replicated": (dict(replicated=["w"]), "use distributed=lazyckpt.Distributed(identical_keys=['w'])",
                   lambda ck: ck.replicated == ["w"]),
    "process_group": (dict(process_group=False), "use distributed=lazyckpt.Distributed(process_group=...)",
                      lambda ck: not ck._dist.distributed),
    "commit_timeout_s": (dict(commit_timeout_s=30), "use distributed=lazyckpt.Distributed(commit_timeout=30)",
                         None),
    "takeover": (dict(takeover=True), "use distributed=lazyckpt.Distributed(takeover=True)",
                 lambda ck: ck._takeover is True),
    "full_every": (dict(incremental=True, full_every=3), "use incremental=lazyckpt.Incremental(full_every=3)",
                   _opt("full_every", 3)),
    "advise_mtbf": (dict(advise_mtbf="8h"), "use interval=lazyckpt.Auto(mtbf='8h')",
                    _opt("advise_mtbf", 8 * 3600.0)),
    "options": (dict(options=lazyckpt.Options(writer_threads=3)), "use the option groups: io=lazyckpt.IO(...)",
                _opt("writer_threads", 3)),
    "queue_policy": (dict(queue_policy="skip"), "use io=lazyckpt.IO(when_full='skip')",
                     _opt("queue_policy", "skip")),
    "exit_policy": (dict(exit_policy="warn"), "use io=lazyckpt.IO(at_exit='warn')", _opt("exit_policy", "warn")),
    "lease_expiry_s": (dict(lease_expiry_s=30), "use io=lazyckpt.IO(lease_expiry=30)",
                       _opt("lease_expiry_s", 30.0)),
    "guard_buffers": (dict(guard_buffers=False), "use io=lazyckpt.IO(guard_buffers=False)", None),
    "writer_threads": (dict(writer_threads=2), "use io=lazyckpt.IO(writer_threads=2)", _opt("writer_threads", 2)),
    "reader_threads": (dict(reader_threads=2), "use io=lazyckpt.IO(reader_threads=2)", _opt("reader_threads", 2)),
    "o_direct": (dict(o_direct=False), "use io=lazyckpt.IO(o_direct=False)", _opt("o_direct", False)),
    "chunk_bytes": (dict(chunk_bytes="64k"), "use io=lazyckpt.IO(chunk_bytes='64k')",
                    _opt("chunk_bytes", 64 << 10)),
    "verify_checksums": (dict(verify_checksums=False), "use io=lazyckpt.IO(verify_checksums=False)",
                         _opt("verify_checksums", False)),
    "max_footer_bytes": (dict(max_footer_bytes="16M"), "use io=lazyckpt.IO(max_footer_bytes='16M')",
                         _opt("max_footer_bytes", 16 * MiB)),
    "max_pending_saves": (dict(max_pending_saves=1), "use io=lazyckpt.IO(max_pending_saves=1)",
                          _opt("max_pending_saves", 1)),
}
#: Replicas need torch.distributed (tests/test_replicas.py): their old spellings are
#: checked here up to the group they build.
REPLICA_OLD = {"node_size": (dict(node_size=2), "use replicas=lazyckpt.Replicas(k, node_size=2)",
                             Replicas(1, node_size=2)),
               "replica_bandwidth": (dict(replica_bandwidth="1MB"), "use replicas=lazyckpt.Replicas(k, "
                                                                    "bandwidth='1MB')", Replicas(1, bandwidth=10 ** 6))}


def test_every_old_spelling_is_covered():
    assert set(OLD) | set(REPLICA_OLD) == set(DEPRECATED)


@pytest.mark.parametrize("name", sorted(OLD))
def test_an_old_flat_keyword_works_and_warns_naming_its_new_spelling(name, tmp_path):
    kwargs, new, check = OLD[name]
    kwargs = kwargs() if callable(kwargs) else kwargs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = lazyckpt.Checkpointer(tmp_path / "run", **kwargs)
    try:
        deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert {str(w.message).split("=")[0] for w in deprecations} == set(kwargs) - {"incremental"}
        mine = [w for w in deprecations if str(w.message).startswith(f"{name}=")]
        assert len(mine) == 1, [str(w.message) for w in deprecations]
        message = str(mine[0].message)
        assert "is deprecated: " + new in message, message
        assert all(w.filename == __file__ for w in deprecations)      # the user's line, not the library's
        if check is not None:
            assert check(ck)
        ck.save(_state(1), 1).wait()
        assert torch.equal(ck.load()["w"], _state(1)["w"])
    finally:
        ck.close()


@pytest.mark.parametrize("name", sorted(REPLICA_OLD))
def test_the_replicas_old_keywords_build_the_replicas_group(name, tmp_path):
    kwargs, new, group = REPLICA_OLD[name]
    with pytest.warns(DeprecationWarning, match=r"is deprecated: " + new.replace("(", r"\(").replace(")", r"\)")):
        groups = settle(replicas=1, deprecated=kwargs, stacklevel=2)
    assert groups.replicas == group
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="needs torch.distributed"):
        lazyckpt.Checkpointer(tmp_path / "run", replicas=1, **kwargs)


def test_old_distributed_and_io_spellings_land_in_their_groups(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        groups = settle(deprecated=dict(commit_timeout_s=30, guard_buffers=False, takeover=True,
                                                  replicated="auto", process_group=False))
    assert groups.distributed == Distributed(False, identical_keys="auto", commit_timeout=30.0, takeover=True)
    assert groups.io == IO(guard_buffers=False)


def test_old_spellings_that_do_not_apply_are_still_refused_naming_the_new_spelling(tmp_path):
    for kwargs, new in ((dict(persist_keep_last=2), r"persist=lazyckpt.Persist\(url, keep=2\)"),
                        (dict(full_every=3), r"incremental=lazyckpt.Incremental\(full_every=3\)"),
                        (dict(node_size=2), r"replicas=lazyckpt.Replicas\(k, node_size=2\)")):
        with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=new):
            lazyckpt.Checkpointer(tmp_path / "d", **kwargs)
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------- what is refused


@pytest.mark.parametrize("kwargs, suggestion", [
    (dict(keep_lsat=3), "did you mean keep="),
    (dict(kep=3), "did you mean keep="),
    (dict(writer_thread=2), r"did you mean io=lazyckpt.IO\(writer_threads=...\)"),
    (dict(persit=_url()), "did you mean persist="),
    (dict(identical_key=["w"]), r"did you mean distributed=lazyckpt.Distributed\(identical_keys=...\)"),
    (dict(when_ful="skip"), r"did you mean io=lazyckpt.IO\(when_full=...\)"),
    (dict(zzzz=1), "unexpected keyword argument 'zzzz'; its parameters"),
])
def test_an_unknown_keyword_is_a_type_error_with_the_closest_name(kwargs, suggestion, tmp_path):
    with pytest.raises(TypeError, match=suggestion) as info:
        lazyckpt.Checkpointer(tmp_path / "d", **kwargs)
    message = str(info.value)
    assert repr(next(iter(kwargs))) in message
    assert all(p in message for p in PARAMETERS)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("kwargs", [
    dict(keep_last=3, keep=3),
    dict(persist_to="mem://bkt/x", persist="mem://bkt/x"),
    dict(persist_keep_last=2, persist=Persist("mem://bkt/x")),
    dict(writer_threads=2, io=IO()),
    dict(options=lazyckpt.Options(), io=IO()),
    dict(replicated=["w"], distributed=Distributed()),
    dict(takeover=True, distributed=Distributed(takeover=True)),
    dict(node_size=2, replicas=Replicas(1)),
    dict(full_every=2, incremental=Incremental()),
    dict(advise_mtbf="8h", interval="auto"),
])
def test_an_old_spelling_with_its_new_one_is_a_type_error(kwargs, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="were both given.*old spelling; pass"):
            lazyckpt.Checkpointer(tmp_path / "d", **kwargs)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("make, field", [
    (lambda: Persist("/a/local/dir"), "Persist.url"),
    (lambda: Persist(42), "Persist.url"),
    (lambda: Persist(_url(), keep=0), "Persist.keep"),
    (lambda: Persist(_url(), bandwidth="fast"), "Persist.bandwidth"),
    (lambda: Persist(_url(), bandwidth=-1), "Persist.bandwidth"),
    (lambda: Persist(_url(), storage_options={"regoin": "x"}), "Persist.storage_options"),
    (lambda: Replicas(0), "Replicas.k"),
    (lambda: Replicas(True), "Replicas.k"),
    (lambda: Replicas(1, node_size=0), "Replicas.node_size"),
    (lambda: Replicas(1, bandwidth="x"), "Replicas.bandwidth"),
    (lambda: Incremental("fast"), "Incremental.mode"),
    (lambda: Incremental(full_every=-1), "Incremental.full_every"),
    (lambda: Incremental(full_every=2.0), "Incremental.full_every"),
    (lambda: Distributed(identical_keys="first"), "Distributed.identical_keys"),
    (lambda: Distributed(identical_keys=7), "Distributed.identical_keys"),
    (lambda: Distributed(commit_timeout="soon"), "Distributed.commit_timeout"),
    (lambda: Distributed(commit_timeout=0), "Distributed.commit_timeout"),
    (lambda: Distributed(takeover="yes"), "Distributed.takeover"),
    (lambda: IO(writer_threads=0), "IO.writer_threads"),
    (lambda: IO(reader_threads=1.5), "IO.reader_threads"),
    (lambda: IO(max_pending_saves=0), "IO.max_pending_saves"),
    (lambda: IO(o_direct="maybe"), "IO.o_direct"),
    (lambda: IO(chunk_bytes=1000), "IO.chunk_bytes"),
    (lambda: IO(chunk_bytes="5000"), "IO.chunk_bytes"),
    (lambda: IO(max_footer_bytes="lots"), "IO.max_footer_bytes"),
    (lambda: IO(verify_checksums="yes"), "IO.verify_checksums"),
    (lambda: IO(when_full="drop"), "IO.when_full"),
    (lambda: IO(at_exit="abort"), "IO.at_exit"),
    (lambda: IO(lease_expiry="10"), "IO.lease_expiry"),
    (lambda: IO(guard_buffers=1), "IO.guard_buffers"),
    (lambda: IO(storage_options={"bogus": 1}), "IO.storage_options"),
])
def test_each_group_validates_its_fields_when_made(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_the_groups_normalize_sizes_and_durations_and_are_frozen():
    assert Persist(_url(), bandwidth="100MB").bandwidth == 10 ** 8
    assert Persist(_url(), keep=3).keep == KeepLast(3)
    assert Replicas(2, bandwidth="1GiB").bandwidth == 1 << 30
    assert IO(chunk_bytes="1M", max_footer_bytes="1GB").chunk_bytes == MiB
    assert IO(max_footer_bytes="1GB").max_footer_bytes == 10 ** 9
    assert IO(lease_expiry="2min").lease_expiry == 120.0 and IO(lease_expiry=5).lease_expiry == 5.0
    assert IO(o_direct="off").o_direct is False and IO(o_direct="auto").o_direct == "auto"
    assert Distributed(commit_timeout="10min").commit_timeout == 600.0
    assert Distributed(identical_keys=["a", "b"]).identical_keys == ("a", "b")
    assert Incremental("version").mode == "version-counters" and Incremental().mode == "content"
    with pytest.raises(dataclasses.FrozenInstanceError):
        IO().writer_threads = 8
    secret = {"secret_access_key": "hunter2"}
    assert "hunter2" not in repr(Persist(_url(), storage_options=secret)) + repr(IO(storage_options=secret))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(keep=0), ValueError, "keep must be an int >= 1"),
    (dict(keep="3"), TypeError, "keep must be None, an int or a retention policy"),
    (dict(host_cache_bytes="lots"), ValueError, "host_cache_bytes: bad size"),
    (dict(host_cache_bytes=100), ValueError, "host_cache_bytes must be 0 .auto. or at least 8192"),
    (dict(persist=42), TypeError, "persist must be None, an object store URL"),
    (dict(persist="/local"), ValueError, "Persist.url must be an object store URL"),
    (dict(replicas=-1), ValueError, "replicas must be an int >= 0"),
    (dict(replicas="2"), TypeError, "replicas must be None, an int"),
    (dict(incremental="fast"), ValueError, "incremental must be False, True"),
    (dict(incremental=1.0), TypeError, "incremental must be a bool"),
    (dict(distributed=False), TypeError, "distributed must be None or lazyckpt.Distributed"),
    (dict(io={"writer_threads": 2}), TypeError, "io must be None or lazyckpt.IO"),
    (dict(io=IO(storage_options={"region": "x"})), ValueError, "IO.storage_options=.*does not apply"),
])
def test_bad_arguments_are_refused_before_anything_is_created(kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        lazyckpt.Checkpointer(tmp_path / "d", **kwargs)
    assert not (tmp_path / "d").exists()


def test_the_real_conflicts_stay_refused(tmp_path):
    with pytest.raises(ValueError, match="not supported on object stores"):
        lazyckpt.Checkpointer(tmp_path / "a", persist=_url(), incremental=True)
    with pytest.raises(ValueError, match="not supported on object stores"):
        lazyckpt.Checkpointer("mem://bkt-surface/run", incremental="content")
    with pytest.raises(ValueError, match="replicas= needs a node-local directory"):
        lazyckpt.Checkpointer("mem://bkt-surface/run", replicas=1)
    with pytest.raises(ValueError, match="replicas= needs a node-local directory and the default process group"):
        lazyckpt.Checkpointer(tmp_path / "b", replicas=Replicas(1), distributed=Distributed(False))
    with pytest.raises(ValueError, match="already on an object store"):
        lazyckpt.Checkpointer("mem://bkt-surface/run", persist=_url())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------- sizes and the environment


def test_sizes_are_strings_everywhere(tmp_path):
    url = _url()
    with lazyckpt.Checkpointer(tmp_path / "run", host_cache_bytes="1MiB",
                               io=IO(chunk_bytes="64k", max_footer_bytes="16M"),
                               persist=Persist(url, bandwidth="10MB")) as ck:
        o = ck.options
        assert (o.host_cache_bytes, o.chunk_bytes, o.max_footer_bytes, o.persist_bandwidth) == \
            (MiB, 64 << 10, 16 * MiB, 10 ** 7)
        ck.save(_state(2), 2).wait()
        assert ck.steps() == [2]


def test_environment_variables_are_site_defaults_under_every_group_field(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYCKPT_HOST_CACHE_BYTES", "2M")
    monkeypatch.setenv("LAZYCKPT_CHUNK_BYTES", "128k")
    monkeypatch.setenv("LAZYCKPT_WRITER_THREADS", "3")
    monkeypatch.setenv("LAZYCKPT_WHEN_FULL", "skip")
    monkeypatch.setenv("LAZYCKPT_LEASE_EXPIRY_S", "45")
    monkeypatch.setenv("LAZYCKPT_PERSIST_BANDWIDTH", "5MB")
    monkeypatch.setenv("LAZYCKPT_FULL_EVERY", "4")
    with lazyckpt.Checkpointer(tmp_path / "a", persist=_url(), io=IO()) as ck:      # env > default
        o = ck.options
        assert (o.host_cache_bytes, o.chunk_bytes, o.writer_threads, o.queue_policy, o.lease_expiry_s,
                o.persist_bandwidth) == (2 * MiB, 128 << 10, 3, "skip", 45.0, 5 * 10 ** 6)
    with lazyckpt.Checkpointer(tmp_path / "b", host_cache_bytes="1M", incremental=Incremental(full_every=2),
                               persist=None,
                               io=IO(chunk_bytes="64k", writer_threads=1, when_full="block",
                                     lease_expiry="1min")) as ck:          # argument > env
        o = ck.options
        assert (o.host_cache_bytes, o.chunk_bytes, o.writer_threads, o.queue_policy, o.lease_expiry_s,
                o.full_every) == (MiB, 64 << 10, 1, "block", 60.0, 2)
    with lazyckpt.Checkpointer(tmp_path / "c", incremental=True) as ck:
        assert ck.options.full_every == 4
    # A site-wide LAZYCKPT_STORAGE_OPTIONS is a default, not a request: not refused on a local directory.
    monkeypatch.setenv("LAZYCKPT_STORAGE_OPTIONS", '{"region": "x"}')
    lazyckpt.Checkpointer(tmp_path / "d").close()


# ---------------------------------------------------------------------- the groups at work


def test_a_checkpointer_built_with_the_groups_saves_and_loads_model_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)         # the new spellings warn about nothing
        ck = lazyckpt.Checkpointer(tmp_path / "run", keep=2, host_cache_bytes="1M", interval=None,
                                   preemption=False, persist=None, replicas=None, incremental=False,
                                   distributed=Distributed(process_group=False, commit_timeout="1min"),
                                   io=IO(writer_threads=2, chunk_bytes="64k", when_full="block"))
    with ck:
        assert ck.keep == KeepLast(2) and isinstance(ck._schedule, SaveSchedule)
        ck.attach(optim)
        for step in range(1, 5):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            ck.save({"model": model.state_dict(), "optim": optim.state_dict()}, step)
        ck.wait()
        assert ck.steps() == [3, 4]
        expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                    "optim": optim.state_dict()}
        fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        state = ck.load()
    fresh.load_state_dict(state["model"])
    fresh_optim.load_state_dict(state["optim"])
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected["model"][k])
    got, want = fresh_optim.state_dict()["state"], expected["optim"]["state"]
    assert got.keys() == want.keys()
    for i in want:
        for k in want[i]:
            assert torch.equal(torch.as_tensor(got[i][k]), torch.as_tensor(want[i][k]))


def test_a_url_string_is_a_persistent_tier_and_keep_a_policy(tmp_path):
    url = _url()
    with lazyckpt.Checkpointer(tmp_path / "run", keep=KeepLast(1), persist=url) as ck:
        assert ck.persistent is not None and ck.persistent.keep is None
        for step in (1, 2):
            ck.save(_state(step), step).wait(persisted=True)
        assert ck.steps() == [2]
    with lazyckpt.Checkpointer(tmp_path / "run2", persist=Persist(url, keep=1)) as ck:
        assert ck.persistent.keep == KeepLast(1)


def test_groups_default_to_every_default():
    groups = Groups()
    assert groups.keep is None and groups.persist is None and groups.replicas is None
    assert groups.incremental is None and groups.distributed == Distributed() and groups.io == IO()
