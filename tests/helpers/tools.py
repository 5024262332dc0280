"""Finding a command-line tool the dev extras install: beside this Python first (the venv), then on PATH."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def tool(name: str, extra: str) -> list[str]:
    """The command for `name`, or skip the test saying which extra installs it."""
    exe = Path(sys.executable).with_name(name)
    if exe.exists():
        return [str(exe)]
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[{extra}]')")
    return [found]
