"""Retention policies and pruning: decide which versions keep their bytes.

Policies in the spirit of Orbax's checkpoint managers, composable by union::

    keep = Retention(KeepLatest(3), KeepBest(2, "metrics.val_loss", "min"), KeepEvery(1000))
    plan = prune(store, keep, dry_run=True)   # what would go, and the bytes gc could then free
    prune(store, keep)                        # mark the rest pruned; `datastates.gc.gc` frees the bytes

Guarantees:
- tagged versions, branch heads and every id a registered protector names are
  always kept, whatever the policies say (never lose the newest good state);
- pruning keeps the version record, so lineage (parents, children, forks)
  stays whole; loading a pruned version raises PrunedError;
- a prune is marked first in the tier files (`versions/<ab>/<id>.pruned`,
  fsync'd), then in the catalog, so a crash in between leaves the version
  loadable and the next `prune` (or a catalog rebuild) completes the mark;
- bytes are never deleted here: `gc` does that, under the tier's exclusive lock.
"""

from __future__ import annotations

import difflib
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base.files import canonical_json, write_new
from ..errors import ArgumentTypeError, DataStatesError, InvalidArgumentError, NotFoundError
from ..meta.versions import Version, cut, decode_record, shown, with_annotations
from ..repo.repository import Repository, as_repository

if TYPE_CHECKING:
    from ..objects.tier import Tier

log = logging.getLogger("datastates.retention")

PRUNED_EXT = "pruned"
"""Suffix of the marker file that says a version's bytes were pruned (next to its record)."""

Protector = Callable[["Repository"], Iterable[str]]

_PROTECTORS: list[Protector] = []
_PROTECTORS_LOCK = threading.Lock()


def register_protector(fn: Protector) -> Protector:
    """Register `fn(store) -> ids` naming versions that `prune` must never prune; return `fn` (a decorator too).

    Protectors run while prune holds the tier's locks: they may read the
    store but must not save, tag or move branches (that would wait forever).
    An exception raised by a protector aborts the prune before anything changes.
    """
    with _PROTECTORS_LOCK:
        if fn not in _PROTECTORS:
            _PROTECTORS.append(fn)
    return fn


def unregister_protector(fn: Protector) -> None:
    """Remove a protector registered with `register_protector` (no error if it is not registered)."""
    with _PROTECTORS_LOCK:
        if fn in _PROTECTORS:
            _PROTECTORS.remove(fn)


def protected_ids(store: Repository) -> set[str]:
    """The union of what every registered protector names for `store`. Protectors are called with
    the object users hold (the Store wrapping the repository), as they were registered for it."""
    repo = as_repository(store)
    holder = repo.owner if repo.owner is not None else repo
    with _PROTECTORS_LOCK:
        fns = list(_PROTECTORS)
    out: set[str] = set()
    for fn in fns:
        out.update(str(v) for v in fn(holder))
    return out


def marker_path(tier: Tier, vid: str) -> Path:
    """Where the pruned marker of version `vid` lives in `tier`."""
    return tier.root / "versions" / vid[:2] / f"{vid}.{PRUNED_EXT}"


def write_marker(tier: Tier, vid: str) -> bool:
    """Write the pruned marker of `vid` on `tier` (fsync'd, `write_new`: an existing marker stays as it is);
    True if this call made it. Every writer of markers uses this: prune, the flusher (publishing a pruned
    version's record on cold) and `fsck --repair`. Raises OSError (StorageFullError) when it cannot be written."""
    return write_new(marker_path(tier, vid), canonical_json({"pruned": time.time(), "version": vid}))


# policies ------------------------------------------------------------------------------------------------------
def _order_key(v: Version) -> tuple[float, int, str]:
    """Newest last: commit time, then step, then id (so equal times still sort the same everywhere)."""
    return (v.created, v.step if v.step is not None else -1, v.id)


class Policy(ABC):
    """A rule naming versions to keep. `a | b` is the union of two rules."""

    @abstractmethod
    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        """Ids among `versions` (the candidates: versions not pruned yet) that this rule keeps."""

    def __or__(self, other: Policy) -> Retention:
        return Retention(self, other)


