"""Library values -> JSON-ready dicts (no query logic: shapes only)."""

from __future__ import annotations

import dataclasses
from typing import Any

import datastates as ds
from datastates.base.files import json_finite

finite = json_finite
"""JSON has no NaN/Infinity: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""


def version_dict(v: ds.Version) -> dict[str, Any]:
    d = dataclasses.asdict(v)
    d["parents"] = list(v.parents)
    return finite(d)  # type: ignore[no-any-return]


def tensor_dict(t: ds.TensorInfo) -> dict[str, Any]:
    return finite({"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes, "kind": t.kind,
                   "chunks": t.chunks, "stats": dict(t.stats)})  # type: ignore[no-any-return]


def table_rows(table: Any) -> list[dict[str, Any]]:
    """A pyarrow Table's rows as JSON-ready dicts."""
    return [finite(r) for r in table.to_pylist()]
