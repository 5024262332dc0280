"""The app factory: `create_app(store_path, token=None, cors_origin=None)`.

The store is opened once per worker process, when the app starts (lifespan),
and closed when it stops. Routes are plain `def` functions, so FastAPI runs
their blocking store calls in its thread pool.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

import datastates as ds

from . import API_PREFIX, errors
from .deps import known_query
from .metrics import Metrics
from .middleware import Observe
from .models import ErrorOut
from .routes import graph, refs, system, tensors, versions

log = logging.getLogger("datastates.server")

ENV_STORE = "DATASTATES_SERVER_STORE"
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {"model": ErrorOut, "description": what} for status, what in [
        (400, "bad query, name, argument or page token"), (401, "missing or wrong bearer token (writes)"),
        (403, "writes disabled: the server has no token file"), (404, "unknown ref, key, name or route"),
        (409, "conflict (name exists, compare-and-swap lost)"), (410, "the version's bytes were pruned"),
        (413, "request body too large"), (416, "range not satisfiable"), (422, "request does not validate"),
        (500, "internal error (typed, with a request id)")]}
ENV_HOT = "DATASTATES_SERVER_HOT"
"""The hot tier of one's own that `datastates --hot DIR serve` reads the store through (see Store.open's
record_tiers)."""
ENV_TOKEN_FILE = "DATASTATES_SERVER_TOKEN_FILE"
STATIC = Path(__file__).parent / "static"


def _index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")
ENV_CORS = "DATASTATES_SERVER_CORS_ORIGIN"


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in `path` (surrounding whitespace stripped). Raises InvalidArgumentError if it is empty
    or unreadable; the message names the file, never its content."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ds.InvalidArgumentError(f"token file {path} is unreadable ({exc.strerror}); "
                                      "give a readable file holding one token") from None
    if not token:
        raise ds.InvalidArgumentError(f"token file {path} is empty; write a token into it, e.g. "
                                      f"`python -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}`")
    return token


def create_app(store_path: str | os.PathLike[str], token: str | None = None,
               cors_origin: str | None = None, hot: str | os.PathLike[str] | None = None) -> FastAPI:
    """The FastAPI app over the store at `store_path` (which must exist), through the hot tier `hot` if given
    (for this server only: config.toml is left as it is).

    `token`: writes need `Authorization: Bearer <token>`; None makes every write endpoint answer 403.
    `cors_origin`: the one origin browsers may call from (CORS is off by default).
    """
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.store = ds.Store.open(store_path, create=False, hot=hot, record_tiers=False)
        try:
            yield
        finally:
            store, app.state.store = app.state.store, None
            store.close(raise_errors=False)

    app = FastAPI(title="DataStates", version=ds.__version__, lifespan=lifespan,
                  description="Lineage queries, tensor downloads and refs of a DataStates store. "
                              "Every list answers {items, next_page_token}; every error {error: {code, message, "
                              "details}}. See docs/server.md.")
    app.state.store = None
    app.state.token = token
    app.state.metrics = metrics
    errors.install(app)
    for r in (versions.router, tensors.router, refs.router, system.router, graph.router):
        app.include_router(r, prefix=API_PREFIX, responses=ERROR_RESPONSES, dependencies=[Depends(known_query)])
    # The lineage page: static files shipped in the package (no CDN, no npm: works air-gapped).
    app.add_api_route("/", _index, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_api_route("/healthz", system.healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", system.metrics, methods=["GET"], include_in_schema=False)
    if cors_origin:
        app.add_middleware(CORSMiddleware, allow_origins=[cors_origin], allow_methods=["GET", "POST", "PUT", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "Range", "If-None-Match"],
                           expose_headers=["ETag", "Content-Range", "X-Request-ID"])
    app.add_middleware(Observe, metrics=metrics)
    return app


def app_from_env() -> FastAPI:
    """Factory for `uvicorn --factory server.app:app_from_env` (each worker process builds its app).

    Reads the store path, the token file's path (never the token itself) and the CORS origin from
    DATASTATES_SERVER_STORE, DATASTATES_SERVER_TOKEN_FILE and DATASTATES_SERVER_CORS_ORIGIN."""
    path = os.environ.get(ENV_STORE)
    if not path:
        raise ds.InvalidArgumentError(f"${ENV_STORE} is not set; start the server with `datastates serve --store PATH`")
    token_file = os.environ.get(ENV_TOKEN_FILE)
    token = read_token_file(token_file) if token_file else None
    return create_app(path, token=token, cors_origin=os.environ.get(ENV_CORS) or None,
                      hot=os.environ.get(ENV_HOT) or None)
