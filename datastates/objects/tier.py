"""A tier: one directory holding packs, manifests, version records, refs and logs.

Layout (see docs/format.md)::

    FORMAT                      {"format": 1, ...}    written once, checked on open
    packs/<pack>.pack           chunk bodies + index
    manifests/<ab>/<id>.arrow   Arrow IPC manifests
    versions/<ab>/<id>.json     canonical version records
    annotations/<ab>/<id>.json  mutable annotations (not part of the id)
    refs/heads/<name>, refs/tags/<name>, logs/...   refs and their reflogs
    locks/                      flock files
    catalog/                    the LMDB index (node-local tiers only)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import blake3

from ..base.files import append_line, replace, write_new
from ..base.locks import flocked, lockfile
from ..errors import NotFoundError, StoreFormatError
from .packs import PackReader, PackWriter

BAD_CHUNKS = "bad-chunks.jsonl"
"""Under `quarantine/`: chunk copies fsck found corrupt on every tier (`Tier.note_bad_copies`)."""

FORMAT = 1
"""The store format number in FORMAT files; a reader refuses a newer one."""


FORMAT_SUM = "blake3"
"""Key of FORMAT holding the blake3 of the JSON of its other keys (written since 2026-11-29; FORMATs without it
are read as they are)."""


def _format_sum(info: dict[str, object]) -> str:
    return blake3.blake3(json.dumps(info, sort_keys=True).encode()).hexdigest()


class DamagedFormatError(StoreFormatError):
    """A FORMAT file that does not parse or does not match its checksum (`Tier.read_format`): the opening of a
    two-tier store words what to do with the other tier's FORMAT at hand."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why
        """What is wrong with the file, without what to do about it."""


def _format_bytes(info: dict[str, object]) -> bytes:
    plain = {k: v for k, v in info.items() if k != FORMAT_SUM}
    return json.dumps(plain | {FORMAT_SUM: _format_sum(plain)}, sort_keys=True).encode()


