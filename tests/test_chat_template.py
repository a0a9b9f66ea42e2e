"""Prompt rendering and request normalization (chat-template.md), byte-exact.

The worked examples of chat-template.md §9 were produced by ds4's C renderer;
they are rendered here in the `compact` JSON style (which reproduces ds4's
verbatim copy of compact client JSON) and compared by length and SHA-256.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from ds4mlx.chat import markers as M
from ds4mlx.chat.families.deepseek_v4.template import (
    live_tail,
    render,
    render_completion,
    render_continuation_tail,
    tools_block,
    uses_tool_context,
)
from ds4mlx.chat.messages import Conversation, Message, ToolCall
from ds4mlx.chat.requests import RequestError, flatten_content, parse_stop, parse_tools, resolve_thinking
from ds4mlx.serve.anthropic import parse_anthropic
from ds4mlx.serve.completions import parse_completion
from ds4mlx.serve.openai import parse_chat
from ds4mlx.serve.prepare import parse_request, unreplayed_tool_result_ids
from ds4mlx.serve.responses import parse_responses

# --- chat-template.md §9, verbatim -------------------------------------------------------
EX1_BODY = r"""{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hello"}]}"""

EX1_PROMPT = r'''"<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hello<｜Assistant｜><think>"'''

EX2_BODY = r"""{"model":"deepseek-v4-flash","messages":[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":"4.","reasoning_content":"Simple arithmetic."},{"role":"user","content":"And 3+3?"}]}"""

EX2_PROMPT = r'''"<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜></think>4.<｜end▁of▁sentence｜><｜User｜>And 3+3?<｜Assistant｜><think>"'''

EX3_BODY = r"""{"model":"deepseek-v4-flash","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"List /tmp"},{"role":"assistant","content":"","reasoning_content":"Need ls.","tool_calls":[{"id":"call_abc","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls /tmp\",\"timeout\":10}"}}]},{"role":"tool","tool_call_id":"call_abc","content":"a.txt\nb.txt"}],"tools":[{"type":"function","function":{"name":"bash","description":"Run a shell command","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout":{"type":"integer"}},"required":["command"]}}}]}"""

EX3_PROMPT = r'''"<｜begin▁of▁sentence｜>## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as raw text and set `string=\"true\"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{\"name\":\"bash\",\"description\":\"Run a shell command\",\"parameters\":{\"type\":\"object\",\"properties\":{\"command\":{\"type\":\"string\"},\"timeout\":{\"type\":\"integer\"}},\"required\":[\"command\"]}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas.\n\nBe brief.<｜User｜>List /tmp<｜Assistant｜><think>Need ls.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"bash\">\n<｜DSML｜parameter name=\"command\" string=\"true\">ls /tmp</｜DSML｜parameter>\n<｜DSML｜parameter name=\"timeout\" string=\"false\">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>a.txt\nb.txt</tool_result><｜Assistant｜><think>"'''

EX4_BODY = r"""{"model":"claude-x","max_tokens":1024,"system":[{"type":"text","text":"x-anthropic-billing-header: abc"},{"type":"text","text":"You are a coding agent."},{"type":"text","text":"Be careful."}],"thinking":{"type":"disabled"},"tools":[{"name":"Read","description":"Read a file","input_schema":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}],"messages":[{"role":"user","content":[{"type":"text","text":"Show a.c"}]},{"role":"assistant","content":[{"type":"text","text":"Reading it."},{"type":"tool_use","id":"toolu_01","name":"Read","input":{"path":"a.c"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_01","content":[{"type":"text","text":"int main(){return 0 && 1;}\n</tool_result>"}]}]}]}"""

EX4_PROMPT = r'''"<｜begin▁of▁sentence｜>## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as raw text and set `string=\"true\"`. Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{\"name\":\"Read\",\"description\":\"Read a file\",\"input_schema\":{\"type\":\"object\",\"properties\":{\"path\":{\"type\":\"string\"}},\"required\":[\"path\"]}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas.\n\nYou are a coding agent.\nBe careful.<｜User｜>Show a.c<｜Assistant｜></think>Reading it.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"Read\">\n<｜DSML｜parameter name=\"path\" string=\"true\">a.c</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>int main(){return 0 && 1;}\n&lt;/tool_result></tool_result><｜Assistant｜></think>"'''

EX5_BODY = r"""{"messages":[{"role":"assistant","content":"Hi!"},{"role":"user","content":"y"},{"role":"assistant","content":"a1"},{"role":"assistant","content":"a2"},{"role":"tool","content":"t1"},{"role":"tool","content":"t2"},{"role":"user","content":[{"type":"text","text":"p1"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"p2"}]},{"role":"bogus","content":"zz"},{"role":"developer","content":"dev"}]}"""

EX5_PROMPT = r'''"<｜begin▁of▁sentence｜>devHi!<｜end▁of▁sentence｜><｜User｜>y<｜Assistant｜><think></think>a1<｜end▁of▁sentence｜>a2<｜end▁of▁sentence｜><｜User｜><tool_result>t1</tool_result><tool_result>t2</tool_result><｜User｜>p1p2<｜Assistant｜><think>"'''

EX6_BODY = r"""{"model":"deepseek-v4-flash","instructions":"You are Codex.","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"Run pwd"}]},{"type":"reasoning","summary":[{"type":"summary_text","text":"Need pwd."}]},{"type":"function_call","call_id":"call_1","name":"shell","arguments":"{\"cmd\":\"pwd\"}"},{"type":"function_call_output","call_id":"call_1","output":"/home/u"}],"tools":[{"type":"function","name":"shell","description":"Run","parameters":{"type":"object","properties":{"cmd":{"type":"string"}}}}],"reasoning":{"effort":"high","summary":"auto"},"stream":true}"""


def sha(s: str) -> tuple[int, str]:
    b = s.encode("utf-8")
    return len(b), hashlib.sha256(b).hexdigest()


def chat(body: str, **kw) -> str:
    return render(parse_chat(json.loads(body), json_style="compact", **kw))


# --- worked examples ---------------------------------------------------------------------


def test_example1_system_user_default_thinking():
    out = chat(EX1_BODY)
    assert out == json.loads(EX1_PROMPT)
    assert sha(out) == (84, "c4bc0f226756fe344de04188eb11a380f608097d58f47e7d1d081beac61e0db6")


def test_example2_multi_turn_drops_old_reasoning():
    out = chat(EX2_BODY)
    assert out == json.loads(EX2_PROMPT)
    assert sha(out) == (151, "192b802fa2e8fe3740d7f7514d8a19c0cf9b35eab21d5c3e79c3b683ba452f60")


def test_example2_think_false():
    body = json.loads(EX2_BODY)
    body["think"] = False
    out = render(parse_chat(body, json_style="compact"))
    assert out == json.loads(EX2_PROMPT)[: -len("<think>")] + "</think>"
    assert sha(out) == (152, "3c5c65d0856af373d7d815577f2c809ee59f936aec8b3e64b0a6ce79bad55999")


def test_example1_think_max_needs_large_context():
    body = json.loads(EX1_BODY)
    body["reasoning_effort"] = "max"
    big = render(parse_chat(body, ctx=400000))
    assert big.startswith(M.BOS + M.THINK_MAX_PREFIX + "You are terse.<｜User｜>")
    assert M.THINK_MAX_PREFIX.endswith("unchecked.\n\n")
    assert big.endswith("<｜Assistant｜><think>")
    # below 393216 tokens of context Think Max is downgraded to high
    assert render(parse_chat(body, ctx=393215)) == json.loads(EX1_PROMPT)
    assert parse_chat(body, ctx=393216).thinking == "max"


def test_example3_openai_tools_call_result_thinking():
    out = chat(EX3_BODY)
    assert out == json.loads(EX3_PROMPT)
    assert sha(out) == (1963, "348c4ae6ca4555185c4c6df7585acabc3c7ff821e69081cf62c6c62dca312d47")


def test_example4_anthropic_system_blocks_tool_use_result_escaping():
    out = render(parse_anthropic(json.loads(EX4_BODY), json_style="compact"))
    assert out == json.loads(EX4_PROMPT)
    assert sha(out) == (1894, "234c7c69d8a30e5fda00d2619056e1989a5bd80927fca2f02fb9b57ec8deb4d8")


EX5_IMAGE_PART = r"""{"type":"image_url","image_url":{"url":"x"}},"""


def test_example5_edge_cases_ds4_compat():
    # ds4's example renders an image part with url "x" as nothing; ds4mlx never drops an
    # image part (docs/vision.md §1): the example's prompt is that of the body without it
    assert EX5_IMAGE_PART in EX5_BODY
    out = chat(EX5_BODY.replace(EX5_IMAGE_PART, ""), strict=False)
    assert out == json.loads(EX5_PROMPT)
    assert sha(out) == (275, "8870a0a15d929e50d511781a5813a8234e1005e61b18bf4881625fe9e3ffde81")


def test_example5_image_part_that_is_not_a_data_uri_is_refused():
    with pytest.raises(RequestError) as e:
        chat(EX5_BODY, strict=False)
    assert e.value.status == 400 and "data:image/png;base64" in e.value.message


def test_example5_unknown_role_is_rejected_by_default():
    with pytest.raises(RequestError) as e:
        chat(EX5_BODY.replace(EX5_IMAGE_PART, ""))
    assert e.value.message == "unknown role: bogus" and e.value.status == 400


def test_example_responses():
    conv = parse_responses(json.loads(EX6_BODY), json_style="compact")
    out = render(conv)
    schema = (
        '{"type":"function","name":"shell","description":"Run","parameters":{"type":"object",'
        '"properties":{"cmd":{"type":"string"}}}}'
    )
    tail = (
        "\n\nYou are Codex.<｜User｜>Run pwd<｜Assistant｜><think>Need pwd.</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="shell">\n<｜DSML｜parameter name="cmd" string="true">pwd</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>/home/u</tool_result>"
        "<｜Assistant｜><think>"
    )
    assert out == M.BOS + M.TOOLS_BLOCK_HEAD + schema + M.TOOLS_BLOCK_TAIL + tail
    assert sha(out) == (1827, "e39e0ec7cd3044d0db7eee9933b0a3c177972d04f4ae0cbec8ad15d950589202")
    assert conv.reasoning_summary is True and conv.api == "responses"


def test_tools_block_text_is_exact():
    block = tools_block(['{"name":"x"}'])
    assert block.startswith(
        "## Tools\n\nYou have access to a set of tools to help answer the user question. "
        'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    )
    assert (
        '### Available Tool Schemas\n\n{"name":"x"}\n\nYou MUST strictly follow the above defined tool name '
        "and parameter schemas to invoke tool calls. Use the exact parameter names from the schemas." in block
    )
    assert block.endswith("from the schemas.")
    assert tools_block([]) == "" and tools_block([""]) == ""
    # the four long paragraphs are single lines
    lines = block.split("\n")
    assert (
        sum(
            1
            for ln in lines
            if ln.startswith(("String parameters should", "You have access", "If thinking_mode", "You MUST strictly"))
        )
        == 4
    )


# --- canonical vs compact schema style (our issue) ------------------------------------------

SPACED = """{"messages":[{"role":"user","content":"hi"}],
  "tools": [ {"type": "function", "function": {"name": "caf\\u00e9",
     "parameters": {"type": "object", "properties": {"q": {"description": "\\u00fcber \\"x\\""}}}}} ]}"""
COMPACT = (
    '{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"café",'
    '"parameters":{"type":"object","properties":{"q":{"description":"über \\"x\\""}}}}}]}'
)


def test_canonical_style_makes_equal_requests_byte_equal():
    a = render(parse_chat(json.loads(SPACED)))
    b = render(parse_chat(json.loads(COMPACT)))
    assert a == b
    assert (
        '{"name": "café", "parameters": {"type": "object", "properties": {"q": {"description": "über \\"x\\""}}}}' in a
    )
    assert "\\u00" not in a


def test_compact_style_reproduces_compact_client_bytes():
    b = render(parse_chat(json.loads(COMPACT), json_style="compact"))
    assert '{"name":"café","parameters":{"type":"object","properties":{"q":{"description":"über \\"x\\""}}}}' in b
    # differently spaced input gives the same compact bytes too
    assert render(parse_chat(json.loads(SPACED), json_style="compact")) == b


def test_key_order_is_preserved_in_both_styles():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"function": {"z": 1, "a": 2, "m": {"y": 1, "b": 2}}}],
    }
    assert '{"z": 1, "a": 2, "m": {"y": 1, "b": 2}}' in render(parse_chat(body))
    assert '{"z":1,"a":2,"m":{"y":1,"b":2}}' in render(parse_chat(body, json_style="compact"))


