"""The demo model's random weights never end a turn: where neither the request nor the
command line sets an output limit, serve and eval stop its answers at 256 tokens (said
at start), and the README's first client example finishes against it."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


@pytest.fixture(scope="module")
def demo(shared_demo):
    return shared_demo()


def _serve_args(*argv: str) -> argparse.Namespace:
    from ds4mlx.serve import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_serve_demo_default_limit_is_said_and_used(demo, caplog):
    from ds4mlx.serve.cli import DEFAULT_TOKENS, build

    with caplog.at_level(logging.WARNING, logger="ds4mlx.serve"):
        engine, _ = build(_serve_args("--ctx", "1024"), loaded=demo)
    try:
        assert engine.default_max_tokens == 256
        assert any("stop after 256 tokens" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()
    engine, _ = build(_serve_args("--ctx", "1024", "--tokens", "9"), loaded=demo)  # the flag still decides
    engine.close()
    assert engine.default_max_tokens == 9
    other = type(demo[0])  # a model that is not the demo keeps the server's usual default
    plain = other.__new__(other)
    plain.__dict__.update(demo[0].__dict__, is_demo=False)
    engine, _ = build(_serve_args("--ctx", "1024"), loaded=(plain, demo[1]))
    engine.close()
    assert engine.default_max_tokens == DEFAULT_TOKENS


def test_readme_client_example_finishes_on_the_demo(demo):
    pytest.importorskip("openai")
    from ds4mlx.serve.app import BackgroundServer
    from ds4mlx.serve.cli import build

    code = re.search(r"```python\n(from openai import OpenAI\n.*?)```", README.read_text(), re.S).group(1)
    assert "max_tokens" in code
    engine, app = build(_serve_args("--ctx", "1024"), loaded=demo)
    try:
        with BackgroundServer(app) as srv:
            printed = []
            exec(
                code.replace("http://127.0.0.1:8000/v1", srv.url + "/v1"),
                {"print": lambda *a: printed.append(a), "__name__": "readme"},
            )
        assert printed and printed[0][0].role == "assistant"
    finally:
        engine.close()


def test_eval_demo_default_limit(capsys):
    from ds4mlx.eval import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    for argv, want in (([], 256), (["-n", "40"], 40), (["--backend", "endpoint", "--endpoint", "http://x"], None)):
        a = p.parse_args(argv)
        cli.demo_limit(a)
        assert a.tokens == want, argv
    assert "stop after 256 tokens" in capsys.readouterr().err
