"""Load run of the REST server: 50 concurrent clients against a store of 10,000 versions.

    .venv/bin/python docs/examples/server_load.py --versions 10000 --clients 50 --requests 2000

Builds the store (small tensors) in a temp dir unless --store is given, starts `python -m server` on
127.0.0.1 (a free port), then runs two phases with httpx's async client, each `--requests` requests
spread over `--clients` concurrent clients: GET /versions/{ref} on random versions, and a paginated
GET /versions (limit=100, following next_page_token from random start pages). Prints p50/p99 latency
and throughput per phase. Figures are written in docs/benchmarks.md ("REST server").
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.server_proc import ServerProc  # noqa: E402

import datastates as ds  # noqa: E402


def build(path: Path, n: int) -> list[str]:
    ids = []
    with ds.Store.open(path) as s:
        for i in range(n):
            ids.append(s.save({"w": torch.full((8,), float(i))}, step=i,
                              hparams={"lr": 10 ** -(1 + i % 4)}, metrics={"loss": 1.0 / (i + 1)}).id)
    return ids


async def phase(api: str, clients: int, total: int, make: object) -> list[float]:
    lat: list[float] = []
    left = [total]

    async def worker(c: httpx.AsyncClient) -> None:
        while left[0] > 0:
            left[0] -= 1
            url, params = make()  # type: ignore[operator]
            t = time.perf_counter()
            r = await c.get(url, params=params)
            lat.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=api, timeout=120, limits=limits) as c:
        await asyncio.gather(*(worker(c) for _ in range(clients)))
    return lat


def report(name: str, lat: list[float], wall: float) -> None:
    q = statistics.quantiles(lat, n=100)
    print(f"{name:<28} n={len(lat):>5}  p50={q[49] * 1e3:7.1f} ms  p99={q[98] * 1e3:7.1f} ms  "
          f"{len(lat) / wall:7.1f} req/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--store", type=Path, default=None, help="reuse a store built by an earlier run")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    path = a.store or Path(tmp.name) / "store"
    t = time.perf_counter()
    if a.store is not None and a.store.exists():
        with ds.Store.open(path, create=False) as s:
            ids = [v.id for v in s.log("main")]
    else:
        ids = build(path, a.versions)
    print(f"store of {len(ids)} versions ready in {time.perf_counter() - t:.1f} s")
    with ServerProc(path) as srv:
        with httpx.Client(base_url=srv.api, timeout=120) as c:  # the page tokens to start from
            tokens: list[str | None] = [None]
            body = c.get("/versions", params={"limit": 100}).json()
            while body["next_page_token"] and len(tokens) < 100:
                tokens.append(body["next_page_token"])
                body = c.get("/versions", params={"limit": 100, "page_token": body["next_page_token"]}).json()
        rng = random.Random(0)
        for name, make in (
            ("GET /versions/{ref}", lambda: (f"/versions/{rng.choice(ids)}", {})),
            ("GET /versions (page of 100)", lambda: ("/versions", {"limit": 100, **(
                {"page_token": tok} if (tok := rng.choice(tokens)) else {})})),
        ):
            t = time.perf_counter()
            lat = asyncio.run(phase(srv.api, a.clients, a.requests, make))
            report(name, lat, time.perf_counter() - t)


if __name__ == "__main__":
    main()
