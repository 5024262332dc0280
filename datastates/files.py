"""Durable file operations: every file the store writes goes through here.

Guarantee: a file written by `write_new` or `replace` is either absent (or
unchanged) or complete and fsync'd, including its directory entry, whatever
instant the process dies at.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any

from .errors import StorageFullError


def canonical_json(obj: Any) -> bytes:
    """Serialize `obj` to the one byte string used for hashing (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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


def _tmp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")


def _write_tmp(final: Path, data: bytes) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise full_or(exc, final) from exc
    return tmp


def full_or(exc: OSError, path: Path) -> OSError:
    """Turn ENOSPC/EDQUOT into StorageFullError naming `path`; return other errors as they are."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(
            errno.ENOSPC, f"no space left while writing {path}; free space or raise the quota, then retry"
        )
    return exc


def write_new(final: Path, data: bytes) -> bool:
    """Write an immutable file; never replaces an existing one.

    Returns False when `final` already existed (content-addressed files with
    the same name hold the same bytes). Uses link+unlink so a rename can never
    silently replace a file.
    """
    if final.exists():
        return False
    tmp = _write_tmp(final, data)
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
    os.replace(tmp, final)
    fsync_dir(final.parent)


def append_line(path: Path, line: bytes) -> None:
    """Append one line durably (used for logs that are never rewritten)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        write_all(fd, line + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
