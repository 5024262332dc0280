"""Helper process for the crash and concurrency tests.

    saver.py crash STORE SEED STEP0
        open STORE, print READY, then save crash_state(SEED, step) on main for step = STEP0, STEP0+1, ...
        forever, printing `COMMITTED <id> <step>` (flushed) after each save returns.
    saver.py concurrent STORE NAME N GOFILE
        open STORE, print READY, wait until GOFILE exists, save N small states on main, printing
        `SAVED <id> <i>` after each, then close the store and exit 0.
    saver.py crashat STORE POINT SEED
        save step 0 (printing COMMITTED), then die with os._exit(137) at POINT inside the next save.
    saver.py commitfail STORE MODE
        make one save fail after its bytes are written, then save again (see `commitfail`).
    saver.py threadopen STORE N
        open STORE from N threads at once (ten rounds), then print DONE.
    saver.py serve
        a zygote: import torch and datastates once, then read commands (any of the above, without
        the script name) from stdin, one per line; fork a child for each and print `PID <pid> <command>`;
        when a child ends, print `EXIT <pid> <status>`; exit when stdin closes (after waiting for the
        children). Children write to the same stdout. Forking skips the seconds that importing torch
        takes, so a test can kill and restart a saver many times. The zygote itself never touches a
        store or runs a torch op, so its children start from a clean, single-threaded process.

Every line is `<pid of the writer> <WORD> ...` and is flushed as soon as it is written. A child of
`serve` never returns into the loop.
"""

from __future__ import annotations

import os
import select
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from states import concurrent_state, crash_state, snapshot_digest  # noqa: E402  (this folder is on sys.path)

import datastates as ds  # noqa: E402


def say(line: str) -> None:
    """Print `<pid> <line>` with one write(2): lines never interleave or sit in a buffer."""
    os.write(1, f"{os.getpid()} {line}\n".encode())


def crash(store_path: str, seed: str, step0: str) -> None:
    store = ds.Store.open(store_path)
    say("READY")
    step = int(step0)
    while True:
        v = store.save(crash_state(int(seed), step), branch="main", step=step, message=f"step {step}")
        say(f"COMMITTED {v.id} {step}")
        step += 1


def concurrent(store_path: str, name: str, n: str, gofile: str) -> None:
    store = ds.Store.open(store_path)
    say("READY")
    deadline = time.monotonic() + 60
    while not Path(gofile).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gofile} never appeared")
        time.sleep(0.002)
    for i in range(int(n)):
        state = concurrent_state(name, i)
        v = store.save(state, branch="main", step=i, message=f"{name} {i}")
        say(f"SAVED {v.id} {i}")
    store.close()


CRASH_POINTS = ("pack_add", "pack_seal", "manifest", "record", "catalog", "reflog")


def crashat(store_path: str, point: str, seed: str) -> None:
    """Save step 0, then die (os._exit(137), like kill -9) at `point` inside the save of step 1."""
    from datastates.meta import refs
    from datastates.objects import packs

    store = ds.Store.open(store_path)
    v = store.save(crash_state(int(seed), 0), branch="main", step=0)
    say(f"COMMITTED {v.id} 0")

    def die_after(obj: object, name: str) -> None:
        original = getattr(obj, name)

        def wrapper(*args: object, **kw: object) -> object:
            result = original(*args, **kw)
            os._exit(137)
            return result

        setattr(obj, name, wrapper)

    if point == "pack_add":  # mid-pack: the first chunk is in the .tmp file, the rest never comes
        die_after(packs.PackWriter, "append_stored")
    elif point == "pack_seal":
        die_after(packs.PackWriter, "seal")
    elif point == "manifest":
        die_after(store.tier, "write_manifest")
    elif point == "record":
        die_after(store.tier, "write_record")
    elif point == "catalog":  # indexed, but the branch not moved yet
        die_after(store.catalog, "commit")
    elif point == "reflog":  # the branch file moved, its reflog line not yet written
        original = refs.append_line
        refs.append_line = lambda *a: os._exit(137) if "logs" in str(a[0]) else original(*a)  # type: ignore
    else:
        raise ValueError(point)
    store.save(crash_state(int(seed), 1), branch="main", step=1)
    say("SURVIVED")


