"""Commands that run a program rather than read a store: demo, bench."""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import positive


def register(sub: Any) -> None:
    s = sub.add_parser("demo", help="train a small model, saving into a local store, then print the log")
    s.add_argument("--dir", default="runs/demo-store",
                   help="the demo's own store (default runs/demo-store); --store and $DATASTATES_STORE are "
                        "ignored, and a store the demo did not make is refused")
    s.add_argument("--steps", type=positive, default=300, help="training steps (default 300)")
    s.add_argument("--every", type=positive, default=20, help="save every N steps (default 20)")
    s.set_defaults(standalone=_demo)
    from ..bench import add_parser

    add_parser(sub)
    sub.choices["bench"].set_defaults(standalone=_bench)


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run

    return run(args.dir, steps=args.steps, every=args.every)  # never args.store: a user's real store


def _bench(args: argparse.Namespace) -> int:
    from ..bench import main

    return main(args)
