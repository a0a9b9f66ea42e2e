"""A tool call the token limit cuts is never presented as executable: on all three
APIs, streamed and not, the finish is the API's length reason (`length`,
`max_tokens`, `incomplete`), no complete call is returned, and the tokens counted
never exceed the limit (forced tool-call tokens included)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402

COMMAND = "rm -rf /tmp/build/output/cache/objects/everything-below-here"
BLOCK = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    f'<｜DSML｜parameter name="command" string="true">{COMMAND}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}


def script(prompt: str) -> str:
    return ("Sure.</think>" if prompt.endswith("<think>") else "") + "Running it." + BLOCK


def body(api: str, max_tokens: int, choice: str, stream: bool) -> dict:
    if api == "chat":
        tools = [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}]
        b = {"messages": [{"role": "user", "content": "go"}], "tools": tools, "tool_choice": choice,
             "max_tokens": max_tokens, "stream": stream}  # fmt: skip
        return dict(b, stream_options={"include_usage": True}) if stream else b
    if api == "anthropic":
        kind = {"required": "any", "auto": "auto"}[choice]
        tools = [{"name": "bash", "input_schema": SCHEMA}]
        return {"messages": [{"role": "user", "content": "go"}], "tools": tools, "tool_choice": {"type": kind},
                "max_tokens": max_tokens, "stream": stream}  # fmt: skip
    tools = [{"type": "function", "name": "bash", "parameters": SCHEMA}]
    return {"input": "go", "tools": tools, "tool_choice": choice, "max_output_tokens": max_tokens, "stream": stream}


PATHS = {"chat": "/v1/chat/completions", "anthropic": "/v1/messages", "responses": "/v1/responses"}


def sse_objects(text: str) -> list[dict]:
    return [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]


def outcome(api: str, r: httpx.Response, stream: bool) -> tuple[str, list, int]:
    """(finish reason, complete calls, output tokens) of one answer."""
    assert r.status_code == 200, r.text
    if not stream:
        o = r.json()
        if api == "chat":
            ch = o["choices"][0]
            return ch["finish_reason"], ch["message"].get("tool_calls", []), o["usage"]["completion_tokens"]
        if api == "anthropic":
            calls = [b for b in o["content"] if b["type"] == "tool_use"]
            return o["stop_reason"], calls, o["usage"]["output_tokens"]
        calls = [i for i in o["output"] if i["type"] == "function_call"]
        return (
            o["incomplete_details"]["reason"] if o["status"] == "incomplete" else o["status"],
            calls,
            o["usage"]["output_tokens"],
        )
    objs = sse_objects(r.text)
    if api == "chat":
        finish = next(
            c["choices"][0]["finish_reason"] for c in objs if c["choices"] and c["choices"][0]["finish_reason"]
        )
        args: dict[int, str] = {}
        for c in objs:
            for tc in c["choices"][0]["delta"].get("tool_calls", []) if c["choices"] else []:
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
        calls = [a for a in args.values() if _is_object(a)]  # a call whose arguments are whole JSON
        usage = next(c["usage"] for c in objs if c.get("usage"))
        return finish, calls, usage["completion_tokens"]
    if api == "anthropic":
        delta = next(o for o in objs if o["type"] == "message_delta")
        parts: dict[int, str] = {}
        for o in objs:
            if o["type"] == "content_block_delta" and o["delta"]["type"] == "input_json_delta":
                parts[o["index"]] = parts.get(o["index"], "") + o["delta"]["partial_json"]
        calls = [a for a in parts.values() if _is_object(a)]
        return delta["delta"]["stop_reason"], calls, delta["usage"]["output_tokens"]
    end = objs[-1]["response"]
    calls = [i for i in end["output"] if i["type"] == "function_call"]
    reason = end["incomplete_details"]["reason"] if end["status"] == "incomplete" else end["status"]
    return reason, calls, end["usage"]["output_tokens"]


def _argument_deltas(objs: list[dict]):
    for o in objs:
        for tc in o["choices"][0]["delta"].get("tool_calls", []) if o.get("choices") else []:
            yield tc["function"].get("arguments", "")
        if o.get("type") == "content_block_delta" and o["delta"]["type"] == "input_json_delta":
            yield o["delta"]["partial_json"]


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


LENGTH = {"chat": "length", "anthropic": "max_tokens", "responses": "max_tokens"}


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture(scope="module")
def srv(tok):
    with serve(tok, ScriptedModel(tok, script), ctx=2048, tokens=256) as s:
        yield s


@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_cut_at_max_tokens_3_finishes_with_length(srv, api, stream):
    r = httpx.post(srv.url + PATHS[api], json=body(api, 3, "required", stream), timeout=60)
    finish, calls, used = outcome(api, r, stream)
    assert finish == LENGTH[api] and calls == [] and used == 3


@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_inside_its_value_is_never_whole(srv, tok, api, stream):
    """The limit falls inside the command: the call the stream announced stays partial
    (no closing quote and brace added), the non-streamed answer has no call."""
    prefix = "Sure.</think>Running it." + BLOCK[: BLOCK.index("output/cache")]
    limit = len(tok.encode(prefix))
    r = httpx.post(srv.url + PATHS[api], json=body(api, limit, "auto", stream), timeout=60)
    finish, calls, used = outcome(api, r, stream)
    assert finish == LENGTH[api] and calls == [] and used == limit
    if stream and api != "responses":  # the partial call was streamed as it arrived, left open
        sent = "".join(_argument_deltas(sse_objects(r.text)))
        assert sent.startswith('{"command":"rm -rf /tmp/build') and not _is_object(sent)
    # the whole call still completes with room to finish it
    r = httpx.post(srv.url + PATHS[api], json=body(api, 256, "auto", stream), timeout=60)
    finish, calls, _ = outcome(api, r, stream)
    assert finish in ("tool_calls", "tool_use", "completed") and len(calls) == 1