def _check_count(policy: str, field: str, value: Any, least: int) -> None:
    """InvalidArgumentError unless `value` is an int (not a bool) of at least `least`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{policy}({field}={shown(value)}): {field} is a count; give an int "
                                   f"such as {policy}({max(least, 1) * 5})")
    if value < least:
        raise InvalidArgumentError(f"{policy}({field}={value}): {field} must be {least} or more")


@dataclass(frozen=True)
class KeepLatest(Policy):
    """The `n` newest versions (by commit time, then step), per branch a version was saved on, or overall.

    With `per_branch`, versions saved with no branch form one group of their own.
    Raises InvalidArgumentError (a ValueError) for n < 0 or an n that is not an int.
    """

    n: int
    per_branch: bool = True

    def __post_init__(self) -> None:
        _check_count("KeepLatest", "n", self.n, 0)

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        groups: dict[str | None, list[Version]] = {}
        for v in versions:
            groups.setdefault(v.branch if self.per_branch else None, []).append(v)
        out: set[str] = set()
        for group in groups.values():
            group.sort(key=_order_key)
            out.update(v.id for v in group[max(0, len(group) - self.n):] if self.n)
        return out


@dataclass(frozen=True)
class KeepBest(Policy):
    """The `n` versions with the best value of `metric` (lowest with mode "min", highest with "max").

    `metric` is a dotted path: "metrics.val_loss" reads the version's metrics as
    users see them (those `store.annotate(v, metrics={...})` put after the save
    over the record's) and, when they lack it, the annotations; "annotations.x" and
    "hparams.x" read those only; a bare name means "metrics.<name>". Versions
    without a finite numeric value are never "best". Ties go to the newer version.
    Raises InvalidArgumentError (a ValueError) for n < 0 (or not an int) or an unknown mode.
    """

    n: int
    metric: str = "metrics.val_loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        _check_count("KeepBest", "n", self.n, 0)
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"KeepBest(mode={self.mode!r}): mode must be 'min' or 'max'")
        if not self.metric or not isinstance(self.metric, str):
            raise InvalidArgumentError(f"KeepBest(metric={self.metric!r}): give a path such as 'metrics.val_loss'")

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        """Raises NotFoundError (with close matches) when no version has the metric at all: a typo
        would otherwise keep nothing by this rule and prune in silence."""
        scored: list[tuple[float, Version]] = []
        for v in versions:
            value = metric_value(v, self.metric)
            if value is not None:
                scored.append((value if self.mode == "min" else -value, v))
        if versions and not scored and not any(_has_path(v, self.metric) for v in versions):
            known = sorted({p for v in versions for p in _paths(v)})
            close = difflib.get_close_matches(self.metric, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(cut, close))}?" if close else \
                f"; the versions have {', '.join(map(cut, known[:10])) or 'no metrics'}"
            raise NotFoundError(f"KeepBest: no version has {self.metric!r}{hint}")
        # Best first; among equals the newest first.
        scored.sort(key=lambda sv: (sv[0], -sv[1].created, -(sv[1].step if sv[1].step is not None else -1), sv[1].id))
        return {v.id for _, v in scored[: self.n]}


@dataclass(frozen=True)
class KeepEvery(Policy):
    """Versions whose step is a multiple of `n_steps` (versions without a step are not kept by this rule).

    Raises InvalidArgumentError (a ValueError) for n_steps < 1 or not an int.
    """

    n_steps: int

    def __post_init__(self) -> None:
        _check_count("KeepEvery", "n_steps", self.n_steps, 1)

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        return {v.id for v in versions if v.step is not None and v.step % self.n_steps == 0}


@dataclass(frozen=True)
class KeepTagged(Policy):
    """Versions a tag points at (always kept by `prune` anyway; useful on its own in `plan`)."""

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        return set(store.tags().values()) & {v.id for v in versions}


@dataclass(frozen=True)
class KeepBranchHeads(Policy):
    """Versions a branch points at (always kept by `prune` anyway)."""

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        return set(store.branches().values()) & {v.id for v in versions}


@dataclass(frozen=True)
class KeepIf(Policy):
    """Versions for which `predicate(version)` is true (an exception from the predicate aborts the prune)."""

    predicate: Callable[[Version], bool]

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        return {v.id for v in versions if self.predicate(v)}


class Retention(Policy):
    """The union of several policies: a version is kept if any of them keeps it.

    Raises InvalidArgumentError when given no policy (that would prune every version but
    the tagged ones and the branch heads; say so with `Retention(KeepBranchHeads())`),
    ArgumentTypeError (a TypeError) for something that is not a Policy.
    """

    def __init__(self, *policies: Policy) -> None:
        flat: list[Policy] = []
        for p in policies:
            if isinstance(p, Retention):
                flat.extend(p.policies)
            elif isinstance(p, Policy):
                flat.append(p)
            else:
                _check_policy(p)
        if not flat:
            raise InvalidArgumentError("Retention() needs at least one policy; Retention(KeepBranchHeads()) keeps only "
                                       "the branch heads and tagged versions")
        self.policies: tuple[Policy, ...] = tuple(flat)

    def keep(self, versions: list[Version], store: Repository) -> set[str]:
        out: set[str] = set()
        for p in self.policies:
            out |= p.keep(list(versions), store)
        return out

    def __repr__(self) -> str:
        return f"Retention({', '.join(map(repr, self.policies))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Retention) and other.policies == self.policies

    def __hash__(self) -> int:
        return hash(self.policies)


def _paths(v: Version) -> list[str]:
    """Every dotted leaf path of a version's metrics, hparams and annotations (internal keys left out)."""
    out: list[str] = []

    def walk(prefix: str, d: Any) -> None:
        if isinstance(d, dict):
            for k, x in d.items():
                if not str(k).startswith("_"):
                    walk(f"{prefix}.{k}", x)
        else:
            out.append(prefix)

    walk("metrics", v.metrics)
    walk("hparams", v.hparams)
    walk("annotations", v.annotations)
    out.extend(p.replace("annotations.", "metrics.", 1) for p in list(out) if p.startswith("annotations."))
    return out


def _has_path(v: Version, path: str) -> bool:
    full = path if "." in path and path.split(".", 1)[0] in ("metrics", "hparams", "annotations") \
        else f"metrics.{path}"
    return full in _paths(v)


def metric_value(v: Version, path: str) -> float | None:
    """The finite number at dotted `path` in a version (see KeepBest), or None."""
    head, _, rest = path.partition(".")
    if not rest:
        head, rest = "metrics", path
    if head == "metrics":
        sources = [v.metrics, v.annotations]
    elif head == "annotations":
        sources = [v.annotations]
    elif head == "hparams":
        sources = [v.hparams]
    else:
        sources = [v.metrics, v.annotations]
        rest = path
    for src in sources:
        value = _lookup(src, rest)
        if value is not None:
            return value
    return None


def _lookup(d: dict[str, Any], path: str) -> float | None:
    # A flat key with dots ("val.loss") wins over nesting; annotations are flat.
    cur: Any = d.get(path, _MISSING) if isinstance(d, dict) else _MISSING
    if cur is _MISSING:
        cur = d
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return None
            cur = cur[part]
    if isinstance(cur, bool) or not isinstance(cur, (int, float)) or not math.isfinite(cur):
        return None
    return float(cur)


_MISSING = object()


# planning and pruning --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrunePlan:
    """What a prune keeps and prunes. With `dry_run` nothing was changed."""

    keep: frozenset[str]
    """Ids of versions that keep their bytes."""
    prune: frozenset[str]
    """Ids of versions pruned by this call (or that would be, in a dry run)."""
    protected: frozenset[str]
    """Ids kept whatever the policies say: tagged versions, branch heads, registered protectors."""
    already_pruned: frozenset[str] = frozenset()
    """Ids pruned before this call (their bytes are gc's business already)."""
    bytes_freed: int = 0
    """Stored bytes of chunks that only the pruned versions name: what `gc` can free once they are pruned
    (a pack above gc's repack threshold keeps its dead bytes until a later gc)."""
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"keep": sorted(self.keep), "prune": sorted(self.prune), "protected": sorted(self.protected),
                "already_pruned": sorted(self.already_pruned), "bytes_freed": self.bytes_freed,
                "dry_run": self.dry_run}


