"""Manifests: the table of one rank's tensors in one version, as an Arrow IPC file.

One row per tensor (see `statetree.TensorEntry` for the row kinds) with its
dtype, shape, chunk ids and statistics; the JSON skeleton of the state and the
chunk size travel in the schema metadata. The manifest id is the blake3 of the
file's bytes.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import IntegrityError, StoreFormatError
from .tree import PathIndex, TensorEntry, dtype_from_name, dtype_name

MANIFEST_FORMAT = "1"
STAT_FIELDS = ("min", "max", "mean", "std", "l2")
COUNT_FIELDS = ("nan_count", "inf_count")

SCHEMA = pa.schema([
    ("key", pa.string()),
    ("kind", pa.string()),
    ("dtype", pa.string()),
    ("shape", pa.list_(pa.int64())),
    ("stride", pa.list_(pa.int64())),
    ("device", pa.string()),
    ("base", pa.int32()),
    ("offset", pa.int64()),
    ("nbytes", pa.int64()),
    ("chunks", pa.list_(pa.binary(32))),
    *[(f, pa.float64()) for f in STAT_FIELDS],
    *[(f, pa.int64()) for f in COUNT_FIELDS],
])


LOAD_COLUMNS = ("key", "kind", "dtype", "shape", "stride", "base", "offset", "nbytes", "chunks")
"""What a load reads of each row (`Manifest.load_columns`): not the statistics."""

_FEW_ROWS = 64
"""Up to this many rows, `Manifest.load_columns(rows)` reads values one by one instead of decoding whole rows."""

_CONSTANT = ("key", "kind", "dtype", "shape", "stride", "device", "base", "offset", "nbytes")
"""The columns a row's flatten fixes: the same in every save of the same tensors (`FlattenCache`)."""


def _constant_columns(entries: list[TensorEntry]) -> dict[str, pa.Array]:
    values: dict[str, list[Any]] = {
        "key": [e.key for e in entries],
        "kind": [e.kind for e in entries],
        "dtype": [dtype_name(e.dtype) for e in entries],
        "shape": [list(e.shape) for e in entries],
        "stride": [list(e.stride) for e in entries],
        "device": [e.device for e in entries],
        "base": [e.base for e in entries],
        "offset": [e.offset for e in entries],
        "nbytes": [e.nbytes for e in entries],
    }
    return {name: pa.array(values[name], type=SCHEMA.field(name).type, memory_pool=_POOL) for name in _CONSTANT}


_VARYING = ("chunks", *STAT_FIELDS, *COUNT_FIELDS)
"""The columns a save fills in: its rows' chunk ids and statistics."""


def _varying_arrays(entries: list[TensorEntry], chunks: list[list[bytes]] | None = None) -> dict[str, pa.Array]:
    values: dict[str, list[Any]] = {"chunks": chunks if chunks is not None else [e.chunks for e in entries]}
    for f in (*STAT_FIELDS, *COUNT_FIELDS):
        values[f] = [e.stats.get(f) for e in entries]
    return {name: pa.array(values[name], type=SCHEMA.field(name).type, memory_pool=_POOL) for name in _VARYING}


def _varying_columns(entries: list[TensorEntry], kept: dict[str, Any] | None) -> dict[str, pa.Array]:
    """The chunk and statistics columns of `entries`. With `kept` (a kept flatten's `encoded`), the last manifest
    encoded through it left its rows' stats dicts and chunk lists there, and its columns: a row with the very same
    stats dict and equal chunks has the same values (stats dicts and committed chunk lists are never changed), so
    only the other rows are encoded, and put in place by one `take` per column. A partial save of 8,000 small
    tensors that changed 800 encodes 800 rows' values, not 8,000 (the statistics were ~4 of the 8 ms of its
    manifest). More than half changed: encoded whole."""
    stats = list(map(_stats_of, entries))
    chunks = list(map(_chunks_of, entries))
    last = kept.get("varying") if kept is not None else None
    cols = None
    n = len(entries)
    if last is not None and len(last[0]) == n:
        old_stats, old_chunks, old_cols = last
        # Compared in C (`map`, `compress`): a Python loop over 8,000 rows cost more than encoding them whole. Chunk
        # lists are compared only where the stats dict is the same object: comparing 8,000 lists of new bytes
        # objects (a full save) took longer than encoding them.
        other = list(map(operator.is_not, stats, old_stats))
        few = other.count(True) * 2 <= n  # (not in a full save: every stats dict new, no index list, no comparison)
        changed: list[int] = []
        if few:
            changed = list(itertools.compress(range(n), other))
            same = list(map(operator.not_, other))
            changed += itertools.compress(itertools.compress(range(n), same), map(
                operator.ne, itertools.compress(chunks, same), itertools.compress(old_chunks, same)))
        if few and not changed:
            cols = old_cols
        elif few and len(changed) * 2 <= n:
            new = _varying_arrays([entries[i] for i in changed])
            where = np.arange(n, dtype=np.int32)
            where[changed] = np.arange(n, n + len(changed), dtype=np.int32)
            take = pa.array(where)
            cols = {name: pc.take(pa.concat_arrays([old_cols[name], new[name]], memory_pool=_POOL), take,
                                  memory_pool=_POOL) for name in _VARYING}
    if cols is None:
        cols = _varying_arrays(entries, chunks)
    if kept is not None:
        # The last manifest's stats dicts and chunk lists are let go by `retire`, once the caller has its version:
        # freed here, a full save's 8,000 of each (and 40,000 floats) added ~8 ms to its commit.
        kept["retired"] = last
        kept["varying"] = (stats, chunks, cols)
    return cols


