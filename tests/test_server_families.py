"""The official SDKs against `ds4mlx serve` once per model family, each on that
family's random-weight demo model: the family's protocol renders the prompt,
`/v1/models` reports its id, and every route answers with well-formed objects."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lazy_modules import lazy

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import serve  # noqa: E402

anthropic = lazy("anthropic")
openai = lazy("openai")

FAMILIES = {
    "deepseek_v4": "deepseek-v4-flash",
    "deepseek_v41": "deepseek-v4.1-flash",
    "glm_moe_dsa": "glm-5.2",
    "glm5_next": "glm-5.3-flash",
    "qwen4_exp": "qwen3.8-flash-next",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, shared_demo):
    from ds4mlx.chat.protocol import protocol_for_model

    model, tok = shared_demo(f"demo:{request.param}")
    protocol = protocol_for_model(model)
    assert (protocol.family, protocol.model_id) == (request.param, FAMILIES[request.param])
    with serve(tok, model, ctx=1024) as s:
        s.protocol = protocol
        yield s


def test_sdks_drive_every_route(family_server):
    url, proto = family_server.url, family_server.protocol
    oc = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    ac = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)

    ids = [m.id for m in oc.models.list().data]
    assert ids[0] == proto.model_id
    model = proto.model_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]

    r = oc.chat.completions.create(model=model, messages=msgs, max_tokens=4, seed=1)
    assert r.id.startswith("chatcmpl-") and r.model == model and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 3 and 0 < r.usage.completion_tokens <= 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(
        oc.chat.completions.create(
            model=model, messages=msgs, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 4

    c = oc.completions.create(model=model, prompt="Hello", max_tokens=4)
    assert c.id.startswith("cmpl-") and c.choices[0].finish_reason in ("stop", "length")

    m = ac.messages.create(model=model, max_tokens=4, system="Be brief.", messages=msgs[1:])
    assert m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert m.usage.output_tokens <= 4
    with ac.messages.stream(model=model, max_tokens=4, messages=msgs[1:]) as st:
        assert st.get_final_message().stop_reason in ("end_turn", "max_tokens", "tool_use")

    resp = oc.responses.create(model=model, input="Hello", instructions="Be brief.", max_output_tokens=4)
    assert resp.id.startswith("resp_") and resp.status in ("completed", "incomplete")
    assert resp.usage.output_tokens <= 4


def test_serve_think_level_flag_sets_the_v41_default_effort(shared_demo):
    import argparse

    from ds4mlx.serve import cli
    from ds4mlx.serve.app import STATE
    from ds4mlx.serve.prepare import prepare

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    loaded = shared_demo("demo:deepseek_v41")
    engine, app = cli.build(p.parse_args(["--think-level", "30"]), loaded=loaded)
    try:
        state = app[STATE]
        body = {"messages": [{"role": "user", "content": "Hi"}]}
        text = prepare(state.cfg, engine, None, "chat", body).job.prompt_text
        assert "Reasoning Effort: 30" in text
        explicit = prepare(state.cfg, engine, None, "chat", dict(body, reasoning_effort=70)).job.prompt_text
        assert "Reasoning Effort: 70" in explicit  # a request's own effort wins
    finally:
        engine.close()
    with pytest.raises(SystemExit):  # not a numeric-effort family
        cli.build(p.parse_args(["--think-level", "30"]), loaded=shared_demo())
    with pytest.raises(SystemExit):
        p.parse_args(["--think-level", "101"])