def _versions(store: Repository, pruned: set[str]) -> list[Version]:
    """Every indexed version as users see it (`Store.version`): metrics annotated after the save laid over the
    record's, so that a policy ranks by them. Built with the annotations as stored, `KeepBest` read the metrics
    of the record only and pruned the version `annotate(v, metrics=...)` had made the best (a hunt)."""
    annotations = store.catalog.all_annotations()
    return [with_annotations(decode_record(vid, data, pruned=vid in pruned), annotations.get(vid, {}))
            for vid, data in store.catalog.records()]


def _pruned_now(store: Repository) -> tuple[set[str], set[str]]:
    """(pruned in the catalog, marked pruned in some tier's files but not yet in the catalog).

    Markers on a shared cold tier may come from another host's prune: they are
    honoured here like a crash's leftovers, for the versions this catalog knows.
    """
    in_catalog = store.catalog.pruned_ids()
    marked: set[str] = set()
    for t in reachable_tiers(store):
        marked.update(t.iter_ids("versions", PRUNED_EXT))
    marked = {vid for vid in marked - in_catalog if store.catalog.record(vid) is not None}
    return in_catalog, marked


def reachable_tiers(store: Repository) -> list[Tier]:
    """The catalog's tier and every other tier whose FORMAT file is there: as the flusher does, never write into
    (or trust the emptiness of) an unmounted cold tier."""
    out = [store.tier]
    for t in store.tiers:
        if t is not store.tier:
            try:
                if (t.root / "FORMAT").is_file():
                    out.append(t)
            except OSError:
                continue
    return out