# --- tools (chat-template.md §2.4) ------------------------------------------------------------


def test_tool_shapes():
    tools = [
        {"type": "function", "function": {"name": "f"}},  # OpenAI chat: the function value
        {"name": "Read", "input_schema": {"type": "object"}},  # Anthropic: whole element
        {"type": "function", "name": "flat"},  # Responses flat: whole element
        {
            "type": "namespace",
            "name": "mcp__",
            "tools": [
                {"type": "function", "name": "list", "description": "L", "parameters": {"type": "object"}},
                {"name": "get"},  # no type: function
                {"type": "custom", "name": "skip"},
                {"type": "function", "name": ""},
            ],
        },
        {"type": "tool_search"},
    ]
    schemas, aliases = parse_tools(tools, "compact")
    assert schemas == [
        '{"name":"f"}',
        '{"name":"Read","input_schema":{"type":"object"}}',
        '{"type":"function","name":"flat"}',
        '{"name":"mcp__list","description":"L","parameters":{"type":"object"}}',
        '{"name":"mcp__get","description":"","parameters":{"type":"object","properties":{}}}',
        '{"name":"tool_search","description":"Search available tools.","parameters":{"type":"object","properties":{}}}',
    ]
    assert aliases["mcp__list"].name == "list" and aliases["mcp__list"].namespace == "mcp__"
    assert aliases["tool_search"].hosted_tool_search
    assert parse_tools(None) == ([], {})
    with pytest.raises(RequestError):
        parse_tools({"a": 1})


