"""Structured output through llguidance (ds4mlx/runtime/structured.py, docs/http-api.md §10.7).

On the random-weight demo model (its free text is gibberish, so the grammar does all
the work): a json_schema with nested objects, arrays, enums and required keys gives
JSON that validates against the schema on 20 of 20 seeds, streamed and not; the
reasoning stays free with thinking on; the OpenAI SDK's `chat.completions.parse`
and pydantic-ai get a parsed object; each API's field and each grammar kind reaches the sampler;
a grammar that does not compile is a 400 naming its field."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve_demo  # noqa: E402
from test_server_http import call, parse_sse  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "owner": {
            "type": "object",
            # bounded sizes: a random model never ends a free string or number (llguidance
            # bounds a string by maxLength, not an integer by maximum)
            "properties": {"city": {"type": "string", "maxLength": 6}, "age": {"enum": [1, 2, 30]}},
            "required": ["city", "age"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "kind", "owner", "tags", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
U = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def srv():
    with serve_demo(ctx=1024, tokens=160) as s:
        yield s


@pytest.fixture(scope="module")
def srv16():
    """The demo under the GPU weight policy (dtype None: 16-bit weights), shared by the cases
    that take it."""
    with serve_demo(dtype=None, ctx=1024, tokens=80) as s:
        yield s


def chat(srv, **extra):
    body = {"messages": U, "reasoning_effort": "none", "temperature": 1.0, "min_p": 0.0, **extra}
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    assert st == 200, text
    return text


def streamed_content(text: str) -> tuple[str, str]:
    chunks = [json.loads(d) for k, d in parse_sse(text) if k != "comment" and d != "[DONE]"]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    return content, reasoning


@pytest.mark.slow  # 20 generations a stream mode: ~40 s of CPU each
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_valid_on_20_seeds(srv, stream):
    for seed in range(1, 21):
        text = chat(srv, response_format=FORMAT, seed=seed, stream=stream)
        if stream:
            content, _ = streamed_content(text)
        else:
            choice = json.loads(text)["choices"][0]
            content = choice["message"]["content"]
            assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(content), SCHEMA)


def test_free_text_is_not_json(srv):  # the oracle: without the grammar the demo model writes gibberish
    content = json.loads(chat(srv, seed=1, max_tokens=24))["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(content), SCHEMA)


def test_thinking_reasoning_is_free_and_the_answer_constrained(srv):
    body = {"messages": U, "response_format": {"type": "json_object"}, "seed": 3, "stream": True, "max_tokens": 160}
    st, _, text = call(srv.url, "/v1/chat/completions", {**body, "reasoning_effort": "high"})
    assert st == 200
    content, reasoning = streamed_content(text)
    # the demo model may never close its think block; when it does, the answer is an object
    if content:
        assert isinstance(json.loads(content), dict)
    assert reasoning or content


@pytest.mark.parametrize(
    "api,extra,check",
    [
        ("chat", {"response_format": {"type": "json_object"}}, None),  # free keys: may not end; reaches the sampler
        ("chat", {"guided_regex": "[a-c]{3}x"}, lambda t: re.fullmatch("[a-c]{3}x", t)),
        ("chat", {"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ("chat", {"guided_json": json.dumps({"enum": [1, 2]})}, lambda t: json.loads(t) in (1, 2)),
        ("chat", {"json_schema": {"type": "boolean"}}, lambda t: json.loads(t) in (True, False)),
        ("chat", {"guided_grammar": 'start: "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
        ("chat", {"grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch("x[0-9]", t)),
        ("completions", {"response_format": FORMAT}, None),
        ("responses", {"text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}}}, None),
        ("anthropic", {"output_format": {"type": "json_schema", "schema": SCHEMA}}, None),
    ],
)
def test_every_field_and_grammar_kind(srv, api, extra, check):
    route = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    route |= {"responses": "/v1/responses", "anthropic": "/v1/messages"}
    base = {
        "chat": {"messages": U, "reasoning_effort": "none"},
        "completions": {"prompt": "JSON:"},
        "responses": {"input": "JSON please", "reasoning": {"effort": "none"}},
        "anthropic": {"messages": U, "max_tokens": 160, "thinking": {"type": "disabled"}},
    }[api]
    st, _, text = call(srv.url, route[api], {**base, **extra, "seed": 2, "temperature": 1.0})
    assert st == 200, text
    out = json.loads(text)
    if api == "chat":
        answer = out["choices"][0]["message"]["content"]
    elif api == "completions":
        answer = out["choices"][0]["text"]
    elif api == "responses":
        answer = "".join(p["text"] for o in out["output"] if o["type"] == "message" for p in o["content"])
    else:
        answer = "".join(b["text"] for b in out["content"] if b["type"] == "text")
    if "json_object" in json.dumps(extra):
        assert answer.startswith("{")
    elif check is None:
        jsonschema.validate(json.loads(answer), SCHEMA)
    else:
        assert check(answer), answer


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, None),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: ???"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_bad_grammar_is_a_400_naming_its_field(srv, extra, field):
    st, _, text = call(srv.url, "/v1/chat/completions", {"messages": U, **extra})
    err = json.loads(text)["error"]
    assert st == 400, text
    assert err["param"] == (field or "response_format.json_schema.schema") and err["message"].startswith(
        "Invalid value for '"
    ), err


class Owner(BaseModel):
    city: Literal["Oslo", "Rome"]
    vip: bool


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    owner: Owner
    ok: bool


def test_openai_sdk_parse_gets_an_object(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.parse(
        model="deepseek-v4-flash",
        messages=U,
        response_format=Pet,
        reasoning_effort="none",
        seed=4,
        max_tokens=160,
        extra_body={"min_p": 0.0},
    )
    assert isinstance(r.choices[0].message.parsed, Pet), r.choices[0].message


def test_pydantic_ai_agent_gets_an_object(srv):
    """pydantic-ai's native structured output (its `response_format` json_schema) parses."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.profiles.openai import OpenAIModelProfile
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        "deepseek-v4-flash",
        provider=OpenAIProvider(base_url=srv.url + "/v1", api_key="unused"),
        profile=OpenAIModelProfile(supports_json_schema_output=True),  # an unknown model name: say so
    )
    settings = {"seed": 4, "max_tokens": 160, "extra_body": {"reasoning_effort": "none", "min_p": 0.0}}
    agent = Agent(model, output_type=NativeOutput(Pet), model_settings=settings, retries=0)
    assert isinstance(agent.run_sync("Describe a pet as JSON.").output, Pet)


