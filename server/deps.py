"""What routes share: the store opened once per worker process, write authorization, path params."""

from __future__ import annotations

import difflib
import hmac
import re

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

import datastates as ds
from datastates.meta.versions import shown

from .errors import ApiError
from .middleware import unescape

_bearer = HTTPBearer(auto_error=False, description="Required on write endpoints when the server has a token file")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def get_store(request: Request) -> ds.Store:
    """The worker's store (opened at startup by the app's lifespan)."""
    store: ds.Store | None = getattr(request.app.state, "store", None)
    if store is None:
        raise ApiError(503, "UNAVAILABLE", "the store is not open yet; retry in a moment")
    # Two stats per request: with the files gone from under the server, every route answers 503 as /healthz
    # does (a ref read found nothing and answered 404 "not a branch", a listing answered from its cache).
    root = store.repo.tier.root
    for needed in (root / "FORMAT", root / "catalog" / "data.mdb"):
        if not needed.is_file():
            raise ApiError(503, "UNAVAILABLE", f"the store's {needed.relative_to(root)} is missing from {root}: the "
                           "store was moved or deleted under the server; restore it, or restart the server on it")
    return store


def known_query(request: Request) -> None:
    """Refuse a query parameter the route does not take (InvalidArgumentError: a 400 naming it, the closest one it
    takes, and all of them): a misspelt `?filtr=` would otherwise list every version as if it had matched."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    # Read per request (a few fields): GET and POST of one path take different ones, so the route, not its
    # path, says which; a walk costs microseconds next to any answer.
    takes = sorted(_names(route.dependant))
    for name in request.query_params:
        if name not in takes:
            close = difflib.get_close_matches(name, takes, n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            raise ds.InvalidArgumentError(
                f"unknown query parameter {name!r} for {request.method} {request.url.path}; {hint}"
                + (f"it takes {', '.join(takes)}" if takes else "it takes no query parameters"))


def _names(dependant: Dependant) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _names(sub)
    return names


def require_write(request: Request,
                  creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """Writes need `Authorization: Bearer <token>` when the server has a token; 403 when it has none."""
    token: str | None = request.app.state.token
    if token is None:
        raise ApiError(403, "WRITES_DISABLED",
                       "this server is read-only: restart it with --token-file FILE to enable writes")
    given = creds.credentials if creds is not None and creds.scheme.lower() == "bearer" else None
    # compare_digest on bytes: constant time whatever the lengths' first differing byte.
    if given is None or not hmac.compare_digest(given.encode(), token.encode()):
        raise ApiError(401, "UNAUTHORIZED",
                       "missing or wrong token; send the header 'Authorization: Bearer <token>'",
                       headers={"WWW-Authenticate": "Bearer"})


def ref_param(value: str, what: str = "ref") -> str:
    """A path parameter decoded (%2F -> '/'); control characters are refused before the store sees them."""
    return body_ref(unescape(value), what)


def body_ref(value: str, what: str = "ref") -> str:
    """A ref or name from a JSON body, as sent (JSON needs no percent-encoding: 'a%2Fb' is those five
    characters); control characters are refused before the store sees them."""
    if not value or _CONTROL.search(value) or not value.isascii() and not _utf8(value):
        raise ds.InvalidNameError(f"{what} {shown(value)} is empty or holds a control character or bytes that "
                                  "are no UTF-8 text; give a version id, branch or tag")
    return value


def _utf8(text: str) -> bool:
    """Whether `text` is text: a path's %FF decodes to a lone surrogate, which no JSON answer can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
