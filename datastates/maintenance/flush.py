"""The flusher: copies committed versions from the hot tier to the cold tier, in commit order.

For each version it copies the packs holding its chunks (those not on cold
yet), then, under cold's sweep lock (see `Tier.sweep_lock`), checks them
again and writes its manifests and its record (a version pruned meanwhile,
while cold was unreachable say: its pruned marker, then its record, never
the record alone), then moves refs on cold
(fast-forward only, compare-and-swap under the cold tier's lock file), and
only then marks the version resident on cold. A crash at any point leaves at
most temp files on cold; the version stays pending and is flushed again by
the next process that opens the store. When cold is unreachable the flusher
retries with exponential backoff and reports its backlog; saves keep landing
on hot meanwhile.

In a job of many ranks, each with a node-local hot tier, the flush is parallel: every rank's flusher
copies the packs that rank wrote (role "part"); rank 0's (role "publisher") copies its own, waits
until every pack of the version is on cold, and alone writes the manifests, the record and the refs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..base.comm import comm_timeout
from ..base.files import copy_file, replace, write_new
from ..errors import ConflictError, DataStatesError, IntegrityError
from .retention import write_marker

if TYPE_CHECKING:
    from ..repo.repository import Repository

log = logging.getLogger("datastates.flush")


class _Waiting(Exception):
    """The publisher waits for other ranks' packs to reach cold: not a failure of cold."""


ROLES = ("all", "part", "publisher")


def ref_conflicts(store: Repository) -> list[str]:
    """The refs this node and the cold tier disagree on for good: a branch whose two heads are not on one line
    (neither an ancestor of the other: another node moved it on cold meanwhile), a tag naming two versions. Read
    from the refs, so any process sees them (`datastates tiers`), not only the one whose flush met them; a head
    the catalog does not hold yet (not refreshed) is not judged. Empty without a cold tier or when it is
    unreachable."""
    from ..query.lineage import is_ancestor

    if store.cold_refs is None:
        return []
    out: list[str] = []
    try:
        cold_branches, cold_tags = store.cold_refs.names("branch"), store.cold_refs.names("tag")
    except OSError:
        return []
    graph, catalog = store.graph, store.catalog
    for name, here in sorted(store.refs.names("branch").items()):
        there = cold_branches.get(name)
        if there is None or there == here or catalog.record(there) is None or catalog.record(here) is None:
            continue
        if not is_ancestor(graph, there, here) and not is_ancestor(graph, here, there):
            out.append(f"branch {name!r} is at {here[:12]} here and at {there[:12]} on cold, on two lines; "
                       f"keep one: `datastates branch -f {name} {there[:12]}` takes cold's (or save under "
                       f"another branch name); cold keeps this line as branch {name}@HOST until you delete it")
    for name, here in sorted(store.refs.names("tag").items()):
        there = cold_tags.get(name)
        if there is not None and there != here:
            out.append(f"tag {name!r} names {here[:12]} here and {there[:12]} on cold")
    return out


