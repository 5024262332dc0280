"""Durable file operations: every file the store writes goes through here.

Guarantee: a file written by `write_new` or `replace` is either absent (or
unchanged) or complete and fsync'd, including its directory entry, whatever
instant the process dies at.
"""

from __future__ import annotations

import errno
import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ..errors import StorageFullError


def canonical_json(obj: Any) -> bytes:
    """Serialize `obj` to the one byte string used for hashing (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def json_finite(x: Any) -> Any:
    """`x` with every non-finite float (nested in dicts, lists, tuples) as the string "NaN", "Infinity" or
    "-Infinity": JSON has no such numbers, and Python's json writes bare tokens other parsers refuse. The REST
    server's encoding, and the CLI's --json."""
    if type(x).__module__ == "numpy" and getattr(x, "shape", None) == ():
        x = x.item()  # a numpy scalar (float32 has no json encoding: it printed as the string 'inf')
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: json_finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_finite(v) for v in x]
    return x


def fsync_dir(path: Path) -> None:
    """Make the directory entries of `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview | bytes) -> int:
    """Write every byte of `data` to `fd` (os.write may write less); return the count."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def writev_all(fd: int, parts: list[memoryview]) -> int:
    """Write every byte of `parts`, in order, to `fd` with one `writev` where it takes them all (a short write
    goes on piece by piece); return the count of bytes. One request instead of one per part: on this VM's disk a
    small O_DIRECT write cost ~0.4 ms, most of it waiting for the request, not moving bytes."""
    # Bytes, not items: `writev` counts bytes, and a view of another format (float32) has fewer items.
    parts = [memoryview(p).cast("B") for p in parts]
    total = sum(len(p) for p in parts)
    done = os.writev(fd, parts)
    for part in parts:
        if done >= len(part):
            done -= len(part)
            continue
        write_all(fd, part[done:])
        done = 0
    return total


ALIGN = 4096
"""O_DIRECT's alignment of memory, offsets and lengths (the largest logical block size we meet)."""
BOUNCE = 2 << 20
"""The size of a bounce buffer: bytes that are not aligned in memory reach an O_DIRECT file through one, in
writes of this size. 280 MiB in O_DIRECT writes on the dev VM: 0.143-0.171 s in 1 MiB writes, 0.134-0.143 in
2 MiB, 0.131-0.137 in 4 MiB; each MiB more is a MiB more of peak RSS per open pack (`datastates bench --rss`,
`small`, has ~1 MiB of slack)."""
_SPARES = 2
_spare: list[np.ndarray] = []
_spare_lock = threading.Lock()


def aligned_empty(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array whose data starts on an `ALIGN` boundary (for O_DIRECT)."""
    raw = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + nbytes]


def take_bounce() -> np.ndarray:
    """A bounce buffer (`BOUNCE` bytes, aligned) from the spares, or a new one: every pack of every save taking
    fresh pages cost ~10 ms per 2 MiB on hosts that charge for touching new pages. Held by one writer at a time;
    give it back with `give_bounce`."""
    with _spare_lock:
        if _spare:
            return _spare.pop()
    return aligned_empty(BOUNCE)


def give_bounce(buf: np.ndarray) -> None:
    """Keep `buf` for the next `take_bounce` (at most `_SPARES` are kept)."""
    with _spare_lock:
        if len(_spare) < _SPARES:
            _spare.append(buf)


def fill_bounce(bounce: memoryview, held: int, view: memoryview, flush: Callable[[], object]) -> int:
    """Copy `view` into `bounce` after the `held` bytes it holds, calling `flush()` (which writes all of `bounce`)
    each time it is full; the bytes it holds after. Every O_DIRECT write of bytes not aligned in memory passes
    here (packs, big manifests)."""
    size = len(bounce)
    pos = 0
    while pos < len(view):
        n = min(len(view) - pos, size - held)
        bounce[held:held + n] = view[pos:pos + n]  # a memcpy, no array object per piece
        held += n
        pos += n
        if held == size:
            flush()
            held = 0
    return held


_ZERO_BLOCK = memoryview(bytes(ALIGN))


def pad_bounce(bounce: memoryview, held: int) -> int:
    """Zero `bounce` from `held` up to the next `ALIGN` boundary, so what it holds can be written with O_DIRECT;
    that padded length."""
    padded = -(-held // ALIGN) * ALIGN
    bounce[held:padded] = _ZERO_BLOCK[:padded - held]
    return padded


def _write_direct(fd: int, view: memoryview) -> None:
    """Write `view` to `fd` (opened with O_DIRECT, at offset 0) through a bounce buffer, the last piece padded
    with zeros to `ALIGN`; the caller truncates the file to `len(view)`."""
    buf = take_bounce()
    try:
        out = buf.data
        held = fill_bounce(out, 0, view, lambda: write_all(fd, out))
        if held:
            write_all(fd, out[:pad_bounce(out, held)])
    finally:
        give_bounce(buf)


_HOST = socket.gethostname().replace(".", "_")


def _tmp_path(final: Path) -> Path:
    # Host and pid in the name let fsck tell a dead writer's debris from a live one's work.
    # The final name is cut so a 255-byte name still leaves room for the suffix (NAME_MAX is 255).
    short = final.name.encode()[:120].decode(errors="ignore")  # bytes, not characters, count for NAME_MAX
    return final.with_name(f".{short}.{_HOST[:60]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


HOST = _HOST
"""This host's name as written into temp file names and lock files (dots replaced)."""


def process_alive(host: str, pid: int) -> bool | None:
    """Whether process `pid` of `host` runs; None when that cannot be told from here (another host)."""
    if host not in (_HOST, _HOST[:60]) or pid <= 0:  # (temp names carry the first 60 characters: `_tmp_path`)
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def tmp_writer(path: Path) -> tuple[str, int] | None:
    """(host, pid) of the process that writes the temp file `path`, as its name says (`_tmp_path`); None for a
    name that carries neither (a save's `<pack id>.pack.tmp`)."""
    parts = path.name.split(".")
    try:
        return (parts[-4], int(parts[-3])) if len(parts) >= 6 else None
    except ValueError:
        return None


def tmp_is_stale(path: Path, max_age_s: float = 3600.0) -> bool:
    """True if a temp file's writer is dead (same host, pid gone) or it is older than `max_age_s`.

    A temp of a live process on this host is never stale, whatever its age (a pid reused since leaves a dead
    writer's debris in place: kept, never a live writer's file deleted)."""
    host, pid = tmp_writer(path) or ("", -1)
    alive = process_alive(host, pid)
    if alive is not None:
        return not alive
    try:
        return time.time() - path.stat().st_mtime > max_age_s
    except FileNotFoundError:
        return False


def make_dirs(path: Path) -> None:
    """Create `path` and parents, fsyncing each new directory's entry in its parent."""
    if path.is_dir():
        return
    make_dirs(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        return
    fsync_dir(path.parent)


def _write_tmp(final: Path, data: bytes | memoryview, direct: bool = False) -> Path:
    make_dirs(final.parent)
    tmp = _tmp_path(final)
    try:
        fd, is_direct = _open_new(tmp, direct)
        try:
            if is_direct:
                view = memoryview(data).cast("B")
                _write_direct(fd, view)
                os.ftruncate(fd, len(view))  # drop the padding of the last piece
            else:
                write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise_full_or(exc, final)
    return tmp


def _open_new(path: Path, direct: bool) -> tuple[int, bool]:
    """A new file opened for writing, with O_DIRECT when `direct` and the file system allows it; (fd, direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: no O_DIRECT here (tmpfs); anything else is a real failure
                raise
            path.unlink(missing_ok=True)
    return os.open(path, flags, 0o644), False


def raise_full_or(exc: OSError, path: Path) -> NoReturn:
    """Re-raise `exc`, as StorageFullError naming `path` when the disk or quota is full."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise StorageFullError(
            errno.ENOSPC, f"no space left while writing {path}; free space or raise the quota, then retry"
        ) from exc
    raise exc


DIRECT_FROM = 256 << 10
"""`write_new(direct=True)` bypasses the page cache for files of at least this many bytes."""


def write_new(final: Path, data: bytes | memoryview, direct: bool = False) -> bool:
    """Write an immutable file; never replaces an existing one.

    Returns False when `final` already existed (content-addressed files with
    the same name hold the same bytes). Uses link+unlink so a rename can never
    silently replace a file. With `direct`, a file of `DIRECT_FROM` bytes or more is written with O_DIRECT where
    the file system allows it (else buffered): for big files the writer will not read back soon (a manifest of
    8,000 rows, 2.1 MB, took ~12 ms through new page-cache pages on a VM that charges for touching them, ~2.5 ms
    around them). Raises StorageFullError when the disk or quota is full (nothing is left behind).
    """
    if final.exists():
        return False
    tmp = _write_tmp(final, data, direct=direct and len(memoryview(data).cast("B")) >= DIRECT_FROM)
    try:
        os.link(tmp, final)
        created = True
    except FileExistsError:
        created = False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)
    return created


def replace(final: Path, data: bytes) -> None:
    """Atomically replace (or create) a small mutable file such as a ref."""
    tmp = _write_tmp(final, data)
    try:
        os.replace(tmp, final)
    except OSError as exc:  # never a temp left behind by a live process (fsck keeps those: see tmp_is_stale)
        tmp.unlink(missing_ok=True)
        raise_full_or(exc, final)
    fsync_dir(final.parent)


def append_line(path: Path, line: bytes) -> None:
    """Append one line durably (used for logs that are never rewritten)."""
    make_dirs(path.parent)
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        write_all(fd, line + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(path.parent)


def copy_file(src: Path, dst: Path, *, overwrite: bool = False) -> bool:
    """Copy `src` durably to `dst` (temp + fsync + link, or rename with `overwrite`).

    Returns False if `dst` existed and `overwrite` is False. A crash leaves at
    most a `.tmp` file behind, never a partial `dst`.
    """
    if dst.exists() and not overwrite:
        return False
    make_dirs(dst.parent)
    tmp = _tmp_path(dst)
    try:
        with open(src, "rb") as fin, open(tmp, "xb") as fout:
            size = os.fstat(fin.fileno()).st_size
            done = 0
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done) if hasattr(
                    os, "copy_file_range") else 0
                if n <= 0:
                    fout.write(fin.read())  # file systems without copy_file_range
                    break
                done += n
            fout.flush()
            os.fsync(fout.fileno())
        if overwrite:
            os.replace(tmp, dst)
        else:
            try:
                os.link(tmp, dst)
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise_full_or(exc, dst)
    fsync_dir(dst.parent)
    return True


class FileSink:
    """An immutable file arriving in pieces (from another rank): written under a temporary name (the
    same convention as every other write here, so fsck can tell a dead writer's debris), then, once
    whole, fsynced and linked into place. Never replaces an existing file."""

    def __init__(self, final: Path) -> None:
        self.final = final
        make_dirs(final.parent)
        self.tmp = _tmp_path(final)
        self.f = open(self.tmp, "xb")  # noqa: SIM115 - closed in done()/abort()
        self.n = 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.n += len(data)

    def done(self, size: int) -> bool:
        """Make the file durable at its place. Returns False when a file was already there (kept).
        Raises OSError when fewer or more than `size` bytes arrived (nothing is placed then)."""
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            if self.n != size:
                raise OSError(f"received {self.n} of {size} bytes of {self.final.name}")
            try:
                os.link(self.tmp, self.final)
            except FileExistsError:
                return False
            fsync_dir(self.final.parent)
            return True
        finally:
            self.tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)
