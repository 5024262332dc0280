"""Options of `datastates bench`, what a run measures (Config, Results) and the targets it checks."""


from __future__ import annotations

import argparse
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..repo.opening import MAX_CHUNK_SIZE
from .shapes import SHAPES

SKIPPABLE = ("torch", "safetensors", "dcp", "train")
"""Groups `--skip` accepts. datastates itself and the plain copy (the floor) always run."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}

METHOD_LABELS: dict[str, str] = {
    "plain_copy": "plain copy into reused buffers (floor)",
    "ds_save": "datastates save (sync, durable)",
    "ds_async_blocking": "datastates save_async: blocking part",
    "ds_async_durable": "datastates save_async: to durable",
    "ds_async_new_blocking": "datastates save_async of new tensor objects (state_dict()): blocking part",
    "ds_async_new_durable": "datastates save_async of new tensor objects: to durable",
    "ds_partial_save": "datastates save, {changed} of tensors changed",
    "ds_partial_reuse_save": "the same, with reuse_unchanged=True",
    "ds_load": "datastates load (full)",
    "ds_load_mmap": "datastates load(mmap=True) (full)",
    "ds_load_one": "datastates load, 1 tensor of the state",
    "ds_load100_full": "datastates load, 100-tensor state (full)",
    "ds_load100_one": "datastates load, 1 tensor of 100",
    "torch_save_fsync": "torch.save + fsync",
    "torch_load": "torch.load",
    "torch_load_mmap": "torch.load(mmap=True)",
    "safetensors_save_fsync": "safetensors save_file + fsync",
    "safetensors_load": "safetensors load_file",
    "dcp_save_t1": "DCP save, thread_count=1",
    "dcp_save_t2": "DCP save, thread_count=2",
    "dcp_load": "DCP load (into new tensors)",
    "dcp_async_blocking": "DCP async_save: blocking part",
    "dcp_async_done": "DCP async_save: to completion",
    "dcp_async_cached_blocking": "DCP async_save, reused stager: blocking",
    "dcp_async_cached_done": "DCP async_save, reused stager: completion",
}
"""Every method key a full run reports, in print order; the JSON uses these keys."""


def parse_size(text: str) -> int:
    """Bytes from '1GiB', '256MiB', '64M', '1e9' or a plain integer. Raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r} is not understood; write e.g. 1GiB, 256MiB, 64M or a byte count")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):  # '1e400': int() of it raised OverflowError, a traceback at the CLI
        raise ValueError(f"size {text!r} is too large; write e.g. 1GiB, 256MiB, 64M or a byte count")
    n = int(value)
    if n <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return n


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> None:
    """Register `datastates bench` and its options on the CLI's subparsers."""
    p = sub.add_parser("bench", help="measure save/load against torch.save, safetensors and DCP",
                       description="Save and load one state with datastates, torch.save, safetensors and "
                                   "torch.distributed.checkpoint, interleaved; print medians, ratios and targets.")
    p.add_argument("--size", type=_size_arg, default=None, help="total state bytes, e.g. 1GiB, 256MiB (default 1GiB)")
    p.add_argument("--tensors", type=int, default=None,
                   help="number of tensors in the state (default 32; with --shape small/uniform: overrides 8000/32)")
    p.add_argument("--shape", choices=SHAPES, default=None,
                   help="a real training-state shape built from torch modules and optimizers: transformer "
                        "(~1.1 GiB, 588 tensors, AdamW), cnn (~140 MiB, 238 tensors, BatchNorm + SGD momentum), "
                        "small (8,000 x 64 KiB), uniform (32 x 32 MiB); checks the issue-13 targets")
    p.add_argument("--scale", type=float, default=None,
                   help="with --shape: multiply the state's bytes, keeping its tensor count and dtypes "
                        "(default 1; 1/16 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 5)")
    p.add_argument("--unchanged", type=float, default=None,
                   help="fraction of tensors left unchanged for the partial save (default 0.9)")
    p.add_argument("--spread", action="store_true",
                   help="change the partial save's tensors spread evenly over the state (adapters between frozen "
                        "layers) instead of one block of neighbours (a run of layers)")
    # dest differs from the global --store (which defaults to $DATASTATES_STORE): the bench must never
    # write into, or delete from, a user's real store.
    p.add_argument("--dir", dest="bench_dir", default=None, metavar="DIR",
                   help="directory for every file of the run (a fresh subdirectory is made there and removed); "
                        "default: the current directory. Avoid tmpfs: it measures memory, not a disk")
    # The old name, kept working but hidden: --store means the user's store everywhere else.
    p.add_argument("--store", dest="bench_dir", default=None, metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="64MiB, 2 repeats, 1 s training windows (for tests)")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write the results as JSON ('-' = stdout)")
    p.add_argument("--skip", default="", help=f"comma-separated groups to leave out: {','.join(SKIPPABLE)}")
    p.add_argument("--chunk-size", type=_size_arg, default=None,
                   help="datastates chunk size, e.g. 1MiB, 4MiB, 16MiB (default: the store default, 16MiB)")
    p.add_argument("--zstd", type=int, default=0, metavar="LEVEL", help="datastates zstd level (default 0 = off)")
    p.add_argument("--reuse-unchanged", action="store_true",
                   help="open the store with reuse_unchanged=True (skip tensors torch's version counter says are "
                        "untouched since the last save)")
    p.add_argument("--rss", action="store_true",
                   help="measure peak RSS instead of time: datastates save, save_async, load and load(mmap=True), "
                        "torch.save, torch.load and safetensors load_file, each in a fresh process, against issue "
                        "13's bounds (default 3 repeats; --skip, --unchanged, --spread, --reuse-unchanged and "
                        "--window do not apply)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the state lives: cpu (default) or cuda / cuda:N. Saves copy from it, loads go onto "
                        "it (torch.load with map_location, safetensors with device), the plain copy is into "
                        "pinned host buffers; the train and dcp groups run on the host only (--skip train,dcp)")
    p.add_argument("--window", type=float, default=None,
                   help="minimum seconds per training window (default: the slowest background save, >= 1 s); "
                        "a window always lasts until its save is complete")


