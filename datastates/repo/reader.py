"""Loading: a version's manifest back into the saved state, tensors bit-exact, and `checkout`
into live objects. Reads go through the object store (verified, across tiers)."""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Iterable
from concurrent.futures import Executor
from typing import Any

import torch

from ..base.collector import paused
from ..base.comm import Comm
from ..base.memory import bytes_at
from ..errors import (
    DeviceError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotFoundError,
    ShapeMismatchError,
)
from ..meta.versions import Version, shown
from ..objects.object_store import PendingRead
from ..save.collective import matches
from ..save.manifest import Manifest
from ..save.tree import SKIP, Route, dtype_from_name, key_patterns, tensor_rows, tree_paths, unflatten
from .repository import Repository

log = logging.getLogger("datastates")

ALIASES = {"optimizer": ("optim", "opt"), "optim": ("optimizer", "opt"), "scheduler": ("lr_scheduler", "sched"),
           "lr_scheduler": ("scheduler", "sched"), "scaler": ("grad_scaler",)}


def load(repo: Repository, ref: Any, *, keys: Iterable[str] | None = None, device: str | torch.device = "cpu",
         allow_pickle: bool = False, rank: int | str = 0, executor: Executor | None = None,
         version: Version | None = None, mmap: bool = False) -> Any:
    """The saved state, rebuilt with the same container types; tensors bit-exact.

    `keys` selects key paths (exact; a prefix of whole segments, 'model' for 'model.fc.weight'; or a
    glob). `version`: the record of `ref` when the caller has just read it (it is not read again). `mmap`: host
    tensors are made on private mappings of the packs where they can be (`_map_rows`); onto an accelerator it
    changes nothing.
    Raises NotFoundError (ref, key), PrunedError, IntegrityError,
    UnsupportedValueError (pickle without allow_pickle), DeviceError (before reading anything).
    """
    repo.check_open()
    dev = usable_device(device)
    # A load allocates a few objects per tensor: with thousands of small tensors, the collections they set
    # off took half of the caller's CPU (8,000 x 16 KiB: 0.216 -> 0.099 s with the collector paused).
    with paused():
        return _load(repo, ref, keys, dev, allow_pickle, rank, executor, version, mmap)


def _load(repo: Repository, ref: Any, keys: Iterable[str] | None, dev: torch.device, allow_pickle: bool,
          rank: int | str, executor: Executor | None, version: Version | None, mmap: bool) -> Any:
    v = repo.version(ref, annotated=False) if version is None else version
    m = repo.manifest_of(v, rank)
    select, route = None, None
    if keys is None:
        # Every row as column lists, not as dicts: a third of the decoding, and no dict per row to read.
        cols = m.load_columns()
        named = [i for i, k in enumerate(cols["kind"]) if k != "storage"]
    else:
        # Only the rows and the part of the tree the keys name are decoded and walked: one tensor out of
        # thousands costs a few lookups on a cached manifest, not a pass over every row and node.
        select, route = _key_selector(key_patterns(keys) or [], m, v)
        named = tensor_rows(m.tree, select, route)
        cols = m.load_columns(named)
        kinds, bases_of = cols["kind"], cols["base"]
        # The rows that aliases and views name, too (a base that is not a row is refused by `want` below).
        bases = [bases_of[i] for i in named if kinds[i] in ("alias", "view") and 0 <= bases_of[i] < m.table.num_rows]
        if bases:
            for name, values in m.load_columns(bases).items():
                cols[name].update(values)
    kind, base = cols["kind"], cols["base"]
    rows = m.table.num_rows
    wanted: dict[int, None] = {}  # an ordered set: bases before the rows that point at them

    def want(i: int) -> None:
        if kind[i] in ("alias", "view"):
            b = base[i]
            if not 0 <= b < rows:
                raise IntegrityError(f"manifest {m.id[:12]} row {i} ({cols['key'][i]!r}) points at row {b} "
                                     f"({rows} rows); run `datastates fsck`")
            want(b)
        wanted.setdefault(i)

    for i in named:
        want(i)
    read = [i for i in wanted if kind[i] in ("tensor", "storage")]
    # The rows read are the bases of the others (aliases name a tensor row, views a storage row).
    if dev.type != "cpu":
        out = _read_rows_onto(repo, m, read, executor, cols, dev)
    elif mmap:
        out = _map_rows(repo, m, read, executor, cols)
    else:
        out = _read_rows(repo, m, read, executor, cols)
    strides = cols["stride"]
    for i in read:
        if strides[i] and kind[i] == "tensor":  # a dense layout other than row-major, as saved (`kept_layout`)
            t = out[i]
            out[i] = torch.empty_strided(t.shape, strides[i], dtype=t.dtype, device=t.device).copy_(t)
    for i in wanted:
        if i in out:
            continue
        if kind[i] == "alias":
            out[i] = out[base[i]]
        else:
            dt = dtype_from_name(cols["dtype"][i])
            out[i] = torch.empty(0, dtype=dt, device=dev).set_(
                out[base[i]].untyped_storage(), cols["offset"][i], cols["shape"][i], cols["stride"][i])
    return unflatten(m.tree, lambda i: out.get(i, SKIP), allow_pickle, select=select, route=route)


