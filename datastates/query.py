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
Unknown namespaced names are not errors: they read as null, because different
runs log different hyperparameters.

Semantics are SQL's three-valued logic; a row is selected only where the filter
is true. `x in (a, b)` means exactly `x = a or x = b`. The literal `null` is only
allowed after `is` / `is not`, since `x = null` is never true in SQL and is almost
always a mistake for `x is null`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import QueryError

__all__ = [
    "BARE_FIELDS", "NAMESPACES", "And", "Compare", "InList", "IsNull", "Like", "Lineage", "LineageFn", "Node",
    "Not", "Or", "Query", "Value", "parse",
]

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

    def apply(self, table: pa.Table, lineage: LineageFn | None = None) -> pa.Table:
        """The rows of `table` where the filter is true, sorted and limited; all columns.

        `lineage(kind, ref)` must return the ids selected by a lineage predicate; it is
        called once per distinct predicate. Missing columns read as all-null.
        Raises QueryError when the query has lineage predicates and `lineage` is None,
        or when a column has a type queries cannot compare (e.g. a list column).
        """
        if lineage is None:
            used = next((n for n in _walk(self.where) if isinstance(n, Lineage)), None)
            if used is not None:
                raise QueryError(f"{used.kind}() needs a lineage resolver, but none was given", self.text, used.offset)
        result = table
        if self.where is not None:
            mask = _Evaluator(table, lineage, self.text).eval(self.where)
            result = table.filter(mask, null_selection_behavior="drop")
        if self.order_by:
            indices = _sort_indices(result, self.order_by)
            if self.limit is not None:
                indices = indices.slice(0, self.limit)
            return result.take(indices)
        if self.limit is not None:
            result = result.slice(0, self.limit)
        return result


def parse(text: str) -> Query:
    """Parse a query string. An empty (or all-blank) query selects every row.

    Raises QueryError with `.offset` at the token where parsing failed and a
    message naming what was expected there.
    """
    try:
        return _Parser(text).parse_query()
    except RecursionError:
        raise QueryError("query nests too deeply", text, 0) from None


# --------------------------------------------------------------------------- lexer


@dataclass(frozen=True)
class _Token:
    kind: str  # IDENT QIDENT KW NUMBER STRING OP LPAREN RPAREN COMMA EOF
    text: str
    value: Any
    offset: int

    def describe(self) -> str:
        """How error messages name this token."""
        if self.kind == "EOF":
            return "end of query"
        if self.kind == "STRING":
            return f"string {self.text}"
        return f"'{self.text}'"


_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_WORD_TAIL_RE = re.compile(r"[A-Za-z0-9_.]+")
_OPERATORS = ("==", "!=", "<>", "<=", ">=", "=", "<", ">")
_OP_ALIASES = {"==": "=", "<>": "!="}
_PUNCT = {"(": "LPAREN", ")": "RPAREN", ",": "COMMA"}
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "t": "\t", "r": "\r", "0": "\0"}
_INT64_MAX = 2**63 - 1


def _tokenize(text: str) -> list[_Token]:
    """Split `text` into tokens ending with EOF; raises QueryError on a bad character,
    an unterminated string or quoted name, or a malformed number."""
    tokens: list[_Token] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            tokens.append(_Token("EOF", "", None, len(text)))
            return tokens
        token = _next_token(text, pos)
        tokens.append(token)
        pos = token.offset + len(token.text)


def _next_token(text: str, pos: int) -> _Token:
    """The token starting at `pos` (which is not blank)."""
    char = text[pos]
    if char in _PUNCT:
        return _Token(_PUNCT[char], char, char, pos)
    if char in "'\"":
        return _lex_string(text, pos)
    if char == "`":
        return _lex_quoted_name(text, pos)
    for op in _OPERATORS:
        if text.startswith(op, pos):
            return _Token("OP", op, _OP_ALIASES.get(op, op), pos)
    number = _NUMBER_RE.match(text, pos)
    if number:
        return _lex_number(text, pos, number.group())
    ident = _IDENT_RE.match(text, pos)
    if ident:
        word = ident.group()
        if word.lower() in _KEYWORDS:
            return _Token("KW", word, word.lower(), pos)
        return _Token("IDENT", word, word, pos)
    raise QueryError(f"unexpected character {char!r}", text, pos)


