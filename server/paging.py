"""Cursor pagination: opaque page tokens and the keyset walk over the versions table.

A token is urlsafe base64 of a small JSON object. For the versions list it
holds the last row's (sort key, id) and a digest of the query it belongs to:
the next page is "rows strictly after that key in (key, id) order", so rows
added later never shift rows already walked (no duplicates, no skips among
versions that existed when the walk began). Lists that are fixed for a version
(ancestors, tensors, diff rows, a history) hold the resolved version id and an
offset, so a branch that moves between two pages does not mix two lists.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

import datastates as ds

T = TypeVar("T")

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100


def encode_token(data: dict[str, Any]) -> str:
    raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


SCALAR = (str, int, float, bool, type(None))
"""What a sort key in a versions token may be (a column's value, a bool column's too; never a list or an
object)."""


def decode_token(token: str, kind: str, **fields: type | tuple[type, ...]) -> dict[str, Any]:
    """The fields of a token made by `encode_token` for list `kind`, each of `fields` present with its type
    (a bool is no int here). Tokens carry no secret, so whatever a client sends is checked before use.

    Raises InvalidArgumentError for a token that is not ours (mangled, from another list, a field missing
    or of another type)."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict) or data.get("k") != kind:
        raise ds.InvalidArgumentError(
            f"page_token {token[:40]!r} is not a token of this list; pass the next_page_token of the previous "
            "page unchanged, or omit it to start at the first page")
    for name, types in fields.items():
        value = data.get(name, ...)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            raise ds.InvalidArgumentError(f"page_token {token[:40]!r} is damaged ({name!r} is missing or of the "
                                          "wrong type); omit it to start at the first page")
    return data


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def pinned(page_token: str | None, kind: str, *query: Any) -> tuple[str, int] | None:
    """(version id, offset) from the token of a list fixed by a version (ancestors, tensors, a diff, a
    history), or None without a token: the token pins the id its first page resolved, and is bound to the
    query (`query`: the ref as given and the other parameters), so a token of one ref's list is refused
    on another's. Raises InvalidArgumentError."""
    if not page_token:
        return None
    tok = decode_token(page_token, kind, q=str, v=str, o=int)
    if tok["q"] != digest(*query):
        raise ds.InvalidArgumentError(f"page_token belongs to another {kind} query; repeat the same "
                                      "parameters, or omit page_token")
    return tok["v"], tok["o"]


def pinned_token(kind: str, vid: str, offset: int | None, *query: Any, **more: Any) -> str | None:
    """The next page's token for `pinned` (None at the end of the list)."""
    if offset is None:
        return None
    return encode_token({"k": kind, "q": digest(*query), "v": vid, "o": offset, **more})


def digest(*parts: Any) -> str:
    """A short digest binding a token to the query it was made for."""
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=6).hexdigest()


# ----------------------------------------------------------------------------- keyset over a table


def parse_order(order_by: str | None, table: pa.Table) -> tuple[str, bool]:
    """(column, descending) from 'step', '-step', 'step desc', 'metrics.loss asc'. Default: newest first.

    Raises InvalidArgumentError for a column that holds lists (tags) or is not a field."""
    if not order_by or not order_by.strip():
        return "created", True
    text = order_by.strip()
    desc = False
    if text.startswith("-"):
        text, desc = text[1:].strip(), True
    words = text.split()
    if len(words) == 2 and words[1].lower() in ("asc", "desc"):
        text, desc = words[0], words[1].lower() == "desc"
    elif len(words) != 1:
        raise ds.InvalidArgumentError(
            f"order_by {order_by!r} is not 'FIELD', '-FIELD' or 'FIELD asc|desc'; e.g. order_by=-metrics.loss")
    name = "tags" if text == "tag" else text
    if name in table.column_names:
        if pa.types.is_list(table.schema.field(name).type):
            raise ds.InvalidArgumentError(f"order_by {text!r} is a list field and cannot be sorted; pick another")
        return name, desc
    if name.split(".", 1)[0] in ("hparams", "metrics", "annotations", "explore") and "." in name:
        return name, desc  # a field no version has yet: all null, so the order is by id
    fields = sorted(c for c in table.column_names if c != "tags")
    raise ds.InvalidArgumentError(f"order_by {text!r} is not a field; fields: {', '.join(fields[:40])}")


def _key_of(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def keyset_page(table: pa.Table, column: str, desc: bool, after: tuple[Any, str] | None,
                limit: int) -> tuple[list[str], tuple[Any, str] | None]:
    """Ids of the next `limit` rows in (column, id) order after `after`; nulls sort last either way, and rows of
    one key (ties, nulls) go by id ascending in either direction: `Store.find`'s order, a stable sort of rows
    read in id order, which `RemoteStore.find` must give too.

    Returns (ids, key of the last row when more rows follow, else None).
    """
    n = table.num_rows
    ids = table.column("id")
    keys = table.column(column) if column in table.column_names else pa.nulls(n)
    if pa.types.is_floating(keys.type):
        keys = pc.if_else(pc.is_nan(keys), pa.scalar(None, keys.type), keys)
    if after is not None:
        k, last = after
        id_after = pc.greater(ids, pa.scalar(last))
        if k is None:
            mask = pc.and_(pc.is_null(keys), id_after)
        else:
            try:
                ks = pa.scalar(k)
                beyond = pc.less(keys, ks) if desc else pc.greater(keys, ks)
                equal = pc.equal(keys, ks)
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
                raise ds.InvalidArgumentError("page_token does not match the order_by column's type; "
                                              "start again without page_token") from None
            mask = pc.or_kleene(pc.or_kleene(beyond, pc.and_kleene(equal, id_after)), pc.is_null(keys))
            mask = pc.fill_null(mask, False)
        table = table.filter(mask)
        ids, keys = table.column("id"), (table.column(column) if column in table.column_names
                                         else pa.nulls(table.num_rows))
        if pa.types.is_floating(keys.type):
            keys = pc.if_else(pc.is_nan(keys), pa.scalar(None, keys.type), keys)
    order = "descending" if desc else "ascending"
    sort = pa.table({"k": keys, "id": ids})
    try:  # pyarrow >= 21 takes the null placement per key (the global option is deprecated)
        idx = pc.sort_indices(sort, sort_keys=[("k", order, "at_end"), ("id", "ascending", "at_end")])
    except (TypeError, ValueError, pa.ArrowInvalid):
        idx = pc.sort_indices(sort, sort_keys=[("k", order), ("id", "ascending")], null_placement="at_end")
    idx = idx.slice(0, limit + 1)
    page = sort.take(idx)
    out_ids = page.column("id").to_pylist()
    if len(out_ids) <= limit:
        return out_ids, None
    out_keys = page.column("k").to_pylist()
    return out_ids[:limit], (_key_of(out_keys[limit - 1]), out_ids[limit - 1])


# ----------------------------------------------------------------------------- offset over a fixed list


def offset_page(items: Sequence[T], start: int, limit: int) -> tuple[list[T], int | None]:
    """items[start:start+limit] and the next offset (None at the end)."""
    if start < 0 or start > len(items):
        raise ds.InvalidArgumentError("page_token points past the end of this list; start again without it")
    end = start + limit
    return list(items[start:end]), (end if end < len(items) else None)
