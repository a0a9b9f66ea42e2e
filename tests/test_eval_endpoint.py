"""`ds4mlx eval --endpoint URL` against a live OpenAI-compatible server on 127.0.0.1.

`ds4mlx serve` is not available yet, so the server here is a small aiohttp stub that
speaks the chat-completions SSE wire format of http-api.md §3 (role chunk,
`reasoning_content` deltas, `content` deltas, finish chunk, usage chunk, [DONE]).
TODO: switch `live_server` to the real `ds4mlx serve` on the demo model once it lands.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from ds4mlx.cli.commands import main
from ds4mlx.eval import load_cases
from ds4mlx.eval.backends import Control, EndpointBackend, GenJob
from ds4mlx.eval.prompts import SYSTEM_PROMPT, build_prompt, user_prompt
from ds4mlx.eval.trace import parse_trace

CORE = load_cases("core")


class Stub:
    """OpenAI-compatible chat server; answers B for the first GPQA case, C otherwise."""

    def __init__(self):
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.fail_status = 0
        self.reasoning = ["Let me ", "think about ", "time dilation."]
        self.delay = 0.0
        self.mode = "sse"  # sse | json (ignores stream) | cut (ends mid-answer) | abort (drops the connection)
        self.fail_body = None  # with fail_status: a raw text/html body instead of the JSON error

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_status and self.fail_body is not None:
            return web.Response(text=self.fail_body, status=self.fail_status, content_type="text/html")
        if self.fail_status:
            return web.json_response({"error": {"message": "prompt exceeds context"}}, status=self.fail_status)
        assert body["stream"] is True
        user = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        answer = "B" if "Magellanic" in user else "C"
        if self.mode == "json":  # a server that ignores stream: true
            return web.json_response(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {
                                "role": "assistant",
                                "reasoning_content": "".join(self.reasoning),
                                "content": f"\n\nAnswer: {answer}",
                            },
                        }
                    ],
                    "usage": {"prompt_tokens": 321, "completion_tokens": 9, "total_tokens": 330},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta, finish=None):
            return {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        events = [chunk({"role": "assistant"})]
        thinking = body.get("think", True) is not False
        last = body["messages"][-1]
        if last["role"] == "assistant" and last.get("prefix"):  # a continuation: the answer only
            thinking = False
        if thinking:
            events += [chunk({"reasoning_content": r}) for r in self.reasoning]
        events += [chunk({"content": "\n\nAnswer: "}), chunk({"content": answer}), chunk({}, "stop")]
        if body.get("stream_options", {}).get("include_usage"):
            events.append(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": body["model"],
                    "choices": [],
                    "usage": {"prompt_tokens": 321, "completion_tokens": 9, "total_tokens": 330},
                }
            )
        wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        if self.mode in ("cut", "abort"):  # cut inside the answer, before its finish chunk
            wire = wire[: wire.index(b'"content": "\\n\\nAnswer: "') + 60]
        for i in range(0, len(wire), 37):  # odd fragment sizes: lines split across writes
            await resp.write(wire[i : i + 37])
            await asyncio.sleep(self.delay)
        if self.mode == "abort":
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp


@pytest.fixture
def live_server():
    stub = Stub()
    app = web.Application()
    app.router.add_get("/v1/models", stub.models)
    app.router.add_post("/v1/chat/completions", stub.chat)
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    runner = web.AppRunner(app)
    ready = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}", stub
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def test_endpoint_eval_end_to_end(live_server, tmp_path, capsys):
    url, stub = live_server
    trace = tmp_path / "t.txt"
    rc = main(
        [
            "eval",
            "--endpoint",
            url,
            "--api-key",
            "sk-test",
            "--plain",
            "--case-id",
            "1",
            "--case-id",
            "2",
            "--trace",
            str(trace),
            "--seed",
            "7",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "ds4-eval: 2/2 passed" in out
    assert "context sized by the server" in err
    req = stub.requests[0]
    assert req["model"] == "stub-model"  # first entry of /v1/models
    assert req["messages"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_prompt(CORE[0])},
    ]
    assert req["max_tokens"] == 16000 and req["temperature"] == 0 and req["seed"] == 7
    assert req["stream_options"] == {"include_usage": True} and "think" not in req
    assert stub.headers[0]["Authorization"] == "Bearer sk-test"
    recs = parse_trace(trace.read_bytes())
    assert [r.status for r in recs] == ["PASSED", "PASSED"]
    assert recs[0].output == "Let me think about time dilation.</think>\n\nAnswer: B"
    assert recs[0].int_field("prompt_tokens") == 321 and recs[0].int_field("generated_tokens") == 9
    assert recs[0].fields["think_close"] == "natural"
    assert "  1 PASSED        321        9      330 B        B" in out
    # plain mode streams the reasoning, </think> and the answer
    assert "Let me think about time dilation.</think>\n\nAnswer: B\nPASSED got B expected B" in out


def test_endpoint_model_name_nothink_and_tokens(live_server, tmp_path, capsys):
    url, stub = live_server
    rc = main(
        [
            "eval",
            "--endpoint",
            url + "/v1",
            "-m",
            "deepseek-chat",
            "--plain",
            "--case-id",
            "1",
            "--nothink",
            "--tokens",
            "64",
        ]
    )
    out, _ = capsys.readouterr()
    assert rc == 0
    req = stub.requests[0]
    assert req["model"] == "deepseek-chat" and req["think"] is False and req["max_tokens"] == 64
    assert "Authorization" not in stub.headers[0]
    assert "PASSED got B expected B" in out


def test_endpoint_http_error_is_an_error_record(live_server, tmp_path, capsys):
    url, stub = live_server
    stub.fail_status = 500
    trace = tmp_path / "t.txt"
    rc = main(
        ["eval", "--endpoint", url, "-m", "x", "--plain", "--case-id", "1", "--case-id", "2", "--trace", str(trace)]
    )
    _, err = capsys.readouterr()
    assert rc == 1
    assert (
        f"ds4-eval: error in recNu3MXkvWUzHZr9: POST {url}/v1/chat/completions: HTTP 500: prompt exceeds context"
    ) in err
    assert [r.status for r in parse_trace(trace.read_bytes())] == ["ERROR"]


def test_endpoint_html_error_page_is_one_short_line_with_the_url(live_server, tmp_path, capsys):
    url, stub = live_server
    stub.fail_status = 502
    stub.fail_body = (
        "<html><head><title>502 Bad Gateway</title><style>body{color:red}</style></head><body>"
        "<h1>Bad Gateway</h1>" + "<p>upstream went away</p>" * 100 + "</body></html>"
    )
    rc = main(["eval", "--endpoint", url, "-m", "x", "--plain", "--case-id", "1"])
    out, err = capsys.readouterr()
    assert rc == 1
    line = next(x for x in err.splitlines() if x.startswith("ds4-eval: error in"))
    assert line.startswith(
        f"ds4-eval: error in recNu3MXkvWUzHZr9: POST {url}/v1/chat/completions: HTTP 502: "
        "502 Bad Gateway Bad Gateway upstream went away"
    )
    assert "<" not in line and "color:red" not in line and len(line) < 300
    assert f"  1 ERROR GPQA Diamond/recNu3MXkvWUzHZr9: POST {url}/v1/chat/completions: HTTP 502" in out


def test_endpoint_connection_refused_names_the_url(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nobody listens here
    url = f"http://127.0.0.1:{port}"
    trace = tmp_path / "t.txt"
    rc = main(["eval", "--endpoint", url, "-m", "x", "--plain", "--case-id", "1", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert rc == 1
    assert f"ds4-eval: error in recNu3MXkvWUzHZr9: POST {url}/v1/chat/completions: ClientConnectorError" in err
    assert f"  1 ERROR GPQA Diamond/recNu3MXkvWUzHZr9: POST {url}/v1/chat/completions: Client" in out
    rec = parse_trace(trace.read_bytes())[0]
    assert rec.status == "ERROR" and url in rec.fields["error"]


def test_endpoint_ignoring_stream_is_graded_from_the_json_body(live_server, tmp_path, capsys):
    url, stub = live_server
    stub.mode = "json"
    trace = tmp_path / "t.txt"
    rc = main(["eval", "--endpoint", url, "--plain", "--case-id", "1", "--case-id", "2", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    recs = parse_trace(trace.read_bytes())
    assert [(r.status, r.picked) for r in recs] == [("PASSED", "B"), ("PASSED", "C")]
    assert recs[0].output == "Let me think about time dilation.</think>\n\nAnswer: B"
    assert recs[0].int_field("generated_tokens") == 9 and recs[0].int_field("prompt_tokens") == 321
    assert "PASSED got B expected B" in out


@pytest.mark.parametrize("mode", ["cut", "abort"])
def test_endpoint_stream_cut_mid_answer_is_an_error_and_retried(live_server, tmp_path, capsys, mode):
    url, stub = live_server
    stub.mode = mode
    trace = tmp_path / "t.txt"
    rc = main(["eval", "--endpoint", url, "--plain", "--case-id", "1", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert rc == 1
    rec = parse_trace(trace.read_bytes())[0]
    assert rec.status == "ERROR" and rec.output.endswith("</think>\n\nAnswer: ")
    assert f"POST {url}/v1/chat/completions" in rec.fields["error"]
    assert "  1 ERROR " in out
    stub.mode = "sse"  # the server is fixed: --retry-incomplete reruns the cut case
    rc = main(["eval", "--endpoint", url, "--plain", "--case-id", "1", "--trace", str(trace), "--retry-incomplete"])
    capsys.readouterr()
    assert rc == 0
    assert [r.status for r in parse_trace(trace.read_bytes())] == ["ERROR", "PASSED"]


def test_endpoint_stop_mid_stream(live_server):
    url, stub = live_server
    stub.reasoning = [f"word{i} " for i in range(50)]
    stub.delay = 0.01
    backend = EndpointBackend(url, model="m")
    control = Control()
    seen: list[str] = []

    def on_text(t: str) -> None:
        seen.append(t)
        if len(seen) == 5:
            control.request_quit()

    res = backend.generate(GenJob(build_prompt(CORE[0]), 100, seed=0, control=control, on_text=on_text))
    assert res.finish == "stopped"
    assert res.raw.startswith("word0 word1 word2 word3 word4") and "</think>" not in res.raw


def test_endpoint_forced_think_close_by_continuation(live_server, tmp_path, capsys):
    url, stub = live_server
    stub.reasoning = [f"w{i} " for i in range(300)]  # would think past the budget
    trace = tmp_path / "t.txt"
    rc = main(
        [
            "eval",
            "--endpoint",
            url,
            "--plain",
            "--case-id",
            "1",
            "--tokens",
            "40",
            "--endpoint-continuation",
            "prefix",
            "--trace",
            str(trace),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert len(stub.requests) == 2
    first, second = stub.requests
    cap = 40 - 10  # hard budget 40 // 4
    thought = "".join(f"w{i} " for i in range(cap))
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": "", "reasoning_content": thought, "prefix": True}
    assert second["max_tokens"] == 40 - cap
    rec = parse_trace(trace.read_bytes())[0]
    assert rec.output == thought + "</think>\n\nAnswer: B" and rec.status == "PASSED"
    assert rec.fields["think_close"] == "hard_forced"
    assert rec.fields["think_close_token_index"] == str(cap + 1)
    assert rec.int_field("generated_tokens") == cap + 9  # the chunks kept + the continuation's usage
    header = trace.read_text().split("=====", 1)[0]
    assert "think_close_forcing: continuation request (prefix)" in header and "ctx: server" in header


def test_endpoint_without_continuation_forces_nothing_and_says_so(live_server, tmp_path, capsys):
    url, stub = live_server
    stub.reasoning = [f"w{i} " for i in range(60)]
    trace = tmp_path / "t.txt"
    rc = main(["eval", "--endpoint", url, "--plain", "--case-id", "1", "--tokens", "40", "--trace", str(trace)])
    capsys.readouterr()
    assert rc == 0 and len(stub.requests) == 1
    rec = parse_trace(trace.read_bytes())[0]
    assert rec.fields["think_close"] == "natural"
    assert "think_close_forcing: none (endpoint without continuation)" in trace.read_text()
    help_text = _help()
    assert "--endpoint-continuation" in help_text and "ctx: server" in help_text


def _help() -> str:
    import argparse

    from ds4mlx.eval.cli import add_arguments

    p = argparse.ArgumentParser(prog="ds4mlx eval")
    add_arguments(p)
    return " ".join(p.format_help().split())
