"""`Store.reserve`: the staging slots a `save_async` of a state takes, made ahead in the background, so that
the first save only copies. Asserts slot counts, bytes and error types (tests/test_cuda.py covers the pinned
pool's slot sizes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.counting import count_slots

import datastates.save.buffers as buffers
from datastates.errors import StoreClosedError, UnsupportedValueError
from datastates.store import Store

MiB = 1 << 20


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {f"big{i}": torch.randn(MiB // 2 + 7 * i, generator=g) for i in range(3)}  # 2 MiB each
    state.update({f"small{i:02d}": torch.randn(1000 + i, generator=g) for i in range(40)})
    state["tied"] = state["big0"]  # one storage, saved once
    state["step"] = torch.tensor(12, dtype=torch.int64)
    state["lr"] = 0.1
    return state


def test_reserve_makes_every_slot_the_first_save_async_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = count_slots(monkeypatch)
    state = _state()
    with Store.open(tmp_path / "a", chunk_size=MiB) as plain:
        plain.save_async(state).result()
        without = len(made)
    assert without > 1  # the control: a first save_async allocates its slots as it copies
    made.clear()
    with Store.open(tmp_path / "b", chunk_size=MiB) as s:
        reserved = s.reserve(state).result(timeout=60)
        assert reserved == s.pool.allocated_bytes == len(made) * s.pool.slot_bytes
        assert len(made) == without
        made.clear()
        v = s.save_async(state).result()
        assert made == []  # the save only copied into the reserved slots
        out = s.load(v)
    assert out["lr"] == 0.1 and int(out["step"]) == 12 and out["tied"] is out["big0"]
    for k, t in state.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(out[k], t), k


def test_reserve_stops_at_the_pools_capacity_and_saves_go_on_through_it(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((MiB // 4,), float(i)) for i in range(12)}  # 12 MiB, 1 MiB slots
    with Store.open(tmp_path / "s", chunk_size=MiB, pool_bytes=3 * MiB) as s:
        assert s.reserve(state).result(timeout=60) == 3 * MiB == s.pool.max_slots * s.pool.slot_bytes
        v = s.save_async(state).result()
        assert s.pool.allocated_bytes == 3 * MiB
        out = s.load(v)
    assert all(torch.equal(out[k], t) for k, t in state.items())


def test_reserve_twice_or_after_a_save_makes_nothing_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = count_slots(monkeypatch)
    state = _state()
    with Store.open(tmp_path / "s", chunk_size=MiB) as s:
        first = s.reserve(state).result(timeout=60)
        n = len(made)
        assert s.reserve(state).result(timeout=60) == first and len(made) == n
        s.save_async(state).result()
        assert s.reserve(state).result(timeout=60) == first and len(made) == n


def test_reserve_of_a_state_a_save_refuses_raises_and_allocates_nothing(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", chunk_size=MiB) as s:
        with pytest.raises(UnsupportedValueError, match="allow_pickle"):
            s.reserve({"w": torch.ones(4), "obj": object()})
        assert s.pool.allocated_bytes == 0 and s.catalog.version_count() == 0
        s.close()
        with pytest.raises(StoreClosedError, match="Store.open"):
            s.reserve({"w": torch.ones(4)})


def test_a_failed_allocation_is_raised_by_the_future_and_keeps_the_slots_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = buffers.slot_buffer
    made: list[int] = []

    def third_fails(nbytes: int, pin: bool) -> torch.Tensor:
        if len(made) == 2:
            raise MemoryError("no memory for a third slot")
        made.append(nbytes)
        return real(nbytes, pin)

    state = _state()
    with Store.open(tmp_path / "s", chunk_size=MiB) as s:
        monkeypatch.setattr(buffers, "slot_buffer", third_fails)
        with pytest.raises(MemoryError, match="third slot"):
            s.reserve(state).result(timeout=60)
        assert s.pool.allocated_bytes == 2 * s.pool.slot_bytes  # the failed one is not counted
        monkeypatch.setattr(buffers, "slot_buffer", real)
        out = s.load(s.save_async(state).result())
        assert s.catalog.version_count() == 1
    assert torch.equal(out["big2"], state["big2"])


def _resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(pages in memory, pages) of the page-aligned range at `address`, from mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), pages


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="mincore(2) on Linux")
def test_reserved_pageable_slots_are_in_memory_before_the_first_save(tmp_path: Path) -> None:
    """Pageable memory is only address space until written; a reserved slot's pages are touched already, so the
    first save's copy does not fault them in."""
    state = {f"t{i}": torch.ones(MiB // 4) for i in range(6)}  # 6 MiB, 1 MiB slots
    with Store.open(tmp_path / "s", chunk_size=MiB) as s:
        assert not s.pool.pin or torch.cuda.is_available()
        s.reserve(state).result(timeout=60)
        slots = [s.pool.acquire()[0] for _ in range(s.pool.allocated_bytes // s.pool.slot_bytes)]
        try:
            for slot in slots:
                resident, pages = _resident_pages(slot.buf.data_ptr(), len(slot.buf))
                assert resident == pages
        finally:
            for slot in slots:
                s.pool.release(slot)
