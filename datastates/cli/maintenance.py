"""Commands that check and reclaim: init, fsck, prune, gc."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..base.config import human_bytes
from ..errors import CatalogDamagedError
from ..maintenance.gc import COLD_GRACE_S
from ..maintenance.retention import Retention
from ..repo.opening import quarantine_catalog
from ..store import Store
from .arguments import fraction, positive, seconds, whole
from .output import print_json, with_store


def register(sub: Any) -> None:
    s = sub.add_parser("init", help="create a store")
    s.set_defaults(handler=_init, creates=True)
    s = sub.add_parser(
        "fsck", help="verify every chunk, manifest, record, annotation and ref on every tier",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=FSCK_HELP)
    s.add_argument("--repair", action="store_true",
                   help="restore damaged copies from a good copy on another tier, move what cannot be "
                        "restored to quarantine/, remove leftovers of interrupted saves; never deletes a version")
    s.add_argument("--rebuild", action="store_true", help="rebuild the catalog from the version records")
    s.add_argument("--json", action="store_true")
    s.set_defaults(standalone=_fsck_standalone)
    _add_gc_prune(sub)


def _init(store: Store, args: argparse.Namespace) -> int:
    print(f"store ready at {store.path}")
    return 0


FSCK_HELP = """\
Checks, on every tier (hot and cold), without changing anything:
  version records   blake3 of the file == the version id; the catalog's copy likewise
  manifests         blake3 of the file == the manifest id
  packs             every chunk's blake3 == its id
  annotations       the checksum stored in the file (files written before checksums: JSON only)
  refs              each branch/tag file holds one version id, of a version that exists
  catalog           the LMDB file is as long as its meta page says
Each problem names the file and the tier that holds the damage.

