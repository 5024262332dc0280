"""A toy population-based training run on CPU (well under a minute): see docs/pbt.md.

Eight members fit the same noisy linear regression with SGD, each from its own learning rate.
Every `--interval` steps each member saves its model and optimizer on its branch with its
validation loss; a member in the bottom quarter then *exploits* (forks a top member's latest
version: no bytes copied) and *explores* (multiplies its learning rate by 0.8 or 1.25). The store
records both as fields of the versions, so the family tree and each member's schedule are queries.

    python docs/examples/pbt_toy.py --store runs/pbt-store
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

import datastates as ds
from datastates.pbt import Population


def make_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    # float64 throughout: the members end within ~1e-9 of each other's loss, and float32's rounding, which
    # differs with the CPU and the thread count, reordered them (another "best" on another machine).
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 1, generator=g, dtype=torch.float64)
    x = torch.randn(512, 16, generator=g, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(512, 1, generator=g, dtype=torch.float64)
    return x[:384], y[:384], x[384:], y[384:]


def run(store_path: str, members: int = 8, steps: int = 200, interval: int = 20, seed: int = 0) -> dict[str, object]:
    """Train the population; return a summary (also printed)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    xt, yt, xv, yv = make_data(seed)
    store = ds.Store.open(store_path)
    lrs = [10 ** rng.uniform(-3.5, -0.5) for _ in range(members)]
    pop = Population(store, "toy", size=members, metric="val_loss", mode="min",
                     hparams=[{"lr": lr} for lr in lrs], seed=seed)
    models = [nn.Linear(16, 1, dtype=torch.float64) for _ in range(members)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(models, lrs)]
    exploits = explores = 0
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            nn.functional.mse_loss(model(xt), yt).backward()
            opt.step()
        if step % interval:
            continue
        for i, member in enumerate(pop.members):
            with torch.no_grad():
                val = nn.functional.mse_loss(models[i](xv), yv).item()
            member.save({"model": models[i], "optim": opts[i]}, metrics={"val_loss": val}, step=step)
        for i, member in enumerate(pop.members):
            if pop.exploit(member) is None:
                continue
            exploits += 1
            pop.explore(member, perturb={"lr": (0.8, 1.25)})
            explores += 1
            # Continue from the donor's weights and optimizer state, with the new learning rate.
            store.checkout(member.branch, model=models[i], optimizer=opts[i])
            for group in opts[i].param_groups:
                group["lr"] = member.hparams["lr"]
    best = pop.ranked()[0]
    tree = pop.family_tree()
    summary = {
        "members": members,
        "versions": len(store.find(f"branch like '{pop.name}/%'")),
        "exploits": exploits,
        "explores": explores,
        "fork_edges": tree.column("kind").to_pylist().count("fork"),
        "best": best.branch,
        "best_val_loss": round(best.score(), 12),  # the last digits vary with the CPU's summation order
        "best_schedule": pop.replay(best),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    store.close()
    for key, value in summary.items():
        print(f"{key}: {value}")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="runs/pbt-store")
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    run(a.store, a.members, a.steps, a.interval, a.seed)


if __name__ == "__main__":
    main()
