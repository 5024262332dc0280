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
# # The family tree of a PBT population
#
# Run the toy population of `docs/examples/pbt_toy.py` (members fit a noisy linear regression, each
# with its own learning rate; every interval the bottom quarter *exploits* a top member, forking its
# latest version at no byte cost, then *explores* by perturbing its learning rate). The store records
# exploits and explores as fields of the versions, so everything below is a query of the store:
# the family tree, the schedule that produced the best member, which donors were used, and any
# ancestor loaded back and evaluated.

# %% tags=["parameters"]
import os

SIZE = os.environ.get("DATASTATES_NOTEBOOK_SIZE", "full")  # "small" in CI
MEMBERS, STEPS, INTERVAL = (4, 40, 10) if SIZE == "small" else (8, 200, 20)
STORE = os.environ.get("DATASTATES_NOTEBOOK_STORE", "")  # default: a fresh temp dir
RESULTS = os.environ.get("DATASTATES_NOTEBOOK_RESULTS", "")  # where the last cell writes its numbers

# %%
# %matplotlib inline
import collections
import importlib.util
import json
import tempfile
from pathlib import Path

import torch
from torch import nn

import datastates as ds
from datastates import plot
from datastates.pbt import Population

# The toy lives with the docs (it is also a script); find it from wherever the notebook runs in the repo.
here = Path.cwd()
found = [p / "docs/examples/pbt_toy.py" for p in (here, *here.parents) if (p / "docs/examples/pbt_toy.py").exists()]
if not found:  # run from outside the repository (a bare StopIteration before)
    raise SystemExit(f"docs/examples/pbt_toy.py is not in {here} or above it: run this notebook from the "
                     "datastates repository (its root or a folder in it)")
toy_path = found[0]
spec = importlib.util.spec_from_file_location("pbt_toy", toy_path)
assert spec is not None and spec.loader is not None
pbt_toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pbt_toy)

path = Path(STORE or tempfile.mkdtemp()) / "pbt"
if path.exists():  # a second run added its versions to the first's: numbers of both, or a tag conflict half way
    raise SystemExit(f"{path} holds the store of an earlier run: point DATASTATES_NOTEBOOK_STORE at another "
                     "directory, or remove that one")
summary = pbt_toy.run(str(path), members=MEMBERS, steps=STEPS, interval=INTERVAL, seed=0)

# %% [markdown]
# ## The family tree
# One column per member branch, time flowing down, colored by validation loss (yellow is low, i.e. better;
# grey nodes are forks, which copy tensors but record no loss).
# Dashed red edges are exploits: the member's next version is a fork of the donor's latest.

# %%
store = ds.Store.open(path)
pop = Population(store, "toy", size=MEMBERS, metric="val_loss", mode="min")  # continues from the branches
plot.lineage(store, population=pop)

# %% [markdown]
# ## The schedule that produced the best member
# `replay` walks the best member's first-parent lineage (through the donors it forked from) and lists
# each learning-rate change: a schedule you could re-run without PBT.

# %%
best = pop.ranked()[0]
schedule = pop.replay(best)
for step, hparams in schedule:
    print(f"from step {step}: lr = {hparams['lr']:.5f}")

# %% [markdown]
# ## Which donors were used

# %%
tree = pop.family_tree().to_pylist()
donors = collections.Counter(store.version(e["parent"]).branch for e in tree if e["kind"] == "fork")
lineage_of_best = [best.head.id, *store.ancestors(best.head.id)]
forks_in_best = [store.version(v) for v in lineage_of_best if store.version(v).fork_of is not None]
print("exploits per donor:", dict(donors))
print(f"the best member ({best.branch}) descends from {len(forks_in_best)} exploit(s):")
for v in sorted(forks_in_best, key=lambda v: v.step or 0):
    print(f"  step {v.step}: {v.branch} <- {store.version(v.fork_of).branch}")

# %% [markdown]
# ## An ancestor, loaded and evaluated
# Take the best member's oldest ancestor on its first-parent line, load its weights into a fresh model and
# evaluate it on the validation data: the loss must be the one recorded when it was saved.

# %%
first_parent_line = [best.head.id, *store.ancestors(best.head.id, first_parent=True)]
ancestor = store.version(first_parent_line[-1])
probe = nn.Linear(16, 1, dtype=torch.float64)  # the toy trains in float64
store.checkout(ancestor.id, model=probe)
_, _, xv, yv = pbt_toy.make_data(0)
with torch.no_grad():
    evaluated = nn.functional.mse_loss(probe(xv), yv).item()
print(f"ancestor {ancestor.short} (step {ancestor.step}, {ancestor.branch}): "
      f"recorded val_loss {ancestor.metrics['val_loss']:.6f}, evaluated now {evaluated:.6f}")

# %% [markdown]
# ## Best against worst member, tensor by tensor

# %%
worst = pop.ranked()[-1]
plot.diff(store, best.branch, worst.branch)

# %%
tree_plot = plot.lineage_data(store, population=pop)
results = {
    "members": MEMBERS,
    "versions": summary["versions"],
    "exploits": summary["exploits"],
    "fork_edges": summary["fork_edges"],
    "lineage_nodes": len(tree_plot.ids),
    "lineage_fork_edges": sum(1 for *_, k in tree_plot.edges if k == "fork"),
    "best": best.branch,
    "best_val_loss": best.score(),
    "schedule": [[s, h] for s, h in schedule],
    "donors": dict(donors),
    "ancestor": ancestor.id,
    "ancestor_recorded_val_loss": ancestor.metrics["val_loss"],
    "ancestor_evaluated_val_loss": evaluated,
    "store": str(path),
}
if RESULTS:
    Path(RESULTS).write_text(json.dumps(results, indent=1))
store.close()
{k: results[k] for k in ("versions", "exploits", "best", "best_val_loss")}