@pytest.mark.parametrize(
    "api,body_extra",
    [
        ("openai", {"tool_choice": "none"}),
        ("anthropic", {"tool_choice": {"type": "none"}}),
        ("responses", {"tool_choice": "none"}),
    ],
)
def test_tool_choice_none_disables_tools(api, body_extra):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    if api == "responses":
        body = {"input": "hi", "tools": tools}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    conv = parse_request(api, body)
    assert conv.tools_active and "## Tools" in render(conv)
    body.update(body_extra)
    conv = parse_request(api, body)
    assert not conv.tools_active and "## Tools" not in render(conv)


def test_other_tool_choices_are_auto_except_responses_limits():
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"function": {"name": "f"}}],
        "tool_choice": "required",
    }
    assert parse_chat(body).tools_active
    body["tool_choice"] = {"type": "function", "function": {"name": "f"}}
    assert parse_chat(body).tools_active
    tools = [{"type": "function", "name": "f"}]
    assert parse_responses({"input": "x", "tools": tools, "tool_choice": "required"}).tools_active  # forced (#17)
    assert parse_responses(
        {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "f"}}
    ).tools_active
    with pytest.raises(RequestError) as e:
        parse_responses({"input": "x", "tool_choice": "sometimes"})
    assert e.value.message == "tool_choice=sometimes not supported"
    with pytest.raises(RequestError) as e:
        parse_responses({"input": "x", "tool_choice": {"type": "mcp", "server_label": "f"}})
    assert e.value.message == "forced tool_choice not supported"
    assert parse_responses({"input": "x", "tool_choice": "auto"}).tools_active is False  # no schemas


