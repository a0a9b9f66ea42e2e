"""Anthropic messages, both directions: the request body -> `Conversation`
(docs/chat-template.md §2.2) and engine events -> wire shapes (docs/http-api.md §5).

Streaming block rules: a thinking block opens with the first reasoning text
and closes (with a `signature_delta` carrying the message id) when content or
a tool call starts, or at the end; a text block opens with the first content
and closes when a tool block starts or at the end; tool blocks stream live.
A stream that had thinking but no text and no tool call gets an empty text
block before `message_delta`.
"""

from __future__ import annotations

from typing import Any

from ..chat import images as chat_images
from ..chat import markers as M
from ..chat.dsml_lex import escape_tool_result
from ..chat.jsontext import dumps_compact
from ..chat.messages import Conversation, Message, ToolCall
from ..chat.requests import (
    DEFAULT_MODEL,
    RequestError,
    Thinking,
    add_id,
    as_str,
    body_object,
    check_image_role,
    finish_conversation,
    flatten_content,
    image_marker,
    invalid_json,
    message_list,
    parse_stop,
    parse_tools,
    require_messages,
)
from ..runtime.events import (
    Finish,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from . import errors as E
from . import sse
from .common import RequestInfo, body_bytes, parsed_parts

# --- request (docs/chat-template.md §2.2) -------------------------------------------------


def _anthropic_block(b: dict, m: Message) -> None:
    typ = text = thinking = bid = name = result = None
    has_input = False
    inp = None
    result_images: list = []  # a tool_result's images (a screenshot a tool returned)
    for k, v in b.items():
        if k == "type":
            typ = as_str(v)
        elif k == "text":
            text = flatten_content(v)
        elif k == "thinking":
            thinking = flatten_content(v)
        elif k in ("id", "tool_use_id"):
            bid = as_str(v)
        elif k == "name":
            name = as_str(v)
        elif k == "input":
            has_input, inp = True, v
        elif k == "content":
            result_images = []
            result = flatten_content(v, result_images)
    if result_images and typ != "tool_result":
        raise RequestError(chat_images.ERR_ROLE)
    if typ == "image":
        m.content += image_marker(b, m.images)
    elif typ == "tool_use":
        m.tool_calls.append(
            ToolCall(id=bid or "", name=name or "", arguments=dumps_compact(inp) if has_input else "{}")
        )
    elif typ == "tool_result":
        add_id(m.tool_call_ids, bid)
        start = len(m.content)
        m.content += M.TOOL_RESULT_OPEN + escape_tool_result(result or "") + M.TOOL_RESULT_CLOSE
        m.result_spans.append((start, len(m.content), bid or ""))
        m.images.extend(result_images)
    else:
        if text:
            m.content += text
        if thinking:
            m.reasoning += thinking


def _anthropic_message(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise invalid_json()
    m = Message(role="user")
    for k, v in obj.items():
        if k == "role":
            m.role = as_str(v)
        elif k == "content":
            m.content, m.reasoning, m.tool_calls, m.tool_call_ids, m.result_spans = "", "", [], [], []
            m.images = []
            if isinstance(v, str):
                m.content = v
            elif isinstance(v, list):
                for e in v:
                    if isinstance(e, str):
                        m.content += e
                    elif isinstance(e, dict):
                        _anthropic_block(e, m)
    return check_image_role(m)


def _anthropic_system(v: Any) -> str:
    parts: list[str] = []

    def add(s: str) -> None:
        if not s or s.startswith("x-anthropic-"):
            return
        if parts and not parts[-1].endswith("\n"):
            parts.append("\n")
        parts.append(s)

    if isinstance(v, str):
        add(v)
    elif isinstance(v, list):
        for e in v:
            if isinstance(e, str):
                add(e)
            elif chat_images.is_image_part(e):
                raise RequestError(chat_images.ERR_ROLE)  # refused, never dropped
            elif isinstance(e, dict) and "text" in e:
                add(as_str(e["text"]))
    return "".join(parts)


def refuse_threads(body: Any, betas: str) -> None:
    """The `thread` field and the message-threads beta are not served: a 400 naming them,
    with the `thread_unsupported_request` details on which the anthropic SDK's thread and
    tool_runner go on sending the full history (docs/http-api.md §1.6)."""
    named = []
    if isinstance(body, dict) and body.get("thread") is not None:
        named.append("the 'thread' field")
    if M.ANTHROPIC_THREADS_BETA in (b.strip() for b in betas.split(",")):
        named.append(f"anthropic-beta '{M.ANTHROPIC_THREADS_BETA}'")
    if named:
        raise E.APIError(
            400,
            E.THREADS_UNSUPPORTED.format(named=" and ".join(named)),
            param="thread",
            extra={"details": dict(E.THREADS_UNSUPPORTED_DETAILS)},
        )


def parse_anthropic(body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True) -> Conversation:
    """POST /v1/messages body -> Conversation (the system text becomes a trailing system message).
    Thinking is off unless `thinking` turns it on or an effort is named (Anthropic's
    default is off; Claude Code with MAX_THINKING_TOKENS=0 sends neither)."""
    body = body_object(body)
    th = Thinking(enabled=False)
    effort_named = False
    msgs = None
    system = ""
    schemas: list[str] = []
    aliases: dict = {}
    tool_choice_none = False
    model = DEFAULT_MODEL
    stop: list[str] = []
    for k, v in body.items():
        if k == "messages":
            msgs = message_list(v, _anthropic_message, lambda i: f"messages.{i}")
        elif k == "system":
            system = _anthropic_system(v)
        elif k == "tools":
            schemas, aliases = parse_tools(v, json_style)
        elif k == "tool_choice":
            if isinstance(v, dict):
                tool_choice_none = "type" in v and as_str(v["type"]) == "none"
        elif k == "model":
            model = as_str(v)
        elif k == "thinking":
            th.control(v)
        elif k == "output_config":
            if isinstance(v, dict) and "effort" in v:
                effort_named = th.set_effort(v["effort"], "output_config.effort") or effort_named
        elif k == "reasoning_effort":
            effort_named = th.set_effort(v) or effort_named
        elif k == "stop_sequences":
            stop = parse_stop(v)
    if effort_named and "thinking" not in body:
        th.enabled = True
    msgs = require_messages(msgs, strict)
    if system:
        msgs.append(Message(role="system", content=system))
    conv = Conversation(
        messages=msgs,
        tool_schemas=schemas,
        tools_active=not tool_choice_none,
        api="anthropic",
        stop=stop,
        tool_aliases=aliases,
    )
    return finish_conversation(conv, model, th, ctx)


# --- response (docs/http-api.md §5) -------------------------------------------------------

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def usage_anthropic(u: Usage) -> dict:
    return {
        "input_tokens": max(0, u.prompt_tokens - u.cached_tokens - u.written_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": u.written_tokens,
    }


def stop_reason(fin: Finish) -> str:
    if fin.reason == "stop" and fin.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(fin.reason, "end_turn")


def tool_input(arguments: str) -> dict:
    from ..chat.jsontext import call_input

    return call_input(arguments)


class AnthropicAdapter:
    api = "anthropic"

    def __init__(self, info: RequestInfo):
        self.info = info
        self.index = -1  # last block index used
        self.open_kind: str | None = None  # thinking | text | tool
        self.had_thinking = self.had_text = self.had_tool = False
        self.tool_blocks: dict[int, int] = {}  # call index -> block index
        self.closed_tools: set[int] = set()

    @staticmethod
    def _ev(name: str, obj: dict) -> bytes:
        return sse.event(name, obj)

    def _open(self, kind: str, block: dict) -> bytes:
        self.index += 1
        self.open_kind = kind
        return self._ev(
            "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    def _delta(self, delta: dict, index: int | None = None) -> bytes:
        return self._ev(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index if index is None else index, "delta": delta},
        )

    def _stop(self, index: int | None = None) -> bytes:
        return self._ev(
            "content_block_stop", {"type": "content_block_stop", "index": self.index if index is None else index}
        )

    def _close_open(self) -> list[bytes]:
        out = []
        if self.open_kind == "thinking":
            out += [self._delta({"type": "signature_delta", "signature": self.info.id}), self._stop()]
        elif self.open_kind == "text":
            out.append(self._stop())
        self.open_kind = None
        return out

    # -- streaming ----------------------------------------------------------------
    def start(self, started: Started) -> list[bytes]:
        u = Usage(started.prompt_tokens, 0, started.cached_tokens, started.prompt_tokens - started.cached_tokens)
        i = self.info
        return [
            self._ev(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": i.id,
                        "type": "message",
                        "role": "assistant",
                        "model": i.model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": usage_anthropic(u),
                    },
                },
            )
        ]

    def event(self, ev) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(ev, ReasoningDelta):
            if not ev.text:
                return out
            if self.open_kind != "thinking":
                out += self._close_open()
                out.append(self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
                self.had_thinking = True
            out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, TextDelta):
            if not ev.text:
                return out
            if self.open_kind != "text":
                out += self._close_open()
                out.append(self._open("text", {"type": "text", "text": ""}))
                self.had_text = True
            out.append(self._delta({"type": "text_delta", "text": ev.text}))
        elif isinstance(ev, ToolCallStart):
            out += self._close_open()
            out.append(self._open("tool", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}))
            self.tool_blocks[ev.index] = self.index
            self.had_tool = True
        elif isinstance(ev, ToolCallDelta):
            b = self.tool_blocks.get(ev.index)
            if b is not None and ev.index not in self.closed_tools and ev.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": ev.arguments}, b))
        elif isinstance(ev, ToolCallEnd):
            b = self.tool_blocks.get(ev.index)
            if b is not None and ev.index not in self.closed_tools:
                self.closed_tools.add(ev.index)
                out.append(self._stop(b))
                if self.open_kind == "tool" and b == self.index:
                    self.open_kind = None
        return out

    def finish(self, fin: Finish) -> list[bytes]:
        out = self._close_open()
        cut = False
        for ci, b in self.tool_blocks.items():  # a call the output broke off inside: left incomplete
            if ci not in self.closed_tools:
                self.closed_tools.add(ci)
                out.append(self._stop(b))
                cut = True
        if cut and fin.reason == "error":
            # a failed turn (EOS inside a call): Anthropic's own mid-stream error, so that no
            # client runs the incomplete tool_use block (docs/http-api.md §1.6)
            out.append(self._ev("error", E.sse_error_payload("anthropic", fin.error or E.GENERATION_FAILED)))
            return out
        if self.had_thinking and not self.had_text and not self.had_tool and fin.reason != "length":
            out.append(self._open("text", {"type": "text", "text": ""}))
            out.append(self._stop())
            self.open_kind = None
        out.append(
            self._ev(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(fin), "stop_sequence": fin.stop_sequence},
                    "usage": {"output_tokens": fin.usage.completion_tokens},
                },
            )
        )
        out.append(self._ev("message_stop", {"type": "message_stop"}))
        return out

    # -- non-streaming ----------------------------------------------------------------
    def body(self, fin: Finish) -> bytes:
        content, reasoning, calls = parsed_parts(fin)
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": self.info.id})
        if content:
            blocks.append({"type": "text", "text": content})
        for c in calls:
            blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)})
        if not blocks or (all(b["type"] == "thinking" for b in blocks) and fin.reason != "length"):
            blocks.append({"type": "text", "text": ""})
        i = self.info
        return body_bytes(
            {
                "id": i.id,
                "type": "message",
                "role": "assistant",
                "model": i.model,
                "content": blocks,
                "stop_reason": stop_reason(fin),
                "stop_sequence": fin.stop_sequence,
                "usage": usage_anthropic(fin.usage),
            }
        )
