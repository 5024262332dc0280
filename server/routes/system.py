"""/healthz, /metrics and /populations/{name}/tree."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import PlainTextResponse

import datastates as ds
from datastates.pbt import Population

from .. import paging
from ..convert import table_rows
from ..deps import get_store, ref_param
from ..models import Health, Page, TreeEdge

router = APIRouter()


@router.get("/healthz", response_model=Health, tags=["system"], summary="Liveness and store reachability")
def healthz(store: ds.Store = Depends(get_store)) -> dict[str, Any]:
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
    pops: dict[str, Population] = request.app.state.populations
    pop = pops.get(pop_name)
    if pop is None or len(pop.members) < len(members):
        # One object per name and worker: Population registers itself for retention, so no new one per request.
        pop = pops[pop_name] = Population(store, pop_name, size=max(2, len(members)))
    rows = table_rows(pop.family_tree())
    start = int(paging.decode_token(page_token, "tree").get("o", 0)) if page_token else 0
    items, nxt = paging.offset_page(rows, start, limit)
    return {"items": items, "next_page_token": None if nxt is None else paging.encode_token({"k": "tree", "o": nxt})}
