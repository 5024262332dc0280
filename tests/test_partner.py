"""Node-local hot tiers, partner replication (SCR's PARTNER) and restart from a partner, over real
`mpiexec` (mpich) and torch.distributed (gloo), with nodes faked by $DATASTATES_NODE on this machine.

The job is tests/helpers/dist_job.py (see test_distributed.py); each fake node has its own hot
directory, the store path is the shared cold tier. "Without cold" is proven by moving the cold
directory away before the restart: any read of it would fail, and the open must not recreate it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from test_distributed import JOB, LAUNCH_TIMEOUT, MPIEXEC, REPLICATED_BYTES, SHARD_BYTES, dcprun, mpi, mpirun, torchrun

import datastates as ds
from datastates.base.comm import SingleComm, exchange_files
from datastates.save.placement import Placement, partner_ring


def _env(tmp: Path, partner: bool = True) -> dict[str, str]:
    return {"FAKE_NODES": "2", "DIST_HOT": str(tmp / "hot-{node}"), "DIST_PARTNER": "1" if partner else "0"}


def _packs(d: Path) -> set[str]:
    return {p.name for p in (d / "packs").glob("*.pack")}


def _all_loaded(rows: list[dict[str, object]], n: int, own: bool) -> bool:
    return len(rows) == n and all(
        r["replicated_ok"] and all(r["shards_ok"].values()) and r["own_shard_ok"] == own  # type: ignore[union-attr]
        for r in rows)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_mpi_partner_copies_let_a_lost_node_restart_without_cold_then_cold_serves_when_both_are_lost(
        tmp_path: Path) -> None:
    cold, env = tmp_path / "cold", _env(tmp_path)
    _, out = mpirun(4, cold, "flushed", env=env)
    saved = [r for r in out if "step" in r]
    assert [r["flushed"] for r in out if "flushed" in r] == [True] * 4  # each rank's part, rank 0 published
    last = [r for r in saved if r["step"] == 2]
    assert len({r["id"] for r in last}) == 1
    assert last[0]["partners"] == {"0": [2, "node1"], "1": [3, "node1"], "2": [0, "node0"], "3": [1, "node0"]}
    written = [r["written"] - SHARD_BYTES for r in last]
    assert sum(written) == REPLICATED_BYTES  # still once in total: partner copies are not "written" bytes
    node0, node1 = tmp_path / "hot-node0", tmp_path / "hot-node1"
    # every pack is on both nodes (its writer's and its partner's) and, flushed in parallel, on cold
    assert _packs(node0) == _packs(node1) == _packs(cold) and len(_packs(cold)) == 8
    with ds.Store.open(cold) as s:  # cold alone is a whole store: record, manifests, refs published once
        v = s.version("main")
        assert v.step == 2 and v.world_size == 4 and v.partners == last[0]["partners"] and s.fsck().ok
        record = json.loads(s.tier.read_record(v.id) or b"null")
    schema = json.loads((Path(__file__).parents[1] / "schemas" / "version-record.schema.json").read_text())
    assert list(Draft202012Validator(schema).iter_errors(record)) == []  # partners and replicated documented

    shutil.rmtree(node1)  # node 1 is lost (a replaced node, a wiped disk) ...
    cold.rename(tmp_path / "cold-away")  # ... and the parallel file system is down
    _, loaded = mpirun(4, cold, "load", env=env)
    assert _all_loaded(loaded, 4, own=True)  # every rank bit-exact, from its node or its partner's copy
    assert not cold.exists()  # nothing read from cold, nothing recreated there
    assert (node1 / "catalog" / "data.mdb").is_file() and _packs(node1) == _packs(node0)
    _, loaded = mpirun(2, cold, "load", env=env)  # another world size, still without cold
    assert _all_loaded(loaded, 2, own=False)

    (tmp_path / "cold-away").rename(cold)
    shutil.rmtree(node0)
    shutil.rmtree(node1)  # a node and its partner lost: only cold has the version
    _, loaded = mpirun(4, cold, "load", env=env)
    assert _all_loaded(loaded, 4, own=True)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_mpi_three_nodes_restart_without_cold_fetches_what_a_third_node_wrote(tmp_path: Path) -> None:
    # 6 ranks on 3 nodes: each node's tier holds its own packs and one partner's, so the replicated
    # chunks written once by the third node are on neither; fetch_from_peers brings them before the load
    cold, env = tmp_path / "cold", {**_env(tmp_path), "FAKE_NODES": "3", "DIST_OWN_ONLY": "1"}
    _, out = mpirun(6, cold, "flushed", env=env)
    assert [r["flushed"] for r in out if "flushed" in r] == [True] * 6
    nodes = [tmp_path / f"hot-node{k}" for k in range(3)]
    assert all(_packs(n) < _packs(cold) for n in nodes)  # no node holds everything
    cold.rename(tmp_path / "cold-away")
    _, loaded = mpirun(6, cold, "load", env=env)  # in place, the parallel file system down
    assert _all_loaded(loaded, 6, own=True) and sum(r["fetched"] for r in loaded) > 0
    held = _packs(nodes[1])
    assert all(sum(p in _packs(n) for n in nodes) >= 2 for p in _packs(tmp_path / "cold-away"))  # two copies
    shutil.rmtree(nodes[1])  # and a node lost: rebuilt from its partner's node, the rest fetched
    _, loaded = mpirun(6, cold, "load", env=env)
    assert _all_loaded(loaded, 6, own=True) and not cold.exists()
    # the rebuilt node holds what it held: its ranks' packs and the copies it kept for node 0's ranks
    # (not node 2's own packs), so every pack has two copies again
    assert _packs(nodes[1]) == held
    assert all(sum(p in _packs(n) for n in nodes) >= 2 for p in _packs(tmp_path / "cold-away"))


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_an_open_that_fails_on_rank_0_fails_on_every_rank_instead_of_hanging(tmp_path: Path) -> None:
    not_a_store = tmp_path / "file"
    not_a_store.write_text("not a store directory")
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(JOB), "mpi", str(not_a_store), "save"],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          env={**os.environ, "DIST_OUT": str(tmp_path)})
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert "StoreFormatError" in err and "rank 0 could not open the store: StoreFormatError" in err  # rank 1's
    assert not_a_store.read_text() == "not a store directory"  # nothing changed


@pytest.mark.timeout(600)
def test_torch_distributed_partner_copies_and_restart_without_cold(tmp_path: Path) -> None:
    cold, env = tmp_path / "cold", _env(tmp_path)
    saved = torchrun(2, cold, "save", tmp_path / "init-save", env=env)
    last = [r for r in saved if r["step"] == 2]
    assert len({r["id"] for r in last}) == 1 and last[0]["partners"] == {"0": [1, "node1"], "1": [0, "node0"]}
    node0, node1 = tmp_path / "hot-node0", tmp_path / "hot-node1"
    assert _packs(node0) == _packs(node1) and len(_packs(node0)) == 4  # 2 ranks x 2 versions
    shutil.rmtree(node0)
    cold.rename(tmp_path / "cold-away")
    loaded = torchrun(2, cold, "load", tmp_path / "init-load", env=env)
    assert _all_loaded(loaded, 2, own=True) and not cold.exists()


@pytest.mark.timeout(900)
def test_dcp_save_on_node_local_tiers_reaches_every_node_with_partner_copies_and_reshards_without_cold(
        tmp_path: Path) -> None:
    # dcp.save by 4 ranks on 2 fake nodes, each node its own hot tier, the store opened with the job's group
    cold = tmp_path / "cold"
    env = {**_env(tmp_path), "DCP_COMM": "1"}
    saved = dcprun(4, cold, "save", tmp_path / "init-save", env=env)
    ids = {r["id"] for r in saved}
    assert len(saved) == 4 and len(ids) == 1  # one version, known on every rank ...
    assert {r["head"] for r in saved} == ids  # ... and on every node's catalog
    assert saved[0]["world_size"] == 4 and saved[0]["partners"] == {
        "0": [2, "node1"], "1": [3, "node1"], "2": [0, "node0"], "3": [1, "node0"]}
    node0, node1 = tmp_path / "hot-node0", tmp_path / "hot-node1"
    assert _packs(node0) == _packs(node1) and len(_packs(node0)) == 4  # each rank's pack, and its partner copy
    with ds.Store.open(cold) as s:  # flushed in parallel and published once: cold alone is a whole store
        v = s.version("dcp")
        assert v.id in ids and v.step == 7 and sorted(v.manifests) == ["0", "1", "2", "3"] and s.fsck().ok

    shutil.rmtree(node1)  # a node lost, the parallel file system down: resharded loads at 2 and 3 ranks
    cold.rename(tmp_path / "cold-away")
    for n, rows in ((2, 12), (3, 8)):
        loaded = dcprun(n, cold, "load", tmp_path / f"init-load-{n}", env={**env, "DIST_PARTNER": "0"})
        assert sorted(r["rank"] for r in loaded) == list(range(n))
        assert all(r["w_ok"] and r["bias_ok"] and r["step"] == 7 and r["local_rows"] == rows for r in loaded)
    assert not cold.exists() and _packs(node1) == _packs(node0)


@pytest.mark.timeout(900)
def test_dcp_load_on_node_local_tiers_fetches_the_other_nodes_packs(tmp_path: Path) -> None:
    # no partner copies: each node holds only what its ranks wrote; the reader brings the rest
    cold = tmp_path / "cold"
    env = {**_env(tmp_path, partner=False), "DCP_COMM": "1"}
    dcprun(4, cold, "save", tmp_path / "init-save", env=env)
    node0, node1 = tmp_path / "hot-node0", tmp_path / "hot-node1"
    assert len(_packs(node0)) == len(_packs(node1)) == 2 and not _packs(node0) & _packs(node1)
    cold.rename(tmp_path / "cold-away")
    loaded = dcprun(2, cold, "load", tmp_path / "init-load", env=env)
    assert len(loaded) == 2 and all(r["w_ok"] and r["bias_ok"] and r["local_rows"] == 12 for r in loaded)
    assert _packs(node0) == _packs(node1) and len(_packs(node0)) == 4 and not cold.exists()


@pytest.mark.timeout(600)
def test_dcp_planner_without_metadata_is_refused_on_node_local_tiers_on_every_rank(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    env = {**_env(tmp_path, partner=False), "DCP_COMM": "1"}
    out = dcprun(2, cold, "save-custom-planner", tmp_path / "init", env=env)
    assert len(out) == 2 and all("InvalidArgumentError" in r["error"] and "planner.metadata" in r["error"]
                                 for r in out)
    for node in ("node0", "node1"):  # nothing written, nothing visible on either node
        assert _packs(tmp_path / f"hot-{node}") == set()
        with ds.Store.open(cold, hot=tmp_path / f"hot-{node}") as s:
            assert s.branches() == {} and s.catalog.version_count() == 0


def test_partner_needs_a_hot_tier_and_two_nodes_and_changes_nothing_when_refused(tmp_path: Path) -> None:
    with pytest.raises(ds.InvalidArgumentError, match="hot="):
        ds.Store.open(tmp_path / "s", partner=True)
    with pytest.raises(ds.InvalidArgumentError, match="at least two nodes"):
        ds.Store.open(tmp_path / "s", hot=tmp_path / "h", partner=True)  # one process: one node
    assert not (tmp_path / "s").exists() and not (tmp_path / "h").exists()


def test_partner_ring_puts_every_partner_on_another_node_once() -> None:
    assert partner_ring(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert partner_ring(["a", "b", "a", "b"]) == [1, 0, 3, 2]
    assert partner_ring(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    for nodes in (["a", "a", "b", "c"], ["x", "y", "z"], ["n1"] * 3 + ["n2"] * 3 + ["n3"] * 2):
        ring = partner_ring(nodes)
        assert sorted(ring) == list(range(len(nodes)))  # a permutation: each rank sends and receives once
        assert all(nodes[ring[r]] != nodes[r] for r in range(len(nodes)))
    with pytest.raises(ds.InvalidArgumentError, match="at most half"):
        partner_ring(["a", "a", "a", "b"])
    p = Placement(1, ["a", "a", "b", "b"], ["/h", "/h", "/h", "/h"], partner_ring(["a", "a", "b", "b"]))
    assert p.partner_of(1) == 3 and p.held_for(1) == 3 and p.leader(1) == 0 and p.groups == 2
    assert not p.applies_commits  # rank 1 shares rank 0's hot tier: rank 0 commits there
    assert Placement(2, p.nodes, p.roots, p.partner).applies_commits  # rank 2 leads node b


def test_exchange_files_moves_whole_files_in_pieces_and_keeps_what_is_there(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    blobs = {"empty": b"", "one": b"x", "several": bytes(range(10)), "exact": b"abcdefgh"}
    for name, data in blobs.items():
        (src / name).write_bytes(data)
    (dst / "kept").mkdir(parents=True)
    (dst / "kept" / "exact").write_bytes(b"already!")  # same name already there: kept, not replaced
    files = [(name, src / name) for name in blobs]
    place = {name: dst / ("kept" if name == "exact" else "new") / name for name in blobs}
    got = exchange_files(SingleComm(), files, 0, 0, place.__getitem__, piece_bytes=4)
    assert sorted(got) == ["empty", "one", "several"]
    assert {n: place[n].read_bytes() for n in blobs} == {**blobs, "exact": b"already!"}
    assert not [p for p in dst.rglob("*") if p.name.endswith(".tmp")]  # no temporaries left
    with pytest.raises(FileNotFoundError):
        exchange_files(SingleComm(), [("gone", src / "gone")], 0, 0, lambda n: dst / n)
    assert not (dst / "gone").exists()


class _ThreadComm:
    """Ranks as threads of this process: just enough of a Comm (allgather) to test opening in turn."""

    def __init__(self, rank: int, nodes: list[str], board: list[object], meet: threading.Barrier) -> None:
        self.rank, self.size, self.node = rank, len(nodes), nodes[rank]
        self._board, self._meet = board, meet

    def allgather(self, obj: object) -> list[object]:
        self._board[self.rank] = obj
        self._meet.wait()
        out = list(self._board)
        self._meet.wait()  # nobody overwrites the board before everyone has read it
        return out


def _open_together(tmp: Path, fail_rank: int | None = None) -> tuple[list[int], list[BaseException | None]]:
    from datastates.store import _open_in_turn

    nodes = ["node0", "node0", "node1", "node1"]
    board: list[object] = [None] * 4
    meet = threading.Barrier(4)
    opened: list[int] = []
    errors: list[BaseException | None] = [None] * 4

    closed: list[int] = []

    class Repo:
        def __init__(self, r: int) -> None:
            self.r = r

        def close(self) -> None:
            closed.append(self.r)

    def rank(r: int) -> None:
        def opening() -> tuple[Repo, bool, bool]:
            if r == fail_rank:
                raise ds.StoreFormatError(f"hot tier of rank {r} is not a store")
            opened.append(r)
            return Repo(r), False, True

        try:
            _open_in_turn(_ThreadComm(r, nodes, board, meet), opening, tmp / f"hot-{nodes[r]}")  # type: ignore[arg-type]
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(closed) == (sorted(opened) if fail_rank is not None else [])  # an open that is not handed out
    return opened, errors


def test_ranks_open_in_turn_rank_0_then_each_other_hot_tiers_first_rank_then_the_rest(tmp_path: Path) -> None:
    # two ranks creating one node's new hot tier at once saw each other's half-made directory
    opened, errors = _open_together(tmp_path)
    assert errors == [None] * 4
    assert opened[0] == 0 and opened[1] == 2 and sorted(opened[2:]) == [1, 3]


def test_a_failed_open_in_any_turn_is_raised_on_every_rank_and_ends_the_turns(tmp_path: Path) -> None:
    opened, errors = _open_together(tmp_path, fail_rank=2)  # node1's first rank
    assert opened == [0]  # ranks 1 and 3 never opened
    assert isinstance(errors[2], ds.StoreFormatError) and "hot tier of rank 2" in str(errors[2])
    for r in (0, 1, 3):
        assert isinstance(errors[r], ds.StoreFormatError)
        assert str(errors[r]).startswith("rank 2 could not open the store: StoreFormatError: hot tier of rank 2")
