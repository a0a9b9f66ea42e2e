"""The request fields an API defines that the server does not act on (docs/http-api.md §10).

Two kinds, one table per API:

* refused: a value that asks for behaviour the server does not implement is a 400
  naming the field (`unsupported_parameter`); the API's own default, the `neutral`
  values (`n: 1`, `logprobs: false`, ...), asks for nothing and passes, so clients that
  send the defaults keep working;
* ignored: advisory fields the official API itself treats as hints or bookkeeping
  (`user`, `metadata`, `store`, ...): type-checked, then accepted and not acted on.

Every entry's JSON type is checked by serve/validate.py (a wrong type is a 400 naming
the field before the refusal).  A path's `[]` stands for every item of an array.
Fields no API defines stay ignored, as ds4 ignores unknown fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

REFUSED, IGNORED = "refused", "ignored"


def _t(*types: str) -> dict:
    return {"type": [*types, "null"]}


NUM, INT, BOOL, STR, OBJ, ARR = _t("number"), _t("integer"), _t("boolean"), _t("string"), _t("object"), _t("array")
STRS = {"type": ["array", "null"], "items": {"type": "string"}}
INTS = {"type": ["array", "null"], "items": {"type": "integer"}}
STR_OR_STRS = {"type": ["string", "array", "null"], "items": {"type": "string"}}


@dataclass(frozen=True)
class Field:
    path: str  # "n", "stream_options.include_obfuscation", "tools[].function.strict"
    schema: dict  # the JSON types the field may have (null = absent)
    status: str = REFUSED
    neutral: tuple = ()  # values that ask for nothing (the API's default): accepted
    allow: Callable[[Any], bool] | None = None  # or: a test of the values that pass


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _f(path: str, schema: dict, *neutral: Any) -> Field:
    return Field(path, schema, REFUSED, neutral)


def _ignored(path: str, schema: dict) -> Field:
    return Field(path, schema, IGNORED)


# Advisory on every OpenAI route: bookkeeping, abuse monitoring, caching and tier hints.
_OPENAI_ADVISORY = [
    _ignored("user", STR),
    _ignored("metadata", OBJ),
    _ignored("store", BOOL),
    _ignored("safety_identifier", STR),
    _ignored("prompt_cache_key", STR),
    _ignored("prompt_cache_retention", STR),
    _ignored("service_tier", STR),
]
# vLLM's and llama.cpp's extensions of both OpenAI routes that would change the output.
_EXTENSIONS = [
    _f("min_tokens", INT, 0),
    _f("stop_token_ids", INTS, []),
    _f("use_beam_search", BOOL, False),
    _f("typical_p", NUM, 1),
    _f("n_probs", INT, 0),
    _f("mirostat", INT, 0),
]

TABLE: dict[str, list[Field]] = {
    "chat": [
        *_OPENAI_ADVISORY,
        _ignored("stream_options.include_obfuscation", BOOL),
        _f("audio", OBJ),
        _f("modalities", STRS, ["text"]),
        _f("prediction", OBJ),
        _f("web_search_options", OBJ),
        _f("verbosity", STR, "medium"),
        _f("functions", ARR, []),
        _f("function_call", {"type": ["string", "object", "null"]}),
        _f("best_of", INT, 1),
        *_EXTENSIONS,
    ],
    "completions": [
        *_OPENAI_ADVISORY,
        _ignored("stream_options.include_obfuscation", BOOL),
        _f("best_of", INT, 1),
        _f("suffix", STR, ""),
        *_EXTENSIONS,
    ],
    "anthropic": [
        _ignored("metadata", OBJ),
        _ignored("service_tier", STR),
        _f("container", {"type": ["string", "object", "null"]}),
        _f("context_management", OBJ),
        _f("mcp_servers", ARR, []),
    ],
    "responses": [
        *_OPENAI_ADVISORY,
        _ignored("stream_options.include_obfuscation", BOOL),
        # reasoning.encrypted_content asks for reasoning to replay statelessly; the server
        # continues from its live KV or the replayed history instead (docs/kv-cache.md §2)
        Field(
            "include",
            STRS,
            REFUSED,
            allow=lambda v: isinstance(v, list) and all(i == "reasoning.encrypted_content" for i in v),
        ),
        _f("text.verbosity", STR, "medium"),
        _f("top_logprobs", INT, 0),
        _f("truncation", STR, "disabled"),
        _f("max_tool_calls", INT),
        _f("background", BOOL, False),
        _f("prompt", OBJ),
    ],
}


def _split(path: str) -> list[str]:
    out: list[str] = []
    for part in path.split("."):
        if part.endswith("[]"):
            out += [part[:-2], "[]"]
        else:
            out.append(part)
    return out


def values(body: Any, path: str) -> Iterator[tuple[list, Any]]:
    """(concrete path, value) of every non-null value at `path` in body."""

    def walk(node: Any, parts: list[str], at: list) -> Iterator[tuple[list, Any]]:
        if not parts:
            if node is not None:
                yield at, node
            return
        head, rest = parts[0], parts[1:]
        if head == "[]":
            if isinstance(node, list):
                for i, item in enumerate(node):
                    yield from walk(item, rest, [*at, i])
        elif isinstance(node, dict) and head in node:
            yield from walk(node[head], rest, [*at, head])

    yield from walk(body, _split(path), [])


def passes(field: Field, value: Any) -> bool:
    """A refused field's value that asks for nothing the server lacks."""
    if field.allow is not None:
        return field.allow(value)
    return any(_same(value, n) for n in field.neutral)


def first_refused(api: str, body: Any) -> list | None:
    """The path of the first field in body the server refuses, or None."""
    for field in TABLE[api]:
        if field.status != REFUSED:
            continue
        for at, value in values(body, field.path):
            if not passes(field, value):
                return at
    return None


def place_types(schema: dict, api: str) -> dict:
    """The API's JSON Schema with every table field's types added at its path."""
    for field in TABLE[api]:
        node = schema
        parts = _split(field.path)
        for part in parts[:-1]:
            if part == "[]":
                node = node.setdefault("items", {"type": "object"})
            else:
                node = node.setdefault("properties", {}).setdefault(part, {"type": ["object", "null"]})
        node.setdefault("properties", {})[parts[-1]] = field.schema
    return schema
