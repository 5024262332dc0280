"""Eviction: keep the hot tier under its capacity without ever dropping a pack that is the only
durable copy of something, or that a version not yet on cold still needs."""

from __future__ import annotations

from ..errors import DataStatesError
from ..meta.versions import decode_record
from ..repo.repository import Repository


class Evictor:
    """Drops least recently used hot packs that cold holds whole.

    Never dropped: a pack cold does not hold, one a version not yet on cold names (flushed later,
    or never, by policy: a cold gc may delete cold's copy meanwhile), one a save in flight in this
    process reuses chunks from (pinned). Runs under the hot ref lock, as commits do, so a save of
    another process either committed before (its packs are kept) or restores what it reused before
    it commits (`ObjectStore.restore_pins`).
    """

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self._packs_seen: dict[str, frozenset[str]] = {}
        """packs_of(version) of versions not on cold, as last computed. Safe to keep: a location only
        moves off a pack that is not on hot (a rewrite), or by gc, which calls `forget`."""

    def forget(self) -> None:
        with self.repo.objects.evict_lock:
            self._packs_seen.clear()

    def evict(self) -> None:
        objects = self.repo.objects
        if not objects.hot_over_capacity():
            return
        with objects.evict_lock, self.repo.refs.locked():
            objects.drop_lru(self._packs_only_hot_may_hold())

    def _packs_only_hot_may_hold(self) -> set[str]:
        """Packs that versions not yet on cold (nor pruned) name: their only durable copy may be hot's."""
        out: set[str] = set()
        catalog = self.repo.catalog
        for vid, data in catalog.records():
            extra = catalog.extra(vid)
            if extra.get("cold") or extra.get("pruned"):
                self._packs_seen.pop(vid, None)
                continue
            packs = self._packs_seen.get(vid)
            if packs is None:
                try:
                    packs = self._packs_seen[vid] = frozenset(self.repo.packs_of(decode_record(vid, data)))
                except DataStatesError:
                    continue  # a manifest unreadable here: fsck reports it
            out |= packs
        return out
