"""Plots of a store: per-layer norms, update ratios, value histograms, diffs and the lineage DAG.

Each `plot.X(store, ...)` returns a `matplotlib.figure.Figure` on an Agg canvas (no pyplot state, no
window: it renders in a notebook cell, `fig.savefig(path)` writes a file). The numbers behind each
figure come from a `X_data(store, ...)` function returning plain arrays, so a script can use them
without matplotlib and a test can check them against the store.

What each one reads:
- `norms`: manifests only (the per-tensor stats stored at save time), never tensor bytes.
- `update_ratios`: manifests, plus the bytes of the chunks that changed between a version and the
  previous one of the chain, one chunk at a time (unchanged chunks cost nothing).
- `histograms`: the one tensor asked for, one version at a time; bin edges come from stored min/max (read from
  the values first for a version that stored none: a view, a complex tensor).
- `diff`: what `Store.diff` reads (changed chunks of both versions).
- `lineage`: version records and the catalog's graph, no manifest nor tensor.

matplotlib is an optional extra: `pip install 'datastates[plot]'`. Without it every plot raises
MissingDependencyError (the `*_data` functions still work).
"""

from __future__ import annotations

import difflib
import math
import operator
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import InvalidArgumentError, MissingDependencyError, NotFoundError
from .meta.versions import shown
from .query.compare import KeyPatterns, history_versions
from .query.compare import diff as _diff
from .save.tree import key_patterns
from .store import Store

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .meta.versions import Version
    from .pbt import Population

__all__ = [
    "DiffData", "HistogramData", "LineageData", "NormsData", "UpdateRatioData", "diff", "diff_data",
    "histograms", "histograms_data", "lineage", "lineage_data", "norms", "norms_data", "update_ratios",
    "update_ratios_data",
]

STATS = ("l2", "mean", "std", "min", "max", "nan_count", "inf_count")
_INSTALL = "pip install 'datastates[plot]'"


# ---------------------------------------------------------------------------------------------
# matplotlib, imported only when a figure is asked for

def _figure(width: float = 8.0, height: float = 4.5) -> Figure:
    """A Figure on an Agg canvas. Raises MissingDependencyError when matplotlib is absent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(f"datastates.plot needs matplotlib, which is not installed; run `{_INSTALL}`") \
            from e
    fig = Figure(figsize=(width, height), layout="constrained")
    # An explicit Agg canvas rather than pyplot: no global figure list to leak, no GUI backend needed.
    FigureCanvasAgg(fig)
    return fig


def _colormap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name]


# ---------------------------------------------------------------------------------------------
# shared helpers

def _as_store(store: Any) -> Store:
    if not isinstance(store, Store):
        raise InvalidArgumentError(f"datastates.plot takes a datastates.Store, not {type(store).__name__}; "
                                   "open one with `datastates.Store.open(path)`")
    return store


def _patterns(keys: str | Iterable[str] | None) -> list[str] | None:
    """`keys` as a list of patterns. Raises InvalidArgumentError for what is no key, glob or list of them (keys=5
    raised TypeError from list(); a list holding an int, from fnmatch)."""
    return key_patterns(keys)


def _count(name: str, value: Any, least: int) -> int:
    """`value` as an int (a NumPy integer too). Raises InvalidArgumentError unless it is a whole number of at least
    `least` (bins=2.5 raised numpy's TypeError, max_keys=0 numpy's ValueError on an empty figure)."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < least:
        raise InvalidArgumentError(f"{name}={value!r}: give a whole number, {least} or more")
    return n


def _selected(key: str, patterns: list[str] | None) -> bool:
    """A key is selected by an exact name, a glob, or a prefix ending at a '.' (as `load(keys=)`)."""
    return patterns is None or _matcher(tuple(patterns)).selects(key)


@lru_cache(maxsize=8)
def _matcher(patterns: tuple[str, ...]) -> KeyPatterns:
    """One `KeyPatterns` per pattern list (a figure asks of every key of every version with the same list)."""
    return KeyPatterns(patterns, strip_dot=True)


def _matched(patterns: list[str], keys: Iterable[str]) -> set[str]:
    """The patterns that select at least one of `keys`, in one pass over the keys."""
    m = _matcher(tuple(patterns))
    out: set[str] = set()
    for k in keys:
        out.update(m.matching(k))
    return out


def _chain(store: Store, ref: Any) -> list[Version]:
    """The first-parent chain ending at `ref`, oldest first, pruned versions left out. Raises PrunedError when
    `ref` itself was pruned (then so was every version before it: the chain has nothing to show)."""
    chain = history_versions(store.repo, ref)
    if not chain:
        _refuse_pruned(store, ref)
    return chain


def _refuse_pruned(store: Store, ref: Any) -> None:
    """PrunedError naming `ref` when it was pruned (its manifest, which the plots read, is gone)."""
    store.manifest_of(store.version(ref))


