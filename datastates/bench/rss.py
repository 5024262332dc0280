"""Peak RSS and time of one save or one load, each in a fresh process: `datastates bench --rss` (issue 13).

    datastates bench --rss --shape transformer         # 7 methods x 3 fresh processes, medians
    datastates bench --rss --quick --size 8MiB         # a tiny state (what the tests run)
    python -m datastates.bench.rss --method ds_load --dir DIR --shape cnn   # one child, as the run starts it

Issue 13 bounds the peak RSS of a save by state + pool + 10 % and of a load by 1.1x the state. A
process's high-water mark keeps whatever an earlier step touched (the state's build, another method's
buffers, a warm pool), so each method runs in a process of its own, started for that one measurement.

What a measurement guarantees:
- the child imports torch and the store, builds the state (for a save) or reads the saved files once and
  drops them from the page cache (for a load: `cold_start`, as the timed bench does), collects garbage, then reads
  its baseline (VmRSS) just before the operation; the peak is VmHWM right after it, with the
  high-water mark first reset to the baseline by writing "5" to /proc/self/clear_refs. Where that
  reset is refused, the peak is the process's VmHWM as it stands (it may date from the build) and the
  result says `peak_reset: false`: the growth is then an upper bound, never an underestimate;
- growth = peak - baseline: the operation's own memory, Store.open included (a restart opens the
  store too); a load's result is the state's bytes and is part of its growth, touched once per page
  so a lazy loader pays for its pages as an eager one does;
- the state is the one `datastates bench` builds (`--shape`/`--scale`, or `--size`/`--tensors`),
  seeded, so the loads read the same state the saves write; the files for the loads are written once
  by an unmeasured child before the measurements;
- the operation's wall time is reported too: for the loads it is a restart's (a fresh process opens the
  store and loads), the case `load` exists for, beside the timed bench's loads in one long-lived process;
  the restart line gives torch.load and safetensors over our load, against issue 13's 1.2. On a VM that
  hands freed memory back to its host, a load's first touch of new pages moves its time by 2-3x from one
  process or repeat to the next (docs/perf-notes.md, "Loads at full size"): compare medians;
- methods are interleaved inside each repeat, the saves first, then the loads in a balanced order that
  changes every repeat (`method_order`: no load always runs first or after the same method); the median of
  the repeats is reported with every sample;
- every file lives in one fresh directory under `--dir`, removed at the end.

The bounds, per method (`bound_bytes`): the state is resident before a save starts, so the issue's
"peak <= state + pool + 10 %" leaves a save a growth of at most pool + 10 % of the state (the pool being
the bytes the store's staging pool holds after the save; none for torch.save). A load starts from
nothing and its result is the state, so its growth may be at most 1.1x the state. The same bounds are
shown for torch.save and torch.load, for comparison; they are not targets for torch.

This module's top level imports only the standard library (the CLI imports the bench at every start).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .options import SHAPE_TARGETS, Config, command_line
from .peers import _nbytes, _touch_pages, cold_start, fresh_dir, make_state
from .shapes import SHAPES, build

if TYPE_CHECKING:
    import torch

RSS_METHODS: dict[str, str] = {
    "ds_save": "datastates save (sync, durable)",
    "ds_save_async": "datastates save_async, to durable",
    "torch_save_fsync": "torch.save + fsync",
    "ds_load": "datastates load (full)",
    "ds_load_mmap": "datastates load(mmap=True)",
    "torch_load": "torch.load",
    "safetensors_load": "safetensors load_file",
}
"""The methods `--rss` measures, in print order; the JSON uses these keys."""

SAVES = ("ds_save", "ds_save_async", "torch_save_fsync")
SAVE_SLACK = 0.10
"""A save may grow by its pool plus this share of the state (issue 13: state + pool + 10 %)."""
LOAD_FACTOR = 1.1
"""A load may grow by this multiple of the state (issue 13: its result is the state itself)."""

_DS_DIR, _PT_FILE, _ST_FILE = "ds", "state.pt", "state.safetensors"  # what the prepare step writes for the loads
_LOAD_FILES = {"ds_load": _DS_DIR, "ds_load_mmap": _DS_DIR, "torch_load": _PT_FILE, "safetensors_load": _ST_FILE}

RESTART_RATIOS = (("torch_load", "ds_load"), ("safetensors_load", "ds_load"), ("torch_load", "ds_load_mmap"),
                  ("safetensors_load", "ds_load_mmap"))
"""(peer, ours) for the restart line: the median seconds of each load in a fresh process, as after a failure; a
pair the timed bench holds to a target (`SHAPE_TARGETS`, issue 13) is held to the same one here."""


# --- the child: one operation, measured in its own process ---------------------------------------------


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes (empty where /proc is missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0]) * 1024  # the kernel writes kB
    except (OSError, ValueError):
        pass
    return out


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel refuses (then VmHWM is the process's peak so far)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _state(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The state `datastates bench` builds for the same options (seed 0)."""
    if args.shape:
        return build(args.shape, args.scale, args.tensors or None, seed=0)
    return make_state(args.size, args.tensors, seed=0)


