"""Shared pieces of the non-V4 families: the request conversation as template
turns, JSON the way Hugging Face's `tojson` writes it, tool-schema types.

The request parsers (serve/openai.py, anthropic.py, responses.py) normalize
every API for DeepSeek V4: Anthropic tool results become `<tool_result>` text inside a user message
and the Anthropic system text a trailing system message.  `turns()` undoes
that so that other templates see what the client sent: tool messages, and the
system first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import markers as M
from ..messages import Conversation, ToolCall

_SYSTEM_ROLES = ("system", "developer")
_TOOL_ROLES = ("tool", "function")


def tojson(v: Any) -> str:
    """transformers' chat-template `tojson` (ensure_ascii=False, default separators)."""
    return json.dumps(v, ensure_ascii=False)


@dataclass
class Turn:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # ToolCall
    tool_id: str = ""  # tool: the call id it answers
    replay: str = ""  # assistant: exact sampled tool-call text to replay ("" = render canonically)


def _split_anthropic_results(m, out: list) -> None:
    """A user message that carries Anthropic tool_result blocks: each block (the span
    the request parser recorded) becomes a tool turn, the text around them user turns;
    literal `<tool_result>` text in a text block stays user text."""
    close_escaped = M.PARAM_CLOSE_TEXT_ESCAPE + M.TOOL_RESULT_CLOSE[1:]
    pos = 0
    for start, end, tool_id in m.result_spans:
        if m.content[pos:start]:
            out.append(Turn("user", m.content[pos:start]))
        body = m.content[start + len(M.TOOL_RESULT_OPEN) : end - len(M.TOOL_RESULT_CLOSE)]
        out.append(Turn("tool", body.replace(close_escaped, M.TOOL_RESULT_CLOSE), tool_id=tool_id))
        pos = end
    if m.content[pos:]:
        out.append(Turn("user", m.content[pos:]))


def replay_text(m, tool_memory) -> str:
    if not m.tool_calls:
        return ""
    if m.raw_dsml:
        return m.raw_dsml
    if tool_memory is not None:
        return tool_memory.lookup_message([c.id for c in m.tool_calls]) or ""
    return ""


def turns(conv: Conversation, tool_memory=None) -> list[Turn]:
    """The conversation as template turns.  developer -> system, function -> tool;
    other roles are ignored (as ds4 does).  Anthropic: system messages move to
    the front and tool results become tool turns."""
    out: list[Turn] = []
    msgs = conv.messages
    if conv.api == "anthropic":
        msgs = [m for m in msgs if m.role in _SYSTEM_ROLES] + [m for m in msgs if m.role not in _SYSTEM_ROLES]
    for m in msgs:
        role = m.role
        if role in _SYSTEM_ROLES:
            out.append(Turn("system", m.content))
        elif role in _TOOL_ROLES:
            out.append(Turn("tool", m.content, tool_id=m.tool_call_ids[0] if m.tool_call_ids else ""))
        elif role == "user":
            if m.result_spans:
                _split_anthropic_results(m, out)
            else:
                out.append(Turn("user", m.content))
        elif role == "assistant":
            out.append(
                Turn("assistant", m.content, m.reasoning, list(m.tool_calls), replay=replay_text(m, tool_memory))
            )
    return out


def merge_leading_system(ts: list[Turn], joiner: str = "\n\n") -> tuple[str | None, list[Turn]]:
    """(text of the leading system turns joined, the remaining turns); None when
    the conversation does not start with a system turn."""
    i = 0
    parts = []
    while i < len(ts) and ts[i].role == "system":
        parts.append(ts[i].content)
        i += 1
    return (joiner.join(parts) if i else None), ts[i:]


def active_schemas(conv: Conversation) -> list[str]:
    return [s for s in conv.tool_schemas if s] if conv.tools_active else []


def schema_objects(schemas: Sequence[str]) -> list[Any]:
    """Schema lines parsed (key order kept); a line that is not JSON is skipped."""
    out = []
    for s in schemas:
        try:
            out.append(json.loads(s))
        except ValueError:
            continue
    return out


def call_arguments(call: ToolCall) -> dict | None:
    """The arguments of a history tool call as an ordered dict (None: not a JSON object)."""
    try:
        v = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def param_types(schemas: Sequence[str]) -> dict[str, dict[str, Any]]:
    """tool name -> parameter name -> declared JSON-schema type (str, list or None)."""
    out: dict[str, dict[str, Any]] = {}
    for obj in schema_objects(schemas):
        if not isinstance(obj, dict):
            continue
        fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
        name = fn.get("name")
        params = fn.get("parameters", fn.get("input_schema"))
        if not isinstance(name, str) or not isinstance(params, dict):
            continue
        props = params.get("properties")
        if isinstance(props, dict):
            out[name] = {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    return out
