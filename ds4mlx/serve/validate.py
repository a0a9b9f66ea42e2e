"""Every known field of a request body checked against its type, before parsing.

One JSON Schema per API (validated with the `jsonschema` library) lists the
fields the server reads, and those it refuses or ignores (serve/fields.py), with the
JSON types each may have; fields no API defines are ignored and `null` means absent
wherever a field is optional.  A well-typed field the server does not honour is then
a 400 naming it (`unsupported_parameter`).  The first
fault becomes one 400 that names the field by its path (`param` on the OpenAI
routes, `messages[0].content[1].text`; Anthropic spells it
`messages.0.content.1.text` in the message).  The same wording on every API.

Media parts (images, audio, files) are refused here with a 400 naming the part;
with a vision encoder loaded (`vision=True`) image parts pass on to chat/images.py,
which parses or refuses each one (docs/vision.md §1).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from jsonschema.validators import extend

from . import errors as E
from .fields import first_refused, place_types

# --- building blocks -------------------------------------------------------------------


def _t(*types: str) -> dict:
    return {"type": list(types) if len(types) > 1 else types[0]}


STR, NUM, BOOL, OBJ = _t("string", "null"), _t("number", "null"), _t("boolean", "null"), _t("object", "null")
INT = _t("integer", "null")  # a count or an id: 2.0 is 2, 2.5 is a 400 (never truncated)
ANY: dict = {}
STR_LIST = {"type": ["array", "null"], "items": {"type": "string"}}
STOP = {"type": ["string", "array", "null"], "items": {"type": "string"}}
MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "input_file": "file",
    "file": "file",
    "document": "document",
}
EFFORT = _t("string", "number", "null")  # numeric levels for numeric-effort families
THINKING = {
    "type": ["boolean", "object", "null"],
    "properties": {"type": {"enum": ["enabled", "disabled", "adaptive"]}, "budget_tokens": INT},
}


def _part(text_types: Iterable[str] | None = None, **more: dict) -> dict:
    """A content part object: `type` a string (or one of text_types), `text` a string."""
    props: dict = {
        "type": {"enum": sorted(set(text_types) | set(MEDIA_PARTS))} if text_types else _t("string"),
        "text": STR,
        **more,
    }
    return {"type": "object", "unsupported_media": True, "properties": props}


def _content(part: dict, *, strings: bool = True) -> dict:
    items = {"anyOf": [_t("string"), part]} if strings else part
    return {"type": ["string", "array", "null"], "items": items}


def _api(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": {
            "model": STR,
            "temperature": NUM,
            "top_p": NUM,
            "top_k": INT,
            "min_p": NUM,
            "seed": INT,
            "max_tokens": INT,
            "stream": BOOL,
            "ignore_eos": BOOL,
            "reasoning_effort": EFFORT,
            **properties,
        },
    }


# a structured-output format with name / schema beside type (Responses text.format, Anthropic output_format)
FLAT_FORMAT = {
    "type": ["object", "null"],
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "name": STR,
        "schema": OBJ,
        "strict": BOOL,
    },
}

OPENAI_SAMPLING = {
    "min_p": NUM,
    "seed": INT,
    "stop": STOP,
    "think": BOOL,
    "thinking": THINKING,
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": BOOL}},
    "n": INT,
    # structured output (serve/grammar.py)
    "response_format": {
        "type": ["object", "null"],
        "required": ["type"],
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": STR, "schema": OBJ, "strict": BOOL}},
        },
    },
    "guided_json": _t("object", "string", "null"),
    "guided_regex": STR,
    "guided_choice": STR_LIST,
    "guided_grammar": STR,
    "grammar": STR,
    "json_schema": OBJ,
    "frequency_penalty": NUM,
    "presence_penalty": NUM,
    "repetition_penalty": NUM,
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
}

# --- OpenAI chat completions ---------------------------------------------------------------
CHAT_PART = _part()
CHAT_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": STR,
        "type": STR,
        "function": {"type": "object", "properties": {"name": _t("string"), "arguments": ANY}},
    },
}
CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": _t("string"),
        "content": _content(CHAT_PART),
        "reasoning_content": _content(CHAT_PART),
        "name": STR,
        "tool_call_id": STR,
        "tool_calls": {"type": ["array", "null"], "items": CHAT_TOOL_CALL},
    },
}
# strict: the arguments held to the schema on a forced call, else a 400 (serve/grammar.py)
FUNCTION = {
    "type": "object",
    "properties": {"name": _t("string"), "description": STR, "parameters": OBJ, "strict": BOOL},
}
CHAT_TOOL = {"type": "object", "properties": {"type": STR, "function": FUNCTION, "name": STR}}
CHAT = _api(
    {
        "messages": {"type": "array", "items": CHAT_MESSAGE},
        "tools": {"type": ["array", "null"], "items": CHAT_TOOL},
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required", None]},
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["function"]},
                        "function": {"type": "object", "required": ["name"], "properties": {"name": _t("string")}},
                    },
                },
            ]
        },
        "max_completion_tokens": INT,
        "parallel_tool_calls": BOOL,
        "logprobs": BOOL,
        "top_logprobs": INT,
        **OPENAI_SAMPLING,
    }
)

# --- legacy completions -------------------------------------------------------------------
COMPLETIONS = _api(
    {
        "prompt": {"type": ["string", "array"], "items": {"type": "string"}},
        "logprobs": INT,
        "echo": BOOL,
        **OPENAI_SAMPLING,
    }
)

# --- Anthropic messages ------------------------------------------------------------------
ANTHROPIC_TEXT = _part(cache_control=OBJ)  # cache_control: accepted, ignored (caching is automatic)
ANTHROPIC_BLOCK = _part(
    thinking=STR,
    id=STR,
    tool_use_id=STR,
    name=STR,
    input=OBJ,
    signature=STR,
    content=_content(ANTHROPIC_TEXT),
    is_error=BOOL,
    cache_control=OBJ,
)
ANTHROPIC_MESSAGE = {"type": "object", "properties": {"role": _t("string"), "content": _content(ANTHROPIC_BLOCK)}}
ANTHROPIC_TOOL = {
    "type": "object",
    "properties": {
        "name": STR,
        "description": STR,
        "input_schema": OBJ,
        "type": STR,
        "cache_control": OBJ,
        "strict": BOOL,
    },
}
ANTHROPIC = _api(
    {
        "messages": {"type": "array", "items": ANTHROPIC_MESSAGE},
        "system": _content(ANTHROPIC_TEXT),
        "tools": {"type": ["array", "null"], "items": ANTHROPIC_TOOL},
        "tool_choice": {
            "type": ["object", "null"],
            "properties": {
                "type": {"enum": ["auto", "any", "tool", "none"]},
                "name": STR,
                "disable_parallel_tool_use": BOOL,
            },
        },
        "stop_sequences": STR_LIST,
        "thinking": THINKING,
        "metadata": OBJ,
        "output_config": {"type": ["object", "null"], "properties": {"effort": EFFORT}},
        "output_format": FLAT_FORMAT,
    }
)

# --- Responses -----------------------------------------------------------------------------
RESPONSES_TEXT = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
RESPONSES_PART = _part(RESPONSES_TEXT)
RESPONSES_ITEM_TYPES = [
    "message",
    "reasoning",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "local_shell_call",
    "local_shell_call_output",
    "web_search_call",
    "web_search_call_output",
    "tool_search_call",
    "tool_search_output",
    "tool_search_call_output",
    "image_generation_call",
    "image_generation_call_output",
    "compaction",
    "context_compaction",
]
RESPONSES_ITEM = {
    "type": "object",
    "properties": {
        "type": {"enum": RESPONSES_ITEM_TYPES},
        "role": _t("string"),
        "name": _t("string"),
        "namespace": _t("string"),
        "call_id": _t("string"),
        "id": _t("string"),
        "status": {"enum": ["completed", "incomplete", None]},
        "content": _content(RESPONSES_PART),
        "summary": _content(RESPONSES_PART),
        "arguments": ANY,
        "input": ANY,
        "output": ANY,
        "tools": ANY,
    },
}
_RESPONSES_FUNCTION = {"type": STR, "name": STR, "description": STR, "parameters": OBJ, "strict": BOOL}
RESPONSES_TOOL = {
    "type": "object",
    "properties": {  # a namespace's functions are tools too
        **_RESPONSES_FUNCTION,
        "tools": {"type": ["array", "null"], "items": {"type": "object", "properties": _RESPONSES_FUNCTION}},
    },
}
RESPONSES = _api(
    {
        "input": {"type": ["string", "array"], "items": RESPONSES_ITEM},
        "instructions": STR,
        "max_output_tokens": INT,
        "tools": {"type": ["array", "null"], "items": RESPONSES_TOOL},
        "tool_choice": {"type": ["string", "object", "null"]},
        "reasoning": {"type": ["object", "null"], "properties": {"effort": EFFORT, "summary": STR}},
        "previous_response_id": STR,
        "conversation": {"type": ["string", "object", "null"]},
        "parallel_tool_calls": BOOL,
        "store": BOOL,
        "stop": STOP,
        "text": {"type": ["object", "null"], "properties": {"format": FLAT_FORMAT}},
    }
)

# the fields the server refuses or ignores (serve/fields.py) are type-checked too
SCHEMAS = {
    api: place_types(copy.deepcopy(schema), api)
    for api, schema in {
        "chat": CHAT,
        "completions": COMPLETIONS,
        "anthropic": ANTHROPIC,
        "responses": RESPONSES,
    }.items()
}


# --- the validator ----------------------------------------------------------------------


def _media_check(accepted: frozenset):
    def check(validator, enabled, instance, schema):
        typ = instance.get("type") if enabled and isinstance(instance, dict) else None
        kind = MEDIA_PARTS.get(typ) if isinstance(typ, str) else None  # any other `type` is the type check's
        if kind is not None and kind not in accepted:
            yield ValidationError(f"unsupported {kind}", validator="unsupported_media")

    return check


_Validator = extend(Draft202012Validator, {"unsupported_media": _media_check(frozenset())})
_VisionValidator = extend(Draft202012Validator, {"unsupported_media": _media_check(frozenset({"image"}))})
_VALIDATORS = {api: _Validator(schema) for api, schema in SCHEMAS.items()}
_VISION_VALIDATORS = {api: _VisionValidator(schema) for api, schema in SCHEMAS.items()}
_JSON_TYPES = {
    "string": "a string",
    "number": "a number",
    "integer": "an integer",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
    "null": "null",
}


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    return "an array" if isinstance(v, list) else "an object"


def field_path(parts: Iterable, api: str) -> str:
    """(messages, 0, content) -> messages[0].content (Anthropic: messages.0.content)."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f".{p}" if api == "anthropic" else f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _expected(err: ValidationError) -> str:
    if err.validator == "type":
        types = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        return _either([_JSON_TYPES[t] for t in types])
    if err.validator == "anyOf":  # a string or a part object, a named choice or an object, ...
        names = []
        for sub in err.validator_value:
            types = sub.get("type", [])
            names += [repr(v) for v in sub.get("enum", []) if v is not None] + [
                _JSON_TYPES[t] for t in (types if isinstance(types, list) else [types])
            ]
        return _either(names)
    return "one of " + ", ".join(repr(v) for v in err.validator_value if v is not None)


