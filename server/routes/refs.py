"""/branches and /tags: list, get, create, move (compare-and-swap), delete."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Response

import datastates as ds
from datastates.tensor_bytes import move_branch

from .. import paging
from ..deps import body_ref, get_store, ref_param, require_write
from ..models import BranchCreate, BranchMove, Page, RefOut, TagCreate

router = APIRouter()

Limit = Query(paging.DEFAULT_LIMIT, ge=1, le=paging.MAX_LIMIT, description="items per page (at most 1000)")
Token = Query(None, max_length=4096, description="next_page_token of the previous page")


def _page(refs: dict[str, str], kind: str, limit: int, page_token: str | None) -> dict[str, Any]:
    """Names in order; the token holds the last name, so refs created meanwhile never repeat a row."""
    names = sorted(refs)
    if page_token:
        after = paging.decode_token(page_token, kind, after=str)["after"]
        names = [n for n in names if n > after]
    page = names[:limit]
    nxt = paging.encode_token({"k": kind, "after": page[-1]}) if len(names) > limit else None
    return {"items": [{"name": n, "id": refs[n]} for n in page], "next_page_token": nxt}


def _one(store: ds.Store, refs: dict[str, str], kind: str, name: str) -> dict[str, Any]:
    if name not in refs:
        # A ref whose file is damaged is in no listing: say so (IntegrityError), as the other routes do,
        # rather than that it does not exist.
        try:
            store.resolve(f"{kind}:{name}")
        except ds.NotFoundError:
            pass
        raise ds.NotFoundError(f"{kind} {name!r} does not exist; GET /api/v1/{kind}es lists them"
                               if kind == "branch" else f"tag {name!r} does not exist; GET /api/v1/tags lists them")
    return {"name": name, "id": refs[name]}


@router.get("/branches", response_model=Page[RefOut], tags=["branches"], summary="List branches")
def list_branches(limit: int = Limit, page_token: str | None = Token,
                  store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    return _page(store.branches(), "branches", limit, page_token)


@router.post("/branches", response_model=RefOut, status_code=201, tags=["branches"], summary="Create a branch",
             dependencies=[Depends(require_write)])
def create_branch(body: BranchCreate, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """409 if it exists (move it with PUT)."""
    vid = store.branch(body_ref(body.name, "branch"), at=body_ref(body.at))
    return {"name": body.name, "id": vid}


@router.get("/branches/{name}", response_model=RefOut, tags=["branches"], summary="One branch")
def get_branch(name: str, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    return _one(store, store.branches(), "branch", ref_param(name, "branch"))


@router.put("/branches/{name}", response_model=RefOut, tags=["branches"], summary="Move a branch (compare-and-swap)",
            dependencies=[Depends(require_write)])
def put_branch(name: str, body: BranchMove, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Points the branch at `to` only if it points at `expected` now; 409 (nothing changes) otherwise."""
    n = ref_param(name, "branch")
    return {"name": n, "id": move_branch(store, n, body_ref(body.to), body.expected)}


@router.delete("/branches/{name}", status_code=204, tags=["branches"], summary="Delete a branch",
               dependencies=[Depends(require_write)])
def delete_branch(name: str, store: ds.Store = Depends(get_store)) -> Response:
    store.delete_branch(ref_param(name, "branch"))
    return Response(status_code=204)


@router.get("/tags", response_model=Page[RefOut], tags=["tags"], summary="List tags")
def list_tags(limit: int = Limit, page_token: str | None = Token,
              store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    return _page(store.tags(), "tags", limit, page_token)


@router.post("/tags", response_model=RefOut, status_code=201, tags=["tags"], summary="Create a tag",
             dependencies=[Depends(require_write)])
def create_tag(body: TagCreate, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    """Tags never move: 409 if it exists (delete it first)."""
    vid = store.tag(body_ref(body.name, "tag"), body_ref(body.ref), body.message)
    return {"name": body.name, "id": vid}


@router.get("/tags/{name}", response_model=RefOut, tags=["tags"], summary="One tag")
def get_tag(name: str, store: ds.Store = Depends(get_store)) -> dict[str, Any]:
    return _one(store, store.tags(), "tag", ref_param(name, "tag"))


@router.delete("/tags/{name}", status_code=204, tags=["tags"], summary="Delete a tag",
               dependencies=[Depends(require_write)])
def delete_tag(name: str, store: ds.Store = Depends(get_store)) -> Response:
    store.delete_tag(ref_param(name, "tag"))
    return Response(status_code=204)
