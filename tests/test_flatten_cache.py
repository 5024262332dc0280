"""The flatten cache (issue 13): a state saved again with the same structure and the same tensors reuses the
last flatten; any change of structure, tensor object, storage, shape, stride, dtype, requires_grad or
sharing flattens anew. Every case compares the cached result with a fresh `flatten` of the same state:
the skeleton, every row's fields and the bytes each row would store."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import datastates as ds
from datastates.save import capture as capture_mod
from datastates.save import tree as tree_mod
from datastates.save.tree import FlattenCache, TensorEntry, flatten


def _row(e: TensorEntry, sig: bool) -> tuple[Any, ...]:
    data = bytes(e.source.numpy()) if e.source is not None else None
    return (e.key, e.dtype, tuple(e.shape), e.device, e.kind, e.base, e.offset, tuple(e.stride), e.nbytes,
            e.sig if sig else None, data)


def _same_as_fresh(cache: FlattenCache, state: Any, sig: bool = True) -> None:
    tree, rows = cache.flatten(state)
    fresh_tree, fresh_rows = flatten(state)
    assert tree == fresh_tree
    assert [_row(e, sig) for e in rows] == [_row(e, sig) for e in fresh_rows]
    assert all(not e.chunks and not e.stats for e in rows)


class _Calls:
    """Counts the calls of `owner.name` (`n`) for the test's duration."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.n = 0
        real = getattr(owner, name)

        def counted(*args: Any, **kw: Any) -> Any:
            self.n += 1
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, counted)


