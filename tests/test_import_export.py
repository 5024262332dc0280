"""Import checkpoints made by torch.save, safetensors (one file and HF-style shards), DCP and the
Hugging Face Trainer's checkpoint-N/ layout; export versions back; a malicious pickle is refused
without running."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import datastates as ds
from datastates.cli import main as cli


def _model_state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(256, 64, generator=g)  # unchanged across checkpoints: dedup
    return {"embed.weight": frozen, "head.weight": torch.full((8, 64), float(step)), "head.bias": torch.zeros(8)}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_torch_save_files_become_one_branch_in_step_order_with_dedup(tmp_path: Path) -> None:
    for step in (300, 100, 200):  # written out of order: the import sorts by step
        torch.save({"model": _model_state(step), "step": step}, tmp_path / f"ckpt-step{step}.pt")
    with ds.Store.open(tmp_path / "s") as store:
        rep = ds.import_checkpoints(store, [tmp_path], glob="*.pt", branch="old-run")
        assert [v.step for v in rep.versions] == [100, 200, 300]
        log = store.log("old-run")
        assert [v.step for v in log] == [300, 200, 100]
        assert log[0].parents == (log[1].id,) and log[1].parents == (log[2].id,)
        frozen = _model_state(0)["embed.weight"].numel() * 4
        assert rep.bytes_saved >= 2 * frozen  # the unchanged embedding is stored once
        assert _same(store.load("old-run~1"), {"model": _model_state(200), "step": 200})


def test_step_from_regex_and_safetensors_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    for epoch in (2, 1):
        save_file(_model_state(epoch), str(tmp_path / f"e{epoch}_x9.safetensors"))
    with ds.Store.open(tmp_path / "s") as store:
        rep = ds.import_checkpoints(store, sorted(tmp_path.glob("*.safetensors")), branch="st",
                                    step_from=r"e(\d+)_")
        assert [v.step for v in rep.versions] == [1, 2]
        assert _same(store.load("st"), _model_state(2))
        with pytest.raises(ds.InvalidArgumentError, match="step-from"):
            ds.import_checkpoints(store, [tmp_path / "e1_x9.safetensors"], branch="st2", step_from=r"step=(\d+)")


def test_hf_trainer_checkpoint_dirs_with_sharded_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    for step in (10, 20):
        d = tmp_path / "out" / f"checkpoint-{step}"
        d.mkdir(parents=True)
        sd = _model_state(step)
        save_file({"embed.weight": sd["embed.weight"]}, str(d / "model-00001-of-00002.safetensors"))
        save_file({k: sd[k] for k in ("head.weight", "head.bias")}, str(d / "model-00002-of-00002.safetensors"))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "embed.weight": "model-00001-of-00002.safetensors", "head.weight": "model-00002-of-00002.safetensors",
            "head.bias": "model-00002-of-00002.safetensors"}}))
        torch.save({"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
                   d / "optimizer.pt")
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [
            {"loss": 1.0 / step, "step": step}, {"eval_loss": 2.0 / step, "step": step}]}))
    with ds.Store.open(tmp_path / "s") as store:
        rep = ds.import_checkpoints(store, sorted((tmp_path / "out").iterdir()), branch="hf")
        assert [(v.step, v.metrics) for v in rep.versions] == [(10, {"loss": 0.1, "eval_loss": 0.2}),
                                                               (20, {"loss": 0.05, "eval_loss": 0.1})]
        got = store.load("hf")
        assert _same(got["model"], _model_state(20))
        assert got["optimizer"]["param_groups"][0]["lr"] == 0.1 and got["trainer_state"]["global_step"] == 20


def test_dcp_directories_need_allow_pickle_and_then_import(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _model_state(5)}, checkpoint_id=str(tmp_path / "dcp-5"))
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.UnsupportedValueError, match="allow-pickle"):
            ds.import_checkpoints(store, [tmp_path / "dcp-5"], branch="d")
        assert "d" not in store.branches()
        rep = ds.import_checkpoints(store, [tmp_path / "dcp-5"], branch="d", allow_pickle=True)
        assert rep.versions[0].step == 5 and _same(store.load("d")["model"], _model_state(5))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"model": _model_state(1), "evil": _Evil(str(marker))}, tmp_path / "evil.pt")
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.UnsupportedValueError, match="--allow-pickle"):
            ds.import_checkpoints(store, [tmp_path / "evil.pt"], branch="x")
        assert not marker.exists() and store.branches() == {}
    assert cli(["--store", str(tmp_path / "s"), "import", str(tmp_path / "evil.pt")]) == 1
    assert not marker.exists()


def test_a_file_the_store_refuses_imports_nothing(tmp_path: Path) -> None:
    """torch.load reads a sparse tensor, which the store refuses: step 100 was imported and its branch made
    before step 200 was refused, though a refused file should change nothing."""
    torch.save({"model": _model_state(1)}, tmp_path / "step-100.pt")
    torch.save({"model": _model_state(2), "sparse": torch.eye(3).to_sparse()}, tmp_path / "step-200.pt")
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.UnsupportedValueError, match="step-200.pt: .*sparse.*; nothing was imported"):
            ds.import_checkpoints(store, [tmp_path / "step-100.pt", tmp_path / "step-200.pt"], branch="x")
        assert store.branches() == {} and store.versions_table().num_rows == 0


def test_files_that_are_no_checkpoint_are_named_without_a_pickle_hint(tmp_path: Path) -> None:
    """A damaged safetensors file gave a bare SafetensorError; a text file named .pt was said to need pickle, and
    --allow-pickle then failed too (a review)."""
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad json}      ")
    (tmp_path / "notes.pt").write_text("not a torch file\n")
    torch.save({"model": _model_state(1)}, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:200])
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "model.safetensors.index.json").write_text("{not json")
    (tmp_path / "shards" / "model-1.safetensors").write_bytes(b"")
    cases = {"bad.safetensors": "safetensors can read", "notes.pt": r"not a torch.save file \(it starts with",
             "cut.pt": "torch.load can read", "shards": "safetensors index"}
    with ds.Store.open(tmp_path / "s") as store:
        for name, message in cases.items():
            for allow in (False, True):
                with pytest.raises(ds.InvalidArgumentError, match=message) as info:
                    ds.import_checkpoints(store, [tmp_path / name], branch="x", allow_pickle=allow)
                assert "pickle" not in str(info.value).split(";")[-1], name  # no hint to allow pickle
        assert store.branches() == {}
    assert cli(["--store", str(tmp_path / "s"), "import", str(tmp_path / "notes.pt")]) == 1


def test_one_path_given_as_a_string_is_one_checkpoint(tmp_path: Path) -> None:
    """A str was iterated letter by letter: the first checkpoint tried was '/'."""
    torch.save({"model": _model_state(3)}, tmp_path / "step-3.pt")
    with ds.Store.open(tmp_path / "s") as store:
        for given in (str(tmp_path / "step-3.pt"), tmp_path / "step-3.pt"):
            report = ds.import_checkpoints(store, given, branch=f"b{len(store.branches())}")
            assert len(report.versions) == 1
        assert store.load("b0")["model"]["head.weight"][0, 0].item() == 3.0


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_export_then_import_round_trips_bit_exact(tmp_path: Path, fmt: str) -> None:
    state = {"model": _model_state(7), "bf16": torch.arange(6, dtype=torch.bfloat16), "step": 7}
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save(state, step=7)
        out = ds.export(store, v, fmt, tmp_path / ("out" if fmt == "dcp" else f"out.{fmt}"))
        rep = ds.import_checkpoints(store, [out], branch="back", allow_pickle=fmt == "dcp")
        back = store.load(rep.versions[0])
        if fmt == "safetensors":  # tensors under their key paths; plain values are not in safetensors
            flat = {f"model.{k}": t for k, t in state["model"].items()} | {"bf16": state["bf16"]}
            assert _same(back, flat)
        else:
            assert _same(back, state)
            if fmt == "torch":  # the same tree and rows: the same manifest, chunk for chunk
                assert rep.versions[0].manifests == v.manifests
        with pytest.raises(ds.InvalidArgumentError, match="exists"):
            ds.export(store, v, fmt, out)
        empty = tmp_path / "empty"
        empty.mkdir()
        if fmt == "dcp":  # a DCP checkpoint is a directory: an empty one takes it
            assert ds.export(store, v, fmt, empty) == empty
        else:  # safetensors' own SafetensorError (untyped) came from writing a file over a directory
            with pytest.raises(ds.InvalidArgumentError, match="exists; give a new path"):
                ds.export(store, v, fmt, empty)
            assert not list(empty.iterdir())


def test_cli_import_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for step in (1, 2):
        torch.save({"model": _model_state(step)}, tmp_path / f"step-{step}.pt")
    s = str(tmp_path / "s")
    assert cli(["--store", s, "init"]) == 0
    assert cli(["--store", s, "import", str(tmp_path / "step-1.pt"), str(tmp_path / "step-2.pt"),
                "--branch", "run"]) == 0
    out = capsys.readouterr().out
    assert "2 version(s) on run" in out and "saved by dedup" in out
    assert cli(["--store", s, "export", "run", str(tmp_path / "run.safetensors"), "--format", "safetensors"]) == 0
    from safetensors.torch import load_file

    assert _same(load_file(str(tmp_path / "run.safetensors")), {f"model.{k}": t for k, t in _model_state(2).items()})


def test_export_of_a_version_of_several_ranks_takes_a_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """export loaded a version of two ranks at world size 1, which gives only its replicated entries: the file
    silently lacked every rank's own (a hunt). It now takes --rank, and refuses without one."""
    store = tmp_path / "s"
    with ds.Store.open(store) as s:
        parts = {str(r): s.stage({"shard": torch.full((3,), float(r)), "rank": r}) for r in range(2)}
        v = s.commit_staged(parts, world_size=2, branch="main")
    out = tmp_path / "r.pt"
    rc = cli(["--store", str(store), "export", "main", str(out), "--format", "torch"])
    assert rc != 0 and not out.exists()
    err = capsys.readouterr().err
    assert "InvalidArgumentError" in err and f"version {v.short} was saved by 2 ranks" in err and "--rank R" in err
    for r in range(2):
        target = tmp_path / f"r{r}.pt"
        assert cli(["--store", str(store), "export", "main", str(target), "--format", "torch",
                         "--rank", str(r)]) == 0
        got = torch.load(target, weights_only=True)
        assert got["rank"] == r and torch.equal(got["shard"], torch.full((3,), float(r)))
    capsys.readouterr()
    # ls and diff read rank 0's manifest: they say so (a change to another rank's own entries read as none)
    for argv in (["ls", "main"], ["diff", "main", "main"]):
        assert cli(["--store", str(store), *argv]) == 0
        assert f"note: {v.short} was saved by 2 ranks; this reads rank 0's manifest" in capsys.readouterr().err


