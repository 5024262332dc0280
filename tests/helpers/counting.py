"""Counting calls the load path makes (never timing them)."""

from __future__ import annotations

import os
from typing import Any

import pytest


class CountPreadv:
    """Counts `os.preadv` calls while installed (for the test's duration, through monkeypatch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.real = os.preadv
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd: int, bufs: Any, offset: int) -> int:
        self.calls += 1
        return self.real(fd, bufs, offset)
