"""A save as data: the `SaveJob` that flows through capture and the pipeline, and the
`SaveHandle` the caller holds (`staged`, `result`, `flushed`)."""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..base.collector import paused
from ..errors import DataStatesError, SaveFailedError, StoreClosedError, name_store
from ..objects.chunks import ChunkLocation
from ..objects.packs import PackWriter
from .buffers import Slot
from .stats import Partial
from .tree import Rows, TensorEntry

if TYPE_CHECKING:
    import torch

    from ..meta.versions import Version


class SaveHandle:
    """The caller's view of one asynchronous save.

    `staged` becomes true once the state's bytes are copied (the caller may
    mutate the tensors from then on); `result()` returns the Version once it
    is durable and committed, or raises what the background raised.

    In a process forked from the one that saved (a DataLoader or multiprocessing worker), `result()`,
    `exception()`, `wait_staged()` and `flushed()` raise StoreClosedError: the save runs, and commits, in the
    parent; the child has none of its threads, and would wait for ever.
    """

    def __init__(self) -> None:
        self._staged = threading.Event()
        self._done = threading.Event()
        self._version: Version | None = None
        self._error: BaseException | None = None
        self._capture_error: BaseException | None = None
        self._flushed: Callable[[float | None], bool] | None = None
        self._commit_lock = threading.Lock()
        self._abandoned = False
        self._committing = False
        self.abandonable = True
        """False for a collective save: every rank commits it together, so one rank cannot drop it (it copies the
        state before its background reads it anyway)."""
        self.store: str | None = None
        """The store's directory, put into the command hints of what `result()` raises (as every `Store` method
        does): a hint pasted into a shell finds no store of its own."""
        self._pid = os.getpid()
        self.delivered = False
        """True once `result()` raised this save's error or `exception()` returned it: the store then does not
        raise it again at the next call."""

    @property
    def staged(self) -> bool:
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the tensors are copied; True if they are. Raises a capture error, and StoreClosedError in
        a forked child."""
        self._check_process()
        ok = self._staged.wait(timeout)
        if self._capture_error is not None:
            raise self._named(SaveFailedError(f"save failed while copying the state: {self._capture_error!r}")) \
                from self._capture_error
        return ok

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Version:
        """The committed Version. Raises SaveFailedError (cause chained) or TimeoutError; StoreClosedError in a
        process forked from the one that saved."""
        self._check_process()
        if not self._done.wait(timeout):
            raise TimeoutError(f"save not durable after {timeout} s; call result() again to keep waiting")
        if self._error is not None:
            self.delivered = True
            if isinstance(self._error, DataStatesError):
                raise self._named(self._error)
            raise self._named(SaveFailedError(f"background save failed: {self._error!r}")) from self._error
        assert self._version is not None
        return self._version

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error once it is finished (None if it committed). Raises TimeoutError; StoreClosedError in
        a forked child."""
        self._check_process()
        if not self._done.wait(timeout):
            raise TimeoutError(f"save not finished after {timeout} s")
        self.delivered = True
        return self._named(self._error) if isinstance(self._error, DataStatesError) else self._error

    def abandon(self) -> bool:
        """Make sure this save is never committed unless its commit has begun; True if it will not be. For a
        synchronous save interrupted (KeyboardInterrupt) while it waits: it reads the caller's tensors in place,
        and the caller, back in control, may change them while the background still hashes and writes them, so
        the bytes written could differ from the ids they were hashed under. Committed, such a chunk made the
        version unloadable, and every later save of the same values reused it. Once the commit has begun every
        byte was read, and the version is whole. An abandoned save's error is not raised again by the store.
        False, changing nothing, for a save that is not `abandonable` (a collective one)."""
        with self._commit_lock:
            if self._committing or not self.abandonable:
                return False
            self._abandoned = self.delivered = True
            return True

    def _may_commit(self) -> bool:
        """Called by the pipeline once every byte is written, before the commit: False if the save was
        abandoned, else True, and `abandon` can no longer stop it."""
        with self._commit_lock:
            self._committing = not self._abandoned
            return self._committing

    def _check_process(self) -> None:
        # Even for a save that was done at the fork: one answer whatever the timing, as every Store call gives there.
        if os.getpid() != self._pid:
            raise self._named(StoreClosedError(
                f"this save belongs to process {self._pid}, which this one was forked from: it runs and commits "
                "there, and this process has none of its threads (it would wait for ever). Wait for it in that "
                "process"))

    def _named(self, exc: DataStatesError) -> DataStatesError:
        if self.store is not None:
            name_store(exc, self.store)
        return exc

    @property
    def id(self) -> str | None:
        """The version id, once durable (None before)."""
        return self._version.id if self._version else None

    def flushed(self, timeout: float | None = None) -> bool:
        """Wait until the version is durable on the cold tier too; True if it is. Raises what `result()` raises."""
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