def _count_flattens(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    """Full flattens (`Flattener.flatten`)."""
    return _Calls(monkeypatch, tree_mod.Flattener, "flatten")


def _state() -> dict[str, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"model": {"w": torch.nn.Parameter(w.clone()), "b": torch.ones(4), "tied": None},
            "optim": [{"step": torch.tensor(3), "lr": 0.1}, ("adam", 2)],
            "t": torch.arange(6, dtype=torch.int64).reshape(2, 3).t()}  # non-contiguous: copied bytes


def test_same_state_is_flattened_once_and_reads_the_new_values(monkeypatch: pytest.MonkeyPatch) -> None:
    st = _state()
    count = _count_flattens(monkeypatch)
    cache = FlattenCache()
    cache.flatten(st)
    with torch.no_grad():
        st["model"]["w"].add_(1)
        st["t"].mul_(7)  # the strided tensor's bytes are a copy: made again on every reuse
    st["optim"][0]["lr"] = 0.05  # a plain value may change without a new flatten
    _same_as_fresh(cache, st)
    assert count.n == 2  # the priming call and the fresh comparison; the reuse flattened nothing
    tree, rows = cache.flatten(st)
    assert tree["v"][1]["v"][0]["v"][1] == {"t": "v", "v": 0.05}
    v0 = st["model"]["b"]._version
    st["model"]["b"].add_(1)
    sig = next(e.sig for e in cache.flatten(st)[1] if e.key == "model.b")
    assert sig is not None and sig[1] == v0 + 1  # reuse_unchanged sees the version counter move


Mutation = Callable[[dict[str, Any]], None]


def _tie(st: dict[str, Any]) -> None:
    st["model"]["tied"] = st["model"]["b"]


def _set_storage(st: dict[str, Any]) -> None:
    st["model"]["b"].set_(torch.zeros(4))


def _set_same_storage_other_view(st: dict[str, Any]) -> None:
    b = st["model"]["b"]
    b.set_(b.untyped_storage(), 1, (2,), (1,))


def _set_onto_other_tensor(st: dict[str, Any]) -> None:
    with torch.no_grad():
        st["model"]["w"].set_(st["model"]["b"].view(1, 4))  # tied through set_: w now shares b's storage


def _resize_smaller(st: dict[str, Any]) -> None:
    with torch.no_grad():
        st["model"]["b"].resize_(2)  # same data pointer, fewer bytes


def _resize_bigger(st: dict[str, Any]) -> None:
    with torch.no_grad():
        st["model"]["b"].resize_(9)


def _dtype_in_place(st: dict[str, Any]) -> None:
    st["model"]["b"].data = st["model"]["b"].data.to(torch.float64)


def _requires_grad(st: dict[str, Any]) -> None:
    st["model"]["b"].requires_grad_(True)


def _replace_tensor(st: dict[str, Any]) -> None:
    st["model"]["b"] = st["model"]["b"].clone()


def _add_key(st: dict[str, Any]) -> None:
    st["model"]["new"] = torch.ones(2)


def _remove_key(st: dict[str, Any]) -> None:
    del st["model"]["b"]


def _rename_key(st: dict[str, Any]) -> None:
    st["model"] = {("bb" if k == "b" else k): v for k, v in st["model"].items()}


def _int_key_becomes_bool(st: dict[str, Any]) -> None:
    st["optim"][1] = ("adam", True)


def _tuple_becomes_list(st: dict[str, Any]) -> None:
    st["optim"][1] = list(st["optim"][1])


def _transpose_in_place(st: dict[str, Any]) -> None:
    st["model"]["b"].unsqueeze_(0)


@pytest.mark.parametrize("mutate", [
    _tie, _set_storage, _set_same_storage_other_view, _set_onto_other_tensor, _resize_smaller, _resize_bigger,
    _dtype_in_place, _requires_grad, _replace_tensor, _add_key, _remove_key, _rename_key, _int_key_becomes_bool,
    _tuple_becomes_list, _transpose_in_place,
])
def test_a_changed_state_is_flattened_anew(mutate: Mutation) -> None:
    st = _state()
    cache = FlattenCache()
    cache.flatten(st)
    cache.flatten(st)
    mutate(st)
    _same_as_fresh(cache, st)
    _same_as_fresh(cache, st)  # and the new structure is reused in turn


def test_a_broken_tie_is_flattened_anew() -> None:
    st = _state()
    st["model"]["tied"] = st["model"]["b"]
    st["model"]["view"] = st["model"]["w"].detach()[1:]  # a view: one storage row, two view rows
    cache = FlattenCache()
    cache.flatten(st)
    kinds = [e.kind for e in cache.flatten(st)[1]]
    assert "alias" in kinds and "storage" in kinds
    st["model"]["tied"] = st["model"]["b"].clone()
    st["model"]["view"].set_(st["model"]["view"].clone())
    _same_as_fresh(cache, st)
    assert {e.kind for e in cache.flatten(st)[1]} == {"tensor"}


def test_conjugate_views_are_never_reused() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    st = {"z": z.conj()}
    cache = FlattenCache()
    cache.flatten(st)
    assert cache._last is None  # saved through a resolved copy: nothing to reuse
    _same_as_fresh(cache, st, sig=False)  # each flatten resolves into a new copy (another data pointer)


def test_state_dicts_of_new_tensor_objects_every_save_reuse_a_record_that_holds_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `model.state_dict()` detaches anew on every call: new objects over the same storages, same signatures.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    cache = FlattenCache()
    cache.flatten({"model": model.state_dict()})  # a record of its objects, gone with them
    cache.flatten({"model": model.state_dict()})  # others at the same addresses: a record that holds none
    assert cache._last is not None and cache._last.refs is None
    count = _count_flattens(monkeypatch)
    for _ in range(3):
        with torch.no_grad():
            model[0].weight.add_(1)
        model[1].num_batches_tracked += 1
        _same_as_fresh(cache, {"model": model.state_dict()})  # rows, signatures (versions) and bytes
    assert count.n == 3  # the comparisons' own flattens: the cache flattened nothing


def test_a_record_of_new_objects_keeps_no_storage_alive(tmp_path: Path) -> None:
    model = torch.nn.Linear(300, 200)
    with ds.Store.open(tmp_path / "s") as store:
        for _ in range(4):  # the third and fourth captures go through the record's layouts
            store.save_async({"model": model.state_dict()}).result()
        record = store._saver.flattener._last
        assert record is not None and record.refs is None and record.plans
        weight = StorageWeakRef(model.weight.untyped_storage())
        del model
        gc.collect()
        assert weight.expired()  # the record and its layouts hold no byte view of the state
        assert store._saver.flattener._last is record


def test_a_kept_flatten_holds_one_storage_reference_shape_strides_and_device_name_per_tensor() -> None:
    """A first save of thousands of small tensors peaks in memory at its end (issue 13's peak-RSS bound): the
    record and its rows share each tensor's storage reference, shape and strides, and every row of one device its
    name."""
    state = {f"t{i}": torch.full((3, i % 5 + 1), float(i)) for i in range(300)}

    def weak_refs() -> int:
        return sum(isinstance(o, StorageWeakRef) for o in gc.get_objects())

    cache = FlattenCache()
    gc.collect()
    before = weak_refs()
    _, rows = cache.flatten(state)
    record = cache._last
    assert record is not None
    gc.collect()
    assert weak_refs() - before == 300
    assert len({id(e.device) for e in rows}) == 1
    for row, i in zip(record.signed, record.sig_of):
        sig = rows[row].sig
        assert sig is not None
        assert (record.sigs[1][i], record.sigs[3][i], record.sigs[4][i]) == (sig[0], rows[row].shape, sig[4])
        assert record.sigs[3][i] is rows[row].shape and record.sigs[4][i] is sig[4]
    assert [r.sig for r in cache.flatten(state)[1]] == [e.sig for e in rows]  # the next save's rows match them
    _same_as_fresh(cache, state)


def test_states_of_other_objects_in_turn_keep_no_record() -> None:
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)  # a population's members saved to one store in turn
    cache = FlattenCache()
    for _ in range(3):
        for m in (a, b):
            _same_as_fresh(cache, {"model": m.state_dict()})
            assert cache._last is None


def test_other_storages_at_the_same_addresses_are_flattened_with_their_own_bytes_and_storages() -> None:
    buf = np.arange(64, dtype=np.float32)
    cache = FlattenCache()
    for i in range(4):  # a new storage over the buffer each time: same address, same signature
        buf += 1
        st = {"w": torch.from_numpy(buf), "b": torch.full((3,), float(i))}
        _same_as_fresh(cache, st)
        rows = cache.flatten(st)[1]
        assert rows[0].sig is not None and rows[0].sig[6] == StorageWeakRef(st["w"].untyped_storage())
    assert cache._last is not None and cache._last.refs is None


