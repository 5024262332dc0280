"""Tensor-level comparison of versions, and a tensor's history across versions.

`diff` streams chunk by chunk: chunks with equal ids are never read, and at
most one chunk per side is in memory, so two 10 GB versions diff in a few MiB.
The dot product behind the cosine comes from the stored norms and the norm of
the change: a.b = (|a|^2 + |b|^2 - |b-a|^2) / 2.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch

from ..errors import InvalidArgumentError, NotFoundError
from ..objects.chunks import spans
from ..repo.reader import load
from ..repo.repository import Repository, as_repository
from ..save.manifest import Manifest
from ..save.tree import PathIndex, dtype_from_name, key_patterns
from .lineage import ancestors

if TYPE_CHECKING:
    from ..meta.versions import Version

DIFF_SCHEMA = pa.schema([
    ("key", pa.string()), ("status", pa.string()),
    ("dtype_a", pa.string()), ("dtype_b", pa.string()),
    ("shape_a", pa.list_(pa.int64())), ("shape_b", pa.list_(pa.int64())),
    ("l2_change", pa.float64()), ("rel_change", pa.float64()), ("cosine", pa.float64()),
    ("max_abs_diff", pa.float64()), ("chunks_shared", pa.int64()), ("chunks_total", pa.int64()),
    ("bytes_shared", pa.int64()),
])


def _as_float(raw: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype) if len(raw) else torch.empty(0, dtype=dtype)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.to(torch.float64)


_GLOB = re.compile(r"[*?\[]")


class KeyPatterns:
    """Which of a list of key patterns select a key: an exact name, a glob, or a prefix ending at a '.'
    (`model.layer` selects `model.layer.weight`), with `strip_dot` read without its trailing dots
    (`model.` too). A key costs a lookup per '.' in it plus one match per glob pattern, not one match per
    pattern: thousands of exact keys checked against thousands of rows made `diff` and the plots that call it
    quadratic (a review: 2,000 keys took 19 s)."""

    def __init__(self, patterns: Iterable[str], *, strip_dot: bool = False) -> None:
        self.patterns = list(patterns)
        self._exact: dict[str, list[str]] = {}
        self._prefix: dict[str, list[str]] = {}
        self._globs: list[tuple[str, str]] = []
        for p in self.patterns:
            base = p.rstrip(".") if strip_dot else p
            if _GLOB.search(p):
                self._globs.append((p, base))
            else:
                self._exact.setdefault(p, []).append(p)
                self._prefix.setdefault(base, []).append(p)

    def matching(self, key: str) -> list[str]:
        """The patterns that select `key` (each as often as it is given)."""
        out = list(self._exact.get(key, ()))
        i = key.find(".")
        while i != -1:  # a prefix ending at a '.': the key's own dotted prefixes, looked up
            out.extend(self._prefix.get(key[:i], ()))
            i = key.find(".", i + 1)
        out.extend(p for p, base in self._globs
                   if key == p or fnmatch.fnmatchcase(key, p) or key.startswith(base + "."))
        return out

    def selects(self, key: str) -> bool:
        return bool(self.matching(key))


def _rows(m: Manifest, keys: list[str] | None, matched: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """The rows (storages left out) that `keys` select (all without); the patterns that selected one are added
    to `matched`."""
    sel = KeyPatterns(keys) if keys else None
    out = {}
    for r in m.rows:
        if r["kind"] == "storage":
            continue
        if sel is not None:
            hit = sel.matching(r["key"])
            if not hit:
                continue
            if matched is not None:
                matched.update(hit)
        out[r["key"]] = r
    return out


def _tensor_row(m: Manifest, r: dict[str, Any]) -> dict[str, Any] | None:
    """The row holding a tensor's own bytes (an alias points at its base); None for views."""
    if r["kind"] == "alias":
        return m.row(r["base"])
    return r if r["kind"] == "tensor" else None


