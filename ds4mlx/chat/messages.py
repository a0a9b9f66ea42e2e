"""The normalized chat request every API is turned into (docs/chat-template.md §2)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import markers as M


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object (or free text for custom tools)


@dataclass
class Message:
    role: str  # system | developer | user | assistant | tool | function
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_ids: list[str] = field(default_factory=list)  # ids of tool results carried here
    # Anthropic: (start, end, tool_use_id) of each tool_result block's `<tool_result>...`
    # text in `content`, so a literal `<tool_result>` typed in a text block stays text.
    result_spans: list[tuple[int, int, str]] = field(default_factory=list)
    # Exact sampled DSML block replayed instead of the canonical rendering of
    # `tool_calls` (set by ToolMemory.attach, docs/dsml.md §9); "" = render canonically.
    raw_dsml: str = ""
    # Accepted images (chat.images.ImageInput), each written into `content` as its marker
    # at its place (docs/vision.md §1).
    images: list = field(default_factory=list)


@dataclass(frozen=True)
class ToolAlias:
    """How a DSML tool name maps back to the client's tool (docs/dsml.md §6).

    Responses namespaces render `namespace + name` in the prompt; the output
    item reports the inner `name` and the `namespace`.  A hosted
    `{"type":"tool_search"}` tool is reported as a `tool_search_call` item."""

    name: str
    namespace: str | None = None
    hosted_tool_search: bool = False


@dataclass
class Conversation:
    messages: list[Message]
    tool_schemas: list[str] = field(default_factory=list)  # one rendered schema line per tool
    tools_active: bool = False  # schemas non-empty and tool_choice is not "none"
    thinking: str = "high"  # none | high | max
    api: str = "openai"  # openai | anthropic | responses
    model: str = M.DEEPSEEK_V4_MODEL_ID  # echoed back verbatim
    stop: list[str] = field(default_factory=list)  # stop / stop_sequences (docs/http-api.md §2)
    tool_aliases: dict[str, ToolAlias] = field(default_factory=dict)  # DSML name -> client tool
    reasoning_summary: bool = False  # Responses reasoning.summary opted in (auto/concise/detailed)


SYSTEM_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")


def live_tail(conv: Conversation, api: str | None = None) -> tuple[int, list[str]] | None:
    """Where a tool-result continuation tail starts and the call ids it answers.

    Responses: the trailing run of tool messages; the ids are those of the
    assistant message right before it (or the outputs' own ids when the request
    holds nothing else).  Anthropic: the trailing run of user messages that
    carry tool_result ids (trailing system messages skipped).  None when the
    request does not end in tool results."""
    api = api or conv.api
    msgs = conv.messages
    ids: list[str] = []

    def push(i: str) -> None:
        if i and i not in ids:
            ids.append(i)

    if api == "responses":
        start = len(msgs)
        while start > 0 and msgs[start - 1].role in TOOL_ROLES:
            start -= 1
        if start == len(msgs):
            return None
        if start > 0:
            anchor = msgs[start - 1]
            if anchor.role != "assistant" or not anchor.tool_calls:
                return None
            for c in anchor.tool_calls:
                push(c.id)
        else:
            for m in msgs:
                for i in m.tool_call_ids:
                    push(i)
    elif api == "anthropic":
        end = len(msgs)
        while end > 0 and msgs[end - 1].role in SYSTEM_ROLES:
            end -= 1
        start = end
        while start > 0 and msgs[start - 1].role == "user" and msgs[start - 1].tool_call_ids:
            start -= 1
        if start == end:
            return None
        for m in msgs[start:]:
            for i in m.tool_call_ids:
                push(i)
    else:
        return None
    return (start, ids) if ids else None
