"""`n` choices on chat and completions (docs/http-api.md §10): n choices with their own
index and finish reason, streamed and not, a long prompt prefilled once (later choices
restore its in-memory checkpoint), a seeded request reproducible choice by choice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, Segment, serve  # noqa: E402
from test_server_http import call, parse_sse  # noqa: E402

# past the memory checkpoints' 512 tokens (memcheckpoints.py): shorter prompts are prefilled again
U = [{"role": "user", "content": "a question long enough to be worth a snapshot " * 70}]


@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    # every token a near tie between the script's and "x": sampled choices differ
    model = ScriptedModel(tok, [Segment("one two three four", soft=True)])
    with serve(tok, model, ctx=1024, tokens=4) as s:
        s.model = model
        yield s


def test_chat_n_choices(srv):
    before = srv.model.prefill_tokens
    body = {"messages": U, "n": 3, "reasoning_effort": "none", "temperature": 1.0, "min_p": 0, "seed": 5}
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    out = json.loads(text)
    assert st == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 12
    prompt = out["usage"]["prompt_tokens"] // 3
    assert prompt > 512 and srv.model.prefill_tokens - before < prompt + 10  # prefilled once
    texts = [c["message"]["content"] for c in out["choices"]]
    again = json.loads(call(srv.url, "/v1/chat/completions", body)[2])
    assert [c["message"]["content"] for c in again["choices"]] == texts  # seeded: reproducible
    assert len(set(texts)) > 1  # seed + j per choice: not the same choice thrice


def test_chat_n_streamed(srv):
    body = {"messages": U, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "think": False}
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    events = [d for _, d in parse_sse(text)]
    assert st == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(d) for d in events[:-1]]
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 8
    by_index: dict = {}
    for c in chunks:
        for ch in c["choices"]:
            by_index.setdefault(ch["index"], []).append(ch)
    assert sorted(by_index) == [0, 1]
    for chs in by_index.values():
        assert chs[0]["delta"] == {"role": "assistant"} and chs[-1]["finish_reason"] == "length"


def test_completions_n_times_prompts(srv):
    body = {"prompt": ["first", "second"], "n": 2, "max_tokens": 2}
    st, _, text = call(srv.url, "/v1/completions", body)
    out = json.loads(text)
    assert st == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    st, _, text = call(srv.url, "/v1/completions", {"prompt": "first", "n": 3, "max_tokens": 2, "stream": True})
    chunks = [json.loads(d) for k, d in parse_sse(text) if k != "comment" and d != "[DONE]"]
    assert {ch["index"] for c in chunks for ch in c["choices"]} == {0, 1, 2}


@pytest.mark.parametrize("n", [0, 129, -1])
def test_n_out_of_range_is_named(srv, n):
    st, _, text = call(srv.url, "/v1/chat/completions", {"messages": U, "n": n})
    err = json.loads(text)["error"]
    assert st == 400 and err["param"] == "n" and err["message"] == "Invalid value for 'n'."
