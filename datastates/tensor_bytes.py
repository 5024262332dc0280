"""Reading one tensor's raw bytes incrementally, for servers that stream tensors.

`Store.load` materializes whole tensors; a REST server answering a download
(or an HTTP Range of it) needs the bytes piece by piece with memory bounded by
one chunk. This module builds that from the store's public-enough parts:
`store.version`, `store.manifest_of(v)` (the manifest rows: dtype, shape,
byte length, chunk ids; `Manifest.chunk_size`) and `store.read_chunk(cid)`
(one verified chunk). The lead plans to move it into the library's load layer.

The bytes are the tensor's logical, row-major, little-endian bytes, exactly
what `store.load(...)[key].contiguous()` holds in memory.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import blake3

from .errors import InvalidArgumentError, NotFoundError

if TYPE_CHECKING:
    from .store import Store

__all__ = ["TensorBytes", "iter_tensor_bytes", "tensor_bytes_info"]


@dataclass(frozen=True)
class TensorBytes:
    """Where one tensor's bytes live in one version (no bytes read to build it)."""

    version: str
    """Full id of the version the tensor was looked up in."""
    key: str
    dtype: str
    """Torch dtype name, e.g. 'float32'."""
    shape: tuple[int, ...]
    nbytes: int
    """Logical byte length: prod(shape) * itemsize."""
    content_hash: str
    """blake3 over dtype, shape and the chunk ids: equal for equal bytes, different otherwise."""
    chunks: tuple[bytes, ...]
    """Chunk ids in order, for a tensor stored by value; empty for a view (see `is_view`)."""
    chunk_size: int
    is_view: bool
    """A view into a shared storage: its bytes are not one run of chunks and are read via `load`."""


def tensor_bytes_info(store: Store, ref: Any, key: str) -> TensorBytes:
    """Describe tensor `key` of version `ref`.

    Raises NotFoundError (ref, or key: naming close keys), PrunedError, AmbiguousRefError.
    """
    v = store.version(ref)
    m = store.manifest_of(v)
    i = m.index.get(key)
    if i is None or m.row(i)["kind"] == "storage":
        keys = [r["key"] for r in m.rows if r["kind"] != "storage"]
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(k) for k in close)}? " if close else ""
        raise NotFoundError(f"version {v.short} has no tensor {key!r}; {hint}"
                            f"`datastates ls {v.short}` lists its tensors")
    r = m.row(i)
    if r["kind"] == "alias":  # the same tensor as its base row: same bytes
        r = m.row(r["base"])
    if r["kind"] not in ("tensor", "view"):
        raise NotFoundError(f"entry {key!r} of version {v.short} is a {r['kind']}, not a tensor")
    shape = tuple(int(d) for d in r["shape"])
    from .save.tree import dtype_from_name

    itemsize = dtype_from_name(r["dtype"]).itemsize
    nbytes = math.prod(shape) * itemsize
    h = blake3.blake3(f"{r['dtype']}|{list(shape)}|".encode())
    is_view = r["kind"] == "view"
    chunks: tuple[bytes, ...] = () if is_view else tuple(r["chunks"])
    if is_view:
        # A view's bytes depend on its base storage's chunks and on offset/stride.
        base = m.row(r["base"])
        h.update(f"view|{r['offset']}|{list(r['stride'])}|".encode())
        for c in base["chunks"]:
            h.update(c)
    else:
        for c in chunks:
            h.update(c)
    return TensorBytes(version=v.id, key=key, dtype=r["dtype"], shape=shape, nbytes=nbytes,
                       content_hash=h.hexdigest(), chunks=chunks, chunk_size=m.chunk_size, is_view=is_view)


