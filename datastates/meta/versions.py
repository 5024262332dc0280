"""Version records: one immutable record per saved state.

The id of a version is the blake3 hex digest of its canonical JSON record, so
two stores holding the same version agree on its id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import blake3

from ..base.files import canonical_json
from ..objects.tier import FORMAT


@dataclass(frozen=True)
class Version:
    """One saved state. Identity fields are hashed; `annotations` and `timings` are not."""

    id: str
    """64 hex digits: blake3 of the canonical record."""
    parents: tuple[str, ...]
    """0 = root, 1 = normal, 2+ = merge; the first parent is the main line."""
    manifests: dict[str, str]
    """rank (as a string) -> manifest id."""
    step: int | None = None
    epoch: int | None = None
    created: float = 0.0
    """Unix seconds at commit."""
    hparams: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    branch: str | None = None
    """The branch this version was saved on (None if saved by id only)."""
    world_size: int = 1
    bytes_total: int = 0
    """Raw bytes of every tensor in the state."""
    bytes_new: int = 0
    """Bytes this save added to the store (chunks that were not there before)."""
    chunks_new: int = 0
    fork_of: str | None = None
    """PBT exploit: the donor version this state was copied from."""
    explore: dict[str, Any] | None = None
    """PBT explore: {"old": {...}, "new": {...}} hyperparameter change."""
    replicated: list[str] | None = None
    """A collective save: the key patterns every rank holds identically (loadable at any world size)."""
    pruned: bool = field(default=False, compare=False)
    annotations: dict[str, Any] = field(default_factory=dict, compare=False)
    timings: dict[str, float] = field(default_factory=dict, compare=False)

    def record(self) -> dict[str, Any]:
        """The hashed fields, as stored in the record file."""
        return record_dict(
            parents=list(self.parents), manifests=self.manifests, step=self.step, epoch=self.epoch,
            created=self.created, hparams=self.hparams, metrics=self.metrics, message=self.message,
            branch=self.branch, world_size=self.world_size, bytes_total=self.bytes_total,
            bytes_new=self.bytes_new, chunks_new=self.chunks_new, fork_of=self.fork_of, explore=self.explore,
            replicated=self.replicated,
        )

    @property
    def short(self) -> str:
        return self.id[:12]


def record_dict(**fields: Any) -> dict[str, Any]:
    """A record with the format number and no None-valued optional fields."""
    rec = {"format": FORMAT}
    rec.update({k: v for k, v in fields.items() if v is not None})
    return rec


def encode_record(rec: dict[str, Any]) -> tuple[str, bytes]:
    """Canonical bytes of a record and its id."""
    data = canonical_json(rec)
    return blake3.blake3(data).hexdigest(), data


def decode_record(vid: str, data: bytes, **nonid: Any) -> Version:
    """Build a Version from record bytes (fields unknown to this reader are ignored)."""
    rec = json.loads(data)
    return Version(
        id=vid, parents=tuple(rec.get("parents", [])), manifests=dict(rec.get("manifests", {})),
        step=rec.get("step"), epoch=rec.get("epoch"), created=float(rec.get("created", 0.0)),
        hparams=rec.get("hparams", {}), metrics=rec.get("metrics", {}), message=rec.get("message", ""),
        branch=rec.get("branch"), world_size=int(rec.get("world_size", 1)),
        bytes_total=int(rec.get("bytes_total", 0)), bytes_new=int(rec.get("bytes_new", 0)),
        chunks_new=int(rec.get("chunks_new", 0)), fork_of=rec.get("fork_of"), explore=rec.get("explore"),
        replicated=rec.get("replicated"), **nonid,
    )


def plain_json(value: Any, what: str) -> Any:
    """Check that hparams/metrics hold only JSON-able plain values; return a copy with tuples as lists.

    Raises UnsupportedValueError naming the offending key.
    """
    from ..errors import UnsupportedValueError

    def walk(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                return repr(v)  # JSON has no NaN/Inf; keep them visible as strings
            return float(v)
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            return walk(v.item(), path)  # numpy / torch scalars
        if isinstance(v, dict):
            return {str(k): walk(x, f"{path}.{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        raise UnsupportedValueError(
            f"{path} is a {type(v).__name__}; {what} take numbers, strings, bools, None, lists and dicts"
        )

    return walk(value if value is not None else {}, what)
