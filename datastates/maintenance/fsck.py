"""Checking and repairing a store: `datastates fsck [--repair] [--rebuild]`.

fsck reads every copy, on every tier, of every pack, manifest, version record (and the catalog's
copy of it), annotation file and ref, and reports what is wrong and on which tier. Without
`repair` it changes nothing. `repair` only restores: a damaged copy is rewritten from an intact
copy (one whose blake3 matches) on another tier or in the catalog; a damaged file with no intact
copy is moved to `quarantine/` (report line in quarantine/report.jsonl) and its version is
marked damaged; versions are never removed. It also removes debris of interrupted saves (temp
files whose writer is gone, packs and manifests no version names, only when every record and
manifest could be read, and never a pack holding a chunk some manifest names: that pack is indexed
again) and of a gc killed mid-repack (a pack no catalog entry names whose every chunk the catalog
locates intact in another pack), and indexes complete records the catalog missed. On a cold tier it
writes the pruned marker of a version the catalog marks pruned whose record is there without it (a
prune run while cold was unreachable). A corrupt chunk is reported and its pack restored from
another tier when one holds a good copy, never removed; with no good copy anywhere its index entry is
dropped, so that the next save of its bytes stores them again (which heals the versions needing it)
instead of naming the bad copy. A pack gone from every tier is reported with the versions that
need it; its catalog entries stay for when it is put back.
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from ..base.files import copy_file, replace, tmp_is_stale, tmp_writer, write_new
from ..base.progress import progress
from ..errors import CatalogDamagedError, DataStatesError, IntegrityError
from ..meta.catalog import CommitBatch
from ..meta.refs import RefStore, ref_name
from ..meta.versions import decode_annotations, encode_annotations, readable
from ..objects.chunks import CODEC_ZSTD, ChunkLocation, chunk_id
from ..objects.packs import list_packs, read_index
from ..repo.repository import Repository, as_repository
from ..save.manifest import Manifest
from .retention import PRUNED_EXT, reachable_tiers, write_marker

if TYPE_CHECKING:
    from ..objects.tier import Tier

log = logging.getLogger("datastates")
_OWN_HINT = re.compile("; run `" + r"datastates fsck[^`]*`")  # split: tests/test_hints.py runs hint literals


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

    Atomic for readers: the catalog is emptied and filled again in one LMDB write transaction
    (`Catalog.rewrite`), so a process reading meanwhile (a training job's load, a server) sees the old catalog
    or the rebuilt one, never one half empty (which said versions did not exist); a rebuild that fails leaves
    the old catalog as it was.
    """
    store = as_repository(store)
    try:  # annotations whose file was lost live on in the catalog: not rebuilt from files, they are kept
        kept = store.catalog.all_annotations()
    except Exception:  # a damaged catalog (the usual reason to rebuild) may not give them back
        kept = {}  # (read in a transaction of its own: a failed read must not spoil the rebuild's)
    with store.catalog.rewrite():
        return _rebuild_catalog(store, kept)


def _rebuild_catalog(store: Repository, kept: dict[str, dict[str, Any]]) -> int:
    """`rebuild_catalog`'s work, inside its one transaction; `kept`: the annotations the catalog held."""
    cat = store.catalog
    cat.clear()
    listed = listed_bad(store.tiers)
    for tier in store.tiers:
        for path in progress(list(list_packs(tier.root / "packs")), f"rebuild: indexing {tier.name} packs",
                             unit="pack"):
            try:
                idx = read_index(path)
            except (IntegrityError, OSError):
                continue  # fsck reports damaged packs; their chunks stay unindexed
            pack = path.name.removesuffix(".pack")
            cat.add_pack_file(path, tier.name, idx, skip=still_bad(store, listed, pack, idx))
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
                cat.set_annotations(vid, decode_annotations(tier.annotation_path(vid).read_bytes()))
            except (OSError, ValueError) as exc:
                # never silently: fsck lists the file; an intact copy on the other tier (if any) is used
                log.warning("annotations of version %s on tier %s %s; run `datastates fsck`", vid[:12],
                            tier.name, exc)
    for vid, values in kept.items():
        if values and cat.record(vid) is not None and not any(t.annotation_path(vid).exists() for t in store.tiers):
            cat.set_annotations(vid, values)
            write_new(store.tier.annotation_path(vid), encode_annotations(values))
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
    tier = store.tier
    with tier.exclusive(reading=not (repair or rebuild)):
        try:
            _check_all(store, rep, repair, rebuild)
        except CatalogDamagedError as exc:
            # A damaged catalog value fsck cannot mend here (a version's extra or annotations entry): said, with
            # the command that rebuilds it, instead of a traceback; the checks after it did not run.
            rep.problems.append(f"{exc} (fsck stopped there: run it again after that)")
    return rep


def _check_all(store: Repository, rep: FsckReport, repair: bool, rebuild: bool) -> None:
    """Every check, in order (what `fsck` runs under the tier's lock)."""
    if rebuild:
        n = rebuild_catalog(store)
        rep.repaired.append(f"rebuilt the catalog from files: {n} versions")
    _check_leftovers(store, rep, repair)
    live_packs = _check_packs(store, rep, repair)
    _check_locations(store, rep, repair)
    corrupt = _unlocate_corrupt(store, rep, repair)
    needs = _check_records(store, rep, repair, _unindexed_chunks(store, live_packs, corrupt), corrupt)
    _check_missing_packs(store, rep, repair, live_packs, needs)
    _check_cold_copies(store, rep, repair, live_packs, needs)
    _check_cold_markers(store, rep, repair)
    if needs.sure:
        _check_orphans(store, rep, repair, live_packs, needs)
    else:
        rep.notes.append("unreferenced manifests and packs were not looked for: a version record or manifest "
                         "has no intact copy, so what it needs is unknown")
    _check_annotations(store, rep, repair)
    _check_refs(store, rep, repair)


