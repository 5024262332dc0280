"""Pausing Python's cyclic garbage collector around work that allocates many objects at once.

A save or load of thousands of small tensors allocates tens of thousands of Python objects; every 700
allocations the collector runs, and its older generations walk every object of the process. Reference
counting still frees everything such work allocates; only cycles wait until the collector is back on.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def paused() -> Iterator[None]:
    """Run the body with the cyclic collector off. Nested and concurrent uses share one pause; the last one
    out restores the collector's state as the first one in found it (a collector the caller had disabled
    stays disabled)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
