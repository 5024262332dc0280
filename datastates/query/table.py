"""The versions table: every version as one row, hparams/metrics/annotations/explore flattened into columns.

Built from the catalog and cached until the catalog's generation counter or
the tags change, so repeated `find` calls cost only the vectorized filter.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from ..meta.versions import LATER_METRICS, merge_metrics, readable
from ..repo.repository import Repository, as_repository

_FIXED: list[tuple[str, pa.DataType]] = [
    ("id", pa.string()), ("step", pa.int64()), ("epoch", pa.int64()), ("created", pa.float64()),
    ("branch", pa.string()), ("tags", pa.list_(pa.string())), ("message", pa.string()),
    ("world_size", pa.int64()), ("bytes_new", pa.int64()), ("bytes_total", pa.int64()),
    ("parents", pa.int64()), ("fork_of", pa.string()), ("pruned", pa.bool_()),
]


def _flatten(prefix: str, d: dict[str, Any], out: dict[str, Any]) -> None:
    for k, v in d.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict):
            _flatten(name, v, out)
        else:
            out[name] = v


def _column(values: list[Any]) -> pa.Array:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pa.array(values, pa.bool_())
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    return pa.array([None if v is None else (v if isinstance(v, str) else json.dumps(v)) for v in values],
                    pa.string())


def build(store: Repository) -> pa.Table:
    """Every version of the store as a pyarrow Table (see module docstring for the columns)."""
    store = as_repository(store)
    tags: dict[str, list[str]] = {}
    for name, vid in store.tags().items():
        tags.setdefault(vid, []).append(name)
    fixed: dict[str, list[Any]] = {name: [] for name, _ in _FIXED}
    dynamic: dict[str, list[Any]] = {}
    annotations = store.catalog.all_annotations()
    pruned = store.catalog.pruned_ids()
    for n, (vid, data) in enumerate(store.catalog.records()):
        rec, _bad = readable(json.loads(data))  # a bad record's odd fields read as empty
        row = {"id": vid, "step": rec.get("step"), "epoch": rec.get("epoch"), "created": rec.get("created"),
               "branch": rec.get("branch"), "tags": tags.get(vid, []), "message": rec.get("message", ""),
               "world_size": rec.get("world_size", 1), "bytes_new": rec.get("bytes_new"),
               "bytes_total": rec.get("bytes_total"), "parents": len(rec.get("parents", [])),
               "fork_of": rec.get("fork_of"), "pruned": vid in pruned}
        for name in fixed:
            fixed[name].append(row[name])
        flat: dict[str, Any] = {}
        _flatten("hparams", rec.get("hparams") or {}, flat)
        notes = annotations.get(vid, {})
        _flatten("metrics", merge_metrics(rec.get("metrics") or {}, notes.get(LATER_METRICS)), flat)
        _flatten("explore", rec.get("explore") or {}, flat)  # PBT: explore.old.lr, explore.new.lr
        _flatten("annotations", {k: v for k, v in notes.items() if not k.startswith("_")}, flat)
        for name, v in flat.items():
            col = dynamic.get(name)
            if col is None:
                col = dynamic[name] = [None] * n
            col.append(v)
        for col in dynamic.values():
            if len(col) < n + 1:
                col.append(None)
    arrays = [pa.array(fixed[name], typ) for name, typ in _FIXED]
    names = [name for name, _ in _FIXED]
    for name in sorted(dynamic):
        arrays.append(_column(dynamic[name]))
        names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


def find(repo: Repository, versions: pa.Table, query: str, *, allow_missing: bool = False) -> pa.Table:
    """The rows of `versions` (the versions table) matching `query`, in the query's `order by`, else
    oldest first (ties by id). The lineage
    predicates (`ancestor_of(ref)`, `descendant_of(ref)`) resolve refs through `repo`.
    A field no version has is a QueryError with close matches unless `allow_missing`.
    Raises QueryError with the offset, NotFoundError for an unknown ref."""
    from .language import parse
    from .lineage import ancestors, descendants

    q = parse(query)

    def lineage(kind: str, ref: str) -> set[str]:
        start = repo.resolve(ref)
        walk = ancestors if kind == "ancestor_of" else descendants
        return set(walk(repo.graph, start))

    rows = q.apply(versions, lineage, allow_missing=allow_missing)
    if not q.order_by:  # like `git log` and MLflow's search: oldest first, then by id for equal times
        rows = rows.sort_by([("created", "ascending"), ("id", "ascending")])
    return rows