def _check_refs(store: Repository, rep: FsckReport, repair: bool) -> None:
    """Every branch and tag file of every tier: one that does not hold a version id, or holds a well-formed id of
    no version (a flipped hex digit), is damaged. With repair it is restored from another tier's copy when that
    one is intact, names a version, and is where the damaged tier's own reflog says its ref was last set (two
    records agreeing: no guess); else it is moved to quarantine/ (which version it meant would be a guess). A
    ref in quarantine/ that was not made again stays a note, so it is not forgotten after the repair."""
    cat = store.catalog

    def exists(vid: str) -> bool:
        return cat.raw_record(vid) is not None or any(u.read_record(vid) is not None for u in store.tiers)

    for t in store.tiers:
        refs = store.refs_on(t)
        for kind in ("branch", "tag"):
            bad = [(name, path, f"{kind} {name!r}: ref file {path} on tier {t.name} {why}", f"ref file {why}")
                   for name, path, why in refs.damaged(kind)]  # type: ignore[arg-type]
            named = refs.names(kind)  # type: ignore[arg-type]
            rep.checked["refs"] = rep.checked.get("refs", 0) + len(named) + len(bad)
            for name, vid in named.items():
                if not exists(vid):
                    # The whole id: a short one may be the prefix of a version that exists (`datastates show`).
                    bad.append((name, refs.path_of(kind, name),  # type: ignore[arg-type]
                                f"{kind} {name!r} on tier {t.name} points at version {vid}, which no tier holds",
                                f"points at missing version {vid}"))
            for name, path, what, why in bad:
                source = _intact_ref_elsewhere(store, t, kind, name, exists)
                if not repair:
                    mend = (f"`datastates fsck --repair` restores it from tier {source[0]}" if source else
                            "`datastates fsck --repair` moves it to quarantine/")
                    rep.problems.append(f"{what}; {mend}")
                    continue
                moved = t.quarantine(path, f"{kind} {name!r}: {why}")
                if source is not None:
                    refs.set_if_equals(kind, name, None, source[1],  # type: ignore[arg-type]
                                       f"fsck --repair: restored from tier {source[0]}")
                    rep.repaired.append(f"restored damaged {kind} {name!r} on tier {t.name} from tier {source[0]} "
                                        f"(version {source[1][:12]}, where its reflog says it was last set); the "
                                        f"damaged file is in {moved.relative_to(t.root)}")
                else:
                    rep.repaired.append(f"moved damaged {kind} {name!r} on tier {t.name} ({why}) to "
                                        f"{moved.relative_to(t.root)}; its reflog (Store.reflog({name!r}, "
                                        f"{kind!r})) shows where it pointed before; recreate the ref")
            if not repair:
                _note_quarantined_refs(t, refs, kind, rep, exists)


def _intact_ref_elsewhere(store: Repository, tier: Tier, kind: str, name: str,
                          exists: Callable[[str], bool]) -> tuple[str, str] | None:
    """(tier name, id) of an intact copy of ref `name` on a tier other than `tier`, naming a version that exists
    and equal to where `tier`'s own reflog last set it; None when there is no such copy. A ref may differ
    between tiers for good reasons (hot ahead of cold until the flusher catches up): the reflog decides."""
    last = [e.get("new") for e in store.refs_on(tier).reflog(kind, name)]  # type: ignore[arg-type]
    if not last or not isinstance(last[-1], str):
        return None
    for other in store.tiers:
        if other is tier:
            continue
        try:
            vid = store.refs_on(other).get(kind, name)  # type: ignore[arg-type]
        except IntegrityError:
            continue  # damaged there too
        if vid is not None and vid == last[-1] and exists(vid):
            return other.name, vid
    return None


def _note_quarantined_refs(tier: Tier, refs: RefStore, kind: str, rep: FsckReport,
                           exists: Callable[[str], bool]) -> None:
    """A note for each ref of `kind` that fsck --repair moved to quarantine/ on `tier` and nobody made again:
    after the repair the store is consistent, but the ref a person relied on (`main`) is gone from every
    listing, and `log` fails on it."""
    report = tier.root / "quarantine" / "report.jsonl"
    prefix = f"refs/{'heads' if kind == 'branch' else 'tags'}/"
    try:
        lines = report.read_bytes().splitlines()
    except OSError:
        return
    seen: set[str] = set()
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        f = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(f, str) or not f.startswith(prefix) or f in seen:
            continue
        seen.add(f)
        path = tier.root / f
        if path.exists():
            continue  # made again since
        name = ref_name(path.name)
        gone = f"{kind} {name!r} on tier {tier.name} is in quarantine/ ({entry.get('moved_to')}) and was not made again"
        last = [e.get("new") for e in refs.reflog(kind, name)]  # type: ignore[arg-type]
        there = last[-1] if last and isinstance(last[-1], str) and exists(last[-1]) else None
        if there is None:
            rep.notes.append(f"{gone}; its reflog (Store.reflog({name!r}, {kind!r})) shows where it pointed: recreate "
                             f"it with Store.{kind}({name!r}, ...)")
        elif kind == "branch":
            rep.notes.append(f"{gone}; its reflog says it was last set to version {there[:12]}: "
                             f"`datastates branch -f {name} {there[:12]}` makes it again there")
        else:
            rep.notes.append(f"{gone}; its reflog says it was last set to version {there[:12]}: "
                             f"Store.tag({name!r}, {there[:12]!r}) makes it again there")


def _check_leftovers(store: Repository, rep: FsckReport, repair: bool) -> None:
    """Temp files of interrupted writes: reported, and with repair removed, only when their writer is gone.

    A temp whose name carries a host and pid (`files._tmp_path`: every `write_new`, `replace`, `copy_file` and
    FileSink) is debris only when `tmp_is_stale` says so, on every tier. The writers lock fsck holds does not
    make a node-local tier's temps debris: it keeps saves out, but refs (tag, branch, their deletion) and
    annotations are written (`replace`) under the ref lock only, and a load promotes packs from cold
    (`copy_file`) under no lock; deleting such a temp broke that writer's rename (a tag silently not made).
    The pid rule covers every writer, present and future; making each take the writers lock instead would make
    a tag wait for a whole gc or fsck, and miss the next writer added. A temp without host and pid is a save's
    `<pack id>.pack.tmp`: on a node-local tier the writers lock proves its save is gone; on a shared tier
    (another host's save) only its age does."""
    for tier in store.tiers:
        for p in tier.leftovers():
            save_gone = not tier.shared and tmp_writer(p) is None  # a `.pack.tmp`, and no save runs
            if not save_gone and not tmp_is_stale(p):
                continue  # a live process (or another host) may be writing it right now
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


