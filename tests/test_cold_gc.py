"""gc on the shared cold tier: what no version on cold needs goes, and nothing a host still needs does.

Hosts are separate hot directories over one cold directory, as in test_tiers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

import datastates as ds
from datastates.cli.maintenance import add_parsers, run
from datastates.retention import KeepLatest, Retention, prune

CHUNK = 64 << 10


def host(root: Path, name: str, **kw: Any) -> ds.Store:
    """The store as the host with hot directory `root/name` sees it."""
    return ds.Store.open(root / "cold", hot=root / name, chunk_size=CHUNK, pool_bytes=16 << 20, **kw)


def t(seed: int, n: int = 64 << 10) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))


def cold_packs(root: Path) -> set[str]:
    return {p.name for p in (root / "cold" / "packs").glob("*.pack")}


def test_a_prune_and_gc_on_one_host_reach_the_other_after_refresh(tmp_path: Path) -> None:
    a = host(tmp_path, "hot-a")
    vs = [a.save({"w": t(i)}, branch="a", step=i) for i in range(4)]
    assert a.flush(timeout=60)
    b = host(tmp_path, "hot-b")
    assert {v.id for v in b.log("a")} == {v.id for v in vs}
    assert same(b.load(vs[0])["w"], t(0))  # read from cold
    assert prune(a, Retention(KeepLatest(1))).prune == {v.id for v in vs[:3]}
    rep = a.gc(cold_grace_s=0)
    assert len(rep.packs_deleted) == 2 * 3  # hot's and cold's copy of each pruned version's pack
    assert len(cold_packs(tmp_path)) == 1
    counts = b.refresh()
    # vs[0]'s pack was promoted to b's hot by the load above: b keeps that copy (its own gc frees it)
    assert counts["pruned"] == 3 and counts["packs_gone"] == 2
    with pytest.raises(ds.PrunedError):
        b.load(vs[0])
    assert same(b.load("a")["w"], t(3))
    assert b.fsck().ok and a.fsck().ok
    a.close()
    b.close()


def test_a_version_not_yet_on_cold_survives_a_cold_gc_of_the_pack_it_shares(tmp_path: Path) -> None:
    """Host b reuses chunks that a's (later pruned) version put on cold, flushes only later:
    b wrote its own copy to hot, and its flush puts a copy back on cold."""
    a = host(tmp_path, "hot-a")
    shared = t(7)
    v0 = a.save({"w": shared}, branch="a")
    assert a.flush(timeout=60)
    b = host(tmp_path, "hot-b", flush=ds.Flush(tagged_only=True))  # nothing reaches cold until asked
    vb = b.save({"w": shared, "x": t(8)}, branch="b")
    assert vb.bytes_new == 2 * shared.nbytes  # "w" was only on cold: written again on b's hot
    a.save({"w": t(9)}, branch="a")
    assert a.flush(timeout=60)  # until then cold's branch "a" still names v0, which keeps it
    assert prune(a, Retention(KeepLatest(1))).prune == {v0.id}
    a.gc(cold_grace_s=0)
    assert a.where(v0) == []
    assert same(b.load(vb)["w"], shared)
    assert b.flush(vb, timeout=60) and b.where(vb) == ["hot", "cold"]
    b.close()
    with host(tmp_path, "hot-c") as c:  # a fresh host: everything comes from cold
        assert same(c.load(vb.id)["w"], shared) and same(c.load(vb.id)["x"], t(8))
        assert c.fsck().ok
    a.close()


def test_a_flush_after_cold_gc_copies_a_collected_pack_again(tmp_path: Path) -> None:
    """One host: v2 reuses chunks of flushed v1 from hot; v1 is pruned and its cold pack collected
    while v2 waits to be flushed. Eviction kept the hot pack; the flush puts it back on cold."""
    s = host(tmp_path, "hot", flush=ds.Flush(tagged_only=True), hot_capacity=1)
    shared = t(1)
    v1 = s.save({"w": shared}, branch="one")
    assert s.flush(v1, timeout=60)
    v2 = s.save({"w": shared}, branch="two", message="same bytes")
    assert v2.bytes_new == 0  # reused from hot
    v3 = s.save({"w": t(2)}, branch="one")
    assert s.flush(v3, timeout=60)
    s._evict()  # over capacity: v1's pack is on cold, but v2 is not: that pack stays; v3's goes
    assert s.where(v2) == ["hot"] and s.where(v3) == ["cold"]
    assert prune(s, Retention(KeepLatest(1))).prune == {v1.id}
    rep = s.gc(cold_grace_s=0)
    assert rep.bytes_freed["cold"] > 0 and len(cold_packs(tmp_path)) == 1  # v3's
    assert s.flush(v2, timeout=60) and s.where(v2) == ["hot", "cold"]
    assert len(cold_packs(tmp_path)) == 2
    s.close()
    with host(tmp_path, "hot-fresh") as c:
        assert same(c.load(v2.id)["w"], shared)


def test_gc_leaves_cold_alone_when_it_is_unreachable(tmp_path: Path) -> None:
    s = host(tmp_path, "hot")
    v = s.save({"w": t(1)})
    s.save({"w": t(2)})
    assert s.flush(timeout=60)
    prune(s, Retention(KeepLatest(1)))
    (tmp_path / "cold").rename(tmp_path / "cold-away")
    rep = s.gc(cold_grace_s=0)
    assert any("unreachable" in x for x in rep.skipped)
    assert rep.bytes_freed["cold"] == 0
    (tmp_path / "cold-away").rename(tmp_path / "cold")
    assert len(cold_packs(tmp_path)) == 2
    rep = s.gc(cold_grace_s=0)
    assert len(cold_packs(tmp_path)) == 1 and rep.bytes_freed["cold"] > 0
    with pytest.raises(ds.PrunedError):
        s.load(v)
    s.close()


def test_cli_gc_prints_what_cold_freed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = host(tmp_path, "hot")
    for i in range(3):
        s.save({"w": t(i)}, step=i)
    assert s.flush(timeout=60)
    prune(s, Retention(KeepLatest(1)))
    p = argparse.ArgumentParser(prog="datastates")
    add_parsers(p.add_subparsers(dest="command", required=True))
    assert run(s, p.parse_args(["gc", "--cold-grace", "0"])) == 0
    out = capsys.readouterr().out
    assert "cold: " in out and "deleted 4 dead pack(s)" in out
    with pytest.raises(SystemExit):
        p.parse_args(["gc", "--cold-grace", "-1"])
    s.close()


# Dies (exit 137, as if killed) just before its (k+1)-th deletion of a cold pack: a deterministic kill -9.
_DIE_IN_COLD_GC = """
import os, pathlib, sys
cold_packs, k = pathlib.Path(sys.argv[1]) / "cold" / "packs", int(sys.argv[2])
real_unlink, seen = pathlib.Path.unlink, [0]
def unlink(self, missing_ok=False):
    if self.parent == cold_packs and self.name.endswith(".pack"):
        if seen[0] == k:
            os._exit(137)
        seen[0] += 1
    real_unlink(self, missing_ok=missing_ok)