# the last case (16-bit weights with thinking, ~17 CPU s on the CPU) in the slow tier; (None, 5) keeps the
# GPU weight policy in the fast one
@pytest.mark.slow_after(4)
@pytest.mark.parametrize("dtype,seed,thinking", [("auto", 3, False), ("auto", 11, False), (None, 5, False),
                                                 ("auto", 2, True), (None, 7, True)])  # fmt: skip
def test_pipelined_grammar_draws_the_host_loops_tokens(request, srv, dtype, seed, thinking):
    """A job with a grammar and no tools runs the lookahead loop (the mask computed while
    the device runs the step: structured.GrammarSampler), with thinking too (the reasoning
    free up to its closing token).  Its tokens are those of the plain host loop: mask (once
    the reasoning closed), draw with the job's seed, read, step; also under the GPU weight
    policy (dtype None: 16-bit weights)."""
    _pipelined_equals_host(srv if dtype == "auto" else request.getfixturevalue("srv16"), seed, thinking)


def _pipelined_equals_host(srv, seed: int, thinking: bool) -> None:
    import mlx.core as mx

    from ds4mlx.chat import markers as M
    from ds4mlx.engine import Job
    from ds4mlx.runtime.events import Finish
    from ds4mlx.runtime.sampling import Penalties, Sampler, SamplingParams
    from ds4mlx.runtime.structured import Constraint, Grammar

    tok, grammar = srv.tok, Grammar("json_schema", SCHEMA)
    close = tok.encode(M.THINK_CLOSE)[0]
    # with thinking, a bias on the reasoning's close so that a random model ends it
    bias = ((close, 9.0),) if thinking else ()
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed, logit_bias=bias)
    if thinking:
        ids = tok.encode(M.BOS + M.USER + "Describe a pet as JSON." + M.ASSISTANT + M.THINK_OPEN)
    else:
        ids = tok.encode("Describe a pet as JSON: ")
    job = Job(prompt_text=tok.decode(ids), prompt_ids=list(ids), api="chat" if thinking else "completions",
              raw=not thinking, thinking="high" if thinking else "none", max_tokens=80, params=params,
              grammar=grammar, logprobs=0)  # fmt: skip
    fin = [ev for ev in srv.engine.generate(job) if isinstance(ev, Finish)][0]
    got = [t.token for t in fin.logprobs]

    session = srv.model.new_session(1024)
    logits = mx.array(session.prefill(ids))
    vocab = int(logits.shape[-1])
    pen = Penalties(params, vocab, session.tokens) if params.penalised else None
    constraint, sampler, want = Constraint(grammar, tok, vocab), Sampler(seed), []
    answering = not thinking
    while len(want) < 80:
        x = constraint.apply(logits) if answering else logits
        t = int(sampler.sample(x, params, want, None, pen).item())
        if t == tok.eos_id:
            break
        if answering:
            constraint.consume(t)
        answering = answering or t == close
        want.append(t)
        logits = session.step(t)
    assert got == want and fin.reason == "stop", (fin.reason, tok.decode(got), tok.decode(want))
    answer = tok.decode(got[got.index(close) + 1 :] if thinking else got)
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_instructor_gets_an_object(srv):
    """instructor's `Mode.JSON_SCHEMA` (`response_format` json_schema) parses.  Its tool modes
    send no `strict` (1.17 sends none even in TOOLS_STRICT), and a call that is not strict is
    the model's own: the random demo's is not JSON."""
    instructor = pytest.importorskip("instructor")
    import openai

    client = instructor.from_openai(
        openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120),
        mode=instructor.Mode.JSON_SCHEMA,
    )
    pet = client.chat.completions.create(
        model="deepseek-v4-flash",
        messages=U,
        response_model=Pet,
        max_retries=0,
        seed=4,
        max_tokens=160,
        extra_body={"reasoning_effort": "none", "min_p": 0.0},
    )
    assert isinstance(pet, Pet), pet
