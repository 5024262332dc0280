"""Walks over the version DAG: ancestors, descendants, merge bases, paths, `REF~N`.

Every walk reads the graph only through the `Graph` accessors (a `DictGraph` through
its dicts), visits only the versions it reaches (never the whole store), and is
iterative: depth of history is bounded by memory, never by Python's recursion
limit. Walks terminate even on a (corrupt) cyclic graph: each version is visited once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from ..errors import ConflictError, InvalidArgumentError, NotFoundError

__all__ = [
    "DictGraph", "Graph", "ancestors", "descendants", "first_parent_chain", "is_ancestor", "merge_base",
    "merge_bases", "paths",
]


class Graph(Protocol):
    """Read access to the version DAG; the first parent is the main line."""

    def parents(self, vid: str) -> Sequence[str]: ...

    def children(self, vid: str) -> Sequence[str]: ...

    def created(self, vid: str) -> float: ...


class DictGraph:
    """An in-memory `Graph`, built from `{vid: (parents, created)}` in any order.

    Raises NotFoundError if a parent is not in the graph, ConflictError on a duplicate id.
    """

    def __init__(self, nodes: Mapping[str, tuple[Sequence[str], float]] | None = None) -> None:
        self._parents: dict[str, tuple[str, ...]] = {}
        self._created: dict[str, float] = {}
        self._children: dict[str, list[str]] = {}
        if nodes:
            # Insert all ids first so the mapping need not be in topological order.
            for vid, (parents, created) in nodes.items():
                self._parents[vid] = tuple(parents)
                self._created[vid] = float(created)
                self._children[vid] = []
            for vid, parents in self._parents.items():
                self._link(vid, parents)

    def add(self, vid: str, parents: Sequence[str] = (), created: float = 0.0) -> None:
        """Add a version whose parents are already in the graph.

        Raises ConflictError if `vid` exists, NotFoundError if a parent does not.
        """
        if vid in self._parents:
            raise ConflictError(f"version {vid[:12]} is already in the graph")
        ps = tuple(parents)
        for p in ps:
            if p not in self._parents:
                raise NotFoundError(f"parent {p} of version {vid[:12]} is not in the graph; add it first")
        self._parents[vid] = ps
        self._created[vid] = float(created)
        self._children[vid] = []
        self._link(vid, ps)

    def _link(self, vid: str, parents: Sequence[str]) -> None:
        for p in dict.fromkeys(parents):  # a repeated parent is still one child edge
            kids = self._children.get(p)
            if kids is None:
                raise NotFoundError(f"parent {p} of version {vid[:12]} is not in the graph")
            kids.append(vid)

    def __contains__(self, vid: object) -> bool:
        return vid in self._parents

    def __len__(self) -> int:
        return len(self._parents)

    def _missing(self, vid: str) -> NotFoundError:
        return NotFoundError(f"version {vid} is not in the graph")

    def parents(self, vid: str) -> Sequence[str]:
        """The parent ids, first parent first. Raises NotFoundError for an unknown id."""
        try:
            return self._parents[vid]
        except KeyError:
            raise self._missing(vid) from None

    def children(self, vid: str) -> Sequence[str]:
        """The child ids in the order they were added. Raises NotFoundError for an unknown id."""
        try:
            return self._children[vid]
        except KeyError:
            raise self._missing(vid) from None

    def created(self, vid: str) -> float:
        """The creation time. Raises NotFoundError for an unknown id."""
        try:
            return self._created[vid]
        except KeyError:
            raise self._missing(vid) from None


def _check_depth(depth: int | None) -> None:
    if depth is not None and depth < 0:
        raise InvalidArgumentError(f"depth must be >= 0 or None, not {depth}")


Step = Callable[[str], Sequence[str]]


def _lookups(g: Graph, *known: str) -> tuple[Step, Step, Callable[[str], float]]:
    """`g`'s (parents, children, created), after checking that the `known` ids exist.

    Raises NotFoundError for an unknown id in `known`.
    """
    for vid in known:
        g.created(vid)
    if type(g) is DictGraph:
        # A DictGraph is closed under its edges, so once the start ids are checked the raw dict
        # lookups cannot miss, and they cost no Python frame per step.
        return g._parents.__getitem__, g._children.__getitem__, g._created.__getitem__
    return g.parents, g.children, g.created


def _reach(step: Step, start: str, depth: int | None) -> list[str]:
    """Versions reachable from `start` through `step` (start excluded), each once, breadth-first."""
    seen = {start}
    out = [start]
    mark, emit = seen.add, out.append
    if depth is None:
        # Iterating a list while appending to it visits the appended items too: the list is the
        # queue, so the walk allocates nothing per step beyond the result and the seen set.
        for v in out:
            for n in step(v):
                if n not in seen:
                    mark(n)
                    emit(n)
    elif depth > 0:
        # Still one queue, cut into levels, so `depth` bounds the shortest edge distance.
        level, level_end = 0, 1
        for i, v in enumerate(out):
            if i == level_end:
                level += 1
                if level == depth:
                    break
                level_end = len(out)
            for n in step(v):
                if n not in seen:
                    mark(n)
                    emit(n)
    del out[0]
    return out


def _first_parents(parents: Step, start: str, limit: int | None) -> list[str]:
    """The first-parent chain below `start` (start excluded), at most `limit` long."""
    out: list[str] = []
    seen = {start}
    v = start
    while limit is None or len(out) < limit:
        ps = parents(v)
        if not ps:
            break
        v = ps[0]
        if v in seen:  # a cycle can only come from a corrupt graph; stop rather than loop forever
            break
        seen.add(v)
        out.append(v)
    return out


def ancestors(g: Graph, start: str, *, depth: int | None = None, first_parent: bool = False,
              include_start: bool = False) -> list[str]:
    """Every version reachable through parents, newest `created` first (ties by id), each once.

    `depth` bounds the parent edges followed; `first_parent` gives the main line in chain order.
    With `include_start`, `start` comes first. Cost O(k log k) in the k versions reached.
    Raises NotFoundError (unknown `start`), ValueError (negative depth).
    """
    _check_depth(depth)
    parents, _, created = _lookups(g, start)
    if first_parent:
        out = _first_parents(parents, start, depth)
    else:
        out = _reach(parents, start, depth)
        # Collect then sort instead of git's date-ordered heap walk: a heap emits in date order only
        # when every parent is older than its child, and clocks skew; sorting costs the same O(k log k).
        out.sort()
        out.sort(key=created, reverse=True)  # stable, so equal times stay in id order
    if include_start:
        out.insert(0, start)
    return out


def descendants(g: Graph, start: str, *, depth: int | None = None, include_start: bool = False) -> list[str]:
    """Every version reachable through children, oldest `created` first (ties by id), each once.

    `depth` bounds the child edges followed; with `include_start`, `start` comes first.
    Raises NotFoundError (unknown `start`), ValueError (negative depth).
    """
    _check_depth(depth)
    _, children, created = _lookups(g, start)
    out = _reach(children, start, depth)
    out.sort()
    out.sort(key=created)
    if include_start:
        out.insert(0, start)
    return out


def _upward(parents: Step, start: str) -> Iterator[str]:
    """`start`, then each of its ancestors once, breadth first (lazily: callers may stop early)."""
    seen = {start}
    queue = [start]
    mark, emit = seen.add, queue.append
    for v in queue:
        yield v
        for p in parents(v):
            if p not in seen:
                mark(p)
                emit(p)


def _closure(parents: Step, start: str) -> set[str]:
    """`start` and all its ancestors, as a set."""
    return set(_upward(parents, start))


def is_ancestor(g: Graph, a: str, b: str) -> bool:
    """True if `a` is `b` or an ancestor of `b`; stops as soon as `a` is found.

    Raises NotFoundError if either id is unknown.
    """
    parents, _, _ = _lookups(g, a, b)
    return any(v == a for v in _upward(parents, b))


def merge_bases(g: Graph, a: str, b: str) -> list[str]:
    """All best common ancestors of `a` and `b` (each counts as its own ancestor), newest first, ties by id.

    Best: not an ancestor of another common ancestor. Empty if the histories are disjoint.
    Raises NotFoundError if either id is unknown.
    """
    parents, _, created = _lookups(g, a, b)
    common = _closure(parents, a)
    common &= _closure(parents, b)
    # Every ancestor of a common ancestor is common too, so the common ancestors that are
    # ancestors of another one are exactly the parents of common ancestors.
    beaten = {p for c in common for p in parents(c)}
    best = sorted(common - beaten)
    best.sort(key=created, reverse=True)
    return best


def merge_base(g: Graph, a: str, b: str) -> str | None:
    """The nearest common ancestor (the newest of `merge_bases`), or None if there is none.

    Raises NotFoundError if either id is unknown.
    """
    best = merge_bases(g, a, b)
    return best[0] if best else None


def paths(g: Graph, src: str, dst: str, *, limit: int = 100) -> list[list[str]]:
    """Up to `limit` simple paths from `src` down to `dst` along child edges (src first, dst last).

    Empty if `dst` is not a descendant of `src`. Only versions that reach `dst` are explored, so
    every branch of the search ends in a path. Raises NotFoundError if either id is unknown.
    """
    parents, children, _ = _lookups(g, src, dst)
    if limit <= 0:
        return []
    if src == dst:
        return [[src]]
    useful = _closure(parents, dst)
    if src not in useful:
        return []
    out: list[list[str]] = []
    path = [src]
    on_path = {src}
    stack: list[Iterator[str]] = [iter([c for c in children(src) if c in useful])]
    while stack:
        nxt = next(stack[-1], None)
        if nxt is None:
            stack.pop()
            on_path.discard(path.pop())
            continue
        if nxt in on_path:
            continue
        if nxt == dst:
            out.append([*path, dst])
            if len(out) >= limit:
                break
            continue
        path.append(nxt)
        on_path.add(nxt)
        stack.append(iter([c for c in children(nxt) if c in useful]))
    return out


def first_parent_chain(g: Graph, start: str, n: int, label: str | None = None) -> str:
    """The version `n` first-parent steps below `start` (git's `REF~N`); n=0 is `start`.

    Raises NotFoundError if the chain is shorter (message names `label`, default the short id),
    ValueError if n < 0.
    """
    if n < 0:
        raise InvalidArgumentError(f"~{n}: the number of steps must be >= 0")
    parents, _, _ = _lookups(g, start)
    chain = _first_parents(parents, start, n)
    if len(chain) < n:
        name = label if label is not None else start[:12]
        raise NotFoundError(f"{name}~{n} goes past the root: the chain has only {len(chain) + 1} versions")
    return chain[-1] if chain else start