def diff(store: Repository, a: Any, b: Any, keys: list[str] | None = None) -> pa.Table:
    """One row per key of either version: status, L2 of the change, relative change, cosine,
    max abs difference, chunks and bytes shared. An element that went to or from NaN or an infinity makes
    the L2 of the change, the relative change and the max abs difference infinite and the cosine null (the
    change is unbounded; NaN staying NaN is no change). Raises NotFoundError (a ref, or a key pattern that
    matches no key of either version, with close matches), PrunedError."""
    store = as_repository(store)
    va, vb = store.version(a), store.version(b)
    ma, mb = store.manifest_of(va), store.manifest_of(vb)
    keys = key_patterns(keys)
    matched: set[str] = set()
    ra, rb = _rows(ma, keys, matched), _rows(mb, keys, matched)
    for k in keys or []:  # a key that selects nothing in either version is a typo, not "no change"
        if k not in matched:
            holder = next((v for v, m in ((va, ma), (vb, mb)) if k in PathIndex(m.tree).route([k])[1]), None)
            if holder is not None:  # (said 'in neither', and `ls` lists tensors only: a review)
                raise NotFoundError(f"key {k!r} of {holder.short} holds no tensor (a plain value, or containers of "
                                    "them); diff compares tensors: load that key of the version in Python to see it "
                                    "(Store.load with keys=[...])")
            names = sorted({r["key"] for r in ma.rows if r["kind"] != "storage"}
                           | {r["key"] for r in mb.rows if r["kind"] != "storage"})
            close = difflib.get_close_matches(k, names, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"`datastates ls {va.short}` lists the keys"
            raise NotFoundError(f"key {k!r} is in neither {va.short} nor {vb.short}; {hint}")
    out: list[dict[str, Any]] = []
    for key in sorted(set(ra) | set(rb)):
        x, y = ra.get(key), rb.get(key)
        row: dict[str, Any] = {"key": key, "dtype_a": x and x["dtype"], "dtype_b": y and y["dtype"],
                               "shape_a": x and x["shape"], "shape_b": y and y["shape"]}
        if x is None or y is None:
            row["status"] = "added" if x is None else "removed"
            out.append(row)
            continue
        if x["dtype"] != y["dtype"] or x["shape"] != y["shape"]:
            row["status"] = "dtype_or_shape_changed"
            out.append(row)
            continue
        tx, ty = _tensor_row(ma, x), _tensor_row(mb, y)
        if tx is None or ty is None:
            # A view of a shared storage has no bytes of its own: compare the bytes the key sees, since a
            # change made through another view of the storage changes it too.
            row.update(_compare_values(_key_bytes(store, ma, x), _key_bytes(store, mb, y),
                                       dtype_from_name(x["dtype"])))
            out.append(row)
            continue
        row.update(_compare(store, ma, tx, mb, ty))
        out.append(row)
    return pa.Table.from_pylist(out, schema=DIFF_SCHEMA)


def _compare(store: Repository, ma: Manifest, x: dict[str, Any], mb: Manifest, y: dict[str, Any]) -> dict[str, Any]:
    dtype = dtype_from_name(x["dtype"])
    shared = shared_bytes = 0
    sq = 0.0
    max_abs = 0.0
    if ma.chunk_size == mb.chunk_size:
        pairs = list(zip(x["chunks"], y["chunks"]))
        parts = spans(x["nbytes"], ma.chunk_size)
        for (ca, cb), (s, e) in zip(pairs, parts):
            if ca == cb:
                shared += 1
                shared_bytes += e - s
                continue
            sq, max_abs = _accumulate(_as_float(store.read_chunk(ca, x["key"]), dtype),
                                      _as_float(store.read_chunk(cb, x["key"]), dtype), sq, max_abs)
    else:
        # Different chunk sizes: compare byte ranges, reading both sides chunk by chunk.
        for s, e in spans(x["nbytes"], min(ma.chunk_size, mb.chunk_size)):
            sq, max_abs = _accumulate(_as_float(_range(store, ma, x, s, e), dtype),
                                      _as_float(_range(store, mb, y, s, e), dtype), sq, max_abs)
    na, nb = x.get("l2"), y.get("l2")
    l2 = math.sqrt(sq)
    total = len(x["chunks"])
    status = "same" if shared == total and x["chunks"] == y["chunks"] else "changed"
    cosine = rel = None
    if na is not None and nb is not None:
        rel = _relative(l2, na)
        if na > 0 and nb > 0 and math.isfinite(sq):
            cosine = max(-1.0, min(1.0, (na * na + nb * nb - sq) / (2 * na * nb)))
    return {"status": status, "l2_change": l2, "rel_change": rel, "cosine": cosine, "max_abs_diff": max_abs,
            "chunks_shared": shared, "chunks_total": total, "bytes_shared": shared_bytes}


def view_span(m: Manifest, r: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """(storage row, first byte, end byte) of the part of its storage that view row `r` can see."""
    base = m.row(r["base"])
    item = dtype_from_name(r["dtype"]).itemsize
    if math.prod(r["shape"]) == 0:
        return base, 0, 0
    last = r["offset"] + sum((n - 1) * st for n, st in zip(r["shape"], r["stride"]))
    return base, r["offset"] * item, (last + 1) * item


def key_chunks(m: Manifest, r: dict[str, Any]) -> list[bytes]:
    """The chunk ids holding the bytes key row `r` sees: its own (or its alias base's), or for a view the
    chunks of its storage that overlap the view's span. Equal lists mean equal bytes."""
    if r["kind"] != "view":
        return list((_tensor_row(m, r) or r)["chunks"] or [])
    base, start, end = view_span(m, r)
    return [c for c, (s, e) in zip(base["chunks"] or [], spans(base["nbytes"], m.chunk_size)) if s < end and e > start]


def _key_bytes(store: Repository, m: Manifest, r: dict[str, Any]) -> bytes:
    """The logical bytes of key row `r` (row-major), read chunk by chunk; views are cut from their storage."""
    if r["kind"] != "view":
        tr = _tensor_row(m, r) or r
        return _range(store, m, tr, 0, tr["nbytes"])
    base, start, end = view_span(m, r)
    dtype = dtype_from_name(r["dtype"])
    raw = _range(store, m, base, start, end)
    if not raw:
        return b""
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    t = flat.as_strided(tuple(r["shape"]), tuple(r["stride"]), 0).contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy().tobytes())


def _compare_values(a: bytes, b: bytes, dtype: torch.dtype) -> dict[str, Any]:
    """diff's columns for two byte strings of one dtype and shape, read whole (views are small parts)."""
    fa, fb = _as_float(a, dtype), _as_float(b, dtype)
    sq, max_abs = _accumulate(fa, fb, 0.0, 0.0)
    l2 = math.sqrt(sq)
    # Norms of the finite values, as the stored statistics (`l2`) are: nan_to_num made an infinity the dtype's
    # largest number, and every change beside it read as 0 (a review).
    na = float(torch.linalg.vector_norm(fa[torch.isfinite(fa)])) if fa.numel() else 0.0
    nb = float(torch.linalg.vector_norm(fb[torch.isfinite(fb)])) if fb.numel() else 0.0
    rel = _relative(l2, na)
    cosine = (max(-1.0, min(1.0, (na * na + nb * nb - sq) / (2 * na * nb)))
              if na > 0 and nb > 0 and math.isfinite(sq) else None)
    return {"status": "same" if a == b else "changed", "l2_change": l2, "rel_change": rel, "cosine": cosine,
            "max_abs_diff": max_abs}


def _relative(l2: float, norm: float) -> float:
    """The change's L2 over the first version's: infinite for an unbounded change (also over an infinite norm, where
    the division gave NaN) or a change from all zeros; 0 for none."""
    if l2 == 0:
        return 0.0
    if math.isinf(l2) or not norm > 0:
        return math.inf
    return l2 / norm if math.isfinite(norm) else 0.0


def _accumulate(fa: torch.Tensor, fb: torch.Tensor, sq: float, max_abs: float) -> tuple[float, float]:
    """The sum of squared changes and the largest absolute change, going on from `sq`, `max_abs` over the elements
    of `fa` -> `fb`. An element that went to or from NaN or an infinity (other than staying the same one) makes both
    infinite: its change is unbounded, never 0 (a review: a run that diverged read as unchanged)."""
    if not fa.numel():
        return sq, max_abs
    d = fb - fa
    finite = torch.isfinite(d)
    if not bool(finite.all()):
        kept = (fa == fb) | (torch.isnan(fa) & torch.isnan(fb))  # NaN -> NaN, inf -> the same inf: no change
        if bool((~finite & ~kept).any()):
            return math.inf, math.inf
        d = torch.where(finite, d, torch.zeros((), dtype=d.dtype))
    sq += float(torch.dot(d, d))
    max_abs = max(max_abs, float(d.abs().max()))
    return sq, max_abs


def _range(store: Repository, m: Manifest, r: dict[str, Any], start: int, end: int) -> bytes:
    out = bytearray()
    for i, (s, e) in enumerate(spans(r["nbytes"], m.chunk_size)):
        if e <= start or s >= end:
            continue
        data = store.read_chunk(r["chunks"][i], r["key"])
        out += data[max(start - s, 0): min(end, e) - s]
    return bytes(out)


HISTORY_SCHEMA = pa.schema([
    ("version", pa.string()), ("step", pa.int64()), ("created", pa.float64()), ("dtype", pa.string()),
    ("shape", pa.list_(pa.int64())), ("min", pa.float64()), ("max", pa.float64()), ("mean", pa.float64()),
    ("std", pa.float64()), ("l2", pa.float64()), ("nan_count", pa.int64()), ("inf_count", pa.int64()),
    ("chunks_changed", pa.int64()), ("l2_delta", pa.float64()),
])


def history_versions(store: Repository, ref: Any) -> list[Version]:
    """The first-parent chain ending at `ref`, oldest first, without pruned versions."""
    store = as_repository(store)
    start = store.resolve(ref)
    chain = [start] + ancestors(store.graph, start, first_parent=True)
    return [v for v in (store.version(x) for x in reversed(chain)) if not v.pruned]


def history(store: Repository, key: str, ref: Any = "main") -> pa.Table:
    """A tensor's stored statistics along the first-parent chain of `ref`, oldest first.

    Reads manifests only, never tensor bytes. Versions without `key` are skipped, pruned ones too.
    Raises NotFoundError naming close keys when no version of the chain has `key` (a typo
    would otherwise read as an empty history), PrunedError when every version of it was pruned.
    """
    rows, _ = history_page(store, key, ref)
    return rows


def history_page(store: Repository, key: str, ref: Any = "main", start: int = 0,
                 limit: int | None = None) -> tuple[pa.Table, int | None]:
    """At most `limit` rows of `history` (all without one), from position `start` of the first-parent chain of
    `ref`, and the position to pass as `start` for the next rows (None when none follow).

    A position counts every version of the chain oldest first, pruned ones too, so positions stay valid while
    versions are pruned between two calls. A page reads the manifests of its own versions and of the one before
    it (for `chunks_changed` and `l2_delta`), never the whole chain's: page k of a 6,000-version history costs
    what page 1 does. Raises NotFoundError as `history` does (when no version of the chain has `key`; checked
    when `start` is 0; PrunedError when every version of it was pruned), InvalidArgumentError for a `start` outside
    the chain."""
    store = as_repository(store)
    _check_key(key)
    head = store.resolve(ref)
    chain = ancestors(store.graph, head, first_parent=True, include_start=True)[::-1]
    if not 0 <= start <= len(chain):
        raise InvalidArgumentError(f"start={start} is outside the first-parent chain of {ref!r} "
                                   f"({len(chain)} versions); start again at 0")
    rows: list[dict[str, Any]] = []
    prev = _history_before(store, key, chain, start)
    nxt: int | None = None
    for pos in range(start, len(chain)):
        got = _history_at(store, key, chain[pos])
        if got is None:
            continue
        if limit is not None and len(rows) == limit:
            nxt = pos  # a row follows: the next page starts at it
            break
        v, tr, r, chunks = got
        if prev is None:
            changed = l2_delta = None
        else:
            p_tr, p_chunks = prev
            changed = sum(1 for j, c in enumerate(chunks) if j >= len(p_chunks) or p_chunks[j] != c)
            l2_delta = None if p_tr["l2"] is None or tr["l2"] is None else tr["l2"] - p_tr["l2"]
        rows.append({"version": v.id, "step": v.step, "created": v.created, "dtype": r["dtype"],
                     "shape": r["shape"],
                     **{f: tr[f] for f in ("min", "max", "mean", "std", "l2", "nan_count", "inf_count")},
                     "chunks_changed": changed, "l2_delta": l2_delta})
        prev = tr, chunks
    if not rows and start == 0:
        live = [v for v in (store.version(x) for x in chain) if not v.pruned]
        if live:
            raise _no_such_key(store, live, key, ref)
        # Every version of the chain was pruned, `ref` too: an empty table read as "no history" (exit 0 at the
        # command line). Its manifest is gone: PrunedError names it.
        store.manifest_of(store.version(head))
    return pa.Table.from_pylist(rows, schema=HISTORY_SCHEMA), nxt


def _history_at(store: Repository, key: str, vid: str) -> tuple[Version, dict[str, Any], dict[str, Any],
                                                                 list[bytes]] | None:
    """(version, the row holding the statistics, the key's row, the chunks its bytes lie in) of `key` at
    `vid`, or None when `vid` is pruned or has no `key`."""
    v = store.version(vid)
    if v.pruned:
        return None
    m = store.manifest_of(v)
    i = m.index.get(key)
    if i is None:
        return None
    r = m.row(i)
    # The chunks of the bytes this key sees (for a view: the overlapping chunks of its storage), so a
    # change made through another view of a shared storage counts here too.
    return v, _tensor_row(m, r) or r, r, key_chunks(m, r)


def _history_before(store: Repository, key: str, chain: list[str],
                    start: int) -> tuple[dict[str, Any], list[bytes]] | None:
    """The statistics row and chunks of the last version before position `start` that has `key`."""
    for pos in range(start - 1, -1, -1):
        got = _history_at(store, key, chain[pos])
        if got is not None:
            return got[1], got[3]
    return None


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"key={key!r} is not a key path; give one such as 'model.fc.weight'")


