"""Per-tensor statistics, computed chunk by chunk and merged (Chan et al.).

Min, max, mean and std are over the finite values; NaN and Inf are counted
apart, so one diverged element does not hide the rest of the picture. Complex
tensors get only the L2 norm and the counts. Dtypes torch cannot do arithmetic
on (packed float4, ...) get no statistics.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_WIDE = {torch.int32, torch.int64, torch.uint32, torch.uint64, torch.float64}


@dataclass(slots=True)
class Partial:
    """Mergeable summary of some elements of one tensor. Slotted: a saver keeps one per chunk of each big tensor
    it last committed (`TensorEntry.piece_stats`)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf
    nan: int = 0
    inf: int = 0
    complex: bool = False
    ok: bool = True

    def merge(self, o: Partial) -> None:
        self.ok = self.ok and o.ok
        self.complex = self.complex or o.complex
        self.nan += o.nan
        self.inf += o.inf
        if o.n == 0:
            return
        n = self.n + o.n
        delta = o.mean - self.mean
        self.mean += delta * o.n / n
        self.m2 += o.m2 + delta * delta * self.n * o.n / n
        self.n = n
        self.lo = min(self.lo, o.lo)
        self.hi = max(self.hi, o.hi)

    def final(self) -> dict[str, float | int | None]:
        if not self.ok:
            return {}
        if self.complex:
            l2 = math.sqrt(max(self.m2 + self.n * self.mean * self.mean, 0.0)) if self.n else 0.0
            return {"l2": l2, "nan_count": self.nan, "inf_count": self.inf}
        if self.n == 0:
            return {"l2": 0.0, "nan_count": self.nan, "inf_count": self.inf}
        return _final(self.n, self.mean, self.m2, self.lo, self.hi, self.nan, self.inf)


def _final(n: int, mean: float, m2: float, lo: float, hi: float, nan: int = 0,
           inf: int = 0) -> dict[str, float | int | None]:
    """The statistics of `n` > 0 finite real values summarized as (mean, m2, min, max), plus the counts."""
    std = math.sqrt(m2 / (n - 1)) if n > 1 else 0.0
    l2 = math.sqrt(max(m2 + n * mean * mean, 0.0))
    return {"min": lo, "max": hi, "mean": mean, "std": std, "l2": l2, "nan_count": nan, "inf_count": inf}


def partial(raw: torch.Tensor, dtype: torch.dtype) -> Partial:
    """Summarize `raw` (uint8 bytes of whole elements of `dtype`)."""
    p = Partial()
    if raw.numel() == 0:
        return p
    try:
        x = raw.view(dtype)
        if x.is_complex():
            p.complex = True
            x = torch.view_as_real(x).reshape(-1)
        if x.dtype == torch.bool:
            x = x.view(torch.uint8)
        x = x.to(torch.float64 if x.dtype in _WIDE else torch.float32)
    except (RuntimeError, TypeError):
        p.ok = False
        return p
    # Sums of x - c, c a shift near the mean when a sample shows values far from 0 next to their spread
    # (BatchNorm weights, exp_avg_sq, a state drifting from 0): the one-pass m2 keeps its digits without a
    # second, centred pass (the shifted-data algorithm). Else c = 0: sum + dot, no scratch copy at all.
    c = _shift(x)
    total, sq = _centred(x, c) if c else (float(x.sum()), float(torch.dot(x, x)))
    lo, hi = torch.aminmax(x)
    if not (math.isfinite(total) and math.isfinite(sq) and math.isfinite(float(lo)) and math.isfinite(float(hi))):
        finite = torch.isfinite(x)
        p.nan = int(torch.isnan(x).sum())
        p.inf = int(x.numel() - finite.sum()) - p.nan
        x = x[finite]
        if x.numel() == 0:
            return p
        if x.dtype != torch.float64:  # finite values whose sum or squares overflow fp32
            x = x.to(torch.float64)
        c = 0.0
        total, sq, (lo, hi) = float(x.sum()), float(torch.dot(x, x)), torch.aminmax(x)
    p.n = x.numel()
    p.mean = c + total / p.n
    p.m2 = max(sq - total * total / p.n, 0.0)  # >= 0 also where squares underflow to 0 (subnormals)
    if not p.m2 > _SAFE * sq and sq:  # (sq == 0: every value is c, m2 = 0 is exact)
        # sum(x^2) - n*mean^2 cancels when the spread is tiny next to the mean (a BatchNorm weight of
        # 1.0 +- 1e-5 in fp32 keeps no digit of its std that way) and no sample caught it: centre on the mean,
        # and correct for the mean being rounded to x's dtype with the residual sum.
        resid, p.m2 = _centred(x, p.mean)
        p.m2 = max(p.m2 - resid * resid / p.n, 0.0)
        p.mean += resid / p.n
    p.lo, p.hi = float(lo), float(hi)
    return p


