"""The batched load path: every tensor of a load read together (one catalog lookup, one preadv per run of
chunks stored back to back), verified, with per-chunk fallback. Asserts bytes, values and call counts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from helpers.counting import CountPreadv

import datastates as ds


def _mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    st: dict[str, Any] = {f"small.{i:03d}": torch.randn(64 + i, generator=g) for i in range(300)}
    st["big"] = torch.randn(300_000, generator=g)  # several chunks at 256 KiB
    st["empty"] = torch.empty(0)
    st["scalar_i64"] = torch.tensor(500)
    st["same_a"] = torch.ones(1000, dtype=torch.float16)
    st["same_b"] = torch.ones(1000, dtype=torch.float16)  # same bytes: one chunk, named twice
    st["bf16"] = torch.randn(333, generator=g).to(torch.bfloat16)
    st["bool"] = torch.rand(77, generator=g) > 0.5
    st["cplx"] = torch.randn(10, dtype=torch.complex64, generator=g)
    st["meta"] = {"step": 3}
    return st


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            assert a[k].dtype == v.dtype and a[k].shape == v.shape, k
            assert torch.equal(a[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
        else:
            assert a[k] == v


def test_mixed_state_loads_bit_exact_in_few_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = _mixed_state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        count = CountPreadv(monkeypatch)
        got = store.load(v)
        _equal(got, st)
        # 311 tensors in one pack, under 8 MiB: one preadv, not one per tensor (any padding the writer put before a
        # large aligned chunk is read through, not around).
        assert count.calls == 1
        assert got["same_a"].untyped_storage().data_ptr() != got["same_b"].untyped_storage().data_ptr()


def test_one_small_tensor_of_many_and_a_pattern(tmp_path: Path) -> None:
    st = _mixed_state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        got = store.load(v, keys=["small.123"])
        assert list(got) == ["small.123"] and torch.equal(got["small.123"], st["small.123"])
        got = store.load(v, keys=["small.01*", "meta"])
        assert set(got) == {f"small.{i:03d}" for i in range(10, 20)} | {"meta"}
        assert got["meta"] == {"step": 3}


def test_load_across_versions_and_packs(tmp_path: Path) -> None:
    # The second version's unchanged tensors sit in the first version's pack: two packs, two runs at least.
    st = _mixed_state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        store.save(st)
        for k in ("small.007", "big", "bool"):
            t = st[k]
            st[k] = ~t if t.dtype == torch.bool else t + 1
        v2 = store.save(st)
        assert 0 < v2.bytes_new < v2.bytes_total
        _equal(store.load(v2), st)


class RecordPreadv:
    """Records each `os.preadv` call while installed: (fd, offset, sizes of its buffers)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, list[int]]] = []
        self.real = os.preadv
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd: int, bufs: Any, offset: int) -> int:
        self.calls.append((fd, offset, [len(memoryview(b)) for b in bufs]))
        return self.real(fd, bufs, offset)


def _every_third_changed(store: ds.Store) -> tuple[dict[str, Any], ds.Version, ds.Version]:
    """Two versions: the second changes every third small tensor, so its unchanged ones lie in the first pack
    with a hole (the changed tensor's old bytes) after every two."""
    st = _mixed_state()
    v1 = store.save(st)
    st = dict(st)
    for i in range(0, 300, 3):
        st[f"small.{i:03d}"] = st[f"small.{i:03d}"] + 1
    v2 = store.save(st)
    return st, v1, v2


def test_chunks_with_small_holes_between_them_are_read_in_one_preadv_per_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datastates.objects.object_store import _GAP_BYTES

    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        st, v1, v2 = _every_third_changed(store)
        cids = {c for r in store.manifest(v2.manifests["0"]).rows for c in r.get("chunks") or []}
        locs = [loc for loc in store.catalog.chunks(list(cids)) if loc is not None]
        unchanged = next(r for r in store.manifest(v2.manifests["0"]).rows if r["key"] == "small.001")
        first_pack = store.catalog.chunk(unchanged["chunks"][0]).pack  # v1's
        rec = RecordPreadv(monkeypatch)
        got = store.load(v2)
    _equal(got, st)
    # 200 unchanged small tensors around 100 holes in the first pack, 100 changed ones back to back in the second:
    # one read per pack, each hole read into a scratch buffer, not a read per stretch between holes.
    assert len(rec.calls) == 2 and len({fd for fd, _, _ in rec.calls}) == 2
    first = max(rec.calls, key=lambda c: len(c[2]))
    in_first = [loc for loc in locs if loc.pack == first_pack]
    start, end = min(x.offset for x in in_first), max(x.offset + x.length for x in in_first)
    assert first[1] == start and sum(first[2]) == end - start  # the whole span, holes included
    assert len(first[2]) > len(in_first)  # a buffer per chunk plus one per hole
    assert all(n <= _GAP_BYTES for n in first[2])


