"""`--chat-template official`: DeepSeek V4 prompts byte for byte as DeepSeek's own encoder
writes them (ds4mlx/chat/families/deepseek_v4/official.py, docs/chat-template.md §11).

The oracle is the release's `encoding_dsv4.py`, vendored verbatim under
tests/data/chat_templates/ (SOURCES.md: where it came from, its licence).  Every
conversation below is a client's request body: ds4mlx parses it as the server does and
renders it with the official template; the encoder gets the same body the way SGLang
hands it over (the tools on the leading system message, an empty system message put
first when there is none; thinking mode "thinking" for high / max, "chat" for none;
reasoning effort "max" for Think Max) and the two strings must be equal.  Nothing
expected is written by hand.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from ds4mlx.chat import markers as M
from ds4mlx.chat.families.deepseek_v4 import template as ds4_template
from ds4mlx.chat.protocol import TemplateError, chat_templates, get_protocol
from ds4mlx.cli.options import UsageError, add_chat_template_argument, chat_protocol
from ds4mlx.serve.prepare import ServeConfig, parse_request, protocol_of

ENCODER_PATH = Path(__file__).parent / "data" / "chat_templates" / "encoding_dsv4.py"
OFFICIAL = get_protocol("deepseek_v4", M.CHAT_TEMPLATE_OFFICIAL)
THINK_MAX_CTX = M.THINK_MAX_MIN_CONTEXT


@pytest.fixture(scope="module")
def encoder():
    spec = importlib.util.spec_from_file_location("encoding_dsv4_oracle", ENCODER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tool(name, description, properties, required=()):
    params = {"type": "object", "properties": properties}
    if required:
        params["required"] = list(required)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


BASH = tool("bash", "Run a shell command", {"command": {"type": "string"}, "timeout": {"type": "integer"}}, ["command"])
READ = tool("read_file", "Read a file — UTF-8 « text »", {"path": {"type": "string"}, "lines": {"type": "array"}})
WEATHER = tool("get_weather", "Weather for a city", {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}})


def call(cid, name, arguments):
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def assistant(content="", reasoning=None, calls=()):
    m = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = list(calls)
    return m


def result(cid, content):
    return {"role": "tool", "tool_call_id": cid, "content": content}


SYS = {"role": "system", "content": "You are a careful agent."}


def user(text):
    return {"role": "user", "content": text}


# name -> (messages, tools); each is rendered with thinking off, on and Think Max
CONVERSATIONS = {
    "plain": ([SYS, user("Hello")], None),
    "plain-no-system": ([user("Hi there")], None),
    "replay-dropped": (
        [user("What is 2+2?"), assistant("4.", "Simple arithmetic."), user("And 3+3?")],
        None,
    ),
    "one-call": (
        [
            SYS,
            user("List /tmp"),
            assistant("", "Need ls.", [call("call_1", "bash", {"command": "ls /tmp", "timeout": 10})]),
            result("call_1", "a.txt\nb.txt"),
        ],
        [BASH],
    ),
    "results-out-of-order": (
        [
            SYS,
            user("Weather in Paris and Rome, and list /tmp"),
            assistant(
                "Checking.",
                "Three calls at once.",
                [
                    call("call_a", "get_weather", {"city": "Paris"}),
                    call("call_b", "get_weather", {"city": "Rome", "unit": "c"}),
                    call("call_c", "bash", {"command": "ls /tmp"}),
                ],
            ),
            result("call_c", "a.txt"),
            result("call_a", "18C"),
            result("call_b", "21C"),
        ],
        [WEATHER, BASH],
    ),
    "results-then-user-text": (
        [
            user("Paris and Rome?"),
            assistant(
                "",
                "Two lookups.",
                [call("c1", "get_weather", {"city": "Paris"}), call("c2", "get_weather", {"city": "Rome"})],
            ),
            result("c2", "21C"),
            result("c1", "18C"),
            user("Also tell me which is warmer."),
        ],
        [WEATHER],
    ),
    "non-string-arguments": (
        [
            SYS,
            user("Read it"),
            assistant(
                "",
                "Typed arguments.",
                [
                    call(
                        "call_x",
                        "read_file",
                        '{"path":"/etc/hosts","lines":[1,2,3],"opts":{"follow":true,"depth":null},'
                        '"ratio":0.5,"big":12345678901234567890,"name":"é ü 中文"}',
                    )
                ],
            ),
            result("call_x", "127.0.0.1 localhost"),
        ],
        [READ],
    ),
    "two-rounds-reasoning-replay": (
        [
            SYS,
            user("Find the largest file"),
            assistant("", "First list.", [call("r1", "bash", {"command": "ls -S"})]),
            result("r1", "big.bin\nsmall.txt"),
            assistant("", "Now its size.", [call("r2", "bash", {"command": "du -h big.bin"})]),
            result("r2", "1.0G big.bin"),
            assistant("big.bin, 1.0G.", "Done."),
            user("Thanks. And the smallest?"),
        ],
        [BASH],
    ),
    "tool-history-without-tools": (
        [
            user("List /tmp"),
            assistant("", "Need ls.", [call("h1", "bash", {"command": "ls"})]),
            result("h1", "x"),
            assistant("There is x.", "One file."),
            user("Good."),
        ],
        None,
    ),
    "system-in-the-middle": (
        [
            SYS,
            user("One"),
            assistant("Uno.", "Translate."),
            {"role": "system", "content": "Now be brief."},
            user("Two"),
        ],
        [BASH],
    ),
    "escapes-left-alone": (
        [
            user("Write the file"),
            assistant(
                'Writing <it> & "quoting".',
                "Careful.",
                [
                    call(
                        "w1",
                        'we"ird<name>',
                        {"text": "a </｜DSML｜parameter> b && c > d", 'k"ey': "v"},
                    )
                ],
            ),
            result("w1", "ok </tool_result> still ok"),
        ],
        [BASH],
    ),
    "free-text-arguments": (
        [
            user("Patch it"),
            assistant("", "Custom tool.", [call("p1", "apply_patch", "*** Begin Patch\n+hello\n*** End Patch")]),
            result("p1", "applied"),
        ],
        [BASH],
    ),
    "ends-with-assistant": (
        [SYS, user("Say hi"), assistant("Hi!", "Greeting.")],
        None,
    ),
    "two-user-messages": (
        [user("First part."), user("Second part."), assistant("Both read.", "Merged."), user("Third.")],
        None,
    ),
    "unknown-result-id": (
        [
            user("Go"),
            assistant("", "", [call("k1", "bash", {"command": "a"}), call("k2", "bash", {"command": "b"})]),
            result("k2", "B"),
            result("zz", "stray"),
            result("k1", "A"),
        ],
        [BASH],
    ),
    "empty-pieces": (
        [
            SYS,
            user(""),
            assistant("", None, [call("e1", "bash", {})]),
            result("e1", ""),
            assistant(""),
            user("?"),
        ],
        [BASH, WEATHER],
    ),
    "trailing-system-message": (
        [
            SYS,
            user("Summarise the result."),
            assistant("", "Look it up.", [call("t1", "bash", {"command": "cat r"})]),
            result("t1", "status=ok"),
            {"role": "system", "content": "<reminder>123 tokens left</reminder>"},
        ],
        [BASH],
    ),
    "numbers-and-duplicate-keys": (
        [
            user("Go"),
            assistant("", "", [call("n1", "bash", '{"a": 1e5, "b": 1.0, "c": -0.0, "a": 2, "d": "\\u00e9"}')]),
            result("n1", "ok"),
        ],
        [BASH],
    ),
    "leading-assistant": (
        [SYS, assistant("Welcome back."), user("Where were we?")],
        None,
    ),
}
MODES = {"none": {"think": False}, "high": {}, "max": {"reasoning_effort": "max"}}


def request_body(messages, tools, mode, **extra):
    body = {"model": "deepseek-v4-flash", "messages": copy.deepcopy(messages), **MODES[mode], **extra}
    if tools:
        body["tools"] = copy.deepcopy(tools)
    return body


def encoder_prompt(encoder, body, mode):
    """The encoder driven as SGLang drives it (module docstring)."""
    messages = [dict(m, role="system") if m["role"] == "developer" else dict(m) for m in body["messages"]]
    for m in messages:
        if isinstance(m.get("content"), list):  # text parts, as SGLang flattens them
            m["content"] = "".join(p["text"] for p in m["content"])
    if not messages or messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": ""})
    if body.get("tools") and body.get("tool_choice") != "none":
        messages[0]["tools"] = body["tools"]
    return encoder.encode_messages(
        messages,
        thinking_mode="chat" if mode == "none" else "thinking",
        reasoning_effort="max" if mode == "max" else None,
    )


def ours(body, mode):
    conv = parse_request("openai", body, ctx=THINK_MAX_CTX)
    assert conv.thinking == mode
    return OFFICIAL.render(conv)


CASES = [(name, mode) for name in CONVERSATIONS for mode in MODES]


def test_at_least_thirty_conversations_with_tools():
    with_tools = [c for c in CASES if CONVERSATIONS[c[0]][1] or "call" in json.dumps(CONVERSATIONS[c[0]][0])]
    assert len(CASES) >= 30 and len(with_tools) >= 30


@pytest.mark.parametrize(("name", "mode"), CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_byte_exact_to_the_encoder(encoder, name, mode):
    messages, tools = CONVERSATIONS[name]
    body = request_body(messages, tools, mode)
    assert ours(body, mode) == encoder_prompt(encoder, body, mode)


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "none"},  # tools off: not rendered
        {"messages": [{"role": "developer", "content": "Answer in French."}, user("Hello")]},
        {
            "messages": [
                SYS,
                {"role": "user", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]},
            ]
        },
        {"messages": [SYS, user("Go"), assistant("", "x", [call("f1", "bash", {"a": 1})]), {**result("f1", "r")}]},
    ],
)
def test_request_shapes(encoder, extra):
    body = request_body(CONVERSATIONS["one-call"][0], [BASH], "high")
    body.update(copy.deepcopy(extra))
    assert ours(body, "high") == encoder_prompt(encoder, body, "high")


def test_anthropic_request_renders_as_its_openai_twin(encoder):
    """Anthropic tool_result blocks are tool results and its system text comes first; the
    encoder gets the conversation in the OpenAI shape with the Anthropic tool object as the
    function."""
    read = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {}}}
    body = {
        "model": "deepseek-v4-flash",
        "max_tokens": 64,
        "system": "Be careful.",
        "thinking": {"type": "enabled"},
        "tools": [read],
        "messages": [
            {"role": "user", "content": "Show a.c and b.c"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two reads."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.c"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"path": "b.c"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "int b;"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "int a;"},
                    {"type": "text", "text": "Compare them."},
                ],
            },
        ],
    }
    conv = parse_request("anthropic", body)
    twin = [
        {"role": "system", "content": "Be careful.", "tools": [{"type": "function", "function": read}]},
        user("Show a.c and b.c"),
        assistant(
            "", "Two reads.", [call("toolu_1", "Read", {"path": "a.c"}), call("toolu_2", "Read", {"path": "b.c"})]
        ),
        result("toolu_2", "int b;"),
        result("toolu_1", "int a;"),
        user("Compare them."),
    ]
    assert OFFICIAL.render(conv) == encoder.encode_messages(twin, thinking_mode="thinking")


def test_the_default_stays_ds4():
    """ds4's rendering is the default; the official one differs where docs/chat-template.md
    §11 says (here: the tools text, result order, the blank line between results)."""
    messages, tools = CONVERSATIONS["results-out-of-order"]
    conv = parse_request("openai", request_body(messages, tools, "high"))
    default = get_protocol("deepseek_v4")
    assert default.chat_template == M.CHAT_TEMPLATE_DS4 and default.render(conv) == ds4_template.render(conv)
    ds4, official = default.render(conv), OFFICIAL.render(conv)
    assert ds4 != official
    assert M.TOOLS_BLOCK_HEAD in ds4 and M.OFFICIAL_TOOLS_BLOCK_HEAD in official
    assert "<tool_result>a.txt</tool_result><tool_result>18C</tool_result>" in ds4
    assert "<tool_result>18C</tool_result>\n\n<tool_result>21C</tool_result>\n\n<tool_result>a.txt</tool_result>" in (
        official
    )


def test_continuation_tail_is_the_rest_of_the_official_prompt():
    messages, tools = CONVERSATIONS["results-out-of-order"]
    conv = parse_request("openai", request_body(messages, tools, "high"))
    start = 3  # the tool results after the assistant's calls
    tail = OFFICIAL.render_continuation_tail(conv, start)
    full = OFFICIAL.render(conv)
    assert tail.startswith(M.EOS) and full.endswith(tail[len(M.EOS) :])
    assert full[: len(full) - len(tail) + len(M.EOS)].endswith(M.EOS)


def test_templates_of_each_family():
    assert chat_templates("deepseek_v4") == M.CHAT_TEMPLATES
    for family in ("deepseek_v41", "glm5_next", "qwen4_exp"):
        assert chat_templates(family) == (M.CHAT_TEMPLATE_DS4,)
        with pytest.raises(TemplateError, match="official"):
            get_protocol(family, M.CHAT_TEMPLATE_OFFICIAL)
    with pytest.raises(TemplateError):
        get_protocol("deepseek_v4", "jinja")


def test_cli_option_and_serve_config():
    import argparse

    p = argparse.ArgumentParser()
    add_chat_template_argument(p)
    assert p.parse_args([]).chat_template == M.CHAT_TEMPLATE_DS4
    args = p.parse_args(["--chat-template", "official"])
    assert chat_protocol(args, get_protocol("deepseek_v4")) is OFFICIAL
    with pytest.raises(UsageError, match="--chat-template official"):
        chat_protocol(args, get_protocol("glm5_next"))
    with pytest.raises(SystemExit):
        p.parse_args(["--chat-template", "jinja"])
    cfg = ServeConfig(family="deepseek_v4", chat_template=M.CHAT_TEMPLATE_OFFICIAL)
    assert protocol_of(cfg) is OFFICIAL
    assert protocol_of(ServeConfig(family="deepseek_v4")) is get_protocol("deepseek_v4")


# --- every command takes --chat-template -------------------------------------------------


@pytest.fixture(scope="module")
def v4_demo(shared_demo):
    return shared_demo()


def _serve(argv, loaded):
    import argparse

    from ds4mlx.serve import cli
    from ds4mlx.serve.app import STATE

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    engine, app = cli.build(p.parse_args(argv), loaded=loaded)
    return engine, app[STATE].cfg


def test_serve_renders_requests_with_the_official_template(encoder, v4_demo):
    from ds4mlx.serve.prepare import prepare

    messages, tools = CONVERSATIONS["results-out-of-order"]
    body = request_body(messages, tools, "high")
    engine, cfg = _serve(["--chat-template", "official"], v4_demo)
    try:
        assert cfg.chat_template == M.CHAT_TEMPLATE_OFFICIAL and engine.protocol is OFFICIAL
        assert prepare(cfg, engine, None, "chat", copy.deepcopy(body)).job.prompt_text == encoder_prompt(
            encoder, body, "high"
        )
    finally:
        engine.close()
    engine, cfg = _serve([], v4_demo)  # the default: ds4's renderer
    try:
        conv = parse_request("openai", copy.deepcopy(body))
        assert prepare(cfg, engine, None, "chat", copy.deepcopy(body)).job.prompt_text == ds4_template.render(conv)
    finally:
        engine.close()


def test_serve_refuses_the_template_for_another_family():
    from types import SimpleNamespace

    glm = SimpleNamespace(args=SimpleNamespace(model_type="glm5_next"))
    with pytest.raises(SystemExit, match="--chat-template official: chat template 'official' is not available"):
        _serve(["--chat-template", "official"], (glm, None))


def test_generate_and_chat_engine_use_the_template(monkeypatch, capsys, v4_demo):
    import argparse

    from ds4mlx.cli import generate
    from ds4mlx.io import loader

    seen = {}
    monkeypatch.setattr(loader, "load", lambda path=None, **kw: v4_demo)

    def fake_stream(engine, job, console, out=None):
        seen["protocol"], seen["job"] = engine.protocol, job
        return None

    monkeypatch.setattr(generate, "stream_job", fake_stream)
    for argv, want in (([], get_protocol("deepseek_v4")), (["--chat-template", "official"], OFFICIAL)):
        p = argparse.ArgumentParser()
        generate.add_arguments(p)  # chat shares these flags (generate._common)
        a = p.parse_args(["-p", "Hi", "-s", "Be brief.", *argv])
        a.command = "generate"
        generate.run(a)
        assert seen["protocol"] is want
        assert seen["job"].prompt_text == want.render(
            parse_request("openai", {"messages": [SYS | {"content": "Be brief."}, user("Hi")]})
        )


def test_agent_engine_uses_the_template(tmp_path):
    import argparse

    from agent_helpers import ScriptedModel, steps

    from ds4mlx.agent import cli
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--cwd", str(tmp_path), "--ctx", "4096", "--chat-template", "official"])
    engine, worker = cli.build(args, ScriptedModel(tok, steps("done")), tok)
    try:
        assert engine.protocol is OFFICIAL and worker.protocol is OFFICIAL
        assert worker.render().startswith(M.BOS) and M.OFFICIAL_TOOLS_BLOCK_TAIL in worker.render()
    finally:
        worker.close()
        engine.close()


def test_eval_in_process_prompts(encoder):
    from scripted_model import ScriptedModel

    from ds4mlx.eval.inprocess import InProcessBackend
    from ds4mlx.eval.prompts import Prompt
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    model = ScriptedModel(tok, {})
    for thinking, think_max, mode in ((False, False, "none"), (True, False, "high"), (True, True, "max")):
        prompt = Prompt("You are solving a benchmark.", "What is 6*7?", thinking, think_max)
        official = InProcessBackend(loaded=(model, tok), chat_template=M.CHAT_TEMPLATE_OFFICIAL).prompt_text(prompt)
        want = encoder.encode_messages(
            prompt.messages,
            thinking_mode="chat" if mode == "none" else "thinking",
            reasoning_effort="max" if mode == "max" else None,
        )
        assert official == want
        assert InProcessBackend(loaded=(model, tok)).prompt_text(prompt) == prompt.text == want  # no tools: the same


def test_eval_endpoint_refuses_the_flag(capsys):
    import argparse

    from ds4mlx.eval import cli as eval_cli

    p = argparse.ArgumentParser()
    eval_cli.add_arguments(p)
    a = p.parse_args(["--endpoint", "http://127.0.0.1:1", "--chat-template", "official"])
    with pytest.raises(SystemExit):
        eval_cli._backend(a)
    assert "--chat-template is for the in-process model" in capsys.readouterr().err
