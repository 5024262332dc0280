# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Restart from a tag, fork with new hyperparameters, compare
#
# A run trains for a while and tags a version `epoch-1`. Later (a new process, a new model object: here,
# a reopened store and fresh `nn.Module`/optimizer) we resume from that tag bit-exactly, continue the
# original line, and fork a second line from the same tag with a lower learning rate and weight decay.
# Then we compare the two lines: losses, norms, and the per-tensor difference of their final weights.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DATASTATES_NOTEBOOK_SIZE", "full")  # "small" in CI
EPOCH_STEPS = 20 if SIZE == "small" else 200
EVERY = 5 if SIZE == "small" else 20
STORE = os.environ.get("DATASTATES_NOTEBOOK_STORE", "")  # default: a fresh temp dir
RESULTS = os.environ.get("DATASTATES_NOTEBOOK_RESULTS", "")  # where the last cell writes its numbers

# %%
# %matplotlib inline
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

import datastates as ds
from datastates import plot

path = Path(STORE or tempfile.mkdtemp()) / "restart"
if path.exists():  # a second run added its versions to the first's: numbers of both, or a tag conflict half way
    raise SystemExit(f"{path} holds the store of an earlier run: point DATASTATES_NOTEBOOK_STORE at another "
                     "directory, or remove that one")
torch.manual_seed(0)
x = torch.randn(256, 10)
y = (x[:, :3] ** 2).sum(1, keepdim=True) + 0.1 * torch.randn(256, 1)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(store: ds.Store, model: nn.Module, opt: torch.optim.Optimizer, branch: str,
          first: int, last: int) -> float:
    """Train from step `first` to `last`, saving model and optimizer every EVERY steps on `branch`."""
    loss = torch.tensor(float("nan"))
    hparams = {k: opt.param_groups[0][k] for k in ("lr", "weight_decay")}
    for step in range(first, last + 1):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % EVERY == 0:
            store.save({"model": model, "optim": opt}, branch=branch, step=step, hparams=hparams,
                       metrics={"loss": loss.item()})
    return loss.item()


with ds.Store.open(path) as store:
    model, opt = make()
    train(store, model, opt, "main", 1, EPOCH_STEPS)
    store.tag("epoch-1", "main")
    before_restart = {k: v.clone() for k, v in model.state_dict().items()}
print(f"tagged epoch-1 at step {EPOCH_STEPS}")

# %% [markdown]
# ## Restart: a new process would do exactly this
# Open the store, build fresh objects, `checkout` the tag into them: weights *and* optimizer state
# (Adam's moments) come back bit-exact, so the resumed run continues as if it had never stopped.

# %%
store = ds.Store.open(path)
model, opt = make()
tagged = store.checkout("epoch-1", model=model, optimizer=opt)
bit_exact = all(torch.equal(before_restart[k], v) for k, v in model.state_dict().items())
print(f"resumed from {tagged.short} (step {tagged.step}); weights bit-exact: {bit_exact}; "
      f"Adam state for {len(opt.state)} tensors")
loss_main = train(store, model, opt, "main", EPOCH_STEPS + 1, 2 * EPOCH_STEPS)

# %% [markdown]
# ## Fork from the same tag with new hyperparameters

# %%
store.branch("low-lr-wd", at="epoch-1")
model, opt = make()
store.checkout("epoch-1", model=model, optimizer=opt)
for group in opt.param_groups:
    group["lr"], group["weight_decay"] = 2e-3, 1e-2
loss_fork = train(store, model, opt, "low-lr-wd", EPOCH_STEPS + 1, 2 * EPOCH_STEPS)
print(f"final loss: main {loss_main:.4f}, low-lr-wd {loss_fork:.4f}")
for name in ("main", "low-lr-wd"):
    print(name, [(v.step, round(v.metrics["loss"], 4)) for v in reversed(store.log(name))][-4:])

# %% [markdown]
# ## Compare the two lines
# Norms along the fork: after the tag, weight decay turns the first layer's norm down (at full size
# 6.9 -> 6.4, while on `main` it keeps growing to 7.2; `plot.norms(store, "main")` shows that line).
# Then the per-tensor difference of the two final states, and where they split.

# %%
plot.norms(store, "low-lr-wd", "model.*.weight")

# %%
plot.diff(store, "main", "low-lr-wd", keys="model.*")

# %%
plot.lineage(store)

# %%
diff = plot.diff_data(store, "main", "low-lr-wd", keys="model.*")
base = store.merge_base("main", "low-lr-wd")
results = {
    "bit_exact_resume": bit_exact,
    "tag_step": tagged.step,
    "merge_base_is_tag": base == store.resolve("epoch-1"),
    "loss_main": loss_main,
    "loss_fork": loss_fork,
    "fork_hparams": store.version("low-lr-wd").hparams,
    "versions_main": len(store.log("main")),
    "versions_fork": len(store.log("low-lr-wd")),
    "diff_keys": diff.keys,
    "diff_cosine": [float(c) for c in diff.cosine],
    "store": str(path),
}
if RESULTS:
    Path(RESULTS).write_text(json.dumps(results, indent=1))
store.close()
results