def rank_for(v: Version, comm: Comm, keys: Iterable[str] | str | None) -> tuple[int, Any]:
    """Which rank's manifest a rank of `comm` loads of `v`, and the keys to read there: its own at the
    world size `v` was saved with; else rank 0's, limited to the replicated entries.
    Raises InvalidArgumentError when `v` has no replicated entries or `keys` asks for sharded ones."""
    if v.world_size == 1:
        return 0, keys
    if v.world_size == comm.size:
        return comm.rank, keys
    hint = f"pass rank=r (0..{v.world_size - 1}) to read rank r's entries"
    if not v.replicated:
        raise InvalidArgumentError(f"version {v.short} was saved by {v.world_size} ranks with no replicated entries "
                                   f"and this job has {comm.size}; {hint}")
    if keys is None:
        return 0, list(v.replicated)
    wanted = key_patterns(keys) or []
    sharded = [k for k in wanted if not matches(k, v.replicated)]
    if sharded:
        raise InvalidArgumentError(f"keys {sharded} of version {v.short} are not replicated (saved by "
                                   f"{v.world_size} ranks, this job has {comm.size}); {hint}")
    return 0, wanted


def _read_rows(repo: Repository, m: Manifest, rows: list[int], executor: Executor | None,
               cols: dict[str, Any]) -> dict[int, torch.Tensor]:
    """Tensor rows `rows` of `m` (their fields in `cols`, `Manifest.load_columns`), read together: every tensor is
    allocated first, then the object store reads all their chunks at once (one catalog lookup, one `preadv` per
    run of chunks stored back to back, in two streams: `ObjectStore.start_read_many`), straight into the tensors'
    storage, verified."""
    out: dict[int, torch.Tensor] = {}
    items = []
    keys, dtypes, shapes, nbytes, chunks = cols["key"], cols["dtype"], cols["shape"], cols["nbytes"], cols["chunks"]
    for i in rows:
        out[i], flat = _empty_row(m, keys[i], dtypes[i], shapes[i], nbytes[i])
        items.append((chunks[i], flat, keys[i]))
    repo.objects.read_many_into(items, executor, streams=2)
    return out


def _map_rows(repo: Repository, m: Manifest, rows: list[int], executor: Executor | None,
              cols: dict[str, Any]) -> dict[int, torch.Tensor]:
    """Tensor rows `rows` of `m`, as `_read_rows` gives them, but made on the packs' bytes where they can be
    (`ObjectStore.map_many`: raw chunks back to back in one hot pack, aligned for the dtype, verified): each such
    tensor has a storage of its own bytes in a private mapping of the pack, so nothing is copied and the pages
    become resident as they are read, as with `torch.load(mmap=True)`. Writes to it stay in this process. The
    rows it cannot map (and empty tensors) are read by `_read_rows`, with its errors.
    Raises IntegrityError (a row whose byte count does not fit its dtype and shape), NotFoundError."""
    keys, dtypes, shapes, nbytes, chunks = cols["key"], cols["dtype"], cols["shape"], cols["nbytes"], cols["chunks"]
    mapped: list[tuple[int, torch.dtype]] = []
    items = []
    for i in rows:
        dtype = dtype_from_name(dtypes[i])
        numel = math.prod(shapes[i])
        if numel * dtype.itemsize != nbytes[i]:
            raise _size_mismatch(m, keys[i], dtypes[i], shapes[i], nbytes[i])
        if numel:
            mapped.append((i, dtype))
            items.append((chunks[i], nbytes[i], dtype.itemsize))
    out: dict[int, torch.Tensor] = {}
    rest = [i for i in rows if nbytes[i] == 0]
    for (i, dtype), view in zip(mapped, repo.objects.map_many(items, executor)):
        if view is None:
            rest.append(i)
        else:
            out[i] = torch.frombuffer(view, dtype=dtype).view(shapes[i])
    if rest:
        out.update(_read_rows(repo, m, rest, executor, cols))
    return out