class Flusher:
    """Background copier hot -> cold; one per tiered store.

    `role`: "all" (one process: copy everything, publish), "part" (a rank of a job other than 0: copy
    the packs this rank wrote, or on resume the ones this node holds; never publish), "publisher"
    (rank 0: copy its own, wait up to the collective timeout for the other ranks' packs on cold, then
    publish)."""

    def __init__(self, store: Repository, role: str = "all") -> None:
        assert role in ROLES
        self.store = store
        self.role = role
        self._own: dict[str, set[str]] = {}
        """Version -> the packs this rank wrote of it (roles part and publisher)."""
        self._waiting_since: dict[str, float] = {}
        self._queue: deque[str] = deque()
        self._queued: set[str] = set()
        self._cv = threading.Condition()
        self._stop = False
        self._busy = False
        self.failures = 0
        self.last_error: str | None = None
        self.conflicts: list[str] = []
        self._counts: dict[str | None, int] = {}
        self._thread = threading.Thread(target=self._run, name="datastates-flusher", daemon=True)
        self._thread.start()

    # policy and queue ------------------------------------------------------------
    def resume(self) -> None:
        """Queue, oldest first, what an earlier process committed but left unflushed."""
        catalog = self.store.catalog
        pending = []
        for vid, data in catalog.records():
            extra = catalog.extra(vid)
            if extra.get("flush") == "pending" and not extra.get("cold"):
                pending.append((json.loads(data).get("created", 0.0), vid))
        for _, vid in sorted(pending):
            self.enqueue(vid)

    def wants(self, branch: str | None) -> bool:
        """The flush policy for a new version on `branch`: every Nth per branch (per process), or none
        with `tagged_only` (tags queue their version themselves)."""
        policy = self.store.tiering.flush
        if policy.tagged_only:
            return False
        n = self._counts[branch] = self._counts.get(branch, 0) + 1
        return n % max(1, policy.every) == 0

    def queue(self, vid: str) -> None:
        """Mark `vid` pending in the catalog (so a restart flushes it too), then enqueue it."""
        self.store.catalog.update_extra(vid, {"flush": "pending"}, only_if_missing="cold")
        self.enqueue(vid)

    def flushed(self, vid: str, timeout: float | None) -> bool:
        """Wait up to `timeout` for the backlog through `vid`; True if `vid` is on cold."""
        self.wait(timeout, vid)
        return bool(self.store.catalog.extra(vid).get("cold"))

    def enqueue(self, vid: str, own: set[str] | None = None) -> None:
        """Queue `vid`; `own`: the packs this rank wrote of it (a job of many ranks)."""
        with self._cv:
            if own is not None:
                self._own[vid] = set(own)
            if vid not in self._queued:
                self._queue.append(vid)
                self._queued.add(vid)
                self._cv.notify_all()

    @property
    def backlog(self) -> int:
        with self._cv:
            return len(self._queue) + (1 if self._busy else 0)

    def pending(self) -> list[str]:
        with self._cv:
            return list(self._queue)

    def wait(self, timeout: float | None = None, vid: str | None = None) -> bool:
        """Block until the queue is empty (or `vid` is flushed); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while (vid in self._queued) if vid is not None else (self._queue or self._busy):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
            return True

    def stop(self, drain: bool = True) -> None:
        """Finish the backlog (unless cold is failing), then end the thread."""
        if drain:
            while self.backlog and self.failures == 0:
                self.wait(timeout=1.0)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    # work ------------------------------------------------------------------------
    def _run(self) -> None:
        delay = 0.05
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                vid = self._queue[0]
                self._busy = True
            try:
                self.flush_version(vid)
            except _Waiting:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait(0.05)
                continue
            except (OSError, DataStatesError) as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("flush of %s to cold failed (%s); retrying in %.2fs", vid[:12], exc, delay)
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
                    self._cv.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.05
            self.failures = 0
            self.last_error = None
            with self._cv:
                self._queue.popleft()
                self._queued.discard(vid)
                self._busy = False
                self._cv.notify_all()

    def flush_version(self, vid: str) -> None:
        """Copy one version (packs, manifests, record, annotations, refs) to cold; idempotent."""
        store = self.store
        hot, cold = store.hot, store.cold
        assert cold is not None
        if not (cold.root / "FORMAT").is_file():
            # Unmounted or gone: never write into an empty mount point.
            raise FileNotFoundError(f"cold tier {cold.root} is unreachable (no FORMAT file); will retry")
        data = store.catalog.record(vid)
        if data is None:
            return  # dropped by fsck/gc meanwhile
        v = store.version(vid)
        packs = store.packs_of(v)
        if self.role != "all":
            mine = self._own.get(vid)
            self._copy_missing({p for p in packs if hot.pack_path(p).exists()} if mine is None else mine)
            if self.role == "part":
                self._own.pop(vid, None)
                store.catalog.update_extra(vid, {"cold": True}, drop=("flush",))  # this rank's part
                return
            self._wait_for_others(vid, packs)
        else:
            self._copy_missing(packs)  # the long part, outside the lock
        with cold.sweep_lock():
            # A cold-tier gc (any host) may have deleted a pack since, if no version on cold named it.
            self._copy_missing(packs)
            # Asked again under the lock: a prune may have run since `v` was read (it holds hot's locks, not
            # this one), and one run while cold was unreachable marked the version on hot only.
            if store.catalog.extra(vid).get("pruned"):
                # Its marker goes on cold before its record: no reader of cold (a gc on any host, a node opening
                # cold with a fresh hot tier) ever sees the record without it, which would make it a live version
                # whose manifests cold lacks (gc stopped on it, loads said "missing" instead of PrunedError). A
                # crash in between leaves a marker without a record, which nothing reads as a version; the
                # version stays pending and this runs again.
                write_marker(cold, vid)
            else:
                for mid in v.manifests.values():
                    if not cold.manifest_path(mid).exists():
                        write_new(cold.manifest_path(mid), store.objects.read_manifest_bytes(mid))  # verified
            write_new(cold.record_path(vid), data)
        ann = hot.annotation_path(vid)
        if ann.exists():
            replace(cold.annotation_path(vid), ann.read_bytes())
        self._publish_refs(v)
        store.catalog.update_extra(vid, {"cold": True}, drop=("flush",))
        self._own.pop(vid, None)
        self._waiting_since.pop(vid, None)

    def _keep_line(self, v: Any) -> str | None:
        """Name `v`, a version whose branch lost the race on cold (another host moved it onto another line), by a
        branch of its own on cold, `BRANCH@HOST` (`BRANCH@HOST-2`, ... when that one is on a line `v` does not
        continue), moved only forward; returns the name, None if none could be made. On cold `v` was named by
        no ref, so a prune run on any other host took it for an abandoned line and pruned this host's latest
        state (its own branch is on its hot tier, which no other host reads). Called under cold's ref lock."""
        import socket

        from ..meta.refs import check_name
        from ..query.lineage import is_ancestor

        store = self.store
        cold_refs = store.cold_refs
        assert cold_refs is not None
        base = f"{v.branch}@{socket.gethostname()}"
        for n in range(1, 100):
            name = base if n == 1 else f"{base}-{n}"
            try:
                check_name(name, "branch")
            except DataStatesError:
                break  # a branch name too long with the host's: the conflict is still reported
            try:
                head = cold_refs.get("branch", name)
            except IntegrityError:
                continue  # a damaged ref file (fsck reports it): never written over
            known = head is not None and store.catalog.record(head) is not None
            if head == v.id or (known and is_ancestor(store.graph, v.id, head)):  # type: ignore[arg-type]
                return name  # kept already: an older version of the line, flushed late (a tag queued it)
            if head is None or (known and is_ancestor(store.graph, head, v.id)):
                cold_refs.set_if_equals("branch", name, head, v.id, f"flush {v.short}: {v.branch} is on another "
                                        "line on cold", locked=True)
                return name
        log.warning("version %s lost branch %r on cold and no branch keeps it there: a prune on another host may "
                    "prune it; give it a tag", v.short, v.branch)
        return None

    def _wait_for_others(self, vid: str, packs: set[str]) -> None:
        """Raise _Waiting (retried soon) while packs of `vid` that this node lacks are not on cold yet;
        past the collective timeout, IntegrityError (a rank died before it flushed: retried with backoff)."""
        hot, cold = self.store.hot, self.store.cold
        assert cold is not None
        missing = [p for p in packs if not cold.pack_path(p).exists() and not hot.pack_path(p).exists()]
        if not missing:
            return
        since = self._waiting_since.setdefault(vid, time.monotonic())
        if time.monotonic() - since < comm_timeout():
            raise _Waiting(vid)
        raise IntegrityError(f"{len(missing)} pack(s) of version {vid[:12]} written by other ranks never reached "
                             "cold (a rank ended before its flush); the version stays on the hot tiers")

    def _copy_missing(self, packs: set[str]) -> None:
        hot, cold = self.store.hot, self.store.cold
        assert cold is not None
        for pack in sorted(packs):
            if cold.pack_path(pack).exists():
                continue
            if not hot.pack_path(pack).exists():
                raise IntegrityError(f"pack {pack} is on neither tier; `datastates fsck` lists what needs it")
            copy_file(hot.pack_path(pack), cold.pack_path(pack))

    def _publish_refs(self, v: Any) -> None:
        from ..query.lineage import is_ancestor

        store = self.store
        cold_refs = store.cold_refs
        assert cold_refs is not None
        if v.branch:
            with cold_refs.locked():
                current = cold_refs.get("branch", v.branch)
                known = current is not None and store.catalog.record(current) is not None
                if current is None or (known and current != v.id and is_ancestor(store.graph, current, v.id)):
                    cold_refs.set_if_equals("branch", v.branch, current, v.id, f"flush {v.short}", locked=True)
                elif current != v.id and not (known and is_ancestor(store.graph, v.id, current)):
                    kept = self._keep_line(v)
                    self.conflicts.append(f"branch {v.branch!r} on cold is at {current[:12]}, which is not an "
                                          f"ancestor of {v.short}; left as is"
                                          + (f", and {v.short} is kept on cold as branch {kept!r}" if kept else ""))
        for name, tid in store.refs.names("tag").items():
            if tid == v.id:
                try:
                    cold_refs.add_if_new("tag", name, v.id, "flush")
                except ConflictError:
                    if cold_refs.get("tag", name) != v.id:
                        self.conflicts.append(f"tag {name!r} on cold names another version; left as is")