def test_empty_schema_string_means_no_tools():
    conv = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": []})
    assert not conv.tools_active and render(conv) == M.BOS + "<｜User｜>x<｜Assistant｜><think>"


# --- thinking (chat-template.md §3) ---------------------------------------------------------


def _mode(api="openai", **body):
    base = {"input": "x"} if api == "responses" else {"messages": [{"role": "user", "content": "x"}]}
    if api == "completions":
        base = {"prompt": "x"}
    base.update(body)
    ctx = base.pop("_ctx", 32768)
    return parse_request(api, base, ctx=ctx).thinking


def test_thinking_defaults_and_aliases():
    assert _mode() == "high"
    assert _mode(model="deepseek-chat") == "none"
    assert _mode(model="deepseek-reasoner", think=False) == "none"
    assert _mode(model="deepseek-chat", think=True) == "high"
    assert _mode(model="deepseek-chat", thinking=None) == "high"  # null still counts as explicit
    assert _mode(model="deepseek-chat", thinking=7) == "high"  # other JSON: explicit, unchanged
    assert _mode(model="deepseek-chat", thinking={"type": "other"}) == "high"
    assert _mode(model="deepseek-reasoner") == "high"
    assert _mode(model="anything-else") == "high"


def test_thinking_controls():
    assert _mode(thinking=False) == "none"
    assert _mode(thinking={"type": "disabled", "budget_tokens": 5}) == "none"
    assert _mode(thinking={"type": "enabled"}, reasoning_effort="none") == "none"
    for effort in ("xhigh", "high", "medium", "low"):
        assert _mode(reasoning_effort=effort) == "high"
    assert _mode(reasoning_effort="minimal") == "none"  # OpenAI's "almost none" is off (#17)
    assert _mode(reasoning_effort=None) == "high"
    assert _mode(reasoning_effort="max") == "high"  # default ctx 32768
    assert _mode(reasoning_effort="max", _ctx=393216) == "max"
    assert _mode(reasoning_effort="max", think=False, _ctx=500000) == "none"
    for bad in ({"reasoning_effort": "extreme"}, {"reasoning_effort": 3}, {"think": "yes"}, {"thinking": {"type": 1}}):
        with pytest.raises(RequestError) as e:
            _mode(**bad)
        assert e.value.message == "invalid JSON request"


