"""Write docs/img/pbt_lineage.png, the README's picture: the family tree of the toy PBT population.

    .venv/bin/python docs/make_readme_image.py [--out docs/img/pbt_lineage.png]

Runs docs/examples/pbt_toy.py (6 members, 120 steps, seed 0: a few seconds on CPU) into a temp store
and draws `datastates.plot.lineage(store, population="toy")`. Deterministic inputs; the PNG carries no
software-version metadata, so rerunning with the same matplotlib gives the same bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import datastates as ds
from datastates import plot

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "img" / "pbt_lineage.png")
    ap.add_argument("--dpi", type=int, default=90)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("pbt_toy", HERE / "examples" / "pbt_toy.py")
    assert spec is not None and spec.loader is not None
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    with tempfile.TemporaryDirectory() as tmp:
        toy.run(str(Path(tmp) / "pbt"), members=6, steps=120, interval=20, seed=0)
        with ds.Store.open(Path(tmp) / "pbt") as store:
            fig = plot.lineage(store, population="toy", metric="val_loss", figsize=(8.0, 7.0))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(args.out, dpi=args.dpi, metadata={"Software": None})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