def _chunks_of(store: Repository, mids: Iterable[str]) -> set[bytes]:
    """Chunk ids the readable manifests among `mids` name (a broken version still gets pruned; gc will refuse
    to run while a live version's manifest is unreadable)."""
    out: set[bytes] = set()
    for mid in mids:
        try:
            col = store.manifest(mid).table.column("chunks").combine_chunks()
        except DataStatesError:
            continue
        out.update(col.flatten().to_pylist())
    return out


def _leased(store: Repository) -> set[str]:
    """Ancestors of the branches under a live lease (a population running in any process on this store).
    An unreadable lease file protects the ancestors of every branch, and a leased branch whose lineage reaches a
    version not on this node protects every version: keeping too much is safe."""
    from ..meta.leases import live
    from ..query.lineage import ancestors

    leases, bad = live(store.root)
    if bad:
        log.warning("unreadable lease file(s) %s: keeping the ancestors of every branch; "
                    "remove them once no population runs", ", ".join(bad))
    prefixes = [""] if bad else [lease.prefix for lease in leases]
    out: set[str] = set()
    graph = store.graph
    for name, vid in store.refs.names("branch").items():
        if any(name.startswith(p) for p in prefixes):
            line = [vid, *ancestors(graph, vid)]
            if any(graph.absent_parents(x) for x in line):
                # The walk ended at a parent this node lacks (kept off cold by the flush policy): which versions
                # past it the branch descends from is unknown here, so every one is kept.
                log.warning("branch %r descends from versions not on this node: keeping every version", name)
                return {vid for vid, _ in store.catalog.raw_records()}
            out.update(line)
    return out


def _plan(store: Repository, retention: Policy, dry_run: bool) -> tuple[PrunePlan, set[str]]:
    in_catalog, marked_only = _pruned_now(store)
    already = in_catalog | marked_only
    versions = _versions(store, already)
    candidates = [v for v in versions if v.id not in already]
    ids = {v.id for v in candidates}
    refs: set[str] = set()
    for t in reachable_tiers(store):  # a shared cold tier may carry other hosts' branches and tags
        refs.update(store.refs_on(t).names("branch").values())
        refs.update(store.refs_on(t).names("tag").values())
    protected = (refs | protected_ids(store) | _leased(store)) & ids
    keep = (retention.keep(list(candidates), store) & ids) | protected
    doomed = ids - keep
    # Bytes gc can free: chunks of the doomed versions that no version keeping its bytes names.
    by_id = {v.id: v for v in versions}
    staying = _chunks_of(store, {m for vid in keep for m in by_id[vid].manifests.values()})
    going = _chunks_of(store, {m for vid in doomed for m in by_id[vid].manifests.values()}
                       - {m for vid in keep for m in by_id[vid].manifests.values()})
    gone = list(going - staying)
    freed = sum(loc.length for loc in store.catalog.chunks(gone) if loc is not None)
    plan = PrunePlan(frozenset(keep), frozenset(doomed), frozenset(protected), frozenset(already), freed, dry_run)
    return plan, marked_only


def _check_policy(retention: Any) -> None:
    if not isinstance(retention, Policy):
        raise ArgumentTypeError(
            f"{shown(retention)} is not a retention policy; give one such as KeepLatest(5), "
            "Retention(KeepLatest(5), KeepBest(3, 'metrics.loss')) or KeepBranchHeads() (from datastates.retention)")


def plan(store: Repository, retention: Policy) -> PrunePlan:
    """What `prune(store, retention)` would do now; changes nothing and takes no lock.

    `bytes_freed` counts the manifests that can be read (a version whose manifest
    is gone is still planned, its bytes uncounted). Raises what a policy or protector raises.
    """
    store = as_repository(store)
    _check_policy(retention)
    return _plan(store, retention, dry_run=True)[0]


