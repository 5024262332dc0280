"""One rank of a collective save or load, launched by tests/test_distributed.py under a real `mpiexec`
(mpi4py) or as one of N processes of a torch.distributed gloo group.

    python dist_job.py BACKEND STORE MODE [INIT_FILE]
    BACKEND: mpi | torch (torch: RANK and WORLD_SIZE in the environment, INIT_FILE the rendezvous)
    MODE:    save   - save two versions (sync, then async) with replicated "model" and "optim" and a
                      per-rank "shard"; print one JSON line per version with this rank's bytes written
             load   - load "main" and check what this world size can get, bit-exact; print JSON
             killed - rank 1 SIGKILLs itself just before its commit report (after its packs are sealed)
             mismatch - rank 1's replicated "model" has another shape: every rank must refuse the save;
                        then a second save works on every rank
             refused - only rank 1's state holds an unsupported value: every rank refuses that save, and the
                       next save holds the next step on every rank
             pipelined - six save_async back to back on every rank, then their results
             hang   - rank 1 never joins the save: rank 0 gets CommTimeoutError, then aborts the job
             failrank - rank 1's pack writes fail (OSError) in the first save: every rank must get
                        SaveFailedError, nothing visible; then a second save works on every rank
             flushed - as save, then wait until the flusher has everything on cold; report this
                       rank's packs of the last version

Node-local hot tiers (optional, from the environment): FAKE_NODES=k puts the ranks on k fake nodes
($DATASTATES_NODE = node0..), DIST_HOT a hot directory with "{node}" in it, DIST_PARTNER=1 partner
replication; DIST_OWN_ONLY=1 makes "load" read no other rank's shard (not on this node's tier).

Every rank appends its results as JSON lines to $DIST_OUT/<rank>.jsonl (mpiexec may interleave the
ranks' stdout mid-line); the test reads them.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import datastates as ds

N_REPLICATED = 16
ELEMS = 16384  # 64 KiB of float32 per replicated tensor


def replicated_state(step: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    model = {f"layer{i}.weight": torch.randn(ELEMS, generator=g) for i in range(N_REPLICATED // 2)}
    optim = {f"exp_avg.{i}": torch.randn(ELEMS, generator=g) for i in range(N_REPLICATED // 2)}
    return {"model": model, "optim": optim}


def shard(rank: int, step: int) -> torch.Tensor:
    return torch.full((1024,), float(rank * 100 + step))


def report(rank: int, obj: dict[str, object]) -> None:
    with open(os.path.join(os.environ["DIST_OUT"], f"{rank}.jsonl"), "a") as f:
        f.write(json.dumps(obj) + "\n")


def comm_for(backend: str, init_file: str | None) -> object:
    if backend == "mpi":
        from mpi4py import MPI

        return MPI.COMM_WORLD
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    return "torch"


def world_rank(backend: str) -> tuple[int, int]:
    if backend == "mpi":
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def main() -> None:
    backend, path, mode = sys.argv[1:4]
    hot = None
    if os.environ.get("FAKE_NODES"):
        r, n = world_rank(backend)
        node = f"node{r * int(os.environ['FAKE_NODES']) // n}"
        os.environ["DATASTATES_NODE"] = node  # before the communicator reads it
        hot = os.environ["DIST_HOT"].replace("{node}", node) if os.environ.get("DIST_HOT") else None
    comm = comm_for(backend, sys.argv[4] if len(sys.argv) > 4 else None)
    if mode == "apart":
        # Each rank opens a store of its own (a relative path from different working directories): refused on
        # every rank; before, each rank wrote its own packs and rank 0 committed a version it could not read.
        r, _ = world_rank(backend)
        try:
            ds.Store.open(f"{path}-{r}", comm=comm)
            outcome = "opened"
        except ds.DataStatesError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        report(r, {"rank": r, "outcome": outcome})
        return
    store = ds.Store.open(path, comm=comm, hot=hot, partner=os.environ.get("DIST_PARTNER") == "1",
                          create=mode != "load")
    rank, size = store.comm.rank, store.comm.size
    if mode == "killed" and rank == 1:
        import datastates.store as store_module

        original = store_module.make_visible_collective

        def die(*args: object, **kw: object) -> object:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9, at the instant under test
            return original(*args, **kw)  # type: ignore[arg-type]

        store_module.make_visible_collective = die  # type: ignore[assignment]
    if mode in ("save", "killed", "flushed"):
        for step in (1, 2):
            state = {**replicated_state(step), "shard": shard(rank, step)}
            if step == 1:
                v = store.save(state, step=step, replicated=["model", "optim"])
            else:
                v = store.save_async(state, step=step, replicated=["model", "optim"]).result()
            row = {"rank": rank, "size": size, "step": step, "id": v.id,
                   "written": v.timings.get("rank_bytes_written"), "world_size": v.world_size,
                   "partners": v.partners, "node": store.comm.node}
            if mode == "save" and step == 2:
                # In a job of the version's world size, export without rank= writes this rank's own entries.
                out = ds.export(store, v.id, "torch", os.path.join(os.environ["DIST_OUT"], f"export-{rank}.pt"))
                row["exported_shard"] = torch.load(out, weights_only=True)["shard"][0].item()
            report(rank, row)
        if mode == "flushed":
            report(rank, {"rank": rank, "flushed": store.flush(timeout=120)})
    elif mode == "mismatch":
        state = replicated_state(1)
        if rank == 1:
            state["model"]["layer0.weight"] = torch.zeros(3)
        try:
            store.save({**state, "shard": shard(rank, 1)}, step=1, replicated=["model", "optim"])
            outcome = "saved"
        except ds.DataStatesError as exc:
            outcome = type(exc).__name__
        versions = len(store.find(""))
        then = store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2, replicated=["model", "optim"])
        report(rank, {"rank": rank, "outcome": outcome, "versions": versions, "then": then.id})
    elif mode == "refused":
        # Only rank 1's state holds a value no save takes: every rank must refuse that save, and the next save
        # must be the next on every rank (not rank 0's step 1 beside rank 1's step 2).
        state = {**replicated_state(1), "shard": shard(rank, 1)}
        if rank == 1:
            state["extra"] = object()
        try:
            store.save(state, step=1, replicated=["model", "optim"])
            first = "saved"
        except ds.DataStatesError as exc:
            first = type(exc).__name__
        v = store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2, replicated=["model", "optim"])
        report(rank, {"rank": rank, "first": first, "second": v.id, "step": v.step,
                      "shards": [store.load(v.id, rank=r, keys=["shard"])["shard"][0].item() for r in range(size)]})
    elif mode == "typo":
        # Only rank 1 misspells a keyword of save (a TypeError, not one of ours): rank 0's step-1 plan met rank 1's
        # step-2 one, and one version held two steps' shards. Then every rank passes replicated as a str.
        state = {**replicated_state(1), "shard": shard(rank, 1)}
        kw = {"mesage": "typo"} if rank == 1 else {}
        firsts = []
        for call, extra in ((store.save, kw), (store.save_async, kw), (store.save, {"replicated": "model"}),
                            (store.save, {"replicated": ["model", "optm.*"]})):
            try:
                call(state, step=1, **{"replicated": ["model", "optim"], **extra})  # type: ignore[operator]
                firsts.append("saved")
            except (ds.DataStatesError, TypeError) as exc:
                firsts.append(type(exc).__name__)
        gen = store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2,
                         replicated=(p for p in ["model", "optim"]))  # a generator: used up by the check once
        v = store.save({**replicated_state(3), "shard": shard(rank, 3)}, step=3, replicated=["model", "optim"])
        report(rank, {"rank": rank, "firsts": firsts, "second": v.id, "step": v.step, "versions": len(store.find("")),
                      "gen_replicated": gen.replicated,
                      "shards": [store.load(v.id, rank=r, keys=["shard"])["shard"][0].item() for r in range(size)]})
    elif mode == "gone":
        # Rank 1 leaves the job (exits) once the store is open; over gloo rank 0's save met a closed connection
        # and raised torch's RuntimeError, not one of ours.
        if rank == 1:
            store.close()
            os._exit(0)
        try:
            store.save({**replicated_state(1), "shard": shard(rank, 1)}, step=1, replicated=["model", "optim"])
            outcome = "saved"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        report(rank, {"rank": rank, "outcome": outcome})
        os._exit(0)  # the process group cannot be torn down cleanly without its peer
    elif mode == "badarg":
        # Only rank 1 passes an argument save_async refuses before the save's collectives (an optimizer= that is
        # none): rank 0 waited in the plan until the communicator's timeout. Every rank must refuse it.
        state = {**replicated_state(1), "shard": shard(rank, 1)}
        kw: dict[str, object] = {"optimizer": "not an optimizer"} if rank == 1 else {}
        try:
            store.save_async(state, step=1, replicated=["model", "optim"], lazy=True, **kw).result()  # type: ignore[arg-type]
            first = "saved"
        except ds.DataStatesError as exc:
            first = type(exc).__name__
        v = store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2, replicated=["model", "optim"])
        report(rank, {"rank": rank, "first": first, "second": v.id, "step": v.step, "versions": len(store.find(""))})
    elif mode == "pipelined":
        # save_async back to back, as a training loop does: the next save's plan (on this thread) runs while the
        # pipeline thread commits the one before; their collectives crossed on one communicator.
        handles = [store.save_async({**replicated_state(step), "shard": shard(rank, step)}, step=step,
                                    replicated=["model", "optim"]) for step in range(1, 7)]
        got = [h.result() for h in handles]
        report(rank, {"rank": rank, "ids": [v.id for v in got], "steps": [v.step for v in got],
                      "shards": [[store.load(v.id, rank=r, keys=["shard"])["shard"][0].item() for r in range(size)]
                                 for v in got]})
    elif mode == "hang":
        # Rank 1 never joins the save (a hung rank): rank 0's collective times out ($DATASTATES_COMM_TIMEOUT)
        # with CommTimeoutError, reports, and aborts the job as a training script would.
        if rank == 1:
            import threading

            threading.Event().wait()  # forever: mpiexec ends this rank when rank 0 aborts
        try:
            store.save({**replicated_state(1), "shard": shard(rank, 1)}, step=1, replicated=["model", "optim"])
            outcome = "saved"
        except ds.DataStatesError as exc:
            outcome = type(exc).__name__
        report(rank, {"rank": rank, "outcome": outcome, "visible": len(store.find(""))})
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(3)
    elif mode in ("failrank", "failmanifest"):
        # Rank 1's disk fills up: while it writes its packs (before the commit's first exchange), or while it
        # writes its manifest (between the commit's two exchanges: the others then waited for it forever).
        from datastates.objects.packs import PackWriter
        from datastates.objects.tier import Tier

        owner, name = (PackWriter, "append_stored") if mode == "failrank" else (Tier, "write_manifest")
        original = getattr(owner, name)
        if rank == 1:
            def failing(self: object, *args: object, **kw: object) -> object:
                raise OSError(28, "No space left on device (injected)")

            setattr(owner, name, failing)
        firsts = []
        for how in ("save", "save_async"):
            try:
                state = {**replicated_state(1), "shard": shard(rank, 1)}
                if how == "save":
                    store.save(state, step=1, replicated=["model", "optim"])
                else:
                    store.save_async(state, step=1, replicated=["model", "optim"]).result()
                firsts.append("saved")
            except ds.DataStatesError as exc:
                firsts.append(type(exc).__name__)
        setattr(owner, name, original)
        store.wait()  # each failure was heard of through its call: nothing more to report
        visible = len(store.find(""))
        v = store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2, replicated=["model", "optim"])
        report(rank, {"rank": rank, "first": firsts[0], "firsts": firsts, "visible_after_failure": visible,
                      "second": v.id, "log": [x.step for x in store.log("main")]})
    elif mode == "offhead":
        # A collective save whose explicit parents leave main's head reachable by no ref: rank 0's commit refuses
        # it under the ref lock, and every rank hears of it (no rank refuses at the call and leaves the others
        # waiting in the save's collectives).
        v1 = store.save({**replicated_state(1), "shard": shard(rank, 1)}, step=1, replicated=["model", "optim"])
        store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2, replicated=["model", "optim"])
        try:
            store.save({**replicated_state(3), "shard": shard(rank, 3)}, step=3, parents=[v1.id],
                       replicated=["model", "optim"])
            first = "saved"
        except ds.DataStatesError as exc:
            first = type(exc).__name__
            try:
                store.wait()
            except ds.SaveFailedError:
                pass
        visible = len(store.find(""))
        forced = store.save({**replicated_state(3), "shard": shard(rank, 3)}, step=3, parents=[v1.id], force=True,
                            replicated=["model", "optim"])
        report(rank, {"rank": rank, "first": first, "visible_after_refusal": visible,
                      "forced_parents": list(forced.parents), "v1": v1.id,
                      "log": [x.step for x in store.log("main")]})
    elif mode == "lineage":
        # Rank 1 gives another step, then another branch: rank 0's were recorded and rank 1's ignored. Every rank
        # refuses such a save, before anything is written; the next save with the same arguments works.
        state = {**replicated_state(1), "shard": shard(rank, 1)}
        firsts: list[str] = []
        for kw in ({"step": 1 + rank}, {"step": 1, "branch": f"b{rank}"}):
            try:
                store.save(state, replicated=["model", "optim"], **kw)  # type: ignore[arg-type]
                firsts.append("saved")
            except ds.DataStatesError as exc:
                firsts.append(f"{type(exc).__name__}: {exc}")
        v = store.save(state, step=1, replicated=["model", "optim"])
        report(rank, {"rank": rank, "firsts": firsts, "step": v.step, "versions": len(store.find("")),
                      "branches": sorted(store.branches())})
    elif mode == "tagall":
        # SPMD code tags and branches on every rank: the same ref at the same version is no conflict on any
        # rank; a tag at another version is.
        v1 = store.save({**replicated_state(1), "shard": shard(rank, 1)}, step=1, replicated=["model", "optim"])
        v2 = store.save({**replicated_state(2), "shard": shard(rank, 2)}, step=2, replicated=["model", "optim"])
        row: dict[str, object] = {"rank": rank, "v1": v1.id}
        # The same ref at once on every rank (whichever wins, each ends at v1); then one at another version per
        # rank, rank 0 first (so that which one conflicts is known).
        for what, call in (("tag", lambda: store.tag("best", v1.id)), ("branch", lambda: store.branch("b", v1.id)),
                           ("other", lambda: store.tag("mine", (v1 if rank == 0 else v2).id))):
            for turn in range(size) if what == "other" else [rank]:
                store.comm.barrier()
                if turn == rank:
                    try:
                        row[what] = call()
                    except ds.DataStatesError as exc:
                        row[what] = type(exc).__name__
        row["tags"] = store.tags()
        report(rank, row)
    elif mode == "load":
        v = store.version("main")
        # node-local tiers: first the packs this rank's load needs from other nodes (a restart)
        fetched = store.fetch_from_peers("main") if hot is not None else 0
        got = store.load("main")
        want = replicated_state(v.step or 0)
        same = all(torch.equal(got[g][k], want[g][k]) for g in want for k in want[g])
        shards = {}
        others = range(v.world_size) if os.environ.get("DIST_OWN_ONLY") != "1" else [rank]
        for r in others:  # any rank can read any rank's sharded entries explicitly
            shards[r] = bool(torch.equal(store.load("main", rank=r, keys=["shard"])["shard"], shard(r, v.step or 0)))
        own = "shard" in got
        if own:
            own = bool(torch.equal(got["shard"], shard(rank, v.step or 0)))
        report(rank, {"rank": rank, "size": size, "replicated_ok": same, "keys": sorted(got),
                      "own_shard_ok": own, "shards_ok": shards, "fetched": fetched})
    store.close()


if __name__ == "__main__":
    main()