def test_dcp_export_refuses_a_state_dcp_would_change(tmp_path: Path) -> None:
    """DCP keeps str key paths: an optimizer's state keyed by parameter index came back keyed '0', '1' (which
    load_state_dict attaches to no parameter: Adam's moments silently lost on resume), and an empty dict (a fresh
    optimizer's state) was dropped; the DCP export said nothing (a hunt). It is refused, and writes nothing."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with ds.Store.open(tmp_path / "s") as store:
        stepped = store.save({"model": model, "optim": opt})
        fresh = store.save({"model": model, "optim": torch.optim.Adam(model.parameters())})
        for v, message in ((stepped, "optim.state has the key 0 .* which DCP turns into a str"),
                           (fresh, "optim.state is an empty dict, which DCP drops")):
            with pytest.raises(ds.UnsupportedValueError, match=message + ".*--format torch"):
                ds.export(store, v, "dcp", tmp_path / "d")
            assert not (tmp_path / "d").exists()
            back = store.load(ds.import_checkpoints(store, ds.export(store, v, "torch", tmp_path / f"{v.short}.pt"),
                                                    branch=f"b{v.short}").versions[0])
            assert _same(back, store.load(v))  # what the refusal points to holds the state


def test_safetensors_export_refuses_a_dtype_it_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """safetensors has no complex128: its KeyError reached the command line as a traceback (a hunt)."""
    s = str(tmp_path / "s")
    with ds.Store.open(s) as store:
        store.save({"z": torch.ones(2, dtype=torch.complex128), "w": torch.ones(2)})
    out = tmp_path / "z.safetensors"
    assert cli(["--store", s, "export", "main", str(out), "--format", "safetensors"]) == 1
    err = capsys.readouterr().err
    assert "UnsupportedValueError: z is a complex128 tensor, which safetensors cannot hold" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_an_export_that_fails_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """A write that failed half way (a full disk) left a partial file or directory at the target, which a retry
    then refused as existing; the errors were torch's RuntimeError, safetensors' SafetensorError or DCP's
    CheckpointException, a traceback on the command line (a hunt). The export is written under a temporary name
    and renamed once whole."""
    import errno

    import safetensors.torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def torch_save(obj: Any, f: Any, *a: Any, **kw: Any) -> None:
        f.write(b"PK\x03\x04 partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662")

    def save_file(tensors: Any, filename: str, *a: Any, **kw: Any) -> None:
        Path(filename).write_bytes(b"partial")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    def dcp_save(state: Any, checkpoint_id: str, **kw: Any) -> None:
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise CheckpointException("CheckpointException ranks:dict_keys([0])",
                                  {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    with ds.Store.open(tmp_path / "s") as store:
        v = store.save({"model": _model_state(1), "step": 1})
        out = tmp_path / "exports" / ("out" if fmt == "dcp" else f"out.{fmt}")
        with monkeypatch.context() as m:
            m.setattr(torch, "save", torch_save)
            m.setattr(safetensors.torch, "save_file", save_file)
            m.setattr(dcp, "save", dcp_save)
            with pytest.raises(OSError, match=f"writing {out}") as info:
                ds.export(store, v, fmt, out)
        if fmt != "torch":  # torch's RuntimeError does not say the disk is full
            assert isinstance(info.value, ds.StorageFullError)
        assert list(out.parent.iterdir()) == []
        assert ds.export(store, v, fmt, out) == out  # the retry finds nothing in the way
        back = store.load(ds.import_checkpoints(store, out, branch="back", allow_pickle=fmt == "dcp").versions[0])
        assert _same(back["model"] if fmt != "safetensors" else back,
                     _model_state(1) if fmt != "safetensors" else {f"model.{k}": t for k, t in _model_state(1).items()})


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_an_export_is_not_stopped_by_a_temp_left_beside_it_and_takes_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """The temp name was fixed (the pid): one a killed export left (a container's pid 1) made the next export
    say the target existed, and the cleanup removed a temp it had not made; `export main . --format dcp` raised
    ValueError from Path('.').with_name (a review). The temp name is this call's own."""
    with ds.Store.open(tmp_path / "s") as store:
        v = store.save({"model": _model_state(1), "step": 1})
        out = tmp_path / "exports" / ("out" if fmt == "dcp" else f"out.{fmt}")
        out.parent.mkdir()
        stale = out.parent / f".{out.name}.{os.getpid()}.tmp"
        stale.write_bytes(b"left by a killed export")
        assert ds.export(store, v, fmt, out) == out
        assert stale.read_bytes() == b"left by a killed export"
        assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, stale.name])
        if fmt == "dcp":
            here = tmp_path / "here"
            here.mkdir()
            monkeypatch.chdir(here)
            assert ds.export(store, v, "dcp", ".") == here
            assert (here / ".metadata").is_file() and not [p for p in here.iterdir() if p.name.endswith(".tmp")]


