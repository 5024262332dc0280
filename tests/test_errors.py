"""Bad input raises a typed error with a message naming the culprit, and changes nothing.

"Changes nothing" is checked with the `unchanged` fixture: the same files with the same bytes under the
store directory (catalog/ and locks/ aside), the same branches, tags and number of versions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import copy_store
from helpers.procs import Zygote
from helpers.states import snapshot, snapshot_digest
from torch import nn

import datastates as ds
from datastates.retention import KeepLatest


@pytest.fixture(scope="module")
def filled_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed store with a root and a child on main, a branch `side` and a tag `t1`."""
    path = tmp_path_factory.mktemp("filled") / "store"
    with ds.Store.open(path) as s:
        root = s.save({"w": torch.arange(4.0), "n": 0}, step=0)
        s.save({"w": torch.arange(4.0) + 1, "n": 1}, step=1)
        s.branch("side", at=root)
        s.tag("t1", "main")
    return path


@pytest.fixture
def filled(filled_template: Path, tmp_path: Path) -> Iterator[ds.Store]:
    """A fresh copy of `filled_template`, open."""
    s = ds.Store.open(copy_store(filled_template, tmp_path / "store"))
    yield s
    s.close(raise_errors=False)


# --------------------------------------------------------------------------- unknown refs
@pytest.mark.parametrize("ref", ["nope", "0" * 64, "abcdef", "abcdef0123", "main~2", "main~1~1", "main^^",
                                 "side~1", "t1~5", "nope~1", "ABCDEF", "", "main~x",
                                 "main~\uff11", "main~\u0661",  # full-width and Arabic-Indic 1: not git's digits
                                 "main~1\n", "main^\n"])  # ($ matched before a newline: read as main~1)
def test_unknown_ref_raises_not_found(filled: ds.Store, unchanged: Any, ref: str) -> None:
    with unchanged(filled):
        for call in (filled.resolve, filled.version, filled.load, filled.ls, lambda r: filled.tag("new", r),
                     lambda r: filled.branch("new", at=r), lambda r: filled.log(r)):
            with pytest.raises(ds.NotFoundError):
                call(ref)


def test_not_found_messages_say_what_and_what_to_do(filled: ds.Store) -> None:
    with pytest.raises(ds.NotFoundError, match="'nope'.*datastates"):
        filled.resolve("nope")
    with pytest.raises(ds.NotFoundError, match="past the root"):
        filled.resolve("main~2")
    assert filled.resolve("main~1") == filled.version("side").id


@pytest.mark.parametrize("n", range(1, 6))
def test_prefix_shorter_than_six_hex_is_refused(filled: ds.Store, n: int) -> None:
    vid = filled.resolve("main")
    with pytest.raises(ds.NotFoundError, match="too short"):
        filled.resolve(vid[:n])
    assert filled.resolve(vid[:6]) == vid


def test_non_string_ref(filled: ds.Store) -> None:
    for ref in (None, 3, b"main", ["main"]):
        with pytest.raises(ds.NotFoundError):
            filled.resolve(ref)


