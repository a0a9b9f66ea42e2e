"""DeepSeek V4.1 Flash chat protocol (ds4mlx/chat/families/deepseek_v41.py).

V4.1 has no jinja chat template: its reference is the `encoding.py` DeepSeek
released with V4.1.  `test_golden_*` render every conversation of
tests/data/chat_templates/deepseek_v41_golden.json -- prompts that encoder's
vendored copy rendered (SOURCES.md: where it came from, the generator's
arguments) -- the way a client sends it (OpenAI and Anthropic bodies through
`parse_request`, the effort resolved as the server does) and compare byte for
byte.  The deliberate differences are the named exceptions below.  The other
tests spell prompts out piece by piece.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4mlx.chat.families.deepseek_v41 import PROTOCOL as V41
from ds4mlx.chat.messages import ToolCall
from ds4mlx.chat.protocol import EffortError, request_effort
from ds4mlx.runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd
from ds4mlx.serve.prepare import parse_request

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYS, USER, ASST = "<｜System｜>", "<｜User｜>", "<｜Assistant｜>"


def effort(n: int) -> str:
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


BASH = {
    "name": "bash",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}},
}
TOOLS_TEXT = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    'writing a "<｜DSML｜ calls>" block like the following:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n'
    '</｜DSML｜ invoke>\n<｜DSML｜ invoke name="$TOOL_NAME2">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n" + json.dumps(BASH, ensure_ascii=False) + "\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
CALLS = (
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="bash">\n'
    '<｜DSML｜ parameter name="command" string="true">ls /tmp</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="timeout" string="false">10</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)


def body(**extra):
    b = {
        "model": "deepseek-v4.1-flash",
        "tools": [{"type": "function", "function": BASH}],
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "List /tmp"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "reasoning_content": "Need ls.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"command": "ls /tmp", "timeout": 10}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
        ],
    }
    b.update(extra)
    return b


def render(b, api="openai"):
    parser_body, eff = request_effort(api, b, numeric=True)
    conv = parse_request(api, parser_body)
    conv.thinking = V41.resolve_thinking(conv.thinking, eff, model=conv.model)
    return V41.render(conv), conv


def test_prompt_system_tools_call_result_thinking():
    got, _ = render(body())
    assert got == (
        BOS
        + SYS
        + effort(75)
        + "You are terse."
        + "\n\n"
        + TOOLS_TEXT
        + USER
        + "List /tmp"
        + ASST
        + "<think>"
        + "Need ls.</think>"
        + "Let me look."
        + CALLS
        + EOS
        + USER
        + "<tool_result>a.txt\nb.txt</tool_result>"
        + ASST
        + "<think>"
    )


def test_numeric_and_named_efforts_and_chat_mode():
    for value, level in (
        ("50", 50),
        (1, 1),
        ("100", 100),
        ("low", 50),
        ("medium", 62),
        ("high", 75),
        ("max", 100),
        ("xhigh", 100),
    ):
        got, conv = render(body(reasoning_effort=value))
        assert conv.thinking == str(level) and got.startswith(BOS + SYS + effort(level))
    for off in (
        {"reasoning_effort": "0"},
        {"reasoning_effort": 0},
        {"reasoning_effort": "none"},
        {"thinking": {"type": "disabled"}},
        {"model": "deepseek-chat"},
    ):
        got, conv = render(body(**off))
        assert conv.thinking == "none"
        assert got == (
            BOS
            + SYS
            + "You are terse."
            + "\n\n"
            + TOOLS_TEXT
            + USER
            + "List /tmp"
            + ASST
            + "</think>"
            + "Let me look."
            + CALLS
            + EOS
            + USER
            + "<tool_result>a.txt\nb.txt</tool_result>"
            + ASST
            + "</think>"
        )
    for bad in ("101", 101, -1):
        with pytest.raises(EffortError):
            render(body(reasoning_effort=bad))
    assert V41.render_think_level(0) == "none" and V41.render_think_level(25) == "25"
    with pytest.raises(EffortError):
        V41.render_think_level(101)


def test_effort_in_responses_and_anthropic_bodies():
    assert request_effort("responses", {"reasoning": {"effort": "40", "summary": "auto"}}, numeric=True) == (
        {"reasoning": {"summary": "auto"}},
        "40",
    )
    assert request_effort("anthropic", {"output_config": {"effort": 7}}, numeric=True) == (
        {"output_config": {}, "thinking": {"type": "enabled"}},
        7,
    )  # a named effort turns thinking on (#17)
    b = {"reasoning_effort": "high"}
    assert request_effort("chat", b, numeric=True) == (b, "high")


def test_deepseek_recipe_goldens():
    """Bodies from the third-party deepseek-recipe tests.  The first expected string is
    theirs; for the second they keep the old reasoning, DeepSeek's encoder (no tool
    context: drop_thinking) and ds4 drop it -- the string here is the encoder's."""
    conv = parse_request("openai", {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "hello"}]})
    conv.thinking = "none"
    assert V41.render(conv) == "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>"
    got, _ = render(
        {
            "model": "deepseek-v4.1-flash",
            "reasoning_effort": "minimal",
            "messages": [
                {"role": "user", "content": "first"},
                {"role": "user", "content": "second"},
                {"role": "assistant", "content": "answer", "reasoning_content": "prior reasoning"},
                {"role": "system", "content": "new instruction"},
            ],
        }
    )
    # deliberate difference (#17): "minimal" is OpenAI's way of saying (almost) no reasoning, so
    # thinking is off; the recipe's encoder renders effort 50 and an open <think> here
    assert got == (
        "<｜begin▁of▁sentence｜><｜User｜>first\n\nsecond<｜Assistant｜></think>"
        "answer<｜end▁of▁sentence｜><｜System｜>new instruction<｜Assistant｜></think>"
    )