STAGE_BYTES = 64 << 20
"""A load onto a GPU reads through two pinned host buffers of this size, in turns (see `_read_rows_onto`)."""


def _read_rows_onto(repo: Repository, m: Manifest, rows: list[int], executor: Executor | None,
                    cols: dict[str, Any], dev: torch.device, stage_bytes: int | None = None
                    ) -> dict[int, torch.Tensor]:
    """Tensor rows `rows` of `m`, as `_read_rows` reads them, made on `dev` (an accelerator): each tensor is
    allocated there, and its chunks are read and verified into one of two reused pinned host buffers, then copied
    on with `non_blocking` (a group of many tensors in one copy to a buffer on `dev`, spread from there with one
    `_foreach_copy_`), so that the next group's read overlaps this group's copies. Each group is read in two
    streams (`ObjectStore.start_read_many`). The host memory touched
    is the two buffers, not the state: reading into new pageable memory and copying each tensor from there made
    a load onto an H100 0.17-0.19 s slower than onto the host for 1.1 GiB. A tensor bigger than a buffer is
    read a run of chunks at a time. The copies are queued on the current stream, so work queued after the load
    sees the tensors complete, as with `Tensor.to(dev, non_blocking=True)`.
    Raises IntegrityError, NotFoundError as `_read_rows`."""
    stage_bytes = STAGE_BYTES if stage_bytes is None else stage_bytes
    out: dict[int, torch.Tensor] = {}
    # (chunks, the bytes on `dev` they fill, key, their count). The count is kept as an int: `len()` of a tensor
    # is a Python-level method, and a load of 8,000 small tensors called it 56,000 times (on an H200, warm loads
    # of `small` onto the GPU 323 -> 317 ms, cold 640 -> 589 ms, medians of 4 alternated).
    segments: list[tuple[list[bytes], torch.Tensor, str, int]] = []
    keys, dtypes, shapes, nbytes, chunks = cols["key"], cols["dtype"], cols["shape"], cols["nbytes"], cols["chunks"]
    big = {i: repo.objects.index.chunks(chunks[i]) for i in rows if nbytes[i] > stage_bytes}
    stage_bytes = max([stage_bytes, *(loc.raw_length for locs in big.values() for loc in locs if loc is not None)])
    hosted = []  # rows whose chunks are not all in the catalog: the host path reports what is missing
    for i in rows:
        if any(loc is None for loc in big.get(i, ())):
            hosted.append(i)
            continue
        t = torch.empty(shapes[i], dtype=dtype_from_name(dtypes[i]), device=dev)
        n = t.numel() * t.element_size()
        if n != nbytes[i]:
            raise _size_mismatch(m, keys[i], dtypes[i], shapes[i], nbytes[i])
        out[i] = t
        if not n:
            continue
        flat = t.reshape(-1).view(torch.uint8)
        if i not in big:
            segments.append((chunks[i], flat, keys[i], n))
            continue
        pos, first, size = 0, 0, 0
        for j, loc in enumerate(big[i]):
            assert loc is not None
            if size + loc.raw_length > stage_bytes:
                part = flat[pos:pos + size]
                segments.append((chunks[i][first:j], part, keys[i], part.numel()))
                pos, first, size = pos + size, j, 0
            size += loc.raw_length
        part = flat[pos:pos + size]
        segments.append((chunks[i][first:], part, keys[i], part.numel()))
    if hosted:
        out.update({i: t.to(dev) for i, t in _read_rows(repo, m, hosted, executor, cols).items()})
    pin = dev.type == "cuda"
    size_of = min(stage_bytes, sum(seg[3] for seg in segments))
    buffers: list[tuple[torch.Tensor, bool]] = []  # (buffer, pinned)
    done: list[Any] = [None, None]
    spread: torch.Tensor | None = None  # on `dev`: a group's bytes, spread from there into their tensors
    # A turn's bytes are read (this thread) while the executor still verifies the previous turn's; that turn is
    # copied on once verified. Waiting for each turn's checks before reading on left this thread idle for the
    # tail of every turn's hashing: on an H200, warm loads of `transformer` (1.1 GiB) went 0.304 -> 0.268 s and of
    # `cnn` 0.048 -> 0.043 s (medians of 5, alternated); cold loads are the disk's either way.
    pending: tuple[int, int, int, PendingRead] | None = None  # (turn, first segment, end, its read)
    turn, start = 0, 0
    while start < len(segments) or pending is not None:
        current = None
        if start < len(segments):
            end, size = start, 0
            while end < len(segments) and size + segments[end][3] <= size_of:
                size += segments[end][3]
                end += 1
            if len(buffers) == turn:  # the second buffer only when there is a second turn
                buffers.append(host_buffer(size_of, pin))
            if done[turn] is not None:
                done[turn].synchronize()  # its last copy out has finished
            arr = buffers[turn][0].numpy()
            items, pos = [], 0
            for cids, _, key, n in segments[start:end]:
                items.append((cids, arr[pos:pos + n], key))
                pos += n
            # Two streams per turn, as onto the host: on an H200, warm loads of `transformer` 0.307 -> 0.220 s and
            # of `cnn` 0.042 -> 0.033 s against one stream, cold 0.919 -> 0.849 and 0.113 -> 0.104 s; `small`
            # unchanged (medians of 4, alternated; docs/benchmarks.md "On a GPU a third time").
            current = (turn, start, end, repo.objects.start_read_many(items, executor, streams=2))
            turn, start = 1 - turn, end
        if pending is not None:
            was, first, last, read = pending
            read.finish()  # its checks (raises IntegrityError, NotFoundError)
            group = segments[first:last]
            if len(group) > 1 and spread is None:
                spread = torch.empty(size_of, dtype=torch.uint8, device=dev)
            done[was] = _copy_across([seg[1] for seg in group], [seg[3] for seg in group], *buffers[was], spread,
                                     dev)
        pending = current
    return out