def prune(store: Repository, retention: Policy, dry_run: bool = False) -> PrunePlan:
    """Mark pruned every version `retention` does not keep (tags, branch heads, protected ids always stay).

    Holds the tier's exclusive lock (saves wait) and the ref lock (no branch or
    tag can move onto a version while it is being pruned). Marks go to the
    files first (`versions/<ab>/<id>.pruned`, fsync'd, on every reachable tier),
    then to the catalog; a mark a crash left only in the files is completed here.
    A cold tier that is unreachable (no FORMAT) is logged as a warning: it gets
    the marker of a version with its record when the flusher publishes it, and
    those of versions already there from the next prune (or `fsck --repair`). Bytes are freed
    later by `datastates.gc.gc`. Raises what `plan` raises (nothing changed then).
    """
    store = as_repository(store)
    if dry_run:
        return plan(store, retention)
    store.check_open()
    _check_policy(retention)
    tier = store.tier
    with tier.exclusive(), store.refs.locked():
        result, marked_only = _plan(store, retention, dry_run=False)
        tiers = reachable_tiers(store)
        away = [t for t in store.tiers if all(t is not r for r in tiers)]
        if away and (result.prune or marked_only):
            # Said, not silent: until the markers are there, a node that opens that tier (a fresh hot directory
            # after this one is lost) takes these versions for live ones.
            log.warning("prune: tier %s is unreachable (no FORMAT file: unmounted?); the pruned markers of %d "
                        "version(s) are written on %s only. The flusher writes the marker with each record it "
                        "publishes there, and the next prune (or `datastates fsck --repair`) writes the others "
                        "once the tier is back", ", ".join(str(t.root) for t in away),
                        len(result.prune | marked_only), ", ".join(t.name for t in tiers))
        for vid in sorted(result.prune):
            _mark(store, vid, tiers)
        for vid in sorted(marked_only):
            _mark(store, vid, tiers)  # roll forward a prune a crash (or another host) left only in the files
        _complete_markers(store, result.prune | result.already_pruned, tiers)
        if result.prune or marked_only:
            _bump_generation(store)
    return result


def _mark(store: Repository, vid: str, tiers: list[Tier]) -> None:
    """Mark `vid` pruned: a marker on every reachable tier (the saving tier first), then the catalog flag."""
    for t in tiers:
        try:
            write_marker(t, vid)
        except OSError:
            if t is store.tier:
                raise
            # A shared tier that failed now gets its marker from the next prune (see _complete_markers).
            log.warning("could not write the pruned marker of %s on tier %s", vid[:12], t.name)
    store.catalog.update_extra(vid, {"pruned": True}, only_if_missing="pruned")


def _complete_markers(store: Repository, pruned: Iterable[str], tiers: list[Tier]) -> None:
    """Write the markers an earlier prune could not write on a tier that was unreachable then."""
    for t in tiers:
        if t is store.tier:
            continue
        have = set(t.iter_ids("versions", PRUNED_EXT))
        for vid in sorted(set(pruned) - have):
            try:
                write_marker(t, vid)
            except OSError:
                log.warning("could not write the pruned marker of %s on tier %s", vid[:12], t.name)
                break


def _bump_generation(store: Repository) -> None:
    # Catalog.set_extra does not bump the generation counter that keys the versions-table cache (find, the
    # REST listing). Two transactions, not one: saves and annotations, which also bump it, are kept out by
    # the locks prune holds; a racing Store.refresh in another process costs at most a stale cache there.
    cat = store.catalog
    raw = cat.meta("generation")
    cat.set_meta("generation", str((int(raw) if raw else 0) + 1))


def is_pruned(store: Repository, vid: str) -> bool:
    """True if version `vid` is marked pruned in the catalog or in the files of a reachable tier."""
    store = as_repository(store)
    return bool(store.catalog.extra(vid).get("pruned")) or any(
        marker_path(t, vid).exists() for t in reachable_tiers(store))


__all__ = [
    "KeepBest", "KeepBranchHeads", "KeepEvery", "KeepIf", "KeepLatest", "KeepTagged", "Policy", "PrunePlan",
    "Retention", "is_pruned", "marker_path", "metric_value", "plan", "protected_ids", "prune",
    "register_protector", "unregister_protector",
]
