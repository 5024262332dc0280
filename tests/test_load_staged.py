"""The staged read of a load onto an accelerator (`reader._read_rows_onto`): chunks read into two reused host
buffers in turns and copied on. Run here with the host as the destination and buffers smaller than the state,
so that grouping, the turns and the split of a tensor bigger than a buffer run without a GPU (tests/test_cuda.py
runs the same through `load(device="cuda")`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import datastates as ds
from datastates.errors import IntegrityError
from datastates.repo import reader

KiB = 1 << 10


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(5000, generator=g)
    return {
        "big": torch.randn(40 * KiB, generator=g),  # 160 KiB: five 32 KiB chunks, over two 64 KiB buffers' worth
        "odd": torch.randn(9 * KiB + 3, generator=g),  # 36 KiB + 12 bytes: two chunks, the second short
        "small": [torch.randn(n, generator=g) for n in (1, 7, 100, 4 * KiB)],
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "i64": torch.arange(-50, 50, dtype=torch.int64),
        "flag": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "tied": base, "tied_again": base, "view": base[10:20],
    }


def _rows(s: ds.Store, v: ds.Version) -> tuple[Any, list[int], dict[str, Any]]:
    m = s.repo.manifest_of(v)
    cols = m.load_columns()
    return m, [i for i, k in enumerate(cols["kind"]) if k in ("tensor", "storage")], cols


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("stage", [32 * KiB, 64 * KiB + 8, 1 << 20])
def test_staged_rows_are_the_bytes_of_the_host_read(tmp_path: Path, stage: int) -> None:
    with ds.Store.open(tmp_path / "s", chunk_size=32 * KiB) as s:
        v = s.save(_state())
        m, rows, cols = _rows(s, v)
        want = reader._read_rows(s.repo, m, rows, None, cols)
        got = reader._read_rows_onto(s.repo, m, rows, None, cols, torch.device("cpu"), stage_bytes=stage)
    assert sorted(got) == sorted(want) and len(rows) == 12
    for i in rows:
        assert (got[i].dtype, got[i].shape) == (want[i].dtype, want[i].shape), cols["key"][i]
        assert _bytes(got[i]) == _bytes(want[i]), cols["key"][i]


def _flip_a_byte(s: ds.Store, root: Path, cid: bytes) -> None:
    """Flip one bit of the stored bytes of chunk `cid` in its pack under `root`."""
    loc = s.repo.objects.index.chunks([cid])[0]
    assert loc is not None
    pack = next(p for p in root.rglob("*") if p.is_file() and p.name.startswith(loc.pack))
    with open(pack, "r+b") as f:
        f.seek(loc.offset + 5)
        b = f.read(1)
        f.seek(loc.offset + 5)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_flipped_byte_fails_the_staged_read(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s", chunk_size=32 * KiB) as s:
        v = s.save(_state())
        m, rows, cols = _rows(s, v)
        _flip_a_byte(s, tmp_path / "s", cols["chunks"][rows[0]][2])
        with pytest.raises(IntegrityError):
            reader._read_rows_onto(s.repo, m, rows, None, cols, torch.device("cpu"), stage_bytes=64 * KiB)


def test_checkout_reads_a_module_onto_its_one_accelerator_and_everything_else_onto_the_host() -> None:
    on_meta = torch.nn.Linear(2, 2, device="meta")
    assert reader._module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert reader._module_device(on_meta) == torch.device("cpu")
    assert reader._module_device(torch.nn.ReLU()) == torch.device("cpu")  # no tensors at all
    assert reader._module_device({"step": 1}) == torch.device("cpu")


def test_a_refused_pinned_buffer_becomes_a_pageable_one(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Pinned memory is locked and scarce: when the driver refuses it, a load onto the GPU copies from pageable
    memory (synchronously) instead of failing."""
    real_empty = torch.empty

    def empty(*a: Any, **k: Any) -> torch.Tensor:
        if k.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory\nmore")
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    buf, pinned = reader.host_buffer(4096, True)
    assert (buf.numel(), buf.dtype, pinned) == (4096, torch.uint8, False)
    assert "no pinned host memory for a load onto the GPU (CUDA error: out of memory)" in caplog.text
    buf, pinned = reader.host_buffer(100, False)
    assert (buf.numel(), pinned) == (100, False)