def _check_locations(store: Repository, rep: FsckReport, repair: bool) -> None:
    """Every chunk location the catalog holds, against the index of the pack it names (the pack's own record of
    where each chunk is, checksummed): a location that index lacks is a damaged catalog entry (a flipped byte of
    an offset), which made every load of the chunk blame the pack while fsck said ok. With repair it is written
    again from the index of the pack that holds the chunk (that pack first, then the catalog tier's packs, then
    the other tiers'). A location in a pack no tier holds intact is the missing-pack check's (a pack in the
    catalog's `packs` table) or damage (a pack id nothing knows).

    Memory: one 8-byte digest per pack index entry (a sorted array), not the indexes themselves (a dict of every
    pack's index cost ~310 bytes per chunk: 3 GB for 10 million chunks; a review). The catalog is then walked in
    batches, each looked up in that array."""
    cat = store.catalog
    digests = array("q")
    intact: set[str] = set()  # packs with an intact index on some tier
    for t in store.tiers:
        for path in list_packs(t.root / "packs"):
            pack = path.name.removesuffix(".pack")
            if pack in intact:
                continue  # packs are byte-identical on every tier that holds them
            idx = _index(path)
            if idx is None:
                continue
            intact.add(pack)
            digests.extend(hash((cid, *loc)) for cid, loc in idx)
    held = np.sort(np.frombuffer(digests, dtype=np.int64)) if digests else np.empty(0, dtype=np.int64)
    known = set(cat.pack_ids())
    wrong: list[tuple[bytes, ChunkLocation]] = []

    def check(batch: list[tuple[bytes, ChunkLocation]]) -> None:
        want = np.fromiter((hash((cid, *loc)) for cid, loc in batch), dtype=np.int64, count=len(batch))
        at = np.searchsorted(held, want)
        found = (at < len(held)) & (held[np.minimum(at, len(held) - 1)] == want) if len(held) else \
            np.zeros(len(batch), dtype=bool)
        rep.checked["chunk locations"] = rep.checked.get("chunk locations", 0) + len(batch)
        for (cid, loc), ok in zip(batch, found.tolist()):
            if not ok and not (loc.pack in known and loc.pack not in intact):
                wrong.append((cid, loc))  # (a pack missing or damaged: _check_missing_packs and _check_packs)

    batch: list[tuple[bytes, ChunkLocation]] = []
    for item in cat.iter_chunks():
        batch.append(item)
        if len(batch) == 65536:
            check(batch)
            batch = []
    if batch:
        check(batch)
    if not wrong:
        return
    # Where each wrongly located chunk really is: the pack its entry names first, then any pack (the catalog's
    # tier first: its packs are what loads read first). Only these few chunks are looked for.
    lost = {cid for cid, _ in wrong}
    found_in: dict[str, dict[bytes, ChunkLocation]] = {}
    anywhere: dict[bytes, ChunkLocation] = {}
    for t in store.tiers:
        for path in list_packs(t.root / "packs"):
            pack = path.name.removesuffix(".pack")
            for c, at in _index(path) or ():
                if c in lost:
                    found_in.setdefault(pack, {}).setdefault(c, at)
                    anywhere.setdefault(c, at)
    for cid, loc in wrong:
        good = found_in.get(loc.pack, {}).get(cid) or anywhere.get(cid)
        what = (f"the catalog locates chunk {cid.hex()} in pack {loc.pack} at offset {loc.offset} (length "
                f"{loc.length}), which that pack's index does not (a damaged catalog entry)")
        if good is None:
            rep.problems.append(f"{what}, and no pack holds the chunk; `datastates fsck --rebuild` rebuilds the "
                                "catalog from the pack files")
        elif repair:
            cat.set_chunk(cid, good)
            rep.repaired.append(f"wrote the catalog's location of chunk {cid.hex()} again from the index of pack "
                                f"{good.pack} (offset {good.offset}; it said {loc.pack} at {loc.offset})")
        else:
            rep.problems.append(f"{what}; `datastates fsck --repair` writes it again from the index of pack "
                                f"{good.pack}")


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
            # The read's own hint says to run fsck, which is what is running: say what repair can do instead.
            what = _OWN_HINT.sub("", str(exc))
            mend = ("`datastates fsck --repair` puts back an intact copy from the other tier if it has one"
                    if len(store.tiers) > 1 else "restore the pack file from a backup")
            rep.problems.append(f"{what} (on tier {tier.name}; {mend})")
            bad.add(pack)
            continue
        live.add(pack)
        for cid, loc in idx:
            rep.checked["chunks"] = rep.checked.get("chunks", 0) + 1
            if not _chunk_ok(reader, cid, loc):
                bad.add(pack)
                rep.corrupt_chunks.append({"chunk": cid.hex(), "pack": pack, "offset": loc.offset,
                                           "tier": tier.name})
                rep.problems.append(f"chunk {cid.hex()[:16]} in pack {pack} at offset {loc.offset} is corrupt "
                                    f"(blake3 mismatch) on tier {tier.name}")
    return bad