def _x_of(versions: Sequence[Version]) -> np.ndarray:
    """The x axis of a chain: steps when every version has one, else positions 0..n-1."""
    if versions and all(v.step is not None for v in versions):
        return np.array([v.step for v in versions], dtype=np.int64)
    return np.arange(len(versions), dtype=np.int64)


def _no_keys(store: Store, ref: Any, patterns: list[str] | None, stat: str | None = None) -> NotFoundError:
    """The error for key patterns that select nothing: a typo must not read as an empty plot. With `stat` (norms):
    keys that match but stored no such statistic are named as such (they read as a typo, with the key itself
    offered as the close match)."""
    infos = store.ls(ref)
    names = [t.key for t in infos]
    held = [t.key for t in infos if _selected(t.key, patterns)]
    if stat is not None and held:
        at = ref if isinstance(ref, str) else store.version(ref).short
        shown_keys = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        return NotFoundError(
            f"{shown_keys} of {ref!r} stored no {stat!r} statistic (a view of a shared storage stores none, a complex "
            "tensor only l2 and the NaN/Inf counts, an empty or all-NaN one no min, max, mean or std); "
            f"`datastates plot histograms {shlex.quote(held[0])} {shlex.quote(at)}` draws its values (plot.histograms "
            "in Python; store.history(key, ref, values=True) yields them)")
    close = list(dict.fromkeys(c for p in patterns or [] for c in difflib.get_close_matches(p, names, n=3, cutoff=0.5)))
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return NotFoundError(f"no tensor of {ref!r} matches {patterns!r}; {hint}`datastates ls {ref}` lists its keys")


def _every_pattern_matches(store: Store, ref: Any, patterns: list[str] | None, present: set[str]) -> None:
    """NotFoundError for the patterns that select no key of the chain (`present`), also when others do: a typo in
    one of them was dropped silently, and the command line `plot norms --keys w b` (REF after --keys, which takes
    every word) drew main, reading the branch b as a key."""
    matched = _matched(patterns or [], present)
    missing = [p for p in patterns or [] if p not in matched]
    if missing:
        raise _no_keys(store, ref, missing)


def _short(key: str, width: int = 40) -> str:
    return key if len(key) <= width else "..." + key[-(width - 3):]


# ---------------------------------------------------------------------------------------------
# norms

@dataclass(frozen=True)
class NormsData:
    """One stat of each selected tensor along a first-parent chain (NaN where a version lacks the key)."""

    stat: str
    """Which stored statistic ('l2', 'mean', 'std', 'min', 'max', ...)."""
    versions: list[str]
    """Version ids, oldest first."""
    x: np.ndarray
    """Steps (or positions when a version has no step), one per version."""
    values: dict[str, np.ndarray] = field(default_factory=dict)
    """Key -> the stat per version, aligned with `versions`."""
    has_steps: bool = True
    """Whether `x` holds steps (else positions)."""
    nonfinite: dict[str, np.ndarray] = field(default_factory=dict)
    """Key -> per version, whether the tensor held NaN or infinite values (its statistics are of the finite ones)."""


def norms_data(store: Store, ref: Any = "main", keys: str | Iterable[str] | None = None, *,
               stat: str = "l2") -> NormsData:
    """A stored per-tensor statistic along the first-parent chain of `ref`; reads manifests only.

    Raises InvalidArgumentError (unknown stat, keys that are no key path or glob), NotFoundError (ref, or keys
    matching no tensor), PrunedError (`ref` was pruned).
    """
    store = _as_store(store)
    if stat not in STATS:
        raise InvalidArgumentError(f"stat {stat!r} is not a stored statistic; use one of {', '.join(STATS)}")
    patterns = _patterns(keys)
    chain = _chain(store, ref)
    values: dict[str, np.ndarray] = {}
    nonfinite: dict[str, np.ndarray] = {}
    present: set[str] = set()
    for i, v in enumerate(chain):
        for info in store.manifest_of(v).info():
            present.add(info.key)
            if info.kind == "view" or not _selected(info.key, patterns):
                continue
            s = info.stats.get(stat)
            if s is None:
                continue
            if info.key not in values:
                values[info.key] = np.full(len(chain), np.nan)
                nonfinite[info.key] = np.zeros(len(chain), dtype=bool)
            values[info.key][i] = float(s)
            nonfinite[info.key][i] = bool(info.stats.get("nan_count") or info.stats.get("inf_count"))
    _every_pattern_matches(store, ref, patterns, present)
    if not values:
        raise _no_keys(store, ref, patterns, stat)
    return NormsData(stat, [v.id for v in chain], _x_of(chain), values, all(v.step is not None for v in chain),
                     nonfinite)


