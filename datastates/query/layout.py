"""A git-style layout of the version graph: one row per version, newest first, one lane per line of
descent, computed in one pass (O(versions + edges)), as `git log --graph` does.

Each version takes the lane that a child already reserved for it (the leftmost when several did:
the others end there, which is where branches fork off), else a free lane. Its first parent
inherits its lane; each further parent (a merge) gets a lane of its own unless a lane is already
waiting for it. Parents outside the laid-out set (filtered away) draw no edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Row:
    id: str
    row: int
    lane: int
    parents: list[tuple[str, int, int]] = field(default_factory=list)
    """(parent id, parent row, parent lane) for each parent in the laid-out set, in parent order."""


def layout(versions: Sequence[tuple[str, Sequence[str]]]) -> tuple[list[Row], int]:
    """Rows for `versions` given newest first as (id, parents); returns (rows, number of lanes).
    A parent must come after its children in the sequence to draw (creation order guarantees it)."""
    row_of = {vid: i for i, (vid, _) in enumerate(versions)}
    lanes: list[str | None] = []  # lanes[i]: the id the line in lane i is heading to
    waiting: dict[str, list[int]] = {}  # id -> lanes heading to it
    lane_of: dict[str, int] = {}
    rows: list[Row] = []
    width = 0

    def free_lane() -> int:
        for i, x in enumerate(lanes):
            if x is None:
                return i
        lanes.append(None)
        return len(lanes) - 1

    for i, (vid, parents) in enumerate(versions):
        mine = waiting.pop(vid, None)
        if mine:
            lane = min(mine)
            for other in mine:
                lanes[other] = None
        else:
            lane = free_lane()
        lanes[lane] = None
        lane_of[vid] = lane
        inside = [p for p in parents if p in row_of and row_of[p] > i]
        for k, p in enumerate(inside):
            if k == 0:
                target = lane
            elif p in waiting:
                continue  # a lane already heads there
            else:
                target = free_lane()
            lanes[target] = p
            waiting.setdefault(p, []).append(target)
        rows.append(Row(vid, i, lane))
        width = max(width, len(lanes))
    for r, (_, parents) in zip(rows, versions):
        r.parents = [(p, row_of[p], lane_of[p]) for p in parents if p in lane_of and row_of[p] > r.row]
    return rows, width