def _no_such_key(store: Repository, chain: list[Version], key: str, ref: Any) -> NotFoundError:
    keys = list(store.manifest_of(chain[-1]).index)
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(k) for k in close)}? " if close else ""
    return NotFoundError(f"no version in the first-parent chain of {ref!r} has a tensor {key!r}; {hint}"
                         f"`datastates ls {ref}` lists its keys")


def history_values(store: Repository, key: str, ref: Any = "main") -> Iterator[tuple[Version, torch.Tensor]]:
    """(version, tensor) along the first-parent chain, loading one tensor at a time as it is iterated. Raises
    NotFoundError at the call, as `history` does, when no version of the chain has `key` (a typo iterated as
    nothing), PrunedError when every version of it was pruned."""
    store = as_repository(store)
    _check_key(key)
    chain = history_versions(store, ref)
    if not chain:  # every version of the chain was pruned, `ref` too (it iterated as nothing): PrunedError
        store.manifest_of(store.version(ref))
    having = [v for v in chain if key in store.manifest_of(v).index]
    if not having and chain:
        raise _no_such_key(store, chain, key, ref)
    return _loading(store, having, key)


def _loading(store: Repository, versions: list[Version], key: str) -> Iterator[tuple[Version, torch.Tensor]]:
    for v in versions:
        state = load(store, v, keys=[key])
        node: Any = state
        for part in _path_in(state, key):
            node = node[part]
        yield v, node


def _path_in(state: Any, key: str) -> list[Any]:
    """The container keys leading to `key` in a partial state (keys may themselves hold dots)."""
    path: list[Any] = []
    node = state
    rest = key
    while rest:
        items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        assert len(items) == 1, "a partial load holds exactly one path"
        k, node = items[0]
        path.append(k)
        rest = rest[len(str(k)) + 1:]
    return path
