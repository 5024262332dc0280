"""The state tree: how a nested training state becomes rows of tensors plus a JSON skeleton.

`flatten` walks dicts, lists, tuples and objects with `state_dict()` and
returns a JSON-safe skeleton plus one `TensorEntry` per tensor; `unflatten`
rebuilds the same container types around loaded tensors. Pickle is used only
when the caller asked for it explicitly, on both sides.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import functools
import itertools
import operator
import pickle
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import DataStatesError, InvalidArgumentError, UnsupportedValueError

if TYPE_CHECKING:
    from .stats import Partial

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called `name`; UnsupportedValueError if this torch lacks it."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise UnsupportedValueError(f"dtype {name!r} is unknown to torch {torch.__version__}; upgrade torch") from None


@dataclass(slots=True)
class TensorEntry:
    """One manifest row while saving. Slotted: thousands are made per save, and each object the collector
    tracks costs it time."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    kind: str
    """'tensor' (own bytes), 'storage' (a shared storage's bytes), 'alias' (same tensor as `base`),
    or 'view' (a view into the storage row `base`)."""
    source: torch.Tensor | None = None
    """For 'tensor' and 'storage': the tensor whose bytes are stored."""
    base: int = -1
    offset: int = 0
    """'view': offset into the base storage, in elements of `dtype`."""
    stride: tuple[int, ...] = ()
    nbytes: int = 0
    """Bytes stored for this row (0 for 'alias' and 'view')."""
    chunks: list[bytes] = field(default_factory=list)
    stats: dict[str, float | int | None] = field(default_factory=dict)
    sig: tuple[object, ...] | None = None
    """For 'tensor' rows: (data_ptr, version counter, dtype, shape, stride, device, storage) at capture, where
    storage is a `StorageWeakRef` of the tensor's storage: equal only for the very same storage (a weak reference
    keeps the storage's record, not its bytes, so no other storage can take its address while it is held). The
    address alone is not enough: a tensor freed and another allocated in its place, at the same version, had
    the same signature, and `reuse_unchanged` stored the old one's chunks for the new one."""
    piece_stats: list[Partial] | None = None
    """For a 'tensor' row of several chunks, once saved: each chunk's own `stats.Partial`, in chunk order (never
    changed once set), so that a later save finding a chunk unchanged need not summarize it again."""


Rows = list[TensorEntry] | Callable[[], list[TensorEntry]]
"""A flatten's rows, or a function that makes them (`FlattenCache.flatten_kept` with `defer`)."""


