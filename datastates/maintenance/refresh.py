"""Refresh: learn what other hosts published to the shared cold tier (their packs, versions,
prunes and ref moves) and forget packs that a cold-tier gc collected."""

from __future__ import annotations

import json
from typing import Any

import blake3

from ..errors import IntegrityError
from ..meta.catalog import CommitBatch
from ..objects.packs import list_packs, read_index
from ..query.lineage import is_ancestor
from ..repo.repository import Repository
from .fsck import listed_bad, still_bad


def refresh(repo: Repository) -> dict[str, int]:
    """Index other hosts' packs and versions found on cold and fast-forward local refs to cold's.
    Returns counts of what was added. Does nothing when cold is unreachable: an empty mount point
    says nothing about what cold holds."""
    counts = {"packs": 0, "versions": 0, "refs": 0, "pruned": 0, "packs_gone": 0}
    cold, hot, catalog = repo.cold, repo.hot, repo.catalog
    if cold is None or repo.cold_refs is None or not (cold.root / "FORMAT").is_file():
        return counts
    known = set(catalog.pack_ids())
    on_cold = {p.name.removesuffix(".pack"): p for p in list_packs(cold.root / "packs")}
    for pack in known - on_cold.keys():  # collected on cold by some host's gc, no copy on hot: forget it
        if not hot.pack_path(pack).exists():
            catalog.drop_pack(pack)
            counts["packs_gone"] += 1
    listed: dict[str, set[bytes]] | None = None
    for pack, path in on_cold.items():  # one listing of cold, not a stat per pack (PFS metadata)
        if pack not in known:
            idx = read_index(path)
            if listed is None:  # read once, and only when there is a pack to index
                listed = listed_bad(repo.tiers)
            catalog.add_pack_file(path, "cold", idx, skip=still_bad(repo, listed, pack, idx))
            counts["packs"] += 1
    for vid in cold.iter_ids("versions", "json"):
        if catalog.record(vid) is None:
            data = cold.read_record(vid)
            if data is not None and blake3.blake3(data).hexdigest() == vid:
                extra: dict[str, Any] = {"cold": True}
                if cold.record_path(vid).with_suffix(".pruned").exists():
                    extra["pruned"] = True  # another host pruned it
                catalog.commit(CommitBatch(vid, data, list(json.loads(data).get("parents", [])), extra=extra))
                counts["versions"] += 1
    pruned = catalog.pruned_ids()
    for vid in cold.iter_ids("versions", "pruned"):  # pruned by another host
        if vid not in pruned and catalog.record(vid) is not None:
            catalog.update_extra(vid, {"pruned": True}, only_if_missing="pruned")
            counts["pruned"] += 1
    for kind in ("branch", "tag"):
        for name, cid in repo.cold_refs.names(kind).items():  # type: ignore[arg-type]
            # Read and move under the lock: other processes of this node (the ranks of a job opening
            # together) refresh the same hot refs at the same time.
            with repo.refs.locked():
                try:
                    mine = repo.refs.get(kind, name)  # type: ignore[arg-type]
                except IntegrityError:
                    continue  # a damaged hot ref: fsck reports it, --repair moves it aside; never overwrite it here
                if catalog.record(cid) is None or mine == cid:
                    continue
                if mine is not None and catalog.raw_record(mine) is None:
                    # A hot ref naming no version this node knows (a flipped hex digit): as damaged as a garbage
                    # ref file, so left alone the same way; the lineage walk below would raise NotFoundError
                    # and fail every open, fsck's included.
                    continue
                if mine is None or (kind == "branch" and (
                        is_ancestor(repo.graph, mine, cid)
                        or flushed_forward(repo.cold_refs.reflog("branch", name), mine, cid))):
                    repo.refs.set_if_equals(kind, name, mine, cid, "refresh from cold",  # type: ignore[arg-type]
                                            locked=True)
                    counts["refs"] += 1
    return counts


def flushed_forward(entries: list[dict[str, Any]], mine: str, cid: str) -> bool:
    """Whether cold's reflog of a branch shows it moved from `mine` to `cid` by flushes alone. A flusher moves a
    cold branch only forward, judged on the node that saved the version, which holds all of its history: so
    then `cid` descends from `mine`, even where this node cannot walk from one to the other (versions between
    them kept off cold by the flush policy: the walk ends at the first)."""
    at = None
    for e in entries:
        if e.get("new") == mine:
            at = mine  # (again, if the branch came back to it)
        elif at is not None:
            fast = e.get("old") == at and str(e.get("message", "")).startswith("flush ") and e.get("new")
            at = e["new"] if fast else None
    return at == cid