# --------------------------------------------------------------------------- bad names
BAD_NAMES = ["..", "a..b", "/lead", "trail/", "a//b", "nul\x00", "ctl\x01", "tab\t", "new\nline", "del\x7f",
             "x" * 256, "\u00e9" * 128, "~", "a~1", "sp ace", " ", "", "a^", "a:b", "a?", "a*", "a[0]", "back\\slash",
             "-dash", ".dot", "x.lock", "HEAD", "@"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_names_are_refused_everywhere(filled: ds.Store, unchanged: Any, name: str) -> None:
    with unchanged(filled):
        with pytest.raises(ds.InvalidNameError):
            filled.branch(name, at="main")
        with pytest.raises(ds.InvalidNameError):
            filled.branch(name, at="main", force=True)
        with pytest.raises(ds.InvalidNameError):
            filled.tag(name, "main")
        with pytest.raises(ds.InvalidNameError):
            filled.save({"x": torch.ones(2)}, branch=name)
        with pytest.raises(ds.InvalidNameError):
            filled.save_async({"x": torch.ones(2)}, branch=name)


def test_non_string_names(filled: ds.Store, unchanged: Any) -> None:
    with unchanged(filled):
        for name in (None, 5, b"main"):
            with pytest.raises(ds.InvalidNameError):
                filled.tag(name, "main")  # type: ignore[arg-type]
            with pytest.raises(ds.InvalidNameError):
                filled.branch(name, at="main")  # type: ignore[arg-type]


# Regression: names the check accepted could still exceed NAME_MAX in the ref's (temp) file name and raise a
# raw OSError ENAMETOOLONG. A name is now either stored or refused up front.
# utf8-254 was a separate bug: the temp name was cut to 120 characters, not bytes.
@pytest.mark.parametrize("name", ["b" * 242, "b" * 255, "\u00e9" * 127, "a/" * 100 + "a", "%" * 90],
                         ids=["242", "255", "utf8-254", "slashes", "percents"])
def test_longest_valid_names(filled: ds.Store, unchanged: Any, name: str) -> None:
    try:
        filled.branch(name, at="main")
    except ds.InvalidNameError:
        with unchanged(filled), pytest.raises(ds.InvalidNameError):
            filled.tag(name, "main")
        assert len(name.replace("%", "%25").replace("/", "%2F").encode()) > 255  # refused only if too long
        return
    assert filled.resolve(name) == filled.resolve("main")
    assert name in filled.branches()
    with unchanged(filled), pytest.raises(ds.ConflictError):  # a tag may not shadow a branch
        filled.tag(name, "main")
    assert filled.resolve(f"branch:{name}") == filled.resolve("main")


# --------------------------------------------------------------------------- values that cannot be stored
@pytest.mark.parametrize("state,path", [
    ({"model": {"fn": lambda x: x}}, "model.fn"),
    ({"a": [1, object()]}, "a.1"),
    ({"cfg": {"s": {1, 2}}}, "cfg.s"),
    ({"t": (torch.ones(1), nn.ReLU)}, "t.1"),
    ({"x": {("tuple", "key"): 1}}, "x"),
    ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
    ({"meta": torch.empty(3, device="meta")}, "meta"),
], ids=["lambda", "object", "set", "class", "tuple-key", "sparse", "meta"])
def test_unsupported_value_names_its_key_path(filled: ds.Store, unchanged: Any, state: Any, path: str) -> None:
    with unchanged(filled):
        with pytest.raises(ds.UnsupportedValueError) as err:
            filled.save(state)
        assert path in str(err.value)


def test_two_values_on_one_key_path(filled: ds.Store, unchanged: Any) -> None:
    with unchanged(filled), pytest.raises(ds.UnsupportedValueError, match="a.b"):
        filled.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})


@pytest.mark.parametrize("field", ["hparams", "metrics"])
def test_unsupported_hparams_and_metrics(filled: ds.Store, unchanged: Any, field: str) -> None:
    with unchanged(filled), pytest.raises(ds.UnsupportedValueError, match="opt"):
        filled.save({"x": torch.ones(1)}, **{field: {"opt": object()}})


def test_unknown_parent(filled: ds.Store, unchanged: Any) -> None:
    with unchanged(filled), pytest.raises(ds.NotFoundError):
        filled.save({"x": torch.ones(1)}, parents=["nope"])


