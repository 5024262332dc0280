"""The Store: the one object users hold. It wires the parts and forwards; logic lives below it.

    repo/       Repository (object store + catalog + refs): resolve, versions, manifests, annotate
    save/       capture, pipeline, and `save.commit.make_visible`, where a version becomes visible
    repo/reader load and checkout          query/  walks, find, versions table, diff, history
    maintenance/ flusher, refresh, eviction, fsck, gc, retention

Guarantees (each pinned by tests):
- a version is visible only after its packs, manifest and record are durable;
- same id, same bytes: reads verify blake3 and raise IntegrityError naming the chunk;
- branch moves are compare-and-swap under a cross-process lock and logged in the reflog;
- bad input raises a typed error before anything is written.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from .base.comm import Comm, SingleComm, as_comm
from .base.config import Flush, TierConfig
from .errors import (
    ArgumentTypeError,
    ConflictError,
    DataStatesError,
    InvalidArgumentError,
    PrunedError,
    SaveFailedError,
    StoreClosedError,
    check_keywords,
    name_store,
)
from .maintenance.eviction import Evictor
from .maintenance.flush import Flusher, ref_conflicts
from .maintenance.fsck import fsck
from .maintenance.gc import COLD_GRACE_S, gc
from .maintenance.refresh import refresh
from .maintenance.retention import prune
from .meta.catalog import Catalog
from .meta.graph import CatalogGraph
from .meta.refs import RefStore
from .meta.versions import Version, decode_record
from .objects.tier import Tier
from .query.facade import Queries
from .repo import reader
from .repo.opening import open_repository
from .repo.recovery import restore_lost_nodes, share_packs
from .repo.repository import Repository
from .save.buffers import BufferPool, default_pool_bytes
from .save.collective import make_visible_collective, matches, refuse_together
from .save.commit import Staged, check_branch_move, make_fork_visible, make_staged_visible, make_visible, stage
from .save.job import SaveHandle, SaveJob
from .save.manifest import Manifest, TensorInfo
from .save.pipeline import Pipeline
from .save.placement import Placement
from .save.request import check_flag, fork_record, save_request
from .save.saver import Saver, at_exit
from .save.tree import key_patterns

log = logging.getLogger("datastates")


T = TypeVar("T")


def _open_in_turn(job: Comm, opening: Any, hot: str | os.PathLike[str] | None) -> Any:
    """Open on rank 0 first, then on the first rank of every other hot tier (node and directory), then
    on the rest: ranks creating one new store, or one node's new hot tier, at once would see each
    other's half-made directories (a FORMAT file not written yet in a directory that is no longer empty).
    A failure is raised on every rank: the failing rank's own error there; on the others the same class
    for a DataStatesError, else DataStatesError, naming the rank and the error (no rank ever waits for
    an open that failed)."""
    from . import errors

    where = job.allgather(None if hot is None else (job.node, str(Path(hot).expanduser().resolve())))
    first: dict[Any, int] = {}
    for r, w in enumerate(where):
        first.setdefault(w, r)
    leaders = set(first.values()) | {0}
    turns = [[0], sorted(leaders - {0}), [r for r in range(job.size) if r not in leaders]]
    out: Any = None
    for turn in (t for t in turns if t):
        failure: tuple[str, str] | None = None
        mine: BaseException | None = None
        if job.rank in turn:
            try:
                out = opening()
            except BaseException as exc:  # every rank must hear of it (OSError too), or the others would wait
                failure, mine = (type(exc).__name__, str(exc)), exc
        failed = [(r, f) for r, f in enumerate(job.allgather(failure)) if f is not None]
        if mine is not None:
            raise mine
        if failed:
            if out is not None:
                out[0].close()  # opened in an earlier turn: not handed to anyone
            r, (name, text) = failed[0]
            cls = getattr(errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, DataStatesError)):
                cls = DataStatesError  # an OSError or a bug on that rank: named in the message
            raise cls(f"rank {r} could not open the store: {name}: {text}")
    return out


def _check_one_store(job: Comm, repo: Repository, path: Any) -> None:
    """Refuse, on every rank, a job whose ranks opened different stores (a relative path from different working
    directories, a "shared" path that is node-local): each rank would write its packs into its own, and rank 0
    commit a version whose other ranks' chunks it does not hold. Stores are told apart by the creation time their
    shared tier's FORMAT records; a rank whose shared tier is unreachable (hot only) is not compared. Collective."""
    tier = repo.cold if repo.cold is not None else repo.tier
    try:
        info = tier.read_format() or {}
    except (OSError, DataStatesError):
        info = {}
    mine = (info.get("created"), info.get("chunk_size")) if info.get("created") is not None else None
    seen = job.allgather((mine, str(Path(path).expanduser().resolve())))
    stores = {ident for ident, _ in seen if ident is not None}
    if len(stores) > 1:
        repo.close()
        where = "; ".join(f"rank {r}: {p}" for r, (_, p) in enumerate(seen))
        raise InvalidArgumentError(f"the ranks opened {len(stores)} different stores ({where}): a collective save "
                                   "needs one store that every rank reaches; open the same shared directory (an "
                                   "absolute path) on every rank")


_NO_REF: Any = object()
"""`Store.annotate`'s version when none is given positionally."""


class _Part(Generic[T]):
    """A part of the repository seen on the facade, read-only: `Store.catalog` is `store.repo.catalog`."""

    def __init__(self, name: str, doc: str = "") -> None:
        self.name, self.__doc__ = name, doc or f"The repository's {name}."

    def __get__(self, store: Store | None, owner: type | None = None) -> T:
        if store is None:  # on the class (help(), docs): the descriptor itself
            return self  # type: ignore[return-value]
        return getattr(store.repo, self.name)  # type: ignore[no-any-return]


