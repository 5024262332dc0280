"""The outermost ASGI layer: request ids, metrics, body-size bound, a typed 500 for anything unexpected,
and routing on the raw path so an encoded '/' (%2F) inside a ref or key stays inside its path segment."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote

from .metrics import Metrics

log = logging.getLogger("datastates.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY = 64 * 1024
"""Largest request body accepted (bytes); every write body is a small JSON object."""

_KEEP = re.compile(r"(%2[fF]|%25)")
_UNESCAPE = re.compile(r"%2F|%25")


def route_path(raw: bytes) -> str:
    """The raw path percent-decoded, except that %2F and %25 stay encoded (upper-case), so
    `/versions/lr%2F0.1/tensors` routes with ref `lr%2F0.1`; `unescape` finishes the decoding."""
    parts = _KEEP.split(raw.decode("latin-1"))
    return "".join(p.upper() if _KEEP.fullmatch(p) else unquote(p, errors="surrogateescape") for p in parts)


def unescape(param: str) -> str:
    """Finish decoding a path parameter routed by `route_path`."""
    return _UNESCAPE.sub(lambda m: "/" if m.group() == "%2F" else "%", param)


class BodyTooLarge(Exception):
    pass


class HeadSent(Exception):
    """A HEAD request's answer is complete (its headers sent): the GET handler that made them stops."""


class Observe:
    """Request id (X-Request-ID), metrics, body bound, and the catch-all typed 500."""

    def __init__(self, app: ASGIApp, metrics: Metrics, max_body: int = MAX_BODY) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        raw = scope.get("raw_path")
        if raw:
            scope["path"] = route_path(raw)
        started = time.perf_counter()
        status = 500
        response_started = False

        # HEAD is answered as GET without the body (RFC 9110 9.3.2): the same status and headers, and the
        # handler stops at its first body message, so a download reads no more than its first chunk.
        head = scope.get("method") == "HEAD"
        if head:  # a copy: the server reads its own scope's method to know it must send no body (httptools)
            scope = dict(scope, method="GET")

        async def send_wrapper(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                response_started = True
                status = int(message["status"])
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode()))
                message["headers"] = headers
            elif head and message["type"] == "http.response.body":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                raise HeadSent()
            await send(message)

        seen = 0

        async def receive_wrapper() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge()
            return message

        try:
            length = _header(scope, b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                await _error(send_wrapper, 413, "PAYLOAD_TOO_LARGE",
                             f"request body is over {self.max_body} bytes; send a smaller JSON object", rid)
                return
            app_receive: Receive = receive_wrapper
            if length is None and _header(scope, b"transfer-encoding") is not None:
                # A chunked body is read whole here, within the bound: raised inside FastAPI's body parsing,
                # BodyTooLarge became its untyped 400 "There was an error parsing the body".
                app_receive = await _buffered(receive_wrapper)
            await self.app(scope, app_receive, send_wrapper)
        except HeadSent:
            pass
        except BodyTooLarge:
            if not response_started:
                await _error(send_wrapper, 413, "PAYLOAD_TOO_LARGE",
                             f"request body is over {self.max_body} bytes; send a smaller JSON object", rid)
        except Exception:
            # Logged with its traceback here, answered without it.
            log.exception("request %s %s %s failed", rid, scope.get("method"), scope.get("path"))
            if not response_started:
                await _error(send_wrapper, 500, "INTERNAL",
                             f"internal error; the server log has the details under request id {rid}", rid)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(str(scope.get("method", "")), template, status, time.perf_counter() - started)


async def _buffered(receive: Receive) -> Receive:
    """Read a request's body messages now (raising what `receive` raises: BodyTooLarge); the returned
    receive gives them as one message, then whatever comes after (a disconnect)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            first: Message = message
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
            break
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1").strip()
    return None


async def _error(send: Send, status: int, code: str, message: str, rid: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message, "details": {}, "request_id": rid}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
