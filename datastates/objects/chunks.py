"""Chunks: content-addressed byte ranges of tensor data.

A chunk's id is the blake3 digest of its *uncompressed* bytes, so the same
bytes always get the same id whatever codec stored them.
"""

from __future__ import annotations

from typing import NamedTuple

import blake3

DEFAULT_CHUNK_SIZE = 16 << 20
"""16 MiB, by measurement (docs/benchmarks.md, "Chunk size"): a 1 GiB save is ~25 %
faster than with 4 MiB chunks (per-chunk costs: a pool slot, a hash and a statistics
call, a write, an index entry) and the async blocking part meets its target. The
price is coarser dedup inside a partly changed tensor (16 MiB granularity); pick a
smaller size at `Store.open(..., chunk_size=)` for states whose big tensors change
in small parts (embedding rows)."""

CODEC_RAW = 0
CODEC_ZSTD = 1


def chunk_id(data: memoryview | bytes) -> bytes:
    """Return the 32-byte blake3 digest of `data` (releases the GIL for large inputs)."""
    return blake3.blake3(data).digest()


def spans(nbytes: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split `nbytes` into [start, end) spans of at most `chunk_size`; one empty span for 0 bytes."""
    if nbytes == 0:
        return [(0, 0)]
    return [(s, min(s + chunk_size, nbytes)) for s in range(0, nbytes, chunk_size)]


class ChunkLocation(NamedTuple):
    """Where a chunk's stored bytes live. A named tuple, not a dataclass: a save of thousands of small tensors
    makes one per new chunk, and a tuple of strings and ints is built ~5x faster and is dropped from the cyclic
    collector's tracking at its first pass (each tracked object a save keeps alive costs the collector's full
    passes ~1.5 us; docs/perf-notes.md)."""

    pack: str
    """Id of the pack file (32 hex characters)."""
    offset: int
    """Byte offset of the stored bytes inside the pack."""
    length: int
    """Number of stored bytes (after compression)."""
    raw_length: int
    """Number of bytes once decoded; what the chunk id hashes."""
    codec: int = CODEC_RAW
    """CODEC_RAW or CODEC_ZSTD."""
