"""Hypothesis fuzz: generated bodies per generation route against a live server
(scripted model, tiny limits).  Every answer must be < 500 and well-formed
(JSON error in the API's shape, JSON body, or an SSE stream), none may hang
(a 60 s client timeout fails the test), and the server must keep serving.
The bodies include image / audio / file parts (a clear 400 without a vision encoder)
and tool histories (calls followed by their results, ids matching or not).
`test_fuzz_images` sends image parts to a server with the demo vision encoder
(`demo:qwen4_exp --vision demo`): real PNG / JPEG data, bad base64, truncated PNGs,
huge dimensions, up to 18 images, images in tool results and assistant turns.

`DS4MLX_FUZZ_EXAMPLES` bodies per route: 250 by default (1,000 in all, the CI
size); `make test-fuzz` runs 2,500 per route, 10,000 in all."""

from __future__ import annotations

import http.client
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402
from vision_helpers import b64, huge_png, image_bytes  # noqa: E402

from ds4mlx.serve.fields import REFUSED, TABLE, passes, values  # noqa: E402

EXAMPLES = int(__import__("os").environ.get("DS4MLX_FUZZ_EXAMPLES", "250"))
DSML = (
    'Hmm.</think>Ok.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)


def script(prompt: str) -> str:
    if "## Tools" in prompt:
        return DSML
    return "Think.</think>Hi 😀" if prompt.endswith("<think>") else "Hi 😀"


# --------------------------------------------------------------------------- strategies
leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
anyjson = st.recursive(
    leaf, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=6), ch, max_size=3), max_leaves=8
)


def mostly(valid):
    """Usually (24 in 25) a plausible value, sometimes any JSON at all."""
    return st.integers(0, 24).flatmap(lambda i: anyjson if i == 0 else valid)


