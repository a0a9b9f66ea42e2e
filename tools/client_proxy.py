"""A logging, request-rewriting reverse proxy for driving real clients' tool loops
against `ds4mlx serve` on the random-weight demo model (which never stops or
calls a tool by itself).

Every generation request (chat, Anthropic, Responses) is rewritten so that one
tool loop completes:

* while the conversation holds no tool result and the request offers the tool
  `--force NAME`: thinking off, `tool_choice` forces NAME and its parameters
  are hidden from the model (NAME must have no required parameters: the client
  then gets `{}`, which it accepts; the server writes a call of a tool without
  parameters whole);
* otherwise (the turn after the tool result, side requests): thinking off,
  greedy decoding and a short stop, so the random text ends at once with a
  normal finish, not a truncation: the proxy first asks the server for the
  answer's first token (the same request, not streamed, `max_tokens` 1) and
  then stops on every printable ASCII character that token does not hold, so
  the answer is never empty (Claude Code fails a turn whose answer is empty).
  The answer is passed on whole once it holds text; an empty one (the probe
  moved the server's cache state) is asked again, up to SHORT_TRIES times.

Every request and response is logged as JSON lines in `--log`
(`{"seq", "path", "request", "rewritten", "status", "response"}`, and `probe`
for a short answer's first-token request), which the real-client tests read.  Usage:

    python tools/client_proxy.py --port 18202 --upstream http://127.0.0.1:18201 \\
        --force TaskList --log proxy.jsonl
"""

from __future__ import annotations

import argparse
import json
import string
from typing import Any

import aiohttp
from aiohttp import web

GENERATION = {"/v1/messages": "anthropic", "/v1/chat/completions": "chat", "/v1/responses": "responses"}
SHORT_STOP = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
SHORT_TRIES = 3
STOP_FIELD = {"anthropic": "stop_sequences", "chat": "stop", "responses": "stop"}
HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-encoding",
}


def has_tool_result(api: str, body: dict) -> bool:
    if api == "anthropic":
        return any(
            isinstance(m, dict)
            and isinstance(m.get("content"), list)
            and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in m["content"])
            for m in body.get("messages") or []
        )
    if api == "chat":
        return any(isinstance(m, dict) and m.get("role") == "tool" for m in body.get("messages") or [])
    items = body.get("input")
    return isinstance(items, list) and any(
        isinstance(i, dict) and i.get("type") == "function_call_output" for i in items
    )


def _tool(api: str, body: dict, name: str) -> dict | None:
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if api == "chat" and isinstance(t.get("function"), dict) else t
        if fn.get("name") == name:
            return fn
    return None


def _thinking_off(api: str, body: dict) -> None:
    body.pop("output_config", None)
    if api == "anthropic":
        body["thinking"] = {"type": "disabled"}
    elif api == "chat":
        body["reasoning_effort"] = "none"
    else:
        body["reasoning"] = {"effort": "none"}


def rewrite(api: str, body: Any, force: str | None, first_text: str = "") -> Any:
    """The request as forwarded (a new dict; non-dict bodies pass unchanged).  A short
    answer stops on no character of `first_text` (its greedy first token)."""
    if not isinstance(body, dict):
        return body
    body = json.loads(json.dumps(body))
    _thinking_off(api, body)
    tool = _tool(api, body, force) if force else None
    if tool is not None and not has_tool_result(api, body):
        key = "input_schema" if api == "anthropic" else "parameters"
        tool[key] = {"type": "object", "properties": {}}
        if api == "anthropic":
            body["tool_choice"] = {"type": "tool", "name": force}
        elif api == "chat":
            body["tool_choice"] = {"type": "function", "function": {"name": force}}
        else:
            body["tool_choice"] = {"type": "function", "name": force}
        return body
    body["temperature"] = 0
    body[STOP_FIELD[api]] = [c for c in SHORT_STOP if c not in first_text]
    return body


def probe(api: str, body: dict) -> dict:
    """A short answer's request cut to its first token: not streamed, no stop."""
    body = {k: v for k, v in body.items() if k not in (STOP_FIELD[api], "stream", "max_completion_tokens")}
    body["max_output_tokens" if api == "responses" else "max_tokens"] = 1
    return body


