"""One rank of a torch.distributed.checkpoint save or load through ds.dcp, in a gloo group of N
processes (RANK, WORLD_SIZE in the environment). A DTensor sharded over all ranks, a plain replicated
tensor and a plain value; the load reshards to this world size. Results go to $DIST_OUT/<rank>.jsonl.

    python dcp_job.py STORE save|load INIT_FILE
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import datastates as ds

ROWS = 24  # divisible by 2, 3 and 4: every world size gets whole shards


def full_weight() -> torch.Tensor:
    return torch.arange(ROWS * 8, dtype=torch.float32).reshape(ROWS, 8) / 7


def main() -> None:
    path, mode, init = sys.argv[1:4]
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    mesh = init_device_mesh("cpu", (size,))
    store = ds.Store.open(path)
    out: dict[str, object] = {"rank": rank, "size": size}
    if mode == "save":
        state = {"w": distribute_tensor(full_weight(), mesh, [Shard(0)]), "bias": torch.linspace(0, 1, 5),
                 "extra": {"step": 7}}
        writer = ds.dcp.StoreWriter(store, branch="dcp", step=7)
        dcp.save(state, storage_writer=writer)
        if writer.version is not None:
            out["id"] = writer.version.id
            out["world_size"] = writer.version.world_size
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
