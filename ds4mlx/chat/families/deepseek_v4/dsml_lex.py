"""DSML lexical primitives shared by the decode tracker and the final parser.

C-locale whitespace, DSML entity decoding and tag attribute lookup.
Strings are Python `str`; positions are character indices.
"""

from __future__ import annotations

import re

from ... import markers as M
from ...markers import DsmlSyntax

_FULL = M.DSML_FULL

C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in C_SPACE:
        i += 1
    return i


def rstrip_ws(s: str) -> str:
    return s.rstrip(C_SPACE)


# =============================================================================
# Entities and attributes
# =============================================================================

_ENTITY_MAP = dict(M.DSML_ENTITIES)
_ENTITY_RE = re.compile("|".join(re.escape(e) for e, _ in M.DSML_ENTITIES))


def decode_entities(s: str, mode: str = "all", syn: DsmlSyntax = _FULL) -> str:
    """Decode DSML entities in a string value.

    mode "all": the five XML entities, single left-to-right pass (ds4).
    mode "close": only the escaped closing parameter tag (the one escape the
    renderer writes), so literal `&amp;` etc. round-trip unchanged."""
    if "&" not in s:
        return s
    if mode == "all":
        return _ENTITY_RE.sub(lambda m: _ENTITY_MAP[m.group()], s)
    if mode == "close":
        return s.replace(M.PARAM_CLOSE_TEXT_ESCAPE + syn.param_close[1:], syn.param_close)
    raise ValueError(f"unknown entity mode {mode!r}")


def entity_modes(mode: str, syn: DsmlSyntax) -> tuple[str, ...]:
    if mode == "all":
        return tuple(e for e, _ in M.DSML_ENTITIES)
    return (M.PARAM_CLOSE_TEXT_ESCAPE + syn.param_close[1:],)


def attr(tag: str, name: str) -> str | None:
    """Attribute value found by substring search for `name="` (entity-decoded), or None."""
    pat = name + '="'
    i = tag.find(pat)
    if i < 0:
        return None
    i += len(pat)
    j = tag.find('"', i)
    if j < 0:
        return None
    return decode_entities(tag[i:j], "all")
