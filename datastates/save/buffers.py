"""Reusable staging buffers: the bounded pool that captures copy into.

Reuse matters: on VMs that hand freed memory back to the host, touching new
pages is ~10x slower than copying into pages already in use.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_ALIGN = 64  # slot offsets stay aligned so a piece can be viewed as any dtype


@dataclass
class Piece:
    row: int
    start: int
    length: int


@dataclass
class Slot:
    """One reusable staging buffer and the pieces of chunks copied into it."""

    buf: torch.Tensor
    pieces: list[Piece] = field(default_factory=list)
    used: int = 0
    """Bytes of `buf` filled so far (a borrowed slot: the bytes of its one piece)."""
    event: Any = None
    borrowed: bool = False
    """`buf` is the caller's own tensor bytes (a synchronous save reads them in place): never pooled."""


class BufferPool:
    """A bounded set of equal-size host buffers, allocated on first use and then reused.

    Reuse matters: on VMs that hand freed memory back to the host, touching new
    pages is ~10x slower than copying into pages already in use.
    """

    def __init__(self, capacity: int, slot_bytes: int, pin: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.max_slots = max(2, capacity // slot_bytes)
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cv = threading.Condition()

    def acquire(self, on_wait: Callable[[], None] | None = None) -> tuple[Slot, float]:
        """A free slot and the seconds spent waiting for one; `on_wait` runs before any wait."""
        t0 = time.perf_counter()
        with self._cv:
            if not self._free and self._allocated >= self.max_slots and on_wait is not None:
                on_wait()
            while not self._free and self._allocated >= self.max_slots:
                self._cv.wait()
            if self._free:
                buf = self._free.pop()
            else:
                self._allocated += 1
                buf = None
        if buf is None:
            try:
                # 4096-aligned so packs can write slots with O_DIRECT.
                raw = torch.empty(self.slot_bytes + 4096, dtype=torch.uint8, pin_memory=self.pin)
                buf = raw[(-raw.data_ptr()) % 4096:][: self.slot_bytes]
            except BaseException:
                with self._cv:
                    self._allocated -= 1
                    self._cv.notify()
                raise
        return Slot(buf), time.perf_counter() - t0

    def release(self, slot: Slot) -> None:
        if slot.borrowed:
            return  # the caller's memory, not one of ours
        with self._cv:
            self._free.append(slot.buf)
            self._cv.notify()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slot_bytes


def default_pool_bytes() -> int:
    """The staging pool a store gets unless told otherwise: a quarter of RAM, at least 256 MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return max(256 << 20, total // 4)
