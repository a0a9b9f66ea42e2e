"""The chat protocol registry, DeepSeek V4 as a protocol (the existing modules,
unchanged), and the wiring: the engine and the server pick the protocol from
the loaded model's family, /v1/models reports that family's id and aliases,
and a whole request runs through another family's renderer and parser."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402

from ds4mlx.chat.families.deepseek_v4 import template  # noqa: E402
from ds4mlx.chat.families.deepseek_v4.dsml import parse_output  # noqa: E402
from ds4mlx.chat.families.deepseek_v4.output import OutputParser  # noqa: E402
from ds4mlx.chat.families.deepseek_v4.protocol import DeepSeekV4Protocol  # noqa: E402
from ds4mlx.chat.protocol import families, get_protocol, model_type_of, protocol_for_model  # noqa: E402
from ds4mlx.serve.prepare import parse_request  # noqa: E402

V4 = get_protocol("deepseek_v4")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
BODIES = [
    {
        "model": "deepseek-v4-flash",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    },
    {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Hi"}]},
    {
        "model": "deepseek-v4-flash",
        "reasoning_effort": "max",
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "ls"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "r",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        ],
    },
]


# --------------------------------------------------------------------------- registry


def test_registry_keys_and_model_types():
    assert set(families()) == {"deepseek_v4", "deepseek_v41", "glm_moe_dsa", "glm5_next", "qwen4_exp"}
    for key in families():
        assert get_protocol(key).family == key
    assert get_protocol("glm5_next_text").family == "glm5_next"
    assert get_protocol("qwen4_exp_text").family == "qwen4_exp"
    assert get_protocol(None) is V4 and isinstance(V4, DeepSeekV4Protocol)
    with pytest.raises(KeyError):
        get_protocol("llama")
    ids = {get_protocol(k).model_id for k in families()}
    assert ids == {"deepseek-v4-flash", "deepseek-v4.1-flash", "glm-5.2", "glm-5.3-flash", "qwen3.8-flash-next"}


def test_protocol_for_model():
    ns = SimpleNamespace
    assert protocol_for_model(ns(args=ns(model_type="qwen4_exp"))).family == "qwen4_exp"
    assert protocol_for_model(ns(model=ns(args=ns(model_type="glm_moe_dsa")))).family == "glm_moe_dsa"
    assert protocol_for_model(ns(config={"model_type": "deepseek_v41"})).family == "deepseek_v41"
    assert (
        model_type_of(ns(config={"model_type": "x", "text_config": {"model_type": "glm5_next_text"}}))
        == "glm5_next_text"
    )
    assert (
        protocol_for_model(ns(config={"model_type": "x", "text_config": {"model_type": "glm5_next_text"}})).family
        == "glm5_next"
    )
    assert protocol_for_model(object()).family == "deepseek_v4"  # says nothing: V4


# --------------------------------------------------------------------------- DeepSeek V4 unchanged


@pytest.mark.parametrize("body", BODIES)
def test_v4_protocol_is_the_existing_template(body):
    conv = parse_request("openai", body)
    assert V4.resolve_thinking(conv.thinking, body.get("reasoning_effort")) == conv.thinking
    assert V4.render(conv) == template.render(conv)
    assert V4.uses_tool_context(conv) == template.uses_tool_context(conv)
    if conv.messages[-1].role == "tool":
        assert V4.render_continuation_tail(conv, 2) == template.render_continuation_tail(conv, 2)


def test_v4_parser_force_text_and_completion():
    text = (
        'r</think>hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" '
        'string="true">ls</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    assert V4.parse(text, thinking=True) == parse_output(text, thinking=True)
    p = V4.make_parser(True, True)
    assert type(p) is OutputParser and p.syntaxes is OutputParser(True, True).syntaxes
    assert V4.force_text(None) == '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'
    assert V4.force_text('a"b') == '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a&quot;b">\n'
    assert V4.render_completion("x", "high") == template.render_completion("x", "high")
    assert V4.model_names == ("deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner")


# --------------------------------------------------------------------------- wiring


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def http(url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


QWEN_CALL = "\n\n<tool_call>\n<function=bash>\n<parameter=command>\nls /tmp\n</parameter>\n</function>\n</tool_call>"


def qwen_script(prompt: str) -> str:
    if "<tool_response>" in prompt[prompt.rfind("<|im_start|>user") :]:
        return "Got it.\n</think>\n\nTwo files."
    if "# Tools" in prompt:
        return "Need ls.\n</think>\n\nLet me look." + QWEN_CALL
    return "Simple.\n</think>\n\nHello!"


def test_qwen_family_server_end_to_end(tok):
    model = ScriptedModel(tok, qwen_script)
    with serve(tok, model, ctx=4096, family="qwen4_exp") as s:
        st, listing = http(s.url + "/v1/models")
        assert st == 200 and [m["id"] for m in listing["data"]] == ["qwen3.8-flash-next"]
        assert listing["data"][0]["aliases"] == ["qwen3.8-flash-next-chat", "qwen3.8-flash-next-reasoner"]
        assert http(s.url + "/v1/models/qwen3.8-flash-next-chat")[0] == 200
        assert http(s.url + "/v1/models/deepseek-v4-flash")[0] == 200  # any name is the loaded model (#17)
        msgs = [{"role": "user", "content": "List /tmp"}]
        st, r1 = http(s.url + "/v1/chat/completions", {"model": "qwen3.8-flash-next", "messages": msgs, "tools": TOOLS})
        assert st == 200, r1
        assert model.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
        c = r1["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me look."
        assert c["message"]["reasoning_content"] == "Need ls."
        (call,) = c["message"]["tool_calls"]
        assert call["function"] == {"name": "bash", "arguments": '{"command":"ls /tmp"}'}
        live = len(s.engine.session)
        msgs2 = msgs + [
            {
                "role": "assistant",
                "content": c["message"]["content"],
                "reasoning_content": c["message"]["reasoning_content"],
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "a.txt\nb.txt"},
        ]
        st, r2 = http(
            s.url + "/v1/chat/completions", {"model": "qwen3.8-flash-next", "messages": msgs2, "tools": TOOLS}
        )
        assert st == 200 and r2["choices"][0]["message"]["content"] == "Two files."
        # the re-rendered history is exactly what was sampled: the live session is reused
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == live
        # thinking off by model alias
        st, r3 = http(s.url + "/v1/chat/completions", {"model": "qwen3.8-flash-next-chat", "messages": msgs})
        assert st == 200 and model.prompts[-1].endswith("<think>\n\n</think>\n\n")


def test_v41_family_numeric_reasoning_effort(tok):
    model = ScriptedModel(tok, "Fine.</think>Done.")
    with serve(tok, model, ctx=4096, family="deepseek_v41") as s:
        assert http(s.url + "/v1/models")[1]["data"][0]["id"] == "deepseek-v4.1-flash"
        body = {"model": "deepseek-v4.1-flash", "messages": [{"role": "user", "content": "Hi"}]}
        st, r = http(s.url + "/v1/chat/completions", dict(body, reasoning_effort="40"))
        assert st == 200 and r["choices"][0]["message"]["content"] == "Done."
        assert "<｜System｜>Reasoning Effort: 40 (range 1-100" in model.prompts[-1]
        for bad in ("101", "-1", "1.5", "50x"):
            st, err = http(s.url + "/v1/chat/completions", dict(body, reasoning_effort=bad))
            assert st == 400, (bad, err)
        st, r = http(s.url + "/v1/chat/completions", dict(body, reasoning_effort="0"))
        assert st == 200 and model.prompts[-1].endswith("<｜Assistant｜></think>")


def test_engine_takes_the_protocol_from_the_model(tok):
    from ds4mlx.engine import Engine, Job
    from ds4mlx.runtime.events import Finish

    model = ScriptedModel(
        tok, "r</think>Ok.<tool_call>bash<arg_key>command</arg_key><arg_value>ls</arg_value></tool_call>"
    )
    model.args = SimpleNamespace(model_type="glm5_next")
    engine = Engine(model, tok, ctx=2048)
    try:
        assert engine.protocol.family == "glm5_next"
        job = Job(prompt_text="[gMASK]<sop><|user|>ls<|assistant|><think>", tools_active=True, thinking="max")
        fin = [e for e in engine.generate(job) if isinstance(e, Finish)][0]
        assert job.family == "glm5_next" and fin.reason == "tool_calls"
        assert [(c.name, c.arguments) for c in fin.result.calls] == [("bash", '{"command":"ls"}')]
    finally:
        engine.close()
