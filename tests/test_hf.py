"""The Hugging Face Trainer callback: every Trainer checkpoint becomes a version (step, epoch, metrics
from the logs, hparams from TrainingArguments), and a version written back as a checkpoint directory
resumes the Trainer to exactly the losses of the uninterrupted run. The model is built here; nothing is
downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.counting import count_slots
from torch import nn

import datastates as ds

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from datastates.ecosystem.hf import DataStatesCallback, checkpoint_dir  # noqa: E402


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        out = self.net(x)
        return {"loss": None if labels is None else ((out - labels) ** 2).mean(), "logits": out}


class Losses(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.seen.append((state.global_step, logs["loss"]))


def _data() -> list[dict[str, torch.Tensor]]:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return [{"x": x[i], "labels": x[i].sum(0, keepdim=True)} for i in range(64)]


def _args(out: Path, save_strategy: str = "steps") -> Any:
    return TrainingArguments(output_dir=str(out), max_steps=12, per_device_train_batch_size=8, learning_rate=0.05,
                             logging_steps=1, save_strategy=save_strategy, save_steps=4, report_to=[], use_cpu=True,
                             seed=0, disable_tqdm=True, dataloader_num_workers=0, log_level="error")


def test_each_checkpoint_is_a_version_and_a_resume_continues_exactly(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        torch.manual_seed(0)
        full = Losses()
        Trainer(model=Tiny(), args=_args(tmp_path / "a"), train_dataset=_data(),
                callbacks=[DataStatesCallback(store, "run"), full]).train()
        versions = list(reversed(store.log("run")))
        assert [v.step for v in versions] == [4, 8, 12]
        assert [v.epoch for v in versions] == [0, 1, 1]  # 8 steps make an epoch of 64 samples
        assert all("loss" in v.metrics and "learning_rate" in v.metrics for v in versions)
        assert versions[0].hparams["learning_rate"] == 0.05 and versions[0].hparams["seed"] == 0
        state = store.load("run~1")
        assert state["trainer_state"]["global_step"] == 8 and "net.weight" in state["model"]

        ck = checkpoint_dir(store, "run~1", tmp_path / "resume")
        assert sorted(p.name for p in ck.iterdir()) == ["optimizer.pt", "pytorch_model.bin", "scheduler.pt",
                                                         "trainer_state.json"]
        torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
        resumed = Losses()
        Trainer(model=Tiny(), args=_args(tmp_path / "b"), train_dataset=_data(),
                callbacks=[resumed]).train(resume_from_checkpoint=str(ck))
        assert resumed.seen == [s for s in full.seen if s[0] > 8]  # steps 9..12, the same losses
        before = {p.name: p.read_bytes() for p in ck.iterdir()}
        assert checkpoint_dir(store, "run", tmp_path / "resume").name == "checkpoint-12"  # a new directory
        with pytest.raises(ds.InvalidArgumentError, match="exists and is not empty"):
            checkpoint_dir(store, "run~1", tmp_path / "resume")  # step 8 again: refused, nothing overwritten
        assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


def test_a_version_not_saved_by_the_callback_is_refused(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        store.save({"w": torch.ones(2)})
        with pytest.raises(ds.NotFoundError, match="DataStatesCallback"):
            checkpoint_dir(store, "main", tmp_path / "out")


class _AfterTheReservation(TrainerCallback):  # type: ignore[misc]
    """Placed after the DataStates callback: waits for its reservation where it is made, so that the saves
    come after it whatever the machine's load."""

    def __init__(self, cb: DataStatesCallback) -> None:
        self.cb = cb

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.cb.reserved is not None:
            self.cb.reserved.result(timeout=60)


def test_the_first_step_reserves_the_buffers_the_checkpoints_copy_into(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    made = count_slots(monkeypatch)
    with ds.Store.open(tmp_path / "s") as store:
        cb = DataStatesCallback(store, "run")
        Trainer(model=Tiny(), args=_args(tmp_path / "a"), train_dataset=_data(),
                callbacks=[cb, _AfterTheReservation(cb)]).train()
        assert cb.reserved is not None and cb.reserved.result() == store.pool.slot_bytes  # one slot holds it all
        assert made[0][1].startswith("datastates-capture")  # made by the reservation, not by the first save
        assert [v.step for v in reversed(store.log("run"))] == [4, 8, 12]


def test_a_trainer_that_saves_no_checkpoint_reserves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = count_slots(monkeypatch)
    args = _args(tmp_path / "a", save_strategy="no")
    with ds.Store.open(tmp_path / "s") as store:
        cb = DataStatesCallback(store, "run")
        Trainer(model=Tiny(), args=args, train_dataset=_data(), callbacks=[cb]).train()
        assert cb.reserved is None and made == [] and store.pool.allocated_bytes == 0
        with pytest.raises(ds.NotFoundError, match="no versions yet"):
            store.log("run")


def test_a_version_whose_step_or_model_is_not_the_callbacks_is_refused(tmp_path: Path) -> None:
    """checkpoint_dir named the directory after trainer_state's global_step as it was: a str such as '/../../x'
    (from an imported trainer_state.json) put pytorch_model.bin outside `out`; a nested model raised AttributeError
    (a hunt)."""
    out = tmp_path / "a" / "out"
    with ds.Store.open(tmp_path / "s") as store:
        for state in ({"model": {"w": torch.ones(2)}, "trainer_state": {"global_step": "/../../escaped"}},
                      {"model": {"w": torch.ones(2)}, "trainer_state": [1]},
                      {"model": {"enc": {"w": torch.ones(2)}}, "trainer_state": {"global_step": 1}},
                      {"model": [torch.ones(2)], "trainer_state": {"global_step": 1}}):
            v = store.save(state)
            with pytest.raises(ds.NotFoundError, match=f"version {v.short} was not saved by DataStatesCallback"):
                checkpoint_dir(store, v, out)
    assert not (tmp_path / "escaped").exists() and not out.exists()
