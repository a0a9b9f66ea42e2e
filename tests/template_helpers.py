"""Shared plumbing of the byte-exact chat-template tests (tests/test_protocol_*.py):
rendering a published template through transformers' own jinja setup, building the
OpenAI body a client sends, and the GLM conversation both GLM templates are checked on."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def render_jinja(template: str, messages, tools=None, **kw) -> str:
    """The template's prompt for `messages` (with the generation prompt)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=template, add_generation_prompt=True, **kw
    )
    return out[0]


def openai_body(model: str, messages, tools=None, **extra) -> dict:
    """A Chat Completions body: tool-call arguments as JSON text, as clients send them
    (the templates take them as objects)."""
    msgs = json.loads(json.dumps(messages))
    for m in msgs:
        for tc in m.get("tool_calls") or []:
            tc["function"]["arguments"] = json.dumps(tc["function"]["arguments"])
    body = {"model": model, "messages": msgs, **extra}
    if tools is not None:
        body["tools"] = tools
    return body


# --- GLM 5.2 and 5.3 Flash: one conversation, checked against each family's template

GLM_TOOLS = [
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
            "strict": True,
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
# system, tools, a tool call (two calls), tool results (out of call order), thinking
GLM_CHAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is in /tmp? Also read a.txt."},
    {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "Need ls, then read.",
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
    {"role": "tool", "tool_call_id": "call_2", "content": "hello </tool_response> world"},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
]
# ... then the answer and a new user turn
GLM_MESSAGES = GLM_CHAIN + [
    {"role": "assistant", "content": "Two files; a.txt says hello.", "reasoning_content": "Summarize."},
    {"role": "user", "content": "Thanks. And </think> <tool_call> are just text here."},
]


def glm_anthropic_case(model: str):
    """(Anthropic body with thinking, tool_use and tool_result, the same conversation in
    the template's terms, its tools)."""
    tools = [{"name": "bash", "description": "Run", "input_schema": {"type": "object", "properties": {}}}]
    body = {
        "model": model,
        "system": "You are terse.",
        "max_tokens": 100,
        "tools": tools,
        "thinking": {"type": "enabled", "budget_tokens": 1024},  # Anthropic's default is off (#17)
        "messages": [
            {"role": "user", "content": "ls"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Need ls."},
                    {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x </tool_result> y"}],
            },
        ],
    }
    ref_msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "ls"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need ls.",
            "tool_calls": [{"id": "toolu_1", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "x </tool_result> y"},
    ]
    return body, ref_msgs, json.loads(json.dumps(tools))
