"""Version records: one immutable record per saved state.

The id of a version is the blake3 hex digest of its canonical JSON record, so
two stores holding the same version agree on its id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
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
    partners: dict[str, list[Any]] | None = None
    """A collective save with partner replication: rank -> [the rank holding its partner copy, that rank's node]."""
    pruned: bool = field(default=False, compare=False)
    annotations: dict[str, Any] = field(default_factory=dict, compare=False)
    timings: dict[str, float] = field(default_factory=dict, compare=False)
    recorded_metrics: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The record's own metrics when `metrics` has later (annotated) metrics laid over them."""
    damaged: str | None = field(default=None, compare=False)
    """Set by `fsck --repair` when a file of this version had no intact copy: what was moved to
    quarantine/. Loading such a version raises IntegrityError naming it."""
    invalid: tuple[str, ...] = field(default=(), compare=False)
    """Record fields a buggy or older writer stored with the wrong type; they read as empty."""

    def record(self) -> dict[str, Any]:
        """The hashed fields, as stored in the record file."""
        return record_dict(
            parents=list(self.parents), manifests=self.manifests, step=self.step, epoch=self.epoch,
            created=self.created, hparams=self.hparams,
            metrics=self.metrics if self.recorded_metrics is None else self.recorded_metrics, message=self.message,
            branch=self.branch, world_size=self.world_size, bytes_total=self.bytes_total,
            bytes_new=self.bytes_new, chunks_new=self.chunks_new, fork_of=self.fork_of, explore=self.explore,
            replicated=self.replicated, partners=self.partners,
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


def readable(rec: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A record as readers may use it, and the names of the fields that were not of their type.

    Records are immutable, so one a buggy or older writer produced (metrics=0.5, step="3") stays in
    the store for good: readers take it through here and see such a field as empty (None or {}),
    never crash on it. fsck and `show` report the invalid names.
    """
    if not isinstance(rec, dict):
        return {}, ("record",)
    out = dict(rec)
    bad: list[str] = []
    for name in ("hparams", "metrics", "explore"):
        v = out.get(name)
        if v is not None and not (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
            bad.append(name)
            out[name] = {} if name != "explore" else None
    for name in ("step", "epoch"):
        v = out.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            bad.append(name)
            out[name] = None
    for name, default in (("world_size", 1), ("bytes_total", 0), ("bytes_new", 0), ("chunks_new", 0)):
        v = out.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int):
            bad.append(name)
            out[name] = default
    created = out.get("created", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        bad.append("created")
        out["created"] = 0.0
    texts: tuple[tuple[str, str | None], ...] = (("message", ""), ("branch", None), ("fork_of", None))
    for name, text in texts:
        if out.get(name) is not None and not isinstance(out[name], str):
            bad.append(name)
            out[name] = text
    parents = out.get("parents", [])
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        bad.append("parents")
        out["parents"] = [p for p in parents if isinstance(p, str)] if isinstance(parents, list) else []
    manifests = out.get("manifests", {})
    if not isinstance(manifests, dict):
        bad.append("manifests")
        out["manifests"] = {}
    return out, tuple(bad)


def decode_record(vid: str, data: bytes, **nonid: Any) -> Version:
    """Build a Version from record bytes (fields unknown to this reader are ignored; fields of the
    wrong type read as empty and are named in `Version.invalid`, see `readable`)."""
    rec, bad = readable(json.loads(data))
    return Version(
        id=vid, parents=tuple(rec.get("parents", [])), manifests=dict(rec.get("manifests", {})),
        step=rec.get("step"), epoch=rec.get("epoch"), created=float(rec.get("created", 0.0)),
        hparams=rec.get("hparams") or {}, metrics=rec.get("metrics") or {}, message=rec.get("message") or "",
        branch=rec.get("branch"), world_size=int(rec.get("world_size", 1)),
        bytes_total=int(rec.get("bytes_total", 0)), bytes_new=int(rec.get("bytes_new", 0)),
        chunks_new=int(rec.get("chunks_new", 0)), fork_of=rec.get("fork_of"), explore=rec.get("explore"),
        replicated=rec.get("replicated"),
        partners=rec.get("partners") if isinstance(rec.get("partners"), dict) else None, invalid=bad, **nonid,
    )


ANNOTATION_SUM = "_blake3"
"""Key of an annotation file that holds the blake3 of the canonical JSON of the other keys."""


def encode_annotations(values: dict[str, Any]) -> bytes:
    """The bytes of an annotation file: canonical JSON of `values` plus their checksum."""
    plain = {k: v for k, v in values.items() if k != ANNOTATION_SUM}
    return canonical_json({**plain, ANNOTATION_SUM: blake3.blake3(canonical_json(plain)).hexdigest()})


def decode_annotations(data: bytes) -> dict[str, Any]:
    """The annotations in an annotation file, verified. Files written before checksums (no
    `_blake3` key) are read as they are. Raises ValueError saying why when the file is damaged
    (not UTF-8 JSON, not an object, or its checksum does not match)."""
    try:
        values = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"is not JSON ({exc})") from exc
    if not isinstance(values, dict):
        raise ValueError("does not hold a JSON object")
    stored = values.pop(ANNOTATION_SUM, None)
    if stored is not None and blake3.blake3(canonical_json(values)).hexdigest() != stored:
        raise ValueError("does not match its checksum")
    return values


LATER_METRICS = "_metrics"
"""Annotation key under which `annotate(v, metrics={...})` keeps metrics computed after the save."""


def merge_metrics(base: dict[str, Any], later: Any) -> dict[str, Any]:
    """`base` with `later` laid over it, nested dicts merged key by key (a copy; neither is changed)."""
    out = dict(base)
    if isinstance(later, dict):
        for k, v in later.items():
            out[k] = merge_metrics(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_annotations(v: Version, raw: dict[str, Any]) -> Version:
    """`v` as users see it with its stored annotations `raw`: metrics annotated after the save laid
    over the record's metrics (the record, and so the id, never changes), internal keys (`_...`)
    hidden from `annotations`."""
    visible = {k: x for k, x in raw.items() if not k.startswith("_")}
    later = raw.get(LATER_METRICS)
    if not later:
        return replace(v, annotations=visible)
    return replace(v, metrics=merge_metrics(v.metrics, later), recorded_metrics=v.metrics, annotations=visible)


MAX_INT = 2**63 - 1
"""Largest integer a record field may hold: the versions table stores numbers as int64/float64."""


def cut(text: str, most: int = 80) -> str:
    """`text` cut to `most` characters for a message (a value or a name can be as long as its author made it)."""
    return text if len(text) <= most else f"{text[: most - 5]}...{text[-2:]}"


def shown(value: Any, most: int = 80) -> str:
    """`repr(value)` cut to `most` characters, for a message (the value may be a 50 MB string)."""
    return cut(repr(value), most)


MAX_FIELD_BYTES = 1 << 20
"""The most a record's hparams, metrics, explore or message (and a version's annotations) may take as JSON:
every log, query and versions table reads them (MLflow bounds a param to a few KB; this leaves room for a
whole config)."""


def check_size(value: Any, what: str) -> None:
    """InvalidArgumentError if `value` (plain JSON) takes more than MAX_FIELD_BYTES as canonical JSON."""
    from ..errors import InvalidArgumentError

    size = len(canonical_json(value))
    if size > MAX_FIELD_BYTES:
        raise InvalidArgumentError(
            f"{what} take {size:,} bytes as JSON, more than the {MAX_FIELD_BYTES:,} a version may hold there "
            "(every log and query reads them); keep big values in the saved state as tensors, or in a file, "
            "and name them here")


def check_text(value: Any, what: str) -> str:
    """`value` if it is a str without NUL and without lone surrogates (neither survives a file name or
    UTF-8 JSON); else InvalidArgumentError naming `what`."""
    from ..errors import InvalidArgumentError

    if not isinstance(value, str):
        raise InvalidArgumentError(f"{what} is a {type(value).__name__}; give a str")
    if "\x00" in value:
        raise InvalidArgumentError(f"{what} {shown(value)} contains a NUL character; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{what} {shown(value)} contains a lone surrogate, which is not text; "
                                   "decode your bytes with errors='replace'") from None
    return value


def plain_json(value: Any, what: str, *, numbers_only: bool = False) -> dict[str, Any]:
    """Check a hparams/metrics/annotations/explore dict and return a plain copy (tuples as lists,
    numpy/torch scalars as the Python numbers they hold).

    Accepted: a dict (None means {}) whose keys are non-empty str without NUL or lone surrogates and
    whose values are None, bool, int within +-(2**63-1), finite float, str, or lists and dicts of those.
    With `numbers_only` (metrics) the leaves are int/float (not bool) or None, dicts may nest.
    NaN and +-inf are refused: the canonical JSON record cannot hold them (docs/format.md).
    Raises UnsupportedValueError (a value of a type that cannot be stored) or InvalidArgumentError
    (not a dict, a bad key, NaN/inf, an int too large, a str leaf in metrics, more than MAX_FIELD_BYTES in
    all), naming the offending path.
    """
    from ..errors import InvalidArgumentError, UnsupportedValueError

    allowed = ("numbers (int, finite float) or None, in nested dicts" if numbers_only
               else "None, bool, int, finite float, str, and lists and dicts of those")

    def scalar(v: Any) -> Any:
        # numpy/torch scalars (0-d) become the Python value they are
        if not isinstance(v, (bool, int, float, str)) and hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            return v.item()
        return v

    def walk(v: Any, path: str) -> Any:
        v = scalar(v)
        if isinstance(v, dict):
            return mapping(v, path)
        if v is None:
            return None
        if numbers_only and isinstance(v, (bool, str, list, tuple)):
            raise InvalidArgumentError(f"{path}={shown(v)} is a {type(v).__name__}; {what} take {allowed}, "
                                       f"e.g. {what}={{'loss': 0.5}} (put labels in hparams or annotations)")
        if isinstance(v, bool):
            return v
        if isinstance(v, str):
            return check_text(v, path)
        if isinstance(v, int):
            if abs(v) > MAX_INT:
                raise InvalidArgumentError(f"{path} is an int with {len(str(abs(v)))} digits; "
                                           f"{what} take ints within +-(2**63-1): store it as a str")
            return int(v)
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise InvalidArgumentError(f"{path}={v!r}: NaN and infinity cannot be stored in a record; "
                                           "store None (missing) or a finite number")
            return float(v)
        if isinstance(v, (list, tuple)) and not numbers_only:
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        raise UnsupportedValueError(f"{path} is a {type(v).__name__}; {what} take {allowed}")

    def mapping(d: dict[Any, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, x in d.items():
            if not isinstance(k, str) or not k:
                raise InvalidArgumentError(f"{path} has the key {k!r}; keys must be non-empty str "
                                           f"(write {str(k)!r} if you meant the text)")
            check_text(k, f"key {k!r} of {path}")
            out[k] = walk(x, f"{path}.{k}")
        return out

    if value is None:
        return {}
    value = scalar(value)
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what}={shown(value)} is a {type(value).__name__}, not a dict; "
                                   f"give a dict such as {what}={{'loss': 0.5}}")
    out = mapping(value, what)
    check_size(out, what)
    return out
