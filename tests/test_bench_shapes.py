"""`datastates bench --shape`: the real-state builders (tensor counts, dtypes, independence) and quick runs.

Byte counts and tensor counts are asserted, never timings.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch

from datastates.bench import shapes
from datastates.cli import main


def _dtypes(state: dict[str, torch.Tensor]) -> Counter[torch.dtype]:
    return Counter(t.dtype for t in state.values())


def test_transformer_shape_counts_and_dtypes() -> None:
    st = shapes.build("transformer", 1 / 256)
    # 12 layers x 12 tensors + embedding + final norm (2) = 147 parameters; AdamW keeps 3 tensors each.
    assert len(st) == 147 * 4
    assert _dtypes(st) == {torch.float32: 588}
    steps = [t for k, t in st.items() if k.endswith(".step")]
    assert len(steps) == 147 and all(t.dim() == 0 and float(t) == 1.0 for t in steps)
    assert st["model.embed.weight"].shape[1] == st["model.encoder.layers.0.linear1.weight"].shape[1]
    # every tensor owns its storage (safetensors refuses shared ones)
    assert len({t.untyped_storage().data_ptr() for t in st.values()}) == len(st)


def test_cnn_shape_has_batchnorm_int64_scalars_and_momentum() -> None:
    st = shapes.build("cnn", 1 / 64)
    counts = _dtypes(st)
    assert counts[torch.int64] == 26  # num_batches_tracked, one per BatchNorm
    assert len(st) == 238
    nbt = [t for k, t in st.items() if k.endswith("num_batches_tracked")]
    assert all(t.dim() == 0 and int(t) == 500 for t in nbt)
    assert sum(k.endswith("momentum_buffer") for k in st) == 26 * 3 + 2  # conv weight, bn weight, bn bias; fc w, b


def test_small_and_uniform_shapes_scale_bytes_not_counts() -> None:
    small = shapes.build("small", 1 / 64)
    assert len(small) == 8000
    assert all(t.numel() * 4 == 1024 for t in small.values())  # 64 KiB / 64
    uni = shapes.build("uniform", 1 / 1024, tensors=4)
    assert len(uni) == 4 and sum(t.numel() * 4 for t in uni.values()) == 4 * (32 << 10)


def test_full_scale_sizes_are_what_the_docs_say() -> None:
    assert shapes.approx_bytes("small") == 8000 * 65536
    assert shapes.approx_bytes("uniform") == 1 << 30
    with pytest.raises(ValueError, match="unknown"):
        shapes.build("mlp")
    with pytest.raises(ValueError, match="positive"):
        shapes.build("cnn", 0)


@pytest.mark.parametrize("shape,extra", [("cnn", ["--scale", "0.01"]), ("transformer", ["--scale", "0.002"]),
                                         ("small", ["--scale", "0.01", "--tensors", "300", "--spread"])])
def test_bench_shape_quick_runs(tmp_path: Path, shape: str, extra: list[str]) -> None:
    out, work = tmp_path / "bench.json", tmp_path / "work"
    rc = main(["bench", "--quick", "--shape", shape, *extra, "--skip", "dcp,train", "--store", str(work),
               "--json-out", str(out)])
    assert rc == 0
    assert list(work.iterdir()) == []
    rep = json.loads(out.read_text())
    assert rep["config"]["shape"] == shape
    assert {"ds_save", "ds_load", "ds_load_one", "torch_save_fsync", "safetensors_load"} <= set(rep["methods"])
    assert set(rep["ratios"]) == {"torch_save_vs_ds", "blocking_vs_copy", "blocking_new_vs_copy", "torch_load_vs_ds",
                                  "safetensors_load_vs_ds", "partial_time", "partial_reuse_time",
                                  "partial_bytes_changed", "one_of_all"}
    assert {"ds_partial_reuse_save", "ds_async_new_blocking", "ds_async_new_durable"} <= set(rep["methods"])
    assert all(r["pass"] in (True, False) for r in rep["ratios"].values())
    assert rep["full_save_new_chunks_min"] == 1.0
    n = rep["config"]["tensors"]
    for p in rep["partial"]:
        assert p["tensors_changed"] == max(1, round(n * 0.1))
        assert p["bytes_new"] < p["bytes_total"]
        assert 0 < p["bytes_new"] <= p["bytes_changed"]
    assert rep["ratios"]["partial_bytes_changed"]["value"] <= 1.0
    share = rep["info_ratios"]["changed_share"]["value"]
    assert share == statistics.median(p["bytes_changed"] / p["bytes_total"] for p in rep["partial"]) > 0
    assert "--shape " + shape in rep["command"]
    spread = "--spread" in extra
    assert rep["config"]["spread"] is spread and ("--spread" in rep["command"]) is spread


def test_changed_keys_are_a_block_or_spread_evenly_and_move_each_repeat() -> None:
    from datastates.bench.runner import changed_keys

    keys = [f"k{i:02d}" for i in range(20)]
    assert changed_keys(keys, 4, 0, False) == ["k00", "k01", "k02", "k03"]
    assert changed_keys(keys, 4, 1, False) == ["k04", "k05", "k06", "k07"]
    assert changed_keys(keys, 4, 5, False) == ["k00", "k01", "k02", "k03"]  # wraps around
    assert changed_keys(keys, 4, 0, True) == ["k00", "k05", "k10", "k15"]
    assert changed_keys(keys, 4, 2, True) == ["k02", "k07", "k12", "k17"]
    assert changed_keys(keys, 3, 0, True) == ["k00", "k06", "k13"]  # 20 / 3: still distinct, still spread
    assert changed_keys(keys, 0, 0, True) == [] and changed_keys(keys, 0, 0, False) == []


def test_bench_shape_option_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--shape", "cnn", "--size", "1MiB", "--store", str(tmp_path)]) == 2
    assert "--size" in capsys.readouterr().err
    assert main(["bench", "--scale", "0.5", "--store", str(tmp_path)]) == 2
    assert "--shape" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device,says", [("nope", "is not a device: use cpu, cuda or cuda:N"),
                                         ("meta", "the bench runs on cpu or cuda"),
                                         ("cuda", "this machine has no CUDA device; leave --device out")])
def test_a_device_the_bench_cannot_use_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], device: str, says: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["bench", "--quick", "--shape", "cnn", "--device", device, "--skip", "dcp,train",
                 "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--device {device}" in err and says in err
    assert list(tmp_path.iterdir()) == []


def test_device_cpu_is_the_default_and_adds_nothing_to_the_command() -> None:
    import argparse

    from datastates.bench import command_line, config_from_args

    base = dict(size=None, tensors=None, shape="cnn", scale=None, repeats=None, unchanged=0.9, spread=False,
                bench_dir=None, quick=True, json_out=None, skip="dcp,train", chunk_size=None, zstd=0,
                reuse_unchanged=False, rss=False, window=None)
    for device in (None, "cpu"):
        cfg = config_from_args(argparse.Namespace(**base, device=device))
        assert cfg.device == "cpu" and "--device" not in command_line(cfg)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_with_the_state_on_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--device cuda`: every method loads onto the GPU and is checked equal there; the host-only groups must be
    skipped by name, and the mapped loads (the same as the others onto a GPU) are left out."""
    assert main(["bench", "--quick", "--shape", "cnn", "--scale", "0.01", "--device", "cuda",
                 "--dir", str(tmp_path)]) == 2
    assert "add --skip dcp,train" in capsys.readouterr().err
    out, work = tmp_path / "bench.json", tmp_path / "work"
    assert main(["bench", "--quick", "--shape", "cnn", "--scale", "0.01", "--device", "cuda", "--skip", "dcp,train",
                 "--dir", str(work), "--json-out", str(out)]) == 0
    assert list(work.iterdir()) == []
    rep = json.loads(out.read_text())
    assert rep["machine"]["device"].startswith("cuda (")
    assert rep["command"].endswith("--device cuda")
    assert {"plain_copy", "ds_save", "ds_async_blocking", "ds_async_new_blocking", "ds_partial_save",
            "ds_partial_reuse_save", "ds_load", "ds_load_one", "torch_save_fsync", "torch_load",
            "safetensors_load"} <= set(rep["methods"])
    assert not {"ds_load_mmap", "torch_load_mmap"} & set(rep["methods"])
    assert rep["full_save_new_chunks_min"] == 1.0
    for p in rep["partial"]:
        assert 0 < p["bytes_new"] <= p["bytes_changed"] < p["bytes_total"]
