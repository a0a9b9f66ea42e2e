"""ds4's thinking flags (ds4mlx/cli/think_flags.py) on generate, chat, serve and eval:
on by default, the last flag wins, --think-level only for DeepSeek V4.1, and
Think Max gated at ds4's context threshold (ds4.c DS4_THINK_MAX_MIN_CONTEXT,
393216): one token below it the prompt is exactly the normal-thinking one and
ds4's warning is given."""

from __future__ import annotations

import argparse
import logging

import pytest

from ds4mlx.chat.markers import THINK_MAX_PREFIX
from ds4mlx.chat.messages import Conversation, Message
from ds4mlx.chat.protocol import families, get_protocol
from ds4mlx.cli.think_flags import THINK_MAX_MIN_CONTEXT, ThinkError, add_think_arguments, resolve

THRESHOLD = 393216
NOTICE = f"--think-max needs --ctx >= {THRESHOLD}; ctx={THRESHOLD - 1} uses normal thinking instead"


def parse(*argv):
    p = argparse.ArgumentParser()
    add_think_arguments(p)
    return p.parse_args(list(argv)).think


def test_threshold_is_ds4s():
    assert THINK_MAX_MIN_CONTEXT == THRESHOLD


def test_flags_default_on_and_last_wins():
    assert parse() == "high"
    assert parse("--nothink") == "none"
    assert parse("--think-max") == "max"
    assert parse("--nothink", "--think") == "high"
    assert parse("--think-level", "30") == 30
    assert parse("--think-level", "30", "--nothink") == "none"
    for bad in ("101", "-1", "high"):
        with pytest.raises(SystemExit):
            parse("--think-level", bad)


@pytest.mark.parametrize("family", families())
def test_think_max_gated_at_the_threshold(family):
    proto = get_protocol(family)
    high = resolve(proto, "high", THRESHOLD - 1)
    below = resolve(proto, "max", THRESHOLD - 1)
    at = resolve(proto, "max", THRESHOLD)
    assert high.notice is None and at.notice is None
    assert below.mode == high.mode and below.notice == NOTICE
    assert at.mode == proto.resolve_thinking("max", "max", explicit=True, ctx=THRESHOLD)
    conv = [Message("user", "Prove it.")]
    render = lambda mode: proto.render(Conversation(list(conv), thinking=mode))  # noqa: E731
    assert render(below.mode) == render(high.mode)
    if family != "qwen4_exp":  # Qwen's top effort is its default one
        assert render(at.mode) != render(high.mode)


def test_deepseek_v4_think_max_prompt():
    proto = get_protocol("deepseek_v4")
    assert THINK_MAX_PREFIX in proto.render(
        Conversation([Message("user", "x")], thinking=resolve(proto, "max", THRESHOLD).mode)
    )
    assert THINK_MAX_PREFIX not in proto.render(
        Conversation([Message("user", "x")], thinking=resolve(proto, "max", 4096).mode)
    )


def test_think_level_only_for_v41():
    v41 = get_protocol("deepseek_v41")
    assert resolve(v41, 30, 4096).mode == "30"
    assert resolve(v41, 0, 4096).mode == "none"
    assert "Reasoning Effort: 30 " in v41.render(Conversation([Message("user", "x")], thinking="30"))
    for family in families():
        if family != "deepseek_v41":
            with pytest.raises(ThinkError, match="--think-level requires a DeepSeek V4.1 model"):
                resolve(get_protocol(family), 30, 4096)


@pytest.fixture(scope="module")
def v4_demo(shared_demo):
    return shared_demo()


def _generate_prompt(monkeypatch, capsys, v4_demo, *argv):
    """The prompt `ds4mlx generate ARGV` sends to the engine, and its stderr."""
    from ds4mlx.cli import generate
    from ds4mlx.io import loader

    seen = {}
    monkeypatch.setattr(loader, "load", lambda path=None, **kw: v4_demo)

    def fake_stream(engine, job, console, out=None):
        seen["job"] = job
        return None

    monkeypatch.setattr(generate, "stream_job", fake_stream)
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    a = p.parse_args(["-p", "Hi", *argv])
    a.command = "generate"
    generate.run(a)
    return seen.get("job"), capsys.readouterr().err


def test_generate_thinks_by_default(monkeypatch, capsys, v4_demo):
    job, _ = _generate_prompt(monkeypatch, capsys, v4_demo)
    assert job.thinking == "high" and job.prompt_text.endswith("<｜Assistant｜><think>")
    job, _ = _generate_prompt(monkeypatch, capsys, v4_demo, "--nothink")
    assert job.thinking == "none" and job.prompt_text.endswith("<｜Assistant｜></think>")


