"""Opening a store directory: one tier, or a hot node-local tier over a cold shared one, with the
settings kept in the cold tier's config.toml. Builds the Repository; starts no threads."""

from __future__ import annotations

import logging
import os
import shlex
from datetime import datetime, timezone
from pathlib import Path

from ..base import config as tier_config
from ..base.config import Flush, TierConfig
from ..errors import InvalidArgumentError, NotFoundError, ReadOnlyStoreError, StoreFormatError
from ..meta.catalog import Catalog, opened_read_only
from ..objects.chunks import DEFAULT_CHUNK_SIZE
from ..objects.object_store import ObjectStore
from ..objects.tier import DamagedFormatError, Tier
from .repository import Repository

log = logging.getLogger("datastates")


def _check_directory(path: Path, what: str) -> None:
    """StoreFormatError if `path`, or a directory above it, is something other than a directory
    (a regular file): opening would otherwise fail deep inside with FileExistsError/NotADirectoryError."""
    for p in (path, *path.parents):
        try:
            if p.exists() and not p.is_dir():
                where = "is" if p == path else f"is under {str(p)!r}, which is"
                raise StoreFormatError(f"{what} path {str(path)!r} {where} a file, not a directory; "
                                       "give the path of a store directory (or of a new one to create)")
        except PermissionError:
            return  # a directory we may not stat: let the real open report it


def _check_apart(root: Path, hot: Path) -> None:
    """InvalidArgumentError when the hot tier is the store directory (the cold tier): the one directory would be
    both tiers, its packs counted twice and its catalog on the shared tier. (A hot tier inside the store
    directory, or around it, was taken before and still is.)"""
    if root.expanduser().resolve() == hot.resolve():
        raise InvalidArgumentError(
            f"hot tier {str(hot)!r} is the store directory {str(root)!r}: the hot tier is a node-local directory of "
            "its own (hot=/local/scratch/NAME), the store directory the shared cold tier")


