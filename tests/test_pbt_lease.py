"""A population running in another process keeps its lineage from any prune (a lease file), and a
dead or closed population stops protecting it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import datastates as ds
from datastates.cli import main as cli

HELPER = Path(__file__).parent / "helpers" / "pbt_holder.py"


def _start(path: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, str(HELPER), str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the child has saved and exploited (its event)
    assert line.strip() == "READY", line
    return proc


def _lineage(path: Path) -> set[str]:
    with ds.Store.open(path, create=False) as s:
        return {vid for name, head in s.branches().items() if name.startswith("sweep/")
                for vid in [head, *s.ancestors(head)]}


def test_prune_from_another_process_keeps_a_live_populations_lineage(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = _start(path)
    try:
        needed = _lineage(path)
        assert len(needed) == 4  # member-01: 3 saves; member-00: the fork of its head (its own line was left)
        assert cli(["--store", str(path), "prune", "--keep-latest", "1"]) == 0
        with ds.Store.open(path, create=False) as s:
            assert not any(s.version(v).pruned for v in needed)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("load\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip().startswith("LOADED ")
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()
    assert not list((path / "leases").glob("*.json"))  # close() released it
    assert cli(["--store", str(path), "prune", "--keep-latest", "1"]) == 0
    with ds.Store.open(path, create=False) as s:
        assert sum(s.version(v).pruned for v in needed) > 0  # no lease: the policy applies again


def test_one_member_process_leaving_keeps_the_others_lineage(tmp_path: Path) -> None:
    """Two processes of one population (members trained apart): the lease was one file per name, held by the
    last to renew, so the first process to finish removed it and a prune took the lineage of the one still
    training. Each process holds its own now."""
    path = tmp_path / "s"
    first, second = _start(path), _start(path)
    try:
        assert len(list((path / "leases").glob("*.json"))) == 2
        assert first.stdin is not None and second.stdin is not None and second.stdout is not None
        first.stdin.write("quit\n")
        first.stdin.flush()
        assert first.wait(60) == 0
        assert [p.name for p in (path / "leases").glob("*.json")] == [f"pbt-sweep@{_host()}-{second.pid}.json"]
        needed = _lineage(path)
        assert cli(["--store", str(path), "prune", "--keep-latest", "1"]) == 0
        with ds.Store.open(path, create=False) as s:
            assert not any(s.version(v).pruned for v in needed)
        second.stdin.write("load\n")
        second.stdin.flush()
        assert second.stdout.readline().strip().startswith("LOADED ")  # a pruned ancestor would raise
        assert second.wait(60) == 0
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
    assert not list((path / "leases").glob("*.json"))


def _host() -> str:
    import socket

    from datastates.meta.leases import _safe
    return _safe(socket.gethostname())


def test_a_killed_populations_lease_stops_protecting(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = _start(path)
    proc.kill()
    proc.wait()
    left = list((path / "leases").glob("*.json"))
    assert [p.name for p in left] == [f"pbt-sweep@{_host()}-{proc.pid}.json"]  # left behind by the SIGKILL
    needed = _lineage(path)
    assert cli(["--store", str(path), "prune", "--keep-latest", "1"]) == 0
    with ds.Store.open(path, create=False) as s:
        assert sum(s.version(v).pruned for v in needed) > 0  # its pid is gone on this host
        from datastates.pbt import Population
        with Population(s, "sweep", size=2):  # the next holder of the name removes the dead one's file
            assert [p.name for p in (path / "leases").glob("*.json")] == [f"pbt-sweep@{_host()}-{os.getpid()}.json"]


def test_an_unreadable_lease_keeps_every_branchs_lineage(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with ds.Store.open(path) as s:
        import torch
        for i in range(4):
            s.save({"w": torch.full((8,), float(i))}, step=i)
        ids = [v.id for v in s.log()]
    (path / "leases").mkdir()
    (path / "leases" / "broken.json").write_bytes(b"\xff not json")
    assert cli(["--store", str(path), "prune", "--keep-latest", "1"]) == 0
    with ds.Store.open(path, create=False) as s:
        assert not any(s.version(v).pruned for v in ids)


def test_a_leased_lineage_past_a_version_not_on_this_node_keeps_every_version(tmp_path: Path) -> None:
    """With Flush(every=2) a node opened from cold lacks every other version of a branch: its lineage walk ends at
    the first gap, so the versions past it could not be told apart from strangers and would have been pruned."""
    import torch

    from datastates.base.config import Flush
    from datastates.meta.leases import release, take
    from datastates.retention import KeepLatest

    s = ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot", flush=Flush(every=2))
    for i in range(6):
        s.save({"w": torch.full((8,), float(i))}, branch="sweep/m0", step=i)
    assert s.flush(timeout=60)
    s.close()
    take(tmp_path / "cold", "pop", "sweep/")
    try:
        with ds.Store.open(tmp_path / "cold", hot=tmp_path / "fresh-hot", create=False) as fresh:
            here = sorted(fresh.versions_table().column("step").to_pylist())
            assert here == [1, 3, 5]
            fresh.prune(KeepLatest(1))
            assert [fresh.find(f"step = {i}")[0].pruned for i in here] == [False, False, False]
    finally:
        release(tmp_path / "cold", "pop")


@pytest.mark.parametrize("name", ["sweep", "a/b.c-d_e", "p" * 240])  # the longest name a member branch takes
def test_population_close_releases_only_its_own_lease(tmp_path: Path, name: str) -> None:
    from datastates.meta import leases
    from datastates.pbt import Population

    with ds.Store.open(tmp_path / "s") as s:
        with Population(s, name, size=2):
            live, bad = leases.live(s.root)
            assert [lease.prefix for lease in live] == [f"{name}/"] and bad == []
            assert all(len(p.name.encode()) <= 255 for p in (s.root / "leases").iterdir())
        assert leases.live(s.root) == ([], [])
