"""diff and history against plain torch computations."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import datastates as ds
from datastates.repo.repository import Repository


@pytest.fixture
def store(tmp_path: Path) -> ds.Store:
    s = ds.Store.open(tmp_path / "s", chunk_size=1 << 16)
    yield s
    s.close()


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(200_000, generator=g), "b": torch.randn(10, generator=g),
         "same": torch.randn(1000, generator=g), "gone": torch.ones(3), "shape": torch.ones(5),
         "i": torch.arange(50, dtype=torch.int64)}
    b = {k: v.clone() for k, v in a.items() if k != "gone"}
    b["w"][123] += 2.0
    b["w"][150_000:150_010] -= 0.5
    b["b"] = b["b"] * 3 + 1
    b["shape"] = torch.ones(6)
    b["new"] = torch.zeros(4)
    b["i"][7] = 1000
    return a, b


def test_diff_values_match_torch(store: ds.Store) -> None:
    a, b = _states()
    va, vb = store.save(a), store.save(b)
    rows = {r["key"]: r for r in store.diff(va, vb).to_pylist()}
    assert rows["gone"]["status"] == "removed"
    assert rows["new"]["status"] == "added"
    assert rows["shape"]["status"] == "dtype_or_shape_changed"
    assert rows["same"]["status"] == "same"
    assert rows["same"]["l2_change"] == 0.0
    for key in ("w", "b", "i"):
        x, y = a[key].double(), b[key].double()
        r = rows[key]
        assert r["status"] == "changed"
        assert r["l2_change"] == pytest.approx(float((y - x).norm()), rel=1e-9)
        assert r["rel_change"] == pytest.approx(float((y - x).norm() / x.norm()), rel=1e-6)
        assert r["cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(x, y, dim=0)), abs=1e-6)
        assert r["max_abs_diff"] == pytest.approx(float((y - x).abs().max()), rel=1e-9)


def test_diff_never_reads_shared_chunks(store: ds.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _states()
    va, vb = store.save(a), store.save(b)
    reads: list[bytes] = []
    original = Repository.read_chunk  # diff reads through the repository under the Store

    def counting(self: Repository, cid: bytes, key: str = "?") -> bytes:
        reads.append(cid)
        return original(self, cid, key)

    monkeypatch.setattr(Repository, "read_chunk", counting)
    rows = {r["key"]: r for r in store.diff(va, vb, keys=["w"]).to_pylist()}
    w = rows["w"]
    # 200k floats = 800,000 bytes = 13 chunks of 64 KiB; the edits touch 2 of them.
    assert w["chunks_total"] == 13
    assert w["chunks_shared"] == 11
    assert len(reads) == 2 * 2
    assert list(rows) == ["w"]


def test_history_tracks_stats_without_reading_tensors(store: ds.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.zeros(1000)
    for step in range(4):
        w[step] = step + 1.0
        store.save({"model": {"w": w}}, step=step)
    monkeypatch.setattr(ds.Store, "read_chunk", lambda *a, **k: pytest.fail("history read tensor bytes"))
    t = store.history("model.w")
    assert t.column("step").to_pylist() == [0, 1, 2, 3]
    expected_l2 = [math.sqrt(sum((i + 1.0) ** 2 for i in range(s + 1))) for s in range(4)]
    assert t.column("l2").to_pylist() == pytest.approx(expected_l2)
    assert t.column("max").to_pylist() == [1.0, 2.0, 3.0, 4.0]
    assert t.column("chunks_changed").to_pylist() == [None, 1, 1, 1]
    with pytest.raises(ds.NotFoundError, match="did you mean 'model.w'"):
        store.history("model.ww")


def test_a_history_page_reads_its_own_versions_and_pages_make_the_whole(store: ds.Store,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """REST paged a history by recomputing all of it for every page (3.2 s a page at 6,000 versions)."""
    from datastates.query.compare import history_page
    from datastates.retention import KeepLatest
    w = torch.zeros(8)
    for step in range(30):
        w[step % 8] += 1.0
        state = {"w": w} if step % 5 != 3 else {"other": torch.ones(1)}  # some versions lack the key
        store.save(state, step=step, branch="main")
        if step == 10:
            store.tag("kept", "main")
        if step == 14:
            store.prune(KeepLatest(3))  # every version but the tag and the three last so far
    whole = store.history("w").to_pylist()
    assert [r["step"] for r in whole] == [10, 12, 14] + [s for s in range(15, 30) if s % 5 != 3]

    reads: list[str] = []
    real = Repository.manifest_of
    monkeypatch.setattr(Repository, "manifest_of", lambda self, v: reads.append(v.id) or real(self, v))
    rows: list[dict[str, object]] = []
    start: int | None = 0
    while start is not None:
        reads.clear()
        page, start = history_page(store, "w", "main", start, 2)
        rows += page.to_pylist()
        assert len(reads) <= 5  # the version before, its two rows, one without the key, the next page's first
    assert rows == whole
    with pytest.raises(ds.InvalidArgumentError, match="start again at 0"):
        history_page(store, "w", "main", 31, 2)
    with pytest.raises(ds.NotFoundError, match="did you mean 'w'"):
        history_page(store, "ww", "main")


def test_history_values_yields_each_version(store: ds.Store) -> None:
    for step in range(3):
        store.save({"w": torch.full((4,), float(step)), "other": torch.ones(2)}, step=step)
    got = [(v.step, t.tolist()) for v, t in store.history("w", values=True)]
    assert got == [(0, [0.0] * 4), (1, [1.0] * 4), (2, [2.0] * 4)]


def test_history_values_of_a_mistyped_key_raises_at_the_call(store: ds.Store) -> None:
    """history(key) refused a typo, history(key, values=True) iterated it as nothing (a review)."""
    store.save({"model": {"fc": {"weight": torch.ones(2)}}}, step=0)
    for values in (False, True):
        with pytest.raises(ds.NotFoundError, match="did you mean 'model.fc.weight'"):
            store.history("model.fc.wieght", values=values)


def test_history_of_a_pruned_line_says_it_was_pruned(store: ds.Store) -> None:
    """history(key, ref) of a ref pruned with every version before it returned an empty table (an empty listing,
    exit 0, from `datastates history`), and values=True iterated nothing."""
    from datastates.cli import main
    from datastates.retention import KeepLatest, Retention

    for i in range(3):
        store.save({"w": torch.full((2,), float(i))}, step=i)
    store.prune(Retention(KeepLatest(1)))
    old = store.log("main")[-1]
    assert old.pruned
    for values in (False, True):
        with pytest.raises(ds.PrunedError, match=f"version {old.short} was pruned"):
            store.history("w", old.id, values=values)
    assert store.history("w").column("step").to_pylist() == [2]  # the live head: its own row, the pruned left out
    assert main(["--store", str(store.path), "history", "w", old.id]) == 1


def test_history_and_ls_at_the_command_line_show_nan_and_inf_counts(store: ds.Store,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The statistics are of the finite values: `datastates history` and `ls` showed a diverged [1, nan, inf] as l2 1,
    min 1, max 1, as a healthy tensor (the counts were in the Python table only)."""
    from datastates.cli import main

    nan, inf = float("nan"), float("inf")
    store.save({"x": torch.tensor([1.0, 2.0, 2.0])}, step=0)
    store.save({"x": torch.tensor([1.0, nan, inf])}, step=1)
    store.save({"x": torch.tensor([nan, nan, -inf])}, step=2)
    assert main(["--store", str(store.path), "history", "x"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.rsplit("  (", 1)[1] if "  (" in r else "" for r in rows] == ["", "1 NaN, 1 inf)", "2 NaN, 1 inf)"]
    assert main(["--store", str(store.path), "ls", "main~1"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("  (1 NaN, 1 inf)")


def test_a_change_to_or_from_nan_or_inf_is_unbounded_not_none(store: ds.Store) -> None:
    """diff counted every element that went to or from NaN or inf as unchanged: a diverged run read as identical
    (l2_change 0, cosine 1; a review). NaN staying NaN, and inf staying the same inf, are no change."""
    nan, inf = float("nan"), float("inf")
    store.save({"to_nan": torch.tensor([1.0, 2.0, 3.0]), "from_inf": torch.tensor([1.0, inf]),
                "stays": torch.tensor([nan, inf, 1.0]), "big": torch.zeros(40_000)}, step=1)
    big = torch.zeros(40_000)
    big[30_000] = nan  # in one of several chunks
    store.save({"to_nan": torch.tensor([1.0, nan, 3.0]), "from_inf": torch.tensor([1.0, 5.0]),
                "stays": torch.tensor([nan, inf, 4.0]), "big": big}, step=2)
    rows = {r["key"]: r for r in store.diff("main~1", "main").to_pylist()}
    for key in ("to_nan", "from_inf", "big"):
        r = rows[key]
        assert r["status"] == "changed", key
        assert (r["l2_change"], r["rel_change"], r["max_abs_diff"], r["cosine"]) == (math.inf, math.inf, math.inf,
                                                                                     None), key
    assert rows["stays"]["l2_change"] == 3.0 and rows["stays"]["max_abs_diff"] == 3.0


def test_diff_memory_stays_bounded(tmp_path: Path) -> None:
    """Diff two 256 MiB versions in a fresh process; its peak RSS grows far less than one version."""
    script = textwrap.dedent(f"""
        import resource, torch, datastates as ds
        s = ds.Store.open({str(tmp_path / "big")!r}, pool_bytes=64 << 20)
        x = torch.randn(64 << 20)            # 256 MiB
        va = s.save({{"x": x}})
        x.add_(1.0)
        vb = s.save({{"x": x}})
        del x
        import gc; gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = s.diff(va, vb).to_pylist()[0]
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        s.close()
        print(r["status"], round(r["max_abs_diff"], 3), after - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
    assert out[0] == "changed"
    assert float(out[1]) == pytest.approx(1.0, abs=1e-3)
    # ru_maxrss is in KiB: the diff may not raise the peak by more than 64 MiB (a version is 256 MiB).
    assert int(out[2]) < 64 * 1024


def test_diff_of_a_plain_value_key_says_it_holds_no_tensor(store: ds.Store) -> None:
    """diff(keys=['lr']) said 'lr' is in neither version, though both hold it (a plain value; a review)."""
    a = store.save({"w": torch.ones(2), "lr": 0.1}, step=0)
    b = store.save({"w": torch.zeros(2), "lr": 0.2}, step=1)
    with pytest.raises(ds.NotFoundError, match=rf"key 'lr' of {a.short} holds no tensor .*Store.load with keys"):
        store.diff(a, b, keys=["lr"])
    assert store.load(a, keys=["lr"]) == {"lr": 0.1}  # what the message says to do
    with pytest.raises(ds.NotFoundError, match="is in neither"):
        store.diff(a, b, keys=["nope"])


def test_a_view_beside_an_infinity_in_its_storage_changes_by_its_finite_values(store: ds.Store) -> None:
    """Through a view, an infinity that stays put made the first version's norm the dtype's largest number, and the
    change beside it read as none (rel 0.0, cosine 1.0; a review)."""
    base = torch.tensor([float("inf"), 1.0, 2.0, 3.0, 9.0])
    a = store.save({"base": base, "v": base[:4]}, step=0)
    base2 = torch.tensor([float("inf"), 5.0, 6.0, 3.0, 9.0])
    b = store.save({"base": base2, "v": base2[:4]}, step=1)
    row = next(r for r in store.diff(a, b).to_pylist() if r["key"] == "v")
    assert row["l2_change"] == pytest.approx(math.sqrt(32.0))
    assert row["rel_change"] == pytest.approx(math.sqrt(32.0) / math.sqrt(14.0))
    assert row["cosine"] == pytest.approx((1 * 5 + 2 * 6 + 3 * 3) / (math.sqrt(14.0) * math.sqrt(70.0)))
