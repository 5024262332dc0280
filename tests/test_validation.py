"""Everyday mistakes refused where values enter; records a buggy writer left behind read without crashing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.states import snapshot

import datastates as ds
from datastates import retention as rt
from datastates.errors import (
    ArgumentTypeError,
    ConflictError,
    InvalidArgumentError,
    InvalidNameError,
    StoreClosedError,
    UnsupportedValueError,
)
from datastates.meta.versions import record_dict
from datastates.save.commit import make_fork_visible

W = {"w": torch.arange(4.0)}


def _refused(store: ds.Store, exc: type[BaseException], **kw: Any) -> str:
    before = store.versions_table().num_rows
    with pytest.raises(exc) as info:
        store.save(W, **kw)
    assert store.versions_table().num_rows == before  # nothing written
    return str(info.value)


@pytest.mark.parametrize("kw, words", [
    ({"metrics": 0.5}, "not a dict"),
    ({"hparams": [1, 2]}, "not a dict"),
    ({"metrics": {"loss": "low"}}, "metrics.loss"),
    ({"metrics": {"ok": True}}, "metrics.ok"),
    ({"hparams": {1: "a", "1": "b"}}, "key 1"),
    ({"hparams": {"": 1}}, "key ''"),
    ({"metrics": {"loss": float("nan")}}, "NaN"),
    ({"metrics": {"loss": float("inf")}}, "NaN and infinity"),
    ({"hparams": {"n": 10**400}}, "digits"),
    ({"step": -5}, "step=-5"),
    ({"epoch": -1}, "epoch=-1"),
    ({"step": "3"}, "step='3'"),
    ({"step": True}, "step=True"),
    ({"message": "a\x00b"}, "NUL"),
    ({"message": "a\ud800"}, "surrogate"),
    ({"message": 5}, "message"),
    ({"hparams": {"a\ud800": 1}}, "surrogate"),
    ({"explore": 3}, "explore"),
])
def test_bad_fields_refused_before_anything_is_written(store: ds.Store, kw: dict[str, Any], words: str) -> None:
    msg = _refused(store, InvalidArgumentError, **kw)
    assert words in msg


def test_unstorable_value_type_is_unsupported(store: ds.Store) -> None:
    assert "hparams.f" in _refused(store, UnsupportedValueError, hparams={"f": object()})


@pytest.mark.parametrize("name", ["a\x00b", "a\ud800b"])
def test_ref_names_with_nul_or_surrogate_are_invalid_names(store: ds.Store, name: str) -> None:
    v = store.save(W)
    with pytest.raises(InvalidNameError):
        store.save(W, branch=name)
    with pytest.raises(InvalidNameError):
        store.branch(name, v)
    with pytest.raises(InvalidNameError):
        store.tag(name, v)
    assert set(store.branches()) == {"main"} and store.tags() == {}


def test_numpy_scalars_are_the_numbers_they_hold(store: ds.Store) -> None:
    v = store.save(W, step=np.int64(3), hparams={"lr": np.float32(0.5), "n": np.int16(7)},
                   metrics={"loss": np.float64(0.25)})
    got = store.version(v.id)
    assert got.step == 3 and got.hparams == {"lr": 0.5, "n": 7} and got.metrics == {"loss": 0.25}
    assert type(got.hparams["n"]) is int


def test_misspelt_keyword_names_save_and_suggests(store: ds.Store) -> None:
    with pytest.raises(TypeError) as info:
        store.save(W, stpe=3)
    assert isinstance(info.value, ds.DataStatesError)
    assert "save()" in str(info.value) and "step=" in str(info.value) and "save_async" not in str(info.value)


def test_record_from_a_buggy_writer_reads_as_invalid_not_a_crash(store: ds.Store, tmp_path: Path) -> None:
    good = store.save(W, step=1, metrics={"loss": 0.5})
    # A record an older/buggy writer produced: metrics a float, hparams a list, step a str.
    rec = record_dict(parents=[good.id], manifests=good.manifests, step="3", epoch=None, created=good.created + 1,
                      hparams=[1], metrics=0.5, message="bad", branch="main", world_size=1,
                      bytes_total=good.bytes_total, bytes_new=0, chunks_new=0)
    bad = make_fork_visible(rec, tier=store.tier, refs=store.refs, catalog=store.catalog, branch="main",
                            message="buggy writer")
    v = store.version(bad)
    assert v.metrics == {} and v.hparams == {} and v.step is None
    assert set(v.invalid) == {"metrics", "hparams", "step"}
    assert [x.id for x in store.log()] == [bad, good.id]
    table = store.versions_table()
    assert table.num_rows == 2 and table.column("metrics.loss").to_pylist().count(0.5) == 1
    assert [x.id for x in store.find("metrics.loss < 1")] == [good.id]
    assert store.du()["versions"] == 2
    store.close()
    out = subprocess.run([sys.executable, "-m", "datastates", "--store", str(store.path), "log"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert bad[:12] in out.stdout and "Traceback" not in out.stderr
    shown = subprocess.run([sys.executable, "-m", "datastates", "--store", str(store.path), "find",
                            "metrics.loss < 1", "--json"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert [r["id"] for r in json.loads(shown.stdout)] == [good.id]


@pytest.mark.parametrize("under", [False, True])
def test_open_on_a_regular_file_is_a_store_format_error(tmp_path: Path, under: bool) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    path = f / "store" if under else f
    with pytest.raises(ds.errors.StoreFormatError) as info:
        ds.Store.open(path)
    assert str(path) in str(info.value) and "a file, not a directory" in str(info.value)
    assert f.read_text() == "hello"


def test_branch_and_tag_names_never_collide_and_qualified_names_resolve(store: ds.Store) -> None:
    a = store.save(W, step=1)
    b = store.save(W, step=2)
    store.tag("best", a)
    with pytest.raises(ds.errors.ConflictError, match="tag:best"):
        store.branch("best", b)
    with pytest.raises(ds.errors.ConflictError, match="tag:best"):
        store.save(W, branch="best")
    with pytest.raises(ds.errors.ConflictError, match="branch:main"):
        store.tag("main", a)
    assert set(store.branches()) == {"main"} and store.tags() == {"best": a.id}
    assert store.resolve("tag:best") == a.id and store.resolve("branch:main") == b.id
    assert store.resolve("branch:main~1") == a.id
    with pytest.raises(ds.NotFoundError):
        store.resolve("branch:best")


def test_delete_branch_refuses_to_orphan_versions_unless_forced(store: ds.Store) -> None:
    a = store.save(W, step=1)
    store.branch("side", a)
    store.save(W, step=2, branch="side")
    store.save(W, step=3, branch="side")
    with pytest.raises(ds.errors.ConflictError, match="2 version"):
        store.delete_branch("side")
    assert "side" in store.branches()
    store.branch("merged", a)
    assert store.delete_branch("merged") == a.id  # main still reaches a
    store.tag("keep", "side~1")
    with pytest.raises(ds.errors.ConflictError, match="1 version"):
        store.delete_branch("side")
    store.delete_branch("side", force=True)
    assert set(store.branches()) == {"main"}


def test_annotated_metrics_are_metrics_and_internal_keys_are_hidden(store: ds.Store) -> None:
    v = store.save(W, step=1, metrics={"loss": 0.5, "val": {"loss": 0.6}})
    got = store.annotate(v, metrics={"val_acc": 0.93, "val": {"acc": 0.9}}, note="late eval")
    assert got.id == v.id
    assert got.metrics == {"loss": 0.5, "val_acc": 0.93, "val": {"loss": 0.6, "acc": 0.9}}
    assert got.annotations == {"note": "late eval"}
    assert got.record()["metrics"] == {"loss": 0.5, "val": {"loss": 0.6}}  # the record is unchanged
    assert [x.id for x in store.find("metrics.val_acc > 0.9 and metrics.val.acc = 0.9")] == [v.id]
    table = store.versions_table()
    assert table.column("metrics.val_acc").to_pylist() == [0.93]
    assert "annotations._updated" not in table.column_names
    with pytest.raises(InvalidArgumentError):
        store.annotate(v, metrics={"acc": "high"})
    with pytest.raises(InvalidArgumentError, match="reserved"):
        store.annotate(v, _secret=1)
    store.close()
    out = subprocess.run([sys.executable, "-m", "datastates", "--store", str(store.path), "show", v.id],
                         capture_output=True, text=True, timeout=120)
    shown = json.loads(out.stdout)
    assert shown["annotations"] == {"note": "late eval"} and shown["metrics"]["val_acc"] == 0.93


def test_annotate_takes_the_version_as_ref_keyword_too(store: ds.Store) -> None:
    """`annotate(ref="main", note=...)` raised Python's bare 'missing 1 required positional argument'."""
    v = store.save(W, step=1)
    assert store.annotate(ref=v.id, note="by keyword").annotations == {"note": "by keyword"}
    assert store.annotate(v.id, ref="an annotation").annotations == {"note": "by keyword", "ref": "an annotation"}
    with pytest.raises(ds.errors.ArgumentTypeError, match=r"store\.annotate\(REF, key=value\)"):
        store.annotate(note="no version")
    assert store.version(v.id).annotations == {"note": "by keyword", "ref": "an annotation"}


