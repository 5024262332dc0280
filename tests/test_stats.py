"""Per-tensor statistics: numerically stable std, chunk merging, NaN/Inf counts; values against torch in fp64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import datastates as ds
from datastates.save.stats import Partial, partial


def _stats_of(x: torch.Tensor, pieces: int = 1) -> dict:
    raw = x.reshape(-1).view(torch.uint8)
    step = -(-x.numel() // pieces) * x.element_size()
    p = Partial()
    for a in range(0, raw.numel(), step):
        p.merge(partial(raw[a:a + step], x.dtype))
    return p.final()


def test_std_of_batchnorm_like_weight_near_one_matches_fp64() -> None:
    g = torch.Generator().manual_seed(0)
    x = (1.0 + 1e-5 * torch.randn(4096, generator=g)).float()
    want = x.double()
    for pieces in (1, 3):
        st = _stats_of(x, pieces)
        assert st["std"] == pytest.approx(float(want.std()), rel=1e-4)
        assert st["mean"] == pytest.approx(float(want.mean()), rel=1e-7)  # fp32 resolution
        assert st["l2"] == pytest.approx(float(want.norm()), rel=1e-6)


def test_std_of_large_chunk_near_constant_goes_through_blocks() -> None:
    # More elements than one scratch block: the centred pass runs block by block.
    g = torch.Generator().manual_seed(1)
    x = (1000.0 + 1e-2 * torch.randn(600_000, generator=g)).float()
    st = _stats_of(x)
    assert st["std"] == pytest.approx(float(x.double().std()), rel=1e-4)
    assert st["min"] == float(x.min()) and st["max"] == float(x.max())


def test_stats_of_ordinary_and_integer_tensors() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10_000, generator=g)
    st = _stats_of(x, 4)
    assert st["std"] == pytest.approx(float(x.double().std()), rel=1e-5)
    i = torch.arange(1000, dtype=torch.int64) + 10**12
    st = _stats_of(i, 2)
    assert st["std"] == pytest.approx(float(i.double().std()), rel=1e-9)
    assert st["mean"] == pytest.approx(float(i.double().mean()), rel=1e-12)


def test_nan_inf_counted_apart_and_overflowing_squares() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 3.0])
    st = _stats_of(x)
    assert (st["nan_count"], st["inf_count"], st["min"], st["max"], st["mean"]) == (1, 2, 1.0, 3.0, 2.0)
    big = torch.tensor([3e38, -3e38, 3e38], dtype=torch.float32)  # squares overflow fp32
    st = _stats_of(big)
    assert st["inf_count"] == 0
    assert st["std"] == pytest.approx(float(big.double().std()), rel=1e-6)


def test_saved_std_of_batchnorm_weight_is_stable(tmp_path: Path) -> None:
    bn = torch.nn.BatchNorm1d(2048)
    with torch.no_grad():
        bn.weight.copy_(1.0 + 1e-6 * torch.randn(2048, generator=torch.Generator().manual_seed(3)))
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save({"bn": bn})
        row = store.history("bn.weight", v.id).to_pylist()[-1]
    assert row["std"] == pytest.approx(float(bn.weight.detach().double().std()), rel=1e-3)


def test_unchanged_tensors_keep_their_stats_and_changed_ones_are_recomputed(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    st = {f"w{i}": torch.randn(1000 + i, generator=g) for i in range(20)}
    with ds.Store.open(tmp_path / "s") as store:
        v1 = store.save(st)
        st["w3"] = st["w3"] + 1.0
        st["w7"] = st["w7"].view(torch.int32)  # same bytes, another dtype: its stats must be recomputed
        v2 = store.save(st)
        fields = ("min", "max", "mean", "std", "l2", "nan_count", "inf_count")
        rows1 = {r["key"]: {f: r[f] for f in fields} for r in store.manifest(v1.manifests["0"]).rows}
        rows2 = {r["key"]: {f: r[f] for f in fields} for r in store.manifest(v2.manifests["0"]).rows}
    for k, t in st.items():
        x = t.double()
        assert rows2[k]["mean"] == pytest.approx(float(x.mean()), rel=1e-5, abs=1e-6), k
        assert rows2[k]["std"] == pytest.approx(float(x.std()), rel=1e-4), k
        assert rows2[k]["max"] == float(x.max()), k
    assert rows2["w0"] == rows1["w0"]
    assert rows2["w3"]["mean"] == pytest.approx(rows1["w3"]["mean"] + 1.0, rel=1e-5)
    assert rows2["w7"]["mean"] != rows1["w7"]["mean"]


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtypes of the pieces whose statistics the pipeline computes one at a time (`partial`), in order."""
    import datastates.save.pipeline as pipeline

    calls: list[torch.dtype] = []
    real = pipeline.partial

    def counting(raw: torch.Tensor, dtype: torch.dtype) -> Partial:
        calls.append(dtype)
        return real(raw, dtype)

    monkeypatch.setattr(pipeline, "partial", counting)
    return calls


