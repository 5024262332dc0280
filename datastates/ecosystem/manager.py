"""`CheckpointManager`: the few calls a training loop needs, in the spirit of Orbax's manager and
Lightning's ModelCheckpoint: save every N steps, keep what a retention policy says, restore the latest.

    mgr = ds.CheckpointManager(store, "run-1", save_interval_steps=100,
                               retention=Retention(KeepLatest(3), KeepBest(1, "metrics.val_loss", "min")))
    for step in range(start, steps):
        ...
        if mgr.should_save(step):
            mgr.save(step, {"model": model, "optim": opt}, metrics={"val_loss": loss})
    mgr.wait()
    state = mgr.restore()            # the latest step (or restore(step) / restore("run-1~2"))

Saves are asynchronous by default (the call returns after the copy). Retention runs after each save has
committed, on a background thread, on this manager's branch only (other branches are never pruned by
it); pruned versions keep their records (the lineage stays) and lose their bytes at the next `store.gc()`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import InvalidArgumentError, NotFoundError
from ..maintenance.retention import Policy
from ..meta.refs import check_name
from ..meta.versions import Version
from ..save.job import SaveHandle
from ..save.request import whole_number
from ..store import Store


class CheckpointManager:
    """Saves of one branch every `save_interval_steps`, with `retention` applied after each.
    Raises InvalidArgumentError for an interval below 1 or a retention that is not a policy."""

    def __init__(self, store: Store, branch: str = "main", *, save_interval_steps: int = 1,
                 retention: Policy | None = None, async_: bool = True) -> None:
        check_name(branch, "branch")
        if whole_number(save_interval_steps, "save_interval_steps") in (None, 0):
            raise InvalidArgumentError(f"save_interval_steps={save_interval_steps} must be 1 or more")
        if retention is not None and not isinstance(retention, Policy):
            raise InvalidArgumentError(f"retention={retention!r} is not a policy; give e.g. "
                                       "Retention(KeepLatest(3), KeepBest(1, 'metrics.val_loss', 'min'))")
        self.store, self.branch, self.interval, self.async_ = store, branch, save_interval_steps, async_
        self.retention = retention
        self._pending: list[Future[Version]] = []
        self._after = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datastates-manager")

    def should_save(self, step: int) -> bool:
        """Whether `step` is a save step (a multiple of the interval) not saved yet on this branch."""
        step = whole_number(step, "step") or 0
        return step % self.interval == 0 and step != self.latest_step()

    def save(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None,
             hparams: dict[str, Any] | None = None, message: str = "") -> SaveHandle | Version:
        """Save `state` at `step` on the branch: a SaveHandle when async (retention follows on a background
        thread once it is durable), else the Version (retention applied before returning)."""
        if self.async_:
            h = self.store.save_async(state, branch=self.branch, step=step, metrics=metrics, hparams=hparams,
                                      message=message)
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
            self._pending.append(self._after.submit(self._settle, h))
            return h
        v = self.store.save(state, branch=self.branch, step=step, metrics=metrics, hparams=hparams,
                            message=message)
        self._prune()
        return v

    def _settle(self, handle: SaveHandle) -> Version:
        v = handle.result()
        self._prune()
        return v

    def wait(self) -> None:
        """Block until every save is durable and retention has run. Raises SaveFailedError (or what the
        retention raised)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def latest_step(self) -> int | None:
        """The step of the branch head (None before the first save)."""
        head = self.store.branches().get(self.branch)
        return None if head is None else self.store.version(head).step

    def all_steps(self) -> list[int]:
        """Steps of the versions on this branch that still hold their bytes, oldest first."""
        head = self.store.branches().get(self.branch)
        if head is None:
            return []
        chain = [head, *self.store.ancestors(head, first_parent=True)]
        versions = [self.store.version(v) for v in chain]
        return sorted(v.step for v in versions if v.step is not None and not v.pruned and v.branch == self.branch)

    def restore(self, step_or_ref: int | str | None = None, **load_kw: Any) -> Any:
        """The state saved at a step (an int), at a ref (a str), or the latest (None). Raises NotFoundError
        for a step this branch has no version of, PrunedError for one retention dropped."""
        self.wait()
        if step_or_ref is None or isinstance(step_or_ref, str):
            return self.store.load(step_or_ref or self.branch, **load_kw)
        step = whole_number(step_or_ref, "step")
        for vid in [self.store.resolve(self.branch), *self.store.ancestors(self.branch, first_parent=True)]:
            if self.store.version(vid).step == step:
                return self.store.load(vid, **load_kw)
        raise NotFoundError(f"branch {self.branch!r} has no version at step {step}; steps: {self.all_steps()}")

    def _prune(self) -> None:
        if self.retention is None:
            return
        self.store.prune(_OnBranch(self.retention, self.branch))


class _OnBranch(Policy):
    """`policy` applied among the versions saved on `branch` alone, every other version kept: a manager's
    retention is its branch's. Ranked among all of the store's versions (with the others only kept beside it), a
    `KeepBest` gave its slots to another branch's better versions and pruned this run's best checkpoint (a hunt)."""

    def __init__(self, policy: Policy, branch: str) -> None:
        self.policy, self.branch = policy, branch

    def keep(self, versions: list[Version], store: Any) -> set[str]:
        mine = [v for v in versions if v.branch == self.branch]
        return {v.id for v in versions if v.branch != self.branch} | self.policy.keep(mine, store)
