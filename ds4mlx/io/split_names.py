"""llama.cpp's split GGUF names (gguf-split, gguf-py's GGUFWriter): NAME-00001-of-00003.gguf.
One home for the pattern: the GGUF reader joins the parts (weights.py), the hub takes a
split whole (hub/spec.py).  Standard library only."""

from __future__ import annotations

import re

SPLIT_GGUF = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(stem: str, no: int, count: int) -> str:
    """The file name of part `no` (1-based) of `count`."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


__all__ = ["SPLIT_GGUF", "part_name"]
