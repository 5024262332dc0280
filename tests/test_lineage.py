"""Graph walks in datastates.lineage, checked against brute-force oracles on random DAGs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import datastates as ds
from datastates.errors import ConflictError, NotFoundError
from datastates.meta import graph
from datastates.query.lineage import (
    DictGraph,
    ancestors,
    descendants,
    first_parent_chain,
    is_ancestor,
    merge_base,
    merge_bases,
    paths,
)

Nodes = dict[str, tuple[list[str], float]]


@st.composite
def dags(draw: st.DrawFn, max_size: int = 24) -> Nodes:
    """Versions generated in order, each with 0-3 distinct earlier parents and a small (tie-prone) time.

    Ids are a random permutation so id order says nothing about creation order, and times are
    random so a parent can be newer than its child (clock skew).
    """
    n = draw(st.integers(1, max_size))
    names = [f"v{i:02d}" for i in draw(st.permutations(range(n)))]
    nodes: Nodes = {}
    for i, vid in enumerate(names):
        k = draw(st.integers(0, min(3, i)))
        parents = draw(st.lists(st.sampled_from(names[:i]), min_size=k, max_size=k, unique=True)) if k else []
        nodes[vid] = (parents, float(draw(st.integers(0, 5))))
    return nodes


def build(nodes: Nodes) -> DictGraph:
    g = DictGraph()
    for vid, (parents, created) in nodes.items():
        g.add(vid, parents, created)
    return g


def oracle_ancestors(nodes: Nodes) -> dict[str, set[str]]:
    """Proper ancestors of every version: transitive closure by iterating to a fixpoint."""
    anc = {v: set(ps) for v, (ps, _) in nodes.items()}
    changed = True
    while changed:
        changed = False
        for v in anc:
            new: set[str] = set()
            for p in list(anc[v]):
                new |= anc[p]
            if not new <= anc[v]:
                anc[v] |= new
                changed = True
    return anc


def oracle_descendants(nodes: Nodes) -> dict[str, set[str]]:
    anc = oracle_ancestors(nodes)
    return {v: {w for w in nodes if v in anc[w]} for v in nodes}


def oracle_levels(nodes: Nodes, start: str, depth: int, down: bool = False) -> set[str]:
    """Versions at most `depth` edges away, by BFS levels."""
    step = {v: set() for v in nodes} if down else {v: set(ps) for v, (ps, _) in nodes.items()}
    if down:
        for v, (ps, _) in nodes.items():
            for p in ps:
                step[p].add(v)
    reached: set[str] = set()
    level = {start}
    for _ in range(depth):
        level = {n for v in level for n in step[v]}
        reached |= level
    return reached - {start}


def oracle_first_parents(nodes: Nodes, start: str) -> list[str]:
    out = []
    v = start
    while nodes[v][0]:
        v = nodes[v][0][0]
        out.append(v)
    return out


def oracle_paths(nodes: Nodes, src: str, dst: str) -> set[tuple[str, ...]]:
    kids: dict[str, list[str]] = {v: [] for v in nodes}
    for v, (ps, _) in nodes.items():
        for p in ps:
            kids[p].append(v)
    found: set[tuple[str, ...]] = set()

    def dfs(path: list[str]) -> None:
        if path[-1] == dst:
            found.add(tuple(path))
            return
        for c in kids[path[-1]]:
            dfs([*path, c])

    dfs([src])
    return found


def newest_first(nodes: Nodes, ids: set[str]) -> list[str]:
    return sorted(ids, key=lambda v: (-nodes[v][1], v))


def oldest_first(nodes: Nodes, ids: set[str]) -> list[str]:
    return sorted(ids, key=lambda v: (nodes[v][1], v))


def non_increasing(nodes: Nodes, ids: Sequence[str]) -> bool:
    return all(nodes[x][1] >= nodes[y][1] for x, y in zip(ids, ids[1:]))


# random DAGs against oracles ----------------------------------------------------------


@given(dags())
def test_ancestors_match_closure(nodes: Nodes) -> None:
    g = build(nodes)
    anc = oracle_ancestors(nodes)
    for v in nodes:
        got = ancestors(g, v)
        assert set(got) == anc[v]
        assert len(got) == len(anc[v])
        assert non_increasing(nodes, got)
        assert got == newest_first(nodes, anc[v])
        assert ancestors(g, v, include_start=True) == [v, *got]


@given(dags(), st.integers(0, 4))
def test_ancestors_depth_match_bfs_levels(nodes: Nodes, depth: int) -> None:
    g = build(nodes)
    for v in nodes:
        want = oracle_levels(nodes, v, depth)
        assert ancestors(g, v, depth=depth) == newest_first(nodes, want)


@given(dags(), st.one_of(st.none(), st.integers(0, 5)))
def test_first_parent_ancestors_and_chain(nodes: Nodes, depth: int | None) -> None:
    g = build(nodes)
    for v in nodes:
        chain = oracle_first_parents(nodes, v)
        want = chain if depth is None else chain[:depth]
        assert ancestors(g, v, first_parent=True, depth=depth) == want
        assert ancestors(g, v, first_parent=True, depth=depth, include_start=True) == [v, *want]
        for n in range(len(chain) + 1):
            assert first_parent_chain(g, v, n) == ([v, *chain])[n]
        with pytest.raises(NotFoundError):
            first_parent_chain(g, v, len(chain) + 1)


@given(dags(), st.one_of(st.none(), st.integers(0, 4)))
def test_descendants_match_closure(nodes: Nodes, depth: int | None) -> None:
    g = build(nodes)
    desc = oracle_descendants(nodes)
    for v in nodes:
        want = desc[v] if depth is None else oracle_levels(nodes, v, depth, down=True)
        got = descendants(g, v, depth=depth)
        assert got == oldest_first(nodes, want)
        assert descendants(g, v, depth=depth, include_start=True) == [v, *got]


@given(dags())
def test_is_ancestor_matches_closure(nodes: Nodes) -> None:
    g = build(nodes)
    anc = oracle_ancestors(nodes)
    for a in nodes:
        for b in nodes:
            assert is_ancestor(g, a, b) == (a == b or a in anc[b])


@given(dags())
@settings(max_examples=150)
def test_merge_bases_match_oracle(nodes: Nodes) -> None:
    g = build(nodes)
    anc = oracle_ancestors(nodes)
    incl = {v: anc[v] | {v} for v in nodes}
    for a in nodes:
        for b in nodes:
            common = incl[a] & incl[b]
            best = {c for c in common if not any(c in anc[d] for d in common)}
            got = merge_bases(g, a, b)
            assert got == newest_first(nodes, best)
            assert merge_base(g, a, b) == (got[0] if got else None)
            if a in incl[b]:
                assert merge_base(g, a, b) == a
                assert merge_base(g, b, a) == a


@given(dags(max_size=12), st.integers(1, 6))
def test_paths_match_dfs_enumeration(nodes: Nodes, limit: int) -> None:
    g = build(nodes)
    for src in nodes:
        for dst in nodes:
            want = oracle_paths(nodes, src, dst)
            got = paths(g, src, dst, limit=1000)
            assert len(got) == len(want)
            assert {tuple(p) for p in got} == want
            some = paths(g, src, dst, limit=limit)
            assert len(some) == min(limit, len(want))
            assert len({tuple(p) for p in some}) == len(some)
            assert {tuple(p) for p in some} <= want


# fixed shapes -------------------------------------------------------------------------


def test_deep_chain_has_no_recursion_limit() -> None:
    n = 10_000
    g = DictGraph()
    for i in range(n):
        g.add(f"c{i:05d}", [f"c{i - 1:05d}"] if i else [], float(i))
    tip, root = f"c{n - 1:05d}", "c00000"
    got = ancestors(g, tip)
    assert len(got) == n - 1
    assert got[0] == f"c{n - 2:05d}" and got[-1] == root
    assert len(ancestors(g, tip, first_parent=True)) == n - 1
    assert len(ancestors(g, tip, depth=n)) == n - 1
    assert len(descendants(g, root)) == n - 1
    assert is_ancestor(g, root, tip) and not is_ancestor(g, tip, root)
    assert merge_base(g, tip, root) == root
    assert [len(p) for p in paths(g, root, tip)] == [n]
    assert first_parent_chain(g, tip, n - 1) == root
    with pytest.raises(NotFoundError, match=r"main~10000 goes past the root: the chain has only 10000 versions"):
        first_parent_chain(g, tip, n, "main")


def test_first_parent_chain_message() -> None:
    g = DictGraph({"a": ([], 1.0), "b": (["a"], 2.0), "c": (["b"], 3.0)})
    with pytest.raises(NotFoundError) as err:
        first_parent_chain(g, "c", 5, label="main")
    assert str(err.value) == "main~5 goes past the root: the chain has only 3 versions"
    assert first_parent_chain(g, "c", 0) == "c"
    with pytest.raises(ValueError):
        first_parent_chain(g, "c", -1)


def test_criss_cross_has_two_merge_bases() -> None:
    #   base - x1 - m1        m1 = merge(x1, y1), m2 = merge(y1, x1)
    #        \    X
    #         y1 - m2
    g = DictGraph()
    g.add("base", [], 1.0)
    g.add("x1", ["base"], 2.0)
    g.add("y1", ["base"], 3.0)
    g.add("m1", ["x1", "y1"], 4.0)
    g.add("m2", ["y1", "x1"], 5.0)
    assert merge_bases(g, "m1", "m2") == ["y1", "x1"]
    assert merge_base(g, "m1", "m2") == "y1"
    assert merge_base(g, "m2", "m1") == "y1"
    assert merge_base(g, "x1", "y1") == "base"
    assert ancestors(g, "m2") == ["y1", "x1", "base"]
    assert ancestors(g, "m2", first_parent=True) == ["y1", "base"]
    assert sorted(map(tuple, paths(g, "base", "m1"))) == [("base", "x1", "m1"), ("base", "y1", "m1")]


def test_criss_cross_tie_broken_by_id() -> None:
    g = DictGraph({
        "m1": (["q", "p"], 4.0), "m2": (["p", "q"], 4.0), "p": (["r"], 2.0), "q": (["r"], 2.0), "r": ([], 1.0),
    })
    assert merge_bases(g, "m1", "m2") == ["p", "q"]
    assert merge_base(g, "m1", "m2") == "p"


def test_disjoint_histories_have_no_merge_base() -> None:
    g = DictGraph({"a": ([], 1.0), "b": ([], 2.0)})
    assert merge_bases(g, "a", "b") == []
    assert merge_base(g, "a", "b") is None
    assert paths(g, "a", "b") == []
    assert not is_ancestor(g, "a", "b")


def test_dictgraph_rejects_bad_input() -> None:
    g = DictGraph({"a": ([], 1.0)})
    with pytest.raises(NotFoundError):
        g.add("b", ["nope"], 2.0)
    with pytest.raises(ConflictError):
        g.add("a", [], 3.0)
    with pytest.raises(NotFoundError):
        DictGraph({"a": (["ghost"], 1.0)})
    assert "b" not in g and len(g) == 1


def test_unknown_ids_and_bad_arguments_raise() -> None:
    g = DictGraph({"a": ([], 1.0), "b": (["a"], 2.0)})
    for call in (
        lambda: ancestors(g, "zz"),
        lambda: descendants(g, "zz"),
        lambda: is_ancestor(g, "zz", "b"),
        lambda: is_ancestor(g, "a", "zz"),
        lambda: merge_base(g, "a", "zz"),
        lambda: paths(g, "zz", "b"),
        lambda: paths(g, "a", "zz"),
        lambda: first_parent_chain(g, "zz", 0),
    ):
        with pytest.raises(NotFoundError):
            call()
    with pytest.raises(ValueError):
        ancestors(g, "b", depth=-1)
    assert ancestors(g, "b", depth=0) == [] and ancestors(g, "b", depth=0, include_start=True) == ["b"]
    assert paths(g, "a", "b", limit=0) == []
    assert paths(g, "b", "b") == [["b"]]


def test_the_catalog_keeps_each_version_s_parents_and_time_for_the_walks(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as s:
        a = s.save({"w": torch.ones(2)})
        b = s.save({"w": torch.zeros(2)}, branch="side")
        m = s.save({"w": torch.full((2,), 0.5)}, parents=[a, b], branch="soup")
        for v in (a, b, m):
            assert s.catalog.node(v.id) == (v.parents, v.created)
        assert s.catalog.node("0" * 64) is None
        graph._CACHE.clear()  # walks read the table, not the records: same answers
        assert set(s.ancestors(m)) == {a.id, b.id} and s.merge_base(m, b) == b.id
        s.fsck(rebuild=True)  # a rebuilt catalog has the table too
        assert s.catalog.node(m.id) == (m.parents, m.created)