def test_a_damaged_dcp_directory_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DCP raises a CheckpointException, a BaseException, for a damaged directory: it passed every handler and
    reached the command line as a traceback (a hunt)."""
    import torch.distributed.checkpoint as dcp

    damaged = {"no-data": lambda d: [f.unlink() for f in d.glob("*.distcp")],
               "bad-metadata": lambda d: (d / ".metadata").write_bytes(b"garbage"),
               "cut-data": lambda d: [f.write_bytes(f.read_bytes()[:5]) for f in d.glob("*.distcp")]}
    s = str(tmp_path / "s")
    for name, damage in damaged.items():
        dcp.save({"model": _model_state(1)}, checkpoint_id=str(tmp_path / name))
        damage(tmp_path / name)
        with ds.Store.open(s) as store:
            with pytest.raises(ds.InvalidArgumentError, match=f"{name} is not a checkpoint torch.distributed"):
                ds.import_checkpoints(store, tmp_path / name, allow_pickle=True)
            assert store.branches() == {}
        capsys.readouterr()
        assert cli(["--store", s, "import", str(tmp_path / name), "--allow-pickle"]) == 1
        assert "datastates: InvalidArgumentError" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{nope", "[1, 2]", '{"global_step": "abc"}', '{"global_step": 1.5}',
                                  '{"global_step": NaN}', '{"global_step": 1, "log_history": [1]}', "\xff"])
def test_a_bad_trainer_state_json_is_named(tmp_path: Path, text: str) -> None:
    """trainer_state.json was read as it was: JSONDecodeError, AttributeError, ValueError, TypeError (a hunt)."""
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    torch.save(_model_state(1), d / "pytorch_model.bin")
    (d / "trainer_state.json").write_bytes(text.encode("latin-1"))
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.InvalidArgumentError, match="trainer_state.json"):
            ds.import_checkpoints(store, d)
        assert store.branches() == {}


def test_a_logged_number_past_any_float_is_no_metric(tmp_path: Path) -> None:
    """An int in log_history too large for a float raised OverflowError from deep inside the import (a review):
    it is no value to record, like NaN, and the checkpoint imports with the other metrics."""
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    torch.save(_model_state(1), d / "pytorch_model.bin")
    (d / "trainer_state.json").write_text('{"global_step": 1, "log_history": [{"loss": 1%s, "lr": 0.5}]}' % ("0" * 400))
    with ds.Store.open(tmp_path / "s") as store:
        (v,) = ds.import_checkpoints(store, d).versions
        assert v.metrics == {"lr": 0.5}


def test_an_import_a_save_would_refuse_imports_nothing(tmp_path: Path) -> None:
    """The saves checked each file's step, metrics and message one by one: a step past 2**63-1 in the last file's
    name, a metric named '' in a Trainer's log, or a file name that is not UTF-8 was refused after the files before
    it were imported (a hunt). Every request is checked before the first save; a name not UTF-8 is imported."""
    torch.save({"model": _model_state(1)}, tmp_path / "ckpt-1.pt")
    torch.save({"model": _model_state(2)}, tmp_path / f"ckpt-{2**64}.pt")
    hf = tmp_path / "checkpoint-3"
    hf.mkdir()
    torch.save(_model_state(3), hf / "pytorch_model.bin")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": [{"": 1.0}]}))
    with ds.Store.open(tmp_path / "s") as store:
        for bad, message in ((tmp_path / f"ckpt-{2**64}.pt", "is out of range"), (hf, "metrics has the key ''")):
            with pytest.raises(ds.InvalidArgumentError, match=f"{bad.name}: .*{message}.*nothing was imported"):
                ds.import_checkpoints(store, [tmp_path / "ckpt-1.pt", bad], branch="x")
            assert store.branches() == {} and store.versions_table().num_rows == 0
        odd = os.fsdecode(bytes(tmp_path) + b"/ckpt-\xff-4.pt")
        torch.save({"model": _model_state(4)}, odd)
        rep = ds.import_checkpoints(store, [tmp_path / "ckpt-1.pt", odd], branch="x")
        assert [v.message for v in rep.versions] == ["import torch: ckpt-1.pt", "import torch: ckpt-\ufffd-4.pt"]


def test_allow_pickle_keeps_a_value_the_store_pickles(tmp_path: Path) -> None:
    """A set (which torch.load reads with weights_only) was refused with a hint to allow pickle, and refused again
    with --allow-pickle: the import passed pickle on only for files that needed it to load (a hunt)."""
    torch.save({"model": _model_state(1), "seen": {1, 2}}, tmp_path / "step-1.pt")
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.UnsupportedValueError, match="nothing was imported .*import with --allow-pickle"):
            ds.import_checkpoints(store, tmp_path / "step-1.pt")
        rep = ds.import_checkpoints(store, tmp_path / "step-1.pt", allow_pickle=True)
        assert store.load(rep.versions[0], allow_pickle=True)["seen"] == {1, 2}


def test_a_version_saved_through_dcp_exports_its_state(tmp_path: Path) -> None:
    """A version saved by dcp.save (StoreWriter) holds DCP's items: export wrote those (t0, a float tensor; t1, the
    bytes of a pickled step) under their item names, not the state that was saved (a hunt). It now writes the state
    DCP puts back together, as StoreReader gives it; a pickle weights_only refuses still needs --allow-pickle."""
    import torch.distributed.checkpoint as dcp

    state = {"model": _model_state(4), "step": 4}
    with ds.Store.open(tmp_path / "s") as store:
        dcp.save(state, storage_writer=ds.dcp.StoreWriter(store, branch="d", step=4))
        for fmt in ("torch", "dcp"):
            out = ds.export(store, "d", fmt, tmp_path / f"d-{fmt}")
            back = ds.import_checkpoints(store, out, branch=f"back-{fmt}", allow_pickle=fmt == "dcp")
            assert _same(store.load(back.versions[0]), state)
        out = ds.export(store, "d", "safetensors", tmp_path / "d.safetensors")
        from safetensors.torch import load_file

        assert _same(load_file(str(out)), {f"model.{k}": t for k, t in _model_state(4).items()})
        dcp.save({"model": _model_state(5), "evil": _Evil(str(tmp_path / "pwned"))},
                 storage_writer=ds.dcp.StoreWriter(store, branch="e"))
        with pytest.raises(ds.UnsupportedValueError, match="'evil' .* add --allow-pickle"):
            ds.export(store, "e", "torch", tmp_path / "e.pt")
        assert not (tmp_path / "e.pt").exists() and not (tmp_path / "pwned").exists()


def test_a_dcp_saved_optimizer_exports_with_its_int_keys(tmp_path: Path) -> None:
    """DCP keeps str key paths: an optimizer's state, keyed by parameter index, was exported keyed by '0', '1',
    and load_state_dict attached Adam's moments to no parameter, silently (a review); a fresh optimizer's empty
    state was gone. Both are put back from param_groups."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    with ds.Store.open(tmp_path / "s") as store:
        dcp.save({"optim": opt.state_dict(), "fresh": fresh.state_dict(), "other": {"0": torch.ones(1)}},
                 storage_writer=ds.dcp.StoreWriter(store, branch="d"))
        back = torch.load(ds.export(store, "d", "torch", tmp_path / "d.pt"), weights_only=True)
    assert list(back["optim"]["state"]) == [0, 1] and back["fresh"]["state"] == {}
    assert list(back["other"]) == ["0"]  # not an optimizer's: as DCP gives it
    again = torch.optim.Adam(model.parameters())
    again.load_state_dict(back["optim"])
    assert all(torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(back["fresh"])


def test_a_directory_of_safetensors_files_holding_one_tensor_twice_is_refused(tmp_path: Path) -> None:
    """A directory of safetensors files without an index was merged file by file: a tensor in two of them
    (model.safetensors beside model.fp16.safetensors) was silently taken from the last in name order (a hunt)."""
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    save_file(_model_state(1), str(d / "model.safetensors"))
    save_file({k: t.half() for k, t in _model_state(1).items()}, str(d / "model.fp16.safetensors"))
    with ds.Store.open(tmp_path / "s") as store:
        with pytest.raises(ds.InvalidArgumentError, match="in two files, model.fp16.safetensors and model.safetensors"):
            ds.import_checkpoints(store, d)
        assert store.branches() == {}
        rep = ds.import_checkpoints(store, d / "model.safetensors")
        assert _same(store.load(rep.versions[0]), _model_state(1))
