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
- every file lives in one fresh directory (under `--store`, default the current directory), removed
  at the end; other methods' files are deleted right after they are timed;
- the CPU time other processes used during each timed step is measured and reported, since a busy
  machine makes the figures noisy;
- each ratio is printed with its target and PASS/MISS; a missed target is reported, never hidden.

This module's top level imports only the standard library: the CLI imports it at every start.
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    if cfg.rss:
        rep = run_rss(cfg)
        print_rss_report(rep, table)
    else:
        rep = run(cfg)
        print_report(rep, table)
    if args.json_out:
        text = json.dumps(rep, indent=2)
        if args.json_out == "-":
            print(text)
        else:
            Path(args.json_out).write_text(text + "\n")
    return 0


__all__ = ["SKIPPABLE", "TARGETS", "Config", "add_parser", "command_line", "config_from_args", "main", "make_state",
           "parse_size", "print_report", "print_rss_report", "run", "run_rss"]