# --------------------------------------------------------------------------- golden prompts (reference encoder)

GOLDEN = json.loads(
    (Path(__file__).parent / "data" / "chat_templates" / "deepseek_v41_golden.json").read_text(encoding="utf-8")
)

# Named exception: the named effort "high".  The vendored encoder maps it to 50
# (its presets: low 25, high 50, xhigh 75, max 100).  ds4 -- DS4_THINK_HIGH,
# `--think` = 75 (seed, think-level paragraph) -- and, per a third-party note,
# DeepSeek's released encoder revision use high 75 (low 50, max 100); we keep 75.
# The number is the only difference: the same case sent with the numeric level
# the encoder used renders its bytes exactly (checked below).
NAMED_EFFORT_EXCEPTIONS = {"high": (50, 75)}


def _openai_body(case: dict) -> dict:
    b = {"model": "deepseek-v4.1-flash", "messages": case["messages"]}
    if case["tools"]:
        b["tools"] = case["tools"]
    # chat mode: effort 0 turns thinking off; otherwise the level or name as sent
    b["reasoning_effort"] = 0 if case["thinking_mode"] == "chat" else case["reasoning_effort"]
    return b


def _golden_expected(case: dict) -> str:
    exp = case["expected"]
    if case["reasoning_effort"] in NAMED_EFFORT_EXCEPTIONS:
        theirs, ours = NAMED_EFFORT_EXCEPTIONS[case["reasoning_effort"]]
        assert exp.count(effort(theirs)) == 1
        exp = exp.replace(effort(theirs), effort(ours))
    return exp


def test_golden_file_covers_the_acceptance_conversation():
    names = {c["name"] for c in GOLDEN}
    for level in (0, 1, 25, 50, "high", 75, 100, "max"):
        assert f"acceptance/effort={level}" in names
    acc = next(c for c in GOLDEN if c["name"] == "acceptance/effort=75")
    roles = [m["role"] for m in acc["messages"]]
    assert roles[0] == "system" and "tool" in roles and roles[-1] == "user" and acc["tools"]
    assert any(m.get("reasoning_content") and m.get("tool_calls") for m in acc["messages"])
    assert {c["thinking_mode"] for c in GOLDEN} == {"chat", "thinking"}
    assert {c["drop_thinking"] for c in GOLDEN} == {True, False}


