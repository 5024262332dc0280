"""Tensor representations for download: .npy and safetensors headers, byte ranges over header + tensors.

The bytes come from `datastates.tensor_bytes.iter_tensor_bytes`, one chunk at a
time, so a request holds one chunk in memory whatever the tensor's size.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import blake3

import datastates as ds
from datastates.tensor_bytes import TensorBytes, iter_tensor_bytes

_NPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
        "int8": "|i1", "uint8": "|u1", "bool": "|b1", "complex64": "<c8", "complex128": "<c16",
        "uint16": "<u2", "uint32": "<u4", "uint64": "<u8"}
_SAFETENSORS = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16",
                "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def npy_header(t: TensorBytes) -> bytes:
    """An .npy (format 1.0) header for the tensor; InvalidArgumentError for dtypes numpy lacks."""
    descr = _NPY.get(t.dtype)
    if descr is None:
        raise ds.InvalidArgumentError(
            f"tensor {t.key!r} has dtype {t.dtype}, which .npy cannot hold; ask for format=safetensors")
    shape = repr(tuple(t.shape))
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    pad = 64 - (10 + len(text) + 1) % 64
    body = (text + " " * (pad % 64) + "\n").encode("latin-1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body


_COMPLEX = {"complex64": "F32", "complex128": "F64", "complex32": "F16"}
"""safetensors has no complex dtype: a complex tensor goes as its real view (`torch.view_as_real`: the same bytes,
a last dimension of 2 more), its key listed in the metadata's `datastates.complex` for the way back."""
COMPLEX_KEYS = "datastates.complex"


def safetensors_header(tensors: list[TensorBytes], metadata: dict[str, str]) -> bytes:
    """A safetensors header placing the tensors back to back in the given order (complex ones as their real view,
    see `_COMPLEX`)."""
    head: dict[str, object] = {"__metadata__": metadata}
    pos = 0
    as_real = [t.key for t in tensors if t.dtype in _COMPLEX]
    if as_real:
        metadata = head["__metadata__"] = metadata | {COMPLEX_KEYS: json.dumps(as_real, separators=(",", ":"))}
    for t in tensors:
        dt = _SAFETENSORS.get(t.dtype) or _COMPLEX.get(t.dtype)
        if dt is None:
            raise ds.InvalidArgumentError(
                f"tensor {t.key!r} has dtype {t.dtype}, which safetensors cannot hold; ask for format=npy")
        shape = [*t.shape, 2] if t.dtype in _COMPLEX else list(t.shape)
        head[t.key] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class Body:
    """A downloadable file: a header followed by the bytes of some tensors, all of one version."""

    header: bytes
    tensors: tuple[TensorBytes, ...]
    media_type: str
    fmt: str

    @property
    def length(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    @property
    def etag(self) -> str:
        """Strong validator: the tensors' content hashes and the representation's header."""
        h = blake3.blake3(self.fmt.encode() + b"|" + self.header)
        for t in self.tensors:
            h.update(t.content_hash.encode())
        return f'"{h.hexdigest()[:32]}"'


def npy_body(t: TensorBytes) -> Body:
    return Body(npy_header(t), (t,), "application/octet-stream", "npy")


def safetensors_body(tensors: list[TensorBytes], version: str,
                     paths: dict[str, list[str | int]] | None = None) -> Body:
    meta = {"datastates.version": version}
    if paths is not None:  # how load() nests these keys: lets a client rebuild the state exactly
        meta["datastates.paths"] = json.dumps({t.key: paths.get(t.key) for t in tensors}, separators=(",", ":"))
    return Body(safetensors_header(tensors, meta), tuple(tensors),
                "application/octet-stream", "safetensors")


def started_body(store: ds.Store, body: Body, start: int, end: int) -> Iterator[bytes]:
    """`iter_body` with its first piece of tensor bytes already read (and verified): a damaged first chunk
    raises its IntegrityError here, before any header is sent, where it becomes a typed error answer
    rather than a 200 cut short. Damage further in can only cut the body short of its Content-Length."""
    it = iter_body(store, body, start, end)
    ahead = list(itertools.islice(it, 2 if start < len(body.header) else 1))
    return itertools.chain(ahead, it)


def iter_body(store: ds.Store, body: Body, start: int, end: int) -> Iterator[bytes]:
    """Bytes [start, end) of the file, one chunk at a time."""
    pos = 0
    h = body.header
    if start < len(h):
        yield h[start:min(end, len(h))]
    pos = len(h)
    for t in body.tensors:
        s, e = pos, pos + t.nbytes
        if e > start and s < end:
            yield from iter_tensor_bytes(store, t.version, t.key, max(start - s, 0), min(end, e) - s, info=t)
        pos = e
        if pos >= end:
            break


def parse_range(header: str | None, length: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=` range; None to send the whole file (no header, several
    ranges, or a malformed one: RFC 9110 lets a server ignore those). Raises ValueError when the
    range is well formed but unsatisfiable (-> 416). Digits are ASCII ones ('¹' is a digit to str.isdigit,
    not to int)."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = (x.strip() for x in spec.partition("-"))
    if not dash or not (first or last) or not all(x.isascii() and x.isdigit() for x in (first, last) if x):
        return None
    if not first:  # a suffix: the last N bytes
        n = int(last)
        if n == 0:
            raise ValueError(f"range {header!r} asks for 0 bytes")
        return max(length - n, 0), length
    s = int(first)
    e = int(last) + 1 if last else length
    if last and e <= s:
        return None  # last < first: invalid, ignored
    if s >= length:
        raise ValueError(f"range {header!r} starts past the end ({length} bytes)")
    return s, min(e, length)
