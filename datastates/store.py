"""The Store: the one object users hold. Saves, loads, refs and walks of the lineage.

Guarantees (each pinned by tests):
- a version is visible only after its packs, manifest and record are durable;
- same id, same bytes: reads verify blake3 and raise IntegrityError naming the chunk;
- branch moves are compare-and-swap under a cross-process lock and logged in the reflog;
- bad input raises a typed error before anything is written.
"""

from __future__ import annotations

import atexit
import fnmatch
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import torch

from . import config as tier_config
from . import manifest as mf
from .catalog import Catalog, CommitBatch
from .chunks import CODEC_RAW, CODEC_ZSTD, DEFAULT_CHUNK_SIZE, ChunkLocation, chunk_id
from .config import Flush, TierConfig
from .engine import BufferPool, CaptureOrder, Pipeline, SaveHandle, SaveJob, capture
from .errors import (
    AmbiguousRefError,
    ConflictError,
    DataStatesError,
    DeviceError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotFoundError,
    PrunedError,
    SaveFailedError,
    ShapeMismatchError,
    StoreClosedError,
)
from .files import canonical_json, copy_file, write_new
from .flush import Flusher
from .manifest import Manifest, TensorInfo
from .refs import HEX_ID, check_name
from .statetree import SKIP, dtype_from_name, flatten, unflatten
from .tier import Tier
from .versions import Version, decode_record, encode_record, plain_json, record_dict

log = logging.getLogger("datastates")
_REF_SUFFIX = re.compile(r"^(.*?)((?:~\d*|\^)+)$")
_ALIASES = {"optimizer": ("optim", "opt"), "optim": ("optimizer", "opt"), "scheduler": ("lr_scheduler", "sched"),
            "lr_scheduler": ("scheduler", "sched"), "scaler": ("grad_scaler",)}


