"""One rank of a torch.distributed.checkpoint save or load through ds.dcp, in a gloo group of N
processes (RANK, WORLD_SIZE in the environment). A DTensor sharded over all ranks, a plain replicated
tensor and a plain value; the load reshards to this world size. Results go to $DIST_OUT/<rank>.jsonl.

    python dcp_job.py STORE save|load INIT_FILE

With DCP_COMM=1 every rank opens the store with the job's group (`comm="torch"`), and then, as in
dist_job.py, FAKE_NODES=k puts the ranks on k fake nodes with DIST_HOT ("{node}" in it) as each node's
hot tier and DIST_PARTNER=1 turns partner copies on.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import datastates as ds

ROWS = 24  # divisible by 2, 3 and 4: every world size gets whole shards


def full_weight() -> torch.Tensor:
    return torch.arange(ROWS * 8, dtype=torch.float32).reshape(ROWS, 8) / 7


class PlannerWithoutMetadata(DefaultSavePlanner):
    """A planner that keeps its global metadata to itself (as a custom planner may)."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = super().create_global_plan(all_plans)
        del self.metadata
        return plans, metadata


def main() -> None:
    path, mode, init = sys.argv[1:4]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    if os.environ.get("DCP_COMM") == "1":
        hot = None
        if os.environ.get("FAKE_NODES"):
            node = f"node{rank * int(os.environ['FAKE_NODES']) // size}"
            os.environ["DATASTATES_NODE"] = node  # before the communicator reads it
            hot = os.environ["DIST_HOT"].replace("{node}", node)
        store = ds.Store.open(path, comm="torch", hot=hot, partner=os.environ.get("DIST_PARTNER") == "1",
                              create=mode != "load")
    else:
        store = ds.Store.open(path)
    out: dict[str, object] = {"rank": rank, "size": size}
    if mode in ("save", "save-custom-planner"):
        state = {"w": distribute_tensor(full_weight(), mesh, [Shard(0)]), "bias": torch.linspace(0, 1, 5),
                 "extra": {"step": 7}}
        writer = ds.dcp.StoreWriter(store, branch="dcp", step=7)
        if mode == "save-custom-planner":
            try:
                dcp.save(state, storage_writer=writer, planner=PlannerWithoutMetadata())
            except BaseException as exc:  # DCP's CheckpointException (every rank's errors) is a BaseException
                out["error"] = str(exc)
        else:
            dcp.save(state, storage_writer=writer)
        if writer.version is not None:
            out["id"] = writer.version.id
            out["world_size"] = writer.version.world_size
            out["partners"] = writer.version.partners
        if os.environ.get("DCP_COMM") == "1" and "error" not in out:
            out["head"] = store.resolve("dcp")  # what this rank's node knows as the branch's head
    else:
        state = {"w": distribute_tensor(torch.zeros(ROWS, 8), mesh, [Shard(0)]), "bias": torch.zeros(5),
                 "extra": {"step": 0}}
        dcp.load(state, storage_reader=ds.dcp.StoreReader(store, "dcp"))
        full = state["w"].full_tensor()
        out["w_ok"] = bool(torch.equal(full, full_weight()))
        out["local_rows"] = int(state["w"].to_local().shape[0])
        out["bias_ok"] = bool(torch.equal(state["bias"], torch.linspace(0, 1, 5)))
        out["step"] = state["extra"]["step"]
    with open(os.path.join(os.environ["DIST_OUT"], f"{rank}.jsonl"), "a") as f:
        f.write(json.dumps(out) + "\n")
    store.close()
    # Every rank past its last collective before any tears gloo down: a rank destroying its group while a peer's
    # gloo threads still talked to it ended one of three loading ranks with SIGABRT ("terminate called without
    # an active exception"), once in ~10 runs.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
