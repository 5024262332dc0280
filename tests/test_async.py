"""The asynchronous save path (DESIGN.md section 4): capture, backpressure, ordering, failures, exit drain.

Every test opens its own store under `tmp_path` through `_store()`, which also keeps the jobs submitted to the
pipeline: `_outcome()` then fails fast (PipelineHung) if the pipeline wedges in Pipeline._drain, and the store
is unwedged and closed on the way out instead of hanging the interpreter's exit. Assertions are on values,
bytes, counts and error types, never on timings.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import math
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from datastates.errors import (
    DataStatesError,
    InvalidArgumentError,
    SaveFailedError,
    StorageFullError,
    StoreClosedError,
)
from datastates.meta.refs import RefStore
from datastates.objects.packs import PackWriter
from datastates.objects.tier import Tier
from datastates.save.foreign import tensors_by_key as _tensors  # key path -> tensor of a nested state
from datastates.store import Store

MiB = 1 << 20
CHUNK = 1 << 20
WAIT = 60.0
"""Seconds a handle may take before a test calls the save hung (never reached when the library works)."""
HANG = 3.0
"""Seconds after which the overlapping-captures helper declares its saves deadlocked (a healthy run takes
well under one)."""
HELPERS = Path(__file__).parent / "helpers"
TIMING_KEYS = ("blocking_s", "staging_s", "pool_wait_s", "write_s", "durable_s")


# helpers ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _store(tmp_path: Path, name: str = "store", **kw: Any) -> Iterator[Store]:
    """A fresh store; on exit, unwedge any job the pipeline is stuck draining, then close without raising."""
    kw.setdefault("chunk_size", CHUNK)
    s = Store.open(tmp_path / name, **kw)
    jobs: list[Any] = []
    submit = s.pipeline.submit

    def tracking_submit(job: Any) -> None:
        jobs.append(job)
        submit(job)

    s.pipeline.submit = tracking_submit  # type: ignore[method-assign]
    s._async_test_jobs = jobs  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        for job in jobs:
            with contextlib.suppress(PipelineHung, TimeoutError):
                _outcome(s, job.handle)
            if not job.handle.done():
                job.slots.put(None)  # the end-of-stream marker Pipeline._drain waits for
                with contextlib.suppress(TimeoutError):
                    job.handle.exception(WAIT)
        s.close(raise_errors=False)


class PipelineHung(AssertionError):
    """The pipeline thread waits in Pipeline._drain for a job whose slot stream has already ended."""


def _stuck_in_drain(s: Store, job: Any) -> bool:
    frame = sys._current_frames().get(s.pipeline._thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "_drain" and frame.f_locals.get("job") is job:
            # the capture put its end marker before setting `staged`; an empty queue means it was consumed
            return job.handle.staged and job.slots.empty()
        frame = frame.f_back
    return False


def _outcome(s: Store, handle: Any, timeout: float = WAIT) -> BaseException | None:
    """handle.exception(), but raise PipelineHung as soon as the pipeline is seen wedged in _drain for it
    (three looks 0.1 s apart, so a drain that is just returning is not mistaken for one that never will)."""
    job = next(j for j in s._async_test_jobs if j.handle is handle)  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    strikes = 0
    while not handle.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"save not finished after {timeout} s")
        strikes = strikes + 1 if _stuck_in_drain(s, job) else 0
        if strikes >= 3:
            raise PipelineHung("the pipeline thread waits forever in Pipeline._drain for a second end-of-stream "
                               "marker: the failed save never finishes")
        time.sleep(0.1)
    return handle.exception(0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _snapshot(state: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in _tensors(state).items()}


def _assert_bits(loaded: Any, expected: dict[str, torch.Tensor]) -> None:
    got = _tensors(loaded)
    assert sorted(got) == sorted(expected)
    for k, want in expected.items():
        g = got[k]
        assert (g.dtype, tuple(g.shape)) == (want.dtype, tuple(want.shape)), k
        assert torch.equal(_bits(g), _bits(want)), f"{k}: saved bytes differ from the snapshot"


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in a if not torch.equal(_bits(a[k]), _bits(b[k]))}


def _mutate(state: Any) -> None:
    """Change every stored byte in place: add_(1) on some tensors, zero_() (or not) on the others."""
    for i, t in enumerate(_tensors(state).values()):
        if t.dtype == torch.bool:
            t.logical_not_()
        elif i % 2 == 0:
            t.add_(1)
        else:
            t.zero_()


def _mixed_state(seed: int, device: str = "cpu") -> dict[str, Any]:
    """Tensors larger than a 1 MiB chunk (not multiples of it), odd sizes, several dtypes, a shared storage."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(MiB // 2 + 3, generator=g)  # 2 MiB + 12 bytes, seen whole and through a view
    state: dict[str, Any] = {
        "big": {"a": torch.randn(3 * MiB // 4, generator=g),  # 3 MiB
                "b": torch.randint(-(2**40), 2**40, (3 * MiB // 8 + 5,), generator=g, dtype=torch.int64)},
        "mat": torch.randn(513, 257, generator=g, dtype=torch.float64),
        "half": (torch.randn(777, generator=g) + 1).to(torch.bfloat16),
        "u8": torch.randint(1, 255, (4097,), generator=g, dtype=torch.uint8),
        "flag": torch.rand(333, generator=g) > 0.5,
        "layers": [torch.randn(1000, generator=g) + 3, torch.randn(17, 3, generator=g) + 3],
        "shared": {"base": base, "view": base[10:100_010]},
        "step": 12,
        "name": "mixed",
    }
    if device != "cpu":
        moved = {k: v.to(device) for k, v in _tensors(state).items()}
        state["big"] = {"a": moved["big.a"], "b": moved["big.b"]}
        for k in ("mat", "half", "u8", "flag"):
            state[k] = moved[k]
        state["layers"] = [moved["layers.0"], moved["layers.1"]]
        b = moved["shared.base"]
        state["shared"] = {"base": b, "view": b[10:100_010]}
    return state


def _plain_state(seed: int, n: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(n)}


def _files(root: Path) -> set[str]:
    """Every file under the store, catalog/ and locks/ aside."""
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and p.relative_to(root).parts[0] not in ("catalog", "locks")}


def _causes(exc: BaseException | None) -> list[BaseException]:
    """exc and its __cause__ chain, stopping at the first repeat (guards against a cause cycle, once a bug here)."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__
    return out


def _fail_nth(n: int, err: int = errno.EIO) -> Any:
    """A PackWriter.append_stored (every chunk write: one chunk, or a stretch of small ones back to back) that
    raises OSError(err) on its n-th call and otherwise writes normally."""
    orig = PackWriter.append_stored
    calls = [0]

    def append_stored(self: PackWriter, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise OSError(err, f"injected {errno.errorcode[err]} on chunk write {n}")
        return orig(self, *a, **k)

    return append_stored


def _helper(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_ds_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# 1. consistency under mutation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_bytes", [None, 2 * MiB], ids=["big-pool", "2-slot-pool"])
def test_eager_save_is_a_snapshot_of_the_call(tmp_path: Path, pool_bytes: int | None) -> None:
    state = _mixed_state(1)
    snap = _snapshot(state)
    with _store(tmp_path, pool_bytes=pool_bytes) as s:
        h = s.save_async(state, step=1)
        assert h.staged, "an eager save_async returns only once the tensors are copied"
        _mutate(state)
        assert _differs(snap, _snapshot(state)) == set(snap)  # every tensor really changed
        v = h.result(WAIT)
        assert h.done() and h.id == v.id
        assert h.wait_staged(0) is True
        loaded = s.load(v)
        _assert_bits(loaded, snap)
        assert loaded["step"] == 12 and loaded["name"] == "mixed"
        # the view still shares the base's storage after the round trip
        assert loaded["shared"]["view"].untyped_storage().data_ptr() == loaded["shared"]["base"].untyped_storage(
        ).data_ptr()


@pytest.mark.parametrize("pool_bytes", [None, 2 * MiB], ids=["big-pool", "2-slot-pool"])
def test_lazy_save_holds_the_state_at_wait_staged(tmp_path: Path, pool_bytes: int | None) -> None:
    state = _mixed_state(2)
    snap = _snapshot(state)
    with _store(tmp_path, pool_bytes=pool_bytes) as s:
        h = s.save_async(state, step=2, lazy=True)
        assert h.wait_staged(WAIT) is True
        assert h.staged
        _mutate(state)
        assert _differs(snap, _snapshot(state)) == set(snap)
        _assert_bits(s.load(h.result(WAIT)), snap)


def test_each_back_to_back_save_keeps_its_own_bytes_through_slot_reuse(tmp_path: Path) -> None:
    """Six saves of one state, mutated in place right after each returns, through a 2-slot pool."""
    g = torch.Generator().manual_seed(3)
    big = torch.randint(-(2**30), 2**30, (3 * MiB // 4 + 7,), generator=g, dtype=torch.int32)
    small = torch.randint(-100, 100, (999,), generator=g, dtype=torch.int32)
    big0, small0 = big.clone(), small.clone()
    with _store(tmp_path, pool_bytes=2 * MiB) as s:
        handles = []
        for i in range(6):
            handles.append(s.save_async({"big": big, "small": small}, step=i))
            big.add_(1)
            small.add_(1)
        s.wait()
        assert s.pool.allocated_bytes <= 2 * MiB
        for i, h in enumerate(handles):
            _assert_bits(s.load(h.result(WAIT)), {"big": big0 + i, "small": small0 + i})


# 2. ordering ---------------------------------------------------------------------------------------------------
def test_ten_saves_in_a_row_form_a_first_parent_chain_in_call_order(tmp_path: Path) -> None:
    with _store(tmp_path) as s:
        root = s.save({"seed": torch.zeros(8)}, step=0)
        states = [_plain_state(100 + i, 2, MiB // 8) for i in range(10)]
        handles = [s.save_async(st, step=i + 1, metrics={"i": i}) for i, st in enumerate(states)]
        s.wait()
        ids = [h.result(0).id for h in handles]
        assert len(set(ids)) == 10

        chain, vid = [], s.resolve("main")
        while vid != root.id:
            chain.append(vid)
            assert len(chain) <= 10, "the chain from main does not reach the root after 10 steps"
            vid = s.version(vid).parents[0]
        assert chain[::-1] == ids

        for prev, vid in zip([root.id, *ids], ids):
            assert s.version(vid).parents == (prev,)
        steps = [s.version(v).step for v in ids]
        assert steps == list(range(1, 11))
        assert [s.version(v).metrics["i"] for v in ids] == list(range(10))
        assert s.resolve("main") == ids[-1]
        assert s.resolve("main~1") == ids[-2]
        assert s.resolve("main~10") == root.id
        assert s.catalog.version_count() == 11
        for st, vid in zip(states, ids):
            _assert_bits(s.load(vid), _snapshot(st))


def test_interleaved_branches_each_get_their_own_chain(tmp_path: Path) -> None:
    with _store(tmp_path) as s:
        hs: dict[str, list[Any]] = {"a": [], "b": []}
        for i in range(8):
            br = "ab"[i % 2]
            hs[br].append(s.save_async({"x": torch.full((1000,), float(i))}, branch=br, step=i))
        s.wait()
        for br, handles in hs.items():
            ids = [h.result(0).id for h in handles]
            assert s.version(ids[0]).parents == ()
            for prev, vid in zip(ids, ids[1:]):
                assert s.version(vid).parents == (prev,)
            assert s.resolve(br) == ids[-1]
            assert [s.version(v).branch for v in ids] == [br] * 4


# 3. failure propagation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("report", ["save", "save_async", "wait", "close"])
@pytest.mark.parametrize("nth", [1, 2])
def test_writer_error_fails_the_save_invisibly_and_is_reported_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: str, nth: int) -> None:
    state = _plain_state(7, 4, MiB // 4)  # 4 chunks of 1 MiB, one per slot
    with _store(tmp_path) as s:
        base = s.save({"w": torch.ones(16)}, step=0)
        count, files = s.catalog.version_count(), _files(s.path)

        monkeypatch.setattr(PackWriter, "append_stored", _fail_nth(nth))
        h = s.save_async(state, step=1)
        assert h._done.wait(WAIT)  # finished; nobody has looked at its result yet
        monkeypatch.undo()

        # nothing of the failed save is visible or left behind
        assert h.done() and h.id is None
        assert s.resolve("main") == base.id
        assert s.catalog.version_count() == count
        assert _files(s.path) == files
        assert s.tier.leftovers() == []

        # a failure nobody looked at: the next save/wait/close raises SaveFailedError once, chaining the OSError
        if report == "close":
            with pytest.raises(SaveFailedError) as er:
                s.close()
            s.close()  # already closed: nothing more to report
        else:
            with pytest.raises(SaveFailedError) as er:
                if report == "save":
                    s.save(state, step=2)
                elif report == "save_async":
                    s.save_async(state, step=2)
                else:
                    s.wait()
            assert s.catalog.version_count() == count  # the refused save wrote nothing
        with pytest.raises(SaveFailedError) as ei:
            h.result(WAIT)  # the handle still says what happened
        chain = _causes(ei.value)
        oserrs = [e for e in chain if isinstance(e, OSError)]
        assert oserrs and oserrs[0].errno == errno.EIO, chain
        assert isinstance(h.exception(0), OSError) and h.exception(0).errno == errno.EIO
        assert oserrs[0] in _causes(er.value)

        if report == "close":
            s = Store.open(tmp_path / "store")
        try:
            s.wait()  # reported once: nothing pending any more
            v = s.save(state, step=3)
            assert v.parents == (base.id,)
            _assert_bits(s.load(v), _snapshot(state))
            assert s.catalog.version_count() == count + 1
        finally:
            if report == "close":
                s.close()


def test_disk_full_raises_storage_full_error_from_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from a pack write becomes StorageFullError (a DataStatesError and an OSError), raised as is by
    result(); having raised it there, the store does not raise it again."""
    import datastates.objects.packs as packs

    def write_all(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "injected ENOSPC")

    with _store(tmp_path) as s:
        base = s.save({"w": torch.ones(16)})
        count, files = s.catalog.version_count(), _files(s.path)
        monkeypatch.setattr(packs, "write_all", write_all)
        h = s.save_async(_plain_state(8, 3, MiB // 4))
        with pytest.raises(StorageFullError) as ei:
            h.result(WAIT)
        monkeypatch.undo()
        assert isinstance(ei.value, DataStatesError) and isinstance(ei.value, OSError)
        assert ei.value.errno == errno.ENOSPC
        assert s.resolve("main") == base.id and s.catalog.version_count() == count
        assert _files(s.path) == files
        s.wait()  # result() raised it: not again


def test_a_failed_save_does_not_take_down_saves_queued_behind_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save submitted before an earlier one failed is neither refused nor lost; its parent is the last
    version that did commit. The failure, seen through its handle, is not raised again by wait()."""
    release = threading.Event()
    fail = _fail_nth(1)

    def gated_fail(self: PackWriter, *a: Any, **k: Any) -> Any:
        release.wait(WAIT)  # hold the first save's failure until the second save is queued
        return fail(self, *a, **k)

    good_state = _plain_state(10, 2, MiB // 4)
    with _store(tmp_path) as s:
        base = s.save({"w": torch.ones(16)})
        monkeypatch.setattr(PackWriter, "append_stored", gated_fail)
        bad = s.save_async(_plain_state(9, 2, MiB // 4), step=1)
        good = s.save_async(good_state, step=2)
        release.set()
        assert isinstance(bad.exception(WAIT), OSError)
        v = good.result(WAIT)
        monkeypatch.undo()
        assert v.parents == (base.id,) and s.resolve("main") == v.id
        _assert_bits(s.load(v), _snapshot(good_state))
        s.wait()
        assert s.catalog.version_count() == 2


def test_a_write_error_cause_chain_has_no_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datastates.objects.packs as packs

    orig = packs.write_all

    def write_all(fd: int, data: Any) -> int:
        raise OSError(errno.EIO, "injected EIO in write_all")

    with _store(tmp_path) as s:
        monkeypatch.setattr(packs, "write_all", write_all)
        h = s.save_async(_plain_state(11, 2, MiB // 4))
        with pytest.raises(SaveFailedError) as ei:
            h.result(WAIT)
        monkeypatch.setattr(packs, "write_all", orig)
        chain, e = [], ei.value
        while e is not None and len(chain) < 10:
            assert all(e is not c for c in chain), f"cycle in the cause chain: {chain + [e]!r}"
            chain.append(e)
            e = e.__cause__
        assert e is None
        assert any(isinstance(c, OSError) and c.errno == errno.EIO for c in chain)


def _fail_seal(self: PackWriter) -> None:
    raise OSError(errno.EIO, "injected EIO in seal")


def _fail_manifest(self: Tier, mid: str, data: bytes) -> None:
    raise OSError(errno.EIO, "injected EIO writing the manifest")


@pytest.mark.parametrize("where", ["last-chunk-write", "pack-seal", "manifest-write"])
def test_error_after_the_last_slot_fails_the_save_instead_of_hanging(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Regression (fixed in 6ee5744): an error after the pipeline took the end-of-slots marker (the last chunk
    writes run from the window's tail, then seal, then the commit) used to leave Pipeline._drain waiting forever
    for a second marker."""
    state = _plain_state(12, 4, MiB // 4)  # 4 slots: writes 1-3 run inside the slot loop, write 4 after it
    with _store(tmp_path) as s:
        base = s.save({"w": torch.ones(16)})
        count, files = s.catalog.version_count(), _files(s.path)
        if where == "last-chunk-write":
            monkeypatch.setattr(PackWriter, "append_stored", _fail_nth(4))
        elif where == "pack-seal":
            monkeypatch.setattr(PackWriter, "seal", _fail_seal)
        else:
            monkeypatch.setattr(Tier, "write_manifest", _fail_manifest)
        h = s.save_async(state)
        err = _outcome(s, h)  # PipelineHung here is the old drain hang
        monkeypatch.undo()
        assert any(isinstance(e, OSError) and e.errno == errno.EIO for e in _causes(err))
        assert s.resolve("main") == base.id and s.catalog.version_count() == count
        assert _files(s.path) == files
        s.wait()  # the handle said it (_outcome): not raised again
        _assert_bits(s.load(s.save(state)), _snapshot(state))


def test_error_after_catalog_commit_loses_no_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _plain_state(13, 3, MiB // 4)
    with _store(tmp_path) as s:
        base = s.save({"w": torch.ones(16)})

        def set_if_equals(self: RefStore, *a: Any, **k: Any) -> None:
            raise OSError(errno.EIO, "injected EIO moving the branch")

        monkeypatch.setattr(RefStore, "set_if_equals", set_if_equals)
        h = s.save_async(state)
        err = _outcome(s, h)
        monkeypatch.undo()
        assert any(isinstance(e, OSError) and e.errno == errno.EIO for e in _causes(err))
        assert s.resolve("main") == base.id
        s.wait()  # the handle said it (_outcome): not raised again
        # whatever the catalog kept of the failed save must be loadable, and so must a new save of the same bytes
        for vid, _ in s.catalog.records():
            s.load(vid)
        _assert_bits(s.load(s.save(state)), _snapshot(state))


# 4. backpressure -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("chunk_size", [CHUNK, CHUNK // 4], ids=["chunk-1MiB", "chunk-256KiB"])
def test_a_16mib_state_through_a_2mib_pool_completes_within_the_bound(
        tmp_path: Path, lazy: bool, chunk_size: int) -> None:
    state = _plain_state(14, 4, MiB)  # 16 MiB
    state["odd"] = torch.arange(100_003, dtype=torch.int64)
    snap = _snapshot(state)
    with _store(tmp_path, pool_bytes=2 * MiB, chunk_size=chunk_size) as s:
        assert s.pool.slot_bytes == MiB and s.pool.max_slots == 2
        h = s.save_async(state, lazy=lazy)
        v = h.result(WAIT)
        assert s.pool.allocated_bytes <= 2 * MiB
        assert v.bytes_total == sum(t.numel() * t.element_size() for t in snap.values())
        _assert_bits(s.load(v), snap)
        v2 = s.save(_plain_state(15, 2, MiB))
        assert s.pool.allocated_bytes <= 2 * MiB
        assert v2.parents == (v.id,)


@pytest.mark.parametrize("pool_bytes", [
    64 * MiB,
    2 * MiB,
], ids=["pool-64MiB", "pool-2MiB"])
def test_overlapping_lazy_captures_complete(tmp_path: Path, pool_bytes: int) -> None:
    proc = subprocess.run([sys.executable, str(HELPERS / "async_overlap.py"), str(tmp_path / "store"), str(HANG),
                           str(pool_bytes)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "DONE True True" in proc.stdout and "LOADED True" in proc.stdout


# 5. close / atexit drain ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [
    "close",
    "exit",
    "lazy-exit",
])
def test_a_save_in_flight_at_process_exit_is_committed(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "store"
    proc = subprocess.run([sys.executable, str(HELPERS / "async_exit.py"), str(path), mode],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    helper = _helper("async_exit")
    with _store(tmp_path) as s:
        assert "main" in s.branches(), f"no version committed; stderr: {proc.stderr[-2000:]}"
        v = s.version("main")
        assert v.step == helper.STEP and v.parents == ()
        assert s.catalog.version_count() == 1
        loaded = s.load(v)
        _assert_bits(loaded, _snapshot(helper.make_state()))
        assert loaded["meta"] == {"epoch": 3, "name": "exit-test"}
        assert s.tier.leftovers() == []


def test_lazy_saves_share_one_capture_thread_that_close_ends(tmp_path: Path) -> None:
    state = _plain_state(17, 3, MiB // 2)
    before = {t.ident for t in threading.enumerate()}

    def capturers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("datastates-capture") and t.ident not in before]

    with Store.open(tmp_path / "store", chunk_size=CHUNK) as s:
        s.save(state)
        assert capturers() == []  # a store that never saves lazily never starts it
        versions = []
        for i in range(4):
            state["t0"].add_(1.0)
            versions.append(s.save_async(state, step=i, lazy=True).result(WAIT))
        assert len(capturers()) == 1
        assert [v.step for v in versions] == [0, 1, 2, 3]
        assert [v.parents for v in versions[1:]] == [(v.id,) for v in versions[:-1]]
        _assert_bits(s.load(versions[-1]), _snapshot(state))
    assert capturers() == []


class _SlowStateDict(torch.nn.Linear):
    """A module whose `state_dict()` (run by `save_async` on the saving thread) says it started, then waits until
    the test has closed the store on another thread: a sharded model's gather, slow."""

    def __init__(self, entered: threading.Event, closed: threading.Event) -> None:
        super().__init__(4, 4)
        self.entered, self.closed = entered, closed

    def state_dict(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        self.closed.wait(WAIT)
        return super().state_dict(*args, **kw)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_save_racing_close_on_another_thread_is_refused_and_leaves_nothing_waiting(tmp_path: Path,
                                                                                      lazy: bool) -> None:
    """save_async checks that the store is open before flattening, which runs the caller's code. A close() on
    another thread meanwhile let it queue its job after the pipeline had stopped: its result() waited for ever;
    lazily, the shut capture thread raised an untyped RuntimeError after the optimizer's step hook was in, and the
    next step() waited for ever. Now StoreClosedError, nothing queued, no hook."""
    entered, closed = threading.Event(), threading.Event()
    model = _SlowStateDict(entered, closed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n_hooks = len(opt._optimizer_step_pre_hooks)
    s = Store.open(tmp_path / "store", chunk_size=CHUNK)
    v0 = s.save({"w": torch.zeros(4)}, step=0)
    out: dict[str, Any] = {}

    def save() -> None:
        try:
            out["handle"] = s.save_async({"model": model}, step=1, lazy=lazy, optimizer=opt if lazy else None)
        except Exception as exc:
            out["error"] = exc

    saver = threading.Thread(target=save)
    saver.start()
    assert entered.wait(WAIT)
    s.close()
    closed.set()
    saver.join(WAIT)
    assert "handle" not in out and isinstance(out.get("error"), StoreClosedError), out
    assert len(opt._optimizer_step_pre_hooks) == n_hooks
    model(torch.ones(1, 4)).sum().backward()
    opt.step()  # nothing to wait for
    with _store(tmp_path) as s2:
        assert [v.id for v in s2.log()] == [v0.id]
        assert s2.fsck().ok


def test_close_frees_the_staging_buffers(tmp_path: Path) -> None:
    """close() kept the pool's buffers (pinned memory on a GPU machine; 2.1 GB after 50 saves of 100 MiB) until the
    Store object itself was freed: a process that goes on after closing its store held them for nothing."""
    s = Store.open(tmp_path / "store", chunk_size=CHUNK, pool_bytes=8 * MiB)
    s.save_async(_plain_state(3, 4, MiB // 4), step=1).result(WAIT)
    pool = s.pool
    buffers = [weakref.ref(b) for b in pool._free]
    assert buffers and pool.allocated_bytes == len(buffers) * pool.slot_bytes
    s.close()
    assert pool.allocated_bytes == 0
    assert [b() for b in buffers] == [None] * len(buffers)  # s is alive still: nothing of it holds them


def test_context_manager_exit_waits_for_saves_in_flight(tmp_path: Path) -> None:
    state = _plain_state(16, 4, MiB // 2)
    snap = _snapshot(state)
    with Store.open(tmp_path / "store", chunk_size=CHUNK) as s:
        h = s.save_async(state, step=5)
        h2 = s.save_async(state, step=6, lazy=True)
    assert h.done() and h2.done()
    v, v2 = h.result(0), h2.result(0)
    assert v2.parents == (v.id,)
    with pytest.raises(StoreClosedError):
        s.save_async(state)
    with _store(tmp_path) as s2:
        assert s2.resolve("main") == v2.id
        _assert_bits(s2.load(v), snap)
        _assert_bits(s2.load(v2), snap)


def test_context_manager_reports_a_failed_save_or_lets_the_block_error_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PackWriter, "append_stored", _fail_nth(1))
    with pytest.raises(SaveFailedError), Store.open(tmp_path / "a", chunk_size=CHUNK) as s:
        s.save_async(_plain_state(17, 2, MiB // 4))
    with pytest.raises(ValueError, match="from the block"), Store.open(tmp_path / "b", chunk_size=CHUNK) as s:
        s.save_async(_plain_state(18, 2, MiB // 4))
        raise ValueError("from the block")


# 6. lazy mode with the optimizer hook --------------------------------------------------------------------------
def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return model, opt, torch.randn(8, 512)


def _gated_pool(s: Store) -> threading.Event:
    """Hold the capture's first slot request until the returned event is set (widens the race the hook closes)."""
    gate = threading.Event()
    acquire = s.pool.acquire

    def gated(*a: Any, **k: Any) -> Any:
        gate.wait(WAIT)
        return acquire(*a, **k)

    s.pool.acquire = gated  # type: ignore[method-assign]
    return gate


def test_optimizer_hook_waits_for_staging_and_stays_single(tmp_path: Path) -> None:
    model, opt, x = _model_and_opt(0)
    with _store(tmp_path, pool_bytes=2 * MiB) as s:
        n_hooks = len(opt._optimizer_step_pre_hooks)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        gate = _gated_pool(s)
        h = s.save_async({"model": model}, lazy=True, optimizer=opt, step=1)
        assert len(opt._optimizer_step_pre_hooks) == n_hooks + 1
        threading.Timer(0.2, gate.set).start()  # opt.step() below must wait for it, via the hook
        model(x).pow(2).mean().backward()
        opt.step()
        assert h.staged
        assert len(opt._optimizer_step_pre_hooks) == n_hooks + 1  # one persistent hook per optimizer
        after = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert _differs(before, after) == set(before)  # the step changed every parameter

        saved = s.load(h.result(WAIT))["model"]
        _assert_bits(saved, before)
        assert _differs({k: saved[k] for k in after}, after) == set(after)

        # later lazy saves reuse the same hook; a step with nothing pending does not wait
        h2 = s.save_async({"model": model}, lazy=True, optimizer=opt, step=2)
        assert len(opt._optimizer_step_pre_hooks) == n_hooks + 1
        model(x).pow(2).mean().backward()
        opt.step()
        assert h2.staged
        opt.step()
        assert len(opt._optimizer_step_pre_hooks) == n_hooks + 1


@pytest.mark.parametrize("second", ["second-lazy-save", "user-hook"])
def test_optimizer_hook_coexists_with_later_hooks(tmp_path: Path, second: str) -> None:
    model, opt, x = _model_and_opt(1)
    with _store(tmp_path) as s:
        n_hooks = len(opt._optimizer_step_pre_hooks)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        h1 = s.save_async({"model": model}, branch="model", lazy=True, optimizer=opt)
        calls: list[int] = []
        if second == "second-lazy-save":
            h2 = s.save_async({"model": model}, branch="copy", lazy=True, optimizer=opt)
        else:
            opt.register_step_pre_hook(lambda o, a, k: calls.append(1))
        model(x).pow(2).mean().backward()
        opt.step()
        assert _differs(before, {k: v.detach() for k, v in model.state_dict().items()}) == set(before)
        _assert_bits(s.load(h1.result(WAIT))["model"], before)
        if second == "second-lazy-save":
            _assert_bits(s.load(h2.result(WAIT))["model"], before)
            assert len(opt._optimizer_step_pre_hooks) == n_hooks + 1
        else:
            assert calls == [1]
            assert len(opt._optimizer_step_pre_hooks) == n_hooks + 2


def test_optimizer_hook_survives_a_failed_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, x = _model_and_opt(2)
    with _store(tmp_path) as s:
        n_hooks = len(opt._optimizer_step_pre_hooks)
        monkeypatch.setattr(PackWriter, "append_stored", _fail_nth(1))
        h = s.save_async({"model": model}, lazy=True, optimizer=opt)
        assert h._done.wait(WAIT)  # failed; nobody looked at it yet
        monkeypatch.undo()
        model(x).pow(2).mean().backward()
        opt.step()  # the hook waits for staging only; the write failure is not the step's business
        assert len(opt._optimizer_step_pre_hooks) == n_hooks + 1
        opt.step()  # training goes on; the failure is reported by the store's next save/wait/close
        with pytest.raises(SaveFailedError):
            s.wait()


# 7. CUDA -------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_cuda_tensors_are_snapshotted_and_load_onto_cuda(tmp_path: Path, lazy: bool) -> None:
    state = _mixed_state(20, device="cuda")
    with _store(tmp_path, pool_bytes=2 * MiB) as s:
        assert s.pool.pin
        snap = _snapshot(state)  # .cpu() synchronizes
        # A write still queued on the caller's stream when save_async is called belongs to the snapshot:
        # park the stream, queue the write behind it, and save at once.
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(100_000_000)
        state["big"]["a"].add_(5)
        snap["big.a"] = snap["big.a"] + 5
        h = s.save_async(state, step=1, lazy=lazy)
        if lazy:
            assert h.wait_staged(WAIT)
        _mutate(state)  # on the default stream, right after return
        torch.cuda.synchronize()
        assert _differs(snap, _snapshot(state)) == set(snap)
        v = h.result(WAIT)
        _assert_bits(s.load(v), snap)
        on_gpu = s.load(v, device="cuda")
        assert {t.device.type for t in _tensors(on_gpu).values()} == {"cuda"}
        _assert_bits(on_gpu, snap)


# 8. metrics ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_version_timings_and_byte_counts(tmp_path: Path, lazy: bool) -> None:
    state = _mixed_state(21)
    nbytes = sum(t.numel() * t.element_size() for k, t in _tensors(state).items() if k != "shared.view")
    with _store(tmp_path, pool_bytes=2 * MiB) as s:
        v = s.save_async(state, step=4, metrics={"loss": 0.25}, lazy=lazy).result(WAIT)
        for timings in (v.timings, s.version(v.id).timings):
            assert set(TIMING_KEYS) <= set(timings), timings
            for k in TIMING_KEYS:
                assert isinstance(timings[k], float) and math.isfinite(timings[k]) and timings[k] >= 0, (k, timings)
        assert v.bytes_total == nbytes
        assert v.bytes_new == nbytes  # random data: every chunk is new
        assert (v.step, v.metrics) == (4, {"loss": 0.25})
        again = s.save_async(state, step=5, lazy=lazy).result(WAIT)
        assert again.bytes_total == nbytes and again.bytes_new == 0 and again.chunks_new == 0



_FORK_CHILD = r"""
import os, sys, threading, torch
import datastates as ds
from datastates.objects.tier import Tier

gate = threading.Event()
write_record = Tier.write_record
def held(self, vid, data):  # the save stays in flight until the child is done
    gate.wait()
    write_record(self, vid, data)
Tier.write_record = held
st = ds.Store.open(sys.argv[1])
h = st.save_async({"w": torch.ones(1000)}, step=1)
pid = os.fork()
if pid == 0:  # exits through the interpreter's normal shutdown, as a multiprocessing or DataLoader worker does
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)  # a hang ends in exit status 1, not in a hung test
    for call in (lambda: st.save({"w": torch.zeros(3)}), lambda: st.load("main"), st.log, st.wait, h.result):
        try:
            call()
            print("child: no error")
        except ds.StoreClosedError as exc:
            print("child: StoreClosedError", "forked from" in str(exc))
    st.close()
    try:  # LMDB allows one open of a file per process, and the parent's is inherited
        ds.Store.open(sys.argv[1])
        print("child: reopened")
    except ds.StoreClosedError as exc:
        print("child: reopen refused", "'spawn'" in str(exc))
    sys.exit(0)
_, status = os.waitpid(pid, 0)
gate.set()
print("parent:", os.waitstatus_to_exitcode(status), h.result().step, [v.step for v in st.log()])
st.close()
"""


def test_a_forked_child_neither_hangs_at_exit_nor_uses_the_parents_store(tmp_path: Path) -> None:
    """A child forked while a save was in flight (a DataLoader or multiprocessing worker) hung at exit: the store's
    exit hook waited for a pipeline thread the child does not have; a save in the child blocked for ever, and so did
    `wait()` and the parent's handle's `result()` there. The child now refuses the store and the handle
    (StoreClosedError), and an open of it there too (reopened, it got the parent's LMDB environment; closing that
    one would have reset the parent's reader slots); it exits, and the parent's save lands."""
    script = tmp_path / "fork_child.py"
    script.write_text(_FORK_CHILD)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["child: StoreClosedError True"] * 5 + ["child: reopen refused True",
                                                                              "parent: 0 1 [1]"]


def test_an_optimizer_that_is_none_is_refused_and_the_next_save_works(tmp_path: Path) -> None:
    """`save_async(lazy=True, optimizer=<a module>)` raised AttributeError after queueing the job, whose capture
    never ran: every later save, close() and the interpreter's exit then waited for ever."""
    model = torch.nn.Linear(4, 2)
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(InvalidArgumentError, match="optimizer= takes the torch.optim.Optimizer .* not a Linear"):
            store.save_async({"m": model}, lazy=True, optimizer=model)  # type: ignore[arg-type]
        assert store.branches() == {}
        v = store.save({"m": model}, step=1)
        assert store.log()[0].id == v.id and torch.equal(store.load()["m"]["weight"], model.weight.detach())


def test_a_copy_interrupted_on_the_callers_thread_is_reported_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt during save_async's copy reached the caller, and then came back as SaveFailedError
    ('the first: KeyboardInterrupt()') from the next save or from close(), failing a `with` block's exit."""
    from datastates.save import capture as capture_module

    hand_over = capture_module._hand_over
    calls: list[int] = []

    def interrupted(*args: Any, **kw: Any) -> Any:
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt
        return hand_over(*args, **kw)

    monkeypatch.setattr(capture_module, "_hand_over", interrupted)
    with Store.open(tmp_path / "s") as store:
        with pytest.raises(KeyboardInterrupt):
            store.save_async({"w": torch.ones(1000)}, step=1)
        store.wait()  # raised SaveFailedError for the save the caller already saw fail
        assert store.branches() == {}
        v = store.save({"w": torch.zeros(3)}, step=2)
        assert [x.id for x in store.log()] == [v.id]


_FORK_READER = r"""
import os, sys, torch
import datastates as ds
st = ds.Store.open(sys.argv[1])
st.save({"w": torch.ones(1000)})
chunks = st.catalog.iter_chunks()
next(chunks)  # the parent's read transaction stays open across the fork
before = st.catalog.env.readers()
pid = os.fork()
if pid == 0:
    chunks.close()  # as the collector would end the inherited generator
    try:
        ds.Store.open(sys.argv[1])
    except ds.StoreClosedError:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print("slot kept:", st.catalog.env.readers() == before and str(os.getpid()) in before)
print("rest:", len(list(chunks)) >= 0)
st.close()
"""


def test_a_forked_child_leaves_the_parents_read_slots_alone(tmp_path: Path) -> None:
    """A child that reopened the store closed the LMDB environment it inherited, and one that ended an inherited
    generator ended its transaction: either reset the parent's reader slot in the lock file they share, leaving the
    parent's snapshot unprotected (a review read 2,000 of 2,000 values wrong after writes)."""
    script = tmp_path / "fork_reader.py"
    script.write_text(_FORK_READER)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "s")], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["slot kept: True", "rest: True"]


def test_a_failed_save_the_caller_heard_of_is_not_raised_again_at_the_next(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed sync save raised at the call, and again at the next (valid) save, which was refused: a loop
    that catches a failed checkpoint and goes on lost the next one too (a hunt). A background failure nobody
    looked at is still raised at the next call."""
    real = Tier.write_manifest
    fail = [True]

    def write_manifest(self: Tier, *args: object, **kwargs: object) -> object:
        if fail[0]:
            fail[0] = False
            raise OSError(errno.ENOSPC, "simulated full disk")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Tier, "write_manifest", write_manifest)
    with Store.open(tmp_path / "s") as s:
        with pytest.raises(DataStatesError):
            s.save({"w": torch.ones(3)}, step=1)
        v = s.save({"w": torch.full((3,), 2.0)}, step=2)
        assert v.step == 2 and [x.step for x in s.log("main")] == [2]
        fail[0] = True
        h = s.save_async({"w": torch.full((3,), 3.0)}, step=3)
        assert isinstance(h.exception(), OSError)  # looked at: not raised again
        s.wait()
        fail[0] = True
        s.save_async({"w": torch.full((3,), 4.0)}, step=4)
        with pytest.raises(SaveFailedError, match="1 earlier background save"):
            s.wait()  # nobody looked at this one
        assert [x.step for x in s.log("main")] == [2]


def test_an_interrupted_sync_save_is_not_committed_from_bytes_changed_after(tmp_path: Path) -> None:
    """A sync save reads the caller's tensors in place. Interrupted (Ctrl-C) while it waited, it went on in the
    background while the caller changed them: it committed the changed values (or, read between hashing and
    writing, chunks that did not match their ids: an unloadable version, reused by every later save of the same
    values; a hunt). Now the save is dropped unless its commit had begun. The test holds the writers lock, so the
    commit cannot have begun when the interrupt lands."""
    import os
    import signal

    from datastates.base.locks import flocked

    path = tmp_path / "s"
    helper = Path(__file__).parent / "helpers" / "interrupted_save.py"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, str(helper), str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        with flocked(path / "locks" / "writers.lock"):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "SAVING"
            proc.send_signal(signal.SIGINT)
            assert proc.stdout.readline().strip() == "INTERRUPTED", proc.stderr.read()
            assert proc.stdout.readline().strip() == "MUTATED"
        proc.stdin.write("released\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["HEAD", "0", "0"]  # step 1 never committed; fsck: no problem
        assert proc.stdout.readline().split() == ["RELOADED", "True"]
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_forked_childs_close_does_not_wait_for_a_close_in_the_parent(tmp_path: Path) -> None:
    """close() took its lock before it looked for a forked child: a parent thread inside close() at the fork (its
    saves draining) left the lock held in the child, whose close() (a `with` block's end) then waited for ever (a
    review)."""
    import os
    import signal

    s = Store.open(tmp_path / "s")
    s.save({"w": torch.zeros(4)})
    with s._closing:  # held, as by a parent thread in close() when the fork happens
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # the child would wait for ever: SIGALRM ends it instead (a non-zero status)
            try:
                s.close()
            finally:
                os._exit(0 if s.repo.released else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    s.close()
    assert s.repo.released


def test_close_lets_the_files_go_when_stopping_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error (not an interrupt) from the flusher's stop at close() left the files open and the exit hook in:
    every later close() ran the stop again and raised again, and the store could not be opened again in that
    process (a review). The error is raised once; the files go."""
    from datastates.maintenance.flush import Flusher

    cold, hot = tmp_path / "cold", tmp_path / "hot"
    s = Store.open(cold, hot=hot)
    v = s.save({"w": torch.ones(8)})
    assert s.flush(timeout=60)

    def gone(self: Flusher, drain: bool = True) -> None:
        raise OSError(errno.EIO, "cold tier went away")

    monkeypatch.setattr(Flusher, "stop", gone)
    with pytest.raises(OSError, match="cold tier went away"):
        s.close()
    assert s.repo.released
    s.close()  # closing a closed store does nothing
    monkeypatch.undo()
    with Store.open(cold, hot=hot) as again:
        assert again.load(v.id)["w"].tolist() == [1.0] * 8
