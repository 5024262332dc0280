"""The demo behind `datastates demo`: a small model trained on CPU, checkpointed into a local store."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from .errors import ConflictError, InvalidArgumentError
from .store import Store

MIN_SAVES = 6  # the demo's diff reads main~5
DEMO_MARK = "demo"  # an hparam every demo version carries: a store holding only such versions is a demo store


def check_demo_dir(path: str | os.PathLike[str]) -> None:
    """Refuse to write into anything but a new or empty directory or a store the demo made.

    Raises ConflictError naming the directory when it is a non-empty non-store, or a store holding a
    version the demo did not save (the demo must never append to a real store)."""
    root = Path(path)
    if not root.exists() or (root.is_dir() and not any(root.iterdir())):
        return
    if not (root / "FORMAT").is_file():
        raise ConflictError(f"{root} is not empty and is not a demo store; the demo writes only into its own "
                            "directory: give a new one with `datastates demo --dir runs/demo-store-2`")
    with Store.open(root, create=False) as store:
        foreign = [v for v in store.find("") if v.hparams.get(DEMO_MARK) is not True]
    if foreign:
        raise ConflictError(f"{root} is a store with {len(foreign)} version(s) the demo did not save; the demo "
                            "writes only into its own store: give a new directory with "
                            "`datastates demo --dir runs/demo-store-2`")


def _script() -> str:
    """How to call the `datastates` script from this shell: bare if it is on PATH, else its path
    (relative when under the current directory, e.g. `.venv/bin/datastates`)."""
    here = Path(sys.executable).with_name("datastates")
    found = shutil.which("datastates")
    if found and Path(found).resolve() == here.resolve():
        return "datastates"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def run(path: str | os.PathLike[str] = "runs/demo-store", steps: int = 300, every: int = 20) -> int:
    """Train a tiny regression MLP for `steps` steps, saving every `every` steps into the store at `path`
    (only there: a new or empty directory, or a store the demo made); print what the store holds.
    Raises InvalidArgumentError when fewer than 6 saves would be made (the demo compares main~5 with main),
    ConflictError for any other directory; nothing is written then."""
    check_demo_dir(path)
    if every < 1 or steps // every < MIN_SAVES:
        raise InvalidArgumentError(
            f"--steps {steps} --every {every} makes {steps // every if every >= 1 else 0} saves; the demo "
            f"compares main~5 with main, so give at least {MIN_SAVES}: "
            f"--steps {MIN_SAVES * max(every, 1)} --every {max(every, 1)} or more")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    w_true = torch.randn(32, 1)
    hparams = {"lr": 3e-3, "width": 256, "optimizer": "adamw", DEMO_MARK: True}
    with Store.open(path) as store:
        print(f"store: {store.path}")
        handles = []
        for step in range(1, steps + 1):
            x = torch.randn(64, 32)
            y = x @ w_true + 0.1 * torch.randn(64, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if step % every == 0:
                # Asynchronous: training continues while the checkpoint is hashed and written.
                handles.append(store.save_async(
                    {"model": model, "optim": opt, "sched": sched, "step": step},
                    branch="main", step=step, hparams=hparams, metrics={"loss": loss.item()},
                    message=f"step {step}"))
        versions = [h.result() for h in handles]
        best = min(versions, key=lambda v: v.metrics["loss"])
        run = len(store.tags()) + 1  # the demo can run again on the same store
        name = "best" if run == 1 else f"best-{run}"
        store.tag(name, best)
        fork = "lr-low" if run == 1 else f"lr-low-{run}"
        store.branch(fork, at=versions[len(versions) // 2])
        state = store.load(fork)
        model.load_state_dict(state["model"])
        v = store.save({"model": model, "optim": opt, "step": state["step"]}, branch=fork, step=state["step"],
                       hparams={**hparams, "lr": 1e-3}, message="fork with a lower lr")
        print(f"\nsaved {len(versions)} versions in {time.perf_counter() - t0:.1f} s; tagged {name} = {best.short} "
              f"(loss {best.metrics['loss']:.4f}); forked {fork} -> {v.short} (new bytes: {v.bytes_new})\n")
        print("log of main (newest first):")
        for ver in store.log("main", limit=8):
            print(f"  {ver.short}  step={ver.step:<4} loss={ver.metrics['loss']:.4f}  new bytes={ver.bytes_new}")
        print("\nhow the weights moved over the last 100 steps (datastates diff main~5 main --keys model):")
        for r in store.diff("main~5", "main", keys=["model"]).to_pylist():
            print(f"  {r['key']:<16} {r['status']:<8} relative change {r['rel_change']:.3f}  cosine {r['cosine']:.4f}")
        found = store.find("metrics.loss < 0.06 order by metrics.loss limit 3")
        print("\nbest three by loss (datastates find \"metrics.loss < 0.06 order by metrics.loss limit 3\"):")
        for v in found:
            print(f"  {v.short}  step={v.step}  loss={v.metrics['loss']:.4f}")
        d = store.du()
        print(f"\n{d['versions']} versions, {d['bytes_total'] / 2**20:.1f} MiB as saved, "
              f"{d['bytes_unique'] / 2**20:.1f} MiB unique on disk")
        cli = f"{_script()} --store {shlex.quote(str(path))}"
        print(f"\nnext, try: `{cli} log`, `{cli} ls {name}`, `{cli} diff main~5 main`, `{cli} du`, `{cli} fsck`")
    return 0