def retire(kept: dict[str, Any] | None) -> None:
    """Let go of what the last `encode` through `kept` (a kept flatten's `encoded`) replaced: for the pipeline, after
    the save's caller has its version (`Saver.remember`)."""
    if kept is not None:
        kept.pop("retired", None)


_stats_of = operator.attrgetter("stats")
_chunks_of = operator.attrgetter("chunks")

_POOL = pa.system_memory_pool()
"""Where a manifest's Arrow buffers are made: the system allocator, which gives big blocks back when they are
freed. Under Arrow's default pool (mimalloc) the columns' builders left ~10 MiB of a first save of 8,000 rows
resident, and the encode was that save's peak RSS (docs/perf-notes.md, "Peak RSS of a save")."""


def encode(tree: dict[str, Any], entries: list[TensorEntry], chunk_size: int,
           kept: dict[str, Any] | None = None) -> tuple[str, memoryview]:
    """Serialize a manifest; return (id, its bytes): a read-only view of the Arrow buffer the file was written
    into, not a copy (2 MiB per 8,000 rows).

    `kept` is the `encoded` dict of the kept flatten `entries` came from (`FlattenCache`): the constant
    columns and the skeleton's JSON are encoded on its first save and reused by every later one (~10 ms of
    GIL-holding work per 8,000 rows), and the chunk and statistics columns of its last manifest are patched
    where rows changed (`_varying_columns`). The bytes are the same with or without it."""
    const = kept.get("columns") if kept is not None else None
    if const is None or len(const["key"]) != len(entries):
        const = _constant_columns(entries)
        if kept is not None:
            kept["columns"] = const
    skeleton = kept.get("tree") if kept is not None else None
    if skeleton is None or skeleton[0] is not tree:  # a changed leaf (a step counter) makes a new skeleton
        skeleton = (tree, json.dumps(tree, separators=(",", ":")).encode())
        if kept is not None:
            kept["tree"] = skeleton
    cols: dict[str, Any] = {**const, **_varying_columns(entries, kept)}
    meta = {
        b"datastates.format": MANIFEST_FORMAT.encode(),
        b"datastates.tree": skeleton[1],
        b"datastates.chunk_size": str(chunk_size).encode(),
    }
    arrays = [cols[f.name] for f in SCHEMA]
    table = pa.Table.from_arrays(arrays, schema=SCHEMA.with_metadata(meta))
    sink = pa.BufferOutputStream(memory_pool=_POOL)
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    data = memoryview(sink.getvalue()).cast("B").toreadonly()  # compared and hashed as bytes, never changed
    return blake3.blake3(data).hexdigest(), data


