"""A save request as data: the record fields of a save or a fork, validated where they enter.

Every check runs before anything is written, so a refused call changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidArgumentError
from ..meta.refs import check_name
from ..meta.versions import MAX_INT, Version, check_size, check_text, plain_json, record_dict

Resolve = Callable[[Any], str]
"""Turns a ref (id, prefix, branch, tag, Version, handle) into a version id; raises NotFoundError."""


def save_request(resolve: Resolve, *, branch: str | None, parents: Sequence[Any] | None, step: Any, epoch: Any,
                 hparams: Any, metrics: Any, message: Any, fork_of: Any, explore: Any,
                 force: Any = False) -> dict[str, Any]:
    """The validated fields of a save (`force`: the branch may move off a head the version does not descend
    from; see `commit.check_branch_move`). Raises InvalidNameError, InvalidArgumentError,
    UnsupportedValueError, NotFoundError (unknown parents)."""
    if branch is not None:
        check_name(branch, "branch")
    return {
        "force": check_flag(force, "force"),
        "branch": branch,
        "parents": None if parents is None else [resolve(p) for p in parent_list(parents)],
        "step": whole_number(step, "step"),
        "epoch": whole_number(epoch, "epoch"),
        "hparams": plain_json(hparams, "hparams"),
        "metrics": plain_json(metrics, "metrics", numbers_only=True),
        "message": _message(message),
        "fork_of": None if fork_of is None else resolve(fork_of),
        "explore": None if explore is None else plain_json(explore, "explore"),
    }


def fork_record(src: Version, resolve: Resolve, *, branch: str | None, parents: Sequence[Any] | None,
                hparams: Any, metrics: Any, step: Any, message: str, fork_of: Any, explore: Any) -> dict[str, Any]:
    """The record of a version naming exactly `src`'s manifests: parents default to [src], hparams and
    step to src's. Raises InvalidNameError, InvalidArgumentError, UnsupportedValueError, NotFoundError."""
    if branch is not None:
        check_name(branch, "branch")
    return record_dict(
        parents=[resolve(p) for p in parent_list(parents)] if parents is not None else [src.id],
        manifests=src.manifests, step=src.step if step is None else whole_number(step, "step"), epoch=src.epoch,
        created=time.time(), hparams=plain_json(src.hparams if hparams is None else hparams, "hparams"),
        metrics=plain_json(metrics, "metrics", numbers_only=True), message=_message(message),
        branch=branch, world_size=src.world_size,
        bytes_total=src.bytes_total, bytes_new=0, chunks_new=0,
        fork_of=None if fork_of is None else resolve(fork_of),
        explore=None if explore is None else plain_json(explore, "explore"),
    )


def _message(value: Any) -> str:
    text = check_text(value, "message")
    check_size(text, "message")
    return text


def check_flag(value: Any, what: str) -> bool:
    """`value` if it is a bool; InvalidArgumentError otherwise (a str such as "no" would be true)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{what}={value!r} is not True or False")
    return value


def parent_list(parents: Any) -> list[Any]:
    """`parents` as a list of refs. Raises InvalidArgumentError for one str (its characters are not refs)
    or anything that is not a list or tuple."""
    if not isinstance(parents, (list, tuple)):
        raise InvalidArgumentError(f"parents={parents!r} is a {type(parents).__name__}; give a list of refs, "
                                   "e.g. parents=['main', 'lr-high']")
    return list(parents)


def whole_number(value: Any, what: str) -> int | None:
    """`value` as an int in 0..2**63-1 (None stays None; numpy ints accepted); InvalidArgumentError for
    anything else: a bool, a fraction, a negative number, a str."""
    if value is None:
        return None
    try:
        n = int(value)
        ok = n == value and not isinstance(value, (bool, str, bytes))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise InvalidArgumentError(f"{what}={value!r} is not a whole number; give an int such as {what}=100")
    if not 0 <= n <= MAX_INT:
        raise InvalidArgumentError(f"{what}={n} is out of range; {what} counts from 0 (at most 2**63-1)")
    return n