class Store(Queries):
    """A versioned model-state store rooted at a directory. Use `Store.open`.

    A process forked from the one that opened it (a DataLoader or multiprocessing worker) does not share its
    threads or its catalog: there every call raises StoreClosedError (`wait()` too, and the `result()` of the
    parent's save handles: those saves run and commit in the parent), and so does opening the store again (LMDB
    allows one open of a file per process, and the parent's is inherited: use a 'spawn' process), and the child's
    exit waits for none of the parent's saves."""

    def __init__(self, repo: Repository, *, pool_bytes: int, zstd_level: int, workers: int) -> None:
        self.repo = repo
        """Objects, catalog and refs: what the query side and maintenance work on."""
        repo.owner = self
        self.flusher: Flusher | None = None
        self.comm: Comm = SingleComm()
        """The ranks saving together (one process unless opened with `comm=`)."""
        self.commit_comm: Comm = self.comm
        """A duplicate of `comm` for the collectives of commits, which run on the pipeline thread while the caller's
        thread may be in the next save's (or a load's) own."""
        self.placement: Placement | None = None
        """Where each rank's hot tier and partner copies are (a job of several ranks)."""
        self.reuse_unchanged = False
        self._evictor = Evictor(repo)
        self._errors: list[tuple[SaveHandle, BaseException]] = []
        self._lock = threading.Lock()
        self._table: tuple[Any, Any] | None = None
        self._closing = threading.Lock()
        self._saver = Saver(self._commit, self._dedup, self.tier.new_pack, self.tier.writing,
                            chunk_size=repo.chunk_size, pool_bytes=pool_bytes, workers=workers,
                            zstd_level=zstd_level, on_error=self._record_error,
                            chunk_drops=self.catalog.chunk_drops if self.cold is None else None,
                            closed_error=partial(StoreClosedError.of, repo.path))
        self._readers = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="datastates-read")
        self._atexit = at_exit(self, Store._drain_at_exit)

    # opening -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = True, chunk_size: int | None = None,
             pool_bytes: int | None = None, verify: bool = True, zstd_level: int = 0, workers: int = 2,
             hot: str | os.PathLike[str] | None = None, hot_capacity: str | int | None = None,
             flush: Flush | None = None, promote: bool | None = None, reuse_unchanged: bool = False,
             comm: Any = None, partner: bool = False, read_only: bool = False,
             record_tiers: bool = True) -> Store:
        """Open (and by default create) the store at `path`.

        With `hot=DIR`, `path` is the cold tier (shared, the truth) and DIR the
        node-local hot tier that saves land on; the flusher copies versions to
        cold in the background (`flush=Flush(every=N)` or `tagged_only`), and
        `hot_capacity` ("200GiB") bounds hot by evicting flushed packs (LRU).
        `reuse_unchanged=True` skips copying and hashing tensors that torch's
        version counter says are untouched since this store last saved them
        (see `save_async`).
        These settings are kept in `path/config.toml`, so a later open of
        `path` alone (CLI, server) sees the same tiers.
        Raises StoreFormatError for a newer format or a non-store directory,
        NotFoundError when `create=False` and nothing is there, InvalidArgumentError
        for a path that is none, a hot tier that is the store directory, or a chunk size, pool size or
        worker count out of range. A missing
        catalog is rebuilt from the tier files.
        `comm` (an mpi4py communicator, a torch.distributed group or "torch") makes saves collective:
        every rank opens the same store and calls `save`/`save_async` in the same order (see
        docs/distributed.md); opening is then collective too. With `hot=` a node-local directory, each
        node keeps its own hot tier and catalog; a node whose hot tier is lost is rebuilt at this open
        from a surviving node's (its partner's when `partner=True`), without reading cold.
        `partner=True` (SCR's PARTNER): before a version is visible, each rank's packs are also copied
        to the hot tier of a rank on another node; raises InvalidArgumentError with one node or
        without `hot=`.
        `read_only=True` (and a store whose catalog this user may not write, which opens so by itself, as `git
        log` works in a repository one may only read): loads and queries work, nothing is written, and every
        call that would write (save, branch, tag, annotate, fork, prune, gc, fsck --repair) raises
        ReadOnlyStoreError. No refresh from cold and no flusher then; `store.read_only` says which it is.
        `record_tiers=False`: the tier settings given here (hot=, hot_capacity=, flush=, promote=) are for this open
        only, config.toml is left as it is (the command line's --hot: a reader's own hot tier must not become the
        store's).
        """
        for name, value in (("path", path), ("hot", hot)):
            if not isinstance(value, (str, os.PathLike)) and not (name == "hot" and value is None):
                raise InvalidArgumentError(f"{name}= must be a directory path (a str or a Path), not "
                                           f"{type(value).__name__}")
        if pool_bytes is not None and pool_bytes <= 0:
            raise InvalidArgumentError(f"pool_bytes {pool_bytes} must be positive (or None: a share of RAM)")
        if workers < 1:
            raise InvalidArgumentError(f"workers {workers} must be 1 or more")
        read_only = check_flag(read_only, "read_only")
        if partner and read_only:
            raise InvalidArgumentError("partner=True copies packs to other nodes at every save; a read_only store "
                                       "saves nothing: drop one of them")
        if partner and hot is None:
            raise InvalidArgumentError("partner=True copies each rank's packs to another node's hot tier; "
                                       "open with hot=NODE_LOCAL_DIR (and the shared store as the path)")
        job = as_comm(comm)
        if partner:
            Placement.check(job)  # collective; raises on every rank before anything is opened
        if job.size > 1 and hot is not None:
            restore_lost_nodes(job, Path(hot), partner=partner)
        opening = partial(open_repository, path, create=create, chunk_size=chunk_size, verify=verify, hot=hot,
                          hot_capacity=hot_capacity, flush=flush, promote=promote, read_only=read_only,
                          record_tiers=check_flag(record_tiers, "record_tiers"))
        repo, rebuild, cold_ok = opening() if job.size == 1 else _open_in_turn(job, opening, hot)
        if job.size > 1:
            _check_one_store(job, repo, path)
        store = cls(repo, pool_bytes=pool_bytes or default_pool_bytes(), zstd_level=zstd_level, workers=workers)
        if rebuild:
            from .maintenance.fsck import rebuild_catalog

            rebuild_catalog(repo)
        if cold_ok and not repo.catalog.read_only:
            try:
                refresh(repo)  # refs (and versions) other processes published to cold
            except OSError as exc:
                log.warning("cold tier %s unreadable at open (%s); working from hot", repo.root, exc)
        if repo.cold is not None and not repo.read_only:
            # a job of many ranks flushes in parallel: each rank its own packs, rank 0 publishes
            store.flusher = Flusher(repo, "all" if job.size == 1 else "publisher" if job.rank == 0 else "part")
            store.flusher.resume()
        store.reuse_unchanged = reuse_unchanged
        store.comm = job
        store.commit_comm = job.dup() if job.size > 1 else job
        if job.size > 1:
            store.placement = Placement.gather(job, repo.hot.root, partner)
        return store

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_errors=exc[0] is None)

    # the parts ---------------------------------------------------------------------
    path: _Part[Path] = _Part("root", "The store directory the user opened (the cold tier when there are two).")
    root: _Part[Path] = _Part("root")
    catalog: _Part[Catalog] = _Part("catalog")
    tier: _Part[Tier] = _Part("hot", "The tier saves write to (the hot tier when there are two).")
    hot: _Part[Tier] = _Part("hot")
    cold: _Part[Tier | None] = _Part("cold")
    tiers: _Part[list[Tier]] = _Part("tiers")
    tiering: _Part[TierConfig] = _Part("tiering")
    refs: _Part[RefStore] = _Part("refs", "Branches and tags (on the hot tier when there are two).")
    chunk_size: _Part[int] = _Part("chunk_size")
    verify: _Part[bool] = _Part("verify")
    graph: _Part[CatalogGraph] = _Part("graph")

    @property
    def read_only(self) -> bool:
        """Opened read-only (`read_only=True`, or a store this user may not write): calls that write raise
        ReadOnlyStoreError."""
        return self.repo.read_only

    @property
    def pool(self) -> BufferPool:
        """The reusable staging buffers saves copy into."""
        return self._saver.pool

    @property
    def pipeline(self) -> Pipeline:
        return self._saver.pipeline

    def _invalidate(self) -> None:
        self._table = None

    def _check_open(self) -> None:
        self.repo.check_open()

    def _record_error(self, job: SaveJob, exc: BaseException) -> None:
        self.repo.objects.unpin(job.pins)
        if job.capture_raised:
            return  # the caller got it from save_async itself; the next call must not raise it again
        with self._lock:
            self._errors.append((job.handle, exc))

    def _raise_pending(self) -> None:
        # An error the caller already heard of (`result()` raised it, `exception()` returned it: a failed sync
        # save) is not raised again: the next save, a valid one, would be refused and its checkpoint lost.
        with self._lock:
            errors = [exc for handle, exc in self._errors if not handle.delivered]
            self._errors = []
        if errors:
            raise SaveFailedError(
                f"{len(errors)} earlier background save(s) failed; the first: {errors[0]!r}. "
                "Nothing of them is visible; fix the cause and save again"
            ) from errors[0]

    def wait(self) -> None:
        """Block until every save in flight is durable; raise SaveFailedError if any failed.

        Raises StoreClosedError once close() has started (the saves in flight are close()'s to finish; call it
        again if it was interrupted), and in a forked child, whose process runs none of the parent's saves (it
        would wait for ever)."""
        self._check_open()
        self.pipeline.wait()
        self._raise_pending()

    def close(self, raise_errors: bool = True) -> None:
        """Finish the saves in flight (and the flusher's backlog), then release the files and the staging buffers.

        From the start of the call, every call that begins something (save, wait, ...) raises StoreClosedError.
        Raises SaveFailedError if a save failed (unless `raise_errors=False`). Interrupted while it waits for the
        saves (a KeyboardInterrupt, raised to the caller), it lets them go on with the files open: they commit in
        the background, and a second close() waits for them and releases the files, as the process's exit does if
        nothing calls it. Closing a closed store does nothing."""
        if os.getpid() != self.repo.pid:
            # A forked child: the threads and files are the parent's (closing LMDB here would drop the parent's
            # reader slots). Nothing of the child's to finish: it could not save (StoreClosedError). Before the
            # lock: a parent thread inside close() at the fork left it held in the child, for ever.
            self.repo.closed = self.repo.released = True
            return
        # One close at a time: a second (another thread's) waits for the first, then finds the files released.
        with self._closing:
            if self.repo.released:
                return
            self.repo.closed = True
            self._saver.flattener.clear()  # no reference to the caller's storages outlives the store
            # Not in a `finally`: interrupted here (KeyboardInterrupt), the pipeline may still be writing and
            # committing saves the caller was told were taken (their copies made); closing the files under it lost
            # every one of them and left half-made versions. They go on; a second close() (or the exit's drain)
            # comes back here. An error (not an interrupt) leaves nothing running: the files go, as they must.
            try:
                self._saver.stop()
                if self.flusher is not None:
                    self.flusher.stop(drain=True)
            except Exception:
                self._release()
                raise
            self._release()
        if raise_errors:
            self._raise_pending()

    def _release(self) -> None:
        """The end of close(): the files, the read threads and the staging buffers go, once no save runs."""
        atexit.unregister(self._atexit)  # harmless if it was registered with threading instead
        try:
            # The files first: a load on another thread then fails with StoreClosedError at its next read,
            # never with the executor's RuntimeError for work submitted after its shutdown.
            self.repo.close()
        finally:
            self._readers.shutdown()
            # Only now: no save runs any more. The buffers (pinned memory on a GPU machine) otherwise stayed
            # the process's until the Store object itself was freed.
            self._saver.release_buffers()

    def _drain_at_exit(self) -> None:
        # A process exiting with saves in flight finishes them rather than losing them silently (and so after a
        # close() that a KeyboardInterrupt cut short: the saves still run, the files are still open).
        if not self.repo.released:
            self.close(raise_errors=False)

    # saving --------------------------------------------------------------------
    def save(self, state: Any, *, branch: str | None = "main", **kw: Any) -> Version:
        """Save `state` and wait until it is durable; see `save_async` for the arguments.

        The state's tensors are read in place (no staging copy) until this returns: do not change them from
        another thread meanwhile (`save_async` copies them first). Interrupted while it waits (KeyboardInterrupt),
        the save is dropped unless its commit had begun; either way the version, if any, is whole.

        Raises UnexpectedArgumentError (a TypeError) naming `save` and the closest keyword for a typo.
        """
        # save_async checks the keywords (under this call's name), on every rank of a collective save at once.
        handle = self.save_async(state, branch=branch, _overlap=True, **kw)
        try:
            return handle.result()
        except BaseException:
            # Interrupted (KeyboardInterrupt) while the background still reads the caller's tensors in place: the
            # caller may change them now, so the save must not be committed from bytes it did not hash.
            handle.abandon()
            raise

    def save_async(self, state: Any, *, branch: str | None = "main", parents: Sequence[Any] | None = None,
                   step: int | None = None, epoch: int | None = None, hparams: dict[str, Any] | None = None,
                   metrics: dict[str, Any] | None = None, message: str = "", allow_pickle: bool = False,
                   lazy: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   fork_of: Any = None, explore: dict[str, Any] | None = None,
                   reuse_unchanged: bool | None = None, replicated: Sequence[str] | None = None,
                   force: bool = False, _overlap: bool = False, **unexpected: Any) -> SaveHandle:
        """Start saving `state`; return once its tensors are copied (at once when `lazy`).

        Modules and optimizers may be passed themselves (`{"model": model, "optim": opt}`): they are saved and
        loaded as their state dicts, and a state holding the same tensor objects as the last save skips its
        flattening and slot layout. A state of `state_dict()`s (new tensor objects over the same storages on every
        call) skips them too, and from its fourth save on is copied from the tensors' addresses, with no byte view
        made per tensor: for a module of 8,000 small parameters with AdamW on a 2-core VM, ~0.40 s of blocking,
        the two `state_dict()` calls included (~0.24 s as objects).
        `parents=None` makes the version a child of the branch head at commit
        time (linear history even with several writers). With explicit `parents`
        that do not descend from `branch`'s head, the save is refused
        (ConflictError, before anything is written; or at the commit, if another
        writer moved the branch meanwhile) when the head would be left reachable
        by no branch or tag: `force=True` moves the branch anyway, as
        `git branch -f` (the old line stays in the reflog). With `lazy=True` the
        copy runs in the background: call `handle.wait_staged()` before
        mutating tensors, or pass `optimizer=` so its next `step()` waits.
        `reuse_unchanged=True` (default: the store's setting) reuses the chunks
        of a tensor whose storage, shape and torch version counter are the same
        as when this store last saved it under the same key: no copy, no hash.
        Writes that bypass the version counter (through `.data`, numpy views
        or ctypes) are not seen, hence opt-in. Fused optimizer steps
        (`fused=True`), whose kernels bump no counter, are seen: a step hook
        bumps the counters of what they wrote (`save.counters`); optimizers
        whose own kernels write in place without saying `fused` in their
        param groups (bitsandbytes' 8-bit ones) are not.
        On a store opened with a communicator of several ranks the save is collective: each rank's
        entries go into its own manifest, and entries under `replicated` (key prefixes or globs,
        identical on every rank) are written once in total, spread over the ranks by bytes.
        Raises (before anything is written) UnsupportedValueError,
        InvalidNameError, InvalidArgumentError (an `optimizer` that is none),
        NotFoundError for unknown parents, ConflictError (see
        `force`), SaveFailedError for an earlier failed background save whose handle nobody asked (`result()`,
        `exception()`), StoreClosedError once close() has begun, on any thread (also when it begins while this call
        takes the state's `state_dict()`s: nothing is queued, no optimizer hook is left). On several ranks, a
        refusal on one rank (a typo in a keyword included) is every rank's.
        """
        t_call = time.perf_counter()
        try:
            # Keywords are taken as **unexpected and checked here, not by Python at the call: its TypeError would
            # come before this body, and on one rank of several skip the refusal the others wait for.
            if unexpected:  # (the signature's walk is not paid by every save; `_overlap`: a call of `save`)
                check_keywords("save" if _overlap else "save_async", unexpected, Store.save_async,
                               hidden=("_overlap",))
            self.repo.check_writable()
            self._raise_pending()
            if optimizer is not None and not callable(getattr(optimizer, "register_step_pre_hook", None)):
                raise InvalidArgumentError(
                    f"optimizer= takes the torch.optim.Optimizer whose next step() waits for this lazy save's copy, "
                    f"not a {type(optimizer).__name__}; pass the optimizer, or put the object in the state")
            if replicated is not None:
                # Made a list once (a generator would be used up by the check). A str would be taken letter by
                # letter (patterns 'm', 'o', ...): the version then could not be loaded at another world size.
                try:
                    items = None if isinstance(replicated, (str, bytes)) else list(replicated)
                except TypeError:
                    items = None
                if items is None or not all(isinstance(p, str) and p for p in items):
                    raise InvalidArgumentError(f"replicated={replicated!r}: give a list of key prefixes or globs, "
                                               "e.g. replicated=['model']")
                replicated = items
            request = save_request(self.resolve, branch=branch, parents=parents, step=step, epoch=epoch,
                                   hparams=hparams, metrics=metrics, message=message, fork_of=fork_of,
                                   explore=explore, force=force)
            if branch is not None:
                self.repo.check_unlike_other_kind("branch", branch)  # saving creates the branch if missing
                if request["parents"] is not None and self.comm.size == 1:
                    # Now, so a refused save writes nothing; the commit checks again under the ref lock. Not on a
                    # job of several ranks: one rank's refusal here would leave the others waiting in the save's
                    # collectives, so there rank 0's commit refuses it, on every rank at once.
                    check_branch_move(self.refs, self.catalog, branch, self.refs.get("branch", branch),
                                      request["parents"], force)
        except Exception as exc:  # a TypeError of a bad argument as well as our own refusals
            self._refuse_together(exc)
            raise
        use = self.reuse_unchanged if reuse_unchanged is None else reuse_unchanged
        handle = self._saver.submit(state, request, allow_pickle=allow_pickle, lazy=lazy, optimizer=optimizer,
                                    reuse_unchanged=use, overlap=_overlap, t_call=t_call, comm=self.comm,
                                    commit_comm=self.commit_comm, replicated=list(replicated or []))
        handle.store = str(self.repo.path)
        return handle

    def _refuse_together(self, exc: Exception) -> None:
        """On a store of several ranks, tell the others (in the save's plan) that this rank refuses the save, so
        that they refuse it too; otherwise their save pairs with this rank's next one, and one version holds two
        steps' shards. Not for a closed store: its rank takes part in no collective any more."""
        if self.comm.size > 1 and not isinstance(exc, StoreClosedError):
            refuse_together(self.comm, exc)

    def reserve(self, state: Any, *, allow_pickle: bool = False) -> Future[int]:
        """Make, in the background, the staging buffers that a `save_async` of `state` will copy into, so that
        the first one blocks only for its copy, as the later ones do. Without it the first save allocates them
        as it goes: on an H200, pinning 1.5 GiB of buffers made the first `save_async` of a 1.1 GiB state block
        0.7-0.9 s against 10-20 ms for the next ones; on a 2-core VM the first blocked 0.32-0.34 s, and 0.14-0.16
        s after a reserve (host buffers are written once here, so their pages are in memory before the first
        copy; pinned ones are by pinning). Call it once the state exists (after building the model and its
        optimizer), well before the first checkpoint; it reads only the state's layout (its tensors' sizes,
        devices and sharing), not their bytes. The buffers count against `pool_bytes` and stay the store's
        until it is closed (pinned, page-locked host memory when CUDA is there).

        Returns a future of the pool's bytes once grown (`result()` waits for it). Raises StoreClosedError,
        UnsupportedValueError for a state `save_async` would refuse (nothing is allocated then); the future
        raises what the allocation raises (out of memory, a refused pinned allocation)."""
        self.repo.check_writable()
        return self._saver.reserve(state, allow_pickle=allow_pickle)

    def _commit(self, job: SaveJob) -> Version | Staged:
        """Make the job's version visible (see `save.commit.make_visible`), then bookkeeping:
        reuse signatures, the flush queue, eviction. Runs on the pipeline thread."""
        if job.request.get("stage"):
            return stage(job, tier=self.tier)
        objects = self.repo.objects
        commit = make_visible if job.dist is None else partial(make_visible_collective, dist=job.dist,
                                                               placement=self.placement)
        vid, data, to_flush = commit(
            job, tier=self.tier, refs=self.refs, catalog=self.catalog,
            before_record=lambda: objects.restore_pins(job.pins), wants_flush=self._wants_flush,
            overwrite_chunks=self.cold is not None)
        for w in job.packs:
            objects.touch(w.id)
        if to_flush and self.flusher is not None:
            self.flusher.enqueue(vid, None if job.dist is None else {w.id for w in job.packs})
        flusher = self.flusher
        job.handle._flushed = (lambda timeout: True) if flusher is None else (
            lambda timeout: flusher.flushed(vid, timeout))
        objects.unpin(job.pins)  # committed and not on cold yet: eviction keeps its packs from here on
        try:
            self._evictor.evict()
        except OSError as exc:  # eviction is housekeeping; the save itself is durable
            log.warning("eviction from hot failed: %s", exc)
        return decode_record(vid, data, timings=dict(job.timings))

    def _dedup(self, job: SaveJob | None, cids: list[bytes]) -> list[bool]:
        """May `job` name these chunks without writing them? (pins reused hot packs; see ObjectStore.dedup)"""
        return self.repo.objects.dedup(job.pins if job is not None else None, cids)

    def stage(self, state: Any) -> Staged:
        """For storage plugins (DCP): write `state`'s chunks and manifest and describe them, making
        nothing visible; `commit_staged` then names the parts of every rank in one version.
        Raises what `save` raises before writing."""
        self.repo.check_writable()
        self._raise_pending()
        request = save_request(self.resolve, branch=None, parents=None, step=None, epoch=None, hparams=None,
                               metrics=None, message="", fork_of=None, explore=None) | {"stage": True}
        staged = self._saver.submit(state, request, allow_pickle=False, lazy=False, optimizer=None,
                                    reuse_unchanged=False, overlap=True, t_call=time.perf_counter()).result()
        assert isinstance(staged, Staged)
        return staged

    def commit_staged(self, parts: dict[str, Staged], *, world_size: int, branch: str | None = "main",
                      parents: Sequence[Any] | None = None, step: int | None = None, hparams: Any = None,
                      metrics: Any = None, message: str = "", force: bool = False) -> Version:
        """One version naming staged parts (manifest key -> part, e.g. {"0": ..., "1": ...}), saved by
        `world_size` ranks. Raises what `save` raises for its arguments (`force` as there), before anything is
        written."""
        self.repo.check_writable()
        request = save_request(self.resolve, branch=branch, parents=parents, step=step, epoch=None, hparams=hparams,
                               metrics=metrics, message=message, fork_of=None, explore=None, force=force)
        vid, to_flush = make_staged_visible(parts, request, world_size=world_size, tier=self.tier, refs=self.refs,
                                            catalog=self.catalog, wants_flush=self._wants_flush)
        if to_flush and self.flusher is not None:
            self.flusher.enqueue(vid)
        return self.version(vid)

    # tiers ---------------------------------------------------------------------------
    def _wants_flush(self, branch: str | None) -> bool:
        return self.flusher is not None and self.flusher.wants(branch)

    def flush(self, ref: Any = None, timeout: float | None = None) -> bool:
        """Wait until the flusher's backlog is on cold (queueing `ref` first, if given); True if done (at once
        on a store without a cold tier). Raises StoreClosedError, NotFoundError for a `ref` that names nothing
        (with or without tiers: a typo is not a success)."""
        if ref is None or self.repo.cold is None:
            self._check_open()
        else:
            self.repo.check_writable()  # it queues a copy to cold
        vid = None if ref is None else self.resolve(ref)
        if self.flusher is None:
            return True
        if vid is not None:
            self.flusher.queue(vid)
        return self.flusher.wait(timeout)

    def packs_of(self, v: Version) -> set[str]:
        """The packs the catalog locates `v`'s chunks in (none for a pruned version)."""
        return self.repo.packs_of(v)

    def where(self, ref: Any) -> list[str]:
        """Names of the tiers that hold the version wholly (record, manifests, every pack)."""
        return self.repo.where(ref)

    def refresh(self) -> dict[str, int]:
        """See what other hosts flushed to the shared cold tier: index their packs and versions and
        fast-forward local refs to cold's. Returns counts of what was added. Raises ReadOnlyStoreError on a store
        opened read-only (it writes this node's catalog and refs; another user's store read through a hot tier of
        one's own refreshes, as that hot tier is this user's)."""
        self.repo.check_catalog_writable()
        return refresh(self.repo)

    def tiers_status(self) -> list[dict[str, Any]]:
        """Per tier: path, bytes in packs, capacity, pack count, reachability; and the flush backlog, its last error
        and the refs this node and cold disagree on for good (`ref_conflicts`, read from the refs: any process
        sees them, not only the one whose flush met them). Raises StoreClosedError after close()."""
        self.repo.check_readable()
        out = self.repo.objects.usage()
        if self.flusher is not None:
            out[-1].update({"backlog": self.flusher.backlog, "last_error": self.flusher.last_error,
                            "conflicts": ref_conflicts(self.repo)})
        return out

    def _evict(self) -> None:
        self._evictor.evict()

    # refs ------------------------------------------------------------------------
    def resolve(self, ref: Any) -> str:
        """The full version id named by `ref`: an id, a unique prefix (>= 6 hex), a branch, a tag, `REF~N`.

        Raises NotFoundError, AmbiguousRefError.
        """
        return self.repo.resolve(ref)

    def version(self, ref: Any) -> Version:
        """The Version named by `ref` (with its annotations). Raises NotFoundError."""
        return self.repo.version(ref)

    def branches(self) -> dict[str, str]:
        return self.repo.branches()

    def tags(self) -> dict[str, str]:
        return self.repo.tags()

    def branch(self, name: str, at: Any = "main", *, force: bool = False) -> str:
        """Create branch `name` at `at`; with force, move an existing one (logged). Returns the id.

        In a job of several ranks, a branch another rank made at the same version is no conflict (SPMD code
        calls this on every rank); at another version it is.

        Raises InvalidNameError, NotFoundError, ConflictError (exists, without force), PrunedError.
        """
        try:
            return self.repo.create_branch(name, at, force=force)
        except ConflictError:
            if not self._made_by_another_rank("branch", name, at):
                raise
            return self.resolve(at)

    def delete_branch(self, name: str, *, force: bool = False) -> str:
        """Delete a branch (its versions stay reachable by id and by the reflog), on cold too.

        Like `git branch -d`: refused with ConflictError (saying how many versions would be reachable
        by name no more) when no other branch or tag reaches its head, unless `force`. Raises NotFoundError.
        """
        return self.repo.delete_ref("branch", name, force=force)

    def tag(self, name: str, ref: Any = "main", message: str = "") -> str:
        """Create an immutable tag. Raises ConflictError if it exists (delete it first), InvalidNameError,
        NotFoundError, PrunedError. In a job of several ranks, a tag another rank made at the same version is no
        conflict (SPMD code calls this on every rank); at another version it is."""
        try:
            vid = self.repo.create_tag(name, ref, message)
        except ConflictError:
            if not self._made_by_another_rank("tag", name, ref):
                raise
            return self.resolve(ref)
        if self.flusher is not None:
            self.flusher.queue(vid)  # tagged versions always reach cold (and the tag with them)
        return vid

    def _made_by_another_rank(self, kind: str, name: str, at: Any) -> bool:
        """Whether ref `name` exists at the version `at` names while this store is one rank of several: what the
        same `tag`/`branch` call on another rank of the job made (ranks sharing a node share its refs)."""
        comm = getattr(self, "comm", None)
        return (comm is not None and comm.size > 1
                and self.refs.get(kind, name) == self.resolve(at))  # type: ignore[arg-type]

    def delete_tag(self, name: str) -> str:
        """Delete a tag (here and on cold); the version stays reachable by id."""
        return self.repo.delete_ref("tag", name)

    def reflog(self, name: str, kind: str = "branch") -> list[dict[str, object]]:
        """The moves of branch (or tag, `kind="tag"`) `name`, oldest first. Raises StoreClosedError after close()."""
        self.repo.check_readable()  # the refs are files, readable after close(): a closed store answers nothing
        return self.refs.reflog(kind, name)  # type: ignore[arg-type]

    def fork(self, ref: Any, *, branch: str | None, parents: Sequence[Any] | None = None,
             hparams: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
             step: int | None = None, message: str = "", fork_of: Any = None,
             explore: dict[str, Any] | None = None, force: bool = False) -> Version:
        """A new version holding exactly the tensors of `ref` (no bytes read or written).

        Its parents default to [ref]; hparams/step default to ref's. Used for
        PBT exploit/explore and for re-labelling a state. Moves `branch` (creates
        it if missing). Raises ConflictError, writing nothing, if that would leave
        the branch's head reachable by no branch or tag (the fork does not descend
        from it): `force=True` moves it anyway (a PBT exploit abandons the member's
        line so), the old line staying in the reflog. Raises NotFoundError,
        PrunedError, InvalidNameError, InvalidArgumentError.
        """
        self.repo.check_writable()
        src = self.version(ref)
        if src.pruned:
            raise PrunedError(f"version {src.short} was pruned; it cannot be forked")
        rec = fork_record(src, self.resolve, branch=branch, parents=parents, hparams=hparams, metrics=metrics,
                          step=step, message=message, fork_of=fork_of, explore=explore)
        if branch is not None:
            self.repo.check_unlike_other_kind("branch", branch)
        vid = make_fork_visible(rec, tier=self.tier, refs=self.refs, catalog=self.catalog, branch=branch,
                                message=f"fork of {src.short}", force=check_flag(force, "force"))
        if self.flusher is not None and self.flusher.wants(branch):
            self.flusher.queue(vid)
        return self.version(vid)

    # loading -----------------------------------------------------------------------
    def manifest(self, mid: str) -> Manifest:
        """Manifest `mid`, verified. Raises StoreClosedError after close() (not NotFoundError: the manifest may well
        be there), NotFoundError, IntegrityError."""
        self.repo.check_readable()
        return self.repo.manifest(mid)

    def manifest_of(self, v: Version, rank: int | str = 0) -> Manifest:
        """The manifest of rank `rank` of version `v`. Raises StoreClosedError after close(), PrunedError,
        NotFoundError."""
        self.repo.check_readable()
        return self.repo.manifest_of(v, rank)

    def ls(self, ref: Any = "main", rank: int = 0) -> list[TensorInfo]:
        """The tensors of a version with dtype, shape, bytes and stats; reads no tensor bytes."""
        return self.manifest_of(self.version(ref), rank).info()

    def fetch_from_peers(self, ref: Any = "main", *, keys: Iterable[str] | str | None = None,
                         every_rank: bool = False) -> int:
        """Collective (every rank of the store's job, before a restart's `load`): copy into this node's
        hot tier, from the hot tiers of the other nodes, the packs that this rank's `load(ref, keys=)`
        reads and its node lacks (chunks written once by a rank of another node, a partner copy lost
        with a node); `every_rank=True`: the packs of every rank's entries (a load that reshards, as
        DCP's). What no node holds is read from cold by the load. Returns the packs this rank
        received. One process, or every rank on one hot tier: nothing to do, returns 0.
        Raises what `load` raises for `ref` and `keys`, and CommTimeoutError as collectives do."""
        self.repo.check_writable()
        v = self.version(ref)
        rank, sel = (0, None) if every_rank else reader.rank_for(v, self.comm, keys)
        if self.placement is None or self.placement.groups == 1:
            return 0  # the arguments were checked; nothing to fetch, so no manifest is decoded
        if every_rank:
            rows = [r for part in v.manifests for r in self.manifest_of(v, part).rows if r["chunks"]]
        else:
            patterns = None if sel is None else key_patterns(sel) or []
            rows = [r for r in self.manifest_of(v, rank).rows if r["chunks"] and (
                patterns is None or r["kind"] == "storage" or matches(r["key"], patterns))]
        packs = {loc.pack for r in rows for loc in self.catalog.chunks(r["chunks"]) if loc is not None}
        return share_packs(self.comm, self.placement, self.hot, packs)

    def load(self, ref: Any = "main", *, keys: Iterable[str] | None = None, device: str | torch.device = "cpu",
             allow_pickle: bool = False, rank: int | str | None = None, comm: Any = None, mmap: bool = False) -> Any:
        """The saved state, rebuilt with the same container types; tensors bit-exact.

        `keys` selects key paths (exact; a prefix of whole
        segments, 'model' for 'model.fc.weight'; or a glob). A version saved by
        several ranks: by default each rank of `comm` (default: the store's) gets its own entries;
        at another world size, the replicated entries (from rank 0's manifest); `rank=r` reads
        rank r's entries whatever the world size. `device`: where the tensors are made; onto a GPU the
        chunks are read and verified through two reused 64 MiB pinned host buffers and copied on
        asynchronously on the current stream (work queued after the call sees them complete).
        `mmap=True` (as in `torch.load`): host tensors are made on private, copy-on-write mappings of the pack
        files, each with a storage of its own bytes, verified as a read is; nothing is copied, and writes to them
        stay in this process. Tensors whose chunks are compressed, on the cold tier only or not stored back to
        back are read as usual; onto an accelerator it changes nothing. A mapped tensor keeps its pack's file (and
        its disk space) alive after a gc or an eviction deletes it. What a read gives and a mapping does not:
        the kernel may drop a clean page and read it again from the pack later, unverified, and an I/O error
        then stops the process with SIGBUS (docs/perf-notes.md "Mapped loads").
        Raises NotFoundError (ref, key), PrunedError, IntegrityError, InvalidArgumentError (sharded
        entries at another world size without rank=), UnsupportedValueError (pickle without
        allow_pickle), DeviceError (before reading anything).
        """
        self._check_open()
        v = None
        if rank is None:
            # Resolved once: the ref is read once, and rank_for and the load see one version (without its
            # annotations, which a load does not use: one step fewer on the path of a one-tensor load).
            v = self.repo.version(ref, annotated=False)
            rank, keys = reader.rank_for(v, self.comm if comm is None else as_comm(comm), keys)
        return reader.load(self.repo, ref, keys=keys, device=device, allow_pickle=allow_pickle, rank=rank,
                           executor=self._readers, version=v, mmap=mmap)

    def read_chunk(self, cid: bytes, key: str = "?") -> bytes:
        """The raw bytes of one chunk, verified. Raises NotFoundError, IntegrityError."""
        return self.repo.read_chunk(cid, key)

    def checkout(self, ref: Any = "main", *, strict: bool = True, allow_pickle: bool = False,
                 **objects: Any) -> Version:
        """Load `ref` into live objects: `checkout("warm", model=m, optimizer=opt)`.

        Each keyword names a top-level key of the saved state (with the usual
        aliases: optimizer/optim, scheduler/lr_scheduler). A module whose parameters
        and buffers all live on one GPU has its state read straight onto that GPU;
        everything else is read onto the host and placed by its `load_state_dict`.
        Raises NotFoundError naming the missing key and the keys that exist;
        nothing changes unless all fit.
        """
        return reader.checkout(self.repo, ref, objects, strict=strict, allow_pickle=allow_pickle,
                               executor=self._readers)

    # metadata and maintenance ---------------------------------------------------------
    def annotate(self, ref: Any = _NO_REF, /, *, metrics: dict[str, Any] | None = None,
                 annotations: dict[str, Any] | None = None, **values: Any) -> Version:
        """Add or change mutable data of a version (never part of the id). `metrics={...}`: metrics known
        after the save, seen as the version's metrics (Version.metrics, find, versions table) over the
        record's; `annotations={...}` or key=value: free-form annotations. See Repository.annotate.
        The version is the first argument; given as `ref=` alone it names the version too (after a
        positional one, `ref=` is an annotation like any other key). Raises ArgumentTypeError without one."""
        if ref is _NO_REF:
            if "ref" not in values:
                raise ArgumentTypeError("annotate() needs the version to annotate: store.annotate(REF, key=value), "
                                        "REF a version id, branch or tag")
            ref = values.pop("ref")
        return self.repo.annotate(ref, metrics=metrics, annotations=annotations, **values)

    def du(self) -> dict[str, int]:
        """Bytes as the versions see them (total) against bytes actually stored (unique)."""
        return self.repo.du()

    def prune(self, retention: Any, *, dry_run: bool = False) -> Any:
        """Drop the bytes of versions no policy keeps (records stay; loading them raises PrunedError).
        Tags, branch heads and protected versions (PBT donors) are always kept. See datastates.retention."""
        if dry_run:
            self._check_open()
        else:
            self.repo.check_writable()
        self.wait()
        return prune(self.repo, retention, dry_run=dry_run)

    def gc(self, *, dry_run: bool = False, repack_threshold: float = 0.5, cold_grace_s: float | None = None) -> Any:
        """Delete packs no live version needs and repack sparse ones, on every tier; returns a
        GcReport with bytes freed per tier. See `datastates.maintenance.gc`."""
        if dry_run:
            self._check_open()
        else:
            self.repo.check_writable()
        self.wait()
        self._evictor.forget()
        return gc(self.repo, dry_run=dry_run, repack_threshold=repack_threshold,
                  cold_grace_s=COLD_GRACE_S if cold_grace_s is None else cold_grace_s)

    def fsck(self, *, repair: bool = False, rebuild: bool = False) -> Any:
        """Verify every chunk, manifest, record and ref; see `datastates.maintenance.fsck`.
        Raises StoreClosedError after `close`, ReadOnlyStoreError for `repair` or `rebuild` on a store opened
        read-only (fsck alone changes nothing)."""
        if repair or rebuild:
            self.repo.check_writable()
        else:
            self._check_open()
        self.wait()
        return fsck(self.repo, repair=repair, rebuild=rebuild)



def _naming_the_store(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:  # no named `self`: annotate(ref, self=1) is an annotation
        try:
            return fn(*args, **kw)
        except DataStatesError as exc:
            name_store(exc, str(args[0].repo.path))
            raise

    return call


# Every public method's errors name this store in their command hints (`datastates --store PATH fsck`): a
# Python caller pastes the hint into a shell, where `datastates fsck` alone finds no store.
for _name in dir(Store):
    _attr = inspect.getattr_static(Store, _name)
    if not _name.startswith("_") and inspect.isfunction(_attr):
        setattr(Store, _name, _naming_the_store(_attr))


def _opening_names_the_store(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(cls: type[Store], path: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(cls, path, *args, **kw)
        except DataStatesError as exc:
            if isinstance(path, (str, os.PathLike)):
                name_store(exc, os.fspath(path))  # (a CatalogDamagedError's `datastates fsck --repair`)
            raise

    return call


Store.open = classmethod(_opening_names_the_store(Store.open.__func__))  # type: ignore[method-assign,assignment,attr-defined]

__all__ = ["Store", "DataStatesError"]