def _copy_across(dests: list[torch.Tensor], sizes: list[int], buf: torch.Tensor, pinned: bool,
                 spread: torch.Tensor | None, dev: torch.device) -> Any:
    """Queue the copies of `buf`'s first bytes into `dests` (byte views on `dev` of `sizes` bytes, back to back in
    `buf`); return the event after which `buf` may be reused, None when the copy was synchronous (pageable `buf`).
    `spread` (on `dev`, at least as big) is needed when there are several `dests`."""
    size = sum(sizes)
    if len(dests) == 1:
        dests[0].copy_(buf[:size], non_blocking=pinned)
    else:
        # Many tensors: one copy across, then one `_foreach_copy_` on the device into their storages (a copy
        # per tensor cost more than the whole-host-load path's `.to()` with 8,000 small tensors).
        assert spread is not None
        spread[:size].copy_(buf[:size], non_blocking=pinned)
        torch._foreach_copy_(dests, list(spread[:size].split(sizes)))
    if not pinned:  # a copy from pageable memory has read it all when it returns
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    return event


def host_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """A host buffer of `nbytes` and whether it is pinned: pinned when `pin` and the driver grants it. A refusal
    (pinned memory is a scarce, locked resource) makes the copies from it synchronous, not the load fail."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as exc:
            log.warning("no pinned host memory for a load onto the GPU (%s); copying from pageable memory",
                        str(exc).splitlines()[0])
    return torch.empty(nbytes, dtype=torch.uint8), False


def _size_mismatch(m: Manifest, key: str, dtype_name: str, shape: list[int], nbytes: int) -> IntegrityError:
    """The error for a row whose byte count does not fit its dtype and shape."""
    return IntegrityError(f"tensor {key!r} in manifest {m.id[:12]}: {nbytes} bytes stored for "
                          f"dtype {dtype_name} shape {shape}; run `datastates fsck`")


def _empty_row(m: Manifest, key: str, dtype_name: str, shape: list[int], nbytes: int
               ) -> tuple[torch.Tensor, memoryview]:
    """An uninitialised tensor for the row `key` of `m` and a flat byte view of its storage (valid while the
    tensor lives). Raises IntegrityError when the row's byte count does not fit its dtype and shape."""
    out = torch.empty(shape, dtype=dtype_from_name(dtype_name))
    n = out.numel() * out.element_size()
    if n != nbytes:
        raise _size_mismatch(m, key, dtype_name, shape, nbytes)
    # From the address, not through numpy (`bytes_at`): a third of this function's time per small tensor.
    return out, bytes_at(out.data_ptr(), n) if n else memoryview(bytearray())


