"""What real clients ran into (#17), at the HTTP level: the official SDKs where
they can say it, raw aiohttp where they cannot.  A scripted model writes the
exact text each case needs through the real sampler, parser and adapters."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest
from lazy_modules import lazy

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, last_user_text, serve  # noqa: E402

anthropic = lazy("anthropic")
openai = lazy("openai")

MODEL = "deepseek-v4-flash"
THINK = {"type": "enabled", "budget_tokens": 1024}
OPEN = "<｜DSML｜tool_calls>"
CLOSE = "</｜DSML｜tool_calls>"
P = "<｜DSML｜parameter"
PC = "</｜DSML｜parameter>"
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}},
    },
    {
        "type": "function",
        "function": {"name": "Read", "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}}},
    },
]
ANTHROPIC_TOOLS = [
    {"name": "bash", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
    {"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}},
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]

# what the scripted model writes for a user message (the reasoning close is added when the prompt opens it)
SCRIPTS = {
    # item 1: the head of a Read call, then the block breaks (Claude Code's "could not be parsed as JSON")
    "broken": "Reading.\n\n" + OPEN + '\n<｜DSML｜invoke name="Read">\n' + "oops, not DSML at all" + CLOSE,
    # item 1: the call is announced, then the model stops inside its value (EOS)
    "cut": "\n\n" + OPEN + '\n<｜DSML｜invoke name="bash">\n' + P + ' name="command" string="true">ls -l',
    # item 1: EOS inside the invoke tag, before anything could be announced
    "head": "Listing.\n\n" + OPEN + '\n<｜DSML｜invoke name="ba',
    # item 2: ds4's test_thinking_dsml_is_not_executable_before_think_close
    "quoted": (
        "I could run "
        + OPEN
        + '\n<｜DSML｜invoke name="bash">\n'
        + P
        + ' name="command" string="true">true'
        + PC
        + "\n</｜DSML｜invoke>\n"
        + CLOSE
        + " but no.</think>Final answer."
    ),
    "long": " ".join(["word"] * 60),
    "think_long": " ".join(["hmm"] * 60),  # reasoning that never closes
    "stop": "alpha beta STOP gamma",
    "ls": "\n\n"
    + OPEN
    + '\n<｜DSML｜invoke name="bash">\n'
    + P
    + ' name="command" string="true">ls'
    + PC
    + "\n</｜DSML｜invoke>\n"
    + CLOSE,
}


def script(prompt: str) -> str:
    u = last_user_text(prompt)
    key = next((k for k in SCRIPTS if u.startswith(k)), None)
    text = SCRIPTS[key] if key else "echo: " + u
    if prompt.endswith("<think>") and key not in ("think_long", "quoted"):
        return "ok.</think>" + text
    return text


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture(scope="module")
def srv(tok):
    with serve(tok, ScriptedModel(tok, script), ctx=4096, tokens=200) as s:
        yield s


@pytest.fixture(scope="module")
def oc(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ac(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)


def user(text):
    return [{"role": "user", "content": text}]


async def _request(method, url, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=body) as r:
            return r.status, dict(r.headers), await r.text()


def request(method, url, body=None):
    return asyncio.run(_request(method, url, body))


def sse_events(raw: str) -> list[tuple[str, dict]]:
    out = []
    for block in raw.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line[6:] != "[DONE]":
                data = json.loads(line[6:])
        if data is not None:
            out.append((name, data))
    return out


# --------------------------------------------------------------------------- item 1
def test_broken_call_is_never_announced_anthropic_stream(ac):
    with ac.messages.stream(model=MODEL, max_tokens=200, messages=user("broken"), tools=ANTHROPIC_TOOLS) as st:
        streamed = st.get_final_message()
    plain = ac.messages.create(model=MODEL, max_tokens=200, messages=user("broken"), tools=ANTHROPIC_TOOLS)
    assert [b.type for b in streamed.content] == [b.type for b in plain.content] == ["text"]
    assert streamed.content[0].text == plain.content[0].text
    assert streamed.stop_reason == plain.stop_reason == "end_turn"


def test_broken_call_is_never_announced_chat_stream(oc):
    chunks = list(oc.chat.completions.create(model=MODEL, messages=user("broken"), tools=OPENAI_TOOLS, stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = oc.chat.completions.create(model=MODEL, messages=user("broken"), tools=OPENAI_TOOLS)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == text


def test_call_cut_at_eos_fails_the_turn(oc, ac):
    """EOS inside an announced call: the turn fails as ds4's does; the partial call the
    stream sent stays partial (never closed into valid JSON) and no answer returns it."""
    chunks = list(oc.chat.completions.create(model=MODEL, messages=user("cut"), tools=OPENAI_TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    args = "".join(tc.function.arguments or "" for tc in calls)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert calls[0].function.name == "bash" and args == '{"command":"ls -l'
    assert "DSML" not in text and chunks[-1].choices[0].finish_reason == "error"
    plain = oc.chat.completions.create(model=MODEL, messages=user("cut"), tools=OPENAI_TOOLS)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "error"
    with pytest.raises(anthropic.APIStatusError, match="unterminated tool call"):  # Anthropic's mid-stream error
        with ac.messages.stream(model=MODEL, max_tokens=200, messages=user("cut"), tools=ANTHROPIC_TOOLS) as st:
            st.get_final_message()
    m = ac.messages.create(model=MODEL, max_tokens=200, messages=user("cut"), tools=ANTHROPIC_TOOLS)
    assert "tool_use" not in [b.type for b in m.content]


def test_block_cut_before_any_announcement_never_shows_markup(oc, ac):
    """ds4 never streams DSML markup: the text before the block is the whole answer,
    streamed and not, on both APIs (ds4 fails the turn: an unterminated tool call)."""
    chunks = list(oc.chat.completions.create(model=MODEL, messages=user("head"), tools=OPENAI_TOOLS, stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = oc.chat.completions.create(model=MODEL, messages=user("head"), tools=OPENAI_TOOLS)
    assert text == plain.choices[0].message.content == "Listing." and plain.choices[0].message.tool_calls is None
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
    with ac.messages.stream(model=MODEL, max_tokens=200, messages=user("head"), tools=ANTHROPIC_TOOLS) as st:
        streamed = st.get_final_message()
    plain = ac.messages.create(model=MODEL, max_tokens=200, messages=user("head"), tools=ANTHROPIC_TOOLS)
    assert [(b.type, b.text) for b in streamed.content] == [(b.type, b.text) for b in plain.content]
    assert [(b.type, b.text) for b in plain.content] == [("text", "Listing.")]


# --------------------------------------------------------------------------- item 2
def test_call_quoted_in_reasoning_is_not_executed(oc, ac):
    chunks = list(oc.chat.completions.create(model=MODEL, messages=user("quoted"), tools=OPENAI_TOOLS, stream=True))
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Final answer."
    m = ac.messages.create(model=MODEL, max_tokens=200, messages=user("quoted"), tools=ANTHROPIC_TOOLS, thinking=THINK)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "Final answer."


# --------------------------------------------------------------------------- item 3
def test_truncated_reasoning_is_reasoning_in_both(oc, ac):
    plain = oc.chat.completions.create(model=MODEL, messages=user("think_long"), max_tokens=12)
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "length" and not msg.content
    assert msg.model_extra["reasoning_content"].startswith("hmm hmm")
    assert plain.usage.completion_tokens_details.reasoning_tokens == 12
    chunks = list(
        oc.chat.completions.create(
            model=MODEL, messages=user("think_long"), max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert streamed == msg.model_extra["reasoning_content"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    m = ac.messages.create(model=MODEL, max_tokens=12, messages=user("think_long"), thinking=THINK)
    assert [b.type for b in m.content] == ["thinking"] and m.stop_reason == "max_tokens"  # no empty text block
    with ac.messages.stream(model=MODEL, max_tokens=12, messages=user("think_long"), thinking=THINK) as st:
        ms = st.get_final_message()
    assert [b.type for b in ms.content] == ["thinking"] and ms.content[0].thinking == m.content[0].thinking


# --------------------------------------------------------------------------- item 4
def test_responses_replays_its_own_incomplete_output_and_forces_tools(oc, srv):
    r = oc.responses.create(model=MODEL, input="long", max_output_tokens=5, reasoning={"effort": "none"})
    assert r.status == "incomplete"
    replay = (
        [{"role": "user", "content": "long"}]
        + [o.model_dump(exclude_none=True) for o in r.output]
        + [{"role": "user", "content": "again"}]
    )
    r2 = oc.responses.create(model=MODEL, input=replay, reasoning={"effort": "none"})
    assert r2.status == "completed" and r2.output_text == "echo: again"
    for choice in ("required", {"type": "function", "name": "bash"}):
        r3 = oc.responses.create(model=MODEL, input="ls", tools=RESPONSES_TOOLS, tool_choice=choice)
        calls = [o for o in r3.output if o.type == "function_call"]
        assert calls and calls[0].name == "bash" and json.loads(calls[0].arguments) == {"command": "ls"}
    st, _, raw = request("POST", srv.url + "/v1/responses", {"input": "hi", "stream": True})
    ev = sse_events(raw)
    assert st == 200 and ev and all(name == data["type"] for name, data in ev)  # every event is named


# --------------------------------------------------------------------------- item 7
def test_health_head_count_tokens_and_any_model_name(srv, ac, oc, tok):
    assert request("GET", srv.url + "/health")[0] == 200
    assert request("HEAD", srv.url + "/")[0] == 200
    n = ac.messages.count_tokens(model="claude-sonnet-4-5", messages=user("count me"), system="sys").input_tokens
    m = ac.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=user("count me"), system="sys")
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.cache_creation_input_tokens
    assert m.model == "claude-sonnet-4-5"
    st, _, body = request("POST", srv.url + "/v1/responses/input_tokens", {"input": "count me"})
    r = oc.responses.create(model="gpt-5", input="count me", max_output_tokens=3)
    assert st == 200 and json.loads(body)["input_tokens"] == r.usage.input_tokens


def test_strict_model_refuses_other_names(tok):
    with serve(tok, ScriptedModel(tok, "ok"), ctx=512, strict_model=True) as s:
        st, _, body = request("POST", s.url + "/v1/chat/completions", {"model": "gpt-9", "messages": user("x")})
        assert st == 404 and "gpt-9" in body
        st, _, _ = request(
            "POST", s.url + "/v1/chat/completions", {"model": MODEL, "messages": user("x"), "max_tokens": 2}
        )
        assert st == 200


# --------------------------------------------------------------------------- item 8
def test_every_way_of_saying_thinking_off(oc, ac):
    m = ac.messages.create(model=MODEL, max_tokens=50, messages=user("hi"))  # absent: Anthropic's default is off
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "echo: hi"
    m = ac.messages.create(model=MODEL, max_tokens=50, messages=user("hi"), thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"]
    m = ac.messages.create(model=MODEL, max_tokens=50, messages=user("hi"), thinking=THINK)
    assert [b.type for b in m.content] == ["thinking", "text"]
    for effort in ("none", "minimal"):
        r = oc.chat.completions.create(model=MODEL, messages=user("hi"), reasoning_effort=effort)
        assert r.choices[0].message.content == "echo: hi" and not r.choices[0].message.model_extra.get(
            "reasoning_content"
        )


# --------------------------------------------------------------------------- item 9
def test_small_protocol_faults(oc, ac, srv):
    r = oc.completions.create(model=MODEL, prompt="x", max_tokens=6, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"  # no temperature 0 needed
    m = ac.messages.create(model=MODEL, max_tokens=50, messages=user("stop"), stop_sequences=["STOP"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "STOP" and m.content[0].text == "alpha beta "
    assert m.id.startswith("msg_") and len(m.id) > 20
    with ac.messages.stream(model=MODEL, max_tokens=50, messages=user("stop"), stop_sequences=["STOP"]) as st:
        ms = st.get_final_message()
    assert ms.stop_reason == "stop_sequence" and ms.stop_sequence == "STOP"
    r = oc.completions.create(model=MODEL, prompt=["first", "second"], max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1]
    chunks = list(oc.completions.create(model=MODEL, prompt=["first", "second"], max_tokens=4, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    ids = {oc.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2).id for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-") and len(i) > 20 for i in ids)


def test_forced_tool_header_counts_against_max_tokens(oc):
    """The forced tool-call header is generated output: it counts against max_tokens (the
    usage never exceeds the limit); a call the limit cuts is never returned."""
    forced = {"type": "function", "function": {"name": "bash"}}
    r = oc.chat.completions.create(
        model=MODEL, messages=user("ls"), tools=OPENAI_TOOLS, max_tokens=16, tool_choice=forced
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.usage.completion_tokens == 16
    r = oc.chat.completions.create(
        model=MODEL, messages=user("ls"), tools=OPENAI_TOOLS, max_tokens=64, tool_choice=forced
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens <= 64
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"command": "ls"}


# --------------------------------------------------------------------------- item 6
def test_keepalive_goes_out_while_progress_events_arrive(tok, monkeypatch):
    """A prefill of many small chunks: progress events every chunk must not hold the
    keepalive back (it used to wait for keepalive_s without any event).  The server's
    clock is a counter that moves one second per reading, so no real time is involved."""
    import time as real_time
    import types

    from ds4mlx.serve import app as app_module

    ticks = iter(range(10**9))
    monkeypatch.setattr(
        app_module, "time", types.SimpleNamespace(monotonic=lambda: float(next(ticks)), time=real_time.time)
    )
    model = ScriptedModel(tok, "done")
    with serve(tok, model, ctx=4096, prefill_chunk=4, keepalive_s=3.0) as s:
        st, _, raw = request(
            "POST", s.url + "/v1/chat/completions", {"messages": user("word " * 60), "stream": True, "max_tokens": 2}
        )
    assert st == 200 and raw.count(": prefill\n\n") >= 2
    assert raw.index(": prefill") < raw.index("data: ")  # during the prefill, before the answer


# --------------------------------------------------------------------------- item 5
def test_retry_after_a_long_generation_restores_the_prompt_checkpoint(tok):
    from ds4mlx.engine.checkpoints import MemoryCheckpoints

    with serve(tok, ScriptedModel(tok, script), ctx=4096, tokens=200) as s:
        s.engine.checkpoints = MemoryCheckpoints(budget_bytes=1 << 20, min_tokens=8)
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        body = dict(model=MODEL, messages=user("long " + "context " * 30), max_tokens=20, reasoning_effort="none")
        first = oc.chat.completions.create(**body)
        assert first.choices[0].finish_reason == "length"  # the live session now holds prompt + 20 tokens
        evaluated = s.engine.stats.prefill_tokens
        again = oc.chat.completions.create(**body)  # a retry: a shorter prefix than the live session
        assert s.engine.stats.prefill_tokens == evaluated  # nothing prefilled again
        assert s.engine.stats.last_cache_source == "memory-checkpoint"
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens == first.usage.prompt_tokens
        assert again.choices[0].message.content == first.choices[0].message.content


def test_new_turn_whose_prefix_ends_inside_the_last_answer_restores_a_generation_frontier(tok):
    """The client sends back a shorter answer than the one generated (edited, cut):
    the common prefix ends inside the previous generation, past the prompt-end
    checkpoint; the aligned frontier checkpoint below it is restored."""
    from ds4mlx.engine.checkpoints import MemoryCheckpoints

    every = 8
    with serve(tok, ScriptedModel(tok, script), ctx=4096, tokens=200) as s:
        s.engine.checkpoints = MemoryCheckpoints(budget_bytes=16 << 20, entries=8, min_tokens=8, every=every)
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        question = user("long " + "context " * 30)
        first = oc.chat.completions.create(model=MODEL, messages=question, max_tokens=40, reasoning_effort="none")
        assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 40
        n1 = first.usage.prompt_tokens
        kept = " ".join(first.choices[0].message.content.split()[:15])  # 15 of the 40 "word" tokens
        assert len(tok.encode(kept)) == 15
        evaluated = s.engine.stats.prefill_tokens
        again = oc.chat.completions.create(
            model=MODEL,
            messages=[*question, {"role": "assistant", "content": kept}, *user("echo this")],
            max_tokens=8,
            reasoning_effort="none",
        )
        frontier = (n1 + 15) // every * every  # the last aligned frontier inside the common prefix
        assert n1 < frontier  # past the prompt-end checkpoint
        assert s.engine.stats.last_cache_source == "memory-checkpoint"
        assert again.usage.prompt_tokens_details.cached_tokens == frontier
        assert s.engine.stats.prefill_tokens - evaluated == again.usage.prompt_tokens - frontier
        assert again.choices[0].message.content == "echo: echo this"


def test_forced_parameterless_tool_is_written_whole(ac, oc):
    """Nothing for the model to choose: the whole call is forced (the real-client
    suite drives Claude Code's TaskList / Codex's and pi's loops this way)."""
    tools = [{"name": "TaskList", "description": "List tasks", "input_schema": {"type": "object", "properties": {}}}]
    m = ac.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=user("anything"),
        tools=tools,
        tool_choice={"type": "tool", "name": "TaskList"},
    )
    assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == [
        ("tool_use", "TaskList", {})
    ]
    r = oc.chat.completions.create(
        model=MODEL,
        messages=user("anything"),
        max_tokens=64,
        tools=[{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}],
        tool_choice={"type": "function", "function": {"name": "now"}},
        reasoning_effort="none",
    )
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.arguments == "{}"
    assert r.usage.completion_tokens <= 64 and m.usage.output_tokens <= 64  # the forced tokens count
