"""`datastates bench` end to end on a tiny state: the report's shape and byte counts, never its timings.

Timings on a shared CI machine say nothing about the code, so no test here asserts one; the byte count
of the partial save does (it is deterministic: only the changed tensors' chunks are new).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from datastates import bench
from datastates.cli import main

DS_METHODS = {"plain_copy", "ds_save", "ds_async_blocking", "ds_async_durable", "ds_partial_save", "ds_load",
              "ds_load_mmap", "ds_load100_full", "ds_load100_one"}
OTHER_METHODS = {"torch_save_fsync", "torch_load", "torch_load_mmap", "safetensors_save_fsync", "safetensors_load"}
DCP_METHODS = {"dcp_save_t1", "dcp_save_t2", "dcp_load", "dcp_async_blocking", "dcp_async_done",
               "dcp_async_cached_blocking", "dcp_async_cached_done"}


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    work = tmp_path / "work"
    rc = main(["bench", "--quick", "--size", "8MiB", "--dir", str(work), "--json-out", str(out), *extra])
    assert rc == 0
    # Every file of the run is removed at the end; only the directory we named is left, empty.
    assert list(work.iterdir()) == []
    return json.loads(out.read_text())


def _check_common(rep: dict, methods: set[str]) -> None:
    assert set(rep["methods"]) == methods
    for key, m in rep["methods"].items():
        assert m["median_s"] > 0, key
        assert len(m["samples_s"]) == rep["config"]["repeats"] == 2
    assert set(rep["ratios"]) == {t.key for t in bench.TARGETS}
    for r in rep["ratios"].values():
        assert r["pass"] in (True, False, None)
    # 32 tensors, 10% changed -> 3 tensors' chunks are new: a byte count, not a timing.
    for p in rep["partial"]:
        assert p["tensors_changed"] == 3
        assert 0 < p["bytes_new"] / p["bytes_total"] <= 0.2
    assert rep["ratios"]["partial_bytes"]["value"] <= 0.2
    # Full saves must not have been helped by dedup (the state is mutated before each one).
    assert rep["full_save_new_chunks_min"] == 1.0


def test_bench_quick_without_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = _run(tmp_path, "--skip", "dcp,train")
    _check_common(rep, DS_METHODS | OTHER_METHODS)
    assert rep["training"] is None
    assert rep["ratios"]["dcp_t2_vs_ds"]["pass"] is None  # skipped: reported as n/a, not as a pass
    printed = capsys.readouterr().out
    assert "PASS" in printed or "MISS" in printed
    assert "n/a" in printed


def test_bench_quick_everything(tmp_path: Path) -> None:
    # ~16 s on 2 cores: DCP's API moves between torch releases, so CI should run this one too.
    rep = _run(tmp_path)
    _check_common(rep, DS_METHODS | OTHER_METHODS | DCP_METHODS)
    tr = rep["training"]
    assert set(tr["windows"]) == {"baseline", "datastates", "dcp"}
    assert all(w["steps"] > 0 and w["seconds"] >= 1.0 for ws in tr["windows"].values() for w in ws)
    assert set(tr["steps_lost"]) == {"datastates", "dcp"}


def test_parse_size() -> None:
    assert bench.parse_size("1GiB") == 1 << 30
    assert bench.parse_size("256MiB") == 256 << 20
    assert bench.parse_size("64M") == 64 << 20
    assert bench.parse_size("1000") == 1000
    with pytest.raises(ValueError):
        bench.parse_size("lots")


def test_bad_skip_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --store is the hidden old name of --dir, kept working
    assert main(["bench", "--quick", "--store", str(tmp_path), "--skip", "nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_gpu_probe_runs_on_the_host_and_names_each_shape(tmp_path: Path) -> None:
    """docs/gpu_probe.py (the figures of docs/benchmarks.md "On a GPU"), as a smoke test with `--device cpu`."""
    probe = Path(__file__).parent.parent / "docs" / "gpu_probe.py"
    lines = {}
    for mode in ("block", "load"):
        r = subprocess.run([sys.executable, str(probe), mode, "--device", "cpu", "--shapes", "cnn", "--scale", "0.01",
                            "--repeats", "1", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        lines[mode] = r.stdout.strip().splitlines()
    assert len(lines["block"]) == 1 and lines["block"][0].startswith("cnn x0.01: 238 tensors | copy loop ")
    assert len(lines["load"]) == 1 and lines["load"][0].startswith("cnn x0.01 cold load onto cpu: datastates ")
    assert list(tmp_path.iterdir()) == []  # every store and file of the probe is removed
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(probe), "load"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and "pass --device cpu" in r.stderr


def _resident_pages(start: int, length: int) -> int:
    """Pages of [start, start + length) this process has mapped in (/proc/self/smaps' Rss of that mapping)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= start < hi:
                rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
                assert start + length <= hi
                return int(rss.split()[1]) * 1024 // 4096
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_the_touch_after_a_timed_load_maps_in_every_page_of_lazy_tensors(tmp_path: Path) -> None:
    # The bench reads one byte per page after every load so lazy (mapped) loads pay for their reads: small
    # tensors take a byte read per page, big ones a torch op; both must reach every page, the last included.
    import mmap

    from datastates.bench.peers import _touch_pages

    page = 4096
    f = tmp_path / "lazy.bin"
    data = bytes(range(256)) * (64 * page // 256)
    f.write_bytes(data)
    with f.open("rb") as fh:
        # Out of the page cache and read at random: a fault maps in its own page only (no read-around,
        # and no neighbours already cached to map around it).
        os.fsync(fh.fileno())
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    m.madvise(mmap.MADV_RANDOM)
    base = torch.frombuffer(m, dtype=torch.uint8)
    state = {
        "small": base[0:3 * page + 8].view(torch.int64),
        "big": base[16 * page:48 * page].view(torch.float32),
        "strided": base[48 * page:56 * page].view(torch.int32)[::2],
        "empty": base[:0],
        "scalar": base[60 * page:60 * page + 4].view(torch.float32)[0],
    }
    assert _resident_pages(base.data_ptr(), len(m)) == 0
    base[63 * page].item()  # a page no tensor holds: where a fault maps in its neighbours too, counts mean nothing
    if _resident_pages(base.data_ptr(), len(m)) != 1:
        pytest.skip("a fault on this file system maps in more than its own page (tmpfs)")
    _touch_pages(state)
    # the probe's page, 4 pages of "small" (its last byte is in the fourth), 32 of "big", 8 of "strided", 1 of
    # "scalar"
    assert _resident_pages(base.data_ptr(), len(m)) == 1 + 4 + 32 + 8 + 1
    assert bytes(m) == data  # read, never written
    del state, base
    m.close()


def test_a_cold_start_reads_the_newest_files_within_its_budget_then_drops_every_one(tmp_path: Path) -> None:
    # Every loader starts alike: its files read once (newest first, about as many bytes as the load reads, not a
    # store's older versions) and then out of the page cache.
    import ctypes
    import mmap

    from datastates.bench.peers import cold_start

    packs = tmp_path / "ds" / "packs"
    packs.mkdir(parents=True)
    mib = 1 << 20
    files = []
    for i, name in enumerate(["old", "mid", "new"]):
        f = packs / f"{name}.pack"
        with f.open("wb") as fh:
            fh.write(bytes([i + 1]) * mib)
            os.fsync(fh.fileno())  # clean pages: dirty ones are not dropped
        os.utime(f, ns=(10**9 * (i + 1), 10**9 * (i + 1)))
        files.append(f)
    assert cold_start([tmp_path / "ds"], mib + 1) == 2 * mib  # "new", then "mid" to pass the budget; "old" unread
    assert cold_start([tmp_path / "ds"]) == 3 * mib
    assert cold_start([files[0]], 10) == mib  # read in whole blocks: a file smaller than one is read whole
    assert cold_start([tmp_path / "missing"]) == 0

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

    def resident(f: Path) -> int:
        """Pages of `f` in the page cache (mincore over a mapping that touches none of them)."""
        n = f.stat().st_size
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            assert addr not in (None, ctypes.c_void_p(-1).value)
            vec = ctypes.create_string_buffer((n + 4095) // 4096)
            try:
                assert libc.mincore(addr, n, vec) == 0
            finally:
                libc.munmap(addr, n)
        finally:
            os.close(fd)
        return sum(b & 1 for b in vec.raw)

    for f in files:
        f.read_bytes()
    if resident(files[2]) == 0:
        pytest.skip("this file system does not keep file pages in the page cache")
    cold_start([tmp_path / "ds"], 1)
    if any(resident(f) for f in files):
        pytest.skip("this file system keeps its pages after posix_fadvise(DONTNEED) (tmpfs)")
    assert [resident(f) for f in files] == [0, 0, 0]  # the unread ones dropped too


@pytest.mark.parametrize("path", ["save", "async", "load", "one", "partial", "reuse"])
def test_the_profiling_target_runs_each_path_and_leaves_no_files(tmp_path: Path, path: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from datastates.bench import profile

    assert profile.main(["--shape", "cnn", "--scale", "0.02", "--path", path, "--repeats", "2",
                         "--dir", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f" {path}: median " in line and line.count("wall samples") == 1
    assert len(line.split("wall samples ")[1].split()) == 2  # one sample per repeat
    assert list(tmp_path.iterdir()) == []  # its store removed


@pytest.mark.parametrize("path", ["save", "async"])
def test_the_profiling_target_saves_new_tensor_objects_every_time_with_form_state_dict(
        tmp_path: Path, path: str, capsys: pytest.CaptureFixture[str]) -> None:
    from datastates.bench import profile

    assert profile.main(["--shape", "cnn", "--scale", "0.02", "--path", path, "--repeats", "3", "--form",
                         "state_dict", "--dir", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"new objects every save) {path}: median " in line
    assert len(line.split("wall samples ")[1].split()) == 3
    assert list(tmp_path.iterdir()) == []


def test_a_run_stopped_by_sigterm_removes_its_files(tmp_path: Path) -> None:
    """`timeout`, `kill` or a scheduler's time limit sends SIGTERM: the run must remove its directory as Ctrl-C
    does (killed by the default action it left `.datastates-bench-*` behind, several states' worth of bytes)."""
    import signal
    import time

    work = tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen([sys.executable, "-m", "datastates", "bench", "--size", "8MiB", "--tensors", "4",
                          "--repeats", "1000", "--skip", "torch,safetensors,dcp,train", "--dir", str(work)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(work.glob(".datastates-bench-*/ds/packs/*")):  # the run is saving into its directory
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.stderr else ""
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("argv,says", [
    (["--size", "1e400"], "size '1e400' is too large"),
    (["--chunk-size", "1e400"], "size '1e400' is too large"),
    (["--chunk-size", "1TiB"], "--chunk-size 1099511627776 must be a multiple of 64 bytes up to 1 GiB"),
    (["--shape", "cnn", "--scale", "inf"], "--scale inf must be a positive number"),
    (["--window", "nan"], "--window nan must be a positive number of seconds"),
    (["--window", "-5"], "--window -5.0 must be a positive number of seconds"),
    (["--window", "0"], "--window 0.0 must be a positive number of seconds"),
    (["--dir", "{tmp}/afile"], "afile is not a directory"),
    (["--dir", "{tmp}/afile/sub"], "afile is not a directory"),
    (["--json-out", "{tmp}"], "is a directory; name a file"),
    (["--json-out", "{tmp}/nowhere/bench.json"], "nowhere is not a directory; make it first"),
    (["--shape", "cnn", "--scale", "0.01", "--tensors", "5"], "--tensors applies to --shape small and uniform only"),
])
def test_odd_option_values_are_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            argv: list[str], says: str) -> None:
    """Each was a traceback (OverflowError), an error after the whole run (--json-out: its results lost), an odd
    OSError (--dir naming a file: "File exists"), or taken as is (--window)."""
    (tmp_path / "afile").write_text("mine")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    extra = [] if "--dir" in argv else ["--dir", str(tmp_path / "work")]
    if "--size" not in argv and "--shape" not in argv:
        extra += ["--size", "1MiB", "--tensors", "2"]  # a tiny run, should one start
    try:
        rc = main(["bench", "--repeats", "1", "--skip", "torch,safetensors,dcp,train", *extra, *argv])
    except SystemExit as exc:  # argparse's own usage errors (--size, --chunk-size)
        rc = exc.code
    assert rc == 2
    assert says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # nothing made, nothing removed
    assert (tmp_path / "afile").read_text() == "mine"


def test_the_disk_space_check_covers_what_a_shape_run_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run refuses to start without the space it needs: the states' worth it reserves must cover what its
    directory holds at the end (every store keeps every version; `--shape` adds two stores, which `3 * repeats + 5`
    left out). In states of the real state's bytes: `approx_bytes`, which sizes a state before it is built, runs
    up to 18 % short at this tiny scale (channel counts round), within 3 % from scale 0.25."""
    from datastates.bench import runner

    seen: dict[str, Any] = {}
    real_fresh, real_run = runner.fresh_dir, runner._Bench.run

    def fresh(cfg: Any, states: float, prefix: str, log: Any) -> Any:
        seen["states"] = states
        out = real_fresh(cfg, states, prefix, log)
        seen["root"] = out[2]
        return out

    def run(self: Any) -> None:
        real_run(self)
        seen["held"] = sum(f.stat().st_size for f in seen["root"].rglob("*") if f.is_file())
        seen["reserved"] = seen["states"] * self.size

    monkeypatch.setattr(runner, "fresh_dir", fresh)
    monkeypatch.setattr(runner._Bench, "run", run)
    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", "cnn", "--scale", "0.02", "--repeats", "3", "--skip",
                 "dcp,torch,safetensors,train", "--dir", str(tmp_path / "work"), "--json-out", str(out)]) == 0
    assert 0 < seen["held"] <= seen["reserved"], seen
    # The JSON's sizes are the state's: `bytes` its nbytes, and no `size` (--size, unused by a shape; it read 1 GiB)
    from datastates.bench.shapes import build

    state = build("cnn", 0.02)
    config = json.loads(out.read_text())["config"]
    assert config["bytes"] == sum(t.nbytes for t in state.values()) and config["tensors"] == len(state) == 238
    assert config["size"] is None


def test_the_partial_save_row_says_the_share_of_tensors_it_changed(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--unchanged 0.9 of 4 tensors changes one (never none): 25 % of the tensors, which the row must say (it said
    the 10 % asked for)."""
    assert main(["bench", "--size", "1MiB", "--tensors", "4", "--repeats", "1", "--skip", "torch,safetensors,dcp,train",
                 "--dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "datastates save, 25% of tensors changed" in printed
    assert "10% of tensors" not in printed
