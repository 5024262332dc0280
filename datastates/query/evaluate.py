"""Vectorized evaluation of a parsed query over an Arrow table (SQL three-valued logic)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import QueryError
from . import syntax as S

_COMPARE_FUNCS: dict[str, Callable[..., Any]] = {
    "=": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater, ">=": pc.greater_equal,
}


def _kind(dtype: pa.DataType) -> str:
    """Which comparison rules a column follows: number, string, bool, null, or other."""
    if pa.types.is_integer(dtype) or pa.types.is_floating(dtype):
        return "number"
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "string"
    if pa.types.is_boolean(dtype):
        return "bool"
    if pa.types.is_null(dtype):
        return "null"
    return "other"


def _nulls(length: int) -> pa.Array:
    return pa.nulls(length, pa.bool_())


def _normalize(array: pa.Array) -> pa.Array:
    """Decode dictionaries and turn decimals and timestamps into float64 (timestamps as
    unix seconds), so every column falls into one of the `_kind` rules."""
    dtype = array.type
    if pa.types.is_dictionary(dtype):
        return _normalize(array.dictionary_decode())
    if pa.types.is_decimal(dtype):
        return pc.cast(array, pa.float64())
    if pa.types.is_timestamp(dtype):
        per_second = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[dtype.unit]
        raw = pc.cast(pc.cast(array, pa.timestamp(dtype.unit)), pa.int64())
        return pc.divide(pc.cast(raw, pa.float64()), float(per_second))
    is_string_view = getattr(pa.types, "is_string_view", None)  # pyarrow >= 16 only
    if is_string_view is not None and is_string_view(dtype):
        return pc.cast(array, pa.string())
    return array


def _column(table: pa.Table, name: str) -> pa.Array:
    """Column `name` as one normalized Array; all-null when the table lacks it."""
    if name not in table.column_names:
        return pa.nulls(table.num_rows)
    return _normalize(table.column(name).combine_chunks())


def _to_float(strings: pa.Array) -> pa.Array:
    """Strings that look like decimal numbers as float64, everything else null."""
    numeric = pc.match_substring_regex(strings, S._NUMERIC_STRING)
    return pc.cast(pc.if_else(numeric, strings, pa.scalar(None, strings.type)), pa.float64())


def _coerce(values: pa.Array, literal: S.Value) -> tuple[pa.Array, S.Value] | None:
    """The column and literal converted so they compare, or None when the pair can never
    compare (the predicate is then null for every row).

    number vs number: as is. string column vs number: the column cast to float (non-numeric
    cells null). number column vs string: the literal parsed as a number. bool vs string:
    'true'/'false' in any case.
    """
    kind = _kind(values.type)
    if isinstance(literal, bool):
        if kind == "bool":
            return values, literal
        if kind == "string":
            return pc.utf8_lower(values), "true" if literal else "false"
        return None
    if isinstance(literal, (int, float)):
        if kind == "number":
            return values, literal
        if kind == "string":
            return _to_float(values), float(literal)
        return None
    if kind == "string":
        return values, literal
    if kind == "number":
        number = S._parse_number(literal)
        return None if number is None else (values, number)
    if kind == "bool":
        flag = {"true": True, "false": False}.get(literal.lower())
        return None if flag is None else (values, flag)
    return None


def _compare(values: pa.Array, op: str, literal: S.Value) -> pa.Array:
    """`values op literal` per row under `_coerce` rules; null where either side is null."""
    coerced = _coerce(values, literal)
    if coerced is None:
        return _nulls(len(values))
    column, scalar = coerced
    if isinstance(scalar, float) and pa.types.is_integer(column.type):
        # Arrow refuses to compare ints beyond 2**53 with a float exactly; compare as floats (a float
        # literal carries no more precision anyway), so `step > 1e999` is false, not an error.
        column = pc.cast(column, pa.float64(), safe=False)
    return _COMPARE_FUNCS[op](column, pa.scalar(scalar))


def _literal_class(literal: S.Value) -> str:
    if isinstance(literal, bool):
        return "bool"
    return "number" if isinstance(literal, (int, float)) else "string"


def _in_list(values: pa.Array, literals: Sequence[S.Value]) -> pa.Array:
    """`values in (literals)`, equal to `values = l1 or values = l2 or ...`, with one
    `is_in` per kind of literal instead of one comparison per literal."""
    result: pa.Array | None = None
    for cls in ("number", "string", "bool"):
        members = [lit for lit in literals if _literal_class(lit) == cls]
        if not members:
            continue
        coerced = [_coerce(values, lit) for lit in members]
        good = [c for c in coerced if c is not None]
        parts: list[pa.Array] = []
        if good:
            parts.append(_is_in(good[0][0], [scalar for _, scalar in good]))
        if len(good) < len(coerced):
            parts.append(_nulls(len(values)))
        for part in parts:
            result = part if result is None else pc.or_kleene(result, part)
    return result if result is not None else _nulls(len(values))


def _is_in(column: pa.Array, scalars: list[S.Value]) -> pa.Array:
    """Membership with SQL nulls: null rows give null, not false."""
    if _kind(column.type) == "number":
        # is_in hashes bits, so -0.0 would miss 0.0 (which `=` matches); adding +0.0 turns -0.0 into 0.0.
        column = pc.add(pc.cast(column, pa.float64()), 0.0)
        value_set = pa.array([float(s) + 0.0 for s in scalars], pa.float64())
    else:
        value_set = pa.array(scalars, column.type)
    found = pc.is_in(column, value_set=value_set)
    return pc.if_else(pc.is_valid(column), found, pa.scalar(None, pa.bool_()))


def _like(values: pa.Array, pattern: str) -> pa.Array:
    """SQL LIKE, case-sensitive; numbers and bools are matched on their Arrow string form."""
    kind = _kind(values.type)
    if kind == "null":
        return _nulls(len(values))
    if kind != "string":
        values = pc.cast(values, pa.string())
    return pc.match_like(values, pattern)


def _leaf(node: S._Leaf, values: pa.Array) -> pa.Array:
    """One predicate over an array of cells."""
    if isinstance(node, S.Compare):
        return _compare(values, node.op, node.value)
    if isinstance(node, S.IsNull):
        return pc.is_valid(values) if node.negated else pc.is_null(values)
    mask = _in_list(values, node.values) if isinstance(node, S.InList) else _like(values, node.pattern)
    return pc.invert(mask) if node.negated else mask


def _positive(node: S._Leaf) -> tuple[S._Leaf, bool]:
    """The predicate without its negation, and whether it was negated (for tag lists)."""
    if isinstance(node, S.Compare) and node.op == "!=":
        return S.Compare(node.field, "=", node.value, node.offset), True
    if isinstance(node, S.InList) and node.negated:
        return S.InList(node.field, node.values, False, node.offset), True
    if isinstance(node, S.Like) and node.negated:
        return S.Like(node.field, node.pattern, False, node.offset), True
    return node, False


class _Evaluator:
    """Evaluates a tree to one boolean (nullable) Array per node, caching columns."""

    def __init__(self, table: pa.Table, lineage: S.LineageFn | None, text: str) -> None:
        self.table = table
        self.rows = table.num_rows
        self.lineage = lineage
        self.text = text
        self.columns: dict[str, pa.Array] = {}
        self.lineage_masks: dict[tuple[str, str], pa.Array] = {}

    def column(self, node: S._Leaf | S.Lineage, name: str) -> pa.Array:
        """Column `name`, checked to be comparable; raises QueryError pointing at `node`."""
        if name not in self.columns:
            array = _column(self.table, name)
            if _kind(array.type) == "other":
                raise QueryError(f"field '{name}' has type {array.type}, which queries cannot compare",
                                 self.text, node.offset)
            self.columns[name] = array
        return self.columns[name]

    def eval(self, node: S.Node) -> pa.Array:
        if isinstance(node, S.And):
            return self.fold(pc.and_kleene, node.operands)
        if isinstance(node, S.Or):
            return self.fold(pc.or_kleene, node.operands)
        if isinstance(node, S.Not):
            return pc.invert(self.eval(node.operand))
        if isinstance(node, S.Lineage):
            return self.eval_lineage(node)
        if node.field == "tag":
            return self.eval_tag(node)
        values = self.column(node, node.field)
        if (isinstance(node, S.Compare) and isinstance(node.value, str) and _kind(values.type) == "number"
                and S._parse_number(node.value) is None):
            raise QueryError(f"field '{node.field}' holds numbers; {node.value!r} is not a number "
                             "(drop the quotes around a number, or compare a text field)", self.text, node.offset)
        return _leaf(node, values)

    def fold(self, combine: Callable[..., Any], operands: tuple[S.Node, ...]) -> pa.Array:
        result = self.eval(operands[0])
        for operand in operands[1:]:
            result = combine(result, self.eval(operand))
        return result

    def eval_lineage(self, node: S.Lineage) -> pa.Array:
        """Rows whose id is in `lineage(kind, ref)`; the resolver runs once per distinct pair."""
        assert self.lineage is not None  # Query.apply checks before evaluating
        key = (node.kind, node.ref)
        if key not in self.lineage_masks:
            ids = self.column(node, "id")
            if _kind(ids.type) != "string":
                self.lineage_masks[key] = _nulls(self.rows)
            else:
                self.lineage_masks[key] = _is_in(ids, sorted(self.lineage(node.kind, node.ref)))
        return self.lineage_masks[key]

    def eval_tag(self, node: S._Leaf) -> pa.Array:
        """Tags are a list per row: a positive predicate holds when any tag satisfies it,
        a negated one when none does; an empty or null list counts as no tags."""
        tags = _column(self.table, "tags")
        if pa.types.is_null(tags.type):
            tags = pa.array([[]] * self.rows, pa.list_(pa.string()))
        if not (pa.types.is_list(tags.type) or pa.types.is_large_list(tags.type)):
            raise QueryError(f"column 'tags' has type {tags.type}, expected a list of strings", self.text, node.offset)
        if isinstance(node, S.IsNull):
            empty = pc.fill_null(pc.equal(pc.list_value_length(tags), 0), True)
            return pc.invert(empty) if node.negated else empty
        positive, negated = _positive(node)
        flat = _normalize(pc.list_flatten(tags))
        hits = pc.fill_null(_leaf(positive, flat), False)
        owners = pc.filter(pc.list_parent_indices(tags), hits).to_numpy()
        any_hit = np.zeros(self.rows, dtype=bool)
        any_hit[owners] = True
        return pa.array(~any_hit if negated else any_hit)


def _sort_indices(table: pa.Table, order_by: list[tuple[str, bool]]) -> pa.Array:
    """Row order for `order_by`: stable, nulls last whatever the direction."""
    keys: dict[str, pa.Array] = {}
    orders: list[tuple[str, str]] = []
    for i, (name, descending) in enumerate(order_by):
        array = _column(table, name)
        if pa.types.is_null(array.type):
            continue  # an all-null key leaves the order as it is
        keys[f"k{i}"] = array
        orders.append((f"k{i}", "descending" if descending else "ascending"))
    if not keys:
        return pa.array(np.arange(table.num_rows, dtype=np.uint64))
    return _stable_sort(pa.table(keys), orders)


def _stable_sort(keys: pa.Table, orders: list[tuple[str, str]]) -> pa.Array:
    # pyarrow 25 moved null_placement into each sort key and deprecated the global option.
    if int(pa.__version__.split(".")[0]) >= 25:
        return pc.sort_indices(keys, sort_keys=[(name, order, "at_end") for name, order in orders])
    return pc.sort_indices(keys, sort_keys=orders, null_placement="at_end")
