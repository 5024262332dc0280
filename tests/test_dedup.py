"""Dedup: bytes already in the store are never written again.

Tensors here are smaller than the chunk size (or aligned to it), so byte counts are exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from helpers.states import assert_same

import datastates as ds

KIB = 1 << 10


def packs_on_disk(store: ds.Store) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store.path / "packs").glob("*.pack")}


def twenty(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"layers": {f"l{i:02d}": torch.randn(16 * KIB, generator=g) for i in range(20)}, "step": 0}  # 64 KiB each


def test_same_state_twice_adds_nothing(store: ds.Store) -> None:
    state = twenty()
    v1 = store.save(state, step=1)
    assert v1.bytes_total == 20 * 64 * KIB
    assert v1.bytes_new == v1.bytes_total and v1.chunks_new == 20
    du1, packs1 = store.du(), packs_on_disk(store)
    assert du1["bytes_unique"] == 20 * 64 * KIB
    v2 = store.save(state, step=2)
    assert v2.id != v1.id and v2.parents == (v1.id,)
    assert (v2.bytes_new, v2.chunks_new) == (0, 0)
    assert v2.bytes_total == v1.bytes_total
    du2 = store.du()
    assert du2["bytes_unique"] == du1["bytes_unique"]
    assert du2["bytes_total"] == 2 * du1["bytes_total"]
    assert packs_on_disk(store) == packs1
    assert_same(store.load(v2), state)


def test_two_changed_tensors_add_only_their_bytes(store: ds.Store) -> None:
    state = twenty()
    store.save(state)
    before = store.du()["bytes_unique"]
    state["layers"]["l03"] = state["layers"]["l03"] + 1
    state["layers"]["l17"][5] = 42.0  # one element is enough: the whole (single-chunk) tensor is new
    v = store.save(state)
    assert v.bytes_new == 2 * 64 * KIB
    assert v.chunks_new == 2
    assert store.du()["bytes_unique"] == before + 2 * 64 * KIB
    assert_same(store.load(v), state)


def test_change_inside_a_large_tensor_adds_one_chunk(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s", chunk_size=64 * KIB) as s:
        big = torch.randn(256 * KIB)  # 1 MiB = 16 chunks
        original = big.clone()
        v1 = s.save({"big": big})
        assert (v1.bytes_new, v1.chunks_new) == (1 << 20, 16)
        big[100 * KIB] = -1.0  # byte offset 400 KiB: chunk 6
        v2 = s.save({"big": big})
        assert (v2.bytes_new, v2.chunks_new) == (64 * KIB, 1)
        assert s.ls(v2)[0].chunks == 16
        assert torch.equal(s.load(v2)["big"], big)
        assert torch.equal(s.load(v1)["big"], original)  # the save copied the tensor before it changed


def test_equal_tensors_in_one_save_are_stored_once(store: ds.Store) -> None:
    t = torch.randn(16 * KIB)
    v = store.save({"a": t, "b": t.clone(), "c": [t.clone()]})  # equal bytes, distinct storages
    assert v.bytes_total == 3 * 64 * KIB
    assert (v.bytes_new, v.chunks_new) == (64 * KIB, 1)
    got = store.load(v)
    assert torch.equal(got["a"], t) and torch.equal(got["b"], t) and torch.equal(got["c"][0], t)


def test_dedup_between_saves_in_flight(store: ds.Store) -> None:
    state = twenty(1)
    h1, h2 = store.save_async(state, branch="x"), store.save_async(state, branch="y")
    v1, v2 = h1.result(), h2.result()
    assert v1.bytes_new + v2.bytes_new == 20 * 64 * KIB
    assert store.du()["bytes_unique"] == 20 * 64 * KIB


def test_dedup_across_branches_and_reopen(tmp_path: Path) -> None:
    state = twenty(2)
    with ds.Store.open(tmp_path / "s") as s:
        s.save(state, branch="a")
        size = packs_on_disk(s)
    with ds.Store.open(tmp_path / "s") as s:
        v = s.save(state, branch="b")
        assert v.bytes_new == 0
        assert packs_on_disk(s) == size


def test_dedup_after_catalog_rebuild(tmp_path: Path) -> None:
    state = twenty(3)
    with ds.Store.open(tmp_path / "s") as s:
        v1 = s.save(state)
        size = packs_on_disk(s)
    shutil.rmtree(tmp_path / "s" / "catalog")
    with ds.Store.open(tmp_path / "s") as s:  # rebuilds the index from the files
        assert s.resolve("main") == v1.id
        v2 = s.save(state)
        assert v2.bytes_new == 0 and v2.parents == (v1.id,)
        assert packs_on_disk(s) == size
        assert_same(s.load(v1), state)
