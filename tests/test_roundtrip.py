"""Round trips: whatever is saved comes back bit-exact, with the same dtypes, shapes and container types.

Property tests draw dtypes (every dtype this torch can allocate on CPU), shapes (0-d, empty, small),
non-contiguous tensors and views, and nested dict / list / tuple / OrderedDict trees with plain values.
Tensors are compared through their raw bytes, so NaN payloads, -0.0 and float8 oddities count.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers.states import assert_same, shares_storage, tensor_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import datastates as ds

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def _usable(dt: torch.dtype) -> bool:
    """A dtype this torch can allocate, reinterpret as bytes and copy on CPU (not quantized)."""
    try:
        with warnings.catch_warnings():  # ComplexHalf and quantized dtypes warn on creation
            warnings.simplefilter("ignore")
            t = torch.empty(4, dtype=dt)
        t.view(torch.uint8)
        t[::2].contiguous()
        return not t.is_quantized
    except (RuntimeError, NotImplementedError, TypeError):
        return False


DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and _usable(d)}, key=str)
REQUIRED = ["float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
            "float8_e5m2fnuz", "float8_e8m0fnu", "complex64", "complex128", "bool", "int8", "int16", "int32",
            "int64", "uint8", "uint16", "uint32", "uint64"]

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def rt_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ds.Store]:
    s = ds.Store.open(tmp_path_factory.mktemp("roundtrip") / "store")
    yield s
    s.close()


def roundtrip(store: ds.Store, state: Any, **kw: Any) -> Any:
    v = store.save(state, branch="rt", **kw)
    return store.load(v.id, **{k: x for k, x in kw.items() if k == "allow_pickle"})


# --------------------------------------------------------------------------- strategies
@st.composite
def tensors(draw: st.DrawFn, min_dims: int = 0, max_dims: int = 3, max_side: int = 4) -> torch.Tensor:
    dt = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims))
    nbytes = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dt == torch.bool:
        raw = bytes(b & 1 for b in raw)  # a bool byte other than 0/1 is undefined behaviour in torch
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone() if nbytes else torch.empty(0, dtype=torch.uint8)
    return flat.view(dt).reshape(shape)


@st.composite
def views(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A base tensor (>= 1-d) and a view of it built from transposes, stepped slices and narrows."""
    base = draw(tensors(min_dims=1, max_dims=3, max_side=5))
    v = base
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["transpose", "step", "narrow", "select", "unsqueeze"]))
        if v.dim() == 0:
            break
        d = draw(st.integers(0, v.dim() - 1))
        if op == "transpose" and v.dim() >= 2:
            v = v.transpose(d, draw(st.integers(0, v.dim() - 1)))
        elif op == "step":
            index = [slice(None)] * v.dim()
            index[d] = slice(draw(st.integers(0, 2)), None, draw(st.integers(1, 3)))
            v = v[tuple(index)]
        elif op == "narrow" and v.shape[d] > 0:
            start = draw(st.integers(0, v.shape[d] - 1))
            v = v.narrow(d, start, draw(st.integers(0, v.shape[d] - start)))
        elif op == "select" and v.shape[d] > 0:
            v = v.select(d, draw(st.integers(0, v.shape[d] - 1)))
        elif op == "unsqueeze":
            v = v.unsqueeze(d)
    return base, v


plain = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                  st.text(max_size=8), st.binary(max_size=8))
keys = st.one_of(st.integers(-3, 20), st.text(alphabet="abcxyz_", min_size=1, max_size=4))
leaves = st.one_of(plain, tensors(max_side=3))
trees = st.recursive(
    leaves,
    lambda ch: st.one_of(
        st.lists(ch, max_size=3),
        st.lists(ch, max_size=3).map(tuple),
        st.dictionaries(keys, ch, max_size=3),
        st.dictionaries(keys, ch, max_size=3).map(OrderedDict),
    ),
    max_leaves=10,
)


