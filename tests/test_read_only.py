"""A store opened read-only: `Store.open(..., read_only=True)`, and a store the user may not write, which opens so by
itself (as `git log` works in a repository one may only read). Loads and queries work; every call that would write
raises ReadOnlyStoreError and changes no file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.states import snapshot

import datastates as ds
from datastates.retention import KeepLatest

REPO = Path(__file__).resolve().parents[1]


def _state(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(64, dtype=torch.float32) + i, "b": torch.full((8,), float(i))}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "store"
    with ds.Store.open(path) as s:
        vids = [s.save(_state(i), step=i).id for i in range(3)]
        s.tag("first", vids[0])
    return path, vids


def test_read_only_store_loads_and_refuses_every_write(saved: tuple[Path, list[str]]) -> None:
    path, vids = saved
    before = snapshot(path, with_catalog=True)
    s = ds.Store.open(path, read_only=True)
    try:
        assert s.read_only is True
        got = s.load("first")
        assert torch.equal(got["w"], _state(0)["w"])
        assert [v.id for v in s.log("main")] == vids[::-1]
        assert s.fsck().ok
        assert s.gc(dry_run=True).packs_deleted == ()  # a dry run reads only
        s.prune(KeepLatest(1), dry_run=True)
        writes = {
            "save": lambda: s.save(_state(9)),
            "save_async": lambda: s.save_async(_state(9)),
            "tag": lambda: s.tag("t2", vids[1]),
            "delete_tag": lambda: s.delete_tag("first"),
            "branch": lambda: s.branch("b", vids[1]),
            "delete_branch": lambda: s.delete_branch("main", force=True),
            "annotate": lambda: s.annotate(vids[0], note="x"),
            "fork": lambda: s.fork(vids[0], branch="f"),
            "prune": lambda: s.prune(KeepLatest(1)),
            "gc": lambda: s.gc(),
            "fsck --repair": lambda: s.fsck(repair=True),
            "fsck --rebuild": lambda: s.fsck(rebuild=True),
            "refresh": lambda: s.refresh(),
            "stage": lambda: s.stage(_state(9)),
            "reserve": lambda: s.reserve(_state(9)),
        }
        for name, call in writes.items():
            with pytest.raises(ds.ReadOnlyStoreError, match="read_only=True") as info:
                call()
            assert str(path) in str(info.value), name
        assert s.flush(vids[0]) is True  # one tier: nothing to flush, as on a writable store
        assert s.tags() == {"first": vids[0]}
        assert s.branches() == {"main": vids[2]}
    finally:
        s.close()
    assert snapshot(path, with_catalog=True) == before
    with ds.Store.open(path) as s:  # and a later open for writing works as before
        assert s.read_only is False
        assert s.save(_state(5)).parents == (vids[2],)


def test_read_only_open_of_nothing_and_of_a_store_without_catalog(tmp_path: Path,
                                                                  saved: tuple[Path, list[str]]) -> None:
    with pytest.raises(ds.NotFoundError, match="no store at"):
        ds.Store.open(tmp_path / "none", read_only=True)
    assert not (tmp_path / "none").exists()
    path, _ = saved
    shutil.rmtree(path / "catalog")
    with pytest.raises(ds.StoreFormatError, match="has no catalog"):
        ds.Store.open(path, read_only=True)
    assert not (path / "catalog").exists()
    with ds.Store.open(path) as s:  # what the message says: a writable open rebuilds it
        assert len(s.log("main")) == 3


def test_open_for_writing_while_open_read_only_in_this_process(saved: tuple[Path, list[str]]) -> None:
    path, vids = saved
    with ds.Store.open(path, read_only=True):
        with pytest.raises(ds.ReadOnlyStoreError, match="open read-only in this process"):
            ds.Store.open(path)
        with ds.Store.open(path, read_only=True) as again:  # a second read-only handle shares it
            assert again.resolve("first") == vids[0]
    with ds.Store.open(path) as s:
        with ds.Store.open(path, read_only=True) as ro:  # read-only beside a writer in this process
            assert ro.read_only and not s.read_only
            with pytest.raises(ds.ReadOnlyStoreError):
                ro.tag("t3", vids[1])
        s.tag("t3", vids[1])
        assert s.tags()["t3"] == vids[1]


def test_read_only_two_tier_reads_cold_without_promoting(tmp_path: Path) -> None:
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot, flush=ds.Flush(every=1)) as s:
        vid = s.save(_state(1)).id
        assert s.flush(vid)
    for pack in (hot / "packs").rglob("*.pack"):  # as an eviction would: the bytes only on cold
        pack.unlink()
    hot_before, cold_before = snapshot(hot, with_catalog=True), snapshot(cold, with_catalog=True)
    with ds.Store.open(cold, hot=hot, read_only=True) as s:
        assert s.flusher is None
        assert torch.equal(s.load(vid)["w"], _state(1)["w"])
        with pytest.raises(ds.ReadOnlyStoreError):
            s.save(_state(2))
        with pytest.raises(ds.ReadOnlyStoreError):
            s.flush(vid)  # two tiers: it would queue a copy
    assert snapshot(hot, with_catalog=True) == hot_before  # no promotion into hot, no catalog write
    assert snapshot(cold, with_catalog=True) == cold_before


@pytest.mark.parametrize("damage", ["corrupt hot pack", "corrupt hot manifest", "manifest only on cold"])
def test_read_only_reads_mend_nothing_on_hot(tmp_path: Path, damage: str) -> None:
    """A read meeting a damaged or missing hot copy mends it from cold: not on a store opened read-only (a review:
    each of these wrote into the hot tier)."""
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot, flush=ds.Flush(every=1)) as s:
        vid = s.save(_state(4)).id
        assert s.flush(vid)
    if damage == "corrupt hot pack":
        pack = next((hot / "packs").rglob("*.pack"))
        raw = bytearray(pack.read_bytes())
        raw[100] ^= 0xFF
        pack.write_bytes(bytes(raw))
    else:
        for m in [m for m in (hot / "manifests").rglob("*") if m.is_file()]:
            if damage == "corrupt hot manifest":
                raw = bytearray(m.read_bytes())
                raw[5] ^= 1
                m.write_bytes(bytes(raw))
            else:
                m.unlink()
    before = snapshot(hot, with_catalog=True)
    with ds.Store.open(cold, hot=hot, read_only=True) as s:
        assert torch.equal(s.load(vid)["w"], _state(4)["w"])
    assert snapshot(hot, with_catalog=True) == before
    with ds.Store.open(cold, hot=hot) as s:  # a writable open mends it, as before
        assert torch.equal(s.load(vid)["w"], _state(4)["w"])
    assert snapshot(hot, with_catalog=True) != before


def test_a_refused_writable_open_writes_nothing(tmp_path: Path) -> None:
    """The writable open of a two-tier store open read-only in this process rewrote config.toml with its settings
    before the catalog refused it (a review)."""
    cold, hot = tmp_path / "cold", tmp_path / "hot"
    with ds.Store.open(cold, hot=hot) as s:
        s.save(_state(1))
    before = snapshot(cold), snapshot(hot, with_catalog=True)
    with ds.Store.open(cold, hot=hot, read_only=True), \
            pytest.raises(ds.ReadOnlyStoreError, match=f"store {cold} is open read-only in this process"):
        ds.Store.open(cold, hot=hot, flush=ds.Flush(every=7), hot_capacity="1GB")
    assert (snapshot(cold), snapshot(hot, with_catalog=True)) == before


def test_read_only_flag_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ds.InvalidArgumentError, match="read_only"):
        ds.Store.open(tmp_path / "s", read_only="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


# A user who may not write the store -------------------------------------------------------------------------------

_NOBODY = 65534


def _child_python() -> str | None:
    """An interpreter the unprivileged user may run, of this one's version (a venv under /root may not be)."""
    want = f"{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3", shutil.which("python3")):
        if not exe:
            continue
        probe = _as_nobody([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], {})
        if probe.returncode == 0 and probe.stdout.strip() == want:
            return exe
    return None