def commitfail(store_path: str, mode: str) -> None:
    """Make one save fail late, then save again.

    Modes: `enospc`: the manifest write hits a full disk; `longname`: a branch name that passes the name
    check but is too long for the file system; `refmove`: moving the branch fails (EIO) after the version
    was indexed, and the next save stores the very same tensors on another branch and loads them back.
    Prints `RESULT <outcome>` for the failing save, `NEXT <outcome>` for each of up to two later saves,
    where an outcome is `ok <id>`, `timeout` (no answer within 30 s) or the exception's class name, and
    `LOAD ok` / `LOAD <exception>` for loading the last good save, and `SNAP <digest>`: the
    `snapshot_digest` of the store right after the failed save. Exits with os._exit so a stuck
    background thread cannot hold the process.
    """
    import errno

    store = ds.Store.open(store_path)
    branch = "main"
    failing = {"t": torch.arange(1000.0)}
    following = {"t": torch.zeros(4)}
    if mode == "enospc":
        def full(*args: object) -> None:
            raise ds.StorageFullError(errno.ENOSPC, "no space left on device (injected by the test)")

        store.tier.write_manifest = full  # type: ignore[method-assign]
    elif mode == "longname":
        branch = "b" * 250
    elif mode == "refmove":
        def eio(*args: object, **kw: object) -> None:
            raise OSError(errno.EIO, "input/output error (injected by the test)")

        store.refs.set_if_equals = eio  # type: ignore[method-assign]
        following = failing
    else:
        raise ValueError(mode)

    def attempt(word: str, state: dict[str, object], branch: str) -> str | None:
        try:
            # A hang detector (a save of a few KiB takes milliseconds), generous for a fully loaded machine.
            v = store.save_async(state, branch=branch).result(timeout=30)
            say(f"{word} ok {v.id}")
            return v.id
        except TimeoutError:
            say(f"{word} timeout")
            os._exit(0)
        except BaseException as exc:
            say(f"{word} {type(exc).__name__}")
            return None

    attempt("RESULT", failing, branch)
    say(f"SNAP {snapshot_digest(Path(store_path))}")
    if mode == "enospc":
        del store.tier.write_manifest  # the disk has space again
    if mode == "refmove":
        del store.refs.set_if_equals
    for _ in range(2):
        vid = attempt("NEXT", following, "other" if mode == "refmove" else "main")
        if vid:
            try:
                ok = torch.equal(store.load(vid)["t"], following["t"])  # type: ignore[arg-type]
                say(f"LOAD {'ok' if ok else 'wrong-bytes'}")
            except BaseException as exc:
                say(f"LOAD {type(exc).__name__}")
            break
    os._exit(0)


def threadopen(store_path: str, n: str) -> None:
    """Open (and close) STORE from N threads at the same instant, ten rounds; print DONE."""
    import threading

    for _ in range(10):
        barrier = threading.Barrier(int(n))

        def opener(barrier: threading.Barrier) -> None:
            barrier.wait()
            ds.Store.open(store_path).close()

        threads = [threading.Thread(target=opener, args=(barrier,)) for _ in range(int(n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    say("DONE")


COMMANDS = {"crash": crash, "concurrent": concurrent, "crashat": crashat, "commitfail": commitfail,
            "threadopen": threadopen}


def run(argv: list[str]) -> None:
    COMMANDS[argv[0]](*argv[1:])


def serve() -> None:
    children: set[int] = set()
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.005)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                say(f"EXIT {pid} {status}")
        if not ready:
            continue
        data = os.read(0, 4096)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            argv = line.decode().split()
            if not argv:
                continue
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    run(argv)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            children.add(pid)
            say(f"PID {pid} {argv[0]}")
    for pid in children:
        _, status = os.waitpid(pid, 0)
        say(f"EXIT {pid} {status}")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        try:
            run(sys.argv[1:])
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