# --------------------------------------------------------------------------- property tests
def test_dtype_coverage() -> None:
    names = {str(d).removeprefix("torch.") for d in DTYPES}
    assert set(REQUIRED) <= names, f"this torch lacks {set(REQUIRED) - names}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_roundtrips(rt_store: ds.Store, dtype: torch.dtype) -> None:
    n = 24
    raw = torch.arange(n * torch.empty(0, dtype=dtype).element_size(), dtype=torch.uint8) * 37 % 251
    if dtype == torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(2, -1)
    state = {"t": t, "tt": t.t(), "step": t[:, ::2], "scalar": t.reshape(-1)[3].clone(), "empty": t[:, :0]}
    got = roundtrip(rt_store, state)
    assert_same(got, {k: x.contiguous() for k, x in state.items()})
    assert got["scalar"].dim() == 0
    assert tuple(got["empty"].shape) == (2, 0)


@SETTINGS
@given(t=tensors())
def test_tensor_roundtrip(rt_store: ds.Store, t: torch.Tensor) -> None:
    got = roundtrip(rt_store, {"t": t})
    assert_same(got, {"t": t})


@SETTINGS
@given(bv=views())
def test_noncontiguous_view_alone(rt_store: ds.Store, bv: tuple[torch.Tensor, torch.Tensor]) -> None:
    _, v = bv
    got = roundtrip(rt_store, {"v": v})["v"]
    assert got.dtype == v.dtype and got.shape == v.shape
    assert tensor_bytes(got) == tensor_bytes(v)


@SETTINGS
@given(bv=views())
def test_view_with_its_base_shares_storage(rt_store: ds.Store, bv: tuple[torch.Tensor, torch.Tensor]) -> None:
    base, v = bv
    got = roundtrip(rt_store, {"base": base, "view": v})
    assert_same(got["base"], base)
    assert tensor_bytes(got["view"]) == tensor_bytes(v) and got["view"].shape == v.shape
    if v.numel() and base.numel():
        assert shares_storage(got["base"], got["view"])
        assert got["view"].stride() == v.stride()
        assert got["view"].storage_offset() == v.storage_offset()


# Regression (found by test_noncontiguous_view_alone): reshape(-1) of a one-element tensor whose stride is not 1
# keeps the stride, and .view(torch.uint8) raised a raw RuntimeError for any dtype wider than a byte.
@pytest.mark.parametrize("make", [lambda: torch.zeros(2)[::2], lambda: torch.zeros(3, 2, dtype=torch.int64)[:1, ::2],
                                  lambda: torch.arange(6.0).reshape(2, 3).t()[2:, :1]], ids=["1d", "2d", "t"])
def test_one_element_slice_with_step(rt_store: ds.Store, make: Any) -> None:
    t = make()
    assert t.numel() == 1 and t.reshape(-1).stride(-1) != 1
    got = roundtrip(rt_store, {"t": t})
    assert_same(got, {"t": t.contiguous()})


def test_empty_tensor_with_step_stride(rt_store: ds.Store) -> None:
    """Regression: an empty tensor keeps odd strides through reshape(-1); saving it raised RuntimeError."""
    for t in (torch.zeros(0, dtype=torch.float32)[::2], torch.zeros(0, 3, dtype=torch.float64)[:, ::2]):
        got = roundtrip(rt_store, {"t": t})
        assert got["t"].dtype == t.dtype and got["t"].shape == t.shape


@SETTINGS
@given(tree=trees)
def test_nested_tree_roundtrip(rt_store: ds.Store, tree: Any) -> None:
    got = roundtrip(rt_store, {"root": tree, "n": 1})
    assert_same(got, {"root": tree, "n": 1})


@SETTINGS
@given(x=plain)
def test_plain_value_at_top_level(rt_store: ds.Store, x: Any) -> None:
    assert_same(roundtrip(rt_store, x), x)