def _copies(store: Repository, kind: str, oid: str) -> tuple[bytes | None, list[tuple[Tier, Path]]]:
    """(the bytes of an intact copy or None, [(tier, path) of every damaged copy]) of a record or
    manifest, reading every tier's copy directly (no repair, no promotion: fsck changes nothing)."""
    good: bytes | None = None
    bad: list[tuple[Tier, Path]] = []
    for t in store.tiers:
        path = t.record_path(oid) if kind == "record" else t.manifest_path(oid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError:
            bad.append((t, path))
            continue
        if blake3.blake3(data).hexdigest() == oid:
            good = good if good is not None else data
        else:
            bad.append((t, path))
    return good, bad


def _mend(store: Repository, rep: FsckReport, repair: bool, what: str, vid: str, good: bytes | None,
          bad: list[tuple[Tier, Path]]) -> bool:
    """Report each damaged copy (naming its tier); with repair, rewrite it from `good` when there is
    one, else move it to quarantine/ and mark version `vid` damaged. Returns False when no intact
    copy exists."""
    for t, path in bad:
        where = f"{what} on tier {t.name} ({path.relative_to(t.root)})"
        if not repair:
            rep.problems.append(f"{where} does not match its id (damaged)")
        elif good is not None:
            replace(path, good)
            rep.repaired.append(f"restored damaged {where} from an intact copy")
        else:
            moved = t.quarantine(path, f"{what} does not match its id and no tier holds an intact copy")
            rep.repaired.append(f"moved damaged {where} to {moved.relative_to(t.root)}: no intact copy")
            _mark_damaged(store, vid, f"{t.name}:{path.relative_to(t.root)}")
    if good is None and bad and repair:
        rep.problems.append(f"{what} has no intact copy on any tier: version {vid[:12]} is marked damaged")
    return good is not None


def _mark_damaged(store: Repository, vid: str, what: str) -> None:
    if store.catalog.raw_record(vid) is not None:
        store.catalog.update_extra(vid, {"damaged": what})


@dataclass
class Needs:
    """What the versions need, from their manifests: `packs` (each with the versions needing it) and
    `manifests`. Pruned versions' count: freeing their
    bytes is gc's job. `sure` is False when some record or manifest has no intact copy anywhere: what it
    names is unknown, so nothing may be called unreferenced."""

    manifests: set[str] = field(default_factory=set)
    packs: dict[str, set[str]] = field(default_factory=dict)
    flushed: dict[str, list[str]] = field(default_factory=dict)
    """Versions the catalog marks as flushed to cold and no tier marks pruned -> their manifests."""
    flushed_chunks: dict[str, set[bytes]] = field(default_factory=dict)
    """The chunks of those versions (which cold must hold once the version is published there)."""
    sure: bool = True


def _unindexed_chunks(store: Repository, live: set[str], corrupt: set[tuple[bytes, str]]) -> dict[bytes, str]:
    """The chunks that sealed packs of the catalog's tier hold and the catalog does not locate, each with its
    pack: what a catalog older than the packs (restored from a backup, or a save killed between its pack and its
    commit) lacks. A version needing them is not missing them. Not the `corrupt` copies ((chunk, pack) pairs):
    indexing one again would have the next save of those bytes name it (`_unlocate_corrupt`). An intact copy of
    the same chunk in another pack is one (a pack a killed gc repack left unindexed may hold the only good copy):
    the pack holding it is indexed again, never removed as unneeded."""
    out: dict[bytes, str] = {}
    cat = store.catalog
    for pack in sorted(live):
        idx = _index(store.tier.pack_path(pack))
        if not idx:
            continue
        for (cid, _), loc in zip(idx, cat.chunks([cid for cid, _ in idx])):
            if loc is None and (cid, pack) not in corrupt:
                out.setdefault(cid, pack)
    return out


def _unlocate_corrupt(store: Repository, rep: FsckReport, repair: bool) -> set[tuple[bytes, str]]:
    """The chunks found corrupt where the catalog locates them on every tier that holds that pack (after
    `_check_packs`' repair, which puts back a good copy from another tier when there is one). A save of the same
    bytes named such a copy (dedup by id), so every later version of those values was unloadable too. With
    repair their index entries are dropped: the next save of the bytes stores them again, and the versions that
    need them load again from then on (their manifests name the id, and the id the new copy). Nothing is
    deleted: the bad copy stays in its pack. Returns (chunk id, pack) of every corrupt copy found."""
    corrupt = {bytes.fromhex(c["chunk"]) for c in rep.corrupt_chunks}
    if not corrupt:
        return set()
    cids = sorted(corrupt)
    lost: list[bytes] = []
    lost_at: list[tuple[bytes, str]] = []
    for cid, loc in zip(cids, store.catalog.chunks(cids)):
        if loc is None:
            continue
        if not _intact_somewhere(store, cid, loc, unreadable=True):  # (a read that failed drops nothing)
            lost.append(cid)
            lost_at.append((cid, loc.pack))
            continue
        # The catalog locates an intact copy (a save stored the bytes again after a repair dropped the bad one's
        # entry, or another tier holds it): the bad copy is a stale duplicate no read uses, which gc repacks away.
        stale = [c for c in rep.corrupt_chunks if c["chunk"] == cid.hex() and c["pack"] != loc.pack]
        for c in stale:
            rep.problems[:] = [p for p in rep.problems
                               if not (cid.hex()[:16] in p and c["pack"] in p and "is corrupt" in p)]
            rep.notes.append(f"chunk {cid.hex()[:16]} has a corrupt copy in pack {c['pack']} on tier {c['tier']} "
                             f"that no read uses (the catalog locates an intact one in pack {loc.pack}); "
                             "`datastates gc` repacks it away once the pack is sparse")
    if lost and repair:
        # Listed before the entries go (a kill between leaves a list the next repair repeats, never an entry
        # dropped unlisted): a catalog rebuilt from the pack files would otherwise index the bad copies again.
        for tier in reachable_tiers(store):  # (never onto an unmounted cold mount point)
            try:
                tier.note_bad_copies(lost_at, "corrupt on every tier; fsck --repair dropped its index entry")
            except OSError as exc:
                if tier is store.tier:
                    raise  # the catalog tier's list is the one a rebuild here reads: no drop without it
                log.warning("fsck: could not list the corrupt copies on tier %s (%s); another host's refresh may "
                            "index them", tier.name, exc)
        store.catalog.drop_chunks(lost)
        rep.repaired.extend(f"dropped the index entry of chunk {cid.hex()[:16]}, corrupt on every tier: the next "
                            "save of its bytes stores it again, and the versions that need it load from then on"
                            for cid in lost)
    elif lost:
        rep.problems.extend(f"chunk {cid.hex()[:16]} is corrupt on every tier, and a save of the same bytes would "
                            "name the bad copy; `datastates fsck --repair` drops its index entry so that the next "
                            "save stores it again" for cid in lost)
    return {(bytes.fromhex(c["chunk"]), c["pack"]) for c in rep.corrupt_chunks}


def listed_bad(tiers: list[Tier]) -> dict[str, set[bytes]]:
    """Pack -> the chunk ids whose copy in it fsck --repair listed as corrupt on any of `tiers`
    (`Tier.note_bad_copies`)."""
    out: dict[str, set[bytes]] = {}
    for tier in tiers:
        for cid, pack in tier.bad_copies():
            out.setdefault(pack, set()).add(cid)
    return out


def still_bad(store: Repository, listed: dict[str, set[bytes]], pack: str,
              index: list[tuple[bytes, ChunkLocation]]) -> set[bytes]:
    """The chunks of `pack` (its `index`) that are `listed` bad and read back intact on no tier now: what a
    catalog built from the pack files must not index (a save would name the bad copy, dedup by id, and commit a
    version that cannot be loaded). A listed copy put back intact (from a backup) is indexed again; one that
    cannot be read (EIO) is not: a later `fsck --repair` indexes it once it reads back intact."""
    ids = listed.get(pack)
    if not ids:
        return set()
    return {cid for cid, loc in index if cid in ids and not _intact_somewhere(store, cid, loc, unreadable=False)}


def _intact_at(tier: Tier, cid: bytes, loc: ChunkLocation, unreadable: bool) -> bool:
    """Whether `tier`'s copy of pack `loc.pack` holds chunk `cid` intact at `loc`; `unreadable` when it cannot be
    read (an I/O error, an NFS hiccup), which says nothing of the bytes: each caller picks the answer that
    changes nothing (True before dropping an index entry, False before removing another copy)."""
    try:
        return tier.pack_path(loc.pack).exists() and _chunk_ok(tier.reader, cid, loc, unreadable=OSError)
    except OSError:
        return unreadable


def _chunk_ok(reader: Any, cid: bytes, loc: ChunkLocation,
              unreadable: type[BaseException] | tuple[type[BaseException], ...] = ()) -> bool:
    """Whether the bytes `reader` reads at `loc` (decompressed) hash to `cid`. A read or decode failure is a bad
    copy, but the `unreadable` errors, raised to the caller."""
    try:
        data = reader.read(loc)
        if loc.codec == CODEC_ZSTD:
            import zstandard

            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=loc.raw_length)
        return chunk_id(data) == cid
    except unreadable:
        raise
    except Exception:  # any other read or decode failure (zstd raises its own type) is a bad copy
        return False


