"""The run: every method interleaved inside each repeat, after the same warm-up."""


from __future__ import annotations

import gc
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:

    from ..meta.versions import Version
    from ..store import Store

from .options import SKIPPABLE, Config, Results
from .peers import (
    CpuMeter,
    Dcp,
    Trainer,
    Warmup,
    _check_equal,
    _is_done,
    _load_and_touch,
    _mutate,
    _nbytes,
    _remove,
    _result,
    _safetensors_save,
    _torch_save,
    cold_start,
    fresh_dir,
    make_state,
    new_objects,
)
from .report import _report
from .shapes import build

# --- the run -------------------------------------------------------------------------------------------------


def changed_keys(keys: list[str], n: int, r: int, spread: bool) -> list[str]:
    """The `n` keys the partial save of repeat `r` changes: a different set each repeat, as different layers would
    in training. One block of neighbours (a run of layers: their old bytes leave one hole in the pack the next
    version reads), or with `spread` every (len(keys) / n)-th key (adapters between frozen layers: a hole after
    every few tensors)."""
    if not spread:
        return [keys[(r * n + i) % len(keys)] for i in range(n)]
    step = len(keys) / n if n else 1
    return [keys[(int(i * step) + r) % len(keys)] for i in range(n)]


def states_held(cfg: Config) -> float:
    """About how many states' worth of bytes the run's directory holds at its fullest (for the disk-space check).

    Every store keeps every version until the end. The main store: its warm-up save, per repeat a full save, a
    full save_async and a partial save, a save_async per training repeat, and (without `--shape`) the 100-tensor
    state. With `--shape`, two stores more: `reuse_unchanged`'s (its warm-up, per repeat a full and a partial save)
    and the one given new tensor objects (its warm-ups, of the same bytes, and a save per repeat). The peers keep
    one state at a time. The count was `3 * repeats + 5` for every run, short of what a `--shape` run holds
    (15.4 states for `--shape cnn --repeats 3 --skip dcp,torch,safetensors,train`, against 14 reserved); 2 more
    cover the stores' own files and a shape's bytes above `approx_bytes`.
    """
    r, partial = cfg.repeats, 1.0 - cfg.unchanged
    main = 1 + r * (2 + partial) + (r if "train" not in cfg.skip else 0) + (0 if cfg.shape else 1)
    shape = (1 + r * (1 + partial)) + (1 + r) if cfg.shape else 0
    peers = 1 if set(SKIPPABLE) - cfg.skip else 0
    return main + shape + peers + 2


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cfg: Config) -> dict[str, Any]:
    """Run the benchmark; return the JSON-ready report. Every file it writes is removed before it returns.

    Raises SystemExit (with a message) when the directory lacks the disk space the run needs.
    """
    parent, fs, root = fresh_dir(cfg, states_held(cfg), ".datastates-bench-", _log)
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
        if cfg.shape:
            self.state = build(cfg.shape, cfg.scale, cfg.tensors or None, seed=0)
            self.state100: dict[str, Any] | None = None
        else:
            self.state = make_state(cfg.size, cfg.tensors, seed=0)
            self.state100 = make_state(cfg.size, 100, seed=1)
        self.dev = torch.device(cfg.device)
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            self.state = {k: v.to(self.dev) for k, v in self.state.items()}
            if self.state100 is not None:
                self.state100 = {k: v.to(self.dev) for k, v in self.state100.items()}
        self.size = _nbytes(self.state)
        self.size100 = _nbytes(self.state100) if self.state100 is not None else 0
        res.extra["bytes"] = self.size
        res.extra["tensors"] = len(self.state)
        res.extra["dtypes"] = sorted({str(t.dtype).removeprefix("torch.") for t in self.state.values()})
        what = f"shape {cfg.shape} at scale {cfg.scale:g}" if cfg.shape else "fp32 tensors"
        _log(f"state: {self.size / 2**20:.0f} MiB in {len(self.state)} tensors ({what}); {cfg.repeats} repeats; "
             f"files in {root} ({fs})")
        self.keys = list(self.state)
        self.n_changed = max(1, round(len(self.keys) * (1 - cfg.unchanged))) if cfg.unchanged < 1 else 0
        self.cpu = CpuMeter()
        self.warm = Warmup(self.state)
        # On a GPU the floor of a blocking save is a copy into reused pinned host buffers (what the pool holds).
        self.copy_bufs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=self.cuda) for k, v in self.state.items()}
        self.plain_copy()  # first use touches new pages: untimed
        self.full_saves: list[dict[str, float]] = []
        self.distinct_chunks: int | None = None
        self.partial: list[dict[str, int]] = []
        self.reuse: Store | None = None
        self.given: Store | None = None
        """With `--shape`: a store saved new tensor objects every time (what `model.state_dict()` returns), apart
        from the others so that its flatten cache serves that form alone."""

    # timing ----------------------------------------------------------------------------------------------
    def plain_copy(self) -> None:
        for k, v in self.state.items():
            self.copy_bufs[k].copy_(v, non_blocking=self.cuda)
        self.sync()

    def sync(self) -> None:
        """Wait for the GPU's queued work (nothing on the host): a timed step ends when its copies have."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.dev)

    def timed(self, key: str, nbytes: int, buffers: Sequence[Any], fn: Callable[..., Any], *args: Any,
              **kw: Any) -> Any:
        """Warm up (touching `buffers`), then time `fn(*args, **kw)` as one sample of `key`; return its result."""
        self.warm(buffers)
        self.sync()
        snap = self.cpu.snap()
        out = fn(*args, **kw)
        self.sync()
        self.res.add(key, time.perf_counter() - snap[0], nbytes, self.cpu.others(snap))
        return out

    def timed_load(self, key: str, nbytes: int, files: Path, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A cold load: `files` read once and dropped from the page cache (`cold_start`), then the load timed, plus
        one read per page of its result."""
        cold_start([files], nbytes)
        return self.timed(key, nbytes, (), _load_and_touch, fn, *args, **kw)

    def timed_async(self, blocking_key: str, end_key: str, buffers: Sequence[Any], start: Callable[[], Any],
                    wait: Callable[[Any], Any]) -> Any:
        """Warm up, then time `start()` as `blocking_key` and through `wait(token)` as `end_key`; return the
        result of `wait`."""
        self.warm(buffers)
        self.sync()
        snap = self.cpu.snap()
        token = start()
        t1 = time.perf_counter()
        out = wait(token)
        self.sync()
        t2 = time.perf_counter()
        others = self.cpu.others(snap)
        self.res.add(blocking_key, t1 - snap[0], self.size, others)
        self.res.add(end_key, t2 - snap[0], self.size, others)
        return out

    # the run ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        from ..store import Store

        cfg = self.cfg
        store = Store.open(self.root / "ds", pool_bytes=2 * self.size, chunk_size=cfg.chunk_size,
                           zstd_level=cfg.zstd, reuse_unchanged=cfg.reuse_unchanged)
        # issue 13's second partial target: a store that trusts torch's version counters
        self.reuse = (Store.open(self.root / "ds-reuse", pool_bytes=2 * self.size, chunk_size=cfg.chunk_size,
                                 zstd_level=cfg.zstd, reuse_unchanged=True) if cfg.shape else None)
        self.given = (Store.open(self.root / "ds-state-dict", pool_bytes=2 * self.size, chunk_size=cfg.chunk_size,
                                 zstd_level=cfg.zstd, reuse_unchanged=cfg.reuse_unchanged) if cfg.shape else None)
        dcp = Dcp() if "dcp" not in cfg.skip else None
        try:
            _log("warming the datastates buffer pool (one untimed save)"
                 + ("" if cfg.shape else " and saving the 100-tensor state"))
            store.save(self.state, branch="main", message="warm-up")
            if self.reuse is not None:
                self.reuse.save(self.state, branch="main", message="warm-up")
            if self.given is not None:
                # As a training loop's first checkpoints: the flatten cache's record of new objects is made by the
                # second save and its slot layout by the third; the pool's slots by the first save_async.
                for _ in range(3):
                    self.given.save_async(new_objects(self.state), branch="main", message="warm-up").result()
            v100 = (store.save(self.state100, branch="bench100", message="100 tensors")
                    if self.state100 is not None else None)
            if dcp is not None:
                _mutate(self.state)
                dcp.async_save(self.state, self.root / "dcp-warm", cached=True).result()  # first staging allocates
                _remove(self.root / "dcp-warm")
            for r in range(cfg.repeats):
                _log(f"repeat {r + 1}/{cfg.repeats}")
                self.timed("plain_copy", self.size, list(self.copy_bufs.values()), self.plain_copy)
                self.datastates(store, r)
                if self.given is not None:
                    self.new_objects(r)
                if v100 is not None:
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
            if self.reuse is not None:
                self.reuse.close()
            if self.given is not None:
                self.given.close()
            store.close()

    def _pool(self, store: Store) -> list[Any]:
        # The free slots of datastates' buffer pool: its reusable buffers, touched by the warm-up like
        # every method's own. (A private attribute: the bench reads it, never changes the pool.)
        return list(getattr(store.pool, "_free", []))

    def _full_save(self, v: Version, store: Store) -> None:
        import torch

        from ..objects.chunks import spans

        if self.distinct_chunks is None:
            # Chunks the state holds once each: identical tensors inside one state (26 BatchNorm
            # num_batches_tracked scalars) are stored once by design, not helped by an earlier save.
            import blake3

            ids = set()
            for t in self.state.values():
                raw = t.detach().cpu().reshape(-1).view(torch.uint8).numpy() if t.numel() else None
                for a, b in spans(t.numel() * t.element_size(), store.chunk_size):
                    ids.add(blake3.blake3(raw[a:b].data if raw is not None else b"").digest())
            self.distinct_chunks = len(ids)
        chunks = self.distinct_chunks
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
        if self.reuse is not None:
            self.reuse.save(state, branch="main", message="before partial")  # untimed: what it last saw
        changed = changed_keys(self.keys, self.n_changed, r, self.cfg.spread)
        _mutate(state, changed)
        v = self.timed("ds_partial_save", size, self._pool(store), store.save, state, branch="main",
                       message="partial")
        self.partial.append({"bytes_new": v.bytes_new, "bytes_total": v.bytes_total,
                             "bytes_changed": sum(state[k].numel() * state[k].element_size() for k in changed),
                             "tensors_changed": self.n_changed, "chunks_new": v.chunks_new})
        if self.reuse is not None:
            vr = self.timed("ds_partial_reuse_save", size, self._pool(self.reuse), self.reuse.save, state,
                            branch="main", message="partial")
            if r == 0:
                _check_equal(self.reuse.load(vr, device=self.dev), state,
                             "datastates partial save with reuse_unchanged")
        # The latest version, what a restart loads: most of its chunks sit in earlier packs.
        out = self.timed_load("ds_load", size, self.root / "ds", store.load, v, device=self.dev)
        if r == 0:
            _check_equal(out, state, "datastates load")
        del out
        if not self.cuda:  # (onto a GPU, mmap changes nothing: the bytes are read into pinned buffers either way)
            # The opt-in that maps the packs, beside torch.load(mmap=True) and safetensors (which maps its file).
            out = self.timed_load("ds_load_mmap", size, self.root / "ds", store.load, v, mmap=True)
            if r == 0:
                _check_equal(out, state, "datastates load(mmap=True)")
            del out
        if self.cfg.shape:
            # One tensor of the whole state, a different one each repeat (what an analyst reads).
            one = self.keys[(r * 37 + len(self.keys) // 2) % len(self.keys)]
            got = self.timed_load("ds_load_one", state[one].numel() * state[one].element_size(), self.root / "ds",
                                  store.load, v, keys=[one], device=self.dev)
            if r == 0:
                _check_equal(got, {one: state[one]}, "datastates load of one tensor")

    def new_objects(self, r: int) -> None:
        """save_async of the state as new tensor objects (`new_objects`), on its own store; last in a repeat,
        so that the main store's partial save still follows a save of the state it changes."""
        assert self.given is not None
        _mutate(self.state)
        given = new_objects(self.state)  # made before the timer, as the caller makes its state_dict()
        v = self.timed_async("ds_async_new_blocking", "ds_async_new_durable", self._pool(self.given),
                             partial(self.given.save_async, given, branch="main"), _result)
        del given
        if r == 0:
            _check_equal(self.given.load(v, device=self.dev), self.state, "datastates save_async of new objects")

    def load100(self, store: Store, v100: Version, r: int) -> None:
        """Cold full load of the 100-tensor state, then of one of its tensors (a different one each repeat)."""
        assert self.state100 is not None
        self.timed_load("ds_load100_full", self.size100, self.root / "ds", store.load, v100, device=self.dev)
        one = list(self.state100)[(r * 37) % 100]
        out = self.timed_load("ds_load100_one", self.state100[one].numel() * 4, self.root / "ds", store.load, v100,
                              keys=[one], device=self.dev)
        if r == 0:
            _check_equal(out, {one: self.state100[one]}, "datastates partial load")

    def torch_save_load(self, r: int) -> None:
        import torch

        path = self.root / "state.pt"
        _mutate(self.state)
        self.timed("torch_save_fsync", self.size, (), _torch_save, self.state, path)
        out = self.timed_load("torch_load", self.size, path, torch.load, path, weights_only=True,
                              **({"map_location": self.dev} if self.cuda else {}))
        if r == 0:
            _check_equal(out, self.state, "torch.load")
        del out
        if not self.cuda:
            self.timed_load("torch_load_mmap", self.size, path, torch.load, path, weights_only=True, mmap=True)
        _remove(path)

    def safetensors_save_load(self, r: int) -> None:
        from safetensors.torch import load_file

        path = self.root / "state.safetensors"
        _mutate(self.state)
        self.timed("safetensors_save_fsync", self.size, (), _safetensors_save, self.state, path)
        out = self.timed_load("safetensors_load", self.size, path, load_file, str(path), device=str(self.dev))
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


