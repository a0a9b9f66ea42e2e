"""`serve` as a service (docs/http-api.md §9): API keys on every API, TLS with the
openai SDK, --root-path, X-Accel-Buffering, GET /metrics read by prometheus_client's
own parser, /slots, /tokenize and /detokenize, and the Ollama API driven by the
`ollama` client.  One scripted-model server (with keys and a root path) serves
most tests; the TLS test starts its own."""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from lazy_modules import lazy  # noqa: E402
from scripted_model import ScriptedModel, last_user_text, serve  # noqa: E402

ollama = lazy("ollama")
openai = lazy("openai")
prom_parser = lazy("prometheus_client.parser")

KEY, KEY2 = "sk-test-one", "sk-test-two"
BEARER = {"Authorization": f"Bearer {KEY}"}
MODEL = "deepseek-v4-flash"
MSG = [{"role": "user", "content": "Hi"}]
BASH_DSML = (
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n'
    '<｜DSML｜parameter name="command" string="true">ls /tmp</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def generated(prompt: str) -> str:
    think = prompt.endswith("<think>")

    def r(text: str) -> str:
        return text + "</think>" if think else ""

    if "<tool_result>" in last_user_text(prompt):
        return r("Got the listing.") + "Two files: a.txt and b.txt."
    if "## Tools" in prompt:
        return r("Need ls.") + "Let me look." + BASH_DSML
    return r("Simple greeting.") + "Hello there!"


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


@pytest.fixture(scope="module")
def srv(tok):
    with serve(tok, ScriptedModel(tok, generated), ctx=4096, api_keys=(KEY, KEY2), root_path="/ds4/") as s:
        yield s


async def _request(method, url, body=None, headers=None):
    async with aiohttp.ClientSession() as cs:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        async with cs.request(method, url, data=data, headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.read()


def call(srv, method, path, body=None, headers=BEARER):
    return asyncio.run(_request(method, srv.url + path, body, headers))


def post_json(srv, path, body, headers=BEARER):
    st, h, raw = call(srv, "POST", path, body, headers)
    return st, h, json.loads(raw)


# --------------------------------------------------------------------------- auth
GENERATION_ROUTES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG}),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": MSG}),
    ("/v1/responses", {"model": MODEL, "input": "Hi"}),
    ("/api/chat", {"model": MODEL, "messages": MSG, "stream": False}),
    ("/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False}),
]
OTHER_ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("GET", "/slots"),
    ("GET", "/v1/ds4mlx/stats"),
    ("GET", "/api/tags"),
    ("GET", "/api/version"),
    ("GET", "/api/ps"),
]


def _error_message(path: str, doc: dict) -> str:
    if path == "/v1/messages":  # Anthropic's shape
        assert doc["type"] == "error" and doc["error"]["type"] == "authentication_error"
        return doc["error"]["message"]
    if path.startswith("/api/"):  # Ollama's
        assert isinstance(doc["error"], str)
        return doc["error"]
    assert doc["error"]["code"] == "invalid_api_key"  # OpenAI's (chat, completions, Responses)
    return doc["error"]["message"]


@pytest.mark.parametrize("path,body", GENERATION_ROUTES, ids=[p for p, _ in GENERATION_ROUTES])
def test_generation_routes_need_a_key(srv, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY + "x"}, {"Authorization": KEY}):
        st, h, doc = post_json(srv, path, body, headers)
        assert st == 401 and h["WWW-Authenticate"] == "Bearer"
        assert "API key" in _error_message(path, doc) and KEY not in json.dumps(doc)
    for headers in (BEARER, {"x-api-key": KEY2}, {"authorization": f"bearer {KEY2}"}):
        st, _, doc = post_json(srv, path, body, headers)
        assert st == 200, doc


@pytest.mark.parametrize("method,path", OTHER_ROUTES, ids=[p for _, p in OTHER_ROUTES])
def test_other_routes_need_a_key(srv, method, path):
    assert call(srv, method, path, headers={})[0] == 401
    assert call(srv, method, path)[0] == 200


