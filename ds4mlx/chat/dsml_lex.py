"""DSML lexical primitives shared by the decode tracker, the final parser and tool memory.

C-locale whitespace, DSML entity decoding, tag attribute lookup and the tool-result escape.
DSML is the tool-call format of the DeepSeek V4 and V4.1 families (docs/dsml.md); its markers
live in chat/markers.py.
Strings are Python `str`; positions are character indices.
"""

from __future__ import annotations

import re

from . import markers as M
from .jsontext import C_SPACE, rstrip_ws, skip_ws  # noqa: F401  (re-exported to the DSML parsers)
from .markers import DsmlSyntax

_FULL = M.DSML_FULL


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


def escape_tool_result(s: str) -> str:
    """Tool result text: verbatim except the leading `<` of `</tool_result>`."""
    return s.replace(M.TOOL_RESULT_CLOSE, M.PARAM_CLOSE_TEXT_ESCAPE + M.TOOL_RESULT_CLOSE[1:])
