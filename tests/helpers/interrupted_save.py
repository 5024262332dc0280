"""A sync save interrupted (SIGINT from the test) while the test holds the store's writers lock, so the save
cannot have committed yet; the caller then changes its tensors, as a notebook user would after Ctrl-C.
Prints READY, SAVING (from a watcher thread, once the main thread waits in `SaveHandle.result`), then
INTERRUPTED (or RETURNED), MUTATED; after a line on stdin (the lock released) it
prints HEAD <step of main> <fsck problems>, then saves the original values again and prints RELOADED <equal>."""

from __future__ import annotations

import sys
import threading
import time

import torch

import datastates as ds


def main(path: str) -> None:
    s = ds.Store.open(path, workers=1)
    s.save({"w0": torch.zeros(4)}, step=0)
    print("READY", flush=True)
    sys.stdin.readline()  # the test holds the writers lock now
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(8)}  # 8 x 1 MiB, read in place
    orig = {k: v.clone() for k, v in state.items()}
    threading.Thread(target=_tell_when_waiting, args=(threading.main_thread().ident,), daemon=True).start()
    try:
        s.save(state, step=1)
        print("RETURNED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    for t in state.values():
        t.fill_(-1.0)
    print("MUTATED", flush=True)
    sys.stdin.readline()  # the lock is released: the pipeline goes on
    s.wait()
    print("HEAD", s.version("main").step, len(s.fsck().problems), flush=True)
    s.save(orig, step=2)
    back = s.load("main")
    print("RELOADED", all(torch.equal(back[k], orig[k]) for k in orig), flush=True)
    s.close()


def _tell_when_waiting(main: int | None) -> None:
    """Print SAVING once the main thread's stack is in `SaveHandle.result` (the save is submitted and the caller
    waits for it): the test's SIGINT then lands there."""
    while True:
        frame = sys._current_frames().get(main)  # type: ignore[arg-type]
        while frame is not None:
            if frame.f_code.co_name == "result" and frame.f_code.co_filename.endswith("job.py"):
                print("SAVING", flush=True)
                return
            frame = frame.f_back
        time.sleep(0.001)


if __name__ == "__main__":
    main(sys.argv[1])
