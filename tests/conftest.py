"""Shared fixtures for the core test suite (round trips, dedup, crashes, corruption, concurrency, errors, refs)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.procs import Zygote
from helpers.states import snapshot

import datastates as ds


@pytest.fixture(scope="session")
def empty_store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty store made once: creating one fsyncs a dozen files, copying it does not."""
    path = tmp_path_factory.mktemp("template") / "store"
    ds.Store.open(path).close()
    return path


def copy_store(template: Path, dest: Path) -> Path:
    """A copy of a closed store directory (a fresh, independent store)."""
    shutil.copytree(template, dest)
    return dest


@pytest.fixture
def store(tmp_path: Path, empty_store_template: Path) -> Iterator[ds.Store]:
    """A fresh, empty store in tmp_path, closed after the test."""
    s = ds.Store.open(copy_store(empty_store_template, tmp_path / "store"))
    try:
        yield s
    finally:
        s.close(raise_errors=False)


def _make_state(seed: int, n: int = 4, numel: int = 1024, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """`n` tensors of `numel` elements named t00, t01, ... plus a few plain values; a pure function of `seed`."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i:02d}": torch.randn(numel, generator=g).to(dtype) for i in range(n)}
    return {"tensors": tensors, "seed": seed, "name": f"state-{seed}", "values": [1, 2.5, None, True]}


@pytest.fixture
def make_state() -> Callable[..., dict[str, Any]]:
    """make_state(seed, n=4, numel=1024, dtype=float32): a deterministic small state."""
    return _make_state


@pytest.fixture
def unchanged() -> Callable[[ds.Store], Any]:
    """unchanged(store) -> a context manager asserting that nothing under the store changes inside it:
    same files with the same bytes (catalog/ and locks/ aside), same refs, same number of versions."""
    from contextlib import contextmanager

    @contextmanager
    def check(s: ds.Store) -> Iterator[None]:
        before = (snapshot(s.path), s.branches(), s.tags(), s.catalog.version_count())
        yield
        after = (snapshot(s.path), s.branches(), s.tags(), s.catalog.version_count())
        assert after[0] == before[0], f"files changed: {sorted(set(after[0].items()) ^ set(before[0].items()))}"
        assert after[1:] == before[1:], "refs or versions changed"

    return check


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """One pre-imported `tests/helpers/saver.py serve` process for the whole session."""
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--deadline", type=float, default=None, metavar="EPOCH_SECONDS",
        help="skip every test that would start after this time (seconds since the epoch), saying so: .ci/run "
             "bounds its sample of slow tests by the time its 30 minutes leave, not by luck")


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = item.config.getoption("--deadline")
    if deadline is not None and time.time() >= deadline:
        # A skip, not a pass: the summary counts and names each one (-ra), with the command that runs it (the
        # README's interpreter, from the repository's root).
        pytest.skip(f"the run's time budget ended (--deadline {deadline:.0f}); run it alone: "
                    f".venv/bin/python -m pytest '{item.nodeid}'")
