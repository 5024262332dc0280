"""The `datastates` command line. The store comes from --store PATH or $DATASTATES_STORE.

One module per command group; each has `register(sub)`, which adds its subcommands with
`handler(store, args) -> int` (run on the opened store) or `standalone(args) -> int` (opens
nothing: demo, bench, serve).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import DataStatesError
from ..store import Store
from . import inspect, maintenance, plot, programs, refs, serve, tiers, transfer
from .arguments import common_options
from .output import with_store

GROUPS = (maintenance, inspect, refs, tiers, transfer, programs, plot, serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="datastates", description="A versioned model-state store for PyTorch.")
    p.add_argument("--store", default=os.environ.get("DATASTATES_STORE"),
                   help="store directory (default: $DATASTATES_STORE)")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    p.add_argument("--hot", default=None, help="a node-local hot tier of your own for a two-tier store (default: "
                   "the one its config.toml names); for reading another user's store")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        # `datastates log --store PATH` works as well as `datastates --store PATH log`.
        s = add(name, **kw)
        # bench and demo: their own directory is --dir, never a user's store
        common_options(s, store=name not in ("bench", "demo"))
        return s

    sub.add_parser = add_parser  # type: ignore[method-assign]
    for group in GROUPS:
        group.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status: 1 and a one-line message (no traceback unless --debug)
    for a DataStates error or an OSError (a disk full, a permission denied), 2 for a usage error."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `datastates log | head` ends quietly
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (DataStatesError, OSError) as exc:
        if args.debug:
            raise
        # The hints in messages say `datastates fsck`: with --store given, that alone would find no store.
        message = with_store(str(exc), getattr(args, "store", None), getattr(args, "hot", None))
        print(f"datastates: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    standalone = getattr(args, "standalone", None)
    if standalone is not None:
        return int(standalone(args))
    if not args.store:
        print("datastates: no store given; pass --store PATH or set DATASTATES_STORE", file=sys.stderr)
        return 2
    # Warnings (a damaged ref skipped by a listing) print as before, their message alone on stderr, with the
    # hints in them naming the store as the errors' do.
    warnings = logging.StreamHandler(sys.stderr)
    warnings.setLevel(logging.WARNING)
    warnings.addFilter(_NamingStore(args.store, getattr(args, "hot", None)))
    logger = logging.getLogger("datastates")
    logger.addHandler(warnings)
    try:
        creates = getattr(args, "creates", False)
        # --hot is this command's hot tier only (a reader's own): it never becomes the store's in config.toml, but
        # for `init`, which makes the store with it.
        store = Store.open(args.store, create=creates, hot=getattr(args, "hot", None), record_tiers=creates)
        try:
            return int(args.handler(store, args))
        finally:
            store.close()
    finally:
        logger.removeHandler(warnings)


class _NamingStore(logging.Filter):
    """Puts `--store STORE` into the command hints of a log record's message (see `with_store`)."""

    def __init__(self, store: str, hot: str | None = None) -> None:
        super().__init__()
        self.store, self.hot = store, hot

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = with_store(record.getMessage(), self.store, self.hot), None
        return True


if __name__ == "__main__":
    sys.exit(main())
