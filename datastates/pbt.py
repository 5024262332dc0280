"""Population-based training on top of the store.

Each member trains on its own branch `<population>/member-NN`. `exploit`
copies a top member's latest state into a bottom member (a fork: no bytes are
read or written) and records the donor in the new version's `fork_of`;
`explore` records a hyperparameter change as `explore = {"old": ..., "new": ...}`
on a version. The family tree is therefore a query over real fields, never a
log to parse. Versions that a living member's lineage needs are protected
from pruning: in this process by a protector (see `protected`), and in every
other process by a lease file naming the population's branch prefix
(datastates.meta.leases), renewed on each save and released by `close()` or
at exit.
"""

from __future__ import annotations

import atexit
import numbers
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .errors import InvalidArgumentError, InvalidNameError, NotFoundError
from .maintenance.retention import register_protector
from .meta import leases
from .meta.refs import check_name
from .meta.versions import shown

if TYPE_CHECKING:
    from .meta.versions import Version
    from .repo.repository import Repository
    from .store import Store


@dataclass
class Member:
    """One member of a population: a branch plus its current hyperparameters."""

    population: Population
    index: int
    hparams: dict[str, Any]

    @property
    def branch(self) -> str:
        return f"{self.population.name}/member-{self.index:02d}"

    @property
    def head(self) -> Version | None:
        vid = self.population.store.branches().get(self.branch)
        return None if vid is None else self.population.store.version(vid)

    def save(self, state: Any, *, metrics: dict[str, Any], step: int | None = None, **kw: Any) -> Version:
        """Save this member's state on its branch with its current hyperparameters."""
        self.population.renew()
        return self.population.store.save(state, branch=self.branch, step=step, hparams=self.hparams,
                                          metrics=metrics, **kw)

    def load(self, **kw: Any) -> Any:
        """The member's latest state (after an exploit: the donor's)."""
        return self.population.store.load(self.branch, **kw)

    def score(self) -> float | None:
        head = self.head
        if head is None:
            return None
        value = head.metrics.get(self.population.metric, head.annotations.get(self.population.metric))
        return None if value is None else float(value)


