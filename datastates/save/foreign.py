"""Checkpoints made by other tools, read into states and written back out: `torch.save` files,
safetensors files (one, or shards with an index json), torch.distributed.checkpoint (DCP) directories
and Hugging Face Trainer `checkpoint-N/` directories.

Reading never runs pickle unless asked: `torch.save` files load with `weights_only=True` (plain
containers, tensors, numbers), and a file that needs more is refused with UnsupportedValueError unless
`allow_pickle`. A DCP directory's `.metadata` is itself a pickle, so DCP imports need `allow_pickle` too.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgumentError, NotFoundError, StorageFullError, UnsupportedValueError
from .tree import dtype_name

FORMATS = ("safetensors", "torch", "dcp")


@dataclass
class Foreign:
    """One checkpoint read from disk: the state, and what its files say of it."""

    path: Path
    kind: str
    state: Any
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    needs_pickle: bool = False


def _unreadable(path: Path, exc: BaseException, what: str = "torch.load") -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{path} is not a checkpoint {what} can read ({type(exc).__name__}: {str(exc)[:200]}); give a "
        "torch.save file, a safetensors file, a DCP directory or a Trainer checkpoint directory")


def _torch_load(path: Path, allow_pickle: bool) -> tuple[Any, bool]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True), False
    except Exception as exc:  # torch raises UnpicklingError (or others) for what weights_only refuses
        head = _head(path)
        if not head.startswith((b"PK\x03\x04", b"\x80")):
            # Neither a zip archive nor a pickle (a text file, an HTML error page): torch's message would suggest
            # weights_only=False, and full pickle would not read it either.
            raise InvalidArgumentError(
                f"{path} is not a torch.save file (it starts with {head!r}, neither a zip archive nor a pickle); "
                "give a torch.save file, a safetensors file, a DCP directory or a Trainer checkpoint directory"
            ) from None
        if not isinstance(exc, pickle.UnpicklingError):  # a damaged archive (a truncated download)
            raise _unreadable(path, exc) from None
        if not allow_pickle:
            raise UnsupportedValueError(
                f"{path} needs full pickle to load ({type(exc).__name__}: {str(exc)[:200]}); import it only if you "
                "trust it, with --allow-pickle (allow_pickle=True)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False), True
    except Exception as exc:  # torch's own error names what is wrong
        raise _unreadable(path, exc) from None


def _head(path: Path) -> bytes:
    """The first bytes of `path` (a torch.save file starts with a zip archive's or a pickle's)."""
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError:
        return b""


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # SafetensorError (a damaged header), OSError
        raise _unreadable(path, exc, "safetensors") from None


def _safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    index = next(iter(sorted(path.glob("*.safetensors.index.json"))), None)
    if index is not None:
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _unreadable(index, exc, "the safetensors index reader") from None
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    out: dict[str, torch.Tensor] = {}
    came_from: dict[str, str] = {}
    for name in files:
        for key, t in _load_safetensors(path / name).items():
            if key in out:  # two files of one tensor (model.safetensors beside model.fp16.safetensors): which one?
                raise InvalidArgumentError(
                    f"{path} holds the tensor {key!r} in two files, {came_from[key]} and {name}; import the one you "
                    "mean by its file path, or give the shards' index json (*.safetensors.index.json)")
            out[key], came_from[key] = t, name
    return out


def latest_numbers(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """The latest finite value of each number in a Trainer's log history (loss, learning_rate, eval_*)."""
    out: dict[str, float] = {}
    for entry in log_history:
        for k, v in entry.items():
            number = isinstance(v, int | float) and not isinstance(v, bool)
            if k not in ("step", "epoch") and number:
                try:
                    value = float(v)
                except OverflowError:  # an int past any float: no value to record, like NaN
                    continue
                if math.isfinite(value):
                    out[k] = value
    return out


def read(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Foreign:
    """Read one checkpoint (a file or a directory) into a state. Raises NotFoundError (nothing there or
    no known layout), UnsupportedValueError (pickle needed and not allowed)."""
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"{p} does not exist")
    if p.is_dir():
        if (p / "trainer_state.json").exists():
            return _read_hf(p, allow_pickle)
        if (p / ".metadata").exists():
            return _read_dcp(p, allow_pickle)
        if any(p.glob("*.safetensors")):
            return Foreign(p, "safetensors", _safetensors_dir(p))
        raise NotFoundError(f"{p} is a directory with no checkpoint layout this knows (a Trainer checkpoint-N/ "
                            "with trainer_state.json, a DCP directory with .metadata, or safetensors shards)")
    if p.suffix == ".safetensors":
        return Foreign(p, "safetensors", _load_safetensors(p))
    state, pickled = _torch_load(p, allow_pickle)
    return Foreign(p, "torch", state, needs_pickle=pickled)


