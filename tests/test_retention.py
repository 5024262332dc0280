"""Retention policies and prune: which versions keep their bytes, and what a prune leaves behind."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import states

from datastates import NotFoundError, PrunedError, Store, Version
from datastates.base.files import write_new
from datastates.cli.maintenance import add_parsers, retention_from_args, run
from datastates.retention import (
    KeepBest,
    KeepBranchHeads,
    KeepEvery,
    KeepIf,
    KeepLatest,
    KeepTagged,
    Policy,
    Retention,
    is_pruned,
    marker_path,
    metric_value,
    plan,
    prune,
    register_protector,
    unregister_protector,
)

Made = dict[str, tuple[str, int]]
"""version id -> (branch, step) it was saved with."""

# main: steps 0, 10, ..., 110 (12 versions); exp: forked at main step 40, steps 50, 60, ..., 120 (8 versions).
MAIN_STEPS = list(range(0, 120, 10))
EXP_STEPS = list(range(50, 130, 10))


def val_loss(branch: str, step: int) -> float | None:
    """Main improves then worsens (best at step 60); exp has no metric at steps that are odd multiples of 10."""
    if branch == "main":
        return round(abs(step - 60) / 100 + 0.1, 4)
    return None if (step // 10) % 2 else round(0.05 + (120 - step) / 1000, 4)


def make_state(branch: str, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 7 + len(branch))  # distinct for every (branch, step) here
    return {"model": {"w": torch.randn(64, generator=g), "b": torch.full((8,), float(step))},
            "frozen": torch.arange(256, dtype=torch.float32), "step": step}


def open_store(path: Path) -> Store:
    return Store.open(path, chunk_size=1024, pool_bytes=32 << 20)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Made]:
    """A closed store of 20 versions on two branches, a tag 'good' at main step 20; id -> (branch, step)."""
    path = tmp_path_factory.mktemp("retention") / "store"
    made: Made = {}
    with open_store(path) as s:
        for step in MAIN_STEPS:
            loss = val_loss("main", step)
            v = s.save(make_state("main", step), branch="main", step=step,
                       metrics={} if loss is None else {"val_loss": loss})
            made[v.id] = ("main", step)
            if step == 40:
                s.branch("exp", at=v)
            if step == 20:
                s.tag("good", v)
        for step in EXP_STEPS:
            loss = val_loss("exp", step)
            v = s.save(make_state("exp", step), branch="exp", step=step,
                       metrics={} if loss is None else {"val_loss": loss})
            made[v.id] = ("exp", step)
    return path, made


@pytest.fixture
def store(template: tuple[Path, Made], tmp_path: Path) -> Iterator[Store]:
    path = tmp_path / "store"
    shutil.copytree(template[0], path)
    with open_store(path) as s:
        yield s


@pytest.fixture
def made(template: tuple[Path, Made]) -> Made:
    return template[1]


def all_versions(store: Store) -> list[Version]:
    return [store.version(vid) for vid, _ in store.catalog.records()]


def ids_where(made: Made, pred: Any) -> set[str]:
    return {vid for vid, (branch, step) in made.items() if pred(branch, step)}


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (lock files aside, the catalog's data file included) and a digest of its bytes."""
    return states.snapshot(root, with_catalog=True)