class Tier:
    """One storage level (hot node-local, or cold shared)."""

    def __init__(self, root: Path, name: str = "hot", shared: bool = False) -> None:
        self.root = root
        self.name = name
        self.shared = shared
        self.reader = PackReader(root / "packs")

    # format ------------------------------------------------------------------
    def read_format(self, *, beside_cold: bool = False) -> dict[str, object] | None:
        """The FORMAT record, None if this directory is not a store yet. `beside_cold`: this is the hot tier of a
        store with a cold one (for the wording of what to do when its FORMAT is lost).

        Raises StoreFormatError for a store of a newer format or a non-empty non-store directory.
        """
        f = self.root / "FORMAT"
        if not f.exists():
            if not (self.root.is_dir() and any(p for p in self.root.iterdir() if not p.name.startswith("."))):
                return None
            # A store's creator writes FORMAT before anything else: what the listing saw was made after it by a
            # process that created the store since our first look (four ranks opening one new store at once).
            if not f.exists():
                kept = sorted(p.name for p in self.root.iterdir() if p.name in ("versions", "packs", "manifests"))
                if kept:  # a store that lost its FORMAT: never taken for a new one, nor for no store at all
                    if beside_cold:
                        raise StoreFormatError(
                            f"hot tier {self.root} holds a store's {', '.join(f'{k}/' for k in kept)} but its FORMAT "
                            "file is missing: put it back (docs/format.md section 2 gives its one line, with this "
                            "store's chunk_size; a hot tier's has no \"tier\" key), or move this directory aside "
                            "and open the store again: a new hot tier is made, and the versions on cold come back")
                    raise StoreFormatError(
                        f"{self.root} holds a store's {', '.join(f'{k}/' for k in kept)} but its FORMAT file is "
                        "missing: put it back from a backup or the other tier (docs/format.md section 2 gives its "
                        "one line, with this store's chunk_size)")
                raise StoreFormatError(
                    f"{self.root} is not empty and holds no datastates store (no FORMAT file); pick an empty directory"
                )
        try:
            info = json.loads(f.read_text())
            fmt = int(info["format"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedFormatError(f"{f} is damaged ({exc}); restore it from another tier or a backup",
                                     f"does not parse ({exc})") from exc
        if fmt > FORMAT:
            raise StoreFormatError(
                f"store {self.root} has format {fmt}; this datastates reads up to format {FORMAT}: upgrade datastates"
            )
        stored = info.pop(FORMAT_SUM, None)
        # (A datastates from before the checksum that marks a cold tier adds "tier" and keeps the sum it read:
        # that one change is not damage.)
        if stored is not None and stored not in (_format_sum(info),
                                                 _format_sum({k: v for k, v in info.items() if k != "tier"})):
            # A flipped digit of chunk_size parsed as another valid size: without the sum it went unnoticed.
            raise DamagedFormatError(
                f"{f} does not match its checksum (a byte of it changed): restore it from the other tier or a "
                "backup, or write it again as docs/format.md section 2 shows, with the chunk_size this store was "
                "made with (16777216 unless chosen)", "does not match its checksum (a byte of it changed)")
        return dict(info)

    def create(self, settings: dict[str, object]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_new(self.root / "FORMAT", _format_bytes({"format": FORMAT, "created": time.time(), **settings}))

    def write_format(self, info: dict[str, object]) -> None:
        """Replace FORMAT by `info` (its checksum added), atomically."""
        replace(self.root / "FORMAT", _format_bytes(info))

    def mark_cold(self, info: dict[str, object]) -> None:
        """Record in FORMAT that this directory is a cold tier (`"tier": "cold"`), so that an open without its
        config.toml refuses it instead of making it a store of its own. Only that key is added (with the
        checksum); an atomic replace, so a reader sees the old record or the new one."""
        replace(self.root / "FORMAT", _format_bytes(info | {"tier": "cold"}))

    # objects -------------------------------------------------------------------
    def _obj(self, kind: str, oid: str, ext: str) -> Path:
        return self.root / kind / oid[:2] / f"{oid}.{ext}"

    def manifest_path(self, mid: str) -> Path:
        return self._obj("manifests", mid, "arrow")

    def record_path(self, vid: str) -> Path:
        return self._obj("versions", vid, "json")

    def annotation_path(self, vid: str) -> Path:
        return self._obj("annotations", vid, "json")

    def write_manifest(self, mid: str, data: bytes | memoryview) -> None:
        """Write manifest `mid` durably (a no-op if it exists): around the page cache when big (`write_new`'s
        `direct`), as a save's manifest is read back only by later loads. Raises StorageFullError."""
        write_new(self.manifest_path(mid), data, direct=True)

    def write_record(self, vid: str, data: bytes) -> None:
        write_new(self.record_path(vid), data)

    def write_annotations(self, vid: str, data: bytes) -> None:
        replace(self.annotation_path(vid), data)

    def read_manifest(self, mid: str) -> bytes:
        try:
            return self.manifest_path(mid).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(
                f"manifest {mid} is missing from tier {self.name} ({self.root}); run `datastates fsck`") from None

    def read_record(self, vid: str) -> bytes | None:
        try:
            return self.record_path(vid).read_bytes()
        except FileNotFoundError:
            return None

    def iter_ids(self, kind: str, ext: str) -> Iterator[str]:
        d = self.root / kind
        if not d.is_dir():
            return
        for sub in sorted(d.iterdir()):
            if sub.is_dir():
                for p in sorted(sub.iterdir()):
                    if p.name.endswith(f".{ext}") and not p.name.startswith("."):
                        yield p.name[: -len(ext) - 1]

    def quarantine(self, path: Path, reason: str) -> Path:
        """Move `path` (a file or directory inside this tier) to `quarantine/`, keeping its relative
        path plus a timestamp, and append a JSON line {file, moved_to, reason, time, tier} to
        `quarantine/report.jsonl`. Nothing is deleted: the bytes stay for a person to inspect.
        Returns the new path."""
        now = time.time()
        rel = path.relative_to(self.root)
        dest = self.root / "quarantine" / rel.parent / f"{rel.name}.{int(now * 1000)}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        append_line(self.root / "quarantine" / "report.jsonl", json.dumps(
            {"file": str(rel), "moved_to": str(dest.relative_to(self.root)), "reason": reason, "time": now,
             "tier": self.name}, sort_keys=True).encode())
        return dest

    def note_bad_copies(self, copies: list[tuple[bytes, str]], reason: str) -> None:
        """Append one JSON line {chunk, pack, reason, time, tier} per (chunk id, pack) copy to
        `quarantine/bad-chunks.jsonl`: copies fsck found corrupt and stopped indexing, which a catalog rebuilt
        from the pack files must not index again (`bad_copies`). The bad bytes stay in their pack."""
        now = time.time()
        for cid, pack in copies:
            append_line(self.root / "quarantine" / BAD_CHUNKS, json.dumps(
                {"chunk": cid.hex(), "pack": pack, "reason": reason, "time": now, "tier": self.name},
                sort_keys=True).encode())

    def bad_copies(self) -> set[tuple[bytes, str]]:
        """The (chunk id, pack) copies `note_bad_copies` listed on this tier. A line that does not parse (a
        damaged byte) names nothing and is skipped: a rebuild then indexes that copy, as before the list, and
        the next fsck finds it corrupt again."""
        path = self.root / "quarantine" / BAD_CHUNKS
        out: set[tuple[bytes, str]] = set()
        try:
            lines = path.read_bytes().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                entry = json.loads(line)
                out.add((bytes.fromhex(entry["chunk"]), str(entry["pack"])))
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def new_pack(self) -> PackWriter:
        return PackWriter(self.root / "packs")

    def pack_path(self, pack: str) -> Path:
        return self.root / "packs" / f"{pack}.pack"

    def leftovers(self) -> list[Path]:
        """Temp files of writes in progress or interrupted: debris only once their writer is gone (`fsck` asks
        `files.tmp_is_stale`; a save's `.pack.tmp`, which names no writer, once no save runs)."""
        out: list[Path] = []
        for sub in ("packs", "manifests", "versions", "annotations", "refs", "tmp"):
            d = self.root / sub
            if d.is_dir():
                out.extend(p for p in d.rglob("*") if p.is_file() and p.name.endswith(".tmp"))
        return sorted(out)

    def writing(self) -> AbstractContextManager[None]:
        """Held (shared) by every save in flight, so fsck/gc never delete a half-written save's files."""
        return flocked(self.root / "locks" / "writers.lock", shared=True)

    def exclusive(self, reading: bool = False) -> AbstractContextManager[None]:
        """Held by fsck (`reading`: without repair) and gc: waits for saves in flight, keeps new ones out."""
        return flocked(self.root / "locks" / "writers.lock", reading=reading)

    def sweep_lock(self) -> AbstractContextManager[None]:
        """The shared tier's lock between deleting and publishing: a cold-tier gc holds it while it
        decides and deletes; a flusher holds it while it checks that a version's packs are there and
        writes its manifests and record. So no version appears naming a pack being deleted."""
        return lockfile(self.root / "locks" / "sweep.lockfile")

    def close(self) -> None:
        self.reader.close()
