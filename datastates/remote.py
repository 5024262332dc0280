"""`RemoteStore`: the read API of `Store`, over the REST server (`datastates serve`).

    remote = ds.RemoteStore("http://127.0.0.1:8080", token=None)
    remote.log("main"); remote.version("main~2"); remote.find("hparams.lr > 1e-3")
    remote.diff("main~5", "main"); remote.history("model.fc.weight"); remote.load("best", keys=["model.fc.weight"])

Answers equal `Store`'s (same ids, rows and bytes). Errors come back as the
same `ds.DataStatesError` subclasses, from the server's error envelope.
Needs httpx (the `server` extra). Pickled values are never loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import quote

from . import errors as E
from .meta.versions import Version
from .query.facade import check_limit
from .query.language import parse as parse_query
from .save.manifest import TensorInfo

_ERRORS: dict[str, type[E.DataStatesError]] = {
    "NOT_FOUND": E.NotFoundError, "AMBIGUOUS_REF": E.AmbiguousRefError, "BAD_QUERY": E.QueryError,
    "INVALID_NAME": E.InvalidNameError, "INVALID_ARGUMENT": E.InvalidArgumentError, "CONFLICT": E.ConflictError,
    "PRUNED": E.PrunedError, "UNSUPPORTED_VALUE": E.UnsupportedValueError, "INTEGRITY_ERROR": E.IntegrityError,
    "STORAGE_FULL": E.StorageFullError, "UNAVAILABLE": E.StoreClosedError,
    "READ_ONLY": E.ReadOnlyStoreError,
}
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class RemoteError(E.DataStatesError):
    """The server answered an error with no datastates equivalent (auth, validation, internal)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}" if status else f"{code}: {message}")
        self.status, self.code = status, code


def _seg(ref: Any) -> str:
    if isinstance(ref, Version):
        ref = ref.id
    return quote(str(ref), safe="")


def _num(x: Any) -> Any:
    return _NONFINITE.get(x, x) if isinstance(x, str) else x


def _version(d: dict[str, Any]) -> Version:
    return Version(id=d["id"], parents=tuple(d["parents"]), manifests=dict(d["manifests"]), step=d.get("step"),
                   epoch=d.get("epoch"), created=float(d["created"]), hparams=d.get("hparams") or {},
                   metrics=d.get("metrics") or {}, message=d.get("message", ""), branch=d.get("branch"),
                   world_size=int(d.get("world_size", 1)), bytes_total=int(d.get("bytes_total", 0)),
                   bytes_new=int(d.get("bytes_new", 0)), chunks_new=int(d.get("chunks_new", 0)),
                   fork_of=d.get("fork_of"), explore=d.get("explore"), pruned=bool(d.get("pruned")),
                   annotations=d.get("annotations") or {}, timings=d.get("timings") or {})


