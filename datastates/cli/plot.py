"""The `plot` command (`datastates plot lineage -o lineage.png`): the figures of `datastates.plot`, written to
an image file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .. import plot as plots
from ..errors import InvalidArgumentError
from ..store import Store
from .arguments import common_options, positive

IMAGE_SUFFIXES = (".png", ".svg", ".pdf")
MAX_PIXELS = 1 << 28
"""The largest image `plot` draws (width x height at --dpi): 1 GiB of RGBA. --dpi 100000 asked Agg for hundreds of
GiB and ended in MemoryError's traceback (or, where memory is overcommitted, the out-of-memory killer)."""


def register(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw norms, update ratios, histograms, a diff or the lineage to an image file",
                       description="Figures of datastates.plot (needs `pip install 'datastates[plot]'`), "
                                   "written to --out (.png, .svg, .pdf: by its suffix).")
    kinds = p.add_subparsers(dest="kind", required=True)

    def kind(name: str, help: str) -> argparse.ArgumentParser:
        k = kinds.add_parser(name, help=help)
        common_options(k)  # `datastates plot norms --store PATH`, as every other command takes it after its name
        k.add_argument("-o", "--out", type=Path, default=None, help=f"image file (default: {name}.png)")
        k.add_argument("--dpi", type=int, default=100)
        k.set_defaults(handler=_plot, plot_kind=name)
        return k

    k = kind("norms", "per-tensor L2 norm (or --stat) against step along REF (stored stats, no tensor read)")
    k.add_argument("ref", nargs="?", default="main")
    k.add_argument("--keys", nargs="+", default=None, help="keys, globs or prefixes (default: every tensor)")
    k.add_argument("--stat", default="l2", choices=plots.STATS)
    k = kind("update-ratios", "heatmap tensors x versions of ||w_t - w_prev|| / ||w_prev|| along REF")
    k.add_argument("ref", nargs="?", default="main")
    k.add_argument("--keys", nargs="+", default=None, help="keys, globs or prefixes (default: every tensor)")
    k = kind("histograms", "the distribution of one tensor over the versions of REF")
    k.add_argument("key")
    k.add_argument("ref", nargs="?", default="main")
    k.add_argument("--bins", type=positive, default=64)
    k.add_argument("--max-versions", type=positive, default=200)
    k = kind("diff", "per-tensor relative change and cosine between two versions")
    k.add_argument("a")
    k.add_argument("b")
    k.add_argument("--keys", nargs="+", default=None, help="keys, globs or prefixes (default: every tensor)")
    k = kind("lineage", "the version DAG (every version, the ancestors of REFs, or a --population)")
    k.add_argument("refs", nargs="*", default=None)
    k.add_argument("--population", default=None, help="a PBT population's name (its member branches)")
    k.add_argument("--metric", default=None, help="metrics name to color by (default: the first one found)")


def _plot(store: Store, args: argparse.Namespace) -> int:
    name = args.plot_kind
    out = args.out or Path(f"{name}.png")
    # Checked before the figure is drawn: matplotlib would raise its own errors only at the write.
    if out.suffix.lower() not in IMAGE_SUFFIXES:
        raise InvalidArgumentError(f"--out {str(out)!r}: give an image file ending in {', '.join(IMAGE_SUFFIXES)}")
    if args.dpi <= 0:
        raise InvalidArgumentError(f"--dpi {args.dpi}: give a positive number of dots per inch, e.g. --dpi 100")
    if not out.resolve().parent.is_dir():
        raise InvalidArgumentError(f"--out {str(out)!r}: the directory {str(out.resolve().parent)!r} does not "
                                   "exist; create it first or write elsewhere")
    if name == "norms":
        fig = plots.norms(store, args.ref, args.keys, stat=args.stat)
    elif name == "update-ratios":
        fig = plots.update_ratios(store, args.ref, args.keys)
    elif name == "histograms":
        fig = plots.histograms(store, args.ref, args.key, bins=args.bins, max_versions=args.max_versions)
    elif name == "diff":
        fig = plots.diff(store, args.a, args.b, args.keys)
    else:
        fig = plots.lineage(store, args.refs or None, population=args.population, metric=args.metric)
    width, height = (float(n) * args.dpi for n in fig.get_size_inches())
    if width * height > MAX_PIXELS:
        raise InvalidArgumentError(f"--dpi {args.dpi}: the image would be {width:,.0f} x {height:,.0f} pixels, "
                                   f"more than {MAX_PIXELS:,} to draw; give a smaller --dpi (100 to 300 is usual)")
    fig.savefig(out, dpi=args.dpi)
    print(f"wrote {out}")
    return 0
