"""Capture: the only part of a save the caller waits for. Copies every stored byte of a
job into pool slots (on a side stream for CUDA tensors) and hands each full slot on."""

from __future__ import annotations

import functools
import operator
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..objects.chunks import spans
from .buffers import _ALIGN, Budget, BufferPool, InPlace, Piece, Slot
from .copier import Copier
from .job import SaveJob
from .tree import Layouts, TensorEntry


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


class CudaStaging:
    """What copies a capture's CUDA pieces to the pinned pool: a side stream, so that the caller's stream goes on
    while it copies, and per GPU one slot-sized buffer on the GPU that gathers each run of a slot's small pieces
    (one `_foreach_copy_`, one kernel), so that the run crosses to the host in one copy. A copy per piece cost
    ~23 us of the caller's time per tensor on an H100 (8,000 x 16 KiB: the blocking part of `save_async` was 4.9x
    a plain copy loop); the buffer costs one slot of GPU memory per device. Used on the side stream only, so
    its reuse by the next slot is ordered after the previous slot's copy out of it."""

    def __init__(self, slot_bytes: int) -> None:
        self.stream = torch.cuda.Stream()
        self.slot_bytes = slot_bytes
        self._gather: dict[torch.device, torch.Tensor] = {}

    def gather_buffer(self, device: torch.device) -> torch.Tensor:
        buf = self._gather.get(device)
        if buf is None:
            with torch.cuda.stream(self.stream):
                buf = self._gather[device] = torch.empty(self.slot_bytes, dtype=torch.uint8, device=device)
        return buf


def capture(job: SaveJob, pool: BufferPool, cuda: CudaStaging | None = None, order: CaptureOrder | None = None,
            borrow: bool = False, plans: dict[Any, list[SlotPlan]] | None = None, copier: Copier | None = None,
            on_caller: bool = False) -> None:
    """Copy every stored byte of the job into pool slots, handing each full slot to the pipeline.

    With `borrow` (a synchronous save: the caller waits until the version is durable, so its
    tensors cannot change under us) nothing on the host is copied here. A host tensor of at least
    `BORROW_MIN` bytes is handed over in place, as a slot of its own that is never pooled: hashing,
    statistics and the pack write read the caller's memory. Smaller ones are laid out in pool slots as
    usual, but the slots go on unfilled (`Slot.in_place`): the hashing worker reads the pieces where
    they lie and copies into the slot only those it must summarize or write. Either way a chunk the
    store already has (and whose statistics are known) costs no copy at all.

    The job is laid out first (`plan`: which piece goes where in which slot) and then copied slot by slot;
    CUDA pieces are copied by `cuda` (see `CudaStaging`); host pieces share their copies with `copier` when given.
    `on_caller`: this runs on the caller's thread, which hears of a failure from this call itself.
    `plans`, when given, keeps that layout for host-only jobs whose rows and byte views are the very same objects' (a
    cached flatten, `FlattenCache`): a repeated capture then only splits each slot and copies. `Layouts` marked
    `unbound` (a kept flatten of new tensor objects every save) keep it without its byte views, and each capture
    binds it to the job's own (`SlotPlan.bound`); where their rows are contiguous host tensors (`Layouts.raw`), it
    is also kept bound to byte views made from the rows' addresses (`Layouts.addressed`), and later jobs, whose
    rows then have no byte views, copy (or borrow) through it as it is: `job.holds` keeps their tensors until the
    copy is done, or with `borrow` until the pipeline is done with the job.

    Always ends the job's slot stream (with None), even on error.
    """
    waited = order.wait_turn(job.ticket) if order is not None else 0.0
    t0 = time.perf_counter()
    try:
        if cuda is not None:
            cuda.stream.wait_stream(torch.cuda.current_stream())
        key = (job.chunk_size, pool.slot_bytes, borrow)
        layouts = plans if isinstance(plans, Layouts) else None
        unbound = layouts is not None and layouts.unbound
        if job.holds is not None:
            # Rows without byte views: the flatten gave them only because this layout exists. It reads the
            # tensors `job.holds` keeps, by address.
            assert layouts is not None and key in layouts.addressed, "a job without byte views needs its layout"
            steps = layouts.addressed[key]
        else:
            steps = plans.get(key) if plans is not None else None
            if steps is None:
                steps = plan(job.entries, job.chunk_size, pool.slot_bytes, borrow)
                if plans is not None:
                    # Without the byte views when the record holds none: they would keep the caller's memory.
                    plans[key] = [step.bound(None, job.chunk_size) for step in steps] if unbound else steps
            elif unbound:
                steps = [step.bound([e.source for e in job.entries], job.chunk_size) for step in steps]
            if layouts is not None and layouts.raw is not None and key not in layouts.addressed:
                layouts.addressed[key] = [step.bound(layouts.raw, job.chunk_size) for step in layouts[key]]
        ahead = Budget(_IN_PLACE_AHEAD)
        for step in steps:
            if step.borrowed is not None:
                _hand_over(job, Slot(step.borrowed, step.pieces, step.used, borrowed=True), None)
                continue
            if step.in_place is not None:
                waited += ahead.take(step.used)
            slot, w = pool.acquire(job.go.set)
            waited += w
            slot.pieces, slot.used = step.pieces, step.used
            if step.in_place is not None:
                slot.in_place, slot.filled = step.in_place, bytearray(len(step.pieces))
                slot.on_release = functools.partial(ahead.give, step.used)
            else:
                try:
                    step.copy_into(slot.buf, cuda, copier)
                except BaseException:
                    pool.release(slot)
                    raise
                if cuda is not None and step.has_cuda:
                    slot.keep = step  # its sources stay alive until the slot's copies are done (Slot.keep)
            _hand_over(job, slot, cuda)
        if cuda is not None:
            # Later kernels on the caller's stream (optimizer steps) wait for our copies.
            torch.cuda.current_stream().wait_stream(cuda.stream)
    except BaseException as exc:
        job.capture_error = exc
        job.capture_raised = on_caller  # before the pipeline can fail the job (the end marker goes in below)
        job.handle._capture_error = exc
        raise
    finally:
        job.timings["pool_wait_s"] = waited
        job.timings["staging_s"] = time.perf_counter() - t0
        job.slots.put(None)
        job.go.set()
        # No reference to the caller's tensors past the capture, but those a borrowing capture's slots read by
        # address (`job.holds`): the pipeline reads them until it is done with the job.
        job.drop_sources(keep_holds=borrow)
        job.handle._set_staged()
        if order is not None:
            order.done(job.ticket)


