"""Two tiers: node-local hot over a shared cold directory, flush, eviction, restart, repair, failures."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.procs import Lines

import datastates as ds
from datastates.base import files

HELPER = Path(__file__).parent / "helpers" / "tiered_saver.py"
MiB = 1 << 20


def _state(i: int, n: int = 256 * 1024) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(i)), "i": torch.tensor(i)}


def _packs(d: Path) -> list[Path]:
    return sorted((d / "packs").glob("*.pack"))


def test_save_lands_on_hot_then_flushes_to_cold(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    h = s.save_async(_state(1), step=1)
    v = h.result()
    assert h.flushed(timeout=30) is True
    assert s.where(v) == ["hot", "cold"]
    assert (tmp_path / "cold" / "refs" / "heads" / "main").read_text().strip() == v.id
    assert [p.name for p in _packs(tmp_path / "hot")] == [p.name for p in _packs(tmp_path / "cold")]
    s.close()
    assert "hot = " in (tmp_path / "cold" / "config.toml").read_text()


def test_close_copies_every_pending_version_to_cold(tmp_path: Path) -> None:
    """close() drains the flush backlog: the flusher read the versions through a store already marked closed,
    which raised StoreClosedError once reads checked it, and the last version never reached cold."""
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    vs = [s.save({"w": torch.full((1 << 16,), float(i))}, step=i) for i in range(3)]
    s.close()  # no flush() first: close alone must leave cold whole
    assert all((tmp_path / "cold" / "versions" / v.id[:2] / f"{v.id}.json").exists() for v in vs)
    assert (tmp_path / "cold" / "refs" / "heads" / "main").read_text().strip() == vs[-1].id
    with ds.Store.open(tmp_path / "cold", hot=tmp_path / "new-node") as fresh:
        assert [v.id for v in fresh.log("main")] == [v.id for v in reversed(vs)]
        assert float(fresh.load("main")["w"][0]) == 2.0


def test_eviction_keeps_hot_under_capacity_and_reads_fall_back_to_cold(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", hot_capacity=3 * MiB, promote=False)
    vs = []
    for i in range(6):
        h = s.save_async(_state(i), step=i)  # 1 MiB of new bytes each
        vs.append(h.result())
        assert h.flushed(timeout=30)
        s._evict()
    assert sum(p.stat().st_size for p in _packs(tmp_path / "hot")) <= 3 * MiB
    assert s.where(vs[0]) == ["cold"]
    assert s.where(vs[-1]) == ["hot", "cold"]
    assert s.load(vs[0])["w"][0].item() == 0.0
    assert len(_packs(tmp_path / "cold")) == 6
    s.close()


def test_eviction_never_drops_the_only_copy(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    s = ds.Store.open(cold, hot=tmp_path / "hot", hot_capacity=1 * MiB)
    s.close()
    os.rename(cold, tmp_path / "away")  # cold unreachable: nothing can be flushed
    s = ds.Store.open(cold, hot=tmp_path / "hot", hot_capacity=1 * MiB)
    vs = [s.save(_state(i), step=i) for i in range(3)]
    s._evict()
    assert len(_packs(tmp_path / "hot")) == 3  # over capacity, but nothing is on cold yet
    assert [s.load(v)["w"][0].item() for v in vs] == [0.0, 1.0, 2.0]
    assert s.tiers_status()[-1]["backlog"] >= 1
    os.rename(tmp_path / "away", cold)
    assert s.flush(timeout=30)
    assert all(s.where(v) == ["hot", "cold"] for v in vs)
    s.close()


def test_restart_with_empty_hot_loads_everything_from_cold(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    vs = [s.save(_state(i), step=i) for i in range(3)]
    s.tag("best", vs[1])
    s.flush(timeout=30)
    s.close()
    shutil.rmtree(tmp_path / "hot")
    s = ds.Store.open(tmp_path / "cold")  # tiers come from config.toml
    assert s.hot.root == tmp_path / "hot"
    assert s.resolve("main") == vs[-1].id
    assert s.resolve("best") == vs[1].id
    assert [s.load(v)["w"][0].item() for v in vs] == [0.0, 1.0, 2.0]
    s.close()


def test_intact_hot_loads_without_touching_cold(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    s = ds.Store.open(cold, hot=tmp_path / "hot")
    vs = [s.save(_state(i), step=i) for i in range(2)]
    s.flush(timeout=30)
    s.close()
    os.rename(cold, tmp_path / "away")
    s = ds.Store.open(cold, hot=tmp_path / "hot")
    assert not cold.exists()
    assert [s.load(v)["w"][0].item() for v in vs] == [0.0, 1.0]
    assert s.resolve("main") == vs[-1].id
    v = s.save(_state(9), step=9)  # saves keep landing on hot
    assert s.where(v) == ["hot"]
    assert not cold.exists()  # the flusher never writes into a missing mount point
    s.close()


def test_lost_catalog_is_rebuilt_from_tier_files(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    vs = [s.save(_state(i), step=i, metrics={"loss": 1.0 / (i + 1)}) for i in range(3)]
    s.annotate(vs[0], val=0.5)
    s.flush(timeout=30)
    s.close()
    shutil.rmtree(tmp_path / "hot" / "catalog")
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    assert [v.id for v in s.log("main")] == [v.id for v in reversed(vs)]
    assert s.version(vs[0]).annotations["val"] == 0.5
    assert s.load(vs[2])["i"].item() == 2
    assert s.where(vs[0]) == ["hot", "cold"]
    s.close()


def test_two_hosts_share_one_cold_tier(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    a = ds.Store.open(cold, hot=tmp_path / "hot-a")
    b = ds.Store.open(cold, hot=tmp_path / "hot-b")
    va = a.save(_state(1), branch="host-a", step=1)
    vb = b.save(_state(2), branch="host-b", step=2)
    assert a.flush(timeout=30) and b.flush(timeout=30)
    assert a.refresh()["versions"] == 1
    b.refresh()
    assert a.resolve("host-b") == vb.id
    assert b.resolve("host-a") == va.id
    assert a.load("host-b")["w"][0].item() == 2.0
    assert b.load(va)["i"].item() == 1
    a.close()
    b.close()


def test_racing_hosts_on_one_branch_lose_nothing(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    a = ds.Store.open(cold, hot=tmp_path / "hot-a")
    b = ds.Store.open(cold, hot=tmp_path / "hot-b")
    va = a.save(_state(1), step=1)
    vb = b.save(_state(2), step=2)  # b never saw a's version: the histories diverge
    assert a.flush(timeout=30) and b.flush(timeout=30)
    heads = (cold / "refs" / "heads" / "main").read_text().strip()
    assert heads in (va.id, vb.id)
    loser = vb if heads == va.id else va
    flusher = (b if loser is vb else a).flusher
    assert flusher is not None and any("not an ancestor" in c for c in flusher.conflicts)
    assert (cold / "versions" / loser.id[:2] / f"{loser.id}.json").exists()  # still reachable by id
    c = ds.Store.open(cold, hot=tmp_path / "hot-c")
    assert c.load(loser)["i"].item() == loser.step
    for s in (a, b, c):
        s.close()
    # Any later process on the losing node sees the split, not only the one whose flush met it (a review).
    from datastates.cli import main as cli

    loser_hot = tmp_path / ("hot-b" if loser is vb else "hot-a")
    with ds.Store.open(cold, hot=loser_hot) as s:  # (config.toml now names this node's hot tier)
        [conflict] = s.tiers_status()[-1]["conflicts"]
        assert conflict.startswith(f"branch 'main' is at {loser.short} here and at {heads[:12]} on cold, on two lines")
    hint = conflict.split("`")[1]
    assert hint == f"datastates branch -f main {heads[:12]}"
    assert cli(["--store", str(cold), *hint.split()[1:]]) == 0
    with ds.Store.open(cold, hot=loser_hot) as s:
        assert s.tiers_status()[-1]["conflicts"] == [] and s.resolve("main") == heads


def test_a_line_that_lost_its_branch_on_cold_survives_a_prune_on_another_host(tmp_path: Path) -> None:
    """b's version lost branch main on cold to a's, and no ref named it on cold (b's own branch is on b's hot
    tier): a prune on host a took it for an abandoned line, gc freed it, and b's `load('main')` raised
    PrunedError (a hunt). Now the flush names it by a branch of its own on cold, moved forward as b goes on."""
    import socket

    from datastates.retention import KeepLatest

    cold = tmp_path / "cold"
    a = ds.Store.open(cold, hot=tmp_path / "hot-a")
    b = ds.Store.open(cold, hot=tmp_path / "hot-b")
    a.save(_state(1), step=1)
    assert a.flush(timeout=30) and b.refresh()["versions"] == 1
    a.save(_state(2), step=2)
    assert a.flush(timeout=30)
    vb = b.save(_state(7), step=7)  # on a1, not on a2: two lines
    assert b.flush(timeout=30)
    kept = f"main@{socket.gethostname()}"
    assert b.flusher is not None and any(f"kept on cold as branch {kept!r}" in c for c in b.flusher.conflicts)
    vb2 = b.save(_state(8), step=8)
    assert b.flush(timeout=30)
    assert b.repo.cold_refs is not None and b.repo.cold_refs.get("branch", kept) == vb2.id  # moved, not made anew
    assert b.flush(vb.id, timeout=30)  # an older version of the line flushed again (a tag queues one): no new name
    assert [n for n in b.repo.cold_refs.names("branch") if n.startswith("main@")] == [kept]
    a.save(_state(3), step=3)
    assert a.flush(timeout=30)
    a.refresh()
    plan = a.prune(KeepLatest(1))
    assert vb2.id in plan.keep and vb.id in plan.prune  # a head is kept; the rest of its line is the policy's
    a.gc(cold_grace_s=0)
    a.close()
    b.close()
    with ds.Store.open(cold, hot=tmp_path / "hot-b") as s:
        assert s.resolve("main") == vb2.id and s.load("main")["i"].item() == 8
    with ds.Store.open(cold, hot=tmp_path / "hot-c") as s:  # a node that never saw b's hot tier
        assert s.resolve(kept) == vb2.id and s.load(kept)["i"].item() == 8


def test_corrupt_hot_chunk_falls_back_to_cold_and_repairs_hot(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    v = s.save(_state(3), step=3)
    s.flush(timeout=30)
    hot_pack = _packs(tmp_path / "hot")[0]
    good = hot_pack.read_bytes()
    data = bytearray(good)
    data[5000] ^= 0xFF
    hot_pack.write_bytes(bytes(data))
    s.hot.reader.forget(hot_pack.name.removesuffix(".pack"))
    assert s.load(v)["w"][0].item() == 3.0
    assert hot_pack.read_bytes() == good  # repaired from cold
    hot_pack.write_bytes(bytes(data))
    s.hot.reader.forget(hot_pack.name.removesuffix(".pack"))
    rep = s.fsck()
    assert [c["tier"] for c in rep.corrupt_chunks] == ["hot"]
    rep = s.fsck(repair=True)
    assert any("good copy from cold" in r for r in rep.repaired)
    assert s.fsck().ok
    assert hot_pack.read_bytes() == good
    s.close()


def _small_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_disk_full_on_hot_fails_cleanly_and_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real size-limited tmpfs where the machine allows mounting; else ENOSPC injected at the write call."""
    hot = tmp_path / "hot"
    mounted = _small_tmpfs(hot, "6m")
    try:
        s = ds.Store.open(tmp_path / "cold", hot=hot, flush=ds.Flush(tagged_only=True))
        v1 = s.save(_state(1), step=1)
        if not mounted:
            real = files.write_all
            calls = {"n": 0}

            def failing(fd: int, data: memoryview | bytes) -> int:
                calls["n"] += 1
                if calls["n"] > 2:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real(fd, data)

            monkeypatch.setattr("datastates.objects.packs.write_all", failing)
        with pytest.raises(ds.StorageFullError) as err:
            s.save({"w": torch.randn(2 * MiB)}, step=2)  # 8 MiB: does not fit
        assert err.value.errno == errno.ENOSPC
        assert "no space left" in str(err.value)
        s.wait()  # the save raised it: not raised again (the next checkpoint would be lost)
        assert s.resolve("main") == v1.id
        assert s.catalog.version_count() == 1
        assert not list((hot / "packs").glob("*.tmp"))
        assert s.load(v1)["w"][0].item() == 1.0
        monkeypatch.undo()
        v3 = s.save(_state(3, n=1000), step=3)
        assert s.load(v3)["i"].item() == 3
        assert s.version("main").parents == (v1.id,)
        s.close()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(hot)], check=False)


