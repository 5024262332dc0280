"""README.md as written: every ```python block runs, in order, in one namespace on a fresh store, and every
```bash line that starts with `datastates ` runs against the demo store the README's own `datastates demo`
makes. Each failure names its block (and line), so a README edit that breaks a snippet fails here.

What the test adds, and only that: a prelude (a small model with `encoder` and `fc`, an SGD optimizer,
`step`), a working directory of its own (the README's relative paths land in it), the README's absolute
tier paths (`/pfs/...`, `/local/...`) moved under it, and `--steps 120` on the demo (the README's 300 steps
would take a minute on a busy CI machine; 120 still gives the `main~5` the other lines use).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers.states import snapshot

import datastates as ds
from datastates.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
# Lines of the ```bash blocks that are not store commands to run here: they set up a machine, run the tests,
# measure for minutes or start a server.
SKIP = ("datastates bench", "datastates serve")

PRELUDE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.fc = nn.Linear(16, 1)

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 300
"""


def blocks(lang: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```lang block of the README, in order."""
    text = README.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in BLOCK.finditer(text) if m.group(1) == lang]


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    assert len(blocks("python")) >= 5
    commands = [line for _, code in blocks("bash") for line in code.splitlines() if line.startswith("datastates ")]
    assert any(c.startswith("datastates init") for c in commands)
    assert any(c.startswith("datastates demo") for c in commands)


def test_every_python_block_runs_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    exec(compile(PRELUDE, "prelude", "exec"), namespace)
    ran = 0
    try:
        for line, code in blocks("python"):
            code = code.replace("/pfs/project/store", str(tmp_path / "pfs")).replace(
                "/local/nvme/store", str(tmp_path / "nvme"))
            try:
                exec(compile(code, f"README.md:{line}", "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"README.md python block at line {line} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
            ran += 1
    finally:
        for name in ("store", "tiered"):
            s = namespace.get(name)
            if isinstance(s, ds.Store):
                s.close()
    assert ran == len(blocks("python"))
    assert namespace["state"]["step"] == 100  # type: ignore[index]  # the first block's `load("main~1")`: v1
    with ds.Store.open(tmp_path / "runs" / "store", create=False) as s:
        assert "soup" in s.branches() and len(s.version("soup").parents) == 2
        assert "sweep-1/member-03" in s.branches()
        assert s.fsck().ok


def test_every_bash_command_runs_on_the_demo_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    failures: list[str] = []
    ran: list[str] = []
    for line_no, code in blocks("bash"):
        for line in code.splitlines():
            words = shlex.split(re.sub(r"\s*\[[^\]]*\]", "", line), comments=True)  # `[--dry-run]`: optional
            if words[:1] == ["export"]:
                name, _, value = words[1].partition("=")
                monkeypatch.setenv(name, value)
                continue
            if not line.startswith("datastates ") or line.startswith(SKIP):
                continue
            argv = words[1:] + (["--steps", "120"] if words[1] == "demo" else [])
            rc = main(argv)
            out = capsys.readouterr()
            ran.append(words[1])
            if rc != 0:
                failures.append(f"README.md bash block at line {line_no}: `{line.strip()}` exited {rc}: "
                                f"{out.err.strip()}")
    assert not failures, "\n".join(failures)
    assert ran[:2] == ["init", "demo"] and len(ran) >= 15
    assert os.environ["DATASTATES_STORE"] == "runs/demo-store"
    with ds.Store.open(tmp_path / "runs" / "demo-store", create=False) as s:
        assert "good" in s.tags() and "exp" in s.branches()


def test_demo_writes_only_into_its_own_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "real"
    with ds.Store.open(real) as s:
        s.save({"w": torch.ones(4)}, step=1)
    monkeypatch.setenv("DATASTATES_STORE", str(real))
    before = snapshot(real)
    rc = main(["demo", "--dir", str(real), "--steps", "20"])  # a real store as --dir: refused
    assert rc == 1 and "ConflictError" in capsys.readouterr().err
    assert snapshot(real) == before
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("x")
    assert main(["demo", "--dir", str(other), "--steps", "20"]) == 1  # a non-empty non-store: refused
    assert sorted(p.name for p in other.iterdir()) == ["a.txt"]
    demo = tmp_path / "demo"
    for _ in range(2):  # the demo may run again on its own store
        assert main(["demo", "--dir", str(demo), "--steps", "120"]) == 0
    out = capsys.readouterr().out
    assert snapshot(real) == before  # $DATASTATES_STORE untouched
    with ds.Store.open(demo, create=False) as s:
        assert {"best", "best-2"} <= set(s.tags())
    hint = re.search(r"next, try: `([^`]*) log`", out)
    assert hint, out
    words = shlex.split(hint.group(1))
    assert Path(words[0]).name == "datastates" and words[1:] == ["--store", str(demo)]
    assert main(words[1:] + ["log"]) == 0  # the closing hint's command works
