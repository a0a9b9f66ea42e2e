"""OpenAI Responses, both directions: the request body -> `Conversation`
(docs/chat-template.md §2.3) and engine events -> wire shapes (docs/http-api.md §6).

Streaming: reasoning (only with `reasoning.summary` opted in) and message text
stream live; tool calls are sent whole after generation; every event carries
`sequence_number`; the terminal event is `response.completed`,
`response.incomplete` (length) or `response.failed` (error).
"""

from __future__ import annotations

import os
from typing import Any

from ..chat import images as chat_images
from ..chat import markers as M
from ..chat.jsontext import dumps_compact, json_text
from ..chat.messages import Conversation, Message, ToolCall
from ..chat.requests import (
    DEFAULT_MODEL,
    ImagePartError,
    RequestError,
    Thinking,
    add_id,
    as_str,
    body_object,
    check_image_role,
    check_role,
    finish_conversation,
    image_marker,
    invalid_json,
    parse_stop,
    parse_tools,
)
from ..runtime.events import Finish, ReasoningDelta, Started, TextDelta, Usage
from . import sse
from .common import RequestInfo, body_bytes, parsed_parts
from .errors import GENERATION_FAILED

# --- request (docs/chat-template.md §2.3) -------------------------------------------------

_SUMMARY_OPT_IN = ("auto", "concise", "detailed")
_ITEM_STATUSES = ("completed", "incomplete")  # what the server emits
_RESPONSES_TEXT_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_HOSTED_CALLS = {
    "local_shell_call": "local_shell",
    "web_search_call": "web_search_call",
    "tool_search_call": "tool_search",
    "image_generation_call": "image_generation_call",
}
_HOSTED_OUTPUTS = (
    "local_shell_call_output",
    "web_search_call_output",
    "tool_search_output",
    "tool_search_call_output",
    "image_generation_call_output",
)


def _responses_content(v: Any, images: list | None = None) -> str:
    """Strict Responses content (docs/chat-template.md §2.3); an `input_image` part
    becomes its marker, the image appended to `images` (refused where `images` is None)."""
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    if not isinstance(v, list):
        raise invalid_json()
    parts = []
    for e in v:
        if isinstance(e, str):
            parts.append(e)
            continue
        if not isinstance(e, dict):
            raise invalid_json()
        typ = e.get("type")
        if typ is not None and not isinstance(typ, str):
            raise invalid_json()
        if typ in ("input_image", "image_url"):
            parts.append(image_marker(e, images))
            continue
        if typ not in _RESPONSES_TEXT_TYPES or "text" not in e:
            raise invalid_json()
        text = e["text"]
        parts.append("" if text is None else as_str(text))
    return "".join(parts)


def _assistant_for_call(msgs: list[Message], pending: list[str]) -> Message:
    last = msgs[-1] if msgs else None
    if last is not None and last.role == "assistant":
        if pending and not last.reasoning:
            last.reasoning = "\n".join(pending)
            pending.clear()
        return last
    m = Message(role="assistant", content="")
    if pending:
        m.reasoning = "\n".join(pending)
        pending.clear()
    msgs.append(m)
    return m


