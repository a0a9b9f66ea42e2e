"""`parallel_tool_calls: false` (chat, Responses) and Anthropic's
`tool_choice.disable_parallel_tool_use` (docs/http-api.md §10): the model writes two calls
in one block; the client gets the first only, streamed and not, and the generation
stopped right after it (the later call was never sampled)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402
from test_server_http import call, parse_sse  # noqa: E402

TWO_CALLS = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">one</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="g">\n<｜DSML｜parameter name="b" string="true">two</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    "</｜DSML｜tool_calls>"
)
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in "fg"]
U = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    model = ScriptedModel(tok, lambda p: TWO_CALLS if "## Tools" in p else "no tools")
    with serve(tok, model, ctx=1024, tokens=200) as s:
        s.model = model
        yield s


def chat(srv, **extra):
    body = {"messages": U, "tools": CHAT_TOOLS, "reasoning_effort": "none", **extra}
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    assert st == 200, text
    return text


def test_chat_default_keeps_both_calls(srv):
    msg = json.loads(chat(srv))["choices"][0]
    assert [c["function"]["name"] for c in msg["message"]["tool_calls"]] == ["f", "g"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_parallel_tool_calls_false_gives_the_first_call(srv, stream):
    steps = srv.model.steps
    text = chat(srv, parallel_tool_calls=False, stream=stream)
    if stream:
        chunks = [json.loads(d) for k, d in parse_sse(text) if d != "[DONE]"]
        deltas = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
        assert {d["index"] for d in deltas} == {0}
        assert json.loads("".join(d["function"].get("arguments", "") for d in deltas)) == {"a": "one"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = json.loads(text)["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and len(calls) == 1
        assert calls[0]["function"]["name"] == "f" and json.loads(calls[0]["function"]["arguments"]) == {"a": "one"}
    whole = len(srv.model.tokenizer.encode(TWO_CALLS))
    assert srv.model.steps - steps < whole - 10  # stopped after the first call, not at the block's end


def test_anthropic_disable_parallel_tool_use(srv):
    tools = [{"name": n, "input_schema": SCHEMA} for n in "fg"]
    body = {"messages": U, "tools": tools, "max_tokens": 200, "thinking": {"type": "disabled"}}
    st, _, text = call(srv.url, "/v1/messages", {**body, "tool_choice": {"type": "auto"}})
    assert [b["name"] for b in json.loads(text)["content"] if b["type"] == "tool_use"] == ["f", "g"]
    one = {**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    st, _, text = call(srv.url, "/v1/messages", one)
    out = json.loads(text)
    assert st == 200 and out["stop_reason"] == "tool_use"
    assert [(b["name"], b["input"]) for b in out["content"] if b["type"] == "tool_use"] == [("f", {"a": "one"})]


def test_responses_parallel_tool_calls_false(srv):
    tools = [{"type": "function", "name": n, "parameters": SCHEMA} for n in "fg"]
    body = {"input": "go", "tools": tools, "reasoning": {"effort": "none"}, "parallel_tool_calls": False}
    st, _, text = call(srv.url, "/v1/responses", body)
    calls = [o for o in json.loads(text)["output"] if o["type"] == "function_call"]
    assert st == 200 and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": "one"})]


def test_next_turn_replays_the_one_call_the_client_saw(srv):
    first = json.loads(chat(srv, parallel_tool_calls=False))["choices"][0]["message"]
    history = [*U, {k: first[k] for k in ("role", "content", "tool_calls")}]
    history.append({"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "done"})
    st, _, text = call(
        srv.url, "/v1/chat/completions", {"messages": history, "tools": CHAT_TOOLS, "reasoning_effort": "none"}
    )
    assert st == 200, text
    prompt = srv.model.prompts[-1]
    assert prompt.count('invoke name="f"') == 1 and 'invoke name="g"' not in prompt


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41", "glm_moe_dsa", "glm5_next", "qwen4_exp"])
def test_every_family_parser_stops_after_the_first_call(family):
    from ds4mlx.chat.messages import ToolCall
    from ds4mlx.chat.protocol import FirstCallOnly, get_protocol
    from ds4mlx.runtime.events import ToolCallEnd

    proto = get_protocol(family)
    text = proto.render_calls([ToolCall("", "f", '{"a": "one"}'), ToolCall("", "g", '{"b": "two"}')])
    schemas = [json.dumps({"name": n, "parameters": SCHEMA}) for n in "fg"]
    parser = FirstCallOnly(proto.make_parser(False, True, tool_schemas=schemas))
    events, fed = [], 0
    for ch in text:  # one character at a time, as tokens might split it
        events += parser.feed(ch)
        fed += 1
        if parser.stop_now:
            break
    tail, final = parser.finish(False)
    events += tail
    assert fed < len(text) - 5, (family, text[fed:])
    assert [(c.name, json.loads(c.arguments)) for c in final.calls] == [("f", {"a": "one"})]
    assert [e.name for e in events if isinstance(e, ToolCallEnd)] == ["f"]