def test_statistics_are_computed_for_changed_tensors_only(tmp_path: Path, alone: list[torch.dtype]) -> None:
    calls = alone
    g = torch.Generator().manual_seed(5)
    st = {f"w{i}": torch.randn(500, generator=g) for i in range(30)}
    with ds.Store.open(tmp_path / "s") as store:
        store.save(st)
        # 30 equal fp32 tensors summarized together (their 2,000-byte pieces are not back to back in the slot:
        # gathered), none alone
        assert calls == []
        st["w5"].add_(1)
        st["w9"] = st["w9"].view(torch.int32)
        store.save(st)
    assert sorted(map(str, calls)) == ["torch.float32", "torch.int32"]


def test_equal_small_tensors_are_summarized_together_with_the_same_values(
        tmp_path: Path, alone: list[torch.dtype]) -> None:
    g = torch.Generator().manual_seed(6)
    st: dict[str, torch.Tensor] = {f"f{i:02d}": torch.randn(1024, generator=g) * (i + 1) + i for i in range(40)}
    st["f05"][17] = float("nan")
    st["f06"][3] = float("inf")
    st["f07"] = 1.0 + 1e-6 * torch.randn(1024, generator=g)  # a spread the one-pass formula cannot keep
    st["f08"] = torch.full((1024,), 3.0)  # no spread at all
    st["i00"] = torch.arange(1024, dtype=torch.int32)  # another dtype between runs
    st.update({f"h{i}": (torch.randn(2048, generator=g) * 3).to(torch.float16) for i in range(5)})
    st.update({f"b{i}": (torch.randn(2048, generator=g) - 5).to(torch.bfloat16) for i in range(5)})
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(st)
        rows = {r["key"]: r for r in store.manifest(v.manifests["0"]).rows}
    # Only the non-finite ones and another dtype are summarized alone: f07 and f08 get the batched centred pass.
    assert sorted(map(str, alone)) == ["torch.float32"] * 2 + ["torch.int32"]  # f05, f06 and i00
    for k, t in st.items():
        want = _stats_of(t)
        finite = t.double()[torch.isfinite(t)]
        for f in ("nan_count", "inf_count", "min", "max"):
            assert rows[k][f] == want[f], (k, f)
        assert rows[k]["mean"] == pytest.approx(float(finite.mean()), rel=1e-5, abs=1e-6), k
        assert rows[k]["std"] == pytest.approx(float(finite.std()), rel=1e-4), k
        assert rows[k]["l2"] == pytest.approx(float(finite.norm()), rel=1e-5), k


