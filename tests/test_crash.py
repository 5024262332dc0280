"""Crash safety: kill -9 a saver at random instants; every version it reported committed stays bit-exact.

`tests/helpers/saver.py crash` saves deterministic ~3 MiB states (a pure function of seed and step,
mixing unchanged, slowly changing and changing tensors, some changed in one chunk only) in a loop and
prints `COMMITTED <id> <step>` after each save returns. Most kills go to children forked by a
pre-imported zygote (`saver.py serve`), so a kill costs milliseconds rather than the seconds importing
torch takes; `test_kill_fresh_subprocess` kills a saver started from scratch with subprocess.

After each kill: the store opens, every committed version loads bit-exact and has its step, the branch
head is the last committed version or a descendant of it through versions committed but not yet
printed (each kill between moving the branch and printing leaves one),
`fsck(repair=True)` then `fsck()` reports ok, and the history of main is linear.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.procs import SAVER, Lines, Zygote
from helpers.states import CRASH_CHUNK, crash_state, state_digest

import datastates as ds


class Oracle:
    """Expected digests per step (regenerating a state costs more than hashing it)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._digests: dict[int, str] = {}

    def digest(self, step: int) -> str:
        if step not in self._digests:
            self._digests[step] = state_digest(crash_state(self.seed, step))
        return self._digests[step]


def verify(path: Path, oracle: Oracle, committed: list[tuple[str, int]]) -> None:
    """Check the store after a kill (see the module docstring)."""
    with ds.Store.open(path) as s:
        for vid, step in committed:
            v = s.version(vid)
            assert v.step == step and v.branch == "main"
            got = s.load(vid)
            assert state_digest(got) == oracle.digest(step), f"version {vid[:12]} (step {step}) differs"
        head = s.branches().get("main")
        if committed:
            last = committed[-1][0]
            assert head is not None
            # Linear history: first parents from the head pass through every committed version, in order.
            chain, vid = [], head
            while vid is not None:
                chain.append(vid)
                parents = s.version(vid).parents
                assert len(parents) <= 1
                vid = parents[0] if parents else None
            # Above the last announced version there may be unannounced ones: each kill between a commit and
            # its COMMITTED line leaves one, and two such kills in a row leave a chain of two.
            assert last in chain, "main lost a committed version"
            assert not set(chain[:chain.index(last)]) & {c for c, _ in committed}
            ids = [c for c, _ in committed]
            on_chain = [c for c in reversed(chain) if c in set(ids)]
            assert on_chain == ids
        first = s.fsck(repair=True)
        assert first.corrupt_chunks == []
        second = s.fsck()
        assert second.ok, second.problems
        assert second.repaired == []
        if committed:  # repair removed nothing a committed version needs
            vid, step = committed[-1]
            assert state_digest(s.load(vid)) == oracle.digest(step)


def crash_cycles(zygote: Zygote, path: Path, seed: int, kills: int, max_delay: float = 0.4) -> dict[str, int]:
    ds.Store.open(path, chunk_size=CRASH_CHUNK).close()
    rng = random.Random(seed)
    oracle = Oracle(seed)
    committed: list[tuple[str, int]] = []
    empty_kills = 0
    for cycle in range(kills):
        pid = zygote.start("crash", str(path), str(seed), str(cycle * 100_000))
        # The kill comes at a random offset after an event the saver reports, never after a fixed delay from
        # its start. Even cycles wait for READY (the kill may land in the first save); odd ones wait for the
        # first COMMITTED, so the cycles interrupt a running save loop however slow the machine is.
        word = "COMMITTED" if cycle % 2 else "READY"
        zygote.lines.wait(lambda pid=pid, word=word: zygote.lines.of(pid, word), 120, f"{word} from saver {pid}")
        time.sleep(rng.uniform(0.0, max_delay))  # the random kill offset, not a wait for the child
        status = zygote.kill(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"saver ended by itself: {status}"
        new = [(x[1], int(x[2])) for x in zygote.lines.of(pid, "COMMITTED")]
        empty_kills += not new
        committed += new
        verify(path, oracle, committed)
    return {"versions": len(committed), "empty_kills": empty_kills}


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_kill_during_saves(zygote: Zygote, tmp_path: Path, seed: int) -> None:
    """4 seeds x 5 kills = 20 kills in the default run."""
    result = crash_cycles(zygote, tmp_path / "store", seed, kills=5)
    assert result["versions"] >= 1  # the kills did interrupt a running save loop


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 106))
def test_kill_during_saves_sample_many(zygote: Zygote, tmp_path: Path, seed: int) -> None:
    """6 seeds x 20 kills = 120 kills; also sampled in CI (`-m slow -k sample`)."""
    result = crash_cycles(zygote, tmp_path / "store", seed, kills=20, max_delay=0.6)
    assert result["versions"] >= 10


