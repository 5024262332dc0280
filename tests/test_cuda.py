"""Saving and loading CUDA tensors: the pinned pool, side-stream copies, backpressure over a pool smaller than the
state, the synchronous, reuse and lazy paths, and loads onto the GPU. Every test asserts bytes, counts or
devices; all skip on a machine without CUDA (CI has none)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.counting import count_slots
from torch import nn

from datastates.store import Store

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 1 << 20
WAIT = 120.0


@contextlib.contextmanager
def _store(path: Path, **kw: Any) -> Iterator[Store]:
    kw.setdefault("chunk_size", MiB)
    s = Store.open(path, **kw)
    try:
        yield s
    finally:
        s.close(raise_errors=False)


def _bits(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy().tobytes()


def _host(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: _bits(v) for k, v in state.items()}


def _gpu_state(seed: int) -> dict[str, torch.Tensor]:
    """Every dtype family, sizes below, at and across the 1 MiB chunk, a non-contiguous tensor, an empty one, a
    scalar, and two keys of one tensor (tied weights)."""
    g = torch.Generator().manual_seed(seed)
    tied = torch.randn(300, 257, generator=g)
    cpu = {
        "f32": torch.randn(3 * MiB // 4 + 7, generator=g),  # 3 MiB + 28 bytes: three chunks and a tail
        "f64": torch.randn(129, 33, generator=g, dtype=torch.float64),
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "f16": torch.randn(64, 64, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (5000,), generator=g, dtype=torch.int64),
        "u8": torch.randint(0, 255, (MiB,), generator=g, dtype=torch.uint8),  # exactly one chunk
        "flag": torch.rand(333, generator=g) > 0.5,
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "emb": tied,
        "head": tied,
    }
    out = {k: v.cuda() for k, v in cpu.items() if k != "head"}
    out["head"] = out["emb"]
    out["t"] = torch.randn(96, 64, generator=g).cuda().t()  # non-contiguous
    return out


def _trained(seed: int, norm: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A small CUDA model with `norm` between two layers, and its AdamW after one step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), norm, nn.Linear(512, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(32, 256, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()
    return model, opt, x


def test_the_pool_is_pinned(tmp_path: Path) -> None:
    with _store(tmp_path / "s", pool_bytes=4 * MiB) as s:
        assert s.pool.pin
        slot, _ = s.pool.acquire()
        try:
            assert slot.buf.is_pinned()
        finally:
            s.pool.release(slot)


def test_a_pinned_slot_pins_its_own_bytes_not_the_next_power_of_two() -> None:
    """torch's pinned allocator rounds each request up to a power of two: a slot asked for with 4 KiB of
    alignment slack would pin twice its size. A pinned slot is requested at exactly its size, page-aligned."""
    from datastates.save.buffers import BufferPool

    slot_bytes = 32 * MiB  # a size no other test's pinned buffers have, so none is reused from the cache
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    pool = BufferPool(4 * slot_bytes, slot_bytes, pin=True)
    slots = [pool.acquire()[0] for _ in range(2)]
    try:
        for slot in slots:
            assert slot.buf.is_pinned() and len(slot.buf) == slot_bytes and slot.buf.data_ptr() % 4096 == 0
            assert slot.buf.untyped_storage().nbytes() == slot_bytes  # the request itself: no slack to round up
        grown = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
        assert grown <= 2 * slot_bytes
    finally:
        for slot in slots:
            pool.release(slot)


@pytest.mark.parametrize("how", ["sync", "async", "lazy"])
def test_cuda_state_round_trips_bit_exact_on_cpu_and_cuda(tmp_path: Path, how: str) -> None:
    state = _gpu_state(1)
    want = _host(state)
    with _store(tmp_path / "s") as s:
        if how == "sync":
            v = s.save(state)
        else:
            h = s.save_async(state, lazy=how == "lazy")
            v = h.result(WAIT)
        on_cpu = s.load(v)
        on_gpu = s.load(v, device="cuda")
    assert _host(on_cpu) == want
    assert {t.device.type for t in on_cpu.values()} == {"cpu"}
    assert {t.device.type for t in on_gpu.values()} == {"cuda"}
    assert _host(on_gpu) == want
    for got in (on_cpu, on_gpu):
        assert got["emb"].untyped_storage().data_ptr() == got["head"].untyped_storage().data_ptr()
        assert (got["t"].shape, got["bf16"].dtype, got["scalar"].shape) == ((64, 96), torch.bfloat16, ())


def test_reserve_of_a_cuda_state_pins_every_slot_its_first_save_async_takes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`Store.reserve` on a GPU state: the slots are pinned ahead, the save that follows allocates none, and
    its bytes are the call's."""
    made = count_slots(monkeypatch)
    state = _gpu_state(11)
    with _store(tmp_path / "a") as plain:
        plain.save_async(state).result(WAIT)
        without = len(made)
    assert without > 1  # the control: a first save_async allocates its slots as it copies
    made.clear()
    want = _host(state)
    with _store(tmp_path / "b") as s:
        reserved = s.reserve(state).result(WAIT)
        assert reserved == s.pool.allocated_bytes == len(made) * s.pool.slot_bytes
        assert len(made) == without
        slot, _ = s.pool.acquire()
        try:
            assert slot.buf.is_pinned()
        finally:
            s.pool.release(slot)
        made.clear()
        h = s.save_async(state)
        for t in state.values():
            if t.is_floating_point():
                t.add_(1)  # on the caller's stream, after the side stream's copies
        v = h.result(WAIT)
        assert made == []  # the save only copied into the reserved slots
        assert _host(s.load(v)) == want


