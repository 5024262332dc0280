"""A real `python -m server` (uvicorn) on 127.0.0.1 in a subprocess, for the server tests.

The port is 0 (the kernel picks a free one); the helper reads the address
from uvicorn's startup line on stderr, then waits for GET /healthz to answer
200, both with a bounded timeout and no fixed sleeps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
_RUNNING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


class ServerProc:
    """`with ServerProc(store_path, token_file=...) as srv: httpx.get(srv.url + "/healthz")`."""

    def __init__(self, store: Path | str, *, token_file: Path | None = None, workers: int = 1,
                 cors_origin: str | None = None, timeout: float = 60.0) -> None:
        self.store, self.token_file, self.workers, self.cors_origin = store, token_file, workers, cors_origin
        self.timeout = timeout
        self.url = ""
        self.log: list[str] = []
        self._found = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProc:
        cmd = [sys.executable, "-m", "server", "--store", str(self.store), "--host", "127.0.0.1", "--port", "0",
               "--workers", str(self.workers)]
        if self.token_file is not None:
            cmd += ["--token-file", str(self.token_file)]
        if self.cors_origin:
            cmd += ["--cors-origin", self.cors_origin]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            if not self._found.wait(self.timeout) or not self.url:
                raise AssertionError("server did not report its address:\n" + "\n".join(self.log[-30:]))
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.log.append(line)
            m = _RUNNING.search(line)
            if m and not self.url:
                self.url = m.group(1)
                self._found.set()
        self._found.set()  # the process ended: stop waiting

    def wait_healthy(self) -> None:
        """Poll /healthz until every worker can answer (bounded by the timeout)."""
        deadline = time.monotonic() + self.timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n" + "\n".join(self.log[-30:]))
            try:
                if httpx.get(self.url + "/healthz", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("server never answered /healthz:\n" + "\n".join(self.log[-30:]))
            self._found.wait(0.05)  # a short bounded pause between polls; the event is already set

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def api(self) -> str:
        return self.url + "/api/v1"