def test_a_record_of_new_objects_leaves_conjugate_views_and_subclasses_to_the_full_flatten() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    cache = FlattenCache()
    for _ in range(2):
        cache.flatten({"z": z.detach()})
    assert cache._last is not None and cache._last.refs is None
    _same_as_fresh(cache, {"z": z.detach().conj()}, sig=False)  # same address, shape, strides: resolved copy

    class Marked(torch.Tensor):
        pass

    w = torch.ones(3)
    for _ in range(2):
        cache.flatten({"w": w.detach()})
    with pytest.raises(ds.UnsupportedValueError, match="w is a tensor subclass Marked"):
        cache.flatten({"w": w.as_subclass(Marked)})


@pytest.mark.parametrize("sync", [True, False], ids=["save", "save_async"])
def test_saves_of_state_dicts_plan_their_layout_once_and_load_back_each_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: bool) -> None:
    # Small parameters, a big one read in place by a sync save (>= 1 MiB), chunked (64 KiB chunks), and AdamW.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1024, 320), torch.nn.Linear(320, 7), torch.nn.LayerNorm(7))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    plans = _count_plans(monkeypatch)
    with ds.Store.open(tmp_path / "s", chunk_size=64 << 10) as store:
        versions, expected = [], []
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            versions.append(store.save(state) if sync else store.save_async(state).result())
            expected.append(copy.deepcopy(state))
        backs = [store.load(v) for v in versions]
    # first save: its objects' record; second: a record of new objects; third: laid out, the layout kept
    assert plans.n == 3
    for back, exp in zip(backs, expected):
        assert _equal(back["model"], exp["model"])
        assert [_equal(back["optim"]["state"][i], exp["optim"]["state"][i]) for i in range(5)] == [True] * 5


def test_the_cache_keeps_no_storage_alive_after_its_tensors_die() -> None:
    st = _state()
    cache = FlattenCache()
    cache.flatten(st)
    assert cache._last is not None
    del st["model"]
    assert cache._last is None


