"""Round trips through lazyckpt.save / lazyckpt.load must be bit-exact: every
dtype, geometry, aliasing, container type and scalar comes back as it was."""

from __future__ import annotations

import collections
import math
import os
import random
import warnings
from typing import Any, NamedTuple, Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lazyckpt
from lzc_tools import assert_same, assert_same_aliasing, parse, storage_key


def _creatable_dtypes():
    """Every torch dtype a dense CPU tensor can be created with (quantized
    dtypes make quantized tensors, which are a different kind of state)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(dir(torch)):
            d = getattr(torch, name)
            if not isinstance(d, torch.dtype) or d in out:
                continue
            try:
                t = torch.empty(2, dtype=d)
                if t.is_quantized:
                    continue
                t.view(torch.uint8)
            except Exception:
                continue
            out.append(d)
    return out


DTYPES = _creatable_dtypes()


def test_dtype_list_covers_the_usual_suspects():
    expected = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64, torch.complex128}
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
        if hasattr(torch, name):
            expected.add(getattr(torch, name))
    assert expected <= set(DTYPES)


def make_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads included)."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rng = np.random.default_rng(seed)
    if dtype == torch.bool:
        raw = rng.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.from_numpy(raw).view(dtype).reshape(shape)


def derive(base: torch.Tensor, how: str) -> torch.Tensor:
    """A view of ``base`` (sharing its storage) or a reshaped geometry."""
    if how == "same":
        return base
    if how == "transpose" and base.dim() >= 2:
        return base.transpose(0, 1)
    if how == "step-slice" and base.dim() >= 1 and base.shape[0] > 1:
        return base[1::2]
    if how == "inner-slice" and base.dim() >= 2 and base.shape[-1] > 2:
        return base[..., 1::3]
    if how == "narrow" and base.dim() >= 1 and base.shape[0] > 1:
        return base.narrow(0, 1, base.shape[0] - 1)
    if how == "expand" and base.dim() >= 1:
        return base[:1].expand(3, *base.shape[1:]) if base.shape[0] else base
    if how == "flat" and base.is_contiguous():
        return base.view(-1)
    if how == "0-d" and base.numel():
        return base.reshape(-1)[-1]
    return base


VIEW_KINDS = ["same", "transpose", "step-slice", "inner-slice", "narrow", "expand", "flat", "0-d"]

shapes = st.one_of(
    st.just(()),                                            # 0-d
    st.lists(st.integers(0, 4), min_size=1, max_size=3),    # may be empty
    st.lists(st.integers(1, 6), min_size=2, max_size=3),
)


class TSpec(NamedTuple):
    """How to build one tensor (hypothesis draws specs, not tensors: a tensor of
    an exotic dtype cannot even be repr'd in a failure report)."""
    dtype: torch.dtype
    shape: tuple
    seed: int
    view: str
    base: Optional[int] = None      # index of a base tensor to take the view of


@st.composite
def tensor_specs(draw, n_bases: int = 0):
    view = draw(st.sampled_from(VIEW_KINDS))
    if n_bases and draw(st.booleans()):
        # A view of one of the state's base tensors (dtype/shape/seed unused).
        return TSpec(torch.uint8, (), 0, view, draw(st.integers(0, n_bases - 1)))
    return TSpec(draw(st.sampled_from(DTYPES)), tuple(draw(shapes)), draw(st.integers(0, 2**32 - 1)), view)


def materialize(x: Any, bases: list) -> Any:
    if isinstance(x, TSpec):
        base = bases[x.base] if x.base is not None else make_tensor(x.dtype, x.shape, x.seed)
        return derive(base, x.view)
    if isinstance(x, (dict, collections.OrderedDict)):
        return type(x)((k, materialize(v, bases)) for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x)(materialize(v, bases) for v in x)
    return x


NP_DTYPES = ["<i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8",
             "<c16", "|b1", ">i4", ">f8", "<M8[ns]", "<M8[D]", "<m8[s]", "<U3", "|S4"]


@st.composite
def numpy_arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = math.prod(shape)
    if dtype.kind == "b":
        arr = rng.integers(0, 2, size=n).astype(bool)
    elif dtype.kind == "U":
        arr = np.array(["".join(chr(c) for c in rng.integers(32, 0x2FFF, size=3)) for _ in range(n)],
                       dtype=dtype)
    elif dtype.kind == "S":
        arr = np.array([bytes(rng.integers(1, 256, size=4, dtype=np.uint8)) for _ in range(n)], dtype=dtype)
    else:
        arr = np.frombuffer(rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).tobytes(),
                            dtype=dtype)
    arr = arr.reshape(shape)
    if draw(st.booleans()) and arr.ndim >= 1 and arr.shape[0] > 1:
        arr = arr[::2]                                       # non-contiguous input
    return arr


