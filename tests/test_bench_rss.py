"""`datastates bench --rss` end to end on a tiny state: the report's keys and that each growth was measured.

Peak RSS on a shared machine that hands freed memory back moves from run to run, so no test here
asserts a bound, a ratio or a size: only that every method ran in its own process and reported a
positive integer growth, and that the run left no file behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datastates.bench.rss import RSS_METHODS, _proc_status
from datastates.cli import main

KEYS = {"label", "state_bytes", "pool_bytes", "pool_capacity_bytes", "growth_bytes", "growth_samples", "pool_samples",
        "ratio_samples", "baseline_bytes", "peak_bytes", "bound_bytes", "bound", "ratio", "pass", "target",
        "peak_reset"}


@pytest.mark.skipif(not _proc_status(), reason="needs /proc/self/status (Linux)")
def test_bench_rss_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, work = tmp_path / "rss.json", tmp_path / "work"
    rc = main(["bench", "--rss", "--quick", "--size", "4MiB", "--tensors", "8", "--repeats", "1", "--dir",
               str(work), "--json-out", str(out)])
    assert rc == 0
    assert list(work.iterdir()) == []  # the run's directory is removed
    rep = json.loads(out.read_text())
    assert "--rss" in rep["command"]
    assert set(rep["rss"]) == set(RSS_METHODS)
    for key, m in rep["rss"].items():
        assert set(m) == KEYS, key
        assert isinstance(m["growth_bytes"], int) and m["growth_bytes"] > 0, key
        assert len(m["growth_samples"]) == 1
        assert m["state_bytes"] == rep["config"]["bytes"] > 0, key  # loads return the whole state
        assert m["peak_bytes"] >= m["baseline_bytes"] > 0, key
        assert m["pass"] in (True, False)
    assert rep["rss"]["ds_save"]["target"] and not rep["rss"]["torch_load"]["target"]
    assert rep["rss"]["torch_save_fsync"]["pool_bytes"] == 0
    printed = capsys.readouterr().out
    assert "datastates bench --rss" in printed
    assert "PASS" in printed or "MISS" in printed


def test_rss_option_defaults() -> None:
    from datastates.bench import config_from_args
    from datastates.cli import build_parser

    args = build_parser().parse_args(["bench", "--rss", "--shape", "cnn"])
    cfg = config_from_args(args)
    assert cfg.rss and cfg.repeats == 3 and cfg.shape == "cnn"
