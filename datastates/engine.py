"""The save pipeline: capture into reused buffers, then hash, dedup, pack, fsync, commit.

    caller:      save_async -> capture (copy into pool slots) -> returns (state may change)
    background:  hash + stats (worker threads) -> dedup -> pack write -> seal -> commit

A save is a `SaveJob` flowing through these stages; slots go back to the pool
as soon as their chunks are written, so a pool smaller than one state still
completes (capture waits: backpressure, counted in the version's timings).
Jobs commit one at a time in the order they were made.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .chunks import CODEC_RAW, CODEC_ZSTD, ChunkLocation, chunk_id, spans
from .errors import DataStatesError, SaveFailedError
from .packs import PackWriter
from .statetree import TensorEntry
from .stats import Partial, partial

if TYPE_CHECKING:
    from .versions import Version

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
    event: Any = None


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
        with self._cv:
            self._free.append(slot.buf)
            self._cv.notify()

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.slot_bytes


class SaveHandle:
    """The caller's view of one asynchronous save.

    `staged` becomes true once the state's bytes are copied (the caller may
    mutate the tensors from then on); `result()` returns the Version once it
    is durable and committed, or raises what the background raised.
    """

    def __init__(self) -> None:
        self._staged = threading.Event()
        self._done = threading.Event()
        self._version: Version | None = None
        self._error: BaseException | None = None
        self._capture_error: BaseException | None = None
        self._flushed: Callable[[float | None], bool] | None = None

    @property
    def staged(self) -> bool:
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the tensors are copied; True if they are. Raises a capture error."""
        ok = self._staged.wait(timeout)
        if self._capture_error is not None:
            raise SaveFailedError(f"save failed while copying the state: {self._capture_error!r}") \
                from self._capture_error
        return ok

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Version:
        """The committed Version. Raises SaveFailedError (cause chained) or TimeoutError."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save not durable after {timeout} s; call result() again to keep waiting")
        if self._error is not None:
            if isinstance(self._error, DataStatesError):
                raise self._error
            raise SaveFailedError(f"background save failed: {self._error!r}") from self._error
        assert self._version is not None
        return self._version

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save not finished after {timeout} s")
        return self._error

    @property
    def id(self) -> str | None:
        """The version id, once durable (None before)."""
        return self._version.id if self._version else None

    def flushed(self, timeout: float | None = None) -> bool:
        """Wait until the version is durable on the cold tier too; True if it is."""
        v = self.result(timeout)
        if self._flushed is None:
            return True
        return self._flushed(timeout) if v else False

    def _set_staged(self) -> None:
        self._staged.set()

    def _finish(self, version: Version | None, error: BaseException | None) -> None:
        self._version, self._error = version, error
        self._staged.set()
        self._done.set()


@dataclass
class SaveJob:
    """One save moving through the pipeline."""

    tree: dict[str, Any]
    entries: list[TensorEntry]
    request: dict[str, Any]
    handle: SaveHandle
    chunk_size: int
    slots: queue.Queue[Slot | None] = field(default_factory=queue.Queue)
    partials: dict[int, Partial] = field(default_factory=dict)
    new_chunks: dict[bytes, ChunkLocation] = field(default_factory=dict)
    packs: list[PackWriter] = field(default_factory=list)
    bytes_new: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    capture_error: BaseException | None = None
    committed: bool = False
    """The catalog names this version: its packs must never be deleted, whatever fails after."""
    ticket: int = 0
    t0: float = field(default_factory=time.perf_counter)
    slots_done: bool = False
    """The pipeline took the end-of-slots marker (nothing more will come)."""
    go: threading.Event = field(default_factory=threading.Event)
    """Set when the background may start: capture finished, or it waits for slots. Until then
    hashing stays off the cores so the caller's copy runs at full speed."""
    pins: set[str] = field(default_factory=set)
    """Hot packs this save reuses chunks from: eviction keeps them until the save ends."""


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