def _error(err: ValidationError, api: str) -> E.APIError:
    path = list(err.absolute_path)
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else ""
        name = field_path(path + [missing], api)
        return E.APIError(400, E.missing_field(name), param=name, code="missing_required_parameter")
    name = field_path(path, api)
    if err.validator == "unsupported_media":
        return E.APIError(
            400, E.unsupported_part(name, err.message.split(" ", 1)[1]), param=name, code="unsupported_content"
        )
    if err.validator in ("type", "anyOf"):
        return E.APIError(
            400, E.invalid_type(name, _expected(err), _json_type(err.instance)), param=name, code="invalid_type"
        )
    return E.APIError(400, E.invalid_value(name, _expected(err), err.instance), param=name, code="invalid_value")


def _accepts(schema: dict, value: Any) -> bool:
    """Whether a branch of an anyOf is meant for a value of this JSON type."""
    types = schema.get("type")
    if types is None:  # a list of named values (strings)
        return "enum" in schema and isinstance(value, str)
    types = types if isinstance(types, list) else [types]
    return _json_type(value) in (_JSON_TYPES[t] for t in types)


def _most_telling(err: ValidationError) -> ValidationError:
    """Inside an anyOf (a string or a part object, ...), the fault of the branch
    meant for the value's JSON type; the anyOf itself when no branch is."""
    while err.validator == "anyOf" and err.context:
        meant = [e for e in err.context if _accepts(err.validator_value[e.relative_schema_path[0]], err.instance)]
        if not meant:
            break
        err = max(meant, key=_relevance)
    return err


def _relevance(err: ValidationError):
    # the deepest fault first; a media part over the other faults of the same part
    return (len(err.absolute_path), err.validator == "unsupported_media", err.validator == "type")


def validate_body(api: str, body: Any, vision: bool = False) -> None:
    """Raise the APIError (400) for the first wrongly typed field of `body`, then for the
    first field the server does not honour (serve/fields.py); image parts are refused
    unless `vision` (a vision encoder is loaded)."""
    errs = [_most_telling(e) for e in (_VISION_VALIDATORS if vision else _VALIDATORS)[api].iter_errors(body)]
    if errs:
        raise _error(max(errs, key=_relevance), api)
    refused = first_refused(api, body)
    if refused is not None:
        name = field_path(refused, api)
        raise E.APIError(400, E.unsupported_field(name), param=name, code="unsupported_parameter")