def read_row(repo: Repository, m: Manifest, i: int) -> torch.Tensor:
    """Tensor row `i` of manifest `m`, read and verified. Raises IntegrityError, NotFoundError."""
    r = m.row(i)
    out, flat = _empty_row(m, r["key"], r["dtype"], r["shape"], r["nbytes"])
    repo.objects.read_chunks_into(r["chunks"], flat, r["key"])
    return out


def checkout(repo: Repository, ref: Any, objects: dict[str, Any], *, strict: bool = True,
             allow_pickle: bool = False, executor: Executor | None = None) -> Version:
    """Load `ref` into live objects ({"model": m, "optimizer": opt}); nothing changes unless all fit.

    Each name is a top-level key of the saved state (with the usual aliases: optimizer/optim,
    scheduler/lr_scheduler). Raises NotFoundError naming the missing key and the keys that exist,
    ShapeMismatchError naming the first tensor whose shape differs, the keys a module and the saved state
    do not share (with `strict`), or the object whose own load_state_dict refused the state (an
    optimizer's parameter groups); the live objects are then as they were.
    """
    v = repo.version(ref)
    names = {}
    top = repo.manifest_of(v).tree
    keys = top.get("k", []) if top["t"] in ("dict", "odict") else []
    for name in objects:
        key = next((k for k in (name, *ALIASES.get(name, ())) if k in keys), None)
        if key is None:
            raise NotFoundError(f"version {v.short} has no key {name!r} (top-level keys: {keys}); "
                                "pass the objects under the names they were saved with")
        names[name] = key
    # A module whose tensors all live on one accelerator gets its state read straight onto it (`_read_rows_onto`),
    # not into new host memory first; the rest (optimizers: their load_state_dict places each state tensor
    # itself, and keeps `step` where it came from) is read onto the host.
    by_device: dict[torch.device, list[str]] = {}
    for name, obj in objects.items():
        by_device.setdefault(_module_device(obj), []).append(names[name])
    state: dict[str, Any] = {}
    for dev, wanted in by_device.items():
        state.update(load(repo, v, keys=wanted, device=dev, allow_pickle=allow_pickle, executor=executor,
                          version=v))
    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
    for name, obj in modules.items():  # checked whole first: a module's load_state_dict copies as it goes
        _check_module(name, state[names[name]], obj.state_dict(), v, strict)
    # The other objects (optimizers, schedulers, scalers) check what they can only in their own load_state_dict:
    # they go before the modules, and one that refuses puts back those loaded before it. Their state_dict()
    # holds references, and their load_state_dict replaces values rather than writing into them, so the
    # references are the state as it was.
    loaded: list[tuple[Any, Any]] = []
    for name, obj in objects.items():
        if name in modules:
            continue
        before = obj.state_dict()
        try:
            obj.load_state_dict(state[names[name]])
        except Exception as exc:
            for done, state_before in reversed(loaded):
                done.load_state_dict(state_before)
            raise ShapeMismatchError(f"{name}: the state saved in version {v.short} does not fit the live object "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                     "nothing was loaded; build it as it was saved (the same parameter groups)"
                                     ) from exc
        loaded.append((obj, before))
    for name, obj in modules.items():
        obj.load_state_dict(state[names[name]], strict=strict)
    return v


