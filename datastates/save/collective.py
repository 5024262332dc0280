"""Saving one version from many ranks (data-parallel or sharded training).

Each rank saves its own entries into its own manifest. Entries declared *replicated* (identical on
every rank: DDP weights, their optimizer state) are hashed and written once in total: `plan` deals
them out over the ranks by bytes, the same way on every rank, and a rank only references the chunks
the owner wrote. `make_visible_collective` is where a distributed version becomes visible, in two
phases: every rank seals its packs and reports; then rank 0 alone writes the record, indexes every
rank's chunks and moves the branch, and tells the others the outcome. A rank that fails before the
report (or dies: the launcher then ends the job) leaves nothing visible.

With node-local hot tiers (see `placement`), each rank first sends its sealed packs to its partner
rank on another node when partner replication is on, before it reports: a version is visible only once
every partner copy is durable. After rank 0's commit, the leader of every other node's hot tier
writes the same record, manifests and chunk index into its node's catalog and moves its branch.
"""

from __future__ import annotations

import fnmatch
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3

from ..base.comm import Comm, exchange_files
from ..errors import ConflictError, InvalidArgumentError, SaveFailedError
from ..meta.catalog import Catalog, CommitBatch
from ..meta.refs import RefStore
from ..meta.versions import encode_record, record_dict
from ..objects.chunks import ChunkLocation
from ..objects.tier import Tier
from . import manifest as mf
from .commit import check_branch_move
from .job import SaveJob
from .placement import Placement
from .tree import TensorEntry, dtype_name, tree_paths


@dataclass
class DistPlan:
    """One collective save: the communicator, the replicated patterns, and who writes what."""

    comm: Comm
    replicated: list[str]
    owners: dict[int, int] = field(default_factory=dict)
    """Row -> rank that hashes and writes it, for replicated rows holding bytes."""
    remote: set[int] = field(default_factory=set)
    """Rows this rank references but another rank writes (filled in from its report)."""


def matches(key: str, patterns: list[str]) -> bool:
    """Whether `key` is under one of the patterns: the key itself, a prefix ending at '.', or a glob."""
    return any(key == p or key.startswith(p + ".") or fnmatch.fnmatchcase(key, p) for p in patterns)


def check_patterns(tree: dict[str, Any], patterns: list[str]) -> None:
    """Raise InvalidArgumentError naming the `replicated` patterns that match no key path of the state (a typo, or
    'model' for a state keyed 'module'): the version would record them, and a load at another world size, which
    reads the replicated entries by those patterns, would fail on each ('has no key')."""
    paths = tree_paths(tree)
    missing = [p for p in patterns if not any(matches(k, [p]) for k in paths)]
    if missing:
        top = sorted({k.split(".", 1)[0] for k in paths})[:10]
        raise InvalidArgumentError(f"replicated patterns {missing} match no key of the state (its top-level keys: "
                                   f"{top}); name prefixes or globs of keys that are in it, e.g. replicated=['model']")


def replicated_rows(entries: list[TensorEntry], patterns: list[str]) -> list[int]:
    """Rows holding bytes whose every key is replicated (a shared storage counts when all its views do)."""
    views: dict[int, list[str]] = {}
    for e in entries:
        if e.kind == "view":
            views.setdefault(e.base, []).append(e.key)
    out = []
    for i, e in enumerate(entries):
        own = e.kind == "tensor" and matches(e.key, patterns)
        shared = e.kind == "storage" and bool(views.get(i)) and all(matches(k, patterns) for k in views[i])
        if own or shared:
            out.append(i)
    return out


LINEAGE_FIELDS = ("branch", "parents", "step", "epoch", "force", "fork_of")
"""The save arguments every rank must give alike: they place the one version in the lineage (rank 0's were
taken and the others' ignored). Metrics, hparams and the message may differ (a rank's own loss): rank 0's are
recorded."""