def _key_json(k: Any, path: str) -> Any:
    if k is None or isinstance(k, (str, bool, int, float)):
        return k
    raise UnsupportedValueError(
        f"{path} has a dict key of type {type(k).__name__}; keys must be str, int, float, bool or None")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's logical bytes (a copy only if it is not contiguous)."""
    # The common case in as few torch calls as possible (each costs ~1.2 us on the 2-core VM, and a state
    # of small tensors makes one view per tensor per save): a detach only for a tensor that needs grad, no
    # reshape of a tensor already flat.
    dim = t.dim()
    if dim == 1 and t.stride(0) == 1 or dim != 1 and t.is_contiguous():  # (a 0-d tensor is contiguous)
        flat = t.detach() if t.requires_grad else t
        if dim != 1:
            flat = flat.view(-1)  # may keep an odd stride (one element, or none): the general path below
        if flat.stride(0) == 1:
            return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)  # strides of empty tensors can be anything
    flat = t.detach().reshape(-1)
    if flat.stride(-1) != 1:
        # A strided 1-d view survives reshape; one element counts as contiguous whatever its stride.
        flat = flat.as_strided((1,), (1,)) if flat.numel() == 1 else flat.contiguous()
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def kept_layout(t: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides a 'tensor' row records: those of a layout that covers its elements densely but not in row-major
    order (channels_last, a transpose), which a load gives back, as `torch.load` does (a fused optimizer pairs a
    parameter's elements with its state's by memory order: a channels_last parameter with row-major state moved
    the weights of a resumed run far from a torch.load resume). Empty for row-major tensors (the row's bytes
    are in that order, whatever the layout), and for layouts with gaps or overlaps (a stepped slice, an
    expanded tensor), whose values come back row-major."""
    if len(shape) < 2 or t.is_contiguous() or 0 in shape:
        return ()
    expect = 1
    for st, n in sorted((st, n) for n, st in zip(shape, stride) if n != 1):
        if st != expect:
            return ()
        expect *= n
    return stride


def _raw_bytes(address: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the `nbytes` host bytes at `address` that owns nothing and keeps nothing alive
    (a ctypes array at that address, wrapped without a copy): valid only while whatever owns those bytes is."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=torch.uint8)


MAX_DEPTH = 200
"""Deepest nesting of containers a state may have (real training states nest a few levels)."""


def key_patterns(keys: Any, what: str = "keys") -> list[str] | None:
    """`keys` as a list of key paths or globs: None stays None, one str is one pattern. Raises
    InvalidArgumentError for anything else (an int, a list holding a non-str or an empty str)."""
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    try:
        out = list(keys)
    except TypeError:
        raise InvalidArgumentError(f"{what}={keys!r} is a {type(keys).__name__}; give a key path or a list of "
                                   "them, e.g. ['model.fc.weight', 'optim.*']") from None
    for k in out:
        if not isinstance(k, str) or not k:
            raise InvalidArgumentError(f"{what} holds {k!r}; each must be a non-empty key path such as "
                                       "'model.fc.weight' (a glob like 'model.*' works too)")
    return out


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if t.is_nested:
        raise UnsupportedValueError(f"{path} is a nested tensor ({t.layout}); save its parts instead, "
                                    "e.g. list(t.unbind())")
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"{path} is a {t.layout} tensor; convert it with .to_dense() before saving")
    if t.device.type == "meta":
        raise UnsupportedValueError(f"{path} is a meta tensor and has no data; materialize it before saving")
    if t.is_quantized:
        # (allow_pickle does not help: tensors are never pickled, so say only what does)
        raise UnsupportedValueError(f"{path} is a quantized tensor; save t.dequantize(), or its int_repr() with "
                                    "its q_scale() and q_zero_point()")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedValueError(f"{path} is a tensor subclass {type(t).__name__}; save a plain tensor")


class Flattener:
    """Walks one state; see module docstring."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self.entries: list[TensorEntry] = []
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._paths: set[str] = set()

    def flatten(self, state: Any) -> dict[str, Any]:
        tree = self._node(state, "")
        self._assign_rows()
        return tree

    def _node(self, v: Any, path: str, depth: int = 0) -> dict[str, Any]:
        if depth > MAX_DEPTH:  # refused before Python's recursion limit would end the save untyped
            raise UnsupportedValueError(f"the state nests containers deeper than {MAX_DEPTH} levels (at "
                                        f"{path[:80]}...); flatten it, e.g. into a dict of key paths")
        if isinstance(v, torch.Tensor):
            _check_tensor(v, path or "<state>")
            if path in self._paths:
                raise UnsupportedValueError(f"two values map to the key path {path!r}; rename one of the keys")
            self._paths.add(path)
            node: dict[str, Any] = {"t": "tensor", "i": len(self._tensors)}
            # `type is`, not isinstance: Parameter's metaclass makes isinstance ~15 us a call, and
            # _check_tensor admits exactly Tensor and Parameter.
            if type(v) is torch.nn.Parameter:
                node["param"] = bool(v.requires_grad)
            elif v.requires_grad:
                node["grad"] = True  # a learned plain tensor (SAC's log_alpha) must come back trainable
            if v.is_conj() or v.is_neg():
                # Lazy conjugate/negative views hold their bits apart from the bytes: save the values.
                v = v.detach().resolve_conj().resolve_neg()
            self._tensors.append((path, v))
            return node
        # Exact types, here and below: a subclass (a str Enum, np.str_, a MaskedArray, np.matrix) saved as its
        # base would load as the base, silently changed; it needs pickle, as with torch.load(weights_only=True).
        if v is None or type(v) in _PLAIN:
            return {"t": "v", "v": v}
        if type(v) in (bytes, bytearray):
            node = {"t": "bytes", "v": base64.b64encode(v).decode()}
            return {**node, "ba": True} if type(v) is bytearray else node
        if isinstance(v, torch.dtype):
            return {"t": "dtype", "v": dtype_name(v)}
        if isinstance(v, torch.device):
            return {"t": "device", "v": str(v)}
        if isinstance(v, torch.Size):
            return {"t": "size", "v": list(v)}
        if type(v) is np.ndarray and v.dtype.kind in "biufc" and v.dtype.isnative:
            # Not np.ascontiguousarray, which makes a 0-d array 1-d.
            node = self._node(torch.from_numpy(v if v.flags.c_contiguous else v.copy(order="C")), path)
            return {**node, "np": True}
        if isinstance(v, np.generic) and v.dtype.kind in "biufc":
            return {"t": "npscalar", "dtype": v.dtype.str, "v": base64.b64encode(v.tobytes()).decode()}
        if isinstance(v, dict) and type(v) in (dict, OrderedDict, Counter):
            keys = [_key_json(k, path) for k in v]
            vals = [self._node(x, f"{path}.{k}" if path else str(k), depth + 1) for k, x in v.items()]
            node = {"t": "odict" if type(v) is OrderedDict else "dict", "k": keys, "v": vals}
            meta = _module_versions(v)
            if meta is not None:
                node["meta"] = meta
            # A Counter (MultiStepLR's milestones) is a dict that loads back as a Counter, as torch.load's does.
            return {**node, "cls": "Counter"} if type(v) is Counter else node
        if type(v) in (list, tuple):
            vals = [self._node(x, f"{path}.{i}" if path else str(i), depth + 1) for i, x in enumerate(v)]
            return {"t": type(v).__name__, "v": vals}
        sd = getattr(v, "state_dict", None)
        if callable(sd) and not isinstance(v, type):
            try:
                state = _state_of(v)
            except _AS_RAISED:
                raise
            except Exception as exc:  # the caller's code: said with the key it was saving, as a pickle error is
                raise _state_dict_error(path, v, exc) from exc
            node = self._node(state, path, depth + 1)
            if isinstance(v, torch.nn.Module):
                _as_detached(node)
            return {**node, "from": _class_name(v)}
        if self.allow_pickle:
            try:
                data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise UnsupportedValueError(
                    f"{path or '<state>'} ({type(v).__name__}) cannot be pickled: {exc}") from exc
            return {"t": "pickle", "v": base64.b64encode(data).decode()}
        raise UnsupportedValueError(
            f"{path or '<state>'} is a {type(v).__module__}.{type(v).__qualname__}, which needs pickle; "
            "store plain values (numbers, strings, lists, dicts, tensors) or pass allow_pickle=True to save and load"
        )

    def _assign_rows(self) -> None:
        # Tensors sharing a storage (tied weights, views) must come back sharing it.
        # One pass of torch calls per tensor (thousands of small tensors make each call count).
        groups: dict[tuple[Any, int], list[int]] = {}
        keys: list[tuple[Any, int] | None] = []
        for i, (_, t) in enumerate(self._tensors):
            key = None
            if t.numel():
                storage = t.untyped_storage()
                if storage.nbytes():
                    key = (t.device, storage.data_ptr())
                    groups.setdefault(key, []).append(i)
            keys.append(key)
        row_of: dict[int, int] = {}
        for i, (path, t) in enumerate(self._tensors):
            if i in row_of:
                continue
            key = keys[i]
            members = groups[key] if key is not None else [i]
            if len(members) == 1:
                row_of[i] = self._add_tensor(path, t)
                continue
            sig = {(m_t.dtype, m_t.storage_offset(), tuple(m_t.shape), m_t.stride())
                   for m_t in (self._tensors[m][1] for m in members)}
            if len(sig) == 1:
                row_of[i] = self._add_tensor(path, t)
                for m in members[1:]:
                    mp, mt = self._tensors[m]
                    row_of[m] = len(self.entries)
                    self.entries.append(TensorEntry(mp, mt.dtype, tuple(mt.shape), _device_name(mt.device), "alias",
                                                    base=row_of[i]))
                continue
            storage = t.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            srow = len(self.entries)
            self.entries.append(TensorEntry(f"~storage/{srow}", torch.uint8, (storage.nbytes(),),
                                            _device_name(t.device), "storage", source=whole,
                                            nbytes=storage.nbytes()))
            for m in members:
                mp, mt = self._tensors[m]
                row_of[m] = len(self.entries)
                self.entries.append(TensorEntry(mp, mt.dtype, tuple(mt.shape), _device_name(mt.device), "view",
                                                base=srow, offset=int(mt.storage_offset()),
                                                stride=tuple(mt.stride())))
        self.tensor_rows = [row_of[i] for i in range(len(self._tensors))]

    def _add_tensor(self, path: str, t: torch.Tensor) -> int:
        src = _bytes_of(t)
        dev, shape, stride = _device_name(t.device), tuple(t.shape), tuple(t.stride())
        sig = (t.data_ptr(), t._version, t.dtype, shape, stride, dev, StorageWeakRef(t.untyped_storage()))
        self.entries.append(TensorEntry(path, t.dtype, shape, dev, "tensor", source=src, nbytes=src.numel(),
                                        sig=sig, stride=kept_layout(t, shape, stride)))
        return len(self.entries) - 1


@functools.cache
def _device_name(device: torch.device) -> str:
    """`str(device)`, one string object per device: every row of a state of thousands of tensors keeps its
    device's name, and the first save of such a state peaks in memory at its end (issue 13's bound)."""
    return str(device)


def flatten(state: Any, allow_pickle: bool = False) -> tuple[dict[str, Any], list[TensorEntry]]:
    """Split `state` into a JSON-safe skeleton and tensor rows.

    Raises UnsupportedValueError naming the key path of the first value that
    cannot be stored without pickle (unless `allow_pickle`).
    """
    f = Flattener(allow_pickle)
    tree = f.flatten(state)
    _renumber(tree, f.tensor_rows)
    return tree, f.entries


def _state_of(obj: Any) -> Any:
    """What `flatten` saves of an object with a `state_dict()`. For a module, its parameters and buffers
    themselves (`keep_vars=True`), not the detached tensors `state_dict()` makes anew on every call: the same
    objects from save to save let the flatten cache serve a training loop's saves of the module. (A state of
    8,000 small parameters saved as a module blocked `save_async` ~285 ms against ~75 ms for the same tensors
    kept, on the 2-core VM.) An override of `state_dict` that takes no `keep_vars` is called plainly."""
    if isinstance(obj, torch.nn.Module):
        try:
            return obj.state_dict(keep_vars=True)
        except TypeError as exc:
            if "keep_vars" not in str(exc):
                raise
    return obj.state_dict()


_AS_RAISED: tuple[type[BaseException], ...] = (
    DataStatesError, MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))