def _trainer_state(path: Path) -> dict[str, Any]:
    """A Trainer's trainer_state.json: a JSON object whose global_step, when there, is a whole number and whose
    log_history, when there, is a list of objects. Raises InvalidArgumentError naming the file otherwise."""
    try:
        state = json.loads(path.read_bytes())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _unreadable(path, exc, "the trainer_state.json reader") from None
    step = state.get("global_step") if isinstance(state, dict) else None
    history = state.get("log_history", []) if isinstance(state, dict) else None
    if not isinstance(state, dict) or step is not None and (not isinstance(step, int) or isinstance(step, bool)) \
            or not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        raise InvalidArgumentError(
            f"{path} is not a Trainer's trainer_state.json (an object whose global_step is a whole number and "
            "whose log_history is a list of objects); fix or remove that file, or import the weights file alone")
    return state


def _read_hf(p: Path, allow_pickle: bool) -> Foreign:
    trainer_state = _trainer_state(p / "trainer_state.json")
    if any(p.glob("*.safetensors")):
        model = _safetensors_dir(p)
    elif (p / "pytorch_model.bin").exists():
        model, _ = _torch_load(p / "pytorch_model.bin", allow_pickle)
    else:
        raise NotFoundError(f"{p} has trainer_state.json but no model weights (model.safetensors, shards with an "
                            "index json, or pytorch_model.bin)")
    state: dict[str, Any] = {"model": model, "trainer_state": trainer_state}
    pickled = False
    for name, key in (("optimizer.pt", "optimizer"), ("scheduler.pt", "scheduler")):
        if (p / name).exists():
            state[key], used = _torch_load(p / name, allow_pickle)
            pickled |= used
    return Foreign(p, "hf", state, step=trainer_state.get("global_step"),
                   metrics=latest_numbers(trainer_state.get("log_history", [])), needs_pickle=pickled)


def _read_dcp(p: Path, allow_pickle: bool) -> Foreign:
    if not allow_pickle:
        raise UnsupportedValueError(f"{p} is a DCP checkpoint, whose .metadata file is a pickle; import it only if "
                                    "you trust it, with --allow-pickle (allow_pickle=True)")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, which DCP wraps errors in
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        try:
            dcp_to_torch_save(str(p), os.path.join(tmp, "state.pt"))
        except (Exception, CheckpointException) as exc:  # a damaged .metadata, a data file missing or cut short
            raise _unreadable(p, checkpoint_cause(exc), "torch.distributed.checkpoint") from None
        state, _ = _torch_load(Path(tmp) / "state.pt", allow_pickle=True)
    return Foreign(p, "dcp", state)


def step_of(f: Foreign, pattern: str | None) -> int | None:
    """The training step of a checkpoint: the first group of `pattern` matched in its path, else what its
    files say (a Trainer's global_step, a 'global_step' or 'step' entry), else the last number in its name."""
    if pattern:
        try:
            m = re.search(pattern, str(f.path))
        except re.error as exc:
            raise InvalidArgumentError(f"--step-from {pattern!r} is not a regex ({exc}); give one with one group, "
                                       r"e.g. 'step=(\d+)'") from None
        if m is None:
            raise InvalidArgumentError(f"--step-from {pattern!r} does not match {f.path}; give a regex with one "
                                       r"group, e.g. 'step=(\d+)'")
        found = m.group(1) if m.groups() else m.group(0)
        if found is None or not found.isdigit():
            raise InvalidArgumentError(f"--step-from {pattern!r} found {found!r} in {f.path}, not a step number; "
                                       r"its group must match digits only, e.g. 'step=(\d+)'")
        return int(found)
    if f.step is not None:
        return int(f.step)
    if isinstance(f.state, dict):
        for key in ("global_step", "step"):
            v = f.state.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                return v
    numbers = re.findall(r"\d+", f.path.name)
    return int(numbers[-1]) if numbers else None