def test_health_and_preflight_need_no_key(srv):
    assert call(srv, "GET", "/health", headers={})[0] == 200
    assert call(srv, "OPTIONS", "/v1/chat/completions", headers={})[0] == 204
    # the chat page and its files load without a key (the page asks for it), its API calls do not
    st, h, _ = call(srv, "GET", "/", headers={"Accept": "text/html"})
    assert st == 200 and h["Content-Type"].startswith("text/html")
    assert call(srv, "GET", "/ui/chat.js", headers={})[0] == 200
    assert call(srv, "GET", "/v1/ds4mlx/stats", headers={})[0] == 401


def test_root_path_prefix_and_plain_paths(srv):
    st, _, doc = post_json(srv, "/ds4/v1/chat/completions", {"messages": MSG})
    assert st == 200 and doc["choices"][0]["message"]["content"] == "Hello there!"
    st, _, raw = call(srv, "GET", "/ds4/v1/models?x=1")
    assert st == 200 and json.loads(raw)["data"][0]["id"] == MODEL
    st, _, doc = post_json(srv, "/ds4/v1/messages", b"{", headers=BEARER)  # the prefix keeps the API's shape
    assert st == 400 and doc["type"] == "error"
    assert call(srv, "GET", "/ds4x/v1/models")[0] == 404


def test_streams_ask_proxies_not_to_buffer(srv):
    st, h, raw = call(srv, "POST", "/v1/chat/completions", {"messages": MSG, "stream": True})
    assert st == 200 and h["X-Accel-Buffering"] == "no" and h["Content-Type"].startswith("text/event-stream")
    st, h, raw = call(srv, "POST", "/api/chat", {"model": MODEL, "messages": MSG})
    assert st == 200 and h["X-Accel-Buffering"] == "no" and h["Content-Type"].startswith("application/x-ndjson")


# --------------------------------------------------------------------------- metrics
def scrape(srv) -> dict:
    """{(sample name, frozenset(labels)): value} parsed by prometheus_client's parser."""
    st, h, raw = call(srv, "GET", "/metrics")
    assert st == 200 and h["Content-Type"].startswith("text/plain")
    out = {}
    for fam in prom_parser.text_string_to_metric_families(raw.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_by_the_known_amounts(srv):
    before = scrape(srv)
    st, _, doc = post_json(srv, "/v1/chat/completions", {"messages": MSG, "think": False})
    assert st == 200
    u1 = doc["usage"]
    history = MSG + [doc["choices"][0]["message"], {"role": "user", "content": "And again"}]
    st, _, doc = post_json(srv, "/v1/chat/completions", {"messages": history, "think": False})
    u2 = doc["usage"]
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0  # the second turn continued the live session
    assert post_json(srv, "/v1/chat/completions", {"messages": MSG}, headers={})[0] == 401
    after = scrape(srv)

    def delta(name, **labels):
        return val(after, name, **labels) - val(before, name, **labels)

    chat = {"handler": "/v1/chat/completions", "method": "POST"}
    assert delta("http_requests_total", **chat, status="200") == 2
    assert delta("http_requests_total", **chat, status="401") == 1
    assert delta("http_requests_total", handler="/metrics", method="GET", status="200") == 1  # the first scrape
    assert delta("ds4mlx:request_success_total", finished_reason="stop") == 2
    assert delta("ds4mlx:prompt_tokens_total") == u1["prompt_tokens"] + u2["prompt_tokens"]
    assert delta("ds4mlx:generation_tokens_total") == u1["completion_tokens"] + u2["completion_tokens"]
    assert delta("ds4mlx:prefix_cache_queries_total") == u1["prompt_tokens"] + u2["prompt_tokens"]
    assert delta("ds4mlx:prefix_cache_hits_total", source="live") == cached
    assert delta("ds4mlx:prefix_cache_requests_total", source="live") == 1
    for name in ("time_to_first_token", "e2e_request_latency", "request_prefill_time", "request_queue_time"):
        assert delta(f"ds4mlx:{name}_seconds_count") == 2
    itl = u1["completion_tokens"] + u2["completion_tokens"] - 2
    assert delta("ds4mlx:inter_token_latency_seconds_count") == itl
    assert delta("ds4mlx:decode_tokens_evaluated_total") >= u2["completion_tokens"]
    assert val(after, "ds4mlx:num_requests_running") == 0 and val(after, "ds4mlx:num_requests_waiting") == 0
    assert val(after, "ds4mlx:predicted_tokens_seconds") > 0
    assert val(after, "ds4mlx:spec_decode_num_drafts_total") == 0


def test_metrics_and_slots_while_jobs_run_and_wait(tok):
    """Gauges and /slots with a job held in its prefill (the model's gate) and one queued."""
    model = ScriptedModel(tok, "fine")
    with serve(tok, model, ctx=512, slots=2) as s:
        model.prefill_gate.close()

        async def go():
            async with aiohttp.ClientSession() as cs:
                jobs = [
                    asyncio.ensure_future(cs.post(s.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}))
                    for i in range(3)
                ]
                assert await asyncio.to_thread(model.prefill_gate.wait_for_waiters, 1)
                # the worker admits what arrived before it entered the held prefill (one or two jobs):
                # the state is stable from then on, and the gauges and /slots must show it
                stable = lambda: len(s.engine.running) >= 1 and len(s.engine.running) + s.engine.queue_depth == 3  # noqa: E731
                assert await asyncio.to_thread(s.wait, stable)
                running = len(s.engine.running)
                async with cs.get(s.url + "/metrics") as r:
                    text = await r.text()
                async with cs.get(s.url + "/slots") as r:
                    slots = await r.json()
                model.prefill_gate.open()
                for j in jobs:
                    r = await j
                    assert r.status == 200
                    await r.read()
                return text, slots, running

        text, slots, running = asyncio.run(go())
    m = {}
    for fam in prom_parser.text_string_to_metric_families(text):
        for smp in fam.samples:
            m[smp.name] = smp.value
    assert m["ds4mlx:num_requests_running"] == running and m["ds4mlx:num_requests_waiting"] == 3 - running
    assert m["ds4mlx:num_slots"] == 2
    assert [sl["id"] for sl in slots] == [0, 1]
    busy = [sl for sl in slots if sl["is_processing"]]
    assert len(busy) == running and all(sl["state"] == "processing" for sl in busy)
    assert [sl["task"]["api"] for sl in busy] == ["completions"] * running


