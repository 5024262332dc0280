"""/versions: listing with a filter and cursor, one version, its lineage, merge bases, diffs, annotations."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from fastapi import APIRouter, Body, Depends, Query

import datastates as ds
from datastates.query.language import parse as parse_query

from .. import paging
from ..convert import table_rows, version_dict
from ..deps import get_store, ref_param, require_write
from ..models import DiffRow, MergeBaseOut, Page, VersionOut

router = APIRouter(tags=["versions"])

Limit = Query(paging.DEFAULT_LIMIT, ge=1, le=paging.MAX_LIMIT, description="items per page (at most 1000)")
Token = Query(None, max_length=4096, description="next_page_token of the previous page")


@router.get("/versions", response_model=Page[VersionOut], summary="List versions")
def list_versions(filter: str = Query("", max_length=8192, description="query, e.g. metrics.loss < 0.1"),
                  branch: str | None = Query(None, max_length=1024,
                                             description="only this ref and its ancestors (like git log)"),
                  order_by: str | None = Query(None, max_length=256,
                                               description="FIELD, -FIELD or 'FIELD desc'; default -created"),
                  limit: int = Limit, page_token: str | None = Token,
                  allow_missing: bool = Query(False, description="read a field no version has as null instead "
                                              "of refusing it as a typo (as store.find's allow_missing)"),
                  store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Versions matching `filter` (the query language of `store.find`), sorted by the filter's own `order by` (one
    field) or else `order_by`, then id, one page at a time. Tokens stay valid while versions are added: no row is
    repeated or skipped."""
    table = store.find(filter, as_table=True, allow_missing=allow_missing)
    if branch is not None:
        head = store.resolve(ref_param(branch, "branch"))
        ids = pa.array([head, *store.ancestors(head)], pa.string())
        table = table.filter(pc.is_in(table.column("id"), value_set=ids))
    own = parse_query(filter).order_by  # (parsed by find above: no error here)
    if own:
        # The filter's own 'order by' is the order asked for: re-sorted by the default, `order by step desc limit 3`
        # came back oldest first (a review).
        if order_by:
            raise ds.InvalidArgumentError("the filter has its own 'order by' and order_by= is given too; give one")
        if len(own) > 1:
            raise ds.InvalidArgumentError("the filter's 'order by' names several fields and pages are sorted by one; "
                                          "keep one field (then ties go by id)")
        order_by = ("-" if own[0][1] else "") + own[0][0]
    column, desc = paging.parse_order(order_by, table)
    q = paging.digest(filter, branch, column, desc)
    after = None
    if page_token:
        tok = paging.decode_token(page_token, "versions", q=str, key=paging.SCALAR, id=str)
        if tok["q"] != q:
            raise ds.InvalidArgumentError("page_token belongs to another filter/branch/order_by; "
                                          "repeat the same query parameters, or omit page_token")
        after = (tok["key"], tok["id"])
    ids_page, last = paging.keyset_page(table, column, desc, after, limit)
    nxt = None if last is None else paging.encode_token({"k": "versions", "q": q, "key": last[0], "id": last[1]})
    return {"items": [version_dict(store.version(v)) for v in ids_page], "next_page_token": nxt}


@router.get("/versions/{ref}", response_model=VersionOut, summary="One version")
def get_version(ref: str, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    return version_dict(store.version(ref_param(ref)))


def _pinned(store: ds.Store, ref: str, page_token: str | None, kind: str, *extra: Any) -> tuple[str, int]:
    """(version id, offset): from the token, else `ref` resolved now and 0."""
    return paging.pinned(page_token, kind, ref, *extra) or (store.resolve(ref_param(ref)), 0)


def _next(kind: str, ref: str, vid: str, offset: int | None, *extra: Any) -> str | None:
    return paging.pinned_token(kind, vid, offset, ref, *extra)


@router.get("/versions/{ref}/ancestors", response_model=Page[str], summary="Ancestor ids, newest first")
def ancestors(ref: str, depth: int | None = Query(None, ge=0, le=1_000_000),
              first_parent: bool = False, limit: int = Limit, page_token: str | None = Token,
              store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    vid, start = _pinned(store, ref, page_token, "ancestors", depth, first_parent)
    items, nxt = paging.offset_page(store.ancestors(vid, depth=depth, first_parent=first_parent), start, limit)
    return {"items": items, "next_page_token": _next("ancestors", ref, vid, nxt, depth, first_parent)}


@router.get("/versions/{ref}/descendants", response_model=Page[str], summary="Descendant ids, oldest first")
def descendants(ref: str, depth: int | None = Query(None, ge=0, le=1_000_000),
                limit: int = Limit, page_token: str | None = Token,
                store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    vid, start = _pinned(store, ref, page_token, "descendants", depth)
    items, nxt = paging.offset_page(store.descendants(vid, depth=depth), start, limit)
    return {"items": items, "next_page_token": _next("descendants", ref, vid, nxt, depth)}


@router.get("/versions/{a}/merge-base/{b}", response_model=MergeBaseOut, summary="Nearest common ancestor")
def merge_base(a: str, b: str, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    return {"merge_base": store.merge_base(ref_param(a), ref_param(b))}


@router.get("/versions/{a}/diff/{b}", response_model=Page[DiffRow], summary="Tensor-by-tensor comparison")
def diff(a: str, b: str,
         keys: list[str] | None = Query(None, description="key paths or globs; repeat or comma-separate"),
         limit: int = Limit, page_token: str | None = Token,
         store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    wanted = [k for item in keys for k in item.split(",") if k] if keys else None
    ida, start = _pinned(store, a, page_token, "diff", b, wanted)
    idb = paging.decode_token(page_token, "diff", w=str)["w"] if page_token else store.resolve(ref_param(b))
    rows = table_rows(store.diff(ida, idb, keys=wanted))
    items, nxt = paging.offset_page(rows, start, limit)
    return {"items": items, "next_page_token": paging.pinned_token("diff", ida, nxt, a, b, wanted, w=idb)}


@router.post("/versions/{ref}/annotations", response_model=VersionOut, summary="Add or change annotations",
             dependencies=[Depends(require_write)])
def annotate(ref: str, values: dict[str, Any] = Body(..., description="e.g. {\"metrics\": {\"val_acc\": 0.91}}"),
             store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Mutable annotations (never part of the id), as `store.annotate(ref, **values)`."""
    if not values:
        raise ds.InvalidArgumentError("the body names no annotation; send e.g. {\"metrics\": {\"val_acc\": 0.91}}")
    return version_dict(store.annotate(ref_param(ref), **values))
