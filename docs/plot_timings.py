"""Time each `datastates.plot` figure on a store of N versions of a small model (docs/notebooks.md).

    .venv/bin/python docs/plot_timings.py --versions 1000 --store /tmp/plot-timings

Builds the store if it is not there (a 4-layer MLP, 8 tensors, ~11 KiB; main gets 80% of the versions,
two forks from its middle, with other learning rates, the rest), then prints seconds per figure:
data + drawing, and with PNG rendering.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import datastates as ds
from datastates import plot


def build(path: Path, versions: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 16), torch.randn(128, 4)
    main_n = int(versions * 0.8)
    fork_n = (versions - main_n) // 2
    with ds.Store.open(path) as store:
        def train(branch: str, n: int, first: int, lr: float = 0.01) -> None:
            for group in opt.param_groups:
                group["lr"] = lr
            for step in range(first, first + n):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                store.save({"model": model}, branch=branch, step=step, metrics={"loss": loss.item()})

        train("main", main_n // 2, 0)
        fork_at = store.resolve("main")
        train("main", main_n - main_n // 2, main_n // 2)
        store.tag("mid", fork_at)
        for name in ("fork-a", "fork-b"):
            store.branch(name, at=fork_at)
            store.checkout(fork_at, model=model)
            # Different learning rates, so the forks differ and `diff` has chunks to read.
            train(name, fork_n if name == "fork-a" else versions - main_n - fork_n, main_n // 2,
                  0.02 if name == "fork-a" else 0.005)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=1000)
    ap.add_argument("--store", default=None, help="store path (built when missing); default: a temp dir")
    args = ap.parse_args()
    path = Path(args.store or tempfile.mkdtemp()) / f"store-{args.versions}"
    if not path.exists():
        t = time.perf_counter()
        build(path, args.versions)
        print(f"built {args.versions} versions in {time.perf_counter() - t:.1f} s")
    out = Path(tempfile.mkdtemp())
    with ds.Store.open(path) as store:
        n = len(store.versions_table())
        chain = len(store.log("main", first_parent=True))
        figures = {
            f"norms (main, {chain} versions)": lambda: plot.norms(store, "main"),
            f"update_ratios (main, {chain} versions)": lambda: plot.update_ratios(store, "main"),
            "histograms (main, 200 versions, 1 tensor)": lambda: plot.histograms(store, "main", "model.2.weight"),
            "diff (fork-a vs fork-b)": lambda: plot.diff(store, "fork-a", "fork-b"),
            f"lineage (all {n} versions)": lambda: plot.lineage(store),
        }
        for name, make in figures.items():
            t = time.perf_counter()
            fig = make()
            t_fig = time.perf_counter() - t
            fig.savefig(out / "x.png")
            print(f"{name}: {t_fig:.2f} s figure, {time.perf_counter() - t:.2f} s with PNG")


if __name__ == "__main__":
    main()