"""What a `state_dict()` raises that stays what it is: our own errors (a store closed meanwhile) and running out of
memory (a full state dict gathered on one rank) say something other than "this value cannot be saved"."""


def _state_dict_error(path: str, obj: Any, exc: Exception) -> UnsupportedValueError:
    """The error for an object whose `state_dict()` raised `exc` while saving it at key path `path`."""
    return UnsupportedValueError(f"{path or '<state>'} ({type(obj).__name__}): its state_dict() raised "
                                 f"{type(exc).__name__}: {exc}; nothing was saved")


class _StateDictRaised(Exception):
    """A `state_dict()` that raised in `_walk`, on its way up to `_walk_state`: each container on the way puts in
    its key, so the key path is made only for the error and a walk that succeeds pays nothing for it."""

    def __init__(self, obj: Any, exc: Exception) -> None:
        super().__init__()
        self.obj, self.exc = obj, exc
        self.keys: list[str] = []
        """The key path's segments, innermost first."""


def _walk_state(v: Any, node: dict[str, Any], out: list[Any], plain: set[int] | None = None) -> dict[str, Any] | None:
    """`_walk`; raises UnsupportedValueError naming the key path (the cause chained) for a `state_dict()` that
    raised, as `flatten` does."""
    try:
        return _walk(v, node, out, plain)
    except _StateDictRaised as raised:
        raise _state_dict_error(".".join(reversed(raised.keys)), raised.obj, raised.exc) from raised.exc


def _as_detached(node: dict[str, Any]) -> None:
    """Drop the parameter and requires-grad marks of the tensors under `node` (a module's state): they are
    saved, and loaded back, as `state_dict()` gives them, detached."""
    if node["t"] == "tensor":
        node.pop("param", None)
        node.pop("grad", None)
    elif node["t"] in ("dict", "odict", "list", "tuple"):
        for child in node["v"]:
            _as_detached(child)


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


_CACHEABLE = frozenset(("tensor", "v", "dict", "odict", "list", "tuple"))
_PLAIN = (type(None), bool, str, int, float)


_SIGNATURE: tuple[Callable[[torch.Tensor], Any], ...] = (
    type, torch.Tensor.data_ptr, operator.attrgetter("dtype"), operator.attrgetter("shape"), torch.Tensor.stride,
    torch.Tensor.storage_offset, operator.attrgetter("requires_grad"), operator.attrgetter("device"))
"""What must not change for a tensor's manifest row and byte view to be reused (its values may): one getter per
field, applied column by column (`map` over all tensors per field: 1.7 ms less per 8,000 tensors than a tuple
per tensor)."""


def _signature(tensors: list[torch.Tensor]) -> list[list[Any]]:
    return [list(map(f, tensors)) for f in _SIGNATURE]


def _walk(v: Any, node: dict[str, Any], out: list[Any], plain: set[int] | None = None) -> dict[str, Any] | None:
    """`v` against the skeleton `node` of an earlier flatten: the skeleton of `v` (reusing `node` and its
    unchanged parts), its tensors appended to `out` in flatten's order; None if `v` has another structure
    (other container types or keys, a tensor where there was none, a value flatten encodes otherwise). The
    containers of `node` whose ids are in `plain` held no tensor: theirs may change shape too (a log that grows
    from save to save), as long as they still hold none."""
    if "from" in node:  # an object saved through its `state_dict()`: walked through it, as `flatten` does
        if _class_name(v) != node["from"]:
            return None
        try:
            v = _state_of(v)
        except _AS_RAISED:
            raise
        except Exception as exc:
            raise _StateDictRaised(v, exc) from exc
    new = _walk_node(v, node, out, plain)
    if new is None and plain is not None and id(node) in plain:
        # Compared first, made anew only when changed: an AdamW's state dict with 8,000 parameter indices took
        # 3.0 ms of CPU to compare and 12.2 ms to flatten again (best of 20).
        return _plain_again(v, node)
    return new


