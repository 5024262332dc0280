"""datastates.plot: each figure shows the numbers the store holds (stats, diffs, tensor values, the DAG)."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import datastates as ds
from datastates import plot
from datastates.pbt import Population

KEYS = ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]


def _train_store(root: Path) -> ds.Store:
    """main: 6 versions of a small MLP trained by SGD with the last layer frozen after step 3;
    a fork 'ft' from main~3 (2 versions); a merge 'soup' of main and ft; a tag 'best'."""
    torch.manual_seed(0)
    store = ds.Store.open(root)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(64, 6), torch.randn(64, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        if step >= 3:
            for p in model[2].parameters():
                p.requires_grad_(False)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        store.save({"model": model, "note": f"step {step}"}, step=step * 10, metrics={"loss": loss.item()})
    store.tag("best", "main~1")
    store.branch("ft", at="main~3")
    state = store.load("ft")
    for step in (100, 110):
        state["model"]["0.weight"] = state["model"]["0.weight"] * 1.5
        store.save(state, branch="ft", step=step, metrics={"loss": 0.5})
    soup = store.load("main")
    store.save(soup, branch="soup", parents=["main", "ft"], step=200)
    return store


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Any:
    store = _train_store(tmp_path_factory.mktemp("plot") / "store")
    yield store
    store.close()


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _tensor(store: ds.Store, ref: str, key: str) -> torch.Tensor:
    top, rest = key.split(".", 1)
    return store.load(ref, keys=[key])[top][rest]


def test_norms_plots_the_stored_l2_of_each_tensor_against_step(trained: ds.Store) -> None:
    fig = plot.norms(trained, "main")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert sorted(lines) == sorted(KEYS)
    for key in KEYS:
        hist = trained.history(key, "main")
        assert lines[key].get_xdata().tolist() == hist.column("step").to_pylist() == [0, 10, 20, 30, 40, 50]
        np.testing.assert_allclose(lines[key].get_ydata(), hist.column("l2").to_pylist())
        np.testing.assert_allclose(lines[key].get_ydata()[-1], float(_tensor(trained, "main", key).norm()),
                                   rtol=1e-5)
    assert _png(fig)[:8] == b"\x89PNG\r\n\x1a\n"


def test_norms_mark_versions_whose_tensor_held_nan_or_inf(tmp_path: Path) -> None:
    """The norms are of the finite values: a tensor gone NaN drew an unremarkable line (l2 of what was left)."""
    nan = float("nan")
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"w": torch.tensor([3.0, 4.0]), "v": torch.ones(2)}, step=0)
        s.save({"w": torch.tensor([3.0, nan]), "v": torch.ones(2)}, step=1)
        s.save({"w": torch.tensor([float("inf"), 4.0]), "v": torch.ones(2)}, step=2)
        data = plot.norms_data(s, "main")
        assert data.values["w"].tolist() == [5.0, 3.0, 4.0]
        assert data.nonfinite["w"].tolist() == [False, True, True] and not data.nonfinite["v"].any()
        fig = plot.norms(s, "main")
    marks = {c.get_gid(): c.get_offsets().tolist() for c in fig.axes[0].collections}
    assert marks == {"nonfinite:w": [[1.0, 3.0], [2.0, 4.0]]}
    assert "holds NaN/inf (stats of the finite values)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_norms_selects_keys_by_glob_and_other_stats(trained: ds.Store) -> None:
    data = plot.norms_data(trained, "ft", "model.*.bias", stat="mean")
    assert sorted(data.values) == ["model.0.bias", "model.2.bias"]
    assert data.x.tolist() == [0, 10, 20, 100, 110]
    assert data.values["model.2.bias"][-1] == pytest.approx(float(_tensor(trained, "ft", "model.2.bias").mean()))


def test_norms_refuses_unknown_stat_and_keys_matching_nothing(trained: ds.Store) -> None:
    with pytest.raises(ds.InvalidArgumentError, match="l2"):
        plot.norms(trained, "main", stat="l3")
    with pytest.raises(ds.NotFoundError, match="datastates ls main"):
        plot.norms(trained, "main", keys="model.9.*")
    with pytest.raises(ds.NotFoundError, match="did you mean model.0.weight"):
        plot.update_ratios(trained, "main", keys="model.0.wieght")
    with pytest.raises(ds.NotFoundError):
        plot.norms(trained, "no-such-branch")


def test_norms_of_a_tied_weight_are_those_of_the_tensor_it_shares(tmp_path: Path) -> None:
    """A tied weight is stored as an alias of the other key: `ls` showed no statistics for it, and norms left it
    out (asked by name: 'no tensor matches model.head.weight; did you mean model.head.weight?')."""
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    with ds.Store.open(tmp_path / "s") as s:
        for i in range(3):
            with torch.no_grad():
                emb.weight.mul_(2.0)
            s.save({"model": model}, step=i)
        assert {t.key: t.kind for t in s.ls()} == {"model.emb.weight": "tensor", "model.head.weight": "alias"}
        data = plot.norms_data(s, "main")
        assert set(data.values) == {"model.emb.weight", "model.head.weight"}
        np.testing.assert_allclose(data.values["model.head.weight"], s.history("model.head.weight").column("l2"))
        np.testing.assert_allclose(data.values["model.head.weight"][-1], float(emb.weight.detach().double().norm()))
        assert plot.norms_data(s, "main", "model.head.weight", stat="max").values["model.head.weight"][-1] == \
            float(emb.weight.detach().max())


def test_norms_of_keys_without_the_stat_say_so(tmp_path: Path) -> None:
    """A complex tensor stores no mean, a view no statistics: norms said 'no tensor matches ['z']; did you mean z?'."""
    with ds.Store.open(tmp_path / "s") as s:
        whole = torch.arange(4.0)
        s.save({"z": torch.ones(2, dtype=torch.complex64), "whole": whole, "part": whole[:2]}, step=0)
        with pytest.raises(ds.NotFoundError, match=r"z of 'main' stored no 'mean' statistic \(.*complex.*\); "
                           "`datastates plot histograms z main` draws its values"):
            plot.norms(s, "main", "z", stat="mean")
        assert plot.norms_data(s, "main", "z").values["z"].tolist() == [math.sqrt(2)]  # l2 it has
        with pytest.raises(ds.NotFoundError, match="part of 'main' stored no 'l2' statistic"):
            plot.norms(s, "main", "part")
        with pytest.raises(ds.NotFoundError, match=r"no tensor of 'main' matches \['zz'\]; did you mean z\?"):
            plot.norms(s, "main", "zz")


def test_a_key_pattern_matching_nothing_is_refused_when_others_match(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A pattern that matched nothing was dropped silently when another matched: `datastates plot norms --keys w b`
    (the branch after --keys, which takes every word) drew main's norms of w, reading b as a key."""
    from datastates.cli import main

    with ds.Store.open(tmp_path / "s") as s:
        for i in range(2):
            s.save({"w": torch.full((2,), i + 1.0), "v": torch.ones(2)}, step=i)
        s.branch("b", at="main")
        for call in (plot.norms_data, plot.update_ratios_data):
            with pytest.raises(ds.NotFoundError, match=r"no tensor of 'main' matches \['b'\]"):
                call(s, "main", ["w", "b"])
            assert set(call(s, "main", ["w", "v*"]).keys if call is plot.update_ratios_data
                       else call(s, "main", ["w", "v*"]).values) == {"w", "v"}
    out = tmp_path / "n.png"
    for kind in ("norms", "update-ratios"):
        assert main(["--store", str(tmp_path / "s"), "plot", kind, "--keys", "w", "b", "-o", str(out)]) == 1
        assert "no tensor of 'main' matches ['b']" in capsys.readouterr().err
    assert not out.exists()