def tensors_by_key(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state under its dotted key path (containers walked, other values left out)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(tensors_by_key(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(tensors_by_key(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _dcp_unfit(state: Any) -> str | None:
    """Where DCP would not hold `state` as it is, or None: DCP keeps a state as flat str key paths, so an empty dict
    is dropped and a non-str dict key comes back as a str (an optimizer's `state` keyed by parameter index, whose
    loaded `load_state_dict` then attaches the moments to no parameter). Found by the same flatten and unflatten
    DCP runs, compared with `state`."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    if not isinstance(state, dict):
        return f"the state is a {type(state).__name__}, and DCP holds a dict only"
    back = unflatten_state_dict(*flatten_state_dict(state))

    def walk(a: Any, b: Any, path: str) -> str | None:
        if isinstance(a, dict):
            if not isinstance(b, dict) or list(a) != list(b):
                for k in a:
                    if not isinstance(k, str):
                        where = path or "the state"
                        return f"{where} has the key {k!r} (a {type(k).__name__}), which DCP turns into a str"
                    if isinstance(b, dict) and k not in b:
                        return f"{f'{path}.{k}' if path else k} is an empty dict, which DCP drops"
                return f"{path or 'the state'} does not come back from DCP as it is"
            for k in a:
                found = walk(a[k], b[k], f"{path}.{k}" if path else str(k))
                if found:
                    return found
        elif isinstance(a, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                return f"{path} does not come back from DCP as it is"
            for i, (x, y) in enumerate(zip(a, b)):
                found = walk(x, y, f"{path}.{i}")
                if found:
                    return found
        return None

    return walk(state, back, "")


def checkpoint_cause(exc: BaseException) -> BaseException:
    """The error inside DCP's CheckpointException (whose text is every rank's traceback), else `exc` itself."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return inner[0]
    return exc


def _write_failed(target: Path, exc: BaseException) -> OSError:
    """A write of `target` that failed inside torch, safetensors or DCP (which raise RuntimeError, SafetensorError or
    a CheckpointException around the OSError), as an OSError: StorageFullError for a full disk or quota."""
    exc = checkpoint_cause(exc)
    text = str(exc)
    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) or any(
        s in text for s in ("No space left", "os error 28", "Disk quota exceeded", "os error 122"))
    if full:
        return StorageFullError(errno.ENOSPC, f"no space left while writing {target}; free space or raise the "
                                "quota, then retry (nothing was left behind)")
    if isinstance(exc, OSError):
        return exc
    return OSError(errno.EIO, f"writing {target} failed ({type(exc).__name__}: {text[:300]}); nothing was left "
                   "behind")


def write(state: Any, fmt: str, out: str | os.PathLike[str], *, version: str) -> Path:
    """Write `state` as `fmt` at `out` (a file for safetensors and torch, a directory for dcp), all or nothing: into
    a temporary name next to it, renamed into place once whole, so that a failed write (a full disk) leaves no
    partial file that a retry would find in the way. Raises InvalidArgumentError for an unknown format or an
    existing target (a file, or a directory that is not an empty one for dcp), UnsupportedValueError for a state
    the format cannot hold as it is (safetensors: a dtype it lacks; dcp: an empty dict, a key that is not a str),
    StorageFullError and OSError for a write that failed."""
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir()) or fmt != "dcp"):
        # (an empty directory only takes a dcp checkpoint, which is a directory; the others are files)
        raise InvalidArgumentError(f"{target} exists; give a new path (nothing is overwritten)")
    flat: dict[str, torch.Tensor] = {}
    if fmt == "safetensors":
        import safetensors.torch

        # safetensors refuses tensors that share memory: each key gets its own contiguous copy.
        flat = {k: t.detach().contiguous().clone() for k, t in tensors_by_key(state).items()}
        known = getattr(safetensors.torch, "_SIZE", None)  # the dtypes it writes (its KeyError names no key)
        for k, t in flat.items():
            if known is not None and t.dtype not in known:
                raise UnsupportedValueError(f"{k} is a {dtype_name(t.dtype)} tensor, which safetensors cannot hold; "
                                            "export with --format torch (Python: fmt='torch')")
    elif fmt == "dcp":
        unfit = _dcp_unfit(state)
        if unfit:
            raise UnsupportedValueError(f"{unfit}: the DCP checkpoint would not load back as this version; export "
                                        "with --format torch (Python: fmt='torch'), which holds the whole state")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, which DCP wraps errors in

    target = target.absolute()  # ('.' has no name to put a temp beside)
    into = target if fmt == "dcp" and target.is_dir() else None  # an empty directory: the temp goes inside it
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name of this call's own (mkstemp/mkdtemp): a fixed one met a temp a killed export left (refused as if the
    # target existed) and another export's temp, which the cleanup below then removed (a review).
    made: Path | None = None
    try:
        if fmt == "dcp":
            import torch.distributed.checkpoint as dcp

            made = Path(tempfile.mkdtemp(prefix=".export-", suffix=".tmp", dir=into or target.parent))
            dcp.save(state, checkpoint_id=str(made))
        else:
            fd, name = tempfile.mkstemp(prefix=".export-", suffix=".tmp", dir=target.parent)
            made = Path(name)
            with os.fdopen(fd, "wb") as f:
                if fmt == "torch":
                    torch.save(state, f)
            if fmt == "safetensors":
                from safetensors.torch import save_file

                save_file(flat, str(made), metadata={"datastates.version": version})
        if into is not None:  # the checkpoint's files into the empty directory given, then the temp goes
            for p in made.iterdir():
                os.rename(p, into / p.name)
            made.rmdir()
        elif fmt == "dcp":
            os.rename(made, target)  # onto a missing directory only (a non-empty one made meanwhile: ENOTEMPTY)
        else:
            os.link(made, target)  # never over a file made meanwhile
            made.unlink()
    except (Exception, CheckpointException) as exc:
        if made is not None and made.is_dir():
            shutil.rmtree(made, ignore_errors=True)
        elif made is not None:
            made.unlink(missing_ok=True)
        if isinstance(exc, FileExistsError) or isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY,
                                                                                          errno.EEXIST):
            raise InvalidArgumentError(f"{target} exists; give a new path (nothing is overwritten)") from None
        raise _write_failed(target, exc) from exc
    return target
