"""Saves forever into a tiered store, printing `<pid> COMMITTED <id> <step>` after each durable save.

Run as: python tiered_saver.py COLD HOT START_STEP
"""

from __future__ import annotations

import os
import sys

import torch

import datastates as ds


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(512 * 1024, generator=g), "small": torch.full((16,), float(step))}


def main() -> None:
    cold, hot, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = ds.Store.open(cold, hot=hot, flush=ds.Flush(every=1))
    step = start
    while True:
        v = store.save(state(step), step=step)
        # one write(2) with our pid first, the line format tests/helpers/procs.Lines reads
        os.write(1, f"{os.getpid()} COMMITTED {v.id} {step}\n".encode())
        step += 1


if __name__ == "__main__":
    main()
