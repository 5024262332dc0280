"""/healthz, /metrics and /populations/{name}/tree."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse

import datastates as ds
from datastates.pbt import family_tree

from .. import paging
from ..convert import table_rows
from ..deps import get_store, ref_param
from ..models import Health, Page, TreeEdge

router = APIRouter()


@router.get("/healthz", response_model=Health, tags=["system"], summary="Liveness and store reachability")
def healthz(store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """ok with the version count, or 503 when the store's files are gone from under the server, as every route
    answers then (the version count comes from a cached table, which would go on answering)."""
    return {"status": "ok", "versions": len(store.versions_table())}


@router.get("/metrics", response_class=PlainTextResponse, tags=["system"], summary="Prometheus metrics")
def metrics(request: Request, store: ds.Store = Depends(get_store)) -> PlainTextResponse:
    du = store.du()
    gauges = {
        "datastates_store_versions": ("Versions in the store.", float(du.get("versions", 0))),
        "datastates_store_bytes_total": ("Raw bytes of every version's tensors.", float(du.get("bytes_total", 0))),
        "datastates_store_bytes_unique": ("Bytes of the distinct chunks.", float(du.get("bytes_unique", 0))),
        "datastates_store_branches": ("Branches.", float(len(store.branches()))),
        "datastates_store_tags": ("Tags.", float(len(store.tags()))),
    }
    return PlainTextResponse(request.app.state.metrics.render(gauges),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/populations/{name}/tree", response_model=Page[TreeEdge], tags=["populations"],
            summary="The family tree of a PBT population")
def population_tree(request: Request, name: str, limit: int = Query(paging.DEFAULT_LIMIT, ge=1, le=paging.MAX_LIMIT),
                    page_token: str | None = Query(None, max_length=4096),
                    store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Edges (child, parent, kind 'parent' or 'fork', member, step, explore) of every version saved on a
    member branch `<name>/member-NN`."""
    pop_name = ref_param(name, "population")
    prefix = f"{pop_name}/"
    members = [b for b in store.branches() if b.startswith(prefix)]
    if not members:
        raise ds.NotFoundError(f"population {pop_name!r} has no member branch ({prefix}member-NN); "
                               "GET /api/v1/branches lists the branches")
    # Not through a Population: making one takes the population's lease, which the trainer holds.
    rows = table_rows(family_tree(store, pop_name))
    start = 0
    if page_token:
        tok = paging.decode_token(page_token, "tree", q=str, o=int)
        if tok["q"] != paging.digest(pop_name):
            raise ds.InvalidArgumentError("page_token belongs to another population's tree; omit it to start over")
        start = tok["o"]
    items, nxt = paging.offset_page(rows, start, limit)
    token = None if nxt is None else paging.encode_token({"k": "tree", "q": paging.digest(pop_name), "o": nxt})
    return {"items": items, "next_page_token": token}