def _as_nobody(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    prefix = ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    return subprocess.run(prefix + argv, capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ.get("PATH", ""), "HOME": "/tmp", **env})


@pytest.fixture
def unwritable_store() -> Iterator[Path]:
    """A store in a folder every user may read and none but its owner may write (root writes anyway, hence the
    child runs as another user when the tests run as root)."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no user to whom the store is read-only")
    top = Path(tempfile.mkdtemp(prefix="ds-ro-", dir="/tmp"))
    try:
        path = top / "store"
        with ds.Store.open(path) as s:
            s.tag("first", s.save(_state(0), step=0))
            s.save(_state(1), step=1)
        for p in (top, *top.rglob("*")):
            p.chmod(0o555 if p.is_dir() else 0o444)
        yield path
    finally:
        for p in (top, *top.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(top)


_CHILD = r"""
import json, sys
import datastates as ds
path = sys.argv[1]
out = {}
s = ds.Store.open(path)
out["read_only"] = s.read_only
out["w0"] = s.load("first")["w"][:3].tolist()
out["log"] = len(s.log("main"))
out["fsck"] = s.fsck().ok
for name, call in (("save", lambda: s.save({"w": ds.__name__ and __import__("torch").zeros(2)})),
                   ("tag", lambda: s.tag("t2", "main")), ("annotate", lambda: s.annotate("main", x=1))):
    try:
        call()
        out[name] = "no error"
    except ds.ReadOnlyStoreError as exc:
        out[name] = str(exc)
s.close()
try:
    ds.Store.open(path + "/../new")
