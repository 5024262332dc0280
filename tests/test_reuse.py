"""reuse_unchanged: tensors torch's version counter says are untouched are not copied or hashed again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import datastates as ds


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(64 * 1024, generator=g) for i in range(10)}


def test_unchanged_tensors_reuse_chunks_and_stats(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    state = _state()
    v1 = s.save(state)
    state["t3"].mul_(2)  # an in-place op bumps the version counter
    state["t7"][5] = 42.0
    v2 = s.save(state)
    assert v2.bytes_new == 2 * 64 * 1024 * 4
    loaded = s.load(v2)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    stats1 = {i.key: i.stats for i in s.ls(v1)}
    stats2 = {i.key: i.stats for i in s.ls(v2)}
    assert stats2["t0"] == stats1["t0"]
    assert stats2["t3"]["max"] == stats1["t3"]["max"] * 2
    s.close()


def test_a_replaced_tensor_is_copied_again(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    state = _state()
    s.save(state)
    state["t1"] = torch.zeros(64 * 1024)  # new storage under the same key
    v = s.save(state)
    assert torch.equal(s.load(v)["t1"], torch.zeros(64 * 1024))
    s.close()


def test_another_tensor_at_the_same_address_and_version_is_saved_anew(tmp_path: Path) -> None:
    # Two storages over one numpy buffer, one after the other: the same address, the same version counter (0),
    # other values. The allocator does the same to a tensor freed and another of its size made next; before the
    # signature held the storage, the second save stored the first tensor's chunks for the second one.
    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    buf = np.ones(64 * 1024, dtype=np.float32)
    first = torch.from_numpy(buf)
    address = first.data_ptr()
    s.save({"w": first})
    del first
    buf[:] = 2.0
    second = torch.from_numpy(buf)
    assert (second.data_ptr(), second._version) == (address, 0)
    v = s.save({"w": second})
    assert v.bytes_new == 64 * 1024 * 4
    assert torch.equal(s.load(v)["w"], torch.full((64 * 1024,), 2.0))
    s.close()


def test_state_dict_tensors_of_unchanged_parameters_are_reused(tmp_path: Path) -> None:
    # `model.state_dict()` makes new tensor objects on every call, over the parameters' own storages: those
    # untouched since the last save are still reused, the stepped one is saved again.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    s.save(model.state_dict())
    with torch.no_grad():
        model[1].weight.add_(1.0)
    v = s.save(model.state_dict())
    assert v.bytes_new == 256 * 256 * 4
    loaded = s.load(v)
    assert all(torch.equal(loaded[k], t) for k, t in model.state_dict().items())
    s.close()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
], ids=["adamw", "sgd", "adagrad"])
@pytest.mark.parametrize("form", ["objects", "state_dicts"])
def test_fused_optimizer_steps_are_seen(tmp_path: Path, make: Any, form: str) -> None:
    """A fused step bumps no version counter, and reuse_unchanged saved the first checkpoint's weights and moments
    at every later save (a review). A step post-hook bumps them for what the step wrote."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = make(model.parameters())
    frozen = torch.nn.Linear(2, 2)  # never stepped: reused
    with ds.Store.open(tmp_path / "s", reuse_unchanged=True) as store:
        for step in range(3):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = ({"model": model, "optim": opt, "frozen": frozen} if form == "objects" else
                     {"model": model.state_dict(), "optim": opt.state_dict(), "frozen": frozen.state_dict()})
            v = store.save(state, step=step)
            got = store.load(v)
            want = {k: t.detach().clone() for k, t in model.state_dict().items()}
            for k in want:
                assert torch.equal(got["model"][k], want[k]), (step, k)
            moments = [t for st in opt.state_dict()["state"].values() for t in st.values() if t.dim()]
            saved = [t for st in got["optim"]["state"].values() for t in st.values() if t.dim()]
            assert moments and all(torch.equal(a, b) for a, b in zip(saved, moments)), step
            assert torch.equal(got["frozen"]["weight"], frozen.weight.detach())


def test_off_by_default_so_writes_through_data_are_saved(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "s")
    state = _state()
    s.save(state)
    state["t2"].data.fill_(3.0)  # bypasses the version counter
    v = s.save(state)
    assert torch.equal(s.load(v)["t2"], torch.full((64 * 1024,), 3.0))
    assert s.save(state, reuse_unchanged=True).bytes_new == 0
    s.close()