def _default_pool_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return max(256 << 20, total // 4)


RefLike = "str | Version | SaveHandle"


class Store:
    """A versioned model-state store rooted at a directory. Use `Store.open`."""

    def __init__(self, tier: Tier, catalog: Catalog, *, chunk_size: int, pool_bytes: int, verify: bool,
                 zstd_level: int, workers: int, cold: Tier | None = None, tiering: TierConfig | None = None,
                 root: Path | None = None) -> None:
        self.tier = tier
        """The tier saves write to (the hot tier when there are two)."""
        self.hot = tier
        self.cold = cold
        self.tiers = [tier] if cold is None else [tier, cold]
        self.root = root or tier.root
        self.tiering = tiering or TierConfig()
        self.catalog = catalog
        self._flush_counts: dict[str | None, int] = {}
        self._pack_used: dict[str, float] = {}
        self._evict_lock = threading.Lock()
        self._pins: dict[str, int] = {}
        """Hot packs that saves in flight reuse chunks from, with a count of such saves (under _evict_lock)."""
        self._packs_seen: dict[str, frozenset[str]] = {}
        """packs_of(version) of versions not on cold, as eviction last computed them. Safe to keep: a
        location only moves off a pack that is not on hot (a rewrite), or by gc, which clears this."""
        self.flusher: Flusher | None = None
        self.reuse_unchanged = False
        self._last_saved: dict[str, tuple[tuple[object, ...], list[bytes], dict[str, Any], int]] = {}
        self.chunk_size = chunk_size
        self.verify = verify
        self._closed = False
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._table: tuple[Any, Any] | None = None
        self.pool = BufferPool(pool_bytes, max(chunk_size, 1 << 20), pin=torch.cuda.is_available())
        self._cuda_stream: Any = None
        self.pipeline = Pipeline(self._commit, self._dedup, self.tier.new_pack, self.pool,
                                 workers=workers, zstd_level=zstd_level, on_error=self._record_error,
                                 guard=self.tier.writing)
        self._readers = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="datastates-read")
        ref = weakref.ref(self)

        def drain() -> None:
            s = ref()
            if s is not None:
                s._drain_at_exit()

        self._atexit = drain
        # threading's exit hooks run before concurrent.futures stops its executors (and before
        # atexit), so saves still in flight can use the hash workers to finish.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(drain)
        else:
            atexit.register(drain)
        self._capture_order = CaptureOrder()
        self._step_hooks: weakref.WeakKeyDictionary[Any, list[SaveHandle]] = weakref.WeakKeyDictionary()

    # opening -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = True, chunk_size: int | None = None,
             pool_bytes: int | None = None, verify: bool = True, zstd_level: int = 0, workers: int = 2,
             hot: str | os.PathLike[str] | None = None, hot_capacity: str | int | None = None,
             flush: Flush | None = None, promote: bool | None = None, reuse_unchanged: bool = False) -> Store:
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
        for a chunk size, pool size or worker count out of range. A missing
        catalog is rebuilt from the tier files.
        """
        if pool_bytes is not None and pool_bytes <= 0:
            raise InvalidArgumentError(f"pool_bytes {pool_bytes} must be positive (or None: a share of RAM)")
        if workers < 1:
            raise InvalidArgumentError(f"workers {workers} must be 1 or more")
        if chunk_size is not None:
            _check_chunk_size(chunk_size)
        root = Path(path).expanduser()
        saved = None
        try:
            saved = tier_config.load(root)
        except OSError:
            saved = None  # cold unreachable: go on with what the caller gave
        hot_dir = hot if hot is not None else (saved.hot if saved else None)
        if hot_dir is None:
            store = cls._open_single(root, create, chunk_size, pool_bytes, verify, zstd_level, workers)
            store.reuse_unchanged = reuse_unchanged
            return store
        cfg = TierConfig(hot=str(Path(hot_dir).expanduser()),
                         hot_capacity=tier_config.parse_size(hot_capacity) if hot_capacity is not None
                         else (saved.hot_capacity if saved else None),
                         flush=flush or (saved.flush if saved else Flush()),
                         promote=promote if promote is not None else (saved.promote if saved else True))
        hot_tier = Tier(Path(cfg.hot or ""), "hot")
        cold_tier = Tier(root, "cold", shared=True)
        hot_info = hot_tier.read_format()
        try:
            cold_info = cold_tier.read_format()
            cold_ok = True
        except OSError:
            cold_info, cold_ok = None, False
        if cold_info is None and hot_info is not None and not root.exists():
            cold_ok = False  # the shared file system is not mounted: keep saving on hot
        if hot_info is None and cold_info is None and not create:
            raise NotFoundError(f"no store at {root}; run `datastates init --store {root}` or pass create=True")
        settings = {"chunk_size": chunk_size or int((cold_info or hot_info or {}).get(  # type: ignore[call-overload]
            "chunk_size", DEFAULT_CHUNK_SIZE))}
        if cold_ok and cold_info is None:
            cold_tier.create(settings)
        if hot_info is None:
            hot_tier.create(settings)
        if cold_ok and (saved is None or saved != cfg):
            tier_config.save(root, cfg)
        size = int(settings["chunk_size"])
        _check_chunk_size(size)
        had_catalog = (hot_tier.root / "catalog" / "data.mdb").exists()
        catalog = Catalog(hot_tier.root / "catalog")
        store = cls(hot_tier, catalog, chunk_size=size, pool_bytes=pool_bytes or _default_pool_bytes(),
                    verify=verify, zstd_level=zstd_level, workers=workers, cold=cold_tier, tiering=cfg, root=root)
        if not had_catalog and any(next(t.iter_ids("versions", "json"), None) for t in store.tiers):
            from .fsck import rebuild_catalog

            rebuild_catalog(store)
        if cold_ok:
            try:
                store.refresh()  # refs (and versions) other processes published to cold
            except OSError as exc:
                log.warning("cold tier %s unreadable at open (%s); working from hot", root, exc)
        store._start_flusher()
        store.reuse_unchanged = reuse_unchanged
        return store

    @classmethod
    def _open_single(cls, root: Path, create: bool, chunk_size: int | None, pool_bytes: int | None, verify: bool,
                     zstd_level: int, workers: int) -> Store:
        tier = Tier(root)
        info = tier.read_format()
        if info is None:
            if not create:
                raise NotFoundError(f"no store at {root}; run `datastates init --store {root}` or pass create=True")
            tier.create({"chunk_size": chunk_size or DEFAULT_CHUNK_SIZE})
            info = tier.read_format() or {}
        size = int(chunk_size or info.get("chunk_size", DEFAULT_CHUNK_SIZE))  # type: ignore[call-overload]
        _check_chunk_size(size)
        had_catalog = (root / "catalog" / "data.mdb").exists()
        catalog = Catalog(root / "catalog")
        store = cls(tier, catalog, chunk_size=size, pool_bytes=pool_bytes or _default_pool_bytes(), verify=verify,
                    zstd_level=zstd_level, workers=workers)
        if not had_catalog and next(tier.iter_ids("versions", "json"), None) is not None:
            from .fsck import rebuild_catalog

            rebuild_catalog(store)
        return store

    def _start_flusher(self) -> None:
        """Start the flusher and queue what an earlier process left unflushed (commit order)."""
        self.flusher = Flusher(self)
        pending = []
        for vid, data in self.catalog.records():
            extra = self.catalog.extra(vid)
            if extra.get("flush") == "pending" and not extra.get("cold"):
                pending.append((json.loads(data).get("created", 0.0), vid))
        for _, vid in sorted(pending):
            self.flusher.enqueue(vid)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_errors=exc[0] is None)

    @property
    def path(self) -> Path:
        """The store directory the user opened (the cold tier when there are two)."""
        return self.root

    def _invalidate(self) -> None:
        self._table = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed; open it again with Store.open")

    def _record_error(self, job: SaveJob, exc: BaseException) -> None:
        self._unpin(job)
        with self._lock:
            self._errors.append(exc)

    def _raise_pending(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise SaveFailedError(
                f"{len(errors)} earlier background save(s) failed; the first: {errors[0]!r}. "
                "Nothing of them is visible; fix the cause and save again"
            ) from errors[0]

    def wait(self) -> None:
        """Block until every save in flight is durable; raise SaveFailedError if any failed."""
        self.pipeline.wait()
        self._raise_pending()

    def close(self, raise_errors: bool = True) -> None:
        """Finish the saves in flight, then release files. Raises SaveFailedError if one failed."""
        if self._closed:
            return
        self._closed = True
        try:
            self.pipeline.stop()
            if self.flusher is not None:
                self.flusher.stop(drain=True)
        finally:
            atexit.unregister(self._atexit)  # harmless if it was registered with threading instead
            self._readers.shutdown()
            for t in self.tiers:
                t.close()
            self.catalog.close()
        if raise_errors:
            self._raise_pending()

    def _drain_at_exit(self) -> None:
        # A process exiting with saves in flight finishes them rather than losing them silently.
        if not self._closed:
            self.close(raise_errors=False)

    # saving --------------------------------------------------------------------
    def save(self, state: Any, *, branch: str | None = "main", **kw: Any) -> Version:
        """Save `state` and wait until it is durable; see `save_async` for the arguments."""
        return self.save_async(state, branch=branch, _overlap=True, **kw).result()

    def save_async(self, state: Any, *, branch: str | None = "main", parents: Sequence[Any] | None = None,
                   step: int | None = None, epoch: int | None = None, hparams: dict[str, Any] | None = None,
                   metrics: dict[str, Any] | None = None, message: str = "", allow_pickle: bool = False,
                   lazy: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   fork_of: Any = None, explore: dict[str, Any] | None = None,
                   reuse_unchanged: bool | None = None, _overlap: bool = False) -> SaveHandle:
        """Start saving `state`; return once its tensors are copied (at once when `lazy`).

        `parents=None` makes the version a child of the branch head at commit
        time (linear history even with several writers). With `lazy=True` the
        copy runs in the background: call `handle.wait_staged()` before
        mutating tensors, or pass `optimizer=` so its next `step()` waits.
        `reuse_unchanged=True` (default: the store's setting) reuses the chunks
        of a tensor whose storage, shape and torch version counter are the same
        as when this store last saved it under the same key: no copy, no hash.
        Writes that bypass the version counter (through `.data`, numpy views
        or ctypes) are not seen, hence opt-in.
        Raises (before anything is written) UnsupportedValueError,
        InvalidNameError, NotFoundError for unknown parents, SaveFailedError
        for an earlier failed background save.
        """
        t_call = time.perf_counter()
        self._check_open()
        self._raise_pending()
        if branch is not None:
            check_name(branch, "branch")
        request = {
            "branch": branch,
            "parents": None if parents is None else [self.resolve(p) for p in parents],
            "step": _whole_number(step, "step"),
            "epoch": _whole_number(epoch, "epoch"),
            "hparams": plain_json(hparams, "hparams"),
            "metrics": plain_json(metrics, "metrics"),
            "message": str(message),
            "fork_of": None if fork_of is None else self.resolve(fork_of),
            "explore": None if explore is None else plain_json(explore, "explore"),
        }
        tree, entries = flatten(state, allow_pickle=allow_pickle)
        handle = SaveHandle()
        job = SaveJob(tree, entries, request, handle, self.chunk_size, t0=t_call,
                      ticket=self._capture_order.ticket())
        if self.reuse_unchanged if reuse_unchanged is None else reuse_unchanged:
            self._reuse_unchanged(job)
        if _overlap and not lazy:
            job.go.set()  # the caller waits for durability anyway: hash while it copies
        stream = self._stream_for(entries)
        self.pipeline.submit(job)
        if lazy:
            if optimizer is not None:
                self._wait_before_step(optimizer, handle)
            threading.Thread(target=self._capture_quietly, args=(job, stream), name="datastates-capture",
                             daemon=True).start()
        else:
            capture(job, self.pool, stream, self._capture_order)
        job.timings["blocking_s"] = time.perf_counter() - t_call
        return handle

    def _reuse_unchanged(self, job: SaveJob) -> None:
        """Point untouched tensors at the chunks and stats this store saved for them last time."""
        candidates = []
        for e in job.entries:
            last = self._last_saved.get(e.key) if e.kind == "tensor" else None
            if last is not None and last[0] == e.sig and last[3] == self.chunk_size:
                candidates.append((e, last))
        wanted = [c for _, last in candidates for c in last[1]]
        if not candidates or not all(self._dedup(job, wanted)):
            return  # something was pruned, collected or evicted since: copy everything
        for e, last in candidates:
            e.chunks, e.stats, e.source = list(last[1]), dict(last[2]), None

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

    def _capture_quietly(self, job: SaveJob, stream: Any) -> None:
        try:
            capture(job, self.pool, stream, self._capture_order)
        except BaseException:
            pass  # reported through the handle by the pipeline

    def _stream_for(self, entries: list[Any]) -> Any:
        if not any(e.source is not None and e.source.device.type == "cuda" for e in entries):
            return None
        if self._cuda_stream is None:
            self._cuda_stream = torch.cuda.Stream()
        return self._cuda_stream

    def _commit(self, job: SaveJob) -> Version:
        """Write manifest and record, index them, move the branch. Runs on the pipeline thread."""
        mid, mdata = mf.encode(job.tree, job.entries, job.chunk_size)
        self.tier.write_manifest(mid, mdata)
        req = job.request
        branch = req["branch"]
        refs = self.tier.refs
        with refs.locked():
            self._restore_pins(job)
            head = refs.get("branch", branch) if branch else None
            parents = req["parents"] if req["parents"] is not None else ([head] if head else [])
            rec = record_dict(
                parents=parents, manifests={"0": mid}, step=req["step"], epoch=req["epoch"], created=time.time(),
                hparams=req["hparams"], metrics=req["metrics"], message=req["message"], branch=branch,
                world_size=1, bytes_total=sum(e.nbytes for e in job.entries), bytes_new=job.bytes_new,
                chunks_new=len(job.new_chunks), fork_of=req["fork_of"], explore=req["explore"],
            )
            vid, data = encode_record(rec)
            self.tier.write_record(vid, data)
            job.timings["durable_s"] = time.perf_counter() - job.t0
            packs = {w.id: {"size": w.size, "chunks": w.count, "tier": self.tier.name} for w in job.packs}
            extra: dict[str, Any] = {"timings": job.timings}
            to_flush = self._wants_flush(branch)
            if to_flush:
                extra["flush"] = "pending"
            self.catalog.commit(CommitBatch(vid, data, parents, list(job.new_chunks.items()), packs, extra,
                                            overwrite_chunks=self.cold is not None))
            job.committed = True
            if branch:
                refs.set_if_equals("branch", branch, head, vid, f"save: {req['message']}".strip(), locked=True)
        for w in job.packs:
            self._pack_used[w.id] = time.monotonic()
        for e in job.entries:
            if e.kind == "tensor" and e.sig is not None:
                self._last_saved[e.key] = (e.sig, list(e.chunks), dict(e.stats), job.chunk_size)
        if to_flush and self.flusher is not None:
            self.flusher.enqueue(vid)
        job.handle._flushed = lambda timeout: self._wait_flushed(vid, timeout)
        self._unpin(job)  # committed and not on cold yet: _evict keeps its packs from here on
        try:
            self._evict()
        except OSError as exc:  # eviction is housekeeping; the save itself is durable
            log.warning("eviction from hot failed: %s", exc)
        return decode_record(vid, data, timings=dict(job.timings))

    # tiers ---------------------------------------------------------------------------
    def _wants_flush(self, branch: str | None) -> bool:
        if self.cold is None or self.tiering.flush.tagged_only:
            return False
        n = self._flush_counts[branch] = self._flush_counts.get(branch, 0) + 1
        return n % max(1, self.tiering.flush.every) == 0

    def _wait_flushed(self, vid: str, timeout: float | None) -> bool:
        if self.cold is None:
            return True
        if self.flusher is not None:
            self.flusher.wait(timeout, vid)
        return bool(self.catalog.extra(vid).get("cold"))

    def flush(self, ref: Any = None, timeout: float | None = None) -> bool:
        """Wait until the flusher's backlog is on cold (queueing `ref` first, if given); True if done."""
        if self.flusher is None:
            return True
        if ref is not None:
            vid = self.resolve(ref)
            self._mark_pending(vid)
            self.flusher.enqueue(vid)
        return self.flusher.wait(timeout)

    def _mark_pending(self, vid: str) -> None:
        self.catalog.update_extra(vid, {"flush": "pending"}, only_if_missing="cold")

    def packs_of(self, v: Version) -> set[str]:
        """The packs the catalog locates `v`'s chunks in (none for a pruned version).
        Raises NotFoundError/IntegrityError if a manifest of `v` cannot be read."""
        packs: set[str] = set()
        if not v.pruned:
            for mid in v.manifests.values():
                m = self.manifest(mid)
                packs |= {loc.pack for r in m.rows for loc in self.catalog.chunks(r["chunks"]) if loc is not None}
        return packs

    def where(self, ref: Any) -> list[str]:
        """Names of the tiers that hold the version wholly (record, manifests, every pack)."""
        v = self.version(ref)
        packs = self.packs_of(v)
        out = []
        for t in self.tiers:
            try:
                ok = t.record_path(v.id).exists() and all(t.manifest_path(mid).exists() for mid in v.manifests.values())
                ok = ok and all(t.pack_path(p).exists() for p in packs)
            except OSError:
                ok = False
            if ok:
                out.append(t.name)
        return out

    def refresh(self) -> dict[str, int]:
        """See what other hosts flushed to the shared cold tier: index their packs and versions and
        fast-forward local refs to cold's. Returns counts of what was added."""
        from .lineage import is_ancestor
        from .packs import list_packs, read_index

        counts = {"packs": 0, "versions": 0, "refs": 0, "pruned": 0, "packs_gone": 0}
        if self.cold is None or not (self.cold.root / "FORMAT").is_file():
            return counts  # unreachable: an empty mount point says nothing about what cold holds
        known = set(self.catalog.packs())
        on_cold = {p.name.removesuffix(".pack"): p for p in list_packs(self.cold.root / "packs")}
        for pack in known - on_cold.keys():  # collected on cold by some host's gc, no copy on hot: forget it
            if not self.hot.pack_path(pack).exists():
                self.catalog.drop_pack(pack)
                counts["packs_gone"] += 1
        for pack, path in on_cold.items():  # one listing of cold, not a stat per pack (PFS metadata)
            if pack not in known:
                idx = read_index(path)
                self.catalog.add_pack_chunks(pack, {"size": path.stat().st_size, "chunks": len(idx),
                                                    "tier": "cold"}, idx)
                counts["packs"] += 1
        for vid in self.cold.iter_ids("versions", "json"):
            if self.catalog.record(vid) is None:
                data = self.cold.read_record(vid)
                if data is not None and blake3.blake3(data).hexdigest() == vid:
                    extra: dict[str, Any] = {"cold": True}
                    if self.cold.record_path(vid).with_suffix(".pruned").exists():
                        extra["pruned"] = True  # another host pruned it
                    self.catalog.commit(CommitBatch(vid, data, list(json.loads(data).get("parents", [])),
                                                    extra=extra))
                    counts["versions"] += 1
        pruned = self.catalog.pruned_ids()
        for vid in self.cold.iter_ids("versions", "pruned"):  # pruned by another host
            if vid not in pruned and self.catalog.record(vid) is not None:
                self.catalog.update_extra(vid, {"pruned": True}, only_if_missing="pruned")
                counts["pruned"] += 1
        for kind in ("branch", "tag"):
            for name, cid in self.cold.refs.names(kind).items():  # type: ignore[arg-type]
                mine = self.hot.refs.get(kind, name)  # type: ignore[arg-type]
                if self.catalog.record(cid) is None or mine == cid:
                    continue
                if mine is None or (kind == "branch" and is_ancestor(self.graph, mine, cid)):
                    with self.hot.refs.locked():
                        self.hot.refs.set_if_equals(kind, name, mine, cid, "refresh from cold",  # type: ignore[arg-type]
                                                    locked=True)
                    counts["refs"] += 1
        return counts

    def tiers_status(self) -> list[dict[str, Any]]:
        """Per tier: path, bytes in packs, capacity, pack count, reachability; and the flush backlog."""
        out = []
        for t in self.tiers:
            try:
                sizes = [p.stat().st_size for p in (t.root / "packs").glob("*.pack")]
                reachable = t.root.is_dir()
            except OSError:
                sizes, reachable = [], False
            out.append({"tier": t.name, "path": str(t.root), "bytes": sum(sizes), "packs": len(sizes),
                        "capacity": self.tiering.hot_capacity if t is self.hot and self.cold else None,
                        "reachable": reachable})
        if self.flusher is not None:
            out[-1].update({"backlog": self.flusher.backlog, "last_error": self.flusher.last_error,
                            "conflicts": list(self.flusher.conflicts)})
        return out

    def _dedup(self, job: SaveJob | None, cids: list[bytes]) -> list[bool]:
        """For each chunk id: may this save name it without writing its bytes?

        Without tiers: whenever the catalog knows it. With tiers: only when a copy
        is in a hot pack, which is then pinned for `job` (eviction keeps it until
        the save commits or fails). A chunk known only on cold is written again,
        so a version never needs a cold pack that a cold-tier gc may delete
        before the flusher has put this version's own copy there.
        """
        if self.cold is None:
            return self.catalog.has_chunks(cids)
        locs = self.catalog.chunks(cids)
        with self._evict_lock:
            on_hot: dict[str, bool] = {}
            for loc in locs:
                if loc is not None and loc.pack not in on_hot:
                    on_hot[loc.pack] = self.hot.pack_path(loc.pack).exists()
            if job is not None:
                for pack in {p for p, ok in on_hot.items() if ok} - job.pins:
                    job.pins.add(pack)
                    self._pins[pack] = self._pins.get(pack, 0) + 1
        return [loc is not None and on_hot[loc.pack] for loc in locs]

    def _restore_pins(self, job: SaveJob) -> None:
        """Under the hot ref lock, just before commit: put back on hot any pack this save reused chunks
        from that another process's eviction removed since (it had a copy on cold). Eviction holds the
        same lock and keeps the packs of committed versions not on cold, so after this commit they stay.

        Raises IntegrityError if the pack is on no tier any more (then nothing is committed)."""
        if self.cold is None:
            return
        for pack in sorted(job.pins):
            hot_path = self.hot.pack_path(pack)
            if hot_path.exists():
                continue
            cold_path = self.cold.pack_path(pack)
            if not cold_path.exists():
                raise IntegrityError(f"pack {pack}, which this save reuses chunks from, is on neither tier; "
                                     "save again (its chunks will be written anew)")
            copy_file(cold_path, hot_path)
            log.info("pack %s was evicted while a save reused it; copied back from cold", pack)

    def _unpin(self, job: SaveJob) -> None:
        with self._evict_lock:
            for pack in job.pins:
                if self._pins.get(pack, 0) <= 1:
                    self._pins.pop(pack, None)
                else:
                    self._pins[pack] -= 1
            job.pins.clear()

    def _packs_only_hot_may_hold(self) -> set[str]:
        """Packs that versions not yet on cold (nor pruned) name: their only durable copy may be hot's."""
        out: set[str] = set()
        for vid, data in self.catalog.records():
            extra = self.catalog.extra(vid)
            if extra.get("cold") or extra.get("pruned"):
                self._packs_seen.pop(vid, None)
                continue
            packs = self._packs_seen.get(vid)
            if packs is None:
                try:
                    packs = self._packs_seen[vid] = frozenset(self.packs_of(decode_record(vid, data)))
                except DataStatesError:
                    continue  # a manifest unreadable here: fsck reports it
            out |= packs
        return out

    def _evict(self) -> None:
        """Keep hot under its capacity: drop least recently used packs that are durable on cold.

        Never dropped: a pack cold does not hold, one a version not yet on cold
        names (flushed later, or never, by policy: a cold gc may delete cold's
        copy meanwhile), one a save in flight in this process reuses chunks
        from. Runs under the hot ref lock, as commits do, so a save of another
        process either committed before (its packs are kept) or restores what
        it reused before it commits (`_restore_pins`).
        """
        cap = self.tiering.hot_capacity
        if self.cold is None or cap is None:
            return
        with self._evict_lock, self.hot.refs.locked():
            packs = {p.name.removesuffix(".pack"): p.stat().st_size for p in (self.hot.root / "packs").glob("*.pack")}
            used = sum(packs.values())
            if used <= cap:
                return
            keep = self._packs_only_hot_may_hold() | set(self._pins)
            # The id starts with its creation time, so unused packs fall back to oldest first.
            order = sorted(packs, key=lambda p: (self._pack_used.get(p, 0.0), p))
            for pack in order:
                if used <= cap:
                    break
                if pack in keep:
                    continue
                try:
                    on_cold = self.cold.pack_path(pack).stat().st_size == packs[pack]
                except OSError:
                    on_cold = False
                if not on_cold:
                    continue  # never drop the only durable copy
                self.hot.reader.forget(pack)
                self.hot.pack_path(pack).unlink(missing_ok=True)
                used -= packs[pack]

    # refs ------------------------------------------------------------------------
    def resolve(self, ref: Any) -> str:
        """The full version id named by `ref`: an id, a unique prefix (>= 6 hex), a branch, a tag, `REF~N`.

        Raises NotFoundError, AmbiguousRefError.
        """
        if isinstance(ref, Version):
            return ref.id
        if isinstance(ref, SaveHandle):
            return ref.result().id
        if not isinstance(ref, str) or not ref:
            raise NotFoundError(f"ref {ref!r} is not a string; give a version id, branch or tag")
        m = _REF_SUFFIX.match(ref)
        if m and m.group(1):
            base, suffix = m.group(1), m.group(2)
            n = sum(int(x) if x else 1 for x in re.findall(r"~(\d*)", suffix)) + suffix.count("^")
            vid = self.resolve(base)
            for i in range(n):
                parents = self._parents(vid)
                if not parents:
                    raise NotFoundError(
                        f"{ref} goes past the root: {base} has only {i + 1} version(s) in its first-parent chain")
                vid = parents[0]
            return vid
        if HEX_ID.match(ref) and self.catalog.record(ref) is not None:
            return ref
        for kind in ("branch", "tag"):
            found_ref = self.tier.refs.get(kind, ref)  # type: ignore[arg-type]
            if found_ref is not None:
                return found_ref
        if re.fullmatch(r"[0-9a-f]{6,64}", ref):
            found = self.catalog.ids_with_prefix(ref, limit=5)
            if len(found) == 1:
                return found[0]
            if found:
                raise AmbiguousRefError(
                    f"prefix {ref!r} matches several versions ({', '.join(f[:12] for f in found)}...); give more digits"
                )
        elif re.fullmatch(r"[0-9a-f]{1,5}", ref):
            raise NotFoundError(f"ref {ref!r} is too short to be an id prefix (6 hex digits at least)")
        raise NotFoundError(
            f"ref {ref!r} is not a branch, tag or version id; `datastates log` lists versions, "
            "`datastates branch` the branches, `datastates tag` the tags"
        )

    def version(self, ref: Any) -> Version:
        """The Version named by `ref` (with its annotations). Raises NotFoundError."""
        vid = self.resolve(ref)
        data = self.catalog.record(vid)
        if data is None:
            raise NotFoundError(f"version {vid[:12]} is not in the catalog; run `datastates fsck --rebuild`")
        extra = self.catalog.extra(vid)
        return decode_record(vid, data, annotations=self.catalog.annotations(vid),
                             timings=extra.get("timings", {}), pruned=bool(extra.get("pruned")))

    def _parents(self, vid: str) -> list[str]:
        data = self.catalog.record(vid)
        if data is None:
            raise NotFoundError(f"version {vid[:12]} is not in the catalog; run `datastates fsck --rebuild`")
        return list(json.loads(data).get("parents", []))

    def branches(self) -> dict[str, str]:
        return self.tier.refs.names("branch")

    def tags(self) -> dict[str, str]:
        return self.tier.refs.names("tag")

    def branch(self, name: str, at: Any = "main", *, force: bool = False) -> str:
        """Create branch `name` at `at`; with force, move an existing one (logged). Returns the id.

        Raises InvalidNameError, NotFoundError, ConflictError (exists, without force).
        """
        check_name(name, "branch")
        vid = self.resolve(at)
        if force:
            with self.tier.refs.locked():
                old = self.tier.refs.get("branch", name)
                self.tier.refs.set_if_equals("branch", name, old, vid, f"branch -f {_label(at)}", locked=True)
        else:
            self.tier.refs.add_if_new("branch", name, vid, f"branch at {_label(at)}")
        return vid

    def delete_branch(self, name: str) -> str:
        """Delete a branch (its versions stay reachable by id and by the reflog), on cold too."""
        return self._delete_ref("branch", name)

    def _delete_ref(self, kind: str, name: str) -> str:
        vid = self.tier.refs.remove_if_equals(kind, name, message="delete")  # type: ignore[arg-type]
        if self.cold is not None:
            # Otherwise the next open's refresh would bring it back from cold.
            try:
                self.cold.refs.remove_if_equals(kind, name, vid, message="delete")  # type: ignore[arg-type]
            except (NotFoundError, ConflictError):
                pass  # absent on cold, or another host moved it there: theirs to keep
            except OSError as exc:
                log.warning("could not delete %s %r on cold (%s); it may come back at the next open", kind, name, exc)
        return vid

    def tag(self, name: str, ref: Any = "main", message: str = "") -> str:
        """Create an immutable tag. Raises ConflictError if it exists (delete it first)."""
        check_name(name, "tag")
        vid = self.resolve(ref)
        self.tier.refs.add_if_new("tag", name, vid, message or f"tag {_label(ref)}")
        if self.flusher is not None:
            # Tagged versions always reach cold (and the tag with them).
            self._mark_pending(vid)
            self.flusher.enqueue(vid)
        return vid

    def delete_tag(self, name: str) -> str:
        """Delete a tag (here and on cold); the version stays reachable by id."""
        return self._delete_ref("tag", name)

    def reflog(self, name: str, kind: str = "branch") -> list[dict[str, object]]:
        return self.tier.refs.reflog(kind, name)  # type: ignore[arg-type]

    # walking -----------------------------------------------------------------------
    def log(self, ref: Any = "main", *, first_parent: bool = False, limit: int | None = None) -> list[Version]:
        """`ref` and its ancestors, newest first (like `git log`)."""
        from .lineage import ancestors

        start = self.resolve(ref)
        ids = [start] + ancestors(self.graph, start, first_parent=first_parent)
        if limit is not None:
            ids = ids[:limit]
        return [self.version(v) for v in ids]

    @property
    def graph(self) -> Any:
        from .graph import CatalogGraph

        return CatalogGraph(self.catalog)

    def ancestors(self, ref: Any, *, depth: int | None = None, first_parent: bool = False) -> list[str]:
        """Ids of the versions `ref` descends from, newest first (without `ref` itself)."""
        from .lineage import ancestors

        return ancestors(self.graph, self.resolve(ref), depth=depth, first_parent=first_parent)

    def descendants(self, ref: Any, *, depth: int | None = None) -> list[str]:
        """Ids of the versions grown from `ref`, across branches, oldest first."""
        from .lineage import descendants

        return descendants(self.graph, self.resolve(ref), depth=depth)

    def merge_base(self, a: Any, b: Any) -> str | None:
        """The nearest common ancestor of two versions (None if they share none)."""
        from .lineage import merge_base

        return merge_base(self.graph, self.resolve(a), self.resolve(b))

    def paths(self, src: Any, dst: Any, *, limit: int = 100) -> list[list[str]]:
        """The lineage paths from `src` down to `dst` (lists of ids)."""
        from .lineage import paths

        return paths(self.graph, self.resolve(src), self.resolve(dst), limit=limit)

    def versions_table(self) -> Any:
        """Every version as a pyarrow Table: fixed fields plus hparams.*, metrics.*, annotations.* columns."""
        from . import table

        key = (self.catalog.generation(), tuple(sorted(self.tags().items())))
        if self._table is None or self._table[0] != key:
            self._table = (key, table.build(self))
        return self._table[1]

    def find(self, query: str = "", *, as_table: bool = False) -> Any:
        """Versions matching a query such as "hparams.lr > 1e-3 and metrics.loss < 0.5 order by step".

        Returns Versions (or the matching rows as a pyarrow Table). Raises QueryError with the offset.
        """
        from .lineage import ancestors, descendants
        from .query import parse

        q = parse(query)

        def lineage(kind: str, ref: str) -> set[str]:
            start = self.resolve(ref)
            walk = ancestors if kind == "ancestor_of" else descendants
            return set(walk(self.graph, start))

        rows = q.apply(self.versions_table(), lineage)
        if as_table:
            return rows
        return [self.version(v) for v in rows.column("id").to_pylist()]

    def diff(self, a: Any, b: Any, *, keys: list[str] | None = None) -> Any:
        """A pyarrow Table, one row per tensor key; see `datastates.compare.diff`."""
        from .compare import diff

        return diff(self, a, b, keys)

    def history(self, key: str, ref: Any = "main", *, values: bool = False) -> Any:
        """A tensor's stats across the first-parent chain of `ref` (Table), or with values=True
        an iterator of (Version, tensor) loading one at a time."""
        from .compare import history, history_values

        return history_values(self, key, ref) if values else history(self, key, ref)

    def fork(self, ref: Any, *, branch: str | None, parents: Sequence[Any] | None = None,
             hparams: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
             step: int | None = None, message: str = "", fork_of: Any = None,
             explore: dict[str, Any] | None = None) -> Version:
        """A new version holding exactly the tensors of `ref` (no bytes read or written).

        Its parents default to [ref]; hparams/step default to ref's. Used for
        PBT exploit/explore and for re-labelling a state. Moves `branch`.
        """
        self._check_open()
        src = self.version(ref)
        if src.pruned:
            raise PrunedError(f"version {src.short} was pruned; it cannot be forked")
        if branch is not None:
            check_name(branch, "branch")
        rec = record_dict(
            parents=[self.resolve(p) for p in parents] if parents is not None else [src.id],
            manifests=src.manifests, step=src.step if step is None else int(step), epoch=src.epoch,
            created=time.time(), hparams=plain_json(src.hparams if hparams is None else hparams, "hparams"),
            metrics=plain_json(metrics, "metrics"), message=message, branch=branch, world_size=src.world_size,
            bytes_total=src.bytes_total, bytes_new=0, chunks_new=0,
            fork_of=None if fork_of is None else self.resolve(fork_of),
            explore=None if explore is None else plain_json(explore, "explore"),
        )
        vid, data = encode_record(rec)
        refs = self.tier.refs
        with self.tier.writing(), refs.locked():
            self.tier.write_record(vid, data)
            self.catalog.commit(CommitBatch(vid, data, list(rec["parents"])))
            if branch:
                refs.set_if_equals("branch", branch, refs.get("branch", branch), vid, f"fork of {src.short}",
                                   locked=True)
        if self.flusher is not None and self._wants_flush(branch):
            self._mark_pending(vid)
            self.flusher.enqueue(vid)
        return self.version(vid)

    # loading -----------------------------------------------------------------------
    def manifest(self, mid: str) -> Manifest:
        m = self._manifests.get(mid)
        if m is None:
            m = Manifest(mid, self._read_manifest_bytes(mid), verify=self.verify)
            if len(self._manifests) > 256:
                self._manifests.clear()
            self._manifests[mid] = m
        return m

    def _read_manifest_bytes(self, mid: str) -> bytes:
        err: Exception | None = None
        for t in self.tiers:
            try:
                data = t.read_manifest(mid)
            except (NotFoundError, OSError) as exc:
                err = exc
                continue
            if t is not self.hot:
                try:  # manifests are small: keep a copy on hot so restarts do not need cold
                    write_new(self.hot.manifest_path(mid), data)
                except OSError:
                    pass
            return data
        assert err is not None
        raise err

    def manifest_of(self, v: Version, rank: int = 0) -> Manifest:
        if v.pruned:
            raise PrunedError(f"version {v.short} was pruned: its record is kept for lineage, its tensors are gone")
        mid = v.manifests.get(str(rank))
        if mid is None:
            raise NotFoundError(f"version {v.short} has no rank {rank} (world size {v.world_size})")
        return self.manifest(mid)

    def ls(self, ref: Any = "main", rank: int = 0) -> list[TensorInfo]:
        """The tensors of a version with dtype, shape, bytes and stats; reads no tensor bytes."""
        return self.manifest_of(self.version(ref), rank).info()

    def load(self, ref: Any = "main", *, keys: Iterable[str] | None = None, device: str | torch.device = "cpu",
             allow_pickle: bool = False, rank: int = 0) -> Any:
        """The saved state, rebuilt with the same container types; tensors bit-exact.

        `keys` selects key paths (exact, a prefix ending at a '.', or a glob).
        Raises NotFoundError (ref, key), PrunedError, IntegrityError,
        UnsupportedValueError (pickle without allow_pickle), DeviceError (before reading anything).
        """
        self._check_open()
        dev = _usable_device(device)
        v = self.version(ref)
        m = self.manifest_of(v, rank)
        select = None
        if keys is not None:
            select = _key_selector([keys] if isinstance(keys, str) else list(keys), _tree_paths(m.tree), v)
        rows = m.rows
        wanted: list[int] = []

        def want(i: int) -> None:
            r = rows[i]
            if r["kind"] in ("alias", "view"):
                want(r["base"])
            if i not in wanted:
                wanted.append(i)

        for i, r in enumerate(rows):
            if r["kind"] != "storage" and (select is None or select(r["key"])):
                want(i)
        loaded = self._read_rows(m, [i for i in wanted if rows[i]["kind"] in ("tensor", "storage")])
        out: dict[int, torch.Tensor] = {}
        for i in wanted:
            r = rows[i]
            if r["kind"] in ("tensor", "storage"):
                out[i] = loaded[i].to(dev) if dev.type != "cpu" else loaded[i]
            elif r["kind"] == "alias":
                out[i] = out[r["base"]]
            else:
                dt = dtype_from_name(r["dtype"])
                out[i] = torch.empty(0, dtype=dt, device=dev).set_(
                    out[r["base"]].untyped_storage(), r["offset"], r["shape"], r["stride"])
        return unflatten(m.tree, lambda i: out.get(i, SKIP), allow_pickle, select=select)

    def _read_rows(self, m: Manifest, rows: list[int]) -> dict[int, torch.Tensor]:
        total = sum(m.rows[i]["nbytes"] for i in rows)
        if len(rows) > 1 and total > 8 << 20:
            return dict(zip(rows, self._readers.map(lambda i: self._read_row(m, i), rows)))
        return {i: self._read_row(m, i) for i in rows}

    def _read_row(self, m: Manifest, i: int) -> torch.Tensor:
        r = m.rows[i]
        out = torch.empty(r["shape"], dtype=dtype_from_name(r["dtype"]))
        flat = out.reshape(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)
        if flat.numel() != r["nbytes"]:
            raise IntegrityError(f"tensor {r['key']!r} in manifest {m.id[:12]}: {r['nbytes']} bytes stored for "
                                 f"dtype {r['dtype']} shape {r['shape']}; run `datastates fsck`")
        arr = flat.numpy()
        locs = self.catalog.chunks(r["chunks"])
        pos = 0
        for run in _contiguous_runs(list(zip(r["chunks"], locs)), r["key"]):
            size = sum(loc.raw_length for _, loc in run)
            if len(run) > 1 and self._read_run(run, arr[pos:pos + size].data):
                pos += size
                continue
            for cid, loc in run:
                self._read_chunk(cid, loc, arr[pos:pos + loc.raw_length].data, r["key"])
                pos += loc.raw_length
        return out

    def _read_run(self, run: list[tuple[bytes, ChunkLocation]], out: memoryview) -> bool:
        """One read for chunks stored back to back in one hot pack, then verify each; False (nothing
        trusted) if any part fails, so the caller falls back to chunk-by-chunk reads across tiers."""
        first = run[0][1]
        span = ChunkLocation(first.pack, first.offset, len(out), len(out))
        try:
            self.hot.reader.read_into(span, out)
        except (NotFoundError, IntegrityError, OSError):
            return False
        pos = 0
        for cid, loc in run:
            if self.verify and chunk_id(out[pos:pos + loc.raw_length]) != cid:
                return False
            pos += loc.raw_length
        self._pack_used[first.pack] = time.monotonic()
        return True

    def _read_chunk(self, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        """`_read_chunk_at`, looking the chunk up again once if its pack vanished: gc in another
        process may have repacked it since we resolved its location."""
        try:
            self._read_chunk_at(cid, loc, out, key)
        except NotFoundError:
            fresh = self.catalog.chunk(cid)
            if fresh is None or fresh == loc:
                raise
            self._read_chunk_at(cid, fresh, out, key)

    def _read_chunk_at(self, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        """Read and verify one chunk: hot first, then cold. A cold read may promote the pack
        into hot; a corrupt hot copy is replaced by a good cold one (logged)."""
        errors: list[Exception] = []
        for t in self.tiers:
            try:
                self._read_chunk_from(t, cid, loc, out, key)
            except NotFoundError as exc:
                errors.append(exc)
                continue
            except IntegrityError as exc:
                errors.append(exc)
                continue
            if t is not self.hot:
                self._after_cold_read(loc.pack, repair=any(isinstance(e, IntegrityError) for e in errors))
            else:
                self._pack_used[loc.pack] = time.monotonic()
            return
        corrupt = [e for e in errors if isinstance(e, IntegrityError)]
        if corrupt:
            raise corrupt[0]
        raise NotFoundError(f"chunk {cid.hex()[:16]} of tensor {key!r} is on no reachable tier: "
                            + "; ".join(str(e) for e in errors))

    def _read_chunk_from(self, t: Tier, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        try:
            if loc.codec == CODEC_ZSTD:
                import zstandard

                data = zstandard.ZstdDecompressor().decompress(t.reader.read(loc), max_output_size=loc.raw_length)
                if len(data) != loc.raw_length:
                    raise IntegrityError(f"chunk {cid.hex()[:16]} of {key!r} decodes to {len(data)} bytes, "
                                         f"not {loc.raw_length}; run `datastates fsck`")
                out[:] = data
            else:
                t.reader.read_into(loc, out)
        except OSError as exc:
            raise NotFoundError(f"pack {loc.pack} is unreadable on tier {t.name}: {exc}") from exc
        except (ValueError, _ZstdError) as exc:  # zstd errors on damaged frames
            raise IntegrityError(f"chunk {cid.hex()[:16]} of tensor {key!r} in pack {loc.pack} does not decode "
                                 f"on tier {t.name}: {exc}; run `datastates fsck`") from exc
        if self.verify and chunk_id(out) != cid:
            raise IntegrityError(
                f"chunk {cid.hex()[:16]} of tensor {key!r} in pack {loc.pack} at offset {loc.offset} is corrupt "
                f"(blake3 mismatch) on tier {t.name}; run `datastates fsck`"
            )

    def _after_cold_read(self, pack: str, repair: bool) -> None:
        assert self.cold is not None
        src, dst = self.cold.pack_path(pack), self.hot.pack_path(pack)
        try:
            if repair:
                log.warning("pack %s was corrupt on hot; replaced it with the good copy from cold", pack)
                self.hot.reader.forget(pack)
                copy_file(src, dst, overwrite=True)
            elif self.tiering.promote and not dst.exists():
                cap = self.tiering.hot_capacity
                used = sum(p.stat().st_size for p in (self.hot.root / "packs").glob("*.pack"))
                if cap is None or used + src.stat().st_size <= cap:
                    copy_file(src, dst)
            self._pack_used[pack] = time.monotonic()
        except OSError as exc:  # promotion is an optimisation; the read already succeeded
            log.warning("could not copy pack %s into hot: %s", pack, exc)

    def read_chunk(self, cid: bytes, key: str = "?") -> bytes:
        """The raw bytes of one chunk, verified. Raises NotFoundError, IntegrityError."""
        loc = self.catalog.chunk(cid)
        if loc is None:
            raise NotFoundError(
                f"chunk {cid.hex()[:16]} of tensor {key!r} is not in the catalog; run `datastates fsck`")
        out = bytearray(loc.raw_length)
        self._read_chunk(cid, loc, memoryview(out), key)
        return bytes(out)

    def checkout(self, ref: Any = "main", *, strict: bool = True, allow_pickle: bool = False,
                 **objects: Any) -> Version:
        """Load `ref` into live objects: `checkout("warm", model=m, optimizer=opt)`.

        Each keyword names a top-level key of the saved state (with the usual
        aliases: optimizer/optim, scheduler/lr_scheduler). Raises NotFoundError
        naming the missing key and the keys that exist.
        """
        v = self.version(ref)
        names = {}
        top = self.manifest_of(v).tree
        keys = top.get("k", []) if top["t"] in ("dict", "odict") else []
        for name in objects:
            key = next((k for k in (name, *_ALIASES.get(name, ())) if k in keys), None)
            if key is None:
                raise NotFoundError(f"version {v.short} has no key {name!r} (top-level keys: {keys}); "
                                    "pass the objects under the names they were saved with")
            names[name] = key
        state = self.load(v, keys=list(names.values()), allow_pickle=allow_pickle)
        for name, obj in objects.items():  # check everything first: a failed checkout changes nothing
            if isinstance(obj, torch.nn.Module):
                _check_shapes(name, state[names[name]], obj.state_dict(), v)
        for name, obj in objects.items():
            sd = state[names[name]]
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(sd, strict=strict)
            else:
                obj.load_state_dict(sd)
        return v

    # metadata ------------------------------------------------------------------------
    def annotate(self, ref: Any, **values: Any) -> Version:
        """Add or change mutable annotations (never part of the id): annotate(v, metrics={...}) or key=value."""
        vid = self.resolve(ref)
        flat = {}
        for k, val in values.items():
            if k in ("metrics", "annotations") and isinstance(val, dict):
                flat.update(val)
            else:
                flat[k] = val
        clean = plain_json(flat, "annotations")
        with self.tier.refs.locked():
            current = self.catalog.annotations(vid)
            current.update(clean)
            current["_updated"] = time.time()
            self.tier.write_annotations(vid, canonical_json(current))
            self.catalog.set_annotations(vid, current)
        return self.version(vid)

    def du(self) -> dict[str, int]:
        """Bytes as the versions see them (total) against bytes actually stored (unique)."""
        total = sum(int(json.loads(rec).get("bytes_total", 0)) for _, rec in self.catalog.records())
        unique = sum(loc.raw_length for _, loc in self.catalog.iter_chunks())
        stored = sum(p.stat().st_size for p in (self.path / "packs").glob("*.pack"))
        return {"versions": self.catalog.version_count(), "bytes_total": total, "bytes_unique": unique,
                "bytes_on_disk": stored, "packs": len(list((self.path / "packs").glob("*.pack")))}

    def prune(self, retention: Any, *, dry_run: bool = False) -> Any:
        """Drop the bytes of versions no policy keeps (records stay; loading them raises PrunedError).
        Tags, branch heads and protected versions (PBT donors) are always kept. See datastates.retention."""
        from .retention import prune

        self.wait()
        return prune(self, retention, dry_run=dry_run)

    def gc(self, *, dry_run: bool = False, repack_threshold: float = 0.5, cold_grace_s: float | None = None) -> Any:
        """Delete packs no live version needs and repack sparse ones, on every tier; returns a
        GcReport with bytes freed per tier. See `datastates.gc.gc` and `datastates.gc.collect_cold`."""
        from .gc import COLD_GRACE_S, gc

        self.wait()
        with self._evict_lock:
            self._packs_seen.clear()
        return gc(self, dry_run=dry_run, repack_threshold=repack_threshold,
                  cold_grace_s=COLD_GRACE_S if cold_grace_s is None else cold_grace_s)

    def fsck(self, *, repair: bool = False, rebuild: bool = False) -> Any:
        """Verify every chunk, manifest, record and ref; see `datastates.fsck.fsck`."""
        from .fsck import fsck

        self.wait()
        return fsck(self, repair=repair, rebuild=rebuild)


def _label(ref: Any) -> str:
    """A short printable name for a ref argument (reflog messages)."""
    if isinstance(ref, Version):
        return ref.short
    return str(ref) if isinstance(ref, str) else type(ref).__name__


def _usable_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this process can allocate on; DeviceError otherwise."""
    try:
        dev = torch.device(device)
        if dev.type != "cpu":
            torch.empty(0, device=dev)  # the one reliable probe: an unknown index, a missing backend
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        raise DeviceError(f"cannot load onto device {device!r}: {str(exc).splitlines()[0]}; "
                          "pass device='cpu' (the default) or a device this process has") from exc
    return dev


def _whole_number(value: Any, what: str) -> int | None:
    """`value` as an int (None stays None); InvalidArgumentError for anything that is not a whole number."""
    if value is None:
        return None
    try:
        n = int(value)
        ok = n == value and not isinstance(value, bool)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise InvalidArgumentError(f"{what}={value!r} is not a whole number; give an int such as {what}=100")
    return n


def _check_chunk_size(size: int) -> None:
    if size <= 0 or size % 64:
        raise InvalidArgumentError(f"chunk_size {size} must be a positive multiple of 64 bytes")


try:
    from zstandard import ZstdError as _ZstdError
except ImportError:  # zstd is optional; without it no chunk can be zstd-coded on this side
    class _ZstdError(Exception):  # type: ignore[no-redef]
        pass


def _contiguous_runs(chunks: list[tuple[bytes, ChunkLocation | None]],
                     key: str) -> list[list[tuple[bytes, ChunkLocation]]]:
    """Group a tensor's chunks into runs stored back to back, uncompressed, in one pack."""
    runs: list[list[tuple[bytes, ChunkLocation]]] = []
    for cid, loc in chunks:
        if loc is None:
            raise NotFoundError(f"chunk {cid.hex()[:16]} of tensor {key!r} is not in the catalog; "
                                "run `datastates fsck`")
        prev = runs[-1][-1][1] if runs else None
        if (prev is not None and loc.codec == CODEC_RAW and prev.codec == CODEC_RAW and prev.pack == loc.pack
                and prev.offset + prev.length == loc.offset):
            runs[-1].append((cid, loc))
        else:
            runs.append([(cid, loc)])
    return runs


def _check_shapes(name: str, saved: Any, live: dict[str, Any], v: Version) -> None:
    """Raise ShapeMismatchError naming the first tensor whose saved shape differs from the live one."""
    for key, t in live.items():
        s = saved.get(key) if isinstance(saved, dict) else None
        if isinstance(t, torch.Tensor) and isinstance(s, torch.Tensor) and tuple(s.shape) != tuple(t.shape):
            raise ShapeMismatchError(
                f"{name}.{key} is {tuple(s.shape)} in version {v.short} but {tuple(t.shape)} in the live object; "
                "build the object with the saved architecture, or load the state and map it yourself"
            )


def _tree_paths(node: dict[str, Any], path: str = "") -> list[str]:
    """Every key path in a state skeleton: leaves and containers (a scheduler's subtree has no tensor)."""
    out = [path] if path else []
    t = node["t"]
    if t in ("dict", "odict"):
        for k, child in zip(node["k"], node["v"]):
            out += _tree_paths(child, f"{path}.{k}" if path else str(k))
    elif t in ("list", "tuple"):
        for i, child in enumerate(node["v"]):
            out += _tree_paths(child, f"{path}.{i}" if path else str(i))
    return out


def _key_selector(keys: list[str], existing: list[str], v: Version) -> Any:
    pats = []
    for k in keys:
        if not isinstance(k, str) or not k:
            raise InvalidNameError(f"key {k!r} must be a non-empty string path like 'model.fc.weight'")
        if not any(e == k or e.startswith(k + ".") or fnmatch.fnmatchcase(e, k) for e in existing):
            raise NotFoundError(f"version {v.short} has no key {k!r}; `datastates ls {v.short}` lists its keys")
        pats.append(k)

    def select(path: str) -> bool:
        return any(path == k or path.startswith(k + ".") or fnmatch.fnmatchcase(path, k) for k in pats)

    return select


__all__ = ["Store", "DataStatesError"]