def plan(entries: list[TensorEntry], patterns: list[str], comm: Comm,
         request: dict[str, Any] | None = None) -> DistPlan:
    """Deal the replicated rows out over the ranks, largest first, each to the rank with the fewest
    bytes so far (ties: the lowest rank). Collective. Raises InvalidArgumentError, on every rank and
    before anything is written, when the ranks' replicated entries differ (keys, dtypes, shapes), or the
    `LINEAGE_FIELDS` of their save `request`s do."""
    rows = replicated_rows(entries, patterns)
    sig = blake3.blake3(repr([(entries[i].key, dtype_name(entries[i].dtype), entries[i].shape, entries[i].nbytes)
                              for i in rows]).encode()).hexdigest()
    lineage = None if request is None else {k: request.get(k) for k in LINEAGE_FIELDS}
    sigs = comm.allgather((sig, len(rows), None, lineage))
    _raise_refusals(sigs)
    if len({s for s, _, _, _ in sigs}) != 1:
        counts = ", ".join(f"rank {r}: {n}" for r, (_, n, _, _) in enumerate(sigs))
        raise InvalidArgumentError(
            f"the entries declared replicated differ across ranks ({counts} replicated tensors, or other keys, "
            "dtypes or shapes); replicated=[...] must name entries that are identical on every rank")
    differ = [k for k in LINEAGE_FIELDS if len({repr((got or {}).get(k)) for *_, got in sigs}) > 1]
    if differ:
        said = "; ".join(f"{k}: " + ", ".join(f"rank {r} {(got or {}).get(k)!r}" for r, (*_, got) in enumerate(sigs))
                         for k in differ)
        raise InvalidArgumentError(
            f"the ranks of this collective save gave different {', '.join(differ)} ({said}); every rank must "
            f"pass the same {', '.join(differ)} (one version is made for all); nothing was written")
    load = [0] * comm.size
    owners: dict[int, int] = {}
    for i in sorted(rows, key=lambda i: (-entries[i].nbytes, entries[i].key)):
        r = min(range(comm.size), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += entries[i].nbytes
    p = DistPlan(comm, list(patterns), owners)
    p.remote = {i for i, r in owners.items() if r != comm.rank}
    for i in p.remote:
        entries[i].source = None  # neither copied nor hashed here: the owner writes it
    return p


def refuse_together(comm: Comm, exc: BaseException) -> None:
    """Where `plan` would run, on a rank whose state was refused before it (a value it cannot save): tell the
    other ranks, whose `plan` then raises, so that every rank refuses this save and the next one is the next on
    every rank. Otherwise the others' plan met this rank's next save's, and one version held two steps' shards.
    Collective; the caller raises `exc` after it."""
    comm.allgather(("", 0, f"{type(exc).__name__}: {exc}", None))


def _raise_refusals(sigs: list[tuple[str, int, str | None, Any]]) -> None:
    refused = [f"rank {r}: {why}" for r, (_, _, why, _) in enumerate(sigs) if why is not None]
    if refused:
        raise InvalidArgumentError(f"the collective save was refused on {'; '.join(refused)}; every rank refuses "
                                   "it and nothing was written: fix that rank's state and save again")


def make_visible_collective(job: SaveJob, dist: DistPlan, *, tier: Tier, refs: RefStore, catalog: Catalog,
                            before_record: Callable[[], None], wants_flush: Callable[[str | None], bool],
                            overwrite_chunks: bool, placement: Placement | None = None) -> tuple[str, bytes, bool]:
    """Commit a collective save from every rank (call on every rank, in the same save order).
    Returns (id, record bytes, queued for cold) on every rank. Raises SaveFailedError on every rank
    when any rank failed to report (its partner copy included) or rank 0 failed to commit: then
    nothing is visible."""
    comm = dist.comm
    mine = {str(i): (job.entries[i].chunks, job.entries[i].stats) for i, r in dist.owners.items() if r == comm.rank}
    if placement is not None and placement.partner is not None:
        _send_to_partner(job, placement, comm, tier)
    failure = None if job.failure is None else f"{type(job.failure).__name__}: {job.failure}"
    reports = comm.allgather({"rows": mine, "failure": failure})
    failed = [f"rank {r}: {rep['failure']}" for r, rep in enumerate(reports) if rep["failure"]]
    if job.failure is not None:
        raise job.failure
    if failed:
        raise SaveFailedError(f"the collective save failed on {'; '.join(failed)}; nothing is visible")
    for i in dist.remote:
        chunks, stats = reports[dist.owners[i]]["rows"][str(i)]
        job.entries[i].chunks, job.entries[i].stats = list(chunks), dict(stats)
    # A failure from here to the second exchange (the manifest's encode or write: a full disk) goes into that
    # exchange, as one before the first does into the first: raised alone, it left the others waiting in it.
    local: BaseException | None = None
    mid, mdata = "", memoryview(b"")
    try:
        mid, mdata = mf.encode(job.tree, job.entries, job.chunk_size, job.encoded)
        tier.write_manifest(mid, mdata)
    except Exception as exc:
        local = exc
    job.timings["rank_bytes_written"] = job.bytes_new  # what this rank wrote (the record sums every rank's)
    # the writer's rank: a rebuilt node gets back its ranks' packs and those it held as their partner
    packs = {w.id: {"size": w.size, "chunks": w.count, "tier": tier.name, "rank": comm.rank} for w in job.packs}
    many_tiers = placement is not None and placement.groups > 1
    phase1 = comm.allgather({"mid": mid, "chunks": [(c, tuple(loc)) for c, loc in job.new_chunks.items()],
                             "packs": packs, "bytes_new": job.bytes_new, "chunks_new": len(job.new_chunks),
                             "bytes_total": sum(e.nbytes for i, e in enumerate(job.entries) if i not in dist.remote),
                             # every node's catalog needs every rank's manifest (loads at other world sizes)
                             "mdata": bytes(mdata) if many_tiers else None,
                             "failure": None if local is None else f"{type(local).__name__}: {local}"})
    if local is not None:
        raise local
    failed = [f"rank {r}: {rep['failure']}" for r, rep in enumerate(phase1) if rep["failure"]]
    if failed:
        raise SaveFailedError(f"the collective save failed on {'; '.join(failed)}; nothing is visible")
    outcome: Any = None
    if comm.rank == 0:
        try:
            outcome = _commit_on_root(job, dist, phase1, tier=tier, refs=refs, catalog=catalog,
                                      before_record=before_record, wants_flush=wants_flush,
                                      overwrite_chunks=overwrite_chunks, placement=placement)
        except BaseException as exc:  # every rank must hear of it, or the others would wait forever
            outcome = ("error", f"{type(exc).__name__}: {exc}")
            comm.bcast(outcome)
            raise
    outcome = comm.bcast(outcome)
    if outcome[0] == "error":
        raise SaveFailedError(f"rank 0 could not commit the collective save: {outcome[1]}; nothing is visible")
    _, vid, data, to_flush = outcome
    job.committed = True
    if many_tiers:
        assert placement is not None
        if placement.applies_commits:
            apply_on_node(vid, data, phase1, tier=tier, refs=refs, catalog=catalog, to_flush=to_flush,
                          overwrite_chunks=overwrite_chunks, force=job.request.get("force", False))
        # Every rank returns only once its node's catalog holds the version: its flusher and its next
        # calls (log, load) look it up there.
        comm.barrier()
    return vid, data, to_flush


def _send_to_partner(job: SaveJob, placement: Placement, comm: Comm, tier: Tier) -> None:
    """Copy this rank's sealed packs into its partner's hot tier while receiving the packs of the rank
    it is partner to; a failure on either side becomes this rank's failure (reported to every rank)."""
    files = [] if job.failure is not None else [(w.id, tier.pack_path(w.id)) for w in job.packs]
    t0 = time.perf_counter()
    try:
        exchange_files(comm, files, placement.partner_of(comm.rank), placement.held_for(comm.rank), tier.pack_path)
    except OSError as exc:
        if job.failure is None:
            job.failure = SaveFailedError(f"the partner copy of rank {comm.rank}'s packs failed: {exc}")
    job.timings["partner_s"] = time.perf_counter() - t0
    job.timings["partner_bytes"] = sum(w.size for w in job.packs)


def _merged(phase1: list[dict[str, Any]]) -> tuple[dict[bytes, ChunkLocation], dict[str, dict[str, Any]]]:
    """Every rank's new chunk locations and packs, as one commit names them."""
    chunks: dict[bytes, ChunkLocation] = {}
    packs: dict[str, dict[str, Any]] = {}
    for rep in phase1:
        for cid, loc in rep["chunks"]:
            chunks.setdefault(cid, ChunkLocation(*loc))  # the same bytes written twice: one copy is enough
        packs.update(rep["packs"])
    return chunks, packs


def _write_manifests(tier: Tier, phase1: list[dict[str, Any]]) -> None:
    """Every rank's manifest that travelled with its report (node-local tiers), on this tier."""
    for rep in phase1:
        if rep.get("mdata") is not None:
            tier.write_manifest(rep["mid"], rep["mdata"])


def apply_on_node(vid: str, data: bytes, phase1: list[dict[str, Any]], *, tier: Tier, refs: RefStore,
                  catalog: Catalog, to_flush: bool, overwrite_chunks: bool, force: bool = False) -> None:
    """Write rank 0's commit `vid` into this node's hot tier and catalog: every rank's manifest, the
    record, the chunk index, and the branch, moved to `vid` by the rule rank 0's commit applied
    (`check_branch_move`, with the save's `force`): a branch this node's saves moved elsewhere is not taken
    from its line. Idempotent: a catalog that already holds `vid` (a tier shared with rank 0) is left as is."""
    rec = json.loads(data)
    with refs.locked():
        if catalog.record(vid) is not None:
            return
        _write_manifests(tier, phase1)
        tier.write_record(vid, data)
        chunks, packs = _merged(phase1)
        parents = list(rec.get("parents") or [])
        extra: dict[str, Any] = {"flush": "pending"} if to_flush else {}
        catalog.commit(CommitBatch(vid, data, parents, list(chunks.items()), packs, extra,
                                   overwrite_chunks=overwrite_chunks))
        branch = rec.get("branch")
        if branch:
            head = refs.get("branch", branch)
            try:
                check_branch_move(refs, catalog, branch, head, parents, force)
            except ConflictError:
                return  # this node's head is on no line the version continues, and nothing else names it
            refs.set_if_equals("branch", branch, head, vid, "save (collective, applied on this node)", locked=True)


def _commit_on_root(job: SaveJob, dist: DistPlan, phase1: list[dict[str, Any]], *, tier: Tier, refs: RefStore,
                    catalog: Catalog, before_record: Callable[[], None], wants_flush: Callable[[str | None], bool],
                    overwrite_chunks: bool, placement: Placement | None) -> tuple[str, str, bytes, bool]:
    req = job.request
    branch = req["branch"]
    chunks, packs = _merged(phase1)
    _write_manifests(tier, phase1)  # the other ranks' manifests, on rank 0's node too
    with refs.locked():
        head = refs.get("branch", branch) if branch else None
        parents = req["parents"] if req["parents"] is not None else ([head] if head else [])
        check_branch_move(refs, catalog, branch, head, parents, req.get("force", False))
        before_record()
        rec = record_dict(
            parents=parents, manifests={str(r): rep["mid"] for r, rep in enumerate(phase1)}, step=req["step"],
            epoch=req["epoch"], created=time.time(), hparams=req["hparams"], metrics=req["metrics"],
            message=req["message"], branch=branch, world_size=dist.comm.size,
            bytes_total=sum(rep["bytes_total"] for rep in phase1),
            bytes_new=sum(rep["bytes_new"] for rep in phase1), chunks_new=len(chunks),
            fork_of=req["fork_of"], explore=req["explore"], replicated=sorted(dist.replicated) or None,
            # where each rank's partner copy lives: rank -> [partner rank, its node]
            partners=None if placement is None or placement.partner is None else {
                str(r): [p, placement.nodes[p]] for r, p in enumerate(placement.partner)},
        )
        vid, data = encode_record(rec)
        tier.write_record(vid, data)
        job.timings["durable_s"] = time.perf_counter() - job.t0
        extra: dict[str, Any] = {"timings": job.timings}
        to_flush = wants_flush(branch)
        if to_flush:
            extra["flush"] = "pending"
        catalog.commit(CommitBatch(vid, data, parents, list(chunks.items()), packs, extra,
                                   overwrite_chunks=overwrite_chunks))
        job.committed = True
        if branch:
            refs.set_if_equals("branch", branch, head, vid, f"save: {req['message']}".strip(), locked=True)
    return "ok", vid, data, to_flush