def test_a_hole_wider_than_the_bound_is_read_around(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datastates.objects.object_store import _GAP_BYTES

    g = torch.Generator().manual_seed(2)
    st = {"a": torch.randn(1000, generator=g), "wide": torch.randn((_GAP_BYTES + 4096) // 4, generator=g),
          "b": torch.randn(1000, generator=g)}
    with ds.Store.open(tmp_path / "s", chunk_size=4 << 20) as store:
        store.save(st)
        st["wide"] = st["wide"] + 1  # its old bytes stay between a and b in the first pack: a hole > the bound
        v2 = store.save(st)
        rec = RecordPreadv(monkeypatch)
        got = store.load(v2)
    _equal(got, st)
    # a and b: two reads of the first pack, nothing of the hole; wide: one read of the second pack
    assert sorted(sum(sizes) for _, _, sizes in rec.calls) == sorted([4000, 4000, st["wide"].numel() * 4])


def _flip(store: ds.Store, version: ds.Version, key: str, at: int, mask: int) -> dict[str, Any]:
    """XOR byte `at` of the first chunk of `key` in `version` with `mask`, in its pack file; returns the row."""
    row = next(r for r in store.manifest(version.manifests["0"]).rows if r["key"] == key)
    loc = store.catalog.chunk(row["chunks"][0])
    assert loc is not None
    path = store.tier.pack_path(loc.pack)
    data = bytearray(path.read_bytes())
    data[loc.offset + at] ^= mask
    path.write_bytes(bytes(data))
    return row


def test_a_flipped_byte_in_a_hole_read_through_changes_nothing(tmp_path: Path) -> None:
    """The bytes between the chunks a load needs are read but never used: damage there is not this version's,
    and the version that owns those bytes still reports it."""
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        st, v1, v2 = _every_third_changed(store)
        _flip(store, v1, "small.150", 3, 0x10)  # changed in v2: its v1 bytes are a hole v2's load reads through
        _equal(store.load(v2), st)
        with pytest.raises(ds.IntegrityError, match="small.150"):
            store.load(v1)


def test_a_flipped_byte_in_a_chunk_after_a_hole_is_named(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        st, v1, v2 = _every_third_changed(store)
        row = _flip(store, v2, "small.151", 7, 0x01)  # unchanged in v2, right after the hole small.150 left
        with pytest.raises(ds.IntegrityError, match="small.151") as err:
            store.load(v2)
        assert row["chunks"][0].hex()[:16] in str(err.value)
        got = store.load(v2, keys=["small.152", "small.154"])  # around it, each verified on its own
        assert torch.equal(got["small.152"], st["small.152"]) and torch.equal(got["small.154"], st["small.154"])


def test_flipped_byte_in_a_merged_run_is_named(tmp_path: Path) -> None:
    st = _mixed_state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = store.save(st)
        row = _flip(store, v, "small.150", 5, 0xFF)
        with pytest.raises(ds.IntegrityError, match="small.150") as err:
            store.load(v)
        assert row["chunks"][0].hex()[:16] in str(err.value)
        # the tensors around it still load, each verified on its own
        got = store.load(v, keys=["small.149", "small.151"])
        assert torch.equal(got["small.149"], st["small.149"]) and torch.equal(got["small.151"], st["small.151"])


def test_corrupt_hot_copy_is_repaired_from_cold(tmp_path: Path) -> None:
    st = _mixed_state()
    store = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", chunk_size=256 << 10)
    try:
        v = store.save(st)
        assert store.flush(timeout=60)
        row = next(r for r in store.manifest(v.manifests["0"]).rows if r["key"] == "small.010")
        loc = store.catalog.chunk(row["chunks"][0])
        assert loc is not None
        hot_pack = tmp_path / "hot" / "packs" / f"{loc.pack}.pack"
        data = bytearray(hot_pack.read_bytes())
        data[loc.offset] ^= 0xFF
        hot_pack.write_bytes(bytes(data))
        _equal(store.load(v), st)
        assert hot_pack.read_bytes()[loc.offset] == data[loc.offset] ^ 0xFF  # the good copy is back on hot
    finally:
        store.close()


def _big_state() -> dict[str, Any]:
    """More than 8 MiB to read (the load hands verification to the store's reader threads), in two packs."""
    st = _mixed_state()
    g = torch.Generator().manual_seed(1)
    for i in range(24):
        st[f"layer.{i:02d}"] = torch.randn(131_072 + 7 * i, generator=g)  # ~512 KiB each, 2-3 chunks
    return st


def _saved_in_two_packs(store: ds.Store, st: dict[str, Any]) -> ds.Version:
    """`st` (a `_big_state`) saved so that its chunks span two packs: the layers saved first stay in the first."""
    store.save({k: t for k, t in st.items() if not k.startswith("layer.1")})
    return store.save(st)


def _recorded_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, streams: int | None
                   ) -> tuple[Any, Any, list[tuple[str, str, int, int]], list[str], set[bytes]]:
    """Load `_big_state` (saved so that it spans two packs) with every `preadv` and chunk check recorded: what was
    loaded and what it should be, (thread, pack file, offset, bytes) per read, the thread of each check, and the
    chunk ids. With `streams`: every tensor row through `ObjectStore.read_many_into` with the store's reader
    threads, against the same read on this thread alone (lists of byte arrays); else `load`, against the state."""
    import threading

    from datastates.objects import object_store
    from datastates.save.tree import dtype_from_name

    st = _big_state()
    reads: list[tuple[str, str, int, int]] = []
    hashed: list[str] = []
    real_preadv, real_id = os.preadv, object_store.chunk_id

    def preadv(fd: int, bufs: Any, offset: int) -> int:
        n = real_preadv(fd, bufs, offset)
        reads.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}"), offset, n))
        return n

    def chunk_id(data: Any) -> bytes:
        hashed.append(threading.current_thread().name)
        return real_id(data)

    def rows() -> list[tuple[list[bytes], Any, str]]:
        return [(cols["chunks"][i], torch.empty(cols["shape"][i], dtype=dtype_from_name(cols["dtype"][i]))
                 .reshape(-1).view(torch.uint8).numpy(), key)
                for i, key in enumerate(cols["key"]) if cols["kind"][i] == "tensor"]

    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = _saved_in_two_packs(store, st)
        m = store.repo.manifest_of(v)
        cols = m.load_columns()
        if streams is not None:
            want: Any = rows()
            store.repo.objects.read_many_into(want, None)
        monkeypatch.setattr("os.preadv", preadv)
        monkeypatch.setattr(object_store, "chunk_id", chunk_id)
        if streams is None:
            got: Any = store.load(v)
            want = st
        else:
            got = rows()
            store.repo.objects.read_many_into(got, store._readers, streams=streams)
            got, want = [a.tobytes() for _, a, _ in got], [a.tobytes() for _, a, _ in want]
    cids = {c for r in m.rows for c in r.get("chunks") or []}
    return got, want, reads, hashed, cids


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a read's file through /proc")
def test_a_big_load_reads_in_two_streams_each_in_offset_order_and_verifies_on_the_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full load reads its runs in two streams: the calling thread the first half of the bytes in pack and
    offset order, one reader thread the rest in the same order (each a sequential reader for the kernel's
    readahead); the reader threads verify every chunk once."""
    import threading

    got, want, reads, hashed, cids = _recorded_load(tmp_path, monkeypatch, None)
    _equal(got, want)
    me = threading.current_thread().name
    mine = [(pack, off) for name, pack, off, _ in reads if name == me]
    theirs = [(pack, off) for name, pack, off, _ in reads if name != me]
    assert mine and theirs  # two streams
    assert all(name.startswith("datastates-read") for name, _, _, _ in reads if name != me)
    assert mine == sorted(mine) and theirs == sorted(theirs)  # each front to back
    assert max(mine) < min(theirs)  # the first half, then the second: not interleaved
    assert len({pack for pack, _ in mine + theirs}) >= 2  # two packs at least
    assert len(hashed) == len(cids)  # every chunk verified once (same_a/same_b share one)
    assert all(name.startswith("datastates-read") for name in hashed)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names a read's file through /proc")
@pytest.mark.parametrize("streams", [1, 2])
def test_read_many_into_reads_in_as_many_streams_as_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          streams: int) -> None:
    """One stream (what the staged load onto an accelerator asks for): every read on the calling thread, front to
    back; two: about half the bytes each (at most one run apart). The same bytes either way."""
    import threading

    got, want, reads, hashed, cids = _recorded_load(tmp_path, monkeypatch, streams)
    assert len(got) == len(want) > 20 and got == want
    me = threading.current_thread().name
    by_thread: dict[str, int] = {}
    for name, _, _, n in reads:
        by_thread[name] = by_thread.get(name, 0) + n
    mine = [(pack, off) for name, pack, off, _ in reads if name == me]
    assert mine == sorted(mine)
    assert len(by_thread) == streams and me in by_thread
    if streams == 2:
        ours = by_thread.pop(me)
        assert abs(ours - sum(by_thread.values())) <= 8 << 20  # `_RUN_BYTES`: one run at most
    assert len(hashed) == len(cids)


def test_a_failed_big_load_raises_only_once_no_check_reads_its_tensors(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's byte views do not keep its tensors alive (`base.memory.bytes_at`), so when a chunk fails its check
    the load raises only once every other check has ended: the last run's check is held until the first run's
    chunk has failed its read, and is done when the IntegrityError arrives."""
    import threading

    from datastates.objects.object_store import ObjectStore

    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v = _saved_in_two_packs(store, _big_state())
        cids = [c for r in store.manifest(v.manifests["0"]).rows for c in r.get("chunks") or []]
        locs = store.repo.objects.index.chunks(cids)
        order = sorted((loc.pack, loc.offset, cid) for cid, loc in zip(cids, locs) if loc is not None)
        first, last = order[0], order[-1]
        pack = next((tmp_path / "s").rglob(f"{first[0]}.pack"))
        data = bytearray(pack.read_bytes())
        data[first[1] + 5] ^= 0x01
        pack.write_bytes(bytes(data))
        failed = threading.Event()
        pending: list[Any] = []
        real_verified, real_read = ObjectStore._verified, ObjectStore._read_chunk
        real_start = ObjectStore.start_read_many

        def verified(self: ObjectStore, run: Any) -> bool:
            if any(cid == last[2] for cid, _, _, _ in run):
                assert failed.wait(60)  # (a guard against a hang, not a timing)
            return real_verified(self, run)

        def read_chunk(self: ObjectStore, *a: Any, **k: Any) -> Any:
            try:
                return real_read(self, *a, **k)
            except ds.IntegrityError:
                failed.set()
                raise

        def start(self: ObjectStore, *a: Any, **k: Any) -> Any:
            pending.append(real_start(self, *a, **k))
            return pending[-1]

        monkeypatch.setattr(ObjectStore, "_verified", verified)
        monkeypatch.setattr(ObjectStore, "_read_chunk", read_chunk)
        monkeypatch.setattr(ObjectStore, "start_read_many", start)
        with pytest.raises(ds.IntegrityError):
            store.load(v)
        assert failed.is_set() and len(pending) == 1
        checks = pending[0]._checks
        assert len(checks) >= 2 and all(fut.done() for _, fut in checks)


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("tiers", ["hot-only", "with-cold"])
def test_a_flipped_byte_in_a_big_load_is_named_or_repaired(tmp_path: Path, tiers: str, mmap: bool) -> None:
    """The same with `load(mmap=True)`: a chunk whose mapped bytes do not match is read as usual, so it is named,
    or read from cold and repaired."""
    st = _big_state()
    cold = tiers == "with-cold"
    kw: dict[str, Any] = {"hot": tmp_path / "hot"} if cold else {}
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10, **kw) as store:
        v = store.save(st)
        if cold:
            assert store.flush(timeout=60)
        row = next(r for r in store.manifest(v.manifests["0"]).rows if r["key"] == "layer.11")
        loc = store.catalog.chunk(row["chunks"][1])
        assert loc is not None
        path = (tmp_path / "hot" / "packs" / f"{loc.pack}.pack") if cold else store.tier.pack_path(loc.pack)
        data = bytearray(path.read_bytes())
        data[loc.offset + 9] ^= 0x01
        path.write_bytes(bytes(data))
        if cold:
            _equal(store.load(v, mmap=mmap), st)
            assert path.read_bytes()[loc.offset + 9] == data[loc.offset + 9] ^ 0x01  # good copy back on hot
        else:
            with pytest.raises(ds.IntegrityError, match="layer.11") as err:
                store.load(v, mmap=mmap)
            assert row["chunks"][1].hex()[:16] in str(err.value)
            got = store.load(v, keys=["layer.10", "layer.12"], mmap=mmap)
            assert torch.equal(got["layer.10"], st["layer.10"]) and torch.equal(got["layer.12"], st["layer.12"])


