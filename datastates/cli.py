"""The `datastates` command line. The store comes from --store PATH or $DATASTATES_STORE."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .config import human_bytes
from .errors import DataStatesError
from .store import Store

_COMMANDS: dict[str, Callable[[Store, argparse.Namespace], int]] = {}


Handler = Callable[[Store, argparse.Namespace], int]


def _command(name: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        _COMMANDS[name] = fn
        return fn
    return deco


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


@_command("init")
def _init(store: Store, args: argparse.Namespace) -> int:
    print(f"store ready at {store.path}")
    return 0


@_command("log")
def _log(store: Store, args: argparse.Namespace) -> int:
    versions = store.log(args.ref, first_parent=args.first_parent, limit=args.n)
    if args.json:
        _print_json([v.record() | {"id": v.id} for v in versions])
        return 0
    heads: dict[str, list[str]] = {}
    for kind, refs in (("", store.branches()), ("tag: ", store.tags())):
        for name, vid in refs.items():
            heads.setdefault(vid, []).append(kind + name)
    for v in versions:
        deco = f" ({', '.join(heads[v.id])})" if v.id in heads else ""
        metrics = " ".join(f"{k}={val:.4g}" if isinstance(val, float) else f"{k}={val}" for k, val in v.metrics.items())
        print(f"{v.short}{deco}  step={v.step}  {_when(v.created)}  new={human_bytes(v.bytes_new)}  {metrics}"
              f"{'  ' + v.message if v.message else ''}")
    return 0


@_command("show")
def _show(store: Store, args: argparse.Namespace) -> int:
    v = store.version(args.ref)
    _print_json(v.record() | {"id": v.id, "annotations": v.annotations, "timings": v.timings})
    return 0


@_command("ls")
def _ls(store: Store, args: argparse.Namespace) -> int:
    infos = store.ls(args.ref)
    width = max((len(i.key) for i in infos), default=3)
    print(f"{'key':<{width}}  {'dtype':<14} {'shape':<20} {'bytes':>10}  {'l2':>10}")
    for i in infos:
        l2 = i.stats.get("l2")
        print(f"{i.key:<{width}}  {i.dtype:<14} {str(list(i.shape)):<20} {human_bytes(i.nbytes):>10}  "
              f"{'' if l2 is None else f'{l2:.4g}':>10}{'' if i.kind == 'tensor' else '  (' + i.kind + ')'}")
    return 0


def _refs(kind: str) -> Handler:
    """`datastates tag` / `branch`: list, create (`NAME [REF]`) or delete (`-d NAME`)."""

    def handler(store: Store, args: argparse.Namespace) -> int:
        if args.delete:
            (store.delete_tag if kind == "tag" else store.delete_branch)(args.delete)
        elif args.name:
            if kind == "tag":
                vid = store.tag(args.name, args.ref, args.message or "")
            else:
                vid = store.branch(args.name, at=args.ref, force=args.force)
            print(f"{kind} {args.name} -> {vid[:12]}")
        else:
            for name, vid in (store.tags() if kind == "tag" else store.branches()).items():
                print(f"{name}\t{vid[:12]}")
        return 0

    return handler


_COMMANDS["tag"] = _refs("tag")
_COMMANDS["branch"] = _refs("branch")


@_command("du")
def _du(store: Store, args: argparse.Namespace) -> int:
    d = store.du()
    if args.json:
        _print_json(d)
        return 0
    ratio = d["bytes_total"] / d["bytes_unique"] if d["bytes_unique"] else 1.0
    print(f"versions      {d['versions']}")
    print(f"bytes total   {human_bytes(d['bytes_total'])}  (what the versions hold)")
    print(f"bytes unique  {human_bytes(d['bytes_unique'])}  (distinct chunks; dedup {ratio:.2f}x)")
    print(f"on disk       {human_bytes(d['bytes_on_disk'])} in {d['packs']} packs")
    return 0


@_command("fsck")
def _fsck(store: Store, args: argparse.Namespace) -> int:
    rep = store.fsck(repair=args.repair, rebuild=args.rebuild)
    if args.json:
        _print_json(rep.to_dict())
    else:
        for line in rep.repaired:
            print(f"repaired: {line}")
        for line in rep.problems:
            print(f"problem:  {line}")
        for line in rep.notes:
            print(f"note:     {line}")
        counts = ", ".join(f"{n} {k}" for k, n in rep.checked.items())
        print(f"{'ok' if rep.ok else 'NOT OK'}: checked {counts}")
    return 0 if rep.ok else 1


def _fmt(x: Any, width: int = 10) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.4g}"
    return f"{x!s:>{width}}"


@_command("diff")
def _diff(store: Store, args: argparse.Namespace) -> int:
    rows = store.diff(args.a, args.b, keys=args.keys or None).to_pylist()
    if args.json:
        _print_json(rows)
        return 0
    if not args.all:
        rows = [r for r in rows if r["status"] != "same"] or rows[:0]
    width = max((len(r["key"]) for r in rows), default=3)
    print(f"{'key':<{width}}  {'status':<22} {'l2 change':>10} {'relative':>10} {'cosine':>10} {'max abs':>10} "
          f"{'chunks shared':>14}")
    for r in rows:
        shared = "" if r["chunks_total"] is None else f"{r['chunks_shared']}/{r['chunks_total']}"
        print(f"{r['key']:<{width}}  {r['status']:<22} {_fmt(r['l2_change'])} {_fmt(r['rel_change'])} "
              f"{_fmt(r['cosine'])} {_fmt(r['max_abs_diff'])} {shared:>14}")
    if not rows:
        print("no tensor differs (use --all to list unchanged ones)")
    return 0


@_command("find")
def _find(store: Store, args: argparse.Namespace) -> int:
    table = store.find(args.query, as_table=True)
    if args.json:
        _print_json(table.to_pylist())
        return 0
    metric_cols = [c for c in table.column_names if c.startswith(("metrics.", "hparams."))]
    for r in table.to_pylist():
        extras = "  ".join(f"{c}={_fmt(r[c], 0).strip()}" for c in metric_cols if r[c] is not None)
        print(f"{r['id'][:12]}  step={r['step']}  branch={r['branch']}  {extras}")
    print(f"{table.num_rows} version(s)")
    return 0


@_command("history")
def _history(store: Store, args: argparse.Namespace) -> int:
    rows = store.history(args.key, args.ref).to_pylist()
    if args.json:
        _print_json(rows)
        return 0
    print(f"{'version':<12}  {'step':>6} {'l2':>10} {'mean':>10} {'std':>10} {'min':>10} {'max':>10} {'changed':>8}")
    for r in rows:
        print(f"{r['version'][:12]}  {_fmt(r['step'], 6)} {_fmt(r['l2'])} {_fmt(r['mean'])} {_fmt(r['std'])} "
              f"{_fmt(r['min'])} {_fmt(r['max'])} {_fmt(r['chunks_changed'], 8)}")
    return 0


@_command("tiers")
def _tiers(store: Store, args: argparse.Namespace) -> int:
    rows = store.tiers_status()
    if args.json:
        _print_json(rows)
        return 0
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


@_command("flush")
def _flush(store: Store, args: argparse.Namespace) -> int:
    if store.flusher is None:
        print("this store has one tier; nothing to flush")
        return 0
    from .progress import bar as progress_bar

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datastates", description="A versioned model-state store for PyTorch.")
    p.add_argument("--store", default=os.environ.get("DATASTATES_STORE"),
                   help="store directory (default: $DATASTATES_STORE)")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        # `datastates log --store PATH` works as well as `datastates --store PATH log`.
        s = add(name, **kw)
        if name != "bench":  # bench's --store is its scratch directory, never a user's store
            s.add_argument("--store", default=argparse.SUPPRESS, help="store directory (default: $DATASTATES_STORE)")
        return s

    sub.add_parser = add_parser  # type: ignore[method-assign]
    sub.add_parser("init", help="create a store")
    s = sub.add_parser("log", help="versions reachable from a ref, newest first")
    s.add_argument("ref", nargs="?", default="main")
    s.add_argument("-n", type=int, default=None, help="at most N versions")
    s.add_argument("--first-parent", action="store_true")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("show", help="one version's record")
    s.add_argument("ref", nargs="?", default="main")
    s = sub.add_parser("ls", help="tensors of a version: dtype, shape, bytes")
    s.add_argument("ref", nargs="?", default="main")
    for name in ("tag", "branch"):
        s = sub.add_parser(name, help=f"list, create or delete {name}{'es' if name == 'branch' else 's'}")
        s.add_argument("name", nargs="?")
        s.add_argument("ref", nargs="?", default="main")
        s.add_argument("-d", "--delete", metavar="NAME")
        if name == "tag":
            s.add_argument("-m", "--message")
        else:
            s.add_argument("-f", "--force", action="store_true")
    s = sub.add_parser("du", help="bytes total vs unique")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("fsck", help="verify every chunk, manifest, record and ref")
    s.add_argument("--repair", action="store_true", help="remove leftovers of interrupted saves")
    s.add_argument("--rebuild", action="store_true", help="rebuild the catalog from the files")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("diff", help="tensor-by-tensor comparison of two versions")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--keys", nargs="*", help="key paths or globs to compare")
    s.add_argument("--all", action="store_true", help="also list unchanged tensors")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("find", help="versions matching a query, e.g. \"hparams.lr > 1e-3 and metrics.loss < 0.5\"")
    s.add_argument("query", nargs="?", default="")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("history", help="one tensor's stats across the first-parent chain")
    s.add_argument("key")
    s.add_argument("ref", nargs="?", default="main")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("tiers", help="usage and flush backlog per tier")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("flush", help="copy pending versions to the cold tier and wait")
    s.add_argument("--timeout", type=float, default=None, help="give up after this many seconds of failures")
    s = sub.add_parser("demo", help="train a small model, saving into a local store, then print the log")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--every", type=int, default=20)
    from .bench import add_parser as add_bench_parser
    from .gc import add_parsers as add_gc_parsers

    add_bench_parser(sub)
    add_gc_parsers(sub)
    return p


def _register_gc() -> None:
    from .gc import COMMANDS, run

    for name in COMMANDS:
        _COMMANDS[name] = run


_register_gc()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 and a one-line message for a DataStates error)."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `datastates log | head` ends quietly
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args.store or "runs/demo-store", steps=args.steps, every=args.every)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(args)
    if not args.store:
        print("datastates: no store given; pass --store PATH or set DATASTATES_STORE", file=sys.stderr)
        return 2
    try:
        store = Store.open(args.store, create=args.command == "init")
        try:
            return _COMMANDS[args.command](store, args)
        finally:
            store.close()
    except DataStatesError as exc:
        print(f"datastates: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