def test_flush_policies_every_and_tagged_only(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "c1", hot=tmp_path / "h1", flush=ds.Flush(every=2))
    vs = [s.save(_state(i, 100), step=i) for i in range(4)]
    s.flush(timeout=30)
    assert [s.where(v) for v in vs] == [["hot"], ["hot", "cold"], ["hot"], ["hot", "cold"]]
    s.close()
    s = ds.Store.open(tmp_path / "c2", hot=tmp_path / "h2", flush=ds.Flush(tagged_only=True))
    vs = [s.save(_state(i, 100), step=i) for i in range(3)]
    s.tag("keep", vs[1])
    s.flush(timeout=30)
    assert [s.where(v) for v in vs] == [["hot"], ["hot", "cold"], ["hot"]]
    assert (tmp_path / "c2" / "refs" / "tags" / "keep").read_text().strip() == vs[1].id
    s.close()


@pytest.mark.parametrize("kills", [6])
def test_kill_during_save_and_flush_keeps_store_consistent(tmp_path: Path, kills: int) -> None:
    _kill_loop(tmp_path, kills, seed=1)


@pytest.mark.slow
def test_kill_during_save_and_flush_many_sample(tmp_path: Path) -> None:
    _kill_loop(tmp_path, 25, seed=2)


def _saver_killed_after_first_commit(cold: Path, hot: Path, step: int, offset: float) -> list[list[str]]:
    """Run the tiered saver from `step`; wait (bounded) for its first COMMITTED line, then SIGKILL it
    `offset` seconds after that event. Returns its `COMMITTED <id> <step>` lines."""
    p = subprocess.Popen([sys.executable, str(HELPER), str(cold), str(hot), str(step)], stdout=subprocess.PIPE)
    try:
        lines = Lines(p.stdout)
        lines.wait(lambda: lines.of(p.pid, "COMMITTED"), 180, "the saver's first COMMITTED line")
        time.sleep(offset)  # the random kill offset after the event, not a wait for the child
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL, f"the saver ended by itself: {p.returncode}"
    lines.wait(lambda: lines.closed, 30, "the end of the saver's output")
    return lines.of(p.pid, "COMMITTED")


