"""Read resources over a real uvicorn: every answer equals the Python API's on the same store."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.server_proc import ServerProc
from server_fixtures import build_lineage_store

import datastates as ds


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_lineage_store(tmp_path_factory.mktemp("read") / "store")


@pytest.fixture(scope="module")
def srv(store_path: Path) -> Iterator[ServerProc]:
    with ServerProc(store_path) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.api, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def store(store_path: Path, srv: ServerProc) -> Iterator[ds.Store]:
    # A second process opening the store the server has open: the library's locking allows readers.
    s = ds.Store.open(store_path, create=False)
    yield s
    s.close()


def walk(client: httpx.Client, path: str, **params: Any) -> list[Any]:
    items: list[Any] = []
    token = None
    while True:
        r = client.get(path, params={**params, **({"page_token": token} if token else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"items", "next_page_token"}
        items += body["items"]
        token = body["next_page_token"]
        if token is None:
            return items


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN and the server's "NaN"/"Infinity" strings stand for those floats."""
    if isinstance(a, str) and a in ("NaN", "Infinity", "-Infinity") and isinstance(b, float):
        a = float(a.replace("Infinity", "inf"))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_versions_default_order_is_newest_first_and_covers_every_version(client: httpx.Client,
                                                                          store: ds.Store) -> None:
    items = walk(client, "/versions", limit=3)
    table = store.find("", as_table=True)
    expected = sorted(zip(table.column("created").to_pylist(), table.column("id").to_pylist()), reverse=True)
    assert [v["id"] for v in items] == [vid for _, vid in expected]


def test_versions_filter_and_order_by_match_find(client: httpx.Client, store: ds.Store) -> None:
    q = "hparams.lr > 2e-3 and metrics.loss < 0.5"
    items = walk(client, "/versions", filter=q, order_by="metrics.loss", limit=2)
    rows = store.find(q, as_table=True).to_pylist()
    expected = [r["id"] for r in sorted(rows, key=lambda r: (r["metrics.loss"], r["id"]))]
    assert [v["id"] for v in items] == expected and len(expected) >= 3


def test_versions_order_by_desc_puts_nulls_last(client: httpx.Client, store: ds.Store) -> None:
    items = walk(client, "/versions", order_by="step desc", limit=4)
    steps = [v["step"] for v in items]
    present = [s for s in steps if s is not None]
    assert present == sorted(present, reverse=True)
    assert len(items) == store.find("", as_table=True).num_rows


def test_versions_branch_is_the_log_of_the_branch(client: httpx.Client, store: ds.Store) -> None:
    items = walk(client, "/versions", branch="lr/high", order_by="created")
    assert sorted(v["id"] for v in items) == sorted(v.id for v in store.log("lr/high"))


@pytest.mark.parametrize("ref", ["main", "main~2", "best", "lr/high", "main^"])
def test_version_equals_store_version(client: httpx.Client, store: ds.Store, ref: str) -> None:
    r = client.get("/versions/" + ref.replace("/", "%2F"))
    assert r.status_code == 200
    v = store.version(ref)
    body = r.json()
    assert body["id"] == v.id and body["parents"] == list(v.parents)
    assert same(body["metrics"], v.metrics) and body["hparams"] == v.hparams
    assert body["annotations"] == v.annotations and body["step"] == v.step and body["created"] == v.created


def test_version_by_unique_prefix(client: httpx.Client, store: ds.Store) -> None:
    v = store.version("main~1")
    assert client.get(f"/versions/{v.id[:10]}").json()["id"] == v.id


def test_ancestors_descendants_merge_base_equal_the_library(client: httpx.Client, store: ds.Store) -> None:
    assert walk(client, "/versions/main/ancestors", limit=2) == store.ancestors("main")
    assert walk(client, "/versions/main/ancestors", first_parent="true") == store.ancestors("main", first_parent=True)
    assert walk(client, "/versions/main/ancestors", depth=2) == store.ancestors("main", depth=2)
    root = store.log("main", first_parent=True)[-1].id
    assert walk(client, f"/versions/{root}/descendants", limit=3) == store.descendants(root)
    r = client.get("/versions/main/merge-base/lr%2Fhigh")
    assert r.json() == {"merge_base": store.merge_base("main", "lr/high")}