class Payload:
    """A picklable object with no state_dict."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Payload) and other.v == self.v


def test_pickle_only_when_asked_on_both_sides(filled: ds.Store, unchanged: Any) -> None:
    state = {"obj": Payload(7), "t": torch.ones(2)}
    with unchanged(filled), pytest.raises(ds.UnsupportedValueError, match="obj.*allow_pickle"):
        filled.save(state)
    v = filled.save(state, allow_pickle=True, branch="pickled")
    with unchanged(filled):
        with pytest.raises(ds.UnsupportedValueError, match="obj"):
            filled.load(v)
        got = filled.load(v, allow_pickle=True)
    assert got["obj"] == Payload(7) and type(got["obj"]) is Payload
    assert torch.equal(got["t"], torch.ones(2))
    assert filled.load(v, keys=["t"])["t"].sum().item() == 2.0  # tensors alone need no pickle


def test_unpicklable_with_allow_pickle(filled: ds.Store, unchanged: Any) -> None:
    with unchanged(filled), pytest.raises(ds.UnsupportedValueError, match="fn"):
        filled.save({"fn": lambda: 1}, allow_pickle=True)


class FailingState(nn.Module):
    """A module whose `state_dict()` raises once `fail` is set (a sharded model's gather that fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.fail = False

    def state_dict(self, *args: Any, **kw: Any) -> Any:
        if self.fail:
            raise self.fail if isinstance(self.fail, BaseException) else RuntimeError("boom in state_dict")
        return super().state_dict(*args, **kw)


@pytest.mark.parametrize("api", ["save", "save_async"])
def test_a_state_dict_that_raises_is_named_by_its_key(filled: ds.Store, unchanged: Any, api: str) -> None:
    """A `state_dict()` that raised came out as its bare RuntimeError, naming no key. Now an UnsupportedValueError
    names the key path and the object's class, with the caller's error chained; nothing is written. Both in a
    first flatten and in a save of the state kept from the one before (its walk, which takes the state again)."""
    model = FailingState()
    state = {"outer": {"model": model}, "t": torch.ones(2)}
    call = filled.save if api == "save" else filled.save_async
    model.fail = True
    with unchanged(filled), pytest.raises(ds.UnsupportedValueError) as first:
        call(state)
    model.fail = False
    filled.save(state, branch="kept")  # the flatten kept for the next save of this state
    model.fail = True
    with unchanged(filled), pytest.raises(ds.UnsupportedValueError) as again:
        call(state)
    for raised in (first, again):
        assert str(raised.value).startswith("outer.model (FailingState): its state_dict() raised RuntimeError: "
                                            "boom in state_dict")
        assert isinstance(raised.value.__cause__, RuntimeError) and str(raised.value.__cause__) == "boom in state_dict"
    # Our own errors and running out of memory stay what they are (they do not say the value cannot be saved).
    for error in (ds.StoreClosedError("another store was closed"), torch.OutOfMemoryError("no memory"),
                  MemoryError("no memory")):
        model.fail = error  # type: ignore[assignment]
        with unchanged(filled), pytest.raises(type(error)) as kept:
            call(state)
        assert kept.value is error
    model.fail = False
    assert torch.equal(filled.load(filled.save(state, branch="kept"))["outer"]["model"]["lin.weight"],
                       model.lin.weight.detach())


# --------------------------------------------------------------------------- store format
def _format(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "FORMAT").read_text()))


def test_a_flipped_digit_of_format_is_refused_and_an_old_format_opens(filled: ds.Store) -> None:
    """A digit of chunk_size flipped to another valid size went unnoticed (left undone in the last note): FORMAT now
    carries a checksum; one written before it (none) opens as before."""
    path = filled.path
    filled.close()
    raw = (path / "FORMAT").read_text()
    assert '"chunk_size": 16777216' in raw and '"blake3": "' in raw
    (path / "FORMAT").write_text(raw.replace("16777216", "16777280"))
    before = snapshot(path)
    with pytest.raises(ds.StoreFormatError, match="FORMAT does not match its checksum"):
        ds.Store.open(path)
    assert snapshot(path) == before
    info = json.loads(raw)
    del info["blake3"]
    (path / "FORMAT").write_text(json.dumps(info, sort_keys=True))  # as written before the checksum
    with ds.Store.open(path) as s:
        assert s.chunk_size == 16777216


def test_a_cold_mark_by_an_older_datastates_is_not_damage(tmp_path: Path) -> None:
    """A datastates from before FORMAT's checksum marks a cold tier by adding "tier" and keeps the checksum it read:
    the store was then refused as damaged (a review)."""
    from datastates.objects.tier import Tier

    tier = Tier(tmp_path / "t")
    tier.create({"chunk_size": 1 << 20})
    info = json.loads((tmp_path / "t" / "FORMAT").read_text())
    (tmp_path / "t" / "FORMAT").write_text(json.dumps(info | {"tier": "cold"}, sort_keys=True))  # as it writes it
    assert tier.read_format() == {k: v for k, v in info.items() if k != "blake3"} | {"tier": "cold"}
    (tmp_path / "t" / "FORMAT").write_text(json.dumps(info | {"tier": "cold", "chunk_size": 1 << 21}))
    with pytest.raises(ds.StoreFormatError, match="does not match its checksum"):
        tier.read_format()


