"""`datastates bench --rss` end to end on a tiny state: the report's keys, that each growth and time was measured,
and the restart line's ratios.

Peak RSS on a shared machine that hands freed memory back moves from run to run, so no test here
asserts a bound, a ratio or a size: only that every method ran in its own process and reported a
positive integer growth, and that the run left no file behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datastates.bench.rss import RSS_METHODS, SAVES, _proc_status, method_order
from datastates.cli import main

KEYS = {"label", "state_bytes", "pool_bytes", "pool_capacity_bytes", "growth_bytes", "growth_samples", "pool_samples",
        "ratio_samples", "baseline_bytes", "peak_bytes", "bound_bytes", "bound", "ratio", "pass", "target",
        "peak_reset", "seconds", "seconds_samples"}


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
        assert m["seconds"] > 0 and m["seconds_samples"] == [m["seconds"]], key
    assert rep["rss"]["ds_save"]["target"] and not rep["rss"]["torch_load"]["target"]
    assert rep["rss"]["torch_save_fsync"]["pool_bytes"] == 0
    # The restart line: each peer's load over ours, from the same median seconds; targets only against the full load.
    restart = {r["label"]: r for r in rep["restart"]}
    assert len(restart) == 4
    full = restart["torch.load / datastates load (full)"]
    assert full["value"] == pytest.approx(rep["rss"]["torch_load"]["seconds"] / rep["rss"]["ds_load"]["seconds"])
    assert full["target"] == 1.2 and full["pass"] == (full["value"] >= 1.2)
    assert restart["torch.load / datastates load(mmap=True)"]["target"] is None
    printed = capsys.readouterr().out
    assert "datastates bench --rss" in printed
    assert "PASS" in printed or "MISS" in printed
    assert "loads as after a restart" in printed and "safetensors load_file / datastates load (full)" in printed


def test_rss_option_defaults() -> None:
    from datastates.bench import config_from_args
    from datastates.cli import build_parser

    args = build_parser().parse_args(["bench", "--rss", "--shape", "cnn"])
    cfg = config_from_args(args)
    assert cfg.rss and cfg.repeats == 3 and cfg.shape == "cnn"


def test_rss_method_order_rotates() -> None:
    # every method runs once per repeat, saves before loads; over four repeats each of the four loads is the
    # first one after the saves exactly once
    loads = [m for m in RSS_METHODS if m not in SAVES]
    orders = [method_order(r) for r in range(4)]
    for order in orders:
        assert sorted(order) == sorted(RSS_METHODS)
        assert set(order[:len(SAVES)]) == set(SAVES)
    assert orders[0][:len(SAVES)] == list(SAVES) and orders[0][len(SAVES)] == "ds_load"
    assert sorted(o[len(SAVES)] for o in orders) == sorted(loads)
    # each ordered pair of loads is adjacent exactly once over the four repeats
    pairs = [(o[i], o[i + 1]) for o in orders for i in range(len(SAVES), len(o) - 1)]
    assert len(pairs) == len(set(pairs)) == 12
    assert method_order(12) == orders[0]  # saves repeat every 3, loads every 4


@pytest.mark.parametrize("option", [["--skip", "torch"], ["--unchanged", "0.5"], ["--spread"], ["--reuse-unchanged"],
                                    ["--window", "2"]])
def test_rss_refuses_the_options_it_does_not_use(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 option: list[str]) -> None:
    """They were ignored, yet written into the report's command line (`--skip torch` still measured torch)."""
    assert main(["bench", "--rss", "--size", "1MiB", "--tensors", "2", "--repeats", "1", "--dir", str(tmp_path),
                 *option]) == 2
    assert f"leave out {option[0]}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
