"""The LMDB catalog: the index that makes lookups and queries fast.

The tier files are the truth; everything here can be rebuilt from them
(`datastates fsck --rebuild`). Keys are raw 32-byte ids so prefix lookups are
range scans. The catalog knows nothing of torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import lmdb

from ..base.locks import flocked
from ..errors import CatalogDamagedError, IntegrityError, ReadOnlyStoreError, StoreClosedError, StoreFormatError
from ..objects.chunks import ChunkLocation

_LOC = struct.Struct("<16sQQQB")
_OPEN: dict[str, tuple[lmdb.Environment, int]] = {}
_OPEN_LOCK = threading.Lock()
_DB_HANDLES: dict[str, dict[str, Any]] = {}
_READ_ONLY: set[str] = set()
"""The keys of `_OPEN` whose environment LMDB opened read-only."""


_INHERITED: dict[str, lmdb.Environment] = {}
"""In a forked child, the parent's environments: not ours to use (LMDB forbids it) nor to close (closing, or ending
one of their transactions, resets reader slots in the lock file the parent shares, and the parent's snapshots are
then unprotected: a review saw 2,000 of 2,000 wrong reads). Kept referenced so that they are never closed here."""


_INHERITED_TXNS: list[lmdb.Transaction] = []
"""In a forked child, the parent's transactions that ended here: referenced, so never ended (see `_INHERITED`)."""


def _forget_inherited() -> None:
    # In a forked child: the lock may have been held by a parent thread at the fork.
    global _OPEN_LOCK
    _INHERITED.update((key, env) for key, (env, _) in _OPEN.items())
    _OPEN.clear()
    _DB_HANDLES.clear()
    _REWRITING.clear()  # the parent's transaction, not ours
    _OPEN_LOCK = threading.Lock()


def opened_read_only(path: Path) -> bool:
    """Whether the catalog at `path` is open read-only in this process (a writable open of it is then refused)."""
    return os.path.realpath(path) in _READ_ONLY


def read_only_message(store: Path | str, unwritable: Path | None = None) -> str:
    """What a call that writes is told on a store opened read-only: by `read_only=True`, or by itself because this
    process may not write `unwritable`."""
    if unwritable is None:
        return (f"store {store} was opened with read_only=True, so nothing was changed: open it again without "
                "read_only=True to change it")
    return (f"store {store} is read-only for this user (who may not write {unwritable}), so nothing was changed: "
            "run this as a user who may write there, or ask the store's owner for write access")


def forked_child_error(path: Path | str) -> StoreClosedError:
    """The error for a store used, or opened again, in a process forked from one that had it open."""
    return StoreClosedError(
        f"store {path} was open in the process this one was forked from: a forked child may neither use that "
        "store nor open it again (LMDB allows one open of a file per process, and the parent's is inherited). "
        "Use the store in the parent, or in a process started with the 'spawn' or 'forkserver' start method")


os.register_at_fork(after_in_child=_forget_inherited)

_DBS = (b"chunks", b"packs", b"versions", b"children", b"extra", b"annotations", b"meta", b"nodes")
_CREATED = struct.Struct("<d")
_META = struct.Struct("<IIQQ")  # mm_magic, mm_version, mm_address, mm_mapsize (after the 16-byte page header)
_MAGIC = 0xBEEFC0DE
_DB = 48  # sizeof(MDB_db) on 64-bit
_CHUNK_DROPS = b"chunk_drops"
"""Meta key of `Catalog.chunk_drops`."""


