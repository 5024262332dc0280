"""Pack files: many chunks written sequentially into one immutable file.

Layout (all integers little-endian)::

    b"DSPACK01"                                   8-byte header
    chunk bodies, back to back                    stored (maybe compressed) bytes
    index: count x (id 32s, offset Q, length Q, raw_length Q, codec B)
    footer: index_offset Q, count Q, blake3(index)[:16] 16s, b"DSPKIDX1"

A pack is written as `<id>.pack.tmp`, fsync'd, then renamed to `<id>.pack`;
a sealed pack is never modified. Leftover `.tmp` files are debris of an
interrupted save and are removed by `fsck --repair`.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np

from ..base.files import ALIGN as _ALIGN
from ..base.files import (
    fill_bounce,
    fsync_dir,
    give_bounce,
    pad_bounce,
    raise_full_or,
    take_bounce,
    write_all,
    writev_all,
)
from ..errors import IntegrityError, NotFoundError, StoreClosedError
from .chunks import CODEC_RAW, ChunkLocation

HEADER = b"DSPACK01"
FOOTER_MAGIC = b"DSPKIDX1"
_ENTRY = struct.Struct("<32sQQQB")
_FOOTER = struct.Struct("<QQ16s8s")


def new_pack_id() -> str:
    """A fresh pack id: time-ordered prefix so listings sort by age, random suffix."""
    return f"{time.time_ns():016x}{secrets.token_hex(8)}"


_DIRECT_MIN = 256 << 10
"""A stretch of stored bytes at least this big is written from its own memory (`PackWriter._append_direct`)."""
_ZEROS = memoryview(bytes(_ALIGN))


class PackWriter:
    """Appends chunks to one new pack file; `seal()` makes it durable and visible.

    Writes bypass the page cache (O_DIRECT) where the file system allows it:
    on hosts that charge for touching new pages, filling the page cache costs
    more than the disk write itself. Large aligned chunks go straight from the
    caller's buffer; small ones are gathered in an aligned bounce buffer.
    Without O_DIRECT (tmpfs, some network file systems) writes are buffered.
    """

    def __init__(self, directory: Path, max_bytes: int = 1 << 31, direct: bool = True) -> None:
        self.directory = directory
        self.id = new_pack_id()
        self.max_bytes = max_bytes
        self.path = directory / f"{self.id}.pack"
        self.tmp = directory / f"{self.id}.pack.tmp"
        directory.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self.direct = False
        self._fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.tmp, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                self.tmp.unlink(missing_ok=True)
        if self._fd < 0:
            self._fd = os.open(self.tmp, flags, 0o644)
        self._entries: list[bytes] = []
        self.size = 0
        """Logical bytes so far (offset of the next chunk)."""
        self._bounce = take_bounce() if self.direct else None
        self._bounce_view = self._bounce.data if self._bounce is not None else memoryview(b"")
        self._held = 0
        self._append(HEADER)

    def _raw_write(self, *parts: memoryview) -> None:
        """Write `parts` back to back at the end of the file, in one request (`writev_all`) when there are
        several; aborts the pack and raises StorageFullError or the OSError when the write fails."""
        try:
            if len(parts) == 1:
                write_all(self._fd, parts[0])
            else:
                writev_all(self._fd, list(parts))
        except OSError as exc:
            self.abort()
            raise_full_or(exc, self.tmp)

    def _append(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        if self._bounce is None:
            self._raw_write(view)
        else:
            self._held = fill_bounce(self._bounce_view, self._held, view, self._write_bounce)
        self.size += len(view)

    def _write_bounce(self) -> None:
        self._raw_write(self._bounce_view)

    def _pad(self) -> None:
        """Close the bounce buffer on a 4096 boundary so the next write is aligned."""
        assert self._bounce is not None
        if self._held:
            padded = pad_bounce(self._bounce_view, self._held)
            self.size += padded - self._held
            self._raw_write(self._bounce_view[:padded])
            self._held = 0

    @property
    def count(self) -> int:
        return len(self._entries)

    def add(self, cid: bytes, stored: memoryview | bytes, raw_length: int, codec: int) -> ChunkLocation:
        """Append one chunk's stored bytes; return where they landed (valid once sealed)."""
        view = memoryview(stored).cast("B")
        n = len(view)
        offset = self.append_stored(view)
        self._entries.append(_ENTRY.pack(cid, offset, n, raw_length, codec))
        return ChunkLocation(self.id, offset, n, raw_length, codec)

    def add_run(self, cids: list[bytes], stored: memoryview, lengths: list[int]) -> list[ChunkLocation]:
        """Append raw chunks that lie back to back in `stored` (`lengths` in the order of `cids`) with one
        write: thousands of small chunks cost one copy, not one each. Their locations (valid once sealed)."""
        offset = self.append_stored(memoryview(stored).cast("B"))
        locs = []
        for cid, n in zip(cids, lengths):
            self._entries.append(_ENTRY.pack(cid, offset, n, n, CODEC_RAW))
            locs.append(ChunkLocation(self.id, offset, n, n, CODEC_RAW))
            offset += n
        return locs

    def append_stored(self, view: memoryview) -> int:
        """Write stored chunk bytes (one chunk or a stretch of them) at the end of the pack, big ones straight
        from the caller's memory; their offset. Every chunk write passes here."""
        if self._bounce is not None and len(view) >= _DIRECT_MIN:
            return self._append_direct(view)
        offset = self.size
        self._append(view)
        return offset

    def _append_direct(self, view: memoryview) -> int:
        """Append a big stretch with its aligned middle written straight from its memory; its offset.

        O_DIRECT needs memory address, file offset and length aligned together, and torch's tensors lie on
        64-byte boundaries, not 4096. So the stretch is placed at a file offset congruent to its address modulo
        `_ALIGN` (zeros pad the gap before it: under 4 KiB), its head up to the first aligned address goes out
        with what the bounce buffer holds, the aligned middle in one write from the caller's memory, and the
        tail into the bounce buffer. Through the bounce alone, `cnn`'s tensors were copied and written 2 MiB at
        a time (~2 ms per 2 MiB here)."""
        n = len(view)
        skew = _address(view) % _ALIGN
        head = min((_ALIGN - skew) % _ALIGN, n)
        self._append(_ZEROS[:(skew - self.size) % _ALIGN])  # size is now congruent to the address
        offset = self.size
        self._append(view[:head])  # ends on an aligned file offset: what the bounce holds is whole blocks
        middle = (n - head) // _ALIGN * _ALIGN  # > 0: a stretch here is far longer than a block
        # What the bounce holds goes out with the middle, in one request: `cnn`'s sync save made 35 writes of a
        # few KiB besides its big ones, 11-18 ms of its ~125 (each waits for the disk like a big one).
        held, self._held = self._held, 0
        self._raw_write(*((self._bounce_view[:held],) if held else ()), view[head:head + middle])
        self.size += middle
        self._append(view[head + middle:])
        return offset

    def seal(self) -> None:
        """Write the index and footer, fsync, and rename into place.

        Raises StorageFullError when the disk fills; the temp file is removed then.
        """
        index = b"".join(self._entries)
        index_offset = self.size
        self._append(index)
        self._append(_FOOTER.pack(index_offset, len(self._entries), blake3.blake3(index).digest()[:16], FOOTER_MAGIC))
        try:
            if self._bounce is not None:
                logical = self.size
                self._pad()
                os.ftruncate(self._fd, logical)  # drop the alignment padding after the footer
                self.size = logical
            os.fsync(self._fd)
        except OSError as exc:
            self.abort()
            raise_full_or(exc, self.tmp)
        self._release_bounce()
        os.close(self._fd)
        self._fd = -1
        os.rename(self.tmp, self.path)
        fsync_dir(self.directory)

    def abort(self) -> None:
        """Drop the unfinished pack; nothing of it stays on disk."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._release_bounce()
        self.tmp.unlink(missing_ok=True)

    def _release_bounce(self) -> None:
        if self._bounce is not None:
            give_bounce(self._bounce)
            self._bounce = None
            self._bounce_view = memoryview(b"")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def read_index(path: Path) -> list[tuple[bytes, ChunkLocation]]:
    """Read a sealed pack's index; raise IntegrityError if the footer or index is damaged."""
    pack_id = path.name.removesuffix(".pack")
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size < len(HEADER) + _FOOTER.size:
            raise IntegrityError(f"pack {pack_id} is truncated ({size} bytes); run `datastates fsck --repair`")
        f.seek(size - _FOOTER.size)
        index_offset, count, digest, magic = _FOOTER.unpack(f.read(_FOOTER.size))
        if magic != FOOTER_MAGIC or index_offset + count * _ENTRY.size != size - _FOOTER.size:
            raise IntegrityError(f"pack {pack_id} has a damaged footer; run `datastates fsck`")
        f.seek(index_offset)
        index = f.read(count * _ENTRY.size)
    if blake3.blake3(index).digest()[:16] != digest:
        raise IntegrityError(f"pack {pack_id} has a damaged index; run `datastates fsck`")
    out = []
    for i in range(count):
        cid, off, length, raw, codec = _ENTRY.unpack_from(index, i * _ENTRY.size)
        out.append((cid, ChunkLocation(pack_id, off, length, raw, codec)))
    return out


