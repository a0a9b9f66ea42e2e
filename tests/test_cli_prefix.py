"""--prefix-file (ds4mlx/cli/prefix_file.py): ds4's parser (the cases of antirez/ds4
tests/ds4_prompt_prefix_test.c, every error naming its line), the rendering of a
prefix + prompt for each family byte for byte (hand-written DeepSeek prompts,
GLM / Qwen through their published jinja templates), and prefix + prompt equal
to the same conversation sent to the server in one piece."""

from __future__ import annotations

import argparse

import pytest
from template_helpers import TEMPLATES, render_jinja

from ds4mlx.chat.messages import Conversation, Message
from ds4mlx.chat.protocol import get_protocol
from ds4mlx.cli.options import conversation_head
from ds4mlx.cli.prefix_file import PrefixError, load, parse, with_head
from ds4mlx.cli.think_flags import THINK_MAX_MIN_CONTEXT, resolve
from ds4mlx.serve.prepare import parse_request


def turns(text):
    return [(m.role, m.content) for m in parse(text)]


# ---------------------------------------------------------------- parsing


def test_multiline_turns_and_indented_markers():
    text = "USER: first line\nsecond line\n USER: this stays in the message\nASSISTANT:\tfirst answer\nsecond answer\n"
    assert turns(text) == [
        ("user", "first line\nsecond line\n USER: this stays in the message"),
        ("assistant", "first answer\nsecond answer"),
    ]


def test_pairs_bom_and_crlf():
    text = "\ufeffUSER: one\r\nASSISTANT: two\r\nUSER: three\nASSISTANT: four"
    assert turns(text) == [("user", "one"), ("assistant", "two"), ("user", "three"), ("assistant", "four")]


def test_only_one_blank_after_the_marker_is_dropped():
    assert turns("USER:  two spaces\nASSISTANT:x") == [("user", " two spaces"), ("assistant", "x")]


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "prefix file is empty"),
        ("preamble\nUSER: one\nASSISTANT: two", "line 1 must start with USER: or ASSISTANT:"),
        ("ASSISTANT: one", "line 1: expected USER:"),
        ("USER: one\nUSER: two", "line 2: expected ASSISTANT:"),
        ("USER: one\nmore\nASSISTANT: two\nUSER: three\nUSER: four\nASSISTANT: x", "line 5: expected ASSISTANT:"),
        ("USER: one", "line 1: prefix file must end with an ASSISTANT turn"),
        ("USER: a\nASSISTANT: b\nUSER: c\nstill c", "line 3: prefix file must end with an ASSISTANT turn"),
        ("USER:\nASSISTANT: two", "line 1 has an empty USER turn"),
        ("USER: one\nASSISTANT:\n", "line 2 has an empty ASSISTANT turn"),
        ("USER: one\nASSISTANT: t\x00wo", "line 2 contains a NUL byte"),
    ],
)
def test_malformed_files_name_the_line(text, message):
    with pytest.raises(PrefixError) as e:
        parse(text)
    assert str(e.value) == message


def test_load_names_the_path(tmp_path):
    p = tmp_path / "prefix.txt"
    p.write_text("USER: loaded\nASSISTANT: yes\n")
    assert [(m.role, m.content) for m in load(str(p))] == [("user", "loaded"), ("assistant", "yes")]
    bad = tmp_path / "bad.txt"
    bad.write_text("USER: a\nUSER: b\n")
    with pytest.raises(PrefixError, match=r"bad\.txt: line 2: expected ASSISTANT:"):
        load(str(bad))
    with pytest.raises(PrefixError, match="cannot open prefix file"):
        load(str(tmp_path / "missing.txt"))
    (tmp_path / "latin1.txt").write_bytes(b"USER: a\nASSISTANT: \xe9\n")
    with pytest.raises(PrefixError, match="line 2 is not valid UTF-8"):
        load(str(tmp_path / "latin1.txt"))


# ---------------------------------------------------------------- rendering

PREFIX = "USER: What is 2+2?\nASSISTANT: 4.\nUSER: And 3+3?\nASSISTANT: 6, of course.\n"
SYSTEM = "You are terse."
PROMPT = "And 4+4?"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"

# chat-template.md §4 / ds4's ds4_chat_append_message: history assistant turns drop
# their reasoning (`</think>`) and end with EOS; the live turn opens <think>
V4_EXPECTED = {
    "high": (
        BOS
        + SYSTEM
        + U
        + "What is 2+2?"
        + A
        + "</think>4."
        + EOS
        + U
        + "And 3+3?"
        + A
        + "</think>6, of course."
        + EOS
        + U
        + PROMPT
        + A
        + "<think>"
    ),
    "none": (
        BOS
        + SYSTEM
        + U
        + "What is 2+2?"
        + A
        + "</think>4."
        + EOS
        + U
        + "And 3+3?"
        + A
        + "</think>6, of course."
        + EOS
        + U
        + PROMPT
        + A
        + "</think>"
    ),
}
V41_EFFORT = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
V41_EXPECTED = {
    "75": (
        BOS
        + "<｜System｜>"
        + V41_EFFORT
        + SYSTEM
        + U
        + "What is 2+2?"
        + A
        + "</think>4."
        + EOS
        + U
        + "And 3+3?"
        + A
        + "</think>6, of course."
        + EOS
        + U
        + PROMPT
        + A
        + "<think>"
    ),
    "none": (
        BOS
        + "<｜System｜>"
        + SYSTEM
        + U
        + "What is 2+2?"
        + A
        + "</think>4."
        + EOS
        + U
        + "And 3+3?"
        + A
        + "</think>6, of course."
        + EOS
        + U
        + PROMPT
        + A
        + "</think>"
    ),
}


