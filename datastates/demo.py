"""The demo behind `datastates demo`: a small model trained on CPU, checkpointed into a local store."""

from __future__ import annotations

import time

import torch

from .store import Store


def run(path: str, steps: int = 300, every: int = 20) -> int:
    """Train a tiny regression MLP for `steps` steps, saving every `every` steps; print what the store holds."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    w_true = torch.randn(32, 1)
    hparams = {"lr": 3e-3, "width": 256, "optimizer": "adamw"}
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
        print(f"\nnext: export DATASTATES_STORE={store.path}; then try `datastates log`, `datastates ls {name}`, "
              "`datastates diff main~5 main`, `datastates du`, `datastates fsck`")
    return 0