def usable_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device this process can allocate on; DeviceError otherwise."""
    try:
        dev = torch.device(device)
        if dev.type != "cpu":
            torch.empty(0, device=dev)  # the one reliable probe: an unknown index, a missing backend
    except (RuntimeError, AssertionError, TypeError, ValueError) as exc:
        raise DeviceError(f"cannot load onto device {device!r}: {str(exc).splitlines()[0]}; "
                          "pass device='cpu' (the default) or a device this process has") from exc
    return dev


def _module_device(obj: Any) -> torch.device:
    """The one accelerator all of `obj`'s parameters and buffers are on, when `obj` is an `nn.Module` with some;
    the host otherwise (any other object, a module on the host, on several devices, or on `meta`)."""
    if isinstance(obj, torch.nn.Module):
        devices = {t.device for t in (*obj.parameters(), *obj.buffers())}
        if len(devices) == 1:
            (dev,) = devices
            if dev.type not in ("cpu", "meta"):
                return dev
    return torch.device("cpu")


def _check_module(name: str, saved: Any, live: dict[str, Any], v: Version, strict: bool) -> None:
    """Raise ShapeMismatchError naming the first tensor whose saved shape differs from the live one, or (with
    `strict`) the keys one side has and the other lacks: what `load_state_dict` refuses only after copying the
    tensors that fit."""
    saved = saved if isinstance(saved, dict) else {}
    for key, t in live.items():
        s = saved.get(key)
        if isinstance(t, torch.Tensor) and isinstance(s, torch.Tensor) and tuple(s.shape) != tuple(t.shape):
            raise ShapeMismatchError(
                f"{name}.{key} is {tuple(s.shape)} in version {v.short} but {tuple(t.shape)} in the live object; "
                "build the object with the saved architecture, or load the state and map it yourself"
            )
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if strict and (missing or unexpected):
        sides = [f"{len(keys)} key(s) {what} {shown(keys)}" for keys, what in (
            (missing, f"of the live module are not in version {v.short}:"),
            (unexpected, f"of version {v.short} are not in the live module:")) if keys]
        raise ShapeMismatchError(f"{name}: {'; '.join(sides)}; nothing was loaded; build the module with the saved "
                                 "architecture, or pass strict=False to load the keys both have")


def _is_glob(key: str) -> bool:
    return any(c in key for c in "*?[")


def _key_selector(keys: list[str], m: Manifest, v: Version) -> tuple[Any, Route | None]:
    """A test of key paths for `keys` (exact paths select themselves and what lies under them; globs
    match by fnmatch), and the route through `m.tree` to them when all are exact (None otherwise).
    Raises InvalidNameError, NotFoundError naming the first key that names nothing."""
    # Exact keys (the common case) are found through the manifest's path index and selected by set
    # lookups of the path and its ancestors: one tensor out of thousands must not cost a walk of the
    # whole tree nor fnmatch on every path. Patterns keep the general test over every path.
    valid = [k for k in keys if isinstance(k, str) and k]
    globs = [k for k in valid if _is_glob(k)]
    exact = {k for k in valid if not _is_glob(k)}
    route, found = m.paths.route(exact)
    existing = tree_paths(m.tree) if globs else []
    for k in keys:
        if not isinstance(k, str) or not k:
            raise InvalidNameError(f"key {k!r} must be a non-empty string path like 'model.fc.weight'")
        if not (k in found if k in exact else
                any(e == k or e.startswith(k + ".") or fnmatch.fnmatchcase(e, k) for e in existing)):
            trailing = (f" (a prefix names whole segments without the dot: {k.rstrip('.')!r})"
                        if k.endswith(".") and k.rstrip(".") else "")
            raise NotFoundError(f"version {v.short} has no key {k!r}{trailing}; `datastates ls {v.short}` lists its "
                                "keys")

    def select(path: str) -> bool:
        if path in exact:
            return True
        if exact:
            i = path.rfind(".")
            while i > 0:
                if path[:i] in exact:
                    return True
                i = path.rfind(".", 0, i)
        return any(path == k or path.startswith(k + ".") or fnmatch.fnmatchcase(path, k) for k in globs)

    return select, None if globs else route