def _store_with_two_versions(tmp_path: Path) -> tuple[ds.Store, str, str]:
    store = ds.Store.open(tmp_path / "s")
    a = store.save(W, branch="main")
    b = store.save({"w": torch.ones(4)}, branch="main")
    store.tag("t1", a.id)
    return store, a.id, b.id


def test_a_closed_store_refuses_every_ref_and_annotation_change(tmp_path: Path) -> None:
    """Tags, branches and annotations were still written after `close()` (saves and loads were refused)."""
    store, a, _ = _store_with_two_versions(tmp_path)
    store.close()
    before = snapshot(tmp_path / "s", with_catalog=True)
    for call in (lambda: store.tag("t2", "main"), lambda: store.branch("b2", at="main"),
                 lambda: store.delete_tag("t1"), lambda: store.delete_branch("main", force=True),
                 lambda: store.annotate("main", metrics={"z": 1.0}), lambda: store.flush()):
        with pytest.raises(StoreClosedError):
            call()
    assert snapshot(tmp_path / "s", with_catalog=True) == before
    with ds.Store.open(tmp_path / "s") as again:
        assert again.tags() == {"t1": a} and set(again.branches()) == {"main"}


@pytest.mark.parametrize("name", [None, "", 5])
def test_deleting_a_ref_that_is_not_a_name_is_refused_by_name(tmp_path: Path, name: Any) -> None:
    store, _, b = _store_with_two_versions(tmp_path)
    with store:
        for call, kind in ((store.delete_branch, "branch"), (store.delete_tag, "tag")):
            with pytest.raises(InvalidNameError, match=f"{kind} name {name!r} is not a name"):
                call(name)
        assert store.branches() == {"main": b} and set(store.tags()) == {"t1"}