def test_saves_of_the_same_cuda_state_keep_its_layout_and_each_keeps_its_own_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training loop's state (the same tensor objects, new values, a CPU step counter beside the GPU weights as
    AdamW keeps it): its slot layout is planned once and kept, and every save, async or sync, holds the bytes of
    its own call."""
    import datastates.save.capture as capture

    planned: list[int] = []
    real = capture.plan

    def counted(entries: Any, *args: Any) -> Any:
        planned.append(len(entries))
        return real(entries, *args)

    monkeypatch.setattr(capture, "plan", counted)
    g = torch.Generator().manual_seed(12)
    state: dict[str, torch.Tensor] = {f"w{i:03d}": torch.randn(1000 + 37 * i, generator=g).cuda() for i in range(200)}
    state["big"] = torch.randn(3 * MiB // 4 + 5, generator=g).cuda()
    state["step"] = torch.tensor(1.0)
    versions, wants = [], []
    with _store(tmp_path / "s", pool_bytes=4 * MiB) as s:
        for _ in range(4):
            wants.append(_host(state))
            h = s.save_async(state)
            for t in state.values():
                t.add_(1)  # on the caller's stream (the step counter on the host) as soon as the call returns
            versions.append(h.result(WAIT))
        wants.append(_host(state))
        versions.append(s.save(state))
        # The first save makes the record, the second its layout, kept for the next two; the sync save plans
        # its own (it reads host bytes in place), once.
        assert len(planned) == 3
        for v, want in zip(versions, wants):
            assert _host(s.load(v)) == want
            assert _host(s.load(v, device="cuda")) == want


def test_the_same_bytes_from_cuda_and_cpu_are_one_set_of_chunks(tmp_path: Path) -> None:
    state = _gpu_state(2)
    on_host = {k: v.cpu() for k, v in state.items()}
    on_host["head"] = on_host["emb"]
    with _store(tmp_path / "s") as s:
        first = s.save(on_host, branch="cpu")
        second = s.save(state, branch="gpu")
        assert first.bytes_new > 0
        assert second.bytes_new == 0  # every chunk the GPU state hashed was already stored from the host copy


def test_async_save_over_a_pool_smaller_than_the_state_keeps_the_bytes_of_the_call(tmp_path: Path) -> None:
    """Twelve slots' worth of CUDA tensors through a two-slot pool: slots are reused while the side stream still
    copies into others, and the caller mutates the tensors as soon as the call returns."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(3 * MiB // 4, generator=g).cuda() for i in range(4)}
    want = _host(state)
    with _store(tmp_path / "s", pool_bytes=2 * MiB) as s:
        h = s.save_async(state)
        for t in state.values():
            t.mul_(-1)  # on the caller's stream: ordered after the side stream's copies
        v = h.result(WAIT)
        torch.cuda.synchronize()
        assert all(_bits(t) != want[k] for k, t in state.items())
        assert _host(s.load(v)) == want