def _check_records(store: Repository, rep: FsckReport, repair: bool, unindexed: dict[bytes, str],
                   corrupt: set[tuple[bytes, str]]) -> Needs:
    """Check every copy of every version record (each tier's file and the catalog's copy) and of
    every manifest they name; returns what the versions need. `unindexed`: chunks in packs the catalog does not
    index (`_unindexed_chunks`); a pack holding some that an intact version needs is indexed again with repair,
    before a version that needs it is, never removed. `corrupt`: (chunk, pack) of copies found corrupt; a pack
    holding the bad copy of a chunk a version needs and no catalog entry locates (repair dropped it:
    `_unlocate_corrupt`) is needed all the same: never removed as unused (a byte put back from a backup makes it
    whole again)."""
    corrupt_in: dict[bytes, set[str]] = {}
    for cid, pack in corrupt:
        corrupt_in.setdefault(cid, set()).add(pack)
    cat = store.catalog
    needs = Needs()
    reindexed: set[str] = set()
    flush = store.tiering.flush
    skips_versions = store.cold is not None and (flush.tagged_only or flush.every > 1)
    ids: dict[str, None] = {}
    for tier in store.tiers:
        ids.update(dict.fromkeys(tier.iter_ids("versions", "json")))
    in_catalog = dict(cat.raw_records())
    ids.update(dict.fromkeys(in_catalog))
    for vid in ids:
        rep.checked["versions"] = rep.checked.get("versions", 0) + 1
        good, bad = _copies(store, "record", vid)
        indexed = in_catalog.get(vid)
        if indexed is not None and blake3.blake3(indexed).hexdigest() != vid:
            if repair and good is not None:
                cat.put_record(vid, good)
                rep.repaired.append(f"re-indexed the damaged catalog copy of version {vid[:12]} from its record file")
            elif not repair or good is None:
                rep.problems.append(f"the catalog's copy of version {vid[:12]} does not match its id (damaged)")
        elif indexed is not None:
            good = good if good is not None else indexed  # the catalog's copy verifies: it is an intact copy
        if not _mend(store, rep, repair, f"version record {vid[:12]}", vid, good, bad):
            needs.sure = False
            continue
        assert good is not None
        if indexed is not None and not any(t.record_path(vid).exists() for t in store.tiers):
            if repair:
                write_new(store.tier.record_path(vid), good)
                rep.repaired.append(f"rewrote the missing record file of version {vid[:12]} on tier "
                                    f"{store.tier.name} from the catalog's verified copy")
            else:
                rep.problems.append(f"catalog lists version {vid[:12]} but its record file is gone from every tier")
        rec, _ = readable(json.loads(good))
        for parent in rec.get("parents", []):
            if isinstance(parent, str) and parent not in ids:
                # Its record is lost or in quarantine/ (no intact copy anywhere): the lineage walks (`log`)
                # stop here, and no repair can bring it back; say so on every run, not only the first. Unless the
                # flush policy leaves versions off cold: then it may be on the hot tier of the node that saved it.
                where = (f"version {vid[:12]} names parent {parent}, whose record no tier or catalog holds "
                         f"here")
                if skips_versions:
                    rep.notes.append(f"{where}: the flush policy ({store.tiering.flush}) leaves versions off cold, "
                                     "so it may be on the hot tier of the node that saved it")
                else:
                    rep.problems.append(f"{where} (lost, or in quarantine/ with no intact copy): put an intact "
                                        f"copy back at versions/{parent[:2]}/{parent}.json from a backup")
        pruned = bool(cat.extra(vid).get("pruned")) or any(
            t.record_path(vid).with_suffix(".pruned").exists() for t in store.tiers)
        complete = True
        lost_packs: set[str] = set()  # packs holding chunks of this version that the catalog does not index
        mids = [m for m in rec.get("manifests", {}).values() if isinstance(m, str)]
        for mid in mids:
            mgood, mbad = _copies(store, "manifest", mid)
            if mbad:
                _mend(store, rep, repair, f"manifest {mid[:12]} of version {vid[:12]}", vid, mgood, mbad)
            if mgood is None:
                # Damaged, missing or in quarantine/: what it names is unknown, so no pack may be called unused
                # (the pack of a version whose manifest is put back from a backup must still be there). A pruned
                # version's manifest may be gone: gc frees what pruned versions held.
                if indexed is not None and (not pruned or mbad):  # (never committed: debris, see below)
                    needs.sure = False
                if not pruned:
                    complete = False
                    if not mbad:
                        rep.problems.append(f"version {vid[:12]}: manifest {mid} is missing from every tier")
                continue
            try:
                m = Manifest(mid, mgood)
            except (DataStatesError, ValueError) as exc:
                rep.problems.append(f"version {vid[:12]}: manifest {mid[:12]}: {exc}")
                complete = False
                needs.sure = False
                continue
            on_cold = store.cold is not None and indexed is not None and bool(cat.extra(vid).get("cold"))
            if on_cold and not pruned:
                needs.flushed.setdefault(vid, []).append(mid)
            for r in m.rows:
                if on_cold and not pruned:
                    needs.flushed_chunks.setdefault(vid, set()).update(r["chunks"])
                for cid, loc in zip(r["chunks"], cat.chunks(r["chunks"])):
                    if loc is not None:
                        needs.packs.setdefault(loc.pack, set()).add(vid)
                    elif cid in unindexed:
                        lost_packs.add(unindexed[cid])
                    elif cid in corrupt_in:
                        for pack in corrupt_in[cid]:
                            needs.packs.setdefault(pack, set()).add(vid)
                        if not pruned:
                            complete = False
                            rep.problems.append(f"version {vid[:12]}: chunk {cid.hex()} of {r['key']!r} is corrupt on "
                                                "every tier (it loads again once a save stores those bytes again)")
                    elif not pruned:
                        complete = False
                        rep.problems.append(f"version {vid[:12]}: chunk {cid.hex()} of {r['key']!r} is missing")
        needs.manifests.update(mids)
        if indexed is not None or complete:  # (never committed and incomplete: debris, see below)
            for pack in sorted(lost_packs):
                needs.packs.setdefault(pack, set()).add(vid)
                if pack not in reindexed:
                    reindexed.add(pack)
                    _reindex_pack(store, rep, repair, pack, unindexed)
        marked = cat.extra(vid).get("damaged") if indexed is not None else None
        if marked and complete:
            if repair:  # the quarantined file was put back intact (from a backup): the version loads again
                cat.update_extra(vid, drop=("damaged",))
                rep.repaired.append(f"version {vid[:12]} is whole again ({marked} is intact): cleared its damaged mark")
            else:
                rep.problems.append(f"version {vid[:12]} is marked damaged but {marked} is intact again; "
                                    "`datastates fsck --repair` clears the mark")
        elif marked:
            rep.problems.append(f"version {vid[:12]} is damaged: {marked} is in quarantine/ (no intact copy)")
        if indexed is None:
            if repair and complete:
                cat.commit(CommitBatch(vid, good, list(rec.get("parents", []))))
                rep.repaired.append(f"indexed version {vid[:12]} that the catalog had missed")
            elif repair:
                # An incomplete record no catalog names: debris of a save that failed, most likely; but it
                # is not provably garbage, so it goes to quarantine/, not away.
                for t in store.tiers:
                    if t.record_path(vid).exists() and not t.shared:
                        moved = t.quarantine(t.record_path(vid), "incomplete version record no catalog names")
                        rep.repaired.append(f"moved incomplete, never-committed version record {vid[:12]} to "
                                            f"{moved.relative_to(t.root)}")
            else:
                rep.problems.append(f"version {vid[:12]} has a record but is not in the catalog")
    return needs


