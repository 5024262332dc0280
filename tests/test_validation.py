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

import datastates as ds
from datastates.errors import InvalidArgumentError, InvalidNameError, UnsupportedValueError
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
