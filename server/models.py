"""Request and response bodies. Field docs end up in schemas/openapi.json."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")

Number = float | int | str | None
"""A statistic: a number, or "NaN" / "Infinity" / "-Infinity" (JSON has no non-finite numbers), or null."""


class Page(BaseModel, Generic[T]):
    """The one list envelope."""

    items: list[T]
    next_page_token: str | None = Field(
        None, description="Pass as page_token to get the next page; null on the last page. Opaque.")


class VersionOut(BaseModel):
    """One saved state (`ds.Version`)."""

    id: str = Field(description="64 hex digits: blake3 of the canonical record")
    parents: list[str] = Field(description="0 = root, 1 = normal, 2+ = merge; the first is the main line")
    manifests: dict[str, str] = Field(description="rank (as a string) -> manifest id")
    step: int | None = None
    epoch: int | None = None
    created: float = Field(description="Unix seconds at commit")
    hparams: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    message: str = ""
    branch: str | None = Field(None, description="the branch this version was saved on")
    world_size: int = 1
    bytes_total: int = 0
    bytes_new: int = 0
    chunks_new: int = 0
    fork_of: str | None = Field(None, description="PBT exploit: the donor version")
    explore: dict[str, Any] | None = Field(None, description="PBT explore: {old: {...}, new: {...}}")
    pruned: bool = False
    annotations: dict[str, Any] = {}
    timings: dict[str, float] = {}


class TensorOut(BaseModel):
    """One manifest entry (`ds.TensorInfo`): no tensor bytes are read to produce it."""

    key: str
    dtype: str
    shape: list[int]
    nbytes: int
    kind: str = Field(description="'tensor', 'alias' (same tensor as another key) or 'view'")
    chunks: int
    stats: dict[str, Number]


class DiffRow(BaseModel):
    """One tensor key of either version (`store.diff`)."""

    key: str
    status: str
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    l2_change: Number = None
    rel_change: Number = None
    cosine: Number = None
    max_abs_diff: Number = None
    chunks_shared: int | None = None
    chunks_total: int | None = None
    bytes_shared: int | None = None


class HistoryRow(BaseModel):
    """A tensor's stored statistics in one version of a first-parent chain (`store.history`)."""

    version: str
    step: int | None = None
    created: float | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    min: Number = None
    max: Number = None
    mean: Number = None
    std: Number = None
    l2: Number = None
    nan_count: int | None = None
    inf_count: int | None = None
    chunks_changed: int | None = None
    l2_delta: Number = None


class MergeBaseOut(BaseModel):
    merge_base: str | None = Field(description="nearest common ancestor id, or null when none")


class RefOut(BaseModel):
    """A branch or tag and the version id it points at."""

    name: str
    id: str


class BranchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=255)
    at: str = Field("main", max_length=1024, description="ref the branch starts at")


class BranchMove(BaseModel):
    """Compare-and-swap move: `to` replaces the head only if the head is `expected`."""

    model_config = ConfigDict(extra="forbid")
    to: str = Field(max_length=1024, description="ref to point the branch at")
    expected: str = Field(max_length=64, description="the full version id the branch must point at now")


class TagCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=255)
    ref: str = Field("main", max_length=1024)
    message: str = Field("", max_length=4096)


class TreeEdge(BaseModel):
    """An edge of a population's family tree (`Population.family_tree`)."""

    child: str
    parent: str
    kind: str = Field(description="'parent' or 'fork' (PBT exploit)")
    member: str | None = None
    step: int | None = None
    explore: str | None = None


class Health(BaseModel):
    status: str
    versions: int


class ErrorDetail(BaseModel):
    code: str = Field(description="NOT_FOUND, BAD_QUERY, INVALID_NAME, INVALID_ARGUMENT, AMBIGUOUS_REF, CONFLICT, "
                                  "PRUNED, UNAUTHORIZED, WRITES_DISABLED, PAYLOAD_TOO_LARGE, RANGE_NOT_SATISFIABLE, "
                                  "VALIDATION_ERROR, INTERNAL, ...")
    message: str = Field(description="names the object and says what to do")
    details: dict[str, Any] = {}
    request_id: str | None = Field(None, description="also in the X-Request-ID header; the server log uses it")


class ErrorOut(BaseModel):
    """The one error envelope."""

    error: ErrorDetail
