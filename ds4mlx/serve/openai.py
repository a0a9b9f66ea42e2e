"""OpenAI chat completions, both directions: the request body -> `Conversation`
(docs/chat-template.md §2.1) and engine events -> wire shapes (docs/http-api.md §3).

Adapters share one interface (see app.py): `start(started)`, `event(ev)` and
`finish(fin)` return SSE chunks for a stream; `body(fin)` returns the
non-streaming response body.
"""

from __future__ import annotations

from typing import Any

from ..chat.jsontext import dumps_compact
from ..chat.messages import Conversation, Message, ToolCall
from ..chat.requests import (
    CHAT_THINKING_FIELDS,
    DEFAULT_MODEL,
    Thinking,
    add_id,
    as_str,
    body_object,
    check_image_role,
    finish_conversation,
    flatten_content,
    invalid_json,
    message_list,
    parse_stop,
    parse_tools,
    require_messages,
)
from ..runtime.events import Finish, ReasoningDelta, Started, TextDelta, ToolCallDelta, ToolCallStart, Usage
from . import sse
from .common import RequestInfo, body_bytes, parsed_parts, total_usage
from .logprobs import chat_logprobs

# --- request (docs/chat-template.md §2.1) -------------------------------------------------


def _chat_tool_calls(v: Any) -> list[ToolCall]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise invalid_json()
    calls = []
    for e in v:
        if not isinstance(e, dict):
            raise invalid_json()
        cid = ""
        name = args = None
        for k, val in e.items():
            if k == "id":
                cid = as_str(val)
            elif k == "function":
                if not isinstance(val, dict):
                    raise invalid_json()
                for fk, fv in val.items():
                    if fk == "name":
                        name = as_str(fv)
                    elif fk == "arguments":
                        args = fv if isinstance(fv, str) else dumps_compact(fv)
        if name is not None and args is not None:
            calls.append(ToolCall(id=cid, name=name, arguments=args))
    return calls


def _chat_message(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise invalid_json()
    m = Message(role="user")
    for k, v in obj.items():
        if k == "role":
            m.role = as_str(v)
        elif k == "content":
            m.images = []
            m.content = flatten_content(v, m.images)
        elif k == "reasoning_content":
            m.reasoning = flatten_content(v)
        elif k == "tool_call_id":
            add_id(m.tool_call_ids, as_str(v))
        elif k == "tool_calls":
            m.tool_calls = _chat_tool_calls(v)
    return check_image_role(m)


def parse_chat(body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True) -> Conversation:
    """POST /v1/chat/completions body -> Conversation.

    `strict` (our issue): empty `messages` and unknown roles are 400s; with
    strict=False they are accepted like ds4 (unknown roles render nothing)."""
    body = body_object(body)
    th = Thinking()
    msgs = None
    schemas: list[str] = []
    aliases: dict = {}
    tool_choice_none = False
    model = DEFAULT_MODEL
    stop: list[str] = []
    for k, v in body.items():
        if k == "messages":
            msgs = message_list(v, _chat_message)
        elif k == "tools":
            schemas, aliases = parse_tools(v, json_style)
        elif k == "tool_choice":
            tool_choice_none = isinstance(v, str) and v == "none"
        elif k == "model":
            model = as_str(v)
        elif k in CHAT_THINKING_FIELDS:
            th.chat_field(k, v)
        elif k == "stop":
            stop = parse_stop(v)
    conv = Conversation(
        messages=require_messages(msgs, strict),
        tool_schemas=schemas,
        tools_active=not tool_choice_none,
        api="openai",
        stop=stop,
        tool_aliases=aliases,
    )
    return finish_conversation(conv, model, th, ctx)


# --- response (docs/http-api.md §3) -------------------------------------------------------


FINISH_REASONS = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "error": "error",
    "cancelled": "error",
}


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


class ChatAdapter:
    api = "chat"

    def __init__(self, info: RequestInfo, index: int = 0, last: bool = True):
        self.info = info
        self.tool_header_streamed = False
        self.index = index  # the choice this adapter prints (n > 1: one adapter per choice)
        self.last = last  # the last choice of the response: the usage chunk and [DONE] follow it

    def _chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        i = self.info
        choice = {"index": self.index, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return sse.data(
            {
                "id": i.id,
                "object": "chat.completion.chunk",
                "created": i.created,
                "model": i.model,
                "choices": [choice],
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

    def finish(self, fin: Finish, usage: Usage | None = None) -> list[bytes]:
        """The choice's last chunk (with the logprobs of all its tokens, when asked); after the
        last choice, the usage (of all of them) and [DONE]."""
        out = [self._chunk({}, finish_reason(fin), chat_logprobs(fin))]
        if not self.last:
            return out
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
                        "usage": usage_openai(usage or fin.usage),
                    }
                )
            )
        out.append(sse.DONE)
        return out

    # -- non-streaming ----------------------------------------------------------------
    def body(self, fin: Finish) -> bytes:
        return self.batch_body([fin])

    def batch_body(self, fins: list) -> bytes:
        """One choice per Finish, in order; usage summed over them (n > 1)."""
        i = self.info
        return body_bytes(
            {
                "id": i.id,
                "object": "chat.completion",
                "created": i.created,
                "model": i.model,
                "choices": [self._choice(k, f) for k, f in enumerate(fins)],
                "usage": usage_openai(total_usage(fins)),
            }
        )

    def _choice(self, index: int, fin: Finish) -> dict:
        content, reasoning, calls = parsed_parts(fin)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        choice = {"index": index, "message": msg, "finish_reason": finish_reason(fin)}
        if fin.logprobs is not None:
            choice["logprobs"] = chat_logprobs(fin)
        return choice
