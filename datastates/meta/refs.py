"""Refs: branches (movable) and tags (fixed), stored as one small file each.

Every change goes through a compare-and-swap under an exclusive lock on the
tier, is written atomically (temp + fsync + rename), and is appended to the
reflog, so no ref move is ever silent.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from ..base.files import append_line, fsync_dir, replace
from ..base.locks import flocked, lockfile
from ..errors import ConflictError, IntegrityError, InvalidNameError, NotFoundError
from .versions import shown

log = logging.getLogger("datastates")

Kind = Literal["branch", "tag"]
_DIRS = {"branch": "heads", "tag": "tags"}
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
HEX_ID = re.compile(r"^[0-9a-f]{64}$")


def check_name(name: str, what: str = "branch") -> str:
    """Return `name` if it is a valid ref name, else raise InvalidNameError saying why.

    Refused: empty, over 255 bytes, `..`, a leading or trailing `/`, `//`,
    control characters, spaces and the characters ``~ ^ : ? * [ \\`` that have
    meaning in ref expressions.
    """
    if not isinstance(name, str) or not name:
        raise InvalidNameError(f"{what} name {shown(name)} is empty or not a string; give a name like 'main'")
    why = None
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(f"{what} name {shown(name)} contains a lone surrogate, which is not text; "
                               "use letters, digits, '-', '_', '.', '/'") from None
    if len(name.encode()) > 255 or len(_encode(name).encode()) > 255:
        why = "is longer than 255 bytes (each '/' or '%' counts as 3 in the file name)"
    elif ".." in name:
        why = "contains '..'"
    elif name.startswith("/") or name.endswith("/") or "//" in name:
        why = "starts or ends with '/' or contains '//'"
    elif _BAD_CHARS.search(name):
        why = "contains a control character, a space or one of ~ ^ : ? * [ \\"
    elif name.startswith("-") or name.endswith(".lock") or name.startswith("."):
        why = "starts with '-' or '.', or ends with '.lock'"
    elif name == "@" or name.upper() == "HEAD":
        why = "is reserved"
    if why:
        raise InvalidNameError(f"{what} name {shown(name)} {why}; use letters, digits, '-', '_', '.', '/'")
    return name


def _encode(name: str) -> str:
    # Flat files: '/' inside a name must not create directories (a/b vs a).
    return name.replace("%", "%25").replace("/", "%2F")


def _decode(fname: str) -> str:
    return fname.replace("%2F", "/").replace("%25", "%")


def ref_name(fname: str) -> str:
    """The ref name a file under refs/heads or refs/tags (or its copy in quarantine/) is named for."""
    return _decode(fname)


class RefStore:
    """Branches and tags of one tier directory."""

    def __init__(self, root: Path, shared: bool = False) -> None:
        self.root = root
        self.shared = shared
        """True on a tier shared by several hosts: lock with O_EXCL lock files, not flock."""
        self._lock_path = root / "locks" / "refs.lock"

    def path_of(self, kind: Kind, name: str) -> Path:
        """The file of ref `name` of `kind` (fsck moves a damaged one aside)."""
        return self._path(kind, name)

    def _path(self, kind: Kind, name: str) -> Path:
        return self.root / "refs" / _DIRS[kind] / _encode(name)

    def _log_path(self, kind: Kind, name: str) -> Path:
        return self.root / "logs" / _DIRS[kind] / _encode(name)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the tier's ref lock, exclusive across processes (and hosts, for a shared tier)."""
        if self.shared:
            with lockfile(self.root / "locks" / "refs.lockfile"):
                yield
            return
        with flocked(self._lock_path):
            yield

    def get(self, kind: Kind, name: str) -> str | None:
        """The version id a ref points at, or None if it does not exist.

        Raises IntegrityError naming the file and `datastates fsck --repair` if the ref file exists
        but does not hold one version id (a flipped byte, a truncation): a damaged ref is never
        read as absent, so a compare-and-swap cannot silently overwrite it.
        """
        path = self._path(kind, name)
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            return None
        vid, why = parse_ref(raw)
        if why:
            raise IntegrityError(damaged_ref_message(kind, name, path, why))
        return vid

    def names(self, kind: Kind) -> dict[str, str]:
        """Every readable ref of `kind` -> its id. A damaged ref file is skipped with a warning (one
        bad file must not hide the others); `damaged` lists them, fsck reports them."""
        out: dict[str, str] = {}
        for name, path, vid, why in self._scan(kind):
            if why:
                log.warning("%s", damaged_ref_message(kind, name, path, why))
            elif vid:
                out[name] = vid
        return out

    def heads_but(self, kind: Kind, name: str) -> list[str]:
        """The ids every readable branch and tag points at, but ref `name` of `kind`'s."""
        return [v for k in ("branch", "tag") for n, v in self.names(k).items()  # type: ignore[arg-type]
                if not (k == kind and n == name)]

    def damaged(self, kind: Kind) -> list[tuple[str, Path, str]]:
        """(name, file, why) of every ref file of `kind` that does not hold one version id."""
        return [(name, path, why) for name, path, _, why in self._scan(kind) if why]

    def _scan(self, kind: Kind) -> Iterator[tuple[str, Path, str | None, str]]:
        d = self.root / "refs" / _DIRS[kind]
        if not d.is_dir():
            return
        for p in sorted(d.iterdir()):
            if p.name.startswith(".") or p.name.endswith(".tmp") or not p.is_file():
                continue
            try:
                raw = p.read_bytes()
            except OSError as exc:
                yield _decode(p.name), p, None, f"unreadable ({exc.strerror})"
                continue
            vid, why = parse_ref(raw)
            yield _decode(p.name), p, vid, why

    def _write(self, kind: Kind, name: str, old: str | None, new: str | None, message: str) -> None:
        path = self._path(kind, name)
        if new is None:
            path.unlink()
            fsync_dir(path.parent)
        else:
            replace(path, (new + "\n").encode())
        entry = {"old": old, "new": new, "time": time.time(), "message": message,
                 "host": socket.gethostname(), "pid": os.getpid()}
        append_line(self._log_path(kind, name), json.dumps(entry, sort_keys=True).encode())

    def set_if_equals(self, kind: Kind, name: str, old: str | None, new: str, message: str = "",
                      *, locked: bool = False, check: Callable[[], None] | None = None) -> None:
        """Point `name` at `new` if it currently points at `old` (None: must not exist). `check`, called with the
        lock held, may raise to refuse the move (a prune, which holds the lock, cannot slip in between).

        Raises ConflictError if another writer moved it first, or what `check` raises; nothing changes then.
        """
        check_name(name, kind)
        if not locked:
            with self.locked():
                return self.set_if_equals(kind, name, old, new, message, locked=True, check=check)
        if check is not None:
            check()
        current = self.get(kind, name)
        if current != old:
            raise ConflictError(
                f"{kind} {name!r} moved to {str(current)[:12]} while you expected {str(old)[:12]}; "
                "your version is kept and reachable by id: re-read the branch and retry"
            )
        self._write(kind, name, old, new, message)

    def add_if_new(self, kind: Kind, name: str, new: str, message: str = "",
                   *, check: Callable[[], None] | None = None) -> None:
        """Create a ref; ConflictError if it exists already. `check`: as for `set_if_equals`."""
        check_name(name, kind)
        with self.locked():
            if check is not None:
                check()
            current = self.get(kind, name)
            if current is not None:
                # Tags never move (git's tags neither): the way out is a delete; a branch moves, with force.
                how = (f"delete it first: `datastates tag -d {name}` (in Python, `store.delete_tag({name!r})`)"
                       if kind == "tag" else
                       f"move it there: `datastates branch -f {name} {new[:12]}` (in Python, "
                       f"`store.branch({name!r}, at=..., force=True)`)")
                raise ConflictError(f"{kind} {name!r} already exists (at {current[:12]}); pick another name, or {how}")
            self._write(kind, name, None, new, message)

    def remove_if_equals(self, kind: Kind, name: str, old: str | None = None, message: str = "") -> str:
        """Delete a ref (only if it points at `old`, when given); return what it pointed at."""
        check_name(name, kind)
        with self.locked():
            current = self.get(kind, name)
            if current is None:
                raise NotFoundError(f"{kind} {name!r} does not exist; `datastates {kind} --list` shows them")
            if old is not None and current != old:
                raise ConflictError(f"{kind} {name!r} points at {current[:12]}, not {old[:12]}; nothing deleted")
            self._write(kind, name, current, None, message)
            return current

    def reflog(self, kind: Kind, name: str) -> list[dict[str, Any]]:
        """Every recorded change of a ref, oldest first."""
        path = self._log_path(kind, name)
        if not path.exists():
            return []
        out = []
        for line in path.read_bytes().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:  # a torn last line from a crash mid-append, or a damaged byte
                log.warning("reflog %s: skipped a damaged line", path)
                continue
            if isinstance(entry, dict):
                out.append(entry)
        return out


def parse_ref(raw: bytes) -> tuple[str, str] | tuple[None, str]:
    """(id, "") for the bytes of a valid ref file, else (None, why it is damaged). An empty file is damage:
    a ref file is written whole (`replace`) and a deleted ref has no file; read as 'no ref', a truncated
    tag vanished from every listing and fsck said ok."""
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, "is not text (a damaged byte)"
    if not text:
        return None, "is empty (truncated)"
    if not HEX_ID.match(text):
        return None, "does not hold a 64-hex-digit version id"
    return text, ""


def damaged_ref_message(kind: str, name: str, path: Path, why: str) -> str:
    return (f"{kind} {name!r}: ref file {path} {why}; run `datastates fsck --repair` to move it to "
            "quarantine/, then recreate the ref")
