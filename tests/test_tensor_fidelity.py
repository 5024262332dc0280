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


def _layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "conv_cl": torch.randn(8, 3, 5, 5, generator=g).to(memory_format=torch.channels_last),
        "conv3d_cl": torch.randn(4, 2, 3, 3, 3, generator=g).to(memory_format=torch.channels_last_3d),
        "transposed": torch.randn(6, 9, generator=g).t(),
        "permuted": torch.randn(2, 3, 4, generator=g).permute(2, 0, 1),
        "size_one_dims": torch.randn(1, 7, 1, 3, generator=g).to(memory_format=torch.channels_last),
        "row_major": torch.randn(3, 4, generator=g),
        "stepped": torch.randn(10, 6, generator=g)[::2],  # gaps: values come back, row-major
        "expanded": torch.randn(3, 1, generator=g).expand(3, 5),  # overlaps: values come back, row-major
    }


@pytest.mark.parametrize("how", ["sync", "async", "mmap", "one key"])
def test_dense_layouts_come_back_with_their_strides(store: ds.Store, how: str) -> None:
    """channels_last and transposed tensors came back row-major: a channels_last model resumed with a fused
    optimizer paired each weight with another one's moment (a review: AdamW off by 0.31 after three steps)."""
    state = _layouts()
    v = store.save_async(state).result() if how == "async" else store.save(state)
    for key, want in state.items():
        got = (store.load(v, keys=[key]) if how == "one key" else store.load(v, mmap=how == "mmap"))[key]
        assert torch.equal(got, want), key
        if key in ("stepped", "expanded"):
            assert got.is_contiguous(), key
        else:
            assert got.stride() == want.stride(), key
    got = store.load(v)
    assert got["conv_cl"].is_contiguous(memory_format=torch.channels_last)
    assert got["conv3d_cl"].is_contiguous(memory_format=torch.channels_last_3d)
    again = store.save(got)  # the same bytes: nothing new stored, nothing changed in the record's values
    assert store.manifest_of(again).rows == store.manifest_of(store.version(v)).rows


def test_a_channels_last_model_resumes_a_fused_optimizer_as_torch_load_does(store: ds.Store, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    step(model, opt)
    v = store.save({"model": model.state_dict(), "optim": opt.state_dict()})
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ref.pt")
    resumed = []
    for source in ("datastates", "torch"):
        sd = store.load(v) if source == "datastates" else torch.load(tmp_path / "ref.pt", weights_only=True)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 3))
        m = m.to(memory_format=torch.channels_last)
        m.load_state_dict(sd["model"])
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        o.load_state_dict(sd["optim"])
        for _ in range(3):
            step(m, o)
        resumed.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*resumed):
        assert torch.equal(a, b)


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


def test_one_tensor_under_keys_with_other_flags_keeps_each_keys_flags(store: ds.Store) -> None:
    """`{"a": t, "b": t.detach()}` with t trainable gave b trainable too (one object for both keys), and a Parameter
    under two keys came back as two Parameters (a review); torch.load gives one Parameter, and b not trainable."""
    t = torch.ones(3, requires_grad=True)
    p = torch.nn.Parameter(torch.arange(3.0))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    state = {"a": t, "b": t.detach(), "p": p, "tied": p, "p_data": p.detach(), "frozen": frozen, "f2": frozen}
    for how in ("sync", "async"):
        v = store.save(state) if how == "sync" else store.save_async(state).result()
        got = store.load(v)
        assert got["a"].requires_grad and not got["b"].requires_grad
        assert got["a"].data_ptr() == got["b"].data_ptr()  # still one storage
        assert got["p"] is got["tied"] and isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
        assert type(got["p_data"]) is torch.Tensor and not got["p_data"].requires_grad
        assert got["p_data"].data_ptr() == got["p"].data_ptr()
        assert got["frozen"] is got["f2"] and not got["frozen"].requires_grad
        got["b"][0] = 7.0  # one storage: a sees it, as after torch.load
        assert got["a"][0].item() == 7.0
