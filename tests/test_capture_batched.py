"""Capture of many small tensors: the pieces of one slot are copied in one batched call. Asserts the bytes
that land in the store (chunk ids = blake3 of each tensor's bytes), dedup per tensor, slot and pack
boundaries, and values after a load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

import datastates as ds


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    st: dict[str, torch.Tensor] = {}
    for i in range(400):
        n = 1 + (i * 37) % 900  # odd sizes: pieces need alignment padding between them
        dt = (torch.float32, torch.float16, torch.int64, torch.bfloat16, torch.uint8)[i % 5]
        t = torch.randn(n, generator=g) * 100
        st[f"p.{i:03d}"] = t.to(dt)
    st["big"] = torch.randn(300_000, generator=g)  # 1.2 MB: split over several 256 KiB chunks and slots
    st["strided"] = torch.randn(64, 64, generator=g).t()  # non-contiguous: copied through its flat bytes
    st["empty"] = torch.empty(0, 3)
    return st


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _rows(store: ds.Store, v: Any) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in store.manifest(v.manifests["0"]).rows}


def test_chunk_ids_are_blake3_of_each_tensor_across_slots(tmp_path: Path) -> None:
    st = _state()
    # Pool of 1 MiB slots, 2 of them: the state crosses many slot boundaries and waits for slots.
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10, pool_bytes=2 << 20) as store:
        v = store.save(st)
        rows = _rows(store, v)
        for k, t in st.items():
            raw = _raw(t)
            want = [blake3.blake3(raw[a:a + (256 << 10)]).digest() for a in range(0, max(len(raw), 1), 256 << 10)]
            assert rows[k]["chunks"] == want, k
        got = store.load(v)
        for k, t in st.items():
            assert got[k].dtype == t.dtype and got[k].shape == t.shape and _raw(got[k]) == _raw(t), k


def test_one_changed_small_tensor_costs_only_its_bytes(tmp_path: Path) -> None:
    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        store.save(st)
        st["p.123"] = st["p.123"] + 1
        v2 = store.save(st)
        assert v2.bytes_new == st["p.123"].numel() * st["p.123"].element_size()
        assert v2.chunks_new == 1
        assert torch.equal(store.load(v2, keys=["p.123"])["p.123"], st["p.123"])


def test_small_tensors_spread_over_packs(tmp_path: Path) -> None:
    # Packs close after 64 KiB: the small tensors of one slot land in several packs, and load back whole.
    st = _state()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        store.pipeline.pack_bytes = 64 << 10
        v = store.save(st)
        packs = {store.catalog.chunk(c).pack for r in _rows(store, v).values() for c in r.get("chunks") or []}
        assert len(packs) > 3
        got = store.load(v)
        assert all(_raw(got[k]) == _raw(t) for k, t in st.items())
        got = store.load(v, keys=["p.321"])
        assert _raw(got["p.321"]) == _raw(st["p.321"])


def test_async_capture_is_staged_before_mutation(tmp_path: Path) -> None:
    st = _state()
    want = {k: _raw(t) for k, t in st.items()}
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        h = store.save_async(st)
        assert h.wait_staged(timeout=60)
        for t in st.values():  # the caller may change its tensors once staged
            if t.numel():
                t.zero_()
        got = store.load(h.result(timeout=60))
        assert all(_raw(got[k]) == want[k] for k in st)


def test_sync_save_reads_big_tensors_in_place(tmp_path: Path) -> None:
    # A sync save hands host tensors >= 1 MiB to the pipeline in place: no pool slot is ever allocated for
    # them, and the bytes stored are exactly the tensors' (chunk ids = blake3 of each 256 KiB span).
    g = torch.Generator().manual_seed(1)
    st = {f"big{i}": torch.randn(300_000 + i * 1000, generator=g) for i in range(4)}
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        v1 = store.save(st)
        assert store.pool.allocated_bytes == 0
        rows = _rows(store, v1)
        for k, t in st.items():
            raw = _raw(t)
            assert rows[k]["chunks"] == [blake3.blake3(raw[a:a + (256 << 10)]).digest()
                                         for a in range(0, len(raw), 256 << 10)], k
        st["big2"][:10] += 1  # one chunk of one tensor changes
        v2 = store.save(st)
        assert v2.chunks_new == 1 and v2.bytes_new == 256 << 10
        got = store.load(v2)
        assert all(torch.equal(got[k], t) for k, t in st.items())
        # an asynchronous save copies (the caller may change its tensors once staged): the pool is used
        h = store.save_async(st)
        assert h.wait_staged(timeout=60)
        for t in st.values():
            t.zero_()
        v3 = h.result(timeout=60)
        assert store.pool.allocated_bytes > 0
        assert torch.equal(store.load(v3)["big1"], got["big1"])


def test_borrowed_chunks_weigh_in_the_hashing_window_what_the_writer_is_expected_to_write() -> None:
    from datastates.save.pipeline import _AHEAD_BYTES, window_weight

    mib = 1 << 20
    assert window_weight(16 * mib, False, 0, 0, 0.1) == 16 * mib  # pool memory: always its bytes
    assert window_weight(16 * mib, True, 0, 0, 1.0) == 16 * mib  # the last save wrote everything
    assert window_weight(16 * mib, True, 0, 0, 0.25) == 4 * mib  # the last save wrote a quarter
    assert window_weight(16 * mib, True, 0, 0, 0.0) == mib  # never under 1/16
    # once the window's worth went through the writer, this save's own fraction counts
    assert window_weight(16 * mib, True, _AHEAD_BYTES, _AHEAD_BYTES // 2, 0.0) == 8 * mib
    assert window_weight(16 * mib, True, _AHEAD_BYTES - 1, _AHEAD_BYTES - 1, 0.0) == mib


def test_the_pipeline_keeps_the_fraction_of_bytes_each_sync_save_wrote(tmp_path: Path) -> None:
    # `window_weight`'s guess for the next save: 1 of 8 equal borrowed tensors changed -> 1/8; the bytes are all
    # there whatever the guess, including in a save that then changes everything.
    g = torch.Generator().manual_seed(7)
    st = {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(8)}  # 8 x 1 MiB, read in place
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        pipeline = store.pipeline
        store.save(st)
        assert pipeline.written_fraction == 1.0
        st["w3"].add_(1)
        v2 = store.save(st)
        assert v2.bytes_new == 1 << 20 and pipeline.written_fraction == 1 / 8
        for t in st.values():
            t.mul_(2)
        v3 = store.save(st)
        assert v3.bytes_new == 8 << 20 and pipeline.written_fraction == 1.0
        assert store.save(st).bytes_new == 0 and pipeline.written_fraction == 0.0
        got = store.load(v3)
        assert all(torch.equal(got[k], t) for k, t in st.items())


def test_save_pauses_the_garbage_collector_and_restores_it(tmp_path: Path) -> None:
    import gc

    collections: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    st = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}
    gc.callbacks.append(seen)
    try:
        with ds.Store.open(tmp_path / "s") as store:
            store.save(st)  # warm: the pool and the pipeline's first allocations
            gc.collect()  # start from empty generation counts: a collection due before the save is not its own
            collections.clear()
            # The blocking part (flatten + capture: ~30,000 allocations, dozens of collections unpaused)
            # runs paused; at most the one collection that falls due when the collector comes back on.
            h = store.save_async(st)
            assert len(collections) <= 1
            assert gc.isenabled()
            v = h.result(timeout=60)
            gc.disable()
            try:
                store.save(st)
                assert not gc.isenabled()  # a collector the caller disabled stays disabled
            finally:
                gc.enable()
            assert torch.equal(store.load(v)["t2999"], st["t2999"])
    finally:
        gc.callbacks.remove(seen)


def _equal_small(n: int = 200) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    st = {f"s.{i:03d}": torch.randn(4096, generator=g) for i in range(n)}  # 16 KiB each: back to back in a slot
    st["s.100"] = st["s.099"].clone()  # the same bytes twice in one run: stored once
    return st


def test_adjacent_small_tensors_are_written_as_one_stretch_and_deduped_per_tensor(tmp_path: Path) -> None:
    st = _equal_small()
    with ds.Store.open(tmp_path / "s", chunk_size=1 << 20) as store:
        v1 = store.save(st)
        assert v1.chunks_new == 199 and v1.bytes_new == 199 * 16384
        rows = _rows(store, v1)
        locs = [store.catalog.chunk(rows[f"s.{i:03d}"]["chunks"][0]) for i in range(100)]
        assert len({loc.pack for loc in locs}) == 1
        assert [b.offset - a.offset for a, b in zip(locs, locs[1:])] == [16384] * 99  # laid out back to back
        for i in (0, 57, 199):
            assert rows[f"s.{i:03d}"]["chunks"] == [blake3.blake3(_raw(st[f"s.{i:03d}"])).digest()]
        with torch.no_grad():
            st["s.042"].add_(1)
        v2 = store.save(st)
        assert v2.chunks_new == 1 and v2.bytes_new == 16384
        assert torch.equal(store.load(v2, keys=["s.042"])["s.042"], st["s.042"])
        got = store.load(v2)
        assert all(torch.equal(got[k], t) for k, t in st.items())


def test_a_stretch_of_small_tensors_is_cut_at_the_pack_limit(tmp_path: Path) -> None:
    st = _equal_small()
    with ds.Store.open(tmp_path / "s", chunk_size=1 << 20) as store:
        store.pipeline.pack_bytes = 100 << 10  # a chunk goes to a pack still under 100 KiB, else to a new one
        v = store.save(st)
        by_pack: dict[str, list[int]] = {}
        for r in _rows(store, v).values():
            loc = store.catalog.chunk(r["chunks"][0])
            by_pack.setdefault(loc.pack, []).append(loc.offset)
        assert len(by_pack) == 29  # 199 distinct chunks, 7 a pack (8-byte header + 7 x 16 KiB crosses 100 KiB)
        assert all(max(offsets) < 100 << 10 for offsets in by_pack.values())
        assert torch.equal(store.load(v, keys=["s.150"])["s.150"], st["s.150"])
        got = store.load(v)
        assert all(torch.equal(got[k], t) for k, t in st.items())


def _count_filled(monkeypatch: Any) -> list[int]:
    """Bytes each `Slot.fill` call copied (pieces not copied before)."""
    from datastates.save.buffers import Slot

    copied: list[int] = []
    real = Slot.fill

    def fill(self: Slot, indices: list[int]) -> None:
        before = bytes(self.filled) if self.filled is not None else b""
        real(self, indices)
        if self.filled is not None:
            copied.append(sum(self.pieces[i].length for i in indices if not before[i] and self.filled[i]))

    monkeypatch.setattr(Slot, "fill", fill)
    return copied


def test_sync_save_copies_only_the_small_tensors_it_writes_or_summarizes(tmp_path: Path, monkeypatch: Any) -> None:
    # A sync save reads small tensors in place too: the workers hash them where they lie and copy into the slot
    # only the pieces they must write (new) or summarize (stats not known from this store's last save).
    st = _state()
    small = sum(t.numel() * t.element_size() for k, t in st.items() if k != "big")
    copied = _count_filled(monkeypatch)
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10, pool_bytes=2 << 20) as store:
        v1 = store.save(st)
        assert sum(copied) == small  # all new
        copied.clear()
        st["p.123"].add_(1)  # in place: the kept flatten and layout are used again
        v2 = store.save(st)
        assert sum(copied) == v2.bytes_new == st["p.123"].numel() * st["p.123"].element_size()
        stats2 = {k: r.get("stats") for k, r in _rows(store, v2).items()}
    copied.clear()
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10, pool_bytes=2 << 20) as store:
        v3 = store.save(st)  # a new process knows no stats: every piece is summarized again, none written
        assert v3.bytes_new == 0 and sum(copied) == small
        assert {k: r.get("stats") for k, r in _rows(store, v3).items()} == stats2
        for v in (v1, v3):
            got = store.load(v)
            assert all(_raw(got[k]) == _raw(t) for k, t in st.items() if v is v3 or k != "p.123")
        for k, t in st.items():
            raw = _raw(t)
            assert _rows(store, v3)[k]["chunks"] == [blake3.blake3(raw[a:a + (256 << 10)]).digest()
                                                     for a in range(0, max(len(raw), 1), 256 << 10)], k


def test_sync_save_writes_a_chunk_evicted_after_the_workers_found_it(tmp_path: Path, monkeypatch: Any) -> None:
    # With a hot tier the writer confirms what the workers found; a chunk gone since is copied from the caller's
    # tensor then and written again, so the version is whole.
    from datastates.objects.object_store import ObjectStore

    st = _state()
    small = {k: t for k, t in st.items() if k not in ("big", "empty")}
    with ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", chunk_size=256 << 10) as store:
        store.save(st)
        real = ObjectStore.dedup

        def dedup(self: Any, pins: Any, cids: list[bytes]) -> list[bool]:
            found = real(self, pins, cids)
            return [False] * len(cids) if pins is not None else found  # the writer's confirmation fails

        monkeypatch.setattr(ObjectStore, "dedup", dedup)
        copied = _count_filled(monkeypatch)
        v2 = store.save(st)
        monkeypatch.undo()
        # Every small tensor written again (each distinct chunk once), copied into a slot by the writer.
        distinct = {_raw(t) for t in small.values()}
        assert v2.bytes_new >= sum(len(b) for b in distinct)
        assert sum(copied) >= sum(len(b) for b in distinct)
        got = store.load(v2)
        assert all(_raw(got[k]) == _raw(t) for k, t in st.items())


def test_a_sync_save_hands_on_a_bounded_stretch_of_slots_read_in_place(tmp_path: Path, monkeypatch: Any) -> None:
    # Slots read in place cost the caller nothing to hand on: without a bound one save would take every pool
    # slot at once. With 2 MiB allowed ahead and 1 MiB slots the pool never grows past 3 slots, however big it
    # may grow, and the bytes are all there.
    from datastates.save import capture

    monkeypatch.setattr(capture, "_IN_PLACE_AHEAD", 2 << 20)
    g = torch.Generator().manual_seed(4)
    st = {f"t{i:03d}": torch.randn(16 * 1024, generator=g) for i in range(320)}  # 320 x 64 KiB = 20 MiB
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10, pool_bytes=64 << 20) as store:
        v = store.save(st)
        assert store.pool.slot_bytes == 1 << 20
        assert 1 << 20 <= store.pool.allocated_bytes <= 3 << 20
        assert v.bytes_new == 20 << 20
        got = store.load(v)
        assert all(torch.equal(got[k], t) for k, t in st.items())


def test_sync_save_reads_the_chunks_of_a_mid_sized_tensor_in_place(tmp_path: Path, monkeypatch: Any) -> None:
    # Under 1 MiB but over the chunk size: its chunks are slices of the caller's tensor, each a piece read in
    # place. A change inside one chunk copies and writes that chunk only: the other chunks' summaries are known
    # from the last save (`KnownStats.pieces`), and nothing of the unchanged `tail` is copied.
    g = torch.Generator().manual_seed(5)
    st = {"mid": torch.randn(180_000, generator=g), "tail": torch.randn(1000, generator=g)}  # 720,000 bytes
    copied = _count_filled(monkeypatch)
    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10) as store:
        store.save(st)
        assert sum(copied) == 720_000 + 4000
        copied.clear()
        st["mid"][70_000] += 1  # byte 280,000: the second chunk
        v2 = store.save(st)
        assert sum(copied) == 256 << 10 and v2.bytes_new == 256 << 10 and v2.chunks_new == 1
        raw = _raw(st["mid"])
        assert _rows(store, v2)["mid"]["chunks"] == [blake3.blake3(raw[a:a + (256 << 10)]).digest()
                                                     for a in range(0, len(raw), 256 << 10)]
        assert torch.equal(store.load(v2)["mid"], st["mid"])


def test_a_failed_save_gives_a_slot_back_only_once_its_worker_is_done_with_it(
        tmp_path: Path, monkeypatch: Any) -> None:
    # A worker copies into a slot read in place (`Slot.fill`). When the save fails while workers still hash its
    # later slots, those slots go back to the pool only once their workers are done: a slot given back sooner
    # could be handed to the next save and then overwritten under it.
    import threading

    import datastates.save.capture as capture_mod
    import datastates.save.pipeline as pipeline_mod
    from datastates.objects.packs import PackWriter
    from datastates.save.buffers import BufferPool

    g = torch.Generator().manual_seed(6)
    first = {"a": torch.randn(1000, generator=g)}
    st = {f"t{i:02d}": torch.randn(16 * 1024, generator=g) for i in range(48)}  # 3 MiB: three 1 MiB slots
    hold_commit, in_commit = threading.Event(), threading.Event()
    captured, released = threading.Event(), threading.Event()
    hashing: set[int] = set()
    hashed: set[int] = set()
    order: list[bool] = []  # per slot given back after its hashing began: had the hashing ended?

    import datastates.store as store_mod

    real_commit, real_capture, real_hash = store_mod.make_visible, capture_mod.capture, pipeline_mod._hash_slot
    real_release = BufferPool.release

    def commit(job: Any, **kw: Any) -> Any:
        in_commit.set()  # the first save's chunks are written
        hold_commit.wait(timeout=60)  # keeps the pipeline on the first save while the second is captured
        return real_commit(job, **kw)

    def capture(job: Any, *a: Any, **k: Any) -> None:
        real_capture(job, *a, **k)
        if k.get("borrow"):
            captured.set()

    def hash_slot(slot: Any, *a: Any, **k: Any) -> Any:
        hashing.add(id(slot))
        try:
            if slot.in_place is not None and slot.pieces[0].row >= 16:  # the second and third slots
                released.wait(timeout=2)  # set by a give-back that did not wait for us
            return real_hash(slot, *a, **k)
        finally:
            hashed.add(id(slot))

    def release(self: BufferPool, slot: Any) -> None:
        if id(slot) in hashing:
            order.append(id(slot) in hashed)
            released.set()
        real_release(self, slot)

    def add_run(self: PackWriter, *a: Any, **k: Any) -> Any:
        raise OSError(28, "No space left on device")

    with ds.Store.open(tmp_path / "s", chunk_size=256 << 10, pool_bytes=16 << 20) as store:
        monkeypatch.setattr(store_mod, "make_visible", commit)
        monkeypatch.setattr("datastates.save.saver.capture", capture)
        monkeypatch.setattr(pipeline_mod, "_hash_slot", hash_slot)
        monkeypatch.setattr(BufferPool, "release", release)
        h1 = store.save_async(first)
        errors: list[BaseException] = []

        def sync_save() -> None:
            try:
                store.save(st)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=sync_save)
        t.start()
        assert in_commit.wait(timeout=60) and captured.wait(timeout=60)  # three slots queued, not yet taken
        monkeypatch.setattr(PackWriter, "add_run", add_run)
        hold_commit.set()
        t.join(timeout=120)
        v1 = h1.result(timeout=60)
        monkeypatch.undo()
        assert len(errors) == 1 and isinstance(errors[0], ds.DataStatesError)
        assert order and all(order)  # every slot a worker had begun was given back after it finished
        assert torch.equal(store.load(v1)["a"], first["a"])
        store.wait()  # the sync save raised it: not raised again
        v3 = store.save(st)  # and the store goes on
        got = store.load(v3)
        assert all(torch.equal(got[k], t) for k, t in st.items())


@pytest.mark.parametrize("nbytes", [1 << 20, 3 * (1 << 20) + 12_345])
def test_a_pageable_slot_is_page_aligned_and_its_exact_size(nbytes: int) -> None:
    """Packs write slots with O_DIRECT: every slot's data starts on a 4096-byte boundary, whatever malloc gave."""
    from datastates.save.buffers import BufferPool

    pool = BufferPool(4 * nbytes, nbytes)
    slots = [pool.acquire()[0] for _ in range(3)]
    for slot in slots:
        assert not slot.buf.is_pinned()
        assert len(slot.buf) == nbytes and slot.buf.data_ptr() % 4096 == 0
    assert len({slot.buf.data_ptr() for slot in slots}) == 3 and pool.allocated_bytes == 3 * nbytes
    for slot in slots:
        pool.release(slot)
