"""Every tensor comes back as it was saved: requires_grad of plain tensors, conjugate and negative
views, unsupported layouts refused by name, and changes made through one view of a shared storage
seen by diff and history for every key that sees them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import datastates as ds


@pytest.fixture()
def store(tmp_path: Path) -> ds.Store:
    s = ds.Store.open(tmp_path / "s", chunk_size=4096)
    yield s
    s.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_requires_grad_of_a_plain_tensor_survives(store: ds.Store, mode: str) -> None:
    state = {"log_alpha": torch.zeros(1, requires_grad=True), "frozen": torch.ones(2),
             "w": torch.nn.Parameter(torch.ones(3)), "w_frozen": torch.nn.Parameter(torch.ones(3), requires_grad=False)}
    v = store.save(state) if mode == "sync" else store.save_async(state).result()
    out = store.load(v)
    assert out["log_alpha"].requires_grad and out["log_alpha"].is_leaf
    assert type(out["log_alpha"]) is torch.Tensor
    assert not out["frozen"].requires_grad
    assert isinstance(out["w"], torch.nn.Parameter) and out["w"].requires_grad
    assert isinstance(out["w_frozen"], torch.nn.Parameter) and not out["w_frozen"].requires_grad
    out["log_alpha"].sum().backward()  # trainable again, as torch.load gives it back
    assert out["log_alpha"].grad is not None and out["log_alpha"].grad.tolist() == [1.0]


def test_conjugate_and_negative_views_are_saved_as_their_values(store: ds.Store) -> None:
    z = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, generator=torch.Generator().manual_seed(1))
    state = {"z": z, "zc": z.conj(), "neg": torch._neg_view(x), "zcn": torch._neg_view(z.conj())}
    out = store.load(store.save(state))
    assert torch.equal(out["z"], z)
    assert torch.equal(out["zc"], z.conj().resolve_conj()) and not out["zc"].is_conj()
    assert torch.equal(out["neg"], -x) and not out["neg"].is_neg()
    assert torch.equal(out["zcn"], -z.conj().resolve_conj())


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["nested", "jagged"])
def test_nested_tensors_are_refused_by_key_and_layout(store: ds.Store, layout: torch.layout) -> None:
    store.save({"a": torch.ones(1)})
    before = store.log()
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(ds.UnsupportedValueError, match=r"model\.seq is a nested tensor") as err:
        store.save({"model": {"seq": nt}})
    assert "unbind" in str(err.value)
    assert [v.id for v in store.log()] == [v.id for v in before]


def test_sparse_tensor_is_refused_with_the_layout(store: ds.Store) -> None:
    with pytest.raises(ds.UnsupportedValueError, match=r"sp is a torch.sparse_coo tensor"):
        store.save({"sp": torch.eye(3).to_sparse()})


def test_a_change_through_one_view_shows_in_diff_and_history_of_the_other(store: ds.Store) -> None:
    flat = torch.zeros(3000)  # a flat-buffer model: two keys view one storage
    state = {"a": flat[:1000].view(10, 100), "b": flat[1000:]}
    v1 = store.save(state, step=1)
    flat[2500] = 2.0  # written through the storage: only `b` sees it
    v2 = store.save(state, step=2)
    rows = {r["key"]: r for r in store.diff(v1, v2).to_pylist()}
    assert rows["a"]["status"] == "same" and rows["a"]["l2_change"] == 0.0
    assert rows["b"]["status"] == "changed" and rows["b"]["l2_change"] == 2.0 and rows["b"]["max_abs_diff"] == 2.0
    hist_b = store.history("b").to_pylist()
    hist_a = store.history("a").to_pylist()
    assert [r["chunks_changed"] for r in hist_b] == [None, 1]
    assert [r["chunks_changed"] for r in hist_a] == [None, 0]
    assert torch.equal(store.load(v2)["b"], flat[1000:])