class KnownStats:
    """Row -> what a store last committed under the row's key, for a tensor of the same dtype. For a single-chunk
    tensor: its chunk id, byte count and stats; a piece that holds the whole tensor and hashes to that id has
    those stats. For a tensor of several chunks: its chunk ids and each chunk's own summary (`pieces`); a piece
    whose id is the one its row had at the same chunk number has that summary (the same bytes of the same dtype),
    so a save that changed a few of a big state's tensors summarizes only their chunks. Made by `prepare` as
    columns when the job's hashing starts (on the pipeline thread, after the last commit's rows are in), so a
    worker looks a piece up with an index, and a save of 8,000 tensors makes a few lists, not 8,000 tuples for the
    cyclic collector to walk."""

    __slots__ = ("_job", "_memory", "cids", "nbytes", "stats", "pieces", "stored")

    def __init__(self, job: SaveJob, memory: SaveMemory) -> None:
        # A weak reference: the job holds this, and a cycle would keep every finished job (its rows, chunk
        # lists, stats) alive until the cyclic collector runs, instead of freeing it when the pipeline is done.
        self._job, self._memory = weakref.ref(job), memory
        self.cids: list[bytes | None] = []
        self.nbytes: list[int] = []
        self.stats: list[dict[str, Any] | None] = []
        self.pieces: list[tuple[list[bytes], list[Partial]] | None] = []
        """Per row of several chunks: the chunk ids and per-chunk summaries last committed under its key."""
        self.stored = False
        """Whether every chunk id of `cids` is still indexed (the catalog's `chunk_drops` token read for this
        job is the one the memory was recorded under): the workers need not look them up."""

    def prepare(self, drops: bytes | None) -> None:
        """Fill the columns from the memory as it is now; `drops` is the catalog's token read under the job's
        guard (None where it cannot be trusted: tiers, collective saves)."""
        job = self._job()
        if job is None:
            return
        by_key = self._memory.by_key
        cids: list[bytes | None] = []
        stats: list[dict[str, Any] | None] = []
        pieces: list[tuple[list[bytes], list[Partial]] | None] = []
        for e in job.entries:
            last = by_key.get(e.key) if e.kind == "tensor" else None
            if last is None or last.dtype != e.dtype:
                cids.append(None)
                stats.append(None)
                pieces.append(None)
            elif len(last.chunks) == 1:
                cids.append(last.chunks[0])
                stats.append(last.stats)
                pieces.append(None)
            else:
                cids.append(None)
                stats.append(None)
                pieces.append((last.chunks, last.piece_stats) if last.piece_stats is not None else None)
        self.cids, self.stats, self.pieces = cids, stats, pieces
        self.nbytes = [e.nbytes for e in job.entries]
        self.stored = drops is not None and drops == self._memory.drops


class SaveMemory:
    """What a saver remembers of its last commits, for `reuse_unchanged` and `KnownStats`: per key, the row
    of the tensor last committed under it (rows are never changed once committed; their sources are dropped),
    and the catalog's `chunk_drops` token under which every chunk those rows name was indexed (None when
    unknown). Every row has the saver's chunk size."""

    __slots__ = ("by_key", "drops")

    def __init__(self) -> None:
        self.by_key: dict[str, TensorEntry] = {}
        self.drops: bytes | None = None


