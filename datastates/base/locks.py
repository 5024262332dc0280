"""Locks that work across processes and hosts: O_EXCL lock files with a heartbeat, for shared
file systems where flock is not reliable."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .files import HOST, process_alive

STALE_LOCK_S = 30.0


@contextmanager
def flocked(path: Path, shared: bool = False, reading: bool = False) -> Iterator[None]:
    """Hold `flock` on `path` (made if missing, with its folder), exclusive or `shared`, across the processes of
    one host; released when the block ends or the process dies. Not for shared file systems (see `lockfile`).

    `reading`: the holder writes nothing under the lock (fsck without repair). Such a process that may not write
    the folder (a reader of a store it may only read) locks the file opened for reading, which flock allows; if
    the file is not there, and cannot be made, it holds no lock: no process that may write has made it yet. A
    writer gets the PermissionError: it never goes on without the lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        if not reading:
            raise
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            yield
            return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def lockfile(path: Path) -> Iterator[None]:
    """A lock that works across hosts on POSIX shared file systems: O_CREAT|O_EXCL is atomic
    there (flock is not everywhere). The holder touches the file every STALE_LOCK_S / 4
    seconds, so a lock untouched for STALE_LOCK_S is from a dead holder and is broken; so is
    one whose holder ran on this host and is gone (its host and pid are in the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    me = f"{HOST} {os.getpid()} {time.time()}".encode()
    delay = 0.001
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime > STALE_LOCK_S or _holder_gone(path):
                    # Rename first so two breakers cannot both delete a fresh lock.
                    stale = path.with_name(f"{path.name}.{os.getpid()}.stale")
                    os.rename(path, stale)
                    stale.unlink(missing_ok=True)
                    continue
            except FileNotFoundError:
                continue
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(STALE_LOCK_S / 4):
            with contextlib.suppress(OSError):
                os.utime(path)

    beat = threading.Thread(target=heartbeat, name="datastates-lock-heartbeat", daemon=True)
    try:
        os.write(fd, me)
        os.close(fd)
        beat.start()
        yield
    finally:
        stop.set()
        if beat.is_alive():
            beat.join()
        path.unlink(missing_ok=True)


def _holder_gone(path: Path) -> bool:
    """True if the lock file names a process of this host that no longer runs."""
    try:
        host, pid, _ = path.read_text().split()
        return process_alive(host, int(pid)) is False
    except (OSError, ValueError):
        return False  # being written, or gone: wait and look again
