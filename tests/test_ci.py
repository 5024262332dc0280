"""The CI script's time bound: `--deadline` skips what would start too late, and says how to run it."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/test_ci.py::test_a_target_for_the_deadline"


def test_a_target_for_the_deadline() -> None:
    assert sum(range(4)) == 6  # only here to be skipped, or run, by the test below


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_test_due_after_the_deadline_is_skipped_with_the_command_that_runs_it() -> None:
    late = _pytest(TARGET, "--deadline", "1")  # 1970: every test starts after it
    assert late.returncode == 0, late.stdout + late.stderr
    assert "1 skipped" in late.stdout and "passed" not in late.stdout
    hint = re.search(r"run it alone: (\.venv/bin/python -m pytest '[^']+')", late.stdout)
    assert hint is not None, late.stdout
    argv = shlex.split(hint.group(1))
    assert argv[-1] == TARGET
    if not (ROOT / argv[0]).exists():  # run by another interpreter than the README's: the hint with that one
        argv[0] = sys.executable
    alone = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0 and "1 passed" in alone.stdout, alone.stdout + alone.stderr


def test_ci_bounds_only_the_slow_sample_by_the_deadline() -> None:
    # The README's test command runs whole; the sample of slow tests stops starting tests before 30 minutes.
    script = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    fast = '.venv/bin/python -m pytest -q -m "not slow"'
    assert fast in readme
    lines = [line.split("#")[0].strip() for line in script.splitlines()]
    assert fast in lines  # verbatim, with no deadline
    slow = [line for line in lines if "-m slow" in line]
    assert len(slow) == 1 and '--deadline "$deadline"' in slow[0]
    assert any(line.startswith("deadline=$((") for line in lines)