def _kill_loop(tmp_path: Path, kills: int, seed: int) -> None:
    """Start the tiered saver `kills` times and kill it at a random offset after its first commit, so the kill
    lands amid later saves and background flushes however slow the machine is (a fixed wall-clock delay
    from the start could fire before anything committed)."""
    rng = random.Random(seed)
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    committed: dict[str, int] = {}
    step = 0
    for _ in range(kills):
        for _, vid, st in _saver_killed_after_first_commit(cold, hot, step, rng.uniform(0.0, 1.0)):
            committed[vid] = int(st)
            step = max(step, int(st) + 1)
    sys.path.insert(0, str(HELPER.parent))
    try:
        from tiered_saver import state
    finally:
        sys.path.pop(0)
    s = ds.Store.open(cold, hot=hot)
    assert committed
    for vid, st in committed.items():
        got = s.load(vid)
        assert torch.equal(got["big"], state(st)["big"])
    assert s.flush(timeout=60)
    for vid in committed:
        assert s.where(vid) == ["hot", "cold"]
    s.fsck(repair=True)
    rep = s.fsck()
    assert rep.ok, rep.problems
    s.close()


def test_fsck_on_a_fresh_hot_tier_keeps_every_cold_version(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    vs = [s.save(_state(i, 100), step=i) for i in range(3)]
    s.flush(timeout=30)
    s.close()
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot2")
    rep = s.fsck(repair=True)
    assert not any("dropped" in r for r in rep.repaired)
    assert s.catalog.version_count() == 3
    assert s.fsck().ok
    assert [s.load(v)["i"].item() for v in vs] == [0, 1, 2]
    s.close()


def test_pruned_but_uncollected_packs_are_not_debris(tmp_path: Path) -> None:
    from datastates.retention import KeepLatest, Retention

    s = ds.Store.open(tmp_path / "s")
    vs = [s.save(_state(i, 1000), step=i) for i in range(4)]
    plan = s.prune(Retention(KeepLatest(1)))
    assert set(plan.prune) == {v.id for v in vs[:3]}
    rep = s.fsck()
    assert rep.ok, rep.problems
    assert len(_packs(tmp_path / "s")) == 4  # freeing them is gc's job, not fsck's
    with pytest.raises(ds.PrunedError):
        s.load(vs[0])
    freed = s.gc()
    assert freed.total_freed > 0
    assert len(_packs(tmp_path / "s")) == 1
    assert s.load(vs[3])["i"].item() == 3
    s.close()


def test_deleted_refs_stay_deleted_and_forks_flush(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    v = s.save(_state(1, 100), step=1)
    s.tag("t", v)
    s.branch("side", at=v)
    f = s.fork(v, branch="side", hparams={"lr": 0.5})
    assert s.flush(timeout=30)
    assert s.where(f) == ["hot", "cold"]
    s.delete_tag("t")
    s.delete_branch("side", force=True)
    s.close()
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    assert "t" not in s.tags() and "side" not in s.branches()
    assert s.version(f).hparams == {"lr": 0.5}
    s.close()


def test_a_cold_tier_without_its_config_is_refused_not_made_a_store_of_its_own(tmp_path: Path) -> None:
    """With config.toml gone, Store.open(cold) made the shared tier a one-tier store: a catalog and locks of its
    own there, beside the hosts using it as their cold tier. FORMAT now records the role; a cold tier made before
    gets it at its next open with a hot tier; opening with the hot tier writes config.toml again."""
    import json

    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot) as s:
        s.save({"w": torch.ones(3)})
        assert s.flush(timeout=60)
    assert json.loads((cold / "FORMAT").read_text())["tier"] == "cold"
    (cold / "config.toml").unlink()
    before = sorted(p.name for p in cold.iterdir())
    with pytest.raises(ds.StoreFormatError, match=r"is the cold tier of a two-tier store.*Store.open\(path, hot="):
        ds.Store.open(cold)
    assert sorted(p.name for p in cold.iterdir()) == before  # no catalog/, nothing else
    with ds.Store.open(cold, hot=hot) as s:
        assert s.load("main")["w"].tolist() == [1.0, 1.0, 1.0]
    assert (cold / "config.toml").exists()
    # a cold tier made before FORMAT recorded the role gets it at its next open with a hot tier
    info = json.loads((cold / "FORMAT").read_text())
    del info["tier"], info["blake3"]  # (nor its checksum, written since the same day)
    (cold / "FORMAT").write_text(json.dumps(info, sort_keys=True))
    ds.Store.open(cold, hot=hot).close()
    marked = json.loads((cold / "FORMAT").read_text())
    assert len(marked.pop("blake3")) == 64 and marked == info | {"tier": "cold"}


def test_a_hot_tier_that_is_the_store_directory_is_refused(tmp_path: Path) -> None:
    """hot= the store directory itself was taken: FORMAT said cold, config.toml named it hot, and its one pack was
    counted on both tiers with the catalog on the shared one. (A hot tier nested in it still opens.)"""
    with pytest.raises(ds.InvalidArgumentError, match="hot tier .* is the store directory"):
        ds.Store.open(tmp_path / "same", hot=tmp_path / "same")
    assert list(tmp_path.iterdir()) == []
    with ds.Store.open(tmp_path / "c", hot=tmp_path / "c" / "hot") as s:
        s.save({"w": torch.ones(1)})
    with ds.Store.open(tmp_path / "c", hot=tmp_path / "c" / "hot") as s:
        assert s.load("main")["w"].tolist() == [1.0]


def test_an_empty_mount_point_is_not_made_a_cold_tier(tmp_path: Path) -> None:
    """With the shared file system unmounted, its empty mount point was made a new cold tier: versions flushed there
    were marked as on cold, eviction then deleted their only copy once the real one was back (a review)."""
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot, flush=ds.Flush(every=1)) as s:
        first = s.save(_state(0), step=0)
        assert s.flush(first)
    os.rename(cold, tmp_path / "real")
    cold.mkdir()  # the mount point, empty
    s = ds.Store.open(cold, hot=hot, hot_capacity=1 * MiB, flush=ds.Flush(every=1))
    try:
        later = [s.save(_state(i), step=i) for i in (1, 2, 3)]
        assert list(cold.iterdir()) == []  # no FORMAT, no config, no pack: nothing written there
        assert all(s.where(v) == ["hot"] for v in later)
        s._evict()
        assert [s.load(v)["w"][0].item() for v in later] == [1.0, 2.0, 3.0]  # kept: not on cold
        cold.rmdir()
        os.rename(tmp_path / "real", cold)  # mounted again
        assert s.flush(timeout=60)
        assert all(s.where(v) == ["hot", "cold"] for v in later)
    finally:
        s.close()
    with ds.Store.open(cold, hot=tmp_path / "new-node") as s:  # every version from cold alone
        assert [v.step for v in s.log("main")] == [3, 2, 1, 0]
        assert [s.load(v)["w"][0].item() for v in s.log("main")] == [3.0, 2.0, 1.0, 0.0]