def test_kill_fresh_subprocess(tmp_path: Path) -> None:
    """The same check with a saver started by subprocess (no zygote) and killed with SIGKILL."""
    path = tmp_path / "store"
    ds.Store.open(path, chunk_size=CRASH_CHUNK).close()
    oracle = Oracle(21)
    proc = subprocess.Popen([sys.executable, str(SAVER), "crash", str(path), "21", "0"], stdout=subprocess.PIPE)
    try:
        lines = Lines(proc.stdout)
        lines.wait(lambda: lines.of(proc.pid, "COMMITTED"), 120, "a first COMMITTED line")
        time.sleep(random.Random(21).uniform(0.05, 0.3))
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    lines.wait(lambda: lines.closed, 10, "end of the saver's output")
    committed = [(x[1], int(x[2])) for x in lines.of(proc.pid, "COMMITTED")]
    assert committed and [s for _, s in committed] == list(range(len(committed)))
    verify(path, oracle, committed)


# "record" is a regression test: fsck(repair=True) removed the never-indexed record but kept its manifest,
# so the next fsck() reported that manifest as a leftover.
POINTS = ["pack_add", "pack_seal", "manifest", "record", "catalog", "reflog"]


@pytest.mark.parametrize("point", POINTS)
def test_die_at_each_commit_step(zygote: Zygote, tmp_path: Path, point: str) -> None:
    """Deterministic crash points inside one save: the earlier version survives, fsck cleans up, saving resumes."""
    path = tmp_path / "store"
    ds.Store.open(path, chunk_size=CRASH_CHUNK).close()
    oracle = Oracle(31)
    pid = zygote.start("crashat", str(path), point, "31")
    status = zygote.exit_status(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 137, f"the child did not die at {point}: {status}"
    assert not zygote.lines.of(pid, "SURVIVED")
    committed = [(x[1], int(x[2])) for x in zygote.lines.of(pid, "COMMITTED")]
    assert len(committed) == 1
    verify(path, oracle, committed)
    with ds.Store.open(path) as s:
        head = s.version("main")
        if point in ("catalog", "reflog"):  # the version of step 1 was indexed before the process died
            assert head.step == (1 if point == "reflog" else 0)
            assert [v.step for v in s.log("main")] == ([1, 0] if point == "reflog" else [0])
        else:
            assert head.id == committed[0][0]
        v = s.save(crash_state(31, 2), step=2)
        assert v.parents == (head.id,)
        assert state_digest(s.load("main")) == oracle.digest(2)
        assert s.fsck().ok


_INTERRUPTED_CLOSE = r"""
import faulthandler, sys, threading, torch
import datastates as ds
from datastates.objects.tier import Tier
from datastates.save.pipeline import Pipeline

faulthandler.dump_traceback_later(120, exit=True)  # a hang ends in exit status 1, not in a hung test
path, mode = sys.argv[1], sys.argv[2]
gate = threading.Event()
write_record = Tier.write_record
def held(self, vid, data):  # the saves stay in flight until the close() is interrupted
    gate.wait()
    write_record(self, vid, data)
stop = Pipeline.stop
def announced(self):  # close() has begun (the store refuses new calls) and waits for the saves here
    print("DRAINING", flush=True)
    stop(self)
Pipeline.stop = announced
st = ds.Store.open(path)
st.save({"w": torch.zeros(4)}, step=0)
Tier.write_record = held
handles = [st.save_async({"w": torch.full((1 << 16,), float(i))}, step=i) for i in range(1, 7)]
try:
    st.close()
    print("close returned")
except KeyboardInterrupt:
    print("interrupted", flush=True)
    gate.set()
    if mode == "die":
        raise  # the process exits with the saves in flight: its exit drains them
    print("second close", st.close())
    for h in handles:
        print("handle", h.result().step)
"""


@pytest.mark.parametrize("mode", ["catch", "die"])
def test_ctrl_c_during_close_keeps_the_saves_in_flight(tmp_path: Path, mode: str) -> None:
    """A SIGINT while close() waited for six saves whose copies were taken: close() had marked the store closed,
    and its `finally` closed the files under the running pipeline: a second close() did nothing, every handle raised
    StoreClosedError, only step 0 was in the store, sometimes with a half-made version. Now the interrupted close()
    raises the KeyboardInterrupt and leaves the saves going with the files open; a second close() (or the exit's
    drain, when the interrupt ends the process) waits for them: every step is committed, and fsck finds nothing."""
    path = tmp_path / "store"
    script = tmp_path / "interrupted_close.py"
    script.write_text(_INTERRUPTED_CLOSE)
    proc = subprocess.Popen([sys.executable, str(script), str(path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if lines == ["DRAINING"]:  # the first close() only
                proc.send_signal(signal.SIGINT)
        err = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        proc.kill()
        proc.wait()
    if mode == "catch":
        assert proc.returncode == 0, err
        assert lines == ["DRAINING", "interrupted", "DRAINING", "second close None"] + [
            f"handle {i}" for i in range(1, 7)]
    else:
        assert proc.returncode == -signal.SIGINT, err
        assert lines[:2] == ["DRAINING", "interrupted"] and "KeyboardInterrupt" in err
    with ds.Store.open(path) as s:
        assert [v.step for v in s.log()] == [6, 5, 4, 3, 2, 1, 0]
        for v in s.log()[:-1]:
            assert torch.equal(s.load(v)["w"], torch.full((1 << 16,), float(v.step)))
        assert s.fsck().ok
        assert s.tier.leftovers() == []
