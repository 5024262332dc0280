"""The notebooks in notebooks/ run on a fresh kernel at small size, compute what they say, and show their plots.

Each notebook (jupytext percent format) is converted in memory, executed by nbclient on the `python3`
kernel of this interpreter, and writes its numbers to the JSON named by $DATASTATES_NOTEBOOK_RESULTS.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

import datastates as ds  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _kernel_env(tmp_path: Path) -> tuple[str, Path]:
    """A kernelspec named python3 that runs this very interpreter (the venv), installed under tmp_path,
    so the notebook imports the datastates under test whatever kernels the machine has."""
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (datastates tests)", "language": "python"}))
    return "python3", tmp_path


def run_notebook(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, dict[str, Any]]:
    """Execute notebooks/<name>.py at small size; return the executed notebook and its results JSON."""
    kernel, jupyter_path = _kernel_env(tmp_path)
    results = tmp_path / "results.json"
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    monkeypatch.setenv("DATASTATES_NOTEBOOK_SIZE", "small")
    monkeypatch.setenv("DATASTATES_NOTEBOOK_STORE", str(tmp_path / "stores"))
    monkeypatch.setenv("DATASTATES_NOTEBOOK_RESULTS", str(results))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = jupytext.read(NOTEBOOKS / f"{name}.py")
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=240,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    return nb, json.loads(results.read_text())


def plot_cells(nb: Any) -> list[Any]:
    """Code cells whose source calls a `plot.<figure>(...)` as their last expression."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        last = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.startswith("#")][-1:]
        if last and last[0].startswith("plot.") and "_data(" not in last[0]:
            cells.append(cell)
    return cells


def assert_each_plot_cell_shows_a_png(nb: Any, expected: int) -> None:
    cells = plot_cells(nb)
    assert len(cells) == expected
    for cell in cells:
        pngs = [o for o in cell.outputs if o.output_type == "execute_result" and "image/png" in o.get("data", {})]
        assert len(pngs) == 1, cell.source
        assert pngs[0]["data"]["image/png"].startswith("iVBORw0KGgo")  # base64 of the PNG signature


def test_weight_evolution_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb, res = run_notebook("weight_evolution", tmp_path, monkeypatch)
    assert_each_plot_cell_shows_a_png(nb, 5)
    assert res["versions_main"] == 8 and res["versions_high_lr"] == 8  # 40 steps saved every 5; fork at 20
    # Over the same steps after the fork, ten times the learning rate moves the weights several times more.
    assert res["median_ratio_after_fork_high_lr"] > res["median_ratio_after_fork_main"] > 0
    assert res["first_interval_factor"] > 2
    with ds.Store.open(res["store"]) as store:
        for key, l2 in res["final_l2"].items():
            assert l2 == pytest.approx(store.history(key, "main").column("l2").to_pylist()[-1])
        rel = {r["key"]: r["rel_change"] for r in store.diff("main", "high-lr").to_pylist()}
        assert res["diff_rel_change"] == pytest.approx([rel[k] for k in res["diff_keys"]])
        assert len(res["diff_keys"]) == 6


def test_pbt_lineage_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb, res = run_notebook("pbt_lineage", tmp_path, monkeypatch)
    assert_each_plot_cell_shows_a_png(nb, 2)
    assert res["members"] == 4
    assert res["lineage_nodes"] == res["versions"] > 0
    assert res["lineage_fork_edges"] == res["fork_edges"] == res["exploits"] > 0
    assert sum(res["donors"].values()) == res["exploits"]
    assert res["ancestor_evaluated_val_loss"] == pytest.approx(res["ancestor_recorded_val_loss"], rel=1e-6)
    with ds.Store.open(res["store"]) as store:
        best = store.version(res["best"])
        assert best.metrics["val_loss"] == pytest.approx(res["best_val_loss"])
        assert res["schedule"][-1][1] == best.hparams
        assert res["ancestor"] in store.ancestors(res["best"], first_parent=True)
        assert not math.isnan(res["best_val_loss"])


def test_restart_and_fork_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb, res = run_notebook("restart_and_fork", tmp_path, monkeypatch)
    assert_each_plot_cell_shows_a_png(nb, 3)
    assert res["bit_exact_resume"] is True
    assert res["merge_base_is_tag"] is True
    assert res["tag_step"] == 20
    assert res["fork_hparams"] == {"lr": 2e-3, "weight_decay": 1e-2}
    assert res["versions_main"] == 8 and res["versions_fork"] == 8  # 4 before the tag, 4 after, on each
    assert res["diff_keys"] == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
    assert all(-1.0 <= c <= 1.0 for c in res["diff_cosine"])
    with ds.Store.open(res["store"]) as store:
        assert store.version("main").metrics["loss"] == pytest.approx(res["loss_main"])
        assert store.version("low-lr-wd").metrics["loss"] == pytest.approx(res["loss_fork"])


@pytest.mark.parametrize(("name", "folder"), [("weight_evolution", "weight-evolution"), ("pbt_lineage", "pbt"),
                                              ("restart_and_fork", "restart")])
def test_a_notebook_refuses_the_store_of_an_earlier_run(name: str, folder: str, tmp_path: Path) -> None:
    """Run again with the same DATASTATES_NOTEBOOK_STORE, weight_evolution added its versions to the first run's,
    then stopped half way at the tag, which existed (ConflictError); pbt_lineage reported numbers of both runs."""
    import os
    import subprocess

    import torch

    with ds.Store.open(tmp_path / folder) as store:
        store.save({"w": torch.ones(2)}, step=1)
        before = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / folder).rglob("*") if p.is_file())
    env = {**os.environ, "DATASTATES_NOTEBOOK_SIZE": "small", "DATASTATES_NOTEBOOK_STORE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(NOTEBOOKS / f"{name}.py")], cwd=NOTEBOOKS.parent, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"{tmp_path / folder} holds the store of an earlier run: point "
                                   "DATASTATES_NOTEBOOK_STORE at another directory, or remove that one")
    assert sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / folder).rglob("*") if p.is_file()) == before