def _responses_input(items: list, style: str, loaded: list[str], aliases: dict, strict: bool) -> list[Message]:
    msgs: list[Message] = []
    pending: list[str] = []
    for n, item in enumerate(items):
        try:
            if not isinstance(item, dict):
                raise invalid_json()
            f: dict[str, Any] = {}
            images: list = []  # a message's or a tool output's images
            for k, v in item.items():
                if k in ("type", "role", "name", "namespace", "call_id", "id", "status"):
                    f[k] = as_str(v)
                elif k == "content":
                    f[k] = _responses_content(v, images)
                elif k == "summary":
                    f[k] = _responses_content(v)
                elif k in ("arguments", "input", "action"):
                    f[k] = v if isinstance(v, str) and k != "action" else dumps_compact(v)
                elif k == "output":
                    if isinstance(v, list):
                        f[k] = _responses_content(v, images)
                    else:
                        f[k] = v if isinstance(v, str) else json_text(v, style)
                elif k == "result":
                    f[k] = v if isinstance(v, str) else json_text(v, style)
                elif k == "tools":
                    f[k] = v
            t = f.get("type", "message")
            if images and t != "message" and t not in ("function_call_output", "custom_tool_call_output"):
                raise RequestError(chat_images.ERR_ROLE)  # never dropped with the item's other text
            status = f.get("status")
            if status and status not in _ITEM_STATUSES:  # the server's own items replay as they were emitted
                raise invalid_json()
            consumes = (
                (t == "message" and f.get("role") == "assistant")
                or t in ("function_call", "custom_tool_call")
                or t in _HOSTED_CALLS
            )
            bookkeeping = t in ("compaction", "context_compaction")
            if not consumes and not bookkeeping and pending:
                msgs.append(Message(role="assistant", content="", reasoning="\n".join(pending)))
                pending.clear()
            if t == "message":
                role = f.get("role", "user")
                m = Message(role=check_role(role) if strict else role, content=f.get("content", ""), images=images)
                check_image_role(m)
                if m.role == "assistant" and pending:
                    m.reasoning = "\n".join(pending)
                    pending.clear()
                msgs.append(m)
            elif t in ("function_call", "custom_tool_call") or t in _HOSTED_CALLS:
                cid = f.get("call_id", f.get("id", ""))
                if t in _HOSTED_CALLS:
                    name = _HOSTED_CALLS[t]
                    args = next((f[k] for k in ("action", "arguments", "input") if k in f), "{}")
                else:
                    name = f.get("name", "")
                    ns = f.get("namespace")
                    if t == "function_call" and ns and name:
                        name = ns + name
                    args = next((f[k] for k in ("arguments", "input") if k in f), "{}")
                _assistant_for_call(msgs, pending).tool_calls.append(ToolCall(id=cid, name=name, arguments=args))
            elif t == "reasoning":
                for key in ("summary", "content"):
                    if f.get(key):
                        pending.append(f[key])
            elif t in ("function_call_output", "custom_tool_call_output") or t in _HOSTED_OUTPUTS:
                m = Message(role="tool")
                if t in _HOSTED_OUTPUTS:
                    if t == "tool_search_output" and "tools" in f:
                        more, more_aliases = parse_tools(f["tools"], style)
                        loaded.extend(more)
                        aliases.update(more_aliases)
                    if "output" in f:
                        m.content = f["output"]
                    elif "result" in f:
                        m.content = f["result"]
                    elif "tools" in f:
                        m.content = json_text(f["tools"], style)
                else:
                    m.content = f.get("output", "")
                m.images = images
                add_id(m.tool_call_ids, f.get("call_id", f.get("id")))
                msgs.append(m)
            elif not bookkeeping:
                raise invalid_json()
        except ImagePartError as err:  # named by its item
            raise err.named(f"input[{n}]") from None
    if pending:
        msgs.append(Message(role="assistant", content="", reasoning="\n".join(pending)))
    return msgs


def parse_responses(body: Any, *, ctx: int = 32768, json_style: str = "canonical", strict: bool = True) -> Conversation:
    """POST /v1/responses body -> Conversation."""
    body = body_object(body)
    th = Thinking()
    msgs = None
    instructions = ""
    schemas: list[str] = []
    loaded: list[str] = []
    aliases: dict = {}
    loaded_aliases: dict = {}
    tool_choice_none = False
    model = DEFAULT_MODEL
    summary = False
    stop: list[str] = []
    for k, v in body.items():
        if k == "input":
            loaded, loaded_aliases = [], {}
            if isinstance(v, str):
                msgs = [Message(role="user", content=v)]
            elif isinstance(v, list):
                msgs = _responses_input(v, json_style, loaded, loaded_aliases, strict)
            else:
                raise invalid_json()
        elif k == "instructions":
            instructions = "" if v is None else as_str(v)
        elif k == "tools":
            schemas, aliases = parse_tools(v, json_style)
        elif k == "tool_choice":
            if isinstance(v, str):
                if v == "none":
                    tool_choice_none = True
                elif v not in ("auto", "required"):  # required: serve/prepare.py forces the call
                    raise RequestError(M.ERR_TOOL_CHOICE.format(value=v), param="tool_choice")
            elif isinstance(v, dict) and v.get("type") != "function":
                raise RequestError(M.ERR_FORCED_TOOL_CHOICE, param="tool_choice")
        elif k == "stop":  # not an OpenAI Responses field: a ds4mlx extension, as on chat
            stop = parse_stop(v)
        elif k == "model":
            model = as_str(v)
        elif k == "reasoning":
            if isinstance(v, dict):
                for rk, rv in v.items():
                    if rk == "effort":
                        if th.set_effort(rv, "reasoning.effort"):
                            th.explicit = True
                            if th.effort == "none":
                                th.enabled = False
                    elif rk == "summary":
                        if isinstance(rv, str) and rv in _SUMMARY_OPT_IN:
                            summary = True
        elif k in ("previous_response_id", "conversation"):
            if v is not None:
                raise RequestError(M.ERR_DURABLE_STATE.format(field=k), param=k)
    if msgs is None:
        raise RequestError(M.ERR_MISSING_INPUT, param="input")
    if instructions:
        msgs.insert(0, Message(role="system", content=instructions))
    all_aliases = dict(aliases)
    all_aliases.update(loaded_aliases)
    conv = Conversation(
        messages=msgs,
        tool_schemas=schemas + loaded,
        tools_active=not tool_choice_none,
        api="responses",
        tool_aliases=all_aliases,
        reasoning_summary=summary,
        stop=stop,
    )
    return finish_conversation(conv, model, th, ctx)