def test_a_hot_tier_deleted_while_open_refuses_saves_and_a_reopen_recovers(tmp_path: Path) -> None:
    """After the hot tier was deleted under an open store, the next save committed a version with no parent, and
    the files it (and a promotion) wrote made a hot directory without FORMAT that no open accepted (a review)."""
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    s = ds.Store.open(cold, hot=hot)
    try:
        first = s.save(_state(1), step=1)
        assert s.flush(first)
        shutil.rmtree(hot)
        with pytest.raises(ds.StoreFormatError, match="was deleted while the store was open"):
            s.save(_state(2), step=2)
        with pytest.raises(ds.StoreFormatError, match="was deleted"):
            s.tag("t", first)
        assert s.load(first)["w"][0].item() == 1.0  # read from cold, not promoted into the deleted tier
        assert not hot.exists()  # nor its manifest kept there (a review)
    finally:
        s.close()
    assert not hot.exists()
    with ds.Store.open(cold, hot=hot) as s:  # what the message says
        again = s.save(_state(3), step=3)
        assert again.parents == (first.id,)
    shutil.rmtree(hot / "catalog")
    (hot / "FORMAT").unlink()
    with pytest.raises(ds.StoreFormatError, match="move this directory aside"):
        ds.Store.open(cold, hot=hot)
    os.rename(hot, tmp_path / "aside")
    with ds.Store.open(cold, hot=hot) as s:
        assert s.load(first)["w"][0].item() == 1.0


