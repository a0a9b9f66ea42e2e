"""GLM 5.3 Flash chat protocol (ds4mlx/chat/families/glm.py), and the output
parsing GLM 5.2 shares.

Prompts are compared byte for byte with the GLM-5.3-Flash chat template
(tests/data/chat_templates/glm5_next.jinja, provenance in SOURCES.md) rendered
by transformers' own jinja setup.  GLM 5.2 (`glm_moe_dsa`) prompts are checked
against GLM 5.2's own template in tests/test_protocol_glm52.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lazy_modules import requires
from template_helpers import (
    GLM_MESSAGES,
    GLM_TOOLS,
    TEMPLATES,
    glm_anthropic_case,
    render_jinja,
)
from template_helpers import (
    openai_body as make_body,
)

from ds4mlx.chat.families.glm import GLM52, GLM53
from ds4mlx.chat.messages import ToolCall
from ds4mlx.runtime.events import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from ds4mlx.serve.prepare import parse_request

needs = requires("transformers.utils.chat_template_utils")

TEMPLATE = (TEMPLATES / "glm5_next.jinja").read_text()
# The template variants that take `enable_thinking` (thinking off renders <think></think>):
# the one edit of the pinned template that the other published copies carry.
PINNED_TAIL = "    <|assistant|>{{- '<think>' -}}\n"
VARIANT_TAIL = (
    "    <|assistant|>{{- '<think>' if enable_thinking is not defined or enable_thinking else '<think></think>' -}}\n"
)

TOOLS, MESSAGES = GLM_TOOLS, GLM_MESSAGES


def jinja(messages, tools=None, template=TEMPLATE, **kw) -> str:
    return render_jinja(template, messages, tools, **kw)


def openai_body(messages, tools=None, **extra) -> dict:
    return make_body("glm-5.3-flash", messages, tools, **extra)


def ours(proto, body, effort=None) -> str:
    conv = parse_request("openai", body)
    conv.thinking = proto.resolve_thinking(conv.thinking, effort)
    return proto.render(conv)


def test_prompt_matches_template():
    assert ours(GLM53, openai_body(MESSAGES, TOOLS)) == jinja(MESSAGES, TOOLS)


@pytest.mark.parametrize("effort", ["low", "high", "max", "medium"])
def test_reasoning_effort_line(effort):
    body = openai_body(MESSAGES[:2], reasoning_effort=effort)
    assert ours(GLM53, body, effort) == jinja(MESSAGES[:2], reasoning_effort=effort)


def test_no_tools_no_system_and_thinking_off_variant():
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Bye"},
    ]
    assert ours(GLM53, openai_body(msgs)) == jinja(msgs)
    variant = TEMPLATE.replace(PINNED_TAIL, VARIANT_TAIL)
    assert variant != TEMPLATE
    got = ours(GLM53, openai_body(msgs, thinking={"type": "disabled"}))
    assert got == jinja(msgs, template=variant, enable_thinking=False)
    assert got.endswith("<|assistant|><think></think>")


def test_results_without_matching_ids_keep_their_order():
    msgs = json.loads(json.dumps(MESSAGES[:5]))
    msgs[3]["tool_call_id"] = "call_9"  # not a call of the turn: the template does not sort
    assert ours(GLM53, openai_body(msgs, TOOLS)) == jinja(msgs, TOOLS)


def test_anthropic_request_renders_like_the_template():
    body, ref_msgs, ref_tools = glm_anthropic_case("glm-5.3-flash")
    conv = parse_request("anthropic", body)
    conv.thinking = GLM53.resolve_thinking(conv.thinking)
    assert GLM53.render(conv) == jinja(ref_msgs, ref_tools)


def test_ids_and_continuation_tail():
    assert GLM53.model_id == "glm-5.3-flash" and GLM52.model_id == "glm-5.2"
    assert GLM53.family == "glm5_next" and GLM52.family == "glm_moe_dsa"
    conv = parse_request("openai", openai_body(MESSAGES[:5], TOOLS))
    conv.thinking = "max"
    full = GLM53.render(conv)
    tail = GLM53.render_continuation_tail(conv, 3)
    assert tail.startswith("<|observation|><tool_response>") and full.endswith(tail)
    assert GLM53.force_text(None) == "<tool_call>" and GLM53.force_text("bash") == "<tool_call>bash"


# --------------------------------------------------------------------------- output parsing

SCHEMAS = [json.dumps(t["function"]) for t in TOOLS]
OUT = (
    "I should list </thi it first.</think>Let me look.<tool_call>bash<arg_key>command</arg_key>"
    "<arg_value>echo '</tool_call> </think> <tool_call>x' &lt;/arg_value></arg_value>"
    "<arg_key>timeout</arg_key><arg_value>10</arg_value></tool_call>\n"
    "<tool_call>read_file<arg_key>path</arg_key><arg_value>42</arg_value>"
    "<arg_key>lines</arg_key><arg_value>[1, 2]</arg_value></tool_call>"
)


def stream(text, chunks, thinking=True, tools=True, schemas=SCHEMAS, proto=GLM53, truncated=False):
    p = proto.make_parser(thinking, tools, tool_schemas=schemas)
    evs, structural = [], []
    pos = 0
    for n in chunks:
        if pos >= len(text) or p.stop_now:
            break
        evs += p.feed(text[pos : pos + n])
        pos += n
        structural.append((pos, p.structural))
    if pos < len(text) and not p.stop_now:
        evs += p.feed(text[pos:])
    more, final = p.finish(truncated)
    evs += more
    return evs, final, structural, p


def check_stream(evs, final):
    """The stream says exactly what the final parse says."""
    assert "".join(e.text for e in evs if isinstance(e, ReasoningDelta)) == (final.reasoning or "")
    assert "".join(e.text for e in evs if isinstance(e, TextDelta)) == final.content
    ends = [e for e in evs if isinstance(e, ToolCallEnd)]
    assert [(e.name, e.arguments, e.id) for e in ends] == [(c.name, c.arguments, c.id) for c in final.calls]
    for i, e in enumerate(ends):
        assert "".join(d.arguments for d in evs if isinstance(d, ToolCallDelta) and d.index == i) == e.arguments
    assert [e.name for e in evs if isinstance(e, ToolCallStart)] == [c.name for c in final.calls]


def test_final_parse_literal_tags_inside_values():
    final = GLM53.parse(OUT, thinking=True, tool_schemas=SCHEMAS)
    assert final.reasoning == "I should list </thi it first." and final.content == "Let me look."
    assert [c.name for c in final.calls] == ["bash", "read_file"]
    assert json.loads(final.calls[0].arguments) == {
        "command": "echo '</tool_call> </think> <tool_call>x' </arg_value>",
        "timeout": 10,
    }
    # a declared string stays a string even when it looks like JSON
    assert json.loads(final.calls[1].arguments) == {"path": "42", "lines": [1, 2]}
    assert final.raw_dsml == OUT[OUT.index("<tool_call>") :] and final.finish == "tool_calls"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 10000])
def test_stream_split_anywhere(size):
    evs, final, _, _ = stream(OUT, [size] * len(OUT))
    check_stream(evs, final)
    assert len(final.calls) == 2


def test_split_think_close_is_not_leaked():
    p = GLM53.make_parser(True, False)
    got = p.feed("abc</thi") + p.feed("nk>Hi")
    assert [type(e).__name__ for e in got] == ["ReasoningDelta", "TextDelta"]
    assert got[0].text == "abc" and got[1].text == "Hi"


def test_structural_flags_greedy_structure_sampled_values():
    text = "r</think><tool_call>bash<arg_key>command</arg_key><arg_value>ls -la</arg_value></tool_call>"
    _, _, flags, _ = stream(text, [1] * len(text))
    state = dict(flags)
    at = text.index
    assert state[at("<tool_call>") + 5] is False  # an open tag being written is still text (as V4 DSML)
    assert state[at("bash") + 2] is True  # the name
    assert state[at("ls -la") + 3] is False  # the value body is sampled
    assert state[at("</arg_value>") + 4] is True  # a partial value close is structure again


def test_text_after_the_calls_stops_generation():
    text = "r</think><tool_call>bash<arg_key>command</arg_key><arg_value>ls</arg_value></tool_call>And more"
    evs, final, _, p = stream(text, [1] * len(text))
    assert p.stop_now and final.calls and "And" not in final.raw_dsml
    check_stream(evs, final)


def test_malformed_and_unterminated_calls():
    final = GLM53.parse("x</think>see <tool_call> here", thinking=True)
    assert not final.calls and final.content == "see <tool_call> here" and final.error == "invalid tool call"
    final = GLM53.parse("x</think>ok<tool_call>bash<arg_key>a</arg_key><arg_value>1", thinking=True)
    assert final.error == "unterminated tool call" and not final.calls
    final = GLM53.parse("x</think>ok<tool_call>bash<arg_key>a</arg_key><arg_value>1", thinking=True, truncated=True)
    assert final.error is None and final.finish == "length" and final.content.startswith("ok<tool_call>")


def test_no_tools_means_no_call_parsing():
    final = GLM53.parse("r</think>  <tool_call>bash</tool_call>  ", thinking=True, tools_active=False)
    assert final.content == "<tool_call>bash</tool_call>" and not final.calls


# --------------------------------------------------------------------------- round trip

_text = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),
    st.sampled_from(
        [
            "</tool_call>",
            "</think>",
            "<tool_call>",
            "</arg_value>",
            "<arg_key>",
            "&lt;/arg_value>",
            "  spaced  ",
            "\nnew\nlines\n",
            '{"a": 1}',
            "42",
        ]
    ),
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=6,
)
# A top-level value under a schema without "string": the template writes a string verbatim and
# anything else as JSON, so the string "0" and the integer 0 render alike and the parser reads
# them by the schema (as 0).  A string there would break its own schema, so none is drawn;
# strings inside lists and objects are JSON-quoted and still drawn.
_non_string_json = _json.filter(lambda v: not isinstance(v, str))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strings=st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), _text, max_size=3),
    others=st.dictionaries(st.from_regex(r"[A-Z]{1,6}", fullmatch=True), _non_string_json, max_size=2),
    chunk=st.integers(1, 9),
)
def test_render_then_parse_round_trip(strings, others, chunk):
    args = {**strings, **others}
    props = {k: {"type": "string"} for k in strings}
    props.update({k: {"type": ["object", "array", "integer", "boolean", "null"]} for k in others})
    schemas = [json.dumps({"name": "tool", "parameters": {"type": "object", "properties": props}})]
    call = ToolCall(id="call_1", name="tool", arguments=json.dumps(args))
    text = "why</think>" + GLM53.render_calls([call])
    final = GLM53.parse(text, thinking=True, tool_schemas=schemas)
    assert len(final.calls) == 1 and json.loads(final.calls[0].arguments) == args
    evs, sfinal, _, _ = stream(text, [chunk] * len(text), schemas=schemas)
    check_stream(evs, sfinal)
    assert json.loads(sfinal.calls[0].arguments) == args


@pytest.mark.parametrize(
    ("declared", "value"),
    [({"type": "string"}, "0"), ({"type": "integer"}, 0), ({"type": ["integer", "null"]}, 0), ({}, 0)],
)
def test_bare_value_is_read_by_its_schema(declared, value):
    # `<arg_value>0</arg_value>` is what the template writes for both "0" and 0: a declared
    # string keeps the text, anything else (or no declaration) reads it as JSON.
    schemas = [json.dumps({"name": "tool", "parameters": {"type": "object", "properties": {"n": declared}}})]
    text = "why</think><tool_call>tool<arg_key>n</arg_key><arg_value>0</arg_value></tool_call>"
    final = GLM53.parse(text, thinking=True, tool_schemas=schemas)
    assert json.loads(final.calls[0].arguments) == {"n": value}
