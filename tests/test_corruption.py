"""Corruption: damaged bytes are found, named and never returned as data.

A byte flipped inside a chunk makes `load` raise IntegrityError naming the chunk (hex prefix), the pack
and the tensor key; `fsck` lists the chunk in `corrupt_chunks`; versions that do not use that chunk
still load, and repair never deletes the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.states import assert_same

import datastates as ds
from datastates.objects.chunks import ChunkLocation

KIB = 1 << 10


@dataclass
class Where:
    key: str
    chunk: bytes
    loc: ChunkLocation
    pack_path: Path


def chunk_of(store: ds.Store, ref: Any, key: str, index: int = 0) -> Where:
    """Where the `index`-th chunk of tensor `key` of version `ref` lives."""
    v = store.version(ref)
    rows = store.manifest(v.manifests["0"]).rows
    row = next(r for r in rows if r["key"] == key)
    cid = row["chunks"][index]
    loc = store.catalog.chunk(cid)
    assert loc is not None
    return Where(key, cid, loc, store.tier.pack_path(loc.pack))


def flip(path: Path, offset: int) -> int:
    """Invert one byte of a file in place; return its old value."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ 0xFF]))
    return old


@pytest.fixture
def two_versions(tmp_path: Path) -> Any:
    """v1 = {a, b}, v2 = {a, c}: `a` is shared, `b` only in v1. Small chunks so `b` spans 4 chunks."""
    s = ds.Store.open(tmp_path / "store", chunk_size=64 * KIB)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(16 * KIB, generator=g), torch.randn(64 * KIB, generator=g),
               torch.randn(1000, generator=g).to(torch.float64))
    v1 = s.save({"a": a, "b": b, "meta": {"n": 1}}, branch="one")
    v2 = s.save({"a": a, "c": c}, branch="two")
    yield s, v1, v2, {"a": a, "b": b, "c": c}
    s.close(raise_errors=False)