def test_near_constant_small_tensors_are_centred_together(tmp_path: Path, alone: list[torch.dtype]) -> None:
    # BatchNorm/LayerNorm weights near 1, AdamW's exp_avg_sq, a state drifting far from zero: the one-pass m2
    # cancels, and the centred second pass runs batched over the run (mixed with ordinary rows in one block).
    g = torch.Generator().manual_seed(7)
    st: dict[str, torch.Tensor] = {}
    for i in range(60):
        base = torch.randn(768, generator=g)
        st[f"n{i:02d}"] = [1.0 + 1e-5 * base, 1000.0 + 1e-2 * base, base, 42.0 + 0 * base][i % 4].float()
    st.update({f"h{i}": (7.0 + 1e-3 * torch.randn(768, generator=g)).half() for i in range(4)})
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(st)
        rows = {r["key"]: r for r in store.manifest(v.manifests["0"]).rows}
        assert alone == []
        first = {k: t.clone() for k, t in st.items()}
        for t in st.values():
            t.add_(1)  # the second save sees new bytes: computed again, batched again
        v2 = store.save(st)
        rows2 = {r["key"]: r for r in store.manifest(v2.manifests["0"]).rows}
    assert alone == []
    for got, tag, state in ((rows, "first", first), (rows2, "second", st)):
        for k, t in state.items():
            x = t.double()
            assert got[k]["std"] == pytest.approx(float(x.std()), rel=1e-3, abs=1e-9), (tag, k)
            assert got[k]["mean"] == pytest.approx(float(x.mean()), rel=1e-7, abs=1e-6), (tag, k)
            assert (got[k]["min"], got[k]["max"]) == (float(x.min()), float(x.max())), (tag, k)


def test_a_run_of_whole_tensors_and_pieces_of_a_bigger_one_keeps_each_tensors_stats(
        tmp_path: Path, alone: list[torch.dtype]) -> None:
    # With 4 KiB chunks, 1,024-element fp32 tensors and the 4 KiB pieces of 4,096-element ones are equal,
    # adjacent pieces of one run: whole tensors get final statistics at once, the pieces are merged per tensor.
    g = torch.Generator().manual_seed(8)
    st: dict[str, torch.Tensor] = {}
    for i in range(12):
        st[f"a{i:02d}"] = torch.randn(4096 if i % 3 == 1 else 1024, generator=g) * (i + 1) + (50.0 if i % 2 else 0.0)
    with ds.Store.open(tmp_path / "s", chunk_size=4096) as store:
        v = store.save(st)
        rows = {r["key"]: r for r in store.manifest(v.manifests["0"]).rows}
    assert alone == []
    assert [len(rows[k]["chunks"]) for k in sorted(st)] == [4 if i % 3 == 1 else 1 for i in range(12)]
    for k, t in st.items():
        x = t.double()
        assert rows[k]["std"] == pytest.approx(float(x.std()), rel=1e-4), k
        assert rows[k]["mean"] == pytest.approx(float(x.mean()), rel=1e-5, abs=1e-5), k
        assert rows[k]["l2"] == pytest.approx(float(x.norm()), rel=1e-5), k
        assert (rows[k]["min"], rows[k]["max"]) == (float(x.min()), float(x.max())), k