def test_swapped_tiers_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot) as s:
        s.save(_state(0))
    before = {p: p.read_bytes() for d in (cold, hot) for p in d.rglob("*") if p.is_file() and "lock" not in p.name}
    with pytest.raises(ds.InvalidArgumentError, match="were the two swapped"):
        ds.Store.open(hot, hot=cold)
    after = {p: p.read_bytes() for d in (cold, hot) for p in d.rglob("*") if p.is_file() and "lock" not in p.name}
    assert after == before
    assert not (cold / "catalog").exists()


def test_a_relative_hot_tier_is_kept_absolute_in_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """config.toml kept hot= as given: a process opening the store from another directory (the CLI, a server)
    read a relative path there, and made and used another, empty hot tier."""
    monkeypatch.chdir(tmp_path)
    with ds.Store.open("cold", hot="hot") as s:
        s.save({"w": torch.ones(2)})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with ds.Store.open(tmp_path / "cold", create=False) as s:
        assert s.hot.root == tmp_path / "hot" and s.load("main")["w"].tolist() == [1.0, 1.0]
    assert not (tmp_path / "elsewhere" / "hot").exists()


def test_refresh_moves_a_branch_forward_across_versions_the_flush_policy_kept_off_cold(tmp_path: Path) -> None:
    """Node A saves with Flush(every=2); node B, which had seen main at step 3, reopened after A flushed step 7 and
    kept main at step 3: its walk from 7 ends at 6, never flushed, so it could not tell 7 descends from 3 (before
    lineage walks ended at such a gap, the open failed with NotFoundError). Cold's reflog shows main moved from 3
    to 7 by flushes alone, each judged on A, which holds the whole line."""
    from datastates.base.config import Flush

    cold = tmp_path / "cold"
    a = ds.Store.open(cold, hot=tmp_path / "hotA", flush=Flush(every=2))
    for i in range(4):
        a.save({"w": torch.full((4,), float(i))}, step=i)
    assert a.flush(timeout=60)
    with ds.Store.open(cold, hot=tmp_path / "hotB", create=False) as b:
        assert b.version("main").step == 3
    for i in range(4, 8):
        a.save({"w": torch.full((4,), float(i))}, step=i)
    assert a.flush(timeout=60)
    a.close()
    with ds.Store.open(cold, hot=tmp_path / "hotB", create=False) as b:
        assert b.version("main").step == 7 and b.load("main")["w"][0].item() == 7.0
        assert b.reflog("main")[-1]["message"] == "refresh from cold"