def iter_tensor_bytes(store: Store, ref: Any, key: str, start: int = 0, end: int | None = None,
                      *, info: TensorBytes | None = None) -> Iterator[bytes]:
    """Yield the bytes [start, end) of tensor `key` in version `ref`, one chunk's worth at a time.

    Memory is bounded by one chunk for tensors stored by value; a view (a tensor
    sharing another's storage) is materialized with `store.load` first. Every
    chunk is verified by `store.read_chunk`. Raises NotFoundError, PrunedError,
    IntegrityError, InvalidArgumentError (a range outside the tensor).
    """
    ti = info or tensor_bytes_info(store, ref, key)
    stop = ti.nbytes if end is None else end
    if start < 0 or stop > ti.nbytes or start > stop:
        raise InvalidArgumentError(f"byte range [{start}, {stop}) is outside tensor {key!r} of {ti.nbytes} bytes")
    if start == stop:
        return
    if ti.is_view:
        yield from _view_bytes(store, ti, start, stop)
        return
    size = ti.chunk_size
    first = start // size
    for i in range(first, len(ti.chunks)):
        s = i * size
        if s >= stop:
            break
        data = store.read_chunk(ti.chunks[i], key)
        e = s + len(data)
        yield data[max(start - s, 0): min(stop, e) - s]


def _view_bytes(store: Store, ti: TensorBytes, start: int, stop: int) -> Iterator[bytes]:
    state = store.load(ti.version, keys=[ti.key])
    node: Any = state
    rest = ti.key
    while rest:  # walk the partial state: exactly one path leads to the key
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        k, node = items[0]
        rest = rest[len(str(k)) + 1:]
    import torch

    flat = node.contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    step = max(ti.chunk_size, 1)
    for s in range(start, stop, step):
        yield raw[s: min(s + step, stop)]


def select_tensor_keys(store: Store, ref: Any, patterns: list[str] | None) -> list[str]:
    """The tensor keys of version `ref` selected by `patterns` (exact key, prefix ending at '.', or a glob),
    in manifest order; every tensor when `patterns` is None. Raises NotFoundError for a pattern
    that selects nothing."""
    import fnmatch

    keys = [t.key for t in store.ls(ref)]
    if patterns is None:
        return keys
    out: list[str] = []
    for p in patterns:
        hit = [k for k in keys if k == p or k.startswith(p + ".") or fnmatch.fnmatchcase(k, p)]
        if not hit:
            close = difflib.get_close_matches(p, keys, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(repr(k) for k in close)}? " if close else ""
            raise NotFoundError(f"no tensor of {ref!r} matches {p!r}; {hint}`datastates ls {ref}` lists them")
        out += [k for k in hit if k not in out]
    return out


def move_branch(store: Store, name: str, to: Any, expected: str) -> str:
    """Compare-and-swap: point branch `name` at `to` only if it points at `expected` now; return the new id.

    The public Store API has `branch(name, at, force=True)` (an unconditional move) but no
    conditional one, so this reaches the tier's RefStore; the lead plans a `Store.move_branch`.
    Raises NotFoundError (branch or ref), ConflictError (the branch is not at `expected`), InvalidNameError,
    PrunedError (`to` was pruned).
    """
    vid = store.resolve(to)
    refs = store.refs
    if refs.get("branch", name) is None:
        raise NotFoundError(f"branch {name!r} does not exist; create it with POST /branches or `datastates branch`")
    refs.set_if_equals("branch", name, expected, vid, f"move to {vid[:12]} (expected {expected[:12]})",
                       check=partial(store.repo.refuse_pruned, vid, "branch"))
    return vid


def tensor_paths(store: Store, ref: Any) -> dict[str, list[str | int]]:
    """key path -> the container keys leading to it in the saved state (dict keys as strings, list and
    tuple positions as ints), so a client can rebuild `load`'s nesting when keys hold dots."""
    m = store.manifest_of(store.version(ref))
    rows = m.rows
    out: dict[str, list[str | int]] = {}

    def walk(node: Any, path: list[str | int]) -> None:
        t = node.get("t") if isinstance(node, dict) else None
        if t in ("dict", "odict"):
            for k, v in zip(node.get("k", []), node.get("v", [])):
                walk(v, [*path, k])
        elif t in ("list", "tuple"):
            for i, v in enumerate(node.get("v", [])):
                walk(v, [*path, i])
        elif "i" in (node if isinstance(node, dict) else {}):
            out[rows[node["i"]]["key"]] = path

    walk(m.tree, [])
    return out
