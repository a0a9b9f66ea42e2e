"""`ds4mlx pull NAME`: download a model into the local hub cache, verified (download.py).
NAME: a catalogue name (`ds4mlx pull` lists them: ds4's quantizations, the MTP head, the
official checkpoints) or `org/repo[:file-or-glob]`.  Prints the local path to pass to -m."""

from __future__ import annotations

import sys

from .spec import HubError


def add_arguments(p) -> None:
    p.add_argument("name", nargs="?", help="catalogue name or org/repo[:file-or-glob] (none: list the catalogue)")


def run(args) -> int:
    from .catalogue import describe

    if not args.name:
        print("ds4mlx pull NAME, NAME one of (or any org/repo[:file-or-glob] on the hub):")
        print("\n".join(describe()))
        return 0
    from . import download
    from .spec import parse

    try:
        spec = parse(args.name)
        local = download.cached(spec) if download.offline() else None  # offline: what is here already
        path = local or download.pull(spec, say=lambda m: print(m, file=sys.stderr))
    except HubError as e:
        print(f"ds4mlx pull: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


__all__ = ["add_arguments", "run"]