numpy_scalars = st.one_of(
    st.integers(-2**63, 2**63 - 1).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    st.floats(allow_nan=True, allow_infinity=True, width=32).map(np.float32),
    st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
    st.floats(width=16).map(np.float16),
    st.booleans().map(np.bool_),
    st.complex_numbers(allow_nan=True).map(np.complex128),
    st.integers(-10**6, 10**6).map(lambda d: np.datetime64(d, "D")),
    st.text(max_size=4).map(np.str_),
    st.binary(max_size=4).map(np.bytes_),
)

hashables = st.one_of(st.integers(), st.text(max_size=5), st.binary(max_size=5),
                      st.tuples(st.integers(), st.text(max_size=3)))

python_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(),
    st.sampled_from([2**64, -(2**64) - 1, 2**200 + 7, -(10**80)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 1.7976931348623157e308]),
    st.text(), st.binary(max_size=40), st.binary(max_size=40).map(bytearray),
    st.complex_numbers(allow_nan=True, allow_infinity=True),
    st.sampled_from([complex(float("nan"), -0.0), complex(-0.0, float("inf"))]),
    st.lists(st.integers(0, 9), max_size=4).map(torch.Size),
    st.sampled_from(DTYPES),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.sets(hashables, max_size=4), st.frozensets(hashables, max_size=4),
)

keys = st.one_of(st.integers(-3, 10**12), st.text(max_size=6))


def containers(children):
    return st.one_of(
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(collections.OrderedDict),
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
    )


@st.composite
def state_specs(draw):
    n_bases = draw(st.integers(0, 3))
    base_specs = [draw(tensor_specs())._replace(view="same") for _ in range(n_bases)]
    leaves = st.one_of(tensor_specs(n_bases), numpy_arrays(), numpy_scalars, python_scalars)
    tree = draw(st.recursive(leaves, containers, max_leaves=14))
    return {"bases": base_specs, "tree": tree, "alias": draw(st.lists(tensor_specs(n_bases), max_size=3))}


def build_state(spec):
    bases = [materialize(b, []) for b in spec["bases"]]
    return {"bases": bases, "tree": materialize(spec["tree"], bases),
            "alias": materialize(spec["alias"], bases)}


