"""The version DAG as seen through the catalog, for the walks in `lineage`.

Records are immutable, so parents and creation times are cached per process
forever; children are read from the catalog each time (new versions appear).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from ..errors import NotFoundError
from .catalog import Catalog

_CACHE: dict[str, dict[str, tuple[tuple[str, ...], float]]] = {}


class CatalogGraph:
    """`lineage.Graph` over an LMDB catalog."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._nodes = _CACHE.setdefault(str(catalog.path), {})

    def _lookup(self, vid: str) -> tuple[tuple[str, ...], float] | None:
        node = self._nodes.get(vid)
        if node is None:
            node = self.catalog.node(vid)
        if node is None:
            data = self.catalog.record(vid)
            if data is None:
                return None  # not cached: a refresh or a repair may index it later
            rec = json.loads(data)
            node = (tuple(rec.get("parents", ())), float(rec.get("created", 0.0)))
        self._nodes[vid] = node
        return node

    def _node(self, vid: str) -> tuple[tuple[str, ...], float]:
        node = self._lookup(vid)
        if node is None:
            raise missing_version(vid)
        return node

    def has(self, vid: str) -> bool:
        """Whether this catalog holds version `vid`."""
        return self._lookup(vid) is not None

    def absent_parents(self, vid: str) -> list[str]:
        """The parents `vid`'s record names that this catalog lacks (where `parents` ends a walk)."""
        return [p for p in self._node(vid)[0] if not self.has(p)]

    def parents(self, vid: str) -> Sequence[str]:
        """The parents of `vid` that this catalog holds: a walk ends at one it lacks, as `git log` ends at a shallow
        clone's boundary (the flush policy keeps versions off cold, so a node opened from cold may never see them;
        `fsck` tells those from lost records). Raises NotFoundError when `vid` itself is not here."""
        ps = self._node(vid)[0]
        return ps if all(self.has(p) for p in ps) else tuple(p for p in ps if self.has(p))

    def created(self, vid: str) -> float:
        return self._node(vid)[1]

    def children(self, vid: str) -> Sequence[str]:
        return self.catalog.children(vid)


def unreached(graph: CatalogGraph, start: str, roots: Iterable[str]) -> int:
    """How many versions are `start` or its ancestors, and neither one of `roots` nor an ancestor of one: what
    a ref at `start` alone keeps reachable by name, once it is deleted or moved (with `roots` the heads that
    stay). A version the catalog lacks (a parent another host never flushed, a record fsck set aside) ends its
    walk there: it has no parents to follow, and the versions past it are not counted."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:  # everything the roots reach
        v = stack.pop()
        if v not in seen:
            seen.add(v)
            stack.extend(_known_parents(graph, v))
    lost: set[str] = set()
    stack = [start]
    while stack:
        v = stack.pop()
        if v not in seen and v not in lost:
            lost.add(v)
            stack.extend(_known_parents(graph, v))
    return len(lost)


def _known_parents(graph: CatalogGraph, vid: str) -> Sequence[str]:
    # A ref may name a version this catalog lacks (another host's, never flushed): it must not fail a move of an
    # unrelated branch.
    try:
        return graph.parents(vid)
    except NotFoundError:
        return ()


def missing_version(vid: str) -> NotFoundError:
    """The error for a version id this catalog lacks (a ref or a record names it). The whole id: a short one may be
    the prefix of a version that does exist (`datastates show` would find that one)."""
    return NotFoundError(f"version {vid} is not in this node's catalog: a parent the flush policy kept off the "
                         "cold tier (it is on the hot tier of the node that saved it), a record lost, or one not "
                         "indexed yet; `datastates fsck` says which, and `datastates fsck --repair` indexes a "
                         "record file that is there")