# --- configuration and results ---------------------------------------------------------------------------


@dataclass
class Config:
    """What to run; `config_from_args` builds it from the command line."""

    size: int = 1 << 30
    tensors: int = 32
    repeats: int = 5
    unchanged: float = 0.9
    spread: bool = False
    """The partial save changes tensors spread evenly over the state, not one block of neighbours."""
    bench_dir: str | None = None
    quick: bool = False
    skip: frozenset[str] = frozenset()
    chunk_size: int | None = None
    zstd: int = 0
    reuse_unchanged: bool = False
    window: float | None = None
    shape: str | None = None
    scale: float = 1.0
    rss: bool = False
    device: str = "cpu"
    """Where the state lives and loads go: "cpu", "cuda" or "cuda:N"."""


@dataclass
class Results:
    """Per method: the timed samples (seconds), the bytes each moved, and other processes' CPU share."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    others: dict[str, list[float]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, seconds: float, nbytes: int, others: float) -> None:
        self.samples.setdefault(key, []).append(seconds)
        self.others.setdefault(key, []).append(others)
        self.nbytes[key] = nbytes

    def median(self, key: str) -> float | None:
        s = self.samples.get(key)
        return statistics.median(s) if s else None


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    num: str
    den: str
    op: str  # "<=" or ">="
    target: float


TARGETS = (
    Target("blocking_vs_copy", "save_async blocking / plain copy", "ds_async_blocking", "plain_copy", "<=", 1.3),
    Target("blocking_vs_dcp_async", "save_async blocking / DCP async_save blocking", "ds_async_blocking",
           "dcp_async_blocking", "<=", 0.25),
    Target("torch_save_vs_ds", "torch.save+fsync / datastates save", "torch_save_fsync", "ds_save", ">=", 2.0),
    Target("dcp_t2_vs_ds", "DCP save (2 threads) / datastates save", "dcp_save_t2", "ds_save", ">=", 1.3),
    Target("partial_bytes", "partial save: bytes written / full bytes", "", "", "<=", 0.12),
    Target("partial_time", "partial save time / full save time", "ds_partial_save", "ds_save", "<=", 0.2),
    Target("torch_load_vs_ds", "torch.load / datastates load", "torch_load", "ds_load", ">=", 1.2),
    Target("one_of_100", "load 1 tensor of 100 / full load", "ds_load100_one", "ds_load100_full", "<=", 0.05),
    Target("train_lost_vs_dcp", "training steps lost: datastates / DCP", "", "", "<=", 0.5),
)

SHAPE_TARGETS = (
    Target("torch_save_vs_ds", "torch.save+fsync / datastates save", "torch_save_fsync", "ds_save", ">=", 1.5),
    Target("blocking_vs_copy", "save_async blocking / plain copy", "ds_async_blocking", "plain_copy", "<=", 1.5),
    # The same target for the way most callers save, `{"model": model.state_dict(), ...}`: new tensor objects
    # over the same storages on every call (the row above saves the same objects every time).
    Target("blocking_new_vs_copy", "save_async blocking, state_dict() objects / plain copy", "ds_async_new_blocking",
           "plain_copy", "<=", 1.5),
    Target("torch_load_vs_ds", "torch.load / datastates load", "torch_load", "ds_load", ">=", 1.2),
    Target("safetensors_load_vs_ds", "safetensors load / datastates load", "safetensors_load", "ds_load", ">=", 1.2),
    Target("partial_time", "partial save time / full save time", "ds_partial_save", "ds_save", "<=", 0.35),
    Target("partial_reuse_time", "partial save, reuse_unchanged=True / full save", "ds_partial_reuse_save", "ds_save",
           "<=", 0.15),
    # Bytes of the changed tensors, not of the state: 10 % of the tensors are not 10 % of the bytes (12.1 % of
    # `transformer`'s), and every byte of a changed tensor must be written.
    Target("partial_bytes_changed", "partial save: bytes written / changed bytes", "", "", "<=", 1.0),
    Target("one_of_all", "load 1 tensor of the state / full load", "ds_load_one", "ds_load", "<=", 0.01),
)
"""The targets of issue 13 (real training states), checked when `--shape` is given."""


def targets_for(cfg: Config) -> tuple[Target, ...]:
    """The targets a run checks: issue 13's with `--shape`, the original ones otherwise."""
    return SHAPE_TARGETS if cfg.shape else TARGETS