def _check_annotations(store: Repository, rep: FsckReport, repair: bool) -> None:
    """Verify every annotation file of every tier; with repair, rewrite a damaged one from the
    catalog's copy (the live one) or from another tier's intact copy, else move it to quarantine/. Annotations
    the catalog holds whose file is gone from every tier are written back from the catalog (a catalog rebuilt
    from the files would otherwise lose them)."""
    cat = store.catalog
    for vid, values in cat.all_annotations().items():
        if values and not any(t.annotation_path(vid).exists() for t in store.tiers):
            where = f"annotations of version {vid[:12]}"
            if repair:
                write_new(store.tier.annotation_path(vid), encode_annotations(values))
                rep.repaired.append(f"rewrote the missing file of the {where} on tier {store.tier.name} from the "
                                    "catalog's copy")
            else:
                rep.problems.append(f"the file of the {where} is gone from every tier (the catalog still holds "
                                    "them; `datastates fsck --repair` writes it back)")
    for t in store.tiers:
        for vid in list(t.iter_ids("annotations", "json")):
            rep.checked["annotations"] = rep.checked.get("annotations", 0) + 1
            path = t.annotation_path(vid)
            try:
                decode_annotations(path.read_bytes())
                continue
            except (OSError, ValueError) as exc:
                why = str(exc)
            where = f"annotations of version {vid[:12]} on tier {t.name} ({path.relative_to(t.root)})"
            if not repair:
                rep.problems.append(f"{where} {why} (damaged)")
                continue
            good: dict[str, Any] | None = cat.annotations(vid) or None
            for other in store.tiers:
                if good is None and other is not t:
                    try:
                        good = decode_annotations(other.annotation_path(vid).read_bytes())
                    except (OSError, ValueError):
                        pass
            if good is not None:
                replace(path, encode_annotations(good))
                rep.repaired.append(f"restored damaged {where} from an intact copy")
            else:
                moved = t.quarantine(path, f"annotations {why}; no intact copy")
                rep.repaired.append(f"moved damaged {where} to {moved.relative_to(t.root)}: no intact copy")
                rep.problems.append(f"{where} had no intact copy; it is in quarantine/")


