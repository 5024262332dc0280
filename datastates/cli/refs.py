"""Commands that list, create and delete refs: tag, branch."""

from __future__ import annotations

import argparse
import fnmatch
from typing import Any

from ..store import Store


def register(sub: Any) -> None:
    for kind in ("tag", "branch"):
        s = sub.add_parser(kind, help=f"list, create or delete {kind}{'es' if kind == 'branch' else 's'}")
        s.add_argument("name", nargs="?", help=f"the {kind} to create (none: list them; with -l: a glob "
                       "pattern the listed names match)")
        s.add_argument("ref", nargs="?", default="main", help="the version it names (default main)")
        s.add_argument("-l", "--list", action="store_true",
                       help=f"list {kind}{'es' if kind == 'branch' else 's'} (as git: NAME is then a glob pattern)")
        s.add_argument("-d", "--delete", metavar="NAME", help=f"delete {kind} NAME")
        if kind == "tag":
            s.add_argument("-m", "--message", help="a message stored with the tag")
        else:
            s.add_argument("-f", "--force", action="store_true",
                           help="move an existing branch; with -d, delete a branch no other ref reaches")
            s.add_argument("-D", dest="force_delete", metavar="NAME", help="delete branch NAME even if no other "
                           "ref reaches its versions (same as -d NAME --force)")
        s.set_defaults(handler=_tag if kind == "tag" else _branch)


def _list(names: dict[str, str], pattern: str | None) -> int:
    """Print `name<TAB>short id` for each ref whose name matches the glob `pattern` (all when None)."""
    for name, vid in names.items():
        if pattern is None or fnmatch.fnmatchcase(name, pattern):
            print(f"{name}\t{vid[:12]}")
    return 0


def _tag(store: Store, args: argparse.Namespace) -> int:
    # `is not None`, not truth: an empty name given is refused by name, not read as "list them".
    if args.delete is not None:
        vid = store.delete_tag(args.delete)
        print(f"deleted tag {args.delete} (was {vid[:12]})")
    elif args.list or args.name is None:
        return _list(store.tags(), args.name)
    else:
        vid = store.tag(args.name, args.ref, args.message or "")
        print(f"tag {args.name} -> {vid[:12]}")
    return 0


def _branch(store: Store, args: argparse.Namespace) -> int:
    if args.delete is not None or args.force_delete is not None:
        name = args.delete if args.delete is not None else args.force_delete
        vid = store.delete_branch(name, force=args.force or args.force_delete is not None)
        print(f"deleted branch {name} (was {vid[:12]})")
    elif args.list or args.name is None:
        return _list(store.branches(), args.name)
    else:
        vid = store.branch(args.name, at=args.ref, force=args.force)
        print(f"branch {args.name} -> {vid[:12]}")
    return 0
