"""A Hugging Face `TrainerCallback` that saves every checkpoint the Trainer makes into the store, and
the way back: a version written out as a checkpoint directory the Trainer resumes from.

    import datastates as ds
    from datastates.ecosystem.hf import DataStatesCallback, checkpoint_dir

    store = ds.Store.open("runs/store")
    trainer = Trainer(model=model, args=args, train_dataset=ds_train, callbacks=[DataStatesCallback(store, "run-1")])
    trainer.train()
    trainer.train(resume_from_checkpoint=checkpoint_dir(store, "run-1~2", "runs/resume"))

Each `on_save` becomes a version on the branch: the model's, optimizer's and scheduler's state dicts and
the TrainerState (as plain JSON), step = `global_step`, epoch = the whole epochs done, metrics = the
latest value of each number in the log history (loss, learning_rate, eval_*), hparams = the
TrainingArguments' plain values. Saves are asynchronous; `on_train_end` waits for them. After the first
training step the callback reserves the saves' staging buffers (`Store.reserve`), so the first checkpoint blocks
the Trainer no longer than the later ones. Nothing is
pickled into the store; `checkpoint_dir` writes `pytorch_model.bin`, `optimizer.pt` and `scheduler.pt`
with torch.save (tensors and plain containers only, which the Trainer reads with `weights_only=True`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..errors import InvalidArgumentError, NotFoundError
from ..meta.refs import check_name
from ..save.foreign import latest_numbers
from ..save.job import SaveHandle
from ..store import Store


def _plain(args: Any) -> dict[str, Any]:
    """The TrainingArguments values that are plain numbers, strings or bools (what hparams hold)."""
    out = {}
    for k, v in args.to_sanitized_dict().items():
        if isinstance(v, bool | int | str) or (isinstance(v, float) and math.isfinite(v)):
            out[k] = v
    return out


def _snapshot(state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> dict[str, Any]:
    """What a checkpoint saves: the state dicts there are and the TrainerState as plain JSON. The objects
    themselves, which the store saves through their `state_dict()`: the same tensors from checkpoint to
    checkpoint, so each save after the first reuses its flatten (`model.state_dict()` detaches anew each call)."""
    snapshot: dict[str, Any] = {"model": model if model is not None else {},
                                "trainer_state": json.loads(json.dumps(dataclasses.asdict(state), default=str))}
    if optimizer is not None:
        snapshot["optimizer"] = optimizer
    if lr_scheduler is not None:
        snapshot["scheduler"] = lr_scheduler
    return snapshot


class DataStatesCallback(TrainerCallback):  # type: ignore[misc]
    """Saves each Trainer checkpoint as a version of `branch` (see the module docstring)."""

    def __init__(self, store: Store, branch: str = "main") -> None:
        check_name(branch, "branch")
        self.store, self.branch = store, branch
        self.handles: list[SaveHandle] = []
        self.reserved: Future[int] | None = None
        """The reservation made after the first step (`Store.reserve`'s future), once made."""

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Once, after the first optimizer step (the optimizer's state exists from then on): `Store.reserve` the
        staging buffers a checkpoint copies into, in the background, so that the first save blocks only for its
        copy, as the later ones do (on an H200, a 1.1 GiB state's first `save_async` blocked 0.93 s without,
        25 ms with). Nothing on ranks other than 0 or when the Trainer saves no checkpoint. Raises
        UnsupportedValueError for a state the saves would refuse too."""
        if (self.reserved is not None or not state.is_world_process_zero
                or str(getattr(args.save_strategy, "value", args.save_strategy)) == "no"):
            return  # made already, another rank's to make, or buffers that would hold memory for no save
        self.reserved = self.store.reserve(_snapshot(state, model, optimizer, lr_scheduler))

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                lr_scheduler: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        self.handles.append(self.store.save_async(
            _snapshot(state, model, optimizer, lr_scheduler), branch=self.branch, step=int(state.global_step),
            epoch=int(math.floor(state.epoch or 0)), hparams=_plain(args), metrics=latest_numbers(state.log_history),
            message=f"checkpoint-{state.global_step}"))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.result()


def checkpoint_dir(store: Store, ref: Any, out: str | os.PathLike[str]) -> Path:
    """Write version `ref` (saved by DataStatesCallback) as a Trainer checkpoint directory under `out`
    and return it, for `trainer.train(resume_from_checkpoint=...)`. Raises NotFoundError when the
    version was not saved by the callback, InvalidArgumentError when that checkpoint directory exists and is
    not empty (nothing is overwritten, as `export` does)."""
    state = store.load(ref)
    shown = getattr(ref, "short", None) or repr(ref)  # a Version's short id, not its whole record
    if not isinstance(state, dict) or "trainer_state" not in state or "model" not in state:
        raise NotFoundError(f"version {shown} was not saved by DataStatesCallback (no model/trainer_state)")
    trainer_state, model = state["trainer_state"], state["model"]
    step = trainer_state.get("global_step", 0) if isinstance(trainer_state, dict) else None
    # The step names the directory: a str there ('/../x') would put it outside `out`.
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(model, dict) \
            or not all(isinstance(t, torch.Tensor) for t in model.values()):
        raise NotFoundError(f"version {shown} was not saved by DataStatesCallback (its trainer_state has no whole "
                            "global_step, or its model is not a flat dict of tensors)")
    path = Path(out) / f"checkpoint-{step}"
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InvalidArgumentError(f"{path} exists and is not empty (a Trainer's own checkpoint?); nothing was "
                                   "overwritten: give another out= directory, or remove that one first")
    path.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous() for k, v in model.items()}, path / "pytorch_model.bin")
    if "optimizer" in state:
        torch.save(state["optimizer"], path / "optimizer.pt")
    if "scheduler" in state:
        torch.save(state["scheduler"], path / "scheduler.pt")
    (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    return path
