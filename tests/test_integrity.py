"""Metadata integrity (issue 12): every byte of metadata is checked like the chunks are.

Each test damages real files of a real store (a flipped byte, a truncation, a deleted file), single
tier and tiered (`Store.open(cold, hot=hot)`), and checks that reads verify and fall back to an intact
copy, that damage ends in a typed error naming the file, that `fsck` changes nothing and names the
tier, and that `fsck --repair` only restores or quarantines: no version ever disappears.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

import datastates as ds
from datastates.base.files import HOST
from datastates.cli import main as cli_main
from datastates.errors import CatalogDamagedError, IntegrityError, StorageFullError, StoreFormatError
from datastates.meta.catalog import Catalog
from datastates.meta.versions import encode_annotations

KIB = 1 << 10


def flip(path: Path, offset: int = -1) -> None:
    """Invert one byte of a file in place (offset -1: the middle)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset < 0 else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root` (LMDB's reader lock table excluded: it
    records readers, not data)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "lock.mdb"}


def states(n: int) -> list[dict[str, Any]]:
    return [{"w": torch.arange(64, dtype=torch.float32) + i, "n": {"step": i}} for i in range(n)]


def make(tmp_path: Path, tiered: bool, n: int = 3) -> tuple[Path, Path | None, list[str]]:
    """A store with `n` versions on main (flushed to cold when tiered), closed; returns (cold, hot, ids)."""
    cold, hot = tmp_path / "cold", (tmp_path / "hot" if tiered else None)
    s = ds.Store.open(cold, hot=hot, chunk_size=4 * KIB)
    ids = []
    for i, st in enumerate(states(n)):
        ids.append(s.save(st, step=i).id)
    s.annotate(ids[0], note="first")
    if tiered:
        assert s.flush(timeout=60)
    s.close()
    return cold, hot, ids


def open_store(cold: Path, hot: Path | None) -> ds.Store:
    return ds.Store.open(cold, hot=hot, create=False)


def roots(cold: Path, hot: Path | None) -> list[Path]:
    return [cold] if hot is None else [hot, cold]


def loads(cold: Path, hot: Path | None, ids: list[str]) -> dict[str, bool]:
    """id -> whether the version loads with exactly the values it was saved with."""
    out = {}
    s = open_store(cold, hot)
    try:
        for i, vid in enumerate(ids):
            try:
                got = s.load(vid)
                out[vid] = bool(torch.equal(got["w"], states(len(ids))[i]["w"]))
            except ds.DataStatesError:
                out[vid] = False
    finally:
        s.close()
    return out


def files(root: Path, kind: str) -> list[Path]:
    ext = {"versions": "json", "manifests": "arrow", "annotations": "json"}[kind]
    return sorted((root / kind).rglob(f"*.{ext}"))


TIERED = pytest.mark.parametrize("tiered", [False, True], ids=["single", "tiered"])


# 1. records and manifests verified on every read ------------------------------------------------

def damage_catalog_copy(cat_dir: Path, vid: str, old: bytes, new: bytes) -> bytes:
    """Replace `old` by `new` in the catalog's copy of record `vid`; return the intact bytes."""
    c = Catalog(cat_dir)
    raw = c.raw_record(vid)
    assert raw is not None and old in raw
    with c.env.begin(write=True) as txn:
        txn.put(bytes.fromhex(vid), raw.replace(old, new), db=c._db["versions"])
    c.close()
    return raw


@TIERED
def test_damaged_catalog_copy_is_reread_from_record_file(tmp_path: Path, tiered: bool) -> None:
    cold, hot, ids = make(tmp_path, tiered)
    raw = damage_catalog_copy((hot or cold) / "catalog", ids[1], b'"step":1', b'"step":7')
    s = open_store(cold, hot)
    try:
        # A load reads the record first (`Catalog.entry`: record and extra in one transaction, no annotations):
        # checked against its id, and the catalog copy mended from the record file.
        assert s.load(ids[1])["w"][0].item() == 1.0
        assert s.catalog.raw_record(ids[1]) == raw  # mended
        assert s.version(ids[1]).step == 1  # not the 7 the damaged copy said
        assert [v.step for v in s.log()] == [2, 1, 0]
        entry = s.catalog.entry(ids[1], annotations=False)
        assert entry is not None and entry[0] == raw and entry[2] == {}
        assert s.catalog.entry("ab" * 32) is None
        assert s.repo.version(ids[0], annotated=False).annotations == {}  # what a load reads
        assert s.version(ids[0]).annotations == {"note": "first"}
    finally:
        s.close()


def test_damaged_record_file_falls_back_to_cold_copy(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    rec = next(p for p in files(hot, "versions") if p.stem == ids[1])
    good = rec.read_bytes()
    flip(rec)
    c = Catalog(hot / "catalog")
    with c.env.begin(write=True) as txn:  # the catalog copy damaged as well: only cold's file is intact
        txn.put(bytes.fromhex(ids[1]), good[:-2] + b"}}", db=c._db["versions"])
    c.close()
    s = open_store(cold, hot)
    try:
        assert s.version(ids[1]).step == 1
        assert rec.read_bytes() == good  # the hot copy was mended from cold
    finally:
        s.close()


def test_record_with_no_intact_copy_is_a_typed_error_naming_the_file(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, False)
    rec = next(p for p in files(cold, "versions") if p.stem == ids[1])
    flip(rec)
    c = Catalog(cold / "catalog")
    raw = c.raw_record(ids[1])
    assert raw is not None
    with c.env.begin(write=True) as txn:
        txn.put(bytes.fromhex(ids[1]), raw[:-1] + b" ", db=c._db["versions"])
    c.close()
    s = open_store(cold, hot)
    try:
        with pytest.raises(IntegrityError) as ei:
            s.version(ids[1])
        assert str(rec) in str(ei.value) and f"`datastates --store {cold} fsck --repair`" in str(ei.value)
        assert s.load(ids[2])["w"][0].item() == 2.0  # the others are unaffected
    finally:
        s.close()


def test_damaged_hot_manifest_falls_back_to_cold_and_is_repaired(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    man = files(hot, "manifests")[0]
    good = man.read_bytes()
    flip(man)
    assert all(loads(cold, hot, ids).values())
    assert man.read_bytes() == good


# 2. refs, config, catalog file -----------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip", "garbage", "truncate", "empty"])
def test_damaged_ref_does_not_take_the_store_down(tmp_path: Path, damage: str) -> None:
    """(An empty file was read as no ref: the branch vanished from every listing and fsck said ok.)"""
    cold, hot, ids = make(tmp_path, False)
    s = open_store(cold, hot)
    s.branch("other", ids[0])
    s.close()
    ref = cold / "refs" / "heads" / "other"
    if damage == "flip":
        flip(ref, 3)
    elif damage == "garbage":
        ref.write_bytes(b"\xff\xfe not an id\n")
    elif damage == "truncate":
        ref.write_bytes(ref.read_bytes()[:20])
    else:
        ref.write_bytes(b"")
    s = open_store(cold, hot)
    try:
        assert s.branches() == {"main": ids[2]}  # skipped, the other refs still list
        assert s.resolve("main") == ids[2]
        with pytest.raises(IntegrityError) as ei:
            s.resolve("other")
        assert str(ref) in str(ei.value) and f"`datastates --store {cold} fsck --repair`" in str(ei.value)
        rep = s.fsck()
        assert any("'other'" in p and "tier" in p for p in rep.problems)
        rep = s.fsck(repair=True)
        assert not ref.exists()
        moved = list((cold / "quarantine" / "refs" / "heads").iterdir())
        assert len(moved) == 1
        report = [json.loads(line) for line in (cold / "quarantine" / "report.jsonl").read_text().splitlines()]
        assert report[-1]["file"] == "refs/heads/other" and report[-1]["reason"] and report[-1]["time"] > 0
        assert s.fsck().ok
    finally:
        s.close()


@pytest.mark.parametrize("content", [b"[tiers]\nhot = \"\xff\xfe\"\n", b"[tiers\nhot = 3", b"tiers = 3\n"])
def test_damaged_config_is_store_format_error(tmp_path: Path, content: bytes) -> None:
    cold, hot, _ = make(tmp_path, True)
    (cold / "config.toml").write_bytes(content)
    with pytest.raises(StoreFormatError) as ei:
        ds.Store.open(cold, create=False)
    assert "config.toml" in str(ei.value)


@TIERED
def test_truncated_catalog_is_typed_error_and_repair_rebuilds(tmp_path: Path, tiered: bool) -> None:
    cold, hot, ids = make(tmp_path, tiered, n=40)
    data = (hot or cold) / "catalog" / "data.mdb"
    size = data.stat().st_size
    assert size > 3 * 4096
    os.truncate(data, size - 4096)
    # In a child process: were the check missing, LMDB would kill the process with SIGBUS.
    code = ("import sys, datastates as ds\n"
            f"try:\n ds.Store.open({str(cold)!r}, hot={str(hot) if hot else None!r}, create=False)\n"
            "except ds.DataStatesError as e:\n print(type(e).__name__, e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "CatalogDamagedError" in r.stdout and f"`datastates --store {cold} fsck --repair`" in r.stdout
    with pytest.raises(CatalogDamagedError):
        open_store(cold, hot)
    assert cli_main(["fsck", "--repair", "--store", str(cold)]) == 0
    assert list(((hot or cold) / "quarantine").glob("catalog.*"))
    assert all(loads(cold, hot, ids).values())


def test_annotations_checksummed_damage_reported_and_old_files_read(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, False)
    ann = files(cold, "annotations")[0]
    assert b'"_blake3"' in ann.read_bytes()
    flip(ann, ann.read_bytes().index(b"first"))
    s = open_store(cold, hot)
    try:
        rep = s.fsck()
        assert any("annotations" in p and ids[0][:12] in p for p in rep.problems)
        s.fsck(repair=True)  # restored from the catalog's live copy
        assert s.fsck().ok
        assert s.version(ids[0]).annotations == {"note": "first"}
    finally:
        s.close()
    ann.write_bytes(json.dumps({"note": "old style"}).encode())  # written before checksums
    shutil.rmtree(cold / "catalog")
    s = open_store(cold, hot)  # rebuilds the catalog from the files
    try:
        assert s.version(ids[0]).annotations == {"note": "old style"}
        assert s.fsck().ok
    finally:
        s.close()


# 3. fsck changes nothing; repair never deletes ---------------------------------------------------

@TIERED
def test_fsck_without_repair_changes_nothing(tmp_path: Path, tiered: bool) -> None:
    cold, hot, ids = make(tmp_path, tiered)
    for r in roots(cold, hot):
        flip(files(r, "versions")[0])
        flip(files(r, "manifests")[0])
    (cold / "refs" / "heads" / "junk").write_bytes(b"\xff")
    s = open_store(cold, hot)
    before = {str(r): tree(r) for r in roots(cold, hot)}
    rep = s.fsck()
    after = {str(r): tree(r) for r in roots(cold, hot)}
    s.close()
    assert before == after
    assert not rep.ok
    for tier in (["hot", "cold"] if tiered else ["hot"]):
        assert any(f"on tier {tier}" in p and "version record" in p for p in rep.problems)
        assert any(f"on tier {tier}" in p and "manifest" in p for p in rep.problems)



def temp_of(final: Path, pid: int, data: bytes) -> Path:
    """A temp file beside `final` named as process `pid` of this host names the temps it writes
    (docs/format.md section 1), holding `data`."""
    path = final.with_name(f".{final.name}.{HOST[:60]}.{pid}.{os.urandom(4).hex()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@TIERED
def test_fsck_leaves_the_temp_files_of_live_writers_alone(tmp_path: Path, tiered: bool) -> None:
    """Regression: fsck --repair took every temp file on a node-local tier for debris, as its exclusive writers
    lock keeps saves out; but tag, branch and annotate write their temps under the ref lock only, so a tag being
    made in another process lost its temp (its rename failed with a bare FileNotFoundError: no tag), and plain
    fsck called it a problem. Now a temp naming a live process of this host (a child waiting on a pipe, or this
    test itself) is neither removed nor reported; a dead process's is, and so is a save's `.pack.tmp` there."""
    cold, hot, ids = make(tmp_path, tiered)
    local = hot or cold  # the node-local tier: the catalog's, where refs and annotations are written first
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    assert gone.wait(timeout=120) == 0  # reaped: its pid names no process now
    note = encode_annotations({"note": "in flight"})
    ref = [vid.encode() + b"\n" for vid in ids]
    try:
        # (tag "keep" and an annotation being written by the child, branch "side" by this process)
        live = {temp_of(local / "refs" / "tags" / "keep", writer.pid, ref[1]): ref[1],
                temp_of(local / "annotations" / ids[2][:2] / f"{ids[2]}.json", writer.pid, note): note,
                temp_of(local / "refs" / "heads" / "side", os.getpid(), ref[0]): ref[0]}
        dead = [temp_of(local / "refs" / "tags" / "lost", gone.pid, ref[0]),
                temp_of(local / "annotations" / ids[0][:2] / f"{ids[0]}.json", gone.pid, note)]
        (local / "packs" / f"{'ab' * 16}.pack.tmp").write_bytes(b"\0" * 100)  # a killed save's: no pid in the name
        dead.append(local / "packs" / f"{'ab' * 16}.pack.tmp")
        s = open_store(cold, hot)
        try:
            before = tree(local)
            rep = s.fsck()
            assert tree(local) == before  # plain fsck changes nothing
            leftovers = [p for p in rep.problems if "leftover" in p]
            assert len(leftovers) == 3 and len(rep.problems) == 3, rep.problems
            assert sorted(p.rsplit(":", 1)[-1].strip() for p in leftovers) == sorted(
                str(d.relative_to(local)) for d in dead)
            assert not any(t.name in p for t in live for p in rep.problems + rep.notes)

            rep = s.fsck(repair=True)
            assert len([r for r in rep.repaired if r.startswith("removed leftover")]) == 3, rep.repaired
            assert not any(d.exists() for d in dead)
            assert {t: t.read_bytes() for t in live} == live  # every byte of every live writer's temp kept
            assert s.fsck().ok
            tag_tmp = next(iter(live))
            os.replace(tag_tmp, local / "refs" / "tags" / "keep")  # the writer's rename, after the repair
            assert s.tags()["keep"] == ids[1]

            writer.stdin.close()  # type: ignore[union-attr]
            assert writer.wait(timeout=120) == 0
            rep = s.fsck(repair=True)  # its writer gone, the annotation temp is debris now; ours is not
            assert len([r for r in rep.repaired if r.startswith("removed leftover")]) == 1, rep.repaired
            assert [t.exists() for t in live][1:] == [False, True]
        finally:
            s.close()
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


KINDS = ["record", "manifest", "annotation", "ref", "catalog-record", "pack"]


def damage_one(cold: Path, hot: Path | None, kind: str, which: int) -> Path | None:
    """Flip one byte of one file of `kind` on one tier (`which` picks the tier and file)."""
    rs = roots(cold, hot)
    root = rs[which % len(rs)]
    if kind == "catalog-record":
        c = Catalog((hot or cold) / "catalog")
        vid, raw = sorted(c.raw_records())[which % 3]
        with c.env.begin(write=True) as txn:
            txn.put(bytes.fromhex(vid), raw[:-1] + b" ", db=c._db["versions"])
        c.close()
        return None
    if kind == "ref":
        path = root / "refs" / "heads" / "main"
    elif kind == "pack":
        path = sorted((root / "packs").glob("*.pack"))[0]
    else:
        # annotate() writes the hot tier; cold has a copy only if the version was flushed after it
        kind_dir = {"record": "versions", "manifest": "manifests", "annotation": "annotations"}[kind]
        fs = files(root, kind_dir) or files(rs[0], kind_dir)
        path = fs[which % len(fs)]
    flip(path)
    return path


def invariant(tmp_path: Path, tiered: bool, kind: str, which: int) -> None:
    cold, hot, ids = make(tmp_path, tiered)
    damaged = damage_one(cold, hot, kind, which)
    names = {str(p) for r in roots(cold, hot) for p in r.rglob("*") if p.is_file()}
    s = open_store(cold, hot)
    try:
        s.fsck(repair=True)
    finally:
        s.close()
    now = {str(p) for r in roots(cold, hot) for p in r.rglob("*") if p.is_file()}
    quarantined = {str(r / json.loads(line)["file"]) for r in roots(cold, hot)
                   if (r / "quarantine" / "report.jsonl").exists()
                   for line in (r / "quarantine" / "report.jsonl").read_text().splitlines()}
    gone = {p for p in names - now if "/quarantine/" not in p and not p.endswith(".tmp")} - quarantined
    assert not gone, f"repair removed {gone} (damaged: {damaged})"
    assert quarantined <= ({str(damaged)} if damaged else set())  # only the damaged file, if anything
    # Every version had an intact copy of each of its files (one tier's copy or the catalog's) except,
    # single tier, the one whose only file was flipped: those stay loadable.
    ok = loads(cold, hot, ids)
    if tiered or kind in ("catalog-record", "ref", "annotation"):
        assert all(ok.values()), ok
    else:
        assert sum(ok.values()) >= len(ids) - 1 if kind in ("record", "manifest") else True
    s = open_store(cold, hot)
    try:
        assert sorted(v.id for v in s.log(ids[2])) == sorted(ids)  # no version was removed
    finally:
        s.close()


@pytest.mark.parametrize("kind", KINDS)
@TIERED
def test_repair_never_deletes(tmp_path: Path, tiered: bool, kind: str) -> None:
    if kind == "ref" and not tiered:
        pytest.skip("a single-tier store's only ref copy: covered by test_damaged_ref_does_not_take_the_store_down")
    invariant(tmp_path, tiered, kind, 0)


@pytest.mark.slow
@pytest.mark.parametrize("which", range(1, 6))
@pytest.mark.parametrize("kind", KINDS)
@TIERED
def test_repair_never_deletes_larger_sample(tmp_path: Path, tiered: bool, kind: str, which: int) -> None:
    if kind == "ref" and not tiered:
        pytest.skip("covered by test_damaged_ref_does_not_take_the_store_down")
    invariant(tmp_path, tiered, kind, which)


def test_unrestorable_record_is_quarantined_and_version_marked_damaged(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, False)
    man = next(p for p in files(cold, "manifests"))
    flip(man)
    s = open_store(cold, hot)
    try:
        rep = s.fsck(repair=True)
        assert any("quarantine" in line for line in rep.repaired)
        bad = [vid for vid in ids if s.version(vid).damaged]
        assert len(bad) == 1
        with pytest.raises(IntegrityError) as ei:
            s.load(bad[0])
        assert "quarantine" in str(ei.value)
        assert len(s.log()) == 3
    finally:
        s.close()
    report = (cold / "quarantine" / "report.jsonl").read_text().splitlines()
    assert len(report) == 1 and json.loads(report[0])["file"].startswith("manifests/")
    entry = json.loads(report[0])
    # The user puts an intact copy back (from a backup): repair clears the mark and the version loads.
    moved = cold / entry["moved_to"]
    flip(moved)  # undo the flipped byte: this is the backup
    os.replace(moved, cold / entry["file"])
    s = open_store(cold, hot)
    try:
        assert not s.fsck().ok
        rep = s.fsck(repair=True)
        assert any("cleared its damaged mark" in line for line in rep.repaired)
        assert s.fsck().ok
        assert all(s.load(vid)["w"].numel() == 64 for vid in ids)
    finally:
        s.close()


def test_repair_keeps_the_packs_of_a_version_whose_manifest_is_missing_or_in_quarantine(tmp_path: Path) -> None:
    """With a manifest deleted, or damaged and moved to quarantine/ by a first repair, the pack of its version
    was called debris ('holds no chunk a version needs') and a repair deleted it: the manifest put back from a
    backup then named chunks that were gone."""
    cold, hot, ids = make(tmp_path, False)
    s = open_store(cold, hot)
    mid = s.version(ids[1]).manifests["0"]
    s.close()
    man = cold / "manifests" / mid[:2] / f"{mid}.arrow"
    backup = man.read_bytes()
    packs = sorted(p.name for p in (cold / "packs").glob("*.pack"))
    for damage in ("delete", "flip"):
        if damage == "delete":
            man.unlink()
        else:
            flip(man)
        s = open_store(cold, hot)
        try:
            for _ in range(2):  # the second repair runs with the manifest in quarantine/
                rep = s.fsck(repair=True)
                assert not rep.ok and any(f"manifest {mid[:12]}" in p for p in rep.problems)
            assert sorted(p.name for p in (cold / "packs").glob("*.pack")) == packs
        finally:
            s.close()
        man.parent.mkdir(parents=True, exist_ok=True)
        man.write_bytes(backup)  # the backup goes back
        s = open_store(cold, hot)
        try:
            s.fsck(repair=True)
            assert s.fsck().ok
        finally:
            s.close()
        assert all(loads(cold, hot, ids).values())


def test_a_lost_pack_is_reported_with_its_versions_and_found_again_when_put_back(tmp_path: Path) -> None:
    """A repair dropped a lost pack's catalog entries and said ok, though versions had lost their tensors; the
    pack put back from a backup was then unindexed, and the next repair deleted it as debris."""
    cold, hot, ids = make(tmp_path, False)
    pack = max((cold / "packs").glob("*.pack"), key=lambda p: p.stat().st_size)
    backup = pack.read_bytes()
    pack.unlink()
    s = open_store(cold, hot)
    try:
        for repair in (False, True, False):
            rep = s.fsck(repair=repair)
            assert not rep.ok
            assert any(f"pack {pack.stem} is missing from every tier and" in p and "version(s) need its chunks" in p
                       for p in rep.problems)
    finally:
        s.close()
    pack.write_bytes(backup)
    s = open_store(cold, hot)
    try:
        assert s.fsck().ok
    finally:
        s.close()
    assert all(loads(cold, hot, ids).values())
    # A pack the catalog forgot (what the old repair did) while a version needs its chunks is indexed again.
    c = Catalog(cold / "catalog")
    c.drop_pack(pack.stem)
    c.close()
    s = open_store(cold, hot)
    try:
        rep = s.fsck()
        assert any(f"pack {pack.stem} holds" in p and "does not index" in p for p in rep.problems)
        rep = s.fsck(repair=True)
        assert any(f"indexed pack {pack.stem} again" in line for line in rep.repaired) and pack.exists()
        assert s.fsck().ok
    finally:
        s.close()
    assert all(loads(cold, hot, ids).values())


@pytest.mark.parametrize("ref_too", [True, False])
def test_repair_indexes_a_version_an_older_catalog_lacks_and_never_deletes_its_pack(tmp_path: Path,
                                                                                    ref_too: bool) -> None:
    """A catalog older than the newest version (restored from a backup; or a save killed between its record and
    its commit, when the branch file is older too): repair called the version's chunks missing, quarantined its
    record and deleted its pack, so the version was lost for good (a hunt)."""
    root = tmp_path / "s"
    with ds.Store.open(root, chunk_size=64 * KIB) as s:
        s.save({"w": torch.zeros(1000)}, branch="main")
    shutil.copytree(root / "catalog", tmp_path / "catalog-backup")
    main = (root / "refs" / "heads" / "main").read_bytes()
    with ds.Store.open(root) as s:
        v2 = s.save({"w": torch.ones(1000), "b": torch.arange(7)}, branch="main")
    shutil.rmtree(root / "catalog")
    shutil.copytree(tmp_path / "catalog-backup", root / "catalog")
    if ref_too:
        (root / "refs" / "heads" / "main").write_bytes(main)
    packs = sorted(p.name for p in (root / "packs").rglob("*.pack"))
    with ds.Store.open(root) as s:
        rep = s.fsck()
        assert not any("is missing" in p for p in rep.problems)
        assert any("does not index" in p for p in rep.problems)
        rep = s.fsck(repair=True)
        assert any(f"indexed version {v2.id[:12]}" in line for line in rep.repaired)
        assert not any("removed" in line or "moved" in line for line in rep.repaired)
        assert s.fsck().ok and s.fsck(repair=True).repaired == []
        got = s.load(v2.id)
    assert sorted(p.name for p in (root / "packs").rglob("*.pack")) == packs
    assert torch.equal(got["w"], torch.ones(1000)) and torch.equal(got["b"], torch.arange(7))


def test_a_pack_on_an_unreachable_cold_tier_only_is_not_called_lost(tmp_path: Path) -> None:
    """An evicted pack (on cold only) with cold unmounted was reported lost, with advice to restore it from a
    backup; it is a note until cold can be read again."""
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    evicted = max((hot / "packs").glob("*.pack"), key=lambda p: p.stat().st_size)
    evicted.unlink()  # as eviction leaves it: the copy is on cold
    cold.rename(tmp_path / "unmounted")
    s = open_store(cold, hot)
    try:
        for repair in (False, True):
            rep = s.fsck(repair=repair)
            assert not any("missing from every tier" in p for p in rep.problems)
            assert any(f"pack {evicted.stem}" in n and "tier cold cannot be read now" in n for n in rep.notes)
    finally:
        s.close()
    (tmp_path / "unmounted").rename(cold)
    assert all(loads(cold, hot, ids).values())


def test_a_parent_the_flush_policy_kept_off_cold_is_no_loss_on_a_fresh_node(tmp_path: Path) -> None:
    """With Flush(every=2) a flushed version's parent stays on the hot tier that saved it: a node opening cold
    with a fresh hot tier was told that record was lost and to restore it from a backup."""
    from datastates.base.config import Flush

    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", flush=Flush(every=2))
    for i, st in enumerate(states(4)):
        s.save(st, step=i)
    assert s.flush(timeout=60)
    s.close()
    fresh = ds.Store.open(tmp_path / "cold", hot=tmp_path / "fresh-hot", create=False)
    try:
        rep = fresh.fsck()
        assert rep.ok and any("the flush policy (Flush(every=2" in n for n in rep.notes)
    finally:
        fresh.close()


def test_lineage_walks_end_at_a_parent_the_flush_policy_kept_off_cold(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """On a node opened from cold after saves with Flush(every=2), `log`, `ancestors` and `history` raised
    NotFoundError for the parent that was never flushed; they now end there, as `git log` ends at a shallow
    clone's boundary, and `datastates log` says where and how to learn why."""
    from datastates.base.config import Flush

    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", flush=Flush(every=2))
    for i in range(4):
        s.save({"w": torch.full((4,), float(i))}, step=i)
    assert s.flush(timeout=60)
    off_cold = s.version("main~1").id  # step 2: on this node's hot tier only
    s.close()
    fresh = ds.Store.open(tmp_path / "cold", hot=tmp_path / "fresh-hot", create=False)
    try:
        head = fresh.log()
        assert [v.step for v in head] == [3]
        assert fresh.ancestors("main") == []
        assert fresh.history("w").column("step").to_pylist() == [3]
        assert sorted(fresh.versions_table().column("step").to_pylist()) == [1, 3]
        with pytest.raises(ds.NotFoundError, match=f"version {off_cold} is not in this node's catalog: a parent the "
                                                   "flush policy kept off the cold tier"):
            fresh.version("main~1")
    finally:
        fresh.close()
    capsys.readouterr()
    assert cli_main(["log", "--store", str(tmp_path / "cold")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"(history goes on past {head[0].short}: its parent {off_cold} is not on this node; "
        f"`datastates --store {tmp_path / 'cold'} fsck` says why)")


def test_a_ref_to_no_version_is_moved_aside_and_lost_annotation_files_are_written_back(tmp_path: Path) -> None:
    """A branch naming a well-formed id of no version was reported forever (repair left it); an annotation
    file deleted went unnoticed, then a catalog rebuild lost the annotations."""
    cold, hot, ids = make(tmp_path, False)
    s = open_store(cold, hot)
    s.branch("ghost", ids[0])
    s.close()
    (cold / "refs" / "heads" / "ghost").write_text("0" * 64 + "\n")
    (ann,) = files(cold, "annotations")
    ann.unlink()
    s = open_store(cold, hot)
    try:
        rep = s.fsck()
        assert any(f"branch 'ghost' on tier hot points at version {'0' * 64}, which no tier holds" in p
                   for p in rep.problems)
        assert any(f"annotations of version {ids[0][:12]} is gone from every tier" in p for p in rep.problems)
        rep = s.fsck(repair=True)
        assert not (cold / "refs" / "heads" / "ghost").exists() and list((cold / "quarantine").rglob("ghost.*"))
        assert ann.exists() and s.fsck().ok and s.version(ids[0]).annotations["note"] == "first"
    finally:
        s.close()
    ann.unlink()  # and a rebuild keeps what the catalog held
    s = open_store(cold, hot)
    try:
        s.fsck(rebuild=True)
        assert s.version(ids[0]).annotations["note"] == "first" and ann.exists()
    finally:
        s.close()


def test_a_record_lost_for_good_keeps_fsck_from_saying_ok(tmp_path: Path) -> None:
    """With no intact copy anywhere (the catalog rebuilt without it), a damaged record went to quarantine/ and
    the next fsck said ok over the remaining versions."""
    cold, hot, ids = make(tmp_path, False)
    flip(cold / "versions" / ids[1][:2] / f"{ids[1]}.json")
    s = open_store(cold, hot)
    try:
        s.fsck(rebuild=True)  # the catalog's copy was the last intact one
        s.fsck(repair=True)
        assert list((cold / "quarantine" / "versions").rglob(f"{ids[1]}.json.*"))
        for _ in range(2):
            rep = s.fsck()
            assert not rep.ok and any(f"version {ids[2][:12]} names parent {ids[1]}, whose record" in p
                                      for p in rep.problems)
        # `log` ends at the lost parent (it failed there before the twenty-seventh session; fsck says why)
        assert [v.id for v in s.log()] == [ids[2]] and s.graph.absent_parents(ids[2]) == [ids[1]]
        assert torch.equal(s.load(ids[2])["w"], states(3)[2]["w"])  # the others still load
    finally:
        s.close()


def test_what_cold_lacks_of_a_flushed_version_is_reported_and_copied_back_from_hot(tmp_path: Path) -> None:
    """fsck never looked at whether cold held what the catalog said was flushed: a pack and a manifest deleted
    from cold passed as ok, and once the hot tier was lost so were the versions. (A record missing from cold is
    left alone: it is the flusher's commit point, and writing it would publish a version whose other ranks'
    parts may not be there.)"""
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    pack = max((cold / "packs").glob("*.pack"), key=lambda p: p.stat().st_size)
    pack.unlink()
    man = files(cold, "manifests")[0]
    man.unlink()
    s = open_store(cold, hot)
    try:
        rep = s.fsck()
        missing = [p for p in rep.problems if "is missing from tier cold, where the version is published" in p]
        assert len(missing) == 2 and not rep.ok
        assert any(f"pack {pack.stem}" in p for p in missing) and all("copies it from hot" in p for p in missing)
        rep = s.fsck(repair=True)
        assert len([line for line in rep.repaired if "on tier cold from hot" in line]) == 2
        assert pack.exists() and man.exists() and s.fsck().ok
    finally:
        s.close()
    shutil.rmtree(hot)  # the node is gone: cold alone holds every version
    assert all(loads(cold, tmp_path / "fresh-hot", ids).values())


# 4. a failed save leaves nothing -----------------------------------------------------------------

@pytest.fixture
def full_disk_on_commit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make the next catalog commit fail as LMDB does on a full disk (the write itself is real)."""
    real = Catalog.commit

    def commit(self: Catalog, batch: Any) -> None:
        monkeypatch.setattr(Catalog, "commit", real)
        raise lmdb.DiskError(errno.ENOSPC, "mdb_txn_commit: No space left on device")

    monkeypatch.setattr(Catalog, "commit", commit)
    yield


@TIERED
def test_failed_catalog_commit_leaves_nothing_visible(tmp_path: Path, tiered: bool,
                                                      full_disk_on_commit: None) -> None:
    cold, hot = tmp_path / "cold", (tmp_path / "hot" if tiered else None)
    s = ds.Store.open(cold, hot=hot)
    try:
        with pytest.raises((ds.DataStatesError, StorageFullError)):
            s.save({"w": torch.ones(100)}, step=1)
        assert s.branches() == {}
        assert list(((hot or cold) / "versions").rglob("*.json")) == []
    finally:
        s.close(raise_errors=False)
    s = ds.Store.open(cold, hot=hot)
    try:
        v = s.save({"w": torch.zeros(100)}, step=2)
        rep = s.fsck()
        assert rep.ok, rep.problems
        assert [x.id for x in s.log()] == [v.id]
    finally:
        s.close()


def test_cli_fsck_names_the_tier_and_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    rec = next(p for p in files(cold, "versions") if p.stem == ids[0])
    flip(rec)
    before = tree(cold)
    assert cli_main(["fsck", "--store", str(cold)]) == 1
    out = capsys.readouterr()
    assert f"version record {ids[0][:12]} on tier cold" in out.out and "Traceback" not in out.err
    assert tree(cold) == before
    assert cli_main(["fsck", "--repair", "--store", str(cold)]) == 0
    assert "restored damaged version record" in capsys.readouterr().out
    assert rec.read_bytes() == next(p for p in files(hot, "versions") if p.stem == ids[0]).read_bytes()
    with pytest.raises(SystemExit):
        cli_main(["fsck", "--help"])
    out = capsys.readouterr()
    assert "quarantine/" in out.out and "every tier" in out.out


def test_queries_over_the_store_read_verified_records(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, False)
    raw = damage_catalog_copy(cold / "catalog", ids[0], b'"step":0', b'"step":9')
    s = open_store(cold, hot)
    try:
        assert sorted(v.step for v in s.find("")) == [0, 1, 2]
        assert s.catalog.raw_record(ids[0]) == raw
    finally:
        s.close()


def test_damaged_reflog_line_is_skipped_not_fatal(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, False)
    log_file = cold / "logs" / "heads" / "main"
    lines = log_file.read_bytes().splitlines()
    assert len(lines) == 3
    data = bytearray(log_file.read_bytes())
    data[len(lines[0]) // 2] = 0xFF  # a non-UTF-8 byte inside the first entry
    log_file.write_bytes(bytes(data))
    s = open_store(cold, hot)
    try:
        assert [e["new"] for e in s.reflog("main")] == ids[1:]
    finally:
        s.close()


def test_deleted_record_file_is_rewritten_from_the_catalog_copy(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, False)
    rec = next(p for p in files(cold, "versions") if p.stem == ids[1])
    good = rec.read_bytes()
    rec.unlink()
    s = open_store(cold, hot)
    try:
        assert any("record file is gone" in p for p in s.fsck().problems)
        assert not rec.exists()  # fsck alone changed nothing
        s.fsck(repair=True)
        assert rec.read_bytes() == good
        assert s.fsck().ok
        assert [v.step for v in s.log()] == [2, 1, 0]
    finally:
        s.close()


def test_annotations_after_flush_reach_the_cold_tier(tmp_path: Path) -> None:
    cold, hot, ids = make(tmp_path, True)
    s = open_store(cold, hot)
    try:
        s.annotate(ids[2], note="late")
    finally:
        s.close()
    from datastates.meta.versions import decode_annotations

    cold_ann = next(p for p in files(cold, "annotations") if p.stem == ids[2])
    assert decode_annotations(cold_ann.read_bytes())["note"] == "late"
    shutil.rmtree(hot)  # the node is lost: cold alone still has the note
    s = ds.Store.open(cold, create=False)
    try:
        assert s.version(ids[2]).annotations == {"note": "late"}
    finally:
        s.close()


def test_log_first_parent_names_no_boundary_it_never_reached(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`datastates log --first-parent` printed the 'history goes on past' line for a merge's second parent that
    this node lacks, though the first-parent walk never went there."""
    s = ds.Store.open(tmp_path / "s")
    a = s.save({"w": torch.zeros(2)}, step=1)
    b = s.save({"w": torch.ones(2)}, branch="side", parents=[a.id], step=2)
    m = s.save({"w": torch.full((2,), 2.0)}, parents=[a.id, b.id], step=3)
    s.delete_branch("side", force=True)
    s.catalog.drop_version(b.id, [a.id])  # as a node whose flush policy never got it
    s.close()
    capsys.readouterr()
    assert cli_main(["log", "--first-parent", "--store", str(tmp_path / "s")]) == 0
    assert "history goes on" not in capsys.readouterr().out
    assert cli_main(["log", "--store", str(tmp_path / "s")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"(history goes on past {m.short}: its parent "
                                                               f"{b.id} is not on this node")


def flip_hex_digit(ref: Path, at: int = 20) -> str:
    """Change one hex digit of the id in ref file `ref` (past the 12 a short id shows): still a well-formed id,
    of no version. Returns the new id."""
    vid = ref.read_text().strip()
    bad = vid[:at] + ("0" if vid[at] != "0" else "1") + vid[at + 1:]
    ref.write_text(bad + "\n")
    return bad


def test_a_hot_ref_naming_no_version_leaves_the_store_openable_and_is_restored_from_cold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every open (fsck's too) failed in refresh's lineage walk with NotFoundError, whose hint ran the same
    failing open; the messages printed a short id that was the prefix of the real head."""
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    ref = hot / "refs" / "heads" / "main"
    bad = flip_hex_digit(ref)
    s = open_store(cold, hot)
    s.close()
    assert cli_main(["fsck", "--store", str(cold)]) == 1
    out = capsys.readouterr().out
    assert (f"branch 'main' on tier hot points at version {bad}, which no tier holds; "
            f"`datastates --store {cold} fsck --repair` restores it from tier cold") in out
    assert cli_main(["fsck", "--repair", "--store", str(cold)]) == 0
    out = capsys.readouterr().out
    assert f"restored damaged branch 'main' on tier hot from tier cold (version {ids[2][:12]}" in out
    assert ref.read_text() == ids[2] + "\n"
    assert [p.read_text() for p in (hot / "quarantine" / "refs" / "heads").iterdir()] == [bad + "\n"]
    assert cli_main(["fsck", "--store", str(cold)]) == 0
    assert cli_main(["log", "--store", str(cold)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(ids[2][:12])


def test_a_quarantined_branch_stays_a_note_and_the_hints_after_it_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After --repair moved `main` aside, `log` said to run `datastates log` (which failed the same way) and fsck
    said ok with no word of the branch."""
    cold, hot, ids = make(tmp_path, False)
    flip_hex_digit(cold / "refs" / "heads" / "main")
    assert cli_main(["fsck", "--repair", "--store", str(cold)]) == 0
    capsys.readouterr()
    assert cli_main(["log", "--store", str(cold)]) == 1
    err = capsys.readouterr().err
    assert f"`datastates --store {cold} find` lists every version" in err
    assert cli_main(["find", "--store", str(cold)]) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith(tuple(
        v[:12] for v in ids))]) == 3
    assert cli_main(["fsck", "--store", str(cold)]) == 0
    out = capsys.readouterr().out
    hint = f"`datastates --store {cold} branch -f main {ids[2][:12]}` makes it again there"
    assert "note:" in out and "branch 'main' on tier hot is in quarantine/" in out and hint in out
    assert cli_main(["branch", "-f", "main", ids[2][:12], "--store", str(cold)]) == 0
    capsys.readouterr()
    s = open_store(cold, hot)
    try:
        rep = s.fsck()
        assert rep.ok and not rep.notes and s.resolve("main") == ids[2]
    finally:
        s.close()


def damage_catalog_value(cat_dir: Path, table: str, key: bytes | None = None, at: int = 0) -> bytes:
    """Flip one bit of byte `at` of the value of `key` (the first key when None) in catalog table `table`;
    return the key."""
    c = Catalog(cat_dir)
    try:
        with c.env.begin(write=True, db=c._db[table]) as txn:
            if key is None:
                key = bytes(next(iter(txn.cursor().iternext(values=False))))
            raw = bytearray(txn.get(key))
            raw[at] ^= 0x01
            txn.put(key, bytes(raw))
    finally:
        c.close()
    return key


@TIERED
def test_a_damaged_chunk_location_in_the_catalog_is_found_and_written_again_from_the_pack(
        tmp_path: Path, tiered: bool) -> None:
    """fsck and fsck --repair said ok while every load of the chunk said the pack was corrupt: fsck never
    compared the catalog's locations with the packs' own indexes. Offset bytes start at 16 (after the pack id)."""
    cold, hot, ids = make(tmp_path, tiered)
    s = open_store(cold, hot)
    cid = s.catalog.iter_chunks().__next__()[0]
    s.close()
    damage_catalog_value((hot or cold) / "catalog", "chunks", cid, at=16)
    before = loads(cold, hot, ids)
    assert not all(before.values())
    s = open_store(cold, hot)
    try:
        rep = s.fsck()
        wrong = [p for p in rep.problems if f"the catalog locates chunk {cid.hex()} in pack" in p]
        assert len(wrong) == 1 and "a damaged catalog entry" in wrong[0] and "`datastates fsck --repair`" in wrong[0]
        rep = s.fsck(repair=True)
        assert any(f"wrote the catalog's location of chunk {cid.hex()} again" in r for r in rep.repaired)
        assert s.fsck().ok
    finally:
        s.close()
    assert all(loads(cold, hot, ids).values())


@TIERED
def test_a_damaged_pack_entry_in_the_catalog_is_a_report_not_a_crash(
        tmp_path: Path, tiered: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """fsck, fsck --repair and gc ended in a raw json.JSONDecodeError from Catalog.packs."""
    cold, hot, ids = make(tmp_path, tiered)
    pack = damage_catalog_value((hot or cold) / "catalog", "packs", at=1).hex()
    s = open_store(cold, hot)
    try:
        with pytest.raises(CatalogDamagedError, match=f"the entry of pack {pack} is damaged"):
            s.catalog.packs()
        rep = s.fsck()
        assert [p for p in rep.problems if f"the entry of pack {pack} is damaged" in p and "fsck --repair" in p]
        assert s.gc(dry_run=True) is not None  # gc needs the packs' ids only
    finally:
        s.close()
    assert cli_main(["fsck", "--repair", "--store", str(cold)]) == 0
    assert f"wrote the damaged catalog entry of pack {pack} again from its file" in capsys.readouterr().out
    s = open_store(cold, hot)
    try:
        info = s.catalog.packs()[pack]
        assert info["chunks"] >= 1 and info["size"] > 0 and s.fsck().ok
    finally:
        s.close()
    assert all(loads(cold, hot, ids).values())


@TIERED
def test_a_damaged_extra_entry_in_the_catalog_is_a_typed_error_and_its_hint_mends_it(tmp_path: Path,
                                                                                      tiered: bool) -> None:
    """A flipped byte of a version's `extra` JSON made its load (a tiered store's open: the flusher reads every
    extra) raise a raw json.JSONDecodeError."""
    cold, hot, ids = make(tmp_path, tiered)
    damage_catalog_value((hot or cold) / "catalog", "extra" if tiered else "annotations",
                         bytes.fromhex(ids[1] if tiered else ids[0]), at=0)
    table, vid = ("extra", ids[1]) if tiered else ("annotations", ids[0])
    hint = f"the {table} entry of version {vid} is damaged"
    if tiered:  # the open reads it: the CLI's fsck --rebuild, as the hint says, moves the catalog aside first
        with pytest.raises(CatalogDamagedError, match=hint):
            open_store(cold, hot)
    else:
        s = open_store(cold, hot)
        try:
            with pytest.raises(CatalogDamagedError, match=hint) as ei:
                s.version(vid)
            assert f"`datastates --store {cold} fsck --rebuild`" in str(ei.value)
            rep = s.fsck()
            assert not rep.ok and any(hint in p and "fsck --rebuild" in p for p in rep.problems)
        finally:
            s.close()
    assert cli_main(["fsck", "--rebuild", "--store", str(cold)]) == 0
    assert all(loads(cold, hot, ids).values())
    s = open_store(cold, hot)
    try:
        assert s.version(ids[0]).annotations == {"note": "first"} and s.fsck().ok
    finally:
        s.close()


def test_a_damaged_hot_format_names_a_fix_that_works(tmp_path: Path) -> None:
    """The hint said to restore hot's FORMAT from the other tier, but the copy was then refused as a swapped cold
    tier (cold's FORMAT says "tier": "cold"), and it suggested chunk_size 16777216 for a store made with 4096."""
    cold, hot, ids = make(tmp_path, True)
    assert hot is not None
    fmt = hot / "FORMAT"
    text = fmt.read_text()
    fmt.write_text(text.replace('"chunk_size": 4096', '"chunk_size": 4097'))  # another valid-looking size
    with pytest.raises(StoreFormatError) as ei:
        open_store(cold, hot)
    msg = str(ei.value)
    assert "does not match its checksum" in msg and "16777216" not in msg and "chunk_size, 4096" in msg
    cp = f"cp {cold / 'FORMAT'} {fmt}"
    assert cp in msg
    subprocess.run(cp.split(), check=True)  # what the message says, as given
    assert all(loads(cold, hot, ids).values())
    info = json.loads(fmt.read_text())
    assert "tier" not in info and info["chunk_size"] == 4096  # written again as a hot tier's
    s = open_store(cold, hot)
    try:
        assert s.fsck().ok
    finally:
        s.close()
    # A real swap is still refused: the hot directory's FORMAT says cold and the cold one's does not.
    assert json.loads((cold / "FORMAT").read_text()).get("tier") == "cold"
    with pytest.raises(ds.DataStatesError, match="were the two swapped"):
        ds.Store.open(hot, hot=cold, create=False)
