"""Argument types for the command line: each reads one number and refuses a bad one where it is read, so
argparse names the option, prints the usage and exits 2 before any store is opened."""

from __future__ import annotations

import argparse


def common_options(parser: argparse.ArgumentParser, store: bool = True) -> None:
    """--store and --hot (with `store`) and --debug on a subcommand's parser, so that "datastates log --store PATH"
    works as well as "datastates --store PATH log"; SUPPRESS keeps a value given before the subcommand."""
    if store:
        parser.add_argument("--store", default=argparse.SUPPRESS, help="store directory (default: $DATASTATES_STORE)")
        parser.add_argument("--hot", default=argparse.SUPPRESS, help="a node-local hot tier of your own for a "
                            "two-tier store (default: the one its config.toml names)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")


def whole(text: str, least: int = 0) -> int:
    """`text` as an int of at least `least`. Raises argparse.ArgumentTypeError otherwise."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{n} must be {least} or more")
    return n


def positive(text: str) -> int:
    """A count of 1 or more (a step multiple, a number of versions or of bins: 0 would mean nothing)."""
    return whole(text, least=1)


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def fraction(text: str) -> float:
    """A number between 0 and 1, both included."""
    f = number(text)
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"{f} must be between 0 and 1")
    return f


def seconds(text: str) -> float:
    """A duration of 0 or more seconds (`not f >= 0` also refuses nan)."""
    f = number(text)
    if not f >= 0.0:
        raise argparse.ArgumentTypeError(f"{f} must be 0 or more seconds")
    return f
