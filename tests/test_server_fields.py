"""Every known field of the wrong type is a 400 that names it, on every API
(serve/validate.py): `param` on the OpenAI routes, the field's path in the
message everywhere; media parts are a clear 400; the JSON nesting limit counts
a field's depth, not the body's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402
from test_server_http import call  # noqa: E402

from ds4mlx.serve.errors import APIError  # noqa: E402
from ds4mlx.serve.validate import validate_body  # noqa: E402

U = {"role": "user", "content": "x"}
ROUTE = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}
BASE = {
    "chat": {"messages": [U]},
    "completions": {"prompt": "x"},
    "anthropic": {"messages": [U], "max_tokens": 4},
    "responses": {"input": "x"},
}

# (api, extra fields, the field named, "type" | "value" | "media")
WRONG = [
    ("chat", {"temperature": "hot"}, "temperature", "type"),
    ("chat", {"max_tokens": "x"}, "max_tokens", "type"),
    ("chat", {"top_k": [1]}, "top_k", "type"),
    ("chat", {"stream": "yes"}, "stream", "type"),
    ("chat", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "type"),
    ("chat", {"stop": 5}, "stop", "type"),
    ("chat", {"stop": ["a", 5]}, "stop[1]", "type"),
    ("chat", {"thinking": "on"}, "thinking", "type"),
    ("chat", {"thinking": {"type": "sometimes"}}, "thinking.type", "value"),
    ("chat", {"tool_choice": "banana"}, "tool_choice", "value"),
    ("chat", {"tool_choice": 7}, "tool_choice", "type"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice.function.name", "type"),
    ("chat", {"tools": {"type": "function"}}, "tools", "type"),
    ("chat", {"tools": [{"type": "function", "function": {"name": 1}}]}, "tools[0].function.name", "type"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "type"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages[0].content[0].text",
        "type",
    ),
    ("chat", {"messages": [{"role": 3, "content": "x"}]}, "messages[0].role", "type"),
    (
        "chat",
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 2}}]}]},
        "messages[0].tool_calls[0].function.name",
        "type",
    ),
    ("chat", {"messages": [{"role": "tool", "content": "r", "tool_call_id": 9}]}, "messages[0].tool_call_id", "type"),
    ("chat", {"model": 4}, "model", "type"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
        "media",
    ),
    ("completions", {"prompt": 5}, "prompt", "type"),
    ("completions", {"prompt": ["a", {"b": 1}]}, "prompt[1]", "type"),
    ("completions", {"seed": "s"}, "seed", "type"),
    (
        "anthropic",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.0.content.0.text",
        "type",
    ),
    ("anthropic", {"system": 5}, "system", "type"),
    ("anthropic", {"system": [{"type": "text", "text": False}]}, "system.0.text", "type"),
    ("anthropic", {"tool_choice": "auto"}, "tool_choice", "type"),
    ("anthropic", {"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "value"),
    ("anthropic", {"stop_sequences": "END"}, "stop_sequences", "type"),
    ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens", "type"),
    ("anthropic", {"max_tokens": "4"}, "max_tokens", "type"),
    (
        "anthropic",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 1}]}]},
        "messages.0.content.0.tool_use_id",
        "type",
    ),
    ("anthropic", {"output_config": {"effort": ["high"]}}, "output_config.effort", "type"),
    (
        "anthropic",
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]}]},
        "messages.0.content.0",
        "media",
    ),
    ("responses", {"input": 5}, "input", "type"),
    ("responses", {"input": [{"type": "message", "role": "user", "content": 5}]}, "input[0].content", "type"),
    ("responses", {"input": [{"type": "bogus"}]}, "input[0].type", "value"),
    ("responses", {"input": [{"type": "function_call", "call_id": 5, "name": "f"}]}, "input[0].call_id", "type"),
    ("responses", {"instructions": 3}, "instructions", "type"),
    ("responses", {"max_output_tokens": "many"}, "max_output_tokens", "type"),
    ("responses", {"reasoning": {"effort": ["high"]}}, "reasoning.effort", "type"),
    (
        "responses",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
        "media",
    ),
]


def _body(api: str, extra: dict) -> dict:
    return {**BASE[api], **extra}


@pytest.mark.parametrize("api,extra,field,kind", WRONG)
def test_wrong_field_is_named(api, extra, field, kind):
    with pytest.raises(APIError) as info:
        validate_body(api, _body(api, extra))
    e = info.value
    assert e.status == 400 and e.param == field, (e.param, e.message)
    assert f"'{field}'" in e.message
    assert e.message.startswith(
        {"type": "Invalid type for", "value": "Invalid value for", "media": "Invalid content part"}[kind]
    ), e.message


@pytest.mark.parametrize("api", list(BASE))
def test_valid_bodies_pass(api):
    validate_body(api, BASE[api])
    validate_body(api, _body(api, {"temperature": None, "max_tokens": 3.0, "stream": None, "model": None}))


@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    with serve(tok, ScriptedModel(tok, lambda p: "ok"), ctx=512, tokens=4) as s:
        yield s


@pytest.mark.parametrize("api,extra,field,kind", WRONG[::3] + [w for w in WRONG if w[3] == "media"])
def test_wrong_field_over_http(srv, api, extra, field, kind):
    st, _, text = call(srv.url, ROUTE[api], _body(api, extra))
    body = json.loads(text)
    assert st == 400, text
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert f"'{field}'" in body["error"]["message"]
    else:
        assert body["error"]["param"] == field and f"'{field}'" in body["error"]["message"]


def test_text_block_of_wrong_type_is_400_on_both_chat_apis(srv):
    bad = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    st_chat, _, chat = call(srv.url, "/v1/chat/completions", {"messages": bad})
    st_msg, _, msg = call(srv.url, "/v1/messages", {"messages": bad, "max_tokens": 4})
    assert (st_chat, st_msg) == (400, 400)
    assert (
        json.loads(chat)["error"]["message"]
        == "Invalid type for 'messages[0].content[0].text': expected a string or null, but got a number instead."
    )
    assert (
        json.loads(msg)["error"]["message"]
        == "Invalid type for 'messages.0.content.0.text': expected a string or null, but got a number instead."
    )


@pytest.mark.parametrize(
    "api,body,field",
    [
        ("chat", {"messages": [U], "reasoning_effort": "extreme"}, "reasoning_effort"),
        ("anthropic", {"messages": [U], "output_config": {"effort": "extreme"}}, "output_config.effort"),
        ("responses", {"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ],
)
def test_unknown_effort_names_its_field(srv, api, body, field):
    st, _, text = call(srv.url, ROUTE[api], body)
    err = json.loads(text)["error"]
    assert st == 400 and err["message"] == f"Invalid value for '{field}'."
    assert api == "anthropic" or err["param"] == field


def _nested(depth: int) -> bytes:
    """A chat body whose field `x` is nested exactly `depth` levels deep."""
    return b'{"messages":[{"role":"user","content":"x"}],"max_tokens":1,"x":' + b"[" * depth + b"]" * depth + b"}"


def test_nesting_limit_counts_the_field_not_the_body(srv):
    assert call(srv.url, "/v1/chat/completions", _nested(256))[0] == 200
    st, _, text = call(srv.url, "/v1/chat/completions", _nested(257))
    assert st == 400 and json.loads(text)["error"]["message"] == "invalid JSON request"


# --- the fields the server refuses or ignores (serve/fields.py, docs/http-api.md §10) -----------
from ds4mlx.serve.fields import IGNORED, TABLE, values  # noqa: E402

# one value per refused field that asks for something the server does not do
ASKS = {
    "frequency_penalty": 0.5,
    "presence_penalty": -1,
    "logit_bias": {"15": 100},
    "n": 2,
    "top_logprobs": 3,
    "response_format": {"type": "json_object"},
    "parallel_tool_calls": False,
    "tools[].function.strict": True,
    "tools[].strict": True,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "verbosity": "low",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "best_of": 3,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "stop_token_ids": [5],
    "use_beam_search": True,
    "typical_p": 0.5,
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'",
    "grammar": "root ::= 'a'",
    "json_schema": {"type": "object"},
    "n_probs": 2,
    "mirostat": 2,
    "suffix": "end",
    "tool_choice.disable_parallel_tool_use": True,
    "container": "c1",
    "context_management": {"edits": []},
    "mcp_servers": [{"type": "url", "url": "https://x", "name": "m"}],
    "output_format": {"type": "json_schema", "schema": {}},
    "include": ["message.output_text.logprobs"],
    "text.format": {"type": "json_object"},
    "text.verbosity": "high",
    "truncation": "auto",
    "max_tool_calls": 2,
    "background": True,
    "prompt": {"id": "pmpt_1"},
}
ASKS_ON: dict = {}
ADVISORY = {"user": "u", "metadata": {"k": "v"}, "store": True, "safety_identifier": "s", "prompt_cache_key": "k"}
ADVISORY |= {"prompt_cache_retention": "24h", "service_tier": "auto", "stream_options.include_obfuscation": False}
_TOOLS = {
    "chat": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "anthropic": [{"name": "f", "input_schema": {"type": "object"}}],
    "responses": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
}


def _with(api: str, path: str, value) -> dict:
    """BASE[api] with `value` at `path` (tools[] -> the first of a one-tool list)."""
    body = json.loads(json.dumps(BASE[api]))
    if path.startswith("tools[]."):
        body["tools"] = json.loads(json.dumps(_TOOLS[api]))
        node, parts = body["tools"][0], path[len("tools[].") :].split(".")
    else:
        node, parts = body, path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {"type": "auto"} if p == "tool_choice" else {})
    node[parts[-1]] = value
    return body


def _concrete(api: str, path: str) -> str:
    return path.replace("tools[]", "tools.0" if api == "anthropic" else "tools[0]")


def _wrong_type(schema: dict):
    types = schema["type"]
    return (
        next(
            v
            for t, v in [("string", 5), ("number", "x"), ("boolean", "x"), ("object", 7), ("array", 7)]
            if t in types and (t != "number" or "string" not in types)
        )
        if "string" in types
        else "x"
    )


TABLE_CASES = [(api, f) for api, fields in TABLE.items() for f in fields]


@pytest.mark.parametrize("api,field", TABLE_CASES, ids=[f"{a}-{f.path}" for a, f in TABLE_CASES])
def test_table_field_typed_refused_or_accepted(api, field):
    name = _concrete(api, field.path)
    with pytest.raises(APIError) as info:  # a wrong type is named first
        validate_body(api, _with(api, field.path, _wrong_type(field.schema)))
    assert info.value.param == name and info.value.message.startswith("Invalid type for"), info.value.message
    validate_body(api, _with(api, field.path, None))  # null: absent
    if field.status == IGNORED:
        validate_body(api, _with(api, field.path, ADVISORY[field.path]))
        return
    with pytest.raises(APIError) as info:
        validate_body(api, _with(api, field.path, ASKS_ON.get((api, field.path), ASKS[field.path])))
    e = info.value
    assert (e.status, e.param, e.code) == (400, name, "unsupported_parameter")
    assert e.message == f"Unsupported parameter: '{name}' is not supported by this server."
    for neutral in field.neutral:  # the API's default asks for nothing
        validate_body(api, _with(api, field.path, neutral))


def test_codex_include_is_accepted():
    validate_body("responses", {"input": "x", "include": ["reasoning.encrypted_content"], "store": False})


def test_refusal_over_http_in_each_apis_shape(srv):
    st, _, text = call(srv.url, ROUTE["chat"], {"messages": [U], "best_of": 2})
    assert st == 400 and json.loads(text)["error"] == {
        "message": "Unsupported parameter: 'best_of' is not supported by this server.",
        "type": "invalid_request_error",
        "param": "best_of",
        "code": "unsupported_parameter",
    }
    st, _, text = call(srv.url, ROUTE["anthropic"], _with("anthropic", "tools[].strict", True))
    body = json.loads(text)
    assert st == 400 and body["type"] == "error" and "'tools.0.strict'" in body["error"]["message"]
    st, _, text = call(srv.url, ROUTE["chat"], {"messages": [U], "n": 1, "logprobs": False, "user": "u"})
    assert st == 200, text


def test_every_table_field_is_documented():
    doc = (Path(__file__).parents[1] / "docs" / "http-api.md").read_text()
    section = doc.split("\n## 9.")[1]
    for api, fields in TABLE.items():
        for f in fields:
            assert f"`{f.path}`" in section, (api, f.path)


def test_values_walks_array_paths():
    body = {"tools": [{"function": {"strict": True}}, {"function": {}}, 5]}
    assert list(values(body, "tools[].function.strict")) == [(["tools", 0, "function", "strict"], True)]


@pytest.mark.parametrize(
    "extra,field,kind",
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty", "value"),
        ({"presence_penalty": -3}, "presence_penalty", "value"),
        ({"repetition_penalty": 0}, "repetition_penalty", "value"),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc", "value"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias.999999999", "value"),
        ({"logit_bias": {"15": "x"}}, "logit_bias.15", "type"),
        ({"frequency_penalty": "x"}, "frequency_penalty", "type"),
    ],
)
def test_penalty_fields_out_of_range_are_named(srv, extra, field, kind):
    for api in ("chat", "completions"):
        st, _, text = call(srv.url, ROUTE[api], _body(api, extra))
        err = json.loads(text)["error"]
        assert st == 400 and err["param"] == field, text
        assert err["message"].startswith({"type": "Invalid type for", "value": "Invalid value for"}[kind])


def test_penalty_fields_are_accepted(srv):
    extra = {"frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1, "logit_bias": {"15": 200}}
    for api in ("chat", "completions"):
        st, _, text = call(srv.url, ROUTE[api], _body(api, extra))
        assert st == 200, text


# --- thinking mode's fixed sampling is said, not silent; seed 0; top_k / top_p bounds -------------
def test_thinking_mode_names_the_sampling_fields_it_replaces(srv):
    from ds4mlx.serve.params import SAMPLING_OVERRIDDEN_HEADER as H

    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "top_p": 0.5, "seed": 3}
    for stream in (False, True):
        st, headers, _ = call(srv.url, "/v1/chat/completions", {**body, "stream": stream, "think": True})
        assert st == 200 and headers[H] == "temperature, top_p"
        st, headers, _ = call(srv.url, "/v1/chat/completions", {**body, "stream": stream, "think": False})
        assert st == 200 and H not in headers  # honoured: nothing replaced
    st, headers, _ = call(srv.url, "/v1/chat/completions", {"messages": body["messages"], "think": True})
    assert st == 200 and H not in headers  # nothing sent, nothing replaced


@pytest.mark.parametrize(
    "extra,field", [({"top_k": 5000}, "top_k"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p")]
)
def test_top_k_past_the_cap_and_top_p_outside_0_1_are_refused(srv, extra, field):
    st, _, text = call(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
    assert st == 400 and json.loads(text)["error"]["param"] == field


def test_seed_0_reproduces_like_any_other_seed():
    import mlx.core as mx

    from ds4mlx.runtime.sampling import Sampler, SamplingParams

    logits = mx.random.normal((64,), key=mx.random.key(1))
    p = SamplingParams(temperature=1.0, seed=0)
    draws = [[int(s.sample(logits, p).item()) for _ in range(16)] for s in (Sampler(0), Sampler(0))]
    assert Sampler(0).seed == 0 and draws[0] == draws[1]