def _module_versions(v: dict[Any, Any]) -> list[list[Any]] | None:
    """A `state_dict()`'s `_metadata` (each submodule's `{"version": n}`), as [prefix, values] pairs to keep with
    its node, when it is there and plain: `load_state_dict` reads it to convert states saved by older module
    versions, and without it took a current checkpoint for an old one (a quantization observer's `eps` reset).
    None otherwise (a metadata of other values is left out, as before)."""
    meta = getattr(v, "_metadata", None)
    if not isinstance(meta, dict) or type(meta) not in (dict, OrderedDict):
        return None
    out = []
    for k, values in meta.items():
        if type(k) is not str or type(values) is not dict or not all(
                type(x) is str and type(y) in (int, float, str, bool, type(None)) for x, y in values.items()):
            return None
        out.append([k, values])
    return out


def _walk_node(v: Any, node: dict[str, Any], out: list[Any], plain: set[int] | None) -> dict[str, Any] | None:
    """`_walk` of `v` (an object's state already taken) against `node` itself."""
    t = node["t"]
    if t == "tensor":
        if not isinstance(v, torch.Tensor):
            return None
        out.append(v)
        return node
    if t == "v":
        if type(v) not in _PLAIN:
            return None
        return node if type(v) is type(node["v"]) and v == node["v"] else {"t": "v", "v": v}
    if t in ("dict", "odict"):
        if type(v) is not (dict if t == "dict" else OrderedDict) or "cls" in node or len(v) != len(node["k"]):
            return None  # ("cls": a Counter, never walked: a dict in its place must not load as one)
        if t == "odict" and _module_versions(v) != node.get("meta"):
            return None
        for k, k0 in zip(v, node["k"]):
            if k is not k0 and (type(k) is not type(k0) or k != k0):
                return None
        vals = list(v.values())
    elif type(v).__name__ == t and type(v) in (list, tuple):
        if len(v) != len(node["v"]):
            return None
        vals = v
    else:
        return None
    children = []
    changed = False
    try:
        for x, child in zip(vals, node["v"]):
            new = _walk(x, child, out, plain)
            if new is None:
                return None
            changed = changed or new is not child
            children.append(new)
    except _StateDictRaised as raised:
        at = len(children)  # the child that raised (no index kept while walking: this is the error's cost only)
        raised.keys.append(str(list(v)[at]) if t in ("dict", "odict") else str(at))
        raise
    return {**node, "v": children} if changed else node


def _plain_again(v: Any, node: dict[str, Any]) -> dict[str, Any] | None:
    """The skeleton of `v` where `node`, a container without tensors, was: `node` itself if unchanged, a new one
    if `v` still holds no tensor and nothing a kept flatten cannot hold, else None."""
    f = Flattener()
    try:
        new = f._node(v, "")
    except UnsupportedValueError:
        return None  # the full flatten says where, as it would have
    if f._tensors or not _cacheable(new):
        return None
    if "from" in node:
        new = {**new, "from": node["from"]}
    return node if new == node else new


def _plain_containers(node: dict[str, Any], out: set[int]) -> bool:
    """Whether `node` holds a tensor; adds to `out` the id of each container under it (itself included) that
    holds none."""
    if node["t"] == "tensor":
        return True
    if node["t"] not in ("dict", "odict", "list", "tuple"):
        return False
    holds = False
    for child in node["v"]:
        holds = _plain_containers(child, out) or holds
    if not holds:
        out.add(id(node))
    return holds


def _cacheable(node: dict[str, Any]) -> bool:
    if node["t"] not in _CACHEABLE or "np" in node:
        return False
    return node["t"] in ("tensor", "v") or all(_cacheable(c) for c in node["v"])


