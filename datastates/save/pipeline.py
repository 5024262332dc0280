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
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConflictError, SaveFailedError, StoreClosedError
from ..objects.chunks import CODEC_ZSTD, chunk_id
from ..objects.packs import PackWriter
from .buffers import BufferPool, Piece, Slot
from .job import KnownStats, SaveJob
from .manifest import encode
from .stats import BATCHED_DTYPES, Partial, partial, partial_gathered, partial_many
from .tree import TensorEntry

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_AHEAD_BYTES = 64 << 20
"""Bytes of captured slots the workers may hash ahead of the one being written, so that every worker stays busy
while the writer writes in order; bytes, not slots, since one big slot may take as long as many small ones
(one slot ahead ran a save at one hashing core's speed; docs/perf-notes.md "Hashing ahead")."""

_LEAST_WEIGHT = 1 / 16
"""The least a chunk borrowed from the caller's tensors weighs in the window, per byte (`window_weight`): at most
16 x `_AHEAD_BYTES` of them (1 GiB) wait for the workers ahead of the writer."""


def window_weight(used: int, borrowed: bool, seen: int, written: int, last_fraction: float) -> int:
    """What a slot of `used` bytes counts against `_AHEAD_BYTES`.

    A slot of pool memory counts its bytes: the window is what bounds the memory a capture holds ahead. A chunk
    borrowed from the caller's tensor (a synchronous save) holds none: it counts what it is expected to cost the
    writer, its bytes times the fraction of the bytes the writer has written so far (`written` of `seen`, once
    `_AHEAD_BYTES` went through; before that, the fraction of the last job, `last_fraction`), and at least
    `_LEAST_WEIGHT` of them. So a save that finds most chunks stored keeps the workers hashing while its writer
    writes the changed ones (they waited on the writer: `transformer`'s partial save 0.233 -> 0.187 s), and a
    save that writes everything keeps 64 MiB ahead (hashing further ahead slowed its writes; docs/perf-notes.md
    "Hashing ahead by what the writer will write")."""
    if not borrowed:
        return used
    fraction = written / seen if seen >= _AHEAD_BYTES else last_fraction
    return int(used * max(fraction, _LEAST_WEIGHT))

Stats = Partial | dict[str, Any] | None
"""A piece's statistics: a mergeable summary (Partial), final statistics (dict: a whole tensor summarized in a
batched run, or known from an earlier save of the same bytes), or none."""
Hashed = list[tuple[bytes, Stats, bytes | None, bool]]
"""Per piece: chunk id, statistics, compressed bytes (or None), and whether the catalog had the chunk when hashed."""
Write = list[tuple[Piece, bytes]] | tuple[bytes, bytes, int]
"""A write `Pipeline._take` decides on: a run of raw chunks back to back in a slot (piece, chunk id), or one
compressed chunk (chunk id, its bytes, raw length)."""