def test_diff_rows_equal_store_diff(client: httpx.Client, store: ds.Store) -> None:
    rows = walk(client, "/versions/main~4/diff/main", limit=2)
    assert same(rows, store.diff("main~4", "main").to_pylist())
    only = walk(client, "/versions/main~4/diff/main", keys="model.fc.*")
    assert same(only, store.diff("main~4", "main", keys=["model.fc.*"]).to_pylist())
    assert {r["key"] for r in only} == {"model.fc.weight", "model.fc.bias"}


def test_history_equals_store_history(client: httpx.Client, store: ds.Store) -> None:
    rows = walk(client, "/tensors/model.fc.weight/history", ref="main", limit=2)
    assert same(rows, store.history("model.fc.weight", "main").to_pylist())


def test_tensors_manifest_equals_ls(client: httpx.Client, store: ds.Store) -> None:
    items = walk(client, "/versions/main~1/tensors", limit=2)
    expected = [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes, "kind": t.kind,
                 "chunks": t.chunks, "stats": t.stats} for t in store.ls("main~1")]
    assert same(items, expected)


def test_branches_and_tags_equal_the_library(client: httpx.Client, store: ds.Store) -> None:
    assert {b["name"]: b["id"] for b in walk(client, "/branches", limit=2)} == store.branches()
    assert {t["name"]: t["id"] for t in walk(client, "/tags")} == store.tags()
    assert client.get("/branches/lr%2Fhigh").json() == {"name": "lr/high", "id": store.branches()["lr/high"]}
    assert client.get("/tags/best").json()["id"] == store.tags()["best"]


def test_population_tree_equals_family_tree_and_writes_nothing(client: httpx.Client, store: ds.Store,
                                                               store_path: Path) -> None:
    """The GET made a Population, which took the population's lease with the server's pid (a running
    trainer's lease was replaced, then deleted when the server stopped)."""
    from helpers.states import snapshot

    from datastates.pbt import family_tree

    before = snapshot(store_path)
    expected = family_tree(store, "sweep").to_pylist()
    items = walk(client, "/populations/sweep/tree", limit=3)
    assert items == expected and any(e["kind"] == "fork" for e in items)
    assert snapshot(store_path) == before


def test_missing_metric_and_nan_tensor_travel_as_strict_json(client: httpx.Client, store: ds.Store) -> None:
    body = client.get("/versions/main").json()
    assert body["metrics"]["loss"] is None and store.version("main").metrics["loss"] is None
    json.dumps(body, allow_nan=False)  # NaN/inf are refused at save; nothing non-finite reaches JSON
    rows = client.get("/versions/main/tensors").json()["items"]
    nan_row = next(r for r in rows if r["key"] == "model.nan")
    assert nan_row["stats"]["nan_count"] == 1 and nan_row["stats"]["max"] == 1.0
    json.dumps(rows, allow_nan=False)


