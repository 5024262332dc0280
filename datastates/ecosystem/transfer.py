"""Moving checkpoints in and out: `import_checkpoints` turns a run's files made by torch.save,
safetensors, DCP or the Hugging Face Trainer into one branch of versions in step order; `export` writes a
version out as safetensors, a torch.save file or a DCP directory.

    import datastates as ds
    store = ds.Store.open("runs/store")
    report = ds.import_checkpoints(store, ["ckpts/step-100.pt", "ckpts/step-200.pt"], branch="old-run")
    ds.export(store, "old-run", "safetensors", "out/model.safetensors")

Imported versions chain: each is the parent of the next, in step order, so `log`, `diff` and `history`
work across the old run, and unchanged tensors cost nothing (dedup across checkpoints).
"""

from __future__ import annotations

import glob as globlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.progress import bar
from ..errors import InvalidArgumentError, NotFoundError, UnsupportedValueError
from ..meta.versions import Version
from ..save.foreign import FORMATS, Foreign, read, step_of, write
from ..save.request import save_request
from ..save.tree import flatten
from ..store import Store


@dataclass
class ImportReport:
    """What an import did: the versions in step order, and the bytes dedup saved."""

    versions: list[Version] = field(default_factory=list)
    bytes_total: int = 0
    bytes_new: int = 0

    @property
    def bytes_saved(self) -> int:
        return self.bytes_total - self.bytes_new


def _expand(paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str], pattern: str | None) -> list[Path]:
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]  # one path, not its characters (a str is an iterable of paths of one letter)
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if pattern is not None and p.is_dir() and not (p / "trainer_state.json").exists() \
                and not (p / ".metadata").exists():
            out += sorted(Path(x) for x in globlib.glob(str(p / pattern)))
        else:
            out.append(p)
    if not out:
        raise NotFoundError(f"no checkpoint matched {list(map(str, paths))} (glob {pattern!r})")
    return out


def import_checkpoints(store: Store, paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str], *,
                       branch: str = "imported",
                       glob: str | None = None, step_from: str | None = None,
                       allow_pickle: bool = False) -> ImportReport:
    """Import checkpoints (files or directories, or one path; with `glob`, directories are searched with it) as
    versions of `branch`, oldest step first, each the parent of the next. The step comes from `step_from` (a regex
    with one group, matched in the path), else from the files, else the last number in the name.
    Raises NotFoundError, UnsupportedValueError (pickle needed without allow_pickle: nothing is imported),
    InvalidArgumentError. All files are read before anything is saved, so a refused file changes nothing."""
    files = _expand(paths, glob)
    read_: list[Foreign] = []
    with bar(len(files), "read", unit="checkpoint") as b:
        for path in files:
            read_.append(read(path, allow_pickle=allow_pickle))
            b.update(1)
    for f in read_:  # what torch.load reads the store may refuse (a sparse tensor): find it before any save
        # A value weights_only reads but the store keeps only as a pickle (a set, a complex number) is kept so
        # when the caller allowed pickle, as the refusal's hint says.
        f.needs_pickle |= allow_pickle
        try:
            flatten(f.state, allow_pickle=f.needs_pickle)
        except UnsupportedValueError as exc:
            hint = "" if allow_pickle or "pickle" not in str(exc) else (
                " (to keep it as a pickle, which loading it then needs allowed too: import with --allow-pickle, "
                "Python allow_pickle=True)")
            raise UnsupportedValueError(f"{f.path}: {exc}; nothing was imported{hint}") from None
    steps = [step_of(f, step_from) for f in read_]
    # (a file name that is not UTF-8 has lone surrogates in Python, which a message may not hold)
    messages = [f"import {f.kind}: {os.fsencode(f.path.name).decode('utf-8', 'replace')}" for f in read_]
    for f, step, message in zip(read_, steps, messages):  # what the saves would refuse, before the first one
        try:
            save_request(store.resolve, branch=branch, parents=None, step=step, epoch=None, hparams=None,
                         metrics=f.metrics or None, message=message, fork_of=None, explore=None)
        except (InvalidArgumentError, UnsupportedValueError) as exc:
            raise type(exc)(f"{f.path}: {exc}; nothing was imported") from None
    order = sorted(range(len(read_)), key=lambda i: (steps[i] is None, steps[i] or 0, str(read_[i].path)))
    report = ImportReport()
    with bar(len(order), "import", unit="checkpoint") as b:
        for i in order:
            f = read_[i]
            v = store.save(f.state, branch=branch, step=steps[i], metrics=f.metrics or None,
                           message=messages[i], allow_pickle=f.needs_pickle)
            report.versions.append(v)
            report.bytes_total += v.bytes_total
            report.bytes_new += v.bytes_new
            b.update(1)
    return report


def export(store: Store, ref: Any, fmt: str, out: str | os.PathLike[str], *, allow_pickle: bool = False,
           rank: int | None = None) -> Path:
    """Write version `ref` as `fmt` ("safetensors", "torch" or "dcp") at `out`; return the path.
    safetensors holds the tensors under their key paths (other values are left out); torch holds the whole
    state, dcp a state whose dict keys are str and whose dicts are not empty (others are refused). A version
    saved by several ranks (each rank's own entries, and replicated ones) is written
    one rank at a time: `rank` (CLI: `--rank`) names which; without it, each rank of a job of that world size
    exports its own, and elsewhere the export is refused (a world-size-1 load gives only the replicated entries:
    the file would silently lack every rank's own). A version holding values saved
    with pickle is refused unless `allow_pickle` (CLI: `--allow-pickle`): reading them runs code. Raises
    NotFoundError (ref; a rank it was not saved by), InvalidArgumentError (unknown format, existing target, a
    version of several ranks without `rank`), UnsupportedValueError (pickled values, without `allow_pickle`; a
    state the format cannot hold as it is)."""
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    v = store.version(ref)
    from ..dcp import saved_state  # (imports torch.distributed.checkpoint: only when exporting)

    try:
        dcp_state = saved_state(store, v, allow_pickle=allow_pickle)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(f"{exc}; to export it, add --allow-pickle (Python: allow_pickle=True)") from None
    if dcp_state is not None:  # saved by dcp.save: its state, not DCP's items t0, t1... (whatever the world size)
        return write(dcp_state, fmt, out, version=v.id)
    if rank is None and v.world_size > 1 and store.comm.size == v.world_size:
        rank = store.comm.rank  # inside a job of that size: each rank exports its own, as its load gives
    if rank is None and v.world_size > 1:
        raise InvalidArgumentError(
            f"version {v.short} was saved by {v.world_size} ranks, each with entries of its own; export one rank at "
            f"a time: add --rank R on the command line, rank=R in Python (R in 0..{v.world_size - 1})")
    return write(store.load(v, allow_pickle=allow_pickle, rank=rank), fmt, out, version=v.id)
