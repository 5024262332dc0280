"""Population-based training helpers: exploit/explore fields, family tree, replay."""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import datastates as ds
from datastates.cli import main as cli_main
from datastates.pbt import Population, protected_versions


def _on_branch(store: ds.Store, branch: str) -> list[ds.Version]:
    """Every version saved on `branch`, lines abandoned by an exploit included."""
    t = store.versions_table()
    return [store.version(i) for i, b in zip(t.column("id").to_pylist(), t.column("branch").to_pylist())
            if b == branch]


def _run(tmp_path: Path) -> tuple[ds.Store, Population]:
    store = ds.Store.open(tmp_path / "s")
    pop = Population(store, "sweep", size=4, hparams=[{"lr": 10.0 ** -i} for i in range(1, 5)], seed=7)
    for step in range(1, 4):
        for m in pop.members:
            w = torch.full((256,), float(m.index * 10 + step))
            m.save({"w": w}, metrics={"score": float(m.index) + step / 10}, step=step)
        worst = pop.ranked()[-1]
        pop.exploit(worst)
        pop.explore(worst, perturb={"lr": (0.5, 2.0)})
    return store, pop


def test_exploit_forks_donor_without_new_bytes(tmp_path: Path) -> None:
    store, pop = _run(tmp_path)
    worst = pop.members[0]  # lowest score every round
    forks = [v for v in _on_branch(store, worst.branch) if v.fork_of is not None]
    assert len(forks) == 3
    for v in forks:
        donor = store.version(v.fork_of)
        assert v.parents == (donor.id,)
        assert v.bytes_new == 0
        assert donor.branch != worst.branch
        assert torch.equal(store.load(v)["w"], store.load(donor)["w"])
    store.close()


def test_explore_records_old_and_new_hparams(tmp_path: Path) -> None:
    store, pop = _run(tmp_path)
    explored = [v for v in _on_branch(store, pop.members[0].branch) if v.explore is not None]
    assert len(explored) == 3
    for v in explored:
        old, new = v.explore["old"]["lr"], v.explore["new"]["lr"]
        assert new in (old * 0.5, old * 2.0)
        assert v.hparams["lr"] == new
    table = store.versions_table()
    assert sum(1 for f in table.column("fork_of").to_pylist() if f is not None) == 3
    store.close()


def test_a_refused_explore_or_population_is_typed_and_changes_nothing(tmp_path: Path) -> None:
    """Perturbing a string hparam raised TypeError, a missing one KeyError (after the member's hparams had
    changed), and a hparams list shorter than the population IndexError."""
    with ds.Store.open(tmp_path / "s") as store:
        pop = Population(store, "sw", size=2, hparams=[{"lr": 0.1, "opt": "adam"}, {"lr": 0.2, "opt": "sgd"}])
        for m in pop.members:
            m.save({"w": torch.ones(1)}, metrics={"score": float(m.index)}, step=1)
        m0 = pop.members[0]
        versions = store.versions_table().num_rows
        for perturb, words in (({"opt": (0.8, 1.2)}, "holds as 'adam', not a number"),
                               ({"momentum": (0.8,)}, "does not have; its hparams: lr, opt"),
                               ({"lr": ()}, "give a tuple of numbers")):
            with pytest.raises(ds.InvalidArgumentError, match=re.escape(words)):
                pop.explore(m0, {"lr": 0.5}, perturb=perturb)
            assert m0.hparams == {"lr": 0.1, "opt": "adam"} and store.versions_table().num_rows == versions
        with pytest.raises(ds.InvalidArgumentError, match="a list of 1 dicts for a population of 3"):
            Population(store, "sw2", size=3, hparams=[{"lr": 1}])
        assert not list((store.path / "leases").glob("pbt-sw2@*"))
        pop.close()


