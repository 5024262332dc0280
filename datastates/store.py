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
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from . import manifest as mf
from .catalog import Catalog, CommitBatch
from .chunks import CODEC_ZSTD, DEFAULT_CHUNK_SIZE, ChunkLocation, chunk_id
from .engine import BufferPool, Pipeline, SaveHandle, SaveJob, capture
from .errors import (
    AmbiguousRefError,
    DataStatesError,
    IntegrityError,
    InvalidNameError,
    NotFoundError,
    PrunedError,
    SaveFailedError,
    StoreClosedError,
)
from .files import canonical_json
from .manifest import Manifest, TensorInfo
from .refs import HEX_ID, check_name
from .statetree import SKIP, dtype_from_name, flatten, unflatten
from .tier import Tier
from .versions import Version, decode_record, encode_record, plain_json, record_dict

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
                 zstd_level: int, workers: int) -> None:
        self.tier = tier
        self.tiers = [tier]
        self.catalog = catalog
        self.chunk_size = chunk_size
        self.verify = verify
        self._closed = False
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}
        self._table: tuple[Any, Any] | None = None
        self.pool = BufferPool(pool_bytes, max(chunk_size, 1 << 20), pin=torch.cuda.is_available())
        self._cuda_stream: Any = None
        self.pipeline = Pipeline(self._commit, self.catalog.has_chunks, self.tier.new_pack, self.pool,
                                 workers=workers, zstd_level=zstd_level, on_error=self._record_error,
                                 guard=self.tier.writing)
        self._readers = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="datastates-read")
        ref = weakref.ref(self)

        def drain() -> None:
            s = ref()
            if s is not None:
                s._drain_at_exit()

        self._atexit = drain
        atexit.register(self._atexit)

    # opening -------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create: bool = True, chunk_size: int | None = None,
             pool_bytes: int | None = None, verify: bool = True, zstd_level: int = 0, workers: int = 2) -> Store:
        """Open (and by default create) the store at `path`.

        Raises StoreFormatError for a newer format or a non-store directory,
        NotFoundError when `create=False` and nothing is there. A missing
        catalog is rebuilt from the tier files.
        """
        root = Path(path).expanduser()
        tier = Tier(root)
        info = tier.read_format()
        if info is None:
            if not create:
                raise NotFoundError(f"no store at {root}; run `datastates init --store {root}` or pass create=True")
            tier.create({"chunk_size": chunk_size or DEFAULT_CHUNK_SIZE})
            info = tier.read_format() or {}
        size = int(chunk_size or info.get("chunk_size", DEFAULT_CHUNK_SIZE))  # type: ignore[call-overload]
        if size <= 0 or size % 64:
            raise ValueError(f"chunk_size {size} must be a positive multiple of 64 bytes")
        had_catalog = (root / "catalog" / "data.mdb").exists()
        catalog = Catalog(root / "catalog")
        store = cls(tier, catalog, chunk_size=size, pool_bytes=pool_bytes or _default_pool_bytes(), verify=verify,
                    zstd_level=zstd_level, workers=workers)
        if not had_catalog and next(tier.iter_ids("versions", "json"), None) is not None:
            from .fsck import rebuild_catalog

            rebuild_catalog(store)
        return store

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(raise_errors=exc[0] is None)

    @property
    def path(self) -> Path:
        return self.tier.root

    def _invalidate(self) -> None:
        self._table = None

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.path} is closed; open it again with Store.open")

    def _record_error(self, job: SaveJob, exc: BaseException) -> None:
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
        finally:
            atexit.unregister(self._atexit)
            self._readers.shutdown()
            self.tier.close()
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
        return self.save_async(state, branch=branch, **kw).result()

    def save_async(self, state: Any, *, branch: str | None = "main", parents: Sequence[Any] | None = None,
                   step: int | None = None, epoch: int | None = None, hparams: dict[str, Any] | None = None,
                   metrics: dict[str, Any] | None = None, message: str = "", allow_pickle: bool = False,
                   lazy: bool = False, optimizer: torch.optim.Optimizer | None = None,
                   fork_of: Any = None, explore: dict[str, Any] | None = None) -> SaveHandle:
        """Start saving `state`; return once its tensors are copied (at once when `lazy`).

        `parents=None` makes the version a child of the branch head at commit
        time (linear history even with several writers). With `lazy=True` the
        copy runs in the background: call `handle.wait_staged()` before
        mutating tensors, or pass `optimizer=` so its next `step()` waits.
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
            "step": None if step is None else int(step),
            "epoch": None if epoch is None else int(epoch),
            "hparams": plain_json(hparams, "hparams"),
            "metrics": plain_json(metrics, "metrics"),
            "message": str(message),
            "fork_of": None if fork_of is None else self.resolve(fork_of),
            "explore": None if explore is None else plain_json(explore, "explore"),
        }
        tree, entries = flatten(state, allow_pickle=allow_pickle)
        handle = SaveHandle()
        job = SaveJob(tree, entries, request, handle, self.chunk_size, t0=t_call)
        stream = self._stream_for(entries)
        self.pipeline.submit(job)
        if lazy:
            threading.Thread(target=self._capture_quietly, args=(job, stream), name="datastates-capture",
                             daemon=True).start()
            if optimizer is not None:
                _wait_before_step(optimizer, handle)
        else:
            capture(job, self.pool, stream)
        job.timings["blocking_s"] = time.perf_counter() - t_call
        return handle

    def _capture_quietly(self, job: SaveJob, stream: Any) -> None:
        try:
            capture(job, self.pool, stream)
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
            self.catalog.commit(CommitBatch(vid, data, parents, list(job.new_chunks.items()), packs,
                                            {"timings": job.timings}))
            if branch:
                refs.set_if_equals("branch", branch, head, vid, f"save: {req['message']}".strip(), locked=True)
        return decode_record(vid, data, timings=dict(job.timings))

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
                self.tier.refs.set_if_equals("branch", name, old, vid, f"branch -f {at}", locked=True)
        else:
            self.tier.refs.add_if_new("branch", name, vid, f"branch at {at}")
        return vid

    def delete_branch(self, name: str) -> str:
        """Delete a branch (its versions stay reachable by id and by the reflog)."""
        return self.tier.refs.remove_if_equals("branch", name, message="delete")

    def tag(self, name: str, ref: Any = "main", message: str = "") -> str:
        """Create an immutable tag. Raises ConflictError if it exists (delete it first)."""
        check_name(name, "tag")
        vid = self.resolve(ref)
        self.tier.refs.add_if_new("tag", name, vid, message or f"tag {ref}")
        return vid

    def delete_tag(self, name: str) -> str:
        return self.tier.refs.remove_if_equals("tag", name, message="delete")

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
        return self.version(vid)

    # loading -----------------------------------------------------------------------
    def manifest(self, mid: str) -> Manifest:
        m = self._manifests.get(mid)
        if m is None:
            m = Manifest(mid, self.tier.read_manifest(mid), verify=self.verify)
            if len(self._manifests) > 256:
                self._manifests.clear()
            self._manifests[mid] = m
        return m

    def manifest_of(self, v: Version, rank: int = 0) -> Manifest:
        if v.pruned:
            raise PrunedError(f"version {v.short} was pruned: its record is kept for lineage, its tensors are gone")
        try:
            return self.manifest(v.manifests[str(rank)])
        except KeyError:
            raise NotFoundError(f"version {v.short} has no rank {rank} (world size {v.world_size})") from None

    def ls(self, ref: Any = "main", rank: int = 0) -> list[TensorInfo]:
        """The tensors of a version with dtype, shape, bytes and stats; reads no tensor bytes."""
        return self.manifest_of(self.version(ref), rank).info()

    def load(self, ref: Any = "main", *, keys: Iterable[str] | None = None, device: str | torch.device = "cpu",
             allow_pickle: bool = False, rank: int = 0) -> Any:
        """The saved state, rebuilt with the same container types; tensors bit-exact.

        `keys` selects key paths (exact, a prefix ending at a '.', or a glob).
        Raises NotFoundError (ref, key), PrunedError, IntegrityError,
        UnsupportedValueError (pickle without allow_pickle).
        """
        self._check_open()
        v = self.version(ref)
        m = self.manifest_of(v, rank)
        select = None
        if keys is not None:
            select = _key_selector(list(keys), [r["key"] for r in m.rows if r["kind"] != "storage"], v)
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
        dev = torch.device(device)
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
        for cid, loc in zip(r["chunks"], locs):
            if loc is None:
                raise NotFoundError(f"chunk {cid.hex()[:16]} of tensor {r['key']!r} is not in the catalog; "
                                    "run `datastates fsck`")
            view = arr[pos:pos + loc.raw_length].data
            self._read_chunk(cid, loc, view, r["key"])
            pos += loc.raw_length
        return out

    def _read_chunk(self, cid: bytes, loc: ChunkLocation, out: memoryview, key: str) -> None:
        if loc.codec == CODEC_ZSTD:
            import zstandard

            data = zstandard.ZstdDecompressor().decompress(self.tier.reader.read(loc), max_output_size=loc.raw_length)
            out[:] = data[: loc.raw_length] if len(data) == loc.raw_length else data + b"\0" * 0
        else:
            self.tier.reader.read_into(loc, out)
        if self.verify and chunk_id(out) != cid:
            raise IntegrityError(
                f"chunk {cid.hex()[:16]} of tensor {key!r} in pack {loc.pack} at offset {loc.offset} is corrupt "
                f"(blake3 mismatch) on tier {self.tier.name}; run `datastates fsck`"
            )

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

    def fsck(self, *, repair: bool = False, rebuild: bool = False) -> Any:
        """Verify every chunk, manifest, record and ref; see `datastates.fsck.fsck`."""
        from .fsck import fsck

        self.wait()
        return fsck(self, repair=repair, rebuild=rebuild)


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


def _wait_before_step(optimizer: torch.optim.Optimizer, handle: SaveHandle) -> None:
    """Make the optimizer's next step() wait until `handle` is staged (one-shot hook)."""
    hook_handle: Any = None

    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        handle.wait_staged()
        hook_handle.remove()

    hook_handle = optimizer.register_step_pre_hook(hook)


__all__ = ["Store", "DataStatesError"]