def test_newer_format_is_refused(filled: ds.Store) -> None:
    path = filled.path
    filled.save({"x": torch.ones(1)})
    filled.close()
    info = _format(path)
    info["format"] = 99
    (path / "FORMAT").write_text(json.dumps(info))
    before = snapshot(path)
    catalog = {p.name: p.read_bytes() for p in (path / "catalog").iterdir()}
    with pytest.raises(ds.StoreFormatError, match="99"):
        ds.Store.open(path)
    with pytest.raises(ds.StoreFormatError):
        ds.Store.open(path, create=False)
    assert snapshot(path) == before
    assert {p.name: p.read_bytes() for p in (path / "catalog").iterdir()} == catalog


@pytest.mark.parametrize("text", ["not json", "{}", '{"format": "x"}', "[1]"])
def test_damaged_format_file(tmp_path: Path, text: str) -> None:
    ds.Store.open(tmp_path / "s").close()
    (tmp_path / "s" / "FORMAT").write_text(text)
    with pytest.raises(ds.StoreFormatError):
        ds.Store.open(tmp_path / "s")


def test_non_store_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "precious.txt").write_text("keep me")
    with pytest.raises(ds.StoreFormatError):
        ds.Store.open(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["precious.txt"]


def test_missing_store_without_create(tmp_path: Path) -> None:
    with pytest.raises(ds.NotFoundError):
        ds.Store.open(tmp_path / "absent", create=False)
    assert not (tmp_path / "absent").exists()


def test_closed_store(tmp_path: Path) -> None:
    s = ds.Store.open(tmp_path / "s")
    s.save({"x": torch.ones(1)})
    s.close()
    s.close()  # idempotent
    with pytest.raises(ds.StoreClosedError):
        s.save({"x": torch.ones(1)})
    with pytest.raises(ds.StoreClosedError):
        s.load("main")


def test_every_read_of_a_closed_store_says_it_is_closed(tmp_path: Path) -> None:
    """log, version, ls, diff, history, find, versions_table, ancestors, du and checkout raised lmdb.Error;
    branches, tags and resolve answered from the files as if the store were open."""
    s = ds.Store.open(tmp_path / "s")
    s.save({"w": torch.ones(3)}, step=1)
    s.save({"w": torch.zeros(3)}, step=2)
    s.close()
    reads = [lambda: s.log(), lambda: s.version("main"), lambda: s.branches(), lambda: s.tags(),
             lambda: s.ls(), lambda: s.diff("main~1", "main"), lambda: s.history("w"), lambda: s.find("step > 0"),
             lambda: s.versions_table(), lambda: s.ancestors("main"), lambda: s.resolve("main"), lambda: s.du(),
             lambda: s.checkout("main", model=nn.Linear(1, 1)), lambda: s.merge_base("main", "main~1")]
    for read in reads:
        with pytest.raises(ds.StoreClosedError, match="is closed; open it again with Store.open"):
            read()


def test_wait_reflog_tiers_status_and_manifests_of_a_closed_store_say_it_is_closed(tmp_path: Path) -> None:
    """After close(), wait(), reflog() and tiers_status() answered as if the store were open, and manifest(id) raised
    NotFoundError for a manifest that is there."""
    s = ds.Store.open(tmp_path / "s")
    v = s.save({"w": torch.ones(3)}, step=1)
    mid = v.manifests["0"]
    assert s.manifest(mid).info()[0].key == "w"
    s.close()
    for call in (s.wait, lambda: s.reflog("main"), s.tiers_status, lambda: s.manifest(mid),
                 lambda: s.manifest_of(v)):
        with pytest.raises(ds.StoreClosedError, match="is closed; open it again with Store.open"):
            call()


def test_maintenance_of_a_closed_store_says_it_is_closed(tmp_path: Path) -> None:
    """Store.fsck() after close raised lmdb.Error."""
    s = ds.Store.open(tmp_path / "s")
    s.save({"w": torch.ones(3)})
    s.close()
    for call in (lambda: s.fsck(), lambda: s.fsck(repair=True), lambda: s.gc(), lambda: s.prune(KeepLatest(1))):
        with pytest.raises(ds.StoreClosedError, match="is closed; open it again with Store.open"):
            call()
    assert ds.Store.open(tmp_path / "s").load("main")["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_catalog_read_in_flight_when_its_store_closes_ends_normally(tmp_path: Path) -> None:
    """A read on another thread racing close() got lmdb.Error ('closed/deleted/dropped object') when the LMDB file
    was let go under its transaction: now the file goes when the last transaction ends, and a read begun after
    close raises StoreClosedError."""
    s = ds.Store.open(tmp_path / "s", chunk_size=1024)
    s.save({"w": torch.arange(2048, dtype=torch.float32)})  # 8 chunks
    chunks = s.catalog.iter_chunks()
    first = next(chunks)  # its transaction is open
    catalog = s.catalog
    s.close()
    assert len([first, *chunks]) == 8
    with pytest.raises(ds.StoreClosedError, match="is closed"):
        catalog.chunk(first[0])


def test_a_pack_file_in_use_is_not_closed_under_its_read(tmp_path: Path) -> None:
    """A reader keeps at most max_open files open: the oldest was closed even while another thread read from it,
    whose read then failed (EBADF) or, with the number handed to the next file opened, read another pack's bytes.
    The same for a pack forgotten (gc) or a store closed during a read."""
    from datastates.objects.packs import PackReader

    s = ds.Store.open(tmp_path / "s")
    a = s.save({"a": torch.full((64,), 1.0)}, branch="a")
    b = s.save({"b": torch.full((64,), 2.0)}, branch="b")
    (pa,), (pb,) = s.packs_of(a), s.packs_of(b)
    s.close()
    reader = PackReader(tmp_path / "s" / "packs", max_open=1)
    head = (tmp_path / "s" / "packs" / f"{pa}.pack").read_bytes()[:64]
    fd = reader._acquire(pa)  # a read of pack a in flight
    reader._release(reader._acquire(pb))  # opening b evicts a's file
    reader.forget(pa)
    reader.close()
    assert os.pread(fd, 64, 0) == head  # still pack a's file
    reader._release(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed once its read ended
    with pytest.raises(ds.StoreClosedError):
        reader._acquire(pb)
    with pytest.raises(ds.StoreClosedError):
        reader.map(pb)  # a mapping after close was made as if the store were open


# --------------------------------------------------------------------------- loading into live objects
def test_checkout_into_wrong_shape(filled: ds.Store) -> None:
    """Regression: torch's RuntimeError escaped after the matching tensors were copied (half-loaded module)."""
    v = filled.save({"model": nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))}, branch="m")
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))
    before = {k: x.clone() for k, x in target.state_dict().items()}
    with pytest.raises(ds.ShapeMismatchError, match="1.weight"):
        filled.checkout(v, model=target)
    assert all(torch.equal(before[k], x) for k, x in target.state_dict().items())


