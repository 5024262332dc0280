"""The query face of the Store facade: lineage walks, the versions table, find, diff and history.

`Store` inherits it; every method works on `self.repo` (a Repository) through the functions of
this subpackage, so the REST server and notebooks get the same answers from the same code.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError
from ..meta.versions import Version
from ..repo.repository import Repository
from . import table
from .compare import diff, history, history_values
from .lineage import ancestors, descendants, merge_base, paths
from .table import find


def check_limit(limit: Any) -> None:
    """InvalidArgumentError unless `limit` is None or a count of versions (0 or more): a negative one sliced
    silently, limit=-1 giving every version but the root (a review)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidArgumentError(f"limit={limit!r} must be a number of versions, 0 or more (None: all)")


class Queries:
    """Read-only questions about versions (mixed into `Store`)."""

    repo: Repository
    _table: tuple[Any, Any] | None = None

    def log(self, ref: Any = "main", *, first_parent: bool = False, limit: int | None = None) -> list[Version]:
        """`ref` and its ancestors, newest first (like `git log`). The walk ends at a parent this node's catalog
        lacks, as `git log` ends at a shallow clone's boundary: one the flush policy kept off the cold tier, or a
        record lost (`fsck` says which); `graph.absent_parents(id)` names them. `limit`: at most that many (0 or
        more). Raises NotFoundError for `ref`, InvalidArgumentError for a limit that is not one."""
        check_limit(limit)
        start = self.repo.resolve(ref)
        ids = [start] + ancestors(self.repo.graph, start, first_parent=first_parent)
        if limit is not None:
            ids = ids[:limit]
        return [self.repo.version(v) for v in ids]

    def ancestors(self, ref: Any, *, depth: int | None = None, first_parent: bool = False) -> list[str]:
        """Ids of the versions `ref` descends from, newest first (without `ref` itself)."""
        return ancestors(self.repo.graph, self.repo.resolve(ref), depth=depth, first_parent=first_parent)

    def descendants(self, ref: Any, *, depth: int | None = None) -> list[str]:
        """Ids of the versions grown from `ref`, across branches, oldest first."""
        return descendants(self.repo.graph, self.repo.resolve(ref), depth=depth)

    def merge_base(self, a: Any, b: Any) -> str | None:
        """The nearest common ancestor of two versions (None if they share none)."""
        return merge_base(self.repo.graph, self.repo.resolve(a), self.repo.resolve(b))

    def paths(self, src: Any, dst: Any, *, limit: int = 100) -> list[list[str]]:
        """The lineage paths from `src` down to `dst` (lists of ids)."""
        return paths(self.repo.graph, self.repo.resolve(src), self.repo.resolve(dst), limit=limit)

    def versions_table(self) -> Any:
        """Every version as a pyarrow Table: fixed fields plus hparams.*, metrics.*, annotations.* columns.
        Raises StoreClosedError."""
        self.repo.check_readable()
        key = (self.repo.catalog.generation(), tuple(sorted(self.repo.tags().items())))
        if self._table is None or self._table[0] != key:
            self._table = (key, table.build(self.repo))
        return self._table[1]

    def find(self, query: str = "", *, as_table: bool = False, allow_missing: bool = False) -> Any:
        """Versions matching a query such as "hparams.lr > 1e-3 and metrics.loss < 0.5 order by step".

        Returns Versions (or the matching rows as a pyarrow Table). Raises QueryError with the offset,
        also for a field no version has (a typo: the message lists close matches) unless
        `allow_missing`, which reads such a field as null; InvalidArgumentError for a query that is no string.
        """
        if not isinstance(query, str):
            raise InvalidArgumentError(f"query must be a string such as \"metrics.loss < 0.5\" (\"\" for every "
                                       f"version), not {type(query).__name__}")
        rows = find(self.repo, self.versions_table(), query, allow_missing=allow_missing)
        if as_table:
            return rows
        return [self.repo.version(v) for v in rows.column("id").to_pylist()]

    def diff(self, a: Any, b: Any, *, keys: list[str] | None = None) -> Any:
        """A pyarrow Table, one row per tensor key; see `datastates.query.compare.diff`."""
        return diff(self.repo, a, b, keys)

    def history(self, key: str, ref: Any = "main", *, values: bool = False) -> Any:
        """A tensor's stats across the first-parent chain of `ref` (Table), or with values=True
        an iterator of (Version, tensor) loading one at a time."""
        return history_values(self.repo, key, ref) if values else history(self.repo, key, ref)