_SAMPLE = 64
"""Elements of a chunk (strided) that `_shift` looks at."""

_SHIFT_FROM = 1 << 16
"""Chunks of at least this many elements get `_shift`'s sample (~10 us); on smaller ones the centred pass it
may save costs less than the sample."""

_NARROW = 0.02
"""A sample whose variance is below this share of its mean square makes the sums shifted by its mean: the
one-pass m2 would then likely keep too few digits (below `_SAFE`), and a shift costs one pass where the centred
second pass costs three. Above it a shift would cost a pass for nothing (a uniform [0, 1) weight plus 1 has a
ratio of ~0.04 and sums fine unshifted)."""


def _shift(x: torch.Tensor) -> float:
    """The mean of a strided sample of `x` (1-D, fp32 or fp64) where the sample sits far from 0 next to its
    spread, else 0.0 (also for small or non-finite samples). Any value is correct as a shift; a good one keeps
    the digits of m2 without a second pass."""
    n = x.numel()
    if n < _SHIFT_FROM:
        return 0.0
    var, mean = torch.var_mean(x[::n // _SAMPLE])
    v, m = float(var), float(mean)
    if not (math.isfinite(v) and math.isfinite(m)) or not v < _NARROW * m * m:
        return 0.0
    return m


BATCHED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes whose equal pieces `partial_many` summarizes together (they all reduce in fp32)."""


def partial_many(raw: torch.Tensor, dtype: torch.dtype, count: int,
                 whole: bool = False) -> list[Partial | dict[str, float | int | None] | None]:
    """Summaries of `count` equal, consecutive pieces of `raw` (uint8 bytes of whole elements of `dtype`, one of
    `BATCHED_DTYPES`) from a handful of batched reductions instead of a handful of torch calls per piece. Pieces
    whose spread is tiny next to their mean (BatchNorm weights, AdamW's `exp_avg_sq`) get the centred second pass
    of `partial`, batched too. With `whole` (each piece is a whole tensor) the summaries are final statistics
    (`Partial.final`'s dicts, no object per piece to merge), else Partials. None for a piece holding a non-finite
    value: `partial` of that piece alone is its summary."""
    x = raw.view(dtype).view(count, -1)
    n = x.shape[1]
    rows = max(1, _BLOCK // n)  # squares (and fp32 copies) go through reused blocks: no new pages
    return _summarize(n, (x[r:r + rows] for r in range(0, count, rows)), whole)


def _summarize(n: int, blocks: Iterable[torch.Tensor],
               whole: bool) -> list[Partial | dict[str, float | int | None] | None]:
    """`partial_many`'s summaries of the rows of `blocks` (each rows x `n` elements of a `BATCHED_DTYPES` dtype, at
    most `_BLOCK` elements), in order; what one block teaches the next (`shift`) is carried through."""
    out: list[Partial | dict[str, float | int | None] | None] = []
    isfinite = math.isfinite
    shift = False
    for part in blocks:
        if part.dtype != torch.float32:
            part = _block(0, part.numel()).view(part.shape).copy_(part)
        # A block after one whose rows sat far from 0 next to their spread (LayerNorm weights, exp_avg_sq, a
        # state drifting from 0) is summed shifted by each row's first element (`partial`'s shifted-data sums,
        # batched): one subtraction instead of the centred second pass. Any shift is correct, so a wrong guess
        # costs one pass, not digits; no sample is taken (a sample per block cost 30-130 us, as much as it
        # saved). Learnt within this call only: the same bytes in the same run give the same bits whatever
        # the thread summarized before (a manifest of the same state is the same manifest).
        if shift:
            shifts = part[:, 0]
            d = torch.sub(part, shifts.unsqueeze(1), out=_block(1, part.numel()).view(part.shape))
            totals = d.sum(1).tolist()
            squares = d.mul_(d).sum(1).tolist()
            means = [c + total / n for c, total in zip(shifts.tolist(), totals)]
        else:
            totals = part.sum(1).tolist()
            squares = torch.mul(part, part, out=_block(1, part.numel()).view(part.shape)).sum(1).tolist()
            means = [total / n for total in totals]
        # amin and amax, not aminmax(dim=1): on CPU the latter is ~18x slower per row block (600 vs 32 us
        # for 64 x 4,096 fp32 in torch 2.13), and it was most of a small-tensor save's statistics time.
        mins, maxs = part.amin(1), part.amax(1)
        m2s = [max(sq - total * total / n, 0.0) for total, sq in zip(totals, squares)]
        # (A non-finite row is summarized alone by the caller: no centred pass for it.)
        narrow = [i for i, (m2, sq) in enumerate(zip(m2s, squares)) if not m2 > _SAFE * sq and sq and isfinite(m2)]
        if narrow:
            _centre_rows(part, narrow, means, m2s)
        # Shift the next block if a row of this one would have needed the centred pass unshifted.
        shift = bool(narrow) if not shift else any(m2 <= _SAFE * (m2 + n * mean * mean) for m2, mean in zip(m2s, means))
        for total, sq, lo, hi, mean, m2 in zip(totals, squares, mins.tolist(), maxs.tolist(), means, m2s):
            if not (isfinite(total) and isfinite(sq) and isfinite(lo) and isfinite(hi)):
                out.append(None)
            elif whole:
                out.append(_final(n, mean, m2, lo, hi))
            else:
                out.append(Partial(n=n, mean=mean, m2=m2, lo=lo, hi=hi))
    return out


def partial_gathered(pieces: list[torch.Tensor], dtype: torch.dtype,
                     whole: bool = False) -> list[Partial | dict[str, float | int | None] | None]:
    """`partial_many` of equal pieces that do not lie back to back (uint8 views of whole elements of `dtype`, one
    of `BATCHED_DTYPES`, all of one length), with the same results: copied a block at a time (`partial_many`'s
    blocks) into one reused per-thread byte block, then summarized as a run. A save whose changed tensors are
    spread over the state (every tenth of 8,000 small tensors changed) summarized each alone: 800 `partial` calls,
    80 ms of the workers' time per save against 11 ms for the same tensors changed as one block. Pieces over half a
    block are summarized alone (`partial`), with no block of their size."""
    if not pieces:
        return []
    length = pieces[0].numel()
    n = length // dtype.itemsize
    rows = _BLOCK // n if n else 0
    if rows < 2:
        return [partial(p, dtype) for p in pieces]

    def blocks() -> Iterator[torch.Tensor]:
        for r in range(0, len(pieces), rows):  # made one at a time: each reuses the block the last one filled
            part = pieces[r:r + rows]
            # block 2: 0 and 1 hold the fp32 copy and the squares `_summarize` makes of this one
            dst = _block(2, _BLOCK).view(torch.uint8)[:length * len(part)]
            torch.cat(part, out=dst)
            yield dst.view(dtype).view(len(part), n)

    return _summarize(n, blocks(), whole)


def _centre_rows(part: torch.Tensor, narrow: list[int], means: list[float], m2s: list[float]) -> None:
    """Recompute the mean and m2 of rows `narrow` of `part` (fp32, one piece per row) centred on their means
    rounded to fp32, corrected by the residual sums (the shifted-data algorithm of `partial`), in `means` and
    `m2s`. Every row of the block is centred (no gathered copy of the narrow ones: no third scratch block)."""
    n = part.shape[1]
    centres = torch.tensor(means, dtype=torch.float32)
    d = torch.sub(part, centres.unsqueeze(1), out=_block(1, part.numel()).view(part.shape))
    resid = d.sum(1).tolist()
    squares = d.mul_(d).sum(1).tolist()
    centre_of = centres.tolist()
    for row in narrow:
        res = resid[row]
        means[row] = centre_of[row] + res / n
        m2s[row] = max(squares[row] - res * res / n, 0.0)


_SAFE = 1e-2
"""Above this share of sum(x^2) the one-pass m2 keeps >= ~4 significant digits of the std in fp32
(the error of sum(x^2) is a few ulps of it); below, `partial` (and `_centre_rows` for a batched run) recomputes
m2 centred."""

_BLOCK = 1 << 18
_scratch = threading.local()


def _block(which: int, numel: int) -> torch.Tensor:
    """The first `numel` elements of reused per-thread fp32 scratch block `which` (0-2; grown, never shrunk)."""
    blocks = getattr(_scratch, "fp32", None)
    if blocks is None:
        blocks = _scratch.fp32 = [torch.empty(0), torch.empty(0), torch.empty(0)]
    if blocks[which].numel() < numel:
        blocks[which] = torch.empty(max(numel, _BLOCK))
    return blocks[which][:numel]


def _centred(x: torch.Tensor, mean: float) -> tuple[float, float]:
    """(sum(x - mean), sum((x - mean)^2)), through a reused per-thread block: no new pages for big chunks."""
    if x.numel() < _SHIFT_FROM:  # small (<= 256 KiB): the allocator's cached blocks, no new pages
        d = x - mean
        return float(d.sum()), float(torch.dot(d, d))
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get(x.dtype)
    if buf is None:
        buf = bufs[x.dtype] = torch.empty(_BLOCK, dtype=x.dtype)
    resid = m2 = 0.0
    for a in range(0, x.numel(), _BLOCK):
        part = x[a:a + _BLOCK]
        d = buf[:part.numel()]
        torch.sub(part, mean, out=d)
        resid += float(d.sum())
        m2 += float(torch.dot(d, d))
    return resid, m2
