"""GLM 5.2 (`glm_moe_dsa`) prompts against GLM 5.2's own chat template.

tests/data/chat_templates/glm_moe_dsa.jinja is the GLM-5.2 template as
ik_llama.cpp ships it (provenance and the sha256 in SOURCES.md).  Rendered by
transformers' own jinja setup and compared byte for byte with the protocol's
prompt: system, tools, tool calls, tool results, thinking, the effort rungs and
thinking off.  That copy is the GLM-5.2-Vision variant: only image parts render
differently from zai-org's text-only file, and no test here sends media.
"""

from __future__ import annotations

import hashlib

import pytest
from lazy_modules import requires
from template_helpers import (
    GLM_CHAIN,
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
from ds4mlx.chat.protocol import get_protocol
from ds4mlx.serve.prepare import parse_request

needs = requires("transformers.utils.chat_template_utils")

TEMPLATE_PATH = TEMPLATES / "glm_moe_dsa.jinja"
TEMPLATE = TEMPLATE_PATH.read_text()
TEMPLATE_SHA256 = "6d172cae09cb494bd825a6b14d07e7b32a2c26988afe43d8bc2bbda91aab99c8"

# system, tools, two calls, results out of call order; then an answer and a new user
# turn: the turns before it lose their reasoning
TOOLS, CHAIN, MESSAGES = GLM_TOOLS, GLM_CHAIN, GLM_MESSAGES


def jinja(messages, tools=None, **kw) -> str:
    return render_jinja(TEMPLATE, messages, tools, **kw)


def openai_body(messages, tools=None, **extra) -> dict:
    return make_body("glm-5.2", messages, tools, **extra)


def ours(body, effort=None, proto=GLM52) -> str:
    conv = parse_request("openai", body)
    conv.thinking = proto.resolve_thinking(conv.thinking, effort)
    return proto.render(conv)


def test_template_is_the_pinned_file():
    assert hashlib.sha256(TEMPLATE_PATH.read_bytes()).hexdigest() == TEMPLATE_SHA256


def test_registered_for_glm_moe_dsa():
    assert get_protocol("glm_moe_dsa") is GLM52
    assert GLM52.family == "glm_moe_dsa" and GLM52.model_id == "glm-5.2"


def test_full_conversation_matches_template():
    got = ours(openai_body(MESSAGES, TOOLS))
    assert got == jinja(MESSAGES, TOOLS)
    # the turns before the last user message render <think></think>; results keep their order
    assert "Need ls" not in got and "Summarize." not in got
    assert got.index("hello </tool_response> world") < got.index("a.txt\nb.txt")
    assert got.startswith("[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>\n# Tools")
    assert got.endswith("<|user|>Thanks. And </think> <tool_call> are just text here.<|assistant|><think>")


def test_tool_chain_keeps_reasoning_after_the_last_user_turn():
    got = ours(openai_body(CHAIN, TOOLS))
    assert got == jinja(CHAIN, TOOLS)
    assert "<|assistant|><think>Need ls, then read.</think>Let me look.<tool_call>bash" in got


def test_differs_from_the_53_rendering():
    body = openai_body(MESSAGES, TOOLS)
    assert ours(body) != ours(body, proto=GLM53)


@pytest.mark.parametrize("effort", ["high", "max"])
def test_template_effort_values_pass_through(effort):
    body = openai_body(MESSAGES[:2], reasoning_effort=effort)
    got = ours(body, effort)
    assert got == jinja(MESSAGES[:2], reasoning_effort=effort)
    assert f"Reasoning Effort: {effort.capitalize()}<|system|>You are terse." in got


# ("minimal" is off in every API since #17: OpenAI's way of saying almost no reasoning)
@pytest.mark.parametrize("effort,rung", [("low", "high"), ("medium", "high"), ("xhigh", "max")])
def test_other_efforts_take_a_template_rung(effort, rung):
    # the template itself renders any value but 'high' as Max; the protocol maps a
    # request below max to High (its lower rung) and renders what the template
    # renders for that rung
    assert GLM52.resolve_thinking("max", effort) == rung
    body = openai_body(MESSAGES[:2], reasoning_effort=effort)
    assert ours(body, effort) == jinja(MESSAGES[:2], reasoning_effort=rung)


def test_thinking_off_drops_the_effort_line():
    body = openai_body(MESSAGES, TOOLS, thinking={"type": "disabled"})
    got = ours(body)
    assert got == jinja(MESSAGES, TOOLS, enable_thinking=False)
    assert "Reasoning Effort" not in got and got.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert got.endswith("<|assistant|><think></think>")
    assert ours(openai_body(MESSAGES[:2], reasoning_effort="none"), "none") == jinja(
        MESSAGES[:2], enable_thinking=False
    )


def test_no_tools_no_system():
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Bye"},
    ]
    assert (
        ours(openai_body(msgs)) == jinja(msgs) == "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Hi"
        "<|assistant|><think></think>Hello!<|user|>Bye<|assistant|><think>"
    )


def test_anthropic_request_renders_like_the_template():
    body, ref_msgs, ref_tools = glm_anthropic_case("glm-5.2")
    conv = parse_request("anthropic", body)
    conv.thinking = GLM52.resolve_thinking(conv.thinking)
    assert GLM52.render(conv) == jinja(ref_msgs, ref_tools)


def test_continuation_tail_inside_a_tool_chain():
    conv = parse_request("openai", openai_body(CHAIN, TOOLS))
    conv.thinking = "max"
    full = GLM52.render(conv)
    tail = GLM52.render_continuation_tail(conv, 3)
    assert tail is not None and tail.startswith("<|observation|><tool_response>") and full.endswith(tail)