@pytest.mark.parametrize("index,where", [(0, "first"), (2, "middle"), (3, "last")])
def test_flipped_byte_in_chunk(two_versions: Any, index: int, where: str) -> None:
    s, v1, v2, t = two_versions
    w = chunk_of(s, v1, "b", index)
    at = {"first": 0, "middle": w.loc.length // 2, "last": w.loc.length - 1}[where]
    old = flip(w.pack_path, w.loc.offset + at)
    with pytest.raises(ds.IntegrityError) as err:
        s.load(v1)
    msg = str(err.value)
    assert w.chunk.hex()[:16] in msg and w.loc.pack in msg and "'b'" in msg
    with pytest.raises(ds.IntegrityError):
        s.load(v1, keys=["b"])
    # What does not use the damaged chunk still loads, bit-exact.
    assert_same(s.load(v1, keys=["a", "meta"]), {"a": t["a"], "meta": {"n": 1}})
    assert_same(s.load(v2), {"a": t["a"], "c": t["c"]})
    rep = s.fsck()
    assert not rep.ok
    assert rep.corrupt_chunks == [{"chunk": w.chunk.hex(), "pack": w.loc.pack, "offset": w.loc.offset,
                                   "tier": s.tier.name}]
    assert any(w.chunk.hex()[:16] in p and w.loc.pack in p for p in rep.problems)
    # Repair deletes no corrupt chunk: the pack and the other versions stay. It drops the chunk's index entry,
    # so that no save names the bad copy (see the next test); a load of v1 then says the chunk is not indexed.
    rep = s.fsck(repair=True)
    assert len(rep.corrupt_chunks) == 1 and w.pack_path.exists()
    assert [r for r in rep.repaired if "dropped the index entry" in r] == [
        f"dropped the index entry of chunk {w.chunk.hex()[:16]}, corrupt on every tier: the next save of its "
        "bytes stores it again, and the versions that need it load from then on"]
    assert_same(s.load(v2), {"a": t["a"], "c": t["c"]})
    with pytest.raises(ds.NotFoundError, match="fsck"):
        s.load(v1, keys=["b"])
    # The error was that one byte: put it back (a backup), and the repair its hint names indexes it again.
    flip(w.pack_path, w.loc.offset + at)
    assert old != old ^ 0xFF
    assert not s.fsck().ok  # v1's chunk is not indexed
    s.fsck(repair=True)
    assert_same(s.load(v1), {"a": t["a"], "b": t["b"], "meta": {"n": 1}})
    assert s.fsck().ok


def test_a_chunk_corrupt_everywhere_is_stored_again_by_the_next_save_of_its_bytes(two_versions: Any) -> None:
    """A save of bytes whose only stored copy is corrupt named that copy (dedup by id): the new version was
    unloadable too, and every later save of the same values, with no way out (a frozen layer could never be
    checkpointed again; a hunt). After `fsck --repair` the next save stores the bytes again, which heals the
    versions that needed them."""
    s, v1, _, t = two_versions
    w = chunk_of(s, v1, "b", 1)
    flip(w.pack_path, w.loc.offset + 5)
    poisoned = s.save({"b": t["b"]}, branch="again")
    assert poisoned.bytes_new == 0  # named the bad copy
    with pytest.raises(ds.IntegrityError, match=w.chunk.hex()[:16]):
        s.load(poisoned)
    rep = s.fsck()
    assert any(f"chunk {w.chunk.hex()[:16]} is corrupt on every tier" in p for p in rep.problems)
    s.fsck(repair=True)
    healed = s.save({"b": t["b"]}, branch="again")
    assert healed.bytes_new == 64 * KIB  # the one chunk, stored again
    for v in (healed, poisoned, v1):
        assert_same(s.load(v, keys=["b"]), {"b": t["b"]})
    rep = s.fsck()
    assert rep.ok, rep.problems
    assert [n for n in rep.notes if w.chunk.hex()[:16] in n and w.loc.pack in n and "no read uses" in n]


def test_shared_chunk_corruption_breaks_both_versions(two_versions: Any) -> None:
    s, v1, v2, t = two_versions
    w = chunk_of(s, v2, "a")
    flip(w.pack_path, w.loc.offset + 7)
    for v in (v1, v2):
        with pytest.raises(ds.IntegrityError, match="'a'"):
            s.load(v)
    assert_same(s.load(v2, keys=["c"]), {"c": t["c"]})
    assert [c["chunk"] for c in s.fsck().corrupt_chunks] == [w.chunk.hex()]


def test_corruption_is_found_by_a_fresh_process_view(two_versions: Any, tmp_path: Path) -> None:
    s, v1, _, _ = two_versions
    w = chunk_of(s, v1, "b", 1)
    s.close()
    flip(w.pack_path, w.loc.offset + 100)
    with ds.Store.open(tmp_path / "store") as s2:
        with pytest.raises(ds.IntegrityError, match=w.chunk.hex()[:16]):
            s2.load("one")
        assert [c["pack"] for c in s2.fsck().corrupt_chunks] == [w.loc.pack]


def test_damaged_manifest(two_versions: Any, tmp_path: Path) -> None:
    s, v1, v2, t = two_versions
    mid = v1.manifests["0"]
    s.close()
    path = tmp_path / "store" / "manifests" / mid[:2] / f"{mid}.arrow"
    flip(path, path.stat().st_size // 2)
    with ds.Store.open(tmp_path / "store") as s2:
        with pytest.raises(ds.IntegrityError, match=mid[:12]):
            s2.load(v1.id)
        assert_same(s2.load(v2.id), {"a": t["a"], "c": t["c"]})
        rep = s2.fsck()
        assert not rep.ok and any(mid[:12] in p for p in rep.problems)


def test_damaged_version_record_is_reported(two_versions: Any) -> None:
    s, v1, _, _ = two_versions
    path = s.tier.record_path(v1.id)
    flip(path, 3)
    rep = s.fsck()
    assert not rep.ok and any(v1.id[:12] in p and "damaged" in p for p in rep.problems)


def test_truncated_pack_index(two_versions: Any) -> None:
    s, v1, v2, t = two_versions
    w = chunk_of(s, v1, "b")
    size = w.pack_path.stat().st_size
    with open(w.pack_path, "r+b") as f:
        f.truncate(size - 5)  # the footer is gone, the chunk bodies are intact
    rep = s.fsck(repair=True)
    assert not rep.ok
    # fsck's report said "run `datastates fsck`" of the pack, which is what ran: it says what can be done instead
    found = [p for p in rep.problems if w.loc.pack in p]
    assert found == [f"pack {w.loc.pack} has a damaged footer (on tier {s.tier.name}; restore the pack file from "
                     "a backup)"]
    assert w.pack_path.exists()  # repair does not delete a pack that committed versions need
    assert_same(s.load(v1)["b"], t["b"])  # bodies verified by blake3 on read


def test_truncated_pack_body(two_versions: Any) -> None:
    s, v1, _, _ = two_versions
    w = chunk_of(s, v1, "b", 3)
    with open(w.pack_path, "r+b") as f:
        f.truncate(w.loc.offset + 10)
    with pytest.raises(ds.IntegrityError, match=w.loc.pack):
        s.load(v1, keys=["b"])
    assert not s.fsck().ok


def test_missing_pack(two_versions: Any) -> None:
    s, v1, v2, t = two_versions
    w = chunk_of(s, v2, "c")  # v2 wrote only c: a was already stored by v1
    assert w.loc.pack != chunk_of(s, v1, "a").loc.pack
    s.tier.reader.forget(w.loc.pack)
    w.pack_path.unlink()
    with pytest.raises(ds.NotFoundError, match=w.loc.pack):
        s.load(v2)
    assert_same(s.load(v1), {"a": t["a"], "b": t["b"], "meta": {"n": 1}})
    rep = s.fsck()
    assert not rep.ok and any(w.loc.pack in p for p in rep.problems)


@pytest.fixture
def zstd_version(tmp_path: Path) -> Any:
    s = ds.Store.open(tmp_path / "zstore", zstd_level=3)
    z = torch.zeros(64 * KIB)
    z[::7] = 1.0
    v = s.save({"z": z})
    w = chunk_of(s, v, "z")
    assert w.loc.codec == 1 and w.loc.length < w.loc.raw_length  # stored compressed
    yield s, v, w, z
    s.close(raise_errors=False)


# Regression: zstandard raises ZstdError (not a ValueError), which escaped load and crashed fsck.
@pytest.mark.parametrize("at", ["header", "middle", "last"])
def test_zstd_corruption_load(zstd_version: Any, at: str) -> None:
    s, v, w, _ = zstd_version
    flip(w.pack_path, w.loc.offset + {"header": 0, "middle": w.loc.length // 2, "last": w.loc.length - 1}[at])
    with pytest.raises(ds.IntegrityError) as err:
        s.load(v)
    assert w.chunk.hex()[:16] in str(err.value) and w.loc.pack in str(err.value)


def test_zstd_corruption_fsck(zstd_version: Any) -> None:
    s, v, w, _ = zstd_version
    flip(w.pack_path, w.loc.offset)
    rep = s.fsck()
    assert [c["chunk"] for c in rep.corrupt_chunks] == [w.chunk.hex()]


def test_a_store_without_its_format_file_says_so(tmp_path: Path) -> None:
    """A store whose FORMAT was deleted was called 'not empty and holds no datastates store; pick an empty
    directory', which sends the user away from their versions."""
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"w": torch.ones(2)})
    (tmp_path / "s" / "FORMAT").unlink()
    with pytest.raises(ds.StoreFormatError, match="holds a store's manifests/, packs/, versions/ but its FORMAT file "
                                                  "is missing: put it back"):
        ds.Store.open(tmp_path / "s")
    assert not (tmp_path / "s" / "FORMAT").exists()


def test_a_read_error_is_no_reason_to_drop_a_chunks_index_entry(two_versions: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """fsck --repair drops the index entry of a chunk whose every copy reads back wrong; a read that failed (EIO,
    an NFS hiccup) said nothing about the bytes, and dropped the location of an intact chunk (a review)."""
    import errno

    from datastates.objects.packs import PackReader

    s, v1, v2, t = two_versions

    def failing(self: PackReader, loc: ChunkLocation) -> bytes:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(PackReader, "read", failing)
    rep = s.fsck(repair=True)
    assert rep.corrupt_chunks and not [r for r in rep.repaired if "dropped the index entry" in r]
    monkeypatch.undo()
    assert_same(s.load(v1), {"a": t["a"], "b": t["b"], "meta": {"n": 1}})
    assert_same(s.load(v2), {"a": t["a"], "c": t["c"]})
    assert s.fsck().ok


@pytest.mark.parametrize("how", ["fsck --rebuild", "catalog lost"])
def test_a_catalog_rebuild_does_not_index_a_copy_repair_found_corrupt(two_versions: Any, tmp_path: Path,
                                                                       how: str) -> None:
    """fsck --repair drops the index entry of a chunk corrupt on every tier, so that the next save of its bytes
    stores them again. A catalog rebuilt from the pack files (`fsck --rebuild`, or a lost catalog rebuilt at
    open) indexed the bad copy again: the next save of those bytes named it (dedup by id) and committed a version
    that could not be loaded (a review). The repair lists the copy in quarantine/bad-chunks.jsonl; a rebuild skips
    a listed copy unless it reads back intact (a byte put back from a backup)."""
    s, v1, _, t = two_versions
    w = chunk_of(s, v1, "b", 1)
    flip(w.pack_path, w.loc.offset + 5)
    s.fsck(repair=True)
    assert s.catalog.chunk(w.chunk) is None
    if how == "fsck --rebuild":
        s.fsck(rebuild=True)
    else:
        s.close()
        for f in (tmp_path / "store" / "catalog").iterdir():
            f.unlink()
        (tmp_path / "store" / "catalog").rmdir()
        s = ds.Store.open(tmp_path / "store")
    assert s.catalog.chunk(w.chunk) is None
    again = s.save({"b": t["b"]}, branch="again")
    assert again.bytes_new == 64 * KIB  # stored again, not named the bad copy
    assert_same(s.load(again), {"b": t["b"]})
    assert_same(s.load(v1, keys=["b"]), {"b": t["b"]})
    s.close()


def test_a_rebuild_indexes_a_listed_copy_put_back_intact(two_versions: Any) -> None:
    """A copy listed as bad whose byte was put back (a backup) reads back intact: a rebuild indexes it again."""
    s, v1, _, t = two_versions
    w = chunk_of(s, v1, "b", 1)
    flip(w.pack_path, w.loc.offset + 5)
    s.fsck(repair=True)
    flip(w.pack_path, w.loc.offset + 5)
    s.fsck(rebuild=True)
    assert s.catalog.chunk(w.chunk) == w.loc
    assert_same(s.load(v1), {"a": t["a"], "b": t["b"], "meta": {"n": 1}})


def test_repair_indexing_a_pack_again_skips_its_corrupt_copies(two_versions: Any) -> None:
    """fsck --repair indexes again a pack holding chunks a version needs that the catalog lost (a catalog
    restored from an older backup); it indexed every chunk of the pack, a corrupt one too, which the next save
    of those bytes then named (dedup by id): a committed version that could not be loaded."""
    s, v1, _, t = two_versions
    good, bad = chunk_of(s, v1, "b", 0), chunk_of(s, v1, "b", 1)
    assert good.loc.pack == bad.loc.pack
    flip(bad.pack_path, bad.loc.offset + 5)
    s.catalog.drop_chunks([good.chunk, bad.chunk])  # the catalog lost the pack's chunks
    rep = s.fsck(repair=True)
    assert any(f"indexed pack {good.loc.pack} again" in r for r in rep.repaired)
    assert s.catalog.chunk(good.chunk) == good.loc and s.catalog.chunk(bad.chunk) is None
    again = s.save({"b": t["b"]}, branch="again")
    assert again.bytes_new == 64 * KIB
    assert_same(s.load(again), {"b": t["b"]})


def test_another_host_does_not_index_a_copy_repair_listed_on_cold(tmp_path: Path) -> None:
    """Two hosts share a cold tier. A's fsck --repair found a chunk corrupt on every tier and listed it on cold
    too: B's refresh, indexing the pack from cold for the first time, skips the bad copy (a catalog rebuilt at
    B's open does too: test_a_catalog_rebuild_does_not_index_a_copy_repair_found_corrupt), so B's next save of
    those bytes stores them again instead of naming it."""
    g = torch.Generator().manual_seed(1)
    b_values = torch.randn(64 * KIB, generator=g)
    a = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot-a", chunk_size=64 * KIB)
    b = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot-b")  # before A's pack: its refresh indexes it
    v = a.save({"b": b_values}, branch="main")
    assert a.flush(timeout=30)
    w = chunk_of(a, v, "b", 1)
    for root in ("hot-a", "cold"):
        flip(tmp_path / root / "packs" / w.pack_path.name, w.loc.offset + 5)
    assert any("dropped the index entry" in r for r in a.fsck(repair=True).repaired)
    assert b.refresh()["packs"] == 1 and b.catalog.chunk(w.chunk) is None
    again = b.save({"b": b_values}, branch="b")
    loc = b.catalog.chunk(w.chunk)
    assert loc is not None and loc.pack != w.loc.pack  # stored again, not the bad copy named
    assert_same(b.load(again), {"b": b_values})
    a.close()
    b.close()


def test_repair_lists_a_bad_copy_on_reachable_tiers_only(tmp_path: Path) -> None:
    """The list of bad copies goes where prune's markers go: never onto an unmounted cold mount point (an empty
    directory), where it would hide under the tier once mounted again (a review)."""
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", chunk_size=64 * KIB)
    v = s.save({"b": torch.randn(64 * KIB, generator=torch.Generator().manual_seed(2))}, branch="main")
    assert s.flush(timeout=30)
    w = chunk_of(s, v, "b", 1)
    flip(w.pack_path, w.loc.offset + 5)
    s.close()
    (tmp_path / "cold").rename(tmp_path / "cold-away")
    (tmp_path / "cold").mkdir()  # the mount point, with nothing mounted
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    assert any("dropped the index entry" in r for r in s.fsck(repair=True).repaired)
    s.close()
    assert list((tmp_path / "cold").iterdir()) == []
    assert (tmp_path / "hot" / "quarantine" / "bad-chunks.jsonl").is_file()