ROUNDTRIP_KNOBS = [dict(), dict(chunk_bytes=8192, host_cache_bytes=16384, writer_threads=2),
                   dict(o_direct=False, writer_threads=1)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(spec=state_specs(), knob_index=st.integers(0, len(ROUNDTRIP_KNOBS) - 1))
@example(spec={"bases": [], "tree": np.str_("\x00"), "alias": []}, knob_index=0)     # finding 25
def test_random_state_round_trips_bit_exactly(tmp_path, spec, knob_index):
    path = tmp_path / "prop.lzc"
    state = build_state(spec)
    knobs = ROUNDTRIP_KNOBS[knob_index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # ComplexHalf is "experimental"
        size = lazyckpt.save(state, path, **knobs)
        assert size == path.stat().st_size
        loaded = lazyckpt.load(path, **knobs)
    assert_same(state, loaded)
    assert_same_aliasing(state, loaded)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_in_every_geometry(tmp_path, dtype):
    base = make_tensor(dtype, (4, 6), seed=1)
    state = {kind: derive(base, kind) for kind in VIEW_KINDS}
    state.update({"empty": make_tensor(dtype, (0, 3), 2), "scalar": make_tensor(dtype, (), 3),
                  "other": make_tensor(dtype, (5,), 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazyckpt.save(state, tmp_path / "d.lzc")
        out = lazyckpt.load(tmp_path / "d.lzc")
    assert_same(state, out)
    assert_same_aliasing(state, out)
    # All views of the base share one storage after load, as before.
    ptrs = {storage_key(out[k]) for k in VIEW_KINDS}
    assert len(ptrs) == 1
    assert storage_key(out["other"]) not in ptrs


def test_aliasing_with_dtype_reinterpreting_view(tmp_path):
    base = torch.arange(8, dtype=torch.float32)
    state = {"f": base, "bytes": base.view(torch.uint8), "ints": base.view(torch.int32)[2:5]}
    lazyckpt.save(state, tmp_path / "v.lzc")
    out = lazyckpt.load(tmp_path / "v.lzc")
    assert_same(state, out)
    assert storage_key(out["f"]) == storage_key(out["bytes"]) == storage_key(out["ints"])
    out["f"][3] = 100.0                     # they really are one memory
    assert out["ints"][1].item() == torch.tensor(100.0).view(torch.int32).item()


def test_conj_and_neg_views_keep_their_values(tmp_path):
    x = torch.randn(3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    state = {"x": x, "conj": x.conj(), "conj_t": x.t().conj(), "neg": x.conj().imag, "conj_slice": x[:, 1::2].conj()}
    lazyckpt.save(state, tmp_path / "c.lzc")
    out = lazyckpt.load(tmp_path / "c.lzc")
    for k, v in state.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        assert torch.equal(out[k].resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg()), k


class Celsius:
    def __init__(self, degrees, history):
        self.degrees, self.history = degrees, history


def test_registered_provider_round_trips_without_pickle(tmp_path):
    lazyckpt.register_provider(Celsius, lambda c: {"deg": c.degrees, "hist": c.history},
                               lambda s: Celsius(s["deg"], s["hist"]), name="tests.roundtrip.Celsius")
    hist = torch.arange(5.0)
    state = {"t": Celsius(21.5, hist), "view": hist[1:]}
    lazyckpt.save(state, tmp_path / "c.lzc")
    assert all(e["kind"] != "pickle" for e in parse(tmp_path / "c.lzc").doc["entries"])
    out = lazyckpt.load(tmp_path / "c.lzc")                 # no allow_pickle needed
    assert type(out["t"]) is Celsius and out["t"].degrees == 21.5
    assert torch.equal(out["t"].history, hist)
    assert storage_key(out["t"].history) == storage_key(out["view"])


def test_special_python_values(tmp_path):
    state = {
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "negzero": -0.0,
        "big": 2**521 - 1, "negbig": -(3**300), "s": "h\u00e9llo \x00 \ud83d \U0001F600", "b": b"\x00\xff",
        "ba": bytearray(b"abc"), "none": None, "t": True, "c": complex(1.5, -0.0),
        "size": torch.Size([2, 0, 3]), "dtype": torch.bfloat16, "dev": torch.device("cuda", 3),
        "set": {1, "a", (2, "b")}, "fs": frozenset({b"x", 3}), "od": collections.OrderedDict(b=1, a=2),
        7: "int key", -1: [(), [], {}],
    }
    lazyckpt.save(state, tmp_path / "s.lzc")
    out = lazyckpt.load(tmp_path / "s.lzc")
    assert_same(state, out)
    assert math.copysign(1.0, out["negzero"]) == -1.0
    assert type(out["ba"]) is bytearray and type(out["b"]) is bytes


def test_huge_python_int_round_trips_or_is_refused_at_save(tmp_path):
    """Ints beyond Python's 4300-digit int/str limit: FORMAT.md (6.1) lets a
    reader refuse them, so a save must either round-trip them or fail cleanly
    up front -- never write a file that cannot be loaded."""
    state = {"huge": 10**5000 + 1, "neg": -(7**6000)}
    path = tmp_path / "h.lzc"
    try:
        lazyckpt.save(state, path)
    except lazyckpt.CheckpointError:
        assert os.listdir(tmp_path) == []
        return
    assert lazyckpt.load(path) == state


def test_numpy_values(tmp_path):
    state = {
        "f": np.linspace(0, 1, 7, dtype=np.float32), "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "b": np.array([True, False]), "dt": np.array(["2020-01-01T00:00", "NaT"], dtype="datetime64[ns]"),
        "u": np.array(["a", "\u00e9\u00e9", ""], dtype="<U2"), "s": np.array([b"ab", b""], dtype="S2"),
        "empty": np.zeros((0, 4), dtype=np.int16), "be": np.arange(3, dtype=">u4"),
        "scalars": [np.float32("nan"), np.int8(-3), np.bool_(True), np.datetime64("2001-02-03"),
                    np.str_("xy"), np.complex64(1 - 2j), np.uint64(2**64 - 1)],
    }
    lazyckpt.save(state, tmp_path / "n.lzc")
    out = lazyckpt.load(tmp_path / "n.lzc")
    assert_same(state, out)


def test_zero_dim_numpy_array_keeps_its_shape(tmp_path):
    """np.ascontiguousarray() turns a 0-d array into shape (1,): a 0-d array
    must still come back 0-d."""
    state = {"f": np.array(3.5), "i": np.array(7, dtype=np.int8), "u": np.array("ab")}
    lazyckpt.save(state, tmp_path / "z.lzc")
    out = lazyckpt.load(tmp_path / "z.lzc")
    assert_same(state, out)
    assert out["f"].shape == () and out["f"][()] == 3.5


def test_empty_numpy_string_scalars(tmp_path):
    """np.str_('') and np.bytes_(b'') have a zero itemsize but non-empty tobytes()."""
    state = {"u": np.str_(""), "s": np.bytes_(b""), "u1": np.str_("x")}
    lazyckpt.save(state, tmp_path / "e.lzc")
    out = lazyckpt.load(tmp_path / "e.lzc")
    assert_same(state, out)


def test_numpy_string_scalars_keep_their_trailing_nuls(tmp_path):
    """np.str_ and np.bytes_ are str and bytes: np.str_('a\\x00') has length 2
    (its repr, stripped as numpy strips fixed-width strings, shows 'a').
    Their fixed-width bytes cannot tell a trailing NUL from padding, so a
    load from the bytes alone returned np.str_('a') (RELIABILITY finding 25:
    the round-trip property found np.str_('\\x00'))."""
    state = {"nul": np.str_("\x00"), "a": np.str_("a\x00"), "two": np.str_("\u00e9\x00\x00"),
             "b": np.bytes_(b"a\x00"), "bnul": np.bytes_(b"\x00"), "inner": np.str_("\x00a"),
             "plain": np.str_("ab"), "empty": np.str_(""), "bempty": np.bytes_(b"")}
    lazyckpt.save(state, tmp_path / "n.lzc")
    out = lazyckpt.load(tmp_path / "n.lzc")
    assert_same(state, out)
    assert [len(v) for v in out.values()] == [len(v) for v in state.values()]
    assert out["two"] == "\u00e9\x00\x00" and out["b"] == b"a\x00"


def test_rng_states_round_trip_and_restore_generators(tmp_path):
    torch.manual_seed(1234)
    np.random.seed(99)
    random.seed(7)
    gen = np.random.default_rng(5)
    torch.rand(3), np.random.rand(2), random.random(), gen.random()   # advance past the seeds
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
             "pcg": gen.bit_generator.state}
    expected = (torch.rand(20), np.random.rand(20), [random.random() for _ in range(20)], gen.random(20))

    lazyckpt.save(state, tmp_path / "rng.lzc")
    torch.manual_seed(0), np.random.seed(0), random.seed(0)             # disturb every generator
    out = lazyckpt.load(tmp_path / "rng.lzc")
    assert_same(state, out)

    torch.set_rng_state(out["torch"])
    np.random.set_state(out["numpy"])
    random.setstate(out["python"])
    gen2 = np.random.default_rng()
    gen2.bit_generator.state = out["pcg"]
    assert torch.equal(torch.rand(20), expected[0])
    assert np.array_equal(np.random.rand(20), expected[1])
    assert [random.random() for _ in range(20)] == expected[2]
    assert np.array_equal(gen2.random(20), expected[3])


class TiedLM(torch.nn.Module):
    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.emb(idx))))


def test_tied_embeddings_keep_sharing_storage(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    sd = model.state_dict()
    assert storage_key(sd["emb.weight"]) == storage_key(sd["head.weight"])
    lazyckpt.save(sd, tmp_path / "tied.lzc")
    out = lazyckpt.load(tmp_path / "tied.lzc")
    assert_same(sd, out)
    assert storage_key(out["emb.weight"]) == storage_key(out["head.weight"])
    torch.manual_seed(1)
    fresh = TiedLM()
    fresh.load_state_dict(out)
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight)


def test_parameters_stay_parameters(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 2))
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    leaf = torch.randn(2, requires_grad=True)
    state = {"p": p, "frozen": frozen, "leaf": leaf, "view_of_p": p.detach()[1]}
    lazyckpt.save(state, tmp_path / "p.lzc")
    out = lazyckpt.load(tmp_path / "p.lzc")
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad
    assert type(out["leaf"]) is torch.Tensor and out["leaf"].requires_grad and out["leaf"].is_leaf
    assert torch.equal(out["p"].detach(), p.detach()) and torch.equal(out["frozen"], frozen)
    assert storage_key(out["p"]) == storage_key(out["view_of_p"])
    out["p"].sum().backward()               # a usable leaf parameter
    assert torch.equal(out["p"].grad, torch.ones(3, 2))


def _transformer(seed):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.1,
                                             batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                               torch.nn.Linear(16, 4))


