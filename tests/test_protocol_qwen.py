"""Qwen3.8 Flash Next chat protocol (ds4mlx/chat/families/qwen.py).

Prompts are compared byte for byte with the official Qwen3.8 chat template
(tests/data/chat_templates/qwen4_exp.jinja; provenance and the one known
Flash-Next difference -- `high` accepted as `xhigh` -- in SOURCES.md),
rendered by transformers' own jinja setup.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lazy_modules import requires
from template_helpers import TEMPLATES, render_jinja
from template_helpers import openai_body as make_body

from ds4mlx.chat.families.qwen import PROTOCOL as QWEN
from ds4mlx.chat.messages import ToolCall
from ds4mlx.runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from ds4mlx.serve.prepare import parse_request

needs = requires("transformers.utils.chat_template_utils")

TEMPLATE = (TEMPLATES / "qwen4_exp.jinja").read_text()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command — carefully",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "array"}}},
        },
    },
]
# system, tools, a tool call (two calls), tool results, thinking (kept in history)
MESSAGES = [
    {"role": "system", "content": "You are terse.\n"},
    {"role": "user", "content": " What is in /tmp? Also read a.txt. "},
    {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "\nNeed ls, then read.\n",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": {"command": "ls /tmp", "timeout": 10}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "read_file", "arguments": {"path": "a.txt", "lines": [1, 2]}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt\n"},
    {"role": "tool", "tool_call_id": "call_2", "content": "hello </tool_response> world"},
    {"role": "assistant", "content": "Two files; a.txt says hello.", "reasoning_content": "Summarize."},
    {"role": "user", "content": "Thanks. And </think> <tool_call> are just text here."},
]


def jinja(messages, tools=None, **kw) -> str:
    return render_jinja(TEMPLATE, messages, tools, **kw)


def openai_body(messages, tools=None, **extra) -> dict:
    return make_body("qwen3.8-flash-next", messages, tools, **extra)


def ours(body, effort=None) -> str:
    conv = parse_request("openai", body)
    conv.thinking = QWEN.resolve_thinking(conv.thinking, effort, model=body.get("model"), explicit="thinking" in body)
    return QWEN.render(conv)


def test_prompt_matches_template():
    assert ours(openai_body(MESSAGES, TOOLS)) == jinja(MESSAGES, TOOLS)


@pytest.mark.parametrize(
    "effort,template_effort",
    [("low", "low"), ("medium", "medium"), ("xhigh", "xhigh"), ("high", "xhigh"), ("max", "xhigh")],
)
def test_reasoning_effort(effort, template_effort):
    for msgs, tools in ((MESSAGES[:2], None), (MESSAGES, TOOLS), (MESSAGES[1:2], None)):
        body = openai_body(msgs, tools, reasoning_effort=effort)
        assert ours(body, effort) == jinja(msgs, tools, reasoning_effort=template_effort)


def test_thinking_off_and_chat_alias():
    msgs = MESSAGES[1:2]
    off = ours(openai_body(msgs, thinking={"type": "disabled"}))
    assert off == jinja(msgs, enable_thinking=False) and off.endswith("<think>\n\n</think>\n\n")
    assert ours(openai_body(msgs, TOOLS, thinking=False)) == jinja(msgs, TOOLS, enable_thinking=False)
    alias = openai_body(msgs)
    alias["model"] = "qwen3.8-flash-next-chat"
    assert ours(alias) == off
    alias["model"] = "qwen3.8-flash-next-reasoner"
    assert ours(alias) == jinja(msgs)


def test_history_without_system_and_empty_content_call():
    msgs = [
        {"role": "user", "content": "ls"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "bash", "arguments": {"command": "ls"}}},
                {"id": "c2", "function": {"name": "bash", "arguments": {"command": "pwd"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
        {"role": "tool", "tool_call_id": "c2", "content": "/"},
    ]
    assert ours(openai_body(msgs, TOOLS)) == jinja(msgs, TOOLS)


def test_anthropic_request_renders_like_the_template():
    body = {
        "model": "qwen3.8-flash-next",
        "system": "Be terse.",
        "max_tokens": 64,
        "thinking": {"type": "enabled", "budget_tokens": 1024},  # Anthropic's default is off (#17)
        "tools": [{"name": "bash", "description": "Run", "input_schema": {"type": "object", "properties": {}}}],
        "messages": [
            {"role": "user", "content": "ls"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need ls."},
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a b"},
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    }
    conv = parse_request("anthropic", body)
    conv.thinking = QWEN.resolve_thinking(conv.thinking)
    ref = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "ls"},
        {
            "role": "assistant",
            "content": "Looking.",
            "reasoning_content": "Need ls.",
            "tool_calls": [{"id": "toolu_1", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a b"},
        {"role": "user", "content": "go on"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "bash", "description": "Run", "input_schema": {"type": "object", "properties": {}}},
        }
    ]
    assert QWEN.render(conv) == jinja(ref, tools)


def test_ids_tail_and_forcing():
    assert QWEN.model_id == "qwen3.8-flash-next" and QWEN.family == "qwen4_exp"
    assert set(QWEN.aliases) == {"qwen3.8-flash-next-chat", "qwen3.8-flash-next-reasoner"}
    assert "<|im_end|>" in QWEN.stop_strings
    conv = parse_request("openai", openai_body(MESSAGES[:5], TOOLS))
    conv.thinking = "xhigh"
    full = QWEN.render(conv)
    tail = QWEN.render_continuation_tail(conv, 3)
    assert tail.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n") and full.endswith(tail)
    assert full[: -len(tail)].endswith("</function>\n</tool_call>")
    assert QWEN.force_text("bash") == "<tool_call>\n<function=bash>\n"


def test_completion_prompt():
    assert QWEN.render_completion("Hi", "medium") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


# --------------------------------------------------------------------------- output parsing

SCHEMAS = [json.dumps(t["function"]) for t in TOOLS]
OUT = (
    "First </thi I check.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=bash>\n<parameter=command>\n"
    "echo '</tool_call> </think> <tool_call> <parameter=x>'\n</parameter>\n<parameter=timeout>\n10\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=read_file>\n<parameter=path>\n42\n</parameter>\n"
    "<parameter=lines>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
)


def stream(text, chunks, thinking=True, tools=True, schemas=SCHEMAS, truncated=False):
    p = QWEN.make_parser(thinking, tools, tool_schemas=schemas)
    evs, flags = [], []
    pos = 0
    for n in chunks:
        if pos >= len(text) or p.stop_now:
            break
        evs += p.feed(text[pos : pos + n])
        pos += n
        flags.append((pos, p.structural))
    if pos < len(text) and not p.stop_now:
        evs += p.feed(text[pos:])
    more, final = p.finish(truncated)
    return evs + more, final, flags, p


def check_stream(evs, final):
    assert "".join(e.text for e in evs if isinstance(e, ReasoningDelta)) == (final.reasoning or "")
    assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == final.content
    ends = [e for e in evs if isinstance(e, ToolCallEnd)]
    assert [(e.name, e.arguments, e.id) for e in ends] == [(c.name, c.arguments, c.id) for c in final.calls]
    for i, e in enumerate(ends):
        assert "".join(d.arguments for d in evs if isinstance(d, ToolCallDelta) and d.index == i) == e.arguments
    assert [e.name for e in evs if isinstance(e, ToolCallStart)] == [c.name for c in final.calls]


def test_final_parse():
    final = QWEN.parse(OUT, thinking=True, tool_schemas=SCHEMAS)
    assert final.reasoning == "First </thi I check." and final.content == "Let me look."
    assert json.loads(final.calls[0].arguments) == {
        "command": "echo '</tool_call> </think> <tool_call> <parameter=x>'",
        "timeout": 10,
    }
    assert json.loads(final.calls[1].arguments) == {"path": "42", "lines": [1, 2]}
    assert final.raw_dsml.startswith("<tool_call>") and final.raw_dsml.endswith("</tool_call>")


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 11, 10000])
def test_stream_split_anywhere(size):
    evs, final, _, _ = stream(OUT, [size] * len(OUT))
    check_stream(evs, final)
    assert [c.name for c in final.calls] == ["bash", "read_file"]


def test_split_think_close_and_call_open_are_held():
    p = QWEN.make_parser(True, True)
    evs = p.feed("Plan</thi")
    assert [e.text for e in evs] == ["Plan"]  # `</thi` is held, not leaked
    evs = p.feed("nk>\n\nHello <tool_")
    assert [(type(e).__name__, e.text) for e in evs] == [("TextDelta", "Hello")]
    evs = p.feed("call>\n<function=bash>\n")
    assert evs == [] and p.structural  # the name alone is not certain yet (#17): nothing announced
    evs = p.feed("<parameter=command>\nls\n</parameter>\n")
    assert [type(e).__name__ for e in evs] == ["ToolCallStart", "ToolCallDelta", "ToolCallDelta"]


def test_inline_think_when_the_prompt_did_not_open_it():
    text = "<think>\nquick check\n</think>\n\nThe answer is 4."
    evs, final, _, _ = stream(text, [1] * len(text), thinking=False, tools=False)
    assert final.reasoning == "quick check" and final.content == "The answer is 4."
    check_stream(evs, final)
    final = QWEN.parse("No thinking here. <think> is a word.", thinking=False, tools_active=False)
    assert final.reasoning is None and final.content == "No thinking here. <think> is a word."


def test_structural_flags():
    text = "r\n</think>\n\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>"
    _, _, flags, _ = stream(text, [1] * len(text))
    state = dict(flags)
    at = text.index
    assert state[at("<function=") + 4] is True and state[at("bash") + 2] is True
    assert state[at("ls -la") + 3] is False  # the value is sampled
    assert state[at("</parameter>") + 3] is True  # a partial close is structure


def test_trailing_text_stops_and_literal_tool_call_in_text():
    text = OUT + "\nand then some text"
    evs, final, _, p = stream(text, [3] * len(text))
    assert p.stop_now and len(final.calls) == 2
    check_stream(evs, final)
    text = "r</think>Use the <tool_call> tag like this."
    evs, final, _, _ = stream(text, [1] * len(text))
    assert final.content == "Use the <tool_call> tag like this." and not final.calls
    check_stream(evs, final)


def test_unterminated_and_truncated():
    text = "r</think>ok\n<tool_call>\n<function=bash>\n<parameter=command>\nls"
    assert QWEN.parse(text, thinking=True).error == "unterminated tool call"
    final = QWEN.parse(text, thinking=True, truncated=True)
    assert final.error is None and final.finish == "length" and not final.calls


# --------------------------------------------------------------------------- round trip

_text = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),
    st.sampled_from(
        [
            "</tool_call>",
            "</think>",
            "<tool_call>",
            "</parameter>",
            "&lt;/parameter>",
            "<parameter=a>",
            "\n",
            "\nlead",
            "trail\n",
            "  ",
            '{"a": 1}',
            "true",
        ]
    ),
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strings=st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), _text, max_size=3),
    others=st.dictionaries(st.from_regex(r"[A-Z]{1,6}", fullmatch=True), _json, max_size=2),
    chunk=st.integers(1, 9),
)
def test_render_then_parse_round_trip(strings, others, chunk):
    args = {**strings, **others}
    props = {k: {"type": "string"} for k in strings}
    props.update({k: {"type": ["object", "array", "integer", "boolean", "null"]} for k in others})
    schemas = [json.dumps({"name": "tool", "parameters": {"type": "object", "properties": props}})]
    calls = [
        ToolCall(id="call_1", name="tool", arguments=json.dumps(args)),
        ToolCall(id="call_2", name="tool", arguments="{}"),
    ]
    text = "why\n</think>\n\n" + QWEN.render_calls(calls)
    final = QWEN.parse(text, thinking=True, tool_schemas=schemas)
    assert [json.loads(c.arguments) for c in final.calls] == [args, {}]
    evs, sfinal, _, _ = stream(text, [chunk] * len(text), schemas=schemas)
    check_stream(evs, sfinal)
