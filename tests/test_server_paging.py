"""Cursor paging over a real uvicorn: walking every page yields each version exactly once, also while
versions are being saved between the page requests."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from helpers.server_proc import ServerProc

import datastates as ds


def _fill(path: Path, n: int) -> list[str]:
    with ds.Store.open(path) as s:
        return [s.save({"w": torch.full((4,), float(i))}, step=i, metrics={"loss": 1.0 / (i + 1)}).id
                for i in range(n)]


def _walk_saving(api: str, store: ds.Store, order_by: str | None, limit: int) -> tuple[list[str], list[str]]:
    """Every page of /versions; after each page one more version is saved, so the set grows mid-walk.
    Returns (the ids walked, the ids saved during the walk)."""
    walked: list[str] = []
    added: list[str] = []
    token = None
    with httpx.Client(base_url=api, timeout=60) as c:
        while True:
            params: dict[str, str | int] = {"limit": limit}
            if order_by:
                params["order_by"] = order_by
            if token:
                params["page_token"] = token
            r = c.get("/versions", params=params)
            assert r.status_code == 200, r.text
            body = r.json()
            walked += [v["id"] for v in body["items"]]
            added.append(store.save({"w": torch.zeros(4)}, step=10**6 + len(added)).id)
            token = body["next_page_token"]
            if token is None:
                return walked, added


@pytest.mark.parametrize("n", [
    400, pytest.param(2500, marks=pytest.mark.slow, id="sample-2500")])
def test_walking_every_page_while_saving_yields_each_version_once(tmp_path: Path, n: int) -> None:
    before = _fill(tmp_path / "s", n)
    with ServerProc(tmp_path / "s") as srv, ds.Store.open(tmp_path / "s", create=False) as store:
        newest_first, added = _walk_saving(srv.api, store, None, 97)
        # Newest first: versions saved during the walk sort before the cursor and are not shown.
        assert len(newest_first) == len(set(newest_first)) == n
        assert set(newest_first) == set(before) and newest_first[0] == before[-1]
        oldest_first, added2 = _walk_saving(srv.api, store, "created", 97)
        # Oldest first: versions saved during the walk sort after the cursor and are all shown, once.
        assert len(oldest_first) == len(set(oldest_first))
        assert oldest_first[:n] == before
        assert set(oldest_first[n:]) <= set(added + added2) and set(added) <= set(oldest_first)
