"""Formatting shared by the command modules: times, JSON, table cells."""

from __future__ import annotations

import datetime
import json
from typing import Any

from ..base.files import json_finite
from ..errors import with_store

__all__ = ["fmt", "one_line", "print_json", "when", "with_store"]



def when(t: float) -> str:
    """`t` (Unix seconds) as a local ISO 8601 time with its UTC offset, to the second."""
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def one_line(text: str) -> str:
    """`text` on one line of a table: its first line, then ' ...' when more follow (as `git log --oneline` shows a
    message's subject), other control characters as escapes, so a message never breaks or rewrites the rows."""
    lines = text.splitlines()
    first = lines[0] if lines else ""
    first = "".join(c if c == "\t" or c.isprintable() else repr(c)[1:-1] for c in first)
    return first + (" ..." if len(lines) > 1 else "")


def print_json(obj: Any) -> None:
    """Strict JSON: non-finite floats as the strings "NaN", "Infinity", "-Infinity", as the REST server writes
    them (a bare Infinity, which Python writes, is refused by JavaScript's, Go's and serde's parsers)."""
    print(json.dumps(json_finite(obj), indent=2, sort_keys=True, default=str, allow_nan=False))


def fmt(x: Any, width: int = 10) -> str:
    """A right-aligned table cell: '-' for None, 4 significant digits for floats."""
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.4g}"
    return f"{x!s:>{width}}"


