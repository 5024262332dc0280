"""Counting calls the save and load paths make (never timing them)."""

from __future__ import annotations

import os
import threading
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


def count_slots(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Every staging slot buffer allocated from here on (`buffers.slot_buffer`): its size and the name of the
    thread that made it."""
    import datastates.save.buffers as buffers

    made: list[tuple[int, str]] = []
    real = buffers.slot_buffer

    def counted(nbytes: int, pin: bool) -> torch.Tensor:
        made.append((nbytes, threading.current_thread().name))
        return real(nbytes, pin)

    monkeypatch.setattr(buffers, "slot_buffer", counted)
    return made