def _hash_slot(slot: Slot, entries: list[TensorEntry], zstd_level: int,
               has_chunks: Callable[[list[bytes]], list[bool]] | None = None,
               known: KnownStats | None = None, copy_first: bool = False) -> Hashed:
    """Chunk id, statistics and compressed bytes of each piece of `slot`. With `copy_first`, a slot read in
    place is copied into its buffer before hashing: for pieces that changed since the last save (all that a
    `reuse_unchanged` save captures), whose bytes will be written anyway. Hashing then reads the copy, and no
    byte view of the caller's memory is made (~10 us per piece, more than the hashing of 64 KiB)."""
    if slot.event is not None:
        slot.event.synchronize()
        slot.keep = None  # the copies are done: the caller's CUDA tensors may go
    out = []
    arr = slot.buf.numpy()
    if slot.in_place is not None and copy_first:
        slot.fill(list(range(len(slot.pieces))))
    in_place = slot.in_place is not None and not copy_first  # read where it lies, copied below only as needed
    if in_place:
        assert slot.in_place is not None
        cids = list(map(chunk_id, slot.in_place.views()))
    else:
        cids = [chunk_id(arr[p.start:p.start + p.length].data) for p in slot.pieces]
    kinds = [entries[p.row].kind for p in slot.pieces]
    found: list[Stats] = [None] * len(cids)
    if known is not None and known.cids:
        known_cids, known_nbytes, known_stats, known_pieces = known.cids, known.nbytes, known.stats, known.pieces
        for i, (p, cid) in enumerate(zip(slot.pieces, cids)):
            row = p.row
            if known_cids[row] == cid and known_nbytes[row] == p.length:  # the whole tensor, as last committed
                found[i] = known_stats[row]
            elif (last := known_pieces[row]) is not None and p.index < len(last[0]) and last[0][p.index] == cid:
                found[i] = last[1][p.index]  # a chunk of a big tensor, as last committed: its own summary
    # Ask the catalog here, beside the hashing, not on the writer's thread: a save of thousands of new chunks
    # then costs the writer no lookup at all (they were ~20 % of its time); with tiers it confirms only the
    # chunks found here, and pins their packs (`Pipeline.confirm_found`). Also, compress only what will be written.
    # A piece whose bytes are what this store last committed under its key needs no lookup while no chunk has
    # left the index since (`KnownStats.stored`): 7,200 of a partial save's 8,000.
    if has_chunks is None:
        stored = [False] * len(cids)
    elif known is not None and known.stored:
        stored = [k is not None for k in found]
        ask = [i for i, k in enumerate(found) if k is None]
        if ask:
            for i, have in zip(ask, has_chunks([cids[i] for i in ask])):
                stored[i] = have
    else:
        stored = has_chunks(cids)
    if in_place:
        # Copy what will be written (new here) or summarized (a tensor's stats not known from its last save).
        slot.fill([i for i, (have, kind, k) in enumerate(zip(stored, kinds, found))
                   if not have or (kind == "tensor" and k is None)])
    stats = _slot_stats(slot, entries, found)
    for p, cid, have, st in zip(slot.pieces, cids, stored, stats):
        packed = None
        if zstd_level and p.length >= 4096 and not have:
            import zstandard

            z = zstandard.ZstdCompressor(level=zstd_level).compress(arr[p.start:p.start + p.length].data)
            if len(z) < p.length * 0.95:
                packed = z
        out.append((cid, st, packed, have))
    return out


def _slot_stats(slot: Slot, entries: list[TensorEntry], found: list[Stats]) -> list[Stats]:
    """The statistics of each piece of `slot`: known from an earlier save of the same bytes (`found`, per
    piece), or computed; pieces of one float dtype and one length (thousands of small tensors) are summarized
    together: in place when they lie back to back, gathered when others lie between them (known ones, or pieces of
    another length or dtype)."""
    out: list[Stats] = [None] * len(slot.pieces)
    groups: dict[tuple[torch.dtype, int], list[int]] = {}  # pieces to summarize, by dtype and length
    for i, (p, k) in enumerate(zip(slot.pieces, found)):
        e = entries[p.row]
        if e.kind != "tensor":
            continue
        if k is not None:
            out[i] = k
        elif e.dtype in BATCHED_DTYPES and p.length:
            groups.setdefault((e.dtype, p.length), []).append(i)
        else:
            out[i] = partial(slot.buf[p.start:p.start + p.length], e.dtype)
    for (dtype, length), group in groups.items():
        if len(group) > 1:
            pieces = [slot.pieces[i] for i in group]
            # Pieces that are whole tensors (thousands of small ones) get their final statistics here: no
            # Partial per piece to keep, merge and finalize on the pipeline thread.
            whole = all(length == entries[p.row].nbytes for p in pieces)
            first = pieces[0]
            if all(b.start == a.start + length for a, b in zip(pieces, pieces[1:])):
                many = partial_many(slot.buf[first.start:first.start + length * len(pieces)], dtype, len(pieces),
                                    whole)
            else:
                many = partial_gathered([slot.buf[p.start:p.start + length] for p in pieces], dtype, whole)
            for i, st in zip(group, many):
                out[i] = st
        for i in group:  # alone, or holding a non-finite value (`partial_many` leaves those to `partial`)
            if out[i] is None:
                p = slot.pieces[i]
                out[i] = partial(slot.buf[p.start:p.start + p.length], dtype)
    return out


