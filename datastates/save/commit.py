"""Where a version becomes visible. The two functions here are the only places that write a
version record and index it: `make_visible` for a save, `make_fork_visible` for a fork.

Order, and why: the packs are sealed and fsync'd (the pipeline did that) and the manifest is
written before the record; the record file is written (temp + fsync + rename + dir fsync)
before the catalog names it; the branch moves last, by compare-and-swap, under the ref lock.
A crash at any point leaves either nothing visible or a whole version.

A branch moves to a version that does not descend from its head (explicit `parents`, a fork of
another line) only if no version is left reachable by id and the reflog alone, or with `force`
(`check_branch_move`, under the ref lock, so a save racing another writer is checked too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConflictError
from ..meta.catalog import Catalog, CommitBatch
from ..meta.graph import CatalogGraph, unreached
from ..meta.refs import RefStore
from ..meta.versions import encode_record, record_dict
from ..objects.chunks import ChunkLocation
from ..objects.tier import Tier
from . import manifest as mf
from .job import SaveJob


def check_branch_move(refs: RefStore, catalog: Catalog, branch: str | None, head: str | None,
                      parents: list[str], force: bool, what: str = "save") -> None:
    """ConflictError if moving `branch` from `head` to a new version with `parents` would leave versions
    reachable only by id and the reflog (`head` is no ancestor of the new version, and no other branch or
    tag reaches it), unless `force`. A branch that does not exist yet, or whose head is a parent, moves
    without a walk (a save with default parents always does). Changes nothing."""
    if force or branch is None or head is None or head in parents:
        return
    lost = unreached(CatalogGraph(catalog), head, [*parents, *refs.heads_but("branch", branch)])
    if lost:
        raise ConflictError(
            f"this {what} would move branch {branch!r} off its head {head[:12]}, which the new version does not "
            f"descend from: {lost} version(s) would be reachable only by id and the reflog. Give it another "
            f"branch, tag the head first (`datastates tag keep-{head[:12]} {head[:12]}`), or pass force=True")


def manifest_of(job: SaveJob) -> tuple[str, memoryview]:
    """The id and bytes of a saved job's manifest: as the pipeline encoded them beside the last writes, or now."""
    if job.manifest is not None:
        return job.manifest
    return mf.encode(job.tree, job.entries, job.chunk_size, job.encoded)


def make_visible(job: SaveJob, *, tier: Tier, refs: RefStore, catalog: Catalog,
                 before_record: Callable[[], None], wants_flush: Callable[[str | None], bool],
                 overwrite_chunks: bool) -> tuple[str, bytes, bool]:
    """Commit a saved job: manifest, record, catalog, then the branch. Returns (id, record bytes,
    whether the version is queued for the cold tier). Runs on the pipeline thread.

    `before_record` runs under the ref lock before anything names the version (the object store
    puts back reused packs there); an exception from it, or from any write, leaves nothing visible.
    """
    mid, mdata = manifest_of(job)
    tier.write_manifest(mid, mdata)
    req = job.request
    branch = req["branch"]
    with refs.locked():
        head = refs.get("branch", branch) if branch else None
        parents = req["parents"] if req["parents"] is not None else ([head] if head else [])
        check_branch_move(refs, catalog, branch, head, parents, req.get("force", False))
        before_record()
        rec = record_dict(
            parents=parents, manifests={"0": mid}, step=req["step"], epoch=req["epoch"], created=time.time(),
            hparams=req["hparams"], metrics=req["metrics"], message=req["message"], branch=branch,
            world_size=1, bytes_total=sum(e.nbytes for e in job.entries), bytes_new=job.bytes_new,
            chunks_new=len(job.new_chunks), fork_of=req["fork_of"], explore=req["explore"],
        )
        vid, data = encode_record(rec)
        tier.write_record(vid, data)
        job.timings["durable_s"] = time.perf_counter() - job.t0
        packs = {w.id: {"size": w.size, "chunks": w.count, "tier": tier.name} for w in job.packs}
        extra: dict[str, Any] = {"timings": job.timings}
        to_flush = wants_flush(branch)
        if to_flush:
            extra["flush"] = "pending"
        _commit_or_unwrite(tier, vid, catalog, CommitBatch(vid, data, parents, list(job.new_chunks.items()),
                                                           packs, extra, overwrite_chunks=overwrite_chunks))
        job.committed = True
        if branch:
            refs.set_if_equals("branch", branch, head, vid, f"save: {req['message']}".strip(), locked=True)
    return vid, data, to_flush


