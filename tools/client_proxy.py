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
* otherwise (the turn after the tool result, side requests): thinking off and
  a short stop (stop sequences on every printable ASCII character, so the
  random text ends at once with a normal finish, not a truncation).

Every request and response is logged as JSON lines in `--log`
(`{"seq", "path", "request", "rewritten", "status", "response"}`), which the
real-client tests read.  Usage:

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


def rewrite(api: str, body: Any, force: str | None) -> Any:
    """The request as forwarded (a new dict; non-dict bodies pass unchanged)."""
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
    body["stop_sequences" if api == "anthropic" else "stop"] = SHORT_STOP
    return body


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
        sent = raw
        if api is not None and request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict):
                sent = json.dumps(rewrite(api, body, self.force)).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        record = {
            "seq": self.seq,
            "method": request.method,
            "path": request.path,
            "request": body,
            "rewritten": json.loads(sent) if body is not None else None,
        }
        out = bytearray()
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.request(
                request.method,
                self.upstream + request.path_qs,
                headers=headers,
                data=sent or None,
                allow_redirects=False,
            ) as up:
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in HOP:
                        resp.headers[k] = v
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    out += chunk
                    await resp.write(chunk)
                await resp.write_eof()
                record["status"] = up.status
        record["response"] = out.decode("utf-8", "replace")
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
