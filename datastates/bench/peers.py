"""What the bench measures around datastates: the peers (torch.save, safetensors, DCP), a training
loop for interference, the state it saves, and the helpers that keep the timing fair."""


from __future__ import annotations

import ctypes
import gc
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .options import Config
from .shapes import approx_bytes

if TYPE_CHECKING:
    import torch




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


def fresh_dir(cfg: Config, states: float, prefix: str, log: Callable[[str], None]) -> tuple[Path, str, Path]:
    """The run's parent directory (`--dir`, default the current one), its file system type, and a fresh
    directory made under it for every file of the run (the caller removes it).

    Raises SystemExit (with a message) when the parent has less free space than `states` states.
    """
    parent = Path(cfg.bench_dir or os.getcwd()).expanduser()
    parent.mkdir(parents=True, exist_ok=True)
    fs = _fs_type(parent)
    if fs in ("tmpfs", "ramfs"):
        log(f"WARNING: {parent} is on {fs}: writes measure memory, not a disk; pass --dir on a real disk")
    size = approx_bytes(cfg.shape, cfg.scale, cfg.tensors or None) if cfg.shape else cfg.size
    need = int(size * states)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise SystemExit(f"datastates bench: {parent} has {free / 2**30:.1f} GiB free; this run needs about "
                         f"{need / 2**30:.1f} GiB (lower --size, --scale or --repeats, or pick another --dir)")
    return parent, fs, Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


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


def _files(paths: Iterable[Path]) -> list[Path]:
    """The regular files among `paths` and under those that are directories; paths that do not exist give none."""
    return [q for p in paths for q in ([p] if p.is_file() else p.rglob("*") if p.is_dir() else []) if q.is_file()]


def _drop_cache(paths: Iterable[Path]) -> None:
    """Evict the files' clean pages so the next read comes from the disk (cold loads for every method)."""
    if not hasattr(os, "posix_fadvise"):
        return
    for q in _files(paths):
        try:
            fd = os.open(q, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_start(paths: Iterable[Path], budget: int | None = None) -> int:
    """Before a timed cold load: read `paths` once (untimed; newest files first, at most about `budget` bytes
    when given: what the load will read, not every older version of a store), then drop every file of them from
    the page cache, so that every loader starts alike: its files read before and just dropped, their pages
    freed right before it fills as many.

    Why: on a VM that hands freed memory back to its host, a page touched for the first time since costs ~10x
    more, and dropping a file's cached pages frees pages in use. A file written through the page cache
    (torch.save, safetensors) was still cached when its load dropped it, and so handed its loader a state's worth
    of such pages; our packs, written with O_DIRECT, were not, and handed ours none: the first load of a freshly
    saved 1 GiB store took 2.5-2.8 s, the next ones 0.51-0.61 s (docs/perf-notes.md "Cold loads and the pages
    they fill"). Then as many bytes of anonymous memory are touched and freed, for the load's result. Returns the
    bytes read; paths that do not exist are left out."""
    files = _files(paths)
    done = 0
    for q in sorted(files, key=lambda f: f.stat().st_mtime_ns, reverse=True):
        if budget is not None and done >= budget:
            break
        with open(q, "rb", buffering=0) as f:
            while (budget is None or done < budget) and (n := len(f.read(8 << 20))):
                done += n
    _drop_cache(files)
    # And as many anonymous pages in use as the load's result will take: a process before that freed a state's
    # worth (torch.load's, safetensors') handed them to the next load, one that mapped its state (a mapped load)
    # did not (a full load after a mapped one: 1.17-1.27 s against 0.54-0.56 s with this touch).
    if done:
        import numpy as np

        np.ones(done, dtype=np.uint8)  # freed (unmapped) at once
    return done


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
    # add_(1) never returns a tensor to earlier bytes, so every save of the mutated tensors is all new data
    # (integer tensors too: BatchNorm's num_batches_tracked).
    for k in keys if keys is not None else list(state):
        t = state[k]
        t.add_(1.0 if t.is_floating_point() or t.is_complex() else 1)


_PAGE = 4096
_FEW_PAGES = 8 * _PAGE


def new_objects(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as `model.state_dict()` gives a module's tensors: new tensor objects over the same storages."""
    return {k: t.detach() for k, t in state.items()}


def _touch_pages(state: Any) -> None:
    """Read one byte per 4 KiB page of every tensor in `state` (a dict), and its last byte: lazy mmap loads
    become resident; wait for the GPU when a tensor is on one (its copies are then complete). Part of every
    timed load, so it must cost little next to the loads it follows."""
    import torch

    byte_at = ctypes.string_at
    on_gpu = False
    for t in state.values():
        if not isinstance(t, torch.Tensor) or not t.nbytes:
            continue
        if t.is_cuda:  # complete, not paged in: its copies may still be queued
            on_gpu = True
            continue
        n = t.nbytes
        if n <= _FEW_PAGES and t.is_cpu and t.is_contiguous():
            # A torch op per tensor costs ~7 us of dispatch: 55 ms of a ~0.2 s load of 8,000 small tensors,
            # the same for every method, which hid their differences. A byte read per page costs ~0.3 us.
            p = t.data_ptr()
            for off in range(0, n, _PAGE):
                byte_at(p + off, 1)
            byte_at(p + n - 1, 1)
        else:
            # A strided tensor is read whole by its copy (a byte view of it is not possible).
            flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
            flat[::_PAGE].sum()
            flat[-1:].sum()
    if on_gpu:
        torch.cuda.synchronize()


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