def test_update_ratios_are_the_relative_change_of_the_saved_tensors(trained: ds.Store) -> None:
    data = plot.update_ratios_data(trained, "main")
    assert data.keys == sorted(KEYS)
    assert data.x.tolist() == [10, 20, 30, 40, 50]
    chain = [v.id for v in reversed(trained.log("main"))]
    assert data.versions == chain[1:]
    for i, key in enumerate(data.keys):
        for j, (prev, cur) in enumerate(zip(chain, chain[1:])):
            a, b = _tensor(trained, prev, key).double(), _tensor(trained, cur, key).double()
            assert data.ratios[i, j] == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-4, abs=1e-12)
    frozen = [data.keys.index("model.2.bias"), data.keys.index("model.2.weight")]
    # The last layer is frozen from step 30 on: its chunks are shared, its ratio exactly 0, nothing read.
    assert (data.ratios[frozen][:, 2:] == 0.0).all()
    assert (data.ratios[frozen][:, :2] > 0).all()
    assert data.chunks_read == 5 * 2 + 2 * 2  # one chunk per tensor, per changed pair


def test_update_ratios_of_some_keys_read_the_chunks_of_those_keys_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The ratios of one small tensor read every changed chunk of every tensor (the whole diff of each pair)."""
    from datastates.repo.repository import Repository

    with ds.Store.open(tmp_path / "s", chunk_size=1024) as s:
        big, small = torch.zeros(4096), torch.ones(4)
        for i in range(3):
            big += 1.0
            small *= 2.0
            s.save({"big": big, "small": small, "other": torch.full((2,), float(i))}, step=i)
        read: list[str] = []
        real = Repository.read_chunk
        monkeypatch.setattr(Repository, "read_chunk", lambda self, cid, key=None, *a, **kw: read.append(key)
                            or real(self, cid, key, *a, **kw))
        data = plot.update_ratios_data(s, "main", ["small", "oth*"])
        assert data.keys == ["other", "small"] and data.ratios[1].tolist() == [1.0, 1.0]
        assert data.chunks_read == 4 and sorted(set(read)) == ["other", "small"] and len(read) == 2 * 4
        assert np.isposinf(data.ratios[0, 0]) and data.ratios[0, 1] == 1.0  # other: from zeros, then 1 -> 2


def test_update_ratios_of_a_glob_over_many_keys_match_each_key_a_bounded_number_of_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Giving diff the keys a glob selected (not the glob) made it check each key against every row: quadratic in
    the keys (2,500 keys: 16 s a pair instead of 0.3 s)."""
    import fnmatch

    n = 300
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"model": {f"k{i}": torch.ones(2) for i in range(n)}, "opt": torch.ones(2)}, step=0)
        s.save({"model": {f"k{i}": torch.full((2,), 2.0) for i in range(n)}, "opt": torch.ones(2)}, step=1)
        calls = [0]
        real = fnmatch.fnmatchcase
        monkeypatch.setattr(fnmatch, "fnmatchcase", lambda *a: calls.__setitem__(0, calls[0] + 1) or real(*a))
        for keys in ("model.k*", "model.", "model"):
            calls[0] = 0
            data = plot.update_ratios_data(s, "main", keys)
            assert len(data.keys) == n and data.ratios.tolist() == [[1.0]] * n
            assert calls[0] < 20 * n, keys  # a few per key, not one per key and row


