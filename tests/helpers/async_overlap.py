"""Two lazy saves whose captures overlap, on a pool smaller than either state (used by tests/test_async.py).

    python async_overlap.py STORE TIMEOUT_S [POOL_BYTES]

POOL_BYTES defaults to 2 MiB (two 1 MiB slots); a pool larger than both states is the control case.

Prints `DONE <ok1> <ok2>` and, when both finished, `LOADED <bit-exact>`; exits 0 only if both saves finished
within TIMEOUT_S and load back bit-exact, 3 otherwise. Ends with os._exit so that a wedged pipeline cannot keep
the process alive (the store's atexit drain would wait for it forever).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch


def finished(handle: Any, timeout: float) -> bool:
    try:
        handle.exception(timeout)
    except TimeoutError:
        return False
    return True


def main(path: str, timeout: float, pool_bytes: int) -> int:
    from datastates.store import Store

    store = Store.open(path, chunk_size=1 << 20, pool_bytes=pool_bytes)
    g = torch.Generator().manual_seed(7)
    a = {f"a{i}": torch.randn(1 << 18, generator=g) for i in range(6)}  # 6 MiB
    b = {f"b{i}": torch.randn(1 << 18, generator=g) for i in range(6)}
    h1 = store.save_async(a, branch="a", lazy=True)
    h2 = store.save_async(b, branch="b", lazy=True)
    ok1 = finished(h1, timeout)
    ok2 = finished(h2, timeout / 4 if ok1 else 0.0)
    print("DONE", ok1, ok2, flush=True)
    if not (ok1 and ok2):
        return 3
    la, lb = store.load(h1.result()), store.load(h2.result())
    exact = all(torch.equal(la[k], a[k]) for k in a) and all(torch.equal(lb[k], b[k]) for k in b)
    print("LOADED", exact, flush=True)
    store.close()
    return 0 if exact else 3


if __name__ == "__main__":
    try:
        rc = main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2 << 20)
    except BaseException:
        traceback.print_exc()
        rc = 4
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