except ds.ReadOnlyStoreError as exc:
    out["create"] = str(exc)
print(json.dumps(out))
"""


def test_a_store_this_user_may_not_write_opens_read_only(unwritable_store: Path) -> None:
    exe = _child_python()
    if exe is None:
        pytest.skip("no interpreter of this version the unprivileged user may run")
    before = snapshot(unwritable_store, with_catalog=True)
    pythonpath = os.pathsep.join([str(REPO), *[p for p in sys.path if p and os.path.isdir(p)]])
    done = _as_nobody([exe, "-c", _CHILD, str(unwritable_store)], {"PYTHONPATH": pythonpath})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["read_only"] is True
    assert out["w0"] == [0.0, 1.0, 2.0]
    assert out["log"] == 2 and out["fsck"] is True
    for name in ("save", "tag", "annotate"):
        assert "is read-only for this user" in out[name] and str(unwritable_store / "catalog") in out[name], name
    assert "cannot create the store" in out["create"] and "Permission denied" in out["create"]
    assert snapshot(unwritable_store, with_catalog=True) == before
    cli = _as_nobody([exe, "-m", "datastates", "--store", str(unwritable_store), "tag", "t3", "first"],
                     {"PYTHONPATH": pythonpath})
    assert cli.returncode == 1
    assert cli.stderr.startswith("datastates: ReadOnlyStoreError: store ") and "ask the store's owner" in cli.stderr
    shown = _as_nobody([exe, "-m", "datastates", "--store", str(unwritable_store), "log"], {"PYTHONPATH": pythonpath})
    assert shown.returncode == 0 and shown.stdout.count("\n") == 2 and "tag: first" in shown.stdout
    assert snapshot(unwritable_store, with_catalog=True) == before


_TWO_TIER_CHILD = r"""
import json, sys, torch
import datastates as ds
cold, own_hot = sys.argv[1], sys.argv[2]
out = {}
try:
    ds.Store.open(cold)
except ds.ReadOnlyStoreError as exc:
    out["no_hot"] = str(exc)
with ds.Store.open(cold, hot=own_hot) as s:
    out["read_only"] = s.read_only
    out["w"] = s.load("first")["w"][:3].tolist()
    out["log"] = [v.step for v in s.log("main")]
    try:
        s.save({"w": torch.zeros(2)})
    except ds.ReadOnlyStoreError as exc:
        out["save"] = str(exc)
print(json.dumps(out))
"""


def test_another_users_two_tier_store_reads_through_a_hot_tier_of_ones_own() -> None:
    """Another user's two-tier store: a plain open failed with a bare PermissionError (config.toml, or the other
    user's hot tier), and read_only=True with a hot tier of one's own could not build its catalog (a review)."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: no user to whom the store is read-only")
    exe = _child_python()
    if exe is None:
        pytest.skip("no interpreter of this version the unprivileged user may run")
    top = Path(tempfile.mkdtemp(prefix="ds-ro2-", dir="/tmp"))
    try:
        cold, their_hot, own_hot = top / "cold", top / "their-hot", top / "own" / "hot"
        with ds.Store.open(cold, hot=their_hot, flush=ds.Flush(every=1)) as s:
            s.tag("first", s.save(_state(0), step=0))
            s.save(_state(1), step=1)
            assert s.flush(timeout=60)
        for p in (top, *top.rglob("*")):
            p.chmod(0o555 if p.is_dir() else 0o444)
        cold.chmod(0o777)  # a folder anyone may write, over subfolders none but the owner may (a review's case)
        their_hot.chmod(0o700)  # node-local, the other user's
        (top / "own").mkdir(mode=0o777)
        (top / "own").chmod(0o777)
        before = snapshot(cold, with_catalog=True)
        pythonpath = os.pathsep.join([str(REPO), *[p for p in sys.path if p and os.path.isdir(p)]])
        done = _as_nobody([exe, "-c", _TWO_TIER_CHILD, str(cold), str(own_hot)], {"PYTHONPATH": pythonpath})
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert "read the store through a hot tier of your own" in out["no_hot"]
        assert out["read_only"] is True and out["w"] == [0.0, 1.0, 2.0] and out["log"] == [1, 0]
        assert "is read-only for this user" in out["save"] and str(cold) in out["save"]
        cli = [exe, "-m", "datastates", "--store", str(cold), "--hot", str(own_hot)]
        shown = _as_nobody([*cli, "log"], {"PYTHONPATH": pythonpath})
        assert shown.returncode == 0 and "tag: first" in shown.stdout
        refused = _as_nobody([*cli, "tag", "t2", "first"], {"PYTHONPATH": pythonpath})
        assert refused.returncode == 1 and "ReadOnlyStoreError" in refused.stderr
        assert snapshot(cold, with_catalog=True) == before
    finally:
        for p in (top, *top.rglob("*")):
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(top)