def _check_missing_packs(store: Repository, rep: FsckReport, repair: bool, live: set[str], needs: Needs) -> None:
    """A pack the catalog indexes whose file is gone from every tier. Its entries are kept while a version
    needs it: dropping them would make fsck say ok for versions that lost their tensors, and a pack put back
    from a backup would no longer be found. Only a pack no version needs is forgotten."""
    cat = store.catalog
    away = [t.name for t in store.tiers if not (t.root / "FORMAT").exists()]  # unreachable now (a cold mount)
    entries = cat.pack_entries()
    for pack in sorted(p for p, info in entries.items() if info is None):
        _mend_pack_entry(store, rep, repair, pack)
    for pack in entries:
        if pack in live or any(t.pack_path(pack).exists() for t in store.tiers):
            continue
        users = needs.packs.get(pack)
        if away:  # an evicted pack is on cold only: nothing is known lost until every tier can be read
            if users:
                rep.notes.append(f"pack {pack} ({len(users)} version(s) need it) is on no reachable tier; tier "
                                 f"{', '.join(away)} cannot be read now: run `datastates fsck` again once it is back")
            continue
        if users and store.cold is not None and all(_elsewhere(store, v) for v in users):
            # A collective save's parts live on the hot tiers of the nodes that wrote them until flushed.
            rep.notes.append(f"pack {pack} is on no tier of this node; the {len(users)} version(s) needing it "
                             "were saved by several ranks and are not on cold yet, so it may be on another "
                             "node's hot tier")
            continue
        if users:
            shown_ids = ", ".join(sorted(v[:12] for v in users)[:10]) + (", ..." if len(users) > 10 else "")
            rep.problems.append(
                f"pack {pack} is missing from every tier and {len(users)} version(s) need its chunks "
                f"({shown_ids}): loading them fails until the file is put back into packs/ from a backup "
                "(then `datastates fsck` checks it); repair cannot restore it")
        elif repair:
            cat.drop_pack(pack)
            rep.repaired.append(f"dropped catalog entries of missing pack {pack} (no version needs it)")
        else:
            rep.problems.append(f"catalog indexes pack {pack} but its file is gone (no version needs it)")


def _mend_pack_entry(store: Repository, rep: FsckReport, repair: bool, pack: str) -> None:
    """A catalog `packs` entry that is not a JSON object (a damaged byte). Everything it holds but a collective
    save's `rank` is known from the pack file (its size, its index's chunk count, the tier it is on): with repair
    it is written again from the first tier whose copy has an intact index. Without one, only a rebuild helps."""
    for t in store.tiers:
        idx = _index(t.pack_path(pack))
        if idx is None:
            continue
        if not repair:
            rep.problems.append(store.catalog.damaged_pack_message(pack))
        else:
            store.catalog.add_pack_file(t.pack_path(pack), t.name, idx, locations=False)  # (checked apart)
            rep.repaired.append(f"wrote the damaged catalog entry of pack {pack} again from its file on tier {t.name}")
        return
    rep.problems.append(f"catalog {store.catalog.path / 'data.mdb'}: the entry of pack {pack} is damaged (not a JSON "
                        "object) and no tier holds the pack file with an intact index to write it again from; "
                        "`datastates fsck --rebuild` rebuilds the catalog from the files")


def _elsewhere(store: Repository, vid: str) -> bool:
    """Whether version `vid` was saved by several ranks and is not flushed: its packs may be on other nodes."""
    if store.catalog.extra(vid).get("cold"):
        return False
    try:
        return store.version(vid, annotated=False).world_size > 1
    except DataStatesError:
        return False


def _check_cold_copies(store: Repository, rep: FsckReport, repair: bool, live: set[str], needs: Needs) -> None:
    """Every version published on cold (its record is there: the flusher writes it last, after the packs and
    manifests) must have its manifests and chunks there too: cold is what a restart without this node's hot
    tier reads. One missing is copied back from hot with repair (content-addressed files: publishing nothing),
    else reported. A version without its record on cold is left alone: it may be a collective save whose other
    parts are still on their way (rank 0 writes the record last), and writing the record would publish it."""
    cold, cat = store.cold, store.catalog
    if cold is None or not (cold.root / "FORMAT").exists():
        return  # one tier, or cold unreachable now (the flusher catches up when it is back)
    published = {vid for vid in needs.flushed if cold.record_path(vid).exists()}
    wanted: list[tuple[str, Path, Path | None]] = []  # (what, cold path, hot source)
    for vid in sorted(published):
        for mid in needs.flushed[vid]:
            wanted.append((f"manifest {mid[:12]} of version {vid[:12]}", cold.manifest_path(mid),
                           store.tier.manifest_path(mid)))
    # Chunks, not packs: the catalog may locate a flushed version's chunk in a newer hot pack (written again
    # after an eviction) while cold holds it in the pack it was flushed in.
    chunks = {cid for vid in published for cid in needs.flushed_chunks.get(vid, ())}
    on_cold = {cid for path in list_packs(cold.root / "packs") for cid, _ in (_index(path) or ())}
    lacking: dict[str, int] = {}
    for loc in cat.chunks(sorted(chunks - on_cold)):
        if loc is not None:
            lacking[loc.pack] = lacking.get(loc.pack, 0) + 1
    for pack, n in sorted(lacking.items()):
        wanted.append((f"pack {pack} ({n} chunk(s) of flushed versions)", cold.pack_path(pack),
                       store.tier.pack_path(pack) if pack in live else None))
    for what, target, source in wanted:
        if target.exists():
            continue
        if repair and source is not None and source.exists():
            copy_file(source, target)
            rep.repaired.append(f"restored the {what} on tier cold from hot")
        else:
            rep.problems.append(f"the {what} is missing from tier cold, where the version is published"
                                + ("; `datastates fsck --repair` copies it from hot" if source is not None
                                   and source.exists() else "; no other copy"))