pathlib.Path.unlink = unlink
import datastates as ds
s = ds.Store.open(cold_packs.parent, hot=cold_packs.parent.parent / "hot")
s.gc(cold_grace_s=0)
print("SURVIVED")
"""


@pytest.mark.parametrize("k", [0, 1, 4])
def test_killed_during_cold_gc_leaves_every_live_version_loadable(tmp_path: Path, k: int) -> None:
    import subprocess
    import sys

    with host(tmp_path, "hot") as s:
        vs = [s.save({"w": t(i)}, step=i) for i in range(8)]
        assert s.flush(timeout=60)
        prune(s, Retention(KeepLatest(2)))
    assert len(cold_packs(tmp_path)) == 8
    proc = subprocess.run([sys.executable, "-c", _DIE_IN_COLD_GC, str(tmp_path), str(k)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 137 and "SURVIVED" not in proc.stdout, proc.stderr
    assert len(cold_packs(tmp_path)) == 8 - k
    with host(tmp_path, "hot") as s:
        assert s.fsck().ok
        rep = s.gc(cold_grace_s=0)  # the lock of the dead gc does not block: its holder is gone
        assert len(rep.packs_deleted) == 6 - k and len(cold_packs(tmp_path)) == 2
        assert s.fsck().ok
    with host(tmp_path, "hot-fresh") as c:
        for i, v in enumerate(vs):
            if i < 6:
                with pytest.raises(ds.PrunedError):
                    c.load(v.id)
            else:
                assert same(c.load(v.id)["w"], t(i))
        assert c.fsck().ok


def test_a_pack_evicted_by_another_process_between_reuse_and_commit_is_put_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process sharing the hot dir evicts (its copy is on cold) a pack this save reuses chunks
    from, after the dedup and before the commit: the commit copies it back from cold, so the version
    never depends on cold alone."""
    real_commit = ds.Store._commit
    evicted: list[str] = []

    def commit_after_foreign_eviction(self: ds.Store, job: Any) -> Any:
        for p in job.pins:  # what the other process's eviction would do: hot copy gone, cold copy kept
            self.hot.pack_path(p).unlink()
            evicted.append(p)
        return real_commit(self, job)

    monkeypatch.setattr(ds.Store, "_commit", commit_after_foreign_eviction)  # before open: the pipeline binds it
    s = host(tmp_path, "hot")
    shared = t(3)
    v1 = s.save({"w": shared})  # reuses nothing: untouched
    assert s.flush(timeout=60) and evicted == []
    (pack,) = [p for p in (tmp_path / "hot" / "packs").glob("*.pack")]
    v2 = s.save({"w": shared, "x": t(4)}, branch="other")
    assert evicted == [pack.stem] and v2.bytes_new == t(4).nbytes  # "w" was reused, not rewritten
    assert pack.exists() and "hot" in s.where(v2)  # restored on hot before the commit
    assert s.flush(timeout=60) and s.where(v2) == ["hot", "cold"]
    (tmp_path / "cold").rename(tmp_path / "cold-away")  # hot alone serves both versions
    assert same(s.load(v2)["w"], shared) and same(s.load(v1)["w"], shared)
    (tmp_path / "cold-away").rename(tmp_path / "cold")
    s.close()


