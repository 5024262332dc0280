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

    def _node(self, vid: str) -> tuple[tuple[str, ...], float]:
        node = self._nodes.get(vid)
        if node is None:
            node = self.catalog.node(vid)
        if node is None:
            data = self.catalog.record(vid)
            if data is None:
                raise NotFoundError(f"version {vid[:12]} is not in the catalog (a parent whose record is lost, or "
                                    "one not indexed yet); `datastates fsck` says which, and `datastates fsck "
                                    "--repair` indexes a record file that is there")
            rec = json.loads(data)
            node = (tuple(rec.get("parents", ())), float(rec.get("created", 0.0)))
        self._nodes[vid] = node
        return node

    def parents(self, vid: str) -> Sequence[str]:
        return self._node(vid)[0]

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
    # Another ref's line may lead to a version this catalog lacks; it must not fail a move of an unrelated branch.
    try:
        return graph.parents(vid)
    except NotFoundError:
        return ()
