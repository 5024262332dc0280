"""The documentation site builds with `mkdocs build --strict` (no broken link, no missing page), and its
API reference documents every public name of `datastates`."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from helpers.tools import tool

import datastates as ds

ROOT = Path(__file__).resolve().parents[1]



def test_the_site_builds_strict_and_documents_every_public_name(tmp_path: Path) -> None:
    run = subprocess.run([*tool("mkdocs", "docs"), "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    missing = [name for name in ds.__all__ if name != "__version__" and not re.search(
        rf'id="datastates(\.[a-z_]+)*\.{name}"', api)]
    assert missing == []
    for page in ("architecture", "format", "server", "distributed", "benchmarks"):
        assert (tmp_path / "site" / page / "index.html").exists()
    assert "Store.save_async" in api or "save_async" in api