# --------------------------------------------------------------------------- fixed cases
def test_special_floats_and_keys(rt_store: ds.Store) -> None:
    state = OrderedDict([
        ("nan", float("nan")), ("neg0", -0.0), ("inf", float("-inf")), ("big", 2**100), ("tiny", 5e-324),
        (7, "int key"), (None, "none key"), (2.5, "float key"), (False, "bool key"),
        ("bytes", b"\x00\xff"), ("text", "h\u00e9\u2603\x00"), ("nested", (1, [2, (3,)], {"k": ()}, [])),
        ("t", torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float64)),
    ])
    got = roundtrip(rt_store, state)
    assert_same(got, state)
    assert type(got) is OrderedDict


def test_torch_and_numpy_values(rt_store: ds.Store) -> None:
    arr = np.arange(12, dtype=np.int16).reshape(3, 4)
    state = {"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3]),
             "np": arr[:, ::2], "np_bool": np.array([True, False]), "np_scalar": np.float32(1.5),
             "np_int": np.int64(-3)}
    got = roundtrip(rt_store, state)
    assert got["dtype"] is torch.bfloat16 and got["device"] == torch.device("cpu")
    assert got["size"] == torch.Size([2, 3]) and type(got["size"]) is torch.Size
    assert isinstance(got["np"], np.ndarray) and got["np"].dtype == np.int16
    assert np.array_equal(got["np"], arr[:, ::2])
    assert got["np_bool"].tolist() == [True, False]
    assert type(got["np_scalar"]) is np.float32 and got["np_scalar"] == np.float32(1.5)
    assert type(got["np_int"]) is np.int64 and got["np_int"] == -3


def test_counters_bytearrays_and_0d_arrays_keep_their_type(rt_store: ds.Store) -> None:
    """MultiStepLR's state holds its milestones as a Counter, which was refused (torch.load takes it); a 0-d
    numpy array came back 1-d and a bytearray as bytes."""
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5, 5])
    got = roundtrip(rt_store, {"sched": sched, "ba": bytearray(b"ab"), "zero_d": np.array(3.5),
                               "counts": Counter({"a": 2, 3: 1})})
    assert type(got["sched"]["milestones"]) is Counter and got["sched"]["milestones"] == Counter({3: 1, 5: 2})
    assert got["sched"] == sched.state_dict()
    assert type(got["ba"]) is bytearray and got["ba"] == b"ab"
    assert type(got["zero_d"]) is np.ndarray and got["zero_d"].shape == () and got["zero_d"] == 3.5
    assert type(got["counts"]) is Counter and list(got["counts"].items()) == [("a", 2), (3, 1)]
    state: dict[str, Any] = {"m": Counter({1: 2}), "w": torch.ones(2)}
    rt_store.save(state, branch="counter")
    state["m"] = {1: 2}  # the same outer dict saved again: its flatten cache must not keep the Counter
    rt_store.save(state, branch="counter")
    assert type(rt_store.load("counter")["m"]) is dict


class _Mode(str, enum.Enum):
    STEPS = "steps"


@pytest.mark.parametrize("value", [np.ma.masked_array([1.0, 2.0], mask=[False, True]), np.matrix([[1, 2]]),
                                   _Mode.STEPS, np.str_("x")], ids=["masked", "matrix", "str-enum", "np-str"])
def test_a_subclass_of_a_plain_type_needs_pickle(rt_store: ds.Store, value: Any, unchanged: Any) -> None:
    """Saved as their base type, these loaded changed without a word (a masked array lost its mask)."""
    with unchanged(rt_store), pytest.raises(ds.UnsupportedValueError, match="x is a .*, which needs pickle"):
        rt_store.save({"x": value}, branch="subclass")
    got = roundtrip(rt_store, {"x": value}, allow_pickle=True)
    assert type(got["x"]) is type(value)