def open_repository(path: str | os.PathLike[str], *, create: bool, chunk_size: int | None, verify: bool,
                    hot: str | os.PathLike[str] | None, hot_capacity: str | int | None, flush: Flush | None,
                    promote: bool | None, read_only: bool = False, record_tiers: bool = True
                    ) -> tuple[Repository, bool, bool]:
    """The repository at `path`, created if missing and `create`. Returns (repository, whether its
    catalog must be rebuilt from the tier files, whether the cold tier is reachable).

    `read_only`, or a store whose catalog folder this process may not write: the catalog opens read-only and
    nothing is written here (no settings, no role marks, no tier made). `record_tiers=False`: the tier settings
    given are for this open only (config.toml is left as it is). Raises StoreFormatError (newer format,
    non-store directory, a read-only store without a catalog), NotFoundError (nothing there and not `create`, or
    a read-only open of nothing), InvalidArgumentError (chunk size), ReadOnlyStoreError (a store to be created
    where this process may not write).
    """
    if chunk_size is not None:
        check_chunk_size(chunk_size)
    root = Path(path).expanduser()
    _check_directory(root, "store")
    if hot is not None:
        _check_directory(Path(hot).expanduser(), "hot tier")
    try:
        saved = tier_config.load(root)
    except OSError:
        saved = None  # cold unreachable: go on with what the caller gave
    hot_dir = hot if hot is not None else (saved.hot if saved else None)
    if hot_dir is None:
        _not_open_read_only(root / "catalog", root, read_only)
        tier = Tier(root)
        info = tier.read_format()
        if info is None:
            if not create or read_only:
                raise _no_store(root)
            _creating(tier, {"chunk_size": chunk_size or DEFAULT_CHUNK_SIZE}, "store")
            info = tier.read_format() or {}
        if info.get("tier") == "cold":
            raise StoreFormatError(
                f"{root} is the cold tier of a two-tier store, and its config.toml, which names the hot tier, is "
                "missing: opened alone it would get a catalog and locks of its own on the shared tier. Open it with "
                "its hot tier once, in Python: Store.open(path, hot=HOT_DIR), which writes config.toml again")
        if "cold" in info:  # a hot tier's FORMAT (`_check_hot_of`), named as the store
            raise StoreFormatError(
                f"{root} is the hot tier of a two-tier store (made for the store created at {_when(info['cold'])}): "
                "opened alone, the tensors evicted to the shared tier read as lost, and prune and gc would mark and "
                f"collect this tier only. Open the store by its shared directory: on the command line --store "
                f"SHARED_DIR --hot {shlex.quote(str(root))}, in Python Store.open(SHARED_DIR, hot={str(root)!r})")
        size = int(chunk_size or info.get("chunk_size", DEFAULT_CHUNK_SIZE))  # type: ignore[call-overload]
        check_chunk_size(size, given=False)  # (a given one was checked above)
        had_catalog = (root / "catalog" / "data.mdb").exists()
        catalog = Catalog(root / "catalog", read_only=read_only, unwritable=_unwritable(root / "catalog", root))
        repo = Repository(ObjectStore(tier, None, catalog, verify=verify, read_only=catalog.read_only), catalog,
                          chunk_size=size)
        rebuild = not had_catalog and next(tier.iter_ids("versions", "json"), None) is not None
        return repo, rebuild, False
    if hot is not None:
        # Absolute in config.toml: a relative one read by a process in another directory (the CLI, a server)
        # named another, empty hot tier, which that process then used.
        hot_dir = os.path.abspath(Path(hot).expanduser())
        _check_apart(root, Path(hot_dir))
    cfg = TierConfig(hot=str(Path(hot_dir).expanduser()),
                     hot_capacity=tier_config.parse_size(hot_capacity) if hot_capacity is not None
                     else (saved.hot_capacity if saved else None),
                     flush=flush or (saved.flush if saved else Flush()),
                     promote=promote if promote is not None else (saved.promote if saved else True))
    _not_open_read_only(Path(cfg.hot or "") / "catalog", root, read_only)
    hot_tier = Tier(Path(cfg.hot or ""), "hot")
    cold_tier = Tier(root, "cold", shared=True)
    try:
        hot_info = hot_tier.read_format(beside_cold=True)
    except DamagedFormatError as exc:
        raise _damaged_hot_format(exc, hot_tier, cold_tier) from exc
    except PermissionError as exc:  # another user's node-local directory
        raise ReadOnlyStoreError(
            f"hot tier {cfg.hot} of store {root} is not readable by this user ({exc.strerror}): read the store "
            f"through a hot tier of your own, Store.open({str(root)!r}, hot=DIR), or on the command line add "
            "--hot DIR (a directory of your own) to the command") from None
    try:
        cold_info = cold_tier.read_format()
        cold_ok = True
    except OSError:
        cold_info, cold_ok = None, False
    _check_hot_of(hot_info, cold_info, cfg.hot or "", root)
    if cold_info is None and hot_info is not None and cold_ok:
        # The hot tier holds a store and the shared one has none: the file system is not mounted (an empty mount
        # point, or no directory at all). Never made a new cold tier there: its flushes would mark versions as on
        # cold that the real one lacks, and eviction would then delete their only copy. Saves stay on hot; the
        # flusher writes only into a directory with a FORMAT file, so the backlog waits for the real one.
        cold_ok = False
        log.warning("cold tier %s holds no store (no FORMAT file) while hot tier %s does: taken as not mounted; "
                    "saves stay on hot until it is back", root, cfg.hot)
    if hot_info is not None and hot_info.get("tier") == "cold" and hot_info == cold_info:
        # Byte for byte cold's own FORMAT (the same "created"): a copy, as the hint for a damaged hot FORMAT
        # says to make, not a swap (swapped, the hot directory's FORMAT says cold and the cold one's does not).
        # Taken as the hot tier's, and written again without the cold mark when this open may write.
        hot_info = {k: v for k, v in hot_info.items() if k != "tier"}
        if not read_only:
            try:
                hot_tier.write_format(hot_info)
            except OSError as exc:
                log.warning("could not write %s/FORMAT without its cold mark (%s)", cfg.hot, exc)
    if hot_info is not None and hot_info.get("tier") == "cold":
        raise InvalidArgumentError(
            f"hot tier {cfg.hot} is the cold tier of a store (its FORMAT says so): were the two swapped? Open "
            f"Store.open(COLD, hot=NODE_LOCAL_DIR), the shared store directory first; nothing was written")
    if hot_info is None and cold_info is None and (not create or read_only):
        raise _no_store(root)
    # Another user's store on the shared tier: this process may read it, not write it (no config.toml, no role
    # mark, no flush, no save), through a hot tier of its own where its catalog is made.
    shared_closed = root if cold_ok and cold_info is not None and _closed_to_us(root) else None
    if shared_closed is not None and hot is None and hot_info is None:
        raise ReadOnlyStoreError(
            f"store {root} is read-only for this user, and the hot tier its config.toml names ({cfg.hot}) holds no "
            "store here (another user's, or another node's): read it through a hot tier of your own, "
            f"Store.open({str(root)!r}, hot=DIR), or on the command line add --hot DIR (a directory of your own) "
            "to the command; its loads and queries work, saves are refused")
    unwritable = _unwritable(Path(cfg.hot or "") / "catalog", Path(cfg.hot or ""))
    read_only = read_only or unwritable is not None
    if read_only and hot_info is None:
        raise StoreFormatError(
            f"hot tier {cfg.hot} of store {root} holds no store, and a read-only open cannot make one: open the "
            "store once with write access, or open it read-only from the node whose hot tier that is")
    settings = {"chunk_size": chunk_size or int((cold_info or hot_info or {}).get(  # type: ignore[call-overload]
        "chunk_size", DEFAULT_CHUNK_SIZE))}
    if read_only or shared_closed is not None:
        pass  # nothing is written: no role mark, no settings
    elif cold_ok and cold_info is None:
        _creating(cold_tier, settings | {"tier": "cold"}, "store")
        cold_info = cold_tier.read_format()
    elif cold_ok and cold_info is not None and cold_info.get("tier") != "cold" and (record_tiers or saved is not None):
        # Not for a one-tier store read through a hot tier for this open only (record_tiers=False, no config.toml:
        # the CLI's --hot): the mark without config.toml made every later plain open of it fail.
        try:
            cold_tier.mark_cold(cold_info)  # made before FORMAT recorded the role (2026-11-29)
        except OSError as exc:  # a read-only mount: the store opens as before, unmarked
            log.warning("could not record the cold role in %s/FORMAT (%s)", root, exc)
    if hot_info is None:
        # The hot tier records which store it serves (its cold tier's creation time), so that a --hot naming
        # another store's hot tier is refused (`_check_hot_of`) instead of mixing the two stores' refs and catalog.
        made_for = {"cold": cold_info["created"]} if cold_info is not None and "created" in cold_info else {}
        _creating(hot_tier, settings | made_for, "hot tier")
    if cold_ok and record_tiers and not read_only and shared_closed is None and (saved is None or saved != cfg):
        tier_config.save(root, cfg)
    size = int(settings["chunk_size"])
    check_chunk_size(size, given=False)
    had_catalog = (hot_tier.root / "catalog" / "data.mdb").exists()
    catalog = Catalog(hot_tier.root / "catalog", read_only=read_only, unwritable=unwritable)
    objects = ObjectStore(hot_tier, cold_tier, catalog, verify=verify, promote=cfg.promote and not read_only,
                          hot_capacity=cfg.hot_capacity, read_only=read_only)
    repo = Repository(objects, catalog, chunk_size=size, tiering=cfg, root=root)
    repo.shared_closed = shared_closed
    if cold_ok and cold_info is not None and cold_info.get("tier") != "cold" and not record_tiers and saved is None:
        # A one-tier store read through a hot tier given for this open only (the CLI's --hot): a write would go to
        # that hot tier's catalog, which the store's own never sees (its refs then named a version its catalog
        # lacked, and fsck said NOT OK; a review). It may be read so, not written.
        repo.writes_refused = (
            f"store {root} is a one-tier store, read here through the hot tier {cfg.hot} given for this command only "
            "(--hot), so nothing was changed: its own catalog would never see the write. Leave --hot out to change "
            "it")
    rebuild = not had_catalog and any(next(t.iter_ids("versions", "json"), None) for t in repo.tiers)
    return repo, rebuild, cold_ok