# --------------------------------------------------------------------------- ops endpoints
def test_tokenize_detokenize_round_trip(srv, tok):
    text = "Hello, wörld! <｜User｜> 123"
    st, _, doc = post_json(srv, "/tokenize", {"content": text})
    assert st == 200 and doc["tokens"] == tok.encode(text) and doc["count"] == len(doc["tokens"])
    assert doc["max_model_len"] == 4096
    st, _, back = post_json(srv, "/detokenize", {"tokens": doc["tokens"]})
    assert st == 200 and back["content"] == text and back["prompt"] == text
    # vLLM's field names, the BOS on request, llama.cpp's pieces
    st, _, doc2 = post_json(srv, "/tokenize", {"prompt": text, "add_special_tokens": True, "with_pieces": True})
    assert [p["id"] for p in doc2["tokens"]] == [tok.bos_id] + doc["tokens"]
    assert "".join(p["piece"] for p in doc2["tokens"][1:] if isinstance(p["piece"], str)).startswith("Hello")
    # the messages form: what the chat route would prefill
    st, _, chat = post_json(srv, "/tokenize", {"messages": MSG})
    _, _, gen = post_json(srv, "/v1/chat/completions", {"messages": MSG})
    assert st == 200 and chat["count"] == gen["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {"content": "x", "add_bos": True}, "add_bos"),
        ("/tokenize", {"content": "x", "prompt": "y"}, "content"),
        ("/tokenize", {"content": 3}, "content"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
    ],
)
def test_tokenize_refusals_name_the_field(srv, path, body, param):
    st, _, doc = post_json(srv, path, body)
    assert st == 400 and doc["error"]["param"] == param


def test_slots(srv):
    post_json(srv, "/v1/chat/completions", {"messages": MSG})
    # the answer reaches the client before the worker frees the slot (its checkpoint follows)
    assert srv.wait(lambda: not srv.engine.running)
    st, _, raw = call(srv, "GET", "/v1/ds4mlx/slots")
    (slot,) = json.loads(raw)
    assert st == 200 and slot["id"] == 0 and slot["n_ctx"] == 4096 and slot["is_processing"] is False
    assert slot["state"] == "idle" and slot["n_tokens"] == len(srv.engine.session) > 0
    assert slot["idle_s"] >= 0 and slot["task"] is None
    assert slot["cached_prefix"].startswith("<｜begin▁of▁sentence｜><｜User｜>Hi")
    assert slot["cached_prefix"].endswith("Hello there!")