def make_fork_visible(rec: dict[str, Any], *, tier: Tier, refs: RefStore, catalog: Catalog,
                      branch: str | None, message: str, force: bool = False) -> str:
    """Commit a version that names existing manifests (a fork): record, catalog, then the branch.
    Returns its id. No bytes of tensors are read or written. Raises ConflictError (`check_branch_move`)
    with nothing written."""
    vid, data = encode_record(rec)
    with tier.writing(), refs.locked():
        head = refs.get("branch", branch) if branch else None
        check_branch_move(refs, catalog, branch, head, list(rec["parents"]), force, "fork")
        tier.write_record(vid, data)
        _commit_or_unwrite(tier, vid, catalog, CommitBatch(vid, data, list(rec["parents"])))
        if branch:
            refs.set_if_equals("branch", branch, head, vid, message, locked=True)
    return vid


def _commit_or_unwrite(tier: Tier, vid: str, catalog: Catalog, batch: CommitBatch) -> None:
    """Index `batch`; if that fails (a full disk, a damaged catalog), remove the record file this save
    just wrote, so the failed save leaves no record that readers or fsck would trip on, then re-raise.
    The record is removed only when the catalog does not know the version (an identical record an
    earlier save committed stays)."""
    try:
        catalog.commit(batch)
    except BaseException:
        try:
            known = catalog.record(vid) is not None
        except Exception:  # the catalog itself is unreadable: the record file is the only copy, keep it
            known = True
        if not known:
            tier.record_path(vid).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Staged:
    """A rank's part of a version written by a storage plugin: its manifest and the chunks it added,
    durable but named by no record yet (`make_staged_visible` names them; until then fsck counts
    its packs as leftovers of an interrupted save)."""

    mid: str
    chunks: list[tuple[bytes, tuple[Any, ...]]]
    """(chunk id, ChunkLocation fields) of every chunk this part wrote."""
    packs: dict[str, dict[str, Any]]
    bytes_total: int
    bytes_new: int


def stage(job: SaveJob, *, tier: Tier) -> Staged:
    """Write a saved job's manifest and describe it, without a record: nothing becomes visible."""
    mid, mdata = manifest_of(job)
    tier.write_manifest(mid, mdata)
    return Staged(mid, [(c, tuple(loc)) for c, loc in job.new_chunks.items()],
                  {w.id: {"size": w.size, "chunks": w.count, "tier": tier.name} for w in job.packs},
                  sum(e.nbytes for e in job.entries), job.bytes_new)


def make_staged_visible(parts: dict[str, Staged], request: dict[str, Any], *, world_size: int, tier: Tier,
                        refs: RefStore, catalog: Catalog,
                        wants_flush: Callable[[str | None], bool]) -> tuple[str, bool]:
    """Name staged parts (rank -> part) in one record: index their chunks, write the record, move the
    branch. Returns (id, queued for cold). A crash before the catalog commit leaves nothing visible."""
    chunks: dict[bytes, ChunkLocation] = {}
    packs: dict[str, dict[str, Any]] = {}
    for part in parts.values():
        for cid, loc in part.chunks:
            chunks.setdefault(cid, ChunkLocation(*loc))
        packs.update(part.packs)
    branch = request["branch"]
    with tier.writing(), refs.locked():
        head = refs.get("branch", branch) if branch else None
        parents = request["parents"] if request["parents"] is not None else ([head] if head else [])
        check_branch_move(refs, catalog, branch, head, parents, request.get("force", False))
        rec = record_dict(
            parents=parents, manifests={k: p.mid for k, p in parts.items()}, step=request["step"],
            epoch=request["epoch"], created=time.time(), hparams=request["hparams"], metrics=request["metrics"],
            message=request["message"], branch=branch, world_size=world_size,
            bytes_total=sum(p.bytes_total for p in parts.values()),
            bytes_new=sum(p.bytes_new for p in parts.values()), chunks_new=len(chunks),
            fork_of=request["fork_of"], explore=request["explore"],
        )
        vid, data = encode_record(rec)
        tier.write_record(vid, data)
        to_flush = wants_flush(branch)
        extra: dict[str, Any] = {"flush": "pending"} if to_flush else {}
        _commit_or_unwrite(tier, vid, catalog, CommitBatch(vid, data, parents, list(chunks.items()), packs, extra))
        if branch:
            refs.set_if_equals("branch", branch, head, vid, f"save: {request['message']}".strip(), locked=True)
    return vid, to_flush