class Population:
    """`Population(store, "sweep-1", size=8, metric="score", mode="max")`."""

    def __init__(self, store: Store, name: str, size: int, *, metric: str = "score", mode: str = "max",
                 hparams: dict[str, Any] | list[dict[str, Any]] | None = None, fraction: float = 0.25,
                 seed: int = 0) -> None:
        if mode not in ("min", "max"):
            raise InvalidArgumentError(f"mode {mode!r} must be 'min' or 'max'")
        given: Any = size  # (numpy integers and floats are numbers too)
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or given < 2:
            raise InvalidArgumentError(f"a population needs at least 2 members, not {shown(size)}")
        size = int(given)
        given = fraction
        if isinstance(given, bool) or not isinstance(given, numbers.Real) or not 0 < float(given) <= 0.5:
            raise InvalidArgumentError(
                f"fraction {shown(fraction)} must be a number in (0, 0.5]: the bottom fraction copies from the top "
                "one, and above a half the two overlap (0.25 is the usual truncation selection)")
        if not isinstance(name, str):
            raise InvalidNameError(f"population name {shown(name)} must be a string")
        try:
            check_name(f"{name}/member-00", "branch")  # each member is a branch NAME/member-NN: refused now, not later
        except InvalidNameError as exc:
            raise InvalidNameError(f"population name {name!r} makes member branches such as '{name}/member-00': "
                                   f"{exc}") from None
        store.repo.check_writable()  # the lease below is a file in the store
        self.store, self.name, self.metric, self.mode, self.fraction = store, name, metric, mode, fraction
        self.rng = random.Random(seed)
        if isinstance(hparams, list) and len(hparams) != size:
            raise InvalidArgumentError(f"hparams is a list of {len(hparams)} dicts for a population of {size}; "
                                       "give one per member, or one dict for all")
        per = hparams if isinstance(hparams, list) else [dict(hparams or {}) for _ in range(size)]
        self.members = [Member(self, i, dict(per[i])) for i in range(size)]
        for m in self.members:  # a restarted population continues from what its branches hold
            head = m.head
            if head is not None:
                m.hparams = dict(head.hparams)
        self.renew()  # first: a lease refused (its file not written) leaves no protection behind in this process
        _LIVING.setdefault(id(store.repo), []).append(self)
        atexit.register(self.close)

    def renew(self) -> None:
        """Take or renew the lease that keeps this population's lineage from any process's prune."""
        leases.take(self.store.root, f"pbt-{self.name}", f"{self.name}/")

    def close(self) -> None:
        """Release the lease and the in-process protection (a Population is also a context manager)."""
        pops = _LIVING.get(id(self.store.repo), [])
        if self in pops:
            pops.remove(self)
        leases.release(self.store.root, f"pbt-{self.name}")

    def __enter__(self) -> Population:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ranked(self) -> list[Member]:
        """Members with a score, best first."""
        scored = [(m.score(), m) for m in self.members]
        ranked = [(s, m) for s, m in scored if s is not None]
        ranked.sort(key=lambda sm: sm[0], reverse=self.mode == "max")
        return [m for _, m in ranked]

    def exploit(self, member: Member, donor: Member | None = None) -> Version | None:
        """Truncation selection: if `member` is in the bottom fraction, fork a top member's
        latest version into it and copy the donor's hyperparameters. Returns the new version,
        or None when the member is not in the bottom fraction. `donor`: that member instead of a random top one.
        Raises InvalidArgumentError for a member or donor that is not one of this population's `members`, or a
        donor that is the member itself; NotFoundError for a donor with no saved version."""
        self._check_member(member, "member")
        if donor is not None:
            self._check_member(donor, "donor")
            if donor is member:
                raise InvalidArgumentError(f"donor {donor.branch} is the member itself; give another member")
        ranked = self.ranked()
        k = max(1, int(len(ranked) * self.fraction))
        if donor is None:
            if member not in ranked[-k:] or len(ranked) < 2:
                return None
            donor = self.rng.choice([m for m in ranked[:k] if m is not member])
        src = donor.head
        if src is None:
            raise NotFoundError(f"donor {donor.branch} has no saved version yet; save before exploiting")
        member.hparams = dict(src.hparams)
        self.renew()
        # force: the member's own line is abandoned on purpose (family_tree still finds it by branch name).
        return self.store.fork(src, branch=member.branch, parents=[src.id], fork_of=src.id, force=True,
                               message=f"exploit: {member.branch} <- {donor.branch}")

    def _check_member(self, m: Any, what: str) -> None:
        if not isinstance(m, Member) or m.population is not self:
            names = ", ".join(x.branch for x in self.members[:3])
            raise InvalidArgumentError(
                f"{what} {shown(m) if not isinstance(m, Member) else m.branch} is not a member of population "
                f"{self.name!r}: give one of its `members` ({names}, ...), e.g. pop.members[0]")

    def explore(self, member: Member, hparams: dict[str, Any] | None = None, *,
                perturb: dict[str, tuple[float, ...]] | None = None) -> Version:
        """Change the member's hyperparameters (given, or each numeric one in `perturb` multiplied
        by a random factor) and record old -> new as the `explore` field of a new version. Raises
        InvalidArgumentError with neither `hparams` nor `perturb` (nothing to explore), or for another
        population's member; NotFoundError for a member with no saved version."""
        self._check_member(member, "member")
        if not hparams and not perturb:
            raise InvalidArgumentError(f"explore of {member.branch} changes nothing: give hparams={{...}} or "
                                       "perturb={'lr': (0.8, 1.2)}")
        head = member.head
        if head is None:
            raise NotFoundError(f"{member.branch} has no saved version yet; save before exploring")
        old = dict(member.hparams)
        new = dict(old)
        if hparams:
            new.update(hparams)
        for key, factors in (perturb or {}).items():
            value = new.get(key)
            if key not in new or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(
                    f"perturb names hparam {key!r}, which {member.branch} "
                    + ("does not have" if key not in new else f"holds as {shown(value)}, not a number")
                    + f"; its hparams: {', '.join(sorted(map(str, new))) or 'none'}")
            if not factors or not all(isinstance(f, (int, float)) and not isinstance(f, bool) for f in factors):
                raise InvalidArgumentError(f"perturb[{key!r}] = {shown(factors)}: give a tuple of numbers to "
                                           "multiply by, e.g. (0.8, 1.2)")
            new[key] = value * self.rng.choice(factors)
        changed = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
        v = self.store.fork(head, branch=member.branch, hparams=new,
                            explore={"old": {k: old.get(k) for k in sorted(changed)},
                                     "new": {k: new.get(k) for k in sorted(changed)}},
                            message=f"explore: {', '.join(sorted(changed))}")
        member.hparams = new  # only once saved: a refused explore leaves the member as it was
        return v

    def family_tree(self) -> pa.Table:
        """Edges of the population's lineage (`family_tree(store, name)`)."""
        return family_tree(self.store, self.name)

    def replay(self, member: Member) -> list[tuple[int | None, dict[str, Any]]]:
        """The (step, hparams) schedule that produced `member`'s latest state, oldest first:
        one entry each time the hyperparameters changed along its first-parent lineage."""
        head = member.head
        if head is None:
            return []
        chain = [head.id, *self.store.ancestors(head.id, first_parent=True)]
        out: list[tuple[int | None, dict[str, Any]]] = []
        for vid in reversed(chain):
            v = self.store.version(vid)
            if not out or out[-1][1] != v.hparams:
                out.append((v.step, dict(v.hparams)))
        return out

    def protected(self) -> set[str]:
        """Every version a living member's lineage needs (its ancestors, donors included)."""
        keep: set[str] = set()
        for m in self.members:
            vid = self.store.branches().get(m.branch)
            if vid is not None:
                keep.add(vid)
                keep.update(self.store.ancestors(vid))
        return keep


def family_tree(store: Store, name: str) -> pa.Table:
    """Edges of population `name`'s lineage: child, parent, kind ('parent' or 'fork'), member, step,
    explore; from every version saved on a member branch `name/...`, abandoned lines (before an exploit)
    included. Reads only: unlike a Population, it takes no lease (a reader must not take over the
    trainer's)."""
    rows: list[dict[str, Any]] = []
    table = store.versions_table()
    prefix = f"{name}/"
    ids = [vid for vid, br in zip(table.column("id").to_pylist(), table.column("branch").to_pylist())
           if br is not None and br.startswith(prefix)]
    for vid in ids:
        v = store.version(vid)
        for p in v.parents:
            rows.append({"child": vid, "parent": p, "kind": "fork" if v.fork_of == p else "parent",
                         "member": v.branch, "step": v.step,
                         "explore": None if v.explore is None else str(v.explore)})
    schema = pa.schema([("child", pa.string()), ("parent", pa.string()), ("kind", pa.string()),
                        ("member", pa.string()), ("step", pa.int64()), ("explore", pa.string())])
    return pa.Table.from_pylist(rows, schema=schema)


_LIVING: dict[int, list[Population]] = {}


def protected_versions(store: Store | Repository) -> set[str]:
    """Versions that the populations open on `store` in this process must keep (for retention).
    Keyed by the repository, which is what prune hands protectors."""
    out: set[str] = set()
    for pop in _LIVING.get(id(getattr(store, "repo", store)), []):
        out |= pop.protected()
    return out


register_protector(protected_versions)