_IN_PLACE_AHEAD = 96 << 20
"""Bytes of slots read in place that a capture hands on before the pipeline gives any back. Such a slot costs
the caller nothing, so without this bound a sync save would take every pool slot at once (the workers fill
the slots of new pieces): small x1's first save grew the pool to 512 MiB, against ~176 MiB when the caller's
copies paced it. The pipeline hashes up to 64 MiB ahead of its writer (`pipeline._AHEAD_BYTES`): this keeps
that window full."""

_BATCH_BYTES = 1 << 20
"""Host pieces of a slot are copied in batches of about this many bytes (one `split` and one `_foreach_copy_`
each)."""

_GATHER_BELOW = 1 << 20
"""CUDA pieces smaller than this are gathered on the GPU with their neighbours (`CudaStaging`); bigger ones cross
to the host alone, where a copy's fixed cost is small beside its bytes."""

_SHARED_BELOW = 1 << 17
"""Batches of pieces all smaller than this are shared with the copier; bigger pieces are copied by the caller,
on torch's own intra-op threads. Small x1's 64 KiB tensors gained from sharing (blocking part 0.086 -> 0.063-0.067
s), `cnn` and `transformer` moved within noise with this bound and with 1 MiB; 32 KiB (torch's grain, in elements
of our uint8 views) left small x1 unshared (docs/perf-notes.md)."""


