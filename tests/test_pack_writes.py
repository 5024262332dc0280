"""Pack writes: reused bounce buffers, and the pipeline hashing ahead of the writer (issue 13)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import torch

import datastates as ds
from datastates.base import files
from datastates.objects import packs
from datastates.objects.chunks import CODEC_RAW
from datastates.objects.packs import PackReader, PackWriter, read_index
from datastates.save import pipeline

WAIT = 60.0


def _direct_or_skip(w: PackWriter) -> None:
    if not w.direct:
        w.abort()
        pytest.skip("this file system refuses O_DIRECT: no bounce buffer is used")


def test_a_sealed_pack_hands_its_bounce_buffer_to_the_next_pack(tmp_path: Path) -> None:
    first = PackWriter(tmp_path)
    _direct_or_skip(first)
    buf = first._bounce
    assert buf is not None
    a = b"a" * 5000
    first.add(blake3.blake3(a).digest(), a, len(a), CODEC_RAW)
    first.seal()
    assert first._bounce is None  # given back with the seal
    second = PackWriter(tmp_path)
    third = PackWriter(tmp_path)  # open at the same time as second: never the same buffer
    assert second._bounce is buf
    assert third._bounce is not buf
    b = b"b" * 3000
    second.add(blake3.blake3(b).digest(), b, len(b), CODEC_RAW)
    second.seal()
    third.abort()
    # the reused buffer held a's bytes: b's pack holds b, and zeros (not a's leftovers) in its padding
    reader = PackReader(tmp_path)
    (cid, loc), = read_index(second.path)
    assert cid == blake3.blake3(b).digest() and reader.read(loc) == b
    raw = second.path.read_bytes()
    assert raw[8:8 + 3000] == b and len(raw) == 8 + 3000 + 57 + 40  # header, b, one index entry, footer
    reader.close()
    assert not list(tmp_path.glob("*.tmp"))


def test_an_aborted_pack_gives_its_bounce_buffer_back_once(tmp_path: Path) -> None:
    w = PackWriter(tmp_path)
    _direct_or_skip(w)
    buf = w._bounce
    w.abort()
    w.abort()  # a second abort (the pipeline aborts every pack of a failed job) changes nothing
    assert sum(x is buf for x in files._spare) == 1
    nxt = PackWriter(tmp_path)
    assert nxt._bounce is buf
    nxt.abort()
    assert not list(tmp_path.iterdir())


def test_spare_buffers_are_bounded(tmp_path: Path) -> None:
    writers = [PackWriter(tmp_path) for _ in range(files._SPARES + 3)]
    _direct_or_skip(writers[0])
    for w in writers:
        w.abort()
    assert len(files._spare) == files._SPARES


def test_the_workers_hash_ahead_while_the_writer_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the writer held on the first slot, the workers go on hashing every later slot within the window's
    bytes (one slot ahead made a save run at one hashing core's speed); the version is then whole. The 4 MiB
    tensor, read in place, is one slot per chunk, so its chunks spread over the workers."""
    chunk = 1 << 20
    state = {f"t{i}": torch.full((chunk // 4,), float(i)) for i in range(2)}
    state["big"] = torch.arange(chunk, dtype=torch.float32)  # 4 chunks
    pieces: list[int] = []
    hashed: list[int] = []
    two_ahead = threading.Event()
    release = threading.Event()
    orig_hash, orig_emit = pipeline._hash_slot, pipeline.Pipeline._emit

    def hash_slot(slot: Any, *a: Any, **k: Any) -> Any:
        out = orig_hash(slot, *a, **k)
        pieces.append(len(slot.pieces))
        hashed.append(1)
        if len(hashed) == 6:
            two_ahead.set()
        return out

    # `_emit` writes every slot, whether after `_write` or among the last slots handed to one worker once all
    # are hashed (`_emit_all`): which path a slot takes depends on how fast the hashing went.
    def emit(self: Any, job: Any, slot: Any, todo: Any) -> None:
        if not release.is_set():
            assert two_ahead.wait(WAIT), "the later slots were not hashed while the first was being written"
            release.set()
        orig_emit(self, job, slot, todo)

    monkeypatch.setattr(pipeline, "_hash_slot", hash_slot)
    monkeypatch.setattr(pipeline.Pipeline, "_emit", emit)
    with ds.Store.open(tmp_path / "s", chunk_size=chunk, workers=2) as s:
        v = s.save(state)
        assert release.is_set()
        assert pieces == [1] * 6  # one slot per chunk of the tensors read in place
        back = s.load(v)
        rows = {r["key"]: r for r in s.manifest(v.manifests["0"]).rows}
        assert len(rows["big"]["chunks"]) == 4
    for k, t in state.items():
        assert torch.equal(back[k], t)
    assert np.array_equal(back["big"].numpy(), np.arange(chunk, dtype=np.float32))


@pytest.mark.parametrize("tiered", [False, True])
def test_the_writer_asks_the_catalog_only_about_chunks_the_workers_found(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiered: bool) -> None:
    # With a hot tier the hashing workers look every chunk up, and the pipeline thread confirms (and pins) the
    # ones found, since eviction may take a chunk meanwhile. Without tiers nothing can: the writer asks nothing,
    # and the workers ask only about chunks that are not what the store last committed under the same key.
    from datastates.objects.object_store import ObjectStore

    asked: list[tuple[str, int, bool]] = []
    real = ObjectStore.dedup

    def dedup(self: Any, pins: Any, cids: list[bytes]) -> list[bool]:
        asked.append((threading.current_thread().name, len(cids), pins is not None))
        return real(self, pins, cids)

    monkeypatch.setattr(ObjectStore, "dedup", dedup)
    g = torch.Generator().manual_seed(3)
    st = {f"t{i:03d}": torch.randn(1024, generator=g) for i in range(300)}
    opened = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot") if tiered else ds.Store.open(tmp_path / "s")
    with opened as store:
        v1 = store.save(st)
        writer = [n for name, n, _ in asked if name == "datastates-pipeline"]
        workers = sum(n for name, n, _ in asked if name.startswith("datastates-hash"))
        assert (sum(writer), workers) == (0, 300)  # all new: no lookup on the writer's thread
        asked.clear()
        st["t007"].add_(1)
        v2 = store.save(st)
        writer_calls = [(n, pinned) for name, n, pinned in asked if name == "datastates-pipeline"]
        workers = sum(n for name, n, _ in asked if name.startswith("datastates-hash"))
        assert workers == (300 if tiered else 1)
        assert sum(n for n, _ in writer_calls) == (299 if tiered else 0)  # the unchanged
        assert all(pinned for _, pinned in writer_calls)  # with the job: its packs pinned
        assert store.version(v2).bytes_new == 4096
        back = store.load(v2)
    assert all(torch.equal(back[k], st[k]) for k in st)
    assert v1.id != v2.id


def _spy_direct(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths `files._write_direct` was called with (files written around the page cache)."""
    calls: list[int] = []
    real = files._write_direct

    def spy(fd: int, view: memoryview) -> None:
        calls.append(len(view))
        real(fd, view)

    monkeypatch.setattr(files, "_write_direct", spy)
    return calls


def _o_direct_here(path: Path) -> bool:
    probe = path / ".probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


@pytest.mark.parametrize("n", [files.DIRECT_FROM - 1, files.DIRECT_FROM, files.DIRECT_FROM + 1,
                               2 * files.BOUNCE + 4095])
def test_a_big_new_file_written_around_the_page_cache_holds_exactly_its_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """`write_new(direct=True)`: from `DIRECT_FROM` bytes on, through the bounce buffer, its last piece padded and
    cut off again; the file holds exactly the bytes given, nothing temporary is left, the spares stay bounded,
    and a second write of the same name changes nothing."""
    calls = _spy_direct(monkeypatch)
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    target = tmp_path / "m" / "x.arrow"
    assert files.write_new(target, data, direct=True) is True
    assert target.read_bytes() == data and target.stat().st_size == n
    assert calls == ([n] if n >= files.DIRECT_FROM and _o_direct_here(tmp_path) else [])
    assert files.write_new(target, b"other", direct=True) is False
    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["x.arrow"]
    assert len(files._spare) <= files._SPARES


def test_a_save_of_many_tensors_writes_its_manifest_around_the_page_cache_and_loads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest of 1,500 rows (over `DIRECT_FROM`) goes through the O_DIRECT path where the file system has
    one, and every tensor loads back from it, in this process and in a freshly opened store."""
    calls = _spy_direct(monkeypatch)
    g = torch.Generator().manual_seed(5)
    st = {f"layer.{i:04d}.w": torch.randn(16, generator=g) for i in range(1500)}
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(st, branch="main")
        back = store.load(v)
    direct = _o_direct_here(tmp_path)
    manifests = [p for p in (tmp_path / "s").rglob("*.arrow")]
    assert len(manifests) == 1 and manifests[0].stat().st_size >= files.DIRECT_FROM
    assert calls == ([manifests[0].stat().st_size] if direct else [])
    assert all(torch.equal(back[k], st[k]) for k in st)
    with ds.Store.open(tmp_path / "s") as store:
        again = store.load("main")
    assert all(torch.equal(again[k], st[k]) for k in st)


@pytest.mark.parametrize("zstd", [0, 3])
def test_the_manifest_encoded_beside_the_last_writes_is_the_one_of_the_finished_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zstd: int) -> None:
    """A `save_async` queues all its slots before the pipeline starts, so once the slots left are hashed their
    results are taken together, a hashing worker writes them and the pipeline thread encodes the manifest
    meanwhile. Its bytes are those of an encoding of the rows after the commit; a tensor repeated in two slots is
    written once; every tensor loads back, compressed or not."""
    from datastates.save import manifest as mf

    made: list[tuple[str, Any, tuple[str, memoryview]]] = []
    emitted: list[str] = []
    real = pipeline.encode
    real_emit_all = pipeline.Pipeline._emit_all

    def emit_all(self: Any, job: Any, slots: Any, handoff: Any) -> None:
        emitted.append(threading.current_thread().name)
        real_emit_all(self, job, slots, handoff)

    def spy(tree: Any, entries: Any, chunk_size: int, kept: Any) -> tuple[str, memoryview]:
        out = real(tree, entries, chunk_size, kept)
        made.append((threading.current_thread().name, (tree, entries), out))
        return out

    monkeypatch.setattr(pipeline, "encode", spy)
    monkeypatch.setattr(pipeline.Pipeline, "_emit_all", emit_all)
    g = torch.Generator().manual_seed(11)
    st: dict[str, torch.Tensor] = {"big": torch.randn(3 << 18, generator=g)}  # 3 MiB: three chunks
    st.update({f"s{i:02d}": torch.randn(40_000, generator=g) for i in range(40)})  # ~6 MiB of small ones
    st["s39"] = st["s01"].clone()  # the same bytes as a tensor in an earlier slot
    st["zeros"] = torch.zeros(200_000)  # compresses
    st["steps"] = torch.arange(1000, dtype=torch.int64)
    with ds.Store.open(tmp_path / "s", chunk_size=1 << 20, pool_bytes=32 << 20, zstd_level=zstd) as store:
        v1 = store.save_async(st, branch="main").result()
        old = {k: st[k].clone() for k in ("s05", "big")}
        for k in old:
            st[k].add_(1)
        v2 = store.save_async(st, branch="main").result()
        backs = [store.load(v1.id), store.load(v2.id)]
        versions = [store.version(v1.id), store.version(v2.id)]
    assert [name for name, _, _ in made] == ["datastates-pipeline"] * 2
    assert [name.startswith("datastates-hash") for name in emitted] == [True, True]
    for (_, (tree, entries), (mid, data)), v in zip(made, versions):
        assert mf.encode(tree, entries, 1 << 20) == (mid, data)  # the finished rows, from scratch
        assert (tmp_path / "s" / "manifests" / mid[:2] / f"{mid}.arrow").read_bytes() == bytes(data)
        assert v.manifests == {"0": mid}
    # s01 and s39 share one chunk: 3 + 40 + 1 + 1 chunks named, 44 distinct
    assert versions[0].chunks_new == 44
    assert versions[1].chunks_new == 4  # big's three chunks and s05
    assert all(torch.equal(backs[1][k], st[k]) for k in st)
    assert all(torch.equal(backs[0][k], t) for k, t in old.items())


@pytest.mark.parametrize("queued", [False, True])
def test_the_last_slots_go_back_to_the_pool_when_their_writer_cannot_be_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, queued: bool) -> None:
    """The slots left once all are hashed leave the window together for one worker to write. If `submit` raises,
    before queuing the call or after (`ThreadPoolExecutor.submit` queues it, then starting a thread may raise, and
    the call runs anyway), the save fails with that error, every slot is back in the pool exactly once, nothing of
    the failed save is committed, and the next save uses the same slots."""
    with ds.Store.open(tmp_path / "s", chunk_size=1 << 20, pool_bytes=8 << 20) as store:
        pipe = store._saver.pipeline
        real_submit = pipe._workers.submit
        refused: list[int] = []

        def submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(fn, "__name__", "") == "_emit_all":
                refused.append(len(args[1]))
                if queued:  # the call is queued and its worker has claimed the slots when submit raises
                    real_submit(fn, *args, **kwargs)
                    getattr(args[2], "started", args[2]).wait()  # (an Event itself before the handoff)
                raise RuntimeError("no worker for the last writes")
            return real_submit(fn, *args, **kwargs)

        monkeypatch.setattr(pipe._workers, "submit", submit)
        g = torch.Generator().manual_seed(3)
        st = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(6)}  # 6 MiB: six slots of 1 MiB
        with pytest.raises(ds.errors.SaveFailedError, match="no worker for the last writes"):
            store.save_async(st, branch="main").result()
        pool = pipe.pool
        assert refused and refused[0] >= 1
        # every slot back, once: a slot released twice would be handed to two captures at the same time
        assert len(pool._free) == pool._allocated == len({id(b) for b in pool._free})
        with pytest.raises(ds.errors.NotFoundError):
            store.log("main")  # nothing committed
        store.wait()  # result() raised it: not raised again (the next save would be lost)
        monkeypatch.undo()
        v = store.save_async(st, branch="main").result()
        assert len(pool._free) == pool._allocated == len({id(b) for b in pool._free})
        back = store.load(v.id)
    assert all(torch.equal(back[k], st[k]) for k in st)
    assert not list((tmp_path / "s").rglob("*.tmp"))  # the failed save's pack is gone


def test_a_finished_job_is_freed_before_the_next_one_arrives(tmp_path: Path) -> None:
    """The pipeline lets go of a job once it is done, not when the next save's job replaces it (freeing a full
    save's job of 8,000 rows took 1-4 ms at the start of the next save); and nothing holds the job in a cycle, so
    it goes with the collector off."""
    import gc
    import time
    import weakref

    jobs: list[weakref.ref[Any]] = []
    with ds.Store.open(tmp_path / "s") as store:
        pipe = store._saver.pipeline
        real = pipe._commit

        def commit(job: Any) -> Any:
            jobs.append(weakref.ref(job))
            return real(job)

        pipe._commit = commit
        st = {f"t{i}": torch.randn(256) for i in range(50)}
        was = gc.isenabled()
        gc.disable()
        try:
            v = store.save_async(st, branch="main").result()
            deadline = time.monotonic() + 30  # a bound on a hang, not a timing claim: it waits for the event
            while jobs[0]() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert jobs[0]() is None
        finally:
            if was:
                gc.enable()
        assert all(torch.equal(store.load(v.id)[k], st[k]) for k in st)


def test_big_chunks_at_any_address_are_written_from_their_memory_and_read_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big chunk whose memory is not 4096-aligned (torch aligns to 64) lands at a pack offset congruent to its
    address, and its aligned middle is written from its own memory in one write; small chunks between big ones,
    and sizes that are not whole blocks, included. Every chunk reads back as written, and the pack's padding is
    zeros."""
    w = PackWriter(tmp_path)
    _direct_or_skip(w)
    calls: list[list[tuple[int, int]]] = []  # (address, length) of each part, per write request
    real = PackWriter._raw_write

    def spy(self: PackWriter, *parts: Any) -> None:
        calls.append([(packs._address(memoryview(p).cast("B")), len(memoryview(p).cast("B"))) for p in parts])
        real(self, *parts)

    monkeypatch.setattr(PackWriter, "_raw_write", spy)
    rng = np.random.default_rng(4)
    block = files.aligned_empty(8 << 20)
    block[:] = rng.integers(0, 256, block.size, dtype=np.uint8)
    big = 256 << 10
    cases = [(64, big), (0, big + 100), (4032, (1 << 20) + 4095), (128, big), (0, 1 << 20), (4095, big + 1)]
    written: list[tuple[bytes, bytes, Any]] = []
    pos = 0
    for i, (skew, n) in enumerate(cases):
        pos = -(-pos // 4096) * 4096 + skew
        data = block[pos:pos + n]
        pos += n
        cid = blake3.blake3(data.data).digest()
        loc = w.add(cid, data.data, n, CODEC_RAW)
        written.append((cid, data.tobytes(), loc))
        assert loc.offset % 4096 == skew
        small = bytes([i]) * (100 + i)
        scid = blake3.blake3(small).digest()
        written.append((scid, small, w.add(scid, small, len(small), CODEC_RAW)))
    before_seal = len(calls)
    w.seal()
    writes = [part for call in calls for part in call]
    for skew, n in cases:  # the middle of each big chunk: written from its own (now aligned) address
        head = (4096 - skew) % 4096
        assert ((n - head) // 4096 * 4096) in [length for _, length in writes]
    assert all(addr % 4096 == 0 and length % 4096 == 0 for addr, length in writes)
    # A small chunk sits in the bounce buffer before every big one: it goes out in the same request as the big
    # chunk's middle (the header, pads and head ahead of it too), never in a request of its own.
    assert [len(call) for call in calls[:before_seal]] == [2] * len(cases)
    assert all(call[0][1] < (64 << 10) <= call[1][1] for call in calls[:before_seal])
    assert len(calls) == before_seal + 1  # the seal: the last small chunk, the index and the footer
    reader = PackReader(tmp_path)
    assert [reader.read(loc) for _, _, loc in written] == [raw for _, raw, _ in written]
    assert {cid: loc.offset for cid, loc in read_index(w.path)} == {cid: loc.offset for cid, _, loc in written}
    raw = w.path.read_bytes()
    spans = sorted((loc.offset, loc.offset + loc.length) for _, _, loc in written)
    gaps = [raw[a:b] for (_, a), (b, _) in zip(spans, spans[1:]) if b > a]
    assert gaps and all(g == bytes(len(g)) for g in gaps)  # padding before the big chunks: zeros
    reader.close()


def test_the_bounce_buffer_is_flushed_each_time_it_fills_and_padded_with_zeros_to_a_block() -> None:
    """`fill_bounce` (packs and big manifests both write through it) hands out every byte in order, one flush
    per full buffer, and keeps the rest; `pad_bounce` zeroes up to the next `ALIGN` boundary."""
    bounce = memoryview(bytearray(3 * files.ALIGN))
    out: list[bytes] = []
    data = bytes(range(256)) * 70  # 17,920 bytes: one buffer is 12,288
    held = files.fill_bounce(bounce, 0, memoryview(data[:5000]), lambda: out.append(bytes(bounce)))
    assert (held, out) == (5000, [])
    held = files.fill_bounce(bounce, held, memoryview(data[5000:]), lambda: out.append(bytes(bounce)))
    assert held == len(data) - len(bounce) and out == [data[:len(bounce)]]
    bounce[held:] = b"\xff" * (len(bounce) - held)  # stale bytes past what it holds
    padded = files.pad_bounce(bounce, held)
    assert padded == 2 * files.ALIGN
    assert bytes(bounce[:padded]) == data[len(bounce):] + bytes(padded - held)


def test_writev_all_finishes_a_short_vectored_write_piece_by_piece(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`writev_all` writes every part in order with one request when the kernel takes them all, and goes on
    from where a short `writev` stopped (in the middle of a part) when it does not. Parts of another format
    (float32) are counted in bytes, as `writev` counts."""
    parts = [memoryview(bytes([i]) * n) for i, n in enumerate((5000, 3, 70_000, 1))]
    parts[2] = parts[2].cast("f")  # 17,500 items of 70,000 bytes
    want = b"".join(bytes(p) for p in parts)
    real = os.writev
    requests: list[int] = []

    def short(fd: int, bufs: list[memoryview]) -> int:
        requests.append(len(bufs))
        return os.write(fd, b"".join(bytes(b) for b in bufs)[:5001])  # the first part and one byte more

    for patched, expect in ((False, [4]), (True, [4])):
        path = tmp_path / f"f{patched}"
        requests.clear()
        monkeypatch.setattr(files.os, "writev", short if patched else
                            lambda fd, bufs: (requests.append(len(bufs)), real(fd, bufs))[1])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            assert files.writev_all(fd, parts) == len(want)
        finally:
            os.close(fd)
        assert path.read_bytes() == want and requests == expect
