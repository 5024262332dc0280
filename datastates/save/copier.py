"""The copier: a second thread that takes a share of the caller's copies during a capture.

A capture of thousands of small host tensors is one `_foreach_copy_` per slot, which copies on one core (each
copy is too small for torch's own intra-op threads); the copies release the GIL, so a second thread copying
other pieces of the same slot halves the time the caller is blocked on two cores (docs/perf-notes.md).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable

import torch


class _Share:
    """The batches of one slot, claimed one at a time by whichever thread comes first."""

    __slots__ = ("n", "copy", "claim", "done", "cv", "error")

    def __init__(self, n: int, copy: Callable[[int], None]) -> None:
        self.n = n
        self.copy = copy
        # `count.__next__` is one C call: two threads never get the same index under the GIL.
        self.claim = itertools.count().__next__
        self.done = 0
        self.cv = threading.Condition(threading.Lock())
        self.error: BaseException | None = None

    def work(self) -> None:
        while (i := self.claim()) < self.n:
            try:
                self.copy(i)
            except BaseException as exc:  # reported to the caller by `Copier.run`
                if self.error is None:
                    self.error = exc
            finally:
                with self.cv:
                    self.done += 1
                    if self.done == self.n:
                        self.cv.notify_all()

    def wait(self) -> None:
        with self.cv:
            while self.done < self.n:
                self.cv.wait()


class Copier:
    """One daemon thread, started on first use, that shares the copies of `run` with its caller.

    The caller never waits for a batch the thread has not started: it claims every batch left, so a busy
    or late thread costs it at most the one batch the thread is copying. Thread-safe."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[_Share | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, n: int, copy: Callable[[int], None]) -> None:
        """Call `copy(i)` once for each i in range(n), on the caller's thread and the copier's, and return
        when all n calls have returned. Raises the first exception a call raised (the others still run)."""
        if n < 2:
            for i in range(n):
                copy(i)
            return
        share = _Share(n, copy)
        self._start()
        self._tasks.put(share)
        share.work()
        share.wait()
        if share.error is not None:
            raise share.error

    def stop(self) -> None:
        """End the thread (after the shares queued before); `run` starts a new one if called again."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._tasks.put(None)
            thread.join()

    def _start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="datastates-copier", daemon=True)
                    self._thread.start()

    def _loop(self) -> None:
        # One intra-op thread, as the hashing workers: a copy here must not start a second thread pool.
        torch.set_num_threads(1)
        while (share := self._tasks.get()) is not None:
            share.work()
