"""CheckpointManager: save interval, retention on its own branch only, latest step, restore."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import datastates as ds
from datastates.retention import KeepBest, KeepLatest, Retention


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(step))}


@pytest.mark.parametrize("async_", [True, False])
def test_interval_retention_latest_and_restore(tmp_path: Path, async_: bool) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        other = store.save(_state(-1), branch="other", step=0, metrics={"loss": -1.0})  # better than any of run's
        store.save(_state(-2), branch="other", step=1)
        mgr = ds.CheckpointManager(store, "run", save_interval_steps=10, async_=async_,
                                   retention=Retention(KeepLatest(2), KeepBest(1, "metrics.loss", "min")))
        assert mgr.latest_step() is None
        saved = []
        for step in range(0, 60):
            if mgr.should_save(step):
                mgr.save(step, _state(step), metrics={"loss": abs(step - 20) / 10})
                saved.append(step)
        mgr.wait()
        assert saved == [0, 10, 20, 30, 40, 50]
        assert mgr.latest_step() == 50
        assert mgr.all_steps() == [20, 40, 50]  # the two newest and the best loss (step 20)
        assert torch.equal(mgr.restore()["w"], _state(50)["w"])
        assert torch.equal(mgr.restore(20)["w"], _state(20)["w"])
        with pytest.raises(ds.PrunedError):
            mgr.restore(10)
        with pytest.raises(ds.NotFoundError, match="no version at step 15"):
            mgr.restore(15)
        # Another branch is never this manager's to prune, nor ranked with its own: its better loss took the
        # KeepBest slot, and run's best (step 20) was pruned (a hunt).
        assert not store.version(other).pruned
        assert not mgr.should_save(50) and mgr.should_save(60) and not mgr.should_save(61)


def test_bad_arguments_are_typed(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.InvalidArgumentError, match="save_interval_steps"):
            ds.CheckpointManager(store, "run", save_interval_steps=0)
        with pytest.raises(ds.InvalidArgumentError, match="not a policy"):
            ds.CheckpointManager(store, "run", retention=3)  # type: ignore[arg-type]
        with pytest.raises(ds.InvalidNameError):
            ds.CheckpointManager(store, "")
