"""The test side of `saver.py`: start it, read its tagged lines, kill its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SAVER = Path(__file__).with_name("saver.py")


class Lines:
    """Collects `<pid> <WORD> args...` lines from a pipe on a reader thread."""

    def __init__(self, stream: object) -> None:
        self.by_pid: dict[int, list[list[str]]] = {}
        self.order: list[tuple[int, list[str]]] = []
        self.closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            parts = raw.decode(errors="replace").split()
            if len(parts) < 2 or not parts[0].isdigit():
                continue
            with self._cv:
                self.by_pid.setdefault(int(parts[0]), []).append(parts[1:])
                self.order.append((int(parts[0]), parts[1:]))
                self._cv.notify_all()
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def of(self, pid: int, word: str | None = None) -> list[list[str]]:
        with self._cv:
            return [x for x in self.by_pid.get(pid, []) if word is None or x[0] == word]

    def wait(self, pred: object, timeout: float, what: str) -> object:
        """Wait until `pred()` returns something truthy; raise AssertionError naming `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = pred()  # type: ignore[operator]
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}; lines: {self.order[-20:]}")
                self._cv.wait(min(left, 0.1))


class Zygote:
    """A `saver.py serve` process: forks pre-imported savers on demand."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SAVER), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.lines = Lines(self.proc.stdout)
        self._started = 0

    def start(self, *argv: str, timeout: float = 60) -> int:
        """Fork a child running `saver.py <argv>`; return its pid."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((" ".join(argv) + "\n").encode())
        self.proc.stdin.flush()
        self._started += 1
        n = self._started
        got = self.lines.wait(lambda: len(self.lines.of(self.proc.pid, "PID")) >= n, timeout, "PID from the zygote")
        assert got
        return int(self.lines.of(self.proc.pid, "PID")[n - 1][1])

    def exit_status(self, pid: int, timeout: float = 60) -> int:
        """Wait for the child to end; its raw wait status."""
        def done() -> list[list[str]]:
            return [x for x in self.lines.of(self.proc.pid, "EXIT") if int(x[1]) == pid]

        got = self.lines.wait(done, timeout, f"EXIT of child {pid}")
        return int(got[0][2])  # type: ignore[index]

    def kill(self, pid: int) -> int:
        """SIGKILL a child this zygote forked; return its wait status once reaped."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended by itself and was reaped; its EXIT line says how
        return self.exit_status(pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