def test_saves_of_a_changing_state_load_back_exactly(tmp_path: Path) -> None:
    st = _state()
    st["model"]["tied"] = st["model"]["b"]
    with ds.Store.open(tmp_path / "s") as store:
        v1 = store.save(st)
        with torch.no_grad():
            st["model"]["b"].add_(5)
        v2 = store.save(st)  # reused flatten
        st["model"]["tied"] = st["model"]["b"].clone()
        with torch.no_grad():
            st["model"]["b"].resize_(2)
        v3 = store.save(st)
        back1, back2, back3 = store.load(v1), store.load(v2), store.load(v3)
    assert back1["model"]["tied"] is back1["model"]["b"]
    assert torch.equal(back2["model"]["b"], torch.full((4,), 6.0))
    assert back2["model"]["tied"] is back2["model"]["b"]
    assert torch.equal(back3["model"]["b"], torch.full((2,), 6.0))
    assert torch.equal(back3["model"]["tied"], torch.full((4,), 6.0))
    assert back3["model"]["tied"].untyped_storage().data_ptr() != back3["model"]["b"].untyped_storage().data_ptr()
    assert isinstance(back3["model"]["w"], torch.nn.Parameter)
    assert torch.equal(back3["t"], st["t"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _equal(a: Any, b: Any) -> bool:
    # Bits, not values: a store is bit-exact, and `resize_` leaves uninitialised elements that may be NaN
    # (NaN != NaN made `_resize_bigger` fail ~1 run in 10 under torch.equal).
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _contiguous_state() -> dict[str, Any]:
    st = _state()
    st["t"] = st["t"].contiguous()  # every row reads the tensor's own memory: the layout may be kept
    return st


def _count_plans(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    """Capture layouts planned anew (`capture.plan`)."""
    return _Calls(monkeypatch, capture_mod, "plan")


def test_a_repeated_capture_reuses_its_slot_layout_and_copies_the_new_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 300 tensors of odd sizes (alignment padding between pieces) through a 2-slot pool of 1 MiB slots.
    st = {f"p{i}": torch.full((1 + (i * 37) % 4000,), float(i)) for i in range(300)}
    plans = _count_plans(monkeypatch)
    with ds.Store.open(tmp_path / "s", pool_bytes=2 * 2**20) as store:
        handles, expected = [], []
        for _ in range(4):
            handles.append(store.save_async(st))
            expected.append({k: v.clone() for k, v in st.items()})
            for v in st.values():
                v.add_(1)  # right after save_async returns: the save must keep the bytes of the call
        backs = [store.load(h.result()) for h in handles]
    # first save: a fresh flatten (no kept layout); second: laid out and kept; then reused
    assert plans.n == 2
    assert all(_equal(b, e) for b, e in zip(backs, expected))


def test_a_strided_tensor_keeps_no_layout_and_each_save_reads_its_new_values(tmp_path: Path) -> None:
    st = _state()  # "t" is a transposed view: its bytes are a contiguous copy made on every save
    cache = FlattenCache()
    cache.flatten_kept(st)
    assert cache.flatten_kept(st)[2] is None
    st2 = _contiguous_state()
    cache.flatten_kept(st2)  # other tensor objects than the time before: no record yet
    cache.flatten_kept(st2)
    assert cache.flatten_kept(st2)[2] is not None
    with ds.Store.open(tmp_path / "s") as store:
        for _ in range(3):
            with torch.no_grad():
                st["t"].mul_(3)
            assert _equal(store.load(store.save(st)), st)


@pytest.mark.parametrize("mutate", [
    _tie, _set_storage, _set_same_storage_other_view, _set_onto_other_tensor, _resize_smaller, _resize_bigger,
    _dtype_in_place, _requires_grad, _replace_tensor, _add_key, _remove_key, _rename_key, _int_key_becomes_bool,
    _tuple_becomes_list, _transpose_in_place,
])
@pytest.mark.parametrize("sync", [True, False], ids=["save", "save_async"])
def test_a_changed_state_is_not_captured_through_a_kept_layout(tmp_path: Path, mutate: Mutation, sync: bool) -> None:
    st = _contiguous_state()
    with ds.Store.open(tmp_path / "s") as store:
        def save() -> Any:
            return store.save(st) if sync else store.save_async(st).result()

        save()
        save()  # the layout is kept now
        with torch.no_grad():
            st["model"]["w"].add_(1)
        assert _equal(store.load(save()), st)
        mutate(st)
        assert _equal(store.load(save()), st)
        with torch.no_grad():
            for t in (st["model"].get("b"), st["model"]["w"]):
                if t is not None:
                    t.add_(2)
        assert _equal(store.load(save()), st)  # the new structure's layout, kept in turn


def test_reuse_unchanged_drops_the_kept_layout_for_a_save_that_skips_rows(tmp_path: Path) -> None:
    st = _contiguous_state()
    with ds.Store.open(tmp_path / "s") as store:
        store.save(st, reuse_unchanged=True)
        store.save(st, reuse_unchanged=True)  # nothing changed: every row is reused, nothing copied
        with torch.no_grad():
            st["model"]["b"].add_(4)
        back = store.load(store.save(st, reuse_unchanged=True))
        assert _equal(back, st)
        with torch.no_grad():
            st["t"].add_(4)
        assert _equal(store.load(store.save(st)), st)  # and the kept layout copies every row again


def test_an_empty_tensor_keeps_the_layout_and_every_save_loads_back(tmp_path: Path) -> None:
    st = {"empty": torch.empty(0), "w": torch.ones(5), "steps": torch.zeros(0, 3, dtype=torch.int64)}
    cache = FlattenCache()
    cache.flatten_kept(st)
    assert cache.flatten_kept(st)[2] is not None  # an empty tensor reads no memory: nothing to copy anew
    with ds.Store.open(tmp_path / "s") as store:
        for _ in range(3):
            st["w"].add_(1)
            assert _equal(store.load(store.save_async(st).result()), st)


def test_known_stats_are_prepared_per_row_and_only_for_one_chunk_of_the_same_dtype() -> None:
    from datastates.save.job import KnownStats, SaveHandle, SaveJob, SaveMemory

    rows = [TensorEntry("a", torch.float32, (4,), "cpu", "tensor", nbytes=16),
            TensorEntry("b", torch.float32, (4,), "cpu", "tensor", nbytes=16),
            TensorEntry("a", torch.float32, (4,), "cpu", "alias", base=0)]
    memory = SaveMemory()
    job = SaveJob({}, rows, {}, SaveHandle(), 1024)
    known = KnownStats(job, memory)
    known.prepare(b"")
    assert known.cids == [None, None, None] and not known.stored  # memory recorded under no token yet

    def committed(dtype: torch.dtype, chunks: list[bytes], stats: dict[str, Any]) -> TensorEntry:
        return TensorEntry("x", dtype, (4,), "cpu", "tensor", nbytes=16, chunks=chunks, stats=stats)

    a = committed(torch.float32, [b"x" * 32], {"mean": 1.0})
    memory.by_key["a"], memory.drops = a, b""  # committed after the job was made: seen when it starts
    known.prepare(b"")
    assert (known.cids, known.nbytes) == ([b"x" * 32, None, None], [16, 16, 0])
    assert known.stats == [{"mean": 1.0}, None, None]
    assert known.stats[0] is a.stats and known.stored  # the very stats dict, shared
    known.prepare(b"other")  # a chunk left the index since the memory was recorded: look every piece up
    assert known.cids[0] == b"x" * 32 and not known.stored
    known.prepare(None)  # tiers, or a collective save: never trusted
    assert not known.stored
    for last in (committed(torch.float64, [b"y" * 32], {}),  # another dtype
                 committed(torch.float32, [b"y" * 32, b"z" * 32], {})):  # two chunks
        memory.by_key["b"] = last
        known.prepare(b"")
        assert known.cids[1] is None and known.cids[0] is not None
    del job  # the job holds its KnownStats, not the other way round: nothing is prepared for a job gone
    known.cids = []
    known.prepare(b"")
    assert known.cids == []


def test_kept_manifest_columns_give_the_same_bytes_and_follow_a_changed_leaf(tmp_path: Path) -> None:
    # The manifest's constant columns and the skeleton's JSON are encoded once per kept flatten; every later
    # save's manifest is byte for byte what encoding from scratch gives, and a changed plain leaf (a step
    # counter) reaches the manifest of the save that changed it.
    from datastates.save import manifest as mf

    g = torch.Generator().manual_seed(11)
    st: dict[str, Any] = {"w": [torch.randn(64, generator=g) for _ in range(20)], "step": 0,
                          "b": torch.arange(5, dtype=torch.int64)}
    cache = FlattenCache()
    kept_seen = []
    for step in (0, 0, 1, 2):
        st["step"] = step
        tree, rows, _, kept, _ = cache.flatten_kept(st)
        assert kept is not None and isinstance(rows, list)
        kept_seen.append(kept)
        for i, e in enumerate(rows):
            e.chunks, e.stats = [bytes([i]) * 32], {"min": float(i), "nan_count": 0}
        assert mf.encode(tree, rows, 1 << 20, kept) == mf.encode(tree, rows, 1 << 20), step
        assert mf.Manifest(*mf.encode(tree, rows, 1 << 20, kept)).tree == tree
    assert all(k is kept_seen[0] for k in kept_seen)  # one record served every save
    st["w"].append(torch.zeros(3))  # another structure: a new record, new columns
    tree, rows, _, kept, _ = cache.flatten_kept(st)
    assert kept is not None and kept is not kept_seen[0] and "columns" not in kept
    with ds.Store.open(tmp_path / "s") as store:
        for step in (3, 4, 4, 5):
            st["step"] = step
            st["w"][0].add_(1)
            v = store.save(st)
            back = store.load(v)
            assert back["step"] == step
            assert torch.equal(back["w"][0], st["w"][0]) and len(back["w"]) == 21


def test_kept_chunk_and_stats_columns_are_patched_where_rows_changed_and_give_the_same_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a kept flatten, a manifest encodes the chunk ids and statistics only of the rows whose stats dict
    is another object or whose chunks differ from the last manifest's, and patches them into its columns; the
    bytes are those of an encoding from scratch whatever changed: a few rows, equal values in new lists and
    dicts, more than half of the rows, missing statistics (nulls), rows without chunks."""
    import random

    from datastates.save import manifest as mf

    rng = random.Random(5)
    st: dict[str, Any] = {"w": [torch.randn(8) for _ in range(300)], "b": torch.arange(3)}
    tree, rows, _, kept, _ = FlattenCache().flatten_kept(st)
    assert kept is not None and isinstance(rows, list)

    def stats() -> dict[str, Any]:
        r = rng.random()
        if r < 0.1:
            return {}
        if r < 0.2:
            return {"l2": rng.random(), "nan_count": rng.randint(0, 3), "inf_count": 0}
        return {"min": rng.random(), "max": rng.random(), "mean": rng.random(),
                "std": None if r < 0.3 else rng.random(), "l2": rng.random(), "nan_count": 0,
                "inf_count": rng.randint(0, 2)}

    def chunks() -> list[bytes]:
        return [rng.randbytes(32) for _ in range(rng.randint(0, 3))]

    encoded: list[int] = []
    real = mf._varying_arrays

    def counting(entries: list[Any], *args: Any) -> Any:
        encoded.append(len(entries))
        return real(entries, *args)

    monkeypatch.setattr(mf, "_varying_arrays", counting)
    for e in rows:
        e.stats, e.chunks = stats(), chunks()
    changes = [("first", len(rows)), ("none", 0), ("stats of 10", 10), ("chunks of 7, the rest new equal lists", 7),
               ("200 rows", None), ("chunks of 1", 1), ("equal values in new dicts", len(rows))]
    for what, expect in changes:
        if what == "stats of 10":
            for e in rng.sample(rows, 10):
                e.stats = stats()
        elif what.startswith("chunks of 7"):
            for e in rows:
                e.chunks = list(e.chunks)
            for e in rng.sample(rows, 7):
                e.chunks = [*e.chunks, rng.randbytes(32)]
        elif what == "200 rows":
            for e in rng.sample(rows, 200):
                e.stats, e.chunks = stats(), chunks()
        elif what == "chunks of 1":
            rows[4].chunks = [rng.randbytes(32)]
        elif what.startswith("equal values"):
            for e in rows:
                e.stats = dict(e.stats)
        encoded.clear()
        data = mf.encode(tree, rows, 1 << 20, kept)
        assert encoded == ([] if expect == 0 else [len(rows) if expect is None else expect]), what
        assert data == mf.encode(tree, rows, 1 << 20), what
        back = mf.Manifest(*data).rows
        assert [r["chunks"] for r in back] == [e.chunks for e in rows], what
        assert [r["std"] for r in back] == [e.stats.get("std") for e in rows], what


def test_a_manifest_is_the_arrow_file_of_its_columns_byte_for_byte() -> None:
    """`encode` builds its columns in the system pool and hands out a view of the Arrow buffer (less resident
    memory, no copy): the bytes, and so every manifest id, are those of Arrow's plain `from_pydict` file."""
    import json

    import pyarrow as pa

    from datastates.save import manifest as mf

    g = torch.Generator().manual_seed(12)
    st: dict[str, Any] = {"w": [torch.randn(64 + i, generator=g) for i in range(30)], "step": 3,
                          "half": torch.ones(7, dtype=torch.bfloat16), "base": torch.arange(6), "none": None}
    st["view"] = st["base"][2:]
    tree, rows = flatten(st)
    for i, e in enumerate(rows):
        e.chunks = [bytes([i, j]) * 16 for j in range(i % 3)]
        e.stats = {} if i % 4 == 0 else {"min": -float(i), "max": float(i), "mean": 0.5, "std": None, "l2": 2.0,
                                         "nan_count": i, "inf_count": 0}
    mid, data = mf.encode(tree, rows, 1 << 20)
    cols: dict[str, Any] = {
        "key": [e.key for e in rows], "kind": [e.kind for e in rows], "dtype": [mf.dtype_name(e.dtype) for e in rows],
        "shape": [list(e.shape) for e in rows], "stride": [list(e.stride) for e in rows],
        "device": [e.device for e in rows], "base": [e.base for e in rows], "offset": [e.offset for e in rows],
        "nbytes": [e.nbytes for e in rows], "chunks": [e.chunks for e in rows]}
    for f in (*mf.STAT_FIELDS, *mf.COUNT_FIELDS):
        cols[f] = [e.stats.get(f) for e in rows]
    meta = {b"datastates.format": mf.MANIFEST_FORMAT.encode(),
            b"datastates.tree": json.dumps(tree, separators=(",", ":")).encode(), b"datastates.chunk_size": b"1048576"}
    table = pa.Table.from_pydict(cols, schema=mf.SCHEMA.with_metadata(meta))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    want = sink.getvalue().to_pybytes()
    assert data == want and bytes(data) == want and data.readonly
    assert mid == mf.Manifest(mid, data).id
    assert [r["key"] for r in map(mf.Manifest(mid, data).row, range(len(rows)))] == cols["key"]


def _trained_module(seed: int) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    opt.step()


def test_a_module_and_its_optimizer_are_flattened_once_across_training_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's way, `{"model": model, "optim": opt}`: the module's own parameters and buffers (not
    `state_dict()`'s detached copies, new objects on every call) and the optimizer's state tensors are the same
    objects from step to step, so the flatten is reused; each reuse gives what a fresh flatten gives."""
    model, opt = _trained_module(0)
    st = {"model": model, "optim": opt, "step": 1}
    count = _count_flattens(monkeypatch)
    cache = FlattenCache()
    cache.flatten(st)
    for i in range(3):
        _step(model, opt)  # new values in place; the BatchNorm's running stats and step counters move too
        st["step"] = i + 2
        _same_as_fresh(cache, st)
    assert count.n == 1 + 3  # the priming call and the three fresh comparisons: the reuses flattened nothing


def test_a_module_is_saved_as_its_state_dict_detached(tmp_path: Path) -> None:
    """Flattened through the module's parameters themselves, it is still stored, and loaded, as `state_dict()`
    gives it: plain tensors without requires_grad, the same skeleton as the state dict's."""
    model, opt = _trained_module(1)
    tree, rows = flatten({"model": model})
    sd_tree, sd_rows = flatten({"model": model.state_dict()})
    assert tree["v"][0] == {**sd_tree["v"][0], "from": "torch.nn.modules.container.Sequential"}
    assert [_row(e, False) for e in rows] == [_row(e, False) for e in sd_rows]
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save({"model": model, "optim": opt})
        back = store.load(v)
    for k, t in model.state_dict().items():
        got = back["model"][k]
        assert type(got) is torch.Tensor and not got.requires_grad and torch.equal(got, t), k
    assert _equal(back["optim"], opt.state_dict())


def test_a_module_whose_state_dict_takes_no_keep_vars_is_saved_through_it() -> None:
    class Old(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
            return {"w": self.w.detach() * 2}

    cache = FlattenCache()
    for _ in range(2):
        tree, rows = cache.flatten({"m": Old()})
        assert tree["v"][0]["from"].endswith("Old") and rows[0].source is not None
        assert bytes(rows[0].source.numpy()) == bytes(torch.full((3,), 2.0).numpy())


@pytest.mark.parametrize("change", ["another module", "another class", "frozen", "a new parameter"])
def test_a_changed_module_is_flattened_anew(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained_module(2)
    st: dict[str, Any] = {"model": model, "optim": opt}
    cache = FlattenCache()
    cache.flatten(st)
    count = _count_flattens(monkeypatch)
    if change == "another module":
        st["model"] = _trained_module(3)[0]  # the same class and keys, other tensors
    elif change == "another class":
        st["model"] = torch.nn.Linear(4, 8)
    elif change == "frozen":
        model[0].weight.requires_grad_(False)
    else:
        model[0].bias = torch.nn.Parameter(torch.zeros(8))
    _same_as_fresh(cache, st)
    assert count.n == 2  # the cache's own flatten and the fresh comparison


def test_saves_of_a_module_in_a_training_loop_load_back_each_step(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained_module(4)
    count = _count_flattens(monkeypatch)
    wants, versions = [], []
    with ds.Store.open(tmp_path / "s") as store:
        for lazy in (False, True, False, True):
            wants.append({"model": {k: t.clone() for k, t in model.state_dict().items()},
                          "optim": opt.state_dict()["state"][0]["exp_avg"].clone()})
            h = store.save_async({"model": model, "optim": opt}, lazy=lazy, optimizer=opt)
            _step(model, opt)  # waits for a lazy save's copy of what it changes
            versions.append(h.result())
        params = {k for k, _ in model.named_parameters()}
        for v, want, lazy in zip(versions, wants, (False, True, False, True)):
            back = store.load(v)
            # A lazy save's copy waits for the optimizer's step only: the forward pass before it moves the
            # BatchNorm's running statistics first (as documented for `lazy`).
            keys = params if lazy else set(want["model"])
            assert _equal({k: back["model"][k] for k in keys}, {k: want["model"][k] for k in keys})
            assert _equal(back["optim"]["state"][0]["exp_avg"], want["optim"])
    assert count.n <= 2  # flattened for the record on the first save, never again


@pytest.mark.parametrize("change", ["a log that grows", "new keys", "a list becomes a dict"])
def test_a_part_without_tensors_may_change_shape_and_the_flatten_is_still_reused(
        change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Trainer's state beside the tensors (its log grows every save) takes no new flatten of the tensors."""
    st = _state()
    st["trainer"] = {"log": [{"loss": 1.0}], "best": None, "args": ["lr", 0.1]}
    count = _count_flattens(monkeypatch)
    cache = FlattenCache()
    cache.flatten(st)
    for i in range(3):
        if change == "a log that grows":
            st["trainer"]["log"].append({"loss": 1.0 / (i + 2), "step": i})
        elif change == "new keys":
            st["trainer"][f"k{i}"] = {"nested": [i, "x", None]}
        else:
            st["trainer"]["args"] = {"lr": 0.1 * i} if i % 2 == 0 else ["lr", i]
        with torch.no_grad():
            st["model"]["w"].add_(1)
        _same_as_fresh(cache, st)
    assert count.n == 1 + 3  # the priming call and the fresh comparisons


def test_a_part_without_tensors_that_gains_one_or_a_refused_value_is_flattened_anew(
        monkeypatch: pytest.MonkeyPatch) -> None:
    st = _state()
    st["trainer"] = {"log": [{"loss": 1.0}]}
    cache = FlattenCache()
    cache.flatten(st)
    count = _count_flattens(monkeypatch)
    st["trainer"]["log"].append({"grad_norm": torch.tensor(0.5)})
    _same_as_fresh(cache, st)
    assert count.n == 2  # the cache's own flatten and the fresh comparison
    st["trainer"]["log"][1] = {"blob": b"\x00\x01"}  # bytes: a value a kept skeleton does not hold
    _same_as_fresh(cache, st)
    st["trainer"]["log"][1] = {"when": object()}
    with pytest.raises(ds.UnsupportedValueError, match=r"trainer\.log\.1\.when"):
        cache.flatten(st)


def test_the_cache_keeps_no_storage_of_a_module_alive_after_the_module_and_its_optimizer_die() -> None:
    import gc
    import weakref

    model, opt = _trained_module(5)
    cache = FlattenCache()
    cache.flatten({"model": model, "optim": opt})
    cache.flatten({"model": model, "optim": opt})
    assert cache._last is not None
    storage = weakref.ref(model[0].weight.untyped_storage())
    del model, opt
    gc.collect()
    assert cache._last is None and storage() is None


def _count_views(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    """Byte views a flatten makes of its tensors (`tree._bytes_of`)."""
    return _Calls(monkeypatch, tree_mod, "_bytes_of")


def _mixed_module() -> torch.nn.Module:
    # Small and chunked parameters (64 KiB chunks: the embedding is 1.25 MiB, borrowed by a sync save), bf16, an
    # int64 scalar buffer (BatchNorm's num_batches_tracked), a 0-d and an empty buffer.
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Embedding(1024, 320), torch.nn.Linear(320, 5), torch.nn.BatchNorm1d(5),
                            torch.nn.Linear(5, 3).to(torch.bfloat16))
    m.register_buffer("scale", torch.tensor(2.5))
    m.register_buffer("nothing", torch.empty(0, 4))
    return m


@pytest.mark.parametrize("mode", ["save", "save_async", "lazy"])
def test_state_dicts_are_copied_by_address_with_no_byte_view_per_save_and_load_back_each_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    from datastates.save import pipeline as pipeline_mod

    model = _mixed_module()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    views = _count_views(monkeypatch)
    held: list[bool] = []  # per slot the writer takes: whether the job still holds the tensors read by address
    real_emit = pipeline_mod.Pipeline._emit

    # `_emit` writes every slot: after `_write`, or for the last slots, handed together to one worker once all are
    # hashed (`_emit_all`); which of the two a slot takes depends on how fast the hashing went.
    def emit(self: Any, job: Any, slot: Any, todo: Any) -> None:
        held.append(job.holds is not None)
        real_emit(self, job, slot, todo)

    monkeypatch.setattr(pipeline_mod.Pipeline, "_emit", emit)
    with ds.Store.open(tmp_path / "s", chunk_size=64 << 10) as store:
        versions, expected, made, kept = [], [], [], []
        for step in range(6):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            model[2].num_batches_tracked += 1
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            expected.append(copy.deepcopy(state))
            before, held[:] = views.n, []
            if mode == "save":
                versions.append(store.save(state))
            else:
                handle = store.save_async(state, lazy=mode == "lazy")
                del state  # the save holds the tensor objects it reads by address until its copy is done
                if mode == "lazy":
                    handle.wait_staged()  # a lazy save copies in the background: the caller waits for this
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-1)  # before the version is durable: the save has its bytes already
                versions.append(handle.result())
            made.append(views.n - before)
            kept.append(all(held) and bool(held))
        record = store._saver.flattener._last
        backs = [store.load(v) for v in versions]
    assert record is not None and record.refs is None and record.plans is not None
    assert record.plans.raw is not None and len(record.plans.addressed) == 1
    # first save: its objects' record; second: a record of new objects; third: its layout kept, and addressed;
    # then no byte view at all: every tensor is copied (or read in place) from where the record says it is
    assert made[3:] == [0, 0, 0] and made[2] > 0
    if mode == "save":
        # A sync save's slots are read in place (hashing, the pack write) after its capture: held till then.
        assert kept[3:] == [True, True, True]
    for back, exp in zip(backs, expected):
        assert _equal(back["model"], exp["model"]) and back["step"] == exp["step"]
        assert _equal(back["optim"]["state"], exp["optim"]["state"])
def test_other_storages_at_the_same_address_are_copied_by_address_and_named_in_the_signatures(
        tmp_path: Path) -> None:
    # A new storage over the same numpy buffer on every save: the address and signature match the record, the
    # bytes copied are the buffer's now, and the rows name the storage they were taken from, so that a later
    # `reuse_unchanged` never takes one storage's chunks for another's.
    buf = np.zeros(20000, dtype=np.float32)
    small = torch.arange(7, dtype=torch.int64)
    with ds.Store.open(tmp_path / "s") as store:
        for i in range(5):
            buf[:] = i
            st = {"w": torch.from_numpy(buf), "small": small.detach()}
            back = store.load(store.save_async(st).result())
            assert torch.equal(back["w"], torch.full((20000,), float(i))) and torch.equal(back["small"], small)
            store._saver.pipeline.settled.wait()  # `Saver.remember` runs after the caller has its version
            last = store._saver.memory.by_key["w"]
            assert last.sig is not None and last.sig[6] == StorageWeakRef(st["w"].untyped_storage())
        assert store._saver.flattener._last is not None and store._saver.flattener._last.plans.addressed
        buf[:] = 9  # in place, under a new storage: the version counter is 0 again, as the last one's was
        st = {"w": torch.from_numpy(buf), "small": small.detach()}
        back = store.load(store.save(st, reuse_unchanged=True))
        assert torch.equal(back["w"], torch.full((20000,), 9.0))


def test_a_state_dict_with_a_strided_tensor_is_never_copied_by_address(tmp_path: Path) -> None:
    w = torch.arange(600, dtype=torch.float32).reshape(20, 30)
    with ds.Store.open(tmp_path / "s") as store:
        for i in range(5):
            st = {"t": w.t(), "b": torch.full((4,), float(i))}  # a transposed view: its bytes are a copy
            with torch.no_grad():
                w.add_(1)
            assert _equal(store.load(store.save_async(st).result()), {"t": w.t().contiguous(), "b": st["b"]})
        record = store._saver.flattener._last
    assert record is not None and record.plans is not None and record.plans.raw is None
    assert not record.plans.addressed


def test_a_lazy_save_holds_the_tensors_it_reads_by_address_until_its_copy_and_no_longer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import weakref

    from datastates.save import saver as saver_mod

    model = torch.nn.Linear(64, 32)
    with ds.Store.open(tmp_path / "s") as store:
        for _ in range(3):  # the third capture makes the addressed layout
            store.save_async({"model": model.state_dict()}).result()
        assert store._saver.flattener._last is not None and store._saver.flattener._last.plans.addressed
        real, go, seen = capture_mod.capture, threading.Event(), []

        def held_capture(job: Any, *args: Any, **kw: Any) -> Any:
            go.wait()  # the caller has dropped every reference of its own by now
            gc.collect()
            seen.append((job.holds is not None, ref() is not None))
            return real(job, *args, **kw)

        monkeypatch.setattr(saver_mod, "capture", held_capture)
        state = {"model": model.state_dict()}
        ref = weakref.ref(state["model"]["weight"])
        expected = model.weight.detach().clone()
        handle = store.save_async(state, lazy=True)
        del state
        go.set()
        back = store.load(handle.result())
        gc.collect()
        assert seen == [(True, True)] and ref() is None  # held for the copy, dropped after it
        assert torch.equal(back["model"]["weight"], expected)
