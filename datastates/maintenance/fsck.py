"""Checking and repairing a store: `datastates fsck [--repair] [--rebuild]`.

fsck reads every pack, manifest, record and ref and reports what is wrong.
`repair` removes debris of interrupted saves (temp files, packs and manifests
no committed version names), indexes complete records the catalog missed and
drops catalog entries whose files are gone. It never deletes a file that a
committed version needs: a corrupt chunk is reported, not removed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from ..base.files import copy_file, tmp_is_stale
from ..base.progress import progress
from ..errors import DataStatesError, IntegrityError
from ..meta.catalog import CommitBatch
from ..objects.chunks import CODEC_ZSTD, chunk_id
from ..objects.packs import list_packs, read_index
from ..repo.repository import Repository, as_repository
from ..save.manifest import Manifest

if TYPE_CHECKING:
    from ..objects.tier import Tier


@dataclass
class FsckReport:
    """What fsck found (`problems`) and, with repair, what it changed (`repaired`)."""

    checked: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    corrupt_chunks: list[dict[str, Any]] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Harmless findings (space gc can free); they do not make the store not ok."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked": self.checked, "problems": self.problems, "notes": self.notes,
                "corrupt_chunks": self.corrupt_chunks, "repaired": self.repaired}


def rebuild_catalog(store: Repository) -> int:
    """Rebuild the LMDB catalog from the files of every tier; return the number of versions indexed.

    Packs are byte-identical on every tier that holds them, so one location
    serves all. A version found on cold is marked resident there; one found
    only on hot is queued for flushing again.
    """
    store = as_repository(store)
    cat = store.catalog
    cat.clear()
    for tier in store.tiers:
        for path in progress(list(list_packs(tier.root / "packs")), f"rebuild: indexing {tier.name} packs",
                             unit="pack"):
            try:
                idx = read_index(path)
            except (IntegrityError, OSError):
                continue  # fsck reports damaged packs; their chunks stay unindexed
            pack = path.name.removesuffix(".pack")
            cat.add_pack_chunks(pack, {"size": path.stat().st_size, "chunks": len(idx), "tier": tier.name}, idx)
    on_cold = set(store.cold.iter_ids("versions", "json")) if store.cold is not None else set()
    flush_rest = store.cold is not None and not store.tiering.flush.tagged_only
    n = 0
    for tier in store.tiers:
        for vid in progress(list(tier.iter_ids("versions", "json")), f"rebuild: indexing {tier.name} versions",
                            unit="version"):
            if cat.record(vid) is not None:
                continue
            data = tier.read_record(vid)
            if data is None or blake3.blake3(data).hexdigest() != vid:
                continue
            extra: dict[str, Any] = {}
            if store.cold is not None:
                extra = {"cold": True} if vid in on_cold else ({"flush": "pending"} if flush_rest else {})
            cat.commit(CommitBatch(vid, data, list(json.loads(data).get("parents", [])), extra=extra))
            n += 1
    for tier in reversed(store.tiers):  # hot last: its annotations are the newest
        for vid in tier.iter_ids("annotations", "json"):
            try:
                cat.set_annotations(vid, json.loads(tier.annotation_path(vid).read_text()))
            except (OSError, ValueError):
                continue
    # A `<id>.pruned` marker beside a record (written by datastates.retention.prune) is the truth: without
    # it a rebuilt catalog would offer a pruned version whose bytes gc may already have freed.
    for tier in store.tiers:
        for vid in tier.iter_ids("versions", "pruned"):
            if cat.record(vid) is not None:
                cat.update_extra(vid, {"pruned": True})
    return n


def fsck(store: Repository, *, repair: bool = False, rebuild: bool = False) -> FsckReport:
    """Verify every chunk, manifest, record and ref of the store; see the module docstring."""
    store = as_repository(store)
    rep = FsckReport()
    tier, cat = store.tier, store.catalog
    with tier.exclusive():
        if rebuild:
            n = rebuild_catalog(store)
            rep.repaired.append(f"rebuilt the catalog from files: {n} versions")
        _check_leftovers(store, rep, repair)
        live_packs = _check_packs(store, rep, repair)
        manifests_needed, packs_needed = _check_records(store, rep, repair)
        _check_orphans(store, rep, repair, live_packs, manifests_needed, packs_needed)
        for kind in ("branch", "tag"):
            for name, vid in store.refs_on(tier).names(kind).items():  # type: ignore[arg-type]
                rep.checked["refs"] = rep.checked.get("refs", 0) + 1
                if cat.record(vid) is None and tier.read_record(vid) is None:
                    rep.problems.append(f"{kind} {name!r} points at missing version {vid[:12]}")
    return rep


def _check_leftovers(store: Repository, rep: FsckReport, repair: bool) -> None:
    for tier in store.tiers:
        for p in tier.leftovers():
            if tier.shared and not tmp_is_stale(p):
                continue  # another host (or a live process) may be writing it right now
            where = f"{tier.name}:{p.relative_to(tier.root)}"
            if repair:
                p.unlink(missing_ok=True)
                rep.repaired.append(f"removed leftover {where}")
            else:
                rep.problems.append(f"leftover of an interrupted write: {where}")


def _check_packs(store: Repository, rep: FsckReport, repair: bool = False) -> set[str]:
    """Verify every chunk of every tier; with repair, replace a corrupt pack by a good copy on another tier.
    Returns the sealed packs of the hot (catalog) tier."""
    live: set[str] = set()
    for tier in store.tiers:
        bad = _check_tier_packs(store, tier, rep, live if tier is store.tier else set())
        for pack in sorted(bad):
            if repair:
                _repair_pack(store, tier, pack, rep)
    return live


def _repair_pack(store: Repository, tier: Tier, pack: str, rep: FsckReport) -> None:
    for other in store.tiers:
        if other is tier or not other.pack_path(pack).exists():
            continue
        probe = FsckReport()
        if _check_tier_packs(store, other, probe, set(), only=pack):
            continue  # that copy is damaged too
        tier.reader.forget(pack)
        copy_file(other.pack_path(pack), tier.pack_path(pack), overwrite=True)
        rep.repaired.append(f"replaced corrupt pack {pack} on {tier.name} with the good copy from {other.name}")
        rep.problems[:] = [p for p in rep.problems if not (pack in p and f"on tier {tier.name}" in p)]
        return


def _check_tier_packs(store: Repository, tier: Tier, rep: FsckReport, live: set[str],
                      only: str | None = None) -> set[str]:
    bad: set[str] = set()
    reader = tier.reader
    paths = [tier.pack_path(only)] if only else list(list_packs(tier.root / "packs"))
    for path in progress(paths, f"fsck: verifying {tier.name} packs", unit="pack"):
        pack = path.name.removesuffix(".pack")
        rep.checked["packs"] = rep.checked.get("packs", 0) + 1
        try:
            idx = read_index(path)
        except (IntegrityError, OSError) as exc:
            rep.problems.append(f"{exc} (on tier {tier.name})")
            bad.add(pack)
            continue
        live.add(pack)
        for cid, loc in idx:
            rep.checked["chunks"] = rep.checked.get("chunks", 0) + 1
            try:
                data = reader.read(loc)
                if loc.codec == CODEC_ZSTD:
                    import zstandard

                    data = zstandard.ZstdDecompressor().decompress(data, max_output_size=loc.raw_length)
                good = chunk_id(data) == cid
            except Exception:  # any decode failure (zstd raises its own type) means a bad chunk
                good = False
            if not good:
                bad.add(pack)
                rep.corrupt_chunks.append({"chunk": cid.hex(), "pack": pack, "offset": loc.offset,
                                           "tier": tier.name})
                rep.problems.append(f"chunk {cid.hex()[:16]} in pack {pack} at offset {loc.offset} is corrupt "
                                    f"(blake3 mismatch) on tier {tier.name}")
    return bad


def _check_records(store: Repository, rep: FsckReport, repair: bool) -> tuple[set[str], set[str]]:
    """Check every version record of every tier against the catalog; return the manifests and
    packs that versions need (pruned versions' packs count as needed: freeing them is gc's job)."""
    cat = store.catalog
    manifests_needed: set[str] = set()
    packs_needed: set[str] = set()
    home: dict[str, Tier] = {}
    for tier in store.tiers:
        for vid in tier.iter_ids("versions", "json"):
            home.setdefault(vid, tier)
    for vid, tier in home.items():
        rep.checked["versions"] = rep.checked.get("versions", 0) + 1
        data = tier.read_record(vid) or b""
        if blake3.blake3(data).hexdigest() != vid:
            rep.problems.append(f"version record {vid[:12]} on tier {tier.name} does not match its id (damaged)")
            continue
        rec = json.loads(data)
        pruned = bool(cat.extra(vid).get("pruned")) or tier.record_path(vid).with_suffix(".pruned").exists()
        complete = True
        mids = list(rec.get("manifests", {}).values())
        for mid in mids:
            try:
                m = Manifest(mid, store.objects.read_manifest_bytes(mid))
            except (DataStatesError, OSError, ValueError) as exc:
                if not pruned:
                    rep.problems.append(f"version {vid[:12]}: manifest {mid[:12]}: {exc}")
                    complete = False
                continue
            for r in m.rows:
                for cid, loc in zip(r["chunks"], cat.chunks(r["chunks"])):
                    if loc is not None:
                        packs_needed.add(loc.pack)
                    elif not pruned:
                        complete = False
                        rep.problems.append(f"version {vid[:12]}: chunk {cid.hex()[:16]} of {r['key']!r} is missing")
        if cat.record(vid) is None:
            if repair and complete:
                cat.commit(CommitBatch(vid, data, list(rec.get("parents", []))))
                rep.repaired.append(f"indexed version {vid[:12]} that the catalog had missed")
            elif repair and not tier.shared:
                tier.record_path(vid).unlink(missing_ok=True)
                rep.repaired.append(f"removed incomplete, never-committed version record {vid[:12]}")
                continue  # its manifests are debris now
            else:
                rep.problems.append(f"version {vid[:12]} has a record but is not in the catalog")
        manifests_needed.update(mids)
    for vid, data in list(cat.records()):
        if vid not in home:
            if repair:
                cat.drop_version(vid, list(json.loads(data).get("parents", [])))
                rep.repaired.append(f"dropped catalog entry of version {vid[:12]} whose record file is gone")
            else:
                rep.problems.append(f"catalog lists version {vid[:12]} but its record file is gone")
    return manifests_needed, packs_needed


def _check_orphans(store: Repository, rep: FsckReport, repair: bool, live: set[str], manifests_needed: set[str],
                   packs_needed: set[str]) -> None:
    tier, cat = store.tier, store.catalog
    for mid in list(tier.iter_ids("manifests", "arrow")):
        if mid not in manifests_needed:
            _orphan(rep, repair, tier.manifest_path(mid), f"manifest {mid[:12]} named by no version", tier.root)
    for pack in sorted(live - packs_needed):
        if _duplicates_only(store, pack):
            # Two writers stored the same new chunk; the catalog uses the other copy. Dead weight, not
            # damage: gc deletes it.
            rep.notes.append(f"pack {pack} only repeats chunks stored elsewhere; `datastates gc` frees it")
            continue
        store.tier.reader.forget(pack)
        if repair:
            cat.drop_pack(pack)
        _orphan(rep, repair, tier.pack_path(pack), f"pack {pack} holds no chunk a version needs", tier.root)
    for pack in cat.packs():
        if pack not in live and not any(t.pack_path(pack).exists() for t in store.tiers):
            if repair:
                cat.drop_pack(pack)
                rep.repaired.append(f"dropped catalog entries of missing pack {pack}")
            else:
                rep.problems.append(f"catalog indexes pack {pack} but its file is gone")


def _duplicates_only(store: Repository, pack: str) -> bool:
    try:
        idx = read_index(store.tier.pack_path(pack))
    except (IntegrityError, OSError):
        return False
    locs = store.catalog.chunks([cid for cid, _ in idx])
    return bool(idx) and all(loc is not None and loc.pack != pack for loc in locs)


def _orphan(rep: FsckReport, repair: bool, path: Path, what: str, root: Path) -> None:
    if repair:
        path.unlink(missing_ok=True)
        rep.repaired.append(f"removed {what} ({path.relative_to(root)})")
    else:
        rep.problems.append(f"{what} (leftover of an interrupted save): {path.relative_to(root)}")