def test_generate_think_max_gating(monkeypatch, capsys, v4_demo):
    job, err = _generate_prompt(monkeypatch, capsys, v4_demo, "--think-max", "--ctx", str(THRESHOLD - 1))
    assert job.thinking == "high" and THINK_MAX_PREFIX not in job.prompt_text
    assert NOTICE in " ".join(err.split())
    job, err = _generate_prompt(monkeypatch, capsys, v4_demo, "--think-max", "--ctx", str(THRESHOLD))
    assert job.thinking == "max" and job.prompt_text.startswith("<｜begin▁of▁sentence｜>" + THINK_MAX_PREFIX)
    assert "needs --ctx" not in err


def test_generate_refuses_think_level_on_v4(monkeypatch, capsys, v4_demo):
    job, err = _generate_prompt(monkeypatch, capsys, v4_demo, "--think-level", "50")
    assert job is None and "--think-level requires a DeepSeek V4.1 model" in " ".join(err.split())


def _serve(args, loaded):
    from ds4mlx.serve import cli
    from ds4mlx.serve.app import STATE

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    engine, app = cli.build(p.parse_args(args), loaded=loaded)
    return engine, app[STATE].cfg


def test_serve_thinking_defaults(v4_demo, caplog):
    from ds4mlx.serve.prepare import prepare

    body = {"messages": [{"role": "user", "content": "Hi"}]}
    engine, cfg = _serve(["--nothink"], v4_demo)
    try:
        assert prepare(cfg, engine, None, "chat", body).job.prompt_text.endswith("</think>")
        on = dict(body, thinking={"type": "enabled"})
        assert prepare(cfg, engine, None, "chat", on).job.prompt_text.endswith("<think>")  # the request wins
    finally:
        engine.close()
    with caplog.at_level(logging.WARNING, logger="ds4mlx.serve"):
        engine, cfg = _serve(["--think-max", "-c", "4096"], v4_demo)
    try:
        assert "--think-max needs --ctx >= 393216; ctx=4096" in caplog.text
        text = prepare(cfg, engine, None, "chat", body).job.prompt_text
        assert THINK_MAX_PREFIX not in text and text.endswith("<think>")
    finally:
        engine.close()
    engine, cfg = _serve(["--think-max", "-c", str(THRESHOLD)], v4_demo)
    try:
        assert THINK_MAX_PREFIX in prepare(cfg, engine, None, "chat", body).job.prompt_text
    finally:
        engine.close()
    engine, cfg = _serve([], v4_demo)  # no flag: thinking on
    try:
        assert prepare(cfg, engine, None, "chat", body).job.prompt_text.endswith("<think>")
    finally:
        engine.close()


def test_eval_flags(capsys):
    from ds4mlx.eval import cli as eval_cli
    from ds4mlx.eval.prompts import Prompt

    p = argparse.ArgumentParser()
    eval_cli.add_arguments(p)

    def thinking(*argv):
        a = p.parse_args(list(argv))
        err = eval_cli._thinking(a)
        return err, a

    err, a = thinking("--think-max", "--ctx", str(THRESHOLD - 1))
    assert err is None and a.thinking and not a.think_max
    assert NOTICE in capsys.readouterr().err
    err, a = thinking("--think-max", "--ctx", str(THRESHOLD))
    assert err is None and a.think_max
    err, a = thinking("--nothink")
    assert err is None and not a.thinking
    err, a = thinking("--think-level", "40")
    assert "requires a DeepSeek V4.1 model" in err
    err, a = thinking("--think-level", "40", "--endpoint", "http://127.0.0.1:1")
    assert err is None and a.think_level == 40
    assert Prompt("S", "U", True, True).text.startswith("<｜begin▁of▁sentence｜>" + THINK_MAX_PREFIX + "S")
    assert THINK_MAX_PREFIX not in Prompt("S", "U", True, False).text


def test_a_refused_speculation_leaves_ctrl_c_unblocked(monkeypatch, capsys, v4_demo):
    """`generate` blocks SIGINT while its engine starts (the worker thread inherits the mask);
    a usage error on the way (`--mtp` with `--draft-model`) must unblock it again, or every
    process started later from this one inherits a blocked Ctrl+C (seen in CI: the REPL's and
    eval's Ctrl+C tests hung after an in-process `generate` test)."""
    import signal

    from ds4mlx.cli import generate
    from ds4mlx.io import loader

    if not hasattr(signal, "pthread_sigmask"):
        pytest.skip("no signal masks here")
    monkeypatch.setattr(loader, "load", lambda path=None, **kw: v4_demo)
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    a = p.parse_args(["-p", "Hi", "--mtp", "--draft-model", "demo"])
    a.command = "generate"
    assert generate.run(a) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
