"""Every error DataStates raises, under one base class.

Messages name the object that was involved and say what to do next.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import shlex
from collections.abc import Callable, Iterable
from typing import Any


class DataStatesError(Exception):
    """Base class of every error raised by datastates."""


_HINT = re.compile("`" + r"datastates ([^`]*)`")  # split: tests/test_hints.py runs every `datastates ...` literal


def with_store(text: str, store: str | None, hot: str | None = None) -> str:
    """`text` with `--store STORE` put into each backquoted hint that is a datastates command, so that the
    hint runs as given in the user's shell. Unchanged when `store` is what $DATASTATES_STORE already names
    (or None), and for hints that name a store of their own. `hot` (a command's --hot) is put in too: without
    it the hint would read the hot tier config.toml names, which may be another user's or another node's."""
    add_store = bool(store) and store != os.environ.get("DATASTATES_STORE")
    if not add_store and not hot:
        return text

    def put(m: re.Match[str]) -> str:
        words = m.group(1).split()
        if words[:1] in (["demo"], ["bench"]):
            return m.group(0)
        try:
            argv = shlex.split(m.group(1))
        except ValueError:
            argv = words
        named = _value(argv, "--store")
        if named is not None and not _same_path(named, store):  # a store of its own
            return m.group(0)
        options = ""
        if add_store and named is None:
            options += " " + _option("--store", store or "")
        # Not into `init`, which would record the reader's directory as the new store's hot tier.
        if hot and _value(argv, "--hot") is None and "init" not in argv:
            options += " " + _option("--hot", hot)
        return "`datastates" + options + m.group(0)[len("`datastates"):]

    return _HINT.sub(put, text)


def _same_path(a: str, b: str | None) -> bool:
    """Whether two spellings of a store path name one directory (`./s1/` and `s1`: a Store's hints carry its
    normalised path, the command line what was typed)."""
    return b is not None and os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def _value(argv: list[str], name: str) -> str | None:
    """The value of option `name` in `argv` (`name VALUE` or `name=VALUE`), None when it is not there."""
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word[len(name) + 1:]
    return None


def _option(name: str, value: str) -> str:
    """`name value` for a shell; `name=value` for a value starting with '-', which argparse would read as an
    option (`--store -runs` fails with 'expected one argument')."""
    return f"{name}={shlex.quote(value)}" if value.startswith("-") else f"{name} {shlex.quote(value)}"


def name_store(exc: BaseException, store: str) -> None:
    """Put `--store STORE` into the command hints of `exc`'s message, in place (see `with_store`): raised
    through a Store's methods, a hint such as `datastates fsck` then runs as given in a shell, which knows no
    store of its own."""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (with_store(exc.args[0], store), *exc.args[1:])


class NotFoundError(DataStatesError, KeyError):
    """A ref, version, chunk, key or file that was asked for does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AmbiguousRefError(DataStatesError, ValueError):
    """A short id prefix matches more than one version."""


class ConflictError(DataStatesError):
    """A compare-and-swap lost a race, or a name that must be new exists."""


class IntegrityError(DataStatesError):
    """Bytes read back do not hash to the id they were stored under."""


class UnsupportedValueError(DataStatesError, TypeError):
    """A value in a state cannot be stored without pickle (or at all)."""


class StoreFormatError(DataStatesError):
    """The directory is not a store, or was written by a newer format."""


class CatalogDamagedError(StoreFormatError):
    """The LMDB catalog file is truncated or damaged; `datastates fsck --repair` rebuilds it from the records."""


class InvalidNameError(DataStatesError, ValueError):
    """A branch, tag or key name breaks the naming rules."""


class QueryError(DataStatesError, ValueError):
    """A query string does not parse; carries the offset where it failed."""

    def __init__(self, message: str, query: str = "", offset: int = 0) -> None:
        self.query = query
        self.offset = offset
        where = f" at offset {offset}" if query else ""
        pointer = f"\n  {query}\n  {' ' * offset}^" if query else ""
        super().__init__(f"{message}{where}{pointer}")


class PrunedError(DataStatesError):
    """The version's record is kept for lineage, but its bytes were pruned."""


class StoreClosedError(DataStatesError):
    """The store was closed; open it again to use it."""

    @classmethod
    def of(cls, store: object) -> StoreClosedError:
        """The error for a call on the closed store at `store` (its directory)."""
        return cls(f"store {store} is closed; open it again with Store.open")


class ReadOnlyStoreError(DataStatesError, PermissionError):
    """A call that writes, on a store opened read-only: `Store.open(..., read_only=True)`, or a store this user may
    not write to (opened read-only by itself). Nothing was changed; the message says how to get write access."""


class SaveFailedError(DataStatesError):
    """A background save failed; the cause is chained as __cause__."""


class CommTimeoutError(SaveFailedError):
    """A collective of a distributed save waited longer than the store's comm timeout for the other
    ranks (a rank hung or died without the launcher ending the job). Nothing of that save is visible;
    the communicator is unusable afterwards: end the job (the launcher restarts it)."""


class ShapeMismatchError(DataStatesError, ValueError):
    """A stored tensor does not match the dtype or shape it is loaded into, or a stored state does not fit
    the live object it is checked out into (keys, an optimizer's parameter groups)."""


class InvalidArgumentError(DataStatesError, ValueError):
    """An argument outside what the call accepts (a negative size, a step that is not an integer...)."""


class DeviceError(DataStatesError, ValueError):
    """A load asked for a device this process cannot use (unknown name, no such GPU, torch built without it)."""


class StorageFullError(DataStatesError, OSError):
    """A tier ran out of space (ENOSPC); nothing of the failed save is visible."""


class MissingDependencyError(DataStatesError, ImportError):
    """An optional dependency (an extra such as `plot`) is not installed; the message names the pip command."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of a type the call does not take (a str where a retention policy goes); a TypeError as
    Python's own would be."""


class UnexpectedArgumentError(InvalidArgumentError, TypeError):
    """A keyword the call does not take (a typo such as `stpe=`); a TypeError as Python's own would be."""


def check_keywords(call: str, given: Iterable[str], target: Callable[..., Any], *,
                   hidden: Iterable[str] = ()) -> None:
    """Raise UnexpectedArgumentError naming `call` and the closest keywords of `target` for each
    name in `given` that `target` does not take (`hidden` names are neither accepted nor suggested)."""
    params = inspect.signature(target).parameters
    known = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
             and n not in ("self", *hidden)]
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(f'{c}=' for c in close)}?" if close else \
                f"; it takes {', '.join(known)}"
            raise UnexpectedArgumentError(f"{call}() got an unexpected keyword argument {name!r}{hint}")
