"""/graph: the version DAG laid out git-style for the lineage page (layout on the server, O(versions)),
and /versions/{ref}/where: the tiers holding a version."""

from __future__ import annotations

import threading
from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

import datastates as ds
from datastates.query.layout import layout

from .. import paging
from ..convert import finite
from ..deps import get_store, ref_param

router = APIRouter()

MAX_GRAPH_PAGE = 2000


class GraphParent(BaseModel):
    id: str
    row: int
    lane: int


class GraphRow(BaseModel):
    id: str
    row: int = Field(description="0 is the newest version shown")
    lane: int
    parents: list[GraphParent] = Field(description="parents among the versions shown")
    branch: str | None = None
    refs: list[str] = Field(description="branches whose head this is, then 'tag: NAME' for its tags")
    step: int | None = None
    created: float
    message: str = ""
    metric: float | None = Field(None, description="the value of the `color` field, if numeric")
    fork: bool = Field(description="a fork (PBT exploit): a new version made from another without a save")
    merge: bool = Field(description="more than one parent")
    pruned: bool = False


class GraphPage(BaseModel):
    items: list[GraphRow]
    next_page_token: str | None = None
    total: int = Field(description="versions in the whole graph (all pages)")
    lanes: int = Field(description="lanes the whole graph needs")


class Where(BaseModel):
    id: str
    tiers: list[str]


_CACHE: dict[tuple[int, str, str], tuple[list[dict[str, Any]], int]] = {}
_CACHE_LOCK = threading.Lock()


def _graph(store: ds.Store, query: str, color: str) -> tuple[list[dict[str, Any]], int]:
    table = store.versions_table()  # cached by the store until a version or ref changes
    key = (id(table), query, color)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    rows = store.find(query, as_table=True).sort_by([("created", "descending"), ("id", "descending")])
    ids: list[str] = rows.column("id").to_pylist()
    cols = {c: rows.column(c).to_pylist() for c in ("branch", "step", "created", "message", "fork_of", "pruned")}
    metric = rows.column(color).to_pylist() if color and color in rows.column_names else [None] * len(ids)
    graph = store.graph
    laid, width = layout([(vid, graph.parents(vid)) for vid in ids])
    heads: dict[str, list[str]] = {}
    for name, vid in sorted(store.branches().items()):
        heads.setdefault(vid, []).append(name)
    for name, vid in sorted(store.tags().items()):
        heads.setdefault(vid, []).append(f"tag: {name}")
    out = []
    for i, r in enumerate(laid):
        m = metric[i]
        out.append({
            "id": r.id, "row": r.row, "lane": r.lane,
            "parents": [{"id": p, "row": pr, "lane": pl} for p, pr, pl in r.parents],
            "branch": cols["branch"][i], "refs": heads.get(r.id, []), "step": cols["step"][i],
            "created": cols["created"][i], "message": cols["message"][i] or "",
            "metric": m if isinstance(m, (int, float)) and not isinstance(m, bool) else None,
            "fork": cols["fork_of"][i] is not None, "merge": len(graph.parents(r.id)) > 1,
            "pruned": bool(cols["pruned"][i]),
        })
    with _CACHE_LOCK:
        if len(_CACHE) > 16:
            _CACHE.clear()
        _CACHE[key] = (out, width)
    return out, width


@router.get("/graph", response_model=GraphPage, tags=["versions"], summary="The version DAG laid out in lanes")
def get_graph(filter: str = Query("", max_length=8192, description="query language; only matching versions"),
              color: str = Query("", max_length=256, description="a numeric field to color nodes by, "
                                                                 "e.g. metrics.loss"),
              limit: int = Query(500, ge=1, le=MAX_GRAPH_PAGE, description="rows per page"),
              page_token: str | None = Query(None, max_length=4096),
              store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Rows newest first, one lane per line of descent (as `git log --graph`), with each row's parents'
    rows and lanes so a client draws the edges. Pages are row ranges of one layout."""
    rows, width = _graph(store, filter, color)
    q = paging.digest("graph", filter, color)
    start = 0
    if page_token:
        tok = paging.decode_token(page_token, "graph", q=str, offset=int)
        if tok["q"] != q:
            raise ds.InvalidArgumentError("page_token belongs to another filter/color; repeat the same "
                                          "query parameters, or omit page_token")
        start = tok["offset"]
        if start < 0:
            raise ds.InvalidArgumentError("page_token is damaged; omit it to start at the first page")
    end = min(start + limit, len(rows))
    nxt = paging.encode_token({"k": "graph", "q": q, "offset": end}) if end < len(rows) else None
    return finite({"items": rows[start:end], "next_page_token": nxt, "total": len(rows), "lanes": width})


@router.get("/versions/{ref}/where", response_model=Where, tags=["versions"], summary="Tiers holding a version")
def get_where(ref: str, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    vid = store.resolve(ref_param(ref))
    return {"id": vid, "tiers": store.where(vid)}
