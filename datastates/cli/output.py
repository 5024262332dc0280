"""Formatting shared by the command modules: times, JSON, table cells."""

from __future__ import annotations

import json
import time
from typing import Any


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def fmt(x: Any, width: int = 10) -> str:
    """A right-aligned table cell: '-' for None, 4 significant digits for floats."""
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, float):
        return f"{x:>{width}.4g}"
    return f"{x!s:>{width}}"