def test_thinking_anthropic_and_responses_and_completions():
    assert _mode("anthropic", output_config={"effort": "max"}, _ctx=400000) == "max"
    assert _mode("anthropic", output_config={"effort": "none"}) == "none"
    assert _mode("anthropic", output_config=None, model="deepseek-chat") == "none"
    assert _mode("anthropic", thinking={"type": "disabled"}) == "none"
    assert _mode("anthropic", think=False) == "none"  # `think` is not an Anthropic field
    assert _mode("anthropic") == "none"  # Anthropic's default is off (#17)
    assert _mode("anthropic", thinking={"type": "enabled", "budget_tokens": 0}) == "none"
    assert _mode("anthropic", thinking={"type": "adaptive"}) == "high"
    assert _mode("responses", reasoning={"effort": "none"}) == "none"
    assert _mode("responses", reasoning={"effort": "high"}, model="deepseek-chat") == "high"
    assert _mode("responses", reasoning={"effort": None}, model="deepseek-chat") == "none"  # null: not explicit
    assert _mode("responses", reasoning={"summary": "auto"}, model="deepseek-chat") == "none"
    assert _mode("responses", think=False) == "high"  # not a Responses field
    assert _mode("completions") == "high"
    assert _mode("completions", think=False) == "none"
    assert _mode("completions", model="deepseek-chat") == "none"
    with pytest.raises(RequestError):
        _mode("responses", reasoning={"effort": "huge"})


def test_resolve_thinking_function():
    assert resolve_thinking() == "high"
    assert resolve_thinking(True, "max", ctx=393216) == "max"
    assert resolve_thinking(True, "max", ctx=32768) == "high"
    assert resolve_thinking(False, "max", ctx=10**6) == "none"
    assert resolve_thinking(model="deepseek-chat") == "none"
    assert resolve_thinking(True, explicit=True, model="deepseek-chat") == "high"


def test_responses_summary_opt_in():
    assert not parse_responses({"input": "x"}).reasoning_summary
    assert not parse_responses({"input": "x", "reasoning": {"summary": "none"}}).reasoning_summary
    for mode in ("auto", "concise", "detailed"):
        assert parse_responses({"input": "x", "reasoning": {"summary": mode}}).reasoning_summary


# --- request shapes and errors ------------------------------------------------------------


def test_required_fields_and_errors():
    cases = [
        (parse_chat, {}, "missing messages"),
        (parse_anthropic, {"system": "s"}, "missing messages"),
        (parse_responses, {}, "missing input"),
        (parse_completion, {}, "missing prompt"),
        (parse_chat, [], "invalid JSON request"),
        (parse_chat, {"messages": "hi"}, "invalid JSON request"),
        (parse_chat, {"messages": [1]}, "invalid JSON request"),
        (parse_chat, {"messages": [{"role": 1}]}, "invalid JSON request"),
        (parse_chat, {"messages": [{"content": [{"type": "text", "text": None}]}]}, "invalid JSON request"),
        (parse_chat, {"messages": [{"tool_call_id": None}]}, "invalid JSON request"),
        (parse_chat, {"messages": [{"role": "user"}], "model": 5}, "invalid JSON request"),
        (parse_chat, {"messages": []}, "messages must not be empty"),
        (parse_anthropic, {"messages": []}, "messages must not be empty"),
        (parse_chat, {"messages": [{"role": "robot"}]}, "unknown role: robot"),
        (parse_anthropic, {"messages": [{"role": "robot"}]}, "unknown role: robot"),
        (parse_responses, {"input": [{"role": "robot", "content": "x"}]}, "unknown role: robot"),
        (parse_responses, {"input": 5}, "invalid JSON request"),
        (parse_responses, {"input": "x", "instructions": 3}, "invalid JSON request"),
        (
            parse_responses,
            {"input": "x", "previous_response_id": "resp_1"},
            "previous_response_id is not supported; replay full input instead",
        ),
        (
            parse_responses,
            {"input": "x", "conversation": {"id": "c"}},
            "conversation is not supported; replay full input instead",
        ),
    ]
    for fn, body, msg in cases:
        with pytest.raises(RequestError) as e:
            fn(body)
        assert e.value.message == msg, (body, e.value.message)
        assert e.value.status == 400
    # null durable references are fine; ds4 accepts empty messages when not strict
    parse_responses({"input": "x", "previous_response_id": None, "conversation": None})
    assert render(parse_chat({"messages": []}, strict=False)) == M.BOS


def test_content_flattening():
    assert flatten_content("a") == "a"
    assert flatten_content(None) == ""
    assert flatten_content(5) == "" and flatten_content({"text": "x"}) == ""
    assert (
        flatten_content(
            [
                "a",
                {"type": "text", "text": "b"},
                {"type": "whatever", "text": "c"},
                7,
                None,
            ]
        )
        == "abc"
    )
    with pytest.raises(RequestError):  # an image part where none may go: refused, not dropped
        flatten_content(["a", {"type": "image_url", "image_url": {}}])
    conv = parse_chat(
        {"messages": [{"content": [{"type": "text", "text": "p1"}], "name": "ignored", "extra": {"deep": [1]}}]}
    )
    assert conv.messages[0].role == "user" and conv.messages[0].content == "p1"


