"""`load(mmap=True)`: host tensors made on private mappings of the packs, verified, with the usual read for what
cannot be mapped. Asserts bytes, values, where each tensor's memory lies (/proc/self/maps) and error types."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import datastates as ds
from datastates.objects.chunks import CODEC_RAW, CODEC_ZSTD, ChunkLocation
from datastates.objects.object_store import _one_span
from datastates.retention import KeepLatest


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randn(1000, generator=g)
    st: dict[str, Any] = {f"small.{i:03d}": torch.randn(50 + i, generator=g) for i in range(200)}
    st.update({
        "big": torch.randn(700_000, generator=g),  # several 256 KiB chunks
        "empty": torch.empty(0),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "f8": torch.randn(99, generator=g).to(torch.float8_e4m3fn),
        "bool": torch.rand(77, generator=g) > 0.5,
        "cplx": torch.randn(10, dtype=torch.complex64, generator=g),
        "u16": torch.arange(11).to(torch.uint16),
        "matrix": torch.randn(40, 30, generator=g),
        "transposed": torch.randn(30, 40, generator=g).t(),
        "tied_a": shared, "tied_b": shared, "window": shared[100:200],
        "meta": {"step": 3, "name": "run"},
    })
    return st


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(_raw(got[k]), _raw(v)), k
        else:
            assert got[k] == v, k


def _mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds `t`'s first byte, with the mapping's permissions ('rw-p path'), or None."""
    p = t.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= p < hi:
            return f"{fields[1]} {fields[5]}" if len(fields) > 5 else None
    return None


def _in_pack(t: torch.Tensor) -> bool:
    return (_mapped_file(t) or "").endswith(".pack")


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.pack"))}


def test_a_mapped_load_equals_a_read_and_views_the_packs(tmp_path: Path) -> None:
    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        read, mapped = store.load(v), store.load(v, mmap=True)
        _same(mapped, st)
        for k, t in read.items():
            if isinstance(t, torch.Tensor):  # the same layout as a read: strides, offsets, storage sizes
                m = mapped[k]
                assert (m.stride(), m.storage_offset(), m.untyped_storage().nbytes()) == (
                    t.stride(), t.storage_offset(), t.untyped_storage().nbytes()), k
        # Chunks lie back to back in a pack, unpadded: a row is mapped exactly when its first byte sits at a
        # multiple of its element size (the others are read), and a read never views a pack.
        packs = {p.name for p in (tmp_path / "s" / "packs").glob("*.pack")}
        rows = [r for r in store.manifest(v.manifests["0"]).rows if r["kind"] in ("tensor", "storage") and r["nbytes"]]
        mapped_rows = 0
        for r in rows:
            loc = store.catalog.chunk(r["chunks"][0])
            assert loc is not None
            k = r["key"] if r["kind"] == "tensor" else "tied_a"  # the storage row's bytes are tied_a's
            where = _mapped_file(mapped[k])
            aligned = loc.offset % mapped[k].element_size() == 0 and not r["stride"]  # (a kept layout is copied)
            assert (where is not None and where.startswith("rw-p ") and Path(where[5:]).name in packs) == aligned, (
                k, where, loc.offset)
            assert not _in_pack(read[k]), k
            mapped_rows += aligned
        assert mapped_rows >= 150 and _in_pack(mapped["big"])  # most of them, the big one too
        # tied tensors and the view share one storage, as in a read
        assert mapped["window"].untyped_storage().data_ptr() == mapped["tied_a"].untyped_storage().data_ptr()
        assert mapped["window"].storage_offset() == 100
        assert mapped["empty"].numel() == 0


def test_writes_to_mapped_tensors_stay_in_the_process(tmp_path: Path) -> None:
    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        before = _digest(tmp_path / "s" / "packs")
        got = store.load(v, mmap=True)
        got["big"].add_(1.0)
        got["small.000"].zero_()
        got["window"].fill_(5.0)
        assert _digest(tmp_path / "s" / "packs") == before  # not one byte of a pack changed
        assert torch.equal(got["big"], st["big"] + 1.0)
        assert torch.equal(got["tied_a"][100:200], torch.full((100,), 5.0))  # the view and its base agree
        _same(store.load(v, mmap=True), st)
        _same(store.load(v), st)
        assert store.fsck().ok