def test_update_ratios_and_diff_of_many_exact_keys_match_each_key_a_bounded_number_of_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit list of thousands of keys was checked pattern by pattern against every key: 2,000 keys took 19 s
    where the base took 1.9 (a review). Exact keys are looked up; no fnmatch runs for them."""
    import fnmatch

    n = 300
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"model": {f"k{i}": torch.ones(2) for i in range(n)}}, step=0)
        s.save({"model": {f"k{i}": torch.full((2,), 2.0) for i in range(n)}}, step=1)
        calls = [0]
        real = fnmatch.fnmatchcase
        monkeypatch.setattr(fnmatch, "fnmatchcase", lambda *a: calls.__setitem__(0, calls[0] + 1) or real(*a))
        keys = [f"model.k{i}" for i in range(n)]
        data = plot.update_ratios_data(s, "main", keys)
        assert sorted(data.keys) == sorted(keys) and data.ratios.tolist() == [[1.0]] * n
        assert len(s.diff("main~1", "main", keys=keys)) == n and len(plot.norms_data(s, "main", keys).values) == n
        assert calls[0] == 0
        with pytest.raises(ds.NotFoundError, match="model.k9999"):
            s.diff("main~1", "main", keys=[*keys, "model.k9999"])


def test_update_ratios_of_a_tensor_never_in_two_versions_alike_say_so(tmp_path: Path) -> None:
    """A key added in the last version, or reshaped at every one, has no update ratio; the error said no tensor
    matched it and offered the key itself as the close match."""
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"w": torch.ones(2)}, step=0)
        s.save({"w": torch.ones(2), "new": torch.ones(3)}, step=1)
        s.save({"r": torch.ones(2)}, branch="x", step=0)
        s.save({"r": torch.ones(3)}, branch="x", step=1)
        for ref, keys, named in (("main", "new", "new"), ("x", "r", "r"), ("x", None, "r")):
            with pytest.raises(ds.NotFoundError, match=f"^{named}: never in two consecutive versions of '{ref}' with "
                               f"one dtype and shape .*`datastates history {named} {ref}` shows each version's$"):
                plot.update_ratios_data(s, ref, keys)


def test_update_ratios_heatmap_holds_log10_of_the_ratios(trained: ds.Store) -> None:
    data = plot.update_ratios_data(trained, "main")
    fig = plot.update_ratios(trained, "main")
    shown = np.ma.filled(fig.axes[0].images[0].get_array(), np.nan)
    assert shown.shape == (4, 5)
    positive = data.ratios > 0
    np.testing.assert_allclose(shown[positive], np.log10(data.ratios[positive]))
    assert (shown[~positive] == np.log10(data.ratios[positive].min())).all()  # zeros sit at the floor
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == sorted(KEYS)


def test_an_unbounded_update_ratio_is_red_not_grey(tmp_path: Path) -> None:
    """A diverged tensor's ratio was NaN, drawn light grey: "no data" (a review)."""
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"w": torch.ones(3), "x": torch.ones(3), "y": torch.zeros(3)}, step=0)
        s.save({"w": torch.full((3,), 2.0), "x": torch.tensor([1.0, float("nan"), 1.0]), "y": torch.ones(3)},
               step=1)
        s.save({"w": torch.full((3,), 2.0), "x": torch.ones(3)}, step=2)
        data = plot.update_ratios_data(s, "main")
        fig = plot.update_ratios(s, "main")
    assert data.keys == ["w", "x", "y"]
    np.testing.assert_array_equal(data.ratios, [[1.0, 0.0], [math.inf, math.inf], [math.inf, math.nan]])
    image = fig.axes[0].images[0]
    colors = image.to_rgba(image.get_array())
    red, grey = (1.0, 0.0, 0.0, 1.0), tuple(float(c) for c in plot._colormap("viridis").with_extremes(
        bad="lightgrey").get_bad())
    assert [tuple(colors[i, j]) for i, j in ((1, 0), (1, 1), (2, 0))] == [red, red, red]
    assert tuple(colors[2, 1]) == grey  # y is gone from the last version: no data
    assert tuple(colors[0, 0]) not in (red, grey)
    assert fig.axes[1].get_ylabel().endswith("red: unbounded")