def _check_hot_of(hot_info: dict[str, object] | None, cold_info: dict[str, object] | None, hot: str,
                  root: Path) -> None:
    """InvalidArgumentError, before anything is written, when the hot tier was made for another store than the one
    at `root` (its FORMAT's "cold" is another cold tier's "created"): opened so (`--hot` naming another store's hot
    tier), a read showed that store's versions as this one's and a refresh wrote this store's refs and catalog
    entries into it (a hunt). Hot tiers made before the mark, and a cold tier that is not there, are not checked."""
    made_for = (hot_info or {}).get("cold")
    if made_for is None or cold_info is None or made_for == cold_info.get("created"):
        return
    raise InvalidArgumentError(
        f"hot tier {hot} belongs to another store: it was made for the store created at {_when(made_for)}, and "
        f"{root} was created at {_when(cold_info.get('created'))}. Give {root}'s own hot tier (its config.toml "
        "names it; leave --hot out) or a new empty directory; nothing was written")


def _when(created: object) -> str:
    """A FORMAT's "created" (seconds since the epoch) as an ISO time, or as it is."""
    try:
        return datetime.fromtimestamp(float(created), timezone.utc).isoformat(timespec="milliseconds")  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, OSError):
        return repr(created)


def _unwritable(catalog: Path, root: Path) -> Path | None:
    """The catalog folder (or, before it exists, the tier's root) when this process may not write it: such a store
    opens read-only, as `git log` works in a repository one may only read. None when it may."""
    where = catalog if catalog.exists() else root
    return where if where.exists() and not os.access(where, os.W_OK) else None


