"""Stores the server tests share: built once per module with the Python API, served by a real uvicorn."""

from __future__ import annotations

from pathlib import Path

import torch

import datastates as ds
from datastates.pbt import Population


def build_lineage_store(path: Path) -> Path:
    """main (6 versions), a branch with a '/' in its name, a merge, tags, a PBT population, odd tensors."""
    g = torch.Generator().manual_seed(0)
    with ds.Store.open(path, chunk_size=4096) as s:
        w = torch.randn(64, 48, generator=g)  # 12 KiB: several 4 KiB chunks, so ranges cross chunks
        for i in range(6):
            w = w + 0.01 * torch.randn(64, 48, generator=g)
            state = {"model": {"fc.weight": w.clone(), "fc.bias": torch.arange(8, dtype=torch.float64) * i,
                               "emb": torch.ones(3, 2, dtype=torch.bfloat16) * i, "mask": torch.tensor([True, False]),
                               "ids": torch.arange(5, dtype=torch.int32)},
                     "optim": {"lr": 0.1, "steps": i}}
            s.save(state, step=i * 10, hparams={"lr": 1e-3 * (i + 1), "opt": "adam"},
                   metrics={"loss": 1.0 / (i + 1), "acc": 0.5 + i * 0.05}, message=f"step {i}")
        s.tag("best", "main~1", message="best so far")
        s.branch("lr/high", at="main~3")
        side = s.save({"model": {"fc.weight": torch.zeros(64, 48), "fc.bias": torch.ones(8, dtype=torch.float64)}},
                      branch="lr/high", step=35, hparams={"lr": 0.5}, metrics={"loss": 0.05})
        s.save({"model": {"fc.weight": torch.full((64, 48), 2.0), "fc.bias": torch.ones(8, dtype=torch.float64),
                          "nan": torch.tensor([float("nan"), 1.0])}},
               branch="main", parents=["main", side], step=70, metrics={"loss": None}, message="soup")
        s.annotate("main~2", metrics={"val_acc": 0.91})
        pop = Population(s, "sweep", size=2, metric="score", hparams=[{"lr": 0.1}, {"lr": 0.01}])
        for t in range(2):
            for m in pop.members:
                m.save({"p": torch.full((4,), float(t + m.index))}, metrics={"score": float(m.index + t)}, step=t)
        pop.exploit(pop.members[0], donor=pop.members[1])
        pop.explore(pop.members[0], {"lr": 0.2})
    return path