@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_golden_openai(case):
    got, conv = render(_openai_body(case))
    assert got == _golden_expected(case)
    # the effort as a digit string, as the CLI think level and as the Anthropic field: same bytes
    if case["thinking_mode"] == "thinking" and isinstance(case["reasoning_effort"], int):
        n = case["reasoning_effort"]
        assert render(dict(_openai_body(case), reasoning_effort=str(n)))[0] == case["expected"]
        assert conv.thinking == V41.render_think_level(n) == V41.resolve_thinking("high", n)
    if case["reasoning_effort"] in NAMED_EFFORT_EXCEPTIONS:
        theirs, _ = NAMED_EFFORT_EXCEPTIONS[case["reasoning_effort"]]
        assert render(dict(_openai_body(case), reasoning_effort=theirs))[0] == case["expected"]


def _anthropic_tool(tool: dict) -> dict:
    fn = tool["function"]
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


def _anthropic_body(case: dict) -> dict | None:
    """The case as an Anthropic Messages body; None where that API cannot say it:
    a system message after the first turn (Anthropic has one top-level system),
    or an empty system prompt (ds4 skips empty system text, spec §2.2)."""
    msgs = case["messages"]
    system = None
    if msgs and msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"], msgs[1:]
        if not system:
            return None
    if any(m["role"] == "system" for m in msgs):
        return None
    out: list = []
    for m in msgs:
        if m["role"] == "tool":
            role = "user"
            blocks = [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]
        else:
            role = m["role"]
            blocks = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or []:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": c["id"],
                        "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"]),
                    }
                )
        if role == "user" and out and out[-1]["role"] == "user":
            # adjacent text blocks are joined with nothing: write the turn boundary out
            if blocks[0]["type"] == "text" and out[-1]["content"][-1]["type"] == "text":
                out[-1]["content"].append({"type": "text", "text": "\n\n"})
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    b = {"model": "deepseek-v4.1-flash", "max_tokens": 64, "messages": out}
    if system is not None:
        b["system"] = system
    if case["tools"]:
        b["tools"] = [_anthropic_tool(t) for t in case["tools"]]
    if case["thinking_mode"] == "chat":
        b["thinking"] = {"type": "disabled"}
    else:
        b["output_config"] = {"effort": case["reasoning_effort"]}
    return b


ANTHROPIC = [c for c in GOLDEN if _anthropic_body(c) is not None]

# Literal `<tool_result>..</tool_result>` typed in a text block next to real tool_result
# blocks stays text (the parser records the blocks' spans, as ds4's ds41_message_views
# does): "parallel_literal_result_text" checks it.


def test_golden_anthropic_covers_tools_results_and_thinking():
    names = {c["name"] for c in ANTHROPIC}
    assert {
        "acceptance/effort=0",
        "acceptance/effort=75",
        "parallel_calls_results_out_of_order/effort=75",
        "nested_arguments/effort=100",
        "multi_turn_reasoning_dropped/effort=75",
    } <= names


@pytest.mark.parametrize("case", ANTHROPIC, ids=[c["name"] for c in ANTHROPIC])
def test_golden_anthropic(case):
    """Named exception: Anthropic tools reach the model as declared -- the schema
    line is the `{name, description, input_schema}` object (spec §2.4), where the
    encoder, which takes OpenAI tools, shows `{name, description, parameters}`."""
    exp = _golden_expected(case)
    for t in case["tools"] or []:
        line = json.dumps(t["function"], ensure_ascii=False)
        assert exp.count(line) == 1
        exp = exp.replace(line, json.dumps(_anthropic_tool(t), ensure_ascii=False))
    got, _ = render(_anthropic_body(case), "anthropic")
    assert got == exp


def test_parallel_tool_results_are_put_in_call_order_and_welded():
    b = body()
    b["messages"][2]["tool_calls"].append(
        {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": '{"command": "pwd"}'}}
    )
    b["messages"][3:] = [
        {"role": "tool", "tool_call_id": "call_2", "content": "/home"},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "user", "content": "and?"},
    ]
    got, conv = render(b)
    assert got.endswith(
        EOS + USER + "<tool_result>a.txt</tool_result>\n\n<tool_result>/home</tool_result>\n\nand?" + ASST + "<think>"
    )
    # Anthropic: parallel results in one user message, system given separately
    a = {
        "model": "deepseek-v4.1-flash",
        "system": "You are terse.",
        "max_tokens": 9,
        "thinking": {"type": "enabled"},
        "tools": [{"name": "bash", "description": "Run", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "t2", "name": "bash", "input": {"command": "pwd"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t2", "content": "/"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "x"},
                ],
            },
        ],
    }
    got, _ = render(a, "anthropic")
    assert got.startswith(BOS + SYS + effort(75) + "You are terse.\n\n## Tools")
    assert got.endswith(EOS + USER + "<tool_result>x</tool_result>\n\n<tool_result>/</tool_result>" + ASST + "<think>")


