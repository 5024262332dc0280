"""Store settings kept in `config.toml` inside the (cold) store directory.

The training job that first opens a store with tiers writes them here, so a
CLI or server that opens the same directory later sees the same tiers.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tomllib

from ..errors import InvalidArgumentError, StoreFormatError
from .files import replace

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n} B"


def parse_size(value: str | int | None) -> int | None:
    """'200GiB', '1.5G', '512MiB' or an int -> bytes; ValueError names the bad value."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise InvalidArgumentError(f"size {value!r} is not like '200GiB', '512MiB' or a number of bytes")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Flush:
    """Which versions the background flusher copies to the cold tier."""

    every: int = 1
    """Flush every Nth version of each branch (1 = all)."""
    tagged_only: bool = False
    """Flush only versions that carry a tag (tagging an unflushed version flushes it)."""

    def __post_init__(self) -> None:
        """Raises InvalidArgumentError for an `every` that is not an int of 1 or more."""
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise InvalidArgumentError(f"Flush(every={self.every!r}): every is a count of versions, 1 or more "
                                       "(Flush(every=1) flushes each one)")


@dataclass(frozen=True)
class TierConfig:
    hot: str | None = None
    hot_capacity: int | None = None
    flush: Flush = Flush()
    promote: bool = True
    """Copy packs read from cold back into hot."""


def load(root: Path) -> TierConfig | None:
    path = root / "config.toml"
    if not path.exists():
        return None
    try:
        data: dict[str, Any] = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StoreFormatError(f"{path} is not UTF-8 text (byte {exc.start} is damaged); fix it, or delete it "
                               "and open the store again with its tiers (Store.open(path, hot=...))") from exc
    except tomllib.TOMLDecodeError as exc:
        raise StoreFormatError(f"{path} is not valid TOML ({exc}); fix it, or delete it and open the store "
                               "again with its tiers (Store.open(path, hot=...))") from exc
    if not isinstance(data.get("tiers", {}), dict) or not isinstance(data.get("flush", {}), dict):
        raise StoreFormatError(f"{path}: [tiers] and [flush] must be tables; fix it, or delete it and open "
                               "the store again with its tiers (Store.open(path, hot=...))")
    tiers = data.get("tiers", {})
    flush = data.get("flush", {})
    try:
        every = int(flush.get("every", 1))
    except (TypeError, ValueError) as exc:
        raise StoreFormatError(f"{path}: [flush] every = {flush.get('every')!r} is not a whole number; fix it "
                               "(every = 1 flushes each version)") from exc
    # A file written before `Flush` checked `every` may hold 0 or less: the flusher always read that as 1, and so
    # does this (refusing it would make the store unopenable).
    return TierConfig(hot=tiers.get("hot"), hot_capacity=parse_size(tiers.get("hot_capacity")),
                      flush=Flush(every=max(1, every), tagged_only=bool(flush.get("tagged_only", False))),
                      promote=bool(tiers.get("promote", True)))


def save(root: Path, cfg: TierConfig) -> None:
    lines = ["# datastates store settings; edit with care", "[tiers]"]
    if cfg.hot is not None:
        lines.append(f"hot = {_q(cfg.hot)}")
    if cfg.hot_capacity is not None:
        lines.append(f"hot_capacity = {cfg.hot_capacity}")
    lines.append(f"promote = {'true' if cfg.promote else 'false'}")
    lines.append("")
    lines.append("[flush]")
    for k, v in asdict(cfg.flush).items():
        lines.append(f"{k} = {str(v).lower() if isinstance(v, bool) else v}")
    replace(root / "config.toml", ("\n".join(lines) + "\n").encode())


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
