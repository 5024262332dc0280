"""The error envelope and the mapping from datastates errors to HTTP statuses.

Every error answer, whatever raised it, is
`{"error": {"code": "NOT_FOUND", "message": "...", "details": {...}}}`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import datastates as ds

log = logging.getLogger("datastates.server")

# Order matters: the first class an error is an instance of wins (subclasses first).
# AmbiguousRefError is a 400: the request as written names no single version, and
# the same request with more digits succeeds; nothing on the server conflicts.
_MAPPING: list[tuple[type[BaseException], int, str]] = [
    (ds.NotFoundError, 404, "NOT_FOUND"),
    (ds.AmbiguousRefError, 400, "AMBIGUOUS_REF"),
    (ds.QueryError, 400, "BAD_QUERY"),
    (ds.InvalidNameError, 400, "INVALID_NAME"),
    (ds.InvalidArgumentError, 400, "INVALID_ARGUMENT"),
    (ds.ShapeMismatchError, 400, "INVALID_ARGUMENT"),
    (ds.DeviceError, 400, "INVALID_ARGUMENT"),
    (ds.UnsupportedValueError, 400, "UNSUPPORTED_VALUE"),
    (ds.ConflictError, 409, "CONFLICT"),
    (ds.PrunedError, 410, "PRUNED"),
    (ds.StorageFullError, 507, "STORAGE_FULL"),
    (ds.ReadOnlyStoreError, 403, "READ_ONLY"),
    (ds.StoreClosedError, 503, "UNAVAILABLE"),
    (ds.IntegrityError, 500, "INTEGRITY_ERROR"),
]

_HTTP_CODES = {400: "BAD_REQUEST", 401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND",
               405: "METHOD_NOT_ALLOWED", 406: "NOT_ACCEPTABLE", 409: "CONFLICT", 410: "PRUNED",
               413: "PAYLOAD_TOO_LARGE", 415: "UNSUPPORTED_MEDIA_TYPE", 416: "RANGE_NOT_SATISFIABLE",
               422: "VALIDATION_ERROR", 429: "TOO_MANY_REQUESTS", 500: "INTERNAL", 503: "UNAVAILABLE"}


class ApiError(Exception):
    """An error the server itself raises (auth, range, size), answered in the envelope."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.details = details or {}
        self.headers = headers or {}


def envelope(status: int, code: str, message: str, details: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None, request_id: str | None = None) -> JSONResponse:
    """The one error answer shape."""
    body: dict[str, Any] = {"error": {"code": code, "message": message, "details": details or {}}}
    if request_id:
        body["error"]["request_id"] = request_id
    return JSONResponse(body, status_code=status, headers=headers)


def classify(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, error code) for a datastates error."""
    for cls, status, code in _MAPPING:
        if isinstance(exc, cls):
            return status, code
    return 500, "INTERNAL"


def _without_paths(message: str, store: ds.Store | None) -> str:
    """`message` without the server's own directories: each tier's root (as given and absolute) written as
    `<store>`, `<hot tier>` or `<cold tier>` where it stands as a whole path, and the `--store PATH` the Store's
    hints carry taken out (a client runs no command on the server's disk). A client learns which file, not where
    the server keeps it; the server's log keeps the full text."""
    if store is None:
        return message
    message = _STORE_OPTION.sub("`datastates ", message)
    tiers = store.repo.tiers
    names = {store.path: "<store>"} | ({t.root: f"<{t.name} tier>" for t in tiers} if len(tiers) > 1 else {})
    spelled = {str(p): name for root, name in names.items() for p in (root, Path(os.path.abspath(root)))}
    for root in sorted(spelled, key=len, reverse=True):  # longest first: nested roots
        # A whole path only: not the "data" in "datastates" of a server run on a store named data
        message = re.sub(rf"(?<![\w.~/-]){re.escape(root)}(?![\w.-])", spelled[root], message)
    return message


_STORE_OPTION = re.compile(r"`datastates --store (?:'[^']*'|\"[^\"]*\"|[^\s'\"`]+)+ ")
"""The `--store PATH` of a hint, PATH one shell word as shlex.quote writes it (quoted runs and plain ones joined:
`'/a/it'"'"'s'`)."""


def _rid(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into the envelope."""

    @app.exception_handler(ds.DataStatesError)
    async def _ds_error(request: Request, exc: ds.DataStatesError) -> JSONResponse:
        status, code = classify(exc)
        details: dict[str, Any] = {"type": type(exc).__name__}
        if isinstance(exc, ds.QueryError):
            details.update(offset=exc.offset, query=exc.query)
        if status >= 500:
            log.error("request %s: %s: %s", _rid(request), type(exc).__name__, exc)
        message = _without_paths(str(exc), getattr(request.app.state, "store", None))
        return envelope(status, code, message, details, request_id=_rid(request))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 500:
            log.error("request %s: %s", _rid(request), exc.message)
        message = _without_paths(exc.message, getattr(request.app.state, "store", None))
        return envelope(exc.status, exc.code, message, exc.details, exc.headers, request_id=_rid(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")),
                   "type": str(e.get("type", ""))} for e in exc.errors()]
        where = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors[:5])
        return envelope(422, "VALIDATION_ERROR", f"request does not validate: {where}; see /docs for the schema",
                        {"errors": errors}, request_id=_rid(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "ERROR")
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; the API lives under /api/v1 (see /docs)"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}; see /docs"
        return envelope(exc.status_code, code, message, {}, dict(exc.headers or {}), request_id=_rid(request))
