"""Images over HTTP on the three chat APIs (docs/vision.md), on `demo:qwen4_exp` with
the demo encoder (`--vision demo`): every refusal is a 400 in the API's error shape,
two images are answered streamed and not, tool-result images round-trip, the image
blocks sit where the parts were, a repeated request reuses its prefix, a replaced image
rebuilds, and a server without an encoder refuses images."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests

from ds4mlx.chat import images as chat_images
from ds4mlx.vision.load import load_vision

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve  # noqa: E402
from vision_helpers import data_uri, huge_png, image_bytes  # noqa: E402

ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
APIS = sorted(ROUTES)


@pytest.fixture(scope="module")
def loaded(shared_demo):
    return shared_demo("demo:qwen4_exp")


@pytest.fixture(scope="module")
def server(loaded):
    model, tok = loaded
    with serve(tok, model, ctx=4096) as s:
        s.engine.enable_vision(load_vision("demo", model))
        yield s


@pytest.fixture(scope="module")
def plain_server(loaded):
    model, tok = loaded
    with serve(tok, model, ctx=4096) as s:
        yield s


# --- bodies ------------------------------------------------------------------------------


def part(api: str, uri: str) -> dict:
    """An image part carrying `uri` (a data URI, or any string to be refused)."""
    if api == "chat":
        return {"type": "image_url", "image_url": {"url": uri}}
    if api == "responses":
        return {"type": "input_image", "image_url": uri}
    media, _, data = uri.partition(";base64,")
    if not data:  # not a data URI: Anthropic's URL source
        return {"type": "image", "source": {"type": "url", "url": uri}}
    return {"type": "image", "source": {"type": "base64", "media_type": media[5:], "data": data}}


def text_part(api: str, text: str) -> dict:
    return {"type": "input_text" if api == "responses" else "text", "text": text}


def body(api: str, content: list, stream: bool = False, max_tokens: int = 3, role: str = "user") -> dict:
    msg = {"role": role, "content": content}
    b = {"model": "m", "stream": stream, "temperature": 0}
    if api == "responses":
        b.update(input=[{"type": "message", **msg}], max_output_tokens=max_tokens)
    else:
        b.update(messages=[msg], max_tokens=max_tokens)
    return b


def post(s, api: str, b: dict) -> requests.Response:
    return requests.post(s.url + ROUTES[api], json=b, timeout=300)


def error_message(api: str, r: requests.Response) -> str:
    """The 400 in the API's shape, its message."""
    assert r.status_code == 400, r.text
    j = r.json()
    if api == "anthropic":
        assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
        return j["error"]["message"]
    assert j["error"]["type"] == "invalid_request_error"
    return j["error"]["message"]


def sse_events(r: requests.Response) -> list[dict]:
    out = []
    # SSE lines end in "\n"; the body is UTF-8 (requests would guess Latin-1 for text/event-stream,
    # and str.splitlines also breaks at U+0085, a Latin-1 reading of a UTF-8 continuation byte)
    for line in r.content.decode("utf-8").split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def two_images(api: str, a: bytes, b: bytes) -> list:
    return [
        text_part(api, "compare "),
        part(api, data_uri(a)),
        text_part(api, " with "),
        part(api, data_uri(b, "image/jpeg")),
        text_part(api, " please"),
    ]


# --- refusals ----------------------------------------------------------------------------

