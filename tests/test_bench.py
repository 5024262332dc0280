"""`datastates bench` end to end on a tiny state: the report's shape and byte counts, never its timings.

Timings on a shared CI machine say nothing about the code, so no test here asserts one; the byte count
of the partial save does (it is deterministic: only the changed tensors' chunks are new).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
