"""`datastates bench` (being written)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    sub.add_parser("bench", help="measure save/load against torch.save, safetensors and DCP")


def main(args: argparse.Namespace) -> int:
    raise SystemExit("datastates bench is not available yet")
