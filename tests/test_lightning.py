"""Lightning's CheckpointIO over the store: a tiny LightningModule trains with the plugin; versions carry
step, epoch and the monitored metric; ModelCheckpoint's top-k is mirrored by tags; resuming from a ref
gives exactly the next losses of the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import datastates as ds

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from datastates.ecosystem.lightning import DataStatesCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _data() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _trainer(tmp_path: Path, io: DataStatesCheckpointIO, epochs: int, callbacks: list[Any]) -> Any:
    return pl.Trainer(max_epochs=epochs, plugins=[io], callbacks=callbacks, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, enable_checkpointing=bool(callbacks))


def test_every_epoch_is_a_version_and_a_resume_gives_the_same_next_losses(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        torch.manual_seed(0)
        full = Tiny()
        every = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
        _trainer(tmp_path, DataStatesCheckpointIO(store, branch="run"), 3, [every]).fit(full, _data())
        versions = list(reversed(store.log("run")))
        assert [(v.step, v.epoch) for v in versions] == [(8, 0), (16, 1), (24, 2)]
        assert sorted(store.tags()) == ["ckpt/epoch=0-step=8.ckpt", "ckpt/epoch=1-step=16.ckpt",
                                        "ckpt/epoch=2-step=24.ckpt"]
        assert versions[0].message == "epoch=0-step=8.ckpt"

        torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
        resumed = Tiny()
        io = DataStatesCheckpointIO(store, branch="resumed")
        _trainer(tmp_path, io, 3, []).fit(resumed, _data(), ckpt_path="datastates://ckpt/epoch=0-step=8.ckpt")
        assert resumed.losses == full.losses[8:]  # bit-identical continuation
        state = store.load("run")
        assert torch.equal(state["state_dict"]["net.weight"], full.net.weight.detach())


def test_top_k_is_mirrored_by_tags_and_the_metric_is_recorded(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        torch.manual_seed(0)
        best = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="train_loss", mode="min", save_top_k=1,
                               every_n_train_steps=2)
        _trainer(tmp_path, DataStatesCheckpointIO(store, branch="run"), 2, [best]).fit(Tiny(), _data())
        versions = store.log("run")
        assert len(versions) >= 2 and all("train_loss" in v.metrics for v in versions)
        assert len(store.tags()) == 1  # the others were removed from the top-k: untagged, still in the lineage
        (tag, vid), = store.tags().items()
        assert tag == f"ckpt/{Path(best.best_model_path).name}"
        assert store.version(vid).metrics["train_loss"] == min(v.metrics["train_loss"] for v in versions)


def test_loading_a_path_never_saved_is_a_typed_error(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        io = DataStatesCheckpointIO(store)
        with pytest.raises(ds.NotFoundError, match="datastates://"):
            io.load_checkpoint(tmp_path / "nope.ckpt")


def test_checkpoints_of_a_training_run_reuse_the_flatten_after_the_second(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning hands over `model.state_dict()` (new tensor objects over the same storages every time) with the
    # optimizer's state and its loops' counters: the store's flatten cache keeps a record of that form.
    from datastates.save import tree as tree_mod

    flattens = []
    real = tree_mod.Flattener.flatten
    monkeypatch.setattr(tree_mod.Flattener, "flatten", lambda f, state: flattens.append(1) or real(f, state))
    with ds.Store.open(tmp_path / "s") as store:
        torch.manual_seed(0)
        model = Tiny()
        every = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
        trainer = _trainer(tmp_path, DataStatesCheckpointIO(store, branch="run"), 5, [every])
        trainer.fit(model, _data())
        assert len(store.log("run")) == 5
        assert len(flattens) == 2  # the first checkpoint, and the second, which makes the record the others reuse
        record = store._saver.flattener._last
        # the third laid the capture out over the tensors' addresses, and the last two copied through that layout
        assert record is not None and record.plans is not None and len(record.plans.addressed) == 1
        last = store.load("run")
        assert torch.equal(last["state_dict"]["net.weight"], model.net.weight.detach())
        momentum = trainer.optimizers[0].state[model.net.weight]["momentum_buffer"]
        assert torch.equal(last["optimizer_states"][0]["state"][0]["momentum_buffer"], momentum)


def test_teardown_after_the_store_was_closed(tmp_path: Path) -> None:
    """A store closed before Lightning's teardown (in on_fit_end) made teardown raise StoreClosedError, since
    wait() after close() does (a review): a closed store has no save left to wait for."""
    store = ds.Store.open(tmp_path / "s")
    io = DataStatesCheckpointIO(store, branch="run")
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "epoch=0.ckpt")
    assert io.load_checkpoint(tmp_path / "epoch=0.ckpt")["state_dict"]["w"].tolist() == [1.0, 1.0]  # (settled)
    store.close()
    io.teardown()
    with ds.Store.open(tmp_path / "s") as again:
        assert again.load("run")["state_dict"]["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("score", [float("nan"), float("inf")])
def test_a_checkpoint_whose_monitored_score_is_not_finite_is_saved(tmp_path: Path, score: float) -> None:
    """A run whose monitored loss diverged (NaN) has ModelCheckpoint's current_score NaN: the plugin passed it as
    the version's metric, which records refuse, so the checkpoint raised and ended the training (torch.save
    would have written it). The score is recorded as no value (None); the checkpoint itself keeps it."""
    with ds.Store.open(tmp_path / "s") as store:
        io = DataStatesCheckpointIO(store, branch="run")
        state = {"state_dict": {"w": torch.ones(2)},
                 "callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": {"current_score": torch.tensor(score),
                                                                         "monitor": "val_loss"}}}
        io.save_checkpoint(state, tmp_path / "last.ckpt")
        io.teardown()
        v = store.version("run")
        assert v.metrics == {"val_loss": None}
        got = io.load_checkpoint(tmp_path / "last.ckpt")
        cs = got["callbacks"]["ModelCheckpoint{'monitor': 'val_loss'}"]["current_score"]
        assert torch.equal(cs.isnan(), torch.tensor(score).isnan()) and cs.isinf() == torch.tensor(score).isinf()
