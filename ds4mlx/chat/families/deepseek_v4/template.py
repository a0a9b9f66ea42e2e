"""DeepSeek V4 Flash prompt rendering (docs/chat-template.md §4, §5).

`render(conv)` is the one chat prompt renderer for every API; the legacy
completions prompt and the live tool-continuation tail have their own entry
points.  Contents are inserted verbatim except the two escapes of docs/chat-template.md §6/§7.
"""

from __future__ import annotations

from collections.abc import Sequence

from ... import markers as M
from ...messages import Conversation, Message, live_tail  # noqa: F401  (re-exported)
from .dsml import escape_tool_result, render_calls

__all__ = [
    "render",
    "render_completion",
    "render_continuation_tail",
    "tools_block",
    "uses_tool_context",
    "live_tail",
    "thinking_enabled",
]

_SYSTEM_ROLES = ("system", "developer")
_TOOL_ROLES = ("tool", "function")
_USER_LIKE = ("user", "tool", "function")


def thinking_enabled(mode: str) -> bool:
    return mode in ("high", "max")


def tools_block(schemas: Sequence[str]) -> str:
    """The `## Tools` system text for the schema lines (docs/chat-template.md §5); "" if none."""
    text = "\n".join(s for s in schemas if s)
    if not text:
        return ""
    return M.TOOLS_BLOCK_HEAD + text + M.TOOLS_BLOCK_TAIL


def _active_schemas(conv: Conversation) -> list[str]:
    return [s for s in conv.tool_schemas if s] if conv.tools_active else []


def uses_tool_context(conv: Conversation) -> bool:
    """Tools active, or any assistant tool call / tool message in the history.

    With tool context every assistant turn keeps `<think>reasoning</think>`
    (ds4's `prompt_preserves_reasoning`)."""
    if _active_schemas(conv):
        return True
    return any((m.role == "assistant" and m.tool_calls) or m.role in _TOOL_ROLES for m in conv.messages)


def _dsml(m: Message, tool_memory) -> str:
    if not m.tool_calls:
        return ""
    if m.raw_dsml:
        return m.raw_dsml
    if tool_memory is not None:
        block = tool_memory.lookup_message([c.id for c in m.tool_calls])
        if block:
            return block
    return render_calls(m.tool_calls)


def _render_turns(out: list[str], messages: Sequence[Message], think: bool, keep_reasoning, tool_memory) -> None:
    pending_assistant = False
    pending_tool = False
    for i, m in enumerate(messages):
        role = m.role
        if role in _SYSTEM_ROLES:
            continue
        if role == "user":
            out.append(M.USER)
            out.append(m.content)
            pending_assistant, pending_tool = True, False
        elif role in _TOOL_ROLES:
            if not pending_tool:
                out.append(M.USER)
            out.append(M.TOOL_RESULT_OPEN)
            out.append(escape_tool_result(m.content))
            out.append(M.TOOL_RESULT_CLOSE)
            pending_assistant, pending_tool = True, True
        elif role == "assistant":
            if pending_assistant:
                out.append(M.ASSISTANT)
                if think and keep_reasoning(i):
                    out.append(M.THINK_OPEN + m.reasoning + M.THINK_CLOSE)
                else:
                    out.append(M.THINK_CLOSE)
            out.append(m.content)
            out.append(_dsml(m, tool_memory))
            out.append(M.EOS)
            pending_assistant, pending_tool = False, False
        # any other role: ignored entirely
    if pending_assistant:
        out.append(M.ASSISTANT)
        out.append(M.THINK_OPEN if think else M.THINK_CLOSE)


def render(conv: Conversation, tool_memory=None) -> str:
    """The full prompt for a chat request (docs/chat-template.md §4.1, §4.2).

    `tool_memory` (a `ToolMemory`) enables exact replay of remembered DSML
    blocks for assistant tool calls that have no `raw_dsml` attached yet."""
    think = thinking_enabled(conv.thinking)
    messages = conv.messages
    system = tools_block(_active_schemas(conv))
    for m in messages:
        if m.role in _SYSTEM_ROLES:
            if system:
                system += "\n\n"
            system += m.content
    tool_context = uses_tool_context(conv)
    last_user = -1
    for i, m in enumerate(messages):
        if m.role in _USER_LIKE:
            last_user = i

    out = [M.BOS]
    if conv.thinking == "max":
        out.append(M.THINK_MAX_PREFIX)
    out.append(system)
    _render_turns(out, messages, think, lambda i: tool_context or i > last_user, tool_memory)
    return "".join(out)


def render_completion(prompt: str, thinking: str = "high") -> str:
    """Legacy /v1/completions prompt (docs/chat-template.md §4.3)."""
    return (
        M.BOS
        + (M.THINK_MAX_PREFIX if thinking == "max" else "")
        + M.COMPLETION_SYSTEM
        + M.USER
        + prompt
        + M.ASSISTANT
        + (M.THINK_OPEN if thinking_enabled(thinking) else M.THINK_CLOSE)
    )


def render_continuation_tail(conv: Conversation, start: int, tool_memory=None) -> str:
    """The live tool-continuation suffix (docs/chat-template.md §4.5): EOS closing the
    live tool-call turn, then messages[start:] rendered as in docs/chat-template.md §4.2, with every
    assistant message in the tail keeping `<think>reasoning</think>`."""
    out = [M.EOS]
    _render_turns(out, conv.messages[start:], thinking_enabled(conv.thinking), lambda i: True, tool_memory)
    return "".join(out)
