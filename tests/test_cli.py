"""The `datastates` command line: each command's output, exit status and errors, on a real store.

Most cases call `datastates.cli.main` in-process (one interpreter, fast); the first runs the installed
`datastates` script in a subprocess with DATASTATES_STORE, as a user's shell would.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from torch import nn

import datastates as ds
from datastates.cli import main
from datastates.retention import KeepLatest

SCRIPT = shutil.which("datastates") or str(Path(sys.executable).with_name("datastates"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def made(tmp_path: Path) -> tuple[Path, list[ds.Version]]:
    """A store with 3 versions of a small model on main (the bias never changes) and a branch."""
    path = tmp_path / "store"
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    with ds.Store.open(path) as s:
        vs = []
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(0.1)
            vs.append(s.save({"model": model, "step": step}, step=step, hparams={"lr": 0.1 * (step + 1)},
                             metrics={"loss": 1.0 / (step + 1)}, message=f"step {step}"))
        s.branch("exp", at=vs[0])
    return path, vs


def test_the_installed_script_with_the_store_from_the_environment(tmp_path: Path) -> None:
    env = dict(os.environ, DATASTATES_STORE=str(tmp_path / "s"))
    p = subprocess.run([SCRIPT, "init"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "store ready" in p.stdout
    assert (tmp_path / "s" / "FORMAT").is_file()
    p = subprocess.run([SCRIPT, "log"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "NotFoundError" in p.stderr and "main" in p.stderr  # no version yet


def test_no_store_given(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    rc, _, err = run(capsys, "log")
    assert rc == 2 and "--store PATH" in err


def test_log_show_ls(made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    rc, out, _ = run(capsys, "log", "--store", str(path))
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 3
    assert lines[0].startswith(vs[2].id[:12]) and "(main)" in lines[0] and "step 2" in lines[0]
    assert lines[2].startswith(vs[0].id[:12]) and "exp" in lines[2]
    rc, out, _ = run(capsys, "--store", str(path), "log", "-n", "1", "--json")
    assert rc == 0 and [r["id"] for r in json.loads(out)] == [vs[2].id]

    rc, out, _ = run(capsys, "--store", str(path), "show", "main~1")
    rec = json.loads(out)
    assert rc == 0 and rec["id"] == vs[1].id and rec["step"] == 1 and rec["hparams"] == {"lr": 0.2}

    rc, out, _ = run(capsys, "--store", str(path), "ls", vs[0].id[:8])
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rc == 0 and out.splitlines()[0].split()[:4] == ["key", "dtype", "shape", "bytes"]
    assert rows["model.weight"][1] == "float32" and "[32," in rows["model.weight"][2]
    assert "8.0 KiB" in " ".join(rows["model.weight"])  # 32 * 64 * 4 bytes
    assert set(rows) == {"model.weight", "model.bias"}  # tensors only; `show` has the plain values


def test_tag_and_branch(made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    rc, out, _ = run(capsys, "--store", str(path), "tag", "warm", "main~2", "-m", "first")
    assert rc == 0 and out.strip() == f"tag warm -> {vs[0].id[:12]}"
    rc, out, _ = run(capsys, "--store", str(path), "tag")
    assert out.split() == ["warm", vs[0].id[:12]]
    rc, _, err = run(capsys, "--store", str(path), "tag", "warm", "main")
    assert rc == 1 and "ConflictError" in err and "warm" in err  # tags never move
    rc, _, err = run(capsys, "--store", str(path), "branch", "bad..name")
    assert rc == 1 and "InvalidNameError" in err
    rc, out, _ = run(capsys, "--store", str(path), "branch", "fork", "warm")
    assert rc == 0 and out.strip() == f"branch fork -> {vs[0].id[:12]}"
    rc, out, _ = run(capsys, "--store", str(path), "branch")
    assert dict(line.split("\t") for line in out.splitlines()) == {
        "main": vs[2].id[:12], "exp": vs[0].id[:12], "fork": vs[0].id[:12]}
    rc, out, _ = run(capsys, "--store", str(path), "branch", "-d", "fork")
    with ds.Store.open(path) as s:
        assert "fork" not in s.branches() and s.tags() == {"warm": vs[0].id}


def test_du_counts_shared_chunks_once(made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    rc, out, _ = run(capsys, "--store", str(path), "du", "--json")
    d = json.loads(out)
    assert rc == 0 and d["versions"] == 3
    assert d["bytes_total"] == sum(v.bytes_total for v in vs)
    assert d["bytes_unique"] == sum(v.bytes_new for v in vs) < d["bytes_total"]  # the bias is stored once
    rc, out, _ = run(capsys, "--store", str(path), "du")
    assert "versions      3" in out and "dedup" in out


def test_fsck_names_a_corrupt_chunk_and_exits_1(made: tuple[Path, list[ds.Version]],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = made
    rc, out, _ = run(capsys, "--store", str(path), "fsck")
    assert rc == 0 and out.startswith("ok: checked")
    pack = sorted((path / "packs").glob("*.pack"))[0]
    data = bytearray(pack.read_bytes())
    data[100] ^= 0xFF
    pack.write_bytes(bytes(data))
    rc, out, _ = run(capsys, "--store", str(path), "fsck")
    assert rc == 1 and "problem:" in out and pack.stem in out and "NOT OK" in out


def test_diff_find_history(made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    rc, out, _ = run(capsys, "--store", str(path), "diff", "main~2", "main")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2 and lines[1].split()[:2] == ["model.weight", "changed"]  # bias is same
    rc, out, _ = run(capsys, "--store", str(path), "diff", "main~2", "main", "--all", "--json")
    assert {r["key"]: r["status"] for r in json.loads(out)} == {"model.weight": "changed", "model.bias": "same"}

    rc, out, _ = run(capsys, "--store", str(path), "find", "hparams.lr > 0.15 and metrics.loss < 0.6")
    assert rc == 0 and out.splitlines()[-1] == "2 version(s)"
    rc, _, err = run(capsys, "--store", str(path), "find", "hparams.lr >")
    assert rc == 1 and "QueryError" in err and "offset" in err

    rc, out, _ = run(capsys, "--store", str(path), "history", "model.weight", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["version"] for r in rows] == [v.id for v in vs]


def test_tiers_and_flush(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ds.Store.open(tmp_path / "cold", hot=tmp_path / "hot") as s:
        s.save({"w": torch.ones(1000)})
    rc, out, _ = run(capsys, "--store", str(tmp_path / "cold"), "flush")
    assert rc == 0 and "backlog 0" in out
    rc, out, _ = run(capsys, "--store", str(tmp_path / "cold"), "tiers", "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["tier"] for r in rows] == ["hot", "cold"] and rows[1]["backlog"] == 0
    assert rows[0]["packs"] == rows[1]["packs"] == 1


def test_progress_bars_go_to_a_terminal_only(made: tuple[Path, list[ds.Version]]) -> None:
    path, _ = made
    leader, follower = pty.openpty()
    # A terminal 100 columns wide: with the 0x0 size a bare pty reports, tqdm draws nothing.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = subprocess.Popen([SCRIPT, "--store", str(path), "fsck"], stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out, _ = p.communicate(timeout=120)
    os.close(leader)
    assert p.returncode == 0 and out.startswith(b"ok: checked")
    assert b"fsck: verifying hot packs" in seen
    p = subprocess.run([SCRIPT, "--store", str(path), "fsck"], capture_output=True, timeout=120)
    assert p.returncode == 0 and p.stderr == b""  # not a terminal: no bar


def test_store_path_that_is_a_file_one_line_error_and_debug_traceback(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    p = subprocess.run([sys.executable, "-m", "datastates", "--store", str(f), "init"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and "StoreFormatError" in p.stderr and str(f) in p.stderr
    p = subprocess.run([sys.executable, "-m", "datastates", "--debug", "--store", str(f / "s"), "log"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr and "StoreFormatError" in p.stderr


def test_an_oserror_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s" / "FORMAT").mkdir(parents=True)  # reading FORMAT raises IsADirectoryError, an OSError
    rc, _, err = run(capsys, "--store", str(tmp_path / "s"), "log")
    assert rc == 1 and "IsADirectoryError" in err and err.count("\n") == 1


def test_branch_d_refuses_unmerged_and_capital_d_forces(made: tuple[Path, list[ds.Version]],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    with ds.Store.open(path) as s:
        s.save({"x": torch.ones(2)}, branch="exp")
    rc, _, err = run(capsys, "--store", str(path), "branch", "-d", "exp")
    assert rc == 1 and "1 version(s)" in err and f"datastates --store {path} branch -D exp" in err
    rc, _, err = run(capsys, "--store", str(path), "branch", "-D", "exp")
    assert rc == 0
    rc, _, err = run(capsys, "--store", str(path), "tag", "main", "main~1")
    assert rc == 1 and "ConflictError" in err and "branch:main" in err
    with ds.Store.open(path) as s:
        assert set(s.branches()) == {"main"} and s.tags() == {}


def test_typos_are_errors_with_close_matches(made: tuple[Path, list[ds.Version]],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    rc, _, err = run(capsys, "--store", str(path), "find", "metrics.los < 0.1")
    assert rc == 1 and "QueryError" in err and "metrics.loss" in err
    rc, out, _ = run(capsys, "--store", str(path), "find", "metrics.los < 0.1", "--allow-missing", "--json")
    assert rc == 0 and json.loads(out) == []
    rc, _, err = run(capsys, "--store", str(path), "find", "metrics.loss < 'abc'")
    assert rc == 1 and "not a number" in err
    rc, _, err = run(capsys, "--store", str(path), "prune", "--keep-best", "1:metrics.los:min")
    assert rc == 1 and "NotFoundError" in err and "metrics.loss" in err
    rc, _, err = run(capsys, "--store", str(path), "diff", "main~2", "main", "--keys", "model.weigth")
    assert rc == 1 and "NotFoundError" in err and "model.weight" in err
    with ds.Store.open(path) as s:
        assert not any(v.pruned for v in s.log())  # the refused prune changed nothing
        assert [v.id for v in s.find("metrics.loss < 0.4")] == [vs[2].id]
        with pytest.raises(ds.errors.QueryError, match="metrics.loss"):
            s.find("metrics.los < 0.1")
        assert s.find("metrics.los < 0.1", allow_missing=True) == []


def test_log_fixed_columns_decorations_last_pruned_marked_and_iso_times(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str]) -> None:
    import datetime

    path, vs = made
    with ds.Store.open(path) as s:
        s.tag("best", vs[1])
        s.delete_branch("exp")  # main still reaches vs[0]
        s.prune(KeepLatest(1))  # vs[0] is no head and no tag: pruned
    rc, out, _ = run(capsys, "--store", str(path), "log", "--format", "table")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 3
    assert [line[41:49] for line in lines] == ["       2", "       1", "       0"]  # fixed columns
    cols = [line.split() for line in lines]
    assert [c[0] for c in cols] == [v.id[:12] for v in reversed(vs)]
    assert [c[1] for c in cols] == [datetime.datetime.fromtimestamp(v.created).astimezone()
                                    .isoformat(timespec="seconds") for v in reversed(vs)]
    assert [c[2] for c in cols] == ["2", "1", "0"]
    assert lines[0].endswith("step 2  (main)") and lines[1].endswith("step 1  (tag: best)")
    assert lines[2].endswith("step 0  [pruned]")
    rc, out_json, _ = run(capsys, "--store", str(path), "log", "--format", "json")
    rc2, out_alias, _ = run(capsys, "--store", str(path), "log", "--json")
    assert rc == rc2 == 0 and out_json == out_alias and [r["pruned"] for r in json.loads(out_json)] == [
        False, False, True]
    rc, out, _ = run(capsys, "--store", str(path), "show", vs[2].id)
    assert json.loads(out)["created"] == cols[0][1]
    with pytest.raises(SystemExit) as exit_info:
        main(["--store", str(path), "log", "-n", "-1"])
    assert exit_info.value.code == 2 and "1 or more" in capsys.readouterr().err


def test_find_without_order_is_by_creation_and_tiers_du_say_what_they_mean(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    with ds.Store.open(path) as s:
        late = s.save({"w": torch.ones(3)}, branch="aaa", step=9)  # a branch name sorting first
    rc, out, _ = run(capsys, "--store", str(path), "find", "step >= 0")
    assert rc == 0 and [line.split()[0] for line in out.splitlines()[:-1]] == [
        v.id[:12] for v in [*vs, late]]
    rc, out, _ = run(capsys, "--store", str(path), "tiers")
    assert rc == 0 and out.startswith("this store has one tier")
    with ds.Store.open(path) as s:
        s.prune(KeepLatest(1))
    rc, out, _ = run(capsys, "--store", str(path), "du")
    assert rc == 0 and "pruned" in out and "dedup and pruning" in out


@pytest.mark.parametrize("argv, words", [
    (["tag", ""], "tag name '' is empty"),
    (["tag", "-d", ""], "tag name '' is not a name"),
    (["branch", ""], "branch name '' is empty"),
    (["branch", "", "main"], "branch name '' is empty"),
    (["branch", "-d", ""], "branch name '' is not a name"),
    (["plot", "norms", "main", "-o", "x.zzz"], "ending in .png, .svg, .pdf"),
    (["plot", "norms", "main", "--dpi", "-5"], "--dpi -5: give a positive number"),
    (["plot", "norms", "main", "-o", "no/such/dir/n.png"], "does not exist; create it first"),
])
def test_an_empty_ref_name_and_a_bad_image_are_refused_in_one_line(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, argv: list[str], words: str) -> None:
    """`tag ''` listed the tags and `branch ''` printed nothing, both with exit 0; a bad --out or --dpi ended
    in matplotlib's traceback after the figure was drawn."""
    from helpers.states import snapshot

    path, _ = made
    monkeypatch.chdir(tmp_path)
    before = snapshot(path, with_catalog=True)
    rc, out, err = run(capsys, "--store", str(path), *argv)
    assert rc == 1 and out == "" and words in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and snapshot(path, with_catalog=True) == before
    assert not list(tmp_path.glob("x.*"))