def test_a_quantized_tensor_is_refused_with_what_works(rt_store: ds.Store, unchanged: Any) -> None:
    """The error said to save with allow_pickle=True, which was refused the same way (tensors never pickle)."""
    q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 0, torch.qint8)
    for allow_pickle in (False, True):
        with unchanged(rt_store), pytest.raises(ds.UnsupportedValueError, match=r"save t.dequantize\(\)") as info:
            rt_store.save({"q": q}, branch="quantized", allow_pickle=allow_pickle)
        assert "allow_pickle" not in str(info.value)


def test_same_tensor_twice_comes_back_as_one(rt_store: ds.Store) -> None:
    t = torch.randn(5, 3)
    got = roundtrip(rt_store, {"a": t, "b": t, "c": [t]})
    assert got["a"] is got["b"] or shares_storage(got["a"], got["b"])
    assert shares_storage(got["a"], got["c"][0])
    assert_same(got["a"], t)


def test_views_of_one_storage_share_storage(rt_store: ds.Store) -> None:
    base = torch.arange(48, dtype=torch.float32)
    state = {"rows": base.view(6, 8), "cols": base.view(6, 8).t(), "tail": base[40:], "odd": base[1::2],
             "as_int": base.view(torch.int32)[8:16]}
    got = roundtrip(rt_store, state)
    for k, x in state.items():
        assert tensor_bytes(got[k]) == tensor_bytes(x), k
        assert got[k].dtype == x.dtype and got[k].shape == x.shape
    ptrs = {got[k].untyped_storage().data_ptr() for k in state}
    assert len(ptrs) == 1
    got["rows"][0, 0] = 123.0  # writes through the shared storage, like the original
    assert got["cols"][0, 0].item() == 123.0
    assert got["as_int"].untyped_storage().nbytes() == base.untyped_storage().nbytes()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_module_weights_share_storage(rt_store: ds.Store) -> None:
    m = Tied()
    got = roundtrip(rt_store, {"model": m})["model"]
    assert list(got) == ["emb.weight", "head.weight"]
    assert shares_storage(got["emb.weight"], got["head.weight"])
    assert_same(got["emb.weight"], m.emb.weight.detach())
    m2 = Tied()
    rt_store.checkout(rt_store.save({"model": m}, branch="tied"), model=m2)
    assert m2.head.weight is m2.emb.weight
    assert torch.equal(m2.emb.weight, m.emb.weight)


def test_shared_parameter_objects_come_back_as_parameters(rt_store: ds.Store) -> None:
    p = nn.Parameter(torch.randn(3, 3))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    got = roundtrip(rt_store, {"p": p, "q": p, "frozen": frozen})
    assert type(got["p"]) is nn.Parameter and type(got["q"]) is nn.Parameter
    assert got["p"].requires_grad and not got["frozen"].requires_grad
    assert shares_storage(got["p"], got["q"])
    assert torch.equal(got["p"].detach(), p.detach())


# --------------------------------------------------------------------------- training objects
def _train_objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    return m, opt, sched, scaler


def _train_step(m: nn.Module, opt: torch.optim.Optimizer, sched: Any, scaler: torch.amp.GradScaler) -> None:
    loss = m(torch.randn(5, 4)).pow(2).sum()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


