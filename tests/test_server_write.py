"""Write endpoints and their authorization, over a real uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers.server_proc import ServerProc

import datastates as ds

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("write") / "store"
    with ds.Store.open(path) as s:
        for i in range(4):
            s.save({"w": torch.full((3,), float(i))}, step=i, metrics={"loss": 1.0 / (i + 1)})
        s.tag("keep", "main~1")
    return path


@pytest.fixture(scope="module")
def srv(store_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    token_file = tmp_path_factory.mktemp("secrets") / "token"
    token_file.write_text(TOKEN + "\n")
    with ServerProc(store_path, token_file=token_file) as s:
        yield s


@pytest.fixture(scope="module")
def store(store_path: Path, srv: ServerProc) -> Iterator[ds.Store]:
    s = ds.Store.open(store_path, create=False)
    yield s
    s.close()


AUTH = {"Authorization": f"Bearer {TOKEN}"}
WRITES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/branches", {"name": "nope", "at": "main"}),
    ("PUT", "/branches/main", {"to": "main~1", "expected": "0" * 64}),
    ("DELETE", "/branches/main", None),
    ("POST", "/tags", {"name": "nope", "ref": "main"}),
    ("DELETE", "/tags/keep", None),
    ("POST", "/versions/main/annotations", {"note": "x"}),
]


def state(store: ds.Store) -> tuple[Any, ...]:
    return store.branches(), store.tags(), store.version("main").annotations


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": f"Bearer {TOKEN}x"}])
def test_write_without_the_right_token_is_401_and_changes_nothing(srv: ServerProc, store: ds.Store, method: str,
                                                                   path: str, body: dict[str, Any] | None,
                                                                   headers: dict[str, str]) -> None:
    before = state(store)
    r = httpx.request(method, srv.api + path, json=body, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHORIZED"
    assert r.headers["www-authenticate"] == "Bearer"
    assert state(store) == before


@pytest.mark.parametrize(("method", "path", "body"), WRITES)
def test_writes_are_403_without_a_token_file(store_path: Path, store: ds.Store, method: str, path: str,
                                             body: dict[str, Any] | None, ro: ServerProc) -> None:
    before = state(store)
    r = httpx.request(method, ro.api + path, json=body, headers=AUTH)
    assert r.status_code == 403 and r.json()["error"]["code"] == "WRITES_DISABLED"
    assert state(store) == before


@pytest.fixture(scope="module")
def ro(store_path: Path, srv: ServerProc) -> Iterator[ServerProc]:
    with ServerProc(store_path) as s:
        yield s


def test_branch_create_move_with_cas_and_delete(srv: ServerProc, store: ds.Store) -> None:
    c = httpx.Client(base_url=srv.api, headers=AUTH)
    r = c.post("/branches", json={"name": "exp/a", "at": "main~2"})
    assert r.status_code == 201 and r.json() == {"name": "exp/a", "id": store.resolve("main~2")}
    assert store.branches()["exp/a"] == store.resolve("main~2")
    assert c.post("/branches", json={"name": "exp/a", "at": "main"}).json()["error"]["code"] == "CONFLICT"
    # compare-and-swap: a stale `expected` is a 409 and the branch stays put
    r = c.put("/branches/exp%2Fa", json={"to": "main", "expected": store.resolve("main~1")})
    assert r.status_code == 409 and store.branches()["exp/a"] == store.resolve("main~2")
    r = c.put("/branches/exp%2Fa", json={"to": "main", "expected": store.resolve("main~2")})
    assert r.status_code == 200 and r.json()["id"] == store.resolve("main")
    assert store.branches()["exp/a"] == store.resolve("main")
    assert c.put("/branches/ghost", json={"to": "main", "expected": "0" * 64}).status_code == 404
    assert c.delete("/branches/exp%2Fa").status_code == 204 and "exp/a" not in store.branches()
    assert c.delete("/branches/exp%2Fa").status_code == 404


def test_tag_create_conflict_and_delete(srv: ServerProc, store: ds.Store) -> None:
    c = httpx.Client(base_url=srv.api, headers=AUTH)
    r = c.post("/tags", json={"name": "v1", "ref": "main~3", "message": "first"})
    assert r.status_code == 201 and store.tags()["v1"] == store.resolve("main~3")
    r = c.post("/tags", json={"name": "v1", "ref": "main"})
    assert r.status_code == 409 and store.tags()["v1"] == store.resolve("main~3")
    assert c.delete("/tags/v1").status_code == 204 and "v1" not in store.tags()


def test_annotations_are_added_and_the_id_is_unchanged(srv: ServerProc, store: ds.Store) -> None:
    vid = store.resolve("main~1")
    r = httpx.post(srv.api + "/versions/main~1/annotations", json={"metrics": {"val_acc": 0.93}, "note": "ok"},
                   headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == vid
    ann = store.version(vid).annotations
    assert store.version(vid).metrics["val_acc"] == 0.93 and ann["note"] == "ok"  # metrics= overlays metrics
    assert store.find("metrics.val_acc > 0.9")[0].id == vid


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), [
    ("POST", "/branches", {"name": "bad name", "at": "main"}, 400, "INVALID_NAME"),
    ("POST", "/branches", {"name": "../escape", "at": "main"}, 400, "INVALID_NAME"),
    ("POST", "/branches", {"name": "ok", "at": "nowhere"}, 404, "NOT_FOUND"),
    ("POST", "/branches", {"name": "ok", "at": "main", "extra": 1}, 422, "VALIDATION_ERROR"),
    ("POST", "/branches", {"at": "main"}, 422, "VALIDATION_ERROR"),
    ("POST", "/tags", {"name": "t\u0000", "ref": "main"}, 400, "INVALID_NAME"),
    ("POST", "/versions/main/annotations", {}, 400, "INVALID_ARGUMENT"),
    ("POST", "/versions/main/annotations", {"_updated": 1}, 400, "INVALID_ARGUMENT"),  # reserved
    ("POST", "/versions/nowhere/annotations", {"a": 1}, 404, "NOT_FOUND"),
    ("POST", "/versions/main/annotations", {"x": "y" * 70_000}, 413, "PAYLOAD_TOO_LARGE"),
])
def test_bad_writes_are_typed_errors_and_change_nothing(srv: ServerProc, store: ds.Store, method: str, path: str,
                                                        body: dict[str, Any], status: int, code: str) -> None:
    before = state(store)
    r = httpx.request(method, srv.api + path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert state(store) == before


def test_not_json_body_is_422(srv: ServerProc) -> None:
    r = httpx.post(srv.api + "/branches", content=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "VALIDATION_ERROR"


def test_the_token_never_appears_in_the_server_log(srv: ServerProc) -> None:
    httpx.post(srv.api + "/tags", json={"name": "logcheck", "ref": "main"}, headers=AUTH)
    httpx.post(srv.api + "/tags", json={"name": "logcheck2"}, headers={"Authorization": "Bearer " + TOKEN[:-1]})
    assert srv.log and not any(TOKEN in line or TOKEN[:-1] in line for line in srv.log)


def test_cors_is_off_by_default_and_allows_only_the_given_origin(store_path: Path, tmp_path: Path) -> None:
    origin = "https://dash.example"
    with ServerProc(store_path) as plain:
        r = httpx.get(plain.api + "/versions/main", headers={"Origin": origin})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with ServerProc(store_path, cors_origin=origin) as srv:
        ok = httpx.get(srv.api + "/versions/main", headers={"Origin": origin})
        assert ok.headers.get("access-control-allow-origin") == origin
        other = httpx.get(srv.api + "/versions/main", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        pre = httpx.options(srv.api + "/branches", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Authorization"})
        assert pre.status_code == 200 and pre.headers.get("access-control-allow-origin") == origin


def test_a_write_first_does_not_change_what_the_reads_of_its_path_take(store_path: Path) -> None:
    # POST /branches takes no query parameter and GET /branches takes limit and page_token: the first request a
    # fresh server answers on the path (here a refused write) must not decide the parameters of the other method.
    with ServerProc(store_path) as fresh, httpx.Client(base_url=fresh.api, timeout=30) as c:
        assert c.post("/branches", json={"name": "x", "at": "main"}).status_code == 403
        assert c.post("/branches", params={"limit": 1}, json={"name": "x", "at": "main"}).status_code == 400
        page = c.get("/branches", params={"limit": 1})
        assert page.status_code == 200 and len(page.json()["items"]) == 1


def test_a_client_token_read_from_a_file_with_its_newline_works(srv: ServerProc, store: ds.Store) -> None:
    """RemoteStore(url, token=open(file).read()) failed as 'no answer from the server': the newline is not allowed
    in an HTTP header (a review). Stripped, as the server strips its token file."""
    client = ds.RemoteStore(srv.url, token=TOKEN + "\n")
    try:
        assert client.tags() == store.tags()
    finally:
        client.close()