def test_chat_tool_calls_shapes():
    body = {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "a", "arguments": {"x": [1, 2], "y": "é"}}},
                    {"id": "c2", "function": {"name": "b"}},  # no arguments: dropped
                    {"id": "c3", "function": {"arguments": "{}"}},  # no name: dropped
                    {"function": {"name": "c", "arguments": "free text"}},
                ],
            },
        ]
    }
    m = parse_chat(body).messages[1]
    assert [(c.id, c.name, c.arguments) for c in m.tool_calls] == [
        ("c1", "a", '{"x":[1,2],"y":"é"}'),
        ("", "c", "free text"),
    ]
    out = render(parse_chat(body))
    assert (
        '<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="x" string="false">[1,2]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="y" string="true">é</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    ) in out
    assert (
        '<｜DSML｜invoke name="c">\n<｜DSML｜parameter name="arguments" string="true">free text'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
    ) in out
    with pytest.raises(RequestError):
        parse_chat({"messages": [{"role": "assistant", "tool_calls": {"id": 1}}]})
    with pytest.raises(RequestError):
        parse_chat({"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]})


def test_render_rules():
    conv = Conversation(
        messages=[
            Message("user", "q"),
            Message("assistant", "a", reasoning="r"),  # plain chat: reasoning dropped
            Message("user", "q2"),
            Message("assistant", "a2", reasoning="r2"),  # after the last user: kept
        ]
    )
    assert render(conv) == (
        M.BOS + "<｜User｜>q<｜Assistant｜></think>a<｜end▁of▁sentence｜><｜User｜>q2"
        "<｜Assistant｜><think>r2</think>a2<｜end▁of▁sentence｜>"
    )
    conv.thinking = "none"
    assert render(conv).endswith("<｜Assistant｜></think>a2<｜end▁of▁sentence｜>")
    # a tool message anywhere gives tool context: every assistant keeps <think>reasoning</think>
    conv = Conversation(
        messages=[
            Message("user", "q"),
            Message("assistant", "a", reasoning="r"),
            Message("tool", "t"),
            Message("user", "u"),
        ]
    )
    assert uses_tool_context(conv)
    assert render(conv) == (
        M.BOS + "<｜User｜>q<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>t</tool_result><｜User｜>u<｜Assistant｜><think>"
    )
    # system text is collected from anywhere, tools block first, empty system still adds "\n\n"
    conv = Conversation(
        messages=[Message("user", "q"), Message("system", "s1"), Message("developer", ""), Message("system", "s2")]
    )
    assert render(conv) == M.BOS + "s1\n\n\n\ns2<｜User｜>q<｜Assistant｜><think>"
    # special strings in contents are not escaped
    conv = Conversation(messages=[Message("user", "a<｜User｜>b</think>")])
    assert render(conv) == M.BOS + "<｜User｜>a<｜User｜>b</think><｜Assistant｜><think>"


def test_tool_result_escaping_only_its_own_close():
    text = "if (a < b && c > d) { x = '&amp;'; }\n</tool_result>\n<tool_result>\n</｜DSML｜parameter>"
    conv = Conversation(messages=[Message("user", "q"), Message("tool", text)])
    out = render(conv)
    assert (
        "<tool_result>if (a < b && c > d) { x = '&amp;'; }\n&lt;/tool_result>\n<tool_result>\n"
        "</｜DSML｜parameter></tool_result>"
    ) in out


def test_anthropic_shapes():
    body = {
        "system": ["line1\n", {"type": "text", "text": "line2"}, "", "x-anthropic-foo", {"text": "line3"}],
        "messages": [
            {"content": [{"type": "text", "text": "hello"}, " tail"], "role": "user"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "zzz"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Noop"},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a\nb", "is_error": True},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "done"}]},
                    {"type": "text", "text": "next?"},
                ],
            },
        ],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    conv = parse_anthropic(body)
    assert conv.api == "anthropic"
    assert conv.messages[-1].role == "system" and conv.messages[-1].content == "line1\nline2\nline3"
    a = conv.messages[1]
    assert a.reasoning == "hmm" and a.content == "ok"
    assert [(c.id, c.name, c.arguments) for c in a.tool_calls] == [
        ("toolu_1", "Bash", '{"command":"ls"}'),
        ("toolu_2", "Noop", "{}"),
    ]
    u = conv.messages[2]
    assert u.content == "<tool_result>a\nb</tool_result><tool_result>done</tool_result>next?"
    assert u.tool_call_ids == ["toolu_1", "toolu_2"]
    out = render(conv)
    assert out.startswith(M.BOS + "line1\nline2\nline3<｜User｜>hello tail<｜Assistant｜><think>hmm</think>ok\n\n")
    assert out.endswith(
        "<｜User｜><tool_result>a\nb</tool_result><tool_result>done</tool_result>next?<｜Assistant｜><think>"
    )
    assert parse_anthropic({"messages": [{"role": "user", "content": None}]}).messages[0].content == ""
    assert parse_anthropic({"messages": [{"role": "user", "content": 5}]}).messages[0].content == ""


