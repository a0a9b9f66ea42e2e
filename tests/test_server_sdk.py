"""The official `openai` and `anthropic` SDKs against a live `ds4mlx serve`
(127.0.0.1, random port): every generation route, streaming and not, and a
two-step tool round trip on every chat API.

The scripted model double emits fixed text and DSML through the real sampler,
detokenizer and output parser; the second half runs the same routes on the
real engine with the random-weight demo model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lazy_modules import lazy

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, last_user_text, serve  # noqa: E402

anthropic = lazy("anthropic")
openai = lazy("openai")

from ds4mlx.chat.families.deepseek_v4.template import render  # noqa: E402
from ds4mlx.serve.anthropic import parse_anthropic  # noqa: E402
from ds4mlx.serve.completions import parse_completion  # noqa: E402
from ds4mlx.serve.openai import parse_chat  # noqa: E402
from ds4mlx.serve.responses import parse_responses  # noqa: E402

MODEL = "deepseek-v4-flash"
THINK = {"type": "enabled", "budget_tokens": 1024}  # Anthropic thinking is off unless asked for (#17)
BASH_DSML = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]


def generated(prompt: str) -> str:
    """What the scripted model writes after `prompt`."""
    think = prompt.endswith("<think>")

    def r(text: str) -> str:
        return text + "</think>" if think else ""

    if "<tool_result>" in last_user_text(prompt):
        return r("Got the listing.") + "Two files: a.txt and b.txt."
    if "## Tools" in prompt:
        return r("Need ls.") + "Let me look." + BASH_DSML
    return r("Simple greeting.") + "Hello there!"


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture(scope="module")
def srv(tok):
    with serve(tok, ScriptedModel(tok, generated), ctx=4096) as s:
        yield s


@pytest.fixture(scope="module")
def oc(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ac(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def ntok(tok, text: str) -> int:
    return len(tok.encode(text))


def fld(obj, name: str):
    """A field the SDK may or may not declare (then it sits in model_extra)."""
    v = getattr(obj, name, None)
    return v if v is not None else (obj.model_extra or {}).get(name)


# --------------------------------------------------------------------------- OpenAI chat
def test_chat_non_streaming(oc, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = oc.chat.completions.create(model=MODEL, messages=msgs)
    prompt = render(parse_chat({"messages": msgs}))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "stop" and c.message.role == "assistant"
    assert c.message.content == "Hello there!" and c.message.tool_calls is None
    assert fld(c.message, "reasoning_content") == "Simple greeting."
    u = r.usage
    assert u.prompt_tokens == ntok(tok, prompt)
    assert u.completion_tokens == ntok(tok, generated(prompt))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens + fld(u.prompt_tokens_details, "cache_write_tokens") == u.prompt_tokens


def test_chat_streaming_with_usage(oc, tok):
    msgs = [{"role": "user", "content": "Hi there"}]
    chunks = list(
        oc.chat.completions.create(model=MODEL, messages=msgs, stream=True, stream_options={"include_usage": True})
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert reasoning == "Simple greeting." and content == "Hello there!"
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == ["stop"] and body[-1].choices[0].finish_reason == "stop"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == ntok(tok, "Simple greeting.</think>Hello there!")


def test_chat_non_thinking_and_sampling_fields(oc):
    r = oc.chat.completions.create(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0.3,
        top_p=0.9,
        seed=3,
        max_tokens=50,
        stop=["zzz"],
        extra_body={"top_k": 5, "min_p": 0.1},
    )
    assert r.model == "deepseek-chat" and r.choices[0].message.content == "Hello there!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_chat_stop_and_length(oc):
    r = oc.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stop=["there"], reasoning_effort="none"
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Hello "
    r = oc.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, reasoning_effort="none"
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


def test_chat_tool_round_trip(oc, srv, tok):
    msgs = [{"role": "user", "content": "List /tmp"}]
    r1 = oc.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS)
    c = r1.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me look."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "bash" and call.id.startswith("call_")
    assert call.function.arguments == '{"command":"ls /tmp"}' and len(call.id) == len("call_") + 32
    live = len(srv.engine.session)
    msgs2 = msgs + [
        {
            "role": "assistant",
            "content": c.message.content,
            "reasoning_content": fld(c.message, "reasoning_content"),
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"},
    ]
    before = srv.model.prefill_tokens
    r2 = oc.chat.completions.create(model=MODEL, messages=msgs2, tools=OPENAI_TOOLS)
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].message.content == "Two files: a.txt and b.txt."
    # The replayed history (exact sampled DSML from tool memory) extends the live session.
    u = r2.usage
    assert u.prompt_tokens_details.cached_tokens == live
    assert srv.model.prefill_tokens - before == u.prompt_tokens - live


def test_chat_streaming_tool_call(oc):
    chunks = list(
        oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "ls please"}], tools=OPENAI_TOOLS, stream=True
        )
    )
    calls: dict = {}
    for ch in chunks:
        for tc in ch.choices[0].delta.tool_calls or []:
            d = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
            d["id"] = tc.id or d["id"]
            if tc.function and tc.function.name:
                d["name"] = tc.function.name
            d["args"] += (tc.function.arguments or "") if tc.function else ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "bash" and calls[0]["args"] == '{"command":"ls /tmp"}'
    assert calls[0]["id"].startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_disables_tools(oc):
    r = oc.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ls"}], tools=OPENAI_TOOLS, tool_choice="none"
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Hello there!"


def test_tool_choice_unknown_name_is_400(oc):
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "ls"}],
            tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.status_code == 400 and "nope" in e.value.body["message"]


# --------------------------------------------------------------------------- completions
def test_completions_non_streaming_and_streaming(oc, tok):
    r = oc.completions.create(model=MODEL, prompt="Say hi", max_tokens=40)
    prompt = parse_completion({"prompt": "Say hi"}).render()
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    (c,) = r.choices
    assert c.text == "Simple greeting.</think>Hello there!" and c.finish_reason == "stop"
    assert r.usage.prompt_tokens == ntok(tok, prompt) and r.usage.completion_tokens == ntok(tok, c.text)
    chunks = list(
        oc.completions.create(
            model=MODEL, prompt="Say hi", max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "Simple greeting.</think>Hello there!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == ntok(tok, text)


# --------------------------------------------------------------------------- Anthropic
def test_anthropic_non_streaming(ac, tok):
    r = ac.messages.create(
        model=MODEL, thinking=THINK, max_tokens=100, system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    prompt = render(
        parse_anthropic({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}], "thinking": THINK})
    )
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Simple greeting." and r.content[0].signature == r.id
    assert r.content[1].text == "Hello there!"
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    u = r.usage
    assert u.cache_read_input_tokens + u.cache_creation_input_tokens == ntok(tok, prompt)
    assert u.input_tokens == 0 and u.output_tokens == ntok(tok, generated(prompt))


def test_anthropic_streaming(ac):
    with ac.messages.stream(
        model=MODEL, thinking=THINK, max_tokens=100, messages=[{"role": "user", "content": "Hey"}]
    ) as st:
        events = [e.type for e in st]
        m = st.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Simple greeting." and m.content[0].signature == m.id
    assert m.content[1].text == "Hello there!" and m.stop_reason == "end_turn"
    assert m.usage.output_tokens > 0


def test_anthropic_max_tokens(ac):
    r = ac.messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}], thinking={"type": "disabled"}
    )
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3 and r.content[0].type == "text"


def test_anthropic_tool_round_trip_continues_live_state(ac, srv):
    msgs = [{"role": "user", "content": "List /tmp"}]
    r1 = ac.messages.create(model=MODEL, thinking=THINK, max_tokens=200, messages=msgs, tools=ANTHROPIC_TOOLS)
    assert r1.stop_reason == "tool_use"
    assert [b.type for b in r1.content] == ["thinking", "text", "tool_use"]
    use = r1.content[2]
    assert use.name == "bash" and use.input == {"command": "ls /tmp"} and use.id.startswith("toolu_")
    live = len(srv.engine.session)
    before = srv.model.prefill_tokens
    msgs2 = msgs + [
        {"role": "assistant", "content": [b.model_dump() for b in r1.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a.txt\nb.txt"}]},
    ]
    r2 = ac.messages.create(model=MODEL, thinking=THINK, max_tokens=200, messages=msgs2, tools=ANTHROPIC_TOOLS)
    assert r2.stop_reason == "end_turn" and r2.content[-1].text == "Two files: a.txt and b.txt."
    assert srv.engine.stats.last_cache_source == "anthropic-tool-output"
    assert r2.usage.cache_read_input_tokens == live
    assert srv.model.prefill_tokens - before == r2.usage.cache_creation_input_tokens  # only the new suffix


def test_anthropic_streaming_tool_use(ac):
    with ac.messages.stream(
        model=MODEL,
        thinking=THINK,
        max_tokens=200,
        messages=[{"role": "user", "content": "ls it"}],
        tools=ANTHROPIC_TOOLS,
    ) as st:
        m = st.get_final_message()
    assert m.stop_reason == "tool_use"
    tool = [b for b in m.content if b.type == "tool_use"]
    assert len(tool) == 1 and tool[0].input == {"command": "ls /tmp"} and tool[0].id.startswith("toolu_")


def test_anthropic_unknown_tool_use_id_is_400(ac):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(
            model=MODEL,
            thinking=THINK,
            max_tokens=10,
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}
            ],
        )
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and "toolu_nope" in e.value.body["error"]["message"]


# --------------------------------------------------------------------------- Responses
def test_responses_non_streaming(oc, tok):
    r = oc.responses.create(model=MODEL, input="Hi", instructions="Be brief.", reasoning={"summary": "auto"})
    prompt = render(parse_responses({"input": "Hi", "instructions": "Be brief."}))
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].summary[0].text == "Simple greeting."
    assert r.output[1].role == "assistant" and r.output_text == "Hello there!"
    u = r.usage
    assert u.input_tokens == ntok(tok, prompt) and u.output_tokens == ntok(tok, generated(prompt))
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens + fld(u.input_tokens_details, "cache_write_tokens") == u.input_tokens


def test_responses_hidden_reasoning_without_summary(oc):
    r = oc.responses.create(model=MODEL, input="Hello")
    assert [o.type for o in r.output] == ["message"] and r.output_text == "Hello there!"


def test_responses_streaming(oc):
    with oc.responses.stream(model=MODEL, input="Hey", reasoning={"summary": "auto"}) as st:
        types = [e.type for e in st]
        r = st.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.reasoning_summary_text.delta" in types and "response.output_text.delta" in types
    assert r.status == "completed" and r.output_text == "Hello there!"
    assert r.output[0].summary[0].text == "Simple greeting."


def test_responses_incomplete_on_max_output_tokens(oc):
    r = oc.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_tokens"


def test_responses_tool_round_trip_continues_live_state(oc, srv):
    r1 = oc.responses.create(model=MODEL, input="List /tmp", tools=RESPONSES_TOOLS)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert len(calls) == 1 and r1.status == "completed"
    call = calls[0]
    assert call.name == "bash" and call.arguments == '{"command":"ls /tmp"}' and call.call_id.startswith("call_")
    assert call.id.startswith("fc_")
    live = len(srv.engine.session)
    before = srv.model.prefill_tokens
    r2 = oc.responses.create(
        model=MODEL,
        tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a.txt\nb.txt"}],
    )
    assert r2.output_text == "Two files: a.txt and b.txt." and r2.status == "completed"
    assert srv.engine.stats.last_cache_source == "responses-tool-output"
    d = r2.usage.input_tokens_details
    assert d.cached_tokens == live
    assert srv.model.prefill_tokens - before == fld(d, "cache_write_tokens")


def test_responses_streaming_tool_call(oc):
    with oc.responses.stream(model=MODEL, input="ls now", tools=RESPONSES_TOOLS) as st:
        types = [e.type for e in st]
        r = st.get_final_response()
    assert "response.function_call_arguments.done" in types
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.arguments == '{"command":"ls /tmp"}'


def test_responses_unknown_call_id_is_400(oc):
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.create(model=MODEL, input=[{"type": "function_call_output", "call_id": "call_x", "output": "x"}])
    assert "call_x" in e.value.body["message"]


# --------------------------------------------------------------------------- demo model
@pytest.fixture(scope="module")
def demo(shared_demo):
    model, tok = shared_demo()
    with serve(tok, model, ctx=1024) as s:
        s.tok = tok
        yield s


def test_demo_model_every_route(demo):
    oc = openai.OpenAI(base_url=demo.url + "/v1", api_key="x", max_retries=0, timeout=120)
    ac = anthropic.Anthropic(base_url=demo.url, api_key="x", max_retries=0, timeout=120)
    tok = demo.tok
    msgs = [{"role": "user", "content": "Hello"}]
    prompt = render(parse_chat({"messages": msgs}))

    r = oc.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, seed=1)
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens == ntok(tok, prompt) and 0 < r.usage.completion_tokens <= 4

    chunks = list(
        oc.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens <= 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] != []

    c = oc.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert c.id.startswith("cmpl-") and c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.completion_tokens <= 4
    cs = list(oc.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True))
    assert cs[-1].choices[0].finish_reason in ("stop", "length")

    m = ac.messages.create(model=MODEL, max_tokens=4, messages=msgs)
    assert m.id.startswith("msg_") and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and m.usage.output_tokens <= 4
    with ac.messages.stream(model=MODEL, max_tokens=4, messages=msgs) as st:
        fm = st.get_final_message()
    assert fm.stop_reason in ("end_turn", "max_tokens", "tool_use")

    resp = oc.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    assert resp.id.startswith("resp_") and resp.status in ("completed", "incomplete")
    assert resp.usage.output_tokens <= 4
    # (the SDK's `responses.stream()` helper only accepts `response.completed`; a
    # max_output_tokens stop ends with `response.incomplete`, so read the raw events)
    evs = list(oc.responses.create(model=MODEL, input="Hello", max_output_tokens=4, stream=True))
    assert evs[0].type == "response.created" and [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[-1].type in ("response.completed", "response.incomplete")
    assert evs[-1].response.status == evs[-1].type.split(".")[1] and evs[-1].response.id == evs[0].response.id


def test_demo_model_ignore_eos_exact_length(demo):
    oc = openai.OpenAI(base_url=demo.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = oc.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason in ("length", "tool_calls")


def test_tool_choice_named_and_required_force_a_call(tok):
    """The scripted model writes filler where the forced DSML goes: only the
    forced generation contains a parseable call."""
    from ds4mlx.serve.prepare import force_text

    rest = (
        '<｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )

    def script(prompt):
        return tok.encode("Hmm.</think>") + tok.encode("x") * len(tok.encode(force_text("bash"))) + tok.encode(rest)

    with serve(tok, ScriptedModel(tok, script), ctx=4096) as s:
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        ac = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "go"}]
        r = oc.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
        r = oc.chat.completions.create(
            model=MODEL,
            messages=msgs,
            tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "bash"}},
        )
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.arguments == '{"command":"ls"}'
        m = ac.messages.create(
            model=MODEL,
            thinking=THINK,
            max_tokens=200,
            messages=msgs,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "tool", "name": "bash"},
        )
        assert m.stop_reason == "tool_use" and m.content[-1].input == {"command": "ls"}
        # required / any: the block and invoke tag are forced, the model names the tool
        long_filler = len(tok.encode(force_text(None)))
        s.model.script = lambda p: (
            tok.encode("Hmm.</think>") + tok.encode("x") * long_filler + tok.encode('bash">\n' + rest)
        )
        r = oc.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS, tool_choice="required")
        assert r.choices[0].message.tool_calls[0].function.name == "bash"
        m = ac.messages.create(
            model=MODEL,
            thinking=THINK,
            max_tokens=200,
            messages=msgs,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any"},
        )
        assert m.stop_reason == "tool_use" and m.content[-1].name == "bash"


def test_responses_full_replay_continues_from_the_visible_transcript(oc, srv):
    """Clients that resend the whole visible history (no reasoning) continue the
    live session through the remembered visible transcript (kv-cache.md §2 step 1)."""
    user = {"role": "user", "content": "List /tmp please"}
    r1 = oc.responses.create(model=MODEL, input=[user], tools=RESPONSES_TOOLS)
    msg = next(o for o in r1.output if o.type == "message")
    call = next(o for o in r1.output if o.type == "function_call")
    history = [
        user,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": msg.content[0].text}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt\nb.txt"},
    ]
    live = len(srv.engine.session)
    before = srv.model.prefill_tokens
    r2 = oc.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS)
    assert r2.output_text == "Two files: a.txt and b.txt."
    assert srv.engine.stats.last_cache_source == "responses-visible"
    d = r2.usage.input_tokens_details
    assert d.cached_tokens == live and srv.model.prefill_tokens - before == fld(d, "cache_write_tokens")
    live = len(srv.engine.session)
    history += [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r2.output_text}]},
        {"role": "user", "content": "thanks"},
    ]
    r3 = oc.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS)
    assert srv.engine.stats.last_cache_source == "responses-visible"
    assert r3.usage.input_tokens_details.cached_tokens == live


def test_multi_turn_chat_reuses_the_live_session_with_hidden_reasoning(oc, ac, srv):
    msgs = [{"role": "user", "content": "Good morning"}]
    r1 = oc.chat.completions.create(model=MODEL, messages=msgs)
    live = len(srv.engine.session)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "And?"}]
    r2 = oc.chat.completions.create(model=MODEL, messages=msgs)
    assert srv.engine.stats.last_cache_source == "thinking-visible"
    assert r2.usage.prompt_tokens_details.cached_tokens == live
    live = len(srv.engine.session)
    amsgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
    amsgs += [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "Ok"}]
    r3 = ac.messages.create(model=MODEL, thinking=THINK, max_tokens=100, messages=amsgs)
    assert srv.engine.stats.last_cache_source == "thinking-visible"
    assert r3.usage.cache_read_input_tokens == live and r3.content[-1].text == "Hello there!"