def test_update_ratios_needs_two_versions(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        store.save({"w": torch.ones(3)}, step=1)
        with pytest.raises(ds.NotFoundError, match="save another version"):
            plot.update_ratios(store, "main")


def test_histograms_count_every_value_of_each_version_in_stored_min_max_bins(trained: ds.Store) -> None:
    key = "model.0.weight"
    data = plot.histograms_data(trained, "main", key, bins=20)
    hist = trained.history(key, "main")
    assert data.edges[0] == pytest.approx(min(hist.column("min").to_pylist()))
    assert data.edges[-1] == pytest.approx(max(hist.column("max").to_pylist()))
    assert data.counts.shape == (6, 20)
    for row, vid in enumerate(data.versions):
        values = _tensor(trained, vid, key).double().numpy().ravel()
        assert data.counts[row].tolist() == np.histogram(values, bins=data.edges)[0].tolist()
        assert data.counts[row].sum() == 16 * 6
    fig = plot.histograms(trained, "main", key, bins=20)
    mesh = fig.axes[0].collections[0]
    with np.errstate(divide="ignore"):
        expected = np.log10(data.counts.T.astype(float))
    shown = np.ma.filled(mesh.get_array(), -np.inf).reshape(expected.shape)
    assert np.array_equal(shown, expected)


def test_histograms_sample_long_chains_keeping_first_and_last(trained: ds.Store) -> None:
    data = plot.histograms_data(trained, "main", "model.2.bias", bins=4, max_versions=3)
    chain = [v.id for v in reversed(trained.log("main"))]
    assert data.versions == [chain[0], chain[2], chain[5]] or data.versions == [chain[0], chain[3], chain[5]]
    assert data.x[0] == 0 and data.x[-1] == 50
    with pytest.raises(ds.NotFoundError, match="model.2.bias"):
        plot.histograms(trained, "main", "model.2.biass")
    with pytest.raises(ds.InvalidArgumentError):
        plot.histograms(trained, "main", "model.2.bias", bins=0)
    with pytest.raises(ds.InvalidArgumentError, match="bins must be 1 to 10000, not 100000000"):
        plot.histograms(trained, "main", "model.2.bias", bins=100_000_000)  # (it ran for minutes: a review)


def test_histograms_count_every_value_of_tensors_without_stored_min_max(tmp_path: Path) -> None:
    """Views and complex tensors store no min/max: the bins were -1..1 and every value outside them was dropped
    silently (a row of zeros for a view of values beyond 1), and a complex tensor lost its imaginary parts."""
    base = torch.tensor([-3.0, -2.0, 0.5, 2.0, 4.0, 5.0])
    with ds.Store.open(tmp_path / "s") as s:
        for i in range(3):
            scaled = base * (i + 1)  # "base" and "part" share it: both are stored as views
            s.save({"base": scaled, "part": scaled[1:5],
                    "z": torch.tensor([3 + 4j, -2 - 1j], dtype=torch.complex64) * (i + 1)}, step=i)
        assert {t.key: t.kind for t in s.ls()} == {"base": "view", "part": "view", "z": "tensor"}
        for key, count in (("part", 4), ("base", 6), ("z", 4)):
            data = plot.histograms_data(s, "main", key, bins=5)
            assert data.counts.sum(1).tolist() == [count] * 3, key
            for row, vid in enumerate(data.versions):
                t = s.load(vid, keys=[key])[key]
                values = (torch.view_as_real(t) if t.is_complex() else t).double().numpy().ravel()
                assert data.counts[row].tolist() == np.histogram(values, bins=data.edges)[0].tolist()
        assert plot.histograms_data(s, "main", "z", bins=5).edges[[0, -1]].tolist() == [-6.0, 12.0]


def test_plots_of_a_pruned_version_say_it_was_pruned(tmp_path: Path) -> None:
    """A pruned ref has no live version to plot: histograms raised IndexError from an empty figure, update_ratios
    said to save another version."""
    from datastates.retention import KeepLatest, Retention

    with ds.Store.open(tmp_path / "s") as s:
        for i in range(3):
            s.save({"w": torch.randn(4)}, step=i)
        s.prune(Retention(KeepLatest(1)))
        old = s.log("main")[-1].id
        for draw in (lambda: plot.histograms(s, old, "w"), lambda: plot.update_ratios(s, old),
                     lambda: plot.norms(s, old)):
            with pytest.raises(ds.PrunedError, match=f"version {old[:12]} was pruned"):
                draw()


def test_an_unbounded_change_is_a_red_bar_not_none(tmp_path: Path) -> None:
    """A change from all zeros, or to NaN, was drawn as no bar: no change (a review)."""
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"bias": torch.zeros(3), "w": torch.ones(3), "x": torch.ones(3)}, step=0)
        s.save({"bias": torch.ones(3), "w": torch.full((3,), 2.0), "x": torch.tensor([1.0, float("nan"), 1.0])},
               step=1)
        data = plot.diff_data(s, "main~1", "main")
        assert dict(zip(data.keys, data.rel_change.tolist())) == {"bias": math.inf, "w": 1.0, "x": math.inf}
        fig = plot.diff(s, "main~1", "main")
    bars = {t.get_text(): p for t, p in zip(fig.axes[0].get_yticklabels(), fig.axes[0].patches)}
    assert bars["w"].get_width() == pytest.approx(1.0)
    assert bars["bias"].get_width() == bars["x"].get_width() == pytest.approx(1.2)  # past the longest finite one
    assert [t.get_text() for t in fig.axes[0].texts] == [" inf", " inf"]


