"""`-m org/repo` (or a catalogue name) on every command: the copy in the local hub cache,
found without the network; when there is none, a download after asking (`--yes` skips
the question; without a terminal and without --yes the command stops with one line)."""

from __future__ import annotations

import sys

from .spec import HubError, is_hub_name, parse

GB = 1e9
MODEL_ARGS = ("model", "file")  # the flags that name a model (`-m`, inspect's FILE)


def resolve(name: str, yes: bool = False, ask=input, say=None) -> str:
    """A local path for `name`: itself when it is no hub name, else its cached copy, else a
    pull (asked first unless `yes`)."""
    if not is_hub_name(name):
        return name
    from . import download

    spec = parse(name)
    local = download.cached(spec)
    if local is not None:
        return str(local)
    if download.offline():
        raise HubError(f"{name}: not in the local hub cache and HF_HUB_OFFLINE is set")
    say = say or (lambda m: print(m, file=sys.stderr))
    if not yes:
        if not sys.stdin.isatty():
            raise HubError(f"{name}: not in the local hub cache; `ds4mlx pull {name}` (or --yes) downloads it")
        p = download.plan(spec)
        answer = ask(
            f"{name} is not here: download {p.to_fetch / GB:.1f} GB from {spec.repo} into {p.cache_dir}? [y/N] "
        )
        if answer.strip().lower() not in ("y", "yes"):
            raise HubError(f"{name}: not downloaded")
    return str(download.pull(spec, say=say))


def resolve_args(args) -> None:
    """Replace a hub name in the command's model flag by its local path."""
    if getattr(args, "endpoint", None):  # eval against a server: -m is the served model's name
        return
    for attr in MODEL_ARGS:
        value = getattr(args, attr, None)
        if isinstance(value, str) and is_hub_name(value):
            setattr(args, attr, resolve(value, yes=bool(getattr(args, "yes", False))))


__all__ = ["resolve", "resolve_args", "MODEL_ARGS", "HubError"]