REFUSALS = [
    ("path", "/home/user/shot.png", chat_images.ERR_NOT_DATA_URI),
    ("http", "http://example.com/a.png", chat_images.ERR_NOT_DATA_URI),
    ("https", "https://example.com/a.png", chat_images.ERR_NOT_DATA_URI),
    ("file", "file:///etc/passwd", chat_images.ERR_NOT_DATA_URI),
    ("gif", "data:image/gif;base64,R0lGODlhAQABAAAAACw=", chat_images.ERR_MEDIA_TYPE.format(media="image/gif")),
    ("bad-base64", "data:image/png;base64,%%%not-base64", chat_images.ERR_BASE64),
    ("not-an-image", data_uri(b"plain text, not a PNG"), chat_images.ERR_BROKEN),
    ("truncated-png", data_uri(image_bytes()[:-30]), chat_images.ERR_BROKEN),
    ("huge", data_uri(huge_png(8000, 8000)), chat_images.ERR_TOO_LARGE.format(w=8000, h=8000, limit=40_000_000)),
]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case,uri,message", REFUSALS, ids=[c for c, _, _ in REFUSALS])
def test_refusals_are_400s_in_the_api_shape(server, api, case, uri, message):
    r = post(server, api, body(api, [text_part(api, "look "), part(api, uri)]))
    got = error_message(api, r)
    # the part is named: its message (the API's own spelling) and its place among the message's images
    where = {"anthropic": "messages.0", "responses": "input[0]"}.get(api, "messages[0]") + ", image 1: "
    if api == "anthropic" and case in ("path", "http", "https", "file"):
        assert got == where + chat_images.ERR_SOURCE_TYPE.format(kind="url")  # Anthropic's URL source
    else:
        assert got == where + message


@pytest.mark.parametrize("api", APIS)
def test_seventeen_images_are_refused(server, api):
    parts = [part(api, data_uri(image_bytes(8, 8, seed=i))) for i in range(17)]
    assert error_message(api, post(server, api, body(api, parts))) == chat_images.ERR_TOO_MANY


@pytest.mark.parametrize("api", APIS)
def test_image_in_an_assistant_message_is_refused(server, api):
    b = body(api, [part(api, data_uri())], role="assistant")
    if api == "responses":
        b["input"][0]["content"] = [{"type": "input_image", "image_url": data_uri()}]
    assert error_message(api, post(server, api, b)) == chat_images.ERR_ROLE


@pytest.mark.parametrize(
    "api,field",
    [
        (
            "chat",
            {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_uri()}}]}]},
        ),
        (
            "chat",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "reasoning_content": [{"type": "image_url", "image_url": {"url": data_uri()}}],
                    }
                ]
            },
        ),
        (
            "anthropic",
            {
                "system": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": data_uri().split(",")[1]},
                    }
                ]
            },
        ),
        (
            "responses",
            {"input": [{"type": "reasoning", "summary": [{"type": "input_image", "image_url": data_uri()}]}]},
        ),
    ],
    ids=["chat-system", "chat-reasoning", "anthropic-system", "responses-reasoning"],
)
def test_images_where_none_may_go_are_refused(server, api, field):
    b = body(api, [text_part(api, "hi")])
    b.update(field)
    assert error_message(api, post(server, api, b)) == chat_images.ERR_ROLE


@pytest.mark.parametrize("api", APIS)
def test_server_without_encoder_refuses_images(plain_server, api):
    msg = error_message(api, post(plain_server, api, body(api, [part(api, data_uri())])))
    assert "image input is not supported" in msg


# --- answers -----------------------------------------------------------------------------


def _blocks(server) -> list[tuple[int, int]]:
    """(start, pads) of every image block in the live session."""
    ids = server.engine.vision.ids
    toks = server.engine.session.tokens
    out = []
    for i, t in enumerate(toks):
        if t == ids.start:
            j = i + 1
            while toks[j] == ids.pad:
                j += 1
            assert toks[j] == ids.end
            out.append((i, j - i - 1))
    return out