def _check_cold_markers(store: Repository, rep: FsckReport, repair: bool) -> None:
    """Every version this catalog marks pruned whose record is on cold must have its pruned marker there: cold is
    what another host's gc and a node opening cold with a fresh hot tier read, and without the marker they take
    it for a live version (its bytes are never freed there, and the gc stops if its manifests are gone; a load
    says "missing" instead of PrunedError). A prune run while cold was unreachable marked hot only. With repair
    the marker is written (restoring what the catalog says, nothing guessed); else reported."""
    cold = store.cold
    if cold is None or not (cold.root / "FORMAT").exists():
        return  # one tier, or cold unreachable now (the next prune writes the markers when it is back)
    marked = set(cold.iter_ids("versions", PRUNED_EXT))
    for vid in sorted(store.catalog.pruned_ids() - marked):
        if not cold.record_path(vid).exists():
            continue  # not published on cold: nothing there reads it as a version
        if repair:
            write_marker(cold, vid)
            rep.repaired.append(f"wrote the pruned marker of version {vid[:12]} on tier cold, where its record "
                                "was published without it")
        else:
            rep.problems.append(f"version {vid[:12]} is pruned but its record on tier cold has no pruned marker (a "
                                "prune ran while cold was unreachable): a node opening cold takes it for a live "
                                "version; `datastates fsck --repair` (or the next prune) writes the marker")


def _check_orphans(store: Repository, rep: FsckReport, repair: bool, live: set[str], needs: Needs) -> None:
    tier, cat = store.tier, store.catalog
    for mid in list(tier.iter_ids("manifests", "arrow")):
        if mid not in needs.manifests:
            path = tier.manifest_path(mid)
            if repair:
                _orphan(rep, repair, path, f"manifest {mid[:12]} named by no version", tier.root)
            else:  # debris of a save that failed or was interrupted, not damage: no version lacks anything
                rep.notes.append(f"manifest {mid[:12]} is named by no version (leftover of a failed or interrupted "
                                 f"save): {path.relative_to(tier.root)}; `datastates fsck --repair` removes it")
    indexed = set(cat.pack_ids())
    for pack in sorted(live - set(needs.packs)):
        idx = _index(tier.pack_path(pack))
        if idx is None:
            continue  # damaged: _check_packs reported it; never removed
        if _duplicates_only(store, pack):
            # Every chunk of it is located in another pack: no read uses it. Dead weight, not damage.
            if pack in indexed:
                # Two writers stored the same new chunk and the catalog uses the other copy: gc deletes a pack
                # the catalog knows once no chunk location names it.
                rep.notes.append(f"pack {pack} only repeats chunks stored elsewhere; `datastates gc` frees it")
            elif not all(loc is not None and _intact_somewhere(store, cid, loc, unreadable=False)
                         for (cid, _), loc in zip(idx, cat.chunks([c for c, _ in idx]))):
                # Some chunk's located copy is corrupt on every tier: this pack may hold its only good copy.
                rep.notes.append(f"pack {pack} repeats chunks the catalog locates in other packs, some of which "
                                 "are corrupt there: kept, as it may hold their only intact copy")
            elif repair:
                # A pack no catalog entry names is one gc never looks at (it judges the packs the catalog knows):
                # a gc killed between sealing a repacked pack and indexing it left this, a second copy of live
                # data, forever. Every chunk has an intact copy the catalog locates, and fsck holds the tier's
                # writers lock (no save or gc writes meanwhile), so no read can need this one.
                tier.reader.forget(pack)
                _orphan(rep, repair, tier.pack_path(pack), f"pack {pack}, which no catalog entry names and only "
                        "repeats chunks the catalog locates intact in other packs (left by a gc or save killed "
                        "before indexing it)", tier.root)
            else:
                rep.notes.append(f"pack {pack} is named by no catalog entry and only repeats chunks the catalog "
                                 "locates intact in other packs (left by a gc or save killed before indexing it); "
                                 "`datastates fsck --repair` removes it")
            continue
        store.tier.reader.forget(pack)
        if repair:
            cat.drop_pack(pack)
        _orphan(rep, repair, tier.pack_path(pack), f"pack {pack} holds no chunk a version needs", tier.root)


def _reindex_pack(store: Repository, rep: FsckReport, repair: bool, pack: str, unindexed: dict[bytes, str]) -> None:
    """Index `pack` again (its chunks that the catalog does not locate); without repair, report it."""
    held = sum(1 for p in unindexed.values() if p == pack)
    if not repair:
        rep.problems.append(f"pack {pack} holds {held} chunk(s) versions need that the catalog does not index; "
                            "`datastates fsck --repair` indexes them")
        return
    path = store.tier.pack_path(pack)
    idx = _index(path) or []
    bad = listed_bad(store.tiers)  # never a copy listed or found corrupt (a save would name it)
    bad.setdefault(pack, set()).update(bytes.fromhex(c["chunk"]) for c in rep.corrupt_chunks if c["pack"] == pack)
    store.catalog.add_pack_file(path, store.tier.name, idx, skip=still_bad(store, bad, pack, idx))
    rep.repaired.append(f"indexed pack {pack} again: it holds {held} chunk(s) versions need that the catalog had "
                        "lost")


def _index(path: Path) -> list[tuple[bytes, Any]] | None:
    try:
        return list(read_index(path))
    except (IntegrityError, OSError):
        return None


def _duplicates_only(store: Repository, pack: str) -> bool:
    idx = _index(store.tier.pack_path(pack))
    if idx is None:
        return False
    locs = store.catalog.chunks([cid for cid, _ in idx])
    return bool(idx) and all(loc is not None and loc.pack != pack for loc in locs)


def _intact_somewhere(store: Repository, cid: bytes, loc: ChunkLocation, unreadable: bool) -> bool:
    """Whether some tier holds chunk `cid` intact at the catalog's location `loc` (`unreadable`: see `_intact_at`)."""
    return any(_intact_at(t, cid, loc, unreadable) for t in store.tiers)


def _orphan(rep: FsckReport, repair: bool, path: Path, what: str, root: Path) -> None:
    if repair:
        path.unlink(missing_ok=True)
        rep.repaired.append(f"removed {what} ({path.relative_to(root)})")
    else:
        rep.problems.append(f"{what} (leftover of an interrupted save): {path.relative_to(root)}")