def _sd_equal(a: Any, b: Any, path: str = "sd") -> None:
    """State dicts equal: tensors bit-exact, everything else ==, containers by value (types may be list/tuple)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _sd_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _sd_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_training_state_dicts_roundtrip(rt_store: ds.Store) -> None:
    m, opt, sched, scaler = _train_objects(0)
    _train_step(m, opt, sched, scaler)
    _train_step(m, opt, sched, scaler)
    got = roundtrip(rt_store, {"model": m, "optimizer": opt, "scheduler": sched, "scaler": scaler})
    assert_same(got["model"], m.state_dict())
    assert_same(got["optimizer"], opt.state_dict())  # int state keys, tuples (betas), 0-d step tensors
    assert_same(got["scheduler"], sched.state_dict())
    assert_same(got["scaler"], scaler.state_dict())


def test_checkout_model_and_optimizer(rt_store: ds.Store) -> None:
    m, opt, sched, scaler = _train_objects(1)
    _train_step(m, opt, sched, scaler)
    v = rt_store.save({"model": m, "optim": opt}, branch="train", step=1)
    m2, opt2, _, _ = _train_objects(2)
    assert not torch.equal(m2[0].weight, m[0].weight)
    assert rt_store.checkout(v, model=m2, optimizer=opt2).id == v.id  # "optimizer" finds the "optim" key
    _sd_equal(m2.state_dict(), m.state_dict())
    _sd_equal(opt2.state_dict(), opt.state_dict())
    # The restored optimizer steps exactly like the original.
    torch.manual_seed(5)
    _train_step(m, opt, torch.optim.lr_scheduler.StepLR(opt, 100), torch.amp.GradScaler("cpu", enabled=False))
    torch.manual_seed(5)
    _train_step(m2, opt2, torch.optim.lr_scheduler.StepLR(opt2, 100), torch.amp.GradScaler("cpu", enabled=False))
    _sd_equal(m2.state_dict(), m.state_dict())


def test_checkout_scheduler_and_scaler(rt_store: ds.Store) -> None:
    """Regression: keys whose subtree holds no tensor (scheduler, scaler) were unknown to checkout/load(keys=)."""
    m, opt, sched, scaler = _train_objects(3)
    _train_step(m, opt, sched, scaler)
    _train_step(m, opt, sched, scaler)
    v = rt_store.save({"model": m, "optimizer": opt, "scheduler": sched, "scaler": scaler}, branch="train")
    m2, opt2, sched2, scaler2 = _train_objects(4)
    rt_store.checkout(v, model=m2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    _sd_equal(m2.state_dict(), m.state_dict())
    _sd_equal(opt2.state_dict(), opt.state_dict())
    _sd_equal(sched2.state_dict(), sched.state_dict())
    _sd_equal(scaler2.state_dict(), scaler.state_dict())


def test_checkout_unknown_name_raises(rt_store: ds.Store) -> None:
    m, opt, *_ = _train_objects(5)
    v = rt_store.save({"model": m}, branch="train")
    with pytest.raises(ds.NotFoundError, match="optimizer"):
        rt_store.checkout(v, model=m, optimizer=opt)


# --------------------------------------------------------------------------- partial loads
@pytest.fixture
def partial_version(rt_store: ds.Store) -> ds.Version:
    state = {
        "model": {"enc": {"weight": torch.randn(4, 4), "bias": torch.randn(4)}, "dec": {"weight": torch.randn(2, 4)}},
        "ema": {"enc": {"weight": torch.randn(4, 4)}},
        "rng": torch.arange(6, dtype=torch.uint8),
    }
    return rt_store.save(state, branch="partial")


def test_partial_load_by_prefix(rt_store: ds.Store, partial_version: ds.Version) -> None:
    full = rt_store.load(partial_version)
    got = rt_store.load(partial_version, keys=["model.enc"])
    assert list(got) == ["model"] and list(got["model"]) == ["enc"]
    assert_same(got["model"]["enc"], full["model"]["enc"])


def test_partial_load_exact_and_glob(rt_store: ds.Store, partial_version: ds.Version) -> None:
    full = rt_store.load(partial_version)
    got = rt_store.load(partial_version, keys=["rng", "*.weight"])
    assert set(got) == {"model", "ema", "rng"}
    assert set(got["model"]) == {"enc", "dec"} and list(got["model"]["enc"]) == ["weight"]
    assert_same(got["rng"], full["rng"])
    assert_same(got["ema"], full["ema"])
    assert_same(got["model"]["dec"], full["model"]["dec"])


def test_partial_load_unknown_key(rt_store: ds.Store, partial_version: ds.Version) -> None:
    with pytest.raises(ds.NotFoundError, match="model.nope"):
        rt_store.load(partial_version, keys=["model.nope"])
    with pytest.raises(ds.NotFoundError):
        rt_store.load(partial_version, keys=["model.enc", "mod"])  # a prefix must end at a '.'


def test_partial_load_leaves_out_unselected_empty_containers(rt_store: ds.Store) -> None:
    """Regression: a fresh optimizer's {'state': {}} came back when only 'model' was asked for."""
    m, opt, *_ = _train_objects(6)  # no step yet: opt.state_dict()["state"] == {}
    v = rt_store.save({"model": m, "optim": opt, "extra": [], "empty": {}}, branch="partial")
    got = rt_store.load(v, keys=["model"])
    assert list(got) == ["model"]
    assert rt_store.load(v, keys=["extra", "empty"]) == {"extra": [], "empty": {}}  # selected: kept
    # A container under the key '' has the state's own path, '': it came back as {'': {}} from every partial load.
    v = rt_store.save({"": {"x": torch.ones(1)}, "w": torch.zeros(2)}, branch="partial")
    assert list(rt_store.load(v, keys=["w"])) == ["w"]
    assert rt_store.load(v, keys=["x"])[""]["x"].tolist() == [1.0]  # (its tensor's path is "x")


