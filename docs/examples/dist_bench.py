"""Distributed save benchmark: N ranks (gloo, one machine) saving one data-parallel state.

    python docs/examples/dist_bench.py --ranks 4 --size 256MiB --repeats 3 --dir /tmp/dbench

Compares, interleaved per repeat, after the same warm-up:
- datastates: every rank calls `store.save(state, replicated=["model", "optim"])` (collective; the
  replicated bytes are written once in total, spread over the ranks), time to durable on every rank;
- rank-0 torch.save: rank 0 writes the whole state with torch.save + fsync while the others wait;
- DCP: `dcp.save(state, storage_writer=FileSystemWriter(dir))` on every rank (its planner also
  writes replicated tensors once);
- datastates + partner: the ranks on two fake nodes ($DATASTATES_NODE), each node with its own hot
  tier, `partner=True`: each rank's packs are also copied to a rank on the other node before the
  version is visible (flush to cold off, to time the node-local path alone).
Reports the median time (max over ranks, barrier to barrier) and the bytes each rank wrote.
Each method's state changes before every save (add_(1)), so no dedup can skip bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for u, m in UNITS.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import datastates as ds

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = f"node{rank * 2 // size}"
    os.environ["DATASTATES_NODE"] = node  # two fake nodes, for the partner method
    dist.init_process_group("gloo", init_method=f"file://{args.dir}/init", rank=rank, world_size=size)
    n = 64
    per = args.size // n // 4
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(per // 2, generator=g) for i in range(n // 2)},
             "optim": {f"m{i}": torch.randn(per // 2, generator=g) for i in range(n // 2)}}
    state = {"model": {**state["model"], **{f"v{i}": torch.randn(per // 2, generator=g) for i in range(n // 2)}},
             "optim": {**state["optim"], **{f"s{i}": torch.randn(per // 2, generator=g) for i in range(n // 2)}}}
    store = ds.Store.open(Path(args.dir) / "store", comm="torch")
    partnered = ds.Store.open(Path(args.dir) / "cold", comm="torch", hot=Path(args.dir) / f"hot-{node}",
                              partner=True, flush=ds.Flush(tagged_only=True))
    times: dict[str, list[float]] = {"datastates": [], "rank0_torch_save": [], "dcp": [], "datastates_partner": []}
    written: dict[str, int] = {}

    def bump() -> None:
        for group in state.values():
            for t in group.values():
                t.add_(1)

    for rep in range(args.repeats + 1):  # the first round warms up every method
        for method in times:
            bump()
            dist.barrier()
            t0 = time.perf_counter()
            if method == "datastates":
                v = store.save(state, step=rep, replicated=["model", "optim"])
                written[method] = int(v.timings.get("rank_bytes_written", 0))
            elif method == "datastates_partner":
                v = partnered.save(state, step=rep, replicated=["model", "optim"])
                # its own packs plus the partner copy it received (the same amount, the ring is a permutation)
                written[method] = int(v.timings.get("rank_bytes_written", 0) + v.timings.get("partner_bytes", 0))
            elif method == "rank0_torch_save":
                if rank == 0:
                    path = Path(args.dir) / "torch.pt"
                    with open(path, "wb") as f:
                        torch.save(state, f)
                        f.flush()
                        os.fsync(f.fileno())
                    written[method] = path.stat().st_size
                else:
                    written[method] = 0
            else:
                out = Path(args.dir) / f"dcp-{rep}"
                dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out), sync_files=True))
                mine = [p for p in out.glob(f"__{rank}_*")]
                written[method] = sum(p.stat().st_size for p in mine)
            dist.barrier()
            if rep:
                times[method].append(time.perf_counter() - t0)
            if method == "dcp" and rank == 0:
                shutil.rmtree(Path(args.dir) / f"dcp-{rep}", ignore_errors=True)
    store.close()
    partnered.close()
    print(json.dumps({"rank": rank, "times": times, "written": written}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"), help="state bytes per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="dist-bench")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", "--ranks", str(args.ranks), "--size",
                               str(args.size), "--repeats", str(args.repeats), "--dir", str(d)],
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.ranks)},
                              stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
    rows = [json.loads(pr.communicate()[0].strip().splitlines()[-1]) for pr in procs]
    print(f"{args.ranks} ranks, state {args.size / 2**20:.0f} MiB per rank (all replicated), "
          f"{args.repeats} repeats, medians of the slowest rank per repeat")
    print(f"{'method':<18} {'time to durable':>16} {'bytes written per rank (MiB)':>32}")
    for method in rows[0]["times"]:
        per_rep = [max(r["times"][method][i] for r in rows) for i in range(args.repeats)]
        w = ", ".join(f"{r['written'][method] / 2**20:.1f}" for r in sorted(rows, key=lambda r: r["rank"]))
        print(f"{method:<18} {statistics.median(per_rep):>15.3f}s {w:>32}")
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
