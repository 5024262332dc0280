"""A population in its own process: saves 3 steps per member, exploits once, prints READY, then waits
for a line on stdin; on "load" it loads every ancestor of every member and prints LOADED N."""

from __future__ import annotations

import sys

import torch

import datastates as ds
from datastates.pbt import Population


def main(path: str) -> None:
    with ds.Store.open(path) as store:
        pop = Population(store, "sweep", size=2, metric="score", hparams=[{"lr": 0.1}, {"lr": 0.01}])
        for step in range(3):
            for m in pop.members:
                m.save({"w": torch.full((256,), float(step * 10 + m.index))}, metrics={"score": float(m.index)},
                       step=step)
        pop.exploit(pop.members[0], donor=pop.members[1])
        print("READY", flush=True)
        if sys.stdin.readline().strip() == "load":
            n = 0
            for m in pop.members:
                for vid in store.ancestors(m.branch):
                    store.load(vid)
                    n += 1
            print(f"LOADED {n}", flush=True)
        pop.close()


if __name__ == "__main__":
    main(sys.argv[1])