def check_catalog_file(path: Path) -> None:
    """Raise CatalogDamagedError if the LMDB file `path` (data.mdb) is shorter than its own meta pages
    say, or has no valid meta page.

    LMDB maps the file and trusts it: reading a page past a truncated end kills the process with
    SIGBUS, which no handler can turn into an error. So the newest meta page's last used page number
    is checked against the file size before the file is ever mapped.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(2 * 65536)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CatalogDamagedError(_damaged(path, f"cannot be read ({exc.strerror})")) from exc
    best: tuple[int, int, int] | None = None  # (txnid, last page, page size)
    page_size = 0
    for meta in range(2):
        base = meta * page_size
        if base + 16 + _META.size + 2 * _DB + 16 > len(head):
            break
        magic, _version, _addr, _mapsize = _META.unpack_from(head, base + 16)
        psize = struct.unpack_from("<I", head, base + 16 + _META.size)[0]  # FREE_DBI's md_pad holds the page size
        if magic != _MAGIC or psize < 512 or psize & (psize - 1):
            if meta == 0:
                break
            continue
        page_size = page_size or psize
        last, txnid = struct.unpack_from("<QQ", head, base + 16 + _META.size + 2 * _DB)
        if best is None or txnid > best[0]:
            best = (txnid, last, psize)
    if best is None:
        raise CatalogDamagedError(_damaged(path, "has no valid LMDB meta page"))
    need = (best[1] + 1) * best[2]
    if size < need:
        raise CatalogDamagedError(_damaged(path, f"is truncated: {size} bytes, its meta page needs {need}"))


def _damaged(path: Path, why: str) -> str:
    return (f"catalog {path} {why}; the catalog is derived from the version records: run "
            "`datastates fsck --repair` to move it to quarantine/ and rebuild it")


def _pack_loc(loc: ChunkLocation) -> bytes:
    return _LOC.pack(bytes.fromhex(loc.pack), loc.offset, loc.length, loc.raw_length, loc.codec)


def _unpack_loc(raw: bytes) -> ChunkLocation:
    pack, off, length, rawlen, codec = _LOC.unpack(raw)
    return ChunkLocation(pack.hex(), off, length, rawlen, codec)


@dataclass
class CommitBatch:
    """Everything one version adds to the catalog, written in one transaction."""

    version_id: str
    record: bytes
    parents: list[str]
    chunks: list[tuple[bytes, ChunkLocation]] = field(default_factory=list)
    packs: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    overwrite_chunks: bool = False
    """Point known chunks at these new locations (a tiered store rewrote them to hot because the
    copy it knew of was on cold only); otherwise the first writer's location stays."""


OPEN_LOCK = "open.lock"
"""In the catalog's folder: held while a process checks and opens the LMDB file (`Catalog`)."""


class _Transaction:
    """An LMDB transaction that tells its catalog when it ends (see `Catalog._begin`)."""

    __slots__ = ("_catalog", "_txn")

    def __init__(self, catalog: Catalog, txn: lmdb.Transaction) -> None:
        self._catalog, self._txn = catalog, txn

    def __enter__(self) -> Any:  # Any, as env.begin() is typed: its callers pass what txn.get returns on
        return self._txn.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if os.getpid() != self._catalog._pid:
            # A forked child ending the parent's transaction (an inherited generator, finished by the collector):
            # ending it would reset the parent's reader slot in the lock file they share. Kept, never ended here.
            _INHERITED_TXNS.append(self._txn)
            return
        try:
            self._txn.__exit__(*exc)
        finally:
            self._catalog._ended()


class _Joined:
    """The write transaction of a `Catalog.rewrite` in progress, as a method of the catalog called on the thread
    that runs it sees it: with the table that method names as the default one (as `env.begin(db=...)` gives), and
    ending nothing when the method's `with` ends (the rewrite commits or aborts it, once)."""

    __slots__ = ("_txn", "_db")

    def __init__(self, txn: lmdb.Transaction, db: Any) -> None:
        self._txn, self._db = txn, db

    def __enter__(self) -> Any:  # Any, as `_Transaction.__enter__`: the catalog's methods take it for one
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def _in(self, db: Any) -> Any:
        return self._db if db is None else db

    def get(self, key: bytes, default: Any = None, db: Any = None) -> Any:
        return self._txn.get(key, default, db=self._in(db))

    def put(self, key: bytes, value: bytes, *, overwrite: bool = True, db: Any = None) -> bool:
        return bool(self._txn.put(key, value, overwrite=overwrite, db=self._in(db)))

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> bool:
        return bool(self._txn.delete(key, value, db=self._in(db)))

    def cursor(self, db: Any = None) -> Any:
        return self._txn.cursor(db=self._in(db))

    def stat(self, db: Any) -> Any:
        return self._txn.stat(db)

    def drop(self, db: Any, delete: bool = True) -> None:
        self._txn.drop(db, delete=delete)