def capture(job: SaveJob, pool: BufferPool, cuda_stream: Any = None, order: CaptureOrder | None = None) -> None:
    """Copy every stored byte of the job into pool slots, handing each full slot to the pipeline.

    Always ends the job's slot stream (with None), even on error.
    """
    waited = order.wait_turn(job.ticket) if order is not None else 0.0
    slot: Slot | None = None
    t0 = time.perf_counter()
    try:
        if cuda_stream is not None:
            cuda_stream.wait_stream(torch.cuda.current_stream())
        for row, e in enumerate(job.entries):
            if e.source is None:
                continue
            src = e.source
            on_gpu = src.device.type == "cuda"
            for a, b in spans(e.nbytes, job.chunk_size):
                n = b - a
                if slot is None or slot.used + n > pool.slot_bytes:
                    if slot is not None:
                        _hand_over(job, slot, cuda_stream)
                    slot, w = pool.acquire(job.go.set)
                    waited += w
                if n:
                    dst = slot.buf[slot.used:slot.used + n]
                    if on_gpu:
                        with torch.cuda.stream(cuda_stream):
                            dst.copy_(src[a:b], non_blocking=True)
                            src.record_stream(cuda_stream)
                    else:
                        dst.copy_(src[a:b])
                slot.pieces.append(Piece(row, slot.used, n))
                slot.used += -(-n // _ALIGN) * _ALIGN
        if slot is not None:
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


def _hand_over(job: SaveJob, slot: Slot, cuda_stream: Any) -> None:
    if cuda_stream is not None:
        slot.event = torch.cuda.Event()
        slot.event.record(cuda_stream)
    job.slots.put(slot)


Hashed = list[tuple[bytes, Partial | None, bytes | None]]


def _hash_slot(slot: Slot, entries: list[TensorEntry], zstd_level: int,
               has_chunks: Callable[[list[bytes]], list[bool]] | None = None) -> Hashed:
    if slot.event is not None:
        slot.event.synchronize()
    out = []
    arr = slot.buf.numpy()
    cids = [chunk_id(arr[p.start:p.start + p.length].data) for p in slot.pieces]
    # Compress only what will be written: a chunk the store has is skipped by the writer anyway.
    stored = has_chunks(cids) if zstd_level and has_chunks is not None else [False] * len(cids)
    for p, cid, have in zip(slot.pieces, cids, stored):
        mv = arr[p.start:p.start + p.length].data
        e = entries[p.row]
        st = partial(slot.buf[p.start:p.start + p.length], e.dtype) if e.kind == "tensor" else None
        packed = None
        if zstd_level and p.length >= 4096 and not have:
            import zstandard

            z = zstandard.ZstdCompressor(level=zstd_level).compress(mv)
            if len(z) < p.length * 0.95:
                packed = z
        out.append((cid, st, packed))
    return out


class Pipeline:
    """The background half: one thread that takes jobs in order, plus hashing workers."""

    def __init__(self, commit: Callable[[SaveJob], Version],
                 has_chunks: Callable[[SaveJob | None, list[bytes]], list[bool]],
                 new_pack: Callable[[], PackWriter], pool: BufferPool, workers: int = 2, zstd_level: int = 0,
                 pack_bytes: int = 1 << 31, on_error: Callable[[SaveJob, BaseException], None] | None = None,
                 guard: Callable[[], Any] | None = None) -> None:
        self._guard = guard
        self._commit = commit
        self._has_chunks = has_chunks
        self._new_pack = new_pack
        self.pool = pool
        self.zstd_level = zstd_level
        self.pack_bytes = pack_bytes
        self._on_error = on_error
        self._jobs: queue.Queue[SaveJob | None] = queue.Queue()
        # One intra-op thread per worker: torch ops here otherwise leave thread pools that slow the
        # caller's next copies (measured: 1 GiB copy 0.110 s -> 0.146-0.200 s).
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="datastates-hash",
                                           initializer=torch.set_num_threads, initargs=(1,))
        self._inflight = 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="datastates-pipeline", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        with self._cv:
            self._inflight += 1
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until every submitted job has finished (committed or failed)."""
        with self._cv:
            while self._inflight:
                self._cv.wait()

    def stop(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._thread.join()
        self._workers.shutdown()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                with self._guard() if self._guard else nullcontext():
                    self._process(job)
                    version = self._commit(job)
                job.handle._finish(version, None)
            except BaseException as exc:
                self._drain(job)
                for w in job.packs:
                    w.abort()
                    if not job.committed:
                        w.path.unlink(missing_ok=True)
                if self._on_error:
                    self._on_error(job, exc)
                job.handle._finish(None, exc)
            finally:
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()

    def _drain(self, job: SaveJob) -> None:
        # The capture may still be filling slots: keep taking them back so it cannot block forever.
        while not job.slots_done:
            slot = job.slots.get()
            if slot is None:
                job.slots_done = True
            else:
                self.pool.release(slot)

    def _process(self, job: SaveJob) -> None:
        window: deque[tuple[Slot, Future[list[tuple[bytes, Partial | None, bytes | None]]]]] = deque()
        job.go.wait()
        t0 = time.perf_counter()
        try:
            while (slot := job.slots.get()) is not None:
                # The workers only ask whether compressing is worth it: no job, nothing pinned.
                window.append((slot, self._workers.submit(_hash_slot, slot, job.entries, self.zstd_level,
                                                          functools.partial(self._has_chunks, None))))
                # Hash the next slot while writing this one, but never sit on slots waiting for more:
                # the capture may need them back to go on (pool smaller than the state).
                while window and (len(window) >= 2 or job.slots.empty()):
                    self._write(job, *window.popleft())
            job.slots_done = True
            while window:
                self._write(job, *window.popleft())
        finally:
            for slot, fut in window:
                fut.cancel()
                self.pool.release(slot)
        if job.capture_error is not None:
            raise job.capture_error
        for w in job.packs:
            w.seal()
        job.timings["write_s"] = time.perf_counter() - t0
        for row, p in job.partials.items():
            job.entries[row].stats = p.final()

    def _write(self, job: SaveJob, slot: Slot, fut: Future[list[tuple[bytes, Partial | None, bytes | None]]]) -> None:
        try:
            results = fut.result()
            known = self._has_chunks(job, [cid for cid, _, _ in results])
            arr = slot.buf.numpy()
            for piece, (cid, st, packed), have in zip(slot.pieces, results, known):
                e = job.entries[piece.row]
                e.chunks.append(cid)
                if st is not None:
                    job.partials.setdefault(piece.row, Partial()).merge(st)
                if have or cid in job.new_chunks:
                    continue
                w = job.packs[-1] if job.packs and job.packs[-1].size < self.pack_bytes else None
                if w is None:
                    w = self._new_pack()
                    job.packs.append(w)
                if packed is not None:
                    loc = w.add(cid, packed, piece.length, CODEC_ZSTD)
                else:
                    loc = w.add(cid, arr[piece.start:piece.start + piece.length].data, piece.length, CODEC_RAW)
                job.new_chunks[cid] = loc
                job.bytes_new += loc.length
        finally:
            self.pool.release(slot)