def test_partial_load_of_plain_values(rt_store: ds.Store) -> None:
    v = rt_store.save({"t": torch.ones(2), "meta": {"n": 1, "tags": ["a", "b"]}, "lr": 0.1}, branch="partial")
    assert rt_store.load(v, keys=["meta"]) == {"meta": {"n": 1, "tags": ["a", "b"]}}
    assert rt_store.load(v, keys=["meta.tags", "lr"]) == {"meta": {"tags": ["a", "b"]}, "lr": 0.1}


def test_loading_by_any_ref_form_writes_nothing(rt_store: ds.Store) -> None:
    v = rt_store.save({"x": torch.ones(3)}, branch="ro")
    before = rt_store.du()
    for ref in (v.id, v.id[:10], "ro", "ro~0"):
        assert torch.equal(rt_store.load(ref)["x"], torch.ones(3))
    assert rt_store.du() == before


def test_a_state_dicts_module_versions_come_back(rt_store: ds.Store, tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """`state_dict()._metadata` was dropped, and `load_state_dict` took the checkpoint for one of an old module
    version: a MinMaxObserver's eps came back as float32's (a review)."""
    from torch.ao.quantization.observer import MinMaxObserver

    obs = MinMaxObserver(eps=1e-3)
    obs(torch.randn(10))
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    for state in ({"obs": obs.state_dict(), "model": model.state_dict()}, {"obs": obs, "model": model}):
        v = rt_store.save(state)
        for got in (rt_store.load(v), rt_store.load(v, keys=["model"])):
            assert got["model"]._metadata == model.state_dict()._metadata
        got = rt_store.load(v)
        assert got["obs"]._metadata == obs.state_dict()._metadata
        fresh = MinMaxObserver()
        fresh.load_state_dict(got["obs"])
        assert fresh.eps.item() == pytest.approx(1e-3)
    again = rt_store.save({"model": model.state_dict()})  # through the kept flatten: the same metadata
    model.state_dict()  # (a new dict each call)
    sd = model.state_dict()
    sd._metadata["1"]["version"] = 1  # type: ignore[attr-defined]
    changed = rt_store.save({"model": sd})  # a changed metadata is not the kept one's
    assert rt_store.load(again)["model"]._metadata["1"] == {"version": 2}
    assert rt_store.load(changed)["model"]._metadata["1"] == {"version": 1}
    out = tmp_path_factory.mktemp("export") / "m.pt"
    ds.export(rt_store, again, "torch", out)
    assert torch.load(out, weights_only=True)["model"]._metadata == model.state_dict()._metadata
