"""A small query language over version metadata, evaluated vectorized on Arrow.

    q = parse("hparams.lr > 1e-3 and tag = 'best' order by metrics.loss asc limit 5")
    rows = q.apply(table, lineage=store_lineage)

Grammar (keywords, bare field names and namespace prefixes are case-insensitive):

    query      := [or_expr] ["order" "by" key ("," key)*] ["limit" INT]
    or_expr    := and_expr ("or" and_expr)*
    and_expr   := not_expr ("and" not_expr)*
    not_expr   := "not" not_expr | "(" or_expr ")" | lineage | predicate
    lineage    := ("ancestor_of" | "descendant_of") "(" STRING ")"
    predicate  := field ( OP value
                        | ["not"] "in" "(" value ("," value)* ")"
                        | ["not"] "like" STRING
                        | "is" ["not"] "null" )
    key        := field ["asc" | "desc"]
    OP         := "=" | "==" | "!=" | "<>" | "<" | "<=" | ">" | ">="
    value      := NUMBER | STRING | "true" | "false"

Fields are the bare names in `BARE_FIELDS` or `hparams.<name>`, `metrics.<name>`,
`annotations.<name>`, `explore.old.<name>` / `explore.new.<name>` (a PBT explore's
hyperparameter change); backquote a name with spaces: `` `hparams.weird name` ``.
A name that no row has (no column in the table) is a QueryError listing the close
matches (`metrics.los` -> `metrics.loss`), since a typo would otherwise match nothing
in silence; with `allow_missing=True` (`datastates find --allow-missing`) unknown
names read as null instead. A table with no rows accepts every name. A name that some
rows lack reads as null in those rows (different runs log different hyperparameters).
Comparing a numeric field with a string that is not a number (`metrics.loss < 'abc'`)
is a QueryError.

Semantics are SQL's three-valued logic; a row is selected only where the filter
is true. `x in (a, b)` means exactly `x = a or x = b`. The literal `null` is only
allowed after `is` / `is not`, since `x = null` is never true in SQL and is almost
always a mistake for `x is null`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import pyarrow as pa

from ..errors import QueryError
from .evaluate import _Evaluator, _sort_indices
from .parser import _Parser
from .syntax import (
    BARE_FIELDS,
    NAMESPACES,
    And,
    Compare,
    InList,
    IsNull,
    Like,
    Lineage,
    LineageFn,
    Node,
    Not,
    Or,
    Value,
    _walk,
)

__all__ = [
    "BARE_FIELDS", "NAMESPACES", "And", "Compare", "InList", "IsNull", "Like", "Lineage", "LineageFn", "Node",
    "Not", "Or", "Query", "Value", "parse",
]



# --------------------------------------------------------------------------- query


@dataclass(frozen=True)
class Query:
    """A parsed query: an optional filter, sort keys and a row limit.

    `order_by` holds `(field, descending)` pairs; `text` is the source, kept so
    that evaluation errors can point into it.
    """

    where: Node | None = None
    order_by: list[tuple[str, bool]] = dataclass_field(default_factory=list)
    limit: int | None = None
    text: str = dataclass_field(default="", compare=False)

    def fields(self) -> set[str]:
        """The field names the query reads (filter and sort keys), as written in the
        query: `tag` stands for the `tags` column. Lineage predicates also read `id`,
        which is not listed; see `lineage_refs`."""
        names = {n.field for n in _walk(self.where) if isinstance(n, (Compare, InList, Like, IsNull))}
        return names | {name for name, _ in self.order_by}

    def lineage_refs(self) -> list[tuple[str, str]]:
        """The `(kind, ref)` of every lineage predicate, in source order, without repeats."""
        refs = [(n.kind, n.ref) for n in _walk(self.where) if isinstance(n, Lineage)]
        return list(dict.fromkeys(refs))

    def apply(self, table: pa.Table, lineage: LineageFn | None = None, *, allow_missing: bool = False) -> pa.Table:
        """The rows of `table` where the filter is true, sorted and limited; all columns.

        `lineage(kind, ref)` must return the ids selected by a lineage predicate; it is
        called once per distinct predicate. A field the (non-empty) table lacks raises
        QueryError with close matches, unless `allow_missing` (then it reads as all-null).
        Raises QueryError when the query has lineage predicates and `lineage` is None,
        when a column has a type queries cannot compare (e.g. a list column), or when a
        numeric field is compared with a string that is not a number.
        """
        if not allow_missing and table.num_rows:
            self._check_fields(table)
        if lineage is None:
            used = next((n for n in _walk(self.where) if isinstance(n, Lineage)), None)
            if used is not None:
                raise QueryError(f"{used.kind}() needs a lineage resolver, but none was given", self.text, used.offset)
        result = table
        if self.where is not None:
            mask = _Evaluator(table, lineage, self.text).eval(self.where)
            result = table.filter(mask, null_selection_behavior="drop")
        # A limit past the row count keeps every row (and one past 2**63 would overflow Arrow's slice).
        limit = None if self.limit is None else min(self.limit, result.num_rows)
        if self.order_by:
            indices = _sort_indices(result, self.order_by)
            if limit is not None:
                indices = indices.slice(0, limit)
            return result.take(indices)
        if limit is not None:
            result = result.slice(0, limit)
        return result

    def _check_fields(self, table: pa.Table) -> None:
        """QueryError for the first field (filter, then sort keys) that `table` has no column for."""
        names = list(table.column_names)
        have = set(names) | {"tag"}
        for n in _walk(self.where):
            if isinstance(n, (Compare, InList, Like, IsNull)) and n.field not in have:
                raise QueryError(f"no version has a field {n.field!r}{_close(n.field, names)} "
                                 "(pass allow_missing=True, or --allow-missing, to read it as null)",
                                 self.text, n.offset)
        for name, _ in self.order_by:
            if name not in have:
                raise QueryError(f"no version has a field {name!r} to order by{_close(name, names)}",
                                 self.text, max(self.text.find(name), 0))


def _close(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def parse(text: str) -> Query:
    """Parse a query string. An empty (or all-blank) query selects every row.

    Raises QueryError with `.offset` at the token where parsing failed and a
    message naming what was expected there.
    """
    try:
        where, order_by, limit = _Parser(text).parse_query()
        return Query(where, order_by, limit, text)
    except RecursionError:
        raise QueryError("query nests too deeply", text, 0) from None


# --------------------------------------------------------------------------- lexer


