"""The caller's part of a save of many small tensors (issue 13): copies shared with the copier thread, and the
rows of a cached flatten made by the pipeline, off the caller's time. Asserts which thread did what (waiting
on events, never on time), every batch copied once, errors reported, and the bytes and values that land."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import datastates as ds
from datastates.save import capture as capture_mod
from datastates.save import tree as tree_mod
from datastates.save.copier import Copier

_WAIT = 60.0  # a bound on a wait for the other thread, so a broken hand-off fails instead of hanging


def test_both_threads_take_batches_and_each_batch_runs_once() -> None:
    copier = Copier()
    ran: list[tuple[int, str]] = []
    second = threading.Event()

    def copy(i: int) -> None:
        ran.append((i, threading.current_thread().name))
        if i == 0:
            # Hold the first batch until the other thread has claimed the second: both must take part.
            assert second.wait(_WAIT)
        elif i == 1:
            second.set()

    try:
        copier.run(6, copy)
    finally:
        copier.stop()
    assert sorted(i for i, _ in ran) == list(range(6))
    assert {name for i, name in ran if i in (0, 1)} == {threading.current_thread().name, "datastates-copier"}


def test_an_error_in_one_batch_reaches_the_caller_after_every_batch_ran() -> None:
    copier = Copier()
    ran: list[int] = []

    def copy(i: int) -> None:
        ran.append(i)
        if i == 2:
            raise ValueError("batch 2")

    try:
        with pytest.raises(ValueError, match="batch 2"):
            copier.run(5, copy)
        copier.run(3, ran.append)  # the thread survives a failed batch
    finally:
        copier.stop()
    assert sorted(ran) == [0, 0, 1, 1, 2, 2, 3, 4]


def _small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    st: dict[str, torch.Tensor] = {}
    for i in range(2500):
        n = 1 + (i * 53) % 1500  # odd sizes: alignment padding between pieces, inside and across batches
        dt = (torch.float32, torch.float16, torch.int64, torch.uint8)[i % 4]
        st[f"p.{i:04d}"] = (torch.randn(n, generator=g) * 50).to(dt)
    return st


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sync", [False, True])
def test_captures_with_and_without_the_copier_load_back_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               sync: bool) -> None:
    shared: list[int] = []
    real = Copier.run

    def counted(self: Copier, n: int, copy: Any) -> None:
        shared.append(n)
        real(self, n, copy)

    monkeypatch.setattr(Copier, "run", counted)
    st = _small_state()
    nbytes = sum(t.numel() * t.element_size() for t in st.values())
    with ds.Store.open(tmp_path / "s") as store:
        versions: list[Any] = []
        expected = []
        for _ in range(3):  # a fresh flatten, then a kept one, then its kept layout
            versions.append(store.save(st) if sync else store.save_async(st))
            expected.append({k: v.clone() for k, v in st.items()})
            for v in st.values():
                v.add_(1)  # right after the call returns: the save must keep the bytes of the call
        backs = [store.load(v if sync else v.result()) for v in versions]
    assert all(_equal(b, e) for b, e in zip(backs, expected))
    # save_async: one 16 MiB slot a save, in batches of ~1 MiB, shared on every save; a sync save copies alone
    # (its hashing workers need the cores, and a faster capture would only fill more of the pool)
    assert shared == ([] if sync else [-(-nbytes // capture_mod._BATCH_BYTES)] * 3)


def test_rows_of_a_cached_flatten_are_made_later_with_the_version_counters_of_the_call() -> None:
    st = {"a": torch.zeros(4), "b": torch.ones(3)}
    cache = tree_mod.FlattenCache()
    cache.flatten_kept(st)
    _, rows, plans = cache.flatten_kept(st, defer=True)[:3]
    assert callable(rows) and plans is not None
    before = st["a"]._version
    st["a"].add_(1)  # after the call, before the rows are made
    made = rows()
    assert isinstance(made, list)
    assert [e.sig[1] if e.sig else None for e in made] == [before, st["b"]._version]
    eager = cache.flatten_kept(st)[1]  # no defer: rows now
    assert isinstance(eager, list) and eager[0].sig is not None and eager[0].sig[1] == before + 1


def test_save_async_of_a_cached_state_makes_its_rows_on_the_pipeline(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    made_on: list[str] = []
    hold = threading.Event()
    real = tree_mod._Flattened._rows

    def rows(self: Any, versions: list[int], tensors: Any, **kw: Any) -> Any:
        made_on.append(threading.current_thread().name)
        if threading.current_thread().name == "datastates-pipeline":  # wait until the caller has changed "a"
            assert hold.wait(_WAIT)
        return real(self, versions, tensors, **kw)

    monkeypatch.setattr(tree_mod._Flattened, "_rows", rows)
    st = {"a": torch.zeros(1000), "b": torch.ones(1000)}
    with ds.Store.open(tmp_path / "s") as store:
        store.save_async(st).result()  # a fresh flatten, kept
        store.save_async(st).result()  # the kept flatten; its slot layout is made (from the rows) and kept
        h = store.save_async(st)  # the kept flatten and layout: rows not needed until the pipeline asks
        st["a"].add_(5)  # the save has the zeros; its rows are not made yet
        hold.set()
        first = store.load(h.result())
        # reuse_unchanged compares version counters: "a" changed after the call, so it is saved again
        v = store.save(st, reuse_unchanged=True)
        second = store.load(v)
    assert made_on == ["MainThread", "datastates-pipeline", "MainThread"]
    assert torch.equal(first["a"], torch.zeros(1000)) and torch.equal(second["a"], torch.full((1000,), 5.0))
    assert torch.equal(second["b"], torch.ones(1000))


def test_finished_saves_leave_no_job_for_the_collector(tmp_path: Path) -> None:
    import gc

    from datastates.save.job import SaveJob

    st = {f"t{i}": torch.randn(100) for i in range(50)}
    was = gc.isenabled()
    gc.disable()  # a job in a reference cycle would stay until the collector runs: count what refcounting left
    try:
        with ds.Store.open(tmp_path / "s") as store:
            for _ in range(4):
                store.save(st)
                store.save_async(st).result()
            alive = sum(1 for o in gc.get_objects() if type(o) is SaveJob)
    finally:
        if was:
            gc.enable()
    assert alive <= 1  # at most the last one, still named by a local of the pipeline thread's loop