def test_diff_bars_are_the_stores_relative_change_and_cosine(trained: ds.Store) -> None:
    table = {r["key"]: r for r in trained.diff("main", "ft").to_pylist()}
    fig = plot.diff(trained, "main", "ft")
    left, right = fig.axes[0], fig.axes[1]
    labels = [t.get_text() for t in left.get_yticklabels()]
    assert labels == sorted(KEYS)
    widths = [p.get_width() for p in left.patches]
    cosines = [p.get_width() for p in right.patches]
    for key, w, c in zip(labels, widths, cosines):
        assert w == pytest.approx(table[key]["rel_change"])
        assert c == pytest.approx(table[key]["cosine"])
    a, b = _tensor(trained, "main", "model.0.weight").double(), _tensor(trained, "ft", "model.0.weight").double()
    assert widths[labels.index("model.0.weight")] == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-5)
    assert "note" not in labels  # plain values have no norm


def test_diff_and_update_ratios_compare_views_as_store_diff_does(tmp_path: Path) -> None:
    """Slices of one saved storage are stored as views: store.diff compares them, but plot.diff and update_ratios
    left them out (asked by name: 'no tensor of main matches ['part']')."""
    with ds.Store.open(tmp_path / "s") as s:
        for i in range(3):
            whole = torch.arange(1.0, 7.0) * 2**i
            s.save({"whole": whole, "part": whole[1:4], "w": torch.ones(2)}, step=i)
        assert {t.key: t.kind for t in s.ls()} == {"whole": "view", "part": "view", "w": "tensor"}
        table = {r["key"]: r for r in s.diff("main~2", "main").to_pylist()}
        data = plot.diff_data(s, "main~2", "main")
        assert data.keys == ["part", "w", "whole"] and not data.other
        assert data.rel_change.tolist() == [table[k]["rel_change"] for k in data.keys] == [3.0, 0.0, 3.0]
        np.testing.assert_allclose(data.cosine, [1.0, 1.0, 1.0])
        ratios = plot.update_ratios_data(s, "main", "part")
        assert ratios.keys == ["part"] and ratios.ratios.tolist() == [[1.0, 1.0]]  # it doubles at each step
        assert plot.update_ratios_data(s, "main").keys == ["part", "w", "whole"]
        fig = plot.diff(s, "main~2", "main", keys="part")
    assert [p.get_width() for p in fig.axes[0].patches] == [3.0]