# Informational ratios (no target): the same comparisons seen from other angles.
INFO_RATIOS = (
    ("blocking_vs_dcp_async_cached", "save_async blocking / DCP async (reused stager)", "ds_async_blocking",
     "dcp_async_cached_blocking"),
    ("async_durable_vs_sync", "save_async to durable / sync save", "ds_async_durable", "ds_save"),
    ("dcp_t1_vs_ds", "DCP save (1 thread) / datastates save", "dcp_save_t1", "ds_save"),
    ("safetensors_save_vs_ds", "safetensors save+fsync / datastates save", "safetensors_save_fsync", "ds_save"),
    ("torch_load_mmap_vs_ds", "torch.load(mmap) / datastates load", "torch_load_mmap", "ds_load"),
    ("safetensors_load_vs_ds", "safetensors load / datastates load", "safetensors_load", "ds_load"),
    ("dcp_load_vs_ds", "DCP load / datastates load", "dcp_load", "ds_load"),
    ("torch_load_vs_ds_mmap", "torch.load / datastates load(mmap=True)", "torch_load", "ds_load_mmap"),
    ("torch_load_mmap_vs_ds_mmap", "torch.load(mmap) / datastates load(mmap=True)", "torch_load_mmap",
     "ds_load_mmap"),
    ("safetensors_load_vs_ds_mmap", "safetensors load / datastates load(mmap=True)", "safetensors_load",
     "ds_load_mmap"),
)


def command_line(cfg: Config) -> str:
    """The `datastates bench` command that reproduces `cfg` (written into the report)."""
    parts = ["datastates bench"]
    if cfg.rss:
        parts.append("--rss")
    if cfg.quick:
        parts.append("--quick")
    if cfg.shape:
        parts += [f"--shape {cfg.shape}", f"--scale {cfg.scale:g}"]
        if cfg.shape in ("small", "uniform") and cfg.tensors:
            parts.append(f"--tensors {cfg.tensors}")
    else:
        parts += [f"--size {cfg.size}", f"--tensors {cfg.tensors}"]
    parts.append(f"--repeats {cfg.repeats}")
    if not cfg.rss:  # --rss has no partial save
        parts.append(f"--unchanged {cfg.unchanged:g}")
        if cfg.spread:
            parts.append("--spread")
    if cfg.reuse_unchanged:
        parts.append("--reuse-unchanged")
    if cfg.chunk_size:
        parts.append(f"--chunk-size {cfg.chunk_size}")
    if cfg.zstd:
        parts.append(f"--zstd {cfg.zstd}")
    if cfg.skip:
        parts.append(f"--skip {','.join(sorted(cfg.skip))}")
    if cfg.window is not None:
        parts.append(f"--window {cfg.window:g}")
    if cfg.device != "cpu":
        parts.append(f"--device {cfg.device}")
    return " ".join(parts)


def _device(text: str | None, skip: frozenset[str], rss: bool) -> str:
    """The `--device` value, checked: "cpu" when not given. Raises ValueError naming what to change."""
    import torch

    if text is None:
        return "cpu"
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ValueError(f"--device {text}: the bench runs on cpu or cuda (cuda:N)")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {text}: this machine has no CUDA device; leave --device out to bench on the host")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if rss:
        raise ValueError("--rss measures host memory in fresh processes; run it without --device")
    host_only = {"train", "dcp"} - skip
    if host_only:
        raise ValueError(f"--device {text}: the {' and '.join(sorted(host_only))} group(s) run on the host only; "
                         f"add --skip {','.join(sorted(skip | {'train', 'dcp'}))}")
    return str(dev)