def test_a_refused_checkout_leaves_every_live_object_as_it_was(filled: ds.Store) -> None:
    """A module with an extra layer was half loaded before torch's RuntimeError; with a module that fit and an
    optimizer that did not, the module was loaded before the optimizer's ValueError. Neither was typed."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.Adam(saved.parameters())
    saved(torch.ones(1, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    v = filled.save({"model": saved, "optim": opt, "sched": sched}, branch="co")

    def snapshot(*objs: Any) -> list[Any]:
        return [repr(o.state_dict()) for o in objs]

    extra = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    before = snapshot(extra)
    words = r"model: 2 key\(s\) of the live module are not in version \w+: \['2.bias', '2.weight'\]; nothing"
    with pytest.raises(ds.ShapeMismatchError, match=words):
        filled.checkout(v, model=extra)
    assert snapshot(extra) == before
    live = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    live_sched_opt = torch.optim.SGD(live.parameters(), lr=0.5)
    live_sched = torch.optim.lr_scheduler.StepLR(live_sched_opt, 7)
    one_group_short = torch.optim.Adam([live[0].weight])
    before = snapshot(live, live_sched, one_group_short)
    with pytest.raises(ds.ShapeMismatchError, match="optim: the state saved in version .* nothing was loaded"):
        filled.checkout(v, model=live, sched=live_sched, optim=one_group_short)  # the scheduler loads, then is put back
    assert snapshot(live, live_sched, one_group_short) == before
    fits = torch.optim.Adam(live.parameters())
    filled.checkout(v, model=live, optim=fits, sched=live_sched)
    assert torch.equal(live[1].weight, saved[1].weight) and live_sched.step_size == 3
    assert torch.equal(fits.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    filled.checkout(v, model=extra, strict=False)  # the keys both have
    assert torch.equal(extra[0].weight, saved[0].weight)


# --------------------------------------------------------------------------- failures after the bytes are written
def _commitfail(zygote: Zygote, path: Path, mode: str) -> dict[str, list[str]]:
    """Run `saver.py commitfail`; its RESULT, SNAP, NEXT and LOAD lines (words after the tag)."""
    pid = zygote.start("commitfail", str(path), mode)
    status = zygote.exit_status(pid, timeout=180)  # above the 30 s hang detector of each save
    assert os.WIFEXITED(status), status
    out = {w: [" ".join(x[1:]) for x in zygote.lines.of(pid, w)] for w in ("RESULT", "SNAP", "NEXT", "LOAD")}
    assert len(out["RESULT"]) == 1 and len(out["SNAP"]) == 1, out
    return out


def test_full_disk_during_commit_raises_and_changes_nothing(zygote: Zygote, filled: ds.Store) -> None:
    """Regression: a failure after the last slot (here ENOSPC on the manifest) used to hang the save forever."""
    path = filled.path
    head, versions = filled.resolve("main"), filled.catalog.version_count()
    filled.close()
    before = snapshot_digest(path)
    out = _commitfail(zygote, path, "enospc")
    assert out["RESULT"] == ["StorageFullError"]
    assert out["SNAP"] == [before]  # nothing of the failed save is left: no pack, manifest, record or ref move
    # The next save may first report the earlier failure (SaveFailedError); then saving works again.
    assert out["NEXT"][-1].startswith("ok ") and set(out["NEXT"][:-1]) <= {"SaveFailedError"}, out["NEXT"]
    assert out["LOAD"] == ["ok"]
    with ds.Store.open(path) as s:
        assert s.catalog.version_count() == versions + 1
        assert s.version("main").parents == (head,)
        assert s.fsck().ok


def test_save_on_a_too_long_branch_name(zygote: Zygote, filled: ds.Store) -> None:
    """Regression: a 250-byte name passed the check but its temp file did not fit NAME_MAX; the save failed late,
    after the version was indexed, and (before that) hung the pipeline."""
    path = filled.path
    filled.close()
    before = snapshot_digest(path)
    out = _commitfail(zygote, path, "longname")
    assert out["RESULT"] == ["InvalidNameError"] or out["RESULT"][0].startswith("ok "), out
    if out["RESULT"] == ["InvalidNameError"]:
        assert out["SNAP"] == [before]
    assert out["NEXT"][-1].startswith("ok ") and out["LOAD"] == ["ok"], out
    with ds.Store.open(path) as s:
        assert s.fsck().ok


def test_failed_branch_move_keeps_the_store_consistent(zygote: Zygote, filled: ds.Store) -> None:
    """Regression: a commit failing after the catalog indexed the version unlinked its packs anyway, so a later
    save of the same tensors deduplicated against deleted chunks and could not be loaded."""
    path = filled.path
    filled.close()
    out = _commitfail(zygote, path, "refmove")
    assert out["RESULT"] == ["SaveFailedError"], out
    assert out["NEXT"][-1].startswith("ok "), out
    assert out["LOAD"] == ["ok"], out  # the same tensors, saved again on another branch, load
    with ds.Store.open(path) as s:
        assert s.fsck().ok


@pytest.mark.parametrize("device", ["nope", "cuda:7", "xpu"])
def test_load_onto_a_device_this_process_lacks(filled: ds.Store, unchanged: Any, device: str) -> None:
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with unchanged(filled), pytest.raises(ds.DeviceError, match=device.split(":")[0]) as err:
        filled.load("main", device=device)
    assert "device='cpu'" in str(err.value)
    from torch.utils._pytree import tree_leaves

    tensors = [x for x in tree_leaves(filled.load("main", device=torch.device("cpu"))) if isinstance(x, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)  # the default place still works


@pytest.mark.parametrize("kw", [{"step": "abc"}, {"step": 1.5}, {"epoch": [1]}, {"step": True}])
def test_step_and_epoch_must_be_whole_numbers(filled: ds.Store, unchanged: Any, kw: dict[str, Any]) -> None:
    name = next(iter(kw))
    with unchanged(filled), pytest.raises(ds.InvalidArgumentError, match=f"{name}=.*whole number"):
        filled.save({"t": torch.ones(2)}, **kw)
    assert filled.save({"t": torch.ones(2)}, step=7.0, epoch=2).step == 7  # 7.0 is a whole number


@pytest.mark.parametrize("kw,what", [({"pool_bytes": -1}, "pool_bytes"), ({"pool_bytes": 0}, "pool_bytes"),
                                     ({"workers": 0}, "workers"), ({"chunk_size": 100}, "chunk_size")])
def test_open_refuses_sizes_out_of_range(tmp_path: Path, kw: dict[str, Any], what: str) -> None:
    with pytest.raises(ds.InvalidArgumentError, match=what):
        ds.Store.open(tmp_path / "s", **kw)
    assert not (tmp_path / "s").exists()  # nothing created


def test_keys_given_as_one_string(filled: ds.Store) -> None:
    v = filled.save({"model": {"w": torch.ones(2), "b": torch.zeros(1)}}, branch="k")
    assert set(filled.load(v, keys="model.w")["model"]) == {"w"}
    assert filled.diff(v, v, keys="model.w").column("key").to_pylist() == ["model.w"]


def test_a_path_or_query_of_another_type_is_a_typed_error(tmp_path: Path) -> None:
    """Store.open(123) and find(None) raised bare TypeErrors."""
    for bad in (123, None, b"bytes"):
        with pytest.raises(ds.InvalidArgumentError, match=r"path= must be a directory path \(a str or a Path\)"):
            ds.Store.open(bad)  # type: ignore[arg-type]
    with pytest.raises(ds.InvalidArgumentError, match="hot= must be a directory path"):
        ds.Store.open(tmp_path / "s", hot=5)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"w": torch.ones(1)})
        with pytest.raises(ds.InvalidArgumentError, match="query must be a string"):
            s.find(None)  # type: ignore[arg-type]


def test_a_transaction_ended_by_the_collector_under_the_open_lock_does_not_deadlock(tmp_path: Path) -> None:
    """The collector may end an abandoned generator's read transaction on a thread that holds the lock of
    Catalog's open (it allocates there): the catalog, closed meanwhile, then let its file go under that lock, which
    the thread was holding already, and waited for itself for ever."""
    import threading

    from datastates.meta import catalog as catalog_module

    s = ds.Store.open(tmp_path / "s")
    s.save({"w": torch.ones(4)})
    catalog = s.catalog
    chunks = catalog.iter_chunks()
    next(chunks)  # a transaction in flight
    key = catalog._key
    s.close()  # the file goes when that transaction ends

    def end_it_under_the_lock() -> None:
        with catalog_module._OPEN_LOCK:
            chunks.close()  # as the collector would, inside Catalog.__init__

    t = threading.Thread(target=end_it_under_the_lock, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive()
    for closer in [x for x in threading.enumerate() if x.name == "datastates-catalog-close"]:
        closer.join(30)
    assert key not in catalog_module._OPEN  # let go once the lock was free


@pytest.mark.parametrize("size", [0, 100, (1 << 30) + 64, 1 << 40, True, 64.0])
def test_a_chunk_size_no_save_could_use_is_refused_at_open(tmp_path: Path, size: Any) -> None:
    """A chunk size of 1 TiB was accepted and kept in FORMAT for good: every later save failed allocating its
    staging slot with torch's RuntimeError, even for a 40-byte tensor (a hunt). Refused, and nothing is made."""
    with pytest.raises(ds.InvalidArgumentError, match="chunk_size .* from 64 B to 1 GiB"):
        ds.Store.open(tmp_path / "s", chunk_size=size)
    assert not (tmp_path / "s").exists()


def test_a_store_made_with_chunks_over_the_bound_still_opens(tmp_path: Path) -> None:
    """The 1 GiB bound is for a chunk_size given to a new open: a store whose FORMAT says 2 GiB (made before the
    bound) was refused at every open, its data out of reach, and a refused open with hot= still wrote config.toml
    and marks (a review). It opens as it did."""
    from datastates.objects.tier import Tier

    tier = Tier(tmp_path / "s")
    tier.create({"chunk_size": 2 << 30})
    with ds.Store.open(tmp_path / "s") as s:
        assert s.chunk_size == 2 << 30
        assert s.load(s.save({"w": torch.ones(3)})).get("w").tolist() == [1.0, 1.0, 1.0]
