"""Raw HTTP against a live `ds4mlx serve` (aiohttp client, 127.0.0.1, random
port): SSE keepalive during a slowed prefill, cancellation on disconnect,
16 concurrent streams, error shapes, CORS, models, trace.  No timing
assertions: gates in the scripted model hold the worker while a test looks."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, last_user_text, serve  # noqa: E402

MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def echo(prompt: str) -> str:
    return ("ok.</think>" if prompt.endswith("<think>") else "") + "echo: " + last_user_text(prompt)


@pytest.fixture(scope="module")
def srv(tok):
    with serve(tok, ScriptedModel(tok, echo), ctx=512, tokens=64) as s:
        yield s


def parse_sse(raw: str) -> list[tuple[str, str]]:
    """SSE text -> [(kind, payload)], kind = 'comment' | event name | 'data'."""
    out = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        name = "data"
        for line in block.split("\n"):
            if line.startswith(":"):
                out.append(("comment", line[1:].strip()))
            elif line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append((name, line[len("data: ") :]))
    return out


async def post(url, path, body, **kw):
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        async with s.post(url + path, data=data, headers={"Content-Type": "application/json"}, **kw) as r:
            return r.status, dict(r.headers), await r.text()


def call(url, path, body, **kw):
    return asyncio.run(post(url, path, body, **kw))


# --------------------------------------------------------------------------- keepalive
def test_prefill_keepalive_comments(tok):
    model = ScriptedModel(tok, echo)
    with serve(tok, model, ctx=512, keepalive_s=0.01) as s:
        model.prefill_gate.close()

        async def go():
            async with aiohttp.ClientSession() as cs:
                async with cs.post(s.url + "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                    seen = b""
                    while seen.count(b": prefill\n\n") < 3:  # the worker is parked in prefill
                        seen += await r.content.readany()
                    assert model.prefill_calls == 0
                    model.prefill_gate.open()
                    seen += await r.content.read()
                    return seen.decode()

        raw = asyncio.run(go())
    ev = parse_sse(raw)
    first_data = next(i for i, e in enumerate(ev) if e[0] == "data")
    assert all(k == "comment" and v == "prefill" for k, v in ev[:first_data]) and first_data >= 3
    assert all(k != "comment" for k, _ in ev[first_data:])
    chunks = [json.loads(v) for k, v in ev if k == "data" and v != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"} and ev[-1] == ("data", "[DONE]")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "echo: Hi"


# --------------------------------------------------------------------------- cancellation
def test_stream_disconnect_stops_decoding_within_one_token(tok):
    model = ScriptedModel(tok, "one two three four five six seven eight nine ten eleven twelve")
    with serve(tok, model, ctx=512) as s:
        model.step_gate.close()
        model.step_gate.allow(2)

        async def go():
            async with aiohttp.ClientSession() as cs:
                r = await cs.post(
                    s.url + "/v1/chat/completions", json={"messages": MSG, "stream": True, "think": False}
                )
                got = b""
                while b'"content"' not in got:
                    got += await r.content.readany()
                assert model.step_gate.wait_for_waiters(1)  # the worker is parked in step 3
                r.close()  # drop the socket mid-stream

        asyncio.run(go())
        assert s.wait(lambda: s.engine.stats.cancel_requests >= 1)
        steps_at_cancel = model.steps
        model.step_gate.open()
        assert s.wait(lambda: s.engine.stats.cancelled >= 1 and s.idle())
        assert model.steps <= steps_at_cancel + 1
        assert len(model.prompts) == 1
        # the server keeps serving
        status, _, body = call(s.url, "/v1/chat/completions", {"messages": MSG, "think": False, "max_tokens": 2})
        assert status == 200


def test_non_streaming_disconnect_cancels(tok):
    model = ScriptedModel(tok, "a b c d e f g h")
    with serve(tok, model, ctx=512) as s:
        model.step_gate.close()

        async def go():
            async with aiohttp.ClientSession() as cs:
                with pytest.raises(asyncio.TimeoutError):
                    async with cs.post(
                        s.url + "/v1/messages",
                        json={"messages": MSG, "max_tokens": 50},
                        timeout=aiohttp.ClientTimeout(total=None, sock_read=0.2),
                    ) as r:
                        await r.read()

        model.step_gate.allow(1)
        asyncio.run(go())
        assert s.wait(lambda: s.engine.stats.cancel_requests >= 1)
        steps_at_cancel = model.steps
        model.step_gate.open()
        assert s.wait(lambda: s.engine.stats.cancelled >= 1 and s.idle())
        assert model.steps <= steps_at_cancel + 1


def test_disconnect_while_queued_cancels_before_prefill(tok):
    model = ScriptedModel(tok, "fine")
    with serve(tok, model, ctx=512) as s:
        model.prefill_gate.close()

        async def go():
            async with aiohttp.ClientSession() as cs:
                first = asyncio.ensure_future(cs.post(s.url + "/v1/chat/completions", json={"messages": MSG}))
                assert await asyncio.to_thread(model.prefill_gate.wait_for_waiters, 1)
                second = asyncio.ensure_future(
                    cs.post(s.url + "/v1/completions", json={"prompt": "queued", "stream": True})
                )
                assert await asyncio.to_thread(s.wait, lambda: s.engine.queue_depth == 1)
                second.cancel()  # the client gives up while its job waits in the queue
                with pytest.raises(asyncio.CancelledError):
                    await second
                assert await asyncio.to_thread(s.wait, lambda: s.engine.stats.cancel_requests >= 1)
                model.prefill_gate.open()
                r = await first
                assert r.status == 200
                await r.read()

        asyncio.run(go())
        assert s.wait(lambda: s.engine.stats.cancelled >= 1 and s.idle())
        assert model.prefill_calls == 1  # the queued job never reached the model


# --------------------------------------------------------------------------- concurrency
def test_sixteen_concurrent_streams(srv):
    apis = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]

    def body(path, i):
        text = f"client {i} says hi"
        if path == "/v1/completions":
            return {"prompt": text, "stream": True}
        if path == "/v1/responses":
            return {"input": text, "stream": True}
        return {"messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": 60}

    async def one(cs, i):
        path = apis[i % 4]
        async with cs.post(srv.url + path, json=body(path, i)) as r:
            assert r.status == 200
            return path, i, parse_sse(await r.text())

    async def go():
        async with aiohttp.ClientSession() as cs:
            return await asyncio.gather(*(one(cs, i) for i in range(16)))

    results = asyncio.run(go())
    for path, i, ev in results:
        ev = [(k, v) for k, v in ev if k != "comment"]  # `: queued N` / `: prefill` while others run
        want = f"echo: client {i} says hi"
        if path == "/v1/chat/completions":
            chunks = [json.loads(v) for k, v in ev if v != "[DONE]"]
            assert ev[-1] == ("data", "[DONE]") and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert len({c["id"] for c in chunks}) == 1
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
            assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
        elif path == "/v1/completions":
            chunks = [json.loads(v) for k, v in ev if v != "[DONE]"]
            assert ev[-1] == ("data", "[DONE]")
            assert "".join(c["choices"][0]["text"] for c in chunks) == "ok.</think>" + want
        elif path == "/v1/messages":
            names = [k for k, _ in ev]
            assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
            text = "".join(json.loads(v)["delta"].get("text", "") for k, v in ev if k == "content_block_delta")
            assert text == want
        else:
            objs = [json.loads(v) for _, v in ev]
            assert [o["sequence_number"] for o in objs] == list(range(len(objs)))
            assert objs[0]["type"] == "response.created" and objs[-1]["type"] == "response.completed"
            assert objs[-1]["response"]["output"][-1]["content"][0]["text"] == want
    assert srv.wait(srv.idle)


# --------------------------------------------------------------------------- errors
BAD_BODIES = [
    (b"{not json", 400, "invalid JSON request"),
    (b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}', 400, "invalid JSON request"),
    (b'{"messages":[{"role":"user","content":"x"}],"temperature":Infinity}', 400, "invalid JSON request"),
    (b'{"messages":[{"role":"user","content":"\\ud800"}]}', 400, "invalid JSON request"),
    (b'{"messages":[], "x":' + b"[" * 300 + b"]" * 300 + b"}", 400, "invalid JSON request"),
    (b"[1,2]", 400, "invalid JSON request"),
    (b'{"messages":"hi"}', 400, None),
    (
        b'{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}',
        400,
        "Invalid type for 'temperature': expected a number or null, but got a string instead.",
    ),
    (
        b'{"messages":[{"role":"user","content":"x"}],"max_tokens":"5"}',
        400,
        "Invalid type for 'max_tokens': expected an integer or null, but got a string instead.",
    ),
    (
        b'{"messages":[{"role":"user","content":"x"}],"stream":1}',
        400,
        "Invalid type for 'stream': expected a boolean or null, but got a number instead.",
    ),
    (b'{"messages":[]}', 400, "messages must not be empty"),
    (b'{"messages":[{"role":"wizard","content":"x"}]}', 400, "unknown role: wizard"),
    (b'{"model":"deepseek-v4-flash"}', 400, "missing messages"),
    (
        b'{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"extreme"}',
        400,
        "Invalid value for 'reasoning_effort'.",
    ),
]


@pytest.mark.parametrize("raw,status,message", BAD_BODIES)
def test_bad_input_openai_shape(srv, raw, status, message):
    st, headers, text = call(srv.url, "/v1/chat/completions", raw)
    assert st == status, text
    body = json.loads(text)
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    if message:
        assert body["error"]["message"] == message
    assert "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("raw,status,message", BAD_BODIES)
def test_bad_input_anthropic_shape(srv, raw, status, message):
    st, _, text = call(srv.url, "/v1/messages", raw)
    assert st == status, text
    body = json.loads(text)
    assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}
    assert body["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_oversize_body_is_413(tok):
    with serve(tok, ScriptedModel(tok, echo), ctx=512, max_body_mb=1) as s:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]})
        st, _, text = call(s.url, "/v1/chat/completions", big)
        assert st == 413 and json.loads(text)["error"]["message"] == "request body too large"
        st, _, text = call(s.url, "/v1/messages", big)
        assert st == 413 and json.loads(text)["error"]["type"] == "request_too_large"
        assert call(s.url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1})[0] == 200


def test_context_length_errors(tok):
    with serve(tok, ScriptedModel(tok, echo), ctx=16) as s:
        long = "word " * 40
        cases = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}, "messages"),
            ("/v1/completions", {"prompt": long}, "prompt"),
            ("/v1/responses", {"input": long}, "input"),
        ]
        for path, body, param in cases:
            st, _, text = call(s.url, path, body)
            err = json.loads(text)["error"]
            assert st == 400 and err["code"] == "context_length_exceeded" and err["param"] == param
            assert err["n_ctx"] == 16 and err["n_prompt_tokens"] > 16
            assert (
                err["message"] == f"Prompt has {err['n_prompt_tokens']} tokens, but the configured context "
                f"size is 16 tokens"
            )
        st, _, text = call(s.url, "/v1/messages", {"messages": [{"role": "user", "content": long}], "max_tokens": 5})
        body = json.loads(text)
        assert st == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert set(body["error"]) == {"type", "message", "n_prompt_tokens", "n_ctx"}


def test_context_boundary_prompt_equal_to_ctx_fails(tok):
    prompt_text = "<｜begin▁of▁sentence｜>You are a helpful assistant<｜User｜>hi<｜Assistant｜><think>"
    n = len(tok.encode(prompt_text))
    with serve(tok, ScriptedModel(tok, echo), ctx=n) as s:
        st, _, text = call(s.url, "/v1/completions", {"prompt": "hi"})
        assert st == 400 and json.loads(text)["error"]["n_prompt_tokens"] == n
    with serve(tok, ScriptedModel(tok, echo), ctx=n + 1) as s:
        st, _, text = call(s.url, "/v1/completions", {"prompt": "hi"})
        assert st == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"


def test_unknown_routes_and_methods(srv):
    async def go():
        async with aiohttp.ClientSession() as cs:
            out = []
            for method, path in [
                ("GET", "/v1/nope"),
                ("POST", "/chat/completions"),
                ("POST", "/v1/chat/completions/"),
                ("GET", "/v1/chat/completions"),
                ("DELETE", "/v1/models"),
            ]:
                async with cs.request(method, srv.url + path) as r:
                    out.append((r.status, await r.json()))
            return out

    for status, body in asyncio.run(go()):
        assert status in (404, 405) and body["error"]["message"] in ("unknown endpoint", "method not allowed")


def test_models_routes(srv):
    async def go():
        async with aiohttp.ClientSession() as cs:
            async with cs.get(srv.url + "/v1/models") as r:
                listing = (r.status, await r.json())
            async with cs.get(srv.url + "/v1/models/deepseek-v4-flash") as r:
                one = (r.status, await r.json())
            async with cs.get(srv.url + "/v1/models/other") as r:
                missing = r.status
            return listing, one, missing

    (st, listing), (st1, one), missing = asyncio.run(go())
    assert st == 200 and listing["object"] == "list" and listing["data"] == [one]
    assert st1 == 200 and one["id"] == "deepseek-v4-flash" and one["object"] == "model"
    assert one["context_length"] == 512 and one["top_provider"]["max_completion_tokens"] == 64
    assert missing == 200  # any name is served by the loaded model unless --strict-model (#17)


def test_cors_only_when_enabled(tok, srv):
    async def go(url):
        async with aiohttp.ClientSession() as cs:
            async with cs.options(url + "/v1/chat/completions") as r:
                opt = (r.status, dict(r.headers), await r.read())
            async with cs.post(
                url + "/v1/chat/completions", json={"messages": MSG, "stream": True, "max_tokens": 2}
            ) as r:
                sse_headers = dict(r.headers)
                await r.read()
            async with cs.post(url + "/v1/messages", data=b"{") as r:
                err_headers = dict(r.headers)
            return opt, sse_headers, err_headers

    (st, h, body), sse_h, err_h = asyncio.run(go(srv.url))
    assert st == 204 and body == b"" and "Access-Control-Allow-Origin" not in h
    assert "Access-Control-Allow-Origin" not in sse_h and "Access-Control-Allow-Origin" not in err_h
    with serve(tok, ScriptedModel(tok, echo), ctx=512, cors=True) as s:
        (st, h, body), sse_h, err_h = asyncio.run(go(s.url))
    for headers in (h, sse_h, err_h):
        assert headers["Access-Control-Allow-Origin"] == "*"
        assert headers["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
        assert headers["Access-Control-Allow-Headers"] == "*"
    assert st == 204


def test_trace_file_has_one_json_line_per_request(tok, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with serve(tok, ScriptedModel(tok, echo), ctx=512, trace=str(trace)) as s:
        call(s.url, "/v1/chat/completions", {"messages": MSG, "think": False})
        call(s.url, "/v1/completions", {"prompt": "yo", "stream": True})
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [x["route"] for x in lines] == ["/v1/chat/completions", "/v1/completions"]
    assert lines[0]["finish"] == "stop" and lines[0]["raw_text"] == "echo: Hi"
    assert lines[0]["prompt"].endswith("<｜Assistant｜></think>") and lines[0]["usage"]["completion_tokens"] > 0
    assert json.loads(lines[0]["response"])["choices"][0]["message"]["content"] == "echo: Hi"


def test_ignore_eos_exact_length(srv):
    st, _, text = call(
        srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    )
    body = json.loads(text)
    assert st == 200 and body["usage"]["completion_tokens"] == 9 and body["choices"][0]["finish_reason"] == "length"


def test_409_when_live_tool_state_vanishes(tok):
    dsml = 'ok.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    model = ScriptedModel(tok, lambda p: "done." if "<tool_result>" in p else dsml)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    with serve(tok, model, ctx=1024) as s:
        st, _, text = call(s.url, "/v1/responses", {"input": "go", "tools": tools})
        call_id = json.loads(text)["output"][-1]["call_id"]
        out = {"input": [{"type": "function_call_output", "call_id": call_id, "output": "r"}], "tools": tools}
        model.prefill_gate.close()

        replay = {
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": call_id, "output": "r"},
            ],
            "tools": tools,
        }

        async def go():
            async with aiohttp.ClientSession() as cs:
                # A full replay continues the live state first; its prefill is held at the gate, so
                # the live binding still stands while the tool-output-only request is validated.
                other = asyncio.ensure_future(cs.post(s.url + "/v1/responses", json=replay))
                assert await asyncio.to_thread(model.prefill_gate.wait_for_waiters, 1)
                cont = asyncio.ensure_future(cs.post(s.url + "/v1/responses", json=out))
                assert await asyncio.to_thread(s.wait, lambda: s.engine.queue_depth == 1)
                model.prefill_gate.open()  # the replay's turn replaces the binding
                r1, r2 = await other, await cont
                return r1.status, r2.status, await r2.json()

        s1, s2, body = asyncio.run(go())
        assert s1 == 200 and s2 == 409
        assert body["error"]["message"] == (
            "Responses continuation state is not available; retry by replaying the full input history"
        )
