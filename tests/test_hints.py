"""Every hint that is a command works: each backquoted `datastates ...` in the package's string literals
(messages, docstrings, f-strings) is run through `datastates.cli.main` on a small real store and must exit 0.

Placeholders of f-strings (`{name}`, `{v.short}`...) get real values from that store; a new placeholder fails
the test until it gets a value in PLACEHOLDERS, so no hint goes unchecked by accident.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import torch

import datastates as ds
from datastates.cli import main

PACKAGE = Path(ds.__file__).parent
HINT = re.compile(r"`(datastates\s[^`]*)`")
# The benchmark is a program of its own, checked by tests/test_bench.py; running it here would cost minutes.
# The server runs until stopped; tests/test_server_*.py start it on a free port and stop it.
SKIP = ("datastates bench", "datastates serve")
# The demo runs here, in the test's directory, with fewer steps (120 still make the `main~5` it diffs).
EXTRA = {"demo": ["--steps", "120"]}


def _text(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's with each `{expr}` kept as written."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else
                       "{" + ast.unparse(v.value) + "}"  # type: ignore[attr-defined]
                       for v in node.values)
    return None


def collect() -> list[tuple[str, str]]:
    """(where, command template) for every backquoted `datastates ...` in datastates/**/*.py."""
    found: dict[tuple[str, str], None] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        # the literal parts of an f-string are seen whole, through their JoinedStr
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if id(node) in parts:
                continue
            text = _text(node)
            for cmd in HINT.findall(text or ""):
                where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
                found[(where, " ".join(cmd.split()))] = None
    return list(found)


HINTS = collect()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """7 versions on main (so `main~5` exists), a branch `exp` at the first, a tag `best` at the head."""
    path = tmp_path_factory.mktemp("hints") / "store"
    with ds.Store.open(path) as s:
        vs = [s.save({"model": {"w": torch.full((64,), float(i))}}, step=i, metrics={"loss": 1.0 / (i + 1)})
              for i in range(7)]
        s.branch("exp", at=vs[0])
        s.tag("best", vs[-1])
    return path


def _placeholders(store: Path, kind: str, template: str, tmp: Path) -> dict[str, str]:
    deletes = "-D" in template or " -d " in template
    with ds.Store.open(store) as s:
        short = s.version("main").short
        if deletes:  # the hint deletes: give it a ref of its own to delete
            if kind == "tag":
                if "scratch" in s.tags():
                    s.delete_tag("scratch")
                s.tag("scratch", "main")
            else:
                s.branch("scratch", at="main", force=True)
    return {"name": "scratch" if deletes else "main", "ref": "main", "v.short": short, "va.short": short,
            "new[:12]": short, "head[:12]": short, "there[:12]": short, "kind": kind, "kind_name[0]": kind,
            "root": str(tmp / "fresh"), "shlex.quote(held[0])": "model.w", "shlex.quote(at)": "main",
            "shlex.quote(first)": "model.w", "shlex.quote(str(ref))": "main"}


def _expand(template: str) -> list[tuple[str, str]]:
    """(kind, template) pairs: a hint over `{kind}` is tried for both ref kinds it can name."""
    if "{kind" not in template:
        return [("tag" if template.startswith("datastates tag ") else "branch", template)]
    kinds = ("branch",) if "-D" in template else ("branch", "tag")  # -D is branch-only, as in the hint's code
    return [(k, template) for k in kinds]


def test_hints_are_collected() -> None:
    commands = {c for _, c in HINTS}
    assert len(HINTS) >= 20, HINTS
    assert {"datastates fsck", "datastates fsck --rebuild", "datastates {kind} --list", "datastates log"} <= commands


@pytest.mark.parametrize(("where", "template"), HINTS, ids=[f"{w}:{c}" for w, c in HINTS])
def test_hint_command_runs(small: Path, tmp_path: Path, where: str, template: str,
                           capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a relative path in a hint (the demo's --dir) lands here
    if template.startswith(SKIP):
        pytest.skip(f"{template!r} is a program of its own, run by its own tests")
    for kind, tmpl in _expand(template):
        values = _placeholders(small, kind, tmpl, tmp_path)
        missing = set(re.findall(r"\{([^}]*)\}", tmpl)) - set(values)
        assert not missing, f"{where}: give the placeholder(s) {missing} a value in _placeholders"
        cmd = re.sub(r"\{([^}]*)\}", lambda m, v=values: v[m.group(1)], tmpl)  # type: ignore[misc]
        cmd = re.sub(r"\s*\[[^\]]*\]", "", cmd)  # a usage synopsis: `fsck [--repair]` runs as `fsck`
        argv = shlex.split(cmd)[1:]
        argv += EXTRA.get(argv[0], [])
        with ds.Store.open(small) as s:
            tags = set(s.tags())
        rc = main(argv if "--store" in argv else ["--store", str(small), *argv])
        out = capsys.readouterr()
        assert rc == 0, f"{where}: `{cmd}` exited {rc}: {out.err.strip()}"
        with ds.Store.open(small) as s:  # a tag a hint made (`datastates tag keep-...`) is not the fixture's
            for name in set(s.tags()) - tags:
                s.delete_tag(name)


def test_list_flags_take_a_glob_like_git(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["--store", str(small), "branch", "-l", "e*"]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["exp"]
    assert main(["--store", str(small), "tag", "--list"]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["best"]


def test_log_on_an_empty_store_does_not_send_the_user_to_log(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    ds.Store.open(tmp_path / "empty").close()
    assert main(["--store", str(tmp_path / "empty"), "log"]) == 1
    err = capsys.readouterr().err
    assert "no versions yet" in err and "`datastates log`" not in err


def test_a_hint_raised_to_a_python_caller_runs_as_given_in_a_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The Python API's errors said `datastates tag keep-... ID`, which a shell (no --store, no
    $DATASTATES_STORE) refused with 'no store given'; so did the CLI's warnings for a damaged ref. Both name
    the store now, and the hint runs as given."""
    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    store = tmp_path / "s"
    with ds.Store.open(store) as s:
        a = s.save({"w": torch.ones(2)})
        s.save({"w": torch.zeros(2)})
        with pytest.raises(ds.ConflictError) as info:
            s.save({"w": torch.full((2,), 2.0)}, parents=[a.id])  # would leave main's head reachable by no ref
        s.branch("exp")
    hint = HINT.search(str(info.value))
    assert hint is not None and hint.group(1).startswith(f"datastates --store {store} tag keep-")
    assert main(shlex.split(hint.group(1))[1:]) == 0
    (store / "refs" / "heads" / "exp").write_text("garbage\n")
    capsys.readouterr()
    assert main(["--store", str(store), "branch"]) == 0
    warned = HINT.search(capsys.readouterr().err)
    assert warned is not None and warned.group(1) == f"datastates --store {store} fsck --repair"
    assert main(shlex.split(warned.group(1))[1:]) == 0
    with ds.Store.open(store) as s:
        assert "exp" not in s.branches()