@pytest.mark.parametrize(("path", "status", "code"), [
    ("/versions/no-such-ref", 404, "NOT_FOUND"),
    ("/versions/main~99", 404, "NOT_FOUND"),
    ("/versions/..%2F..%2Fetc%2Fpasswd", 404, "NOT_FOUND"),
    ("/versions/%00", 400, "INVALID_NAME"),
    ("/versions/main%00x/tensors", 400, "INVALID_NAME"),
    ("/versions/main/tensors/..%2F..%2Fformat.json", 404, "NOT_FOUND"),
    ("/versions/main/tensors/model.fc.weight%00", 400, "INVALID_NAME"),
    ("/tensors/no.such.key/history", 404, "NOT_FOUND"),
    ("/branches/..", 404, "NOT_FOUND"),
    ("/tags/%2E%2E%2Frefs", 404, "NOT_FOUND"),
    ("/versions?filter=metrics.loss%20%3C", 400, "BAD_QUERY"),
    ("/versions?order_by=tag", 400, "INVALID_ARGUMENT"),
    ("/versions?order_by=nonsense", 400, "INVALID_ARGUMENT"),
    ("/versions?limit=100000", 422, "VALIDATION_ERROR"),
    ("/versions?limit=0", 422, "VALIDATION_ERROR"),
    ("/versions?page_token=garbage", 400, "INVALID_ARGUMENT"),
    ("/no/such/route", 404, "NOT_FOUND"),
    ("/populations/nobody/tree", 404, "NOT_FOUND"),
])
def test_bad_input_gets_the_typed_error_envelope(client: httpx.Client, store: ds.Store, path: str, status: int,
                                                  code: str) -> None:
    before = (store.branches(), store.tags(), store.find("", as_table=True).num_rows)
    r = client.get(path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and "Traceback" not in r.text
    assert err["request_id"] == r.headers["x-request-id"]
    assert (store.branches(), store.tags(), store.find("", as_table=True).num_rows) == before


def test_query_error_carries_the_offset(client: httpx.Client) -> None:
    err = client.get("/versions", params={"filter": "metrics.loss <"}).json()["error"]
    assert err["details"]["offset"] == len("metrics.loss <") and err["details"]["type"] == "QueryError"


def test_page_token_of_another_query_is_refused(client: httpx.Client) -> None:
    token = client.get("/versions", params={"limit": 1}).json()["next_page_token"]
    r = client.get("/versions", params={"limit": 1, "order_by": "step", "page_token": token})
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_ARGUMENT"


@pytest.mark.parametrize(("path", "params", "named"), [
    ("/versions", {"filtr": "step > 1"},
     "did you mean filter=? it takes allow_missing, branch, filter, limit, order_by, page_token"),
    ("/versions", {"where": "step > 1", "limit": 2},
     "it takes allow_missing, branch, filter, limit, order_by, page_token"),
    ("/versions/main", {"x": "1"}, "it takes no query parameters"),
    ("/versions/main/state", {"key": "model.fc.weight"}, "did you mean keys=?"),
])
def test_an_unknown_query_parameter_is_refused_not_ignored(client: httpx.Client, path: str,
                                                           params: dict[str, Any], named: str) -> None:
    # Ignored, a misspelt filter would list every version as if each had matched it.
    r = client.get(path, params=params)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "INVALID_ARGUMENT"
    unknown = next(k for k in params if k not in ("limit",))
    assert f"unknown query parameter {unknown!r} for GET /api/v1{path}; {named}" in err["message"]
    assert client.get(path, params={k: v for k, v in params.items() if k != unknown}).status_code == 200


def test_metrics_count_requests_and_report_versions(srv: ServerProc, client: httpx.Client, store: ds.Store) -> None:
    client.get("/versions/main")
    text = httpx.get(srv.url + "/metrics").text
    assert 'datastates_http_requests_total{method="GET",route="/versions/{ref}",status="200"}' in text
    line = next(x for x in text.splitlines() if x.startswith("datastates_store_versions "))
    assert int(float(line.split()[1])) == store.find("", as_table=True).num_rows


def test_healthz_counts_versions(srv: ServerProc, store: ds.Store) -> None:
    assert httpx.get(srv.api + "/healthz").json() == {"status": "ok",
                                                      "versions": store.find("", as_table=True).num_rows}


def test_two_workers_over_one_store_answer_alike(store_path: Path, store: ds.Store) -> None:
    with ServerProc(store_path, workers=2) as two, httpx.Client(base_url=two.api, timeout=30) as c:
        answers = [c.get("/versions/main~1").json()["id"] for _ in range(12)]
        rids = {c.get("/healthz").headers.get("x-request-id") for _ in range(4)}
    assert answers == [store.resolve("main~1")] * 12 and len(rids) == 4
