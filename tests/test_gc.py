"""Garbage collection: dead packs go, sparse packs are repacked, live versions stay bit-exact, even through kill -9."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import states

from datastates import NotFoundError, PrunedError, Store
from datastates.base.config import Flush, human_bytes
from datastates.cli.maintenance import add_parsers, run
from datastates.maintenance.gc import GcReport, gc
from datastates.objects.packs import list_packs, read_index
from datastates.repo.repository import as_repository
from datastates.retention import KeepEvery, KeepLatest, Retention, prune

CHUNK = 1024


def open_store(path: Path, chunk_size: int = CHUNK) -> Store:
    return Store.open(path, chunk_size=chunk_size, pool_bytes=32 << 20)


def tensor(k: int, epoch: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(k * 100_003 + epoch)
    return torch.randn(n, generator=g)


def state_at(step: int, tensors: int, n: int) -> dict[str, torch.Tensor]:
    """Tensor k changes every k+1 steps, so a version's pack holds chunks that later versions keep sharing."""
    return {f"t{k}": tensor(k, step // (k + 1), n) for k in range(tensors)}


def build(path: Path, steps: int, tensors: int, n: int, chunk_size: int = CHUNK) -> dict[str, int]:
    """A store of `steps` versions on main; returns id -> step."""
    made = {}
    with open_store(path, chunk_size) as s:
        for step in range(steps):
            made[s.save(state_at(step, tensors, n), step=step).id] = step
    return made


def tree_bytes(*dirs: Path) -> int:
    return sum(p.stat().st_size for d in dirs if d.is_dir() for p in d.rglob("*") if p.is_file())


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (lock files aside, the catalog's data file included) and a digest of its bytes."""
    return states.snapshot(root, with_catalog=True)


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and a[k].view(torch.uint8).numpy().tobytes() == b[k].view(torch.uint8).numpy().tobytes() for k in a)


def check_live_versions(s: Store, made: dict[str, int], tensors: int, n: int) -> int:
    """Every version not pruned loads bit-exact; every pruned one raises PrunedError. Returns the live count."""
    live = 0
    for vid, step in made.items():
        if s.version(vid).pruned:
            with pytest.raises(PrunedError):
                s.load(vid)
        else:
            assert same_bytes(s.load(vid), state_at(step, tensors, n)), f"version at step {step} differs"
            live += 1
    return live


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("gc") / "store"
    return path, build(path, steps=12, tensors=4, n=2048)


@pytest.fixture
def store_made(template: tuple[Path, dict[str, int]], tmp_path: Path) -> Iterator[tuple[Store, dict[str, int]]]:
    path = tmp_path / "store"
    shutil.copytree(template[0], path)
    with open_store(path) as s:
        yield s, template[1]


def test_gc_with_nothing_pruned_changes_nothing(store_made: tuple[Store, dict[str, int]]) -> None:
    s, made = store_made
    before = snapshot(s.path)
    rep = gc(s)
    assert rep.packs_deleted == () and rep.packs_repacked == () and rep.manifests_deleted == 0
    assert rep.bytes_freed == {s.tier.name: 0} and rep.chunks_dropped == 0
    assert snapshot(s.path) == before


def test_gc_after_prune_frees_bytes_and_live_versions_load_bit_exact(store_made: tuple[Store, dict[str, int]]) -> None:
    s, made = store_made
    p = prune(s, Retention(KeepEvery(4)))
    assert len(p.prune) == 12 - 4  # kept: steps 0, 4, 8 and the head 11
    packs_before = tree_bytes(s.path / "packs")
    total_before = tree_bytes(s.path / "packs", s.path / "manifests")
    manifests_before = len(list((s.path / "manifests").rglob("*.arrow")))
    rep = gc(s)
    assert tree_bytes(s.path / "packs") < packs_before
    assert total_before - tree_bytes(s.path / "packs", s.path / "manifests") == rep.total_freed > 0
    manifests_after = len(list((s.path / "manifests").rglob("*.arrow")))
    assert rep.manifests_deleted == len(p.prune) == manifests_before - manifests_after
    assert len(rep.packs_deleted) > 0
    assert check_live_versions(s, made, 4, 2048) == 4
    assert s.fsck().ok
    for vid in p.prune:  # records and lineage stay
        assert s.tier.record_path(vid).exists() and s.version(vid).pruned
    assert set(p.prune) <= set(s.ancestors("main"))


def test_gc_dry_run_changes_nothing_and_predicts_the_real_run(store_made: tuple[Store, dict[str, int]]) -> None:
    s, made = store_made
    prune(s, Retention(KeepEvery(3)))
    before = snapshot(s.path)
    dry = gc(s, dry_run=True)
    assert snapshot(s.path) == before
    assert dry.dry_run and dry.total_freed > 0 and (dry.packs_deleted or dry.packs_repacked)
    real = gc(s)
    assert not real.dry_run
    for name in ("packs_deleted", "packs_repacked", "packs_written", "bytes_written", "manifests_deleted",
                 "chunks_live", "chunks_dropped", "bytes_freed", "skipped"):
        assert getattr(dry, name) == getattr(real, name), name
    assert snapshot(s.path) != before


def test_gc_twice_finds_nothing_the_second_time(store_made: tuple[Store, dict[str, int]]) -> None:
    s, made = store_made
    prune(s, Retention(KeepLatest(2)))
    first = gc(s, repack_threshold=1.0)
    second = gc(s, repack_threshold=1.0)
    assert first.total_freed > 0
    assert second == GcReport(False, chunks_live=first.chunks_live, bytes_freed={s.tier.name: 0})


def test_sparse_pack_is_repacked_and_the_sharing_version_stays_bit_exact(tmp_path: Path) -> None:
    ten = {f"t{k}": tensor(k, 0, 1024) for k in range(10)}  # 4 KiB each: 4 chunks of 1 KiB
    with open_store(tmp_path / "s") as s:
        first = s.save(ten, step=0)
        later_state = {"t0": ten["t0"], "t1": ten["t1"]}
        later = s.save(later_state, step=1)
        assert later.bytes_new == 0
        (old_pack,) = [p.name.removesuffix(".pack") for p in list_packs(s.path / "packs")]
        old_size = s.tier.pack_path(old_pack).stat().st_size
        prune(s, Retention(KeepLatest(1)))
        assert s.version(first).pruned
        manifest_size = s.tier.manifest_path(first.manifests["0"]).stat().st_size
        rep = gc(s)
        assert rep.packs_repacked == (old_pack,) and rep.packs_deleted == () and rep.packs_written == 1
        assert rep.chunks_dropped == 8 * 4 and rep.chunks_live == 2 * 4
        packs = [p.name.removesuffix(".pack") for p in list_packs(s.path / "packs")]
        assert len(packs) == 1 and packs[0] != old_pack
        new_size = s.tier.pack_path(packs[0]).stat().st_size
        assert new_size < old_size / 4 and rep.total_freed == old_size - new_size + manifest_size
        assert {loc.pack for _, loc in s.catalog.iter_chunks()} == {packs[0]}
        assert same_bytes(s.load(later), later_state)
        assert s.fsck().ok
        # A chunk gc dropped is written again by a save that needs it, never deduplicated against a gone pack.
        again = s.save({"t5": ten["t5"]}, step=2)
        assert again.bytes_new == ten["t5"].nbytes
        assert same_bytes(s.load(again), {"t5": ten["t5"]})


def test_a_save_after_gc_writes_again_what_its_last_commit_named_and_gc_dropped(tmp_path: Path) -> None:
    # A save looks up no chunk that is what the store last committed under the same key, as long as no chunk
    # has left the index since (the catalog's drop token). gc dropping those chunks changes the token: the
    # next save of the same bytes looks them up, finds them gone and writes them again.
    ten = {f"t{k}": tensor(k, 0, CHUNK // 4) for k in range(6)}  # one chunk each: their stats are remembered
    with open_store(tmp_path / "s") as s:
        first = s.save(ten, step=0)
        s.save({"other": tensor(99, 0, 16)}, step=1)
        token = s.catalog.chunk_drops()
        prune(s, Retention(KeepLatest(1)))
        assert s.version(first).pruned
        rep = gc(s)
        assert rep.chunks_dropped == 6 and s.catalog.chunk_drops() != token
        again = s.save(ten, step=2)
        assert again.bytes_new == sum(t.nbytes for t in ten.values())
        assert same_bytes(s.load(again), ten)
        assert s.fsck().ok


def test_threshold_zero_never_repacks(tmp_path: Path) -> None:
    ten = {f"t{k}": tensor(k, 0, 1024) for k in range(10)}
    with open_store(tmp_path / "s") as s:
        s.save(ten, step=0)
        later = s.save({"t0": ten["t0"]}, step=1)
        before = sorted(p.name for p in list_packs(s.path / "packs"))
        prune(s, Retention(KeepLatest(1)))
        rep = gc(s, repack_threshold=0.0)
        assert rep.packs_repacked == () and rep.packs_deleted == () and rep.manifests_deleted == 1
        assert sorted(p.name for p in list_packs(s.path / "packs")) == before
        assert same_bytes(s.load(later), {"t0": ten["t0"]})
        # The dead chunks stay indexed (their pack is still there), so a save may reuse them: no bytes written.
        again = s.save({"t7": ten["t7"]}, step=2)
        assert again.bytes_new == 0 and same_bytes(s.load(again), {"t7": ten["t7"]})
        assert s.fsck().ok


def test_gc_keeps_a_manifest_a_fork_still_names(tmp_path: Path) -> None:
    state = {"w": tensor(0, 0, 4096)}
    with open_store(tmp_path / "s") as s:
        original = s.save(state, step=0)
        fork = s.fork(original, branch="copy")
        s.save({"w": tensor(0, 1, 4096)}, step=1)
        p = prune(s, Retention(KeepLatest(1)))
        assert p.prune == {original.id}
        rep = gc(s)
        assert rep.manifests_deleted == 0 and rep.packs_deleted == ()
        assert s.tier.manifest_path(original.manifests["0"]).exists()
        assert same_bytes(s.load(fork), state)
        with pytest.raises(PrunedError):
            s.load(original)


def test_gc_keeps_chunks_of_a_record_a_crash_left_out_of_the_catalog(tmp_path: Path) -> None:
    a, b = {"a": tensor(0, 0, 4096)}, {"b": tensor(1, 0, 4096)}
    with open_store(tmp_path / "s") as s:
        first = s.save(a, step=0)
        s.save(b, step=1)
        renamed = {"a2": a["a"]}
        late = s.save(renamed, branch=None, step=2)  # another manifest, every chunk deduplicated against the first
        assert late.bytes_new == 0 and late.manifests != first.manifests
        s.catalog.drop_version(late.id, list(late.parents))  # as if it died between record and catalog
        p = prune(s, Retention(KeepLatest(1)))
        assert p.prune == {first.id}
        rep = gc(s)
        assert rep.packs_deleted == () and rep.manifests_deleted == 1
        s.fsck(repair=True)  # indexes the record the catalog missed
        assert same_bytes(s.load(late.id), renamed)
        assert s.fsck().ok


def test_gc_refuses_to_guess_when_a_live_manifest_is_missing(store_made: tuple[Store, dict[str, int]]) -> None:
    s, made = store_made
    prune(s, Retention(KeepEvery(4)))
    head = s.version("main")
    s.tier.manifest_path(head.manifests["0"]).unlink()
    before = snapshot(s.path)
    with open_store(s.path) as fresh, pytest.raises(NotFoundError, match="gc stopped before changing anything"):
        gc(fresh)  # a fresh handle: nothing of the manifest cached in memory
    assert snapshot(s.path) == before


def test_gc_rejects_a_threshold_outside_zero_one(store_made: tuple[Store, dict[str, int]]) -> None:
    s, _ = store_made
    with pytest.raises(ValueError):
        gc(s, repack_threshold=1.5)
    with pytest.raises(ValueError):
        gc(s, repack_threshold=-0.1)


def test_rebuilt_catalog_after_gc_keeps_pruned_marks(store_made: tuple[Store, dict[str, int]]) -> None:
    s, made = store_made
    p = prune(s, Retention(KeepEvery(4)))
    gc(s)
    rep = s.fsck(rebuild=True)
    assert rep.ok, rep.problems
    assert s.catalog.pruned_ids() == set(p.prune)
    assert check_live_versions(s, made, 4, 2048) == 4


def tiered_store(root: Path, flush: Flush) -> tuple[Store, list[str], list[dict[str, torch.Tensor]]]:
    s = Store.open(root / "cold", hot=root / "hot", chunk_size=CHUNK, pool_bytes=32 << 20, flush=flush)
    states = [{"w": tensor(0, i, 2048), "shared": tensor(1, 0, 512)} for i in range(6)]
    ids = [s.save(st, step=i).id for i, st in enumerate(states)]
    assert s.flush(timeout=60)
    return s, ids, states


def test_gc_on_a_tiered_store_frees_hot_then_cold_past_the_grace_age(tmp_path: Path) -> None:
    s, ids, states = tiered_store(tmp_path, Flush())
    try:
        assert all(s.where(v) == ["hot", "cold"] for v in ids)
        p = prune(s, Retention(KeepLatest(2)))
        assert p.prune == set(ids[:4])
        cold_packs = snapshot(tmp_path / "cold" / "packs")
        hot = (tmp_path / "hot" / "packs", tmp_path / "hot" / "manifests")
        hot_before, cold_before = tree_bytes(*hot), tree_bytes(tmp_path / "cold" / "manifests")
        rep = gc(s, repack_threshold=1.0)  # default grace: cold packs this young stay
        assert snapshot(tmp_path / "cold" / "packs") == cold_packs
        assert hot_before - tree_bytes(*hot) == rep.bytes_freed["hot"] > 0
        assert rep.bytes_freed["cold"] == cold_before - tree_bytes(tmp_path / "cold" / "manifests") > 0
        assert rep.packs_repacked == ()  # never on cold: other hosts' catalogs point into its packs
        assert rep.chunks_dropped == 0  # the cold copies keep the catalog entries valid
        assert len(rep.packs_deleted) == 3  # the first pack also holds the shared tensor: live, kept
        assert rep.manifests_deleted == 2 * 4  # the pruned versions' manifests, on hot and on cold

        dry = gc(s, dry_run=True, cold_grace_s=0)
        assert snapshot(tmp_path / "cold" / "packs") == cold_packs
        cold_before = tree_bytes(tmp_path / "cold" / "packs")
        rep = gc(s, cold_grace_s=0)
        assert rep.packs_deleted == dry.packs_deleted and len(rep.packs_deleted) == 3
        assert rep.bytes_freed == dry.bytes_freed == {"hot": 0, "cold": cold_before - tree_bytes(tmp_path / "cold" /
                                                                                                   "packs")}
        assert rep.bytes_freed["cold"] > 0
        assert len(list(list_packs(tmp_path / "cold" / "packs"))) == len(cold_packs) - 3
        assert rep.chunks_dropped == 3 * 8  # no copy left on any tier: the catalog forgets the dead chunks
        for vid, st in zip(ids[4:], states[4:]):
            assert same_bytes(s.load(vid), st)
        assert s.fsck().ok
    finally:
        s.close()
    # A host with an empty hot tier loads what was kept from cold alone.
    with Store.open(tmp_path / "cold", hot=tmp_path / "hot2", chunk_size=CHUNK, pool_bytes=32 << 20) as s2:
        for vid, st in zip(ids[4:], states[4:]):
            assert same_bytes(s2.load(vid), st)
        with pytest.raises(PrunedError):
            s2.load(ids[0])
        assert s2.fsck().ok


def test_gc_on_a_tiered_store_forgets_packs_that_never_reached_cold(tmp_path: Path) -> None:
    s, ids, states = tiered_store(tmp_path, Flush(tagged_only=True))
    try:
        assert all(s.where(v) == ["hot"] for v in ids)
        prune(s, Retention(KeepLatest(2)))
        rep = gc(s)
        assert len(rep.packs_deleted) == 3 and rep.chunks_dropped == 3 * 8  # each: the 8 chunks of "w"
        assert not any((tmp_path / "cold" / "packs").glob("*.pack"))
        for vid, st in zip(ids[4:], states[4:]):
            assert same_bytes(s.load(vid), st)
        assert s.fsck().ok
    finally:
        s.close()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="datastates")
    add_parsers(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_cli_gc_prints_bytes_freed_human_readable(store_made: tuple[Store, dict[str, int]],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    s, _ = store_made
    prune(s, Retention(KeepEvery(4)))
    before = snapshot(s.path)
    assert run(s, parse(["gc", "--dry-run", "--repack-threshold", "0.3"])) == 0
    dry_out = capsys.readouterr().out
    assert snapshot(s.path) == before
    expected = gc(s, dry_run=True, repack_threshold=0.3)
    assert f"would free {human_bytes(expected.total_freed)} (hot: " in dry_out
    assert run(s, parse(["gc", "--repack-threshold", "0.3"])) == 0
    assert f"freed {human_bytes(expected.total_freed)}" in capsys.readouterr().out
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(10) == "10 B" and human_bytes(3 << 20) == "3.0 MiB"
    with pytest.raises(SystemExit):
        parse(["gc", "--repack-threshold", "2"])


# kill -9 -------------------------------------------------------------------------------------------------------
CRASH_STEPS, CRASH_TENSORS, CRASH_N, CRASH_CHUNK = 40, 8, 4096, 256
"""Small chunks make gc long enough (many packs, thousands of catalog moves) to be cut at many points."""
CRASH_LIVE = 8  # KeepEvery(6) keeps steps 0, 6, ..., 36; the head 39 stays too

# A fork server: torch is imported once, then each trial is a forked process that runs gc until killed.
# The server reaps a trial only when told, so the pid the test kills cannot have been reused meanwhile.
_SERVER = """
import os, sys, traceback
from datastates import Store
from datastates.maintenance.gc import gc
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "reap":
        _, status = os.waitpid(int(args[0]), 0)
        print(f"reaped {status}", flush=True)
        continue
    path, chunk = args
    if os.fork() == 0:
        code = 0
        try:
            s = Store.open(path, chunk_size=int(chunk), pool_bytes=32 << 20)
            print(f"started {os.getpid()}", flush=True)
            gc(s)
            s.close()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
"""


@pytest.fixture(scope="module")
def crash_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int], float]:
    """A pruned, not yet collected store (dead and sparse packs) and how long one gc of it takes here."""
    path = tmp_path_factory.mktemp("crash") / "store"
    made = build(path, CRASH_STEPS, CRASH_TENSORS, CRASH_N, CRASH_CHUNK)
    with open_store(path, CRASH_CHUNK) as s:
        prune(s, Retention(KeepEvery(6)))
    probe = path.parent / "probe"
    shutil.copytree(path, probe)
    with open_store(probe, CRASH_CHUNK) as s:
        t0 = time.perf_counter()
        rep = gc(s)
        took = time.perf_counter() - t0
    shutil.rmtree(probe)
    assert rep.packs_deleted and rep.packs_repacked  # the kills below land among both kinds of step
    return path, made, took


class GcServer:
    """Runs gc in forked children of one long-lived interpreter and SIGKILLs them on demand."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the gc server died; see its stderr above"
        return line.strip()

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def gc_killed_after(self, path: Path, delay: float) -> int:
        """Start gc on `path`, SIGKILL it `delay` seconds after it began; return its wait status."""
        self._send(f"run {path} {CRASH_CHUNK}")
        started = self._line()
        assert started.startswith("started "), started
        pid = int(started.split()[1])
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # our own child's child, not yet reaped: the pid is still its
        self._send(f"reap {pid}")
        reaped = self._line()
        assert reaped.startswith("reaped "), reaped
        return int(reaped.split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def check_after_crash(path: Path, made: dict[str, int]) -> None:
    with open_store(path, CRASH_CHUNK) as s:
        # Before any repair: the crash alone must not have cost a live version anything.
        assert check_live_versions(s, made, CRASH_TENSORS, CRASH_N) == CRASH_LIVE
        s.fsck(repair=True)
        rep = s.fsck()
        assert rep.ok, rep.problems
        gc(s)  # a later gc finishes the job
        assert s.fsck().ok
        assert check_live_versions(s, made, CRASH_TENSORS, CRASH_N) == CRASH_LIVE


def crash_loop(template: tuple[Path, dict[str, int], float], workdir: Path, trials: int) -> int:
    """Kill gc at stratified random moments over (1.5x) its measured duration, on a fresh copy each time.

    Returns how many trials were killed before gc finished (the others ran to the end first).
    """
    path, made, took = template
    seed = int(os.environ.get("DATASTATES_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    server = GcServer()
    cut = 0
    try:
        for i in range(trials):
            copy = workdir / f"trial{i}"
            shutil.copytree(path, copy)
            # 1.5x: a forked run is slower than the warm probe, and its last steps must be hit too.
            delay = 1.5 * took * (i + rng.random()) / trials
            status = server.gc_killed_after(copy, delay)
            assert not (os.WIFEXITED(status) and os.WEXITSTATUS(status)), f"gc failed in trial {i}; see stderr"
            cut += os.WIFSIGNALED(status)
            try:
                check_after_crash(copy, made)
            except AssertionError as exc:
                raise AssertionError(f"trial {i}, killed after {delay:.3f}s of a {took:.3f}s gc (seed {seed}): "
                                     f"{exc}") from exc
            shutil.rmtree(copy)
    finally:
        server.close()
    return cut


def test_sigkill_during_gc_leaves_every_live_version_loadable(
        crash_template: tuple[Path, dict[str, int], float], tmp_path: Path) -> None:
    crash_loop(crash_template, tmp_path, trials=6)


@pytest.mark.slow
def test_sigkill_during_gc_sample_many_kills(crash_template: tuple[Path, dict[str, int], float],
                                            tmp_path: Path) -> None:
    crash_loop(crash_template, tmp_path, trials=24)


def test_the_drop_token_changes_exactly_when_chunk_entries_can_leave_the_index(tmp_path: Path) -> None:
    # Saves trust chunks their last commit named while the token read then is unchanged: a save, a commit or
    # a read leaves it as it is; forgetting a pack (gc, repair, refresh) and emptying the index (rebuild) change it.
    with open_store(tmp_path / "s") as s:
        cat = s.catalog
        assert cat.chunk_drops() == b""  # no chunk ever left
        v = s.save({"t": tensor(1, 0, 1024)})
        s.load(v)
        assert cat.chunk_drops() == b""
        (pack,) = [p.name.removesuffix(".pack") for p in list_packs(s.path / "packs")]
        assert cat.drop_pack(pack) == 4 and cat.chunk_drops() != b""
        after_drop = cat.chunk_drops()
        assert cat.drop_pack(pack) == 0 and cat.chunk_drops() != after_drop  # nothing left, still a new token
        before_clear = cat.chunk_drops()
        cat.clear()
        assert cat.chunk_drops() not in (b"", before_clear)


def test_fsck_still_removes_debris_after_prune_and_gc(tmp_path: Path) -> None:
    """gc deletes pruned versions' manifests by design; fsck took each as 'no intact copy', so it kept the debris
    of interrupted saves on every store that had ever been collected, with a note saying what it needed was
    unknown."""
    with Store.open(tmp_path / "store") as s:
        for i in range(4):
            s.save({"w": torch.full((1000,), float(i))}, step=i)
        s.prune(KeepLatest(1))
        s.gc()
        with Store.open(tmp_path / "other") as o:  # a save's pack and manifest, as if its record never came
            o.save({"x": torch.arange(5000.0)})
        debris = []
        for sub in ("packs", "manifests"):
            for p in (tmp_path / "other" / sub).rglob("*.*"):
                q = tmp_path / "store" / p.relative_to(tmp_path / "other")
                q.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(p, q)
                debris.append(q)
        rep = s.fsck(repair=True)
        assert rep.problems == [] and rep.notes == [] and len(rep.repaired) == 2
        assert not any(p.exists() for p in debris) and s.fsck().ok
        assert float(s.load("main")["w"][0]) == 3.0


def _sealed_unindexed_copy(s: Store, pack: str) -> str:
    """What a gc killed between sealing a repacked pack and indexing it leaves (as `_repack` writes it): a new
    sealed pack holding the chunks of `pack`, named by no catalog entry. Returns its id."""
    tier = as_repository(s).tier
    w = tier.new_pack()
    for cid, loc in read_index(tier.pack_path(pack)):
        w.add(cid, tier.reader.read(loc), loc.raw_length, loc.codec)
    w.seal()
    return w.id


def test_fsck_repair_removes_the_pack_a_gc_killed_before_indexing_it_left(
        store_made: tuple[Store, dict[str, int]]) -> None:
    """kill -9 of gc right after a repacked pack was sealed left a pack no catalog entry names, every chunk of it
    located (intact) in another pack. fsck and fsck --repair only said "`datastates gc` frees it", but gc judges
    the packs the catalog knows: the second copy stayed forever. Now fsck --repair removes it."""
    s, made = store_made
    packs = s.path / "packs"
    live_bytes = tree_bytes(packs)
    biggest = max(list_packs(packs), key=lambda p: p.stat().st_size).name.removesuffix(".pack")
    dup = _sealed_unindexed_copy(s, biggest)
    assert tree_bytes(packs) > live_bytes
    rep = s.fsck()
    assert rep.ok and any(dup in n and "`datastates fsck --repair` removes it" in n for n in rep.notes)
    gc(s)
    assert (packs / f"{dup}.pack").exists()  # gc judges the packs the catalog knows: not this one
    rep = s.fsck(repair=True)
    assert any(dup in r and "removed" in r for r in rep.repaired)
    assert not (packs / f"{dup}.pack").exists() and tree_bytes(packs) == live_bytes
    assert check_live_versions(s, made, tensors=4, n=2048) == len(made)
    rep = s.fsck()
    assert rep.ok and not any(dup in n for n in rep.notes)


def test_fsck_repair_keeps_an_unindexed_pack_holding_the_only_intact_copy(
        store_made: tuple[Store, dict[str, int]]) -> None:
    """The same unindexed copy, but a chunk is corrupt where the catalog locates it: that copy is the only good
    one. fsck --repair indexes it again (the versions needing the chunk load) and never removes it."""
    s, made = store_made
    packs = s.path / "packs"
    biggest = max(list_packs(packs), key=lambda p: p.stat().st_size).name.removesuffix(".pack")
    dup = _sealed_unindexed_copy(s, biggest)
    _, loc = read_index(packs / f"{biggest}.pack")[0]
    with open(packs / f"{biggest}.pack", "r+b") as f:  # one flipped byte in the located copy
        f.seek(loc.offset)
        b = f.read(1)
        f.seek(loc.offset)
        f.write(bytes([b[0] ^ 0xFF]))
    s.fsck(repair=True)
    assert (packs / f"{dup}.pack").exists()
    assert check_live_versions(s, made, tensors=4, n=2048) == len(made)


def test_fsck_repair_keeps_an_unindexed_copy_when_the_located_one_cannot_be_read(
        store_made: tuple[Store, dict[str, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails (EIO) says nothing of the bytes: the located copy may be gone, and the unindexed one the
    only one left. fsck --repair removes an unindexed duplicate only when every located copy read back intact
    (a review: a failed read counted as intact there)."""
    import errno

    from datastates.objects.packs import PackReader

    s, made = store_made
    packs = s.path / "packs"
    biggest = max(list_packs(packs), key=lambda p: p.stat().st_size).name.removesuffix(".pack")
    dup = _sealed_unindexed_copy(s, biggest)

    def failing(self: PackReader, loc: object) -> bytes:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(PackReader, "read", failing)
    s.fsck(repair=True)
    monkeypatch.undo()
    assert (packs / f"{dup}.pack").exists()
    assert check_live_versions(s, made, tensors=4, n=2048) == len(made)