def test_tensors_saved_apart_with_equal_bytes_do_not_share_a_mapping(tmp_path: Path) -> None:
    """Dedup stores equal bytes once, and a mapped load made every tensor over them share one memory: AdamW's
    per-parameter `step` counters became one counter after a resume (a review: 9 of 15 optimizers diverged)."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(200_000, generator=g)  # 800 KB: chunks of 256 KiB
    st = {"step_a": torch.tensor(3.0), "step_b": torch.tensor(3.0), "zeros_a": torch.zeros(1000),
          "zeros_b": torch.zeros(1000), "big": big, "same_as_big": big.clone(),
          "tail_of_big": big[65536:131072].clone()}  # equal to big's second chunk alone
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        got = store.load(v, mmap=True)
        ptrs = {k: t.untyped_storage().data_ptr() for k, t in got.items()}
        assert len(set(ptrs.values())) == len(ptrs)  # seven tensors, seven memories
        assert _in_pack(got["big"]) and _in_pack(got["step_a"])  # the first over each byte still maps
        got["step_a"] += 1
        got["zeros_a"][0] = 5
        got["big"][65536:131072] = -1.0
        assert got["step_b"].item() == 3.0 and got["zeros_b"][0].item() == 0.0
        assert torch.equal(got["same_as_big"], big) and torch.equal(got["tail_of_big"], st["tail_of_big"])
        assert got["step_a"].item() == 4.0


def test_mapped_tensors_outlive_their_packs_deletion(tmp_path: Path) -> None:
    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v1 = store.save(st)
        first = {p.name for p in (tmp_path / "s" / "packs").glob("*.pack")}
        got = store.load(v1, mmap=True)
        store.save({"other": torch.randn(1000)})
        store.prune(KeepLatest(1))  # v1 is no head and no tag any more: its bytes go
        store.gc()
        assert first.isdisjoint(p.name for p in (tmp_path / "s" / "packs").glob("*.pack"))  # its pack is deleted
        _same(got, st)  # the mapping keeps the deleted file's bytes
        with pytest.raises(ds.PrunedError):
            store.load(v1, mmap=True)


def test_a_flipped_byte_is_named_and_the_rest_maps(tmp_path: Path) -> None:
    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        row = next(r for r in store.manifest(v.manifests["0"]).rows if r["key"] == "small.123")
        loc = store.catalog.chunk(row["chunks"][0])
        assert loc is not None
        path = store.tier.pack_path(loc.pack)
        data = bytearray(path.read_bytes())
        data[loc.offset + 3] ^= 0x20
        path.write_bytes(bytes(data))
        with pytest.raises(ds.IntegrityError, match="small.123") as err:
            store.load(v, mmap=True)
        assert row["chunks"][0].hex()[:16] in str(err.value)
        got = store.load(v, keys=["small.122", "small.124", "big"], mmap=True)
        assert torch.equal(got["small.122"], st["small.122"]) and torch.equal(got["small.124"], st["small.124"])
        assert torch.equal(got["big"], st["big"])


def test_what_cannot_be_mapped_is_read(tmp_path: Path) -> None:
    """Compressed chunks, and a state whose packs are only on cold (hot lost, no promotion): the same values."""
    g = torch.Generator().manual_seed(5)
    st = {"r": torch.randint(0, 256, (12000,), dtype=torch.uint8, generator=g),  # incompressible: stored raw
          "ones": torch.ones(200_000), "seq": torch.arange(5000, dtype=torch.float32)}
    with ds.Store.open(tmp_path / "z", zstd_level=3, chunk_size=256 << 10) as store:
        v = store.save(st)
        got = store.load(v, mmap=True)
        _same(got, st)
        assert not _in_pack(got["ones"])  # zstd-coded: decoded into new memory
        assert _in_pack(got["r"])
    with ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", chunk_size=256 << 10, promote=False) as store:
        v = store.save(st)
        assert store.flush(timeout=60)
    shutil.rmtree(tmp_path / "hot")
    with ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", chunk_size=256 << 10, promote=False) as store:
        got = store.load(v, mmap=True)
        _same(got, st)
        assert not any(_in_pack(t) for t in got.values())


def test_unverified_store_maps_without_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datastates.objects import object_store

    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
    hashed: list[int] = []
    real = object_store.chunk_id

    def chunk_id(data: Any) -> bytes:
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(object_store, "chunk_id", chunk_id)
    with ds.Store.open(tmp_path / "s", verify=False) as store:
        got = store.load(v, mmap=True)
    _same(got, st)
    assert hashed == []
    with ds.Store.open(tmp_path / "s") as store:
        store.load(v, keys=["big"], mmap=True)
    assert len(hashed) == 11  # 2,800,000 bytes in 256 KiB chunks: every chunk checked


def _loc(pack: str, offset: int, length: int, codec: int = CODEC_RAW) -> ChunkLocation:
    return ChunkLocation(pack, offset, length, length, codec)


def test_only_raw_chunks_back_to_back_in_one_pack_and_aligned_are_one_span() -> None:
    a, b = "a" * 32, "b" * 32
    assert _one_span([_loc(a, 64, 100), _loc(a, 164, 28)], 128, 4) == (a, 64)
    assert _one_span([_loc(a, 64, 100), _loc(a, 165, 28)], 128, 4) is None  # a hole between them
    assert _one_span([_loc(a, 64, 100), _loc(b, 164, 28)], 128, 4) is None  # two packs
    assert _one_span([_loc(a, 66, 128)], 128, 4) is None  # not aligned for a 4-byte element
    assert _one_span([_loc(a, 66, 128)], 128, 2) == (a, 66)
    assert _one_span([_loc(a, 64, 128, CODEC_ZSTD)], 128, 4) is None  # compressed
    assert _one_span([_loc(a, 64, 100)], 128, 4) is None  # fewer bytes than the row says
    assert _one_span([None], 128, 4) is None
    assert _one_span([], 0, 4) is None


def test_mapped_tensors_behave_as_torch_load_mmap_ones(tmp_path: Path) -> None:
    """What a caller does next with a mapped state: save it with torch.save, share it with worker processes,
    load it into a module (copied, or assigned and still mapped); a resize is refused, as for
    `torch.load(mmap=True)`'s tensors."""
    import io

    model = torch.nn.Linear(10, 3)
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save({"model": model.state_dict(), "x": torch.arange(1000, dtype=torch.float32)})
        got = store.load(v, mmap=True)
        spare = store.load(v, keys=["x"], mmap=True)["x"]
    with pytest.raises(RuntimeError, match="not resizable"):
        spare.resize_(2000)
    buf = io.BytesIO()
    torch.save(got, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    _same(back["model"], got["model"])
    assert torch.equal(back["x"], got["x"])
    x = got["x"]
    assert _in_pack(x)
    x.share_memory_()
    assert x.is_shared() and not _in_pack(x) and torch.equal(x, torch.arange(1000, dtype=torch.float32))
    copy = torch.nn.Linear(10, 3)
    copy.load_state_dict(got["model"])
    assert torch.equal(copy.weight, model.weight) and not _in_pack(copy.weight)
    copy.load_state_dict(got["model"], assign=True)
    assert torch.equal(copy.weight, model.weight) and _in_pack(copy.weight)
