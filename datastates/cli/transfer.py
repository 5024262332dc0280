"""Commands that move checkpoints in and out of a store: import, export."""

from __future__ import annotations

import argparse
from typing import Any

from ..base.config import human_bytes
from ..ecosystem.transfer import export, import_checkpoints
from ..save.foreign import FORMATS
from ..store import Store
from .output import one_line


def register(sub: Any) -> None:
    p = sub.add_parser("import", help="import checkpoints (torch.save, safetensors, DCP, HF Trainer) as a branch")
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint files or directories")
    p.add_argument("--branch", default="imported", help="branch to import into (default: imported)")
    p.add_argument("--glob", default=None, help="search directories with this glob, e.g. '*.pt'")
    p.add_argument("--step-from", default=None, metavar="REGEX", help=r"take the step from the path, e.g. 'step=(\d+)'")
    p.add_argument("--allow-pickle", action="store_true", help="allow files that need full pickle (trusted only)")
    p.set_defaults(handler=_import)
    p = sub.add_parser("export", help="write a version as safetensors, a torch.save file or a DCP directory")
    p.add_argument("ref", help="the version: id, prefix, branch, tag or REF~N")
    p.add_argument("out", help="the file (safetensors, torch) or directory (dcp) to write")
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--allow-pickle", action="store_true",
                   help="export a version holding values saved with pickle (reading them runs code; trusted only)")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="of a version saved by several ranks, export rank R's entries (required there)")
    p.set_defaults(handler=_export)


def _import(store: Store, args: argparse.Namespace) -> int:
    rep = import_checkpoints(store, args.paths, branch=args.branch, glob=args.glob, step_from=args.step_from,
                             allow_pickle=args.allow_pickle)
    for v in rep.versions:
        print(f"{v.short}  step={v.step}  {one_line(v.message)}")
    print(f"{len(rep.versions)} version(s) on {args.branch}; {human_bytes(rep.bytes_total)} as saved, "
          f"{human_bytes(rep.bytes_new)} new ({human_bytes(rep.bytes_saved)} saved by dedup)")
    return 0


def _export(store: Store, args: argparse.Namespace) -> int:
    print(export(store, args.ref, args.format, args.out, allow_pickle=args.allow_pickle, rank=args.rank))
    return 0