@pytest.fixture
def second_passes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the sums shifted by a value (`_centred`) and of the batched centred second pass (`_centre_rows`)."""
    from datastates.save import stats

    calls = {"_centred": 0, "_centre_rows": 0}
    for name in calls:
        real = getattr(stats, name)

        def counting(*a: object, _real: object = real, _name: str = name) -> object:
            calls[_name] += 1
            return _real(*a)  # type: ignore[operator]

        monkeypatch.setattr(stats, name, counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_big_chunk_far_from_zero_is_summed_shifted_by_its_sample_once(
        dtype: torch.dtype, second_passes: dict[str, int]) -> None:
    # A drifted weight (mean 3, std 0.02): the sample's mean is the shift, so the sums keep the digits of the
    # std in one pass over shifted values, without the centred pass on top.
    g = torch.Generator().manual_seed(9)
    x = (3.0 + 0.02 * torch.randn(300_000, generator=g)).to(dtype)
    st = _stats_of(x)
    assert second_passes == {"_centred": 1, "_centre_rows": 0}
    want = x.double()
    assert st["std"] == pytest.approx(float(want.std()), rel=1e-4)
    assert st["mean"] == pytest.approx(float(want.mean()), rel=1e-7)
    assert (st["min"], st["max"]) == (float(want.min()), float(want.max()))
    # Centred on 0: summed as it is, no shifted pass at all.
    second_passes["_centred"] = 0
    w = (0.02 * torch.randn(300_000, generator=g)).to(dtype)
    assert _stats_of(w)["std"] == pytest.approx(float(w.double().std()), rel=1e-5)
    assert second_passes["_centred"] == 0


def test_a_chunk_whose_sample_misses_its_spread_still_gets_the_centred_pass(second_passes: dict[str, int]) -> None:
    # Every sampled element (each 4,687th) is 5.0 and the rest 0 or 0.01: the sample says "far from 0" and
    # shifts by 5, the sums show the shift was poor, and the centred pass runs: the values stay exact.
    x = torch.zeros(300_000)
    x[1::2] = 0.01
    x[::300_000 // 64] = 5.0
    st = _stats_of(x)
    assert second_passes["_centred"] == 2
    assert st["std"] == pytest.approx(float(x.double().std()), rel=1e-4)
    assert st["mean"] == pytest.approx(float(x.double().mean()), rel=1e-6)
    # A non-finite element the sample caught: no shift, counted apart.
    y = 3.0 + torch.rand(300_000)
    y[0] = float("nan")
    st = _stats_of(y)
    finite = y.double()[1:]
    assert (st["nan_count"], st["inf_count"]) == (1, 0)
    assert st["std"] == pytest.approx(float(finite.std()), rel=1e-5)


def test_blocks_after_a_block_far_from_zero_are_shifted_by_their_first_elements(
        second_passes: dict[str, int]) -> None:
    from datastates.save import stats

    g = torch.Generator().manual_seed(10)
    rows = stats._BLOCK // 4096  # rows of 4,096 fp32 per scratch block
    narrow = 7.0 + 1e-3 * torch.randn(3 * rows, 4096, generator=g)
    narrow[rows + 3, 0] = 7.5  # an outlier first element: a poor shift for its row, caught by the sums
    narrow[2 * rows + 1, 0] = float("inf")  # a shift that makes its row non-finite: summarized alone, as before
    wide = torch.randn(2 * rows, 4096, generator=g)
    x = torch.cat([narrow, wide])
    raw = x.reshape(-1).view(torch.uint8)
    got = stats.partial_many(raw, torch.float32, x.shape[0], whole=True)
    # The first narrow block learns, the next two are shifted (one centred pass for the outlier's block),
    # the first wide block is shifted too and teaches the second not to be.
    assert second_passes["_centre_rows"] == 2
    # What a call learns stays in it: the same bytes give the same bits after any other call.
    stats.partial_many(narrow.reshape(-1).view(torch.uint8), torch.float32, narrow.shape[0], whole=True)
    assert stats.partial_many(raw, torch.float32, x.shape[0], whole=True) == got
    assert stats.partial_many(raw[:rows * 4096 * 4], torch.float32, rows, whole=True) == got[:rows]
    for i, row in enumerate(x):
        if i == 2 * rows + 1:
            assert got[i] is None
            continue
        want = row.double()
        st = got[i]
        assert isinstance(st, dict)
        assert st["std"] == pytest.approx(float(want.std()), rel=1e-4), i
        assert st["mean"] == pytest.approx(float(want.mean()), rel=1e-7, abs=1e-7), i
        assert (st["min"], st["max"]) == (float(want.min()), float(want.max())), i


def test_values_whose_squares_underflow_get_a_std_of_zero_not_an_error() -> None:
    # 2**-127 squared is 0 in fp32: sum(x^2) is 0 while sum(x)^2 / n is not (found by hypothesis in
    # test_roundtrip: the save failed with "math domain error").
    from datastates.save import stats

    x = torch.full((4,), 2.0 ** -127)
    st = _stats_of(x)
    assert (st["std"], st["min"], st["mean"]) == (0.0, float(x[0]), float(x[0]))
    many = stats.partial_many(torch.full((3, 4), 2.0 ** -127).reshape(-1).view(torch.uint8), torch.float32, 3,
                              whole=True)
    assert [m["std"] for m in many if isinstance(m, dict)] == [0.0, 0.0, 0.0]


def test_the_same_state_saved_after_another_gives_the_same_manifest(tmp_path: Path) -> None:
    # Statistics are a function of the bytes and the save's layout, not of what a worker summarized before:
    # a store that saved another state first writes the very manifest a fresh store writes.
    g = torch.Generator().manual_seed(11)
    wide = {f"a{i:02d}": torch.randn(4096, generator=g) for i in range(64)}
    narrow = {f"b{i:02d}": 7.0 + 1e-3 * torch.randn(4096, generator=g) for i in range(64)}
    first = {**wide, **narrow}  # ends with blocks that need the shift
    second = {k: t + 1.0 for k, t in first.items()}  # all new bytes: nothing known from the first save
    with ds.Store.open(tmp_path / "a") as a, ds.Store.open(tmp_path / "b") as b:
        a.save(first)
        va, vb = a.save(second), b.save(second)
    assert va.manifests == vb.manifests


def test_changed_tensors_spread_over_the_state_are_summarized_together(
        tmp_path: Path, alone: list[torch.dtype]) -> None:
    # Every third tensor changed: the unchanged ones between them keep their known stats, and the changed ones,
    # no longer back to back, are gathered and summarized as one run, not one at a time.
    g = torch.Generator().manual_seed(12)
    st: dict[str, torch.Tensor] = {f"f{i:03d}": torch.randn(1024, generator=g) * (i % 7 + 1) + i for i in range(90)}
    st.update({f"h{i:02d}": (torch.randn(2048, generator=g) * 3).to(torch.bfloat16) for i in range(30)})
    with ds.Store.open(tmp_path / "s") as store:
        store.save(st)
        alone.clear()
        changed = [k for i, k in enumerate(st) if i % 3 == 0]
        for k in changed:
            st[k].mul_(2).add_(1)
        st["f042"] = 1.0 + 1e-6 * torch.randn(1024, generator=g)  # a spread the one-pass formula cannot keep
        st["f045"][5] = float("nan")  # non-finite: summarized alone
        v = store.save(st)
        rows = {r["key"]: r for r in store.manifest(v.manifests["0"]).rows}
    assert alone == [torch.float32]  # f045 only
    for k in [*changed, "f042"]:
        t = st[k]
        want = _stats_of(t)
        finite = t.double()[torch.isfinite(t.double())]
        for f in ("nan_count", "inf_count", "min", "max"):
            assert rows[k][f] == want[f], (k, f)
        assert rows[k]["mean"] == pytest.approx(float(finite.mean()), rel=1e-5, abs=1e-6), k
        assert rows[k]["std"] == pytest.approx(float(finite.std()), rel=1e-4), k


def test_gathered_pieces_give_what_the_same_pieces_back_to_back_give() -> None:
    from datastates.save import stats

    g = torch.Generator().manual_seed(13)
    x = torch.randn(stats._BLOCK * 4 // 4096 * 2 + 3, 1024, generator=g) * 5 + 2  # fp32 rows of 4 KiB: 3 blocks
    x[7] = 1.0 + 1e-6 * torch.randn(1024, generator=g)
    raw = x.reshape(-1).view(torch.uint8)
    pieces = [row.view(torch.uint8) for row in x.clone()]  # separate tensors: not back to back
    assert stats.partial_gathered(pieces, torch.float32, whole=True) == stats.partial_many(
        raw, torch.float32, x.shape[0], whole=True)
    # Pieces over half a block are each summarized alone, with no block of their size
    big = [torch.randn(stats._BLOCK, generator=g).view(torch.uint8) for _ in range(2)]
    got = stats.partial_gathered(big, torch.float32)
    assert all(isinstance(p, Partial) for p in got)
    assert [p.final() for p in got if isinstance(p, Partial)] == [
        partial(b, torch.float32).final() for b in big]
    assert stats.partial_gathered([], torch.float32) == []


def _big_state(seed: int) -> dict[str, torch.Tensor]:
    # 2 MiB tensors (over capture.BORROW_MIN: a sync save summarizes each 256 KiB chunk alone) and a small one.
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(512, 1024, generator=g) * 3 + 2, "proj": torch.randn(512, 1024, generator=g),
            "bias": torch.randn(1024, generator=g)}


_CHUNK = 256 << 10


def test_unchanged_chunks_of_a_big_tensor_are_not_summarized_again(
        tmp_path: Path, alone: list[torch.dtype]) -> None:
    st = _big_state(21)
    with ds.Store.open(tmp_path / "s", chunk_size=_CHUNK) as store:
        store.save(st)
        store._saver.pipeline.settled.wait()  # the record of the commit (`Saver.remember`) is made after it returns
        first = {k: list(e.piece_stats or []) for k, e in store._saver.memory.by_key.items()}
        assert [len(first[k]) for k in ("emb", "proj")] == [8, 8]  # one summary per chunk, kept
        alone.clear()
        st["emb"][300, 5] += 1.0  # one element: chunk 4 of 8 (rows 256-319 hold its bytes)
        v2 = store.save(st)
        store._saver.pipeline.settled.wait()
        second = {k: e.piece_stats or [] for k, e in store._saver.memory.by_key.items()}
    # Only the changed chunk was summarized; the others are the very summaries the first save made.
    assert alone == [torch.float32]
    assert [a is b for a, b in zip(first["emb"], second["emb"])] == [True] * 4 + [False] + [True] * 3
    assert all(a is b for a, b in zip(first["proj"], second["proj"]))
    with ds.Store.open(tmp_path / "fresh", chunk_size=_CHUNK) as fresh:
        # The same statistics, bit for bit, as a store that never saw the first state: the same manifest.
        assert fresh.save(st).manifests == v2.manifests


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_big_tensor_changed_in_some_chunks_or_in_dtype_gets_the_statistics_of_its_bytes(
        tmp_path: Path, how: str) -> None:
    st = _big_state(22)
    with ds.Store.open(tmp_path / "s", chunk_size=_CHUNK) as store:
        def save() -> ds.Version:
            return store.save(st) if how == "save" else store.save_async(st).result()

        save()
        st["emb"][0, 0] = float("nan")  # the first chunk: its summary is the merge's start
        st["emb"][511, 1023] = 1e6  # and the last
        st["proj"] = st["proj"].view(torch.int32)  # the same bytes as another dtype: summarized again
        v2 = save()
        rows = {r["key"]: r for r in store.manifest(v2.manifests["0"]).rows}
        v3 = save()  # nothing changed: everything known
    assert v3.manifests == v2.manifests
    for k in ("emb", "proj"):
        want = _stats_of(st[k], pieces=8)
        for f in ("nan_count", "inf_count", "min", "max"):
            assert rows[k][f] == want[f], (k, f)
        for f in ("mean", "std", "l2"):
            assert rows[k][f] == pytest.approx(want[f], rel=1e-6), (k, f)
    assert rows["emb"]["nan_count"] == 1 and rows["emb"]["max"] == 1e6
    with ds.Store.open(tmp_path / "fresh", chunk_size=_CHUNK) as fresh:  # saved the same way, knowing nothing
        assert (fresh.save(st) if how == "save" else fresh.save_async(st).result()).manifests == v2.manifests


def test_a_tensor_reused_unchanged_keeps_its_chunk_summaries_for_the_next_save(
        tmp_path: Path, alone: list[torch.dtype]) -> None:
    st = _big_state(23)
    with ds.Store.open(tmp_path / "s", chunk_size=_CHUNK, reuse_unchanged=True) as store:
        store.save(st)
        store._saver.pipeline.settled.wait()  # the record of the commit (`Saver.remember`) is made after it returns
        kept = list(store._saver.memory.by_key["proj"].piece_stats or [])
        store.save(st)  # every tensor reused: nothing read
        store._saver.pipeline.settled.wait()
        assert all(a is b for a, b in zip(store._saver.memory.by_key["proj"].piece_stats or [], kept, strict=True))
        alone.clear()
        st["proj"][0, 0] += 1.0  # its version counter moves: read again, in chunk 0 only changed
        v3 = store.save(st)
    # The reused row handed its summaries on: only the changed chunk was summarized.
    assert alone == [torch.float32]
    with ds.Store.open(tmp_path / "fresh", chunk_size=_CHUNK) as fresh:
        assert fresh.save(st).manifests == v3.manifests
