"""Capture: the only part of a save the caller waits for. Copies every stored byte of a
job into pool slots (on a side stream for CUDA tensors) and hands each full slot on."""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..objects.chunks import spans
from .buffers import _ALIGN, BufferPool, Piece, Slot
from .job import SaveJob
from .tree import TensorEntry


class CaptureOrder:
    """Captures run one at a time in submission order (the pipeline's order): a later save
    holding pool slots that an earlier one needs to finish would deadlock a small pool."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next_ticket = 0
        self._turn = 0

    def ticket(self) -> int:
        with self._cv:
            t = self._next_ticket
            self._next_ticket += 1
            return t

    def wait_turn(self, ticket: int) -> float:
        t0 = time.perf_counter()
        with self._cv:
            while self._turn != ticket:
                self._cv.wait()
        return time.perf_counter() - t0

    def done(self, ticket: int) -> None:
        with self._cv:
            self._turn = ticket + 1
            self._cv.notify_all()


BORROW_MIN = 1 << 20
"""With `borrow`, host tensors of at least this many bytes are read in place, not copied."""


def capture(job: SaveJob, pool: BufferPool, cuda_stream: Any = None, order: CaptureOrder | None = None,
            borrow: bool = False, plans: dict[Any, list[SlotPlan]] | None = None) -> None:
    """Copy every stored byte of the job into pool slots, handing each full slot to the pipeline.

    With `borrow` (a synchronous save: the caller waits until the version is durable, so its
    tensors cannot change under us) a host tensor of at least `BORROW_MIN` bytes is handed over in
    place, as a slot of its own that is never pooled: hashing, statistics and the pack write read
    the caller's memory, and a chunk the store already has costs no copy at all.

    A host-only job is laid out first (`plan`: which piece goes where in which slot) and then copied slot by
    slot. `plans`, when given, keeps that layout for jobs whose rows and byte views are the very same
    objects' (a cached flatten, `FlattenCache`): a repeated capture then only splits each slot and copies.

    Always ends the job's slot stream (with None), even on error.
    """
    waited = order.wait_turn(job.ticket) if order is not None else 0.0
    slot: Slot | None = None
    batch: list[tuple[int, int, torch.Tensor]] = []  # host copies into the current slot, done at hand-over
    t0 = time.perf_counter()
    try:
        if cuda_stream is None:
            key = (job.chunk_size, pool.slot_bytes, borrow)
            steps = plans.get(key) if plans is not None else None
            if steps is None:
                steps = plan(job.entries, job.chunk_size, pool.slot_bytes, borrow)
                if plans is not None:
                    plans[key] = steps
            for step in steps:
                if step.borrowed is not None:
                    _hand_over(job, Slot(step.borrowed, step.pieces, step.used, borrowed=True), None)
                    continue
                slot, w = pool.acquire(job.go.set)
                waited += w
                slot.pieces, slot.used = step.pieces, step.used
                try:
                    step.copy_into(slot.buf)
                except BaseException:
                    pool.release(slot)
                    raise
                _hand_over(job, slot, None)
            return
        cuda_stream.wait_stream(torch.cuda.current_stream())
        for row, e in enumerate(job.entries):
            if e.source is None:
                continue
            src = e.source
            on_gpu = src.is_cuda  # not device.type: a new str per tensor
            nbytes = e.nbytes
            if borrow and not on_gpu and nbytes >= BORROW_MIN and src.is_contiguous():
                # A slot per chunk: a slot is hashed by one worker, and a big tensor's chunks should spread
                # over all of them.
                for a, b in spans(nbytes, job.chunk_size):
                    _hand_over(job, Slot(src, [Piece(row, a, b - a)], b - a, borrowed=True), None)
                continue
            for a, b in ((0, nbytes),) if nbytes <= job.chunk_size else spans(nbytes, job.chunk_size):
                n = b - a
                if slot is None or slot.used + n > pool.slot_bytes:
                    if slot is not None:
                        _copy_batch(slot, batch)
                        _hand_over(job, slot, cuda_stream)
                    slot, w = pool.acquire(job.go.set)
                    waited += w
                if n:
                    if on_gpu:
                        dst = slot.buf[slot.used:slot.used + n]
                        with torch.cuda.stream(cuda_stream):
                            dst.copy_(src[a:b], non_blocking=True)
                            src.record_stream(cuda_stream)
                    else:
                        batch.append((slot.used, n, src if n == nbytes else src[a:b]))
                slot.pieces.append(Piece(row, slot.used, n))
                slot.used += -(-n // _ALIGN) * _ALIGN
        if slot is not None:
            _copy_batch(slot, batch)
            _hand_over(job, slot, cuda_stream)
        if cuda_stream is not None:
            # Later kernels on the caller's stream (optimizer steps) wait for our copies.
            torch.cuda.current_stream().wait_stream(cuda_stream)
    except BaseException as exc:
        job.capture_error = exc
        job.handle._capture_error = exc
        raise
    finally:
        job.timings["pool_wait_s"] = waited
        job.timings["staging_s"] = time.perf_counter() - t0
        job.slots.put(None)
        job.go.set()
        for e in job.entries:
            e.source = None  # drop references to the caller's tensors
        job.handle._set_staged()
        if order is not None:
            order.done(job.ticket)


class SlotPlan:
    """One slot of a host capture's layout: its pieces and the copies that fill it, or a borrowed slot (the
    caller's own bytes, read in place). Read-only once made: the pieces list is handed to every slot made
    from this plan, and the pipeline only reads it."""

    __slots__ = ("pieces", "used", "borrowed", "_start", "_end", "_sizes", "_keep", "_srcs")

    def __init__(self, pieces: list[Piece], used: int, borrowed: torch.Tensor | None = None,
                 batch: list[tuple[int, int, torch.Tensor]] | None = None) -> None:
        self.pieces = pieces
        self.used = used
        self.borrowed = borrowed
        self._srcs = [src for _, _, src in batch or ()]
        self._start = self._end = 0
        self._sizes: list[int] = []
        self._keep: Callable[[Any], Any] | None = None
        if not batch:
            return
        take: list[int] = []
        self._start = pos = batch[0][0]
        for off, n, _ in batch:
            if off > pos:  # alignment padding between pieces
                self._sizes.append(off - pos)
            take.append(len(self._sizes))
            self._sizes.append(n)
            pos = off + n
        self._end = pos
        if len(take) != len(self._sizes):
            self._keep = operator.itemgetter(*take)

    def copy_into(self, buf: torch.Tensor) -> None:
        """Copy the plan's sources into `buf` (a pool slot): one `split` and one `_foreach_copy_` (with
        thousands of small tensors, per-piece slicing and copy calls cost as much as the copying itself)."""
        srcs = self._srcs
        if len(srcs) == 1:
            buf[self._start:self._end].copy_(srcs[0])
        elif srcs:
            parts = buf[self._start:self._end].split(self._sizes)
            torch._foreach_copy_(list(parts if self._keep is None else self._keep(parts)), srcs)


def plan(entries: list[TensorEntry], chunk_size: int, slot_bytes: int, borrow: bool) -> list[SlotPlan]:
    """The layout of a host capture of `entries` (rows without a source are skipped), slots in hand-over
    order; `borrow` as in `capture`. Each chunk of a row is one piece; pieces start on `_ALIGN` bytes."""
    steps: list[SlotPlan] = []
    pieces: list[Piece] | None = None
    batch: list[tuple[int, int, torch.Tensor]] = []
    used = 0
    for row, e in enumerate(entries):
        src = e.source
        if src is None:
            continue
        nbytes = e.nbytes
        if borrow and nbytes >= BORROW_MIN and src.is_contiguous():
            # A slot per chunk: a slot is hashed by one worker, and a big tensor's chunks should spread
            # over all of them.
            for a, b in spans(nbytes, chunk_size):
                steps.append(SlotPlan([Piece(row, a, b - a)], b - a, borrowed=src))
            continue
        for a, b in ((0, nbytes),) if nbytes <= chunk_size else spans(nbytes, chunk_size):
            n = b - a
            if pieces is None or used + n > slot_bytes:
                if pieces is not None:
                    steps.append(SlotPlan(pieces, used, batch=batch))
                pieces, batch, used = [], [], 0
            if n:
                batch.append((used, n, src if n == nbytes else src[a:b]))
            pieces.append(Piece(row, used, n))
            used += -(-n // _ALIGN) * _ALIGN
    if pieces is not None:
        steps.append(SlotPlan(pieces, used, batch=batch))
    return steps


def _copy_batch(slot: Slot, batch: list[tuple[int, int, torch.Tensor]]) -> None:
    """Copy the pending host pieces `(offset, length, source bytes)` into `slot` and empty `batch`.

    One `split` and one `_foreach_copy_` for the whole slot: with thousands of small tensors the
    per-piece Python slicing and copy calls cost as much as the copying itself."""
    if len(batch) == 1:
        off, n, src = batch[0]
        slot.buf[off:off + n].copy_(src)
    elif batch:
        sizes: list[int] = []
        take: list[bool] = []
        start = pos = batch[0][0]
        for off, n, _ in batch:
            if off > pos:  # alignment padding between pieces
                sizes.append(off - pos)
                take.append(False)
            sizes.append(n)
            take.append(True)
            pos = off + n
        parts = slot.buf[start:pos].split(sizes)
        torch._foreach_copy_([p for p, keep in zip(parts, take) if keep], [src for _, _, src in batch])
    batch.clear()


def _hand_over(job: SaveJob, slot: Slot, cuda_stream: Any) -> None:
    if cuda_stream is not None:
        slot.event = torch.cuda.Event()
        slot.event.record(cuda_stream)
    job.slots.put(slot)