def test_deleting_a_ref_says_what_it_named(made: tuple[Path, list[ds.Version]],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path, vs = made
    assert run(capsys, "--store", str(path), "tag", "t", vs[1].id)[0] == 0
    assert run(capsys, "--store", str(path), "tag", "-d", "t")[:2] == (0, f"deleted tag t (was {vs[1].short})\n")
    rc, out, _ = run(capsys, "--store", str(path), "branch", "-D", "exp")
    assert (rc, out) == (0, f"deleted branch exp (was {vs[0].short})\n")


@pytest.mark.parametrize("argv, words", [
    (["--step-from", "("], "is not a regex"),
    (["--step-from", "ck_(step)"], "found 'step'"),
    (["--allow-pickle"], "is not a torch.save file"),
])
def test_import_of_a_bad_pattern_or_a_file_that_is_no_checkpoint_is_one_line(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        argv: list[str], words: str) -> None:
    from helpers.states import snapshot

    path, _ = made
    bad = tmp_path / "ck_step=7.pt"
    bad.write_text("notatorch")  # a text file: with --allow-pickle, torch.load's own error
    if argv[0] == "--step-from":
        torch.save({"w": torch.ones(2)}, bad)
    before = snapshot(path, with_catalog=True)
    rc, out, err = run(capsys, "--store", str(path), "import", *argv, str(bad))
    assert rc == 1 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert snapshot(path, with_catalog=True) == before


@pytest.mark.parametrize("value", ["-3", "0"])
def test_keep_every_names_its_own_bound(made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str],
                                         value: str) -> None:
    """-3 was refused as 'must be 0 or more', then 0 as 'must be 1 or more'."""
    path, _ = made
    with pytest.raises(SystemExit) as info:
        main(["--store", str(path), "prune", "--keep-every", value])
    assert info.value.code == 2 and f"{value} must be 1 or more" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["flush", "--timeout", "-1"], "argument --timeout: -1.0 must be 0 or more seconds"),
    (["flush", "--timeout", "nan"], "argument --timeout: nan must be 0 or more seconds"),
    (["prune", "--keep-best", "2::min"], "the metric is empty; give N:METRIC[:min|max]"),
    (["plot", "histograms", "model.weight", "--bins", "0"], "argument --bins: 0 must be 1 or more"),
    (["plot", "histograms", "model.weight", "--max-versions", "-2"], "argument --max-versions: -2 must be 1 or more"),
    (["log", "-n", "0"], "argument -n: 0 must be 1 or more"),
    (["demo", "--every", "0"], "argument --every: 0 must be 1 or more"),
    (["demo", "--steps", "x"], "argument --steps: 'x' is not a whole number"),
])
def test_a_number_out_of_its_range_is_refused_where_it_is_read(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, argv: list[str], words: str) -> None:
    """`flush --timeout -1` was taken, `prune --keep-best 2::min` ranked by metrics.val_loss, and `demo --every 0`
    ended in ZeroDivisionError after the store was made."""
    from helpers.states import snapshot

    path, _ = made
    monkeypatch.chdir(tmp_path)
    before = snapshot(path, with_catalog=True)
    with pytest.raises(SystemExit) as info:
        main(["--store", str(path), *argv])
    assert info.value.code == 2 and words in capsys.readouterr().err
    assert snapshot(path, with_catalog=True) == before and not (tmp_path / "runs").exists()


