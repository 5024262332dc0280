"""Running the app under uvicorn (shared by `datastates serve` and `python -m server`)."""

from __future__ import annotations

import argparse
import os
import sys

from .app import ENV_CORS, ENV_HOT, ENV_STORE, ENV_TOKEN_FILE, read_token_file

MAX_REQUEST_HEAD = 512 * 1024
"""Bytes of a request line and headers uvicorn's h11 protocol reads. Its 16 KiB default is below a query the
routes accept (a filter of 8,192 characters is up to 98 KB percent-encoded): such a request got h11's own
plain-text 400, which no route documents, instead of the route's answer."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--token-file", default=None,
                   help="file holding the bearer token that write endpoints require; without it writes answer 403")
    p.add_argument("--workers", type=int, default=1, help="worker processes, each opening the store (default 1)")
    p.add_argument("--cors-origin", default=None, help="the one browser origin allowed to call the API (default none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def serve(args: argparse.Namespace) -> int:
    """Check the arguments, then run uvicorn until interrupted. Returns the exit status."""
    import uvicorn

    import datastates as ds

    if not args.store:
        print("datastates serve: no store given; pass --store PATH or set DATASTATES_STORE", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"datastates serve: --workers {args.workers} must be 1 or more", file=sys.stderr)
        return 2
    try:
        hot = getattr(args, "hot", None)
        ds.Store.open(args.store, create=False, hot=hot, record_tiers=False).close()  # here once, not per worker
        if args.token_file:
            read_token_file(args.token_file)
    except ds.DataStatesError as exc:
        print(f"datastates serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    os.environ[ENV_STORE] = str(args.store)
    if hot:
        os.environ[ENV_HOT] = os.path.abspath(hot)
    else:
        os.environ.pop(ENV_HOT, None)
    # Workers read the token from the file themselves: the token never travels in the environment.
    if args.token_file:
        os.environ[ENV_TOKEN_FILE] = os.path.abspath(args.token_file)
    else:
        os.environ.pop(ENV_TOKEN_FILE, None)
    if args.cors_origin:
        os.environ[ENV_CORS] = args.cors_origin
    else:
        os.environ.pop(ENV_CORS, None)
    uvicorn.run("server.app:app_from_env", factory=True, host=args.host, port=args.port, workers=args.workers,
                log_level=args.log_level, access_log=False, h11_max_incomplete_event_size=MAX_REQUEST_HEAD)
    return 0