def answer_text(api: str, response: str) -> str:
    """The answer text of a response body, streamed (SSE) or not."""
    try:
        events = [json.loads(response)]
    except ValueError:
        events = []
        for line in response.splitlines():
            if line.startswith("data: ") and line[6:].strip() != "[DONE]":
                try:
                    events.append(json.loads(line[6:]))
                except ValueError:
                    pass
    out = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if api == "anthropic":
            blocks = ev.get("content") or [ev.get("delta") or {}]
        elif api == "chat":
            blocks = [
                {"text": (c.get("message") or c.get("delta") or {}).get("content")} for c in ev.get("choices") or []
            ]
        elif ev.get("type") == "response.output_text.delta":
            blocks = [{"text": ev.get("delta")}]
        else:
            blocks = [p for item in ev.get("output") or [] if isinstance(item, dict) for p in item.get("content") or []]
        out += [str(b.get("text") or "") for b in blocks if isinstance(b, dict)]
    return "".join(out)


class Proxy:
    def __init__(self, upstream: str, force: str | None, log_path: str | None):
        self.upstream = upstream.rstrip("/")
        self.force = force
        self.log_path = log_path
        self.seq = 0

    def _log(self, record: dict) -> None:
        if self.log_path:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seq += 1
        raw = await request.read()
        api = GENERATION.get(request.path)
        body: Any = None
        if api is not None and request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        url = self.upstream + request.path_qs
        record: dict = {"seq": self.seq, "method": request.method, "path": request.path, "request": body}
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            rewritten = rewrite(api, body, self.force) if isinstance(body, dict) else None
            if rewritten is not None and STOP_FIELD[api] in rewritten:
                return await self._short_answer(s, request, url, headers, api, body, record)
            sent = json.dumps(rewritten).encode() if rewritten is not None else raw
            record["rewritten"] = rewritten
            out = bytearray()
            async with s.request(request.method, url, headers=headers, data=sent or None, allow_redirects=False) as up:
                resp = await self._start(request, up)
                async for chunk in up.content.iter_any():
                    out += chunk
                    await resp.write(chunk)
                await resp.write_eof()
                record["status"] = up.status
        record["response"] = out.decode("utf-8", "replace")
        self._log(record)
        return resp

    @staticmethod
    async def _start(request: web.Request, up: aiohttp.ClientResponse) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, reason=up.reason)
        for k, v in up.headers.items():
            if k.lower() not in HOP:
                resp.headers[k] = v
        await resp.prepare(request)
        return resp

    async def _short_answer(self, s, request, url, headers, api, body, record) -> web.StreamResponse:
        """Probe the first token, ask for the short answer and pass it on once it holds
        text.  The probe and the answer can be served from different cache states (the
        probe moves the server's live session), so an empty answer is asked again, a
        few times at most; every try is logged."""
        record["tries"] = []
        for _ in range(SHORT_TRIES):
            first = probe(api, rewrite(api, body, self.force))
            async with s.post(url, headers=headers, json=first) as up:
                probed = await up.text()
            rewritten = rewrite(api, body, self.force, answer_text(api, probed))
            up = await s.post(url, headers=headers, json=rewritten)
            data = await up.read()
            text = data.decode("utf-8", "replace")
            record["tries"].append({"probe": first, "probe_response": probed, "rewritten": rewritten})
            if up.status != 200 or answer_text(api, text):
                break
            up.release()
        record.update(rewritten=rewritten, status=up.status, response=text)
        resp = await self._start(request, up)
        await resp.write(data)
        await resp.write_eof()
        up.release()
        self._log(record)
        return resp


def make_app(upstream: str, force: str | None, log_path: str | None) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", Proxy(upstream, force, log_path).handle)
    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=18202)
    p.add_argument("--upstream", default="http://127.0.0.1:18201")
    p.add_argument("--force", default=None, help="tool to force while no tool result is in the conversation")
    p.add_argument("--log", default=None, help="append one JSON line per request")
    a = p.parse_args(argv)
    web.run_app(
        make_app(a.upstream, a.force, a.log), host="127.0.0.1", port=a.port, print=lambda *x: print(*x, flush=True)
    )


if __name__ == "__main__":
    main()
