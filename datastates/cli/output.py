"""Formatting shared by the command modules: times, JSON, table cells."""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
from typing import Any

_HINT = re.compile("`" + r"datastates ([^`]*)`")  # split: tests/test_hints.py runs every `datastates ...` literal


def when(t: float) -> str:
    """`t` (Unix seconds) as a local ISO 8601 time with its UTC offset, to the second."""
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def fmt(x: Any, width: int = 10) -> str:
    """A right-aligned table cell: '-' for None, 4 significant digits for floats."""
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.4g}"
    return f"{x!s:>{width}}"


def with_store(text: str, store: str | None) -> str:
    """`text` with `--store STORE` put into each backquoted hint that is a datastates command, so that the
    hint runs as given in the user's shell. Unchanged when `store` is what $DATASTATES_STORE already names
    (or None), and for hints that name a store of their own."""
    if not store or store == os.environ.get("DATASTATES_STORE"):
        return text

    def put(m: re.Match[str]) -> str:
        rest = m.group(1)
        if "--store" in rest.split() or rest.split()[:1] in (["demo"], ["bench"]):
            return m.group(0)
        return m.group(0).replace("datastates ", f"datastates --store {shlex.quote(store)} ", 1)

    return _HINT.sub(put, text)
