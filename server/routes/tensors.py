"""Tensors of a version: the manifest, downloads (.npy / safetensors, Range, ETag), a key's history."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Header, Query, Response
from fastapi.responses import StreamingResponse

import datastates as ds
from datastates.query.compare import history_page
from datastates.tensor_bytes import select_tensor_keys, tensor_bytes_info, tensor_paths

from .. import paging
from ..convert import table_rows, tensor_dict
from ..deps import get_store, ref_param
from ..errors import ApiError
from ..models import HistoryRow, Page, TensorOut
from ..tensorio import Body, npy_body, parse_range, safetensors_body, started_body

router = APIRouter(tags=["tensors"])

Limit = Query(paging.DEFAULT_LIMIT, ge=1, le=paging.MAX_LIMIT, description="items per page (at most 1000)")
Token = Query(None, max_length=4096, description="next_page_token of the previous page")
MAX_STATE_KEYS = 10_000

_BINARY = {200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                 "description": "the file (or the asked byte range, 206)"},
           206: {"description": "the asked byte range"}, 304: {"description": "not modified (If-None-Match)"},
           416: {"description": "range not satisfiable"}}


@router.get("/versions/{ref}/tensors", response_model=Page[TensorOut], summary="The manifest of a version")
def list_tensors(ref: str, limit: int = Limit, page_token: str | None = Token,
                 store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    vid, start = paging.pinned(page_token, "tensors", ref) or (store.resolve(ref_param(ref)), 0)
    items, nxt = paging.offset_page([tensor_dict(t) for t in store.ls(vid)], start, limit)
    return {"items": items, "next_page_token": paging.pinned_token("tensors", vid, nxt, ref)}


def _disposition(filename: str) -> str:
    """An attachment header for `filename` (letters, digits, '._-'): HTTP headers are Latin-1, so a name
    in another script goes as RFC 6266's `filename*` (UTF-8, percent-encoded) after an ASCII one."""
    plain = "".join(c if c.isascii() else "_" for c in filename)
    if plain == filename:
        return f'attachment; filename="{filename}"'
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(filename, safe='')}"


def _send(store: ds.Store, body: Body, filename: str, range_: str | None, if_none_match: str | None,
          if_range: str | None) -> Response:
    etag = body.etag
    headers = {"ETag": etag, "Cache-Control": "public, max-age=31536000, immutable", "Accept-Ranges": "bytes",
               "Content-Disposition": _disposition(filename)}
    if if_none_match is not None and (if_none_match.strip() == "*"
                                      or etag in [t.strip().removeprefix("W/") for t in if_none_match.split(",")]):
        return Response(status_code=304, headers={k: v for k, v in headers.items() if k != "Content-Disposition"})
    length = body.length
    if if_range is not None and if_range.strip() != etag:
        range_ = None  # the client's copy is another representation: send all of it
    try:
        span = parse_range(range_, length)
    except ValueError:
        raise ApiError(416, "RANGE_NOT_SATISFIABLE", f"range {range_!r} is outside the file of {length} bytes; "
                       f"ask within bytes=0-{length - 1}", {"length": length},
                       headers={"Content-Range": f"bytes */{length}"}) from None
    start, end = span or (0, length)
    headers["Content-Length"] = str(end - start)
    status = 200
    if span is not None:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{length}"
    return StreamingResponse(started_body(store, body, start, end), status_code=status, media_type=body.media_type,
                             headers=headers)


@router.get("/versions/{ref}/tensors/{key}", summary="Download one tensor (.npy or safetensors)",
            response_class=Response, responses=_BINARY)  # type: ignore[arg-type]
def get_tensor(ref: str, key: str, format: Literal["npy", "safetensors"] = "npy",
               range: str | None = Header(None, max_length=256),
               if_none_match: str | None = Header(None, max_length=4096),
               if_range: str | None = Header(None, max_length=256),
               store: ds.Store = Depends(get_store)) -> Response:
    """The tensor's bytes, streamed chunk by chunk; `ETag` is the content hash, so a cached copy
    revalidates with `If-None-Match` (304), and `Range: bytes=a-b` gives 206 with that slice."""
    k = ref_param(key, "key")
    info = tensor_bytes_info(store, ref_param(ref), k)
    body = npy_body(info) if format == "npy" else safetensors_body([info], info.version)
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in k)  # letters of any script stay
    return _send(store, body, f"{safe}.{'npy' if format == 'npy' else 'safetensors'}", range, if_none_match,
                 if_range)


@router.get("/versions/{ref}/state", summary="Download several tensors as one safetensors file",
            response_class=Response, responses=_BINARY)  # type: ignore[arg-type]
def get_state(ref: str,
              keys: list[str] | None = Query(None, description="keys, prefixes or globs; repeat or comma-separate; "
                                                                "default: every tensor"),
              range: str | None = Header(None, max_length=256),
              if_none_match: str | None = Header(None, max_length=4096),
              if_range: str | None = Header(None, max_length=256),
              store: ds.Store = Depends(get_store)) -> Response:
    vid = store.resolve(ref_param(ref))
    wanted = [k for item in keys for k in item.split(",") if k] if keys else None
    selected = select_tensor_keys(store, vid, wanted)
    if len(selected) > MAX_STATE_KEYS:
        raise ds.InvalidArgumentError(f"{len(selected)} tensors selected; ask for at most {MAX_STATE_KEYS} at once")
    body = safetensors_body([tensor_bytes_info(store, vid, k) for k in selected], vid, tensor_paths(store, vid))
    return _send(store, body, f"{vid[:12]}.safetensors", range, if_none_match, if_range)


@router.get("/tensors/{key}/history", response_model=Page[HistoryRow], summary="A tensor's stats across versions")
def history(key: str, ref: str = Query("main", max_length=1024), limit: int = Limit,
            page_token: str | None = Token, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Stats along the first-parent chain of `ref`, oldest first; reads manifests, never tensor bytes."""
    k = ref_param(key, "key")
    # The token holds a position in the pinned version's first-parent chain (not a row offset; tokens of
    # row offsets were of kind "history"), so a page reads its own versions only, never the whole chain.
    vid, start = paging.pinned(page_token, "key-history", ref, k) or (store.resolve(ref_param(ref)), 0)
    rows, nxt = history_page(store.repo, k, vid, start, limit)
    return {"items": table_rows(rows), "next_page_token": paging.pinned_token("key-history", vid, nxt, ref, k)}
