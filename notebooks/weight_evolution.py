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
# # Weight evolution
#
# Train a small MLP, save every few steps into a DataStates store, fork a second line with a ten
# times higher learning rate halfway, and look at the weights the way TensorBoard or W&B would show
# them, except that every plot is computed from the store (after the fact, for any branch):
#
# - per-layer L2 norms against step (`plot.norms`: stored stats, no tensor read),
# - per-layer update ratios ||w_t - w_prev|| / ||w_prev|| (`plot.update_ratios`),
# - the distribution of one weight matrix over time (`plot.histograms`),
# - how far the two forks ended up apart (`plot.diff`), and where they split (`plot.lineage`).
#
# Render: `jupytext --to ipynb notebooks/weight_evolution.py`.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DATASTATES_NOTEBOOK_SIZE", "full")  # "small" in CI
STEPS = 40 if SIZE == "small" else 600
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

path = Path(STORE or tempfile.mkdtemp()) / "weight-evolution"
if path.exists():  # a second run added its versions to the first's: numbers of both, or a tag conflict half way
    raise SystemExit(f"{path} holds the store of an earlier run: point DATASTATES_NOTEBOOK_STORE at another "
                     "directory, or remove that one")
store = ds.Store.open(path)

torch.manual_seed(0)
x = torch.randn(512, 20)
y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.05 * torch.randn(512, 1)
model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def train(branch: str, lr: float, first: int, last: int) -> float:
    """SGD with momentum from step `first` to `last`, saving every EVERY steps on `branch`."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = torch.tensor(float("nan"))
    for step in range(first, last + 1):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % EVERY == 0:
            store.save({"model": model}, branch=branch, step=step, hparams={"lr": lr},
                       metrics={"loss": loss.item()})
    return loss.item()


half = STEPS // 2
train("main", 0.01, 1, half)
store.tag("half", "main")
loss_main = train("main", 0.01, half + 1, STEPS)
store.branch("high-lr", at="half")
store.checkout("half", model=model)
loss_high = train("high-lr", 0.1, half + 1, STEPS)
print(f"{len(store.log('main'))} versions on main, {len(store.log('high-lr'))} on high-lr; "
      f"final loss {loss_main:.4f} (lr 0.01) vs {loss_high:.4f} (lr 0.1)")

# %% [markdown]
# ## Per-layer norms along `main`
# Stored statistics only: the manifest of each version holds every tensor's L2 norm.

# %%
plot.norms(store, "main")

# %% [markdown]
# ## Update ratios along the high-learning-rate fork
# Each cell is the size of one saved update relative to the weights. The first half is `main`'s history
# (the fork shares it); after the fork point the columns brighten: right after it, the updates are several
# times `main`'s over the same steps (about ten at full size, the factor the learning rate changed by).

# %%
plot.update_ratios(store, "high-lr")

# %% [markdown]
# ## The first layer's weights over time
# Reads that one tensor from each version (at most 200 versions, evenly spaced).

# %%
plot.histograms(store, "main", "model.0.weight")

# %% [markdown]
# ## How far apart did the forks end up?

# %%
plot.diff(store, "main", "high-lr")

# %%
plot.lineage(store)

# %% [markdown]
# ## Reading the plots
# - Norms: the last layer's weight (`model.4.weight`) is the one that grows (at full size its norm more
#   than doubles): PyTorch's default init makes it small, and it has to reach the scale of the target.
#   The hidden layers' norms move by a few percent only; their directions change, not their size.
# - Update ratios: compare the two lines over the same steps (the numbers below). Right after the fork
#   the high-lr line's updates are several times `main`'s (about 10x at full size); later they shrink as
#   that line converges, to a lower loss than `main`. Around 1e-3 per step is the usual healthy value for
#   SGD; here a saved interval spans several steps, so the ratios are larger.
# - Diff: which layers the higher learning rate moved most away from `main`'s end; a cosine close to 1
#   means the two lines still point the same way.

# %%
high = plot.update_ratios_data(store, "high-lr")
low = plot.update_ratios_data(store, "main")
norms = plot.norms_data(store, "main")
fork_step = store.version("half").step
after_high, after_low = high.ratios[:, high.x > fork_step], low.ratios[:, low.x > fork_step]
first_factor = float(torch.tensor(after_high[:, 0] / after_low[:, 0]).nanmedian())
print(f"first saved interval after the fork: high-lr updates are {first_factor:.1f}x main's (median over layers)")
diff = plot.diff_data(store, "main", "high-lr")
results = {
    "versions_main": len(store.log("main")),
    "versions_high_lr": len(store.log("high-lr")),
    "loss_main": loss_main,
    "loss_high_lr": loss_high,
    "final_l2": {k: float(v[-1]) for k, v in norms.values.items()},
    "median_ratio_after_fork_high_lr": float(torch.tensor(after_high).nanmedian()),
    "median_ratio_after_fork_main": float(torch.tensor(after_low).nanmedian()),
    "first_interval_factor": first_factor,
    "diff_keys": diff.keys,
    "diff_rel_change": [float(r) for r in diff.rel_change],
    "store": str(path),
}
if RESULTS:
    Path(RESULTS).write_text(json.dumps(results, indent=1))
store.close()
{k: v for k, v in results.items() if k != "final_l2"}