_REWRITING: dict[str, tuple[int, lmdb.Transaction]] = {}
"""Catalog key (real path) -> (thread id, write transaction) of the `Catalog.rewrite` running in this process."""


class Catalog:
    """One process-wide handle per LMDB directory (LMDB forbids opening one twice)."""

    def __init__(self, path: Path, *, read_only: bool = False, unwritable: Path | None = None) -> None:
        """Open the catalog at `path` (created if missing, unless `read_only`).

        `read_only`: LMDB's read-only mode; `data.mdb` must exist (StoreFormatError otherwise). `unwritable`: the
        folder this process may not write, when that is why it is read-only (for the errors' wording). When this process
        may not write the catalog's folder, LMDB's lock file is not used either: reads are then safe only while
        no other process writes the store (records are still checked against their ids). Raises
        ReadOnlyStoreError when the catalog is already open read-only in this process and `read_only` is not
        asked for, CatalogDamagedError for a damaged file."""
        self.path = path
        self.read_only = read_only or unwritable is not None
        self.unwritable = unwritable
        """The folder this process may not write, when that made the catalog read-only."""
        read_only = self.read_only
        key = os.path.realpath(path)
        with _OPEN_LOCK:  # LMDB forbids concurrent mdb_dbi_open: open the tables once, under the lock
            env, refs = _OPEN.get(key, (None, 0))
            if env is not None and key in _READ_ONLY and not read_only:
                raise ReadOnlyStoreError(
                    f"store {path.parent} is open read-only in this process, and LMDB allows one open of a file per "
                    "process; close that Store before opening it for writing")
            if env is None:
                # One process at a time checks and opens the file: LMDB creates data.mdb empty and writes its meta
                # pages after, so a process checking it meanwhile took a catalog being made for a damaged one
                # (four ranks opening a new store at once, in CI). LMDB's own lock is not taken before the open.
                if key in _INHERITED:
                    raise forked_child_error(path.parent)
                env = self._open_env(path, key, read_only)
            _OPEN[key] = (env, refs + 1)
            self._db = _DB_HANDLES[key]
        self._key = key
        self.env = env
        self._in_flight = 0
        self._closed = False
        self._pid = os.getpid()
        # Reentrant: the collector may end an abandoned generator's transaction (`_ended`) on a thread inside
        # `_begin` of this very catalog.
        self._use = threading.RLock()
        self.record_source: Callable[[str], bytes] | None = None
        """Where a damaged catalog copy of a record is read again from: a function returning the
        verified bytes of the record file (the repository sets it; it raises IntegrityError naming
        the files when no copy is good)."""

    @staticmethod
    def _open_env(path: Path, key: str, read_only: bool) -> lmdb.Environment:
        # under _OPEN_LOCK
        # LMDB's lock file (readers' slots) needs write access to the folder; without it a read-only open
        # goes without the lock, as LMDB's own tools do on a read-only copy.
        locking = not read_only or os.access(path, os.W_OK)
        if read_only and not (path / "data.mdb").exists():
            raise StoreFormatError(
                f"store {path.parent} has no catalog ({path / 'data.mdb'} is missing), and a read-only open cannot "
                "make one: open it once with write access, which rebuilds it from the version records")
        with flocked(path / OPEN_LOCK) if locking else contextlib.nullcontext():
            check_catalog_file(path / "data.mdb")
            # map_size is virtual address space; the file grows only as pages are used.
            try:
                env = lmdb.open(str(path), map_size=1 << 40, max_dbs=len(_DBS), subdir=True, max_readers=256,
                                readonly=read_only, lock=locking)
                _DB_HANDLES[key] = {name.decode(): env.open_db(name, create=not read_only) for name in _DBS}
            except lmdb.NotFoundError as exc:  # a table a read-only open may not create
                raise StoreFormatError(
                    f"store {path.parent}'s catalog lacks a table ({exc}), which a read-only open cannot add: open "
                    "it once with write access") from exc
            except (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
                    lmdb.VersionMismatchError, lmdb.BadDbiError) as exc:
                raise CatalogDamagedError(_damaged(path / "data.mdb", f"is damaged ({exc})")) from exc
            except lmdb.Error as exc:
                if "already open in this process" not in str(exc):
                    raise
                # forked while another thread was opening it: inherited, though not yet in _OPEN
                raise forked_child_error(path.parent) from exc
        if read_only:
            _READ_ONLY.add(key)
        return env

    def _begin(self, *, write: bool = False, db: Any = None) -> _Transaction | _Joined:
        """A transaction counted as in flight: `close` lets the LMDB file go only once the last one has ended.
        Raises StoreClosedError once `close` was called (a read racing the close of its store from another
        thread gets that, never an lmdb.Error from a handle closed under it). On the thread running a `rewrite`
        of this catalog, that rewrite's transaction (LMDB allows one write transaction at a time: a second one
        begun on that thread would wait for itself)."""
        if write and self.read_only:
            raise ReadOnlyStoreError(read_only_message(self.path.parent, self.unwritable))
        joined = _REWRITING.get(self._key)
        if joined is not None and joined[0] == threading.get_ident():
            return _Joined(joined[1], db)
        with self._use:
            if self._closed:
                raise StoreClosedError.of(self.path.parent)
            self._in_flight += 1
        try:
            return _Transaction(self, self.env.begin(write=write, db=db))
        except BaseException:
            self._ended()
            raise

    def _ended(self) -> None:
        with self._use:
            self._in_flight -= 1
            last = self._closed and not self._in_flight
        if not last:
            return
        # This may run inside the collector (it ended an abandoned generator's transaction) on a thread that holds
        # _OPEN_LOCK, opening another catalog: never wait for that lock here, or the thread waits for itself.
        if _OPEN_LOCK.acquire(blocking=False):
            try:
                self._let_go()
            finally:
                _OPEN_LOCK.release()
        else:
            threading.Thread(target=self._release, name="datastates-catalog-close", daemon=True).start()

    def close(self) -> None:
        """Take no new transaction; the file is let go now, or when the last one in flight ends (so that a
        read on another thread finishes instead of failing half way)."""
        with self._use:
            if self._closed:
                return
            self._closed = True
            idle = not self._in_flight
        if idle:
            self._release()

    def _release(self) -> None:
        with _OPEN_LOCK:
            self._let_go()

    def _let_go(self) -> None:
        # under _OPEN_LOCK
        env, refs = _OPEN.get(self._key, (None, 0))
        if env is None:
            return
        if refs <= 1:
            del _OPEN[self._key]
            _DB_HANDLES.pop(self._key, None)
            _READ_ONLY.discard(self._key)
            env.close()
        else:
            _OPEN[self._key] = (env, refs - 1)

    # chunks -----------------------------------------------------------------
    def chunk(self, cid: bytes) -> ChunkLocation | None:
        with self._begin(db=self._db["chunks"]) as txn:
            raw = txn.get(cid)
        return None if raw is None else _unpack_loc(raw)

    def chunks(self, cids: Iterable[bytes]) -> list[ChunkLocation | None]:
        with self._begin(db=self._db["chunks"]) as txn:
            return [None if (r := txn.get(c)) is None else _unpack_loc(r) for c in cids]

    def has_chunks(self, cids: Iterable[bytes]) -> list[bool]:
        with self._begin(db=self._db["chunks"]) as txn:
            return [txn.get(c) is not None for c in cids]

    def iter_chunks(self) -> Iterator[tuple[bytes, ChunkLocation]]:
        with self._begin(db=self._db["chunks"]) as txn:
            for k, v in txn.cursor():
                yield bytes(k), _unpack_loc(v)

    def packs(self) -> dict[str, dict[str, Any]]:
        """Every indexed pack -> its entry ({"size", "chunks", "tier"}). Raises CatalogDamagedError naming the
        pack when an entry is not a JSON object (a damaged byte): `pack_entries` gives the others."""
        out: dict[str, dict[str, Any]] = {}
        for pack, info in self.pack_entries().items():
            if info is None:
                raise CatalogDamagedError(self.damaged_pack_message(pack))
            out[pack] = info
        return out

    def pack_ids(self) -> list[str]:
        """Every indexed pack, its entry not read (what refresh and gc need: a damaged entry stops neither)."""
        with self._begin(db=self._db["packs"]) as txn:
            return [bytes(k).hex() for k in txn.cursor().iternext(values=False)]

    def pack_entries(self) -> dict[str, dict[str, Any] | None]:
        """Every indexed pack -> its entry, None where the entry is damaged (fsck reports and mends those)."""
        with self._begin(db=self._db["packs"]) as txn:
            return {bytes(k).hex(): _json_object(v) for k, v in txn.cursor()}

    def damaged_pack_message(self, pack: str) -> str:
        """What a damaged `packs` entry is reported as: the catalog, the pack, and the commands that mend it."""
        return (f"catalog {self.path / 'data.mdb'}: the entry of pack {pack} is damaged (not a JSON object); run "
                "`datastates fsck --repair` to write it again from the pack file (or `datastates fsck --rebuild`)")

    def chunk_drops(self) -> bytes:
        """A token that changes whenever chunk locations leave the index (`drop_pack`, `clear`): whoever read
        the same token before knows that every chunk it saw indexed then is indexed still. Empty if no chunk
        ever left."""
        with self._begin(db=self._db["meta"]) as txn:
            raw = txn.get(_CHUNK_DROPS)
        return b"" if raw is None else bytes(raw)

    def _dropped_chunks(self, txn: lmdb.Transaction) -> None:
        # A random token, not a counter: `clear` empties the meta table too, and a counter starting again
        # could come back to a value a process read before the chunks went.
        txn.put(_CHUNK_DROPS, os.urandom(16), db=self._db["meta"])

    def drop_pack(self, pack: str) -> int:
        """Forget a pack and every chunk location that points into it; return chunks dropped."""
        dropped = 0
        with self._begin(write=True) as txn:
            self._dropped_chunks(txn)
            txn.delete(bytes.fromhex(pack), db=self._db["packs"])
            cur = txn.cursor(db=self._db["chunks"])
            stale = [bytes(k) for k, v in cur if _unpack_loc(v).pack == pack]
            for k in stale:
                txn.delete(k, db=self._db["chunks"])
                dropped += 1
        return dropped

    def drop_chunks(self, cids: Iterable[bytes]) -> int:
        """Forget these chunks' locations (their packs stay indexed); return how many were indexed. For a chunk
        whose every stored copy is corrupt (fsck): a save then writes its bytes again instead of naming the bad copy
        (the `chunk_drops` token changes, so no saver trusts what it remembered as indexed)."""
        dropped = 0
        with self._begin(write=True) as txn:
            self._dropped_chunks(txn)
            for cid in cids:
                dropped += bool(txn.delete(cid, db=self._db["chunks"]))
        return dropped

    def add_pack_file(self, path: Path, tier: str, index: list[tuple[bytes, ChunkLocation]], *,
                      locations: bool = True, skip: Container[bytes] = frozenset()) -> None:
        """Index the sealed pack file at `path` on `tier`: its entry from the file (size, the chunk count of its
        `index`) and, with `locations`, its chunks (without overwriting locations already known) but those in
        `skip` (copies known to be corrupt: a save would name them)."""
        self.add_pack_chunks(path.name.removesuffix(".pack"),
                             {"size": path.stat().st_size, "chunks": len(index), "tier": tier},
                             [(c, loc) for c, loc in index if c not in skip] if locations else [])

    def add_pack_chunks(self, pack: str, info: dict[str, Any], chunks: list[tuple[bytes, ChunkLocation]]) -> None:
        """Index a sealed pack's chunks without overwriting locations already known."""
        with self._begin(write=True) as txn:
            txn.put(bytes.fromhex(pack), json.dumps(info).encode(), db=self._db["packs"])
            for cid, loc in chunks:
                txn.put(cid, _pack_loc(loc), db=self._db["chunks"], overwrite=False)

    def set_chunk(self, cid: bytes, loc: ChunkLocation) -> None:
        with self._begin(write=True, db=self._db["chunks"]) as txn:
            txn.put(cid, _pack_loc(loc))

    # versions ---------------------------------------------------------------
    def commit(self, batch: CommitBatch) -> None:
        """Index a version and the chunks it added, atomically."""
        vid = bytes.fromhex(batch.version_id)
        with self._begin(write=True) as txn:
            for pack, info in batch.packs.items():
                txn.put(bytes.fromhex(pack), json.dumps(info).encode(), db=self._db["packs"])
            for cid, loc in batch.chunks:
                # Unless told otherwise, the first writer wins: a chunk another process indexed stays put.
                txn.put(cid, _pack_loc(loc), db=self._db["chunks"], overwrite=batch.overwrite_chunks)
            txn.put(vid, batch.record, db=self._db["versions"])
            # The walks' view of the record (creation time, parents) without parsing its JSON.
            created = float(json.loads(batch.record).get("created") or 0.0)
            txn.put(vid, _CREATED.pack(created) + b"".join(bytes.fromhex(p) for p in batch.parents),
                    db=self._db["nodes"])
            for p in batch.parents:
                txn.put(bytes.fromhex(p) + vid, b"", db=self._db["children"])
            if batch.extra:
                txn.put(vid, json.dumps(batch.extra).encode(), db=self._db["extra"])
            txn.put(b"generation", str(self._generation(txn) + 1).encode(), db=self._db["meta"])

    def _generation(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(b"generation", db=self._db["meta"])
        return int(raw) if raw else 0

    def generation(self) -> int:
        """A counter bumped by every change to versions or annotations (for caches)."""
        with self._begin() as txn:
            return self._generation(txn)

    def record(self, vid: str) -> bytes | None:
        """The verified record bytes of an indexed version, None if it is not indexed.

        Every read checks blake3(bytes) == id. A damaged catalog copy is read again from the record
        files (`record_source`) and rewritten; IntegrityError if no copy is good."""
        raw = self.raw_record(vid)
        return None if raw is None else self._verified(vid, raw)

    def entry(self, vid: str, annotations: bool = True
              ) -> tuple[bytes, dict[str, Any], dict[str, Any]] | None:
        """What `record`, `extra` and `annotations` give for `vid`, read in one transaction (the annotations
        left empty unless asked for); None if the version is not indexed. Raises what `record` raises."""
        key = bytes.fromhex(vid)
        with self._begin() as txn:
            raw = txn.get(key, db=self._db["versions"])
            if raw is None:
                return None
            raw = bytes(raw)
            extra = txn.get(key, db=self._db["extra"])
            notes = txn.get(key, db=self._db["annotations"]) if annotations else None
            extra_d = self._json_dict(extra, "extra", vid)
            notes_d = self._json_dict(notes, "annotations", vid)
        return self._verified(vid, raw), extra_d, notes_d  # outside the transaction: a repair writes

    def raw_record(self, vid: str) -> bytes | None:
        """The catalog's copy of a record as stored, unverified (fsck compares it)."""
        with self._begin(db=self._db["versions"]) as txn:
            raw = txn.get(bytes.fromhex(vid))
        return None if raw is None else bytes(raw)

    def records(self) -> Iterator[tuple[str, bytes]]:
        """(id, verified record bytes) of every indexed version; damaged catalog copies are re-read
        from the record files (after the others). Raises IntegrityError for one with no good copy."""
        damaged: list[tuple[str, bytes]] = []
        with self._begin(db=self._db["versions"]) as txn:
            for k, v in txn.cursor():
                vid, data = bytes(k).hex(), bytes(v)
                if blake3.blake3(data).hexdigest() == vid:
                    yield vid, data
                else:
                    damaged.append((vid, data))
        for vid, data in damaged:  # outside the read transaction: repairing writes
            yield vid, self._verified(vid, data)

    def raw_records(self) -> Iterator[tuple[str, bytes]]:
        """Every catalog copy as stored, unverified (fsck checks them)."""
        with self._begin(db=self._db["versions"]) as txn:
            for k, v in txn.cursor():
                yield bytes(k).hex(), bytes(v)

    def _verified(self, vid: str, raw: bytes) -> bytes:
        if blake3.blake3(raw).hexdigest() == vid:
            return raw
        if self.record_source is None:
            raise IntegrityError(f"the catalog's copy of version {vid[:12]} does not match its id; run "
                                 "`datastates fsck --repair`")
        good = self.record_source(vid)
        if not self.read_only:
            self.put_record(vid, good)  # the catalog is a cache of verified records: mend it
        return good

    def put_record(self, vid: str, data: bytes) -> None:
        """Replace the catalog's copy of an indexed record by `data`, which must hash to `vid`."""
        if blake3.blake3(data).hexdigest() != vid:
            raise IntegrityError(f"refusing to index record bytes that do not match version {vid[:12]}")
        with self._begin(write=True) as txn:
            txn.put(bytes.fromhex(vid), data, db=self._db["versions"])

    def version_count(self) -> int:
        with self._begin() as txn:
            return int(txn.stat(self._db["versions"])["entries"])

    def ids_with_prefix(self, prefix: str, limit: int = 2) -> list[str]:
        """Up to `limit` version ids starting with the hex `prefix`."""
        even = prefix[: len(prefix) // 2 * 2]
        start = bytes.fromhex(even)
        out: list[str] = []
        with self._begin(db=self._db["versions"]) as txn:
            cur = txn.cursor()
            if not cur.set_range(start):
                return out
            for k in cur.iternext(values=False):
                h = bytes(k).hex()
                if not h.startswith(even):
                    break
                if h.startswith(prefix):
                    out.append(h)
                    if len(out) >= limit:
                        break
        return out

    def children(self, vid: str) -> list[str]:
        key = bytes.fromhex(vid)
        out = []
        with self._begin(db=self._db["children"]) as txn:
            cur = txn.cursor()
            if cur.set_range(key):
                for k in cur.iternext(values=False):
                    k = bytes(k)
                    if k[:32] != key:
                        break
                    out.append(k[32:].hex())
        return out

    def extra(self, vid: str) -> dict[str, Any]:
        with self._begin(db=self._db["extra"]) as txn:
            return self._json_dict(txn.get(bytes.fromhex(vid)), "extra", vid)

    def set_extra(self, vid: str, extra: dict[str, Any]) -> None:
        with self._begin(write=True, db=self._db["extra"]) as txn:
            txn.put(bytes.fromhex(vid), json.dumps(extra).encode())

    def update_extra(self, vid: str, set_: dict[str, Any] | None = None, drop: Iterable[str] = (),
                     only_if_missing: str | None = None) -> dict[str, Any]:
        """Read-modify-write a version's extra in one transaction (flusher, prune and saves race on it).
        With `only_if_missing`, nothing changes when that key is already truthy. Bumps the generation."""
        key = bytes.fromhex(vid)
        with self._begin(write=True) as txn:
            raw = txn.get(key, db=self._db["extra"])
            extra = self._json_dict(raw, "extra", vid)
            if only_if_missing is not None and extra.get(only_if_missing):
                return extra
            extra.update(set_ or {})
            for k in drop:
                extra.pop(k, None)
            txn.put(key, json.dumps(extra).encode(), db=self._db["extra"])
            txn.put(b"generation", str(self._generation(txn) + 1).encode(), db=self._db["meta"])
        return extra

    def set_chunks(self, items: Iterable[tuple[bytes, ChunkLocation]]) -> None:
        """Point many chunks at new locations in one transaction (gc's repack)."""
        with self._begin(write=True, db=self._db["chunks"]) as txn:
            for cid, loc in items:
                txn.put(cid, _pack_loc(loc))

    def pruned_ids(self) -> set[str]:
        """Ids of versions whose bytes were pruned (their records stay)."""
        with self._begin(db=self._db["extra"]) as txn:
            return {bytes(k).hex() for k, v in txn.cursor() if b'"pruned": true' in v}

    # annotations ------------------------------------------------------------
    def annotations(self, vid: str) -> dict[str, Any]:
        with self._begin(db=self._db["annotations"]) as txn:
            return self._json_dict(txn.get(bytes.fromhex(vid)), "annotations", vid)

    def all_annotations(self) -> dict[str, dict[str, Any]]:
        with self._begin(db=self._db["annotations"]) as txn:
            return {bytes(k).hex(): self._json_dict(v, "annotations", bytes(k).hex()) for k, v in txn.cursor()}

    def set_annotations(self, vid: str, values: dict[str, Any]) -> None:
        with self._begin(write=True) as txn:
            txn.put(bytes.fromhex(vid), json.dumps(values).encode(), db=self._db["annotations"])
            txn.put(b"generation", str(self._generation(txn) + 1).encode(), db=self._db["meta"])

    def meta(self, key: str) -> str | None:
        with self._begin(db=self._db["meta"]) as txn:
            raw = txn.get(key.encode())
        return None if raw is None else bytes(raw).decode()

    def set_meta(self, key: str, value: str) -> None:
        with self._begin(write=True, db=self._db["meta"]) as txn:
            txn.put(key.encode(), value.encode())

    def node(self, vid: str) -> tuple[tuple[str, ...], float] | None:
        """(parents, created) of an indexed version, read without parsing its record; None if absent
        (unknown, or indexed by a catalog older than the `nodes` table: read the record then)."""
        with self._begin(db=self._db["nodes"]) as txn:
            raw = txn.get(bytes.fromhex(vid))
        if raw is None:
            return None
        raw = bytes(raw)
        parents = tuple(raw[i:i + 32].hex() for i in range(_CREATED.size, len(raw), 32))
        return parents, _CREATED.unpack_from(raw)[0]

    def _json_dict(self, raw: bytes | None, table: str, vid: str) -> dict[str, Any]:
        """A stored JSON object (a version's extra, its annotations) as a dict; {} when nothing is stored. Raises
        CatalogDamagedError naming the catalog, the table and the version when it is not one (a damaged byte)."""
        if raw is None:
            return {}
        got = _json_object(raw)
        if got is None:
            # The files hold the truth (annotation files, .pruned markers, which tier has the record): a rebuild
            # derives both tables from them.
            raise CatalogDamagedError(
                f"catalog {self.path / 'data.mdb'}: the {table} entry of version {vid} is damaged (not a JSON "
                "object); run `datastates fsck --rebuild` to rebuild the catalog from the files")
        return got

    def drop_version(self, vid: str, parents: list[str]) -> None:
        key = bytes.fromhex(vid)
        with self._begin(write=True) as txn:
            txn.delete(key, db=self._db["versions"])
            txn.delete(key, db=self._db["nodes"])
            txn.delete(key, db=self._db["extra"])
            for p in parents:
                txn.delete(bytes.fromhex(p) + key, db=self._db["children"])
            txn.put(b"generation", str(self._generation(txn) + 1).encode(), db=self._db["meta"])

    def clear(self) -> None:
        """Empty every table (before a rebuild: see `rewrite`, which other processes never see half done)."""
        with self._begin(write=True) as txn:
            generation = self._generation(txn)
            for name in _DBS:
                txn.drop(self._db[name.decode()], delete=False)
            self._dropped_chunks(txn)
            # Never back to a generation a process read before the clear: its versions-table cache, keyed by that
            # number, would be taken for the new catalog's.
            txn.put(b"generation", str(generation + 1).encode(), db=self._db["meta"])

    @contextlib.contextmanager
    def rewrite(self) -> Iterator[None]:
        """Run the block's calls of this catalog, on this thread, in one write transaction, committed when the
        block ends and aborted (the catalog unchanged) when it raises.

        Other processes and threads read the catalog as it was before the block, or as it is after it, never
        in between: a rebuild (`clear`, then every pack and record added again) is seen whole or not at all, where
        readers of a catalog emptied and refilled transaction by transaction were told that versions do not
        exist. Writers elsewhere wait for the block (LMDB's one writer at a time). Calls inside read what the
        block wrote so far. LMDB spills a big transaction's dirty pages to the file, so millions of chunks fit;
        the pages it frees are reused only after it commits, so the file may grow to about twice the catalog."""
        me = threading.get_ident()
        running = _REWRITING.get(self._key)
        if running is not None and running[0] == me:
            yield  # inside a rewrite already: part of it
            return
        with self._begin(write=True) as txn:  # (another thread's rewrite: LMDB makes this wait for its end)
            _REWRITING[self._key] = (me, txn)
            try:
                yield
            finally:
                del _REWRITING[self._key]


def _json_object(raw: bytes) -> dict[str, Any] | None:
    """The JSON object a catalog value holds, None when it holds none (a damaged byte)."""
    try:
        got = json.loads(bytes(raw))
    except ValueError:  # (UnicodeDecodeError is one)
        return None
    return got if isinstance(got, dict) else None