def test_bad_members_donors_names_and_fractions_are_refused(tmp_path: Path) -> None:
    """A donor given by name raised AttributeError; another population's member and a number were taken silently
    (None); a member its own donor was forked onto itself; fraction=2.0 made the best member copy a worse one; a
    name no branch may have was taken, with its lease, until the first save (a review)."""
    with ds.Store.open(tmp_path / "s") as store:
        pop = Population(store, "sw", size=4)
        other = Population(store, "other", size=2)
        for i, m in enumerate(pop.members + other.members):
            m.save({"w": torch.full((2,), float(i))}, metrics={"score": float(i)}, step=1)
        versions = store.versions_table().num_rows
        heads = store.branches()
        for call, words in (
                (lambda: pop.exploit(pop.members[0], donor="sw/member-03"), "donor 'sw/member-03' is not a member"),
                (lambda: pop.exploit(other.members[0]), "member other/member-00 is not a member of population 'sw'"),
                (lambda: pop.exploit(2), "member 2 is not a member"),  # type: ignore[arg-type]
                (lambda: pop.exploit(pop.members[1], donor=pop.members[1]), "is the member itself"),
                (lambda: pop.explore(pop.members[1]), "changes nothing"),
                (lambda: pop.explore(other.members[1], {"lr": 1.0}), "not a member of population 'sw'")):
            with pytest.raises(ds.InvalidArgumentError, match=re.escape(words)):
                call()
        assert store.versions_table().num_rows == versions and store.branches() == heads
        for fraction in (2.0, 0, -0.1, 0.75, "0.2"):
            with pytest.raises(ds.InvalidArgumentError, match="fraction"):
                Population(store, "f", size=4, fraction=fraction)  # type: ignore[arg-type]
        Population(store, "np", size=np.int64(2), fraction=np.float64(0.5)).close()  # numpy numbers are numbers
        with pytest.raises(ds.InvalidNameError, match="population name 'bad name~'"):
            Population(store, "bad name~", size=2)
        assert sorted(p.name.split("@")[0] for p in (store.path / "leases").iterdir()) == ["pbt-other", "pbt-sw"]
        assert pop.exploit(pop.members[0], donor=pop.members[3]).parents == (heads["sw/member-03"],)
        pop.close()
        other.close()


def test_family_tree_and_replay(tmp_path: Path) -> None:
    store, pop = _run(tmp_path)
    tree = pop.family_tree().to_pylist()
    assert sum(1 for e in tree if e["kind"] == "fork") == 3
    children = {e["child"] for e in tree}
    assert all(store.version(c).parents for c in children)
    sched = pop.replay(pop.members[0])
    steps = [s for s, _ in sched]
    assert steps == sorted(steps)
    assert sched[-1][1] == pop.members[0].hparams
    assert len(sched) >= 2  # donor's hparams, then at least one explore change
    store.close()


def test_protected_versions_cover_donors(tmp_path: Path) -> None:
    store, pop = _run(tmp_path)
    keep = protected_versions(store)
    for v in _on_branch(store, pop.members[0].branch):
        if v.fork_of:
            assert v.fork_of in keep
    store.close()


def test_explore_and_fork_fields_are_queryable(tmp_path: Path) -> None:
    store, pop = _run(tmp_path)
    explored = store.find("explore.new.lr is not null")
    assert len(explored) == 3 and all(v.explore is not None for v in explored)
    small = store.find("explore.old.lr < 0.001")
    assert {v.id for v in small} == {v.id for v in explored if v.explore["old"]["lr"] < 0.001}
    assert len(store.find("fork_of is not null")) == 3
    store.close()


def test_the_docs_example_trains_a_population_in_seconds(tmp_path: Path) -> None:
    example = Path(__file__).parent.parent / "docs" / "examples" / "pbt_toy.py"
    p = subprocess.run([sys.executable, str(example), "--store", str(tmp_path / "s"), "--steps", "100"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = dict(line.split(": ", 1) for line in p.stdout.splitlines())
    assert out["members"] == "8" and out["versions"] != "0"
    assert int(out["exploits"]) == int(out["explores"]) == int(out["fork_edges"]) > 0
    with ds.Store.open(tmp_path / "s") as store:
        forks = store.find("fork_of is not null")
        assert len(forks) == int(out["exploits"])
        for v in forks:
            assert v.bytes_new == 0 and store.version(v.fork_of).branch != v.branch
        for v in store.find("explore.new.lr is not null"):
            ratio = v.explore["new"]["lr"] / v.explore["old"]["lr"]
            assert math.isclose(ratio, 0.8) or math.isclose(ratio, 1.25)


def test_the_docs_pbt_output_is_what_the_script_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """docs/pbt.md shows the example's output for its defaults (all but the `seconds` line) and shell
    commands on the store it makes: both as the code does them today."""
    root = Path(__file__).parent.parent
    doc = (root / "docs" / "pbt.md").read_text()
    shown = re.search(r"```\n(members: .*?)```", doc, re.S)
    assert shown, "docs/pbt.md lost its example output block"
    store = tmp_path / "pbt-store"
    p = subprocess.run([sys.executable, str(root / "docs" / "examples" / "pbt_toy.py"), "--store", str(store)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr

    def lines(text: str) -> list[str]:
        return [x for x in text.splitlines() if x and not x.startswith("seconds: ")]

    assert lines(p.stdout) == lines(shown.group(1))
    monkeypatch.setenv("DATASTATES_STORE", str(store))
    commands = re.findall(r"^(datastates .*?)(?:\s+#.*)?$", doc, re.M)
    assert len(commands) == 4
    for cmd in commands:
        assert cli_main(shlex.split(cmd)[1:]) == 0, f"docs/pbt.md: `{cmd}` failed: {capsys.readouterr().err}"