class _Handoff:
    """The last slots of a save, handed to one worker to write: exactly one side, the worker or the pipeline
    whose `submit` failed, claims them, writes or not, and releases them."""

    def __init__(self) -> None:
        self._claimed = threading.Lock()
        self.started = threading.Event()
        """Set by the worker once it has claimed the slots, before its first write."""
        self.finished = threading.Event()
        """Set by the worker when it is done with the slots."""

    def claim(self) -> bool:
        """True for the first caller only."""
        return self._claimed.acquire(blocking=False)


class Pipeline:
    """The background half: one thread that takes jobs in order, plus hashing workers."""

    def __init__(self, commit: Callable[[SaveJob], Any],
                 has_chunks: Callable[[SaveJob | None, list[bytes]], list[bool]],
                 new_pack: Callable[[], PackWriter], pool: BufferPool, workers: int = 2, zstd_level: int = 0,
                 pack_bytes: int = 1 << 31, on_error: Callable[[SaveJob, BaseException], None] | None = None,
                 guard: Callable[[], Any] | None = None, after_commit: Callable[[SaveJob], None] | None = None,
                 chunk_drops: Callable[[], bytes] | None = None) -> None:
        self._guard = guard
        self.chunk_drops = chunk_drops
        """`Catalog.chunk_drops` where only a drop from the index removes a chunk (no tiers), else None (chunks
        may leave without one: eviction from a hot tier). Read for each job under its guard, for
        `KnownStats.stored` and to check `reuse_unchanged`'s chunks."""
        self._after_commit = after_commit
        """Run on the pipeline thread after a committed job's handle is finished, before the next job: work the
        caller of a sync save need not wait for (`Saver.remember`: 4.7 ms per 8,000 tensors)."""
        self.settled = threading.Event()
        """Clear while `after_commit` of a committed job is still to run; those who need its effect wait."""
        self.settled.set()
        self.confirm_found = chunk_drops is None
        """Whether a chunk the hashing workers found stored must be looked up again (and pinned) by the writer.
        Needed where chunks can leave while a job runs (eviction from a hot tier); otherwise only a drop from
        the index removes one, and nothing is dropped while a job holds `guard` (gc and repair take the tier's
        exclusive lock), so the workers' answer stands, and a save finding 7,200 chunks stored skips as many
        lookups."""
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
        self._stopped = False
        self.written_fraction = 1.0
        """Of the bytes of the last finished job's slots, the fraction its writer wrote (chunks not stored yet):
        `window_weight`'s guess for the start of the next one."""
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="datastates-pipeline", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> None:
        """Queue `job`. Raises StoreClosedError once `stop` has drained the pipeline: no thread would ever take it
        (its handle would never finish)."""
        with self._cv:
            if self._stopped:
                raise StoreClosedError("the save pipeline was stopped (its store is closed); nothing was queued")
            self._inflight += 1
        self._jobs.put(job)

    def wait(self) -> None:
        """Block until every submitted job has finished (committed or failed)."""
        with self._cv:
            while self._inflight:
                self._cv.wait()

    def stop(self) -> None:
        """Wait for every job, refuse new ones (`submit`), then end the thread and the workers. Interrupted while
        it waits (KeyboardInterrupt), the jobs go on and the pipeline still takes new ones; call it again."""
        with self._cv:
            while self._inflight:
                self._cv.wait()
            self._stopped = True  # in the same hold of the lock as the count found 0: no job slips in between
        self._jobs.put(None)
        self._thread.join()
        self._workers.shutdown()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                with self._guard() if self._guard else nullcontext():
                    try:
                        self._process(job)
                    except BaseException as exc:
                        if job.dist is None:
                            raise
                        job.failure = exc  # the other ranks wait in the commit's collectives: tell them
                    if job.dist is None and not job.handle._may_commit():
                        raise SaveFailedError("save abandoned by its caller (interrupted) before its commit; "
                                              "nothing of it is visible")
                    version = self._commit(job)
                follow = self._after_commit is not None and job.committed
                if follow:
                    self.settled.clear()
                job.handle._finish(version, None)
                if follow:
                    self._follow_up(job)
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
                job.holds = None  # what a borrowing capture's slots read by address: nothing reads them now
                with self._cv:
                    self._inflight -= 1
                    self._cv.notify_all()
            # Freed now, between saves, not when the next job arrives: a full save of 8,000 tensors left 1-4 ms of
            # objects (chunk locations, lists per row) that the next save's hashing would wait for.
            del job

    def _follow_up(self, job: SaveJob) -> None:
        assert self._after_commit is not None
        # Let the caller of a sync save, woken by `_finish`, take the GIL first: it otherwise waited for this
        # (small: 1.5-8 ms of `remember`) before its save returned; this needs no hurry (`settled` tells who waits).
        time.sleep(0)
        try:
            self._after_commit(job)
        except Exception:  # bookkeeping for later saves: the version itself is committed and reported
            log.exception("after the commit of a save")
        finally:
            self.settled.set()

    def _drain(self, job: SaveJob) -> None:
        # The capture may still be filling slots: keep taking them back so it cannot block forever.
        while not job.slots_done:
            slot = job.slots.get()
            if slot is None:
                job.slots_done = True
            else:
                self.pool.release(slot)

    def _process(self, job: SaveJob) -> None:
        window: deque[tuple[Slot, Future[Hashed], int]] = deque()
        ahead = 0  # what the slots in the window weigh (`window_weight`)
        seen = written = 0  # bytes of the slots through the writer, and of those, written
        job.go.wait()
        t0 = time.perf_counter()
        self._prepare(job)
        try:
            while (slot := job.slots.get()) is not None:
                # The workers only ask whether compressing is worth it: no job, nothing pinned.
                fut = self._workers.submit(_hash_slot, slot, job.entries, self.zstd_level,
                                           functools.partial(self._has_chunks, None), job.known_stats,
                                           bool(job.reused))
                weight = window_weight(slot.used, slot.borrowed, seen, written, self.written_fraction)
                window.append((slot, fut, weight))
                ahead += weight
                # Hash the next slots while writing this one, but never sit on slots waiting for more:
                # the capture may need them back to go on (pool smaller than the state).
                while window and (ahead > _AHEAD_BYTES or job.slots.empty()):
                    oldest, hashed, oldest_weight = window.popleft()
                    ahead -= oldest_weight
                    seen += oldest.used
                    written += self._write(job, oldest, hashed)
            job.slots_done = True
            while window:
                wait([window[0][1]])
                if job.dist is None and job.capture_error is None and all(fut.done() for _, fut, _ in window):
                    # Every slot left is hashed: take them all now, which completes the rows, and encode the
                    # manifest while their chunks are written (`small` with 10 % changed: the encode, ~10 ms, ran
                    # after the last ~10 ms of writes). The writes go to an idle worker and the encode stays on
                    # this thread: encoded on a worker, its buffers came from that thread's malloc arena, and the
                    # first save of `small` peaked 1.5 MiB higher (145.9 against 144.5 MiB, bound 146.0).
                    queued: set[bytes] = set()
                    ops = [self._take(job, slot, fut.result(), queued) for slot, fut, _ in window]
                    self._finish_rows(job)
                    last = []
                    for todo, count in ops:
                        oldest, _, _ = window.popleft()
                        seen += oldest.used
                        written += count
                        last.append((oldest, todo))
                    handoff = _Handoff()
                    try:
                        writing = self._workers.submit(self._emit_all, job, last, handoff)
                    except BaseException:
                        # `submit` queues the call before it starts a thread, and that start may raise: the call
                        # may run anyway. Whoever claims the slots first writes and releases them; they are out
                        # of the window, so the `finally` below no longer has them.
                        if handoff.claim():
                            for slot, _ in last:
                                self.pool.release(slot)
                        else:
                            handoff.finished.wait()  # its writes end before the job's packs are aborted
                        raise
                    # Until the worker holds the GIL and goes into its first write: taken by the encode first, it
                    # waited for a switch interval (5 ms) and more before writing anything.
                    handoff.started.wait()
                    try:
                        job.manifest = encode(job.tree, job.entries, job.chunk_size, job.encoded)
                    finally:
                        writing.result()  # the writes end (or fail) before anything else happens to the job
                    break
                oldest, hashed, _ = window.popleft()
                seen += oldest.used
                written += self._write(job, oldest, hashed)
        finally:
            for slot, fut, _ in window:
                if not fut.cancel():
                    # Running: a worker may still copy into this slot (`Slot.fill`), and once released the slot may
                    # hold another save's bytes. Wait for it (at most one slot's hashing).
                    wait([fut])
                self.pool.release(slot)
        if seen:
            self.written_fraction = written / seen
        if job.capture_error is not None:
            raise job.capture_error
        for w in job.packs:
            w.seal()
        job.timings["write_s"] = time.perf_counter() - t0
        if job.manifest is None:
            self._finish_rows(job)

    @staticmethod
    def _finish_rows(job: SaveJob) -> None:
        """Put each row's final statistics in, and the per-chunk summaries of rows of several chunks (for the next
        save's `KnownStats`): once every slot is taken."""
        entries = job.entries
        for row, p in job.partials.items():
            entries[row].stats = p.final()
        for row, kept in job.piece_stats.items():
            e = entries[row]
            if len(kept) == len(e.chunks):  # else a piece had no summary: nothing to reuse next time
                e.piece_stats = kept

    def _prepare(self, job: SaveJob) -> None:
        """Under the job's guard (no gc runs until it ends): read the catalog's `chunk_drops` token, prepare
        the known stats, and make sure the chunks `reuse_unchanged` named without reading them are indexed.
        Raises ConflictError, before anything is written, if a gc removed one since the caller's save call."""
        if self.chunk_drops is not None and job.dist is None:
            job.drops = self.chunk_drops()
        if job.known_stats is not None:
            job.known_stats.prepare(job.drops)
        if job.reused_under is None or job.reused_under == job.drops:
            return
        gone = [cid for cid, have in zip(job.reused, self._has_chunks(job, job.reused)) if not have]
        if gone:
            raise ConflictError(
                f"{len(gone)} chunks this save reuses (first {gone[0].hex()[:12]}) were removed by a gc or repair "
                "since the save was called; nothing was written: save again")

    def _write(self, job: SaveJob, slot: Slot, fut: Future[Hashed]) -> int:
        """Take `slot`'s hashing results into the job and write its new chunks; the bytes written (raw). The slot
        goes back to the pool."""
        try:
            todo, written = self._take(job, slot, fut.result(), set())
        except BaseException:
            self.pool.release(slot)
            raise
        self._emit(job, slot, todo)
        return written

    def _take(self, job: SaveJob, slot: Slot, results: Hashed, queued: set[bytes]) -> tuple[list[Write], int]:
        """Put `slot`'s chunk ids and statistics into the job's rows, and say what of it to write: runs of raw
        chunks lying back to back in the slot, and compressed chunks, in slot order; with the bytes (raw) they
        hold. `queued`: chunks taken to be written but not written yet (`_emit` writes them), added to here; a chunk
        stored, written or queued is not written again."""
        # What the workers found stored, confirmed (and pinned) now when chunks may go meanwhile (see
        # `confirm_found`): a chunk gone since is written again; one stored since by another writer is
        # written twice, which costs only its bytes.
        entries = job.entries
        maybe = [cid for cid, _, _, stored in results if stored] if self.confirm_found else []
        known = dict(zip(maybe, self._has_chunks(job, maybe))) if maybe else {}
        todo: list[Write] = []
        run: list[tuple[Piece, bytes]] = []  # new raw chunks back to back in the slot: written together
        written = 0
        for i, (piece, (cid, st, packed, stored)) in enumerate(zip(slot.pieces, results)):
            have = stored and (not self.confirm_found or known[cid])
            e = entries[piece.row]
            e.chunks.append(cid)
            if isinstance(st, dict):
                e.stats = st  # made for this piece, or an earlier save's: stats dicts are never changed
            elif st is not None:
                merged = job.partials.get(piece.row)
                if e.nbytes > job.chunk_size:
                    # Kept as they are for the next save (`KnownStats.pieces`); the merge goes into a copy.
                    job.piece_stats.setdefault(piece.row, []).append(st)
                    if merged is None:
                        job.partials[piece.row] = replace(st)
                    else:
                        merged.merge(st)
                elif merged is None:
                    job.partials[piece.row] = st  # made for this piece alone: no one else holds it
                else:
                    merged.merge(st)
            if have or cid in job.new_chunks or cid in queued:
                continue
            if stored:
                slot.fill([i])  # found by the worker, gone since: written again, so its bytes are needed now
            if run and (packed is not None or piece.start != run[-1][0].start + run[-1][0].length):
                todo.append(run)
                run = []
            written += piece.length
            queued.add(cid)
            if packed is not None:
                todo.append((cid, packed, piece.length))
            else:
                run.append((piece, cid))
        if run:
            todo.append(run)
        return todo, written

    def _emit_all(self, job: SaveJob, slots: list[tuple[Slot, list[Write]]], handoff: _Handoff) -> None:
        """`_emit` each slot in order, unless the pipeline claimed them first (its `submit` failed); every slot
        goes back to the pool, written or not. Sets `handoff.started` first and `handoff.finished` last."""
        if not handoff.claim():
            return
        try:
            handoff.started.set()
            for i, (slot, todo) in enumerate(slots):
                try:
                    self._emit(job, slot, todo)
                except BaseException:
                    for rest, _ in slots[i + 1:]:
                        self.pool.release(rest)
                    raise
        finally:
            handoff.finished.set()

    def _emit(self, job: SaveJob, slot: Slot, todo: list[Write]) -> None:
        """Write what `_take` found new in `slot`, in order; the slot goes back to the pool."""
        try:
            arr = slot.buf.numpy()
            for w in todo:
                if isinstance(w, list):
                    self._write_run(job, arr, w)
                else:
                    cid, packed, length = w
                    loc = self._pack_for(job).add(cid, packed, length, CODEC_ZSTD)
                    job.new_chunks[cid] = loc
                    job.bytes_new += loc.length
        finally:
            self.pool.release(slot)

    def _pack_for(self, job: SaveJob) -> PackWriter:
        """The pack the job's next chunk goes to: its last one while under `pack_bytes`, else a new one."""
        if job.packs and job.packs[-1].size < self.pack_bytes:
            return job.packs[-1]
        w = self._new_pack()
        job.packs.append(w)
        return w

    def _write_run(self, job: SaveJob, arr: Any, run: list[tuple[Piece, bytes]]) -> None:
        """Write raw chunks lying back to back in the slot with one append per pack, each chunk going to the
        pack it would go to alone (the last one while under `pack_bytes`); empties `run`."""
        i = 0
        while i < len(run):
            w = self._pack_for(job)
            j, size = i, w.size
            while j < len(run) and size < self.pack_bytes:
                size += run[j][0].length
                j += 1
            first, last = run[i][0], run[j - 1][0]
            locs = w.add_run([cid for _, cid in run[i:j]], arr[first.start:last.start + last.length].data,
                             [p.length for p, _ in run[i:j]])
            for (_, cid), loc in zip(run[i:j], locs):
                job.new_chunks[cid] = loc
                job.bytes_new += loc.length
            i = j
        run.clear()