@pytest.mark.parametrize("policy, words", [
    ("keep everything", "is not a retention policy"),
    (None, "is not a retention policy"),
    (lambda: rt.KeepBest("loss", 3), "KeepBest(n='loss'): n is a count"),  # the arguments swapped
    (lambda: rt.KeepLatest(2.5), "KeepLatest(n=2.5): n is a count"),
    (lambda: rt.KeepEvery(True), "KeepEvery(n_steps=True): n_steps is a count"),
    (lambda: rt.Retention("x"), "'x' is not a retention policy"),
])
def test_prune_with_what_is_not_a_policy_is_refused_before_anything_changes(
        tmp_path: Path, policy: Any, words: str) -> None:
    store, _, _ = _store_with_two_versions(tmp_path)
    with store:
        before = snapshot(tmp_path / "s", with_catalog=True)
        with pytest.raises(InvalidArgumentError) as info:
            store.prune(policy() if callable(policy) else policy, dry_run=False)
        assert words in str(info.value)
        if not callable(policy) or "Retention" in words:
            assert isinstance(info.value, ArgumentTypeError) and isinstance(info.value, TypeError)
        assert snapshot(tmp_path / "s", with_catalog=True) == before
        assert store.fsck().ok


def test_a_metric_name_in_a_policy_message_is_cut_short(tmp_path: Path) -> None:
    store, _, _ = _store_with_two_versions(tmp_path)
    with store:
        store.save(W, branch="main", metrics={"x" * 10_000: 1.0})
        with pytest.raises(ds.NotFoundError) as info:
            store.prune(rt.KeepBest(1, "metrics.loss"), dry_run=True)
        assert len(str(info.value)) < 400 and "xxx..." in str(info.value)