small_int = st.integers(-3, 8)
text = st.text(max_size=24) | st.sampled_from(
    ["<｜User｜>", "</think>", "<｜DSML｜tool_calls>", "｜DSML｜", "<tool_result>", "\\u0000", "\x00\x08"]
)
block_type = st.sampled_from(
    ["text", "image_url", "input_text", "output_text", "tool_use", "tool_result", "thinking", "summary_text", "bogus"]
)
block = st.fixed_dictionaries(
    {"type": block_type},
    optional={
        "text": mostly(text),
        "id": text,
        "tool_use_id": text,
        "name": text,
        "input": anyjson,
        "content": text,
        "thinking": text,
    },
)
call_id = st.sampled_from(["call_1", "call_2", "toolu_1", "fc_1"]) | text
media = st.one_of(  # every API's media parts: refused with a 400 naming the part
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": mostly(
                st.fixed_dictionaries(
                    {
                        "url": st.sampled_from(
                            ["https://example.com/a.png", "data:image/png;base64,iVBORw0KGgo=", "file:///etc/passwd"]
                        )
                    }
                )
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": mostly(
                st.fixed_dictionaries(
                    {
                        "type": st.sampled_from(["base64", "url"]),
                        "media_type": st.just("image/png"),
                        "data": st.just("iVBORw0KGgo="),
                    }
                )
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.just("input_image"), "image_url": mostly(text)}),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_audio", "file", "input_file", "document"])},
        optional={"input_audio": anyjson, "file": anyjson, "source": anyjson},
    ),
)
content = mostly(text | st.none() | st.lists(text | block | media, max_size=3))
tool_call = mostly(
    st.fixed_dictionaries(
        {
            "id": text,
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": text, "arguments": mostly(text)}),
        }
    )
)
role = mostly(st.sampled_from(["user", "user", "assistant", "system", "developer", "tool", "function", "wizard"]))
message = st.fixed_dictionaries(
    {"role": role, "content": content},
    optional={"tool_calls": st.lists(tool_call, max_size=2), "tool_call_id": text, "reasoning_content": mostly(text)},
)
# tool histories: a user turn, an assistant call, its result (id matching or not), the user again
chat_call = st.fixed_dictionaries(
    {
        "id": call_id,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]), "arguments": mostly(st.sampled_from(['{"a": 1}', "{}", "not json"]))}
        ),
    }
)
chat_history = st.tuples(
    st.just({"role": "user", "content": "use the tool"}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": mostly(st.just("") | text),
            "tool_calls": st.lists(chat_call, min_size=1, max_size=2),
        }
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": call_id, "content": mostly(text)}),
    st.lists(message, max_size=1),
).map(lambda t: [t[0], t[1], t[2], *t[3]])
messages = mostly(st.lists(message, min_size=1, max_size=4) | st.lists(message, max_size=1) | chat_history)
anthropic_history = st.tuples(
    st.just({"role": "user", "content": "use the tool"}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.lists(
                st.one_of(
                    st.fixed_dictionaries(
                        {
                            "type": st.just("tool_use"),
                            "id": call_id,
                            "name": st.sampled_from(["f", "g"]),
                            "input": mostly(st.just({"a": 1})),
                        }
                    ),
                    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text}),
                ),
                min_size=1,
                max_size=2,
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.just("tool_result"),
                        "tool_use_id": call_id,
                        "content": mostly(text | st.lists(block | media, max_size=2)),
                    }
                ),
                min_size=1,
                max_size=2,
            ),
        }
    ),
).map(list)
anthropic_messages = mostly(st.lists(message, min_size=1, max_size=4) | anthropic_history)
model = mostly(
    st.sampled_from(["deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner", "deepseek-v4-flash", "gpt-4", ""])
)
fn_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | text, "parameters": anyjson}),
    }
)
flat_tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "namespace", "tool_search", "custom"]),
        "name": st.sampled_from(["f", "g"]) | text,
    },
    optional={"parameters": anyjson, "tools": st.lists(anyjson, max_size=2), "input_schema": anyjson},
)
tools = mostly(st.lists(fn_tool | flat_tool, max_size=2))
effort = mostly(st.sampled_from(["max", "high", "low", "none", "bogus"]))
common = {
    "model": model,
    "temperature": mostly(st.floats(-1, 3)),
    "top_p": mostly(st.floats(-1, 2)),
    "top_k": mostly(small_int),
    "min_p": mostly(st.floats(-1, 2)),
    "seed": mostly(st.integers(-5, 2**64)),
    "max_tokens": mostly(small_int),
    "stream": mostly(st.booleans()),
    "stop": mostly(text | st.lists(text)),
    "ignore_eos": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": mostly(st.booleans())})),
    "reasoning_effort": effort,
    "thinking": mostly(st.booleans() | st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])})),
    "think": mostly(st.booleans()),
    "extra": anyjson,
}


def with_table_field(api: str, strategy):
    """One body in three gets one of the API's top-level refused / ignored fields
    (serve/fields.py): any JSON, or a value the table passes (null, the API's default)."""
    fields = [f for f in TABLE[api] if "." not in f.path and "[" not in f.path]
    one = st.sampled_from(fields).flatmap(
        lambda f: st.fixed_dictionaries({f.path: st.one_of(anyjson, st.sampled_from([None, *f.neutral]))})
    )
    extra = st.integers(0, 2).flatmap(lambda i: one if i == 0 else st.just({}))
    return st.tuples(strategy, extra).map(lambda t: {**t[0], **t[1]})


