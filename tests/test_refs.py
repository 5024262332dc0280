"""Refs: resolving ids, prefixes, branches, tags and `REF~N`; tags are fixed, branches move by compare-and-swap,
and every move is in the reflog."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
from conftest import copy_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datastates as ds
from datastates.meta.catalog import CommitBatch
from datastates.meta.refs import check_name
from datastates.meta.versions import encode_record


@pytest.fixture(scope="module")
def chain_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A closed store with 5 versions on main (ids oldest first)."""
    path = tmp_path_factory.mktemp("chain") / "store"
    with ds.Store.open(path) as s:
        ids = [s.save({"x": torch.full((3,), float(i)), "i": i}, step=i).id for i in range(5)]
    return path, ids


@pytest.fixture
def chain(chain_template: tuple[Path, list[str]], tmp_path: Path) -> Iterator[tuple[ds.Store, list[str]]]:
    path, ids = chain_template
    s = ds.Store.open(copy_store(path, tmp_path / "store"))
    yield s, ids
    s.close(raise_errors=False)


# --------------------------------------------------------------------------- resolve
def test_resolve_forms(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    head = ids[-1]
    assert s.resolve("main") == head
    assert s.resolve(head) == head
    for n in (6, 7, 12, 63):
        assert s.resolve(head[:n]) == head
    for k in range(5):
        assert s.resolve(f"main~{k}") == ids[-1 - k]
    assert s.resolve("main~") == s.resolve("main^") == ids[-2]
    assert s.resolve("main~2^") == s.resolve("main^^^") == s.resolve("main~1~2") == ids[-4]
    assert s.resolve(f"{head[:8]}~4") == ids[0]
    assert s.resolve(s.version("main~1")) == ids[-2]
    with pytest.raises(ds.NotFoundError, match="past the root"):
        s.resolve("main~5")
    with pytest.raises(ds.NotFoundError):
        s.resolve(f"{ids[0]}^")


def test_branch_and_tag_targets(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    assert s.tag("v0", "main~4") == ids[0]
    assert s.branch("dev", at="v0") == ids[0]
    assert s.resolve("v0") == s.resolve("dev") == ids[0]
    assert s.resolve("dev~0") == ids[0]
    v = s.save({"x": torch.zeros(1)}, branch="dev")
    assert v.parents == (ids[0],) and s.resolve("dev~1") == ids[0]
    assert s.resolve("v0") == ids[0]  # a tag does not move with saves
    assert s.branches() == {"dev": v.id, "main": ids[-1]}
    assert s.tags() == {"v0": ids[0]}


def test_branch_never_takes_a_tags_name(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    s.tag("same", ids[0])
    with pytest.raises(ds.errors.ConflictError):
        s.branch("same", at=ids[1])
    assert s.resolve("same") == ids[0] and "same" not in s.branches()


def test_hex_looking_branch_name(chain: tuple[ds.Store, list[str]], unchanged: Any) -> None:
    """A ref named like the start of a version's id hid that version wherever the prefix was given (refs
    resolve first, as in git): it is refused, in either case; a hex name no id starts with is a name."""
    s, ids = chain
    makers = (lambda n: s.branch(n, at=ids[3]), lambda n: s.tag(n, ids[3]),
              lambda n: s.save({"x": torch.zeros(1)}, branch=n), lambda n: s.fork(ids[3], branch=n))
    for name in (ids[0][:8], ids[0][:12].upper()):
        with unchanged(s):
            for make in makers:
                with pytest.raises(ds.ConflictError, match=f"is the start of version {ids[0][:12]}'s id"):
                    make(name)
        assert s.resolve(name) == ids[0]
    free = next(f"{n:06x}" for n in range(2**24) if not any(i.startswith(f"{n:06x}") for i in ids))
    assert s.branch(free, at=ids[3]) == s.resolve(free) == ids[3]
    s.repo.refs.add_if_new("tag", ids[1][:8], ids[3], "made before names were checked")
    assert s.resolve(ids[1][:8]) == ids[3]  # such a ref, already there, still resolves first


# --------------------------------------------------------------------------- tags
def test_tag_twice_is_a_conflict(chain: tuple[ds.Store, list[str]], unchanged: Any) -> None:
    s, ids = chain
    s.tag("best", ids[2], message="the best")
    with unchanged(s):
        for target in (ids[3], ids[2]):
            # the way out (tags never move), naming the store: a Python caller pastes it into a shell
            with pytest.raises(ds.ConflictError, match=f"`datastates --store {s.path} tag -d best`"):
                s.tag("best", target)
    assert s.resolve("best") == ids[2]
    with unchanged(s), pytest.raises(ds.ConflictError,
                                     match=f"`datastates --store {s.path} branch -f main {ids[1][:12]}`"):
        s.branch("main", at=ids[1])  # a branch moves, with force: the hint says so with the id it was asked for


def test_delete_and_recreate_tag(chain: tuple[ds.Store, list[str]], unchanged: Any) -> None:
    s, ids = chain
    s.tag("t", ids[1])
    assert s.delete_tag("t") == ids[1]
    assert "t" not in s.tags()
    with pytest.raises(ds.NotFoundError):
        s.resolve("t")
    with unchanged(s), pytest.raises(ds.NotFoundError):
        s.delete_tag("t")
    s.tag("t", ids[4])
    assert s.resolve("t") == ids[4]
    log = s.reflog("t", kind="tag")
    assert [(e["old"], e["new"]) for e in log] == [(None, ids[1]), (ids[1], None), (None, ids[4])]


# --------------------------------------------------------------------------- branches
def test_branch_exists_without_force(chain: tuple[ds.Store, list[str]], unchanged: Any) -> None:
    s, ids = chain
    s.branch("dev", at=ids[0])
    with unchanged(s), pytest.raises(ds.ConflictError, match="dev"):
        s.branch("dev", at=ids[1])
    assert s.branch("dev", at=ids[1], force=True) == ids[1]
    assert s.resolve("dev") == ids[1]
    assert [(e["old"], e["new"]) for e in s.reflog("dev")] == [(None, ids[0]), (ids[0], ids[1])]


def test_delete_branch_keeps_versions(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    s.branch("gone", at=ids[2])
    v = s.save({"x": torch.ones(2)}, branch="gone")
    with pytest.raises(ds.errors.ConflictError, match="1 version"):
        s.delete_branch("gone")  # v is reachable only through "gone"
    assert s.delete_branch("gone", force=True) == v.id
    assert "gone" not in s.branches()
    assert torch.equal(s.load(v.id)["x"], torch.ones(2))
    assert s.reflog("gone")[-1]["old"] == v.id and s.reflog("gone")[-1]["new"] is None
    with pytest.raises(ds.NotFoundError):
        s.delete_branch("gone")


def test_compare_and_swap(chain: tuple[ds.Store, list[str]], unchanged: Any) -> None:
    s, ids = chain
    refs = s.refs
    with unchanged(s):
        with pytest.raises(ds.ConflictError, match="main"):
            refs.set_if_equals("branch", "main", ids[0], ids[1])  # main is at ids[4], not ids[0]
        with pytest.raises(ds.ConflictError):
            refs.set_if_equals("branch", "main", None, ids[1])  # None: must not exist yet
        with pytest.raises(ds.ConflictError):
            refs.remove_if_equals("branch", "main", ids[0])
    refs.set_if_equals("branch", "main", ids[4], ids[2], "reset")
    assert s.resolve("main") == ids[2]
    assert s.reflog("main")[-1]["message"] == "reset"


def test_reflog_has_one_entry_per_move(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    log = s.reflog("main")
    assert [e["new"] for e in log] == ids
    assert [e["old"] for e in log] == [None, *ids[:-1]]
    assert all({"time", "message", "pid", "host"} <= set(e) for e in log)
    assert s.reflog("never") == []


def test_log_follows_first_parents(chain: tuple[ds.Store, list[str]]) -> None:
    pytest.importorskip("datastates.query.lineage")
    s, ids = chain
    assert [v.id for v in s.log("main")] == ids[::-1]
    assert [v.step for v in s.log("main~2")] == [2, 1, 0]
    assert [v.id for v in s.log("main", limit=2)] == [ids[4], ids[3]]


# --------------------------------------------------------------------------- names
name_chars = st.sampled_from(list("abcXYZ019-_./%@\u00e9\u4e2d+=,"))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(names=st.lists(st.text(name_chars, min_size=1, max_size=20), min_size=1, max_size=4, unique=True))
def test_valid_names_round_trip(chain: tuple[ds.Store, list[str]], names: list[str]) -> None:
    s, ids = chain
    good = []
    for name in names:
        try:
            check_name(name)
        except ds.InvalidNameError:
            with pytest.raises(ds.InvalidNameError):
                s.branch(name, at=ids[0])
            continue
        good.append(name)
    for i, name in enumerate(good):
        s.branch(name, at=ids[i % 5], force=True)
        if f"tag-{name}" not in s.tags():  # 't' and 'g' are not in name_chars: never a branch's name
            s.tag(f"tag-{name}", ids[i % 5])
    branches, tags = s.branches(), s.tags()
    for i, name in enumerate(good):  # '/' and '%' in names neither collide nor make directories
        assert branches[name] == ids[i % 5]
        assert f"tag-{name}" in tags
        assert s.resolve(name) == ids[i % 5]
    assert not [p for p in (s.path / "refs" / "heads").iterdir() if p.is_dir()]


def test_slash_and_percent_names_do_not_collide(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    for i, name in enumerate(["a/b", "a%2Fb", "a%252Fb", "a", "a/b/c", "%", "%%2F"]):
        s.branch(name, at=ids[i % 5])
    assert {k: v for k, v in s.branches().items() if k != "main"} == {
        "a/b": ids[0], "a%2Fb": ids[1], "a%252Fb": ids[2], "a": ids[3], "a/b/c": ids[4], "%": ids[0],
        "%%2F": ids[1]}


# --------------------------------------------------------------------------- ambiguous prefixes
def _colliding_records(s: ds.Store, base: str) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
    """Two valid version records (children of `base`, reusing its manifest) whose ids share 6 hex digits.

    Found by hashing candidate records (the birthday bound makes this ~5000 blake3 calls), not by
    saving thousands of versions."""
    rec = json.loads(s.catalog.record(base) or b"{}")
    rec["parents"] = [base]
    seen: dict[str, tuple[str, bytes]] = {}
    for i in range(200_000):
        rec["message"] = f"collide {i}"
        vid, data = encode_record(rec)
        other = seen.get(vid[:6])
        if other is not None:
            return other, (vid, data)
        seen[vid[:6]] = (vid, data)
    raise AssertionError("no 6-hex collision in 200000 records")


def test_ambiguous_prefix(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    (a, da), (b, db) = _colliding_records(s, ids[-1])
    for vid, data in ((a, da), (b, db)):
        assert blake3.blake3(data).hexdigest() == vid
        s.tier.write_record(vid, data)  # exactly what a save writes, minus the tensors it reuses
        s.catalog.commit(CommitBatch(vid, data, [ids[-1]]))
    with pytest.raises(ds.AmbiguousRefError) as err:
        s.resolve(a[:6])
    assert a[:12] in str(err.value) and b[:12] in str(err.value)
    assert isinstance(err.value, ValueError)
    n = next(i for i in range(64) if a[i] != b[i]) + 1
    for vid in (a, b):
        assert s.resolve(vid[:n]) == vid
        assert s.resolve(vid) == vid
        assert s.version(vid).parents == (ids[-1],)
        assert torch.equal(s.load(vid)["x"], torch.full((3,), 4.0))
    if n > 7:  # an odd-length prefix still shared by both
        with pytest.raises(ds.AmbiguousRefError):
            s.resolve(a[:7])
    assert sorted(s.catalog.ids_with_prefix(a[:6], limit=5)) == sorted([a, b])
    assert len(s.catalog.ids_with_prefix(a[:6], limit=1)) == 1
    assert s.fsck().ok


def test_catalog_prefix_lookup(chain: tuple[ds.Store, list[str]]) -> None:
    s, ids = chain
    for vid in ids:
        for n in (1, 2, 5, 6, 13, 64):
            assert vid in s.catalog.ids_with_prefix(vid[:n], limit=10)
    absent = next(p for p in (f"{i:06x}" for i in range(1 << 24)) if not any(v.startswith(p) for v in ids))
    assert s.catalog.ids_with_prefix(absent) == []
    with pytest.raises(ds.NotFoundError):
        s.resolve(absent)
    assert sorted(v for v, _ in s.catalog.records()) == sorted(ids)


def test_a_long_ref_is_shown_cut_in_its_error(chain: tuple[ds.Store, list[str]], unchanged: Any) -> None:
    """A 5,000-character ref was echoed whole, in resolve's error and in a refused ref name."""
    s, _ = chain
    long = "x" * 5000
    with unchanged(s):
        for call in (lambda: s.load(long), lambda: s.tag(long, "main"), lambda: s.branch(long + "\x00", at="main")):
            with pytest.raises((ds.NotFoundError, ds.InvalidNameError)) as info:
                call()
            shown = str(info.value).replace(str(s.path), "")  # its hints name the store, whose path is long here
            assert "'xxxxxxxxxx" in shown and len(shown) < 300