def _measure(op: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run `op` between a baseline and a peak reading; return its own fields plus the RSS figures and the
    wall seconds `op` took."""
    gc.collect()
    reset = _reset_peak()
    base = _proc_status().get("VmRSS", 0)
    t0 = time.perf_counter()
    extra = op()
    seconds = time.perf_counter() - t0
    peak = _proc_status().get("VmHWM", 0)
    if not reset:
        peak = max(peak, base)
    return {**extra, "baseline_bytes": base, "peak_bytes": peak, "growth_bytes": peak - base, "peak_reset": reset,
            "seconds": seconds}


def _child(argv: list[str] | None = None) -> int:
    """One method in this process; print one JSON line (the last line of stdout). Returns 0."""
    p = argparse.ArgumentParser(prog="python -m datastates.bench.rss")
    p.add_argument("--method", choices=("prepare", *RSS_METHODS), required=True)
    p.add_argument("--dir", required=True, help="the run's directory (the loads read what prepare wrote there)")
    p.add_argument("--shape", choices=SHAPES, default=None)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=0)
    p.add_argument("--size", type=int, default=64 << 20)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--zstd", type=int, default=0)
    args = p.parse_args(argv)
    # Imported before the baseline: a process imports these whether it saves or loads.
    import torch

    from ..store import Store
    from .peers import _safetensors_save, _torch_save

    root = Path(args.dir)
    method = args.method
    result: dict[str, Any]
    if method == "prepare":
        state = _state(args)
        with Store.open(root / _DS_DIR, pool_bytes=2 * _nbytes(state), chunk_size=args.chunk_size,
                        zstd_level=args.zstd) as store:
            store.save(state, branch="main", message="rss")
        _torch_save(state, root / _PT_FILE)
        _safetensors_save(state, root / _ST_FILE)
        result = {"state_bytes": _nbytes(state), "tensors": len(state)}
    elif method in SAVES:
        state = _state(args)
        size = _nbytes(state)
        out = root / f"{method}-{os.getpid()}"

        def save() -> dict[str, Any]:
            if method == "torch_save_fsync":
                _torch_save(state, out)
                return {"pool_bytes": 0, "pool_capacity_bytes": 0}
            # The same pool the timed bench gives the store (twice the state); the bound uses what it
            # actually holds after the save, since slots are allocated on first use only.
            store = Store.open(out, pool_bytes=2 * size, chunk_size=args.chunk_size, zstd_level=args.zstd)
            if method == "ds_save_async":
                # Copies every tensor into pool slots (a sync save reads big ones in place): the pool's case.
                store.save_async(state, branch="main", message="rss").result()
            else:
                store.save(state, branch="main", message="rss")
            pool = store.pool
            figures = {"pool_bytes": pool.allocated_bytes, "pool_capacity_bytes": pool.max_slots * pool.slot_bytes}
            store.close()  # inside the measurement: a save is done when its store can be closed
            return figures

        result = {"state_bytes": size, **_measure(save)}
    else:
        # As the timed bench does: read once, then dropped, so that no loader gains from whether its files were
        # last written through the page cache.
        cold_start([root / _LOAD_FILES[method]])
        if method == "safetensors_load":
            from safetensors.torch import load_file  # imported before the baseline, as torch is

        def load() -> dict[str, Any]:
            if method == "torch_load":
                got = torch.load(root / _PT_FILE, weights_only=True)
            elif method == "safetensors_load":
                got = load_file(str(root / _ST_FILE))
            else:
                with Store.open(root / _DS_DIR, create=False) as store:
                    got = store.load("main", mmap=method == "ds_load_mmap")
            _touch_pages(got)
            # The result stays alive until the peak is read (the caller reads it after this returns).
            holder.append(got)
            return {"pool_bytes": 0, "pool_capacity_bytes": 0}

        holder: list[Any] = []
        result = _measure(load)
        result["state_bytes"] = _nbytes(holder[0])
    print(json.dumps({"method": method, **result}), flush=True)
    return 0


# --- the parent: fresh children, medians, bounds -----------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench rss {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _spawn(cfg: Config, method: str, root: Path) -> dict[str, Any]:
    """Run one child; return its JSON. Raises RuntimeError with the child's stderr if it fails."""
    cmd = [sys.executable, "-m", "datastates.bench.rss", "--method", method, "--dir", str(root),
           "--zstd", str(cfg.zstd)]
    if cfg.shape:
        cmd += ["--shape", cfg.shape, "--scale", repr(cfg.scale), "--tensors", str(cfg.tensors or 0)]
    else:
        cmd += ["--size", str(cfg.size), "--tensors", str(cfg.tensors)]
    if cfg.chunk_size:
        cmd += ["--chunk-size", str(cfg.chunk_size)]
    # The child must import this very package, wherever the parent was started from.
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"datastates bench --rss: the {method} child failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    got: dict[str, Any] = json.loads(lines[-1])
    return got


def method_order(repeat: int) -> list[str]:
    """The methods of repeat `repeat` (from 0) in the order their children run: the saves (rotated by `repeat`),
    then the loads in row `repeat` of a balanced Latin square: over as many repeats as there are loads (four),
    each load runs first after the saves once and right after each other load once. What the process before
    did to the machine's memory and disk can move a 1 GiB load by 2-3x on a VM (docs/perf-notes.md "Loads at
    full size"), so no load may always follow the same method."""
    saves = [m for m in RSS_METHODS if m in SAVES]
    loads = [m for m in RSS_METHODS if m not in SAVES]
    n, s = len(loads), repeat % len(saves)
    # Williams' first row 0, 1, n-1, 2, n-2, ...; row r adds r to each (mod n).
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    return saves[s:] + saves[:s] + [loads[(i + repeat) % n] for i in first]


def _bound(method: str, state: int, pool: int) -> int:
    return int(state * LOAD_FACTOR) if method not in SAVES else pool + int(state * SAVE_SLACK)


def run_rss(cfg: Config) -> dict[str, Any]:
    """Measure every method `cfg.repeats` times, each in a fresh process; return the JSON-ready report.

    Every file the run writes is removed before it returns. Raises SystemExit when the directory lacks
    the disk space the run needs, RuntimeError when a child fails.
    """
    import platform

    # The prepared store, .pt and .safetensors files, plus one save's output at a time.
    parent, fs, root = fresh_dir(cfg, 5, ".datastates-bench-rss-", _log)
    t_start = time.time()
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in RSS_METHODS}
    try:
        _log(f"writing the state for the loads (one untimed child) in {root} ({fs})")
        prep = _spawn(cfg, "prepare", root)
        _log(f"state: {prep['state_bytes'] / 2**20:.0f} MiB in {prep['tensors']} tensors; {cfg.repeats} repeats "
             f"of {len(RSS_METHODS)} methods, each in a fresh process")
        for r in range(cfg.repeats):
            for method in method_order(r):
                got = _spawn(cfg, method, root)
                samples[method].append(got)
                _log(f"repeat {r + 1}/{cfg.repeats} {method}: growth {got['growth_bytes'] / 2**20:.1f} MiB")
                for leftover in root.glob(f"{method}-*"):  # a save's own output: the next child starts clean
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    methods: dict[str, Any] = {}
    for method, runs in samples.items():
        # The pool a save ends with differs from process to process (slots are allocated as the pipeline
        # falls behind), so each sample is held to its own bound; the verdict is on the median ratio.
        bounds = [_bound(method, s["state_bytes"], s["pool_bytes"]) for s in runs]
        ratios = [s["growth_bytes"] / b for s, b in zip(runs, bounds, strict=True)]
        ratio = statistics.median(ratios)
        methods[method] = {
            "label": RSS_METHODS[method], "state_bytes": int(statistics.median(s["state_bytes"] for s in runs)),
            "pool_bytes": int(statistics.median(s["pool_bytes"] for s in runs)),
            "pool_capacity_bytes": int(statistics.median(s["pool_capacity_bytes"] for s in runs)),
            "growth_bytes": int(statistics.median(s["growth_bytes"] for s in runs)),
            "growth_samples": [s["growth_bytes"] for s in runs], "pool_samples": [s["pool_bytes"] for s in runs],
            "baseline_bytes": int(statistics.median(s["baseline_bytes"] for s in runs)),
            "peak_bytes": int(statistics.median(s["peak_bytes"] for s in runs)),
            "bound_bytes": int(statistics.median(bounds)),
            "bound": f"<= pool + {SAVE_SLACK:.0%} of state" if method in SAVES else f"<= {LOAD_FACTOR:g} x state",
            "ratio": ratio, "ratio_samples": ratios, "pass": ratio <= 1.0, "target": method.startswith("ds_"),
            "peak_reset": all(s["peak_reset"] for s in runs),
            "seconds": statistics.median(s["seconds"] for s in runs), "seconds_samples": [s["seconds"] for s in runs]}
    return {"command": command_line(cfg), "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
            "duration_s": time.time() - t_start, "restart": _restart_ratios(methods),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(), "fs_type": fs, "dir": str(parent)},
            "config": {"size": None if cfg.shape else cfg.size, "bytes": prep["state_bytes"],
                       "tensors": prep["tensors"],
                       "shape": cfg.shape, "scale": cfg.scale, "repeats": cfg.repeats, "quick": cfg.quick,
                       "chunk_size": cfg.chunk_size, "zstd": cfg.zstd},
            "rss": methods}