def _train(model, opt, steps, first_step):
    losses = []
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(1000 + step)       # data independent of the global RNG
        x, y = torch.randn(4, 5, 16, generator=g), torch.randn(4, 5, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)     # dropout draws from the global RNG
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_model_and_adamw_resume_trains_identically(tmp_path):
    model = _transformer(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95))
    torch.manual_seed(42)
    reference = _train(model, opt, 6, 0)

    model = _transformer(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, betas=(0.9, 0.95))
    torch.manual_seed(42)
    first = _train(model, opt, 3, 0)
    assert first == reference[:3]
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": 3}
    lazyckpt.save(state, tmp_path / "train.lzc")
    out = lazyckpt.load(tmp_path / "train.lzc")
    assert_same(state, out)
    assert set(out["optim"]["state"]) == set(range(len(list(model.parameters()))))

    model2 = _transformer(123)                  # different init: everything must come from the file
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optim"])
    torch.manual_seed(7)
    torch.set_rng_state(out["rng"])
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["betas"] == (0.9, 0.95)
    resumed = _train(model2, opt2, 3, out["step"])
    assert resumed == reference[3:]


# -- the tree decoded while the reads run ------------------------------------------

def _early_decodes(monkeypatch):
    """Records, per load, whether the decode during the reads produced the state."""
    from lazyckpt.loading import loader
    seen = []
    real = loader._EarlyDecode.run

    def run(self, storages):
        real(self, storages)
        seen.append(self.done)
    monkeypatch.setattr(loader._EarlyDecode, "run", run)
    return seen


