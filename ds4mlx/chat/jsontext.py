"""JSON text as the prompts and the wire write it, family-neutral.

ds4's string escaping (docs/http-api.md §1.3), the two prompt styles of a parsed JSON value
(canonical and compact), ds4's lenient minifier and flat-object reader, and a parsed call's
arguments as an object.  The chat families, the HTTP adapters, request preparation and the
agent import them from here.
"""

from __future__ import annotations

import json
import re
from json.decoder import scanstring

C_SPACE = " \t\n\v\f\r"  # C isspace() in the "C" locale


def skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in C_SPACE:
        i += 1
    return i


def rstrip_ws(s: str) -> str:
    return s.rstrip(C_SPACE)


# docs/http-api.md §1.3: '"' '\\' LF CR TAB escaped, other bytes < 0x20 as \u00xx, the rest raw.
_ESCAPE_TABLE = {c: "\\u%04x" % c for c in range(0x20)}
_ESCAPE_TABLE.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})


def json_escape_fragment(s: str) -> str:
    """ds4's string escaping, without the surrounding quotes."""
    return s.translate(_ESCAPE_TABLE)


def json_escape(s: str) -> str:
    """ds4's JSON string literal (differs from Python's only for \\b and \\f)."""
    return '"' + s.translate(_ESCAPE_TABLE) + '"'


def dumps_compact(obj) -> str:
    """Compact JSON, no spaces, UTF-8 kept raw, strings escaped like ds4."""
    if isinstance(obj, str):
        return json_escape(obj)
    if isinstance(obj, dict):
        return "{" + ",".join(json_escape(str(k)) + ":" + dumps_compact(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(dumps_compact(v) for v in obj) + "]"
    return json.dumps(obj)  # numbers, booleans, null


def dumps_canonical(obj) -> str:
    """The issue's canonical schema text: key order kept, Python default separators, raw UTF-8."""
    return json.dumps(obj, ensure_ascii=False)


def json_text(obj, style: str = "canonical") -> str:
    """Serialize a parsed JSON value in one of the two prompt styles."""
    if style == "canonical":
        return dumps_canonical(obj)
    if style == "compact":
        return dumps_compact(obj)
    raise ValueError(f"unknown JSON style {style!r}")


_DECODER = json.JSONDecoder(strict=False)
_STRING_OR_WS = re.compile(r'("(?:[^"\\]|\\.)*")|[ \t\n\r\f\v]+', re.S)


def _minify_slice(raw: str) -> str:
    return _STRING_OR_WS.sub(lambda m: m.group(1) or "", raw)


def minify_json(text: str) -> str | None:
    """The first JSON value of `text` with whitespace outside strings removed.

    Trailing bytes after that value are dropped (as ds4's minifier does); None if
    no valid value starts there."""
    i = skip_ws(text, 0)
    try:
        _, end = _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None
    return _minify_slice(text[i:end])


def parse_flat_object(text: str) -> list[tuple[str, str, bool]] | None:
    """Parse a JSON object as a flat member list `(key, value, is_string)`.

    String values are unescaped; other values keep their source text, minified.
    Duplicate keys are kept in order.  Lenient like ds4's parser: commas between
    members are optional, a trailing comma and bytes after `}` are accepted.
    None if `text` is not an object."""
    n = len(text)
    i = skip_ws(text, 0)
    if i >= n or text[i] != "{":
        return None
    i = skip_ws(text, i + 1)
    members: list[tuple[str, str, bool]] = []
    try:
        while i < n and text[i] != "}":
            if text[i] != '"':
                return None
            key, i = scanstring(text, i + 1, False)
            i = skip_ws(text, i)
            if i >= n or text[i] != ":":
                return None
            i = skip_ws(text, i + 1)
            if i < n and text[i] == '"':
                value, i = scanstring(text, i + 1, False)
                members.append((key, value, True))
            else:
                _, end = _DECODER.raw_decode(text, i)
                members.append((key, _minify_slice(text[i:end]), False))
                i = end
            i = skip_ws(text, i)
            if i < n and text[i] == ",":
                i = skip_ws(text, i + 1)
    except (ValueError, RecursionError):
        return None
    if i >= n:
        return None
    return members


def call_input(arguments_json: str) -> dict:
    """The arguments of a parsed call as a JSON object (Anthropic `input`, docs/dsml.md §6)."""
    try:
        obj = json.loads(arguments_json)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}