def test_a_demo_too_short_to_diff_is_refused_before_its_store_is_made(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`demo --steps 100` saved 5 versions, then failed on `main~5` with a traceback."""
    rc, out, err = run(capsys, "demo", "--dir", str(tmp_path / "d"), "--steps", "100")
    assert (rc, out) == (1, "") and not (tmp_path / "d").exists()
    assert "makes 5 saves; the demo compares main~5 with main, so give at least 6: --steps 120 --every 20" in err


@pytest.mark.parametrize("argv", [["show", "nope"], ["tag", "-d", "nope"],
                                  ["diff", "main~1", "main", "--keys", "nope"]])
def test_a_hint_in_an_error_runs_as_given_with_the_same_store(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    """With --store and no $DATASTATES_STORE, a hint `datastates log` said 'no store given'."""
    import re
    import shlex

    path, _ = made
    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    rc, _, err = run(capsys, "--store", str(path), *argv)
    hints = re.findall(r"`(datastates [^`]*)`", err)
    assert rc == 1 and hints and all(h.startswith(f"datastates --store {shlex.quote(str(path))} ") for h in hints)
    for hint in hints:
        assert run(capsys, *shlex.split(hint)[1:])[0] == 0, hint
    monkeypatch.setenv("DATASTATES_STORE", str(path))  # the store the environment names: hints stay short
    assert "`datastates find`" in run(capsys, "show", "nope")[2]


def test_json_output_is_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """diff --json printed the bare token Infinity for a change from an all-zero tensor (a zero-init bias), which
    JavaScript's, Go's and serde's parsers refuse (a review); the REST server writes the string "Infinity"."""
    with ds.Store.open(tmp_path / "s") as s:
        s.save({"bias": torch.zeros(4), "w": torch.ones(2)}, step=1)
        s.save({"bias": torch.ones(4), "w": torch.tensor([1.0, float("nan")])}, step=2)
    rc, out, _ = run(capsys, "--store", str(tmp_path / "s"), "diff", "main~1", "main", "--json")
    assert rc == 0
    parsed = json.loads(out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert {r["key"]: (r["rel_change"], r["cosine"]) for r in parsed} == {"bias": ("Infinity", None),
                                                                          "w": ("Infinity", None)}


def test_a_reading_command_with_hot_leaves_a_one_tier_store_as_it_was(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`--hot DIR` is that command's hot tier only, yet `log --hot DIR` on a one-tier store marked its FORMAT as a
    cold tier's (without config.toml, which --hot never writes): every plain command on it then failed with
    StoreFormatError, 'the cold tier of a two-tier store'."""
    from helpers.states import snapshot

    path, vs = made
    before = snapshot(path)
    rc, out, _ = run(capsys, "--store", str(path), "--hot", str(tmp_path / "mine"), "log")
    assert rc == 0 and vs[-1].short in out
    assert snapshot(path) == before and not (path / "config.toml").exists()
    rc, out, err = run(capsys, "--store", str(path), "log")
    assert rc == 0 and vs[-1].short in out, err


def test_a_writing_command_with_hot_on_a_one_tier_store_is_refused_and_changes_nothing(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A write through --hot on a one-tier store went to that hot tier's catalog, which the store's own never
    sees: `import --hot` then left a branch naming a version its catalog lacked, and fsck said NOT OK (a review).
    Such an open may read, not write: ReadOnlyStoreError, exit 1, nothing changed."""
    from helpers.states import snapshot

    path, vs = made
    torch.save({"w": torch.zeros(2)}, tmp_path / "ck.pt")
    before = snapshot(path)
    for argv in (["import", str(tmp_path / "ck.pt"), "--branch", "imp"], ["tag", "t", "main"],
                 ["prune", "--keep-latest", "1"]):
        rc, _, err = run(capsys, "--store", str(path), "--hot", str(tmp_path / "mine"), *argv)
        assert rc == 1 and "ReadOnlyStoreError" in err and "Leave --hot out" in err, (argv, err)
    assert snapshot(path) == before
    with ds.Store.open(path) as s:
        assert "imp" not in s.branches() and s.tags() == {} and s.fsck().ok


def test_plot_takes_store_and_debug_after_its_kind(made: tuple[Path, list[ds.Version]],
                                                   capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Every command takes --store after its name (`datastates log --store PATH`); `datastates plot lineage
    --store PATH` ended in 'unrecognized arguments: --store' (exit 2), as did --debug there."""
    path, _ = made
    out = tmp_path / "l.svg"
    rc, printed, err = run(capsys, "plot", "lineage", "--store", str(path), "--debug", "-o", str(out))
    assert rc == 0 and out.is_file() and f"wrote {out}" in printed, err
    # Given before the command and after its kind, the later one is used, as for the other commands.
    rc, _, err = run(capsys, "--store", str(tmp_path / "nope"), "plot", "norms", "--store", str(path),
                     "-o", str(tmp_path / "n.png"))
    assert rc == 0 and (tmp_path / "n.png").is_file(), err


def test_log_shows_a_message_of_several_lines_on_its_own_row(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`log` is one line per version, yet a message 'a\\nb' printed its second line as a row of its own (one that
    could pass for another version's), and an escape sequence in it reached the terminal."""
    path = tmp_path / "s"
    with ds.Store.open(path) as s:
        v1 = s.save({"w": torch.ones(2)}, step=1, message="subject\nf5428b8664a8  2026-01-01  forged row")
        v2 = s.save({"w": torch.zeros(2)}, step=2, message="red \x1b[31malert")
    rc, out, _ = run(capsys, "--store", str(path), "log")
    rows = out.splitlines()
    assert rc == 0 and len(rows) == 2 and [r.split()[0] for r in rows] == [v2.short, v1.short]
    assert rows[1].endswith("subject ...") and "\x1b" not in out and "red \\x1b[31malert" in rows[0]
    rc, out, _ = run(capsys, "--store", str(path), "log", "--json")  # JSON keeps the message whole
    assert [r["message"] for r in json.loads(out)] == [v2.message, v1.message]


@pytest.mark.parametrize("count", ["9" * 5000, "0" * 5000 + "3", "9" * 19])
def test_a_ref_with_a_count_of_thousands_of_digits_goes_past_the_root(
        made: tuple[Path, list[ds.Version]], capsys: pytest.CaptureFixture[str], count: str) -> None:
    """`main~<5000 digits>` ended in ValueError's traceback (int() refuses over 4300 digits)."""
    path, vs = made
    rc, out, err = run(capsys, "--store", str(path), "show", f"main~{count}")
    assert rc == 1 and out == "" and "NotFoundError" in err and "goes past the root" in err and len(err) < 400, err
    with ds.Store.open(path) as s:  # the short forms read as before
        assert [s.resolve(r) for r in ("main~0", "main~", "main~1~1", "main~^", "main~002")] == [
            vs[2].id, vs[1].id, vs[0].id, vs[0].id, vs[0].id]
        # Leading zeros count for nothing, however many (a count of 19 characters was read as past the root).
        assert s.resolve("main~" + "0" * 20) == vs[2].id and s.resolve("main~" + "0" * 5000 + "1") == vs[1].id


def test_a_hint_keeps_the_commands_hot_tier_and_a_store_named_like_an_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The hints put --store in but dropped --hot: pasted, they read the hot tier config.toml names (another user's,
    another node's) instead of the reader's own. And a store path starting with '-' made hints that failed with
    'argument --store: expected one argument'."""
    import re
    import shlex

    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    monkeypatch.chdir(tmp_path)
    with ds.Store.open("cold", hot=str(tmp_path / "owners-hot")) as s:
        s.save({"w": torch.ones(2)}, step=1)
        s.flush()
    rc, _, err = run(capsys, "--store", "cold", "--hot", "mine", "show", "nope")
    hints = re.findall(r"`(datastates [^`]*)`", err)
    assert rc == 1 and hints and all(" --store cold " in h and " --hot mine " in h for h in hints), err
    for hint in hints:
        assert run(capsys, *shlex.split(hint)[1:])[0] == 0, hint
    # `init` would record the reader's directory as a new store's hot tier: its hint stays as it was.
    rc, _, err = run(capsys, "--store", "none", "--hot", "mine2", "log")
    assert rc == 1 and "`datastates init --store none`" in err, err
    with ds.Store.open("-runs") as s:
        s.save({"w": torch.ones(2)}, step=1)
    rc, _, err = run(capsys, "--store=-runs", "show", "nope")
    hints = re.findall(r"`(datastates [^`]*)`", err)
    assert rc == 1 and hints and all(h.startswith("datastates --store=-runs ") for h in hints), err
    for hint in hints:
        assert run(capsys, *shlex.split(hint)[1:])[0] == 0, hint


def test_a_hint_naming_the_store_as_typed_otherwise_still_gets_the_hot_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Store's hints carry its normalised path (`--store s1`); the command line had `--store ./s1/`: the two
    spellings were taken for two stores, and the hint lost the command's --hot (a review)."""
    from datastates.errors import with_store

    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    assert with_store("see `datastates --store s1 ls main`", "./s1/", "h1") == \
        "see `datastates --hot h1 --store s1 ls main`"
    assert with_store("see `datastates --store other ls main`", "./s1/", "h1") == \
        "see `datastates --store other ls main`"
