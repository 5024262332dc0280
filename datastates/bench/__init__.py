"""`datastates bench`: one state saved and loaded by datastates, torch.save, safetensors and DCP.

    datastates bench                          # 1 GiB state, 32 tensors, 5 repeats, every method
    datastates bench --quick --skip dcp       # 64 MiB, 2 repeats (what the tests run)
    datastates bench --json-out bench.json    # also write every sample as JSON ("-" = stdout)
    datastates bench --rss --shape cnn        # peak RSS of each save and load, each in a fresh process

What a run guarantees:
- every method sees the same state, allocated once and mutated in place (`add_(1)`) before every
  full save, so no method (datastates' dedup in particular) can skip bytes that a training step
  would have changed; the report checks that each datastates full save wrote every chunk anew;
- methods are interleaved inside each repeat and every timed step follows the same warm-up (garbage
  collection, a copy of the state into a scratch copy, and a touch of the method's own reusable
  buffers), so drift of the machine hits every method alike; medians are reported;
- loads start cold: the files are read once, untimed, then dropped from the page cache (posix_fadvise), so every
  loader starts alike however its files were written (`peers.cold_start`); each load ends with one read per
  page of the result, so lazy (mmap) loaders pay for their reads too;
- each load's result is checked bit-exact against the saved state once (a fast wrong answer is no result);
- every file lives in one fresh directory (under `--dir`, default the current directory), removed
  at the end; other methods' files are deleted right after they are timed;
- the CPU time other processes used during each timed step is measured and reported, since a busy
  machine makes the figures noisy;
- each ratio is printed with its target and PASS/MISS; a missed target is reported, never hidden.

This module's top level imports only the standard library: the CLI imports it at every start.
"""


from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from .options import SKIPPABLE, TARGETS, Config, add_parser, command_line, config_from_args, parse_size
from .peers import make_state
from .report import print_report
from .rss import print_rss_report, run_rss
from .runner import run


def main(args: argparse.Namespace) -> int:
    """Run `datastates bench`; 0 when it ran (missed targets included: they are results), 2 for bad options."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"datastates bench: {exc}", file=sys.stderr)
        return 2
    # With the JSON on stdout, the table goes to stderr so stdout stays parseable.
    table = sys.stderr if args.json_out == "-" else sys.stdout
    with _stopped_cleanly():
        rep = run_rss(cfg) if cfg.rss else run(cfg)
    if cfg.rss:
        print_rss_report(rep, table)
    else:
        print_report(rep, table)
    if args.json_out:
        text = json.dumps(rep, indent=2)
        if args.json_out == "-":
            print(text)
        else:
            Path(args.json_out).write_text(text + "\n")
    return 0


@contextmanager
def _stopped_cleanly() -> Iterator[None]:
    """SIGTERM and SIGHUP (`timeout`, `kill`, a batch scheduler's time limit, a closed terminal) end the run as
    Ctrl-C does, by an exception in the main thread, so the run's `finally` removes its files: killed by the default
    action, a run left its directory behind, hidden (`.datastates-bench-*`) and holding several states' worth of
    bytes. A signal someone set to be ignored (`nohup`) stays ignored. Exits with 128 + the signal's number."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        print(f"datastates bench: stopped by {signal.Signals(signum).name}; removing the run's files",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    before: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            before[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


__all__ = ["SKIPPABLE", "TARGETS", "Config", "add_parser", "command_line", "config_from_args", "main", "make_state",
           "parse_size", "print_report", "print_rss_report", "run", "run_rss"]
