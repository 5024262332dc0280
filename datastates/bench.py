"""`datastates bench`: one state saved and loaded by datastates, torch.save, safetensors and DCP.

    datastates bench                          # 1 GiB state, 32 tensors, 5 repeats, every method
    datastates bench --quick --skip dcp       # 64 MiB, 2 repeats (what the tests run)
    datastates bench --json-out bench.json    # also write every sample as JSON ("-" = stdout)

What a run guarantees:
- every method sees the same state, allocated once and mutated in place (`add_(1)`) before every
  full save, so no method (datastates' dedup in particular) can skip bytes that a training step
  would have changed; the report checks that each datastates full save wrote every chunk anew;
- methods are interleaved inside each repeat and every timed step follows the same warm-up (garbage
  collection, a copy of the state into a scratch copy, and a touch of the method's own reusable
  buffers), so drift of the machine hits every method alike; medians are reported;
- loads start cold: the files' pages are dropped from the page cache (posix_fadvise) first, and end
  with one read per page of the result, so lazy (mmap) loaders pay for their reads too;
- each load's result is checked bit-exact against the saved state once (a fast wrong answer is no result);
- every file lives in one fresh directory (under `--store`, default the current directory), removed
  at the end; other methods' files are deleted right after they are timed;
- the CPU time other processes used during each timed step is measured and reported, since a busy
  machine makes the figures noisy;
- each ratio is printed with its target and PASS/MISS; a missed target is reported, never hidden.

This module's top level imports only the standard library: the CLI imports it at every start.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import torch

    from .store import Store
    from .versions import Version

SKIPPABLE = ("torch", "safetensors", "dcp", "train")
"""Groups `--skip` accepts. datastates itself and the plain copy (the floor) always run."""

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}

METHOD_LABELS: dict[str, str] = {
    "plain_copy": "plain copy into reused buffers (floor)",
    "ds_save": "datastates save (sync, durable)",
    "ds_async_blocking": "datastates save_async: blocking part",
    "ds_async_durable": "datastates save_async: to durable",
    "ds_partial_save": "datastates save, {changed} of tensors changed",
    "ds_load": "datastates load (full)",
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
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
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
    p.add_argument("--tensors", type=int, default=32, help="number of tensors in the state (default 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 5)")
    p.add_argument("--unchanged", type=float, default=0.9,
                   help="fraction of tensors left unchanged for the partial save (default 0.9)")
    # dest differs from the global --store (which defaults to $DATASTATES_STORE): the bench must never
    # write into, or delete from, a user's real store.
    p.add_argument("--store", dest="bench_dir", default=None, metavar="DIR",
                   help="directory for every file of the run (a fresh subdirectory is made there and removed); "
                        "default: the current directory. Avoid tmpfs: it measures memory, not a disk")
    p.add_argument("--quick", action="store_true", help="64MiB, 2 repeats, 1 s training windows (for tests)")
    p.add_argument("--json-out", default=None, metavar="PATH", help="write the results as JSON ('-' = stdout)")
    p.add_argument("--skip", default="", help=f"comma-separated groups to leave out: {','.join(SKIPPABLE)}")
    p.add_argument("--chunk-size", type=_size_arg, default=None,
                   help="datastates chunk size, e.g. 1MiB, 4MiB, 16MiB (default: the store default, 16MiB)")
    p.add_argument("--zstd", type=int, default=0, metavar="LEVEL", help="datastates zstd level (default 0 = off)")
    p.add_argument("--reuse-unchanged", action="store_true",
                   help="open the store with reuse_unchanged=True (skip tensors torch's version counter says are "
                        "untouched since the last save)")
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
    bench_dir: str | None = None
    quick: bool = False
    skip: frozenset[str] = frozenset()
    chunk_size: int | None = None
    zstd: int = 0
    reuse_unchanged: bool = False
    window: float | None = None


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
)


# --- helpers -----------------------------------------------------------------------------------------------


def _fs_type(path: Path) -> str:
    """The file system type holding `path` (from /proc/mounts; 'unknown' elsewhere)."""
    best, kind = "", "unknown"
    try:
        real = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _mem_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class CpuMeter:
    """The share of the machine's CPU time used by *other* processes over an interval (0..1).

    Machine busy time comes from /proc/stat, ours from getrusage; where /proc/stat is missing the
    share reads 0 (unknown), never a made-up figure.
    """

    def __init__(self) -> None:
        self.ncpu = os.cpu_count() or 1
        try:
            self.tick = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError):
            self.tick = 100.0

    def _busy(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        guest = sum(fields[8:10]) if len(fields) > 9 else 0.0  # already counted in user/nice
        return (sum(fields) - idle - guest) / self.tick

    @staticmethod
    def _own() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    def snap(self) -> tuple[float, float | None, float]:
        return time.perf_counter(), self._busy(), self._own()

    def others(self, a: tuple[float, float | None, float]) -> float:
        """Others' share of all CPUs since snapshot `a`."""
        b = self.snap()
        wall = b[0] - a[0]
        if a[1] is None or b[1] is None or wall <= 0:
            return 0.0
        # /proc/stat ticks at 1/CLK_TCK, so very short intervals read as 0 or one tick: clamp to [0, 1].
        return min(1.0, max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (wall * self.ncpu)))


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_cache(paths: Iterable[Path]) -> None:
    """Evict the files' clean pages so the next read comes from the disk (cold loads for every method)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for p in paths:
        files = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()] if p.is_dir() else []
        for q in files:
            try:
                fd = os.open(q, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def make_state(total: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`n` random fp32 tensors of about `total` bytes together (each a multiple of 64 bytes).

    Random fp32 is the honest case for a checkpoint store: it neither compresses nor dedups by itself.
    """
    import torch

    per = max(16, (total // n) // 64 * 16)  # fp32 elements, a multiple of 16 (64 bytes)
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i:03d}.weight": torch.randn(per, generator=g) for i in range(n)}


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _mutate(state: dict[str, torch.Tensor], keys: Iterable[str] | None = None) -> None:
    # add_(1) never returns a tensor to earlier bytes, so every save of the mutated tensors is all new data.
    for k in keys if keys is not None else list(state):
        state[k].add_(1.0)


def _touch_pages(state: Any) -> None:
    """Read one byte per 4 KiB page of every tensor in `state` (a dict): lazy mmap loads become resident."""
    import torch

    for t in state.values():
        if isinstance(t, torch.Tensor) and t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def _load_and_touch(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    out = fn(*args, **kw)
    _touch_pages(out)
    return out


def _check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Raise RuntimeError unless `got` holds exactly `want`'s keys and bytes."""
    import torch

    if set(got) != set(want) or not all(torch.equal(got[k], want[k]) for k in want):
        raise RuntimeError(f"{what} returned a state different from the one saved; the benchmark is invalid")


class Warmup:
    """The same untimed step before every timed one.

    Garbage is collected, the state is copied into a scratch copy that stays allocated, and the timed
    method's own reusable buffers (if it has any) are written once. Buffers left idle can be slow to
    touch again on VMs that reclaim guest memory, and each method deserves its buffers in the state its
    steady use would leave them in. No new pages are touched here: those cost ~10x more on such VMs.
    """

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        import torch

        self.state = state
        self.scratch = {k: torch.empty_like(v) for k, v in state.items()}
        self()

    def __call__(self, buffers: Iterable[Any] = ()) -> None:
        gc.collect()
        for k, v in self.state.items():
            self.scratch[k].copy_(v)
        for b in buffers:
            b.fill_(0)


# --- the other methods -------------------------------------------------------------------------------------


def _torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(path.parent)  # datastates fsyncs its directories too: the same durability for both


def _safetensors_save(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(state, str(path))
    _fsync_path(path)
    _fsync_path(path.parent)


class Dcp:
    """torch.distributed.checkpoint in one process without a process group (`no_dist=True`)."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # DCP's best fair chance on CPU, like datastates' warm buffer pool: one stager reused across saves
        # caches its staging storages, so copies land in buffers allocated once. (The writer's own
        # cache_staged_state_dict option pins memory, which needs CUDA.)
        self.cached_stager: Any = DefaultStager(StagingOptions(False, False, False, False))

    @staticmethod
    def save(state: dict[str, torch.Tensor], path: Path, threads: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads), no_dist=True)

    def async_save(self, state: dict[str, torch.Tensor], path: Path, cached: bool) -> Any:
        """Start a save; return DCP's Future. Without `cached`, this is the plain documented call."""
        import torch.distributed.checkpoint as dcp

        # thread_count=2: DCP's faster writer setting, as in the durable comparison.
        return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2),
                              no_dist=True, async_stager=self.cached_stager if cached else None)

    @staticmethod
    def load(like: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
        import torch
        import torch.distributed.checkpoint as dcp

        # DCP loads in place; allocating the destination is timed too, as every other load allocates its output.
        out = {k: torch.empty_like(v) for k, v in like.items()}
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        return out

    def buffers(self) -> list[Any]:
        """The reused stager's cached storages (empty if this torch keeps them elsewhere)."""
        inner = getattr(self.cached_stager, "_state_dict_stager", None)
        cache = getattr(inner, "_cached_storage_mapping", None)
        try:
            return list(cache.values()) if cache is not None else []
        except Exception:
            return []

    def close(self) -> None:
        if self.cached_stager is not None:
            self.cached_stager.close()
            self.cached_stager = None


# --- training interference ---------------------------------------------------------------------------------


class Trainer:
    """A small CPU MLP (SGD with momentum) whose step takes ~10-30 ms; the batch is sized by measuring."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        self.batch, self.width = 128, 1024
        while True:
            model = torch.nn.Sequential(torch.nn.Linear(512, self.width), torch.nn.ReLU(),
                                        torch.nn.Linear(self.width, self.width), torch.nn.ReLU(),
                                        torch.nn.Linear(self.width, 10))
            self.model, self.opt = model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            self.x, self.y = torch.randn(self.batch, 512), torch.randint(0, 10, (self.batch,))
            for _ in range(3):
                self.step()
            t0 = time.perf_counter()
            for _ in range(10):
                self.step()
            self.step_s = (time.perf_counter() - t0) / 10
            if self.step_s < 0.010 and self.batch < 4096:
                self.batch *= 2
            elif self.step_s > 0.030 and self.batch > 16:
                self.batch //= 2
            else:
                return

    def step(self) -> None:
        import torch

        self.opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def window(self, min_s: float, start: Callable[[], Any] | None = None,
               done: Callable[[Any], bool] | None = None, max_s: float = 120.0) -> tuple[int, float, Any]:
        """Train for at least `min_s` and until `done(start())` holds; return (steps, seconds, start's result).

        `start` (a background save) is called at the window's start, so its blocking part is inside.
        """
        for _ in range(3):
            self.step()  # back to steady state after the untimed work between windows
        t0 = time.perf_counter()
        token = start() if start is not None else None
        steps = 0
        while True:
            elapsed = time.perf_counter() - t0
            if (elapsed >= min_s and (done is None or done(token))) or elapsed >= max_s:
                return steps, elapsed, token
            self.step()
            steps += 1


def _result(token: Any) -> Any:
    """Wait for a background save (a datastates SaveHandle or a DCP Future); return its result."""
    return token.result()


def _is_done(token: Any) -> bool:
    """Whether a background save (a datastates SaveHandle or a DCP Future) has finished; True for none."""
    return token is None or bool(token.done())


# --- the run -------------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cfg: Config) -> dict[str, Any]:
    """Run the benchmark; return the JSON-ready report. Every file it writes is removed before it returns.

    Raises SystemExit (with a message) when the directory lacks the disk space the run needs.
    """
    parent = Path(cfg.bench_dir or os.getcwd()).expanduser()
    parent.mkdir(parents=True, exist_ok=True)
    fs = _fs_type(parent)
    if fs in ("tmpfs", "ramfs"):
        _log(f"WARNING: {parent} is on {fs}: writes measure memory, not a disk; pass --store on a real disk")
    # The datastates store keeps every version until the end: ~2.1 states per repeat plus the first ones.
    need = cfg.size * (2 * cfg.repeats + 5)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise SystemExit(f"datastates bench: {parent} has {free / 2**30:.1f} GiB free; this run needs about "
                         f"{need / 2**30:.1f} GiB (lower --size or --repeats, or pick another --store)")
    root = Path(tempfile.mkdtemp(prefix=".datastates-bench-", dir=parent))
    res = Results()
    t_start = time.time()
    try:
        with warnings.catch_warnings():
            # DCP warns at every call that it runs without a process group, partly from its own threads.
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            _Bench(cfg, root, res, fs).run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _report(cfg, res, fs, parent, t_start)


class _Bench:
    """One run: the states, the store, the warm-up, and one method per group of measured steps."""

    def __init__(self, cfg: Config, root: Path, res: Results, fs: str) -> None:
        import torch

        self.cfg, self.root, self.res = cfg, root, res
        _log(f"state: {cfg.size / 2**20:.0f} MiB in {cfg.tensors} fp32 tensors; {cfg.repeats} repeats; "
             f"files in {root} ({fs})")
        self.state = make_state(cfg.size, cfg.tensors, seed=0)
        self.state100 = make_state(cfg.size, 100, seed=1)
        self.size, self.size100 = _nbytes(self.state), _nbytes(self.state100)
        res.extra["bytes"] = self.size
        self.keys = list(self.state)
        self.n_changed = max(1, round(len(self.keys) * (1 - cfg.unchanged))) if cfg.unchanged < 1 else 0
        self.cpu = CpuMeter()
        self.warm = Warmup(self.state)
        self.copy_bufs = {k: torch.empty_like(v) for k, v in self.state.items()}
        self.plain_copy()  # first use touches new pages: untimed
        self.full_saves: list[dict[str, float]] = []
        self.partial: list[dict[str, int]] = []

    # timing ----------------------------------------------------------------------------------------------
    def plain_copy(self) -> None:
        for k, v in self.state.items():
            self.copy_bufs[k].copy_(v)

    def timed(self, key: str, nbytes: int, buffers: Sequence[Any], fn: Callable[..., Any], *args: Any,
              **kw: Any) -> Any:
        """Warm up (touching `buffers`), then time `fn(*args, **kw)` as one sample of `key`; return its result."""
        self.warm(buffers)
        snap = self.cpu.snap()
        out = fn(*args, **kw)
        self.res.add(key, time.perf_counter() - snap[0], nbytes, self.cpu.others(snap))
        return out

    def timed_load(self, key: str, nbytes: int, files: Path, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A cold load: drop `files` from the page cache, then time the load plus one read per page of its result."""
        _drop_cache([files])
        return self.timed(key, nbytes, (), _load_and_touch, fn, *args, **kw)

    def timed_async(self, blocking_key: str, end_key: str, buffers: Sequence[Any], start: Callable[[], Any],
                    wait: Callable[[Any], Any]) -> Any:
        """Warm up, then time `start()` as `blocking_key` and through `wait(token)` as `end_key`; return the
        result of `wait`."""
        self.warm(buffers)
        snap = self.cpu.snap()
        token = start()
        t1 = time.perf_counter()
        out = wait(token)
        t2 = time.perf_counter()
        others = self.cpu.others(snap)
        self.res.add(blocking_key, t1 - snap[0], self.size, others)
        self.res.add(end_key, t2 - snap[0], self.size, others)
        return out

    # the run ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        from .store import Store

        cfg = self.cfg
        store = Store.open(self.root / "ds", pool_bytes=2 * self.size, chunk_size=cfg.chunk_size,
                           zstd_level=cfg.zstd, reuse_unchanged=cfg.reuse_unchanged)
        dcp = Dcp() if "dcp" not in cfg.skip else None
        try:
            _log("warming the datastates buffer pool (one untimed save) and saving the 100-tensor state")
            store.save(self.state, branch="main", message="warm-up")
            v100 = store.save(self.state100, branch="bench100", message="100 tensors")
            if dcp is not None:
                _mutate(self.state)
                dcp.async_save(self.state, self.root / "dcp-warm", cached=True).result()  # first staging allocates
                _remove(self.root / "dcp-warm")
            for r in range(cfg.repeats):
                _log(f"repeat {r + 1}/{cfg.repeats}")
                self.timed("plain_copy", self.size, list(self.copy_bufs.values()), self.plain_copy)
                self.datastates(store, r)
                self.load100(store, v100, r)
                if "torch" not in cfg.skip:
                    self.torch_save_load(r)
                if "safetensors" not in cfg.skip:
                    self.safetensors_save_load(r)
                if dcp is not None:
                    self.dcp(dcp, r)
            self.res.extra["full_saves"] = self.full_saves
            self.res.extra["partial"] = self.partial
            if "train" not in cfg.skip:
                self.res.extra["training"] = self.training(store, dcp)
        finally:
            if dcp is not None:
                dcp.close()
            store.close()

    def _pool(self, store: Store) -> list[Any]:
        # The free slots of datastates' buffer pool: its reusable buffers, touched by the warm-up like
        # every method's own. (A private attribute: the bench reads it, never changes the pool.)
        return list(getattr(store.pool, "_free", []))

    def _full_save(self, v: Version, store: Store) -> None:
        from .chunks import spans

        chunks = sum(len(spans(t.numel() * t.element_size(), store.chunk_size)) for t in self.state.values())
        self.full_saves.append({"chunks_new": v.chunks_new, "chunks": chunks, "bytes_new": v.bytes_new,
                                "bytes_total": v.bytes_total, **{f"t_{k}": float(x) for k, x in v.timings.items()}})

    def datastates(self, store: Store, r: int) -> None:
        """Full sync save, full async save, partial save, then a cold full load of the latest version."""
        state, size = self.state, self.size
        _mutate(state)
        v = self.timed("ds_save", size, self._pool(store), store.save, state, branch="main")
        self._full_save(v, store)
        _mutate(state)
        v = self.timed_async("ds_async_blocking", "ds_async_durable", self._pool(store),
                             partial(store.save_async, state, branch="main"), _result)
        self._full_save(v, store)
        # A different set of tensors changes each repeat, as different layers would in training.
        changed = [self.keys[(r * self.n_changed + i) % len(self.keys)] for i in range(self.n_changed)]
        _mutate(state, changed)
        v = self.timed("ds_partial_save", size, self._pool(store), store.save, state, branch="main",
                       message="partial")
        self.partial.append({"bytes_new": v.bytes_new, "bytes_total": v.bytes_total,
                             "tensors_changed": self.n_changed, "chunks_new": v.chunks_new})
        # The latest version, what a restart loads: most of its chunks sit in earlier packs.
        out = self.timed_load("ds_load", size, self.root / "ds", store.load, v)
        if r == 0:
            _check_equal(out, state, "datastates load")

    def load100(self, store: Store, v100: Version, r: int) -> None:
        """Cold full load of the 100-tensor state, then of one of its tensors (a different one each repeat)."""
        self.timed_load("ds_load100_full", self.size100, self.root / "ds", store.load, v100)
        one = list(self.state100)[(r * 37) % 100]
        out = self.timed_load("ds_load100_one", self.state100[one].numel() * 4, self.root / "ds", store.load, v100,
                              keys=[one])
        if r == 0:
            _check_equal(out, {one: self.state100[one]}, "datastates partial load")

    def torch_save_load(self, r: int) -> None:
        import torch

        path = self.root / "state.pt"
        _mutate(self.state)
        self.timed("torch_save_fsync", self.size, (), _torch_save, self.state, path)
        out = self.timed_load("torch_load", self.size, path, torch.load, path, weights_only=True)
        if r == 0:
            _check_equal(out, self.state, "torch.load")
        del out
        self.timed_load("torch_load_mmap", self.size, path, torch.load, path, weights_only=True, mmap=True)
        _remove(path)

    def safetensors_save_load(self, r: int) -> None:
        from safetensors.torch import load_file

        path = self.root / "state.safetensors"
        _mutate(self.state)
        self.timed("safetensors_save_fsync", self.size, (), _safetensors_save, self.state, path)
        out = self.timed_load("safetensors_load", self.size, path, load_file, str(path))
        if r == 0:
            _check_equal(out, self.state, "safetensors load_file")
        del out
        _remove(path)

    def dcp(self, dcp: Dcp, r: int) -> None:
        path = self.root / "dcp"
        for threads in (1, 2):
            _mutate(self.state)
            self.timed(f"dcp_save_t{threads}", self.size, (), dcp.save, self.state, path, threads)
            if threads == 1:
                _remove(path)
        out = self.timed_load("dcp_load", self.size, path, dcp.load, self.state, path)
        if r == 0:
            _check_equal(out, self.state, "DCP load")
        del out
        _remove(path)
        for cached in (False, True):
            name = "dcp_async_cached" if cached else "dcp_async"
            _mutate(self.state)
            self.timed_async(f"{name}_blocking", f"{name}_done", dcp.buffers() if cached else [],
                             partial(dcp.async_save, self.state, path, cached), _result)
            _remove(path)

    # training interference ---------------------------------------------------------------------------------
    def training(self, store: Store, dcp: Dcp | None) -> dict[str, Any]:
        """Steps a training loop loses while one background save runs, against a window without a save.

        Each window lasts at least the minimum and until its save is complete; steps lost =
        (steps per second in the same repeat's baseline window) x (window seconds) - steps done.
        """
        cfg, state = self.cfg, self.state
        trainer = Trainer()
        slowest = max((m for m in (self.res.median("ds_async_durable"), self.res.median("dcp_async_done")) if m),
                      default=1.0)
        min_s = cfg.window or max(1.0, slowest)
        _log(f"training interference: step {trainer.step_s * 1e3:.1f} ms (batch {trainer.batch}), windows of "
             f">= {min_s:.1f} s")
        names = ["datastates"] + (["dcp"] if dcp is not None else [])
        windows: dict[str, list[dict[str, float]]] = {n: [] for n in ["baseline", *names]}
        lost: dict[str, list[float]] = {n: [] for n in names}
        for r in range(cfg.repeats):
            _log(f"training repeat {r + 1}/{cfg.repeats}")
            for name in ["baseline", *names]:
                path = self.root / "dcp-train"
                start: Callable[[], Any] | None = None
                if name == "datastates":
                    start = partial(store.save_async, state, branch="main", message="train")
                elif name == "dcp" and dcp is not None:
                    start = partial(dcp.async_save, state, path, False)
                if start is not None:
                    _mutate(state)
                gc.collect()
                snap = self.cpu.snap()
                steps, secs, token = trainer.window(min_s, start, _is_done)
                others = self.cpu.others(snap)
                complete = _is_done(token)  # False only if the save outlasted the window's 120 s cap
                if token is not None:
                    token.result()
                _remove(path)
                windows[name].append({"steps": steps, "seconds": secs, "others_cpu": others, "complete": complete})
            base = windows["baseline"][-1]
            rate = base["steps"] / base["seconds"]
            for name in names:
                w = windows[name][-1]
                lost[name].append(rate * w["seconds"] - w["steps"])
        return {"step_ms": trainer.step_s * 1e3, "batch": trainer.batch, "width": trainer.width,
                "min_window_s": min_s, "windows": windows, "steps_lost_samples": lost,
                "steps_lost": {n: statistics.median(v) for n, v in lost.items()}}


# --- the report ----------------------------------------------------------------------------------------------


def _ratio_value(t: Target, res: Results) -> tuple[float | None, str]:
    if t.key == "partial_bytes":
        parts = res.extra.get("partial") or []
        vals = [p["bytes_new"] / p["bytes_total"] for p in parts if p["bytes_total"]]
        return (statistics.median(vals), "") if vals else (None, "not measured")
    if t.key == "train_lost_vs_dcp":
        lost = (res.extra.get("training") or {}).get("steps_lost", {})
        if "datastates" not in lost or "dcp" not in lost:
            return None, "skipped"
        if lost["dcp"] <= 0:
            return None, f"DCP lost {lost['dcp']:.1f} steps: no interference measured, ratio undefined"
        return max(lost["datastates"], 0.0) / lost["dcp"], ""
    num, den = res.median(t.num), res.median(t.den)
    if num is None or den is None or den <= 0:
        return None, "skipped"
    return num / den, ""


def _report(cfg: Config, res: Results, fs: str, parent: Path, t_start: float) -> dict[str, Any]:
    import torch

    methods = {}
    for key in METHOD_LABELS:
        s = res.samples.get(key)
        if s:
            med = statistics.median(s)
            methods[key] = {"median_s": med, "gb_per_s": res.nbytes[key] / med / 1e9 if med > 0 else None,
                            "bytes": res.nbytes[key], "samples_s": s,
                            "others_cpu_median": statistics.median(res.others[key])}
    ratios: dict[str, Any] = {}
    for t in TARGETS:
        value, note = _ratio_value(t, res)
        ok = None if value is None else (value <= t.target if t.op == "<=" else value >= t.target)
        ratios[t.key] = {"label": t.label, "value": value, "op": t.op, "target": t.target, "pass": ok,
                         "note": note}
    info = {}
    for key, label, num, den in INFO_RATIOS:
        a, b = res.median(num), res.median(den)
        info[key] = {"label": label, "value": a / b if a is not None and b else None}
    full = res.extra.get("full_saves") or []
    all_others = [x for v in res.others.values() for x in v]
    return {
        "command": command_line(cfg),
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
        "duration_s": time.time() - t_start,
        "machine": {"cpus": os.cpu_count(), "mem_bytes": _mem_total(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": torch.__version__, "fs_type": fs,
                    "dir": str(parent)},
        "config": {"size": cfg.size, "bytes": res.extra.get("bytes"), "tensors": cfg.tensors,
                   "repeats": cfg.repeats, "unchanged": cfg.unchanged, "quick": cfg.quick,
                   "skip": sorted(cfg.skip), "chunk_size": cfg.chunk_size, "zstd": cfg.zstd,
                   "reuse_unchanged": cfg.reuse_unchanged},
        "methods": methods,
        "ratios": ratios,
        "info_ratios": info,
        "partial": res.extra.get("partial"),
        # Each datastates full save must write every chunk anew; below 1.0, dedup flattered the full saves.
        "full_save_new_chunks_min": min((f["chunks_new"] / f["chunks"] for f in full), default=None),
        "full_save_stored_over_raw": statistics.median(f["bytes_new"] / f["bytes_total"] for f in full)
        if full else None,
        "full_saves": full,
        "others_cpu_median": statistics.median(all_others) if all_others else None,
        "training": res.extra.get("training"),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict[str, Any], out: TextIO) -> None:
    """The human-readable table: methods (median s, GB/s), then each ratio with its target and PASS/MISS."""
    cfg = rep["config"]
    w = 46
    print(f"\ndatastates bench: {cfg['bytes'] / 2**20:.0f} MiB in {cfg['tensors']} fp32 tensors, "
          f"{cfg['repeats']} repeats, chunk {cfg['chunk_size'] or 'default'}, zstd {cfg['zstd']}, "
          f"{rep['machine']['cpus']} CPUs, {rep['machine']['fs_type']}", file=out)
    print(f"\n{'method':<{w}} {'median s':>9} {'GB/s':>7} {'others':>6}  samples (s)", file=out)
    for key, m in rep["methods"].items():
        label = METHOD_LABELS[key].format(changed=f"{1 - cfg['unchanged']:.0%}")
        samples = " ".join(f"{s:.3f}" for s in m["samples_s"])
        print(f"{label:<{w}} {m['median_s']:>9.4f} {_fmt(m['gb_per_s'], '.2f'):>7} "
              f"{m['others_cpu_median']:>6.0%}  {samples}", file=out)
    print("(others: median share of the machine's CPU used by other processes during the timed step)", file=out)
    stored = rep.get("full_save_stored_over_raw")
    if cfg["zstd"] and stored is not None:
        print(f"zstd level {cfg['zstd']}: full saves stored {stored:.3f} of their raw bytes", file=out)
    tr = rep.get("training")
    if tr:
        steps = {k: [int(w["steps"]) for w in v] for k, v in tr["windows"].items()}
        print(f"\ntraining interference: step {tr['step_ms']:.1f} ms (batch {tr['batch']}), windows >= "
              f"{tr['min_window_s']:.1f} s, steps per window {steps}", file=out)
        for k, v in tr["steps_lost"].items():
            late = sum(1 for w in tr["windows"][k] if not w["complete"])
            print(f"  steps lost during one {k} save: {v:.1f}  (samples "
                  f"{', '.join(f'{x:.0f}' for x in tr['steps_lost_samples'][k])})"
                  + (f"  WARNING: {late} save(s) outlasted the window; steps lost undercounted" if late else ""),
                  file=out)
    print(f"\n{'ratio':<{w + 8}} {'value':>7} {'target':>9}  result", file=out)
    missed = []
    for r in rep["ratios"].values():
        verdict = "n/a" if r["pass"] is None else "PASS" if r["pass"] else "MISS"
        if r["pass"] is False:
            missed.append(r["label"])
        note = f"  ({r['note']})" if r["note"] else ""
        print(f"{r['label']:<{w + 8}} {_fmt(r['value'], '7.3f'):>7} {r['op'] + ' ' + format(r['target'], 'g'):>9}  "
              f"{verdict}{note}", file=out)
    for r in rep["info_ratios"].values():
        if r["value"] is not None:
            print(f"{r['label']:<{w + 8}} {r['value']:>7.3f} {'(info)':>9}", file=out)
    frac = rep.get("full_save_new_chunks_min")
    if frac is not None and frac < 1.0:
        print(f"WARNING: a datastates full save wrote only {frac:.1%} of its chunks anew: dedup helped it, so the "
              "full-save figures are optimistic", file=out)
    busy = rep.get("others_cpu_median")
    if busy is not None and busy > 0.05:
        print(f"WARNING: other processes used {busy:.0%} of the CPUs (median) during the timed steps; "
              "the figures are noisier than on a quiet machine", file=out)
    checked = sum(1 for r in rep["ratios"].values() if r["pass"] is not None)
    if missed:
        print(f"\nMISSED {len(missed)} of {checked} targets: " + "; ".join(missed), file=out)
    else:
        print(f"\nall {checked} measured targets met", file=out)


def command_line(cfg: Config) -> str:
    """The `datastates bench` command that reproduces `cfg` (written into the report)."""
    parts = ["datastates bench"]
    if cfg.quick:
        parts.append("--quick")
    parts += [f"--size {cfg.size}", f"--tensors {cfg.tensors}", f"--repeats {cfg.repeats}",
              f"--unchanged {cfg.unchanged:g}"]
    if cfg.chunk_size:
        parts.append(f"--chunk-size {cfg.chunk_size}")
    if cfg.zstd:
        parts.append(f"--zstd {cfg.zstd}")
    if cfg.skip:
        parts.append(f"--skip {','.join(sorted(cfg.skip))}")
    if cfg.window is not None:
        parts.append(f"--window {cfg.window:g}")
    return " ".join(parts)


def config_from_args(args: argparse.Namespace) -> Config:
    """A Config from parsed CLI arguments; raises ValueError naming a bad option."""
    skip = frozenset(s.strip() for s in (args.skip or "").split(",") if s.strip())
    bad = skip - set(SKIPPABLE)
    if bad:
        raise ValueError(f"--skip {','.join(sorted(bad))}: unknown; choose from {','.join(SKIPPABLE)}")
    if not 0.0 <= args.unchanged <= 1.0:
        raise ValueError(f"--unchanged {args.unchanged} must be between 0 and 1")
    if args.tensors < 1:
        raise ValueError("--tensors must be at least 1")
    if args.zstd < 0 or args.zstd > 22:
        raise ValueError(f"--zstd {args.zstd} must be 0 (off) or a zstd level 1..22")
    if args.chunk_size is not None and args.chunk_size % 64:
        raise ValueError(f"--chunk-size {args.chunk_size} must be a multiple of 64 bytes")
    quick = bool(args.quick)
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    if repeats < 1:
        raise ValueError("--repeats must be at least 1")
    return Config(size=args.size or ((64 << 20) if quick else (1 << 30)), tensors=args.tensors, repeats=repeats,
                  unchanged=args.unchanged, bench_dir=args.bench_dir, quick=quick, skip=skip,
                  chunk_size=args.chunk_size, zstd=args.zstd, reuse_unchanged=args.reuse_unchanged,
                  window=args.window if args.window is not None else (1.0 if quick else None))


def main(args: argparse.Namespace) -> int:
    """Run `datastates bench`; 0 when it ran (missed targets included: they are results), 2 for bad options."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"datastates bench: {exc}", file=sys.stderr)
        return 2
    rep = run(cfg)
    # With the JSON on stdout, the table goes to stderr so stdout stays parseable.
    print_report(rep, sys.stderr if args.json_out == "-" else sys.stdout)
    if args.json_out:
        text = json.dumps(rep, indent=2)
        if args.json_out == "-":
            print(text)
        else:
            Path(args.json_out).write_text(text + "\n")
    return 0
