"""Restart of a job whose node-local hot tiers were partly lost (SCR's rebuild from a partner).

At a collective open, every rank tells whether its node's hot tier is whole (a FORMAT file and a
catalog). A lost one (a replaced node, a wiped local disk) is rebuilt from the surviving nodes' hot
tiers before anything else opens it. One donor (the node holding its partner copies when partner
replication is on, else the first surviving node) sends its records, manifests, annotations, refs,
reflogs and a consistent snapshot of its catalog. The packs it gets back are those it held: the packs
its ranks wrote (from their partner copies) and, with partner replication, the packs it held as the
partner of other nodes' ranks (from their writers' nodes), each sent once, by the donor when it holds
it, else by the lowest-ranked node that does; the catalog names each pack's writer rank
(`make_visible_collective`). Packs of unknown writer (written before writers were recorded, or indexed
by a catalog rebuilt from files) come from the donor, all it holds. Nothing is read from the cold tier,
so a restart works while the parallel file system is down. When every node's hot tier is lost,
nothing is sent and the open rebuilds from cold as a single process would.

`share_packs` (behind `Store.fetch_from_peers`) covers what partner copies alone do not: a chunk written
once by a rank of a third node (replicated entries are written once in total) lies on that node and
on its partner only; before a restart's load, each node asks the others for the packs its ranks need.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from ..base.comm import Comm, exchange_files
from ..errors import InvalidArgumentError
from ..objects.tier import Tier
from ..save.placement import Placement, partner_ring

log = logging.getLogger("datastates")

_NOT_SENT = ("catalog", "locks", "packs", "quarantine", "tmp")
"""Parts of a hot tier that are not copied as files: the catalog goes as a snapshot, the packs by
`_pack_senders`; locks, quarantined files and temporaries belong to the node they are on."""


def tier_is_whole(hot: Path) -> bool:
    return (hot / "FORMAT").is_file() and (hot / "catalog" / "data.mdb").is_file()


def restore_lost_nodes(comm: Comm, hot: Path, *, partner: bool) -> int:
    """Rebuild the hot tiers of this job that are missing from surviving ones (collective: every rank
    at open, before the tier is opened). Returns the number of files this rank received.
    Raises OSError or CommTimeoutError when the transfer fails (the lost tier is then left partial:
    the next collective open sees it has no catalog and rebuilds it again)."""
    hot = hot.expanduser()
    seen = comm.allgather((comm.node, str(hot.resolve()), tier_is_whole(hot)))
    groups: dict[tuple[str, str], list[int]] = {}
    for r, (node, root, _) in enumerate(seen):
        groups.setdefault((node, root), []).append(r)
    whole = {g for g, ranks in groups.items() if seen[ranks[0]][2]}
    lost = [g for g in groups if g not in whole]
    if not lost or not whole:
        return 0  # nothing to rebuild, or nothing to rebuild from (then the open rebuilds from cold)
    ring: list[int] | None = None
    if partner:
        try:
            ring = partner_ring([n for n, _, _ in seen])
        except InvalidArgumentError:
            ring = None
    # what every surviving node holds: pack -> its writer rank (None: not recorded)
    holdings = comm.allgather(_pack_writers(hot) if any(comm.rank == groups[w][0] for w in whole) else {})
    received = 0
    for g in lost:
        leader = groups[g][0]
        donor_group = next(iter(sorted(whole, key=lambda w: groups[w][0])))
        if ring is not None:
            holder = (seen[ring[leader]][0], seen[ring[leader]][1])
            donor_group = holder if holder in whole else donor_group
        donor = groups[donor_group][0]
        senders = _pack_senders(set(groups[g]), donor, holdings, ring)
        with tempfile.TemporaryDirectory(prefix="datastates-snapshot-") as snap:
            for src in sorted(senders, key=lambda r: (r != donor, r)):  # the donor first: metadata and catalog
                files: list[tuple[str, Path]] = []
                if comm.rank == src:
                    files = [(f"packs/{p}.pack", hot / "packs" / f"{p}.pack") for p in sorted(senders[src])]
                    if src == donor:
                        files = _tier_files(hot, Path(snap)) + files
                    log.warning("node %s's hot tier %s is lost; sending it %d files (%d packs) of this node's "
                                "hot tier", g[0], g[1], len(files), len(senders[src]))
                got = exchange_files(comm, files, leader if comm.rank == src else None,
                                     src if comm.rank == leader else None, lambda name: hot / name)
                received += len(got)
    # No rank opens its tier before every lost one is whole: a rank sharing the lost node would
    # otherwise find it half-written and create an empty catalog there.
    comm.barrier()
    return received


def _pack_senders(lost: set[int], donor: int, holdings: list[dict[str, int | None]],
                  ring: list[int] | None) -> dict[int, set[str]]:
    """Which surviving leader sends which packs to a lost node whose ranks are `lost`: the packs its
    ranks wrote, those it held as partner of their writers (`ring`), and, from the donor, every pack
    of unknown writer it holds. Each pack once: from the donor when it holds it, else the lowest rank.
    The donor is always a sender (it sends the metadata)."""
    senders: dict[int, set[str]] = {donor: set()}
    order = [donor] + sorted(r for r in range(len(holdings)) if holdings[r] and r != donor)
    placed: set[str] = set()
    for r in order:
        for pack, writer in holdings[r].items():
            if pack in placed:
                continue
            if writer is None:
                wanted = r == donor
            else:
                wanted = writer in lost or (ring is not None and writer < len(ring) and ring[writer] in lost)
            if wanted:
                senders.setdefault(r, set()).add(pack)
                placed.add(pack)
    return senders


def _pack_writers(hot: Path) -> dict[str, int | None]:
    """Every pack file of a whole hot tier -> the rank that wrote it, as its catalog records it."""
    import lmdb

    on_disk = {p.stem for p in (hot / "packs").glob("*.pack")}
    env = lmdb.open(str(hot / "catalog"), readonly=True, lock=False, subdir=True, max_dbs=64)
    try:
        with env.begin(db=env.open_db(b"packs", create=False)) as txn:
            info = {bytes(k).hex(): _entry(v) for k, v in txn.cursor()}
    finally:
        env.close()
    out: dict[str, int | None] = {}
    for pack in sorted(on_disk):
        writer = info.get(pack, {}).get("rank")
        out[pack] = writer if isinstance(writer, int) else None
    return out


def _entry(raw: bytes) -> dict[str, Any]:
    """A `packs` entry, {} when damaged: its writer is then unknown, as for a pack indexed without one."""
    try:
        got = json.loads(bytes(raw))
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def _tier_files(hot: Path, snap: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of every file a rebuilt hot tier needs but its packs, the catalog as a
    snapshot in `snap`."""
    import lmdb

    files: list[tuple[str, Path]] = []
    for p in sorted(hot.rglob("*")):
        rel = p.relative_to(hot)
        if p.is_file() and rel.parts[0] not in _NOT_SENT and not p.name.endswith(".tmp"):
            files.append((str(rel), p))
    env = lmdb.open(str(hot / "catalog"), readonly=True, lock=False, subdir=True, max_dbs=64)
    try:
        env.copy(str(snap), compact=True)  # a consistent copy even while this node's ranks read it
    finally:
        env.close()
    files.append(("catalog/data.mdb", snap / "data.mdb"))
    return files


