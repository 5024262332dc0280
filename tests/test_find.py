"""store.find: the query language over real versions, annotations and lineage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import datastates as ds


@pytest.fixture
def store(tmp_path: Path) -> ds.Store:
    s = ds.Store.open(tmp_path / "s")
    for step, lr in enumerate([1e-2, 1e-3, 1e-4, 3e-3]):
        s.save({"w": torch.full((8,), float(step))}, step=step, hparams={"lr": lr, "opt": "adam"},
               metrics={"val_loss": 1.0 / (step + 1)})
    yield s
    s.close()


def test_find_filters_orders_and_limits(store: ds.Store) -> None:
    got = store.find("hparams.lr > 1e-3 order by step desc")
    assert [v.step for v in got] == [3, 0]
    assert [v.step for v in store.find("metrics.val_loss < 0.4 or step = 0 order by step limit 2")] == [0, 2]


def test_find_sees_tags_annotations_and_lineage(store: ds.Store) -> None:
    store.tag("best", "main~1")
    store.annotate("main~2", metrics={"val_acc": 0.91})
    assert [v.step for v in store.find("tag = 'best'")] == [2]
    assert [v.step for v in store.find("metrics.val_acc >= 0.9")] == [1]
    assert sorted(v.step for v in store.find("ancestor_of('best')")) == [0, 1]
    assert sorted(v.step for v in store.find("descendant_of('main~3')")) == [1, 2, 3]


def test_annotations_never_change_the_version_id(store: ds.Store) -> None:
    before = store.resolve("main")
    v = store.annotate("main", metrics={"late": 1.5})
    assert v.id == before
    assert v.metrics["late"] == 1.5 and v.annotations == {}  # metrics, and no internal `_updated`
    assert store.resolve("main") == before


def test_find_syntax_error_names_the_offset(store: ds.Store) -> None:
    with pytest.raises(ds.QueryError) as err:
        store.find("hparams.lr >> 1")
    assert err.value.offset == 12


def test_lineage_walks_and_merge(store: ds.Store) -> None:
    base = store.resolve("main~2")
    store.branch("side", at=base)
    side = store.save({"w": torch.zeros(8)}, branch="side", step=10)
    merged = store.save({"w": torch.ones(8)}, branch="main", parents=["main", side], step=11)
    assert merged.parents == (store.resolve("main~1"), side.id)
    assert store.merge_base("main~1", "side") == base
    assert side.id in store.ancestors(merged)
    assert store.ancestors(merged, first_parent=True)[0] == merged.parents[0]
    assert merged.id in store.descendants(base)
    assert [merged.id] == [p[-1] for p in store.paths(side, merged)]