def test_lineage_draws_one_node_per_version_and_every_edge(trained: ds.Store) -> None:
    data = plot.lineage_data(trained)
    versions = trained.versions_table().column("id").to_pylist()
    assert sorted(data.ids) == sorted(versions) and len(data.ids) == 9
    kinds = [k for _, _, k in data.edges]
    assert kinds.count("parent") == 8 and kinds.count("merge") == 1 and kinds.count("fork") == 0
    assert data.lanes == ["main", "ft", "soup"]
    assert data.metric_name == "loss"
    assert math.isnan(data.metric[data.ids.index(trained.resolve("soup"))])
    assert data.metric[data.ids.index(trained.resolve("ft"))] == 0.5
    best = data.ids.index(trained.resolve("best"))
    assert data.labels[best] == ["tag: best"]
    fig = plot.lineage(trained)
    ax = fig.axes[0]
    nodes = sum(len(c.get_offsets()) for c in ax.collections if (c.get_gid() or "").startswith("nodes"))
    assert nodes == 9
    segments = sum(len(c.get_segments()) for c in ax.collections if c.get_gid() is None)
    assert segments == 9
    assert _png(fig)[:4] == b"\x89PNG"


def test_lineage_of_refs_is_their_ancestors(trained: ds.Store) -> None:
    data = plot.lineage_data(trained, "ft")
    assert set(data.ids) == {trained.resolve("ft"), *trained.ancestors("ft")} and len(data.ids) == 5
    with pytest.raises(ds.InvalidArgumentError):
        plot.lineage(trained, "ft", population="pop")