def share_packs(comm: Comm, placement: Placement, hot: Tier, wanted: set[str]) -> int:
    """Copy into this node's hot tier, from the hot tiers of other nodes, the packs of `wanted` it lacks
    (collective: every rank, each with the packs it needs). Each node receives each pack once, from the
    lowest-ranked node that holds it; what no node holds is left to the cold tier. Returns the number of
    packs this rank received (its node's leader receives for the node)."""
    asked = comm.allgather(sorted(p for p in wanted if not hot.pack_path(p).exists()))
    groups: dict[tuple[str, str], list[int]] = {}
    for r in range(len(asked)):
        groups.setdefault(placement.group(r), []).append(r)
    leaders = {g: ranks[0] for g, ranks in groups.items()}
    need = {g: sorted({p for r in ranks for p in asked[r]}) for g, ranks in groups.items()}
    every = sorted({p for ps in need.values() for p in ps})
    if not every:
        return 0
    leading = placement.leader(comm.rank) == comm.rank
    held = comm.allgather([p for p in every if hot.pack_path(p).exists()] if leading else [])
    transfers: dict[tuple[int, int], list[str]] = {}
    for g in sorted(need, key=lambda g: leaders[g]):
        for p in need[g]:
            holder = next((leaders[h] for h in sorted(groups, key=lambda h: leaders[h])
                           if h != g and p in held[leaders[h]]), None)
            if holder is not None:
                transfers.setdefault((holder, leaders[g]), []).append(p)
    received = 0
    for (src, dst), packs in sorted(transfers.items()):
        files = [(p, hot.pack_path(p)) for p in packs] if comm.rank == src else []
        got = exchange_files(comm, files, dst if comm.rank == src else None, src if comm.rank == dst else None,
                             hot.pack_path)
        received += len(got)
    comm.barrier()  # no rank of a node reads before its node's packs are whole
    return received
