"""OpenAI chat completions: engine events -> wire shapes (docs/http-api.md §3).

Adapters share one interface (see app.py): `start(started)`, `event(ev)` and
`finish(fin)` return SSE chunks for a stream; `body(fin)` returns the
non-streaming response body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..events import Finish, ReasoningDelta, Started, TextDelta, ToolCallDelta, ToolCallStart, Usage
from . import sse

FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "error": "error",
    "cancelled": "error",
}


@dataclass
class RequestInfo:
    """What an adapter needs to know about its request."""

    id: str
    model: str
    created: int
    include_usage: bool = False
    thinking: str = "high"
    reasoning_summary: bool = False  # Responses
    tool_aliases: dict = field(default_factory=dict)  # DSML name -> chat.messages.ToolAlias
    extra: dict = field(default_factory=dict)


def usage_openai(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.written_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def finish_reason(fin: Finish) -> str:
    return FINISH_REASONS.get(fin.reason, "stop")


def parsed_parts(fin: Finish) -> tuple[str, str | None, list]:
    """(content, reasoning, calls) of the final parse (raw text when there is none)."""
    r = fin.result
    if r is None:
        return fin.raw_text, None, []
    return (getattr(r, "content", "") or ""), getattr(r, "reasoning", None), list(getattr(r, "calls", []) or [])


def body_bytes(obj: Any, newline: bool = True) -> bytes:
    return sse.encode(obj) + (b"\n" if newline else b"")


class ChatAdapter:
    api = "chat"

    def __init__(self, info: RequestInfo):
        self.info = info
        self.tool_header_streamed = False

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        i = self.info
        return sse.data(
            {
                "id": i.id,
                "object": "chat.completion.chunk",
                "created": i.created,
                "model": i.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    # -- streaming ----------------------------------------------------------------
    def start(self, started: Started) -> list[bytes]:
        return [self._chunk({"role": "assistant"})]

    def event(self, ev) -> list[bytes]:
        if isinstance(ev, ReasoningDelta):
            return [self._chunk({"reasoning_content": ev.text})] if ev.text else []
        if isinstance(ev, TextDelta):
            return [self._chunk({"content": ev.text})] if ev.text else []
        if isinstance(ev, ToolCallStart):
            self.tool_header_streamed = True
            return [
                self._chunk(
                    {
                        "tool_calls": [
                            {
                                "index": ev.index,
                                "id": ev.id,
                                "type": "function",
                                "function": {"name": ev.name, "arguments": ""},
                            }
                        ]
                    }
                )
            ]
        if isinstance(ev, ToolCallDelta):
            if not ev.arguments:
                return []
            return [self._chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]})]
        return []

    def finish(self, fin: Finish) -> list[bytes]:
        out = [self._chunk({}, finish_reason(fin))]
        if self.info.include_usage:
            i = self.info
            out.append(
                sse.data(
                    {
                        "id": i.id,
                        "object": "chat.completion.chunk",
                        "created": i.created,
                        "model": i.model,
                        "choices": [],
                        "usage": usage_openai(fin.usage),
                    }
                )
            )
        out.append(sse.DONE)
        return out

    # -- non-streaming ----------------------------------------------------------------
    def body(self, fin: Finish) -> bytes:
        content, reasoning, calls = parsed_parts(fin)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        i = self.info
        return body_bytes(
            {
                "id": i.id,
                "object": "chat.completion",
                "created": i.created,
                "model": i.model,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason(fin)}],
                "usage": usage_openai(fin.usage),
            }
        )