def test_versions_pruned_while_cold_is_unreachable_reach_cold_marked(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Versions pending flush were pruned while cold was unmounted (no FORMAT): prune marked hot only, in silence,
    and the flusher then published their records on cold without the marker. Cold held live-looking versions
    whose manifests it lacked: gc there stopped (IntegrityError), fsck said ok, and a node opening cold with a
    fresh hot directory got "manifest missing" instead of PrunedError. Now prune warns, the flusher writes the
    marker before the record, and fsck reports (--repair writes) the marker of a version flushed before the
    prune."""
    cold = tmp_path / "cold"
    s = host(tmp_path, "hot", flush=ds.Flush(every=1))
    states = {i: {"w": t(100 + i), "b": t(200 + i, 1000)} for i in range(4)}
    v0 = s.save(states[0], step=0)
    assert s.flush(v0, timeout=60)  # on cold before the prune: only fsck or the next prune marks it there
    (cold / "FORMAT").rename(tmp_path / "FORMAT.away")  # unmounted: the mount point is an empty directory
    vs = [v0, *(s.save(states[i], step=i) for i in range(1, 4))]
    with caplog.at_level("WARNING", logger="datastates.retention"):
        res = prune(s, Retention(KeepLatest(1)))
    assert res.prune == {v.id for v in vs[:3]}
    assert any("unreachable" in r.getMessage() and "pruned markers" in r.getMessage() for r in caplog.records)
    s.gc(cold_grace_s=0)  # hot only (cold is away): deletes the manifests only pruned versions name
    (tmp_path / "FORMAT.away").rename(cold / "FORMAT")
    assert s.flush(timeout=60)
    markers = {p.name.removesuffix(".pruned") for p in (cold / "versions").rglob("*.pruned")}
    assert {v.id for v in vs[1:3]} <= markers  # published by the flusher with their marker
    rep = s.fsck()
    assert not rep.ok and any(v0.id[:12] in p and "no pruned marker" in p for p in rep.problems)
    rep = s.fsck(repair=True)
    assert any(v0.id[:12] in r for r in rep.repaired)
    assert s.fsck().ok
    markers = {p.name.removesuffix(".pruned") for p in (cold / "versions").rglob("*.pruned")}
    assert {v.id for v in vs[:3]} <= markers
    s.close()
    with host(tmp_path, "hot-fresh") as c:  # this node is lost: another opens cold
        rep = c.gc(cold_grace_s=0)
        assert rep.bytes_freed["cold"] > 0
        for v in vs[:3]:
            with pytest.raises(ds.PrunedError):
                c.load(v.id)
        got = c.load(vs[3].id)
        assert same(got["w"], states[3]["w"]) and same(got["b"], states[3]["b"])
        assert c.fsck().ok
