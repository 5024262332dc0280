"""Commands about the tiers: tiers (usage, backlog), flush (copy pending versions to cold)."""

from __future__ import annotations

import argparse
from typing import Any

from ..base.config import human_bytes
from ..store import Store
from .arguments import seconds
from .output import print_json


def register(sub: Any) -> None:
    s = sub.add_parser("tiers", help="usage and flush backlog per tier")
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=_tiers)
    s = sub.add_parser("flush", help="copy pending versions to the cold tier and wait")
    s.add_argument("--timeout", type=seconds, default=None, help="give up after this many seconds of failures")
    s.set_defaults(handler=_flush)


def _tiers(store: Store, args: argparse.Namespace) -> int:
    rows = store.tiers_status()
    if args.json:
        print_json(rows)
        return 0
    if len(rows) == 1:
        print("this store has one tier (no --hot tier); nothing is flushed or evicted")
    for r in rows:
        cap = f" of {human_bytes(r['capacity'])}" if r.get("capacity") else ""
        state = "" if r["reachable"] else "  UNREACHABLE"
        print(f"{r['tier']:<5} {r['path']}  {human_bytes(r['bytes'])}{cap} in {r['packs']} packs{state}")
        if "backlog" in r:
            print(f"      flush backlog: {r['backlog']} version(s)"
                  f"{'; last error: ' + r['last_error'] if r['last_error'] else ''}")
            for c in r["conflicts"]:
                print(f"      conflict: {c}")
    return 0


def _flush(store: Store, args: argparse.Namespace) -> int:
    if store.flusher is None:
        print("this store has one tier; nothing to flush" if store.cold is None else
              "this store is open read-only (this user may not write it); nothing is flushed from here")
        return 0
    from ..base.progress import bar as progress_bar

    total = store.flusher.backlog
    with progress_bar(total, "flush", unit="version") as bar:
        done = False
        while not done:
            done = store.flush(timeout=0.5 if args.timeout is None else min(0.5, args.timeout))
            bar.update(total - store.flusher.backlog - bar.n)
            if args.timeout is not None and not done and store.flusher.failures:
                break
    left = store.flusher.backlog
    print(f"flushed; backlog {left}" if not left else f"backlog {left}: {store.flusher.last_error}")
    return 0 if not left else 1