def list_packs(directory: Path) -> Iterator[Path]:
    """Sealed pack files in `directory`, oldest first."""
    if directory.is_dir():
        yield from sorted(p for p in directory.iterdir() if p.name.endswith(".pack"))


class PackReader:
    """Positional reads from sealed packs, keeping a bounded set of files open."""

    def __init__(self, directory: Path, max_open: int = 64) -> None:
        self.directory = directory
        self.max_open = max_open
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._reads: dict[int, int] = {}
        """Reads in flight per file descriptor."""
        self._retired: set[int] = set()
        """Descriptors let go (evicted, forgotten, closed) while a read used them: closed when it ends. Closing one
        under a read would fail it, or worse hand its number to the next file opened, which the read would read."""
        self._closed = False

    def _acquire(self, pack: str) -> int:
        """An open descriptor of `pack`, counted as in use until `_release`. Raises NotFoundError (no such pack),
        StoreClosedError (after `close`)."""
        with self._lock:
            if self._closed:
                raise StoreClosedError.of(self.directory.parent)
            fd = self._fds.get(pack)
            if fd is not None:
                self._fds.move_to_end(pack)
            else:
                try:
                    fd = os.open(self.directory / f"{pack}.pack", os.O_RDONLY)
                except FileNotFoundError:
                    raise NotFoundError(
                        f"pack {pack} is missing from {self.directory}; run `datastates fsck` to see what it held"
                    ) from None
                self._fds[pack] = fd
                if len(self._fds) > self.max_open:
                    self._retire(self._fds.popitem(last=False)[1])
            self._reads[fd] = self._reads.get(fd, 0) + 1
            return fd

    def _release(self, fd: int) -> None:
        with self._lock:
            left = self._reads.pop(fd) - 1
            if left:
                self._reads[fd] = left
            elif fd in self._retired:
                self._retired.discard(fd)
                os.close(fd)

    def _retire(self, fd: int) -> None:
        # under self._lock
        if fd in self._reads:
            self._retired.add(fd)
        else:
            os.close(fd)

    def read(self, loc: ChunkLocation) -> bytes:
        """The stored bytes of a chunk (still encoded)."""
        fd = self._acquire(loc.pack)
        try:
            data = os.pread(fd, loc.length, loc.offset)
        finally:
            self._release(fd)
        if len(data) != loc.length:
            raise IntegrityError(f"pack {loc.pack} is shorter than its index says (offset {loc.offset})")
        return data

    def read_into(self, loc: ChunkLocation, out: memoryview) -> None:
        """Read raw (uncompressed) stored bytes straight into `out`."""
        fd = self._acquire(loc.pack)
        try:
            got = os.preadv(fd, [out], loc.offset)
            while got < loc.length:
                n = os.preadv(fd, [out[got:]], loc.offset + got)
                if n == 0:
                    raise IntegrityError(f"pack {loc.pack} is shorter than its index says (offset {loc.offset})")
                got += n
        finally:
            self._release(fd)

    def readv_into(self, pack: str, offset: int, outs: list[memoryview]) -> None:
        """Read the stored bytes at `offset` onward into `outs`, in order, back to back: one `preadv`
        when the kernel returns everything (the common case), more calls for the rest otherwise.
        Raises IntegrityError when the pack ends early, NotFoundError when it is missing."""
        fd = self._acquire(pack)
        try:
            self._readv(fd, pack, offset, outs)
        finally:
            self._release(fd)

    @staticmethod
    def _readv(fd: int, pack: str, offset: int, outs: list[memoryview]) -> None:
        total = sum(len(o) for o in outs)
        got = os.preadv(fd, outs, offset) if outs else 0
        if got == total:
            return
        pos = 0
        for o in outs:  # a short read: finish buffer by buffer
            if pos + len(o) <= got:
                pos += len(o)
                continue
            done = max(0, got - pos)
            while done < len(o):
                n = os.preadv(fd, [o[done:]], offset + pos + done)
                if n == 0:
                    raise IntegrityError(f"pack {pack} is shorter than its index says (offset {offset + pos})")
                done += n
            pos += len(o)

    def map(self, pack: str) -> mmap.mmap | None:
        """A private, copy-on-write mapping of the whole pack (writes to it stay in this process and never reach
        the file), or None when the pack is missing, empty or cannot be mapped (a file system without mmap).
        The mapping outlives the file's deletion (gc, eviction, a repair's replacement: packs are never changed
        in place, only written whole and renamed or removed), so it stays readable as long as anything views it.
        Raises StoreClosedError after `close`."""
        if self._closed:
            raise StoreClosedError.of(self.directory.parent)
        try:
            fd = os.open(self.directory / f"{pack}.pack", os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if not size:
                return None
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file

    def forget(self, pack: str) -> None:
        """Close a pack's file (before it is deleted; a read in flight finishes first)."""
        with self._lock:
            fd = self._fds.pop(pack, None)
            if fd is not None:
                self._retire(fd)

    def close(self) -> None:
        """Open no file any more (StoreClosedError); those read from now are closed when their reads end."""
        with self._lock:
            self._closed = True
            for fd in self._fds.values():
                self._retire(fd)
            self._fds.clear()
