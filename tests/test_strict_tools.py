"""Strict tools (`tools[].function.strict`, Responses' and Anthropic's `tools[].strict`,
docs/http-api.md §10.7): on the random-weight demo model (free arguments are gibberish),
a call tool_choice forces has arguments that validate against the tool's schema on every
seed, on each API, streamed and not; reasoning stays free.  Where the server cannot hold
a call to the schema (tool_choice auto, a free tool beside a strict one) `strict: true` is
a 400 naming the field."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve_demo  # noqa: E402
from test_server_http import call, parse_sse  # noqa: E402

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2},
        "where": {
            "type": "object",
            "properties": {"near": {"type": "boolean"}, "zone": {"$ref": "#/$defs/zone"}},
            "required": ["near", "zone"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "days", "where"],
    "additionalProperties": False,
    "$defs": {"zone": {"enum": ["n", "s"]}},
}
OTHER = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 5}},
    "required": ["q"],
    "additionalProperties": False,
}
U = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def srv():
    with serve_demo(ctx=1024, tokens=200) as s:
        yield s


def chat_tools(strict=True, other_strict=True):
    return [
        {"type": "function", "function": {"name": "weather", "parameters": PARAMS, "strict": strict}},
        {"type": "function", "function": {"name": "search", "parameters": OTHER, "strict": other_strict}},
    ]


def _check_call(name: str, arguments) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, PARAMS if name == "weather" else OTHER)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_strict_call_validates(srv, seed, choice):
    body = {"messages": U, "tools": chat_tools(), "tool_choice": choice, "seed": seed, "reasoning_effort": "none"}
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    assert st == 200, text
    choice_ = json.loads(text)["choices"][0]
    assert choice_["finish_reason"] == "tool_calls", choice_
    calls = choice_["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] in ("weather", "search") for c in calls)
    for c in calls:
        _check_call(c["function"]["name"], c["function"]["arguments"])
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in calls] == ["weather"]


def test_streamed_and_thinking(srv):
    """Streamed, with thinking on: the forced head waits for the reasoning's end (pushed by a
    logit_bias on `</think>`: a random model's reasoning would not end), then the call's
    arguments hold."""
    from ds4mlx.chat.markers import THINK_CLOSE

    close = srv.tok.encode(THINK_CLOSE)
    body = {"messages": U, "tools": chat_tools(), "tool_choice": "required", "seed": 1, "stream": True,
            "reasoning_effort": "high", "max_tokens": 200, "logit_bias": {str(close[0]): 100}}  # fmt: skip
    assert len(close) == 1
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    assert st == 200, text
    chunks = [json.loads(d) for k, d in parse_sse(text) if k != "comment" and d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls: dict = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            entry["name"] += (tc.get("function") or {}).get("name") or ""
            entry["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["tool_calls"] and calls, deltas[-3:]
    for c in calls.values():
        _check_call(c["name"], c["arguments"])


def test_responses_and_anthropic_strict(srv):
    tools = [{"type": "function", "name": "weather", "parameters": PARAMS, "strict": True}]
    body = {"input": "weather?", "tools": tools, "tool_choice": "required", "reasoning": {"effort": "none"}}
    st, _, text = call(srv.url, "/v1/responses", {**body, "seed": 2})
    assert st == 200, text
    items = [i for i in json.loads(text)["output"] if i["type"] == "function_call"]
    assert items and all(i["name"] == "weather" for i in items)
    for i in items:
        _check_call("weather", i["arguments"])
    tools = [{"name": "weather", "input_schema": PARAMS, "strict": True}]
    body = {"messages": U, "tools": tools, "tool_choice": {"type": "any"}, "max_tokens": 200, "seed": 3}
    st, _, text = call(srv.url, "/v1/messages", body)
    assert st == 200, text
    uses = [b for b in json.loads(text)["content"] if b["type"] == "tool_use"]
    assert uses and json.loads(text)["stop_reason"] == "tool_use"
    for b in uses:
        _check_call("weather", b["input"])


@pytest.mark.parametrize(
    "route,body,field",
    [
        ("/v1/chat/completions", {"messages": U, "tools": chat_tools()}, "tools[0].function.strict"),  # auto
        (
            "/v1/chat/completions",
            {"messages": U, "tools": chat_tools(other_strict=False), "tool_choice": "required"},
            "tools[0].function.strict",
        ),
        (  # the named tool is free: its block may go on to call the strict one unconstrained
            "/v1/chat/completions",
            {
                "messages": U,
                "tools": chat_tools(strict=False),
                "tool_choice": {"type": "function", "function": {"name": "weather"}},
            },
            "tools[1].function.strict",
        ),
        (
            "/v1/responses",
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": OTHER, "strict": True}]},
            "tools[0].strict",
        ),
        (
            "/v1/messages",
            {"messages": U, "max_tokens": 4, "tools": [{"name": "f", "input_schema": OTHER, "strict": True}]},
            "tools.0.strict",
        ),
    ],
)
def test_strict_that_cannot_hold_is_a_400_naming_it(srv, route, body, field):
    st, _, text = call(srv.url, route, body)
    err = json.loads(text)["error"]
    assert st == 400 and f"'{field}'" in err["message"], text


def test_free_arguments_do_not_validate(srv):
    """The oracle that the grammar does the work: without `strict` the demo model's forced
    call does not fit the schema."""
    body = {"messages": U, "tools": chat_tools(strict=False, other_strict=False), "reasoning_effort": "none",
            "tool_choice": {"type": "function", "function": {"name": "weather"}}, "seed": 0, "max_tokens": 60}  # fmt: skip
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    assert st == 200, text
    calls = json.loads(text)["choices"][0]["message"].get("tool_calls") or []
    with pytest.raises((ValueError, jsonschema.ValidationError, IndexError)):
        _check_call("weather", calls[0]["function"]["arguments"])


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp", "deepseek_v41"])
def test_a_family_without_a_call_grammar_refuses_strict(family):
    from ds4mlx.chat.protocol import get_protocol
    from ds4mlx.runtime.tokenizer import Tokenizer
    from ds4mlx.serve.errors import APIError
    from ds4mlx.serve.grammar import strict_call_grammar_of

    proto = get_protocol(family)
    body = {"messages": U, "tools": chat_tools(), "tool_choice": "required"}
    with pytest.raises(APIError) as info:
        strict_call_grammar_of("chat", body, proto.force_text(None), proto, Tokenizer.default())
    assert info.value.param == "tools[0].function.strict" and "families" in info.value.message


def test_responses_namespace_function_strict(srv):
    """A namespace's function (written `namespace + name` in DSML) is held to its schema."""
    inner = {"type": "function", "name": "weather", "parameters": PARAMS, "strict": True}
    tools = [{"type": "namespace", "name": "mcp__", "tools": [inner]}]
    body = {"input": "weather?", "tools": tools, "tool_choice": "required", "reasoning": {"effort": "none"}, "seed": 4}
    st, _, text = call(srv.url, "/v1/responses", body)
    assert st == 200, text
    items = [i for i in json.loads(text)["output"] if i["type"] == "function_call"]
    assert items and all(i["name"] == "weather" and i.get("namespace") == "mcp__" for i in items), items
    for i in items:
        _check_call("weather", i["arguments"])
