"""The save engine of one store: the buffer pool, the pipeline, capture in submission order,
lazy saves that an optimizer's next step waits for, and `reuse_unchanged`.

It turns a validated save request into a `SaveJob`, captures it (the only part the caller
waits for) and hands it to the pipeline, whose last stage calls the store's commit.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..base.collector import paused
from ..base.comm import Comm
from ..errors import StoreClosedError
from ..objects.packs import PackWriter
from .buffers import BufferPool
from .capture import CaptureOrder, CudaStaging, capture
from .capture import plan as plan_slots
from .collective import check_patterns, plan, refuse_together
from .copier import Copier
from .counters import watch_fused_steps
from .job import KnownStats, SaveHandle, SaveJob, SaveMemory
from .manifest import retire
from .pipeline import Pipeline
from .tree import FlattenCache, Flattener


class Saver:
    """Owns the pool, the pipeline and the capture order of one store; thread-safe `submit`."""

    def __init__(self, commit: Callable[[SaveJob], Any], dedup: Callable[[SaveJob | None, list[bytes]], list[bool]],
                 new_pack: Callable[[], PackWriter], guard: Callable[[], AbstractContextManager[None]], *,
                 chunk_size: int, pool_bytes: int, workers: int, zstd_level: int,
                 on_error: Callable[[SaveJob, BaseException], None],
                 chunk_drops: Callable[[], bytes] | None = None,
                 closed_error: Callable[[], Exception] = StoreClosedError) -> None:
        """`chunk_drops`: the catalog's `Catalog.chunk_drops` where nothing but a drop from the index removes a
        chunk (no tiers), else None (see `Pipeline.chunk_drops`). `closed_error`: makes what `submit` and `reserve`
        raise once `stop` has begun (the store's StoreClosedError)."""
        watch_fused_steps()  # before any save this store could reuse
        self.chunk_size = chunk_size
        self.dedup = dedup
        self.pool = BufferPool(pool_bytes, max(chunk_size, 1 << 20), pin=torch.cuda.is_available())
        self.pipeline = Pipeline(commit, dedup, new_pack, self.pool, workers=workers, zstd_level=zstd_level,
                                 on_error=on_error, guard=guard, after_commit=self.remember,
                                 chunk_drops=chunk_drops)
        self.memory = SaveMemory()
        self._capture_order = CaptureOrder()
        self._order_lock = threading.Lock()
        self._stopped = False
        """Set by `stop`, under `_order_lock`: nothing is queued from then on."""
        self._closed_error = closed_error
        # One thread for every lazy save's capture, started on first use: captures run one at a time in
        # submission order anyway (`CaptureOrder`), and starting a thread per save cost half of a lazy
        # `save_async` of `cnn` (238 tensors: 4.2 -> 2.0 ms, alternated save by save).
        self._capturer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="datastates-capture")
        self.copier = Copier()
        self.flattener = FlattenCache()
        self._cuda: CudaStaging | None = None
        self._step_hooks: weakref.WeakKeyDictionary[Any, list[SaveHandle]] = weakref.WeakKeyDictionary()

    def submit(self, state: Any, request: dict[str, Any], *, allow_pickle: bool, lazy: bool,
               optimizer: torch.optim.Optimizer | None, reuse_unchanged: bool, overlap: bool,
               t_call: float, comm: Comm | None = None, replicated: list[str] | None = None,
               commit_comm: Comm | None = None) -> SaveHandle:
        """Flatten `state`, queue its job and capture it (in the background when `lazy`); returns its handle.
        With a communicator of several ranks the save is collective (see `save.collective`): every
        rank must call it, in the same order. Raises UnsupportedValueError (from flatten), and for a
        collective save InvalidArgumentError when the replicated entries differ across ranks, before
        anything is queued, and StoreClosedError once `stop` has begun (the store checks before flattening, but
        flattening runs the caller's code, e.g. a slow `state_dict()`, while another thread may close it).
        `commit_comm`: the communicator the pipeline thread commits a collective save on, a
        duplicate of `comm` (each thread's collectives then follow that thread's order, the same on every rank)."""
        # Flatten and capture allocate ~10 objects per tensor: collections took ~30 % of the CPU of a sync save
        # of 8,000 small tensors (docs/perf-notes.md). Deliberately not held until a sync save is durable: the
        # collection that falls due would then run between the commit and the return, and a kill there leaves a
        # committed version the caller never heard of (tests/test_crash.py caught exactly that).
        with paused():
            return self._submit(state, request, allow_pickle=allow_pickle, lazy=lazy, optimizer=optimizer,
                                reuse_unchanged=reuse_unchanged, overlap=overlap, t_call=t_call, comm=comm,
                                replicated=replicated, commit_comm=commit_comm)

    def _submit(self, state: Any, request: dict[str, Any], *, allow_pickle: bool, lazy: bool,
                optimizer: torch.optim.Optimizer | None, reuse_unchanged: bool, overlap: bool,
                t_call: float, comm: Comm | None, replicated: list[str] | None,
                commit_comm: Comm | None) -> SaveHandle:
        group = comm if comm is not None and comm.size > 1 else None  # a collective save's ranks
        # Rows the caller needs now (a collective plan, reuse_unchanged) are made now; otherwise the pipeline
        # makes them, if the flatten was a cached one.
        # The capture's layout key (a sync save borrows: see `capture`), under which the kept flatten may have an
        # addressed layout.
        borrow = overlap and not lazy and group is None
        reuse = self._reuse_token() if reuse_unchanged and group is None else None
        try:
            tree, rows, plans, encoded, holds = self.flattener.flatten_kept(
                state, allow_pickle=allow_pickle, defer=group is None and not reuse_unchanged,
                address_key=(self.chunk_size, self.pool.slot_bytes, borrow),
                committed=self.memory.by_key if reuse is not None and reuse[1] else None)
            if group is not None and replicated:
                check_patterns(tree, replicated)
        except Exception as exc:
            if group is not None:
                refuse_together(group, exc)  # the other ranks are in `plan`: they refuse this save too
            raise
        handle = SaveHandle()
        job = SaveJob(tree, rows, request, handle, self.chunk_size, t0=t_call, encoded=encoded, holds=holds)
        if group is not None:
            handle.abandonable = False
            job.dist = plan(job.entries, replicated or [], group, request)
            # The commit's collectives run on the pipeline thread while the caller may be in the next save's plan:
            # on one communicator the two threads' messages crossed (mixed saves, a gloo abort, hangs).
            job.dist.comm = commit_comm or group
        if job.dist is not None or (reuse is not None and self._reuse_unchanged(job, *reuse)):
            plans = None  # rows without their source now: a kept layout would copy them
        job.known_stats = KnownStats(job, self.memory)
        if overlap and not lazy:
            job.go.set()  # the caller waits for durability anyway: hash while it copies
        # A kept layout's rows may not be made yet (the pipeline makes them): its record knows their devices.
        cuda = self._staging_for(plans.devices if plans is not None else
                                 [e.device for e in job.entries if e.source is not None])
        with self._order_lock:
            # Checked under the lock `stop` takes to set it: a job queued after the pipeline stopped never finished
            # (its handle's result() waited for ever), and a lazy one's capture was refused by the shut capturer.
            if self._stopped:
                raise self._closed_error()
            # Taken last, once nothing can refuse the save: a ticket never captured stops every later capture.
            # Under one lock with the submit, so that the pipeline's order is the captures' order whatever threads
            # call.
            job.ticket = self._capture_order.ticket()
            self.pipeline.submit(job)
        if lazy:
            self._capturer.submit(self._capture_quietly, job, cuda, plans)
            if optimizer is not None:
                # Once the capture is sure to run: a hook waiting for a capture that never runs blocks every step.
                self._wait_before_step(optimizer, handle)
        else:
            # A sync save (overlap: the caller waits for durability) reads big host tensors in place.
            # A sync save's copies race its hashing workers for the cores, and a faster capture only fills more of
            # the pool ahead of the writer (small x1: 176 -> 400 MiB of slots): the copier serves the others.
            capture(job, self.pool, cuda, self._capture_order, borrow=borrow and job.dist is None, plans=plans,
                    copier=None if overlap else self.copier, on_caller=True)
        job.timings["blocking_s"] = time.perf_counter() - t_call
        return handle

    def reserve(self, state: Any, *, allow_pickle: bool = False) -> Future[int]:
        """Grow the pool, in the background, to the slots a `save_async` of `state` takes (its layout, as
        `capture` plans it; at most the pool's capacity). Returns a future of the pool's bytes once grown.
        Raises UnsupportedValueError (from flatten) here, before anything is allocated; the future raises what
        the allocation raises."""
        f = Flattener(allow_pickle)
        f.flatten(state)
        slots = sum(1 for step in plan_slots(f.entries, self.chunk_size, self.pool.slot_bytes, borrow=False)
                    if step.borrowed is None)
        # On the capture thread: a lazy save submitted after this captures once the slots exist, not beside
        # the allocation.
        with self._order_lock:  # (`stop` shuts the capture thread down only after setting `_stopped` under it)
            if self._stopped:
                raise self._closed_error()
            return self._capturer.submit(self.pool.grow, slots)

    def stop(self) -> None:
        """Refuse new saves (`submit` raises StoreClosedError), finish every job in flight, then end the pipeline's,
        the capture's and the copier's threads. Interrupted (KeyboardInterrupt), the jobs go on; calling it again
        waits for them and ends the threads."""
        with self._order_lock:
            self._stopped = True
        self.pipeline.stop()  # (a job's lazy capture runs on `_capturer` meanwhile: the job needs it to finish)
        self._capturer.shutdown(wait=True)
        self.copier.stop()

    def release_buffers(self) -> None:
        """After `stop`: let go of the pool's buffers and the CUDA staging buffers, which nothing uses any more."""
        self.pool.close()
        self._cuda = None

    def remember(self, job: SaveJob) -> None:
        """After a commit: what `reuse_unchanged` may reuse next time for each tensor of `job`. Keeps the
        committed rows themselves (nothing changes them after the commit: no tuple per row); a reuse puts them in
        its job in place of the rows of unchanged tensors (`_reuse_unchanged`). Runs on the pipeline thread once the
        caller has its version (`Pipeline.settled` is clear until it is done)."""
        memory = self.memory
        if job.drops != memory.drops:
            # Rows kept under another token may name chunks dropped since: only this job's are known indexed.
            memory.by_key.clear()
            memory.drops = job.drops
        by_key = memory.by_key
        for e in job.entries:
            if e.kind == "tensor" and e.sig is not None:
                e.source = None  # never keep the caller's tensors alive
                by_key[e.key] = e
        retire(job.encoded)  # the last manifest's values, with the rows just replaced: freed here, not in a commit

    def _reuse_token(self) -> tuple[bytes | None, bool]:
        """For a `reuse_unchanged` save, before its rows are made: the catalog's `chunk_drops` token (None with
        tiers), and whether every chunk the remembered rows name is still indexed under it (nothing dropped since
        they were remembered), so that a row found unchanged needs no lookup and may go into the job as it is."""
        # The record of the last commit is made after its caller got the version: wait for it, or a save right
        # after another finds nothing to reuse. (An older record is never wrong, only less useful: a tensor
        # changed since has another version counter.)
        self.pipeline.settled.wait()
        # Read before the rows are chosen, outside the job's guard: the pipeline checks under the guard that no
        # chunk left the index since (`Pipeline._prepare`), or looks the reused chunks up again there. Read
        # after, a gc between the choice and the read (whose drops a concurrent `remember` recorded) would go
        # unseen.
        known = self.memory.drops
        chunk_drops = self.pipeline.chunk_drops
        drops = chunk_drops() if chunk_drops is not None else None
        return drops, drops is not None and drops == known

    def _reuse_unchanged(self, job: SaveJob, drops: bytes | None, indexed: bool) -> bool:
        """Point untouched tensors at the chunks and stats this store saved for them last time; True if any.
        `drops`, `indexed`: what `_reuse_token` told before the job's rows were made."""
        by_key = self.memory.by_key
        entries = job.entries
        candidates = []
        placed = []  # the committed rows the kept flatten put in the job (`_Flattened._rows`)
        for i, e in enumerate(entries):
            if e.kind != "tensor":
                continue
            last = by_key.get(e.key)
            if last is e:
                placed.append(e)
            elif last is not None and last.sig == e.sig:
                candidates.append((i, last))
        if not candidates and not placed:
            return False
        wanted = [c for last in placed for c in last.chunks] + [c for _, last in candidates for c in last.chunks]
        # (Rows are placed only when `indexed`: no lookup to fail, no fresh row to make again.)
        if not indexed and not all(self.dedup(job, wanted)):
            return False  # something was pruned, collected or evicted since: copy everything
        job.reused, job.reused_under = wanted, drops
        # The committed row itself stands for its unchanged tensor: a 'tensor' row is its key and signature (which
        # fix dtype, shape, stride and device), its chunks and its stats, all equal here, and nothing changes a row
        # once committed (the pipeline appends chunks only to the rows it captures; this one has no source). So a
        # save that changed 800 of 8,000 tensors leaves 800 new rows for the collector, not 8,000 rows with as
        # many chunk lists and signatures (24,900 young objects, a 5-18 ms collection on the caller's thread).
        for i, last in candidates:
            entries[i] = last
        return True

    def _wait_before_step(self, optimizer: torch.optim.Optimizer, handle: SaveHandle) -> None:
        """Make the optimizer's next step() wait until `handle` is staged.

        One persistent pre-hook per optimizer waits for every lazy save
        registered since the last step: removing a hook from inside
        Optimizer.step would mutate the dict torch is iterating.
        """
        pending = self._step_hooks.get(optimizer)
        if pending is None:
            pending = self._step_hooks[optimizer] = []
            hooks = self._step_hooks

            def hook(opt: Any, args: Any, kwargs: Any) -> None:
                waiting = hooks.get(opt, [])
                while waiting:
                    h = waiting.pop(0)
                    h._staged.wait()  # a capture error is reported by result(), not by the step

            optimizer.register_step_pre_hook(hook)
        pending.append(handle)

    def _capture_quietly(self, job: SaveJob, cuda: CudaStaging | None, plans: dict[Any, Any] | None) -> None:
        try:
            capture(job, self.pool, cuda, self._capture_order, plans=plans, copier=self.copier)
        except BaseException:
            pass  # reported through the handle by the pipeline

    def _staging_for(self, devices: Iterable[str]) -> CudaStaging | None:
        """The side stream for a job whose stored bytes are on `devices` (as `TensorEntry.device` names them) when
        its CUDA ones are all the current device; None otherwise. A stream and its events belong to one device, and
        a copy from another device's tensor runs on that device's stream, which the slot's event would not cover: a
        state spread over several GPUs (a model split across them in one process) is copied synchronously
        instead."""
        gpus = {d for d in map(torch.device, set(devices)) if d.type == "cuda"}
        if not gpus or gpus != {torch.device("cuda", torch.cuda.current_device())}:
            return None
        if self._cuda is None:
            self._cuda = CudaStaging(self.pool.slot_bytes)
        return self._cuda


def at_exit(owner: Any, method: Callable[[Any], None]) -> Callable[[], None]:
    """Run `method(owner)` when the process exits, if `owner` is still alive then (a weak reference:
    this keeps nothing alive). Returns the hook, for `atexit.unregister`.

    Registered with threading's exit hooks, which run before concurrent.futures stops its executors
    (and before atexit), so saves still in flight can use the hash workers to finish."""
    ref = weakref.ref(owner)
    pid = os.getpid()

    def drain() -> None:
        obj = ref()
        # A forked child (a DataLoader worker) inherits the hook but none of the threads it would wait for: it
        # hung at exit waiting on a pipeline that does not exist there. The parent drains its own saves.
        if obj is not None and os.getpid() == pid:
            method(obj)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(drain)
    else:
        atexit.register(drain)
    return drain