def test_reuse_unchanged_with_cuda_tensors_stores_only_what_changed(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    state = {f"p{i}": torch.randn(64 << 10, generator=g).cuda() for i in range(20)}  # 256 KiB each
    with _store(tmp_path / "s", reuse_unchanged=True) as s:
        s.save(state)
        state["p3"].add_(1)
        state["p11"].mul_(2)
        want = _host(state)
        v = s.save(state)
        assert v.bytes_new == 2 * (256 << 10)
        assert _host(s.load(v)) == want
        assert _host(s.load(v, device="cuda")) == want


def test_lazy_save_with_a_cuda_optimizer_keeps_the_weights_before_the_step(tmp_path: Path) -> None:
    model, opt, x = _trained(5, nn.LayerNorm(512))
    before = {k: _bits(v) for k, v in model.state_dict().items()}
    with _store(tmp_path / "s") as s:
        h = s.save_async({"model": model, "opt": opt.state_dict()}, lazy=True, optimizer=opt)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()  # waits for the staging of the weights it is about to change
        after = {k: _bits(v) for k, v in model.state_dict().items()}
        assert {k for k in before if before[k] != after[k]} == {k for k, p in model.named_parameters()}
        got = s.load(h.result(WAIT))
        assert {k: _bits(v) for k, v in got["model"].items()} == before


def test_one_key_loads_onto_cuda(tmp_path: Path) -> None:
    state = _gpu_state(6)
    with _store(tmp_path / "s") as s:
        v = s.save(state)
        got = s.load(v, keys=["f32"], device="cuda")
    assert list(got) == ["f32"]
    assert got["f32"].device.type == "cuda"
    assert _bits(got["f32"]) == _bits(state["f32"])


def test_small_cuda_pieces_are_gathered_in_runs_that_host_and_big_pieces_end() -> None:
    from datastates.save.capture import _GATHER_BELOW, _cuda_runs

    def gpu(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device="cuda")

    big = _GATHER_BELOW
    batch = [(0, 16, gpu(16)), (64, 16, gpu(16)), (128, 16, torch.zeros(16, dtype=torch.uint8)),
             (192, 16, gpu(16)), (256, big, gpu(big)), (256 + big, 16, gpu(16)), (320 + big, 8, gpu(8)),
             (384 + big, 4, gpu(4))]
    alone, runs = _cuda_runs(batch)
    assert [(off, n) for off, n, _ in alone] == [(192, 16), (256, big)]
    assert [(r.start, r.end) for r in runs] == [(0, 80), (256 + big, 388 + big)]


def test_a_mixed_host_and_cuda_state_keeps_every_byte_when_small_cuda_pieces_are_gathered(tmp_path: Path) -> None:
    """Small CUDA tensors between host tensors and big CUDA ones, in slots that hold all three: a gathered run is
    copied to the slot as one stretch, which must not overwrite the host pieces beside it."""
    g = torch.Generator().manual_seed(7)
    state: dict[str, torch.Tensor] = {}
    for i in range(300):
        n = [100, 4096, 16 << 10, 3 << 18][i % 4]
        t = torch.randn(n, generator=g)
        state[f"t{i:03d}"] = t.cuda() if i % 5 else t  # every fifth on the host
    want = _host(state)
    with _store(tmp_path / "s", pool_bytes=8 * MiB, chunk_size=4 * MiB) as s:
        for lazy in (False, True):
            h = s.save_async(state, lazy=lazy, branch=f"b{lazy}")
            h.wait_staged(WAIT)
            for t in state.values():
                t.add_(1)
            v = h.result(WAIT)
            assert _host(s.load(v)) == want
            want = _host(state)


def test_a_load_onto_cuda_through_buffers_smaller_than_the_state_is_bit_exact(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Many turns of the two pinned buffers, and tensors of several chunks split across them."""
    from datastates.repo import reader

    monkeypatch.setattr(reader, "STAGE_BYTES", 256 << 10)
    state = _gpu_state(8)
    want = _host(state)
    with _store(tmp_path / "s") as s:
        v = s.save(state)
        got = s.load(v, device="cuda")
    assert {t.device.type for t in got.values()} == {"cuda"}
    assert _host(got) == want
    assert got["emb"].untyped_storage().data_ptr() == got["head"].untyped_storage().data_ptr()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_state_spread_over_two_gpus_is_saved_bit_exact(tmp_path: Path) -> None:
    """The side stream is one device's: a state on two GPUs is copied synchronously, never hashed half-copied."""
    g = torch.Generator().manual_seed(9)
    state = {f"w{i}": torch.randn(200_000 + i, generator=g).to(f"cuda:{i % 2}") for i in range(8)}
    want = _host(state)
    with _store(tmp_path / "s", pool_bytes=2 * MiB) as s:
        h = s.save_async(state)
        for t in state.values():
            t.mul_(-1)
        assert _host(s.load(h.result(WAIT))) == want


def test_checkout_into_a_cuda_model_and_its_optimizer_restores_every_byte_and_trains_on(tmp_path: Path) -> None:
    """The model's state is read straight onto its GPU; the optimizer's through the host, so that AdamW keeps
    its `step` on the host, where a non-capturable AdamW wants it."""
    from datastates.repo.reader import _module_device

    model, opt, x = _trained(10, nn.BatchNorm1d(512))
    assert _module_device(model) == torch.device("cuda", torch.cuda.current_device())
    with _store(tmp_path / "s") as s:
        v = s.save({"model": model, "optimizer": opt.state_dict()})
        want = {k: _bits(t) for k, t in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        s.checkout(v, model=model, optimizer=opt)
    assert {k: _bits(t) for k, t in model.state_dict().items()} == want
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert all(st["step"].device.type == "cpu" for st in opt.state.values())
    assert all(st["exp_avg"].device.type == "cuda" for st in opt.state.values())
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # trains on from the restored state
