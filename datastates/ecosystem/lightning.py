"""A Lightning `CheckpointIO` plugin: `Trainer(plugins=[DataStatesCheckpointIO(store)])` saves every
checkpoint Lightning writes into the store, asynchronously, instead of a `.ckpt` file.

    import datastates as ds
    from datastates.ecosystem.lightning import DataStatesCheckpointIO

    io = DataStatesCheckpointIO(ds.Store.open("runs/store"), branch="run-1")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=3)])
    trainer.fit(model)
    trainer.fit(model, ckpt_path="datastates://run-1")      # resume from a ref (branch, tag, id, REF~N)

Each checkpoint becomes a version on `branch` (step = `global_step`, epoch, the monitored metric as a
metric, the file name as the message) and is tagged `ckpt/<file name>`. When `ModelCheckpoint` drops a
checkpoint from its top k (`remove_checkpoint`), the tag goes: the version stays in the lineage and
`prune` (tags and branch heads are always kept) reclaims its bytes. A path given to `load_checkpoint`
is either `datastates://<ref>` or a path Lightning saved through this plugin. Pickle is never used
unless `allow_pickle=True` (Lightning checkpoints are plain containers, tensors and numbers).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO

from ..errors import NotFoundError
from ..meta.refs import check_name
from ..store import Store

SCHEME = "datastates://"


def tag_for(path: str | os.PathLike[str]) -> str:
    """The tag a checkpoint written to `path` gets: `ckpt/<file name>`."""
    return f"ckpt/{Path(path).name}"


class DataStatesCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO over a datastates store. Saves are asynchronous (the call returns once
    the tensors are copied); `teardown` (Lightning calls it at the end of fit) waits for them."""

    def __init__(self, store: Store, branch: str = "main", *, allow_pickle: bool = False) -> None:
        check_name(branch, "branch")
        self.store, self.branch, self.allow_pickle = store, branch, allow_pickle
        # Tags are set once each save is durable, in save order, off the training thread.
        self._tagger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datastates-lightning")
        self._pending: list[Future[None]] = []

    def _settle(self) -> None:
        """Wait for the saves (and their tags) in flight; re-raise the first failure."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        metrics: dict[str, float | None] = {}
        for key, state in (checkpoint.get("callbacks") or {}).items():
            if isinstance(state, dict) and "ModelCheckpoint" in str(key):
                score, monitor = state.get("current_score"), state.get("monitor")
                if monitor and score is not None:
                    # A diverged run's NaN (or inf) score is recorded as no value: records hold finite numbers
                    # only, and refusing the save would end the training that torch.save checkpoints through.
                    value = float(score)
                    metrics[str(monitor)] = value if math.isfinite(value) else None
        handle = self.store.save_async(checkpoint, branch=self.branch, step=int(checkpoint.get("global_step", 0)),
                                       epoch=int(checkpoint.get("epoch", 0)), metrics=metrics,
                                       message=Path(path).name, allow_pickle=self.allow_pickle)
        tag = tag_for(path)

        def name_it() -> None:
            v = handle.result()  # the tag names only a durable version
            if tag in self.store.tags():  # the same file name again (save_top_k=-1 reuses none; `last.ckpt` does)
                self.store.delete_tag(tag)
            self.store.tag(tag, v, message=str(path))

        self._pending.append(self._tagger.submit(name_it))

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self._settle()
        if str(path).startswith(SCHEME):
            ref = str(path)[len(SCHEME):]
        else:
            ref = tag_for(path)
            if ref not in self.store.tags():
                raise NotFoundError(f"no checkpoint saved through DataStatesCheckpointIO at {path}; "
                                    f"pass ckpt_path='{SCHEME}<ref>' (a branch, tag or version id)")
        device = map_location if isinstance(map_location, str) else "cpu"
        state = self.store.load(ref, device=device, allow_pickle=self.allow_pickle)
        if not isinstance(state, dict):
            raise NotFoundError(f"version {ref!r} does not hold a Lightning checkpoint (a dict)")
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self._settle()
        if tag_for(path) in self.store.tags():
            self.store.delete_tag(tag_for(path))

    def teardown(self) -> None:
        self._settle()
        if not self.store.repo.closed:  # a store the user closed first (in on_fit_end) has no saves left to wait for
            self.store.wait()
