"""Leases: what a running process needs kept, written where every process that prunes reads it.

Each process running a `Population` (all its members, or some of them) holds a
lease naming its branch prefix (`sweep-1/`); `prune` run anywhere on the same store keeps every ancestor of
the branches under a live lease's prefix (their heads are kept anyway as branch
heads). Without it, a prune run from the shell deleted donor versions
a population in another process was about to fork from or replay.

A lease is one small JSON file per holding process, `leases/<name>@<host>-<pid>.json`
under the store root, replaced atomically: `{"name", "prefix", "host", "pid", "expires"}`.
One file per process, not per name: the members of one population often run in
several processes, and with one file the last to renew held it alone, so its exit
(or its `close()`) unprotected the members still training. A lease is live
until `expires` (the holder renews it on every save it makes), and on the
holder's own host only while its pid is alive, so a crashed run does not pin
versions forever. A lease file that cannot be read counts as live (keeping too
much is safe; pruning too much is not) and is reported by `live()`'s caller.
Files of the older layout (`leases/<name>.json`) are read the same way.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import blake3

from ..base.files import HOST, make_dirs, process_alive, replace

LEASE_DIR = "leases"
DEFAULT_TTL = 3600.0
"""Seconds a lease stays live without renewal (a population renews on every save)."""


@dataclass(frozen=True)
class Lease:
    name: str
    prefix: str
    host: str
    pid: int
    expires: float

    def alive(self, now: float | None = None) -> bool:
        """Not expired, and on this host only while the holder's process exists."""
        return (now if now is not None else time.time()) <= self.expires and not self.holder_gone()

    def holder_gone(self) -> bool:
        """The holder is a process of this host that no longer exists (another host's is never known gone)."""
        return self.host == socket.gethostname() and process_alive(HOST, self.pid) is False


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "%" + format(ord(c), "02X") for c in text)


def _stem(name: str) -> str:
    """The part of a lease file's name that names the lease: `name` itself when short, else its first 100
    characters and a digest of the whole (host and pid follow, and a file name holds 255 bytes; the JSON has the
    full name)."""
    safe = _safe(name)
    return safe if len(safe) <= 100 else f"{safe[:100]}-{blake3.blake3(name.encode()).hexdigest()[:16]}"


def _path(root: Path, name: str) -> Path:
    """This process's lease file for `name`."""
    return root / LEASE_DIR / f"{_stem(name)}@{_safe(socket.gethostname())[:60]}-{os.getpid()}.json"


def take(root: Path, name: str, prefix: str, ttl: float = DEFAULT_TTL) -> Lease:
    """Write (or renew) this process's lease `name` on branches starting with `prefix`. Other processes'
    leases of the same name (members of one population in other processes) are theirs, left as they are."""
    lease = Lease(name, prefix, socket.gethostname(), os.getpid(), time.time() + ttl)
    path = _path(root, name)
    make_dirs(path.parent)
    if not path.exists():
        _drop_dead(path.parent, name)
    replace(path, json.dumps(lease.__dict__, sort_keys=True).encode())
    return lease


def _drop_dead(folder: Path, name: str) -> None:
    """Remove the leases `name` left on this host by processes that are gone (killed: nothing released them),
    so that a file per process does not pile up run after run. Only this host's: whether another host's
    holder lives is not known here, and an expired lease it is renewing now must not be deleted under it."""
    for path in folder.glob(f"{_stem(name)}@{_safe(socket.gethostname())[:60]}-*.json"):
        lease = _read(path)
        if lease is not None and lease.name == name and lease.pid != os.getpid() and lease.holder_gone():
            path.unlink(missing_ok=True)


def _read(path: Path) -> Lease | None:
    """The lease in `path`; None if it cannot be read (`live` reports it: a person removes it)."""
    try:
        d = json.loads(path.read_bytes())
        return Lease(str(d["name"]), str(d["prefix"]), str(d["host"]), int(d["pid"]), float(d["expires"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def release(root: Path, name: str) -> None:
    """Remove this process's lease `name`; other processes' leases of that name are left alone."""
    _path(root, name).unlink(missing_ok=True)


def live(root: Path) -> tuple[list[Lease], list[str]]:
    """(live leases, files that could not be read). Unreadable lease files are the caller's to keep
    safe: `prune` then keeps every ancestor of every branch (see maintenance.retention)."""
    out: list[Lease] = []
    bad: list[str] = []
    now = time.time()
    for path in sorted((root / LEASE_DIR).glob("*.json")):
        lease = _read(path)
        if lease is None:
            bad.append(str(path))
        elif lease.alive(now):
            out.append(lease)
    return out, bad
