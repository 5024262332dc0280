"""Property tests over what users pass in: any save argument either round-trips exactly or is refused
by our own validation (a DataStatesError, ValueError or TypeError) before anything is written, and the
store stays readable; any query string either runs or is a QueryError/NotFoundError."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datastates as ds

REFUSALS = (ds.DataStatesError, ValueError, TypeError)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

texts = st.text(alphabet=st.characters(blacklist_categories=()), max_size=12)  # lone surrogates and NUL too
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), texts)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(texts, st.integers(0, 3)), inner, max_size=3)),
    max_leaves=8)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ds.Store]:
    s = ds.Store.open(tmp_path_factory.mktemp("props") / "s")
    s.save({"w": torch.zeros(2)}, step=0, hparams={"lr": 0.1}, metrics={"loss": 1.0})
    yield s
    assert s.fsck().ok  # whatever was tried, the store is sound
    s.close()


def _same(a: Any, b: Any) -> bool:
    """Equality as JSON keeps it: tuples come back as lists, NaN never gets in."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _leaves(d: Any) -> Iterator[Any]:
    for x in d.values():
        if isinstance(x, dict):
            yield from _leaves(x)
        else:
            yield x


def _try_save(store: ds.Store, **kw: Any) -> ds.Version | None:
    before = [v.id for v in store.log()]
    try:
        return store.save({"w": torch.ones(2)}, **kw)
    except REFUSALS:
        assert [v.id for v in store.log()] == before  # refused: nothing written
        store.versions_table()  # ... and every reader still works
        return None


@SETTINGS
@given(hparams=values)
def test_hparams_round_trip_or_are_refused(store: ds.Store, hparams: Any) -> None:
    v = _try_save(store, hparams=hparams)
    if v is not None:
        assert _same(store.version(v.id).hparams, {} if hparams is None else hparams)
        assert store.find(f"id = '{v.id}'")[0].id == v.id


@SETTINGS
@given(metrics=values)
def test_metrics_round_trip_or_are_refused(store: ds.Store, metrics: Any) -> None:
    v = _try_save(store, metrics=metrics)
    if v is not None:
        assert _same(store.version(v.id).metrics, {} if metrics is None else metrics)
        assert all(isinstance(x, (int, float)) and not isinstance(x, bool) or x is None for x in _leaves(v.metrics))


@SETTINGS
@given(step=scalars, epoch=scalars, message=scalars)
def test_step_epoch_message_round_trip_or_are_refused(store: ds.Store, step: Any, epoch: Any, message: Any) -> None:
    v = _try_save(store, step=step, epoch=epoch, message=message)
    if v is not None:
        got = store.version(v.id)
        assert (got.step, got.epoch, got.message) == (step, epoch, message or "")


@SETTINGS
@given(name=texts)
def test_branch_and_tag_names_work_or_are_refused(store: ds.Store, name: str) -> None:
    v = _try_save(store, branch=name)
    if v is not None:
        assert store.resolve(f"branch:{name}") == v.id


tokens = st.sampled_from(["metrics.loss", "hparams.lr", "step", "id", "branch", "tags", "<", "<=", "=", "!=",
                          ">", "and", "or", "not", "(", ")", "in", "like", "is", "null", "order by", "limit",
                          "desc", "1", "-2.5e3", "1e999", "9" * 40, "'main'", "'%a_'", ",", "ancestor_of('main')",
                          "descendant_of('nope')", "'", "\\", "\x00"])
queries = st.one_of(texts, st.lists(tokens, max_size=8).map(" ".join))


@SETTINGS
@given(query=queries)
def test_any_query_runs_or_is_a_query_error(store: ds.Store, query: str) -> None:
    try:
        rows = store.find(query, as_table=True, allow_missing=True)
    except (ds.QueryError, ds.NotFoundError):
        return
    assert rows.num_rows <= len(store.versions_table())


@pytest.mark.parametrize(("call", "error"), [
    (lambda s: s.load("main", keys=123), ds.InvalidArgumentError),
    (lambda s: s.load("main", keys=["model", 7]), ds.InvalidArgumentError),
    (lambda s: s.diff("main", "main", keys=5), ds.InvalidArgumentError),
    (lambda s: s.history(5), ds.InvalidArgumentError),
    (lambda s: s.save({"w": torch.ones(1)}, parents="main"), ds.InvalidArgumentError),
    (lambda s: s.find("step > " + "9" * 400), None),  # beyond any float: compares as infinity
], ids=["keys-int", "keys-list-int", "diff-keys-int", "history-key-int", "parents-str", "huge-int-in-find"])
def test_odd_arguments_are_typed_errors(store: ds.Store, call: Any, error: type[Exception] | None) -> None:
    before = [v.id for v in store.log()]
    if error is None:
        assert call(store) == []
    else:
        with pytest.raises(error):
            call(store)
    assert [v.id for v in store.log()] == before


def test_a_state_nested_5000_deep_is_refused_typed(tmp_path: Path) -> None:
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    with ds.Store.open(tmp_path / "s") as s:
        with pytest.raises(ds.UnsupportedValueError, match="deeper than"):
            s.save(deep)
        assert s.branches() == {}  # nothing was written
        shallow = {"a": {"b": {"c": torch.ones(1)}}}
        assert torch.equal(s.load(s.save(shallow))["a"]["b"]["c"], torch.ones(1))


def test_float_literals_compare_with_ints_beyond_2_to_53(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as s:
        for step in (0, 5, 2**53 + 1, 2**63 - 1):
            s.save({"w": torch.ones(1)}, step=step)
        assert [v.step for v in s.find("step > " + "9" * 400)] == []  # beyond any float: infinity
        assert [v.step for v in s.find("step > 1e300")] == []
        assert [v.step for v in s.find("step > 2.5")] == [5, 2**53 + 1, 2**63 - 1]
        assert [v.step for v in s.find("step = 9223372036854775807")] == [2**63 - 1]