def test_lineage_walks_the_ancestors_of_each_line_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each version of a population's branches walked its whole line again: quadratic in the versions."""
    with ds.Store.open(tmp_path / "s") as store:
        for t in range(6):
            for m in ("pop/member-00", "pop/member-01"):
                store.save({"w": torch.full((2,), float(t))}, branch=m, step=t)
        store.branch("pop/member-02", at="pop/member-00~2")
        store.save({"w": torch.zeros(2)}, branch="pop/member-02", step=9)
        store.save({"w": torch.zeros(2)}, branch="elsewhere", step=1)
        walks: list[str] = []
        ancestors = ds.Store.ancestors
        monkeypatch.setattr(ds.Store, "ancestors",
                            lambda self, ref, **kw: walks.append(ref) or ancestors(self, ref, **kw))
        data = plot.lineage_data(store, population="pop")
        assert sorted(walks) == sorted(store.resolve(f"pop/member-0{i}") for i in range(3))  # the heads only
        assert len(data.ids) == 13 and set(data.ids) == {v for v in store.versions_table().column("id").to_pylist()
                                                         if store.version(v).branch != "elsewhere"}
        walks.clear()
        refs = plot.lineage_data(store, ["pop/member-02", "pop/member-00~1", "pop/member-00"])
        assert len(walks) == 2 and set(refs.ids) == set(data.ids) - set(store.ancestors("pop/member-01")) - {
            store.resolve("pop/member-01")}


def test_lineage_names_a_metric_no_drawn_version_has(trained: ds.Store) -> None:
    """A typo in the metric drew every node grey, as versions without one, and exited 0."""
    with pytest.raises(ds.NotFoundError, match="no version drawn has the metric 'los'; the metrics they have: loss"):
        plot.lineage(trained, metric="los")
    data = plot.lineage_data(trained, metric="metrics.loss")  # as the colorbar names it
    assert data.metric_name == "loss" and data.metric[data.ids.index(trained.resolve("ft"))] == 0.5


