"""Timings of the CUDA paths, per state shape, for docs/benchmarks.md ("On a GPU").

    python docs/gpu_probe.py block   # save_async's blocking part against a plain copy loop into pinned buffers
    python docs/gpu_probe.py load    # cold loads onto the GPU against torch.load(map_location=...)

`block`: the state of each shape on the GPU; per repeat, every tensor is changed (`add_(1)`), then copied
tensor by tensor into reused pinned buffers (`non_blocking`, one synchronize: the floor a capture compares
with), changed again and saved with `save_async`, whose blocking part is timed; the save is then waited for.
`load`: one sync save and one `torch.save` + fsync of the same state; per repeat, both files' page cache is
dropped (`POSIX_FADV_DONTNEED`) before each cold load: `Store.load(device=...)`, `torch.load(map_location=...,
weights_only=True)` and `Store.load()` onto the host; then one warm `Store.load(device=...)`. Medians of the
repeats after a first, dropped one. `--device cpu` runs the same on the host (a smoke test; no GPU figures).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from datastates.bench.peers import _drop_cache
from datastates.bench.shapes import build
from datastates.store import Store

SHAPES = {"transformer": 1.0, "cnn": 1.0, "small": 0.25, "uniform": 1.0}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    _sync(dev)
    t = time.perf_counter()
    out = fn()
    _sync(dev)
    return time.perf_counter() - t, out


def block(shape: str, scale: float, dev: torch.device, repeats: int, where: str) -> str:
    state = {k: v.to(dev) for k, v in build(shape, scale).items()}
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=dev.type == "cuda") for k, v in state.items()}
    d = tempfile.mkdtemp(dir=where)
    copy, blocking = [], []
    try:
        with Store.open(os.path.join(d, "s")) as s:
            for _ in range(repeats + 1):
                for v in state.values():
                    v.add_(1)
                copy.append(_timed(dev, lambda: [pinned[k].copy_(v, non_blocking=True) for k, v in state.items()])[0])
                for v in state.values():
                    v.add_(1)
                _sync(dev)
                t = time.perf_counter()
                h = s.save_async(state)
                blocking.append(time.perf_counter() - t)
                h.result(600)
    finally:
        shutil.rmtree(d)
    c, b = statistics.median(copy[1:]), statistics.median(blocking[1:])
    return (f"{shape} x{scale}: {len(state)} tensors | copy loop {c * 1e3:.1f} ms | save_async blocking "
            f"{b * 1e3:.1f} ms ({b / c:.2f}x)")


def load(shape: str, scale: float, dev: torch.device, repeats: int, where: str) -> str:
    state = {k: v.to(dev) for k, v in build(shape, scale).items()}
    d = tempfile.mkdtemp(dir=where)
    times: dict[str, list[float]] = {"ds": [], "torch": [], "ds_host": [], "ds_warm": []}
    try:
        with Store.open(os.path.join(d, "s")) as s:
            v = s.save(state)
            pt = os.path.join(d, "state.pt")
            with open(pt, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            ways: dict[str, Callable[[], Any]] = {
                "ds": lambda: s.load(v, device=dev),
                "torch": lambda: torch.load(pt, map_location=dev, weights_only=True),
                "ds_host": lambda: s.load(v),
            }
            got: Any = None
            for _ in range(repeats + 1):
                for name, fn in ways.items():
                    _drop_cache([Path(d)])  # the store's files and torch's
                    times[name].append(_timed(dev, fn)[0])
                t, got = _timed(dev, ways["ds"])
                times["ds_warm"].append(t)
            if any(not torch.equal(got[k], state[k]) for k in state):
                raise SystemExit(f"{shape}: the loaded state differs from the saved one")
    finally:
        shutil.rmtree(d)
    m = {k: statistics.median(x[1:]) for k, x in times.items()}
    return (f"{shape} x{scale} cold load onto {dev}: datastates {m['ds']:.3f} s, torch.load {m['torch']:.3f} s "
            f"({m['torch'] / m['ds']:.2f}x) | onto the host {m['ds_host']:.3f} s | warm {m['ds_warm']:.3f} s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["block", "load"])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--scale", type=float, default=None, help="override every shape's scale")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7 block, 3 load)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the stores and files go (not tmpfs)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; pass --device cpu for a smoke test")
    run = block if a.mode == "block" else load
    repeats = a.repeats if a.repeats is not None else (7 if a.mode == "block" else 3)
    if dev.type == "cuda":
        print(torch.__version__, torch.cuda.get_device_name(dev), flush=True)
    for shape in a.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; pass --shapes with some of {', '.join(SHAPES)}")
        print(run(shape, SHAPES[shape] if a.scale is None else a.scale, dev, repeats, a.dir), flush=True)


if __name__ == "__main__":
    main()
