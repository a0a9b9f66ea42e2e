"""JSON output, Server-Sent Events and NDJSON framing (docs/http-api.md §1.1, §1.3, §9).

`dumps` writes compact JSON with raw UTF-8 and ds4's escapes (`\\b`/`\\f` as
`\\u0008`/`\\u000c`).  `SSEStream` owns one streaming response: it sends the
headers lazily (on the first keepalive or event), reports write failures as
`closed` instead of raising, and counts keepalive comments (tests use that).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

KEEPALIVE = b": prefill\n\n"


def queued_comment(position: int) -> bytes:
    """The keepalive of a stream whose job still waits (1 = next to run)."""
    return b": queued %d\n\n" % position


DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    if "\\b" in s or "\\f" in s:
        # json.dumps writes \b and \f; ds4 writes \u0008 and \u000c.  Only
        # replace real escapes (an escaped backslash followed by b stays).
        out = []
        i = 0
        while i < len(s):
            c = s[i]
            if c == "\\" and i + 1 < len(s):
                nxt = s[i + 1]
                out.append({"b": "\\u0008", "f": "\\u000c"}.get(nxt, c + nxt))
                i += 2
                continue
            out.append(c)
            i += 1
        s = "".join(out)
    return s


def encode(obj: Any) -> bytes:
    return dumps(obj).encode("utf-8", "replace")


def data(obj: Any) -> bytes:
    return b"data: " + encode(obj) + b"\n\n"


def event(name: str, obj: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + encode(obj) + b"\n\n"


# X-Accel-Buffering: nginx buffers proxied responses unless told not to; a stream must go
# out as it is written (docs/http-api.md §9.2)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def ndjson(obj: Any) -> bytes:
    """One line of a newline-delimited JSON stream (the Ollama API's streams)."""
    return encode(obj) + b"\n"


class SSEStream:
    base_headers = SSE_HEADERS

    def __init__(self, request: web.Request, headers: dict | None = None):
        self.request = request
        self.response = web.StreamResponse(status=200, headers={**self.base_headers, **(headers or {})})
        self.started = False
        self.closed = False
        self.keepalives = 0
        self.events = 0

    async def start(self) -> bool:
        if self.closed:
            return False
        if not self.started:
            self.started = True
            try:
                await self.response.prepare(self.request)
            except (ConnectionError, RuntimeError, OSError):
                self.closed = True
                return False
        return True

    async def write(self, chunk: bytes) -> bool:
        if not chunk:
            return not self.closed
        if not await self.start():
            return False
        try:
            await self.response.write(chunk)
            self.events += 1
            return True
        except (ConnectionError, RuntimeError, OSError):
            self.closed = True
            return False

    async def write_all(self, chunks) -> bool:
        for c in chunks:
            if not await self.write(c):
                return False
        return True

    async def keepalive(self, comment: bytes = KEEPALIVE) -> bool:
        ok = await self.write(comment)
        if ok:
            self.keepalives += 1
        return ok

    async def end(self) -> None:
        if self.closed or not self.started:
            return
        try:
            await self.response.write_eof()
        except (ConnectionError, RuntimeError, OSError):
            self.closed = True


class NDJSONStream(SSEStream):
    """A newline-delimited JSON stream: the same lazy start and write-failure tracking,
    but no comment lines exist in the format, so keepalives only send the headers."""

    base_headers = NDJSON_HEADERS

    async def keepalive(self, comment: bytes = KEEPALIVE) -> bool:
        return await self.start()
