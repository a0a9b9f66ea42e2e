"""Diagnostics name what they are about: errors under /v1/messages/ come back in
Anthropic's shape, a response's id is the id its trace record carries, and a demo's
banner names its own architecture."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, serve  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from ds4mlx.runtime.tokenizer import Tokenizer

    return Tokenizer.default()


def test_errors_under_v1_messages_are_anthropic_shaped_and_ids_match_the_trace(tok, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with serve(tok, ScriptedModel(tok, lambda p: "ok"), ctx=512, tokens=4, trace=str(trace)) as s:
        for path in ("/v1/messages/nope", "/v1/messages/count_tokens"):
            r = httpx.post(s.url + path, content=b"{", headers={"Content-Type": "application/json"}, timeout=30)
            assert r.status_code >= 400 and r.json()["type"] == "error", (path, r.text)
        ids = []
        for path, body in (
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ):
            ids.append(httpx.post(s.url + path, json=body, timeout=30).json()["id"])
    traced = [json.loads(line)["id"] for line in trace.read_text().splitlines() if line.strip()]
    assert traced == ids and ids[0].startswith("resp_")


@pytest.mark.parametrize("family,name", [("qwen4_exp", "Qwen3.8 Flash Next"), ("deepseek_v4", "DeepSeek V4 Flash")])
def test_demo_banner_names_its_architecture(family, name):
    from ds4mlx.io.demo import notice

    class Loaded:
        config = {"model_type": family}

    assert f"{name} architecture" in notice(Loaded()) and "RANDOM weights" in notice(Loaded())