@dataclass(frozen=True)
class TensorInfo:
    """What `ls` shows of one tensor: no bytes are read to produce it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str
    chunks: int
    stats: dict[str, float | int | None]


class Manifest:
    """A decoded manifest (read-only)."""

    def __init__(self, mid: str, data: bytes, verify: bool = True) -> None:
        if verify and blake3.blake3(data).hexdigest() != mid:
            raise IntegrityError(f"manifest {mid} does not match its id; run `datastates fsck`")
        self.id = mid
        self.table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        meta = self.table.schema.metadata or {}
        fmt = meta.get(b"datastates.format", b"?").decode()
        if fmt != MANIFEST_FORMAT:
            raise StoreFormatError(
                f"manifest {mid} has format {fmt}; this datastates reads {MANIFEST_FORMAT}: upgrade it")
        self.tree: dict[str, Any] = json.loads(meta[b"datastates.tree"])
        self.chunk_size = int(meta[b"datastates.chunk_size"])
        self.paths = PathIndex(self.tree)
        """Where exact key paths lie in `tree` (filled as loads look them up)."""
        self._decoded: dict[int, dict[str, Any]] = {}
        self._read: set[int] = set()
        """Rows whose load columns `load_columns` read one by one (not decoded whole)."""

    @cached_property
    def rows(self) -> list[dict[str, Any]]:
        """Every row, decoded (thousands of rows take milliseconds: one load of a few keys uses `row`)."""
        return self.table.to_pylist()

    def row(self, i: int) -> dict[str, Any]:
        """Row `i`, decoded alone unless every row already is. Raises IntegrityError when there is no row `i`
        (a row pointing at a base that does not exist)."""
        rows = self.__dict__.get("rows")
        if rows is None:
            rows = self._decoded
            if i not in rows:
                self.decode([i])
        elif not 0 <= i < len(rows):
            rows = {}
        try:
            return rows[i]
        except KeyError:
            raise self._no_row(i) from None

    def decode(self, rows: list[int]) -> None:
        """Decode rows `rows` for `row`: one slice per run of consecutive rows, one take if they are scattered
        (out-of-range numbers are left for `row` to refuse)."""
        n = self.table.num_rows
        todo = sorted({i for i in rows if 0 <= i < n and i not in self._decoded})
        if not todo or "rows" in self.__dict__:
            return
        runs: list[list[int]] = []  # consecutive rows: what one key of a module names
        for i in todo:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        if len(runs) <= 8:  # a slice costs ~4x less than the take kernel, whose first call costs ~40 ms
            for run in runs:
                self._decoded.update(zip(run, self.table.slice(run[0], len(run)).to_pylist()))
        else:
            self._decoded.update(zip(todo, self.table.take(todo).to_pylist()))

    def load_columns(self, rows: list[int] | None = None) -> dict[str, Any]:
        """The columns a load reads (`LOAD_COLUMNS`), each indexable by row number: with `rows` None, every row,
        as lists (cached; 6 ms for 8,000 rows, against 18.5 ms for `rows` as dicts); else only `rows`, as dicts.
        Raises IntegrityError when a row of `rows` does not exist (see `row`)."""
        if rows is None:
            cols = self.__dict__.get("_load_columns")
            if cols is None:
                cols = self.__dict__["_load_columns"] = {n: self.table.column(n).to_pylist() for n in LOAD_COLUMNS}
            return cols
        if len(rows) > _FEW_ROWS:
            self.decode(rows)
            got = {i: self.row(i) for i in rows}
            return {n: {i: r[n] for i, r in got.items()} for n in LOAD_COLUMNS}
        n = self.table.num_rows
        for i in rows:
            if not 0 <= i < n:
                raise self._no_row(i)
        every = self.__dict__.get("_load_columns")
        if every is not None:  # a full load decoded them all already
            return {name: {i: col[i] for i in rows} for name, col in every.items()}
        # A few rows (a load of one tensor): each value read where it lies, ~6 us a row, where decoding whole rows
        # through a slice took ~55 us for one row, and 0.5 ms right after a full load had left the caches cold.
        self._read.update(rows)
        return {name: {i: col[i].as_py() for i in rows} for name, col in self._load_arrays.items()}

    @cached_property
    def _load_arrays(self) -> dict[str, pa.ChunkedArray]:
        return {n: self.table.column(n) for n in LOAD_COLUMNS}

    def _no_row(self, i: int) -> IntegrityError:
        return IntegrityError(f"manifest {self.id[:12]} has no row {i} ({self.table.num_rows} rows); "
                              "run `datastates fsck`")

    @property
    def decoded_rows(self) -> int:
        """How many rows have been decoded so far, whole or only what a load reads of them (all of them once
        `rows` or every row's `load_columns` was used)."""
        rows = self.__dict__.get("rows")
        if rows is not None or "_load_columns" in self.__dict__:
            return self.table.num_rows
        return len(self._read.union(self._decoded))

    @cached_property
    def index(self) -> dict[str, int]:
        """key path -> row number (from the key column alone)."""
        return {k: i for i, k in enumerate(self.table.column("key").to_pylist())}

    def info(self) -> list[TensorInfo]:
        """What `ls` shows of each key (storages left out). A tied weight (an alias) shows its base's statistics:
        the same tensor (they read as None, and `plot.norms` said no tensor matched the alias's key)."""
        out = []
        for r in self.rows:
            if r["kind"] == "storage":
                continue
            nbytes = math.prod(r["shape"]) * dtype_from_name(r["dtype"]).itemsize
            held = self.row(r["base"]) if r["kind"] == "alias" else r
            out.append(TensorInfo(r["key"], r["dtype"], tuple(r["shape"]), nbytes, r["kind"], len(r["chunks"]),
                                  {f: held[f] for f in (*STAT_FIELDS, *COUNT_FIELDS)}))
        return out