def _restart_ratios(methods: dict[str, Any]) -> list[dict[str, Any]]:
    """`RESTART_RATIOS` from the median seconds: label, value, target (None: for information) and pass."""
    targets = {(t.num, t.den): t.target for t in SHAPE_TARGETS if t.op == ">="}
    out = []
    for peer, ours in RESTART_RATIOS:
        target = targets.get((peer, ours))
        value = methods[peer]["seconds"] / methods[ours]["seconds"] if methods[ours]["seconds"] > 0 else None
        out.append({"label": f"{RSS_METHODS[peer]} / {RSS_METHODS[ours]}", "value": value, "target": target,
                    "pass": None if target is None or value is None else value >= target})
    return out


def print_rss_report(rep: dict[str, Any], out: TextIO) -> None:
    """The table: per method the state, the pool, the median growth (and samples), its bound and PASS/MISS."""
    cfg = rep["config"]
    kind = f"shape {cfg['shape']} (scale {cfg['scale']:g})" if cfg.get("shape") else "fp32 tensors"
    mib = 2**20
    print(f"\ndatastates bench --rss: {cfg['bytes'] / mib:.0f} MiB in {cfg['tensors']} tensors, {kind}, "
          f"{cfg['repeats']} fresh processes per method, {rep['machine']['cpus']} CPUs", file=out)
    w = 34
    print(f"\n{'method':<{w}} {'seconds':>8} {'state MiB':>9} {'pool MiB':>8} {'growth MiB':>10} {'bound MiB':>9} "
          f"{'ratio':>6}  result  samples (MiB)", file=out)
    for m in rep["rss"].values():
        verdict = ("PASS" if m["pass"] else "MISS") if m["target"] else ("within" if m["pass"] else "over")
        samples = " ".join(f"{s / mib:.1f}" for s in m["growth_samples"])
        print(f"{m['label']:<{w}} {m['seconds']:>8.4f} {m['state_bytes'] / mib:>9.1f} {m['pool_bytes'] / mib:>8.1f} "
              f"{m['growth_bytes'] / mib:>10.1f} {m['bound_bytes'] / mib:>9.1f} {m['ratio']:>6.2f}  {verdict:<6}  "
              f"{samples}", file=out)
    print(f"(seconds: the operation's wall time in its fresh process; growth: peak RSS (VmHWM) minus RSS just\n"
          f" before the operation; medians; ratio: median of growth/bound; bound: saves pool + {SAVE_SLACK:.0%} of\n"
          f" the state, loads {LOAD_FACTOR:g}x the state; torch and safetensors rows are for comparison)", file=out)
    print("\nloads as after a restart (each in a fresh process; median seconds):", file=out)
    for r in rep["restart"]:
        value = "-" if r["value"] is None else f"{r['value']:.3f}"
        verdict = "(info)" if r["target"] is None else f">= {r['target']:g}  {'PASS' if r['pass'] else 'MISS'}"
        print(f"  {r['label']:<60} {value:>7}  {verdict}", file=out)
    if not all(m["peak_reset"] for m in rep["rss"].values()):
        print("WARNING: /proc/self/clear_refs refused the high-water-mark reset: growths are upper bounds", file=out)
    missed = [m["label"] for m in rep["rss"].values() if m["target"] and not m["pass"]]
    checked = sum(1 for m in rep["rss"].values() if m["target"])
    print(f"\nMISSED {len(missed)} of {checked} RSS bounds: " + "; ".join(missed) if missed
          else f"\nall {checked} RSS bounds met", file=out)


if __name__ == "__main__":
    raise SystemExit(_child())