def test_a_big_load_from_cold_only_reads_on_the_reader_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hot lost (a restart on a fresh node): every chunk comes from cold, read and verified on the store's reader
    threads (a parallel file system serves concurrent reads better), and the load is bit-exact."""
    import shutil
    import threading

    st = _big_state()
    with ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", chunk_size=256 << 10, promote=False) as store:
        v = store.save(st)
        assert store.flush(timeout=60)
    shutil.rmtree(tmp_path / "hot")
    names: list[str] = []
    real = os.preadv

    def preadv(fd: int, bufs: Any, offset: int) -> int:
        names.append(threading.current_thread().name)
        return real(fd, bufs, offset)

    with ds.Store.open(tmp_path / "cold", promote=False) as store:
        monkeypatch.setattr("os.preadv", preadv)
        got = store.load(v)
    _equal(got, st)
    assert names and all(n.startswith("datastates-read") for n in names)
    assert not list((tmp_path / "hot" / "packs").glob("*.pack"))  # nothing promoted


def test_load_pauses_the_garbage_collector_and_restores_it(tmp_path: Path) -> None:
    """A load of thousands of small tensors runs with the cyclic collector off (its collections took half of the
    caller's CPU); it comes back on after, and a collector the caller disabled stays disabled."""
    import gc

    collections: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    st = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(st)
        store.load(v)  # warm: the manifest cache
        gc.collect()
        gc.callbacks.append(seen)
        try:
            collections.clear()
            got = store.load(v)  # ~10,000 allocations: a dozen collections unpaused
            assert len(collections) <= 1  # at most the one that falls due as the collector comes back
            assert gc.isenabled()
            gc.disable()
            try:
                again = store.load(v, keys=["t7"])
                assert not gc.isenabled()
            finally:
                gc.enable()
        finally:
            gc.callbacks.remove(seen)
    assert len(got) == 3000 and torch.equal(got["t2999"], st["t2999"]) and torch.equal(again["t7"], st["t7"])


_EVERY_DTYPE = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8,
                torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.bool, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", _EVERY_DTYPE, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4)], ids=str)
def test_an_empty_row_is_a_tensor_whose_bytes_the_flat_view_views(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from types import SimpleNamespace

    from datastates.repo import reader

    n = torch.empty(shape, dtype=dtype).nbytes
    name, m = str(dtype).removeprefix("torch."), SimpleNamespace(id="ab" * 32)
    out, flat = reader._empty_row(m, "w", name, list(shape), n)  # type: ignore[arg-type]
    assert out.dtype == dtype and tuple(out.shape) == shape and flat.format == "B" and flat.nbytes == n
    assert not flat.readonly and flat.contiguous
    want = bytes(range(1, n + 1))  # every dtype alike: writing the view writes the tensor
    flat[:] = want
    assert out.reshape(-1).view(torch.uint8).numpy().tobytes() == want
    with pytest.raises(ds.IntegrityError, match="'w' in manifest abababababab: .* run `datastates fsck`"):
        reader._empty_row(m, "w", name, list(shape), n + 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [99, -1])
def test_a_row_pointing_at_a_row_that_is_not_there_is_an_integrity_error(tmp_path: Path, bad: int) -> None:
    # Tied weights: the second key is an alias row naming the first. A damaged base number (past the end, or
    # negative, which a Python list would quietly wrap around) is refused with a hint, never read as another row.
    t = torch.arange(6, dtype=torch.float32)
    with ds.Store.open(tmp_path / "s") as s:
        v = s.save({"a": t, "b": t})
        m = s.manifest_of(v)
        cols = m.load_columns()
        alias = cols["kind"].index("alias")
        cols["base"][alias] = bad  # the cached columns of the manifest a full load reads
        with pytest.raises(ds.IntegrityError, match=f"points at row {bad} .*run `datastates --store [^ ]+ fsck`"):
            s.load(v)
        with pytest.raises(ds.IntegrityError, match=f"points at row {bad} .*run `datastates --store [^ ]+ fsck`"):
            s.load(v, keys=["b"])  # a keyed load after a full one takes its rows from those columns
        # A keyed load with nothing decoded yet reads the row's values where they lie, and refuses the same.
        del m.__dict__["_load_columns"]
        m._load_arrays["base"] = pa.chunked_array([pa.array(cols["base"], type=pa.int32())])
        with pytest.raises(ds.IntegrityError, match=f"points at row {bad} .*run `datastates --store [^ ]+ fsck`"):
            s.load(v, keys=["b"])
        assert torch.equal(s.load(v, keys=["a"])["a"], t)
