"""Reusable staging buffers: the bounded pool that captures copy into.

Reuse matters: on VMs that hand freed memory back to the host, touching new
pages is ~10x slower than copying into pages already in use.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.memory import bytes_at

_ALIGN = 64  # slot offsets stay aligned so a piece can be viewed as any dtype


@dataclass
class Piece:
    row: int
    start: int
    length: int
    index: int = 0
    """The piece's chunk number within its row (its byte offset in the tensor / the chunk size)."""


class InPlace:
    """The sources of a slot's pieces, read where they lie (the caller's host tensors, in a synchronous save:
    the caller waits until the version is durable, so they cannot change under us). Hashing reads them in
    place, and only the pieces that must be written or summarized are copied into the slot
    (`Slot.fill`): a save that finds 90 % of its chunks stored copies 10 % of its bytes.

    Kept with a capture's layout (`capture.SlotPlan`), so a repeated save of the same tensors makes its byte
    views once. They are made from addresses, not with `Tensor.numpy()`: a numpy array kept alive makes the
    caller's storage unresizable (`resize_` raises), and these outlive the save. An address stays valid as long
    as the layout is used: `sources` holds the storages, and a layout is only reused while every tensor keeps
    its data pointer, dtype, shape and strides (`tree.FlattenCache`)."""

    __slots__ = ("sources", "_addresses", "_views")

    def __init__(self, sources: list[torch.Tensor | None]) -> None:
        self.sources = sources
        """Per piece: a flat uint8 host tensor of its bytes (None: an empty piece)."""
        self._addresses: list[int] | None = None
        self._views: list[memoryview] | None = None

    def addresses(self) -> list[int]:
        """Per piece, the address of its first byte (0 for an empty piece)."""
        if self._addresses is None:
            self._addresses = [0 if s is None else s.data_ptr() for s in self.sources]
        return self._addresses

    def views(self) -> list[memoryview]:
        """Per piece, its bytes as a read-only memoryview, for hashing (made on first use, off the caller's
        thread)."""
        if self._views is None:
            self._views = [memoryview(b"") if s is None else bytes_at(a, s.numel()).toreadonly()
                           for s, a in zip(self.sources, self.addresses())]
        return self._views


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
    in_place: InPlace | None = None
    """Set when the pieces are not copied yet: their bytes are read from these sources, and copied into `buf`
    only by `fill`, piece by piece, when something needs them there."""
    filled: bytearray | None = None
    """With `in_place`: per piece, 1 once copied into `buf`."""
    on_release: Callable[[], None] | None = None
    """Called when the slot goes back to the pool (`BufferPool.release`)."""
    keep: Any = None
    """What holds the CUDA sources of the slot's copies (its `SlotPlan`): they stay alive until `event` has
    completed, so that the caching allocator cannot hand their memory to a new tensor while the side stream
    still reads it. One reference per slot, where `record_stream` would cost a call per piece."""

    def fill(self, indices: list[int]) -> None:
        """Copy the pieces at `indices` (of `pieces`) from their sources into `buf`, each at most once; a no-op
        for a slot whose pieces were copied at capture."""
        if self.filled is None:  # copied at capture
            return
        assert self.in_place is not None
        filled, addresses, pieces = self.filled, self.in_place.addresses(), self.pieces
        base = self.buf.data_ptr()
        for i in indices:
            if not filled[i]:
                p = pieces[i]
                if p.length:
                    ctypes.memmove(base + p.start, addresses[i], p.length)
                filled[i] = 1


class Budget:
    """Bytes that may be out at once: `take` waits until `n` more fit (one taker alone always fits), `give`
    returns them. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._out = 0
        self._cv = threading.Condition()

    def take(self, n: int) -> float:
        """Take `n` bytes; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            while self._out and self._out + n > self.limit:
                self._cv.wait()
            self._out += n
        return time.perf_counter() - t0

    def give(self, n: int) -> None:
        with self._cv:
            self._out -= n
            self._cv.notify_all()


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
        self._closed = False
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
            buf = self._new_slot()
        return Slot(buf), time.perf_counter() - t0

    def _new_slot(self) -> torch.Tensor:
        """A new slot buffer, counted already (`_allocated`); the count is given back if allocating fails."""
        try:
            return slot_buffer(self.slot_bytes, self.pin)
        except BaseException:
            with self._cv:
                self._allocated -= 1
                self._cv.notify()
            raise

    def grow(self, slots: int) -> int:
        """Allocate slots until the pool holds `slots` of them (at most its capacity) and keep them free, so the
        saves that need them later only copy. Safe beside `acquire`. Returns the pool's bytes then
        (`allocated_bytes`). Raises what the allocation raises (the slots made before it stay in the pool)."""
        while True:
            with self._cv:
                if self._allocated >= min(slots, self.max_slots):
                    return self._allocated * self.slot_bytes
                self._allocated += 1
            buf = self._new_slot()
            if not self.pin:
                # Pageable memory is only address space until written: touch every page now, or the first save's
                # copy still pays the page faults (~0.2 GB/s on a VM that hands freed memory back to its host).
                # Pinning has faulted pinned slots in already.
                buf.fill_(0)
            with self._cv:
                self._free.append(buf)
                self._cv.notify()

    def release(self, slot: Slot) -> None:
        if slot.on_release is not None:
            slot.on_release()
            slot.on_release = None
        if slot.borrowed:
            return  # the caller's memory, not one of ours
        with self._cv:
            if self._closed:
                self._allocated -= 1  # freed with the slot, not kept
                return
            self._free.append(slot.buf)
            self._cv.notify()

    def close(self) -> None:
        """Free the pool's buffers (pinned memory when `pin`): its store is closed, no save will take a slot again.
        A slot still out is freed when it is released; a slot taken after this is allocated anew and freed at its
        release."""
        with self._cv:
            self._closed = True
            self._allocated -= len(self._free)
            self._free.clear()
        if self.pin:
            # torch keeps freed pinned blocks cached for its next pinned allocation: hand them back to the system
            # (a private call, looked up: where torch lacks it they stay cached, for the next pinned allocation).
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slot_bytes


def slot_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A new uint8 host buffer of `nbytes` whose data starts on a 4096-byte boundary, so that packs can write it
    with O_DIRECT; pinned (page-locked, for copies from a GPU) when `pin`. Raises what torch raises when the
    memory cannot be had."""
    if pin:
        # Exactly `nbytes`: torch's pinned allocator rounds every request up to a power of two, so the 4 KiB of
        # slack that aligns a pageable buffer would make a 64 MiB slot pin 128 MiB, twice the memory and twice
        # the pinning time of the first save. Pinned blocks are page-aligned; the slack stays as a fallback.
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % 4096 == 0:
            return raw
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8, pin_memory=True)
    else:
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)  # malloc puts a header before a big block
    return raw[(-raw.data_ptr()) % 4096:][:nbytes]


def default_pool_bytes() -> int:
    """The staging pool a store gets unless told otherwise: a quarter of RAM, at least 256 MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return max(256 << 20, total // 4)
