"""What the API modules share on the response side: the request facts an adapter
needs, the final parse's parts, JSON body bytes.

Request-side pieces every API shares (content, thinking, stop, tools) live in
chat/requests.py: they produce chat-layer values and the agent uses them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..runtime.events import Finish, Usage
from . import sse


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


def parsed_parts(fin: Finish) -> tuple[str, str | None, list]:
    """(content, reasoning, calls) of the final parse (raw text when there is none)."""
    r = fin.result
    if r is None:
        return fin.raw_text, None, []
    return (getattr(r, "content", "") or ""), getattr(r, "reasoning", None), list(getattr(r, "calls", []) or [])


def total_usage(fins: list) -> Usage:
    """The usage of several choices: summed."""
    return Usage(
        sum(f.usage.prompt_tokens for f in fins),
        sum(f.usage.completion_tokens for f in fins),
        sum(f.usage.cached_tokens for f in fins),
        sum(f.usage.written_tokens for f in fins),
        sum(f.usage.reasoning_tokens for f in fins),
    )


def body_bytes(obj: Any, newline: bool = True) -> bytes:
    return sse.encode(obj) + (b"\n" if newline else b"")