--repair only restores, never guesses: a damaged copy is rewritten from a copy on another tier
whose hash matches; a damaged file with no good copy is moved to quarantine/ (a line in
quarantine/report.jsonl says file, reason, time) and its version is marked damaged (loading it
says so); versions are never removed. A truncated catalog is moved to quarantine/ and rebuilt
from the records. Leftovers of interrupted saves (temp files, packs and manifests no version
names) are removed."""


def _fsck_standalone(args: argparse.Namespace) -> int:
    if not getattr(args, "store", None):
        print("datastates: no store given; pass --store PATH or set DATASTATES_STORE", file=sys.stderr)
        return 2
    try:
        store = Store.open(args.store, create=False, hot=getattr(args, "hot", None),
                           record_tiers=False)
    except CatalogDamagedError as exc:
        if not (args.repair or args.rebuild):  # --rebuild too: the hint of a damaged catalog value names it
            raise
        moved = quarantine_catalog(args.store, getattr(args, "hot", None))
        print(f"repaired: {exc}; moved it to {moved} and rebuilt it from the version records")
        store = Store.open(args.store, create=False, hot=getattr(args, "hot", None),
                           record_tiers=False)
    try:
        return _fsck(store, args)
    finally:
        store.close()


def _fsck(store: Store, args: argparse.Namespace) -> int:
    rep = store.fsck(repair=args.repair, rebuild=args.rebuild)
    if args.json:
        print_json(rep.to_dict())
    else:
        for label, lines in (("repaired:", rep.repaired), ("problem: ", rep.problems), ("note:    ", rep.notes)):
            for line in lines:
                print(f"{label} {with_store(line, args.store, getattr(args, 'hot', None))}")
        counts = ", ".join(f"{n} {k}" for k, n in rep.checked.items())
        print(f"{'ok' if rep.ok else 'NOT OK'}: checked {counts}")
    return 0 if rep.ok else 1


"""The subcommands `add_parsers` adds; `run` handles both."""


def _best(text: str) -> tuple[int, str, str]:
    parts = text.split(":")
    if len(parts) > 3 or not parts[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: give N, N:METRIC or N:METRIC:min|max")
    n = whole(parts[0])
    if len(parts) > 1 and not parts[1]:  # '2::max' read as the default metric would rank by the wrong one
        raise argparse.ArgumentTypeError(f"{text!r}: the metric is empty; give N:METRIC[:min|max], "
                                         "e.g. 2:metrics.val_loss:min")
    metric = parts[1] if len(parts) > 1 else "metrics.val_loss"
    mode = parts[2] if len(parts) > 2 else "min"
    if mode not in ("min", "max"):
        raise argparse.ArgumentTypeError(f"{text!r}: the mode must be min or max, not {mode!r}")
    return n, metric, mode


def _add_gc_prune(sub: Any) -> None:
    s = sub.add_parser("gc", help="free the bytes of pruned versions: delete dead packs, repack sparse ones")
    s.add_argument("--dry-run", action="store_true", help="say what would be freed; change nothing")
    s.add_argument("--repack-threshold", type=fraction, default=0.5, metavar="F",
                   help="repack a pack whose live bytes are under this share of its bytes (default 0.5)")
    s.add_argument("--cold-grace", type=seconds, default=COLD_GRACE_S, metavar="SECONDS",
                   help=f"leave cold packs younger than this alone (default {COLD_GRACE_S:.0f})")
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=_run_gc)
    s = sub.add_parser("prune", help="mark versions pruned unless a --keep rule (or a tag, or a branch head) keeps "
                                     "them; `gc` then frees their bytes")
    s.add_argument("--keep-latest", type=whole, metavar="N", help="keep the N newest versions of each branch")
    s.add_argument("--keep-best", type=_best, action="append", default=[], metavar="N[:METRIC[:min|max]]",
                   help="keep the N best by a metric (default metrics.val_loss, min); repeatable")
    s.add_argument("--keep-every", type=positive, metavar="N", help="keep versions whose step is a multiple of N")
    s.add_argument("--dry-run", action="store_true", help="list what would be pruned; change nothing")
    s.add_argument("--json", action="store_true")
    s.set_defaults(handler=_run_prune)


def retention_from_args(args: argparse.Namespace) -> Retention | None:
    """The Retention the `prune` arguments describe, or None when they name no --keep rule."""
    from ..maintenance.retention import KeepBest, KeepEvery, KeepLatest, Policy, Retention

    policies: list[Policy] = []
    if args.keep_latest is not None:
        policies.append(KeepLatest(args.keep_latest))
    for n, metric, mode in args.keep_best:
        policies.append(KeepBest(n, metric, mode))
    if args.keep_every is not None:
        policies.append(KeepEvery(args.keep_every))
    return Retention(*policies) if policies else None


def _run_gc(store: Store, args: argparse.Namespace) -> int:
    rep = store.gc(dry_run=args.dry_run, repack_threshold=args.repack_threshold, cold_grace_s=args.cold_grace)
    if args.json:
        print(json.dumps(rep.to_dict() | {"total_freed": rep.total_freed}, indent=2, sort_keys=True))
        return 0
    d = rep.dry_run
    per_tier = ", ".join(f"{t}: {human_bytes(b)}" for t, b in rep.bytes_freed.items())
    print(f"{'dry run: would delete' if d else 'deleted'} {len(rep.packs_deleted)} dead pack(s), "
          f"{'would repack' if d else 'repacked'} {len(rep.packs_repacked)} sparse pack(s) into {rep.packs_written}, "
          f"{'would remove' if d else 'removed'} {rep.manifests_deleted} manifest(s) of pruned versions")
    print(f"{'would free' if d else 'freed'} {human_bytes(rep.total_freed)} ({per_tier}); "
          f"{rep.chunks_live} live chunk(s)")
    for line in rep.skipped:
        print(f"skipped: {line}")
    return 0


def _run_prune(store: Store, args: argparse.Namespace) -> int:
    try:
        retention = retention_from_args(args)
    except argparse.ArgumentTypeError as exc:
        print(f"datastates prune: {exc}", file=sys.stderr)
        return 2
    if retention is None:
        print("datastates prune: give at least one of --keep-latest, --keep-best, --keep-every "
              "(tagged versions and branch heads are always kept)", file=sys.stderr)
        return 2
    result = store.prune(retention, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return 0
    would = "would prune" if result.dry_run else "pruned"
    rows = []
    for vid in result.prune:
        v = store.version(vid)
        rows.append((v.created, v.short, v.step, v.branch))
    for _, short, step, branch in sorted(rows):
        print(f"{'would prune' if result.dry_run else 'pruned'} {short}  step={step}  branch={branch}")
    print(f"{'dry run: ' if result.dry_run else ''}{would} {len(result.prune)} version(s), keeping "
          f"{len(result.keep)} ({len(result.protected)} of them tagged, branch heads or protected); "
          f"{len(result.already_pruned)} pruned before")
    tail = "after `datastates gc`" if not result.dry_run else "once pruned and collected"
    # bytes_freed counts only this call's versions: "0 B" after a second prune hid what gc still frees
    before = (f", beside what the {len(result.already_pruned)} version(s) pruned before hold "
              "(`datastates gc --dry-run` counts all)" if result.already_pruned else "")
    print(with_store(f"{human_bytes(result.bytes_freed)} can be freed {tail}{before}", getattr(args, "store", None),
                     getattr(args, "hot", None)))
    return 0



def add_parsers(sub: Any) -> None:
    """Add only `gc` and `prune` to an argparse subparsers object (for programs embedding them; see `run`)."""
    _add_gc_prune(sub)


def run(store: Store, args: argparse.Namespace) -> int:
    """Run the command `args` was parsed for (by `add_parsers` or the CLI) on `store`; the exit status."""
    return int(args.handler(store, args))