class SlotPlan:
    """One slot of a capture's layout: its pieces and the copies that fill it, or a borrowed slot (the caller's
    own bytes, read in place). Read-only once made: the pieces list is handed to every slot made from this
    plan, and the pipeline only reads it."""

    __slots__ = ("pieces", "used", "borrowed", "in_place", "_batches", "_shared", "_cuda", "_alone", "_runs",
                 "_picks")

    def __init__(self, pieces: list[Piece], used: int, borrowed: torch.Tensor | None = None,
                 batch: list[tuple[int, int, torch.Tensor]] | None = None, in_place: InPlace | None = None
                 ) -> None:
        self.pieces = pieces
        self.used = used
        self.borrowed = borrowed
        self.in_place = in_place
        """Set for a synchronous save's slot of host pieces: handed on unfilled (see `capture`)."""
        batch = batch or []
        self._cuda = [b for b in batch if b[2].is_cuda]
        self._alone, self._runs = _cuda_runs(batch) if self._cuda else ([], [])
        """`_alone`: CUDA pieces that cross to the host alone, big ones and small ones with no small CUDA
        neighbour. `_runs`: runs of small CUDA pieces next to each other in the slot, on one device, each gathered
        on the GPU and then copied as one."""
        host = [b for b in batch if not b[2].is_cuda] if self._cuda else batch
        self._batches: list[_Batch] = []
        """Batches of pieces of at least `_SHARED_BELOW` bytes (copied by the caller) come before the others."""
        self._shared = 0
        """How many batches, at the end of `_batches`, are shared with the copier."""
        self._picks: list[list[int]] = []
        """Per batch of `_batches`: the positions of its pieces in `batch` (`bound` gives it other sources)."""
        for small in (False, True):
            at = [k for k, b in enumerate(host) if (b[1] < _SHARED_BELOW) is small]
            run = [host[k] for k in at]
            i = 0
            while i < len(run):
                j, size = i, 0
                while j < len(run) and (j == i or size < _BATCH_BYTES):
                    size += run[j][1]
                    j += 1
                self._batches.append(_Batch(run[i:j]))
                self._picks.append(at[i:j])
                self._shared += small
                i = j

    @property
    def has_cuda(self) -> bool:
        return bool(self._cuda)

    def bound(self, sources: list[torch.Tensor | None] | None, chunk_size: int) -> SlotPlan:
        """This host slot's layout over `sources`, per row the flat byte view of its whole bytes (rows of the
        same sizes and the same kinds as those `plan` laid out: a flatten of other tensor objects with the same
        signatures), or over none (a template, which `bound` binds again). Costs a few list operations per
        piece, against a `plan` of every row: 88 ms of 114 saved per save of 32,000 small tensors on the 2-core
        VM."""
        assert not self._cuda, "only host layouts are kept without their byte views"
        new = SlotPlan.__new__(SlotPlan)
        new.pieces, new.used, new._shared, new._picks = self.pieces, self.used, self._shared, self._picks
        new._cuda, new._alone, new._runs, new.in_place, new.borrowed = [], [], [], None, None
        if self.borrowed is not None:  # the caller's tensor itself (a template keeps a placeholder to bind)
            new.borrowed = sources[self.pieces[0].row] if sources is not None else _UNBOUND
            new._batches = []
            return new
        views = [None if p.length == 0 or sources is None else _piece_view(sources[p.row], p, chunk_size)
                 for p in self.pieces]
        if self.in_place is not None:
            new.in_place = InPlace(views)
        host = [v for v in views if v is not None] if sources is not None else None
        new._batches = [b.bound(host, pick) for b, pick in zip(self._batches, self._picks)]
        return new

    def copy_into(self, buf: torch.Tensor, cuda: CudaStaging | None = None, copier: Copier | None = None) -> None:
        """Copy the plan's sources into `buf` (a pool slot). Host pieces: one `split` and one `_foreach_copy_`
        per batch (with thousands of small tensors, per-piece slicing and copy calls cost as much as the copying
        itself); batches of small pieces are shared with `copier` when given. CUDA pieces: asynchronous copies
        on `cuda`'s stream, runs of small ones gathered on the GPU first; the caller keeps the sources alive
        until the slot's event has completed (`Slot.keep`). Without `cuda`, CUDA pieces are copied one by one,
        synchronously."""
        if cuda is None:
            for off, n, src in self._cuda:
                buf[off:off + n].copy_(src)
        elif self._cuda:
            with torch.cuda.stream(cuda.stream):
                for off, n, src in self._alone:
                    buf[off:off + n].copy_(src, non_blocking=True)
                for r in self._runs:
                    gather = cuda.gather_buffer(r.device)
                    r.copy_into(gather)
                    buf[r.start:r.end].copy_(gather[r.start:r.end], non_blocking=True)
        batches = self._batches
        alone = len(batches) - self._shared if copier is not None and self._shared > 1 else len(batches)
        for b in batches[:alone]:
            b.copy_into(buf)
        if alone < len(batches):
            shared = batches[alone:]
            assert copier is not None
            copier.run(len(shared), lambda i: shared[i].copy_into(buf))


_UNBOUND = torch.empty(0, dtype=torch.uint8)
"""The bytes of a borrowed slot in a layout kept without its byte views (`SlotPlan.bound`)."""


def _piece_view(src: torch.Tensor | None, p: Piece, chunk_size: int) -> torch.Tensor:
    """The bytes of piece `p` of the row whose byte view is `src`, as `plan` views them."""
    assert src is not None
    if p.length == src.numel():
        return src
    a = p.index * chunk_size
    return src[a:a + p.length]