def _lex_number(text: str, pos: int, digits: str) -> _Token:
    """A NUMBER token; an int when written without '.' or exponent (kept exact)."""
    tail = _WORD_TAIL_RE.match(text, pos + len(digits))
    if tail:
        raise QueryError(f"malformed number '{digits}{tail.group()}'", text, pos)
    is_int = not any(c in digits for c in ".eE")
    return _Token("NUMBER", digits, int(digits) if is_int else float(digits), pos)


def _lex_string(text: str, start: int) -> _Token:
    """A quoted string; backslash escapes (\\n \\t \\r \\0 \\\\ \\' \\") and a doubled quote
    are decoded. Any other backslash is kept, so `like '50\\%'` escapes the %."""
    quote = text[start]
    out: list[str] = []
    pos = start + 1
    while pos < len(text):
        char = text[pos]
        if char == "\\" and pos + 1 < len(text):
            nxt = text[pos + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            pos += 2
        elif char == quote and text.startswith(quote * 2, pos):
            out.append(quote)
            pos += 2
        elif char == quote:
            return _Token("STRING", text[start : pos + 1], "".join(out), start)
        else:
            out.append(char)
            pos += 1
    raise QueryError(f"unterminated string (no closing {quote})", text, start)


def _lex_quoted_name(text: str, start: int) -> _Token:
    """A backquoted field name; a doubled backquote stands for one backquote."""
    pos = start + 1
    out: list[str] = []
    while pos < len(text):
        if text.startswith("``", pos):
            out.append("`")
            pos += 2
        elif text[pos] == "`":
            return _Token("QIDENT", text[start : pos + 1], "".join(out), start)
        else:
            out.append(text[pos])
            pos += 1
    raise QueryError("unterminated quoted name (no closing `)", text, start)


# --------------------------------------------------------------------------- parser


def _field_list() -> str:
    return ", ".join(sorted(BARE_FIELDS)) + ", " + ", ".join(f"{ns}.<name>" for ns in NAMESPACES)


class _Parser:
    """Recursive descent over the token list; every method leaves `pos` after what it read."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0

    # helpers ---------------------------------------------------------------
    @property
    def tok(self) -> _Token:
        return self.tokens[self.pos]

    def advance(self) -> _Token:
        token = self.tokens[self.pos]
        if token.kind != "EOF":
            self.pos += 1
        return token

    def at_kw(self, *words: str) -> bool:
        return self.tok.kind == "KW" and self.tok.value in words

    def fail(self, message: str, token: _Token | None = None) -> QueryError:
        token = token or self.tok
        return QueryError(message, self.text, token.offset)

    def expect_kw(self, word: str, after: str) -> None:
        if not self.at_kw(word):
            raise self.fail(f"expected '{word}' after '{after}', found {self.tok.describe()}")
        self.advance()

    def expect(self, kind: str, what: str) -> _Token:
        if self.tok.kind != kind:
            raise self.fail(f"expected {what}, found {self.tok.describe()}")
        return self.advance()

    # grammar ---------------------------------------------------------------
    def parse_query(self) -> Query:
        where: Node | None = None
        if self.tok.kind != "EOF" and not self.at_kw("order", "limit"):
            where = self.parse_or()
        if self.tok.kind != "EOF" and not self.at_kw("order", "limit"):
            raise self.fail(f"expected 'and', 'or', 'order by', 'limit' or end of query, found {self.tok.describe()}")
        order_by = self.parse_order_by()
        limit = self.parse_limit()
        if self.tok.kind != "EOF":
            raise self.fail(f"expected end of query, found {self.tok.describe()}")
        return Query(where, order_by, limit, self.text)

    def parse_or(self) -> Node:
        operands = [self.parse_and()]
        while self.at_kw("or"):
            self.advance()
            operands.append(self.parse_and())
        return operands[0] if len(operands) == 1 else Or(tuple(operands))

    def parse_and(self) -> Node:
        operands = [self.parse_not()]
        while self.at_kw("and"):
            self.advance()
            operands.append(self.parse_not())
        return operands[0] if len(operands) == 1 else And(tuple(operands))

    def parse_not(self) -> Node:
        if self.at_kw("not"):
            self.advance()
            return Not(self.parse_not())
        if self.tok.kind == "LPAREN":
            self.advance()
            inner = self.parse_or()
            self.expect("RPAREN", "')'")
            return inner
        if self.tok.kind == "IDENT" and self.tok.value.lower() in LINEAGE_FUNCTIONS:
            return self.parse_lineage()
        if self.tok.kind in ("IDENT", "QIDENT"):
            return self.parse_predicate()
        raise self.fail(f"expected a condition (a field, 'not', '(' or ancestor_of(...)), found {self.tok.describe()}")

    def parse_lineage(self) -> Lineage:
        name = self.advance()
        kind = name.value.lower()
        self.expect("LPAREN", f"'(' after '{name.text}'")
        ref = self.tok
        if ref.kind != "STRING":
            raise self.fail(f"expected a quoted ref inside {kind}(), e.g. {kind}('main'), found {ref.describe()}")
        self.advance()
        self.expect("RPAREN", "')'")
        return Lineage(kind, ref.value, name.offset)

    def parse_predicate(self) -> _Leaf:
        start = self.tok
        name = self.parse_field()
        if self.tok.kind == "OP":
            op = self.advance()
            value = self.parse_value(f"after '{op.text}'", name)
            return Compare(name, op.value, value, start.offset)
        negated = self.at_kw("not")
        if negated:
            self.advance()
            if not self.at_kw("in", "like"):
                raise self.fail(f"expected 'in' or 'like' after 'not', found {self.tok.describe()}")
        if self.at_kw("in"):
            self.advance()
            return InList(name, self.parse_value_list(name), negated, start.offset)
        if self.at_kw("like"):
            self.advance()
            pattern = self.expect("STRING", "a quoted pattern after 'like'")
            return Like(name, pattern.value, negated, start.offset)
        if self.at_kw("is"):
            self.advance()
            is_not = self.at_kw("not")
            if is_not:
                self.advance()
            self.expect_kw("null", "is not" if is_not else "is")
            return IsNull(name, is_not, start.offset)
        raise self.fail(f"expected a comparison operator after '{start.text}', found {self.tok.describe()}")

    def parse_field(self) -> str:
        """The canonical field name of the IDENT/QIDENT at `pos`; raises on unknown bare names."""
        token = self.advance()
        raw: str = token.value
        namespace, dot, rest = raw.partition(".")
        if dot and namespace.lower() in NAMESPACES:
            if not rest:
                raise self.fail(f"expected a name after '{raw}', e.g. {namespace.lower()}.lr", token)
            return f"{namespace.lower()}.{rest}"
        if not dot and raw.lower() in BARE_FIELDS:
            return raw.lower()
        if not dot and raw.lower() in NAMESPACES:
            raise self.fail(f"'{raw}' needs a name: write {raw.lower()}.<name>", token)
        raise self.fail(_unknown_field_message(raw), token)

    def parse_value(self, where: str, field_name: str) -> Value:
        token = self.tok
        if token.kind == "KW" and token.value == "null":
            raise self.fail("null can only be tested with 'is null' or 'is not null'")
        if token.kind == "KW" and token.value in ("true", "false"):
            self.advance()
            return token.value == "true"
        if token.kind == "NUMBER":
            self.advance()
            return _exact_number(token.value)
        if token.kind == "STRING":
            self.advance()
            if field_name == "created":
                return self.created_seconds(token)
            return str(token.value)
        raise self.fail(f"expected a value {where}, found {token.describe()}")

    def parse_value_list(self, field_name: str) -> tuple[Value, ...]:
        self.expect("LPAREN", "'(' after 'in'")
        values = [self.parse_value("in the list", field_name)]
        while self.tok.kind == "COMMA":
            self.advance()
            values.append(self.parse_value("after ','", field_name))
        self.expect("RPAREN", "',' or ')' in the list")
        return tuple(values)

    def created_seconds(self, token: _Token) -> float:
        """A string compared with `created`: a number, or an ISO date/datetime (naive = UTC)."""
        seconds = _parse_number(token.value)
        if seconds is None:
            seconds = _iso_to_unix(token.value)
        if seconds is None:
            raise self.fail(
                f"expected an ISO date like '2026-11-01' or '2026-11-01T10:00:00' for 'created', "
                f"found {token.describe()}", token)
        return seconds

    def parse_order_by(self) -> list[tuple[str, bool]]:
        if not self.at_kw("order"):
            return []
        self.advance()
        self.expect_kw("by", "order")
        keys = [self.parse_sort_key()]
        while self.tok.kind == "COMMA":
            self.advance()
            keys.append(self.parse_sort_key())
        if self.tok.kind != "EOF" and not self.at_kw("limit"):
            raise self.fail(f"expected ',', 'asc', 'desc', 'limit' or end of query, found {self.tok.describe()}")
        return keys

    def parse_sort_key(self) -> tuple[str, bool]:
        token = self.tok
        if token.kind not in ("IDENT", "QIDENT"):
            raise self.fail(f"expected a field to order by, found {token.describe()}")
        name = self.parse_field()
        if name == "tag":
            raise self.fail("cannot order by 'tag': a version can carry several tags", token)
        descending = self.at_kw("desc")
        if self.at_kw("asc", "desc"):
            self.advance()
        return name, descending

    def parse_limit(self) -> int | None:
        if not self.at_kw("limit"):
            return None
        self.advance()
        token = self.tok
        if token.kind != "NUMBER" or not isinstance(token.value, int) or token.value < 0:
            raise self.fail(f"expected a non-negative integer after 'limit', found {token.describe()}")
        self.advance()
        return int(token.value)


def _unknown_field_message(raw: str) -> str:
    """'unknown field ...' with the list of fields and, when one is close, a suggestion."""
    namespace, dot, rest = raw.partition(".")
    if dot:
        close = difflib.get_close_matches(namespace.lower(), NAMESPACES, n=1)
        guess = f"{close[0]}.{rest}" if close else ""
    else:
        close = difflib.get_close_matches(raw.lower(), sorted(BARE_FIELDS), n=1)
        guess = close[0] if close else ""
    hint = f"; did you mean '{guess}'?" if guess else ""
    return f"unknown field '{raw}' (fields: {_field_list()}){hint}"


_NUMERIC_STRING = r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$"
_NUMERIC_STRING_RE = re.compile(_NUMERIC_STRING)


def _parse_number(text: str) -> float | None:
    """`text` as a float if it is a plain decimal number (no nan/inf/blanks), else None.

    The same rule casts string columns, so literals and cells agree."""
    return float(text) if _NUMERIC_STRING_RE.match(text) else None


def _exact_number(value: int | float) -> int | float:
    """Ints that do not fit in int64 become floats, so Arrow can hold them."""
    if isinstance(value, int) and abs(value) > _INT64_MAX:
        return float(value)
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
    numeric = pc.match_substring_regex(strings, _NUMERIC_STRING)
    return pc.cast(pc.if_else(numeric, strings, pa.scalar(None, strings.type)), pa.float64())


def _coerce(values: pa.Array, literal: Value) -> tuple[pa.Array, Value] | None:
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
        number = _parse_number(literal)
        return None if number is None else (values, number)
    if kind == "bool":
        flag = {"true": True, "false": False}.get(literal.lower())
        return None if flag is None else (values, flag)
    return None


def _compare(values: pa.Array, op: str, literal: Value) -> pa.Array:
    """`values op literal` per row under `_coerce` rules; null where either side is null."""
    coerced = _coerce(values, literal)
    if coerced is None:
        return _nulls(len(values))
    column, scalar = coerced
    return _COMPARE_FUNCS[op](column, pa.scalar(scalar))


def _literal_class(literal: Value) -> str:
    if isinstance(literal, bool):
        return "bool"
    return "number" if isinstance(literal, (int, float)) else "string"


def _in_list(values: pa.Array, literals: Sequence[Value]) -> pa.Array:
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


def _is_in(column: pa.Array, scalars: list[Value]) -> pa.Array:
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


def _leaf(node: _Leaf, values: pa.Array) -> pa.Array:
    """One predicate over an array of cells."""
    if isinstance(node, Compare):
        return _compare(values, node.op, node.value)
    if isinstance(node, IsNull):
        return pc.is_valid(values) if node.negated else pc.is_null(values)
    mask = _in_list(values, node.values) if isinstance(node, InList) else _like(values, node.pattern)
    return pc.invert(mask) if node.negated else mask


def _positive(node: _Leaf) -> tuple[_Leaf, bool]:
    """The predicate without its negation, and whether it was negated (for tag lists)."""
    if isinstance(node, Compare) and node.op == "!=":
        return Compare(node.field, "=", node.value, node.offset), True
    if isinstance(node, InList) and node.negated:
        return InList(node.field, node.values, False, node.offset), True
    if isinstance(node, Like) and node.negated:
        return Like(node.field, node.pattern, False, node.offset), True
    return node, False


class _Evaluator:
    """Evaluates a tree to one boolean (nullable) Array per node, caching columns."""

    def __init__(self, table: pa.Table, lineage: LineageFn | None, text: str) -> None:
        self.table = table
        self.rows = table.num_rows
        self.lineage = lineage
        self.text = text
        self.columns: dict[str, pa.Array] = {}
        self.lineage_masks: dict[tuple[str, str], pa.Array] = {}

    def column(self, node: _Leaf | Lineage, name: str) -> pa.Array:
        """Column `name`, checked to be comparable; raises QueryError pointing at `node`."""
        if name not in self.columns:
            array = _column(self.table, name)
            if _kind(array.type) == "other":
                raise QueryError(f"field '{name}' has type {array.type}, which queries cannot compare",
                                 self.text, node.offset)
            self.columns[name] = array
        return self.columns[name]

    def eval(self, node: Node) -> pa.Array:
        if isinstance(node, And):
            return self.fold(pc.and_kleene, node.operands)
        if isinstance(node, Or):
            return self.fold(pc.or_kleene, node.operands)
        if isinstance(node, Not):
            return pc.invert(self.eval(node.operand))
        if isinstance(node, Lineage):
            return self.eval_lineage(node)
        if node.field == "tag":
            return self.eval_tag(node)
        return _leaf(node, self.column(node, node.field))

    def fold(self, combine: Callable[..., Any], operands: tuple[Node, ...]) -> pa.Array:
        result = self.eval(operands[0])
        for operand in operands[1:]:
            result = combine(result, self.eval(operand))
        return result

    def eval_lineage(self, node: Lineage) -> pa.Array:
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

    def eval_tag(self, node: _Leaf) -> pa.Array:
        """Tags are a list per row: a positive predicate holds when any tag satisfies it,
        a negated one when none does; an empty or null list counts as no tags."""
        tags = _column(self.table, "tags")
        if pa.types.is_null(tags.type):
            tags = pa.array([[]] * self.rows, pa.list_(pa.string()))
        if not (pa.types.is_list(tags.type) or pa.types.is_large_list(tags.type)):
            raise QueryError(f"column 'tags' has type {tags.type}, expected a list of strings", self.text, node.offset)
        if isinstance(node, IsNull):
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
