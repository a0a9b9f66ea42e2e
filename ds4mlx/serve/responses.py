"""OpenAI Responses: engine events -> wire shapes (docs/http-api.md §6).

Streaming: reasoning (only with `reasoning.summary` opted in) and message text
stream live; tool calls are sent whole after generation; every event carries
`sequence_number`; the terminal event is `response.completed`,
`response.incomplete` (length) or `response.failed` (error).
"""

from __future__ import annotations

import os
from typing import Any

from ..events import Finish, ReasoningDelta, Started, TextDelta, Usage
from . import sse
from .errors import GENERATION_FAILED
from .openai import RequestInfo, body_bytes, parsed_parts


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
        self.resp_id = _hex_id("resp_")
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
                from ..chat.families.deepseek_v4.dsml import call_input

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
