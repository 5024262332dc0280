"""Counting calls the save and load paths make (never timing them)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch


class CountPreadv:
    """Counts `os.preadv` calls while installed (for the test's duration, through monkeypatch)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.real = os.preadv
        monkeypatch.setattr(os, "preadv", self)

    def __call__(self, fd: int, bufs: Any, offset: int) -> int:
        self.calls += 1
        return self.real(fd, bufs, offset)


def count_slots(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every staging slot buffer allocated from here on (`buffers.slot_buffer`), by size."""
    import datastates.save.buffers as buffers

    made: list[int] = []
    real = buffers.slot_buffer

    def counted(nbytes: int, pin: bool) -> torch.Tensor:
        made.append(nbytes)
        return real(nbytes, pin)

    monkeypatch.setattr(buffers, "slot_buffer", counted)
    return made
