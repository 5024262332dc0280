"""Where the ranks of a job keep their copies: node groups, the partner ring, and what each node's
hot tier must learn of a collective commit.

A *group* is the ranks that share one hot tier: the same node and the same hot directory. Each group
has its own catalog and refs (on its node-local disk); rank 0's group commits, and the lowest rank of
every other group (its *leader*) applies the same commit to its node's catalog, so that every node can
resolve, list and load every version without the others.

*Partner replication* (SCR's PARTNER scheme): with `partner=True` each rank's packs of a version are
copied, before the version is committed, into the hot tier of a rank on another node. The ranks are
ordered by node and rank, and rank r's partner is the rank `m` places further in that ring, where `m` is
the largest number of ranks on one node: so no rank's partner is on its own node, and the mapping is a
permutation (every rank sends once and receives once). It needs at least two nodes and no node
holding more than half of the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..base.comm import Comm
from ..errors import InvalidArgumentError


def partner_ring(nodes: list[str]) -> list[int]:
    """Rank -> the rank that holds its partner copies (see the module docstring).
    Raises InvalidArgumentError with one node, or with a node holding more than half of the ranks."""
    distinct = list(dict.fromkeys(nodes))
    if len(distinct) < 2:
        raise InvalidArgumentError(
            f"partner replication needs ranks on at least two nodes, and all {len(nodes)} ranks are on node "
            f"{distinct[0]!r}; open the store with partner=False (or set DATASTATES_NODE per node)")
    ring = sorted(range(len(nodes)), key=lambda r: (distinct.index(nodes[r]), r))
    shift = max(nodes.count(n) for n in distinct)
    partner = [0] * len(nodes)
    for i, r in enumerate(ring):
        partner[r] = ring[(i + shift) % len(ring)]
    same = [r for r in range(len(nodes)) if nodes[partner[r]] == nodes[r]]
    if same:
        counts = ", ".join(f"{n}: {nodes.count(n)}" for n in distinct)
        raise InvalidArgumentError(
            f"partner replication needs every node to hold at most half of the ranks ({counts}); no partner "
            "on another node is left for some ranks. Spread the ranks over more nodes, or open with partner=False")
    return partner


@dataclass(frozen=True)
class Placement:
    """The ranks of a job: their nodes, their hot tiers, and their partners (None: no replication)."""

    rank: int
    nodes: list[str]
    roots: list[str]
    partner: list[int] | None = None

    @classmethod
    def gather(cls, comm: Comm, hot_root: Path, partner: bool) -> Placement:
        """Collective: every rank's node and hot directory. Raises InvalidArgumentError (on every rank)
        when `partner` cannot be honoured."""
        seen = comm.allgather((comm.node, str(hot_root.resolve())))
        nodes, roots = [n for n, _ in seen], [r for _, r in seen]
        return cls(comm.rank, nodes, roots, partner_ring(nodes) if partner else None)

    @staticmethod
    def check(comm: Comm) -> None:
        """Collective: raise InvalidArgumentError on every rank when partner replication is impossible."""
        partner_ring([n for n in comm.allgather(comm.node)])

    def group(self, rank: int) -> tuple[str, str]:
        return self.nodes[rank], self.roots[rank]

    @property
    def groups(self) -> int:
        return len({self.group(r) for r in range(len(self.nodes))})

    def leader(self, rank: int) -> int:
        """The lowest rank sharing `rank`'s hot tier."""
        g = self.group(rank)
        return min(r for r in range(len(self.nodes)) if self.group(r) == g)

    @property
    def applies_commits(self) -> bool:
        """Whether this rank writes rank 0's commits into its own node's catalog: it leads a group other
        than rank 0's."""
        return self.leader(self.rank) == self.rank and self.group(self.rank) != self.group(0)

    def partner_of(self, rank: int) -> int | None:
        return None if self.partner is None else self.partner[rank]

    def held_for(self, rank: int) -> int | None:
        """The rank whose partner copies `rank` holds."""
        return None if self.partner is None else self.partner.index(rank)
