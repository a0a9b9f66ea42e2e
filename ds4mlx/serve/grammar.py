"""A request's structured-output field -> a `structured.Grammar` (docs/http-api.md §10.7).

Strict tools (`tools[].function.strict`, Responses' and Anthropic's `tools[].strict`):
the arguments of a call tool_choice forces, held to the tool's schema by a grammar of the
call's rest (the family protocol's `strict_call_grammar`); anywhere else a 400 naming
the field, never a silent no-op.

Chat and completions: `response_format` (`json_object`, `json_schema`), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (Lark) and
llama.cpp's `json_schema` / `grammar` (GBNF); Responses: `text.format`; Anthropic:
`output_format`.  At most one per request; a grammar that does not compile is a 400
naming its field (serve/validate.py has checked the JSON types).
"""

from __future__ import annotations

import json
from typing import Any

from ..runtime.structured import Grammar, GrammarError, lark_json, lark_literal
from . import errors as E
from .validate import field_path


def _refuse(field: str, why: str) -> E.APIError:
    return E.APIError(400, f"Invalid value for '{field}': {why}", param=field, code="invalid_value")


def _format(fmt: dict, field: str, flat: bool) -> tuple[str, Grammar | None]:
    """OpenAI's format object; `flat`: Responses' (name / schema beside type)."""
    kind = fmt.get("type")
    if kind == "json_object":
        return field, Grammar("json_object", None)
    if kind == "json_schema":
        inner = fmt if flat else (fmt.get("json_schema") or {})
        schema = inner.get("schema")
        where = f"{field}.schema" if flat else f"{field}.json_schema.schema"
        return where, Grammar("json_schema", schema if schema is not None else {"type": "object"})
    return field, None  # text


def _json(v: Any, field: str) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError:
            raise _refuse(field, "not JSON") from None
    return v


def _candidates(api: str, body: dict) -> list[tuple[str, Grammar]]:
    out: list[tuple[str, Grammar | None]] = []
    if api in ("chat", "completions"):
        if isinstance(body.get("response_format"), dict):
            out.append(_format(body["response_format"], "response_format", flat=False))
        extras = {
            "guided_json": lambda v: Grammar("json_schema", _json(v, "guided_json")),
            "json_schema": lambda v: Grammar("json_schema", v),
            "guided_regex": lambda v: Grammar("regex", v),
            "guided_choice": lambda v: Grammar("choice", list(v)),
            "guided_grammar": lambda v: Grammar("lark", v),
            "grammar": lambda v: Grammar("gbnf", v) if v else None,
        }
        for field, make in extras.items():
            if body.get(field) is not None:
                out.append((field, make(body[field])))
    elif api == "responses":
        text = body.get("text")
        if isinstance(text, dict) and isinstance(text.get("format"), dict):
            out.append(_format(text["format"], "text.format", flat=True))
    elif api == "anthropic":
        if isinstance(body.get("output_format"), dict):
            out.append(_format(body["output_format"], "output_format", flat=True))
    return [(f, g) for f, g in out if g is not None]


def grammar_of(api: str, body: Any) -> Grammar | None:
    """The request's grammar, compiled once here so a bad one is a 400 before queueing."""
    if not isinstance(body, dict):
        return None
    found = _candidates(api, body)
    if len(found) > 1:
        raise _refuse(found[1][0], f"only one structured-output field per request ('{found[0][0]}' is set)")
    if not found:
        return None
    field, grammar = found[0]
    if grammar.kind == "choice" and not grammar.source:
        raise _refuse(field, "no choices")
    try:
        grammar.llguidance()
    except GrammarError as e:
        raise _refuse(field, str(e).strip().splitlines()[0][:200] if str(e).strip() else "does not compile") from None
    return grammar


def _function_tools(api: str, body: dict) -> list[tuple[list, str, Any, bool]]:
    """(path of its strict field, name the model writes, parameters schema, strict) of each
    function tool (a Responses namespace's functions as `namespace + name`, as
    chat/requests.py names them)."""
    out = []
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict):
            continue
        if api == "chat":
            found = [(t.get("function"), ["tools", i, "function", "strict"], "")]
        elif api == "anthropic":
            found = [(t, ["tools", i, "strict"], "")]
        elif t.get("type") == "namespace" and isinstance(t.get("name"), str) and isinstance(t.get("tools"), list):
            found = [(f, ["tools", i, "tools", j, "strict"], t["name"]) for j, f in enumerate(t["tools"])]
        else:
            found = [(t if t.get("type") == "function" else None, ["tools", i, "strict"], "")]
        for fn, at, prefix in found:
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                schema = fn.get("input_schema" if api == "anthropic" else "parameters")
                out.append((at, prefix + fn["name"], schema, fn.get("strict") is True))
    return out


def _forced_name(api: str, body: dict) -> str | None:
    """The tool a tool_choice object names (prepare has checked it), else None."""
    tc = body.get("tool_choice")
    if not isinstance(tc, dict):
        return None
    if api == "chat":
        fn = tc.get("function")
        return fn.get("name") if isinstance(fn, dict) else None
    return tc.get("name") if api == "responses" or tc.get("type") == "tool" else None


def strict_call_grammar_of(api: str, body: Any, forced: str | None, protocol, tokenizer) -> Grammar | None:
    """The grammar of a forced call's rest when a tool is strict (None when none is, or the
    forced text is the whole call); a 400 naming the strict field where it cannot hold."""
    if api == "completions" or not isinstance(body, dict):
        return None
    tools = _function_tools(api, body)
    strict = [t for t in tools if t[3]]
    if not strict:
        return None

    def refuse(at: list, condition: str) -> E.APIError:
        name = field_path(at, api)
        return E.APIError(400, E.supported_only(name, condition), param=name, code="unsupported_parameter")

    if forced is None:
        raise refuse(strict[0][0], E.STRICT_NEEDS_FORCED_CALL)
    named = _forced_name(api, body)
    callable_ = [t for t in tools if named is None or t[1] == named]
    if not callable_ or not all(t[3] for t in callable_):  # a call that may reach a free tool is not held
        raise refuse(strict[0][0], E.STRICT_NEEDS_EVERY_TOOL)
    text = protocol.strict_call_grammar(
        {t[1]: t[2] for t in callable_}, named, lambda s: lark_literal(s, tokenizer), lark_json
    )
    if text is None:
        raise refuse(strict[0][0], E.STRICT_NEEDS_FAMILY)
    if forced != protocol.force_text(named):
        return None  # the forced text is the whole call (a tool without parameters)
    grammar = Grammar("lark", text)
    try:
        grammar.llguidance()
    except GrammarError as e:
        raise _refuse(field_path(strict[0][0], api), str(e).strip().splitlines()[0][:200]) from None
    return grammar