def assert_bit_exact(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert got.contiguous().view(torch.uint8).numpy().tobytes() == \
            want.contiguous().view(torch.uint8).numpy().tobytes()
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for k in want:
            assert_bit_exact(got[k], want[k])
    else:
        assert got == want


# single policies -------------------------------------------------------------------------------------------------
def test_keep_latest_per_branch_keeps_the_newest_n_of_each_branch(store: Store, made: Made) -> None:
    kept = KeepLatest(3).keep(all_versions(store), store)
    assert kept == ids_where(made, lambda b, s: (b == "main" and s >= 90) or (b == "exp" and s >= 100))


def test_keep_latest_overall_keeps_the_newest_n_saved(store: Store, made: Made) -> None:
    kept = KeepLatest(4, per_branch=False).keep(all_versions(store), store)
    assert kept == ids_where(made, lambda b, s: b == "exp" and s >= 90)  # exp was saved last
    assert KeepLatest(0).keep(all_versions(store), store) == set()
    assert len(KeepLatest(100).keep(all_versions(store), store)) == 20


def test_keep_best_min_and_max_skip_versions_without_the_metric(store: Store, made: Made) -> None:
    versions = all_versions(store)
    best_min = KeepBest(2, "metrics.val_loss", "min").keep(versions, store)
    # exp 120: 0.05, exp 100: 0.07 are the lowest losses.
    assert best_min == ids_where(made, lambda b, s: b == "exp" and s in (100, 120))
    best_max = KeepBest(1, "metrics.val_loss", "max").keep(versions, store)
    assert best_max == ids_where(made, lambda b, s: b == "main" and s == 0)
    with_metric = sum(1 for v in versions if "val_loss" in v.metrics)
    assert with_metric == 16  # four exp versions have no metric
    assert len(KeepBest(50).keep(versions, store)) == 16
    with pytest.raises(NotFoundError, match="metrics.nope"):
        KeepBest(3, "metrics.nope").keep(versions, store)  # no version has it: a typo, not "keep none"
    with pytest.raises(NotFoundError, match="did you mean metrics.val_loss"):
        KeepBest(3, "metrics.val_los").keep(versions, store)


def test_keep_best_reads_annotations_added_after_the_save(store: Store, made: Made) -> None:
    target = next(iter(ids_where(made, lambda b, s: b == "exp" and s == 50)))  # no val_loss in its record
    store.annotate(target, metrics={"val_loss": 0.001, "acc": 0.99})
    versions = all_versions(store)
    assert KeepBest(1).keep(versions, store) == {target}
    assert KeepBest(1, "metrics.acc", "max").keep(versions, store) == {target}
    assert KeepBest(1, "val_loss").keep(versions, store) == {target}  # a bare name means metrics.<name>
    assert metric_value(store.version(target), "hparams.lr") is None


def test_prune_ranks_by_metrics_annotated_after_the_save(tmp_path: Path) -> None:
    """KeepBest ranked prune's versions by their records' metrics only: a version `annotate(v, metrics=...)` made
    the best (evaluated later) was pruned, and with the metric only in annotations prune refused ('no version
    has metrics.val_loss'; a hunt)."""
    with Store.open(tmp_path / "s") as s:
        vs = [s.save({"w": torch.full((4,), float(i))}, step=i, metrics={"val_loss": 5.0 - i / 10}) for i in range(5)]
        s.annotate(vs[0], metrics={"val_loss": 0.01})
        plan = s.prune(Retention(KeepBest(1, "metrics.val_loss", "min")))
        assert vs[0].id in plan.keep and vs[3].id in plan.prune
        assert s.load(vs[0])["w"].tolist() == [0.0] * 4
    with Store.open(tmp_path / "t") as s:
        vs = [s.save({"w": torch.full((4,), float(i))}, step=i) for i in range(4)]
        for i, v in enumerate(vs):
            s.annotate(v, metrics={"val_loss": float(i)})
        plan = s.prune(Retention(KeepBest(1, "val_loss", "min")), dry_run=True)
        assert vs[0].id in plan.keep and {vs[1].id, vs[2].id} <= plan.prune


def test_keep_every_keeps_steps_that_are_multiples(store: Store, made: Made) -> None:
    kept = KeepEvery(40).keep(all_versions(store), store)
    assert kept == ids_where(made, lambda b, s: s % 40 == 0)
    assert len(kept) == 5  # main 0, 40, 80; exp 80, 120


def test_keep_tagged_and_branch_heads(store: Store, made: Made) -> None:
    versions = all_versions(store)
    assert KeepTagged().keep(versions, store) == ids_where(made, lambda b, s: b == "main" and s == 20)
    assert KeepBranchHeads().keep(versions, store) == ids_where(
        made, lambda b, s: (b, s) in (("main", 110), ("exp", 120)))


def test_keep_if_applies_the_predicate(store: Store, made: Made) -> None:
    kept = KeepIf(lambda v: v.branch == "exp" and (v.step or 0) < 70).keep(all_versions(store), store)
    assert kept == ids_where(made, lambda b, s: b == "exp" and s < 70)


def test_policies_reject_bad_arguments() -> None:
    with pytest.raises(ValueError):
        KeepLatest(-1)
    with pytest.raises(ValueError):
        KeepBest(1, mode="avg")
    with pytest.raises(ValueError):
        KeepEvery(0)
    with pytest.raises(ValueError):
        Retention()
    with pytest.raises(TypeError):
        Retention(3)  # type: ignore[arg-type]


# combined ------------------------------------------------------------------------------------------------------
def test_retention_is_the_union_of_its_policies(store: Store) -> None:
    versions = all_versions(store)
    parts: list[Policy] = [KeepLatest(2), KeepBest(2), KeepEvery(50)]
    union = set().union(*(p.keep(versions, store) for p in parts))
    assert Retention(*parts).keep(versions, store) == union
    assert (KeepLatest(2) | KeepBest(2) | KeepEvery(50)) == Retention(*parts)
    # latest 2 per branch: main 100, 110, exp 110, 120; best 2: exp 120, 100; every 50: main 0, 50, 100, exp 50, 100
    assert len(union) == 8


def test_plan_splits_every_unpruned_version_into_keep_and_prune(store: Store, made: Made) -> None:
    before = snapshot(store.path)
    p = plan(store, Retention(KeepLatest(2), KeepEvery(40)))
    assert snapshot(store.path) == before
    assert store.catalog.pruned_ids() == set()
    assert p.keep | p.prune == set(made) and not (p.keep & p.prune)
    assert p.dry_run
    expected_keep = ids_where(made, lambda b, s: s % 40 == 0 or (b == "main" and s >= 100) or (b == "exp" and s >= 110)
                              or (b, s) == ("main", 20))  # the tag
    assert p.keep == expected_keep
    assert p.protected == ids_where(made, lambda b, s: (b, s) in (("main", 20), ("main", 110), ("exp", 120)))


def test_prune_dry_run_changes_nothing(store: Store) -> None:
    before = snapshot(store.path)
    p = prune(store, Retention(KeepLatest(1)), dry_run=True)
    assert len(p.prune) == 20 - 3
    assert snapshot(store.path) == before
    assert not any(store.version(v).pruned for v in p.prune)


def test_prune_keeps_tags_and_branch_heads_even_if_no_policy_does(store: Store,
                                                                  made: Made) -> None:
    p = prune(store, KeepIf(lambda v: False))
    survivors = ids_where(made, lambda b, s: (b, s) in (("main", 20), ("main", 110), ("exp", 120)))
    assert p.keep == survivors == p.protected
    assert p.prune == set(made) - survivors
    for vid in survivors:
        branch, step = made[vid]
        assert_bit_exact(store.load(vid), make_state(branch, step))
    assert store.catalog.pruned_ids() == set(made) - survivors


def test_pruned_version_raises_pruned_error_and_keeps_record_and_lineage(store: Store,
                                                                        made: Made) -> None:
    victim = next(iter(ids_where(made, lambda b, s: (b, s) == ("main", 40))))  # exp's fork point
    record_before = store.version(victim)
    parents_of_exp_head = store.ancestors("exp")
    prune(store, Retention(KeepLatest(2)))
    v = store.version(victim)
    assert v.pruned and v.parents == record_before.parents and v.record() == record_before.record()
    with pytest.raises(PrunedError):
        store.load(victim)
    with pytest.raises(PrunedError):
        store.ls(victim)
    assert store.ancestors("exp") == parents_of_exp_head  # lineage through the pruned fork point is whole
    assert victim in store.ancestors("main")
    assert len(store.descendants(victim)) == 7 + 8  # main 50..110 and the exp branch
    assert store.tier.record_path(victim).exists()
    assert marker_path(store.tier, victim).exists() and is_pruned(store, victim)
    assert json.loads(marker_path(store.tier, victim).read_text())["version"] == victim
    table = store.versions_table()  # the cached table must see the prune
    pruned_col = dict(zip(table.column("id").to_pylist(), table.column("pruned").to_pylist()))
    assert pruned_col[victim] is True and sum(pruned_col.values()) == 20 - 5


def test_prune_twice_prunes_nothing_new(store: Store) -> None:
    first = prune(store, Retention(KeepLatest(3)))
    second = prune(store, Retention(KeepLatest(3)))
    assert second.prune == set() and second.already_pruned == first.prune
    assert second.bytes_freed == 0


def test_later_prune_counts_only_versions_not_pruned_yet(store: Store, made: Made) -> None:
    prune(store, Retention(KeepLatest(4)))
    second = prune(store, Retention(KeepLatest(2)))
    gone = (("main", 80), ("main", 90), ("exp", 90), ("exp", 100))
    assert second.prune == ids_where(made, lambda b, s: (b, s) in gone)


def test_protector_keeps_the_versions_it_names(store: Store, made: Made) -> None:
    donors = ids_where(made, lambda b, s: b == "main" and s in (30, 70))

    def protect(s: Store) -> set[str]:
        assert s is store
        return donors

    register_protector(protect)
    try:
        p = prune(store, Retention(KeepLatest(1)))
    finally:
        unregister_protector(protect)
    assert donors <= p.keep and donors <= p.protected and not (donors & p.prune)
    for vid in donors:
        assert_bit_exact(store.load(vid), make_state(*made[vid]))
    # Unregistered, it protects nothing any more.
    p2 = prune(store, Retention(KeepLatest(1)))
    assert p2.prune == donors


def test_failing_protector_aborts_the_prune_before_any_change(store: Store) -> None:
    def broken(s: Store) -> set[str]:
        raise RuntimeError("population registry unavailable")

    before = snapshot(store.path)
    register_protector(broken)
    try:
        with pytest.raises(RuntimeError):
            prune(store, Retention(KeepLatest(1)))
    finally:
        unregister_protector(broken)
    assert snapshot(store.path) == before and store.catalog.pruned_ids() == set()


def test_plan_bytes_freed_counts_chunks_only_pruned_versions_name(store: Store) -> None:
    p = plan(store, Retention(KeepLatest(2)))
    chunks_of = {vid: {c for r in store.manifest_of(store.version(vid)).rows for c in r["chunks"]}
                 for vid in p.keep | p.prune}
    staying: set[bytes] = set().union(*(chunks_of[v] for v in p.keep))
    going: set[bytes] = set().union(*(chunks_of[v] for v in p.prune)) - staying
    locs = [loc for loc in store.catalog.chunks(going) if loc is not None]
    assert len(locs) == len(going) > 0
    assert p.bytes_freed == sum(loc.length for loc in locs)


def test_rebuilt_catalog_keeps_pruned_marks(store: Store, made: Made) -> None:
    p = prune(store, Retention(KeepLatest(2)))
    rep = store.fsck(rebuild=True)
    assert store.catalog.pruned_ids() == set(p.prune)
    assert not any(line.startswith("version") for line in rep.problems)
    with pytest.raises(PrunedError):
        store.load(next(iter(p.prune)))
    path = store.path
    store.close()
    shutil.rmtree(path / "catalog")
    with open_store(path) as again:  # a missing catalog is rebuilt on open
        assert again.catalog.pruned_ids() == set(p.prune)
        with pytest.raises(PrunedError):
            again.load(next(iter(p.prune)))
        for vid in p.keep:
            assert_bit_exact(again.load(vid), make_state(*made[vid]))


def test_prune_completes_a_mark_a_crash_left_only_in_the_files(store: Store, made: Made) -> None:
    half_done = next(iter(ids_where(made, lambda b, s: (b, s) == ("main", 10))))
    write_new(marker_path(store.tier, half_done), b"{}")  # the crash hit after the marker, before the catalog
    assert not store.version(half_done).pruned
    p = plan(store, Retention(KeepLatest(100)))
    assert half_done in p.already_pruned and half_done not in p.keep
    prune(store, Retention(KeepLatest(100)))
    assert store.version(half_done).pruned
    assert store.catalog.pruned_ids() == {half_done}


def test_prune_on_a_tiered_store_marks_cold_too_so_another_host_sees_it(tmp_path: Path) -> None:
    cold, ids = tmp_path / "cold", []
    with Store.open(cold, hot=tmp_path / "hot-a", chunk_size=1024, pool_bytes=32 << 20) as a:
        for step in range(4):
            ids.append(a.save(make_state("main", step), step=step).id)
        assert a.flush(timeout=60)
        p = prune(a, Retention(KeepLatest(1)))
        assert p.prune == set(ids[:3])
        assert all(marker_path(t, vid).exists() for t in a.tiers for vid in p.prune)
    # Another host: its own empty hot tier, a catalog rebuilt from the shared cold tier.
    with Store.open(cold, hot=tmp_path / "hot-b", chunk_size=1024, pool_bytes=32 << 20) as b:
        assert b.catalog.pruned_ids() == set(ids[:3])
        with pytest.raises(PrunedError):
            b.load(ids[0])
        assert_bit_exact(b.load(ids[3]), make_state("main", 3))


def test_prune_honours_a_marker_another_host_left_on_cold(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    with Store.open(cold, hot=tmp_path / "hot", chunk_size=1024, pool_bytes=32 << 20) as s:
        ids = [s.save(make_state("main", step), step=step).id for step in range(3)]
        assert s.flush(timeout=60)
        assert s.cold is not None
        write_new(marker_path(s.cold, ids[0]), b"{}")  # as a prune on another host would leave it
        p = prune(s, Retention(KeepLatest(100)))
        assert p.prune == set() and p.already_pruned == {ids[0]}
        assert s.version(ids[0]).pruned and marker_path(s.tier, ids[0]).exists()


# command line ----------------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="datastates")
    add_parsers(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_cli_prune_parses_every_rule_and_prints_a_summary(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["prune", "--keep-latest", "2", "--keep-best", "1:metrics.val_loss:max", "--keep-every", "40",
                  "--dry-run"])
    retention = retention_from_args(args)
    assert retention == Retention(KeepLatest(2), KeepBest(1, "metrics.val_loss", "max"), KeepEvery(40))
    assert run(store, args) == 0
    out = capsys.readouterr().out
    expected = plan(store, retention)
    assert f"would prune {len(expected.prune)} version(s)" in out
    assert out.count("would prune ") == len(expected.prune) + 1
    assert store.catalog.pruned_ids() == set()
    assert run(store, parse(["prune", "--keep-latest", "2", "--keep-every", "40"])) == 0
    # kept: main 0, 20 (tag), 40, 80, 100, 110 and exp 80, 110, 120
    assert len(store.catalog.pruned_ids()) == 20 - 9


def test_cli_prune_again_does_not_say_nothing_can_be_freed(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    """A second prune before gc printed "0 B can be freed after `datastates gc`" while gc freed what the first
    prune gave up: the line now says what it counts and which command counts the rest."""
    assert run(store, parse(["prune", "--keep-latest", "2"])) == 0
    capsys.readouterr()
    assert run(store, parse(["prune", "--keep-latest", "2"])) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    n = len(store.catalog.pruned_ids())
    assert last == (f"0 B can be freed after `datastates gc`, beside what the {n} version(s) pruned before hold "
                    "(`datastates gc --dry-run` counts all)")
    assert store.gc(dry_run=True).total_freed > 0


def test_cli_prune_without_a_rule_refuses(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(store, parse(["prune"])) == 2
    assert "--keep-latest" in capsys.readouterr().err
    assert store.catalog.pruned_ids() == set()
    with pytest.raises(SystemExit):
        parse(["prune", "--keep-best", "2:metrics.val_loss:median"])
    with pytest.raises(SystemExit):
        parse(["prune", "--keep-latest", "-1"])


def test_a_tag_or_branch_at_a_pruned_version_is_refused(tmp_path: Path) -> None:
    """A tag or branch at a pruned version was made: it looked like a restart point, protected nothing (the bytes
    were already given up) and every load of it raised PrunedError. Now it is refused with PrunedError, in the
    API, the CLI and the REST move, and no ref is made."""
    from datastates.tensor_bytes import move_branch

    s = Store.open(tmp_path / "s")
    old = s.save({"w": torch.ones(4)}, branch="main")
    s.save({"w": torch.zeros(4)}, branch="main")
    s.prune(KeepLatest(1))
    s.branch("side", "main")
    refs = (s.tags(), s.branches())
    with pytest.raises(PrunedError, match=f"version {old.short} was pruned.*tag"):
        s.tag("old", old.id)
    with pytest.raises(PrunedError, match="branch"):
        s.branch("fork", old.id)
    with pytest.raises(PrunedError, match="branch"):
        s.branch("side", old.id, force=True)
    with pytest.raises(PrunedError):
        move_branch(s, "side", old.id, s.resolve("side"))
    assert (s.tags(), s.branches()) == refs
    s.close()
    r = subprocess.run([sys.executable, "-m", "datastates", "--store", str(tmp_path / "s"), "tag", "old", old.id],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "was pruned" in r.stderr and "Traceback" not in r.stderr
    assert Store.open(tmp_path / "s").tags() == {}