chat_body = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        **common,
        "tools": tools,
        "tool_choice": mostly(
            st.sampled_from(["auto", "none", "required"])
            | st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})}
            )
        ),
        "max_completion_tokens": mostly(small_int),
        "logprobs": mostly(st.booleans()),
        "top_logprobs": mostly(st.integers(-2, 25)),
    },
)
completion_body = st.fixed_dictionaries(
    {"prompt": mostly(text | st.lists(text, max_size=2))},
    optional={**common, "logprobs": mostly(st.integers(-2, 25))},
)
anthropic_body = st.fixed_dictionaries(
    {"messages": anthropic_messages, "max_tokens": mostly(small_int)},
    optional={
        **{k: v for k, v in common.items() if k != "max_tokens"},
        "system": mostly(text | st.lists(text | block, max_size=2)),
        "tools": tools,
        "tool_choice": mostly(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none"])},
                optional={"name": st.sampled_from(["f", "h"])},
            )
        ),
        "stop_sequences": mostly(st.lists(text, max_size=2)),
        "output_config": mostly(st.fixed_dictionaries({"effort": effort})),
    },
)
item_type = st.sampled_from(
    [
        "message",
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
        "custom_tool_call",
        "local_shell_call",
        "tool_search_output",
        "compaction",
        "bogus",
    ]
)
item = st.fixed_dictionaries(
    {"type": item_type},
    optional={
        "role": role,
        "content": content,
        "call_id": text,
        "name": text,
        "arguments": mostly(text),
        "output": mostly(text),
        "summary": mostly(st.lists(block, max_size=2)),
        "status": mostly(st.sampled_from(["completed", "completed", "in_progress"])),
        "namespace": text,
        "tools": anyjson,
    },
)
responses_history = st.tuples(
    st.just({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "use the tool"}]}),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call", "custom_tool_call"]),
            "call_id": call_id,
            "name": st.sampled_from(["f", "g"]),
            "arguments": mostly(st.just('{"a":1}')),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
            "call_id": call_id,
            "output": mostly(text),
        }
    ),
    st.lists(item, max_size=1),
).map(lambda t: [t[0], t[1], t[2], *t[3]])
responses_media = st.fixed_dictionaries(
    {"type": st.just("message"), "role": st.just("user"), "content": st.lists(media | block, min_size=1, max_size=2)}
)
responses_body = st.fixed_dictionaries(
    {"input": mostly(text | st.lists(item | responses_media, max_size=4) | responses_history)},
    optional={
        **common,
        "instructions": mostly(text),
        "tools": tools,
        "max_output_tokens": mostly(small_int),
        "tool_choice": mostly(st.sampled_from(["auto", "none", "required"])),
        "reasoning": mostly(
            st.fixed_dictionaries(
                {}, optional={"effort": effort, "summary": mostly(st.sampled_from(["auto", "concise", "none"]))}
            )
        ),
        "previous_response_id": st.none() | text,
    },
)
raw_bytes = st.binary(max_size=48) | st.sampled_from(
    [
        b"",
        b"{",
        b"null",
        b"[]",
        b'{"messages":NaN}',
        b'{"a":1}x',
        b"\xff\xfe",
        b'{"messages":[{"content":"\\ud83d"}]}',
        b'{"x":' + b"[" * 400 + b"]" * 400 + b"}",
        b'{"input":' + b'{"a":' * 300 + b"1" + b"}" * 301,
    ]
)