def _answer_ok(api: str, r: requests.Response, stream: bool) -> int:
    """The answer's prompt token count."""
    assert r.status_code == 200, r.text
    if not stream:
        j = r.json()
        u = j["usage"]
        if api == "anthropic":
            return u["input_tokens"] + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)
        return u.get("prompt_tokens") or u["input_tokens"]
    ev = sse_events(r)
    assert ev, r.text
    if api == "chat":
        assert ev[-1]["choices"] == [] or ev[-1]["choices"][0]["finish_reason"]
        return next(e["usage"]["prompt_tokens"] for e in ev if e.get("usage"))
    if api == "responses":
        done = next(e for e in ev if e.get("type") in ("response.completed", "response.incomplete"))
        return done["response"]["usage"]["input_tokens"]
    start = next(e for e in ev if e.get("type") == "message_start")
    assert any(e.get("type") == "message_stop" for e in ev)
    u = start["message"]["usage"]
    return u["input_tokens"] + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_two_images_are_answered(server, api, stream):
    a, b = image_bytes(64, 40, seed=11), image_bytes(100, 100, "JPEG", seed=12)
    b_ = body(api, two_images(api, a, b), stream=stream)
    if api == "chat" and stream:
        b_["stream_options"] = {"include_usage": True}
    prompt_tokens = _answer_ok(api, post(server, api, b_), stream)
    enc = server.engine.vision
    na = enc.n_tokens(chat_images.from_data_uri(data_uri(a)))
    nb = enc.n_tokens(chat_images.from_data_uri(data_uri(b)))
    blocks = _blocks(server)
    assert [n for _, n in blocks] == [na, nb]
    # the text between the blocks is the text between the parts
    tok = server.engine.tokenizer
    toks = server.engine.session.tokens
    (sa, _), (sb, _) = blocks
    assert tok.decode(toks[sa + na + 2 : sb]) == " with "
    assert tok.decode(toks[:sa]).endswith("compare ")
    assert prompt_tokens > na + nb + 4


@pytest.mark.parametrize("api", APIS)
def test_tool_result_images_round_trip(server, api):
    shot = data_uri(image_bytes(50, 50, seed=21))
    if api == "chat":
        b = {
            "model": "m",
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": "take a screenshot"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": [part(api, shot)]},
            ],
        }
    elif api == "anthropic":
        b = {
            "model": "m",
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": "take a screenshot"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [part(api, shot)]}],
                },
            ],
        }
    else:
        b = {
            "model": "m",
            "max_output_tokens": 2,
            "input": [
                {"type": "message", "role": "user", "content": "take a screenshot"},
                {"type": "function_call", "call_id": "call_1", "name": "shot", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": [part(api, shot)]},
            ],
        }
    r = post(server, api, b)
    assert r.status_code == 200, r.text
    assert len(_blocks(server)) == 1


def test_same_request_reuses_and_a_replaced_image_rebuilds(server):
    a, b, c = image_bytes(64, 64, seed=31), image_bytes(64, 64, seed=32), image_bytes(64, 64, seed=33)
    first = post(server, "chat", body("chat", two_images("chat", a, b)))
    assert first.status_code == 200, first.text
    again = post(server, "chat", body("chat", two_images("chat", a, b))).json()["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"]
    other = post(server, "chat", body("chat", two_images("chat", a, c))).json()["usage"]
    assert other["prompt_tokens"] == again["prompt_tokens"]  # same sizes: the same token ids
    assert other["prompt_tokens_details"]["cached_tokens"] == 0


NO_THINKING = {
    "chat": {"think": False},
    "anthropic": {"thinking": {"type": "disabled"}},
    "responses": {"reasoning": {"effort": "none"}},
}


@pytest.mark.parametrize("api", APIS)
def test_next_turn_reuses_the_image_prefix_unless_the_image_changed(server, api):
    a, c = image_bytes(64, 64, seed=41), image_bytes(64, 64, seed=42)

    def turn(image: bytes, history: list | None):
        first = body(api, [text_part(api, "look "), part(api, data_uri(image))], max_tokens=2)
        first.update(NO_THINKING[api])  # the template renders the earlier answer as it was sampled
        if history is None:
            return first
        key = "input" if api == "responses" else "messages"
        first[key] = first[key] + history
        return first

    r1 = post(server, api, turn(a, None))
    assert r1.status_code == 200, r1.text
    n1 = _answer_ok(api, r1, False)
    if api == "responses":
        history = [{"type": "message", "role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    else:
        history = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and?"}]
    kept = post(server, api, turn(a, history)).json()["usage"]
    cached = {"chat": "prompt_tokens_details", "responses": "input_tokens_details"}
    read = (
        (lambda u: u["cache_read_input_tokens"]) if api == "anthropic" else (lambda u: u[cached[api]]["cached_tokens"])
    )
    assert read(kept) == n1  # the first prompt, its image block included, is reused
    r0 = post(server, api, turn(a, None))  # back to the first prompt's state
    assert r0.status_code == 200
    replaced = post(server, api, turn(c, history)).json()["usage"]
    assert read(replaced) == 0