def test_the_command_lines_hot_tier_is_for_that_command_only(tmp_path: Path) -> None:
    """datastates --hot DIR log rewrote config.toml to name DIR: the owner's next plain command then read an empty
    hot tier and missed a version not yet on cold (a review). --hot is that command's hot tier only."""
    from datastates.cli import main as cli

    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot, flush=ds.Flush(tagged_only=True)) as s:
        first = s.save(_state(1), step=1)
        s.tag("t", first)
        assert s.flush(timeout=60)
        later = s.save(_state(2), step=2)  # on hot only (the policy flushes tagged versions)
    config = (cold / "config.toml").read_bytes()
    assert cli(["--store", str(cold), "--hot", str(tmp_path / "elsewhere"), "log"]) == 0
    assert (cold / "config.toml").read_bytes() == config
    with ds.Store.open(cold) as s:  # the store's own hot tier, as before
        assert s.resolve("main") == later.id


def test_a_hot_tier_of_another_store_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """`--hot` naming another store's hot tier was accepted: a read showed that store's versions as this one's
    and a refresh wrote this store's refs and catalog entries into it (B then listed A's branch and fsck said NOT
    OK; a hunt). The hot tier records the store it serves; another store's is refused, nothing written."""
    a = ds.Store.open(tmp_path / "A", hot=tmp_path / "Ah")
    a.save(_state(1), branch="a")
    a.close()
    b = ds.Store.open(tmp_path / "B", hot=tmp_path / "Bh")
    b.save(_state(2), branch="b")
    b.close()
    before = sorted((p, p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "Bh").rglob("*")
                    if p.name != "lock.mdb")
    with pytest.raises(ds.InvalidArgumentError, match="belongs to another store"):
        ds.Store.open(tmp_path / "A", hot=tmp_path / "Bh", record_tiers=False)
    r = subprocess.run([sys.executable, "-m", "datastates", "--store", str(tmp_path / "A"), "--hot",
                        str(tmp_path / "Bh"), "log"], capture_output=True, text=True)
    assert r.returncode == 1 and "belongs to another store" in r.stderr and "Traceback" not in r.stderr
    assert sorted((p, p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "Bh").rglob("*")
                  if p.name != "lock.mdb") == before
    with ds.Store.open(tmp_path / "B", hot=tmp_path / "Bh") as again:
        assert again.branches().keys() == {"b"} and again.fsck().ok
    with ds.Store.open(tmp_path / "A") as own:  # its config.toml names its own hot tier
        assert own.branches().keys() == {"a"}


def test_a_hot_tier_named_as_the_store_is_refused(tmp_path: Path) -> None:
    """`--store HOT_DIR` opened a hot tier as a one-tier store: fsck said the evicted packs were missing from
    every tier, and prune and gc marked and collected that tier only (a hunt). A hot tier's FORMAT names its
    store: opened as a store it is refused, and nothing is written."""
    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot")
    s.save(_state(1), branch="main")
    s.close()
    before = sorted((p, p.stat().st_size) for p in (tmp_path / "hot").rglob("*") if p.name != "lock.mdb")
    with pytest.raises(ds.StoreFormatError, match="is the hot tier of a two-tier store"):
        ds.Store.open(tmp_path / "hot")
    r = subprocess.run([sys.executable, "-m", "datastates", "--store", str(tmp_path / "hot"), "fsck"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "is the hot tier of a two-tier store" in r.stderr and "Traceback" not in r.stderr
    assert sorted((p, p.stat().st_size) for p in (tmp_path / "hot").rglob("*") if p.name != "lock.mdb") == before
    with ds.Store.open(tmp_path / "cold") as again:
        assert again.fsck().ok