def norms(store: Store, ref: Any = "main", keys: str | Iterable[str] | None = None, *, stat: str = "l2",
          log: bool | None = None, max_keys: int = 24) -> Figure:
    """Per-layer `stat` (default L2 norm) against step along `ref`'s first-parent chain, one line per
    tensor (the `max_keys` largest by final value when more match). Reads manifests only.

    `log`: log y axis; by default when every value is positive and they span over a decade.
    Raises what `norms_data` raises, MissingDependencyError.
    """
    max_keys = _count("max_keys", max_keys, 1)
    data = norms_data(store, ref, keys, stat=stat)
    fig = _figure()
    ax = fig.add_subplot()
    ranked = sorted(data.values, key=lambda k: -_last(data.values[k]))[:max_keys]
    diverged = 0
    for key in sorted(ranked):
        ax.plot(data.x, data.values[key], marker="." if len(data.x) < 60 else None, label=_short(key))
        # The stats are of the finite values: a tensor gone NaN drew an unremarkable line (a review). Mark it.
        bad = data.nonfinite.get(key, np.zeros(0, dtype=bool))
        if bad.any():
            diverged += 1
            ax.scatter(data.x[bad], data.values[key][bad], marker="x", s=40, c="red", zorder=3, gid=f"nonfinite:{key}",
                       label="holds NaN/inf (stats of the finite values)" if diverged == 1 else None)
    every = np.concatenate([data.values[k] for k in ranked])
    finite = every[np.isfinite(every)]
    if log is None:
        log = bool(finite.size) and bool((finite > 0).all()) and finite.max() / finite.min() > 10
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(_x_label_for(data))
    ax.set_ylabel("L2 norm" if stat == "l2" else stat)
    hidden = len(data.values) - len(ranked)
    ax.set_title(f"{'L2 norm' if stat == 'l2' else stat} per tensor along {ref}"
                 + (f" ({hidden} smaller tensors not shown)" if hidden else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


def _last(a: np.ndarray) -> float:
    finite = a[np.isfinite(a)]
    return float(abs(finite[-1])) if finite.size else -math.inf


def _x_label_for(data: NormsData | UpdateRatioData | HistogramData) -> str:
    return "step" if data.has_steps else "version (oldest first)"


# ---------------------------------------------------------------------------------------------
# update ratios

@dataclass(frozen=True)
class UpdateRatioData:
    """||w_t - w_prev|| / ||w_prev|| per tensor (rows) and version (columns) along a chain."""

    keys: list[str]
    """Row labels, sorted."""
    versions: list[str]
    """Column versions: every version of the chain but the first (it has no previous version)."""
    x: np.ndarray
    """Steps (or positions) of those versions."""
    ratios: np.ndarray
    """keys x versions; 0.0 for an unchanged tensor, NaN where either side lacks the key, inf for an unbounded
    change (from all zeros, or to or from NaN or an infinity: a run that diverged), as `diff_data` has it."""
    chunks_read: int
    """How many chunk pairs had to be read (the others were shared, so their change is known to be 0); views of a
    shared storage, whose bytes `diff` reads as the view sees them, are not counted."""
    has_steps: bool = True


def update_ratios_data(store: Store, ref: Any = "main", keys: str | Iterable[str] | None = None) -> UpdateRatioData:
    """The relative update of each tensor between consecutive versions of `ref`'s first-parent chain
    (a pruned version is skipped, so the ratio then spans it). Streams: reads only changed chunks,
    one at a time. Raises NotFoundError (ref, or keys matching no tensor), PrunedError, InvalidArgumentError (keys
    that are no key path or glob)."""
    store = _as_store(store)
    patterns = _patterns(keys)
    chain = _chain(store, ref)
    cols: list[dict[str, float]] = []
    chunks_read = 0
    present: set[str] = set()
    for prev, cur in zip(chain, chain[1:]):
        table = _pair_diff(store, prev, cur, patterns, present)
        if table is None:
            cols.append({})
            continue
        col: dict[str, float] = {}
        for row in table.to_pylist():
            if row["key"] is None or not _selected(row["key"], patterns) or row["status"] not in ("same", "changed"):
                continue  # added/removed/reshaped tensors have no ratio
            rel = row["rel_change"]
            col[row["key"]] = math.nan if rel is None else float(rel)
            # A view of a shared storage (no chunks of its own: diff compares the bytes it sees) has its ratio
            # too; it was left out, and asked by name said no tensor matched it.
            if row["chunks_total"] is not None:
                chunks_read += row["chunks_total"] - row["chunks_shared"]
        cols.append(col)
    if len(chain) >= 2:
        _every_pattern_matches(store, ref, patterns, present)
    names = sorted({k for c in cols for k in c})
    if not names:
        if len(chain) < 2:
            raise NotFoundError(f"{ref!r} has {len(chain)} version(s) in its first-parent chain; an update "
                                "ratio needs two: save another version first")
        if present:  # (said no tensor matched, offering the same key as the close match)
            first = sorted(present)[0]
            named = ", ".join(sorted(present)[:5]) + (" ..." if len(present) > 5 else "")
            raise NotFoundError(
                f"{named}: never in two consecutive versions of {ref!r} with one dtype and shape (added, removed or "
                "reshaped), and an update ratio compares a version with the one before it; "
                f"`datastates history {shlex.quote(first)} {shlex.quote(str(ref))}` "
                "shows each version's")
        raise _no_keys(store, ref, patterns)
    ratios = np.full((len(names), len(cols)), np.nan)
    for j, c in enumerate(cols):
        for i, k in enumerate(names):
            if k in c:
                ratios[i, j] = c[k]
    has_steps = all(v.step is not None for v in chain)
    return UpdateRatioData(names, [v.id for v in chain[1:]], _x_of(chain)[1:], ratios, chunks_read, has_steps)


def _pair_diff(store: Store, prev: Version, cur: Version, patterns: list[str] | None, present: set[str]) -> Any:
    """`diff` of two consecutive versions for the keys `patterns` select (all without), None when they select none
    of either version; the keys selected are added to `present`. Only the selected keys are compared: the whole diff
    read every changed chunk of every tensor, so the ratios of one small layer cost reading the whole model's
    changes. The patterns that select something here go to diff, never the keys they select: diff checks each key
    it is given against every row (thousands of keys made that quadratic)."""
    if patterns is None:
        table = _diff(store.repo, prev.id, cur.id)
        present.update(k for k in table.column("key").to_pylist() if k is not None)
        return table
    here = {r["key"] for v in (prev, cur) for r in store.manifest_of(v).rows if r["kind"] != "storage"}
    selected = {k for k in here if _selected(k, patterns)}
    present.update(selected)
    if not selected:
        return None
    matched = _matched(patterns, selected)
    live = [p for p in patterns if p in matched]
    try:
        # A prefix may end in '.' here ('model.'); diff reads a prefix without it (its rows are filtered below).
        return _diff(store.repo, prev.id, cur.id, [p.rstrip(".") or p for p in live])
    except NotFoundError:  # a pattern diff reads otherwise (a glob ending in '.'): compare every key
        return _diff(store.repo, prev.id, cur.id)


def update_ratios(store: Store, ref: Any = "main", keys: str | Iterable[str] | None = None, *,
                  log: bool = True) -> Figure:
    """Heatmap, tensors x versions, of ||w_t - w_prev|| / ||w_prev|| along `ref` (log10 color by
    default; an update ratio near 1e-3 per step is the usual healthy range for SGD-like training).
    Raises what `update_ratios_data` raises, MissingDependencyError."""
    data = update_ratios_data(store, ref, keys)
    fig = _figure(9.0, max(3.0, 1.2 + 0.28 * len(data.keys)))
    ax = fig.add_subplot()
    shown = data.ratios.copy()
    label = "||w_t - w_prev|| / ||w_prev||"
    if log:
        with np.errstate(divide="ignore"):
            # A zero update (shared chunks) has no logarithm: show it at the colormap's bottom, apart from NaN.
            positive = shown[np.isfinite(shown) & (shown > 0)]
            floor = float(positive.min()) if positive.size else 1e-12
            shown = np.log10(np.where(shown > 0, shown, np.where(np.isnan(shown), np.nan, floor)))
        label = "log10 " + label
    # An unbounded change (a diverged run) is drawn in the colormap's "over" colour, past the largest finite
    # ratio: masked as invalid it would read as "no data".
    unbounded = np.isposinf(shown)
    finite = shown[np.isfinite(shown)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    shown[unbounded] = high + 1.0
    cmap = _colormap("viridis").with_extremes(bad="lightgrey", over="red")
    image = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=low, vmax=high)
    ax.set_yticks(range(len(data.keys)), [_short(k) for k in data.keys], fontsize="x-small")
    ticks = np.unique(np.linspace(0, len(data.x) - 1, min(len(data.x), 10)).astype(int))
    ax.set_xticks(ticks, [str(data.x[t]) for t in ticks])
    ax.set_xlabel(_x_label_for(data))
    ax.set_title(f"update ratio per tensor along {ref}")
    fig.colorbar(image, ax=ax, label=label + ("; red: unbounded" if unbounded.any() else ""),
                 extend="max" if unbounded.any() else "neither")
    return fig


# ---------------------------------------------------------------------------------------------
# histograms

@dataclass(frozen=True)
class HistogramData:
    """Value counts of one tensor, one histogram per version, over shared bin edges."""

    key: str
    versions: list[str]
    """Versions histogrammed, oldest first (evenly spaced over the chain when it was longer than asked)."""
    x: np.ndarray
    edges: np.ndarray
    """bins + 1 edges spanning the min..max of the tensor's finite values over those versions (stored, or read from
    the values of a version that stored none)."""
    counts: np.ndarray
    """versions x bins; each row sums to the tensor's count of finite values."""
    has_steps: bool = True


MAX_BINS = 10_000
"""The most bins `histograms` takes (a row of counts per version, each as wide)."""


def histograms_data(store: Store, ref: Any = "main", key: str = "", *, bins: int = 64,
                    max_versions: int | None = 200) -> HistogramData:
    """Histograms of tensor `key` along `ref`'s first-parent chain, reading only that tensor, one
    version at a time. Bin edges come from the stored min/max (no pass over the bytes to find them), or for a
    version that stored none (a view, a complex tensor) from its values, read once more. A complex tensor counts
    its real and imaginary parts, as its statistics do.
    Raises NotFoundError (ref, or no version has `key`), PrunedError (`ref` was pruned), InvalidArgumentError
    (bins not a whole number in 1..MAX_BINS, max_versions not one of 2 or more)."""
    store = _as_store(store)
    bins = _count("bins", bins, 1)
    if bins > MAX_BINS:
        raise InvalidArgumentError(f"bins must be 1 to {MAX_BINS}, not {bins} (a figure shows a few hundred at most; "
                                   f"{bins} took minutes and memory before drawing anything)")
    if max_versions is not None:
        max_versions = _count("max_versions", max_versions, 2)  # (None: every version)
    stats = store.history(key, ref)  # raises NotFoundError with close key names on a typo
    ids: list[str] = stats.column("version").to_pylist()
    if not ids:  # no live version in the chain: `ref` was pruned (an empty figure raised IndexError: a review)
        _refuse_pruned(store, ref)
    pick = list(range(len(ids)))
    if max_versions is not None and len(ids) > max_versions:
        pick = sorted(set(np.linspace(0, len(ids) - 1, max_versions).round().astype(int).tolist()))
    versions = [ids[i] for i in pick]
    stored = list(zip(stats.column("min").to_pylist(), stats.column("max").to_pylist()))
    # The bins span the stored min/max; a version that stored none (a view, a complex tensor, an empty or all-NaN
    # one) has its range read from its values first: bins that missed its values dropped them silently, its row
    # counting nothing (a review).
    ranges = [stored[i] if stored[i][0] is not None and stored[i][1] is not None
              else _finite_range(_values(_one_tensor(store, vid, key))) for i, vid in zip(pick, versions)]
    mins = np.array([r[0] for r in ranges if r is not None], dtype=np.float64)
    maxs = np.array([r[1] for r in ranges if r is not None], dtype=np.float64)
    mins, maxs = mins[np.isfinite(mins)], maxs[np.isfinite(maxs)]
    # No finite value in any version (all-NaN tensors, or empty ones): any range will do, nothing falls in it.
    lo, hi = (float(mins.min()), float(maxs.max())) if mins.size and maxs.size else (-1.0, 1.0)
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    edges = np.linspace(lo, hi, bins + 1)
    counts = np.zeros((len(pick), bins), dtype=np.int64)
    for row, vid in enumerate(versions):
        counts[row] = np.histogram(_values(_one_tensor(store, vid, key)), bins=edges)[0]
    steps = stats.column("step").to_pylist()
    has_steps = all(steps[i] is not None for i in pick)
    x = np.array([steps[i] for i in pick] if has_steps else pick, dtype=np.int64)
    return HistogramData(key, versions, x, edges, counts, has_steps)


def _values(tensor: Any) -> np.ndarray:
    """The finite values of a tensor as float64, flat; a complex tensor's real and imaginary parts, as its stored
    statistics and `diff` count them (a cast to float kept the real parts alone, with a warning)."""
    t = tensor.detach().to("cpu")
    if t.is_complex():
        t = torch.view_as_real(t)
    values = t.double().flatten().numpy()
    return values[np.isfinite(values)]


def _finite_range(values: np.ndarray) -> tuple[float, float] | None:
    return (float(values.min()), float(values.max())) if values.size else None


def _one_tensor(store: Store, ref: Any, key: str) -> Any:
    """The tensor at `key` of `ref`, loading nothing else."""
    node: Any = store.load(ref, keys=[key])
    rest = key
    while rest:  # walk the one path of the partial state (container keys may hold dots themselves)
        (k, node), = node.items() if isinstance(node, dict) else enumerate(node)
        rest = rest[len(str(k)) + 1:]
    return node


def histograms(store: Store, ref: Any = "main", key: str = "", *, bins: int = 64,
               max_versions: int | None = 200) -> Figure:
    """The distribution of tensor `key` over the versions of `ref` (TensorBoard-style): a 2-D histogram,
    step on x, value on y, log count as color; plus the first and last version's histograms.
    Raises what `histograms_data` raises, MissingDependencyError."""
    data = histograms_data(store, ref, key, bins=bins, max_versions=max_versions)
    fig = _figure(10.0, 4.5)
    ax, side = fig.subplots(1, 2, width_ratios=[3, 1])
    with np.errstate(divide="ignore"):
        shown = np.log10(data.counts.T.astype(np.float64))
    cmap = _colormap("magma").with_extremes(bad="black")
    xs = np.arange(len(data.versions) + 1) - 0.5
    mesh = ax.pcolormesh(xs, data.edges, np.ma.masked_invalid(shown), cmap=cmap, shading="flat")
    ticks = np.unique(np.linspace(0, len(data.x) - 1, min(len(data.x), 10)).astype(int))
    ax.set_xticks(ticks, [str(data.x[t]) for t in ticks])
    ax.set_xlabel(_x_label_for(data))
    ax.set_ylabel("value")
    ax.set_title(f"{_short(key)} along {ref}")
    fig.colorbar(mesh, ax=ax, label="log10 count")
    centers = (data.edges[:-1] + data.edges[1:]) / 2
    for row, name in ((0, "first"), (len(data.versions) - 1, "last")):
        side.plot(data.counts[row], centers, label=f"{name} (x={data.x[row]})")
    side.set_xlabel("count")
    side.legend(fontsize="x-small")
    side.set_title("first vs last")
    return fig


# ---------------------------------------------------------------------------------------------
# diff

@dataclass(frozen=True)
class DiffData:
    """Per-tensor comparison of two versions (tensors present in both with the same dtype and shape)."""

    a: str
    b: str
    keys: list[str]
    rel_change: np.ndarray
    """||b - a|| / ||a|| per key (inf for a change from all zeros, or to or from NaN or an infinity; NaN when
    unknown)."""
    cosine: np.ndarray
    """cos(a, b) per key (NaN when either is all zeros)."""
    other: dict[str, str]
    """Keys not compared, with why: 'added', 'removed', 'dtype_or_shape_changed'."""


def diff_data(store: Store, a: Any, b: Any, keys: str | Iterable[str] | None = None) -> DiffData:
    """The numbers of `Store.diff(a, b)` per tensor. Raises NotFoundError, PrunedError, InvalidArgumentError (keys
    that are no key path or glob)."""
    store = _as_store(store)
    patterns = _patterns(keys)
    table = store.diff(a, b, keys=patterns)
    names: list[str] = []
    rel: list[float] = []
    cos: list[float] = []
    other: dict[str, str] = {}
    for row in table.to_pylist():
        if row["status"] in ("added", "removed", "dtype_or_shape_changed"):
            other[row["key"]] = row["status"]
        else:  # same or changed; views too (diff compares the bytes they see: they were left out, as no tensor)
            names.append(row["key"])
            rel.append(math.nan if row["rel_change"] is None else row["rel_change"])
            cos.append(math.nan if row["cosine"] is None else row["cosine"])
    return DiffData(store.resolve(a), store.resolve(b), names, np.array(rel, dtype=np.float64),
                    np.array(cos, dtype=np.float64), other)


def diff(store: Store, a: Any, b: Any, keys: str | Iterable[str] | None = None) -> Figure:
    """Two panels, one bar per tensor: relative change ||b - a|| / ||a|| and cosine(a, b); e.g. two
    PBT forks, or a fine-tune against its base. Raises what `diff_data` raises, MissingDependencyError."""
    data = diff_data(store, a, b, keys)
    fig = _figure(10.0, max(3.0, 1.2 + 0.3 * len(data.keys)))
    left, right = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(data.keys))
    # An unbounded change (from all zeros, or to or from NaN or an infinity) was drawn as no bar, as no change (a
    # review): it is a red bar past the longest finite one, labelled inf.
    rel = data.rel_change
    finite = rel[np.isfinite(rel)]
    cap = float(finite.max()) * 1.2 if finite.size and finite.max() > 0 else 1.0
    unbounded = np.isinf(rel)
    left.barh(y, np.where(unbounded, cap, np.nan_to_num(rel)),
              color=["tab:red" if u else "tab:blue" for u in unbounded])
    for yi in y[unbounded]:
        left.text(cap, yi, " inf", va="center", fontsize="x-small", color="tab:red")
    left.set_yticks(y, [_short(k) for k in data.keys], fontsize="x-small")
    left.invert_yaxis()
    left.set_xlabel("||b - a|| / ||a||")
    left.set_title("relative change")
    right.barh(y, np.nan_to_num(data.cosine, nan=0.0), color="tab:orange")
    right.set_xlim(min(0.0, float(np.nanmin(data.cosine)) if data.cosine.size and np.isfinite(data.cosine).any()
                       else 0.0), 1.0)
    right.set_xlabel("cosine(a, b)")
    right.set_title("cosine similarity")
    extra = f"; {len(data.other)} tensors added/removed/reshaped" if data.other else ""
    fig.suptitle(f"{_name(a)} ({data.a[:10]}) -> {_name(b)} ({data.b[:10]}){extra}")
    return fig


def _name(ref: Any) -> str:
    return ref if isinstance(ref, str) and not _looks_like_id(ref) else "version"


def _looks_like_id(ref: str) -> bool:
    return len(ref) >= 6 and all(c in "0123456789abcdef" for c in ref)


# ---------------------------------------------------------------------------------------------
# lineage

@dataclass(frozen=True)
class LineageData:
    """A git-style layout of a set of versions: one row per version in time order, one lane per branch."""

    ids: list[str]
    """Version ids, oldest first (by creation time); node i is drawn at (lane[i], i)."""
    lane: np.ndarray
    lanes: list[str]
    """Lane names (the branch each version was saved on; '(none)' for versions saved without one)."""
    edges: list[tuple[int, int, str]]
    """(parent index, child index, kind): kind 'parent' (first parent), 'merge' (second+ parent) or
    'fork' (a PBT exploit: the child copies the donor `fork_of`)."""
    metric: np.ndarray
    """The metric per node (NaN when absent)."""
    metric_name: str | None
    labels: dict[int, list[str]]
    """Node index -> branch heads and tags pointing at it."""
    pruned: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    """Per node: the version was pruned (its record kept for lineage, its bytes gone)."""


def _drawn_metric(metric: str, versions: Iterable[Version]) -> str:
    """The metrics name `metric` means among `versions`. Raises NotFoundError when none of them has it: a
    typo would otherwise draw every node grey, as versions without a metric."""
    found = {k for v in versions for k in v.metrics}
    if metric not in found and metric.startswith("metrics.") and metric[len("metrics."):] in found:
        return metric[len("metrics."):]
    if metric not in found:
        names = ", ".join(sorted(found)[:20]) or "none"
        raise NotFoundError(f"no version drawn has the metric {shown(metric)}; the metrics they have: {names} "
                            "(`datastates log` shows each version's metrics)")
    return metric


def lineage_data(store: Store, refs: Any = None, *, population: Population | str | None = None,
                 metric: str | None = None) -> LineageData:
    """Which versions to draw: the ancestors of `refs` (a ref or a list), or every version saved on a
    member branch of `population` (a Population or its name) and their ancestors, or (both None) every
    version in the store. `metric`: a metrics name (default: the population's metric, else the first
    metric any version has; `metrics.NAME` is read as NAME). Raises NotFoundError (a ref; a metric no drawn
    version has), InvalidArgumentError (both refs and population; a metric that is no str; a population that is
    neither a Population nor a str)."""
    store = _as_store(store)
    if metric is not None and not isinstance(metric, str):
        raise InvalidArgumentError(f"metric={metric!r}: give a metrics name such as 'loss' (or None)")
    asked = metric
    if refs is not None and population is not None:
        raise InvalidArgumentError("give lineage either refs or population, not both")
    table = store.versions_table()
    all_ids: list[str] = table.column("id").to_pylist()
    if population is not None and not isinstance(population, str) and not hasattr(population, "name"):
        raise InvalidArgumentError(f"population={population!r}: give a Population or its name (or None)")
    if population is not None:
        name = population if isinstance(population, str) else population.name
        # The population's own metric may be in no version yet (scores come later, or as annotations): it
        # only colors; a metric the caller names (`asked`) is checked below.
        metric = metric or (None if isinstance(population, str) else population.metric)
        branch_col = table.column("branch").to_pylist()
        seeds = [vid for vid, br in zip(all_ids, branch_col) if br is not None and br.startswith(f"{name}/")]
        if not seeds:
            raise NotFoundError(f"no version was saved on a branch of population {name!r}; "
                                "`datastates branch` lists the branches (a population's are NAME/member-NN)")
        chosen = _with_ancestors(store, seeds)
    elif refs is not None:
        chosen = _with_ancestors(store, [store.resolve(r) for r in (
            [refs] if isinstance(refs, str) or not isinstance(refs, Iterable) else list(refs))])
    else:
        chosen = set(all_ids)
    graph = store.graph
    created = {vid: graph.created(vid) for vid in chosen}
    ids = sorted(chosen, key=lambda v: (created[v], v))
    index = {vid: i for i, vid in enumerate(ids)}
    records = {vid: store.version(vid) for vid in ids}
    lanes: list[str] = []
    lane_of: dict[str, int] = {}
    lane = np.zeros(len(ids), dtype=np.int64)
    edges: list[tuple[int, int, str]] = []
    for i, vid in enumerate(ids):
        v = records[vid]
        name = v.branch or "(none)"
        if name not in lane_of:
            lane_of[name] = len(lanes)
            lanes.append(name)
        lane[i] = lane_of[name]
        for n, p in enumerate(v.parents):
            if p in index:
                kind = "fork" if v.fork_of == p else ("parent" if n == 0 else "merge")
                edges.append((index[p], i, kind))
        if v.fork_of is not None and v.fork_of not in v.parents and v.fork_of in index:
            edges.append((index[v.fork_of], i, "fork"))
    if metric is None:
        metric = next((k for v in records.values() for k in sorted(v.metrics)), None)
    elif metric == asked:
        metric = _drawn_metric(metric, records.values())
    values = np.array([_number(records[vid].metrics.get(metric)) if metric else math.nan for vid in ids])
    labels: dict[int, list[str]] = {}
    for name, vid in sorted(store.branches().items()):
        if vid in index:
            labels.setdefault(index[vid], []).append(name)
    for name, vid in sorted(store.tags().items()):
        if vid in index:
            labels.setdefault(index[vid], []).append(f"tag: {name}")
    pruned = np.array([records[vid].pruned for vid in ids], dtype=bool)
    return LineageData(ids, lane, lanes, edges, values, metric, labels, pruned)


def _with_ancestors(store: Store, ids: list[str]) -> set[str]:
    """`ids` and all their ancestors. Newest first, skipping an id already reached (its ancestors are too): a
    walk per id made a population's lineage quadratic, every version of a member branch walking the whole
    branch again (2,000 versions took a second, 20,000 would take minutes)."""
    graph = store.graph
    reached: set[str] = set()
    for vid in sorted(set(ids), key=lambda v: (graph.created(v), v), reverse=True):
        if vid not in reached:
            reached.update(store.ancestors(vid))
    return reached | set(ids)


def _number(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def lineage(store: Store, refs: Any = None, *, population: Population | str | None = None,
            metric: str | None = None, cmap: str = "viridis_r", max_labels: int = 40,
            figsize: tuple[float, float] | None = None) -> Figure:
    """The version DAG, git-style: time flows down, one column (lane) per branch; solid lines join a
    version to its parents, dashed red lines are PBT forks (exploits), dotted lines merges; nodes are
    colored by `metric` (log scale when it spans over a decade; grey where a version has none, e.g. a
    fork, which copies tensors but not metrics; a black x where it was pruned); branch heads and tags
    are labeled. See `lineage_data` for which versions are drawn.
    Raises what `lineage_data` raises, MissingDependencyError."""
    data = lineage_data(store, refs, population=population, metric=metric)
    n = len(data.ids)
    fig = _figure(*(figsize or (max(6.0, 1.5 + 0.9 * len(data.lanes)), min(16.0, max(4.0, 1.0 + 0.12 * n)))))
    from matplotlib.collections import LineCollection  # after _figure: it says what to install when absent

    ax = fig.add_subplot()
    y = np.arange(n)
    styles = {"parent": ("tab:gray", "solid"), "merge": ("tab:purple", "dotted"), "fork": ("tab:red", "dashed")}
    for kind, (color, style) in styles.items():
        segs = [[(data.lane[p], p), (data.lane[c], c)] for p, c, k in data.edges if k == kind]
        if segs:
            ax.add_collection(LineCollection(segs, colors=color, linestyles=style, linewidths=1.0, zorder=1,
                                             label=f"{kind} ({len(segs)})"))
    has = np.isfinite(data.metric) & ~data.pruned
    bare = ~np.isfinite(data.metric) & ~data.pruned
    ax.scatter(data.lane[bare], y[bare], s=18, c="lightgrey", edgecolors="grey", zorder=2, gid="nodes-no-metric",
               label=f"no {data.metric_name or 'metric'} ({int(bare.sum())})")
    if data.pruned.any():
        ax.scatter(data.lane[data.pruned], y[data.pruned], s=22, marker="x", c="black", zorder=2, gid="nodes-pruned",
                   label=f"pruned ({int(data.pruned.sum())})")
    if has.any():
        from matplotlib.colors import LogNorm

        values = data.metric[has]
        # Losses fall by orders of magnitude: a linear scale would paint all but the first few nodes alike.
        norm = LogNorm() if (values > 0).all() and values.max() > 10 * values.min() else None
        points = ax.scatter(data.lane[has], y[has], s=22, c=values, cmap=cmap, norm=norm, zorder=3, gid="nodes")
        fig.colorbar(points, ax=ax, label=f"metrics.{data.metric_name}")
    for i, names in list(sorted(data.labels.items()))[:max_labels]:
        ax.annotate(", ".join(names), (data.lane[i], i), xytext=(6, 0), textcoords="offset points",
                    fontsize="x-small", va="center")
    ax.set_xticks(range(len(data.lanes)), [_short(x, 18) for x in data.lanes], rotation=45, ha="right",
                  fontsize="small")
    ax.set_xlim(-0.6, len(data.lanes) - 0.4 + 0.6)
    ax.set_ylim(n - 0.5 + 0.5, -1.0)
    ax.set_ylabel("versions, oldest at the top")
    ax.set_title(f"lineage: {n} versions, {len(data.lanes)} branches"
                 + (f", colored by {data.metric_name}" if data.metric_name else ""))
    fig.legend(loc="outside lower center", ncols=4, fontsize="x-small", frameon=False)
    return fig