# --------------------------------------------------------------------------- image inputs
_PNG, _JPEG = image_bytes(40, 30), image_bytes(33, 70, "JPEG", seed=1)
good_payload = st.sampled_from(
    [
        ("image/png", b64(_PNG)),
        ("image/jpeg", b64(_JPEG)),
        ("image/jpg", b64(_JPEG)),
        ("image/png", b64(_JPEG)),  # mislabelled: the bytes decide
    ]
)
bad_payload = st.sampled_from(
    [
        ("image/png", b64(_PNG[:-25])),  # truncated PNG
        ("image/jpeg", b64(_JPEG[: len(_JPEG) // 2])),  # truncated JPEG
        ("image/png", b64(huge_png(8000, 8000))),  # over the pixel limit
        ("image/png", b64(huge_png(30000, 30000))),  # Pillow's bomb guard
        ("image/png", "iVBORw0KGgo="),  # a PNG signature only
        ("image/png", "%%%not base64"),
        ("image/png", b64(_PNG)[:-3]),  # bad padding
        ("image/gif", "R0lGODlhAQABAAAAACw="),
        ("image/webp", b64(_PNG)),
        ("text/plain", "aGk="),
    ]
)
image_payload = st.integers(0, 2).flatmap(lambda i: bad_payload if i == 0 else good_payload)
image_url = st.integers(0, 5).flatmap(
    lambda i: (
        st.sampled_from(["/tmp/a.png", "https://example.com/a.png", "file:///etc/passwd", "data:image/png,raw", ""])
        if i == 0
        else image_payload.map(lambda p: f"data:{p[0]};base64,{p[1]}")
    )
)


def _image_part(api: str):
    if api == "anthropic":
        src = image_payload.map(lambda p: {"type": "base64", "media_type": p[0], "data": p[1]})
        src = src | st.fixed_dictionaries({"type": st.sampled_from(["url", "file"]), "url": image_url})
        return st.fixed_dictionaries({"type": st.just("image"), "source": mostly(src)})
    if api == "responses":
        return st.fixed_dictionaries({"type": st.just("input_image"), "image_url": mostly(image_url)})
    return st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": mostly(image_url | st.fixed_dictionaries({"url": image_url}))}
    )


def _image_content(api: str):
    txt = st.fixed_dictionaries(
        {"type": st.just("input_text" if api == "responses" else "text"), "text": st.text(max_size=8)}
    )
    one = _image_part(api)
    many = st.integers(15, 18).flatmap(lambda n: st.lists(one, min_size=n, max_size=n))  # around the 16 limit
    return st.lists(one | txt, min_size=1, max_size=4) | many


def image_body(api: str):
    role = st.sampled_from(["user"] * 6 + ["assistant", "system", "tool"])
    content = _image_content(api)
    if api == "responses":
        msg = st.fixed_dictionaries({"type": st.just("message"), "role": role, "content": content})
        out = st.fixed_dictionaries(
            {"type": st.just("function_call_output"), "call_id": st.just("call_1"), "output": content}
        )
        call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
        items = st.lists(msg, min_size=1, max_size=2) | out.map(lambda o: [{"role": "user", "content": "x"}, call, o])
        return st.fixed_dictionaries(
            {"input": items, "max_output_tokens": st.integers(1, 3)}, optional={"stream": st.booleans()}
        )
    msg = st.fixed_dictionaries({"role": role, "content": content})
    if api == "anthropic":
        result = content.map(
            lambda c: {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": c}]}
        )
        msgs = st.lists(msg, min_size=1, max_size=2) | result.map(lambda r: [r])
    else:
        msgs = st.lists(msg, min_size=1, max_size=2)
    return st.fixed_dictionaries(
        {"messages": msgs, "max_tokens": st.integers(1, 3)}, optional={"stream": st.booleans()}
    )


def bodies(structured):
    as_bytes = structured.map(lambda b: json.dumps(b, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return st.one_of(as_bytes, as_bytes, as_bytes, anyjson.map(lambda b: json.dumps(b).encode()), raw_bytes)


# --------------------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    with serve(tok, ScriptedModel(tok, script), ctx=256, tokens=8) as s:
        yield s


class Client:
    def __init__(self, url: str):
        host, port = url.rsplit("/", 1)[-1].split(":")
        self.host, self.port = host, int(port)
        self.conn = None

    def post(self, path: str, body: bytes):
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                return r.status, r.getheader("Content-Type") or "", r.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise


def refused_in(api: str, raw: bytes) -> str | None:
    """A field the table refuses, present with a value it does not pass (a wrong type
    included): such a body must never be answered 200."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    for f in TABLE[api]:
        if f.status == REFUSED and any(not passes(f, v) for _, v in values(body, f.path)):
            return f.path
    return None


def check(srv, client, path, body, api) -> int:
    status, ctype, data = client.post(path, body)
    assert status < 500, (status, body[:300], data[:300])
    refused = refused_in(api, body)
    assert refused is None or status == 400, (refused, status, body[:300])
    if ctype.startswith("text/event-stream"):
        assert status == 200 and data.endswith(b"\n\n")
        return status
    obj = json.loads(data)
    if status >= 400:
        if api == "anthropic":
            assert obj["type"] == "error" and isinstance(obj["error"]["message"], str)
        else:
            assert isinstance(obj["error"]["message"], str)
    return status


SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,api,strategy",
    [
        ("/v1/chat/completions", "chat", with_table_field("chat", chat_body)),
        ("/v1/completions", "completions", with_table_field("completions", completion_body)),
        ("/v1/messages", "anthropic", with_table_field("anthropic", anthropic_body)),
        ("/v1/responses", "responses", with_table_field("responses", responses_body)),
    ],
)
def test_fuzz_route(srv, path, api, strategy):
    client = Client(srv.url)
    counts: dict = {}

    @SETTINGS
    @given(bodies(strategy))
    def run(body):
        status = check(srv, client, path, body, api)
        counts[status] = counts.get(status, 0) + 1

    run()
    print(f"{path}: {sum(counts.values())} bodies, statuses {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES
    assert counts.get(200, 0) >= EXAMPLES // 20, counts  # a real share of bodies reached the engine
    # still serving, worker alive
    status, _, data = client.post("/v1/chat/completions", b'{"messages":[{"role":"user","content":"x"}]}')
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == "Hi 😀"
    assert srv.engine._worker.is_alive()


@pytest.fixture(scope="module")
def vision_srv():
    import ds4mlx
    from ds4mlx.vision.load import load_vision

    model, tok = ds4mlx.load("demo:qwen4_exp")
    with serve(tok, model, ctx=2048, tokens=4) as s:
        s.engine.enable_vision(load_vision("demo", model))
        yield s


IMAGE_SETTINGS = settings(
    max_examples=max(20, EXAMPLES // 5),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,api", [("/v1/chat/completions", "chat"), ("/v1/messages", "anthropic"), ("/v1/responses", "responses")]
)
def test_fuzz_images(vision_srv, path, api):
    client = Client(vision_srv.url)
    counts: dict = {}

    @IMAGE_SETTINGS
    @given(image_body(api).map(lambda b: json.dumps(b).encode()))
    def run(body):
        status = check(vision_srv, client, path, body, api)
        counts[status] = counts.get(status, 0) + 1

    run()
    print(f"{path} images: {sum(counts.values())} bodies, statuses {dict(sorted(counts.items()))}")
    assert counts.get(200, 0) > 0 and counts.get(400, 0) > 0, counts  # answers and refusals both
    assert vision_srv.engine._worker.is_alive()


# --------------------------------------------------------------------------- typed pass
# One body per route that sets every field its API defines; the typed pass puts a value
# of every JSON type (objects and arrays where strings are expected, and the reverse) at
# every path of it, one to three paths at a time: each answer is an answer or a 400.
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
_COMMON = {
    "model": "deepseek-v4-flash",
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 4,
    "max_tokens": 2,
    "stream": False,
    "ignore_eos": False,
    "reasoning_effort": "high",
}
_OPENAI = {"min_p": 0.1, "seed": 7, "stop": ["zz"], "think": True, "thinking": {"type": "enabled"}}
RICH = {
    "chat": {
        **_COMMON,
        **_OPENAI,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "use f"}]},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "think",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "1"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": _SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_completion_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
    },
    "completions": {
        **_COMMON,
        **_OPENAI,
        "prompt": ["Hello"],
        "stream_options": {"include_usage": True},
        "logprobs": 2,
    },
    "anthropic": {
        **_COMMON,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "use f"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "t", "signature": "s"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "1"}],
                        "is_error": False,
                    }  # fmt: skip
                ],
            },
        ],
        "tools": [{"name": "f", "description": "d", "input_schema": _SCHEMA}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "stop_sequences": ["zz"],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "u"},
        "output_config": {"effort": "high"},
    },
    "responses": {
        **_COMMON,
        "stop": ["zz"],
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "use f"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "t"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a":1}', "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
        ],
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": _SCHEMA}],
        "tool_choice": "auto",
        "max_output_tokens": 2,
        "reasoning": {"effort": "high", "summary": "auto"},
        "parallel_tool_calls": True,
        "store": False,
    },
}
EVERY_TYPE = [None, True, 0, -1.5, "", "x", [], ["x"], [{}], {}, {"type": "text"}, {"a": [1]}]


def paths(value, prefix=()):
    """Every path of a JSON value (the root excluded)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,)
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield prefix + (i,)
            yield from paths(v, prefix + (i,))


def replaced(value, path, new):
    if not path:
        return new
    out = dict(value) if isinstance(value, dict) else list(value)
    out[path[0]] = replaced(value[path[0]], path[1:], new)
    return out


def typed_bodies(api: str):
    base = RICH[api]
    every = sorted(set(paths(base)), key=repr)
    edits = st.lists(st.tuples(st.sampled_from(every), st.sampled_from(EVERY_TYPE)), min_size=1, max_size=3)

    def apply(changes):
        body = base
        for path, new in changes:
            try:
                body = replaced(body, path, new)
            except (KeyError, IndexError, TypeError):  # an earlier edit removed the path
                pass
        return json.dumps(body).encode()

    return edits.map(apply)


@pytest.fixture(scope="module")
def typed_srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    with serve(tok, ScriptedModel(tok, script), ctx=1024, tokens=8) as s:
        yield s


def test_rich_bodies_are_answered(typed_srv):
    """The typed pass starts from bodies the server answers."""
    client = Client(typed_srv.url)
    for api, path in (("chat", "/v1/chat/completions"), ("completions", "/v1/completions"),
                      ("anthropic", "/v1/messages"), ("responses", "/v1/responses")):  # fmt: skip
        status, _, data = client.post(path, json.dumps(RICH[api]).encode())
        assert status == 200, (api, data[:300])


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,api",
    [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/v1/messages", "anthropic"),
        ("/v1/responses", "responses"),
    ],
)
def test_fuzz_typed(typed_srv, path, api):
    srv = typed_srv
    client = Client(srv.url)
    counts: dict = {}
    # every path with every JSON type once, then random combinations
    for p in sorted(set(paths(RICH[api])), key=repr):
        for new in EVERY_TYPE:
            status = check(srv, client, path, json.dumps(replaced(RICH[api], p, new)).encode(), api)
            counts[status] = counts.get(status, 0) + 1

    @SETTINGS
    @given(typed_bodies(api))
    def run(body):
        status = check(srv, client, path, body, api)
        counts[status] = counts.get(status, 0) + 1

    run()
    print(f"{path} typed: {sum(counts.values())} bodies, statuses {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES and counts.get(400, 0) > 0 and counts.get(200, 0) > 0, counts
    assert srv.engine._worker.is_alive()


# --------------------------------------------------------------------------- field pass
# Every field of every API's JSON Schema (serve/validate.py, which holds serve/fields.py's
# table too) gets a value of each JSON type it does not allow, placed into the API's rich
# body: each must be a 400 naming that field, never an answer.  The paths come from the
# schemas, so a new field is covered the moment it is declared; docs/http-api.md §10's
# tables and the schemas must list the same fields.
from ds4mlx.serve.validate import SCHEMAS, field_path  # noqa: E402

_SAMPLE = {"null": None, "boolean": True, "integer": 7, "number": 1.5, "string": "x", "array": [], "object": {}}


def schema_fields(node: dict, path: tuple = ()):
    """(path, schema) of every field a schema declares; "[]" is any item of an array,
    "*" any value of a map."""
    if path:
        yield path, node
    for branch in [node, *node.get("anyOf", [])]:
        for key, child in branch.get("properties", {}).items():
            yield from schema_fields(child, path + (key,))
        for key, part in (("items", "[]"), ("additionalProperties", "*")):
            if isinstance(branch.get(key), dict):
                yield from schema_fields(branch[key], path + (part,))


def allowed_types(node: dict) -> set[str] | None:
    """The JSON types a field may have; None when any value is (nothing to get wrong)."""
    if "anyOf" in node:
        out: set[str] = set()
        for branch in node["anyOf"]:
            types = allowed_types(branch)
            if types is None:
                return None
            out |= types
        return out
    if "enum" in node:
        return {next(t for t, v in _SAMPLE.items() if _json_kind(v) == _json_kind(e)) for e in node["enum"]}
    if "type" not in node:
        return None
    types = set(node["type"] if isinstance(node["type"], list) else [node["type"]])
    return types | {"integer"} if "number" in types else types


def _json_kind(v) -> str:
    return "boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else type(v).__name__


def wrong_values(node: dict) -> list:
    """A value of each JSON type the field does not allow; a string the field's named
    values do not include."""
    types = allowed_types(node)
    if types is None:
        return []
    out = [v for t, v in _SAMPLE.items() if t not in types]
    if "enum" in node and "string" in types:
        out.append("no-such-value")
    return out


def placed(body, pattern: tuple, value):
    """(concrete path, body with value there): the place reached through the most nodes
    the body already has (missing objects and arrays are made)."""
    best = None

    def walk(node, rest, at, made):
        nonlocal best
        if not rest:
            if best is None or made < best[0]:
                best = (made, at)
            return
        head = rest[0]
        if head == "[]":
            items = node if isinstance(node, list) else []
            for i, item in enumerate(items):
                walk(item, rest[1:], at + (i,), made)
            if not items:
                walk(None, rest[1:], at + (0,), made + 1)
        else:
            key = "15" if head == "*" else head  # a map's key: a token id
            inside = node.get(key) if isinstance(node, dict) else None
            walk(inside, rest[1:], at + (key,), made + (inside is None))

    walk(body, pattern, (), 0)
    return best[1], put(body, best[1], value)


def put(node, at: tuple, value):
    if not at:
        return value
    head = at[0]
    if isinstance(head, int):
        out = list(node) if isinstance(node, list) else []
        out[head : head + 1] = [put(out[head] if head < len(out) else None, at[1:], value)]
        return out
    out = dict(node) if isinstance(node, dict) else {}
    out[head] = put(out.get(head), at[1:], value)
    return out


FIELD_CASES = [
    (api, pattern, value)
    for api in SCHEMAS
    for pattern, node in sorted(set((p, json.dumps(n, sort_keys=True)) for p, n in schema_fields(SCHEMAS[api])))
    for value in wrong_values(json.loads(node))
]


def test_every_field_gets_wrong_values():
    """The pass reaches every API and most fields (the count a floor against a schema
    walk that silently stops finding fields)."""
    per_api = {api: len({p for a, p, _ in FIELD_CASES if a == api}) for api in SCHEMAS}
    assert all(n >= 40 for n in per_api.values()), per_api


@pytest.mark.parametrize("api", sorted(SCHEMAS))
def test_every_field_of_the_wrong_type_is_a_400_naming_it(typed_srv, api):
    client = Client(typed_srv.url)
    answered = []
    for a, pattern, value in FIELD_CASES:
        if a != api:
            continue
        at, body = placed(RICH[api], pattern, value)
        status, _, data = client.post(ROUTES[api], json.dumps(body).encode())
        name = field_path(at, api)
        if status != 400 or f"'{name}'" not in json.loads(data)["error"]["message"]:
            answered.append((name, value, status, data[:160]))
    assert not answered, f"{len(answered)} wrong values not refused by name: {answered[:20]}"


ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}

TABLE_SECTIONS = {"chat": "10.1", "completions": "10.2", "anthropic": "10.3", "responses": "10.4"}


def table_fields(api: str) -> set[str]:
    """The fields named in the first column of the API's table in docs/http-api.md §10
    (parenthesised remarks left out)."""
    doc = (Path(__file__).parents[1] / "docs" / "http-api.md").read_text()
    section = doc.split(f"\n### {TABLE_SECTIONS[api]} ")[1].split("\n### ")[0]
    out: set[str] = set()
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("| field"):
            continue
        cell, before = line.split("|")[1], None
        while before != cell:
            before, cell = cell, re.sub(r"\([^()]*\)", "", cell)
        out |= set(re.findall(r"`([^`]+)`", cell))
    return out


def _dotted(pattern: tuple) -> str:
    return ".".join(pattern).replace(".[]", "[]")


@pytest.mark.parametrize("api", sorted(SCHEMAS))
def test_the_table_and_the_schema_list_the_same_fields(api):
    """Every field the table names is type-checked (a schema path, or the last name of
    one: `cache_control` sits on blocks and tools), and every top-level field of the
    schema is in the table (itself or one of its sub-fields)."""
    declared = {_dotted(p) for p, _ in schema_fields(SCHEMAS[api])}
    documented = table_fields(api)
    unchecked = {f for f in documented if f not in declared and not any(d.endswith("." + f) for d in declared)}
    assert not unchecked, unchecked
    undocumented = {
        k
        for k in SCHEMAS[api]["properties"]
        if not any(f == k or f.startswith((k + ".", k + "[]")) for f in documented)
    }
    assert not undocumented, undocumented