class _Flattened:
    """One flatten kept for reuse: the skeleton, a template per row, and per tensor the signature that must
    still hold (`_SIGNATURE`), and a weak reference to it. Holds the rows' byte views (so the storages they
    view) only while every tensor object is alive: the first one to die drops the whole record.

    With `on_death` None (a state whose tensors are new objects on every save: `model.state_dict()` detaches
    anew on every call), the record holds no tensor and no byte view, nothing that keeps the state's memory:
    a state of other objects with the same signatures (so the same memory, the same aliasing) reuses its
    skeleton and rows, each save making its rows' byte views afresh."""

    def __init__(self, tree: dict[str, Any], f: Flattener, tensors: list[torch.Tensor],
                 on_death: Callable[[Any], None] | None) -> None:
        self.tree = tree
        self.encoded: dict[str, Any] = {}
        """What the manifest encoder derives from the rows' constant fields (key, dtype, shape, ...) and the
        skeleton: the same for every save this record serves, whatever the rows' sources (see `manifest.encode`)."""
        self.refs = [weakref.ref(t, on_death) for t in tensors] if on_death is not None else None
        self.count = len(tensors)
        self.complex = any(t.is_complex() for t in tensors)
        """Whether a tensor is complex: only those can be lazy conjugate or negative views, which a flatten
        saves through a resolved copy (a state of new objects is checked for them)."""
        self.plain: set[int] = set()
        """Ids of the skeleton's containers without tensors (`_walk`); the record holds `tree`, so they stay
        its nodes'."""
        _plain_containers(tree, self.plain)
        self.sigs = _signature(tensors)
        # Each tensor's shape as its row holds it (a tuple, equal to the tensor's torch.Size), not one more object
        # per tensor for as long as the record.
        self.sigs[3] = [f.entries[row].shape for row in f.tensor_rows]
        tensor_of = {row: i for i, row in enumerate(f.tensor_rows)}
        # The rows as columns, so a reuse builds its fresh rows with one `map` (no Python loop per row).
        self.columns: list[list[Any]] = [[], [], [], [], [], [], [], [], [], []]
        self.copied: list[tuple[int, int]] = []
        """(row, tensor) of the 'tensor' rows whose bytes are a contiguous copy, made again on every save."""
        self.signed: list[int] = []
        """The 'tensor' rows (each gets a fresh `sig`), and the tensor each one stores, in `sig_of`."""
        self.sig_of: list[int] = []
        # A stored tensor's address, strides and storage reference as its row's signature holds them (equal to the
        # getters' results), not one more object each for as long as the record.
        ptrs, strides, storages = self.sigs[1], self.sigs[4], []
        for row, e in enumerate(f.entries):
            src = e.source
            if e.kind == "tensor":
                assert src is not None and e.sig is not None
                i = tensor_of[row]
                ptrs[i], strides[i] = e.sig[0], e.sig[4]
                storages.append(e.sig[6])
                t = tensors[i]
                # A byte view is reused only if it reads the tensor's own memory (not a contiguous copy); an
                # empty one reads nothing.
                if self.refs is None or (src.numel() and src.data_ptr() != t.data_ptr()):
                    src = None
                    self.copied.append((row, i))
                self.signed.append(row)
                self.sig_of.append(i)
            elif e.kind != "storage":
                src = None
            for col, v in zip(self.columns, (e.key, e.dtype, e.shape, e.device, e.kind, src, e.base, e.offset,
                                             e.stride, e.nbytes)):
                col.append(v)
        self._signed_keys = [self.columns[0][row] for row in self.signed]
        signed = set(self.signed)
        self._unsigned = [row for row in range(len(self.columns[0])) if row not in signed]
        self._sig_cols = [[self.sigs[1][i] for i in self.sig_of]] + [
            [self.columns[c][row] for row in self.signed] for c in (1, 2)] + [
            [self.sigs[4][i] for i in self.sig_of], [self.columns[3][row] for row in self.signed], storages]
        self.own_sources = not self.copied
        """Every stored row reads through a byte view this record keeps (no contiguous copy made per save):
        each save's rows have the very same sources, so `plans` may hold them."""
        self.plans: Layouts | None = Layouts(
            frozenset(d for d, src in zip(self.columns[3], self.columns[5]) if src is not None))
        """What later steps derive from this flatten alone and keep with it (`capture`'s slot layouts):
        valid for every save this record serves, dropped with it. For a record of other objects every save, the
        layouts without their byte views, if every stored byte is on the host (None otherwise)."""
        if self.refs is None:
            stored = frozenset(self.columns[3][row] for row in self.signed)
            # A stored row of another kind ('storage') makes no record of new objects (`FlattenCache`).
            self.plans = Layouts(stored, unbound=True, raw=self._raw_sources(tensors)) if stored <= {"cpu"} else None

    def _raw_sources(self, tensors: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
        """For a record of other tensor objects every save, on the host: per row, a byte view of a stored row's
        memory made from its address (`_raw_bytes`: it owns and keeps nothing), None for a row stored by none;
        None if a stored tensor is not contiguous (its bytes are a copy, made per save). A state that matches
        this record has every tensor at the same address, in the same shape and strides (`_SIGNATURE`), so
        these views read its bytes for as long as its tensors are alive: a capture that holds them copies
        through views made once, not a byte view per tensor per save (`capture`, `Layouts.addressed`)."""
        raw: list[torch.Tensor | None] = [None] * len(self.columns[0])
        for row, i in zip(self.signed, self.sig_of):
            t = tensors[i]
            if not t.is_contiguous():
                return None
            raw[row] = _raw_bytes(t.data_ptr(), self.columns[9][row])
        return raw

    def reuse(self, state: Any, defer: bool = False, address_key: Any = None,
              committed: Mapping[str, TensorEntry] | None = None
              ) -> tuple[dict[str, Any], Rows, list[torch.Tensor] | None] | None:
        """The skeleton and fresh rows of `state` if it holds the same tensors as this flatten, in the same
        structure, each with the same signature, and the tensors the capture must hold (see below); None
        otherwise. With `defer`, the rows may come as a function that makes them (when none needs a copy of its
        tensor now): building 8,000 rows took ~5 ms of a 50 ms `save_async`, and the background can do it.
        Version counters are read here either way.

        With `address_key` (the capture's layout key), a record of other objects every save whose layouts have an
        addressed layout under that key (`Layouts.addressed`) gives rows without byte views, made later, and the
        state's tensors: the capture copies (or borrows) through the addressed layout, and the job must hold them
        while their bytes are read. The bytes are read where this save's tensors are, as the signature check
        confirmed.

        With `committed` (rows by key; rows given with no `defer`), a tensor whose row there has the signature
        its fresh row would have gets that row itself, not a new one (`_rows`)."""
        tensors: list[torch.Tensor] = []
        tree = _walk_state(state, self.tree, tensors, self.plain)
        if tree is None or len(tensors) != self.count:
            return None
        if self.refs is not None:
            if not all(map(operator.is_, map(_deref, self.refs), tensors)):
                return None
        elif not self._same_kind(tensors):
            return None
        if not all(list(map(f, tensors)) == col for f, col in zip(_SIGNATURE, self.sigs)):
            return None
        # Now, not when the rows are made: the caller may change its tensors as soon as the save returns.
        versions = list(map(_version_of, [tensors[i] for i in self.sig_of]))
        if defer and not self.copied:
            return tree, functools.partial(self._rows, versions, tensors=None), None
        if address_key is not None and self.plans is not None and address_key in self.plans.addressed:
            # The storages now, not later: the signatures must name the ones these tensors are on.
            now = [tensors[i].untyped_storage() for i in self.sig_of]
            return tree, functools.partial(self._rows, versions, None, now), tensors
        return tree, self._rows(versions, tensors, committed=committed), None

    def _same_kind(self, tensors: list[torch.Tensor]) -> bool:
        """For a record of other tensor objects: whether `tensors` are all tensors `flatten` stores as they are
        (plain or parameter, strided, not lazy conjugate or negative views). A value it refuses (a sparse or
        nested tensor, a subclass) is left to the full flatten, which names it."""
        if not all(map(_STORED.__contains__, map(type, tensors))):
            return False
        if not all(t.layout == torch.strided and not t.is_nested for t in tensors):
            return False
        return not self.complex or not any(t.is_conj() or t.is_neg() for t in tensors)

    def _rows(self, versions: list[int], tensors: list[torch.Tensor] | None,
              now: list[torch.UntypedStorage] | None = None,
              committed: Mapping[str, TensorEntry] | None = None) -> list[TensorEntry]:
        """Fresh rows; each 'tensor' row's byte view made from `tensors` when given (else none), its signature
        naming the storage it is on now (`now`, per signed row, or from `tensors`) for a record of other objects.

        With `committed` (rows by key, never changed: a saver's last commits), a 'tensor' row whose key has a row
        there with the very signature the fresh one would have is that row, as it is (its chunks and statistics,
        no byte view): a `reuse_unchanged` save of 8,000 tensors that changed 800 makes 800 rows, not 8,000 of
        which it would throw 7,200 away (~10 ms of the caller's time). Which rows are unchanged is the caller's
        business: this only spares the objects."""
        ptrs, dtypes, shapes, strides, devices, storages = self._sig_cols
        if self.refs is None and tensors is not None:
            now = [tensors[i].untyped_storage() for i in self.sig_of]
        if now is not None:
            # Other tensor objects, maybe over other storages at the same addresses: each row's signature names
            # the storage its tensor is on now (the record's reference where it is that one).
            storages = [r if u._cdata == r.cdata else StorageWeakRef(u) for r, u in zip(storages, now)]
        # sig: (data_ptr, version counter, dtype, shape, stride, device, storage), as `Flattener._add_tensor` makes it
        sigs = list(zip(ptrs, versions, dtypes, shapes, strides, devices, storages))
        n = len(self.columns[0])
        same = None
        if committed:
            # In C (`map`, `compress`): a Python loop per row cost about what making the rows did.
            lasts = list(map(committed.get, self._signed_keys, itertools.repeat(_NO_ROW)))
            same = list(map(operator.eq, map(_sig_of, lasts), sigs))
            if not any(same):
                same = None
        if same is None:
            entries = list(map(TensorEntry, *self.columns))
            made = self.signed
            kept: set[int] = set()
        else:
            entries = [None] * n  # type: ignore[list-item]
            kept_rows = list(itertools.compress(self.signed, same))
            list(map(entries.__setitem__, kept_rows, itertools.compress(lasts, same)))
            other = list(map(operator.not_, same))
            made = list(itertools.compress(self.signed, other))
            sigs = list(itertools.compress(sigs, other))
            fresh = self._unsigned + made
            made_rows = map(TensorEntry, *([col[row] for row in fresh] for col in self.columns))
            list(map(entries.__setitem__, fresh, made_rows))
            kept = set(kept_rows) if self.copied else set()
        if tensors is not None:
            for row, i in self.copied:
                if row not in kept:
                    entries[row].source = _bytes_of(tensors[i])
        for row, sig in zip(made, sigs):
            entries[row].sig = sig
        return entries


_NO_ROW = TensorEntry("", torch.uint8, (), "", "")
"""What `_Flattened._rows` finds under a key without a committed row: a row whose signature (None) is no
tensor's."""
_sig_of = operator.attrgetter("sig")


class Layouts(dict[Any, Any]):
    """A kept flatten's capture layouts (`capture`'s slot plans, by chunk size, slot size and borrowing), and the
    devices its stored bytes are on (`devices`, as `TensorEntry.device` names them): which side stream copies
    them is decided from these, not from rows that may not be made yet. `unbound`: the layouts hold no byte
    view (a record of new tensor objects every save), and each capture binds them to its rows'."""

    def __init__(self, devices: frozenset[str], unbound: bool = False,
                 raw: list[torch.Tensor | None] | None = None) -> None:
        super().__init__()
        self.devices = devices
        self.unbound = unbound
        self.raw = raw
        """For `unbound` layouts of contiguous host tensors: per row, a byte view made from the address of its
        tensor's bytes, owning nothing (`_Flattened._raw_sources`); None otherwise."""
        self.addressed: dict[Any, Any] = {}
        """By capture key: the layout bound to `raw`, made once and used as it is by every capture of a state that
        matches the record (`capture`): no byte view made per tensor per save."""


_deref = weakref.ref.__call__
_STORED = frozenset((torch.Tensor, torch.nn.Parameter))
_version_of = operator.attrgetter("_version")


class FlattenCache:
    """`flatten` for a caller that saves the same state again and again (a training loop: same containers,
    same tensor objects, new values): the last flatten is reused when the state has the same structure
    and every tensor is the same object with the same data pointer, dtype, shape, strides, storage offset,
    device and requires_grad; anything else flattens anew. A state made of new tensor objects on every save
    (`model.state_dict()`) reuses the skeleton and rows, not the byte views, when every tensor has the same
    signature as the last time's (see `_Flattened`). Thread-safe."""

    def __init__(self) -> None:
        self._last: _Flattened | None = None
        self._probe: tuple[weakref.ref[torch.Tensor], int, int] | None = None
        """The first tensor of the last state flattened, its data pointer and the state's tensor count: a state
        whose first tensor is the same object gets a record that holds its tensors; one whose first tensor is
        another object at the same address, in as many tensors, gets one that holds none (a loop saving
        `model.state_dict()`); any other is not worth a record (saves of other states in turn: a population's
        members)."""

    def flatten(self, state: Any, allow_pickle: bool = False) -> tuple[dict[str, Any], list[TensorEntry]]:
        """As `flatten`; raises what it raises."""
        tree, entries = self.flatten_kept(state, allow_pickle)[:2]
        assert isinstance(entries, list)
        return tree, entries

    def flatten_kept(self, state: Any, allow_pickle: bool = False, defer: bool = False, address_key: Any = None,
                     committed: Mapping[str, TensorEntry] | None = None
                     ) -> tuple[dict[str, Any], Rows, Layouts | None, dict[str, Any] | None,
                                list[torch.Tensor] | None]:
        """As `flatten`, plus on a reuse whose rows read only byte views the record keeps, the record's `plans`
        (`Layouts` that name those views), else None; the record's `encoded` whenever the rows come from (or
        made) a record, else None; and the tensors a capture must hold while it copies, when the rows have no
        byte views for it (else None). With `defer`, a reuse with `plans` may give its rows as a function that
        makes them (`_Flattened.reuse`, which says what `address_key` and `committed` are for). Raises what
        `flatten` raises."""
        last = self._last
        if last is not None:
            # A layout names the rows' byte views: kept when every save has the very same ones. CUDA rows too: on
            # an H200, planning them anew made `small`'s save_async block 71 ms against 38 ms with the layout kept
            # (medians of 8, alternated; `cnn` 5.9 -> 4.7, `transformer` 15.2 -> 12.0 ms).
            kept = last.own_sources
            hit = last.reuse(state, defer and kept, address_key if defer else None, committed)
            if hit is not None:
                return hit[0], hit[1], last.plans if kept or last.refs is None else None, last.encoded, hit[2]
        f = Flattener(allow_pickle)
        tree = f.flatten(state)
        _renumber(tree, f.tensor_rows)
        self._last = None
        first = f._tensors[0][1] if f._tensors else None
        probe, where, self._probe = self._probe, None, None
        if first is not None:
            where = (first.data_ptr(), len(f._tensors))
            self._probe = (weakref.ref(first), *where)
        # Keep a record on the first save, and later only when the state is the one flattened the time before:
        # building one costs ~a quarter of a flatten, which other states in turn would pay for nothing.
        same = probe is None or probe[0]() is first
        again = not same and probe is not None and probe[1:] == where
        if (same or (again and all(e.kind != "storage" for e in f.entries))) and _cacheable(tree):
            tensors: list[torch.Tensor] = []
            # conj/neg views are saved through a resolved copy: the same object, but no reusable row.
            if _walk_state(state, tree, tensors) is tree and all(a is b for a, (_, b) in zip(tensors, f._tensors)):
                self._last = _Flattened(tree, f, tensors, self._forget if same else None)
                return tree, f.entries, None, self._last.encoded, None
        return tree, f.entries, None, None, None

    def clear(self) -> None:
        """Drop the kept flatten (and with it every reference to the state's storages)."""
        self._last = self._probe = None

    def _forget(self, _ref: Any) -> None:
        self._last = None


def _renumber(node: dict[str, Any], rows: list[int]) -> None:
    if node["t"] == "tensor":
        node["i"] = rows[node["i"]]
    elif node["t"] in ("dict", "odict", "list", "tuple"):
        for child in node["v"]:
            _renumber(child, rows)


Route = dict[int, list[int]]
"""For a load of exact key paths: id(container node) -> positions of the children on the way to them."""

_CONTAINERS = ("dict", "odict", "list", "tuple")


class _Handed:
    """`unflatten`'s tensor source, remembering what it made of each loaded tensor, per key flags."""

    def __init__(self, source: Callable[[int], Any]) -> None:
        self._source = source
        self._made: dict[int, tuple[Any, dict[tuple[Any, ...], Any]]] = {}

    def __call__(self, i: int) -> Any:
        return self._source(i)

    def handed(self, val: Any) -> dict[tuple[Any, ...], Any]:
        # keyed by id, holding `val` so the id stays its own for the whole unflatten
        return self._made.setdefault(id(val), (val, {}))[1]


def unflatten(node: dict[str, Any], tensor: Callable[[int], Any], allow_pickle: bool = False, path: str = "",
              select: Callable[[str], bool] | None = None, route: Route | None = None, root: bool = True) -> Any:
    """Rebuild the saved containers around `tensor(row)`; pickle only with `allow_pickle`. `root`: `node` is
    the whole state (a child under the key '' has the path '' too).

    A subtree whose tensors were not selected (`tensor` returns the `SKIP`
    sentinel) is left out of its container. With a `route` (`PathIndex.route`),
    a container that `select` does not name visits only the children on it.
    """
    if root and not isinstance(tensor, _Handed):
        tensor = _Handed(tensor)
    t = node["t"]
    if select is not None and t not in _CONTAINERS and not select(path):
        return SKIP
    if t == "tensor":
        val = tensor(node["i"])
        if val is SKIP:
            return SKIP
        # One loaded tensor may stand for several keys (the same tensor, or identical views, saved under each).
        # Keys with the same flags get the same object (a Parameter under two keys is one Parameter, as
        # torch.load gives it); a key with other flags gets an object of its own over the same storage, so
        # that making one trainable does not make the other so (`{"a": t_grad, "b": t_grad.detach()}`).
        flags = (node.get("param"), bool(node.get("grad")), bool(node.get("np")))
        handed = tensor.handed(val) if isinstance(tensor, _Handed) else {}
        if flags in handed:
            return handed[flags]
        if handed:
            val = val.detach()
        if node.get("np"):
            out_t: Any = val.numpy()
        elif "param" in node:
            out_t = torch.nn.Parameter(val, requires_grad=node["param"])
        else:
            out_t = val.requires_grad_(True) if node.get("grad") and not val.requires_grad else val
        handed[flags] = out_t
        return out_t
    if t == "v":
        return node["v"]
    if t == "bytes":
        raw = base64.b64decode(node["v"])
        return bytearray(raw) if node.get("ba") else raw
    if t == "dtype":
        return dtype_from_name(node["v"])
    if t == "device":
        return torch.device(node["v"])
    if t == "size":
        return torch.Size(node["v"])
    if t == "npscalar":
        return np.frombuffer(base64.b64decode(node["v"]), dtype=np.dtype(node["dtype"]))[0]
    if t in ("dict", "odict"):
        out: dict[Any, Any] = OrderedDict() if t == "odict" else (Counter() if node.get("cls") == "Counter" else {})
        if "meta" in node:
            out._metadata = OrderedDict((k, dict(v)) for k, v in node["meta"])  # type: ignore[attr-defined]
        keys, vals = node["k"], node["v"]
        for j in _positions(node, path, select, route):
            k = keys[j]
            v = unflatten(vals[j], tensor, allow_pickle, f"{path}.{k}" if path else str(k), select, route, False)
            if v is not SKIP:
                out[k] = v
        return SKIP if _drop_empty(select, path, out, root) else out
    if t in ("list", "tuple"):
        vals = node["v"]
        items = [unflatten(vals[i], tensor, allow_pickle, f"{path}.{i}" if path else str(i), select, route, False)
                 for i in _positions(node, path, select, route)]
        items = [x for x in items if x is not SKIP]
        if _drop_empty(select, path, items, root):
            return SKIP
        return items if t == "list" else tuple(items)
    if t == "pickle":
        if not allow_pickle:
            raise UnsupportedValueError(
                f"{path or '<state>'} was saved with pickle; loading it runs code chosen by whoever saved it. "
                "Pass allow_pickle=True (on the command line: --allow-pickle) only if you trust this store"
            )
        try:
            return pickle.loads(base64.b64decode(node["v"]))
        except Exception as exc:  # a class gone from this environment (ModuleNotFoundError, AttributeError)
            raise UnsupportedValueError(
                f"{path or '<state>'} was saved with pickle and cannot be unpickled here ({type(exc).__name__}: "
                f"{exc}): make the code that defined it importable (the same package and module), or load the "
                "other keys with keys=[...]") from exc
    raise UnsupportedValueError(f"{path or '<state>'} has node type {t!r} unknown to this datastates; upgrade it")


def tensor_rows(node: dict[str, Any], select: Callable[[str], bool] | None = None, route: Route | None = None,
                path: str = "") -> list[int]:
    """The manifest rows of the tensor leaves `unflatten(node, ..., select=select, route=route)` asks for,
    in tree order."""
    t = node["t"]
    if t == "tensor":
        return [node["i"]] if select is None or select(path) else []
    out: list[int] = []
    if t in ("dict", "odict"):
        keys, vals = node["k"], node["v"]
        for j in _positions(node, path, select, route):
            out += tensor_rows(vals[j], select, route, f"{path}.{keys[j]}" if path else str(keys[j]))
    elif t in ("list", "tuple"):
        vals = node["v"]
        for i in _positions(node, path, select, route):
            out += tensor_rows(vals[i], select, route, f"{path}.{i}" if path else str(i))
    return out


def _positions(node: dict[str, Any], path: str, select: Callable[[str], bool] | None,
               route: Route | None) -> Iterable[int]:
    """The children of a container to visit: all of them, unless a route says which (and `select` does
    not name the container itself, which takes it whole)."""
    if route is None or select is None or (path and select(path)):
        return range(len(node["v"]))
    return route.get(id(node), ())


class PathIndex:
    """Finds the nodes of one skeleton that exact key paths name, visiting only the containers on the way.

    Each visited dict's child keys are sorted once, on first use, so the same lookups on a cached
    manifest cost a few bisections per level, however many keys it has. Keys may themselves contain
    dots (`{"layers.0.weight": t}`): a key path can cross a node in several ways, all of them found.
    """

    def __init__(self, tree: dict[str, Any]) -> None:
        self.tree = tree
        self._sorted: dict[int, tuple[list[str], list[int]]] = {}  # by id(node): the nodes live as long as `tree`

    def route(self, keys: Iterable[str]) -> tuple[Route, set[str]]:
        """The route to `keys` (non-empty exact paths), and which of them name a node: a node whose path
        is the key or lies under it (`a.b` names `a.b.c`)."""
        on: dict[int, set[int]] = {}
        found: set[str] = set()
        for key in keys:
            self._walk(self.tree, "", key, on, found)
        return {n: sorted(js) for n, js in on.items()}, found

    def _walk(self, node: dict[str, Any], path: str, key: str, route: dict[int, set[int]], found: set[str]) -> None:
        t = node["t"]
        if t not in _CONTAINERS:
            return
        rem = key[len(path) + 1:] if path else key
        on = route.setdefault(id(node), set())
        for j in self._candidates(node, rem, not path):
            seg = f"{node['k'][j]}" if t in ("dict", "odict") else str(j)
            sub = f"{path}.{seg}" if path else seg
            if sub and (sub == key or sub.startswith(key + ".")):
                found.add(key)
            elif not sub or key.startswith(sub + "."):  # an empty key at the top adds nothing to the path
                self._walk(node["v"][j], sub, key, route, found)
            else:
                continue
            on.add(j)

    def _candidates(self, node: dict[str, Any], rem: str, at_top: bool) -> list[int]:
        """Children whose key segment is `rem`, a dotted prefix of `rem`, or starts with `rem` + '.'; and
        the empty segment `at_top` (the node's path is empty: that child's path is empty too)."""
        if node["t"] in ("list", "tuple"):  # segments are indices: no dots
            head = rem.partition(".")[0]
            if head.isascii() and head.isdigit() and str(int(head)) == head and int(head) < len(node["v"]):
                return [int(head)]
            return []
        ix = self._sorted.get(id(node))
        if ix is None:
            segs = [f"{k}" for k in node["k"]]
            order = sorted(range(len(segs)), key=segs.__getitem__)
            ix = self._sorted[id(node)] = ([segs[j] for j in order], order)
        names, order = ix
        out: list[int] = []
        end = len(rem)
        while end >= 0:  # rem itself, then each dotted prefix of it
            p = rem[:end]
            out += order[bisect.bisect_left(names, p):bisect.bisect_right(names, p)]
            end = rem.rfind(".", 0, end)
        # every string starting with rem + "." sorts in [rem + ".", rem + "/"): "/" follows "."
        out += order[bisect.bisect_left(names, rem + "."):bisect.bisect_left(names, rem + "/")]
        if at_top and not rem.startswith("."):  # else the loop above took the empty segment already
            out += order[:bisect.bisect_right(names, "")]
        return out


def _drop_empty(select: Callable[[str], bool] | None, path: str, kept: Any, root: bool) -> bool:
    """A container left empty by a partial load goes too, unless it was selected itself or is the state."""
    return select is not None and not kept and not root and not select(path)


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP: Any = _Skip()


def tree_paths(node: dict[str, Any], path: str = "") -> list[str]:
    """Every key path in a state skeleton: leaves and containers (a scheduler's subtree has no tensor)."""
    out = [path] if path else []
    t = node["t"]
    if t in ("dict", "odict"):
        for k, child in zip(node["k"], node["v"]):
            out += tree_paths(child, f"{path}.{k}" if path else str(k))
    elif t in ("list", "tuple"):
        for i, child in enumerate(node["v"]):
            out += tree_paths(child, f"{path}.{i}" if path else str(i))
    return out