def _check_dir(text: str | None) -> None:
    """Raise ValueError unless `--dir` names a directory or a path one can be made at (before anything runs)."""
    if text is None:
        return
    path = Path(text).expanduser()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--dir {text}: {existing} is not a directory; name a directory (made if missing)")


def _check_json_out(text: str | None) -> None:
    """Raise ValueError unless `--json-out` can be written: checked before the run, not after it (a run lasts
    minutes, and its results were lost to the error)."""
    if not text or text == "-":
        return
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"--json-out {text} is a directory; name a file, e.g. {path / 'bench.json'}")
    if not path.parent.is_dir():
        raise ValueError(f"--json-out {text}: {path.parent} is not a directory; make it first")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--json-out {text} cannot be written; name a file you may write")


def config_from_args(args: argparse.Namespace) -> Config:
    """A Config from parsed CLI arguments; raises ValueError naming a bad option (a `--dir` that is not a directory
    and a `--json-out` that cannot be written included)."""
    skip = frozenset(s.strip() for s in (args.skip or "").split(",") if s.strip())
    bad = skip - set(SKIPPABLE)
    if bad:
        raise ValueError(f"--skip {','.join(sorted(bad))}: unknown; choose from {','.join(SKIPPABLE)}")
    unchanged = args.unchanged if args.unchanged is not None else 0.9
    if not 0.0 <= unchanged <= 1.0:
        raise ValueError(f"--unchanged {unchanged} must be between 0 and 1")
    if args.tensors is not None and args.tensors < 1:
        raise ValueError("--tensors must be at least 1")
    shape = getattr(args, "shape", None)
    scale = getattr(args, "scale", None)
    if scale is not None and not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"--scale {scale} must be a positive number")
    window = getattr(args, "window", None)
    if window is not None and not (window > 0 and math.isfinite(window)):
        # 0 fell back to the default, a negative one was taken as is, nan made every window run to its 120 s cap
        raise ValueError(f"--window {window} must be a positive number of seconds")
    _check_dir(args.bench_dir)
    _check_json_out(getattr(args, "json_out", None))
    if scale is not None and shape is None:
        raise ValueError("--scale needs --shape (use --size for the default state)")
    if shape in ("transformer", "cnn") and args.tensors is not None:
        # Their tensor count is the model's: --tensors was ignored, the run saving the model's own count.
        raise ValueError(f"--tensors applies to --shape small and uniform only; --shape {shape} has the tensors of "
                         f"its model (use --scale to size it)")
    if shape is not None and args.size is not None:
        raise ValueError("--size and --shape exclude each other (use --scale to size a shape)")
    if args.zstd < 0 or args.zstd > 22:
        raise ValueError(f"--zstd {args.zstd} must be 0 (off) or a zstd level 1..22")
    if args.chunk_size is not None and (args.chunk_size % 64 or args.chunk_size > MAX_CHUNK_SIZE):
        raise ValueError(f"--chunk-size {args.chunk_size} must be a multiple of 64 bytes up to 1 GiB")
    quick = bool(args.quick)
    rss = bool(getattr(args, "rss", False))
    if rss:
        # Each was ignored, yet written into the report's command line as if it had applied (--skip torch still
        # measured torch.save and torch.load).
        given = [name for name, value in (("--skip", bool(skip)), ("--unchanged", args.unchanged is not None),
                                          ("--spread", getattr(args, "spread", False)),
                                          ("--reuse-unchanged", args.reuse_unchanged),
                                          ("--window", getattr(args, "window", None) is not None)) if value]
        if given:
            raise ValueError(f"--rss measures its fixed set of saves and loads (each in a fresh process), no partial "
                             f"save and no training: leave out {' '.join(given)}")
    # --rss: each repeat is a fresh process per method; three give a median that one outlier cannot move.
    repeats = args.repeats if args.repeats is not None else (3 if rss else 2 if quick else 5)
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if shape is not None:
        scale = scale if scale is not None else (1 / 16 if quick else 1.0)
    device = _device(getattr(args, "device", None), skip, rss)
    return Config(device=device, size=args.size or ((64 << 20) if quick else (1 << 30)),
                  tensors=args.tensors if args.tensors is not None else (0 if shape else 32), repeats=repeats,
                  shape=shape, scale=scale if scale is not None else 1.0, rss=rss,
                  unchanged=unchanged, spread=bool(getattr(args, "spread", False)),
                  bench_dir=args.bench_dir, quick=quick, skip=skip,
                  chunk_size=args.chunk_size, zstd=args.zstd, reuse_unchanged=args.reuse_unchanged,
                  window=args.window if args.window is not None else (1.0 if quick else None))


