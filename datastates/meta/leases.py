"""Leases: what a running process needs kept, written where every process that prunes reads it.

A `Population` running in one process holds a lease naming its branch prefix
(`sweep-1/`); `prune` run anywhere on the same store keeps every ancestor of
the branches under a live lease's prefix (their heads are kept anyway as branch
heads). Without it, a prune run from the shell deleted donor versions
a population in another process was about to fork from or replay.

A lease is one small JSON file `leases/<name>.json` under the store root,
replaced atomically: `{"name", "prefix", "host", "pid", "expires"}`. It is live
until `expires` (the holder renews it on every save it makes), and on the
holder's own host only while its pid is alive, so a crashed run does not pin
versions forever. A lease file that cannot be read counts as live (keeping too
much is safe; pruning too much is not) and is reported by `live()`'s caller.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..base.files import make_dirs, replace

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
        if (now if now is not None else time.time()) > self.expires:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:  # another user's live process
                return True
        return True


def _path(root: Path, name: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "%" + format(ord(c), "02X") for c in name)
    return root / LEASE_DIR / f"{safe}.json"


def take(root: Path, name: str, prefix: str, ttl: float = DEFAULT_TTL) -> Lease:
    """Write (or renew) the lease `name` on branches starting with `prefix`, held by this process."""
    lease = Lease(name, prefix, socket.gethostname(), os.getpid(), time.time() + ttl)
    path = _path(root, name)
    make_dirs(path.parent)
    replace(path, json.dumps(lease.__dict__, sort_keys=True).encode())
    return lease


def release(root: Path, name: str) -> None:
    """Remove the lease `name` if this process holds it (another holder's lease is left alone)."""
    path = _path(root, name)
    try:
        held = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return
    if held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def live(root: Path) -> tuple[list[Lease], list[str]]:
    """(live leases, files that could not be read). Unreadable lease files are the caller's to keep
    safe: `prune` then keeps every ancestor of every branch (see maintenance.retention)."""
    out: list[Lease] = []
    bad: list[str] = []
    now = time.time()
    for path in sorted((root / LEASE_DIR).glob("*.json")):
        try:
            d = json.loads(path.read_bytes())
            lease = Lease(str(d["name"]), str(d["prefix"]), str(d["host"]), int(d["pid"]), float(d["expires"]))
        except (OSError, ValueError, KeyError, TypeError):
            bad.append(str(path))
            continue
        if lease.alive(now):
            out.append(lease)
    return out, bad
