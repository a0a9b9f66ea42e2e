"""What a model name means on the hub: a catalogue name (catalogue.py), `org/repo` or
`org/repo:FILE-OR-PATTERN`, the files it selects, and which local path in a repository's
snapshot is the model to load.  No network, no huggingface_hub import: cli.py asks
`is_hub_name` on every command that takes a model."""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..io.split_names import SPLIT_GGUF, part_name
from .catalogue import CATALOGUE

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
MODEL_SUFFIXES = (".gguf", ".safetensors")


class HubError(Exception):
    """A hub name, download or cache problem: str() is one line."""


@dataclass(frozen=True)
class Spec:
    name: str  # as written
    repo: str
    patterns: tuple[str, ...]  # file names or glob patterns; () = the whole repository
    exact: bool  # the patterns are exact names (a catalogue entry)
    support: bool = False  # a support file (the MTP head), not a model

    def selects(self, filename: str) -> bool:
        if not self.patterns:
            return True
        base = filename.rsplit("/", 1)[-1]
        return any(
            filename == p or fnmatch.fnmatchcase(filename, p) or fnmatch.fnmatchcase(base, p) for p in self.patterns
        )


def is_hub_name(name) -> bool:
    """`name` is not a local path but a catalogue name or `org/repo[:pattern]`.  A missing
    local file with a model suffix (`models/x.gguf`) stays a path: its error is the loader's."""
    if name is None:
        return False
    name = os.fspath(name)
    if os.path.exists(name) or name.startswith(("/", ".", "~")):
        return False
    if name in CATALOGUE:
        return True
    repo, colon, pattern = name.partition(":")
    if not HUB_ID.fullmatch(repo) or (colon and not pattern):
        return False
    return bool(colon) or not repo.lower().endswith(MODEL_SUFFIXES)


def parse(name: str) -> Spec:
    if name in CATALOGUE:
        e = CATALOGUE[name]
        return Spec(name, e.repo, e.files, exact=bool(e.files), support=e.support)
    if not is_hub_name(name):
        raise HubError(f"{name!r} is neither a catalogue name ({', '.join(CATALOGUE)}) nor org/repo[:file]")
    repo, _, pattern = name.partition(":")
    return Spec(name, repo, (pattern,) if pattern else (), exact=False)


def split_parts(filename: str, available) -> list[str]:
    """Every part of the split GGUF `filename` belongs to that is in `available`
    (just [filename] for a file that is not a split part)."""
    m = SPLIT_GGUF.match(filename)
    if not m:
        return [filename]
    count = int(m["count"])
    names = [part_name(m["stem"], i, count) for i in range(1, count + 1)]
    return [n for n in names if n in set(available)]


def select(spec: Spec, filenames) -> list[str]:
    """The repository files `spec` asks for, a split GGUF whole."""
    filenames = list(filenames)
    if spec.exact:
        missing = [p for p in spec.patterns if p not in filenames]
        if missing:
            raise HubError(f"{spec.repo} has no file {missing[0]}")
    chosen = [f for f in filenames if spec.selects(f)]
    if not chosen:
        raise HubError(f"no file of {spec.repo} matches {':'.join(spec.patterns)!r}")
    out: list[str] = []
    for f in chosen:
        out += [p for p in split_parts(f, filenames) if p not in out]
    return sorted(out)


def _is_support(filename: str) -> bool:
    return "mtp" in filename.rsplit("/", 1)[-1].lower()


def pick_model(folder: Path, spec: Spec) -> Path:
    """The path to load in a repository snapshot: a Hugging Face folder (config.json and
    safetensors), the one GGUF the spec selects (a split's first part), or a one-line error
    naming the candidates."""
    folder = Path(folder)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    chosen = [f for f in files if spec.selects(f)]
    if not spec.patterns and "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return folder
    ggufs = [f for f in chosen if f.endswith(".gguf")]
    firsts = sorted({split_parts(f, files)[0] for f in ggufs})
    models = [f for f in firsts if not _is_support(f)] or firsts
    if spec.support and len(firsts) == 1:
        models = firsts
    if len(models) == 1:
        return folder / models[0]
    if not models and len(chosen) == 1:
        return folder / chosen[0]
    if not models:
        raise HubError(f"{spec.name}: no model file (GGUF, or config.json + safetensors) in the local copy {folder}")
    raise HubError(
        f"{spec.name}: {len(models)} models in {spec.repo} ({', '.join(models[:4])}{', ...' if len(models) > 4 else ''}); "
        f"name one: {spec.repo}:FILE"
    )


__all__ = ["HubError", "Spec", "is_hub_name", "parse", "select", "split_parts", "pick_model"]
