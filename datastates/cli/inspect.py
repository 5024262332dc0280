"""Commands that read versions: log, show, ls, du, diff, find, history."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..base.config import human_bytes
from ..store import Store
from .arguments import positive
from .output import fmt, one_line, print_json, when, with_store


def register(sub: Any) -> None:
    s = sub.add_parser("log", help="versions reachable from a ref, newest first")
    s.add_argument("ref", nargs="?", default="main", help="where to start: branch, tag, id or REF~N (default main)")
    s.add_argument("-n", type=positive, default=None, help="at most N versions (N >= 1)")
    s.add_argument("--first-parent", action="store_true", help="follow only the first parent of merges")
    s.add_argument("--format", choices=("table", "json"), default="table", help="output format (default table)")
    s.add_argument("--json", action="store_const", const="json", dest="format", help="same as --format json")
    s.set_defaults(handler=_log)
    s = sub.add_parser("show", help="one version's record")
    s.add_argument("ref", nargs="?", default="main", help="branch, tag, id or REF~N (default main)")
    s.set_defaults(handler=_show)
    s = sub.add_parser("ls", help="tensors of a version: dtype, shape, bytes")
    s.add_argument("ref", nargs="?", default="main", help="branch, tag, id or REF~N (default main)")
    s.set_defaults(handler=_ls)
    s = sub.add_parser("du", help="bytes total vs unique")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(handler=_du)
    s = sub.add_parser("diff", help="tensor-by-tensor comparison of two versions")
    s.add_argument("a", help="the older version (ref)")
    s.add_argument("b", help="the newer version (ref)")
    s.add_argument("--keys", nargs="*", help="key paths or globs to compare")
    s.add_argument("--all", action="store_true", help="also list unchanged tensors")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(handler=_diff)
    s = sub.add_parser("find", help="versions matching a query, e.g. \"hparams.lr > 1e-3 and metrics.loss < 0.5\"")
    s.add_argument("query", nargs="?", default="", help="a query; empty selects every version")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--allow-missing", action="store_true",
                   help="read a field no version has as null instead of failing (typos then match nothing)")
    s.set_defaults(handler=_find)
    s = sub.add_parser("history", help="one tensor's stats across the first-parent chain")
    s.add_argument("key", help="the tensor's key path, e.g. model.fc.weight")
    s.add_argument("ref", nargs="?", default="main", help="where the chain ends (default main)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(handler=_history)


def _log(store: Store, args: argparse.Namespace) -> int:
    """One line per version: fixed columns (id, created, step, new bytes, metrics), then the message,
    then decorations (refs, `[pruned]`), so the columns never shift."""
    versions = store.log(args.ref, first_parent=args.first_parent, limit=args.n)
    if args.format == "json":
        print_json([v.record() | {"id": v.id, "metrics": v.metrics, "created_iso": when(v.created),
                                  "pruned": v.pruned} for v in versions])
        return 0
    heads: dict[str, list[str]] = {}
    for kind, refs in (("", store.branches()), ("tag: ", store.tags())):
        for name, vid in refs.items():
            heads.setdefault(vid, []).append(kind + name)
    for v in versions:
        deco = [f"({', '.join(heads[v.id])})"] if v.id in heads else []
        if v.pruned:
            deco.append("[pruned]")
        metrics = " ".join(f"{k}={val:.4g}" if isinstance(val, float) else f"{k}={val}"
                           for k, val in v.metrics.items())
        step = "-" if v.step is None else str(v.step)
        tail = "  ".join(x for x in (metrics, one_line(v.message), " ".join(deco)) if x)
        print(f"{v.short}  {when(v.created)}  {step:>8}  {human_bytes(v.bytes_new):>10}  {tail}".rstrip())
    graph = store.repo.graph
    followed = (lambda v: v.parents[:1]) if args.first_parent else (lambda v: v.parents)
    absent = [(v, p) for v in versions for p in followed(v) if not graph.has(p)]
    for v, p in absent:  # where the walk ended early, as git marks a shallow clone's boundary
        print(with_store(f"(history goes on past {v.short}: its parent {p} is not on this node; "
                         "`datastates fsck` says why)", args.store, getattr(args, "hot", None)))
    return 0


def _show(store: Store, args: argparse.Namespace) -> int:
    v = store.version(args.ref)
    print_json(v.record() | {"id": v.id, "created": when(v.created), "metrics": v.metrics, "pruned": v.pruned,
                             "annotations": v.annotations, "timings": v.timings})
    return 0


def _ls(store: Store, args: argparse.Namespace) -> int:
    infos = store.ls(args.ref)
    width = max((len(i.key) for i in infos), default=3)
    print(f"{'key':<{width}}  {'dtype':<14} {'shape':<20} {'bytes':>10}  {'l2':>10}")
    for i in infos:
        l2 = i.stats.get("l2")
        print(f"{i.key:<{width}}  {i.dtype:<14} {str(list(i.shape)):<20} {human_bytes(i.nbytes):>10}  "
              f"{'' if l2 is None else f'{l2:.4g}':>10}{'' if i.kind == 'tensor' else '  (' + i.kind + ')'}"
              f"{nonfinite(i.stats)}")
    _note_ranks(store, args.ref)
    return 0


def nonfinite(stats: dict[str, Any]) -> str:
    """'  (2 NaN, 1 inf)' for statistics that counted NaN or infinite values, else ''. The statistics are of the
    finite values: without it a diverged tensor ([1, nan, inf]) showed l2 1, min 1, max 1, as a healthy one."""
    parts = [f"{n} {name}" for name, n in (("NaN", stats.get("nan_count")), ("inf", stats.get("inf_count"))) if n]
    return f"  ({', '.join(parts)})" if parts else ""


def _du(store: Store, args: argparse.Namespace) -> int:
    d = store.du()
    if args.json:
        print_json(d)
        return 0
    ratio = d["bytes_total"] / d["bytes_unique"] if d["bytes_unique"] else 1.0
    pruned = sum(1 for p in store.versions_table().column("pruned").to_pylist() if p)
    print(f"versions      {d['versions']}{f' ({pruned} pruned)' if pruned else ''}")
    print(f"bytes total   {human_bytes(d['bytes_total'])}  (what the versions hold)")
    # After prune + gc, unique bytes shrink by deletion too: only call the ratio dedup when nothing was pruned.
    why = "dedup and pruning" if pruned else "dedup"
    print(f"bytes unique  {human_bytes(d['bytes_unique'])}  (distinct chunks; total/unique {ratio:.2f}x from {why})")
    print(f"on disk       {human_bytes(d['bytes_on_disk'])} in {d['packs']} packs")
    return 0


def _diff(store: Store, args: argparse.Namespace) -> int:
    rows = store.diff(args.a, args.b, keys=args.keys or None).to_pylist()
    if args.json:
        print_json(rows)
        return 0
    if not args.all:
        rows = [r for r in rows if r["status"] != "same"] or rows[:0]
    width = max((len(r["key"]) for r in rows), default=3)
    print(f"{'key':<{width}}  {'status':<22} {'l2 change':>10} {'relative':>10} {'cosine':>10} {'max abs':>10} "
          f"{'chunks shared':>14}")
    for r in rows:
        shared = "" if r["chunks_total"] is None else f"{r['chunks_shared']}/{r['chunks_total']}"
        print(f"{r['key']:<{width}}  {r['status']:<22} {fmt(r['l2_change'])} {fmt(r['rel_change'])} "
              f"{fmt(r['cosine'])} {fmt(r['max_abs_diff'])} {shared:>14}")
    if not rows:
        print("no tensor differs (use --all to list unchanged ones)")
    _note_ranks(store, args.a, args.b)
    return 0


def _note_ranks(store: Store, *refs: str) -> None:
    """On stderr, that a version of several ranks was read through rank 0's manifest: without it, a change to
    another rank's own entries read as no change."""
    for ref in refs:
        v = store.version(ref)
        if v.world_size > 1:
            print(f"note: {v.short} was saved by {v.world_size} ranks; this reads rank 0's manifest (its own entries "
                  "and the replicated ones); other ranks' own entries load with Store.load(ref, rank=R)",
                  file=sys.stderr)