def test_the_record_is_made_after_the_caller_has_its_version_and_the_next_save_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `remember` runs on the pipeline thread after the sync save returned; a reuse_unchanged save right after
    # waits for it, and so still reuses every unchanged tensor.
    from datastates.save.saver import Saver

    go = threading.Event()
    order: list[str] = []
    real = Saver.remember

    def remember(self: Saver, job: Any) -> None:
        order.append("remember blocked" if go.wait(timeout=120) else "remember timed out")
        real(self, job)
        order.append("remembered")

    monkeypatch.setattr(Saver, "remember", remember)
    with ds.Store.open(tmp_path / "s") as s:
        state = _state()
        v1 = s.save(state)
        order.append("save returned")  # before remember could run: go is not set yet
        go.set()
        copied: list[int] = []
        real_reuse = Saver._reuse_unchanged

        def reuse(self: Saver, job: Any, *args: Any) -> bool:
            out = real_reuse(self, job, *args)
            copied.append(sum(e.source is not None for e in job.entries if e.kind == "tensor"))
            return out

        monkeypatch.setattr(Saver, "_reuse_unchanged", reuse)
        state["t3"].mul_(2)
        v2 = s.save(state, reuse_unchanged=True)
        assert order[:3] == ["save returned", "remember blocked", "remembered"]
        assert copied == [1] and v2.bytes_new == 64 * 1024 * 4  # only t3 copied; the other 9 reused
        assert v1.id != v2.id and torch.equal(s.load(v2)["t3"], state["t3"])


def test_a_gc_between_the_call_and_the_pipeline_fails_the_save_and_the_next_one_writes_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # reuse_unchanged names the chunks of untouched tensors on the caller's thread, before the job holds the
    # guard that keeps gc out. A gc that drops them in between is caught under the guard: the save fails with
    # ConflictError and writes nothing; the next save finds them gone and copies the tensors again.
    from datastates.maintenance.gc import gc
    from datastates.retention import KeepLatest, Retention, prune
    from datastates.save.saver import Saver

    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    state = _state()
    first = s.save(state)
    head = s.save({"other": torch.ones(4)})
    prune(s, Retention(KeepLatest(1)))  # `first` loses its bytes' only owner; gc has not run yet
    real = Saver._reuse_unchanged
    collected: list[int] = []

    def reuse_then_collect(self: Saver, job: Any, *args: Any) -> bool:
        reused = real(self, job, *args)
        if reused and not collected:
            collected.append(gc(s).chunks_dropped)
        return reused

    monkeypatch.setattr(Saver, "_reuse_unchanged", reuse_then_collect)
    with pytest.raises(ds.ConflictError, match="removed by a gc"):
        s.save(state)
    assert collected == [len(state)] and s.resolve("main") == head.id and s.version(first).pruned
    again = s.save(state)  # the failed save raised at its call, and only there
    assert again.bytes_new == sum(t.nbytes for t in state.values())
    back = s.load(again)
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert s.fsck().ok
    s.close()


def test_the_tensors_a_reuse_save_captures_are_hashed_from_their_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small tensors of a sync save are read in place; those a reuse_unchanged save captures changed, so they
    # are copied first and hashed from the copy: no byte view of the caller's memory is made for them.
    from datastates.save.buffers import InPlace

    views: list[int] = []
    real = InPlace.views

    def counting(self: InPlace) -> list[memoryview]:
        out = real(self)
        views.append(len(out))
        return out

    monkeypatch.setattr(InPlace, "views", counting)
    g = torch.Generator().manual_seed(3)
    state = {f"s{i:02d}": torch.randn(4096, generator=g) for i in range(40)}
    with ds.Store.open(tmp_path / "s") as s:
        s.save(state)
        assert views == [40]  # a first save hashes in place
        for k in ("s03", "s17", "s31"):
            state[k].add_(1)
        v = s.save(state, reuse_unchanged=True)
        assert views == [40]
        assert v.bytes_new == 3 * 4096 * 4
        got, want = s.load(v), {k: t.clone() for k, t in state.items()}
        rows = {r["key"]: r for r in s.manifest(v.manifests["0"]).rows}
        state["s05"].add_(1)
        s.save(state)  # a plain sync save hashes in place again
        assert views == [40, 40]
    assert all(torch.equal(got[k], want[k]) for k in state)
    assert rows["s17"]["max"] == float(want["s17"].max())


