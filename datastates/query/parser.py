"""The query language's lexer and recursive-descent parser (grammar in `language`)."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from ..errors import QueryError
from . import syntax as S


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
        if word.lower() in S._KEYWORDS:
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
    return ", ".join(sorted(S.BARE_FIELDS)) + ", " + ", ".join(f"{ns}.<name>" for ns in S.NAMESPACES)


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
    def parse_query(self) -> tuple[S.Node | None, list[tuple[str, bool]], int | None]:
        """(filter, sort keys, limit) of the whole query."""
        where: S.Node | None = None
        if self.tok.kind != "EOF" and not self.at_kw("order", "limit"):
            where = self.parse_or()
        if self.tok.kind != "EOF" and not self.at_kw("order", "limit"):
            raise self.fail(f"expected 'and', 'or', 'order by', 'limit' or end of query, found {self.tok.describe()}")
        order_by = self.parse_order_by()
        limit = self.parse_limit()
        if self.tok.kind != "EOF":
            raise self.fail(f"expected end of query, found {self.tok.describe()}")
        return where, order_by, limit

    def parse_or(self) -> S.Node:
        operands = [self.parse_and()]
        while self.at_kw("or"):
            self.advance()
            operands.append(self.parse_and())
        return operands[0] if len(operands) == 1 else S.Or(tuple(operands))

    def parse_and(self) -> S.Node:
        operands = [self.parse_not()]
        while self.at_kw("and"):
            self.advance()
            operands.append(self.parse_not())
        return operands[0] if len(operands) == 1 else S.And(tuple(operands))

    def parse_not(self) -> S.Node:
        if self.at_kw("not"):
            self.advance()
            return S.Not(self.parse_not())
        if self.tok.kind == "LPAREN":
            self.advance()
            inner = self.parse_or()
            self.expect("RPAREN", "')'")
            return inner
        if self.tok.kind == "IDENT" and self.tok.value.lower() in S.LINEAGE_FUNCTIONS:
            return self.parse_lineage()
        if self.tok.kind in ("IDENT", "QIDENT"):
            return self.parse_predicate()
        raise self.fail(f"expected a condition (a field, 'not', '(' or ancestor_of(...)), found {self.tok.describe()}")

    def parse_lineage(self) -> S.Lineage:
        name = self.advance()
        kind = name.value.lower()
        self.expect("LPAREN", f"'(' after '{name.text}'")
        ref = self.tok
        if ref.kind != "STRING":
            raise self.fail(f"expected a quoted ref inside {kind}(), e.g. {kind}('main'), found {ref.describe()}")
        self.advance()
        self.expect("RPAREN", "')'")
        return S.Lineage(kind, ref.value, name.offset)

    def parse_predicate(self) -> S._Leaf:
        start = self.tok
        name = self.parse_field()
        if self.tok.kind == "OP":
            op = self.advance()
            value = self.parse_value(f"after '{op.text}'", name)
            return S.Compare(name, op.value, value, start.offset)
        negated = self.at_kw("not")
        if negated:
            self.advance()
            if not self.at_kw("in", "like"):
                raise self.fail(f"expected 'in' or 'like' after 'not', found {self.tok.describe()}")
        if self.at_kw("in"):
            self.advance()
            return S.InList(name, self.parse_value_list(name), negated, start.offset)
        if self.at_kw("like"):
            self.advance()
            pattern = self.expect("STRING", "a quoted pattern after 'like'")
            return S.Like(name, pattern.value, negated, start.offset)
        if self.at_kw("is"):
            self.advance()
            is_not = self.at_kw("not")
            if is_not:
                self.advance()
            self.expect_kw("null", "is not" if is_not else "is")
            return S.IsNull(name, is_not, start.offset)
        raise self.fail(f"expected a comparison operator after '{start.text}', found {self.tok.describe()}")

    def parse_field(self) -> str:
        """The canonical field name of the IDENT/QIDENT at `pos`; raises on unknown bare names."""
        token = self.advance()
        raw: str = token.value
        namespace, dot, rest = raw.partition(".")
        if dot and namespace.lower() in S.NAMESPACES:
            if not rest:
                raise self.fail(f"expected a name after '{raw}', e.g. {namespace.lower()}.lr", token)
            return f"{namespace.lower()}.{rest}"
        if not dot and raw.lower() in S.BARE_FIELDS:
            return raw.lower()
        if not dot and raw.lower() in S.NAMESPACES:
            raise self.fail(f"'{raw}' needs a name: write {raw.lower()}.<name>", token)
        raise self.fail(_unknown_field_message(raw), token)

    def parse_value(self, where: str, field_name: str) -> S.Value:
        token = self.tok
        if token.kind == "KW" and token.value == "null":
            raise self.fail("null can only be tested with 'is null' or 'is not null'")
        if token.kind == "KW" and token.value in ("true", "false"):
            self.advance()
            return token.value == "true"
        if token.kind == "NUMBER":
            self.advance()
            return S._exact_number(token.value)
        if token.kind == "STRING":
            self.advance()
            if field_name == "created":
                return self.created_seconds(token)
            return str(token.value)
        raise self.fail(f"expected a value {where}, found {token.describe()}")

    def parse_value_list(self, field_name: str) -> tuple[S.Value, ...]:
        self.expect("LPAREN", "'(' after 'in'")
        values = [self.parse_value("in the list", field_name)]
        while self.tok.kind == "COMMA":
            self.advance()
            values.append(self.parse_value("after ','", field_name))
        self.expect("RPAREN", "',' or ')' in the list")
        return tuple(values)

    def created_seconds(self, token: _Token) -> float:
        """A string compared with `created`: a number, or an ISO date/datetime (naive = UTC)."""
        seconds = S._parse_number(token.value)
        if seconds is None:
            seconds = S._iso_to_unix(token.value)
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
        close = difflib.get_close_matches(namespace.lower(), S.NAMESPACES, n=1)
        guess = f"{close[0]}.{rest}" if close else ""
    else:
        close = difflib.get_close_matches(raw.lower(), sorted(S.BARE_FIELDS), n=1)
        guess = close[0] if close else ""
    hint = f"; did you mean '{guess}'?" if guess else ""
    return f"unknown field '{raw}' (fields: {_field_list()}){hint}"


