"""`ds.RemoteStore` over a real uvicorn answers exactly as `ds.Store` does on the same store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.server_proc import ServerProc
from server_fixtures import build_lineage_store

import datastates as ds


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lineage_store(tmp_path_factory.mktemp("remote") / "store")


@pytest.fixture(scope="module")
def remote(store_path: Path) -> Iterator[ds.RemoteStore]:
    with ServerProc(store_path) as srv, ds.RemoteStore(srv.url, page_size=3) as r:
        yield r  # page_size=3: every list below spans several pages


@pytest.fixture(scope="module")
def store(store_path: Path, remote: ds.RemoteStore) -> Iterator[ds.Store]:
    s = ds.Store.open(store_path, create=False)
    yield s
    s.close()


def test_version_and_log_equal_the_store(remote: ds.RemoteStore, store: ds.Store) -> None:
    for ref in ("main", "main~2", "best", "lr/high"):
        mine, theirs = remote.version(ref), store.version(ref)
        assert (mine.id, mine.parents, mine.step, mine.hparams, mine.metrics) == \
            (theirs.id, theirs.parents, theirs.step, theirs.hparams, theirs.metrics)
    assert [v.id for v in remote.log("main")] == [v.id for v in store.log("main")]
    assert [v.id for v in remote.log("main", first_parent=True, limit=3)] == \
        [v.id for v in store.log("main", first_parent=True, limit=3)]


def test_find_equals_the_store(remote: ds.RemoteStore, store: ds.Store) -> None:
    for q in ("", "hparams.lr > 1e-3", "metrics.loss < 0.4", "step >= 20 and step <= 40"):
        assert [v.id for v in remote.find(q)] == [v.id for v in store.find(q)], q
    assert len(remote.find("hparams.lr > 1e-3")) >= 4
    # A query's own order by is the order (it was re-sorted oldest first: a review), ties included: the server
    # broke them by id descending in a descending order, where Store.find keeps them by id ascending.
    for q in ("order by step desc limit 5", "hparams.lr > 1e-3 order by metrics.loss", "order by step desc",
              "order by step", "order by metrics.loss desc", "order by hparams.opt desc"):
        want = [v.id for v in store.find(q)]
        assert [v.id for v in remote.find(q)] == want, q
    steps = [v.step for v in store.find("order by step desc")]
    assert len(steps) > len(set(steps))  # ties there are
    for order_by in ("-step", "step", "-metrics.loss"):
        field, desc = order_by.lstrip("-"), order_by.startswith("-")
        q = f"order by {field}{' desc' if desc else ''}"
        assert [v.id for v in remote.find(order_by=order_by)] == [v.id for v in store.find(q)], order_by
    with pytest.raises(ds.InvalidArgumentError, match="its own 'order by' and order_by= is given too"):
        remote.find("order by step", order_by="-created")
    with pytest.raises(ds.InvalidArgumentError, match="names several fields"):
        remote.find("order by step, metrics.loss")
    # the typo refusal's hint (allow_missing=True) works through the client and the route too (a review)
    with pytest.raises(ds.QueryError, match="allow_missing=True"):
        remote.find("metrics.f1 > 0.5")
    assert remote.find("metrics.f1 > 0.5", allow_missing=True) == store.find("metrics.f1 > 0.5", allow_missing=True)
    assert remote.find("metrics.f1 is null", allow_missing=True) != []


def test_log_limit_is_checked_as_the_stores(remote: ds.RemoteStore, store: ds.Store) -> None:
    assert [v.id for v in remote.log(limit=2)] == [v.id for v in store.log(limit=2)] and remote.log(limit=0) == []
    with pytest.raises(ds.InvalidArgumentError, match="must be a number of versions"):
        remote.log(limit=-1)  # (it returned [] silently: a review)


def test_lineage_equals_the_store(remote: ds.RemoteStore, store: ds.Store) -> None:
    assert remote.ancestors("main") == store.ancestors("main")
    assert remote.ancestors("main", first_parent=True) == store.ancestors("main", first_parent=True)
    assert remote.descendants("main~4") == store.descendants("main~4")
    assert remote.merge_base("main", "lr/high") == store.merge_base("main", "lr/high")
    assert remote.branches() == store.branches() and remote.tags() == store.tags()


def test_diff_and_history_equal_the_store(remote: ds.RemoteStore, store: ds.Store) -> None:
    assert remote.diff("main~3", "main").to_pylist() == store.diff("main~3", "main").to_pylist()
    assert remote.history("model.fc.weight", "main").to_pylist() == \
        store.history("model.fc.weight", "main").to_pylist()
    assert [(i.key, i.dtype, i.shape, i.nbytes) for i in remote.ls("main~1")] == \
        [(i.key, i.dtype, i.shape, i.nbytes) for i in store.ls("main~1")]


def test_load_with_keys_is_bit_exact(remote: ds.RemoteStore, store: ds.Store) -> None:
    got = remote.load("best", keys=["model.fc.weight", "model.emb"])
    want = store.load("best", keys=["model.fc.weight", "model.emb"])
    assert set(got["model"]) == {"fc.weight", "emb"}
    for k in ("fc.weight", "emb"):
        assert got["model"][k].dtype == want["model"][k].dtype
        assert torch.equal(got["model"][k].view(torch.uint8), want["model"][k].view(torch.uint8))


def test_errors_come_back_typed(remote: ds.RemoteStore) -> None:
    with pytest.raises(ds.NotFoundError):
        remote.version("no-such-ref")
    with pytest.raises(ds.QueryError):
        remote.find("metrics.loss <")
    with pytest.raises(ds.NotFoundError):
        remote.load("main", keys=["model.no_such_key"])


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "not a url", "ftp://example.invalid"])
def test_no_answer_is_a_typed_error_naming_the_url(url: str) -> None:
    """A refused connection or a URL httpx cannot send to raised httpx's own errors, no DataStatesError."""
    from datastates.remote import RemoteError

    with ds.RemoteStore(url) as remote:
        for call in (lambda: remote.log("main"), lambda: remote.load("main")):
            with pytest.raises(RemoteError, match=f"UNREACHABLE: no answer from {url} .*datastates serve") as info:
                call()
            assert info.value.code == "UNREACHABLE"