def test_a_reuse_save_keeps_the_committed_rows_of_unchanged_tensors(tmp_path: Path) -> None:
    """An unchanged tensor's row in a reuse save is the very row committed for it before (no new row, chunk list
    or signature per unchanged tensor); a changed tensor gets a new row, which the next save keeps in turn. Every
    version still loads its own bytes and lists its own statistics."""
    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    state = _state()
    saved = []
    for change in (None, "t3", "t5"):
        if change is not None:
            state[change].mul_(2)
        v = s.save(state)
        s._saver.pipeline.settled.wait()  # the record of the commit (`Saver.remember`) is made after it returns
        saved.append((v, {k: t.clone() for k, t in state.items()}, dict(s._saver.memory.by_key)))
    (v1, _, rows1), (v2, _, rows2), (v3, _, rows3) = saved
    assert [k for k in state if rows2[k] is not rows1[k]] == ["t3"]
    assert [k for k in state if rows3[k] is not rows2[k]] == ["t5"]
    assert rows3["t3"] is rows2["t3"] and rows2["t3"].chunks != rows1["t3"].chunks
    assert (v2.bytes_new, v3.bytes_new) == (64 * 1024 * 4, 64 * 1024 * 4)
    for v, values, _ in saved:
        loaded = s.load(v)
        assert all(torch.equal(loaded[k], values[k]) for k in state)
        assert {i.key: i.stats["max"] for i in s.ls(v)} == {k: t.max().item() for k, t in values.items()}
    s.close()


def test_a_reuse_save_through_the_kept_flatten_makes_rows_only_for_changed_tensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept flatten gives an unchanged tensor its committed row without making a fresh one first: a reuse save
    that changed 2 of 10 tensors makes 2 rows. One whose chunks a gc may have dropped since (the catalog's drop
    token moved) makes every row and looks the chunks up, as before; a plain save makes every row. Every version
    loads its own bytes."""
    from datastates.maintenance.gc import gc
    from datastates.retention import KeepIf, prune
    from datastates.save import tree as tree_mod

    made: list[int] = []
    real = tree_mod.TensorEntry

    def counting(*args: Any, **kw: Any) -> Any:
        made.append(1)
        return real(*args, **kw)

    s = ds.Store.open(tmp_path / "s", reuse_unchanged=True)
    state = _state()
    s.save(state)  # the first flatten, kept
    s.save(state)  # through the kept flatten: every row its committed one
    monkeypatch.setattr(tree_mod, "TensorEntry", counting)
    saved = []
    for changed, expect in ((("t3", "t5"), 2), (("t1",), 1), ((), 0)):
        for k in changed:
            state[k].add_(1)
        s._saver.pipeline.settled.wait()
        made.clear()
        v = s.save(state)
        assert len(made) == expect, changed
        assert v.bytes_new == expect * 64 * 1024 * 4
        saved.append((v, {k: t.clone() for k, t in state.items()}))
    with ds.Store.open(tmp_path / "s") as other:  # another handle: `s` keeps its kept flatten
        side = other.save({"other": torch.ones(3)}, branch="side")
        other.delete_branch("side", force=True)
        prune(other, KeepIf(lambda v: v.id != side.id))
        assert gc(other).chunks_dropped == 1  # a chunk left the index: the remembered rows' are looked up again
    state["t0"].add_(1)
    s._saver.pipeline.settled.wait()
    made.clear()
    v = s.save(state)
    assert len(made) == len(state) and v.bytes_new == 64 * 1024 * 4
    saved.append((v, {k: t.clone() for k, t in state.items()}))
    made.clear()
    s.save(state, reuse_unchanged=False)
    assert len(made) == len(state)
    for v, values in saved:
        loaded = s.load(v)
        assert all(torch.equal(loaded[k], values[k]) for k in state)
    assert s.fsck().ok
    s.close()
