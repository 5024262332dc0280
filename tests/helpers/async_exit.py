"""Start an asynchronous save, then end the process without waiting for it (used by tests/test_async.py).

    python async_exit.py STORE MODE

MODE is one of
  exit       save_async, then fall off the end of the script: only the store's atexit drain can finish the save;
  lazy-exit  the same with save_async(lazy=True): the capture itself may still run on the capture thread;
  close      save_async, then store.close() before exiting (the control case).

The state is `make_state()`, a pure function the parent test rebuilds to compare bytes. Nothing about the
version is printed: the parent finds it through the branch head.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

CHUNK = 1 << 20
STEP = 41


def make_state() -> dict[str, Any]:
    """8 MiB of float32 in 1 MiB-sized tensors plus a few odd-sized ones; the same bytes in every process."""
    g = torch.Generator().manual_seed(20240611)
    state: dict[str, Any] = {f"w{i}": torch.randn(CHUNK // 4, generator=g) for i in range(8)}
    state["odd"] = torch.randint(-1000, 1000, (12345,), generator=g, dtype=torch.int64)
    state["meta"] = {"epoch": 3, "name": "exit-test"}
    return state


def main(path: str, mode: str) -> None:
    from datastates.store import Store

    store = Store.open(path, chunk_size=CHUNK)
    store.save_async(make_state(), step=STEP, message=f"async_exit {mode}", lazy=mode == "lazy-exit")
    if mode == "close":
        store.close()
    elif mode not in ("exit", "lazy-exit"):
        raise SystemExit(f"unknown mode {mode!r}")
    # "exit": no wait, no close; the interpreter shuts down right here.


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