def _cuda_runs(batch: list[tuple[int, int, torch.Tensor]]
               ) -> tuple[list[tuple[int, int, torch.Tensor]], list[_Batch]]:
    """The CUDA pieces of a slot's `batch` (in slot order) as pieces copied alone and runs to gather."""
    alone: list[tuple[int, int, torch.Tensor]] = []
    runs: list[_Batch] = []
    run: list[tuple[int, int, torch.Tensor]] = []

    def close() -> None:
        if len(run) > 1:
            runs.append(_Batch(run[:]))
        else:
            alone.extend(run)
        run.clear()

    for b in batch:
        if not b[2].is_cuda or b[1] >= _GATHER_BELOW:
            close()  # a host piece or a big one between small CUDA pieces ends their run
            if b[2].is_cuda:
                alone.append(b)
            continue
        if run and run[0][2].device != b[2].device:
            close()
        run.append(b)
    close()
    return alone, runs


class _Batch:
    """Host pieces lying in one stretch of a slot, copied with one call."""

    __slots__ = ("_start", "_end", "_sizes", "_keep", "_srcs")

    def __init__(self, host: list[tuple[int, int, torch.Tensor]]) -> None:
        self._srcs = [src for _, _, src in host]
        self._sizes: list[int] = []
        self._keep: Callable[[Any], Any] | None = None
        take: list[int] = []
        self._start = pos = host[0][0]
        for off, n, _ in host:
            if off > pos:  # alignment padding (or a CUDA piece) between pieces
                self._sizes.append(off - pos)
            take.append(len(self._sizes))
            self._sizes.append(n)
            pos = off + n
        self._end = pos
        if len(take) != len(self._sizes):
            self._keep = operator.itemgetter(*take)

    @property
    def start(self) -> int:
        return self._start

    @property
    def end(self) -> int:
        return self._end

    @property
    def device(self) -> torch.device:
        return self._srcs[0].device

    def bound(self, views: list[torch.Tensor] | None, pick: list[int]) -> _Batch:
        """This batch over `views[i]` for `i` in `pick` (its pieces' positions in the slot's batch), or over
        nothing (a template)."""
        new = _Batch.__new__(_Batch)
        new._start, new._end, new._sizes, new._keep = self._start, self._end, self._sizes, self._keep
        new._srcs = [views[i] for i in pick] if views is not None else []
        return new

    def copy_into(self, buf: torch.Tensor) -> None:
        srcs = self._srcs
        if len(srcs) == 1:
            buf[self._start:self._end].copy_(srcs[0])
        else:
            parts = buf[self._start:self._end].split(self._sizes)
            torch._foreach_copy_(list(parts if self._keep is None else self._keep(parts)), srcs)


def plan(entries: list[TensorEntry], chunk_size: int, slot_bytes: int, borrow: bool) -> list[SlotPlan]:
    """The layout of a capture of `entries` (rows without a source are skipped), slots in hand-over order;
    `borrow` as in `capture` (host tensors only). Each chunk of a row is one piece; pieces start on `_ALIGN`
    bytes."""
    steps: list[SlotPlan] = []
    pieces: list[Piece] | None = None
    batch: list[tuple[int, int, torch.Tensor]] = []
    sources: list[torch.Tensor | None] = []  # per piece, for a slot read in place
    host = True  # no CUDA piece in the slot so far

    def close() -> None:
        assert pieces is not None
        steps.append(SlotPlan(pieces, used, batch=batch, in_place=InPlace(sources) if borrow and host else None))

    used = 0
    for row, e in enumerate(entries):
        src = e.source
        if src is None:
            continue
        nbytes = e.nbytes
        if borrow and nbytes >= BORROW_MIN and not src.is_cuda and src.is_contiguous():
            # A slot per chunk: a slot is hashed by one worker, and a big tensor's chunks should spread
            # over all of them.
            for a, b in spans(nbytes, chunk_size):
                steps.append(SlotPlan([Piece(row, a, b - a, a // chunk_size)], b - a, borrowed=src))
            continue
        for a, b in ((0, nbytes),) if nbytes <= chunk_size else spans(nbytes, chunk_size):
            n = b - a
            if pieces is None or used + n > slot_bytes:
                if pieces is not None:
                    close()
                pieces, batch, sources, host, used = [], [], [], True, 0
            view = src if n == nbytes else src[a:b]
            if n:
                batch.append((used, n, view))
            sources.append(view if n else None)
            host = host and not src.is_cuda
            pieces.append(Piece(row, used, n, a // chunk_size))
            used += -(-n // _ALIGN) * _ALIGN
    if pieces is not None:
        close()
    return steps


def _hand_over(job: SaveJob, slot: Slot, cuda: CudaStaging | None) -> None:
    if cuda is not None:
        slot.event = torch.cuda.Event()
        slot.event.record(cuda.stream)
    job.slots.put(slot)