# --- response (docs/http-api.md §6) -------------------------------------------------------


def _hex_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def usage_responses(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.written_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _status(reason: str) -> str:
    return "incomplete" if reason == "length" else "failed" if reason in ("error", "cancelled") else "completed"


def _item_status(reason: str) -> str:
    return "incomplete" if reason in ("length", "error", "cancelled") else "completed"


class ResponsesAdapter:
    api = "responses"

    def __init__(self, info: RequestInfo):
        self.info = info
        self.resp_id = info.id  # the id the server's trace records too
        self.seq = 0
        self.outputs: list[dict] = []  # streamed items in output order
        self.rs: dict | None = None  # reasoning item being streamed
        self.msg: dict | None = None  # message item being streamed
        self.reasoning = ""
        self.text = ""

    def _ev(self, typ: str, **fields) -> bytes:
        obj = {"type": typ, "sequence_number": self.seq}
        obj.update(fields)
        self.seq += 1
        return sse.event(typ, obj)  # Responses streams name every event (`event:` lines)

    def _response(self, status: str, output: list, reason: str | None, usage: Usage | None) -> dict:
        i = self.info
        r: dict[str, Any] = {
            "id": self.resp_id,
            "object": "response",
            "created_at": i.created,
            "status": status,
            "model": i.model,
        }
        if reason == "length":
            r["incomplete_details"] = {"reason": "max_tokens"}
        elif reason in ("error", "cancelled"):
            r["error"] = {"code": "server_error", "message": GENERATION_FAILED}
        r["output"] = output
        if usage is not None:
            r["usage"] = usage_responses(usage)
        return r

    def _call_items(self, calls, status: str) -> list[dict]:
        items = []
        for c in calls:
            alias = self.info.tool_aliases.get(c.name)
            fc_id = _hex_id("fc_")
            if alias is not None and alias.hosted_tool_search:
                from ..chat.jsontext import call_input

                items.append(
                    {
                        "id": fc_id,
                        "type": "tool_search_call",
                        "status": status,
                        "call_id": c.id,
                        "execution": "client",
                        "arguments": call_input(c.arguments),
                    }
                )
                continue
            item: dict[str, Any] = {
                "id": fc_id,
                "type": "function_call",
                "status": status,
                "name": alias.name if alias is not None else c.name,
            }
            if alias is not None and alias.namespace:
                item["namespace"] = alias.namespace
            item["call_id"] = c.id
            item["arguments"] = c.arguments
            items.append(item)
        return items

    # -- streaming ----------------------------------------------------------------
    def start(self, started: Started) -> list[bytes]:
        return [self._ev("response.created", response=self._response("in_progress", [], None, None))]

    def event(self, ev) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(ev, ReasoningDelta) and ev.text and self.info.reasoning_summary:
            if self.rs is None:
                self.rs = {"id": _hex_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": []}
                self.rs_index = len(self.outputs)
                self.outputs.append(self.rs)
                out.append(self._ev("response.output_item.added", output_index=self.rs_index, item=dict(self.rs)))
                out.append(
                    self._ev(
                        "response.reasoning_summary_part.added",
                        item_id=self.rs["id"],
                        output_index=self.rs_index,
                        summary_index=0,
                        part={"type": "summary_text", "text": ""},
                    )
                )
            self.reasoning += ev.text
            out.append(
                self._ev(
                    "response.reasoning_summary_text.delta",
                    item_id=self.rs["id"],
                    output_index=self.rs_index,
                    summary_index=0,
                    delta=ev.text,
                )
            )
        elif isinstance(ev, TextDelta) and ev.text:
            if self.msg is None:
                self.msg = {
                    "id": _hex_id("msg_"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                self.msg_index = len(self.outputs)
                self.outputs.append(self.msg)
                out.append(self._ev("response.output_item.added", output_index=self.msg_index, item=dict(self.msg)))
                out.append(
                    self._ev(
                        "response.content_part.added",
                        item_id=self.msg["id"],
                        output_index=self.msg_index,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": []},
                    )
                )
            self.text += ev.text
            out.append(
                self._ev(
                    "response.output_text.delta",
                    item_id=self.msg["id"],
                    output_index=self.msg_index,
                    content_index=0,
                    delta=ev.text,
                )
            )
        return out

    def finish(self, fin: Finish) -> list[bytes]:
        out: list[bytes] = []
        reason = fin.reason
        _, parsed_reasoning, calls = parsed_parts(fin)
        istatus = _item_status(reason)
        final_items: list[dict] = []
        if self.rs is not None:
            part = {"type": "summary_text", "text": self.reasoning}
            closed = parsed_reasoning is not None
            self.rs.update(status="completed" if closed else "incomplete", summary=[part])
            out.append(
                self._ev(
                    "response.reasoning_summary_text.done",
                    item_id=self.rs["id"],
                    output_index=self.rs_index,
                    summary_index=0,
                    text=self.reasoning,
                )
            )
            out.append(
                self._ev(
                    "response.reasoning_summary_part.done",
                    item_id=self.rs["id"],
                    output_index=self.rs_index,
                    summary_index=0,
                    part=part,
                )
            )
            out.append(self._ev("response.output_item.done", output_index=self.rs_index, item=self.rs))
        if self.msg is not None:
            part = {"type": "output_text", "text": self.text, "annotations": []}
            self.msg.update(status=istatus, content=[part])
            out.append(
                self._ev(
                    "response.output_text.done",
                    item_id=self.msg["id"],
                    output_index=self.msg_index,
                    content_index=0,
                    text=self.text,
                )
            )
            out.append(
                self._ev(
                    "response.content_part.done",
                    item_id=self.msg["id"],
                    output_index=self.msg_index,
                    content_index=0,
                    part=part,
                )
            )
            out.append(self._ev("response.output_item.done", output_index=self.msg_index, item=self.msg))
        final_items.extend(self.outputs)
        for item in self._call_items(calls, istatus):
            idx = len(final_items)
            final_items.append(item)
            added = dict(item, status="in_progress")
            if item["type"] == "function_call":
                added["arguments"] = ""
            out.append(self._ev("response.output_item.added", output_index=idx, item=added))
            if item["type"] == "function_call":
                out.append(
                    self._ev(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=idx,
                        delta=item["arguments"],
                    )
                )
                done: dict[str, Any] = {"item_id": item["id"], "output_index": idx, "name": item["name"]}
                if "namespace" in item:
                    done["namespace"] = item["namespace"]
                done["arguments"] = item["arguments"]
                out.append(self._ev("response.function_call_arguments.done", **done))
            out.append(self._ev("response.output_item.done", output_index=idx, item=item))
        status = _status(reason)
        terminal = {
            "completed": "response.completed",
            "incomplete": "response.incomplete",
            "failed": "response.failed",
        }[status]
        out.append(self._ev(terminal, response=self._response(status, final_items, reason, fin.usage)))
        return out

    # -- non-streaming ----------------------------------------------------------------
    def body(self, fin: Finish) -> bytes:
        content, reasoning, calls = parsed_parts(fin)
        istatus = _item_status(fin.reason)
        output: list[dict] = []
        if reasoning and self.info.reasoning_summary:
            output.append(
                {
                    "id": _hex_id("rs_"),
                    "type": "reasoning",
                    "status": istatus,
                    "summary": [{"type": "summary_text", "text": reasoning}],
                }
            )
        if content:
            output.append(
                {
                    "id": _hex_id("msg_"),
                    "type": "message",
                    "status": istatus,
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": content, "annotations": []}],
                }
            )
        output += self._call_items(calls, istatus)
        return body_bytes(self._response(_status(fin.reason), output, fin.reason, fin.usage), newline=False)