def _closed_to_us(root: Path) -> bool:
    """Whether this process may not write what a save or a flush writes on the shared tier (the tier's folder,
    config.toml, packs/, manifests/, versions/, refs/): another user's store, read through a hot tier of one's
    own. (A writable top folder over read-only subfolders is such a store too.)"""
    names = ("", "config.toml", "packs", "manifests", "versions", "refs")
    return any((root / n).exists() and not os.access(root / n, os.W_OK) for n in names)


def _not_open_read_only(catalog: Path, root: Path, read_only: bool) -> None:
    """ReadOnlyStoreError for a writable open of a store this process has open read-only, before anything is
    written (LMDB allows one open of a file per process, and that one is read-only)."""
    if not read_only and opened_read_only(catalog):
        raise ReadOnlyStoreError(f"store {root} is open read-only in this process, and LMDB allows one open of a "
                                 "file per process; close that Store before opening it for writing")


def _creating(tier: Tier, settings: dict[str, object], what: str) -> None:
    """`tier.create`, with ReadOnlyStoreError when this process may not write there."""
    try:
        tier.create(settings)
    except PermissionError as exc:
        raise ReadOnlyStoreError(
            f"cannot create the {what} at {tier.root}: {exc.strerror} ({exc.filename}); give a directory this "
            "user may write to") from exc


def _damaged_hot_format(exc: DamagedFormatError, hot: Tier, cold: Tier) -> StoreFormatError:
    """The error for a damaged hot FORMAT, naming the fix that works when cold's FORMAT is readable: copying it
    (the open takes an exact copy of cold's as the hot tier's), and the store's chunk_size from it."""
    try:
        info = cold.read_format()
    except (OSError, StoreFormatError):
        info = None
    if info is None:
        return exc
    return StoreFormatError(
        f"{hot.root / 'FORMAT'} (the hot tier's) {exc.why}. The cold tier's is intact: copy it, "
        f"cp {shlex.quote(str(cold.root / 'FORMAT'))} {shlex.quote(str(hot.root / 'FORMAT'))} (an exact copy is "
        f"taken as the hot tier's), or write it again as docs/format.md section 2 shows with this store's "
        f"chunk_size, {info.get('chunk_size', DEFAULT_CHUNK_SIZE)}, and no \"tier\" key")


def quarantine_catalog(path: str | os.PathLike[str], hot: str | os.PathLike[str] | None = None) -> Path:
    """Move the catalog directory of the store at `path` (on its hot tier when it has one) to that
    tier's `quarantine/`, so that the next open rebuilds it from the version records. Returns where
    it went. Raises NotFoundError if the store has no catalog."""
    root = Path(path).expanduser()
    if hot is None:
        saved = tier_config.load(root)
        hot = saved.hot if saved else None
    tier = Tier(Path(hot).expanduser(), "hot") if hot is not None else Tier(root)
    cat = tier.root / "catalog"
    if not cat.exists():
        raise NotFoundError(f"store {root} has no catalog at {cat}; open it to create one")
    return tier.quarantine(cat, "catalog damaged; rebuilt from the version records")


MAX_CHUNK_SIZE = 1 << 30
"""The largest chunk a store takes: a save stages a chunk whole in one slot of its pool, so a terabyte chunk size
(which FORMAT then kept for good) made every later save fail allocating a slot (a hunt)."""


def check_chunk_size(size: int, *, given: bool = True) -> None:
    """InvalidArgumentError unless `size` is a whole multiple of 64 bytes from 64 B to `MAX_CHUNK_SIZE`. A size
    read from a store's FORMAT (`given=False`) is held to the rule it was made under (no upper bound): a store
    made with 2 GiB chunks before the bound opens as it did (a review)."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % 64 or (
            given and size > MAX_CHUNK_SIZE):
        raise InvalidArgumentError(f"chunk_size {size!r} must be a multiple of 64 bytes from 64 B to 1 GiB "
                                   "(the default is 16 MiB)")


def _no_store(root: Path) -> NotFoundError:
    return NotFoundError(f"no store at {root}; create one with `datastates init --store {root}` "
                         "(in Python: Store.open(path, create=True))")
