"""OpenAI legacy completions: raw generated text (docs/http-api.md §4)."""
from __future__ import annotations

from typing import Optional

from ..events import Finish, Started, TextDelta
from . import sse
from .openai import RequestInfo, body_bytes, finish_reason, usage_openai


class CompletionsAdapter:
    api = "completions"

    def __init__(self, info: RequestInfo):
        self.info = info

    def _chunk(self, text: str, finish: Optional[str]) -> bytes:
        i = self.info
        return sse.data({"id": i.id, "object": "text_completion", "created": i.created, "model": i.model,
                         "choices": [{"text": text, "index": 0, "finish_reason": finish}]})

    def start(self, started: Started) -> list[bytes]:
        return []

    def event(self, ev) -> list[bytes]:
        if isinstance(ev, TextDelta) and ev.text:
            return [self._chunk(ev.text, None)]
        return []

    def finish(self, fin: Finish) -> list[bytes]:
        out = [self._chunk("", finish_reason(fin))]
        if self.info.include_usage:
            i = self.info
            out.append(sse.data({"id": i.id, "object": "text_completion", "created": i.created, "model": i.model,
                                 "choices": [], "usage": usage_openai(fin.usage)}))
        out.append(sse.DONE)
        return out

    def body(self, fin: Finish) -> bytes:
        i = self.info
        return body_bytes({"id": i.id, "object": "text_completion", "created": i.created, "model": i.model,
                           "choices": [{"text": fin.raw_text, "index": 0, "finish_reason": finish_reason(fin)}],
                           "usage": usage_openai(fin.usage)})
