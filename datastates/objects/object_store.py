"""The object store: chunks in packs over one or two tiers (hot node-local, cold shared).

Like dulwich's object store with an *alternate*: reads look in hot, then in
cold; a cold read may promote the pack into hot, and a corrupt hot copy is
replaced by a good cold one. Every read is verified against the chunk's
blake3 (unless verification is off). It also owns the dedup answer (may a
save name a chunk without writing it?), the pins that keep reused hot packs
from eviction while a save is in flight, and the least-recently-used order
eviction drops packs in.

It knows nothing of versions, refs or torch: where a chunk is comes from a
`ChunkIndex` (the catalog implements it).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any, Protocol, TypeAlias

import blake3
import numpy as np

from ..base.files import copy_file, replace, write_new
from ..errors import IntegrityError, NotFoundError
from .chunks import CODEC_RAW, CODEC_ZSTD, ChunkLocation, chunk_id
from .tier import Tier

log = logging.getLogger("datastates")

_RUN_BUFFERS = 1024
"""At most this many buffers (chunks and skipped gaps) per `preadv` (Linux IOV_MAX)."""
_RUN_BYTES = 8 << 20
"""At most this many bytes of the pack (gaps included) per merged read, so big states still spread over the
executor's threads (64 MiB runs made a warm `cnn` load ~2x slower in CPU than per-tensor reads: too few tasks for
two workers)."""
_GAP_BYTES = 256 << 10
"""Chunks of one pack at most this far apart are read in one `preadv`, the bytes between them into a scratch
buffer and dropped. A version saved after others has its chunks in older packs with holes where tensors changed
since; reading around each hole broke the kernel's readahead: a cold load of 8,000 x 16 KiB, 1,150 reads with
holes of 32 KiB, took 225 ms against 102 ms read through the holes (docs/perf-notes.md "Reading through holes").
At this bound even a lone 16 KiB chunk per gap reads about as fast as a separate read would."""

try:
    from zstandard import ZstdError as _ZstdError
except ImportError:  # zstd is optional; without it no chunk can be zstd-coded on this side
    class _ZstdError(Exception):  # type: ignore[no-redef]
        pass


class ChunkIndex(Protocol):
    """Where chunks are: chunk id -> (pack, offset, length, codec)."""

    def chunk(self, cid: bytes) -> ChunkLocation | None: ...

    def chunks(self, cids: list[bytes]) -> list[ChunkLocation | None]: ...

    def has_chunks(self, cids: list[bytes]) -> list[bool]: ...


Dest: TypeAlias = np.ndarray[Any, Any] | memoryview
"""Where a read puts a tensor's bytes: a flat uint8 numpy array or a writable byte memoryview
(`base.memory.bytes_at`)."""


def _flat(arr: Dest) -> memoryview:
    return arr if isinstance(arr, memoryview) else arr.data


_Run: TypeAlias = list[tuple[bytes, ChunkLocation, memoryview, str]]
"""Chunks read together: (id, location, the view their bytes go to, the tensor's key) each."""
_Check: TypeAlias = tuple[_Run, Future[Any]]
"""A run read by a stream, and its check on the executor."""


def _halfway(runs: list[_Run]) -> int:
    """The index of the first run past half of the runs' bytes: where a second read stream starts."""
    total = sum(len(r[2]) for run in runs for r in run)
    done = 0
    for k, run in enumerate(runs):
        if 2 * done >= total:
            return k
        done += sum(len(r[2]) for r in run)
    return len(runs)


class PendingRead:
    """What `ObjectStore.start_read_many` left to do: the executor's checks of runs this thread has read, the
    fallback of a run that failed them, and the copies of chunks named twice. Its arrays are complete and verified
    once `finish` returns."""

    __slots__ = ("_checks", "_slow", "_copies")

    def __init__(self, checks: list[_Check], slow: Callable[[_Run], None],
                 copies: list[tuple[memoryview, memoryview]]) -> None:
        self._checks, self._slow, self._copies = checks, slow, copies

    def finish(self) -> None:
        """Wait for the checks, read a failed run again chunk by chunk across tiers (fallback, repair,
        promotion), then copy the chunks named twice. Raises IntegrityError, NotFoundError, only once no check
        reads the arrays any more (their owners may be freed as soon as this raises)."""
        try:
            for run, fut in self._checks:
                if fut.result() is False:
                    self._slow(run)
            for src, dst in self._copies:
                dst[:] = src
        except BaseException:
            wait([fut for _, fut in self._checks])
            raise


class ObjectStore:
    """Chunk reads across tiers with verification, fallback, repair and promotion; dedup; pins."""

    def __init__(self, hot: Tier, cold: Tier | None, index: ChunkIndex, *, verify: bool = True,
                 promote: bool = True, hot_capacity: int | None = None, read_only: bool = False) -> None:
        self.read_only = read_only
        """A store opened read-only: reads mend, copy and promote nothing (`_hot_writable`)."""
        self.hot = hot
        """The tier saves write to (the only one without a cold tier)."""
        self.cold = cold
        self.tiers = [hot] if cold is None else [hot, cold]
        self.index = index
        self.verify = verify
        self.promote = promote
        self.hot_capacity = hot_capacity
        self.evict_lock = threading.Lock()
        """Held while deciding dedup against hot packs and while evicting them."""
        self.pins: dict[str, int] = {}
        """Hot packs that saves in flight reuse chunks from, with a count of such saves (under evict_lock)."""
        self.pack_used: dict[str, float] = {}
        """Last use of each pack in this process (monotonic time), for LRU eviction."""

    @property
    def tier(self) -> Tier:
        return self.hot

    def touch(self, pack: str) -> None:
        self.pack_used[pack] = time.monotonic()

    # dedup and pins ----------------------------------------------------------------
    def dedup(self, pins: set[str] | None, cids: list[bytes]) -> list[bool]:
        """For each chunk id: may a save name it without writing its bytes?

        Without tiers: whenever the index knows it. With tiers: only when a copy
        is in a hot pack, which is then pinned into `pins` (eviction keeps it until
        `unpin`). A chunk known only on cold is written again, so a version never
        needs a cold pack that a cold-tier gc may delete before the flusher has
        put this version's own copy there.
        """
        if self.cold is None:
            return self.index.has_chunks(cids)
        locs = self.index.chunks(cids)
        with self.evict_lock:
            on_hot: dict[str, bool] = {}
            for loc in locs:
                if loc is not None and loc.pack not in on_hot:
                    on_hot[loc.pack] = self.hot.pack_path(loc.pack).exists()
            if pins is not None:
                for pack in {p for p, ok in on_hot.items() if ok} - pins:
                    pins.add(pack)
                    self.pins[pack] = self.pins.get(pack, 0) + 1
        return [loc is not None and on_hot[loc.pack] for loc in locs]

    def restore_pins(self, pins: set[str]) -> None:
        """Put back on hot any pinned pack that another process's eviction removed (it had a copy
        on cold). Called under the hot ref lock just before a commit, which eviction also holds.

        Raises IntegrityError if the pack is on no tier any more (then nothing is committed)."""
        if self.cold is None:
            return
        for pack in sorted(pins):
            hot_path = self.hot.pack_path(pack)
            if hot_path.exists():
                continue
            cold_path = self.cold.pack_path(pack)
            if not cold_path.exists():
                raise IntegrityError(f"pack {pack}, which this save reuses chunks from, is on neither tier; "
                                     "save again (its chunks will be written anew)")
            copy_file(cold_path, hot_path)
            log.info("pack %s was evicted while a save reused it; copied back from cold", pack)

    def unpin(self, pins: set[str]) -> None:
        with self.evict_lock:
            for pack in pins:
                if self.pins.get(pack, 0) <= 1:
                    self.pins.pop(pack, None)
                else:
                    self.pins[pack] -= 1
            pins.clear()

    def drop_lru(self, keep: set[str]) -> None:
        """Drop least recently used hot packs that cold holds whole, skipping `keep` and pinned
        packs, until hot is under its capacity. The caller holds `evict_lock` and the hot ref lock."""
        cap = self.hot_capacity
        if self.cold is None or cap is None:
            return
        packs = {p.name.removesuffix(".pack"): p.stat().st_size for p in (self.hot.root / "packs").glob("*.pack")}
        used = sum(packs.values())
        keep = keep | set(self.pins)
        # The id starts with its creation time, so unused packs fall back to oldest first.
        for pack in sorted(packs, key=lambda p: (self.pack_used.get(p, 0.0), p)):
            if used <= cap:
                break
            if pack in keep:
                continue
            try:
                on_cold = self.cold.pack_path(pack).stat().st_size == packs[pack]
            except OSError:
                on_cold = False
            if not on_cold:
                continue  # never drop the only durable copy
            self.hot.reader.forget(pack)
            self.hot.pack_path(pack).unlink(missing_ok=True)
            used -= packs[pack]

    def hot_over_capacity(self) -> bool:
        cap = self.hot_capacity
        if self.cold is None or cap is None:
            return False
        return sum(p.stat().st_size for p in (self.hot.root / "packs").glob("*.pack")) > cap

    # manifests -----------------------------------------------------------------------
    def read_manifest_bytes(self, mid: str) -> bytes:
        """The bytes of manifest `mid`, verified (blake3 == id) unless verification is off: the first
        good copy, hot then cold. A damaged hot copy is rewritten from the good cold one, and a copy
        read from cold is kept on hot, so restarts do not need cold. Raises NotFoundError (no tier
        has it) or IntegrityError naming every damaged copy."""
        if not self.verify:
            for t in self.tiers:
                try:
                    return t.read_manifest(mid)
                except (NotFoundError, OSError):
                    continue
        return self._read_verified("manifest", mid)

    def read_record_bytes(self, vid: str) -> bytes:
        """The bytes of version record `vid` from the first tier whose copy hashes to `vid`; a damaged
        hot copy is rewritten from it. Raises NotFoundError (no record file) or IntegrityError naming
        every damaged copy and saying to run `datastates fsck --repair`."""
        return self._read_verified("record", vid)

    def _read_verified(self, kind: str, oid: str) -> bytes:
        bad: list[tuple[Tier, str]] = []
        good: tuple[Tier, bytes] | None = None
        for t in self.tiers:
            path = t.manifest_path(oid) if kind == "manifest" else t.record_path(oid)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            except OSError as exc:
                bad.append((t, f"{path} on tier {t.name} ({exc.strerror})"))
                continue
            if blake3.blake3(data).hexdigest() == oid:
                good = (t, data)
                break
            bad.append((t, f"{path} on tier {t.name}"))
        if good is None:
            if not bad:
                raise NotFoundError(f"{kind} {oid} is missing from every tier; run `datastates fsck`")
            raise IntegrityError(
                f"{kind} {oid[:12]} has no intact copy: {'; '.join(w for _, w in bad)} "
                f"{'does' if len(bad) == 1 else 'do'} not match its id; run `datastates fsck --repair` "
                "(it moves damaged files to quarantine/ and marks the version damaged)")
        src, data = good
        for t, where in bad:  # mend copies a read would meet first (hot) from the good one
            if self.tiers.index(t) < self.tiers.index(src) and self._hot_writable():
                try:
                    replace(t.manifest_path(oid) if kind == "manifest" else t.record_path(oid), data)
                    log.warning("%s %s: replaced the damaged copy %s by the good one on tier %s",
                                kind, oid[:12], where, src.name)
                except OSError:
                    pass
        if kind == "manifest" and src is not self.hot and not any(t is self.hot for t, _ in bad) \
                and self._hot_writable():
            try:
                write_new(self.hot.manifest_path(oid), data)
            except OSError:
                pass
        return data

    # chunks --------------------------------------------------------------------------
    def read_chunk(self, cid: bytes, key: str = "?") -> bytes:
        """The raw bytes of one chunk, verified. Raises NotFoundError, IntegrityError."""
        loc = self.index.chunk(cid)
        if loc is None:
            raise NotFoundError(
                f"chunk {cid.hex()[:16]} of tensor {key!r} is not in the catalog; run `datastates fsck`")
        out = bytearray(loc.raw_length)
        self._read_chunk(cid, loc, memoryview(out), key)
        return bytes(out)

    def read_chunks_into(self, cids: list[bytes], arr: Dest, key: str) -> None:
        """Fill `arr` (flat uint8, the chunks' total length) with the chunks in order, verified; chunks
        stored back to back in one hot pack are read in one call. Raises NotFoundError, IntegrityError."""
        locs = self.index.chunks(cids)
        buf = _flat(arr)
        pos = 0
        for run in contiguous_runs(list(zip(cids, locs)), key):
            size = sum(loc.raw_length for _, loc in run)
            if len(run) > 1 and self._read_run(run, buf[pos:pos + size]):
                pos += size
                continue
            for cid, loc in run:
                self._read_chunk(cid, loc, buf[pos:pos + loc.raw_length], key)
                pos += loc.raw_length

    def read_many_into(self, items: Sequence[tuple[list[bytes], Dest, str]],
                       executor: Executor | None = None, *, streams: int = 1) -> None:
        """Fill each `(cids, arr, key)` as `read_chunks_into` would, for many tensors at once: `start_read_many`
        then its `finish` (`streams` as there). Raises NotFoundError, IntegrityError."""
        self.start_read_many(items, executor, streams=streams).finish()

    def start_read_many(self, items: Sequence[tuple[list[bytes], Dest, str]],
                        executor: Executor | None = None, *, streams: int = 1) -> PendingRead:
        """Start filling each `(cids, arr, key)` as `read_chunks_into` would, for many tensors at once; the
        arrays hold their verified bytes once the returned `PendingRead.finish()` has returned.

        One catalog lookup for every chunk. Uncompressed chunks stored back to back in one hot pack
        are read with one `preadv` per run (at most `_RUN_BUFFERS` chunks and `_RUN_BYTES` bytes),
        straight into the destination arrays, in pack offset order (chunks up to `_GAP_BYTES` apart make one
        run: the bytes between them are read into a scratch buffer and dropped), then each chunk is verified
        (blake3) unless verification is off. A run that fails in any way is read again chunk by
        chunk across tiers (fallback, repair, promotion), so the guarantees are those of
        `read_chunks_into`. A chunk named twice is read once and copied. With an `executor` and more
        than 8 MiB to read, this thread reads the runs on hot in order and the executor verifies them
        (and reads compressed chunks and chunks found only on cold); with `streams=2` this thread reads the first
        half of the bytes and one executor thread the second half, each in order. This returns once the reads are
        done, so a caller can start the next batch's reads while the executor still verifies this one.
        Raises NotFoundError (here), IntegrityError (here or from `finish`).
        """
        cids_all = [c for cids, _, _ in items for c in cids]
        locs = self.index.chunks(cids_all)
        first: dict[bytes, memoryview] = {}
        copies: list[tuple[memoryview, memoryview]] = []
        reads: _Run = []
        i = 0
        for cids, arr, key in items:
            pos = 0
            buf = _flat(arr)
            whole = len(cids) == 1  # one chunk, the whole array (a small tensor): no slice object to make
            for cid in cids:
                loc = locs[i]
                i += 1
                if loc is None:
                    raise NotFoundError(f"chunk {cid.hex()[:16]} of tensor {key!r} is not in the catalog; "
                                        "run `datastates fsck`")
                view = buf if whole and loc.raw_length == len(buf) else buf[pos:pos + loc.raw_length]
                if len(view) != loc.raw_length:
                    raise IntegrityError(f"tensor {key!r}: its chunks hold more bytes than its shape and dtype; "
                                         "run `datastates fsck`")
                pos += loc.raw_length
                if cid in first:
                    copies.append((first[cid], view))
                    continue
                first[cid] = view
                reads.append((cid, loc, view, key))
        raw = sorted((r for r in reads if r[1].codec == CODEC_RAW), key=lambda r: (r[1].pack, r[1].offset))
        runs: list[_Run] = []
        run_start = run_buffers = 0
        for r in raw:
            prev = runs[-1][-1][1] if runs else None
            loc = r[1]
            end = loc.offset + loc.length
            if prev is not None and prev.pack == loc.pack:
                gap = loc.offset - (prev.offset + prev.length)
                buffers = run_buffers + (2 if gap else 1)
                if 0 <= gap <= _GAP_BYTES and buffers <= _RUN_BUFFERS and end - run_start <= _RUN_BYTES:
                    runs[-1].append(r)
                    run_buffers = buffers
                    continue
            runs.append([r])
            run_start, run_buffers = loc.offset, 1
        runs += [[r] for r in reads if r[1].codec != CODEC_RAW]

        def slow(run: _Run) -> None:
            for cid, loc, view, key in run:
                self._read_chunk(cid, loc, view, key)

        def read(run: _Run) -> None:
            if not (run[0][1].codec == CODEC_RAW and self._read_views(run) and self._verified(run)):
                slow(run)

        checks: list[_Check] = []
        if executor is None or sum(len(r[2]) for r in reads) <= 8 << 20:
            for run in runs:
                read(run)
            return PendingRead(checks, slow, copies)
        pool = executor

        def read_in_order(part: list[_Run], out: list[_Check]) -> None:
            for run in part:
                if run[0][1].codec == CODEC_RAW and self._read_views(run):
                    out.append((run, pool.submit(self._verified, run)))
                else:  # compressed, or not on hot (cold reads, on a parallel file system, gain from company)
                    out.append((run, pool.submit(slow, run)))

        # Each stream reads its runs in pack and offset order, and the workers verify what it has read, so
        # hashing overlaps the reads. Two streams each read a contiguous half, so the kernel's readahead sees two
        # sequential readers (two threads reading alternate 8 MiB pieces defeated it: a cold 141 MiB file took
        # 0.114 s against 0.087 on one thread). Cold loads of `transformer` (1.1 GiB) on the dev VM: 0.69 s against
        # 0.89 with one stream (medians of 16, alternated; docs/perf-notes.md "Two read streams for a full load").
        cut = _halfway(runs) if streams > 1 else len(runs)
        theirs: list[_Check] = []
        other = pool.submit(read_in_order, runs[cut:], theirs) if cut < len(runs) else None
        try:
            read_in_order(runs[:cut], checks)
            if other is not None:
                other.result()
        except BaseException:
            # The arrays' owners may be freed as soon as this raises: the other stream's reads and every check
            # already submitted end first.
            if other is not None:
                wait([other])
            wait([fut for _, fut in checks + theirs])
            raise
        return PendingRead(checks + theirs, slow, copies)

    def map_many(self, items: list[tuple[list[bytes], int, int]], executor: Executor | None = None
                 ) -> list[memoryview | None]:
        """For each `(cids, nbytes, align)`: its chunks' bytes, in order, as a writable view of a private
        (copy-on-write) mapping of their pack on the hot tier, verified (blake3 of every chunk, unless
        verification is off): what a load with `mmap=True` builds tensors on. Nothing is copied; writes through a
        view stay in this process and never reach the pack.

        None for an item this cannot serve, which the caller reads with `read_many_into` (and its fallback across
        tiers, repair and errors): no chunks, a chunk unknown to the catalog, compressed or on another pack, chunks
        not back to back in order, a total other than `nbytes`, a first offset not a multiple of `align` (the
        dtype's element size), a pack missing from hot or not mappable, or a chunk whose mapped bytes do not match
        its id. Raises nothing for damaged data.

        The views stay valid after the pack is deleted (packs are never changed in place), and keep the deleted
        file's disk space until the last of them is gone. What they do not have
        is a read's isolation: a page the kernel drops is read again from the pack file when next touched,
        unverified, and an I/O error then is a SIGBUS (docs/perf-notes.md "Mapped loads")."""
        locs = self.index.chunks([c for cids, _, _ in items for c in cids])
        spans: list[tuple[str, int] | None] = []  # per item: its pack and first offset
        i = 0
        for cids, nbytes, align in items:
            spans.append(_one_span(locs[i:i + len(cids)], nbytes, align))
            i += len(cids)
        # Equal bytes are stored once: two tensors saved apart (AdamW's per-parameter `step` counters) name the same
        # chunks, and on one mapping they would share memory, an in-place change to one showing in the other. The
        # first of the items over any byte keeps the mapping; the others are read into memory of their own.
        for k in _overlapping(spans, [n for _, n, _ in items]):
            spans[k] = None
        maps: dict[str, memoryview | None] = {}
        for pack in {s[0] for s in spans if s is not None}:
            mapping = self.hot.reader.map(pack)
            maps[pack] = None if mapping is None else memoryview(mapping)
            if mapping is not None:
                _will_need(mapping, sorted((s[1], s[1] + n) for s, (_, n, _) in zip(spans, items)
                                           if s is not None and s[0] == pack))
        out: list[memoryview | None] = []
        checks: list[tuple[int, _Run]] = []  # item, its chunks' run
        i = 0
        for k, (span, (cids, nbytes, _)) in enumerate(zip(spans, items)):
            item_locs = locs[i:i + len(cids)]
            i += len(cids)
            whole = maps.get(span[0]) if span is not None else None
            if span is None or whole is None or span[1] + nbytes > len(whole):
                out.append(None)  # a pack shorter than its index says: the read reports it
                continue
            out.append(whole[span[1]:span[1] + nbytes])
            run, pos = [], span[1]
            for cid, loc in zip(cids, item_locs):
                assert loc is not None  # `_one_span` took only located chunks
                run.append((cid, loc, whole[pos:pos + loc.length], ""))
                pos += loc.length
            checks.append((k, run))
        # The read path's check (`_verified`: each chunk's id, unless verification is off), in ~8 MiB tasks so the
        # executor's threads share a big state.
        batches: list[list[tuple[int, _Run]]] = [[]]
        size = 0
        for c in checks:
            if size >= _RUN_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(c)
            size += sum(loc.length for _, loc, _, _ in c[1])

        def bad(batch: list[tuple[int, _Run]]) -> list[int]:
            return [k for k, run in batch if not self._verified(run)]

        if executor is None or len(batches) == 1:
            failed = [k for b in batches for k in bad(b)]
        else:
            failed = [k for f in [executor.submit(bad, b) for b in batches] for k in f.result()]
        for k in failed:
            out[k] = None
        return out

    def _read_views(self, run: _Run) -> bool:
        """One `preadv` of raw chunks of one hot pack, in offset order, into their views, the bytes of the gaps
        between them (at most `_GAP_BYTES` each) into one scratch buffer shared by every gap; False (nothing
        trusted) if it fails."""
        first = run[0][1]
        outs: list[memoryview] = []
        pos = first.offset
        scratch: memoryview | None = None
        for _, loc, view, _ in run:
            if loc.offset > pos:
                if scratch is None:  # per call: concurrent loads of one store each have their own
                    scratch = memoryview(bytearray(_GAP_BYTES))
                outs.append(scratch[:loc.offset - pos])
            outs.append(view)
            pos = loc.offset + loc.length
        try:
            self.hot.reader.readv_into(first.pack, first.offset, outs)
        except (NotFoundError, IntegrityError, OSError):
            return False
        return True

    def _verified(self, run: _Run) -> bool:
        """Whether every chunk of a run read by `_read_views` has its id (always, with verification off)."""
        if self.verify:
            for cid, _, view, _ in run:
                if chunk_id(view) != cid:
                    return False
        self.touch(run[0][1].pack)
        return True

    def _read_run(self, run: list[tuple[bytes, ChunkLocation]], out: memoryview) -> bool:
        """One read for chunks stored back to back in one hot pack, then verify each; False (nothing
        trusted) if any part fails, so the caller falls back to chunk-by-chunk reads across tiers."""
        first = run[0][1]
        span = ChunkLocation(first.pack, first.offset, len(out), len(out))
        try:
            self.hot.reader.read_into(span, out)
        except (NotFoundError, IntegrityError, OSError):
            return False
        pos = 0
        for cid, loc in run:
            if self.verify and chunk_id(out[pos:pos + loc.raw_length]) != cid:
                return False
            pos += loc.raw_length
        self.touch(first.pack)
        return True

    def _read_chunk(self, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        """`_read_chunk_at`, looking the chunk up again once if its pack vanished: gc in another
        process may have repacked it since we resolved its location."""
        try:
            self._read_chunk_at(cid, loc, out, key)
        except NotFoundError:
            fresh = self.index.chunk(cid)
            if fresh is None or fresh == loc:
                raise
            self._read_chunk_at(cid, fresh, out, key)

    def _read_chunk_at(self, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        """Read and verify one chunk: hot first, then cold. A cold read may promote the pack
        into hot; a corrupt hot copy is replaced by a good cold one (logged)."""
        errors: list[Exception] = []
        for t in self.tiers:
            try:
                self._read_chunk_from(t, cid, loc, out, key)
            except (NotFoundError, IntegrityError) as exc:
                errors.append(exc)
                continue
            if t is not self.hot:
                self._after_cold_read(loc.pack, repair=any(isinstance(e, IntegrityError) for e in errors))
            else:
                self.touch(loc.pack)
            return
        corrupt = [e for e in errors if isinstance(e, IntegrityError)]
        if corrupt:
            raise corrupt[0]
        raise NotFoundError(f"chunk {cid.hex()[:16]} of tensor {key!r} is on no reachable tier: "
                            + "; ".join(str(e) for e in errors))

    def _read_chunk_from(self, t: Tier, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        try:
            if loc.codec == CODEC_ZSTD:
                import zstandard

                data = zstandard.ZstdDecompressor().decompress(t.reader.read(loc), max_output_size=loc.raw_length)
                if len(data) != loc.raw_length:
                    raise IntegrityError(f"chunk {cid.hex()[:16]} of {key!r} decodes to {len(data)} bytes, "
                                         f"not {loc.raw_length}; run `datastates fsck`")
                out[:] = data
            else:
                t.reader.read_into(loc, out)
        except OSError as exc:
            raise NotFoundError(f"pack {loc.pack} is unreadable on tier {t.name}: {exc}") from exc
        except (ValueError, _ZstdError) as exc:  # zstd errors on damaged frames
            raise IntegrityError(f"chunk {cid.hex()[:16]} of tensor {key!r} in pack {loc.pack} does not decode "
                                 f"on tier {t.name}: {exc}; run `datastates fsck`") from exc
        if self.verify and chunk_id(out) != cid:
            raise IntegrityError(
                f"chunk {cid.hex()[:16]} of tensor {key!r} in pack {loc.pack} at offset {loc.offset} is corrupt "
                f"(blake3 mismatch) on tier {t.name}; run `datastates fsck`"
            )

    def _hot_writable(self) -> bool:
        """Whether a read may write into the hot tier (mend a damaged copy, keep a manifest or pack read from cold):
        not on a store opened read-only, nor into a hot tier deleted while the store was open (its files would
        make a directory without FORMAT that no open accepts)."""
        return not self.read_only and (self.hot.root / "FORMAT").exists()

    def _after_cold_read(self, pack: str, repair: bool) -> None:
        assert self.cold is not None
        src, dst = self.cold.pack_path(pack), self.hot.pack_path(pack)
        if not self._hot_writable():
            return
        try:
            if repair:
                log.warning("pack %s was corrupt on hot; replaced it with the good copy from cold", pack)
                self.hot.reader.forget(pack)
                copy_file(src, dst, overwrite=True)
            elif self.promote and not dst.exists():
                cap = self.hot_capacity
                used = sum(p.stat().st_size for p in (self.hot.root / "packs").glob("*.pack"))
                if cap is None or used + src.stat().st_size <= cap:
                    copy_file(src, dst)
            self.touch(pack)
        except OSError as exc:  # promotion is an optimisation; the read already succeeded
            log.warning("could not copy pack %s into hot: %s", pack, exc)

    # usage ---------------------------------------------------------------------------
    def usage(self) -> list[dict[str, Any]]:
        """Per tier: name, path, bytes in packs, pack count, capacity, reachability."""
        out = []
        for t in self.tiers:
            try:
                sizes = [p.stat().st_size for p in (t.root / "packs").glob("*.pack")]
                reachable = t.root.is_dir()
            except OSError:
                sizes, reachable = [], False
            out.append({"tier": t.name, "path": str(t.root), "bytes": sum(sizes), "packs": len(sizes),
                        "capacity": self.hot_capacity if t is self.hot and self.cold else None,
                        "reachable": reachable})
        return out

    def close(self) -> None:
        for t in self.tiers:
            t.close()


def _will_need(mapping: mmap.mmap, spans: list[tuple[int, int]]) -> None:
    """Ask the kernel to read ahead the sorted byte `spans` of `mapping`, spans at most `_GAP_BYTES` apart as one
    (one call per stretch, not per tensor); advice only, so a refusal changes nothing."""
    page = mmap.PAGESIZE
    start, end = spans[0]
    for a, b in [*spans[1:], (-1, -1)]:
        if a != -1 and a - end <= _GAP_BYTES:
            end = max(end, b)
            continue
        lo = start - start % page
        try:
            mapping.madvise(mmap.MADV_WILLNEED, lo, end - lo)
        except (OSError, ValueError, AttributeError):
            return
        start, end = a, b


def _overlapping(spans: list[tuple[str, int] | None], sizes: list[int]) -> list[int]:
    """The items whose byte range [offset, offset + size) in their pack meets that of an item before them in offset
    order (ties: the earlier item first)."""
    order = sorted((s[0], s[1], k) for k, s in enumerate(spans) if s is not None)
    out: list[int] = []
    pack, end = None, 0
    for p, start, k in order:
        if p == pack and start < end:
            out.append(k)
        if p != pack:
            pack, end = p, 0
        end = max(end, start + sizes[k])
    return out


def _one_span(locs: list[ChunkLocation | None], nbytes: int, align: int) -> tuple[str, int] | None:
    """(pack, offset of the first) when `locs` are raw chunks stored back to back, in order, in one pack (one of
    `contiguous_runs`), `nbytes` in all, the first at a multiple of `align`; None otherwise."""
    located = [loc for loc in locs if loc is not None]
    if not located or len(located) < len(locs):
        return None
    first = located[0]
    if first.codec != CODEC_RAW or first.offset % align:
        return None
    if len(contiguous_runs([(b"", loc) for loc in located], "")) > 1:
        return None
    return (first.pack, first.offset) if sum(loc.length for loc in located) == nbytes else None


def contiguous_runs(chunks: list[tuple[bytes, ChunkLocation | None]],
                    key: str) -> list[list[tuple[bytes, ChunkLocation]]]:
    """Group a tensor's chunks into runs stored back to back, uncompressed, in one pack.
    Raises NotFoundError for a chunk the index does not know."""
    runs: list[list[tuple[bytes, ChunkLocation]]] = []
    for cid, loc in chunks:
        if loc is None:
            raise NotFoundError(f"chunk {cid.hex()[:16]} of tensor {key!r} is not in the catalog; "
                                "run `datastates fsck`")
        prev = runs[-1][-1][1] if runs else None
        if (prev is not None and loc.codec == CODEC_RAW and prev.codec == CODEC_RAW and prev.pack == loc.pack
                and prev.offset + prev.length == loc.offset):
            runs[-1].append((cid, loc))
        else:
            runs.append([(cid, loc)])
    return runs
