"""The OpenAI chat-completions wire format as eval reads it: SSE `data:` lines, a
whole `chat.completion` body (servers that ignore `stream: true`), and error bodies
turned into one short line (a JSON error's message, or an HTML page's text)."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from typing import Any

ERROR_CHARS = 200
_TAG = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.S | re.I)


def short_error(body: str, limit: int = ERROR_CHARS) -> str:
    """One line for an error body: `error.message` of a JSON body, else the text
    of the body with HTML tags and runs of whitespace removed."""
    text = body.strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)
        msg = err.get("message") or err.get("detail") if isinstance(err, dict) else err
        if msg:
            text = str(msg)
    else:
        text = html.unescape(_TAG.sub(" ", text))
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sse_data(buf: bytearray) -> Iterator[bytes]:
    """Pop the complete `data:` payloads from `buf` (an SSE byte buffer)."""
    while True:
        nl = buf.find(b"\n")
        if nl < 0:
            return
        line = bytes(buf[:nl]).strip()
        del buf[: nl + 1]
        if line.startswith(b"data:"):
            yield line[5:].strip()


def message_of(body: Any) -> tuple[str, str, str | None] | None:
    """(reasoning, content, finish_reason) of a non-streamed `chat.completion`
    body, or None when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        return None
    choice = body["choices"][0]
    msg = choice.get("message") or choice.get("delta") or {}
    if not isinstance(msg, dict):
        return None
    reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
    return str(reasoning), str(msg.get("content") or ""), choice.get("finish_reason")


def usage_of(body: Any) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