def cli_render(family: str, thinking: str, system: str = SYSTEM, prefix: str = PREFIX, prompt: str = PROMPT) -> str:
    """What `ds4mlx generate -sys SYSTEM --prefix-file F -p PROMPT` renders."""
    msgs = conversation_head(system, parse(prefix)) + [Message("user", prompt)]
    return get_protocol(family).render(Conversation(msgs, thinking=thinking))


def one_piece(family: str, thinking: str = "high") -> list[dict]:
    return (
        [{"role": "system", "content": SYSTEM}]
        + [{"role": m.role, "content": m.content} for m in parse(PREFIX)]
        + [{"role": "user", "content": PROMPT}]
    )


@pytest.mark.parametrize("thinking", ["high", "none"])
def test_deepseek_v4_bytes(thinking):
    assert cli_render("deepseek_v4", thinking) == V4_EXPECTED[thinking]


@pytest.mark.parametrize("thinking", ["75", "none"])
def test_deepseek_v41_bytes(thinking):
    assert cli_render("deepseek_v41", thinking) == V41_EXPECTED[thinking]


def _jinja(name: str, **kw) -> str:
    pytest.importorskip("transformers.utils.chat_template_utils")
    return render_jinja((TEMPLATES / name).read_text(), one_piece(name), **kw)


def cli_mode(family: str, think="high") -> str:
    """The mode `--think` / `--think-max` gives the family (think_flags.resolve)."""
    return resolve(get_protocol(family), think, THINK_MAX_MIN_CONTEXT).mode


@pytest.mark.parametrize("think,effort", [("high", "high"), ("max", "max")])
def test_glm53_bytes_equal_its_template(think, effort):
    assert cli_render("glm5_next", cli_mode("glm5_next", think)) == _jinja("glm5_next.jinja", reasoning_effort=effort)


@pytest.mark.parametrize("think,effort", [("high", "high"), ("max", "max")])
def test_glm52_bytes_equal_its_template(think, effort):
    assert cli_render("glm_moe_dsa", cli_mode("glm_moe_dsa", think)) == _jinja(
        "glm_moe_dsa.jinja", reasoning_effort=effort
    )


def test_qwen_bytes_equal_its_template():
    assert cli_render("qwen4_exp", cli_mode("qwen4_exp")) == _jinja("qwen4_exp.jinja")


@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41", "glm5_next", "glm_moe_dsa", "qwen4_exp"])
def test_prefix_plus_prompt_equals_the_conversation_in_one_piece(family):
    """The CLI's prefix + prompt is the prompt a client gets for the whole
    conversation in one Chat Completions request, and what `serve --prefix-file
    -sys` makes of a request carrying only the prompt."""
    proto = get_protocol(family)
    conv = parse_request("openai", {"model": proto.model_id, "messages": one_piece(family), "reasoning_effort": "high"})
    thinking = proto.resolve_thinking(conv.thinking, None if family == "deepseek_v4" else "high")
    assert thinking == cli_mode(family)  # what the client asked for is what --think gives
    conv.thinking = thinking
    whole = proto.render(conv)
    assert cli_render(family, thinking) == whole
    served = parse_request("openai", {"model": proto.model_id, "messages": [{"role": "user", "content": PROMPT}]})
    served.messages = with_head(served.messages, SYSTEM, parse(PREFIX))
    served.thinking = thinking
    assert proto.render(served) == whole


def test_serve_keeps_a_request_system_prompt():
    msgs = [Message("system", "client system"), Message("user", "hi")]
    out = with_head(msgs, SYSTEM, parse("USER: a\nASSISTANT: b"))
    assert [(m.role, m.content) for m in out] == [
        ("system", "client system"),
        ("user", "a"),
        ("assistant", "b"),
        ("user", "hi"),
    ]


def test_generate_flags(tmp_path):
    """-sys, --prompt-file and --prefix-file parse as ds4 spells them; --prefix-file
    with --raw is refused like ds4 does."""
    from ds4mlx.cli import generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    a = p.parse_args(["-sys", "S", "--prompt-file", "x.txt", "--prefix-file", "f.txt", "--nothink"])
    assert (a.system, a.prompt_file, a.prefix_file, a.think) == ("S", "x.txt", "f.txt", "none")
    with pytest.raises(SystemExit):
        p.parse_args(["-p", "a", "--prompt-file", "b"])  # one prompt source
    pf = tmp_path / "prefix.txt"
    pf.write_text(PREFIX)
    a = p.parse_args(["-p", "x", "--raw", "--prefix-file", str(pf)])
    a.command = "generate"
    assert generate.run(a) == 2
