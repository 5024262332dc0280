"""Deterministic states and bit-exact comparison, shared by the tests and the helper scripts.

Imported as `helpers.states` by the tests and as `states` by the scripts in this folder.
"""

from __future__ import annotations

import hashlib
import math
import struct
from pathlib import Path
from typing import Any

import torch

CRASH_CHUNK = 128 << 10
"""Chunk size of the crash-test stores: tensors span several chunks, so a save mixes new and known chunks."""


def gen(*key: int) -> torch.Generator:
    """A torch generator seeded from integers (same numbers in every process)."""
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k)) % (1 << 62)
    return torch.Generator().manual_seed(seed)


def crash_state(seed: int, step: int) -> dict[str, Any]:
    """About 3 MiB whose content is a pure function of (seed, step).

    Some tensors never change, one changes every third step, two change every step and one
    large tensor changes in a single 128 KiB block per step (so dedup works below the tensor).
    """
    frozen = {f"f{i}": torch.randn(64 << 10, generator=gen(seed, 0, i)) for i in range(4)}
    big = torch.randn(256 << 10, generator=gen(seed, 1))
    block = (step % 8) * (32 << 10)
    big[block:block + (32 << 10)] = torch.randn(32 << 10, generator=gen(seed, 2, step))
    return {
        "model": {
            "frozen": frozen,
            "big": big,
            "slow": torch.randn(64 << 10, generator=gen(seed, 3, step // 3)),
            "w0": torch.randn(64 << 10, generator=gen(seed, 4, step)),
            "w1": torch.randn(128, 256, generator=gen(seed, 5, step)).to(torch.bfloat16),
            "ints": torch.randint(-(1 << 40), 1 << 40, (4096,), generator=gen(seed, 6, step)),
        },
        "step": step,
        "meta": {"seed": seed, "tag": f"s{step}", "ratio": step / 7},
    }


def concurrent_state(name: str, i: int) -> dict[str, Any]:
    """A small state whose tensors differ between writers (no chunk is shared by two writers)."""
    k = sum(map(ord, name))
    return {"writer": name, "i": i, "w": torch.full((256,), float(i) + 1000.0 * k), "own": torch.tensor([k, i])}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The logical bytes of `t` in row-major order (NaN-safe, dtype-agnostic)."""
    if t.numel() == 0:
        return b""
    # A fresh tensor has row-major strides; .contiguous() may keep odd strides on size-1 dims (which
    # torch counts as contiguous) and .view(uint8) would refuse them.
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def state_digest(obj: Any) -> str:
    """A digest of structure, container types, keys, dtypes, shapes, tensor bytes and plain values."""
    h = hashlib.sha256()

    def put(*parts: Any) -> None:
        for p in parts:
            b = p if isinstance(p, bytes) else repr(p).encode()
            h.update(struct.pack("<Q", len(b)))
            h.update(b)

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            put("T", type(v).__name__, str(v.dtype), tuple(v.shape), tensor_bytes(v))
        elif isinstance(v, dict):
            put("D", type(v).__name__, len(v))
            for k, x in v.items():
                put(type(k).__name__, k)
                walk(x)
        elif isinstance(v, (list, tuple)):
            put("L", type(v).__name__, len(v))
            for x in v:
                walk(x)
        elif isinstance(v, float):
            put("F", struct.pack("<d", v))
        else:
            put("V", type(v).__name__, v)

    walk(obj)
    return h.hexdigest()


def assert_same(got: Any, want: Any, path: str = "<state>") -> None:
    """Assert `got` equals `want` bit for bit: same container types, keys, dtypes, shapes and bytes."""
    assert type(got) is type(want), f"{path}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert tensor_bytes(got) == tensor_bytes(want), f"{path}: bytes differ"
        if isinstance(want, torch.nn.Parameter):
            assert got.requires_grad == want.requires_grad, f"{path}: requires_grad differs"
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert type(next(x for x in got if x == k)) is type(k), f"{path}: key {k!r} changed type"
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}.{i}")
    elif isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got), f"{path}: {got!r} is not nan"
        else:
            assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def snapshot(path: Path, with_catalog: bool = False) -> dict[str, str]:
    """Relative path -> sha256 of every file under a directory, except locks/ and catalog/
    (with `with_catalog`, the catalog's data file counts too; its lock file never does)."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path)
        skip = rel.parts[0] == "locks" or (rel.parts[0] == "catalog" and (not with_catalog or p.name == "lock.mdb"))
        if skip or not p.is_file():
            continue
        out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def snapshot_digest(path: Path) -> str:
    """One digest of `snapshot(path)` (to compare snapshots taken in different processes)."""
    return hashlib.sha256(repr(sorted(snapshot(path).items())).encode()).hexdigest()


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


__all__ = ["CRASH_CHUNK", "assert_same", "concurrent_state", "crash_state", "gen", "shares_storage", "snapshot",
           "snapshot_digest", "state_digest", "tensor_bytes"]
