"""Loading a few keys of a large version: bit-exact, and only the rows, tree nodes and chunks the keys name
are decoded and read. Asserts values, counts and error types (never times)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.counting import CountPreadv
from helpers.states import assert_same

import datastates as ds
from datastates.repo.reader import _key_selector
from datastates.save.manifest import Manifest
from datastates.save.tree import SKIP, PathIndex, flatten, tree_paths, unflatten

N = 2000


def _big_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    st: dict[str, Any] = {f"layers.{i:04d}.weight": torch.randn(16, generator=g) for i in range(N)}
    shared = torch.randn(64, generator=g)
    st["tied.a"] = shared
    st["tied.b"] = shared  # the same tensor twice: an alias row
    base = torch.arange(32, dtype=torch.int16)
    st["views.whole"] = base
    st["views.part"] = base[4:12].view(2, 4)  # a storage row and two view rows
    st["meta"] = {"step": 7, "lrs": [0.1, 0.01]}
    return st


def test_one_key_of_thousands_decodes_one_row_and_reads_one_chunk(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    st = _big_state()
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(st)
    with ds.Store.open(tmp_path / "s") as store:  # a fresh open: nothing cached
        count = CountPreadv(monkeypatch)
        got = store.load(v, keys=["layers.1234.weight"])
        assert_same(got, {"layers.1234.weight": st["layers.1234.weight"]})
        m = store.manifest_of(v)
        assert m.decoded_rows == 1 and m.table.num_rows == N + 5
        assert count.calls == 1
        got = store.load(v, keys=["layers.0007.weight", "meta.lrs.1"])
        assert_same(got, {"layers.0007.weight": st["layers.0007.weight"], "meta": {"lrs": [0.01]}})
        assert m.decoded_rows == 2 and count.calls == 2


def test_one_tied_or_view_key_brings_its_base(tmp_path: Path) -> None:
    st = _big_state()
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(st)
    with ds.Store.open(tmp_path / "s") as store:
        m = store.manifest_of(v)
        got = store.load(v, keys=["tied.b"])
        assert_same(got, {"tied.b": st["tied.a"]})
        assert m.decoded_rows == 2  # the alias row and the tensor row it names
        got = store.load(v, keys=["tied"])
        assert got["tied.a"] is got["tied.b"]
        got = store.load(v, keys=["views.part"])
        assert_same(got, {"views.part": st["views.part"]})
        both = store.load(v, keys=["views.whole", "views.part"])
        assert both["views.part"].untyped_storage().data_ptr() == both["views.whole"].untyped_storage().data_ptr()
        assert_same(both, {"views.whole": st["views.whole"], "views.part": st["views.part"]})
        assert m.decoded_rows < 10


def test_unknown_or_partial_segment_key_raises_not_found(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(_big_state())
        for key in ("layers.9999.weight", "layers.00", "layers.0001.weigh", "meta.lrs.2", "meta.lrs.01", "tied.a.x"):
            with pytest.raises(ds.NotFoundError, match=f"has no key '{key}'.*`datastates --store {store.path} ls "):
                store.load(v, keys=["layers.0001.weight", key])
        got = store.load(v, keys=["layers.0001"])  # a dotted prefix of a key names what lies under it
        assert list(got) == ["layers.0001.weight"]


def _tricky_state(rng: random.Random) -> dict[Any, Any]:
    """Dict keys with dots, keys that are dotted prefixes of others, non-str keys, nested lists."""
    def t() -> torch.Tensor:
        return torch.full((2,), float(rng.randrange(1000)))

    st: dict[Any, Any] = {
        "a": {"b": {"q": t()}, "b.c": t(), "x": [t(), {"y": t()}]},
        "a.b": {"r": t()},
        "a.b.c": {"d": t()},
        "a.b.q": 5,
        "a.bc": t(),
        "l": [t() for _ in range(12)],
        3: {None: t(), 1.5: t(), True: "flag"},
        "": {"e": t()},
        "s": {"": t(), ".x": t()},
        "v": 1,
    }
    for i in range(rng.randrange(5, 40)):
        st[f"p.{i}.{rng.choice(['w', 'b', 'w.q'])}"] = t()
    return st


def test_exact_keys_select_what_a_walk_of_every_path_selects() -> None:
    """The path index and the route through the tree name the same nodes as testing every path, for keys
    that cross dotted dict keys in several ways."""
    rng = random.Random(5)
    for _ in range(20):
        tree, _entries = flatten(_tricky_state(rng))
        index = PathIndex(tree)
        paths = tree_paths(tree)
        probes = set(paths) | {p[:i] for p in paths for i in range(1, len(p) + 1)} | {"zz", "l.12", "a.b.c.d.e"}
        for key in sorted(probes):
            _route, found = index.route([key])
            assert (key in found) == any(e == key or e.startswith(key + ".") for e in paths), key
        for _ in range(30):
            keys = rng.sample(sorted(k for k in probes if index.route([k])[1]), rng.randrange(1, 4))
            m = _FakeManifest(tree, index)
            select, route = _key_selector(keys, m, _FakeVersion())  # type: ignore[arg-type]
            assert route is not None
            full = unflatten(tree, lambda i: i, select=select)
            routed = unflatten(tree, lambda i: i, select=select, route=route)
            assert routed == full, keys
            assert full is not SKIP


class _FakeManifest:
    def __init__(self, tree: dict[str, Any], index: PathIndex) -> None:
        self.tree, self.paths = tree, index


class _FakeVersion:
    short = "000000000000"


def test_rows_decoded_one_at_a_time_match_the_full_decode(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(_big_state())
        mid = v.manifests["0"]
        data = store.repo.objects.read_manifest_bytes(mid)
    lazy, full = Manifest(mid, data), Manifest(mid, data)
    lazy.decode([5, 3, N + 4])
    for i in (0, 3, 5, N + 4, N + 1):
        assert lazy.row(i) == full.rows[i]
    assert lazy.decoded_rows == 5 and "rows" not in lazy.__dict__
    runs, scattered = list(range(10, 30)), list(range(100, 400, 10))  # sliced as one run; taken
    lazy.decode(runs + scattered + [N + 5, -1])
    assert lazy.decoded_rows == 5 + 20 + 30
    assert all(lazy.row(i) == full.rows[i] for i in runs + scattered)
    with pytest.raises(ds.IntegrityError, match=f"no row {N + 5}"):
        lazy.row(N + 5)
    with pytest.raises(ds.IntegrityError, match="no row -1"):
        full.row(-1)


def test_the_load_columns_of_a_few_rows_are_read_one_by_one_and_match_the_full_decode(tmp_path: Path) -> None:
    from datastates.save.manifest import _FEW_ROWS, LOAD_COLUMNS

    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(_big_state())
        mid = v.manifests["0"]
        data = store.repo.objects.read_manifest_bytes(mid)
    few, many, cached, full = (Manifest(mid, data) for _ in range(4))
    some = [N + 4, 0, 3, N + 1, 3]  # a view row, tensor rows, the storage row; one twice

    def want(rows: list[int]) -> dict[str, dict[int, Any]]:
        return {n: {i: full.rows[i][n] for i in rows} for n in LOAD_COLUMNS}

    assert few.load_columns(some) == want(some)
    assert few.decoded_rows == 4 and few._decoded == {}  # read value by value: no row decoded whole
    spread = list(range(0, N, N // (_FEW_ROWS + 10)))
    assert len(spread) > _FEW_ROWS and many.load_columns(spread) == want(spread)
    assert many.decoded_rows == len(spread)
    cached.load_columns()  # what a full load decodes: a few rows are taken from it
    assert cached.load_columns(some) == want(some) and cached.decoded_rows == N + 5
    for m in (few, cached):
        for bad in (N + 5, -1):
            with pytest.raises(ds.IntegrityError, match=f"no row {bad} .*run `datastates fsck`"):
                m.load_columns([1, bad])
