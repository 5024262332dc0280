"""Garbage collection: free the bytes of pruned versions. Also the `gc` and `prune` commands.

A chunk is live when a manifest of a version that is not pruned names it.
`gc` deletes packs holding no live chunk, repacks packs whose live share of
chunk bytes is under a threshold (copies the live chunks into a new pack,
points the catalog at them, then deletes the old pack) and deletes manifests
only pruned versions name. Version records always stay (lineage).

Crash safety (kill -9 at any instant leaves every live chunk readable):
- a dead pack leaves the catalog before its file goes, so no save can dedup
  against a chunk whose bytes are gone; a file left behind is an orphan that
  `fsck --repair` removes;
- a repack seals the new pack before the catalog names it, and repoints every
  live chunk before the old pack is dropped: until then both copies exist, and
  a new pack the catalog never came to name is a second copy that gc never
  judges (it looks only at packs the catalog knows) and `fsck --repair`
  removes (every chunk of it located intact in another pack).

With a cold tier, gc also collects cold (see `collect_cold`): it deletes
cold packs that no version on cold needs and manifests only pruned versions
name, under the cold tier's sweep lock; it never repacks there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ..base.files import fsync_dir
from ..base.progress import bar as progress_bar
from ..base.progress import progress
from ..errors import DataStatesError, IntegrityError, InvalidArgumentError
from ..objects.chunks import CODEC_ZSTD, ChunkLocation, chunk_id

# The pack format's fixed sizes, so a dry run predicts a repacked pack's size exactly.
from ..objects.packs import _ENTRY, _FOOTER, HEADER, list_packs, read_index
from ..repo.repository import Repository, as_repository
from ..save.manifest import Manifest

T = TypeVar("T")

REPACK_PACK_BYTES = 1 << 30
"""A repack rolls over to a new pack once the one it writes holds this many bytes."""

COLD_GRACE_S = 3600.0
"""A cold pack younger than this is never collected: a flusher may be copying the version that names it.
(Safety does not rest on it: the flusher checks its packs again under the sweep lock. It saves re-copies.)"""


@dataclass(frozen=True)
class GcReport:
    """What gc did (or, with `dry_run`, would do). Byte counts are file bytes on disk."""

    dry_run: bool
    packs_deleted: tuple[str, ...] = ()
    """Packs that held no live chunk."""
    packs_repacked: tuple[str, ...] = ()
    """Sparse packs whose live chunks were copied into new packs, then deleted."""
    packs_written: int = 0
    """New packs the repack wrote."""
    bytes_written: int = 0
    """Bytes of those new packs."""
    manifests_deleted: int = 0
    """Manifests that only pruned versions named."""
    chunks_live: int = 0
    """Distinct chunks the versions that are not pruned name."""
    chunks_dropped: int = 0
    """Catalog entries of dead chunks forgotten along with their packs."""
    bytes_freed: dict[str, int] = field(default_factory=dict)
    """Net bytes freed per tier name (deleted packs and manifests, minus what repacking wrote)."""
    skipped: tuple[str, ...] = ()
    """Packs left alone, and why (damaged, corrupt live chunk, file missing): `datastates fsck` explains."""

    @property
    def total_freed(self) -> int:
        return sum(self.bytes_freed.values())

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "packs_deleted": list(self.packs_deleted),
                "packs_repacked": list(self.packs_repacked), "packs_written": self.packs_written,
                "bytes_written": self.bytes_written, "manifests_deleted": self.manifests_deleted,
                "chunks_live": self.chunks_live, "chunks_dropped": self.chunks_dropped,
                "bytes_freed": dict(self.bytes_freed), "skipped": list(self.skipped)}


def _pack_size(lengths: Iterable[int]) -> int:
    """Bytes of a sealed pack holding chunks of these stored lengths (the writer's bounce path: no padding)."""
    n, body = 0, 0
    for length in lengths:
        n += 1
        body += length
    return len(HEADER) + body + n * _ENTRY.size + _FOOTER.size


def _live_chunks(store: Repository) -> tuple[set[bytes], set[str], set[str]]:
    """(live chunk ids, manifests of versions not pruned, manifests only pruned versions name).

    Raises NotFoundError/IntegrityError when a manifest of a version that is not
    pruned cannot be read: gc must not guess what is live.
    """
    pruned = store.catalog.pruned_ids()
    live_m: set[str] = set()
    pruned_m: set[str] = set()
    for vid, data in store.catalog.records():
        mids = json.loads(data).get("manifests", {}).values()
        (pruned_m if vid in pruned else live_m).update(mids)
    live: set[bytes] = set()
    for mid in progress(sorted(live_m), "gc: reading manifests", unit="manifest"):
        try:
            col = store.manifest(mid).table.column("chunks").combine_chunks()
        except DataStatesError as exc:
            raise type(exc)(f"gc stopped before changing anything: manifest {mid[:12]} of a version that is not "
                            f"pruned cannot be read ({exc}); run `datastates fsck`") from exc
        live.update(col.flatten().to_pylist())
    # A record a crash left out of the catalog is still a committed version (`fsck --repair` indexes it):
    # the chunks it shares with indexed packs must survive until then.
    for mid in _unindexed_manifests(store) - live_m:
        live_m.add(mid)
        try:
            col = store.manifest(mid).table.column("chunks").combine_chunks()
        except DataStatesError:
            continue  # never complete: fsck --repair removes the record
        live.update(col.flatten().to_pylist())
    return live, live_m, pruned_m - live_m


def _unindexed_manifests(store: Repository) -> set[str]:
    """Manifests named by records in the saving tier that the catalog lacks (and no marker prunes)."""
    tier, out = store.tier, set()
    pruned = set(tier.iter_ids("versions", "pruned"))
    for vid in tier.iter_ids("versions", "json"):
        if vid in pruned or store.catalog.record(vid) is not None:
            continue
        data = tier.read_record(vid)
        try:
            out.update(json.loads(data or b"{}").get("manifests", {}).values())
        except ValueError:
            continue  # a damaged record: fsck reports it
    return out


@dataclass
class _Sparse:
    pack: str
    size: int
    live: list[tuple[bytes, ChunkLocation]]


def gc(store: Repository, dry_run: bool = False, repack_threshold: float = 0.5,
       cold_grace_s: float = COLD_GRACE_S) -> GcReport:
    """Delete dead packs, repack sparse ones, delete manifests only pruned versions name.

    A pack is repacked when its live chunk bytes are under `repack_threshold`
    of its chunk bytes (0 never repacks; 1 repacks any pack with a dead chunk).
    Holds the tier's exclusive lock throughout (saves in flight finish first, new
    ones wait), dry run included, so its figures are those a real run would give.

    On a store with a cold tier, hot packs are not repacked (a pack on hot is
    a copy of one on cold, or about to be) and a dead hot pack that cold also
    holds loses only its hot copy; then cold is collected by `collect_cold`
    when it is reachable (`cold_grace_s` is its age limit).

    Raises ValueError for a threshold outside [0, 1]; NotFoundError/IntegrityError
    if a manifest of a version that is not pruned cannot be read (nothing changed then).
    """
    store = as_repository(store)
    if not 0.0 <= repack_threshold <= 1.0:
        raise InvalidArgumentError(f"repack_threshold {repack_threshold} must be between 0 and 1")
    store.check_open()
    tier, cat, cold = store.tier, store.catalog, store.cold
    # As the flusher does: an unmounted cold tier is an empty directory, never "the pack is not there".
    cold_ok = cold is not None and _exists(cold.root / "FORMAT") is True
    with tier.exclusive():
        live, _, dead_manifests = _live_chunks(store)
        by_pack: dict[str, list[tuple[bytes, ChunkLocation]]] = {}
        indexed: dict[str, int] = {}  # catalog entries per pack: what drop_pack will forget
        for cid, loc in cat.iter_chunks():
            indexed[loc.pack] = indexed.get(loc.pack, 0) + 1
            if cid in live:
                by_pack.setdefault(loc.pack, []).append((cid, loc))
        known = set(cat.pack_ids()) | set(by_pack)
        dead: list[tuple[str, int, bool]] = []  # (pack, bytes, whether the catalog forgets it)
        sparse: list[_Sparse] = []
        skipped: list[str] = []
        for pack in progress(sorted(known), "gc: sizing packs", unit="pack"):
            path = tier.pack_path(pack)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                if cold is None:
                    skipped.append(f"pack {pack}: indexed but its file is missing")
                continue  # with tiers: evicted from hot, or only ever on cold
            entries = by_pack.get(pack)
            if not entries:
                on_cold = False if cold is None else (_exists(cold.pack_path(pack)) if cold_ok else None)
                if on_cold is None:
                    skipped.append(f"pack {pack}: cold tier unreachable, cannot tell whether hot holds the only copy")
                    continue
                # A copy on cold keeps the catalog entries valid (reads fall back to cold), so they stay.
                dead.append((pack, size, not on_cold))
                continue
            if cold is not None:
                continue
            try:
                index = read_index(path)
            except IntegrityError as exc:
                skipped.append(f"pack {pack}: {exc}")
                continue
            live_bytes = sum(loc.length for _, loc in entries)
            if len(entries) < len(index) and live_bytes < repack_threshold * sum(loc.length for _, loc in index):
                sparse.append(_Sparse(pack, size, sorted(entries, key=lambda e: e[1].offset)))
        groups = _groups([e for s in sparse for e in s.live])
        manifest_sizes = {mid: n for mid in sorted(dead_manifests) if (n := _size(tier.manifest_path(mid))) is not None}
        freed = {t.name: 0 for t in store.tiers}

        if dry_run:
            written = sum(_pack_size(loc.length for _, loc in g) for g in groups)
            freed[tier.name] = (sum(size for _, size, _ in dead) + sum(s.size for s in sparse) - written
                                + sum(manifest_sizes.values()))
            dropped = (sum(indexed.get(p, 0) for p, _, forget in dead if forget)
                       + sum(indexed[s.pack] - len(s.live) for s in sparse))
            report = GcReport(True, tuple(p for p, _, _ in dead), tuple(s.pack for s in sparse), len(groups),
                              written, len(manifest_sizes), len(live), dropped, freed, tuple(skipped))
            return _with_cold(store, report, cold_ok, cold_grace_s)

        dropped = 0
        for pack, size, forget in progress(dead, "gc: deleting dead packs", unit="pack"):
            if forget:
                dropped += cat.drop_pack(pack)  # the catalog forgets first: no save may dedup against it meanwhile
            tier.reader.forget(pack)
            tier.pack_path(pack).unlink(missing_ok=True)
            freed[tier.name] += size
        if dead:
            fsync_dir(tier.root / "packs")

        written, n_written, repacked = _repack(store, sparse, groups, skipped)
        for s in sparse:
            if s.pack not in repacked:
                continue
            dropped += cat.drop_pack(s.pack)  # every live chunk of it points at its new pack by now
            tier.reader.forget(s.pack)
            tier.pack_path(s.pack).unlink(missing_ok=True)
            freed[tier.name] += s.size
        if repacked:
            fsync_dir(tier.root / "packs")
        freed[tier.name] -= written

        dirs: set[Path] = set()
        for mid, size in manifest_sizes.items():
            path = tier.manifest_path(mid)
            path.unlink(missing_ok=True)
            dirs.add(path.parent)
            freed[tier.name] += size
        for d in dirs:
            fsync_dir(d)
    report = GcReport(False, tuple(p for p, _, _ in dead), tuple(s.pack for s in sparse if s.pack in repacked),
                      n_written, written, len(manifest_sizes), len(live), dropped, freed, tuple(skipped))
    return _with_cold(store, report, cold_ok, cold_grace_s)


def _with_cold(store: Repository, report: GcReport, cold_ok: bool, grace_s: float) -> GcReport:
    """`report` plus what collecting the cold tier did (or would do)."""
    if store.cold is None:
        return report
    if not cold_ok:
        return replace(report, skipped=report.skipped + (f"cold tier {store.cold.root}: unreachable, not collected",))
    cold = collect_cold(store, dry_run=report.dry_run, grace_s=grace_s)
    return replace(report, packs_deleted=report.packs_deleted + cold.packs_deleted,
                   manifests_deleted=report.manifests_deleted + cold.manifests_deleted,
                   chunks_dropped=report.chunks_dropped + cold.chunks_dropped,
                   bytes_freed=report.bytes_freed | cold.bytes_freed, skipped=report.skipped + cold.skipped)


def collect_cold(store: Repository, dry_run: bool = False, grace_s: float = COLD_GRACE_S) -> GcReport:
    """Delete cold packs holding no chunk that a version on cold (not pruned) names, and cold
    manifests that only pruned versions name. Never repacks: other hosts' catalogs point into
    cold packs, and only the locations of dead chunks may go stale under them.

    Liveness comes from cold's own files (records, `.pruned` markers, manifests), which every
    host flushes to, so it holds for all hosts: a version not on cold yet never needs a cold
    pack, because saves on a tiered store only reuse chunks with a copy on hot, and eviction
    keeps those until the version is on cold (see `ObjectStore.dedup` and `Evictor`). The
    sweep lock keeps flushers from publishing a version while its packs are judged.

    Raises NotFoundError/IntegrityError, changing nothing, if a manifest of a version that is
    not pruned cannot be read from cold (gc must not guess what is live).
    """
    store = as_repository(store)
    cold, cat = store.cold, store.catalog
    assert cold is not None
    skipped: list[str] = []
    with cold.sweep_lock():
        pruned = set(cold.iter_ids("versions", "pruned"))
        live_m: set[str] = set()
        named_m: set[str] = set()
        for vid in cold.iter_ids("versions", "json"):
            try:
                mids = json.loads(cold.read_record(vid) or b"{}").get("manifests", {}).values()
            except ValueError as exc:
                raise IntegrityError(f"gc stopped before changing anything: the record of {vid[:12]} on cold is "
                                     f"not JSON ({exc}); run `datastates fsck`") from exc
            named_m.update(mids)
            if vid not in pruned:
                live_m.update(mids)
        live: set[bytes] = set()
        for mid in progress(sorted(live_m), "gc: reading cold manifests", unit="manifest"):
            try:
                col = Manifest(mid, cold.read_manifest(mid), verify=True).table.column("chunks").combine_chunks()
            except (DataStatesError, OSError) as exc:
                raise IntegrityError(f"gc stopped before changing anything: manifest {mid[:12]} of a version that "
                                     f"is not pruned cannot be read from cold ({exc}); run `datastates fsck`") from exc
            live.update(col.flatten().to_pylist())
        now = time.time()
        dead: list[tuple[str, int]] = []
        for path in progress(list(list_packs(cold.root / "packs")), "gc: judging cold packs", unit="pack"):
            pack = path.name.removesuffix(".pack")
            try:
                st = path.stat()
                index = read_index(path)
            except (OSError, IntegrityError) as exc:
                skipped.append(f"cold pack {pack}: {exc}")
                continue
            if now - st.st_mtime < grace_s:
                continue  # a flush may be on its way to naming it
            if not any(cid in live for cid, _ in index):
                dead.append((pack, st.st_size))
        dead_m = {mid: n for mid in sorted(named_m - live_m) if (n := _size(cold.manifest_path(mid))) is not None}
        freed = sum(n for _, n in dead) + sum(dead_m.values())
        dropped = 0
        if not dry_run:
            for pack, _ in progress(dead, "gc: deleting cold packs", unit="pack"):
                if not store.hot.pack_path(pack).exists():
                    dropped += cat.drop_pack(pack)  # no copy left anywhere this host reads from
                cold.reader.forget(pack)
                cold.pack_path(pack).unlink(missing_ok=True)
            if dead:
                fsync_dir(cold.root / "packs")
            dirs: set[Path] = set()
            for mid in dead_m:
                cold.manifest_path(mid).unlink(missing_ok=True)
                dirs.add(cold.manifest_path(mid).parent)
            for d in dirs:
                fsync_dir(d)
    return GcReport(dry_run, tuple(p for p, _ in dead), manifests_deleted=len(dead_m), chunks_live=len(live),
                    chunks_dropped=dropped, bytes_freed={cold.name: freed}, skipped=tuple(skipped))


def _exists(path: Path) -> bool | None:
    """Whether `path` exists; None when its file system cannot be asked (an unmounted cold tier)."""
    try:
        return path.exists()
    except OSError:
        return None


def _size(path: Path) -> int | None:
    """The file's size, None if it is gone (a manifest an earlier gc deleted already)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _groups(entries: list[tuple[bytes, ChunkLocation]]) -> list[list[tuple[bytes, ChunkLocation]]]:
    """Split live chunks into the new packs a repack writes (same rule in dry and real runs)."""
    groups: list[list[tuple[bytes, ChunkLocation]]] = []
    size = 0
    for e in entries:
        if not groups or size >= REPACK_PACK_BYTES:
            groups.append([])
            size = len(HEADER)
        groups[-1].append(e)
        size += e[1].length
    return groups


def _repack(store: Repository, sparse: list[_Sparse], groups: list[list[tuple[bytes, ChunkLocation]]],
            skipped: list[str]) -> tuple[int, int, set[str]]:
    """Copy the live chunks of sparse packs into new packs and repoint the catalog.

    Returns (bytes written, packs written, old packs whose every live chunk now
    lives elsewhere). An old pack with a live chunk that fails verification is
    left in place and named in `skipped`; the catalog keeps pointing into it.
    """
    tier, cat = store.tier, store.catalog
    owner = {cid: s.pack for s in sparse for cid, _ in s.live}
    bad: set[str] = set()
    written, n_written = 0, 0
    total = sum(loc.length for g in groups for _, loc in g)
    bar = progress_bar(total, "gc: repacking", unit="B", unit_scale=True)
    try:
        for group in groups:
            w = tier.new_pack()
            moved: list[tuple[bytes, ChunkLocation]] = []
            try:
                for cid, loc in group:
                    data = tier.reader.read(loc)
                    if store.verify and not _intact(cid, loc, data):
                        bad.add(owner[cid])
                        skipped.append(f"pack {owner[cid]}: live chunk {cid.hex()[:16]} at offset {loc.offset} is "
                                       "corrupt; pack kept, run `datastates fsck`")
                        continue
                    moved.append((cid, w.add(cid, data, loc.raw_length, loc.codec)))
                    bar.update(loc.length)
                w.seal()
            except BaseException:
                w.abort()
                raise
            size = w.path.stat().st_size
            # Name the new pack, then move each chunk onto it; the old copies stay readable until the end.
            cat.add_pack_chunks(w.id, {"size": size, "chunks": w.count, "tier": tier.name}, [])
            cat.set_chunks((cid, loc) for cid, loc in moved if owner[cid] not in bad)
            written += size
            n_written += 1
    finally:
        bar.close()
    return written, n_written, {s.pack for s in sparse} - bad


def _intact(cid: bytes, loc: ChunkLocation, data: bytes) -> bool:
    try:
        if loc.codec == CODEC_ZSTD:
            import zstandard

            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=loc.raw_length)
        return len(data) == loc.raw_length and chunk_id(data) == cid
    except Exception:
        return False


# the command line ----------------------------------------------------------------------------------------------