def test_flush_policy_counts_from_one(tmp_path: Path) -> None:
    for every in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="every is a count of versions"):
            ds.Flush(every=every)
    assert ds.Flush(every=3).every == 3


def test_a_config_written_with_every_0_still_opens_and_flushes_each_version(tmp_path: Path) -> None:
    """Before `Flush` checked `every`, 0 could be written; the flusher read it as 1, and so does `load`."""
    from datastates.base import config

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.toml").write_text(f'[tiers]\nhot = "{tmp_path / "h"}"\n[flush]\nevery = 0\n')
    assert config.load(tmp_path / "c").flush.every == 1  # type: ignore[union-attr]
    (tmp_path / "c" / "config.toml").write_text('[flush]\nevery = "often"\n')
    with pytest.raises(ds.errors.StoreFormatError, match="every = 'often' is not a whole number"):
        config.load(tmp_path / "c")


def test_flush_of_a_ref_that_names_nothing_is_refused_without_tiers_too(tmp_path: Path) -> None:
    store, _, _ = _store_with_two_versions(tmp_path)
    with store:
        with pytest.raises(ds.NotFoundError, match="'nope' is not a branch, tag or version id"):
            store.flush("nope")
        assert store.flush("main") is True


def test_an_upper_case_id_prefix_names_its_version_and_an_empty_ref_is_called_empty(tmp_path: Path) -> None:
    store, a, b = _store_with_two_versions(tmp_path)
    with store:
        assert store.resolve(b[:8].upper()) == b and store.resolve(a.upper()) == a
        with pytest.raises(ds.NotFoundError, match="ref '' is empty"):
            store.load("")
        store.branch("ABCDEF", at=a)  # a branch named like a prefix is still found first
        assert store.resolve("ABCDEF") == a


