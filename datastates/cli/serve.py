"""`datastates serve`: the REST server (server/ package, FastAPI + uvicorn) over a store.

Registered in the CLI through `register(sub)`; `server` is imported only when
the command runs, so the library needs no web dependencies.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add the `serve` parser to argparse's subparsers object (standalone: it opens the store itself)."""
    p = sub.add_parser("serve", help="serve the store over REST (see docs/server.md)")
    try:
        from server.serve import add_arguments
    except ImportError:  # without the server extra: the command exists and says what to install
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(standalone=_missing)
        return
    add_arguments(p)
    p.set_defaults(standalone=_run)


def _run(args: argparse.Namespace) -> int:
    from server.serve import serve

    return serve(args)


def _missing(args: argparse.Namespace) -> int:
    print("datastates serve: the server package or its dependencies are missing; "
          "install them with `pip install 'datastates[server]'`")
    return 2
