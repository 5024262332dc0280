"""The query language's syntax tree: field names, literal values and the node classes."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime, timezone

BARE_FIELDS: frozenset[str] = frozenset({
    "step", "epoch", "branch", "tag", "created", "id", "message", "world_size",
    "bytes_new", "bytes_total", "parents", "fork_of", "pruned",
})
NAMESPACES: tuple[str, ...] = ("hparams", "metrics", "annotations", "explore")
LINEAGE_FUNCTIONS: tuple[str, ...] = ("ancestor_of", "descendant_of")
_KEYWORDS = frozenset({
    "and", "or", "not", "in", "like", "is", "null", "true", "false", "order", "by", "asc", "desc", "limit",
})

Value = bool | int | float | str
LineageFn = Callable[[str, str], set[str]]


# --------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class Compare:
    """`field op value`; `op` is one of = != < <= > >=."""

    field: str
    op: str
    value: Value
    offset: int = dataclass_field(default=0, compare=False)


@dataclass(frozen=True)
class InList:
    """`field [not] in (values...)`."""

    field: str
    values: tuple[Value, ...]
    negated: bool = False
    offset: int = dataclass_field(default=0, compare=False)


@dataclass(frozen=True)
class Like:
    """`field [not] like 'pattern'` with SQL wildcards % and _ (backslash escapes them)."""

    field: str
    pattern: str
    negated: bool = False
    offset: int = dataclass_field(default=0, compare=False)


@dataclass(frozen=True)
class IsNull:
    """`field is [not] null`."""

    field: str
    negated: bool = False
    offset: int = dataclass_field(default=0, compare=False)


@dataclass(frozen=True)
class Lineage:
    """`ancestor_of('ref')` or `descendant_of('ref')`."""

    kind: str
    ref: str
    offset: int = dataclass_field(default=0, compare=False)


@dataclass(frozen=True)
class Not:
    """`not operand`; null stays null."""

    operand: Node


@dataclass(frozen=True)
class And:
    """Two or more operands joined by `and` (Kleene logic)."""

    operands: tuple[Node, ...]


@dataclass(frozen=True)
class Or:
    """Two or more operands joined by `or` (Kleene logic)."""

    operands: tuple[Node, ...]


Node = Compare | InList | Like | IsNull | Lineage | Not | And | Or
_Leaf = Compare | InList | Like | IsNull


def _walk(node: Node | None) -> list[Node]:
    """Every node of the tree in source order (pre-order)."""
    if node is None:
        return []
    if isinstance(node, Not):
        return [node, *_walk(node.operand)]
    if isinstance(node, (And, Or)):
        return [node, *(n for child in node.operands for n in _walk(child))]
    return [node]


# literals shared by the parser and the evaluator
_INT64_MAX = 2**63 - 1
_NUMERIC_STRING = r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$"
_NUMERIC_STRING_RE = re.compile(_NUMERIC_STRING)


def _parse_number(text: str) -> float | None:
    """`text` as a float if it is a plain decimal number (no nan/inf/blanks), else None.

    The same rule casts string columns, so literals and cells agree."""
    return float(text) if _NUMERIC_STRING_RE.match(text) else None


def _exact_number(value: int | float) -> int | float:
    """Ints that do not fit in int64 become floats, so Arrow can hold them."""
    if isinstance(value, int) and abs(value) > _INT64_MAX:
        try:
            return float(value)
        except OverflowError:  # beyond any float: compares like infinity, as 1e999 does
            return math.inf if value > 0 else -math.inf
    return value


def _iso_to_unix(text: str) -> float | None:
    """Unix seconds of an ISO date or datetime (naive means UTC), or None if not ISO."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


# --------------------------------------------------------------------------- evaluation