def test_a_row_whose_bytes_do_not_fit_its_shape_is_refused_by_both_reads(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s", chunk_size=32 * KiB) as s:
        v = s.save(_state())
        m, rows, cols = _rows(s, v)
        bad = {**cols, "nbytes": list(cols["nbytes"])}
        i = cols["key"].index("odd")
        bad["nbytes"][i] += 4
        for read in (lambda: reader._read_rows(s.repo, m, rows, None, bad),
                     lambda: reader._read_rows_onto(s.repo, m, rows, None, bad, torch.device("cpu"))):
            with pytest.raises(IntegrityError, match=r"tensor 'odd' in manifest .*: 36880 bytes stored for dtype "
                                                     r"float32 shape \[9219\]; run `datastates fsck`"):
                read()


MiB = 1 << 20


def _turns_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    state = {"big": torch.randn(6 * MiB, generator=g)}  # 24 MiB: split over several 10 MiB turns
    state.update({f"mid{i}": torch.randn(3 * MiB // 4 + i, generator=g) for i in range(3)})
    state.update({f"s{i:02d}": torch.randn(64 * KiB, generator=g) for i in range(40)})  # 256 KiB each
    return state


def test_the_next_turn_is_read_while_the_last_ones_checks_run_and_every_byte_arrives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns over 8 MiB go to the executor for their checks: the next turn's read starts before the previous
    turn's checks are waited on (finish), and each turn is finished, in order, before its bytes are copied on."""
    from concurrent.futures import ThreadPoolExecutor

    from datastates.objects.object_store import ObjectStore

    events: list[str] = []
    asked: list[int] = []  # per turn, the read streams it asked for
    real = ObjectStore.start_read_many

    def start(self: ObjectStore, items: Any, executor: Any = None, *, streams: int = 1) -> Any:
        n = sum(1 for e in events if e.startswith("start"))
        events.append(f"start{n}")
        asked.append(streams)
        pending = real(self, items, executor, streams=streams)
        finish = pending.finish

        class Logged:
            def finish(self) -> None:
                finish()
                events.append(f"finish{n}")

        return Logged()

    with ds.Store.open(tmp_path / "s", chunk_size=MiB) as s, ThreadPoolExecutor(2) as pool:
        v = s.save(_turns_state())
        m, rows, cols = _rows(s, v)
        want = reader._read_rows(s.repo, m, rows, None, cols)
        monkeypatch.setattr(ObjectStore, "start_read_many", start)
        got = reader._read_rows_onto(s.repo, m, rows, pool, cols, torch.device("cpu"), stage_bytes=10 * MiB)
    turns = sum(1 for e in events if e.startswith("start"))
    assert turns == 5  # `big` in pieces of 10, 10 and 4 MiB, then 19 MiB of the rest in turns of at most 10 MiB
    assert asked == [2] * turns  # each turn in two read streams, as a load onto the host
    assert events == ["start0"] + [e for k in range(1, turns) for e in (f"start{k}", f"finish{k - 1}")] + [
        f"finish{turns - 1}"]
    assert sorted(got) == sorted(want) and len(rows) == 44
    for i in rows:
        assert _bytes(got[i]) == _bytes(want[i]), cols["key"][i]


def test_a_flipped_byte_in_a_later_turn_fails_the_overlapped_read(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ds.Store.open(tmp_path / "s", chunk_size=MiB) as s, ThreadPoolExecutor(2) as pool:
        v = s.save(_turns_state())
        m, rows, cols = _rows(s, v)
        i = cols["key"].index("mid2")  # in the fourth turn (10 MiB: checked on the executor), the fifth read after it
        _flip_a_byte(s, tmp_path / "s", cols["chunks"][i][1])
        with pytest.raises(IntegrityError, match="mid2"):
            reader._read_rows_onto(s.repo, m, rows, pool, cols, torch.device("cpu"), stage_bytes=10 * MiB)
