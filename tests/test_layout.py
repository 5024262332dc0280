"""The git-style layout behind the lineage page: lanes, parents' rows and lanes, merges and forks."""

from __future__ import annotations

from datastates.query.layout import layout


def test_linear_history_is_one_lane() -> None:
    rows, width = layout([("c", ["b"]), ("b", ["a"]), ("a", [])])
    assert width == 1 and [r.lane for r in rows] == [0, 0, 0]
    assert [r.parents for r in rows] == [[("b", 1, 0)], [("a", 2, 0)], []]


def test_a_branch_and_a_merge_take_a_second_lane_then_join() -> None:
    rows, width = layout([("e", ["c", "d"]), ("d", ["b"]), ("c", ["b"]), ("b", ["a"]), ("a", [])])
    lanes = {r.id: r.lane for r in rows}
    assert width == 2 and lanes == {"e": 0, "c": 0, "d": 1, "b": 0, "a": 0}
    assert rows[0].parents == [("c", 2, 0), ("d", 1, 1)]


def test_two_heads_side_by_side_and_parents_outside_the_set_draw_nothing() -> None:
    rows, width = layout([("x2", ["x1"]), ("y1", ["gone"]), ("x1", [])])
    assert width == 2 and [r.lane for r in rows] == [0, 1, 0]
    assert rows[1].parents == []  # its parent was filtered away


def test_lanes_are_reused_after_a_line_ends() -> None:
    seq = [(f"v{i}", [f"v{i - 1}"] if i % 3 else []) for i in range(9, -1, -1)]  # four separate lines
    rows, width = layout(seq)
    assert width <= 2 and len(rows) == 10