# --------------------------------------------------------------------------- TLS
def test_openai_sdk_over_https_with_a_self_signed_cert(tok, tmp_path):
    trustme = pytest.importorskip("trustme")
    from ds4mlx.serve.app import BackgroundServer, make_app
    from ds4mlx.serve.cli import server_ssl_context
    from ds4mlx.serve.prepare import ServeConfig

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    with serve(tok, ScriptedModel(tok, generated), ctx=1024) as plain:  # the engine; served again over TLS
        app = make_app(plain.engine, ServeConfig(ctx=1024, api_keys=(KEY,)), plain.tool_memory)
        with BackgroundServer(app, ssl_context=server_ssl_context(str(certfile), str(keyfile))) as s:
            assert s.url.startswith("https://")
            http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cafile)))
            oc = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60, http_client=http)
            r = oc.chat.completions.create(model=MODEL, messages=MSG)
            assert r.choices[0].message.content == "Hello there!"
            bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0, timeout=60, http_client=http)
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model=MODEL, messages=MSG)
            untrusting = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
            with pytest.raises(openai.APIConnectionError):  # the self-signed chain is not trusted by default
                untrusting.chat.completions.create(model=MODEL, messages=MSG)


def test_ssl_flags_refused_early(tmp_path):
    from ds4mlx.serve.cli import server_ssl_context

    assert server_ssl_context(None, None) is None
    with pytest.raises(ValueError, match="needs --ssl-certfile"):
        server_ssl_context(None, "key.pem")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="junk.pem"):
        server_ssl_context(str(tmp_path / "junk.pem"), None)


def test_key_and_tls_flags(tmp_path):
    import argparse
    import os
    import subprocess

    from ds4mlx.serve.cli import add_arguments, api_keys

    p = argparse.ArgumentParser()
    add_arguments(p)
    keys = tmp_path / "keys.txt"
    keys.write_text("# the ops team\nk1\n\n  k2  \n")
    args = p.parse_args(["--api-key", "a", "--api-key", "b", "--api-key-file", str(keys), "--root-path", "/x/"])
    assert api_keys(args) == ("a", "b", "k1", "k2") and args.root_path == "/x/"
    (tmp_path / "empty.txt").write_text("# nothing yet\n")
    with pytest.raises(SystemExit, match="no key"):
        api_keys(p.parse_args(["--api-key-file", str(tmp_path / "empty.txt")]))
    with pytest.raises(SystemExit, match="missing.txt"):
        api_keys(p.parse_args(["--api-key-file", str(tmp_path / "missing.txt")]))
    # the real command refuses a bad certificate before it loads a model
    proc = subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", "serve", "--ssl-certfile", str(tmp_path / "none.pem")],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert proc.returncode == 2 and "none.pem" in proc.stderr and "listening" not in proc.stderr


# --------------------------------------------------------------------------- Ollama
@pytest.fixture(scope="module")
def oc(srv):
    return ollama.Client(host=srv.url, headers=BEARER, timeout=60)


def test_ollama_list_show_ps_version(oc, srv):
    (m,) = oc.list().models
    assert m.model == MODEL + ":latest" and m.details.family == "deepseek_v4"
    shown = oc.show(MODEL)
    assert "tools" in shown.capabilities and shown.modelinfo["deepseek_v4.context_length"] == 4096
    (p,) = oc.ps().models
    assert p.model == MODEL + ":latest"
    st, _, raw = call(srv, "GET", "/api/version")
    assert json.loads(raw)["version"]


def test_ollama_chat_not_streamed(oc, tok):
    r = oc.chat(model=MODEL, messages=MSG)
    assert r.done and r.done_reason == "stop" and r.model == MODEL
    assert r.message.role == "assistant" and r.message.content == "Hello there!"
    assert r.message.thinking == "Simple greeting."
    assert r.eval_count == len(tok.encode("Simple greeting.</think>Hello there!"))  # EOS not counted
    assert r.prompt_eval_count > 0 and r.total_duration >= r.eval_duration >= 0
    r = oc.chat(model=MODEL + ":latest", messages=MSG, think=False, options={"temperature": 0, "num_predict": 2})
    assert r.done_reason == "length" and r.eval_count == 2 and r.message.thinking is None


