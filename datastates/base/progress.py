"""Progress bars for long CLI work (gc, fsck, flush, rebuild), shown only to a person watching.

Bars go to stderr and only when it is a terminal, so logs, pipes and `--json`
output stay clean.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(total: float | None, desc: str, unit: str = "it", **kw: Any) -> tqdm:  # type: ignore[type-arg]
    """A bar to `update()` by hand; a no-op object when stderr is not a terminal."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not sys.stderr.isatty(), **kw)


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """`items`, with a bar while they are consumed."""
    return iter(tqdm(items, desc=desc, total=total, unit=unit, leave=False, disable=not sys.stderr.isatty()))