def test_continuation_tail_and_completion_and_forcing():
    _, conv = render(body())
    full = V41.render(conv)
    tail = V41.render_continuation_tail(conv, 3)
    assert tail == EOS + USER + "<tool_result>a.txt\nb.txt</tool_result>" + ASST + "<think>"
    assert full.endswith(tail) and full[: -len(tail)].endswith("</｜DSML｜ calls>")
    assert V41.render_completion("Hi", "75") == (
        BOS + SYS + effort(75) + "You are a helpful assistant" + USER + "Hi" + ASST + "<think>"
    )
    assert V41.force_text("bash") == '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="bash">\n'


# --------------------------------------------------------------------------- output parsing

OUT = "Need ls.</think>Let me look." + CALLS


def run(text, size, thinking=True):
    p = V41.make_parser(thinking, True)
    evs = []
    for i in range(0, len(text), size):
        evs += p.feed(text[i : i + size])
        if p.stop_now:
            break
    more, final = p.finish()
    return evs + more, final, p


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_spaced_dsml_stream_and_final(size):
    evs, final, p = run(OUT, size)
    assert final.reasoning == "Need ls." and final.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in final.calls] == [("bash", {"command": "ls /tmp", "timeout": 10})]
    assert final.raw_dsml == CALLS and p.stop_now
    assert "".join(e.text for e in evs if isinstance(e, ReasoningDelta)) == final.reasoning
    assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == final.content
    end = [e for e in evs if isinstance(e, ToolCallEnd)]
    assert [e.arguments for e in end] == [final.calls[0].arguments]
    assert "".join(e.arguments for e in evs if isinstance(e, ToolCallDelta)) == final.calls[0].arguments


def test_v4_spelling_still_parses_and_split_think_close():
    v4 = (
        'x</think>ok\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" '
        'string="true">ls</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    final = V41.parse(v4, thinking=True)
    assert final.calls and json.loads(final.calls[0].arguments) == {"command": "ls"}
    p = V41.make_parser(True, True)
    assert [e.text for e in p.feed("abc</thi")] == ["a"]  # V4's rule: a possible partial </think> is held
    evs = p.feed("nk>Hi")
    assert [(type(e).__name__, e.text) for e in evs] == [("ReasoningDelta", "bc"), ("TextDelta", "Hi")]


def test_literal_close_tag_inside_a_string_value_round_trips():
    call = ToolCall(id="c", name="write", arguments=json.dumps({"text": "a </｜DSML｜ parameter> b </think>"}))
    text = "r</think>" + V41.render_calls([call])
    assert "&lt;/｜DSML｜ parameter>" in text
    final = V41.parse(text, thinking=True)
    assert json.loads(final.calls[0].arguments) == {"text": "a </｜DSML｜ parameter> b </think>"}


_plain = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="&"), max_size=25)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | _plain.filter(lambda s: len(s) < 8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text("abc", max_size=4), c, max_size=3),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    args=st.dictionaries(
        st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
        st.one_of(_plain, st.sampled_from(["</｜DSML｜ parameter>", "</｜DSML｜ calls>", "</think>"]), _json),
        max_size=4,
    ),
    size=st.integers(1, 9),
)
def test_render_then_parse_round_trip(args, size):
    call = ToolCall(id="c", name="tool", arguments=json.dumps(args))
    text = "why</think>" + V41.render_calls([call])
    evs, final, _ = run(text, size)
    assert [json.loads(c.arguments) for c in final.calls] == [args]
    # the projection streams JSON values as sampled (V4's OutputParser); the final text is minified
    assert json.loads("".join(e.arguments for e in evs if isinstance(e, ToolCallDelta))) == args
