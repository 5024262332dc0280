"""Requests a hostile or unlucky client sends, over a real uvicorn: each gets a typed answer (never a 500 for
bad input, never a 200 that is wrong), and reads change no file of the store. Found by a hostile-client review;
each case failed before its fix."""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers.server_proc import ServerProc
from server_fixtures import build_lineage_store

import datastates as ds

TOKEN = "hostile-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_lineage_store(tmp_path_factory.mktemp("hostile") / "store")
    with ds.Store.open(path) as s:
        s.save({"权重": torch.arange(6, dtype=torch.float32)}, branch="unicode", step=1)
    return path


def _serve(template: Path, where: Path) -> ServerProc:
    path = where / "store"
    shutil.copytree(template, path)
    token_file = where / "token"
    token_file.write_text(TOKEN + "\n")
    return ServerProc(path, token_file=token_file)


@pytest.fixture(scope="module")
def srv(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    with _serve(template, tmp_path_factory.mktemp("served")) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv: ServerProc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.api, timeout=30) as c:
        yield c


def token(data: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


@pytest.mark.parametrize(("path", "forged"), [
    ("/branches", {"k": "branches"}),
    ("/tags", {"k": "tags", "after": 3}),
    ("/versions/main/tensors", {"k": "tensors"}),
    ("/versions/main/tensors", {"k": "tensors", "q": "x", "v": "main", "o": "abc"}),
    ("/tensors/model.fc.weight/history", {"k": "key-history", "key": "model.fc.weight"}),
    ("/populations/sweep/tree", {"k": "tree", "o": "x"}),
    ("/versions/main/ancestors", {"k": "ancestors", "q": "x", "v": "main", "o": True}),
    ("/graph", {"k": "graph", "q": "x", "offset": "9"}),
    ("/versions", {"k": "versions", "q": "x", "key": [1, "a"], "id": "x"}),
])
def test_a_forged_page_token_is_a_typed_400(client: httpx.Client, path: str, forged: dict[str, object]) -> None:
    """Tokens carry no secret: a field missing or of another type raised KeyError/ValueError (500)."""
    r = client.get(path, params={"page_token": token(forged)})
    assert error(r) == (400, "INVALID_ARGUMENT")


def test_a_versions_token_with_a_huge_key_is_a_typed_400(client: httpx.Client) -> None:
    real = client.get("/versions", params={"limit": 2}).json()["next_page_token"]
    data = json.loads(base64.urlsafe_b64decode(real + "=" * (-len(real) % 4)))
    for key in ([1, "a"], 10**40):
        r = client.get("/versions", params={"limit": 2, "page_token": token({**data, "key": key})})
        assert error(r) == (400, "INVALID_ARGUMENT")


@pytest.mark.parametrize("where", ["path", "query"])
def test_a_page_token_of_one_ref_is_refused_on_another(client: httpx.Client, where: str) -> None:
    """The tensors and history tokens were not bound to the ref: main's page 2 answered lr/high's rows."""
    def get(ref: str, **params: object) -> httpx.Response:
        if where == "path":
            return client.get(f"/versions/{ref}/tensors", params={"limit": 1, **params})
        return client.get("/tensors/model.fc.weight/history", params={"ref": ref, "limit": 1, **params})

    first = get("lr/high".replace("/", "%2F") if where == "path" else "lr/high").json()
    assert first["next_page_token"]
    r = get("main", page_token=first["next_page_token"])
    assert error(r) == (400, "INVALID_ARGUMENT") and "another" in r.json()["error"]["message"]
    again = get("lr%2Fhigh" if where == "path" else "lr/high", page_token=first["next_page_token"])
    assert again.status_code == 200 and again.json()["items"] != first["items"]


def test_annotations_named_like_the_methods_parameters_are_annotations(client: httpx.Client) -> None:
    """{"self": 1} raised TypeError (500): it met Store.annotate's own parameter."""
    r = client.post("/versions/main~1/annotations", json={"self": 1, "ref": "x"}, headers=AUTH)
    assert r.status_code == 200 and {"self": 1, "ref": "x"}.items() <= r.json()["annotations"].items()


def test_a_tensor_key_in_another_script_downloads(client: httpx.Client) -> None:
    """The key went into the Content-Disposition header, which is Latin-1: UnicodeEncodeError (500)."""
    r = client.get("/versions/unicode/tensors/%E6%9D%83%E9%87%8D")
    assert r.status_code == 200
    assert r.headers["content-disposition"] == (
        "attachment; filename=\"__.npy\"; filename*=UTF-8''%E6%9D%83%E9%87%8D.npy")
    assert np.load(io.BytesIO(r.content)).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_name_that_is_no_utf8_is_a_typed_400(client: httpx.Client) -> None:
    """%FF decoded to a lone surrogate that went into the 404 message, which JSON could not encode (500)."""
    assert error(client.get("/populations/%FF/tree")) == (400, "INVALID_NAME")
    assert error(client.get("/versions/%FF")) == (400, "INVALID_NAME")


def test_names_in_a_json_body_are_taken_as_sent(client: httpx.Client, srv: ServerProc) -> None:
    """Body fields were percent-decoded as path parameters are: 'a%2Fb' made branch 'a/b'."""
    r = client.post("/branches", json={"name": "a%2Fb", "at": "main"}, headers=AUTH)
    assert r.status_code == 201 and r.json()["name"] == "a%2Fb"
    r = client.post("/tags", json={"name": "t%25x", "ref": "main"}, headers=AUTH)
    assert r.status_code == 201
    with ds.Store.open(srv.store, create=False) as s:
        assert "a%2Fb" in s.branches() and "a/b" not in s.branches()
        assert "t%25x" in s.tags() and "t%x" not in s.tags()


def test_a_chunked_body_over_the_bound_is_413(client: httpx.Client) -> None:
    """Raised inside FastAPI's body parsing, the bound became an untyped 400 'error parsing the body'."""
    def chunks() -> Iterator[bytes]:
        yield b'{"note": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    json_type = {**AUTH, "content-type": "application/json"}
    r = client.post("/versions/main/annotations", content=chunks(), headers=json_type)
    assert error(r) == (413, "PAYLOAD_TOO_LARGE")
    small = client.post("/versions/main/annotations", content=iter([b'{"note": ', b'"ok"}']), headers=json_type)
    assert small.status_code == 200 and small.json()["annotations"]["note"] == "ok"


@pytest.mark.parametrize("path", ["/versions/main", "/versions/main/tensors/model.fc.weight", "/branches"])
def test_head_answers_as_get_without_a_body(client: httpx.Client, path: str) -> None:
    """HEAD was 405 everywhere (RFC 9110: a server supports HEAD wherever it supports GET)."""
    got, head = client.get(path), client.head(path)
    assert head.status_code == got.status_code == 200 and head.content == b""
    for name in ("content-type", "content-length", "etag"):
        assert head.headers.get(name) == got.headers.get(name)


def test_head_leaves_the_servers_own_scope_alone() -> None:
    """The middleware turned HEAD into GET in the server's scope dict; uvicorn's httptools protocol reads that
    method to know it must send no body, so every HEAD ended in 'Response content shorter than Content-Length'
    and broke its keep-alive connection (h11, used here, copes)."""
    import asyncio

    from server.metrics import Metrics
    from server.middleware import Observe

    seen: dict[str, str] = {}
    sent: list[dict[str, object]] = []

    async def app(scope: dict[str, object], receive: object, send: object) -> None:
        seen["method"] = str(scope["method"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b""}

    scope: dict[str, object] = {"type": "http", "method": "HEAD", "path": "/x", "headers": []}
    asyncio.run(Observe(app, Metrics())(scope, receive, send))  # type: ignore[arg-type]
    assert scope["method"] == "HEAD" and seen["method"] == "GET"
    assert [m["body"] for m in sent if m["type"] == "http.response.body"] == [b""]


def test_versions_pages_in_the_order_of_a_bool_column(client: httpx.Client) -> None:
    """A page token holding a bool sort key was refused as damaged (page 2 of order_by=pruned was a 400)."""
    first = client.get("/versions", params={"order_by": "pruned", "limit": 2}).json()
    rest = client.get("/versions", params={"order_by": "pruned", "limit": 1000,
                                           "page_token": first["next_page_token"]})
    assert rest.status_code == 200
    ids = [v["id"] for v in first["items"] + rest.json()["items"]]
    assert len(ids) == len(set(ids)) == len(client.get("/versions", params={"limit": 1000}).json()["items"])


def test_the_server_reads_the_longest_request_head_a_route_accepts(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """h11 (uvicorn's default protocol) gives up on a request head still incomplete past 16 KiB and answers its
    own plain-text 400, which no route documents: the schema fuzzer hit it in CI with a filter of ~8,190
    four-byte characters (98 KB percent-encoded) that arrived over several reads of a busy machine. The bound
    given to uvicorn must hold every route's longest query (12 bytes a character), so each gets its answer."""
    import argparse

    import uvicorn

    from server import serve
    from server.openapi import document

    longest = 0
    for ops in document()["paths"].values():
        for op in ops.values():
            query = [p for p in op.get("parameters", []) if p["in"] == "query"]
            longest = max(longest, sum(12 * p["schema"].get("maxLength", 32) + len(p["name"]) + 2 for p in query))
    assert 98_000 < longest < serve.MAX_REQUEST_HEAD - 16 * 1024  # (room for the path and the headers)
    from server.app import ENV_CORS, ENV_STORE, ENV_TOKEN_FILE

    for name in (ENV_CORS, ENV_STORE, ENV_TOKEN_FILE):  # serve() sets them for its workers: undone after
        monkeypatch.setenv(name, "")
    got: dict[str, object] = {}
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: got.update(kw))
    ds.Store.open(tmp_path / "s").close()
    args = argparse.Namespace(store=str(tmp_path / "s"), workers=1, token_file=None, cors_origin=None,
                              host="127.0.0.1", port=0, log_level="warning")
    assert serve.serve(args) == 0 and got["h11_max_incomplete_event_size"] == serve.MAX_REQUEST_HEAD


def test_a_range_with_a_digit_int_cannot_read_is_ignored() -> None:
    from server.tensorio import parse_range

    assert parse_range("bytes=0-\u00b9", 100) is None  # '¹' is a digit to str.isdigit, not to int
    assert parse_range("bytes=\u0661-5", 100) is None  # Arabic-Indic one
    assert parse_range("bytes=2-5", 100) == (2, 6)


def test_damage_under_a_running_server_is_a_typed_answer(template: Path, tmp_path: Path) -> None:
    """A truncated pack gave 200 and a body cut after the npy header; a damaged ref file answered 404 'does not
    exist' on GET /branches/NAME (and named the server's absolute path); a store deleted under the server left
    /healthz at 200 ok."""
    with _serve(template, tmp_path) as srv, httpx.Client(base_url=srv.api, timeout=30) as c:
        store = Path(srv.store)
        packs = sorted((store / "packs").glob("*.pack"))
        for p in packs:
            with open(p, "r+b") as f:
                f.truncate(64)
        r = c.get("/versions/main/tensors/model.fc.weight")
        assert error(r) == (500, "INTEGRITY_ERROR") and "pack" in r.json()["error"]["message"]
        (store / "refs" / "heads" / "lr%2Fhigh").write_text("garbage\n")
        r = c.get("/branches/lr%2Fhigh")
        assert error(r) == (500, "INTEGRITY_ERROR")
        # the file is named under <store>, not by the server's own absolute path
        assert "<store>/refs/heads/lr%2Fhigh" in r.json()["error"]["message"]
        assert str(store) not in r.text
        assert c.get("/healthz").status_code == 200
        store.rename(tmp_path / "moved")
        try:
            r = httpx.get(srv.url + "/healthz", timeout=30)
            assert error(r) == (503, "UNAVAILABLE") and "moved or deleted" in r.json()["error"]["message"]
            assert "FORMAT is missing from <store>" in r.json()["error"]["message"] and str(store) not in r.text
            for path in ("/versions/main/tensors/model.fc.weight", "/versions", "/branches/main"):
                # they answered 404 "not a branch" or from the cached table
                assert error(httpx.get(srv.api + path, timeout=30)) == (503, "UNAVAILABLE"), path
        finally:
            (tmp_path / "moved").rename(store)


def test_paths_are_taken_out_of_messages_as_whole_paths_and_hints_lose_their_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served from a store named `data`, a message's `datastates log` became `<store>states log` (the name replaced
    inside a word); the hints' `--store /server/path` (which the Store adds for Python callers) reached clients."""
    from server.errors import _without_paths

    monkeypatch.chdir(tmp_path)
    with ds.Store.open("data") as store:
        store.save({"w": torch.ones(1)})
        with pytest.raises(ds.NotFoundError) as info:
            store.load("main", keys=["nokey"])
        assert "`datastates --store data ls " in str(info.value)
        shown = _without_paths(str(info.value), store)
        assert "`datastates ls " in shown and "<store>" not in shown and "--store" not in shown
        quoted = "`datastates --store '/srv/my dir/it'\"'\"'s' ls 6dec24c79fa0`"  # shlex.quote of a path with ' in it
        assert _without_paths(quoted, store) == "`datastates ls 6dec24c79fa0`"
        message = f"ref file data/refs/heads/x and {tmp_path}/data/packs/p.pack; /elsewhere/data/x; `datastates log`"
        assert _without_paths(message, store) == ("ref file <store>/refs/heads/x and <store>/packs/p.pack; "
                                                  "/elsewhere/data/x; `datastates log`")