def test_export_of_a_version_with_pickled_values_takes_allow_pickle(tmp_path: Path) -> None:
    """The refusal said to pass allow_pickle=True, which `export` did not take."""
    from datastates.ecosystem.transfer import export

    store = ds.Store.open(tmp_path / "s")
    with store:
        v = store.save({"w": torch.arange(3.0), "cfg": {1, 2}}, branch="main", allow_pickle=True)
        with pytest.raises(UnsupportedValueError, match="allow_pickle=True"):
            export(store, v.id, "torch", tmp_path / "out.pt")
        assert not (tmp_path / "out.pt").exists()
        path = export(store, v.id, "torch", tmp_path / "out.pt", allow_pickle=True)
        back = torch.load(path, weights_only=False)
        assert torch.equal(back["w"], torch.arange(3.0)) and back["cfg"] == {1, 2}
    out = subprocess.run([sys.executable, "-m", "datastates", "--store", str(tmp_path / "s"), "export", "main",
                          str(tmp_path / "cli.pt"), "--format", "torch", "--allow-pickle"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert torch.load(tmp_path / "cli.pt", weights_only=False)["cfg"] == {1, 2}


def _diverged(tmp_path: Path) -> tuple[ds.Store, str, str, str]:
    """main: a <- b; branch `other` at a root version c of its own line."""
    store = ds.Store.open(tmp_path / "s")
    a = store.save(W, branch="main").id
    b = store.save({"w": torch.ones(4)}, branch="main").id
    c = store.save({"w": torch.zeros(4)}, branch="other").id
    return store, a, b, c


def test_a_fork_onto_a_branch_whose_head_it_would_orphan_is_refused_unless_forced(tmp_path: Path) -> None:
    """fork() moved an existing branch to another line in silence, leaving its head reachable only by id
    (branch() and delete_branch() refuse that without force)."""
    store, a, b, c = _diverged(tmp_path)
    with store:
        before = snapshot(tmp_path / "s", with_catalog=True)
        with pytest.raises(ConflictError, match=f"move branch 'main' off its head {b[:12]}.*: 2 version"):
            store.fork(c, branch="main")
        with pytest.raises(ConflictError):
            store.fork(a, branch="main")  # an ancestor of the head: b would be orphaned all the same
        assert snapshot(tmp_path / "s", with_catalog=True) == before and store.resolve("main") == b
        ahead = store.fork(b, branch="main", message="relabel")  # descends from the head: moves
        assert store.resolve("main") == ahead.id and ahead.parents == (b,)
        store.tag("keep", ahead.id)
        moved = store.fork(c, branch="main")  # the head stays reachable by the tag: moves
        forced = store.fork(a, branch="other", force=True)  # c is lost to names, but forced
        assert store.resolve("main") == moved.id and store.resolve("other") == forced.id
        assert [e["new"] for e in store.reflog("other")][-1] == forced.id
        assert torch.equal(store.load(b)["w"], torch.ones(4)) and torch.equal(store.load(c)["w"], torch.zeros(4))


def test_a_save_with_parents_off_the_branch_head_is_refused_before_writing_unless_forced(tmp_path: Path) -> None:
    store, a, b, c = _diverged(tmp_path)
    with store:
        before = snapshot(tmp_path / "s", with_catalog=True)
        with pytest.raises(ConflictError, match="this save would move branch 'main'"):
            store.save({"w": torch.full((4,), 7.0)}, branch="main", parents=[a])
        with pytest.raises(InvalidArgumentError, match="force='yes' is not True or False"):
            store.save(W, branch="main", parents=[a], force="yes")
        assert snapshot(tmp_path / "s", with_catalog=True) == before  # not even a pack
        merged = store.save(W, branch="main", parents=[b, c])  # a merge keeps the head as a parent
        restart = store.save({"w": torch.full((4,), 7.0)}, branch="main", parents=[a], force=True)
        assert merged.parents == (b, c) and restart.parents == (a,) and store.resolve("main") == restart.id
        assert store.fsck().ok


def test_a_save_whose_branch_moved_off_its_parents_before_the_commit_is_refused_there(tmp_path: Path) -> None:
    """The call's check passed (main was at a, the parent); another writer moved main to c before the commit,
    under the ref lock this test holds: the commit refuses, nothing of the save is visible, main stays at c."""
    store = ds.Store.open(tmp_path / "s")
    with store:
        a = store.save(W, branch="main").id
        c = store.save({"w": torch.zeros(4)}, branch=None).id
        with store.refs.locked():
            handle = store.save_async({"w": torch.full((4,), 3.0)}, branch="main", parents=[a])
            store.refs.set_if_equals("branch", "main", a, c, "another writer", locked=True)
        with pytest.raises(ConflictError, match=f"off its head {c[:12]}"):
            handle.result(60)
        assert store.resolve("main") == c and store.versions_table().num_rows == 2
        store.wait()  # result() raised it: not raised again
        assert store.save({"w": torch.full((4,), 3.0)}, branch="main", parents=[c]).parents == (c,)


def test_the_commit_of_a_fork_checks_the_branch_under_the_lock(tmp_path: Path) -> None:
    store, a, b, c = _diverged(tmp_path)
    with store:
        rec = record_dict(parents=[c], manifests=store.version(c).manifests, step=None, epoch=None, created=1.0,
                          hparams={}, metrics={}, message="", branch="main", world_size=1, bytes_total=16,
                          bytes_new=0, chunks_new=0, fork_of=None, explore=None)
        before = snapshot(tmp_path / "s", with_catalog=True)
        with pytest.raises(ConflictError):
            make_fork_visible(rec, tier=store.tier, refs=store.refs, catalog=store.catalog, branch="main",
                              message="race")
        assert snapshot(tmp_path / "s", with_catalog=True) == before


def test_a_ref_whose_line_leads_to_a_version_the_catalog_lacks_does_not_block_a_move(tmp_path: Path) -> None:
    """The move check walks every other ref's line; one reaching a record fsck set aside (or a parent another
    host never flushed) failed every save(parents=...) and fork with NotFoundError, on any branch."""
    store = ds.Store.open(tmp_path / "s")
    with store:
        a = store.save({"w": torch.full((4,), 1.0)}, branch="old").id
        store.save({"w": torch.full((4,), 2.0)}, branch="old")
        record = store.tier.record_path(a)
        raw = bytearray(record.read_bytes())
        raw[-3] ^= 1
        record.write_bytes(bytes(raw))
        store.fsck(rebuild=True)
        assert store.catalog.record(a) is None
        x1 = store.save({"w": torch.full((4,), 10.0)}, branch="exp").id
        x2 = store.save({"w": torch.full((4,), 11.0)}, branch="exp").id
        store.tag("keep", x2)
        back = store.save({"w": torch.full((4,), 12.0)}, branch="exp", parents=[x1])  # x2 stays tagged
        assert store.resolve("exp") == back.id and back.parents == (x1,)
        store.tag("keep2", back.id)
        assert store.fork(x1, branch="exp").parents == (x1,)


def test_commit_staged_takes_force_as_save_does(tmp_path: Path) -> None:
    store = ds.Store.open(tmp_path / "s")
    with store:
        a = store.save({"w": torch.zeros(4)}, branch="main").id
        store.save({"w": torch.ones(4)}, branch="main")
        part = store.stage({"w": torch.full((4,), 2.0)})
        with pytest.raises(ConflictError, match="pass force=True"):
            store.commit_staged({"0": part}, world_size=1, branch="main", parents=[a])
        v = store.commit_staged({"0": part}, world_size=1, branch="main", parents=[a], force=True)
        assert store.resolve("main") == v.id and torch.equal(store.load(v.id)["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize("kw", [
    {"hparams": {"s": "x" * (2 << 20)}},
    {"metrics": {f"m{i}": 0.5 for i in range(100_000)}},
    {"message": "y" * (2 << 20)},
])
def test_record_fields_over_a_mebibyte_are_refused_before_anything_is_written(tmp_path: Path, kw: Any) -> None:
    """A 50 MB hparams string was stored in the record that every log and query reads."""
    with ds.Store.open(tmp_path / "s") as store:
        store.save(W, branch="main")
        before = snapshot(tmp_path / "s", with_catalog=True)
        assert "bytes as JSON, more than the 1,048,576" in _refused(store, InvalidArgumentError, **kw)
        with pytest.raises(InvalidArgumentError, match="more than the 1,048,576"):
            store.fork("main", branch="f", **kw)
        assert snapshot(tmp_path / "s", with_catalog=True) == before
        assert store.save(W, branch="main", hparams={"s": "x" * 500_000}).hparams["s"] == "x" * 500_000


def test_a_refused_huge_value_is_shown_cut_short(tmp_path: Path) -> None:
    with ds.Store.open(tmp_path / "s") as store:
        message = _refused(store, InvalidArgumentError, message="z" * 5_000_000 + "\x00")
        assert "contains a NUL character" in message and len(message) < 300
        assert len(_refused(store, InvalidArgumentError, metrics={"loss": ["x" * 100_000]})) < 400


def test_a_pickled_value_whose_class_is_gone_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load(allow_pickle=True) raised a bare ModuleNotFoundError naming no key, and the CLI export a traceback."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "gone_cfg.py").write_text("class Cfg:\n    lr = 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    import gone_cfg  # type: ignore[import-not-found]

    with ds.Store.open(tmp_path / "s") as store:
        v = store.save({"w": torch.ones(2), "cfg": gone_cfg.Cfg()}, allow_pickle=True)
    monkeypatch.delitem(sys.modules, "gone_cfg")
    (tmp_path / "mods" / "gone_cfg.py").unlink()
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.UnsupportedValueError, match=r"^cfg was saved with pickle and cannot be unpickled here "
                                                           r"\(ModuleNotFoundError"):
            store.load(v, allow_pickle=True)
        assert store.load(v, keys=["w"])["w"].tolist() == [1.0, 1.0]


def test_log_limit_must_be_a_count(store: ds.Store) -> None:
    """log(limit=-1) sliced silently: every version but the root (a review)."""
    for i in range(3):
        store.save({"w": torch.full((2,), float(i))}, step=i)
    assert [v.step for v in store.log(limit=2)] == [2, 1] and store.log(limit=0) == []
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="must be a number of versions"):
            store.log(limit=bad)  # type: ignore[arg-type]


def test_a_misspelt_keyword_of_save_or_save_async_names_that_call_and_saves_nothing(tmp_path: Path) -> None:
    """Both calls check their keywords in save_async's body (so a collective save refuses a typo on every rank);
    the message names the call the user made."""
    with ds.Store.open(tmp_path / "s") as store:
        for call, name in ((store.save, "save"), (store.save_async, "save_async")):
            with pytest.raises(ds.errors.UnexpectedArgumentError,
                               match=rf"^{name}\(\) got an unexpected keyword argument 'mesage'; did you mean"):
                call({"w": torch.ones(2)}, mesage="x")
        assert store.find("") == []
