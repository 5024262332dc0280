"""The repository: an object store, a catalog and refs tied together (dulwich's `Repo`).

This is what the query side and maintenance work on: it resolves refs to
version ids, reads version records and manifests, names the packs a version
needs and which tiers hold it whole, and writes annotations. It has no save
engine and no background threads; `Store` wires one around it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from functools import partial
from pathlib import Path
from typing import Any

from ..base.config import TierConfig
from ..errors import (
    AmbiguousRefError,
    ConflictError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotFoundError,
    PrunedError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreFormatError,
)
from ..meta.catalog import Catalog, forked_child_error, read_only_message
from ..meta.graph import CatalogGraph, missing_version, unreached
from ..meta.refs import HEX_ID, RefStore, check_name
from ..meta.versions import (
    LATER_METRICS,
    Version,
    cut,
    decode_record,
    encode_annotations,
    merge_metrics,
    plain_json,
    readable,
    shown,
    with_annotations,
)
from ..objects.object_store import ObjectStore
from ..objects.tier import Tier
from ..save.job import SaveHandle
from ..save.manifest import Manifest

log = logging.getLogger("datastates")
_REF_SUFFIX = re.compile(r"(.*?)((?:~[0-9]*|\^)+)")  # ASCII digits: int() reads "~１" (full width) as ~1
_ID_PREFIX = re.compile(r"[0-9a-fA-F]{6,64}")  # what resolve reads as an id prefix (any case)


class Repository:
    """Objects + catalog + refs of one store. Refs live on the hot tier (the only one without tiers);
    the cold tier's refs are what other hosts see, published by the flusher."""

    def __init__(self, objects: ObjectStore, catalog: Catalog, *, chunk_size: int,
                 tiering: TierConfig | None = None, root: Path | None = None) -> None:
        self.objects = objects
        self.catalog = catalog
        catalog.record_source = objects.read_record_bytes  # a damaged catalog copy is re-read from the files
        self.chunk_size = chunk_size
        self.tiering = tiering or TierConfig()
        self.root = root or objects.hot.root
        self.refs = RefStore(objects.hot.root, shared=objects.hot.shared)
        """Branches and tags as this process sees and moves them."""
        self.cold_refs = None if objects.cold is None else RefStore(objects.cold.root, shared=True)
        """The shared tier's refs (None without tiers)."""
        self.closed = False
        """Set when closing starts: no new call is taken (saves in flight and the flusher still finish)."""
        self.released = False
        """Set once the files and the catalog are let go: nothing can be read any more."""
        self.pid = os.getpid()
        """The process that opened it: a forked child shares none of its threads, and LMDB forbids using an
        environment across fork."""
        self.owner: Any = None
        """The object users hold for this repository (the Store), handed to retention protectors."""
        self._manifests: dict[str, Manifest] = {}
        self.shared_closed: Path | None = None
        """The cold tier, when this process may not write it (another user's store, read through a hot tier of
        this user's own): saves and ref changes are refused, the hot tier's catalog and cache are written."""
        self.writes_refused: str | None = None
        """Why this open may read but not write, when it was opened so for a reason of its own (a one-tier store
        read through a hot tier given for this open only): what a call that writes raises."""

    # the parts, by the names maintenance code uses -------------------------------------
    @property
    def tier(self) -> Tier:
        """The tier saves write to (the hot tier when there are two)."""
        return self.objects.hot

    @property
    def hot(self) -> Tier:
        return self.objects.hot

    @property
    def cold(self) -> Tier | None:
        return self.objects.cold

    @property
    def tiers(self) -> list[Tier]:
        return self.objects.tiers

    @property
    def verify(self) -> bool:
        return self.objects.verify

    @property
    def path(self) -> Path:
        """The store directory the user opened (the cold tier when there are two)."""
        return self.root

    def refs_on(self, tier: Tier) -> RefStore:
        """The refs kept on `tier`."""
        if tier is self.objects.hot:
            return self.refs
        if tier is self.objects.cold and self.cold_refs is not None:
            return self.cold_refs
        return RefStore(tier.root, shared=tier.shared)

    def check_open(self) -> None:
        """StoreClosedError once closing has started (for the calls that begin something), and in a forked child."""
        if self.closed:
            raise StoreClosedError.of(self.path)
        if os.getpid() != self.pid:
            raise self._forked()

    @property
    def read_only(self) -> bool:
        """Opened read-only (`Store.open(..., read_only=True)`, or a store this process may not write: its catalog,
        or its shared cold tier, read through a hot tier of this user's own)."""
        return self.catalog.read_only or self.shared_closed is not None or self.writes_refused is not None

    def check_writable(self) -> None:
        """check_open, then ReadOnlyStoreError on a store opened read-only (for the calls that write), and
        StoreFormatError when the tier saves write to was deleted while the store was open."""
        self.check_catalog_writable()
        if self.shared_closed is not None:
            raise ReadOnlyStoreError(read_only_message(self.path, self.shared_closed))
        if self.writes_refused is not None:
            raise ReadOnlyStoreError(self.writes_refused)
        if not (self.tier.root / "FORMAT").exists():
            # Its refs gone, a save would have started a new line with no parent, and its files a directory
            # without FORMAT that no later open accepts (a review).
            if self.cold is None:
                raise StoreFormatError(f"store {self.path} was deleted while open (its FORMAT file is gone): nothing "
                                       "was written")
            raise StoreFormatError(
                f"hot tier {self.tier.root} was deleted while the store was open (its FORMAT file is gone): nothing "
                "was written. Close the store and open it again: the hot tier is made anew, and the versions on "
                "cold come back from there")

    def check_catalog_writable(self) -> None:
        """check_open, then ReadOnlyStoreError when this node's catalog was opened read-only (refresh writes only
        that, and may run on another user's store read through a hot tier of one's own)."""
        self.check_open()
        if self.catalog.read_only:
            raise ReadOnlyStoreError(read_only_message(self.path, self.catalog.unwritable))

    def check_readable(self) -> None:
        """StoreClosedError once the catalog is let go (for reads: the drain of a closing store still reads), and in
        a forked child."""
        if self.released:
            raise StoreClosedError.of(self.path)
        if os.getpid() != self.pid:
            raise self._forked()

    def _forked(self) -> StoreClosedError:
        return forked_child_error(self.path)

    # refs -------------------------------------------------------------------------------
    def resolve(self, ref: Any) -> str:
        """The full version id named by `ref`: an id, a unique prefix (>= 6 hex), a branch, a tag, `REF~N`.

        Raises StoreClosedError, NotFoundError, AmbiguousRefError.
        """
        self.check_readable()  # every read names a version first: after close() the catalog is gone (lmdb.Error)
        if isinstance(ref, Version):
            return ref.id
        if isinstance(ref, SaveHandle):
            return ref.result().id
        if not isinstance(ref, str) or not ref:
            what = "is empty" if ref == "" else "is not a string"
            raise NotFoundError(f"ref {shown(ref)} {what}; give a version id, branch or tag")
        m = _REF_SUFFIX.fullmatch(ref)  # ($ would match before a trailing newline: 'main~1\n' read as main~1)
        if m and m.group(1):
            base, suffix = m.group(1), m.group(2)
            # A count of more than 18 digits (int() refuses over 4300, a ValueError) is past any chain's root.
            n = sum((int(x.lstrip("0") or "0") if len(x.lstrip("0")) <= 18 else 10**18) if x else 1
                    for x in re.findall(r"~([0-9]*)", suffix))  # (leading zeros count for nothing: ~0001 is ~1)
            n += suffix.count("^")
            vid = self.resolve(base)
            for i in range(n):
                parents = self.parents(vid)
                if not parents:
                    raise NotFoundError(
                        f"{cut(ref, 80)} goes past the root: {base} has only {i + 1} version(s) in its first-parent "
                        "chain")
                vid = parents[0]
            return vid
        kind_name = ref.split(":", 1)
        if len(kind_name) == 2 and kind_name[0] in ("branch", "tag"):  # qualified: `branch:best`, `tag:best`
            found_ref = self.refs.get(kind_name[0], kind_name[1])  # type: ignore[arg-type]
            if found_ref is None:
                raise NotFoundError(f"no {kind_name[0]} named {kind_name[1]!r}; `datastates {kind_name[0]}` "
                                    f"lists the {kind_name[0]}{'es' if kind_name[0] == 'branch' else 's'}")
            return found_ref
        if HEX_ID.match(ref) and self.catalog.record(ref) is not None:
            return ref
        for kind in ("branch", "tag"):
            found_ref = self.refs.get(kind, ref)  # type: ignore[arg-type]
            if found_ref is not None:
                return found_ref
        if _ID_PREFIX.fullmatch(ref):
            # Ids are lower-case hex; one copied from an upper-casing tool still names its version.
            found = self.catalog.ids_with_prefix(ref.lower(), limit=5)
            if len(found) == 1:
                return found[0]
            if found:
                raise AmbiguousRefError(
                    f"prefix {ref!r} matches several versions ({', '.join(f[:12] for f in found)}...); give more digits"
                )
        elif re.fullmatch(r"[0-9a-f]{1,5}", ref):
            raise NotFoundError(f"ref {ref!r} is too short to be an id prefix (6 hex digits at least)")
        if self.catalog.version_count() == 0:  # pointing at `datastates log` would only repeat the failure
            raise NotFoundError(f"ref {shown(ref)} names nothing: the store has no versions yet; save one first "
                                "(Store.save in Python)")
        # Not `datastates log`: it starts at main, which may be the very ref missing (fsck --repair moves a
        # damaged one to quarantine/), and would fail the same way.
        raise NotFoundError(
            f"ref {shown(ref)} is not a branch, tag or version id; `datastates find` lists every version, "
            "`datastates branch` the branches, `datastates tag` the tags, `datastates fsck` damaged ones"
        )

    def branches(self) -> dict[str, str]:
        self.check_readable()
        return self.refs.names("branch")

    def tags(self) -> dict[str, str]:
        self.check_readable()
        return self.refs.names("tag")

    def create_branch(self, name: str, at: Any = "main", *, force: bool = False) -> str:
        """Create branch `name` at `at`; with force, move an existing one (logged). Returns the id.

        Raises StoreClosedError, InvalidNameError, NotFoundError, ConflictError (exists, without force),
        PrunedError (`at` was pruned).
        """
        self.check_writable()
        check_name(name, "branch")
        vid = self.resolve(at)
        self.check_unlike_other_kind("branch", name)
        kept = partial(self.refuse_pruned, vid, "branch")  # under the ref lock: a prune holds it to decide
        if force:
            with self.refs.locked():
                old = self.refs.get("branch", name)
                self.refs.set_if_equals("branch", name, old, vid, f"branch -f {label(at)}", locked=True, check=kept)
        else:
            self.refs.add_if_new("branch", name, vid, f"branch at {label(at)}", check=kept)
        return vid

    def create_tag(self, name: str, ref: Any = "main", message: str = "") -> str:
        """Create an immutable tag. Raises StoreClosedError, InvalidNameError, NotFoundError, ConflictError
        (exists), PrunedError (`ref` was pruned)."""
        self.check_writable()
        check_name(name, "tag")
        vid = self.resolve(ref)
        self.check_unlike_other_kind("tag", name)
        self.refs.add_if_new("tag", name, vid, message or f"tag {label(ref)}",
                             check=partial(self.refuse_pruned, vid, "tag"))
        return vid

    def refuse_pruned(self, vid: str, kind: str) -> None:
        """PrunedError if version `vid` was pruned: a `kind` ref at it would name tensors that are gone (or that
        the next gc frees) and look like a restart point, while protecting nothing and loading nothing."""
        if self.catalog.extra(vid).get("pruned"):
            raise PrunedError(f"version {vid[:12]} was pruned: its tensors are gone or freed by the next gc, so a "
                              f"{kind} at it could not be loaded; point the {kind} at a version that was kept "
                              "(`datastates log` marks the pruned ones [pruned])")

    def check_unlike_other_kind(self, kind: str, name: str) -> None:
        """ConflictError if a new `kind` ref `name` would share its name with a ref of the other kind, or be
        the prefix of a version's id (a bare name would then silently mean one of them). Existing refs of the
        same kind pass."""
        other = "tag" if kind == "branch" else "branch"
        if self.refs.get(kind, name) is not None:  # type: ignore[arg-type]
            return
        if self.refs.get(other, name) is not None:  # type: ignore[arg-type]
            raise ConflictError(
                f"a {other} named {name!r} exists; pick another name for the {kind} "
                f"(refer to the existing one unambiguously as {other}:{name})")
        # Refs resolve before id prefixes (as in git): such a ref would hide the version its name abbreviates.
        if _ID_PREFIX.fullmatch(name) and (found := self.catalog.ids_with_prefix(name.lower(), limit=1)):
            raise ConflictError(
                f"{kind} name {name!r} is the start of version {found[0][:12]}'s id, which the {kind} would then "
                f"hide wherever {name!r} is given; pick another name, e.g. 'v-{name}'")

    def unreachable_if_deleted(self, kind: str, name: str) -> int:
        """How many versions no ref would reach (by name, as ancestor-or-self of a branch or tag head)
        once ref `name` is gone. Raises InvalidNameError (not a string), NotFoundError."""
        _check_ref_name(kind, name)
        head = self.refs.get(kind, name)  # type: ignore[arg-type]
        if head is None:
            raise NotFoundError(f"no {kind} named {name!r}; `datastates {kind}` lists them")
        return unreached(self.graph, head, self.refs.heads_but(kind, name))  # type: ignore[arg-type]

    def delete_ref(self, kind: str, name: str, *, force: bool = True) -> str:
        """Delete a branch or tag here and on cold (else the next open's refresh would bring it back).
        Without `force`, a branch whose head no other ref reaches is kept (like `git branch -d`).
        Returns the id it named. Raises StoreClosedError, InvalidNameError (not a string), NotFoundError,
        ConflictError (unmerged, without force)."""
        self.check_writable()
        _check_ref_name(kind, name)
        if not force:
            lost = self.unreachable_if_deleted(kind, name)
            if lost:
                raise ConflictError(
                    f"{kind} {name!r} is the only ref reaching {lost} version(s); they would stay reachable "
                    f"only by id and the reflog. Delete anyway with `datastates {kind} -D {name}` "
                    f"(Store.delete_{kind}({name!r}, force=True)), or tag its head first")
        vid = self.refs.remove_if_equals(kind, name, message="delete")  # type: ignore[arg-type]
        if self.cold_refs is not None:
            try:
                self.cold_refs.remove_if_equals(kind, name, vid, message="delete")  # type: ignore[arg-type]
            except (NotFoundError, ConflictError):
                pass  # absent on cold, or another host moved it there: theirs to keep
            except OSError as exc:
                log.warning("could not delete %s %r on cold (%s); it may come back at the next open", kind, name, exc)
        return vid

    # versions ---------------------------------------------------------------------------
    def version(self, ref: Any, annotated: bool = True) -> Version:
        """The Version named by `ref`, with its annotations (later metrics laid over the record's) unless
        `annotated` is False: a load needs only the record and whether the version was pruned or damaged.
        Raises StoreClosedError, NotFoundError, IntegrityError."""
        vid = self.resolve(ref)
        got = self.catalog.entry(vid, annotations=annotated)
        if got is None:
            raise missing_version(vid)
        data, extra, notes = got
        v = decode_record(vid, data, timings=extra.get("timings", {}), pruned=bool(extra.get("pruned")),
                          damaged=extra.get("damaged") or None)
        return with_annotations(v, notes) if annotated else v

    def parents(self, vid: str) -> list[str]:
        data = self.catalog.record(vid)
        if data is None:
            raise missing_version(vid)
        return list(json.loads(data).get("parents", []))

    @property
    def graph(self) -> CatalogGraph:
        return CatalogGraph(self.catalog)

    # manifests and chunks ---------------------------------------------------------------
    def manifest(self, mid: str) -> Manifest:
        """Manifest `mid`, verified (cached). Raises NotFoundError, IntegrityError."""
        m = self._manifests.get(mid)
        if m is None:
            m = Manifest(mid, self.objects.read_manifest_bytes(mid), verify=self.objects.verify)
            if len(self._manifests) > 256:
                self._manifests.clear()
            self._manifests[mid] = m
        return m

    def manifest_of(self, v: Version, rank: int | str = 0) -> Manifest:
        if v.pruned:
            raise PrunedError(f"version {v.short} was pruned: its record is kept for lineage, its tensors are gone; "
                              "load a version that was kept (`datastates log` marks the pruned ones [pruned])")
        if v.damaged:
            raise IntegrityError(f"version {v.short} is damaged: {v.damaged} had no intact copy and is in "
                                 "quarantine/ (see quarantine/report.jsonl); restore that file from a backup, "
                                 "then run `datastates fsck --repair`")
        mid = v.manifests.get(str(rank))
        if mid is None:
            raise NotFoundError(f"version {v.short} has no rank {rank} (world size {v.world_size})")
        return self.manifest(mid)

    def read_chunk(self, cid: bytes, key: str = "?") -> bytes:
        """The raw bytes of one chunk, verified. Raises NotFoundError, IntegrityError."""
        return self.objects.read_chunk(cid, key)

    def packs_of(self, v: Version) -> set[str]:
        """The packs the catalog locates `v`'s chunks in (none for a pruned version).
        Raises NotFoundError/IntegrityError if a manifest of `v` cannot be read."""
        packs: set[str] = set()
        if not v.pruned:
            for mid in v.manifests.values():
                m = self.manifest(mid)
                packs |= {loc.pack for r in m.rows for loc in self.catalog.chunks(r["chunks"]) if loc is not None}
        return packs

    def where(self, ref: Any) -> list[str]:
        """Names of the tiers that hold the version wholly (record, manifests, every pack)."""
        v = self.version(ref)
        packs = self.packs_of(v)
        out = []
        for t in self.tiers:
            try:
                ok = t.record_path(v.id).exists() and all(t.manifest_path(mid).exists() for mid in v.manifests.values())
                ok = ok and all(t.pack_path(p).exists() for p in packs)
            except OSError:
                ok = False
            if ok:
                out.append(t.name)
        return out

    # annotations --------------------------------------------------------------------------
    def annotate(self, ref: Any, /, *, metrics: Any = None, annotations: Any = None, **values: Any) -> Version:
        """Add or change mutable annotations (never part of the id).

        `metrics={...}` (numbers or None, as for save) are metrics computed after the save: they read
        as the version's metrics (`Version.metrics`, `find("metrics.x ...")`, the versions table),
        laid over the record's. `annotations={...}` and `key=value` are free-form annotations (any
        name: `ref` is positional only, so `self=1` and `ref=2` are annotations too). Keys starting with
        '_' are reserved. Raises StoreClosedError, InvalidArgumentError,
        UnsupportedValueError, NotFoundError, ReadOnlyStoreError.
        """
        self.check_writable()
        vid = self.resolve(ref)
        later = plain_json(metrics, "metrics", numbers_only=True)
        flat = plain_json(annotations, "annotations")
        flat.update(plain_json(values, "annotations"))
        reserved = [k for k in flat if k.startswith("_")]
        if reserved:
            raise InvalidArgumentError(f"annotation {reserved[0]!r}: keys starting with '_' are reserved; "
                                       "rename it")
        with self.refs.locked():
            current = self.catalog.annotations(vid)
            current.update(flat)
            if later:
                current[LATER_METRICS] = merge_metrics(current.get(LATER_METRICS) or {}, later)
            current["_updated"] = time.time()
            data = encode_annotations(current)
            self.tier.write_annotations(vid, data)
            self.catalog.set_annotations(vid, current)
            if self.cold is not None and self.catalog.extra(vid).get("cold"):
                # Already flushed: the flusher will not copy them again, so keep cold's copy current here
                # (annotations are user data; a lost hot tier must not lose them).
                try:
                    self.cold.write_annotations(vid, data)
                except OSError as exc:
                    log.warning("annotations of %s not copied to the cold tier (%s); they are on hot", vid[:12], exc)
        return self.version(vid)

    def du(self) -> dict[str, int]:
        """Bytes as the versions see them (total) against bytes actually stored (unique)."""
        self.check_readable()
        total = sum(readable(json.loads(rec))[0]["bytes_total"] for _, rec in self.catalog.records())
        unique = sum(loc.raw_length for _, loc in self.catalog.iter_chunks())
        packs = list((self.path / "packs").glob("*.pack"))
        return {"versions": self.catalog.version_count(), "bytes_total": total, "bytes_unique": unique,
                "bytes_on_disk": sum(p.stat().st_size for p in packs), "packs": len(packs)}

    def close(self) -> None:
        self.closed = self.released = True
        self.objects.close()
        self.catalog.close()


def as_repository(store: Any) -> Repository:
    """The Repository behind `store`: maintenance and query functions take either the `Store` facade
    users hold or a Repository (without importing the facade)."""
    repo = getattr(store, "repo", store)
    if not isinstance(repo, Repository):
        raise TypeError(f"expected a datastates Store or Repository, not {type(store).__name__}")
    return repo


def _check_ref_name(kind: str, name: Any) -> None:
    """InvalidNameError for a ref name that is not a non-empty str (no ref can have it), before any lookup."""
    if not isinstance(name, str) or not name:
        raise InvalidNameError(f"{kind} name {name!r} is not a name; `datastates {kind}` lists the "
                               f"{kind}{'es' if kind == 'branch' else 's'}")


def label(ref: Any) -> str:
    """A short printable name for a ref argument (reflog messages)."""
    if isinstance(ref, Version):
        return ref.short
    return str(ref) if isinstance(ref, str) else type(ref).__name__