def test_ollama_chat_streamed(oc):
    parts = list(oc.chat(model=MODEL, messages=MSG, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "stop"
    assert "".join(p.message.content or "" for p in parts) == "Hello there!"
    assert "".join(p.message.thinking or "" for p in parts) == "Simple greeting."


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat_with_a_tool(oc, stream):
    msgs = [{"role": "user", "content": "List /tmp"}]
    if stream:
        parts = list(oc.chat(model=MODEL, messages=msgs, tools=TOOLS, stream=True))
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
        content = "".join(p.message.content or "" for p in parts)
    else:
        r = oc.chat(model=MODEL, messages=msgs, tools=TOOLS)
        calls, content = r.message.tool_calls, r.message.content
    (call_,) = calls
    assert call_.function.name == "bash" and call_.function.arguments == {"command": "ls /tmp"}
    assert content == "Let me look."
    msgs += [
        {"role": "assistant", "content": content, "tool_calls": [call_]},
        {"role": "tool", "content": "a.txt\nb.txt", "tool_name": "bash"},
    ]
    r = oc.chat(model=MODEL, messages=msgs, tools=TOOLS)
    assert r.message.content == "Two files: a.txt and b.txt." and not r.message.tool_calls


def test_ollama_generate(oc, srv):
    r = oc.generate(model=MODEL, prompt="Hi", think=False)
    assert r.response == "Hello there!" and r.done and r.done_reason == "stop"
    parts = list(oc.generate(model=MODEL, prompt="Hi", stream=True))
    assert "".join(p.response for p in parts) == "Hello there!" and parts[-1].done
    assert "".join(p.thinking or "" for p in parts) == "Simple greeting."
    r = oc.generate(model=MODEL, prompt="Hi", raw=True, options={"num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    r = oc.generate(model=MODEL)  # no prompt: Ollama's "load the model"
    assert r.done and r.done_reason == "load" and r.response == ""


@pytest.mark.parametrize(
    "body,words",
    [
        ({"options": {"mirostat": 1}}, "options.mirostat"),
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"num_ctx": 10**6}}, "options.num_ctx"),
        ({"think": "maybe"}, "think"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_ollama_refusals(srv, body, words):
    st, _, doc = post_json(srv, "/api/chat", {"model": MODEL, "messages": MSG, "stream": False, **body})
    assert st == 400 and words in doc["error"]
    with pytest.raises(ollama.ResponseError, match="not supported|Unsupported|Invalid"):
        ollama.Client(host=srv.url, headers=BEARER).chat(model=MODEL, messages=MSG, **body)


def test_ollama_format_is_structured_output():
    """`format` becomes the pipeline's response_format (structured output: tests/test_structured_output.py)."""
    from ds4mlx.serve import ollama as O

    base = {"model": MODEL, "messages": MSG}
    assert O.translate("chat", {**base, "format": "json"}).body["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = O.translate("generate", {"model": MODEL, "prompt": "Hi", "format": schema}).body["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"] == schema
    assert "response_format" not in O.translate("chat", base).body
    from ds4mlx.serve.errors import APIError

    with pytest.raises(APIError) as e:  # (the ollama client refuses such a value itself)
        O.translate("chat", {**base, "format": "yaml"})
    assert e.value.status == 400 and "format" in str(e.value.message if hasattr(e.value, "message") else e.value)


def test_ollama_num_ctx_caps_the_answer(srv):
    st, _, doc = post_json(srv, "/api/chat", {"model": MODEL, "messages": MSG, "stream": False})
    need = doc["prompt_eval_count"]
    st, _, doc = post_json(
        srv, "/api/chat", {"model": MODEL, "messages": MSG, "stream": False, "options": {"num_ctx": need + 3}}
    )
    assert st == 200 and doc["eval_count"] == 3 and doc["done_reason"] == "length"
    st, _, doc = post_json(
        srv, "/api/chat", {"model": MODEL, "messages": MSG, "stream": False, "options": {"num_ctx": need}}
    )
    assert st == 400 and "context" in doc["error"]


def test_ollama_unknown_route_in_ollama_shape(srv):
    st, _, doc = post_json(srv, "/api/embed", {"model": MODEL, "input": "x"})
    assert st == 404 and isinstance(doc["error"], str)
