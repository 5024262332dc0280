"""`python -m server --store PATH [--host 127.0.0.1] [--port 8080] [--token-file F] [--workers N]`."""

from __future__ import annotations

import argparse
import os
import sys

from .serve import add_arguments, serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server", description="Serve a DataStates store over REST.")
    p.add_argument("--store", default=os.environ.get("DATASTATES_STORE"), help="store directory")
    add_arguments(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