def test_an_error_of_opening_names_the_store_in_its_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Store.open is a classmethod, which the wrapping of the methods missed: a truncated catalog's
    `datastates fsck --repair` came without --store, the hint a user most needs to paste."""
    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    store = tmp_path / "s"
    with ds.Store.open(store) as s:
        s.save({"w": torch.ones(2)})
    data = store / "catalog" / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(8192)
    with pytest.raises(ds.DataStatesError, match="truncated") as info:
        ds.Store.open(store)
    hint = HINT.search(str(info.value))
    assert hint is not None and hint.group(1) == f"datastates --store {store} fsck --repair"
    assert main(shlex.split(hint.group(1))[1:]) == 0
    with ds.Store.open(store) as s:
        assert s.load("main")["w"].tolist() == [1.0, 1.0]


def test_a_hint_raised_by_a_save_handle_names_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of the background, raised by `SaveHandle.result()` rather than by a Store method, kept
    `datastates tag keep-...` without --store: pasted into a shell, it found no store."""
    monkeypatch.delenv("DATASTATES_STORE", raising=False)
    store = tmp_path / "s"
    with ds.Store.open(store) as s:
        s.save({"w": torch.ones(2)})
        b = s.save({"w": torch.zeros(2)})
        with s.refs.locked():  # both saves wait at their commit: the second's check at the call sees head b
            first = s.save_async({"w": torch.full((2,), 3.0)})
            second = s.save_async({"w": torch.full((2,), 4.0)}, parents=[b.id])
        first.result()
        with pytest.raises(ds.ConflictError) as info:
            second.result()
        assert second.exception() is info.value
    hint = HINT.search(str(info.value))
    assert hint is not None and hint.group(1).startswith(f"datastates --store {store} tag keep-")
    assert main(shlex.split(hint.group(1))[1:]) == 0
    with ds.Store.open(store) as s:
        assert [t for t in s.tags() if t.startswith("keep-")] == [f"keep-{first.id[:12]}"]