def _find(store: Store, args: argparse.Namespace) -> int:
    table = store.find(args.query, as_table=True, allow_missing=args.allow_missing)
    if args.json:
        print_json(table.to_pylist())
        return 0
    metric_cols = [c for c in table.column_names if c.startswith(("metrics.", "hparams."))]
    for r in table.to_pylist():
        extras = "  ".join(f"{c}={fmt(r[c], 0).strip()}" for c in metric_cols if r[c] is not None)
        print(f"{r['id'][:12]}  step={r['step']}  branch={r['branch']}  {extras}")
    print(f"{table.num_rows} version(s)")
    return 0


def _history(store: Store, args: argparse.Namespace) -> int:
    rows = store.history(args.key, args.ref).to_pylist()
    if args.json:
        print_json(rows)
        return 0
    print(f"{'version':<12}  {'step':>6} {'l2':>10} {'mean':>10} {'std':>10} {'min':>10} {'max':>10} {'changed':>8}")
    for r in rows:
        print(f"{r['version'][:12]}  {fmt(r['step'], 6)} {fmt(r['l2'])} {fmt(r['mean'])} {fmt(r['std'])} "
              f"{fmt(r['min'])} {fmt(r['max'])} {fmt(r['chunks_changed'], 8)}{nonfinite(r)}")
    return 0