def test_lineage_of_a_population_shows_exploits_as_fork_edges(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        pop = Population(store, "pop", size=4, metric="score", hparams=[{"lr": 0.1 * (i + 1)} for i in range(4)])
        for t in (1, 2):
            for i, m in enumerate(pop.members):
                m.save({"w": torch.full((4,), float(i + t))}, metrics={"score": float(i * t)}, step=t)
            pop.exploit(pop.members[0], donor=pop.members[3])
        store.save({"other": torch.zeros(2)}, branch="unrelated", step=1)
        data = plot.lineage_data(store, population=pop)
        assert len(data.ids) == 10  # 8 saves + 2 exploits; the unrelated branch is left out
        forks = [(data.ids[p], data.ids[c]) for p, c, k in data.edges if k == "fork"]
        assert len(forks) == 2
        for donor, child in forks:
            assert store.version(child).fork_of == donor and store.version(donor).branch == pop.members[3].branch
        assert data.metric_name == "score"
        with pytest.raises(ds.NotFoundError, match="population 'nope'"):
            plot.lineage(store, population="nope")
        # The population's own metric in no version yet (reported later, or as annotations) only colors nothing;
        # the check of a metric the caller types refused the plot.
        later = Population(store, "pop", size=4, metric="val_score")
        data = plot.lineage_data(store, population=later)
        assert data.metric_name == "val_score" and all(math.isnan(x) for x in data.metric)
        later.close()


def test_lineage_marks_pruned_versions(tmp_path: Path) -> None:
    from datastates.retention import KeepLatest, Retention

    with ds.Store.open(tmp_path / "s") as store:
        for i in range(5):
            store.save({"w": torch.full((3,), float(i))}, step=i, metrics={"loss": 1.0 / (i + 1)})
        store.prune(Retention(KeepLatest(2)))
        data = plot.lineage_data(store)
        assert data.pruned.tolist() == [True, True, True, False, False]
        ax = plot.lineage(store).axes[0]
        gids = {c.get_gid(): len(c.get_offsets()) for c in ax.collections if c.get_gid()}
        assert gids == {"nodes-pruned": 3, "nodes": 2, "nodes-no-metric": 0}
        assert len(plot.norms_data(store).versions) == 2  # pruned versions have no stats to plot


def test_plots_without_matplotlib_name_the_extra(trained: ds.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """plot.lineage imported matplotlib before its check: a bare ModuleNotFoundError (a traceback in the CLI)."""
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.collections"):
        monkeypatch.setitem(sys.modules, name, None)
    for draw in (lambda: plot.norms(trained, "main"), lambda: plot.lineage(trained)):
        with pytest.raises(ds.DataStatesError, match=r"pip install 'datastates\[plot\]'") as info:
            draw()
        assert isinstance(info.value, ImportError)
    assert plot.norms_data(trained, "main").values  # the numbers need no matplotlib


def test_plot_arguments_of_the_wrong_kind_are_typed_errors(trained: ds.Store) -> None:
    """keys=5, a list holding an int, bins=2.5, max_keys=0, metric=5 raised TypeError, ValueError or AttributeError
    from list(), fnmatch, numpy or str methods."""
    calls = {
        "keys=5 is a int": lambda: plot.norms(trained, "main", 5),  # type: ignore[arg-type]
        "keys holds 1;": lambda: plot.update_ratios_data(trained, "main", [1]),  # type: ignore[list-item]
        "keys holds '';": lambda: plot.diff_data(trained, "main~1", "main", [""]),
        "bins=2.5: give a whole number, 1 or more": lambda: plot.histograms_data(trained, "main", "model.0.weight",
                                                                                   bins=2.5),  # type: ignore[arg-type]
        "max_versions=1: give a whole number, 2 or more": lambda: plot.histograms(trained, "main", "model.0.weight",
                                                                                  max_versions=1),
        "max_keys=0": lambda: plot.norms(trained, "main", max_keys=0),
        "metric=5": lambda: plot.lineage_data(trained, metric=5),  # type: ignore[arg-type]
    }
    for message, call in calls.items():
        with pytest.raises(ds.InvalidArgumentError, match=message.replace("(", r"\(")):
            call()
    assert plot.histograms_data(trained, "main", "model.0.weight", bins=np.int64(3)).counts.shape[1] == 3


def test_plot_refuses_what_is_not_a_store() -> None:
    with pytest.raises(ds.InvalidArgumentError, match="Store.open"):
        plot.norms("runs/store")  # type: ignore[arg-type]


def test_cli_plot_writes_each_figure_to_the_named_file(trained: ds.Store, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from datastates.cli import main

    root = str(trained.path)
    runs = {
        "norms.png": ["plot", "norms", "main", "--keys", "model.*.weight"],
        "ratios.png": ["plot", "update-ratios", "ft"],
        "hist.svg": ["plot", "histograms", "model.0.weight", "main", "--bins", "8"],
        "diff.pdf": ["plot", "diff", "main", "ft"],
        "lineage.png": ["plot", "lineage", "--metric", "loss"],
    }
    magic = {".png": b"\x89PNG", ".svg": b"<?xml", ".pdf": b"%PDF"}
    for name, argv in runs.items():
        out = tmp_path / name
        assert main(["--store", root, *argv, "-o", str(out)]) == 0
        assert out.read_bytes().startswith(magic[out.suffix])
        assert capsys.readouterr().out == f"wrote {out}\n"
    assert main(["--store", root, "plot", "histograms", "model.0.wieght", "-o", str(tmp_path / "x.png")]) == 1
    assert "did you mean 'model.0.weight'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_plot_refuses_a_dpi_whose_image_does_not_fit(trained: ds.Store, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--dpi 100000 ended in MemoryError's traceback (Agg asked for a 800,000 x 450,000 pixel canvas)."""
    from datastates.cli import main

    out = tmp_path / "n.png"
    assert main(["--store", str(trained.path), "plot", "norms", "--dpi", "100000", "-o", str(out)]) == 1
    assert "--dpi 100000: the image would be 800,000 x 450,000 pixels" in capsys.readouterr().err
    assert not out.exists()


def test_lineage_refuses_a_population_of_the_wrong_kind(tmp_path: Path) -> None:
    """population=5 raised AttributeError from inside (a review): InvalidArgumentError naming it."""
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"w": torch.ones(2)})
        with pytest.raises(ds.InvalidArgumentError, match="population=5"):
            plot.lineage_data(s, population=5)  # type: ignore[arg-type]