def test_a_plain_load_decodes_its_tensors_while_the_reads_run_and_returns_them_read(tmp_path, monkeypatch):
    """Views, aliasing, Parameters and the bytes themselves come out as saved."""
    seen = _early_decodes(monkeypatch)
    base = torch.randn(64, 64)
    state = {"w": torch.nn.Parameter(torch.randn(300, 70)), "b": base, "view": base[3:9, ::2],
             "opt": {"step": torch.tensor(7), "m": [torch.randn(5000), torch.zeros(0)]}, "lr": 0.1, "name": "x"}
    lazyckpt.save(state, tmp_path / "s.lzc", chunk_bytes=64 << 10)
    out = lazyckpt.load(tmp_path / "s.lzc")
    assert seen == [True]
    assert_same(out, state)
    assert_same_aliasing(state, out)
    assert type(out["w"]) is torch.nn.Parameter


@pytest.mark.parametrize("case", ["numpy", "bytes", "custom", "map_location"])
def test_a_value_that_needs_its_bytes_sends_the_decode_after_the_reads(tmp_path, monkeypatch, case):
    """numpy arrays, bytes, a registered provider's from_state (which may read a
    tensor's values) and a storage the mapper moves are decoded after the reads:
    their values are the saved ones, never bytes that had not arrived."""
    from lazyckpt.state import providers

    class Box:
        def __init__(self, total):
            self.total = total
    seen = _early_decodes(monkeypatch)
    t = torch.arange(1.0, 100_001.0)
    value = {"numpy": np.arange(10), "bytes": b"abc", "custom": Box(t), "map_location": None}[case]
    if case == "custom":
        monkeypatch.setattr(providers._registry, "custom", dict(providers._registry.custom))
        lazyckpt.register_provider(Box, lambda b: {"t": b.total}, lambda s: Box(float(s["t"].sum())))
    lazyckpt.save({"t": t, "v": value}, tmp_path / "s.lzc")
    kwargs = {"map_location": lambda storage, loc: storage.clone()} if case == "map_location" else {}
    out = lazyckpt.load(tmp_path / "s.lzc", **kwargs)
    assert seen == [False]
    assert torch.equal(out["t"], t)
    if case == "custom":
        assert out["v"].total == float(t.sum())
    elif case != "map_location":
        assert_same(out["v"], value)


def test_a_decode_that_may_only_make_views_never_runs_a_from_state():
    from lazyckpt.state import providers
    ctx = providers.LoadContext(entry_value=None, storage=None, allow_pickle=False, path="p", views_only=True)
    ran = []
    provider = providers.CustomProvider(dict, "anything", dict, ran.append)
    with pytest.raises(providers.BytesNotReady):
        provider.load({"$": "custom", "name": "anything", "v": 1}, ctx)
    assert ran == []


def test_a_damaged_block_fails_the_load_though_its_tree_was_decoded_during_the_reads(tmp_path, monkeypatch):
    from lzc_tools import flip_byte
    seen = _early_decodes(monkeypatch)
    lazyckpt.save({"w": torch.randn(100_000)}, tmp_path / "s.lzc")
    p = parse(tmp_path / "s.lzc")
    entry = p.doc["entries"][0]
    flip_byte(tmp_path / "s.lzc", entry["offset"] + entry["length"] // 2)
    with pytest.raises(lazyckpt.CorruptCheckpointError):
        lazyckpt.load(tmp_path / "s.lzc")
    assert seen == [True]
