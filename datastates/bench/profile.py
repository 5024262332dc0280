"""A target for profilers: one path of a save or load on a `--shape` state, repeated.

    python -m datastates.bench.profile --shape small --path save --repeats 5
    py-spy record --native -o save.svg -- .venv/bin/python -m datastates.bench.profile --shape small --path save
    pyinstrument -m datastates.bench.profile --shape cnn --path load

Paths: `save` (sync, durable), `async` (the blocking part of save_async; each save waits for the previous
one before the next starts), `load` (full), `one` (one tensor of the state), `partial` (sync save with
10 % of the tensors changed), `reuse` (the same, on a store with `reuse_unchanged=True`). With
`--form state_dict`, every save is given new tensor objects over the state's storages (what
`model.state_dict()` returns on every call), made before the timer starts. The state is
mutated (`add_(1)`) before every save so every save writes new bytes, as in `datastates bench`. Prints the
median wall seconds of the path and the median CPU seconds it used: of the whole process (every thread:
caller, pipeline, hashing workers), and of the caller's thread alone. On a machine shared with other busy
processes, CPU seconds move far less than wall seconds. Files go to a fresh directory under --dir (default:
the current directory), removed at the end.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .peers import _mutate, new_objects
from .shapes import SHAPES, build


def main(argv: list[str] | None = None) -> int:
    """Run the chosen path `--repeats` times; print per-run and median seconds. Returns 0."""
    p = argparse.ArgumentParser(prog="python -m datastates.bench.profile")
    p.add_argument("--shape", choices=SHAPES, default="small")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--path", choices=("save", "async", "load", "one", "partial", "reuse"), default="save")
    p.add_argument("--form", choices=("objects", "state_dict"), default="objects",
                   help="save the same tensor objects every time, or new ones over the same storages")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=".")
    args = p.parse_args(argv)
    from ..store import Store

    state = build(args.shape, args.scale)
    size = sum(t.numel() * t.element_size() for t in state.values())
    keys = list(state)
    root = Path(tempfile.mkdtemp(prefix=".datastates-profile-", dir=args.dir))
    times: list[float] = []
    cpu: list[float] = []
    caller: list[float] = []

    def proc_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    try:
        store = Store.open(root / "ds", pool_bytes=2 * size, reuse_unchanged=args.path == "reuse")
        def given() -> dict[str, Any]:
            return state if args.form == "objects" else new_objects(state)

        v = store.save(given(), branch="main")
        for r in range(args.repeats):
            if args.path in ("save", "async"):
                _mutate(state)
            elif args.path in ("partial", "reuse"):
                n = max(1, len(keys) // 10)
                _mutate(state, keys[r * n % len(keys):][:n])
            saved = given()
            c0, th0, t0 = proc_cpu(), time.thread_time(), time.perf_counter()
            if args.path in ("save", "partial", "reuse"):
                v = store.save(saved, branch="main")
            elif args.path == "async":
                h = store.save_async(saved, branch="main")
                times.append(time.perf_counter() - t0)
                caller.append(time.thread_time() - th0)
                v = h.result()
                cpu.append(proc_cpu() - c0)
                continue
            elif args.path == "load":
                store.load(v)
            else:
                store.load(v, keys=[keys[(r * 37) % len(keys)]])
            times.append(time.perf_counter() - t0)
            caller.append(time.thread_time() - th0)
            cpu.append(proc_cpu() - c0)
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    form = "" if args.form == "objects" else ", new objects every save"
    print(f"{args.shape} x{args.scale:g} ({len(state)} tensors, {size / 2**20:.0f} MiB{form}) {args.path}: "
          f"median {statistics.median(times):.4f} s wall, {statistics.median(cpu):.4f} s CPU (all threads"
          f"{', to durable' if args.path == 'async' else ''}), {statistics.median(caller):.4f} s CPU (caller's "
          f"thread); wall samples " + " ".join(f"{t:.4f}" for t in times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