class RemoteStore:
    """A client of the REST API with `Store`'s read methods. Thread-safe (one httpx client)."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, page_size: int = 1000) -> None:
        import httpx

        # Stripped as the server strips its token file: a token read from a file ends with a newline, which an HTTP
        # header may not hold (the request then failed as 'no answer from the server').
        token = token.strip() if isinstance(token, str) else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.page_size = page_size
        self._http = httpx.Client(base_url=self.url + "/api/v1", headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # transport ---------------------------------------------------------------------
    def _get(self, path: str, **params: Any) -> Any:
        return self._check(self._send(path, {k: v for k, v in params.items() if v is not None})).json()

    def _send(self, path: str, params: dict[str, Any]) -> Any:
        """GET `path`; RemoteError (code UNREACHABLE) when no answer comes: httpx's own errors are no
        DataStatesError."""
        import httpx

        try:
            return self._http.get(path, params=params)
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise RemoteError(0, "UNREACHABLE", f"no answer from {self.url} ({type(exc).__name__}: {exc}); check "
                              "the URL and that `datastates serve` runs there") from exc

    def _check(self, r: Any) -> Any:
        if r.status_code < 400:
            return r
        try:
            err = r.json()["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            raise RemoteError(r.status_code, "HTTP", r.text[:200]) from None
        cls = _ERRORS.get(code)
        if cls is None:
            raise RemoteError(r.status_code, code, message)
        if cls is E.QueryError:
            raise E.QueryError(message)
        raise cls(message)

    def _walk(self, path: str, **params: Any) -> Iterator[Any]:
        token = None
        while True:
            page = self._get(path, limit=self.page_size, page_token=token, **params)
            yield from page["items"]
            token = page["next_page_token"]
            if token is None:
                return

    # the read API --------------------------------------------------------------------
    def version(self, ref: Any) -> Version:
        """The Version named by `ref`. Raises NotFoundError, AmbiguousRefError."""
        return _version(self._get(f"/versions/{_seg(ref)}"))

    def resolve(self, ref: Any) -> str:
        return self.version(ref).id

    def log(self, ref: Any = "main", *, first_parent: bool = False, limit: int | None = None) -> list[Version]:
        """`ref` and its ancestors, newest first (one request per version shown). Raises InvalidArgumentError for a
        limit that is no count, as Store.log does."""
        check_limit(limit)
        head = self.version(ref)
        if limit == 0:
            return []
        out = [head]
        for vid in self._walk(f"/versions/{head.id}/ancestors", first_parent=str(first_parent).lower()):
            if limit is not None and len(out) >= limit:
                break
            out.append(self.version(vid))
        return out[:limit] if limit is not None else out

    def ancestors(self, ref: Any, *, depth: int | None = None, first_parent: bool = False) -> list[str]:
        return list(self._walk(f"/versions/{_seg(ref)}/ancestors", depth=depth,
                               first_parent=str(first_parent).lower()))

    def descendants(self, ref: Any, *, depth: int | None = None) -> list[str]:
        return list(self._walk(f"/versions/{_seg(ref)}/descendants", depth=depth))

    def merge_base(self, a: Any, b: Any) -> str | None:
        return self._get(f"/versions/{_seg(a)}/merge-base/{_seg(b)}")["merge_base"]  # type: ignore[no-any-return]

    def find(self, query: str = "", *, order_by: str | None = None, branch: str | None = None,
             allow_missing: bool = False) -> list[Version]:
        """Versions matching `query`, in `Store.find`'s order: the query's own `order by` (one field), else
        `order_by` (FIELD, -FIELD or 'FIELD desc'), else creation time, oldest first. `allow_missing` as
        `Store.find`'s: a field no version has reads as null instead of being refused as a typo."""
        if order_by is None and not (query.strip() and parse_query(query).order_by):
            order_by = "created"
        rows = self._walk("/versions", filter=query, order_by=order_by, branch=branch,
                          allow_missing=allow_missing or None)
        return [_version(d) for d in rows]

    def branches(self) -> dict[str, str]:
        return {r["name"]: r["id"] for r in self._walk("/branches")}

    def tags(self) -> dict[str, str]:
        return {r["name"]: r["id"] for r in self._walk("/tags")}

    def ls(self, ref: Any = "main") -> list[TensorInfo]:
        return [TensorInfo(t["key"], t["dtype"], tuple(t["shape"]), t["nbytes"], t["kind"], t["chunks"],
                           {k: _num(v) for k, v in t["stats"].items()})
                for t in self._walk(f"/versions/{_seg(ref)}/tensors")]

    def diff(self, a: Any, b: Any, *, keys: list[str] | None = None) -> Any:
        """A pyarrow Table like `Store.diff`."""
        import pyarrow as pa

        from .query.compare import DIFF_SCHEMA

        rows = [{k: _num(v) for k, v in r.items()}
                for r in self._walk(f"/versions/{_seg(a)}/diff/{_seg(b)}", keys=keys)]
        return pa.Table.from_pylist(rows, schema=DIFF_SCHEMA)

    def history(self, key: str, ref: Any = "main") -> Any:
        """A pyarrow Table like `Store.history` (stats only; no tensor bytes are read)."""
        import pyarrow as pa

        from .query.compare import HISTORY_SCHEMA

        rows = [{k: _num(v) for k, v in r.items()}
                for r in self._walk(f"/tensors/{_seg(key)}/history", ref=ref if isinstance(ref, str) else _seg(ref))]
        return pa.Table.from_pylist(rows, schema=HISTORY_SCHEMA)

    def load(self, ref: Any = "main", *, keys: Iterable[str] | None = None) -> Any:
        """The tensors of `ref` (those `keys` select), nested as `Store.load` nests them. Plain
        (non-tensor) values are not sent over REST and are absent. Bit-exact."""
        import torch
        from safetensors.torch import load as st_load

        params: dict[str, Any] = {}
        if keys is not None:
            params["keys"] = [keys] if isinstance(keys, str) else list(keys)
        r = self._check(self._send(f"/versions/{_seg(ref)}/state", params))
        data = r.content
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        paths: dict[str, list[Any]] = json.loads(meta.get("datastates.paths", "{}"))
        tensors = st_load(data)
        for key in json.loads(meta.get("datastates.complex", "[]")):  # sent as their real views
            tensors[key] = torch.view_as_complex(tensors[key])
        out: dict[Any, Any] = {}
        for key, t in tensors.items():
            path = paths.get(key) or key.split(".")
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = t
        return out