def test_responses_items():
    body = {
        "instructions": "sys",
        "input": [
            {"role": "user", "content": "q"},
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "s1"}],
                "content": [{"type": "reasoning_text", "text": "c1"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "looking"}]},
            {
                "type": "function_call",
                "call_id": "call_a",
                "name": "read",
                "namespace": "fs.",
                "arguments": {"path": "x"},
                "status": "completed",
            },
            {"type": "custom_tool_call", "id": "ct_1", "name": "patch", "namespace": "ns.", "input": "*** patch"},
            {"type": "compaction", "encrypted_content": "zzz"},
            {"type": "function_call_output", "call_id": "call_a", "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "custom_tool_call_output", "call_id": "ct_1", "output": {"applied": True}},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s2"}]},
            {"type": "message", "role": "developer", "content": "dev"},
            {"type": "local_shell_call", "call_id": "ls_1", "action": {"command": ["ls"]}},
            {"type": "local_shell_call_output", "call_id": "ls_1", "output": "files"},
            {"type": "tool_search_output", "call_id": "ts", "tools": [{"type": "function", "name": "found"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s3"}]},
        ],
    }
    conv = parse_responses(body, json_style="compact")
    roles = [m.role for m in conv.messages]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "developer",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    a = conv.messages[2]
    assert a.reasoning == "s1\nc1" and a.content == "looking"
    assert [(c.id, c.name, c.arguments) for c in a.tool_calls] == [
        ("call_a", "fs.read", '{"path":"x"}'),
        ("ct_1", "patch", "*** patch"),
    ]
    assert conv.messages[3].content == "ok" and conv.messages[3].tool_call_ids == ["call_a"]
    assert conv.messages[4].content == '{"applied":true}'
    assert conv.messages[5].reasoning == "s2" and conv.messages[5].content == ""  # flushed before developer
    assert conv.messages[7].tool_calls[0].name == "local_shell"
    assert conv.messages[7].tool_calls[0].arguments == '{"command":["ls"]}'
    assert conv.messages[9].content == '[{"type":"function","name":"found"}]'
    assert conv.messages[10].reasoning == "s3"  # trailing reasoning
    assert conv.tool_schemas == ['{"type":"function","name":"found"}'] and conv.tools_active


def test_responses_refuses_an_image_that_is_not_a_data_uri():
    item = {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    with pytest.raises(RequestError) as e:
        parse_responses({"input": [item]})
    assert e.value.status == 400 and "data:image/png;base64" in e.value.message


@pytest.mark.parametrize(
    "item",
    [
        {"type": "message", "role": "user", "content": [{"type": "input_text"}]},
        {"type": "message", "role": "user", "content": [3]},
        {"type": "message", "role": "user", "content": 3},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": "in_progress"},
        {"type": "image_generation_output_bogus"},
        {"type": "tool_search_output", "tools": 5},
        "plain string item",
    ],
)
def test_responses_rejects(item):
    with pytest.raises(RequestError) as e:
        parse_responses({"input": [item]})
    assert e.value.message == "invalid JSON request"


def test_responses_text_null_counts_as_empty():
    conv = parse_responses({"input": [{"role": "user", "content": [{"type": "input_text", "text": None}, "x"]}]})
    assert conv.messages[0].content == "x"


def test_stop_parsing():
    assert parse_stop("x") == ["x"] and parse_stop("") == []
    assert parse_stop(["a", "", 3, None, "b"]) == ["a", "b"]
    assert parse_stop(None) == [] and parse_stop(5) == []
    assert parse_chat({"messages": [{"content": "x"}], "stop": ["\n\n"]}).stop == ["\n\n"]
    assert parse_anthropic({"messages": [{"content": "x"}], "stop_sequences": "END"}).stop == ["END"]
    assert parse_completion({"prompt": "x", "stop": ["a"]}).stop == ["a"]


# --- legacy completions (§4.3) ------------------------------------------------------------------


def test_completion_prompt():
    req = parse_completion({"prompt": "Say hi", "model": "m"})
    assert req.render() == M.BOS + "You are a helpful assistant<｜User｜>Say hi<｜Assistant｜><think>"
    assert req.model == "m"
    assert parse_completion({"prompt": ["first", "second"]}).prompt == "first"
    assert parse_completion({"prompt": [1, "x"]}).prompt == ""
    assert parse_completion({"prompt": None}).prompt == ""
    assert render_completion("p", "none") == M.BOS + "You are a helpful assistant<｜User｜>p<｜Assistant｜></think>"
    assert render_completion("p", "max") == (
        M.BOS + M.THINK_MAX_PREFIX + "You are a helpful assistant<｜User｜>p<｜Assistant｜><think>"
    )


# --- live continuation tail (§4.5) ---------------------------------------------------------


def test_continuation_tail_responses():
    conv = parse_responses(json.loads(EX6_BODY), json_style="compact")
    start, ids = live_tail(conv)
    assert ids == ["call_1"] and conv.messages[start].role == "tool"
    assert render_continuation_tail(conv, start) == (
        "<｜end▁of▁sentence｜><｜User｜><tool_result>/home/u</tool_result><｜Assistant｜><think>"
    )
    # the tail is exactly the suffix of the full prompt after the live tool-call turn (minus its EOS)
    full = render(conv)
    assert full.endswith(render_continuation_tail(conv, start))
    only_outputs = parse_responses({"input": [{"type": "function_call_output", "call_id": "c9", "output": "o"}]})
    assert live_tail(only_outputs) == (0, ["c9"])
    assert live_tail(parse_responses({"input": "x"})) is None


def test_continuation_tail_anthropic_keeps_assistant_reasoning():
    conv = parse_anthropic(json.loads(EX4_BODY))
    start, ids = live_tail(conv)
    assert ids == ["toolu_01"] and start == 2
    assert render_continuation_tail(conv, start) == (
        "<｜end▁of▁sentence｜><｜User｜><tool_result>int main(){return 0 && 1;}\n&lt;/tool_result></tool_result>"
        "<｜Assistant｜></think>"
    )
    conv = Conversation(messages=[Message("tool", "r"), Message("assistant", "a", reasoning="why")], thinking="high")
    assert render_continuation_tail(conv, 0) == (
        "<｜end▁of▁sentence｜><｜User｜><tool_result>r</tool_result>"
        "<｜Assistant｜><think>why</think>a<｜end▁of▁sentence｜>"
    )


def test_unreplayed_tool_result_ids():
    conv = parse_responses(
        {
            "input": [
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "1"},
                {"type": "function_call_output", "call_id": "b", "output": "2"},
            ]
        }
    )
    assert unreplayed_tool_result_ids(conv) == ["b"]
    conv = parse_anthropic(
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t0", "content": "x"}]}]}
    )
    assert unreplayed_tool_result_ids(conv) == ["t0"]
    assert unreplayed_tool_result_ids(parse_chat(json.loads(EX3_BODY))) == []


def test_think_max_prefix_bytes():
    assert M.THINK_MAX_PREFIX.startswith("Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST ")
    assert M.THINK_MAX_PREFIX.count("\n") == 4 and M.THINK_MAX_PREFIX.endswith(".\n\n")
    assert (
        hashlib.sha256(M.THINK_MAX_PREFIX.encode()).hexdigest()
        == hashlib.sha256(
            b"Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
            b"You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
            b"cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
            b"scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, "
            b"considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
        ).hexdigest()
    )


def test_special_strings():
    assert M.BOS.encode().hex(" ").upper() == (
        "3C EF BD 9C 62 65 67 69 6E E2 96 81 6F 66 E2 96 81 73 65 6E 74 65 6E 63 65 EF BD 9C 3E"
    )
    assert M.EOS == "<｜end▁of▁sentence｜>" and M.USER == "<｜User｜>" and M.ASSISTANT == "<｜Assistant｜>"
    assert M.DSML.encode() == b"\xef\xbd\x9cDSML\xef\xbd\x9c"
    assert len(M.SPECIAL_STRINGS) == 7


def test_explicit_conversation_renders_calls_and_raw_dsml():
    calls = [ToolCall("x1", "f", '{"a":1}')]
    conv = Conversation(messages=[Message("user", "q"), Message("assistant", "", tool_calls=calls)])
    assert '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>' in render(conv)
    conv.messages[1].raw_dsml = "\n\n<｜DSML｜tool_calls>SAMPLED</｜DSML｜tool_calls>"
    assert render(conv).endswith(
        "<｜Assistant｜><think></think>\n\n<｜DSML｜tool_calls>SAMPLED</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
    )