@dataclass
class SaveJob:
    """One save moving through the pipeline."""

    tree: dict[str, Any]
    rows: Rows
    """The rows, or until first asked for (`entries`), a function that makes them."""
    request: dict[str, Any]
    handle: SaveHandle
    chunk_size: int
    slots: queue.Queue[Slot | None] = field(default_factory=queue.Queue)
    partials: dict[int, Partial] = field(default_factory=dict)
    """Per row summarized piece by piece: the merge of its pieces' summaries so far (for a row of several chunks,
    a copy of the first: never one of `piece_stats`)."""
    piece_stats: dict[int, list[Partial]] = field(default_factory=dict)
    """Per row of several chunks: each chunk's own summary, in chunk order (becomes `TensorEntry.piece_stats`)."""
    new_chunks: dict[bytes, ChunkLocation] = field(default_factory=dict)
    packs: list[PackWriter] = field(default_factory=list)
    bytes_new: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    capture_error: BaseException | None = None
    capture_raised: bool = False
    """The capture failed on the caller's thread and raised there (a sync save, or a KeyboardInterrupt during a
    copy): the caller has heard of it, so the store does not report it again with the next call."""
    committed: bool = False
    """The catalog names this version: its packs must never be deleted, whatever fails after."""
    ticket: int = 0
    t0: float = field(default_factory=time.perf_counter)
    slots_done: bool = False
    """The pipeline took the end-of-slots marker (nothing more will come)."""
    go: threading.Event = field(default_factory=threading.Event)
    """Set when the background may start: capture finished, or it waits for slots. Until then
    hashing stays off the cores so the caller's copy runs at full speed."""
    dist: Any = None
    """For a collective save: its `save.collective.DistPlan` (None on one process)."""
    failure: BaseException | None = None
    """A collective save's own failure, carried to the commit so every rank hears of it."""
    known_stats: KnownStats | None = None
    """What this store last saved under each row's key, asked for by the hashing workers (see `KnownStats`)."""
    drops: bytes | None = None
    """The catalog's `chunk_drops` token read when the job's hashing started, under its guard (None with tiers
    or for a collective save)."""
    reused: list[bytes] = field(default_factory=list)
    """Chunk ids `reuse_unchanged` pointed rows at without reading their tensors."""
    reused_under: bytes | None = None
    """The `chunk_drops` token under which `reused` were known indexed (None: the pins keep them, with tiers)."""
    encoded: dict[str, Any] | None = None
    """The kept flatten's `encoded` when the rows came from one: the manifest's constant columns, encoded once."""
    manifest: tuple[str, memoryview] | None = None
    """The manifest's id and bytes when the pipeline encoded it beside the job's last writes (else the commit
    encodes it)."""
    pins: set[str] = field(default_factory=set)
    """Hot packs this save reuses chunks from: eviction keeps them until the save ends."""
    holds: list[torch.Tensor] | None = None
    """The caller's tensors when the rows have no byte views of them (a kept flatten's addressed layout reads
    their memory by address: `tree.Layouts.addressed`): held until the capture is over, or for a capture that
    borrows (its slots are read in place by the hashing workers and the writer) until the pipeline is done with
    the job."""
    _keep_sources: bool = True

    @property
    def entries(self) -> list[TensorEntry]:
        """The rows, made on first use by whichever thread asks first (the pipeline's, for a `save_async` of a
        cached flatten: off the caller's time)."""
        rows = self.rows
        if isinstance(rows, list):
            return rows
        with _ROWS_LOCK:
            if not isinstance(self.rows, list):
                with paused():  # thousands of objects at once, as in the caller's flatten (see `Saver.submit`)
                    made = self.rows()
                self.rows = made
                # After publishing them, as `drop_sources` sets the flag before looking: one of us drops them.
                if not self._keep_sources:
                    for e in made:
                        e.source = None
            return self.rows

    def drop_sources(self, keep_holds: bool = False) -> None:
        """Forget the caller's tensors (the capture is over): now on rows already made, or on those made later;
        `holds` too unless `keep_holds` (the pipeline drops them when it is done with the job). Never waits for
        rows being made."""
        self._keep_sources = False
        if not keep_holds:
            self.holds = None
        rows = self.rows
        if isinstance(rows, list):
            for e in rows:
                e.source = None


_ROWS_LOCK = threading.Lock()
"""Guards the making of a job's rows; taken only while a job's rows are not made yet."""
