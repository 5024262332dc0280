"""Collective saves and loads over real `mpiexec` (mpi4py, the mpich wheel) and torch.distributed (gloo).

Each launch runs tests/helpers/dist_job.py on every rank under an outer timeout; the ranks write
JSON lines into a fresh directory, which these tests check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import datastates as ds
from datastates.base.comm import SingleComm
from datastates.meta.versions import Version
from datastates.repo.reader import rank_for

JOB = Path(__file__).parent / "helpers" / "dist_job.py"
MPIEXEC = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
LAUNCH_TIMEOUT = 240
REPLICATED_BYTES = 16 * 16384 * 4  # 16 tensors of 64 KiB (see dist_job.py)
SHARD_BYTES = 1024 * 4

mpi = pytest.mark.skipif(not Path(MPIEXEC).exists(), reason="needs mpiexec (pip install mpich mpi4py)")


def _outdir(store: Path) -> Path:
    n = 0
    while (store.parent / f"out-{n}").exists():
        n += 1
    out = store.parent / f"out-{n}"
    out.mkdir()
    return out


def _read(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) for line in f.read_text().splitlines()]


def mpirun(n: int, store: Path, mode: str, check: bool = True,
           env: dict[str, str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run the job on n ranks; (mpiexec's exit status, every rank's results)."""
    out = _outdir(store)
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(JOB), "mpi", str(store), mode],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          env={**os.environ, "DIST_OUT": str(out), **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode, _read(out)


def torchrun(n: int, store: Path, mode: str, init: Path, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return _launch(n, store, [str(JOB), "torch", str(store), mode, str(init)], env)


def _launch(n: int, store: Path, argv: list[str], env: dict[str, str] | None) -> list[dict[str, Any]]:
    """`n` ranks of `python argv...` (RANK and WORLD_SIZE set, as torchrun would), each rank's output read back."""
    out = _outdir(store)
    env = {**os.environ, "WORLD_SIZE": str(n), "DIST_OUT": str(out), **(env or {})}
    procs = [subprocess.Popen([sys.executable, *argv], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    try:
        # Every rank's end, not only the first failure's: a rank that dies shows up in the others as a closed
        # connection, and the cause is in its own output.
        ended = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    failed = [f"rank {r} exited {p.returncode}:\n{o[-1500:]}{e[-1500:]}"
              for r, (p, (o, e)) in enumerate(zip(procs, ended)) if p.returncode != 0]
    assert not failed, "\n".join(failed)
    return _read(out)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_replicated_entries_are_written_once_spread_over_ranks_and_load_at_any_world_size(tmp_path: Path) -> None:
    store = tmp_path / "store"
    _, saved = mpirun(4, store, "save")
    exported = {r["rank"]: r["exported_shard"] for r in saved if "exported_shard" in r}
    assert exported == {r: r * 100 + 2.0 for r in range(4)}  # each rank's own entries (a review)
    assert len(saved) == 8  # 4 ranks x 2 versions (a sync save, then save_async)
    for step in (1, 2):
        rows = [r for r in saved if r["step"] == step]
        assert len({r["id"] for r in rows}) == 1 and all(r["world_size"] == 4 for r in rows)
        written = [r["written"] - SHARD_BYTES for r in rows]  # each rank also writes its own shard
        assert sum(written) == REPLICATED_BYTES  # every replicated byte written exactly once
        assert max(written) <= 1.5 * (REPLICATED_BYTES / 4)  # spread within 1.5x of even
    with ds.Store.open(store) as s:
        v = s.version("main")
        assert v.world_size == 4 and sorted(v.manifests) == ["0", "1", "2", "3"] and v.replicated == ["model", "optim"]
        assert v.bytes_new == REPLICATED_BYTES + 4 * SHARD_BYTES
        assert s.fsck().ok
        # An export at world size 1 held only the replicated entries, silently (a hunt): it takes a rank.
        with pytest.raises(ds.InvalidArgumentError, match="saved by 4 ranks"):
            ds.export(s, v, "torch", tmp_path / "all.pt")
        assert not (tmp_path / "all.pt").exists()
        got = torch.load(ds.export(s, v, "torch", tmp_path / "r2.pt", rank=2), weights_only=True)
        assert sorted(got) == ["model", "optim", "shard"] and torch.equal(got["shard"], torch.full((1024,), 202.0))
    for n in (4, 2, 3):  # the same world size, then fewer ranks than saved
        _, loaded = mpirun(n, store, "load")
        assert len(loaded) == n
        assert all(r["replicated_ok"] and all(r["shards_ok"].values()) and len(r["shards_ok"]) == 4 for r in loaded)
        assert all(r["own_shard_ok"] == (n == 4) for r in loaded)  # own shards only at the saved world size


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_a_version_saved_by_two_ranks_loads_on_four(tmp_path: Path) -> None:
    store = tmp_path / "store"
    mpirun(2, store, "save")
    _, loaded = mpirun(4, store, "load")
    assert sorted(r["rank"] for r in loaded) == [0, 1, 2, 3]
    assert all(r["replicated_ok"] and r["keys"] == ["model", "optim"] and r["shards_ok"] == {"0": True, "1": True}
               for r in loaded)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_a_rank_killed_mid_save_leaves_nothing_visible_and_the_next_save_works(tmp_path: Path) -> None:
    store = tmp_path / "store"
    status, out = mpirun(2, store, "killed", check=False)
    assert status != 0 and out == []  # rank 1 died before any version was committed
    with ds.Store.open(store) as s:
        assert s.find("") == []
        assert s.branches() == {}
        assert not s.fsck().ok  # the sealed packs of the interrupted save are reported ...
        assert s.fsck(repair=True).repaired  # ... and removed by repair
        assert s.fsck().ok
    _, saved = mpirun(2, store, "save")
    assert len({r["id"] for r in saved if r["step"] == 2}) == 1
    with ds.Store.open(store) as s:
        assert [v.step for v in s.log("main")] == [2, 1] and s.fsck().ok


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_replicated_entries_that_differ_across_ranks_are_refused_on_every_rank(tmp_path: Path) -> None:
    _, out = mpirun(2, tmp_path / "store", "mismatch")
    assert sorted(r["rank"] for r in out) == [0, 1]
    assert all(r["outcome"] == "InvalidArgumentError" and r["versions"] == 0 for r in out)
    assert len({r["then"] for r in out}) == 1  # the next save works (it hung: the refused one kept its turn)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_a_value_one_rank_cannot_save_refuses_the_save_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 refused its state before the save's collectives and rank 0 went on: rank 0's step-1 plan met rank
    1's step-2 one, and the version recorded as step 1 held rank 1's step-2 shard."""
    _, out = mpirun(2, tmp_path / "store", "refused")
    assert {r["rank"]: r["first"] for r in out} == {0: "InvalidArgumentError", 1: "UnsupportedValueError"}
    assert len({r["second"] for r in out}) == 1
    assert all(r["step"] == 2 and r["shards"] == [2.0, 102.0] for r in out)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_an_argument_one_rank_refuses_refuses_the_save_on_every_rank(tmp_path: Path) -> None:
    """An argument save_async refuses before the plan (optimizer= that is none), on one rank: the others waited in
    the plan until the communicator's timeout (the twenty-seventh session's note)."""
    _, out = mpirun(2, tmp_path / "store", "badarg")
    assert {r["rank"]: r["first"] for r in out} == {0: "InvalidArgumentError", 1: "InvalidArgumentError"}
    assert len({r["second"] for r in out}) == 1
    assert all(r["step"] == 2 and r["versions"] == 1 for r in out)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_a_keyword_typo_on_one_rank_refuses_the_save_on_every_rank(tmp_path: Path) -> None:
    """A misspelt keyword raised a TypeError on rank 1 only, which skipped the refusal the others wait for: rank
    0's step-1 save paired with rank 1's step-2 one and committed a version of two steps' shards (a hunt; for
    save_async Python raised it before the call, a review). replicated='model' (a str) was taken letter by letter;
    it is refused; a generator was used up by that check (a review). A pattern that matches no key ('optm.*')
    made a version that could not load at another world size: refused too."""
    _, out = mpirun(2, tmp_path / "store", "typo")
    refused = ["InvalidArgumentError"] * 4
    assert {r["rank"]: r["firsts"] for r in out} == {
        0: refused, 1: ["UnexpectedArgumentError", "UnexpectedArgumentError", "InvalidArgumentError",
                        "InvalidArgumentError"]}
    assert len({r["second"] for r in out}) == 1
    assert all(r["step"] == 3 and r["versions"] == 2 and r["shards"] == [3.0, 103.0] for r in out)
    assert all(r["gen_replicated"] == ["model", "optim"] for r in out)  # a generator was used up: none


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_ranks_that_opened_different_stores_are_refused_at_open(tmp_path: Path) -> None:
    """Each rank saved into a store of its own and every rank reported success; the version was unreadable (a hunt)."""
    _, out = mpirun(2, tmp_path / "store", "apart")
    assert sorted(r["rank"] for r in out) == [0, 1]
    assert all(r["outcome"].startswith("InvalidArgumentError: the ranks opened 2 different stores") for r in out)
    assert all(f"rank {r}: {tmp_path / 'store'}-{r}" in out[0]["outcome"] for r in (0, 1))


@pytest.mark.timeout(600)
def test_torch_gloo_a_rank_that_left_the_job_is_a_save_failed_error(tmp_path: Path) -> None:
    """gloo's 'Connection closed by peer' reached the caller as torch's RuntimeError, not a DataStatesError."""
    out = torchrun(2, tmp_path / "store", "gone", tmp_path / "init", env={"DATASTATES_COMM_TIMEOUT": "60"})
    assert [r["rank"] for r in out] == [0]
    assert out[0]["outcome"].startswith("SaveFailedError: the job's"), out
    assert "a rank of the job left it" in out[0]["outcome"]


def _check_pipelined(out: list[dict[str, Any]], size: int) -> None:
    assert sorted(r["rank"] for r in out) == list(range(size))
    assert len({tuple(r["ids"]) for r in out}) == 1 and len(set(out[0]["ids"])) == 6
    for r in out:
        assert r["steps"] == [1, 2, 3, 4, 5, 6]
        assert r["shards"] == [[float(k * 100 + step) for k in range(size)] for step in range(1, 7)]


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_save_async_back_to_back_keeps_each_saves_collectives_apart(tmp_path: Path) -> None:
    """The caller's plan of the next save and the pipeline's commit of the one before shared one communicator:
    their messages crossed (InvalidArgumentError for equal replicated entries, a TypeError in the commit, a hang)."""
    _, out = mpirun(2, tmp_path / "store", "pipelined")
    _check_pipelined(out, 2)


@pytest.mark.timeout(600)
def test_torch_gloo_save_async_back_to_back_keeps_each_saves_collectives_apart(tmp_path: Path) -> None:
    """The same over gloo, where the crossed messages aborted a rank (gloo::EnforceNotMet, SIGABRT)."""
    _check_pipelined(torchrun(2, tmp_path / "store", "pipelined", tmp_path / "init"), 2)


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_a_rank_that_never_arrives_ends_in_a_comm_timeout_not_a_hang(tmp_path: Path) -> None:
    store = tmp_path / "store"
    status, out = mpirun(2, store, "hang", check=False, env={"DATASTATES_COMM_TIMEOUT": "5"})
    assert status != 0  # rank 0 aborted the job after the timeout
    assert out == [{"rank": 0, "outcome": "CommTimeoutError", "visible": 0}]
    with ds.Store.open(store, create=False) as s:
        assert s.find("") == [] and s.fsck().ok


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["failrank", "failmanifest"])
def test_mpi_a_failing_rank_fails_the_save_on_every_rank_and_the_next_save_works(tmp_path: Path, mode: str) -> None:
    """failmanifest: a rank failing between the commit's two exchanges (its manifest write) left the others
    waiting in the second until the communicator's timeout; save_async's messages then crossed (KeyError)."""
    _, out = mpirun(2, tmp_path / "store", mode)
    assert sorted(r["rank"] for r in out) == [0, 1]
    assert all(r["firsts"][1:] == [r["first"]] for r in out)  # save and save_async alike
    assert all(r["first"] == "SaveFailedError" for r in out), out
    assert all(r["visible_after_failure"] == 0 for r in out)
    assert len({r["second"] for r in out}) == 1 and all(r["log"] == [2] for r in out)
    with ds.Store.open(tmp_path / "store") as s:
        assert s.fsck().ok  # the failed save's packs were removed by each rank


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nodes", [1, 2])
def test_mpi_a_save_that_would_orphan_the_branch_head_is_refused_on_every_rank_unless_forced(
        tmp_path: Path, nodes: int) -> None:
    """On two (fake) nodes each with its own hot tier, the forced move is applied on both: every rank's log of
    main, read from its own node, shows it."""
    env = {"FAKE_NODES": "2", "DIST_HOT": str(tmp_path / "hot-{node}")} if nodes == 2 else None
    _, out = mpirun(2, tmp_path / "store", "offhead", env=env)
    assert sorted(r["rank"] for r in out) == [0, 1]
    firsts = {r["rank"]: r["first"] for r in out}
    assert firsts == {0: "ConflictError", 1: "SaveFailedError"}, firsts
    assert all(r["visible_after_refusal"] == 2 for r in out)
    assert all(r["forced_parents"] == [r["v1"]] and r["log"] == [3, 1] for r in out)
    with ds.Store.open(tmp_path / "store") as s:
        assert s.fsck().ok


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_ranks_that_give_a_save_different_steps_or_branches_are_refused_on_every_rank(tmp_path: Path) -> None:
    """A collective save recorded rank 0's step and branch and ignored the others' (a rank-local step counter
    went unnoticed). Now every rank refuses it, naming each rank's value, and nothing is written."""
    _, out = mpirun(2, tmp_path / "store", "lineage")
    for r in out:
        step, branch = r["firsts"]
        assert step.startswith("InvalidArgumentError") and "step (step: rank 0 1, rank 1 2)" in step
        assert branch.startswith("InvalidArgumentError") and "branch: rank 0 'b0', rank 1 'b1'" in branch
        assert r["step"] == 1 and r["versions"] == 1 and r["branches"] == ["main"]


@mpi
@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_mpi_a_tag_or_branch_made_on_every_rank_at_one_version_is_no_conflict(tmp_path: Path) -> None:
    """SPMD code calls `tag`/`branch` on every rank: all but the first raised ConflictError. The same ref at the
    same version is now no conflict; a tag the ranks want at different versions still is, on the later rank."""
    _, out = mpirun(2, tmp_path / "store", "tagall")
    v1 = out[0]["v1"]
    assert [(r["tag"], r["branch"]) for r in sorted(out, key=lambda r: r["rank"])] == [(v1, v1), (v1, v1)]
    assert [r["other"] for r in sorted(out, key=lambda r: r["rank"])] == [v1, "ConflictError"]
    assert all(r["tags"]["best"] == v1 for r in out)


@pytest.mark.timeout(600)
def test_torch_distributed_gloo_three_ranks_save_and_two_ranks_load(tmp_path: Path) -> None:
    store = tmp_path / "store"
    saved = torchrun(3, store, "save", tmp_path / "init-save")
    assert sorted(r["exported_shard"] for r in saved if "exported_shard" in r) == [2.0, 102.0, 202.0]
    assert len(saved) == 6 and len({r["id"] for r in saved if r["step"] == 2}) == 1
    written = [r["written"] - SHARD_BYTES for r in saved if r["step"] == 2]
    assert sum(written) == REPLICATED_BYTES and max(written) <= 1.5 * REPLICATED_BYTES / 3
    loaded = torchrun(2, store, "load", tmp_path / "init-load")
    assert len(loaded) == 2 and all(r["replicated_ok"] and len(r["shards_ok"]) == 3 for r in loaded)


def test_rank_for_picks_the_manifest_each_world_size_can_read() -> None:
    v = Version(id="ab" * 32, parents=(), manifests={"0": "m0", "1": "m1"}, world_size=2, replicated=["model"])
    one = SingleComm()
    assert rank_for(v, one, None) == (0, ["model"])  # another world size: rank 0's replicated entries
    assert rank_for(v, one, ["model.fc"]) == (0, ["model.fc"])
    with pytest.raises(ds.InvalidArgumentError, match="rank=r"):
        rank_for(v, one, ["shard"])
    sharded_only = Version(id="cd" * 32, parents=(), manifests={"0": "m0", "1": "m1"}, world_size=2)
    with pytest.raises(ds.InvalidArgumentError, match="no replicated entries"):
        rank_for(sharded_only, one, None)
    single = Version(id="ef" * 32, parents=(), manifests={"0": "m0"})
    assert rank_for(single, one, ["x"]) == (0, ["x"])


def test_a_store_without_comm_saves_as_one_rank(tmp_path: Path) -> None:
    import torch

    with ds.Store.open(tmp_path / "s") as s:
        v = s.save({"model": {"w": torch.ones(3)}}, replicated=["model"])
        assert v.world_size == 1 and v.replicated is None and s.comm.size == 1
        with pytest.raises(ds.InvalidArgumentError, match="not a communicator"):
            ds.Store.open(tmp_path / "t", comm=object())


DCP_JOB = Path(__file__).parent / "helpers" / "dcp_job.py"


def dcprun(n: int, store: Path, mode: str, init: Path, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    return _launch(n, store, [str(DCP_JOB), str(store), mode, str(init)], env)


@pytest.mark.timeout(600)
def test_dcp_save_at_four_ranks_loads_resharded_at_two_and_three(tmp_path: Path) -> None:
    store = tmp_path / "store"
    saved = dcprun(4, store, "save", tmp_path / "init-save")
    ids = [r["id"] for r in saved if "id" in r]
    assert len(saved) == 4 and len(ids) == 1  # the coordinator commits one version
    with ds.Store.open(store) as s:
        v = s.version("dcp")
        assert v.id == ids[0] and v.world_size == 4 and v.step == 7
        assert sorted(v.manifests) == ["0", "1", "2", "3", "dcp"]
        assert s.fsck().ok
    for n, rows in ((2, 12), (3, 8)):
        loaded = dcprun(n, store, "load", tmp_path / f"init-load-{n}")
        assert sorted(r["rank"] for r in loaded) == list(range(n))
        assert all(r["w_ok"] and r["bias_ok"] and r["step"] == 7 and r["local_rows"] == rows for r in loaded)


def test_dcp_metadata_round_trips_through_json_without_pickle(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from datastates.dcp import StoreReader, StoreWriter, decode_metadata, encode_metadata

    state = {"w": torch.arange(12.0).reshape(3, 4), "meta": {"epoch": 3, "name": "run"}}
    with ds.Store.open(tmp_path / "s") as s:
        writer = StoreWriter(s, branch="dcp", step=3)
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.version is not None and writer.version.world_size == 1
        reader = StoreReader(s, "dcp")
        meta = reader.read_metadata()
        assert decode_metadata(encode_metadata(meta)) == meta
        target = {"w": torch.zeros(3, 4), "meta": {"epoch": 0, "name": ""}}
        dcp.load(target, storage_reader=StoreReader(s, "dcp"), no_dist=True)
        assert torch.equal(target["w"], state["w"]) and target["meta"] == {"epoch": 3, "name": "run"}
        again = StoreWriter(s, branch="dcp", step=4)
        dcp.save(state, storage_writer=again, no_dist=True)
        assert again.version.parents == (writer.version.id,)
        assert again.version.bytes_new < 200  # the tensor's chunk is already stored: only the metadata is new
        s.save({"x": torch.ones(1)}, branch="plain")
        with pytest.raises(ds.NotFoundError, match="torch.distributed.checkpoint"):
            StoreReader(s, "plain").read_metadata()


def _mark(path: str) -> None:
    Path(path).write_text("ran")


class _Runs:
    """A value whose pickle calls a function at load (writes a file): what no load may run unless asked to."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_mark, (str(self.marker),))


def test_dcp_load_never_runs_a_pickled_call_unless_allowed(tmp_path: Path) -> None:
    """DCP keeps non-tensor values as pickles, which its planner loads with weights_only=False: the reader
    handed it whatever the store held, so dcp.load ran pickled code no Store.load would."""
    import torch
    import torch.distributed.checkpoint as dcp

    from datastates.dcp import StoreReader, StoreWriter

    marker = tmp_path / "ran"
    with ds.Store.open(tmp_path / "s") as s:
        dcp.save({"w": torch.arange(4.0), "extra": _Runs(marker), "step": 7},
                 storage_writer=StoreWriter(s, branch="dcp"), no_dist=True)
        target: dict[str, Any] = {"w": torch.zeros(4), "extra": None, "step": 0}
        with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
            dcp.load(target, storage_reader=StoreReader(s, "dcp"), no_dist=True)
        inner = info.value.failures[0][0]  # type: ignore[attr-defined]  # (exception, its frames) of rank 0
        assert isinstance(inner, ds.UnsupportedValueError) and "'extra'" in str(inner)
        assert "allow_pickle=True" in str(inner)
        assert not marker.exists()
        assert torch.equal(target["w"], torch.zeros(4)) and target["step"] == 0  # nothing loaded before the refusal
        dcp.load(target, storage_reader=StoreReader(s, "dcp", allow_pickle=True), no_dist=True)
        assert marker.read_text() == "ran" and target["step"] == 7 and torch.equal(target["w"], torch.arange(4.0))


def test_comm_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from datastates.base.comm import DEFAULT_TIMEOUT, comm_timeout

    monkeypatch.delenv("DATASTATES_COMM_TIMEOUT", raising=False)
    assert comm_timeout() == DEFAULT_TIMEOUT
    monkeypatch.setenv("DATASTATES_COMM_TIMEOUT", "2.5")
    assert comm_timeout() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv("DATASTATES_COMM_TIMEOUT", bad)
        with pytest.raises(ds.InvalidArgumentError, match="DATASTATES_COMM_TIMEOUT"):
            comm_timeout()
