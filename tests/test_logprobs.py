"""logprobs on chat and legacy completions (docs/http-api.md §10): OpenAI's shapes, streamed
and not, with values equal to a log-softmax recomputed from the scripted model's logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_model import ScriptedModel, Segment, serve  # noqa: E402
from test_server_http import call, parse_sse  # noqa: E402

TEXT = "hello world, how are you today"
GREEDY = {"temperature": 0, "think": False, "max_tokens": 3}


@pytest.fixture(scope="module")
def srv():
    from ds4mlx.runtime.tokenizer import Tokenizer

    tok = Tokenizer.default()
    # soft: a distractor close behind each token, so the top alternatives are not all equal
    model = ScriptedModel(tok, lambda p: [Segment(TEXT, soft=True)], distractor="x")
    with serve(tok, model, ctx=512, tokens=8) as s:
        s.tok, s.model = tok, model
        yield s


def _expected(srv, n: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, log-prob, the top 3) of the first n script tokens, recomputed in numpy."""
    out = []
    for t in srv.tok.encode(TEXT)[:n]:
        x = srv.model.logits_for(t, True).astype(np.float64)
        lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
        order = np.argsort(-lp, kind="stable")[:3]
        out.append((srv.tok.decode([t]), lp[t], [(srv.tok.decode([int(i)]), lp[i]) for i in order]))
    return out


def _check_chat(srv, logprobs: dict, k: int) -> None:
    content = logprobs["content"]
    exp = _expected(srv, len(content))
    assert len(content) == 3
    for entry, (text, lp, top) in zip(content, exp):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == text and entry["bytes"] == list(text.encode())
        assert entry["logprob"] == pytest.approx(lp, abs=1e-4)
        tops = entry["top_logprobs"]
        assert len(tops) == k
        values = [e["logprob"] for e in tops]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([v for _, v in top[:k]], abs=1e-4)
        if k:  # the chosen token is the most likely: first, with its own value
            assert tops[0]["token"] == text and tops[0]["logprob"] == entry["logprob"]
        assert all(set(e) == {"token", "logprob", "bytes"} for e in tops)


@pytest.mark.parametrize("k", [0, 3])
def test_chat_logprobs(srv, k):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": k, **GREEDY}
    st, _, text = call(srv.url, "/v1/chat/completions", body)
    assert st == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["message"]["content"] == "".join(srv.tok.decode([t]) for t in srv.tok.encode(TEXT)[:3])
    _check_chat(srv, choice["logprobs"], k)
    st, _, raw = call(srv.url, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(v) for kind, v in parse_sse(raw) if kind == "data" and v != "[DONE]"]
    content = [e for c in chunks for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content", [])]
    assert content == choice["logprobs"]["content"]  # the streamed entries, concatenated


def test_chat_without_logprobs_has_none(srv):
    st, _, text = call(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **GREEDY})
    assert st == 200 and "logprobs" not in json.loads(text)["choices"][0]


def test_completions_logprobs(srv):
    body = {"prompt": "say", "logprobs": 2, **GREEDY}
    st, _, text = call(srv.url, "/v1/completions", body)
    assert st == 200, text
    choice = json.loads(text)["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    exp = _expected(srv, 3)
    assert lp["tokens"] == [t for t, _, _ in exp]
    assert lp["token_logprobs"] == pytest.approx([v for _, v, _ in exp], abs=1e-4)
    assert lp["text_offset"] == [0, *np.cumsum([len(t) for t, _, _ in exp])[:-1].tolist()]
    for d, (_, _, top) in zip(lp["top_logprobs"], exp):
        assert d == pytest.approx(dict(top[:2]), abs=1e-4)
    st, _, raw = call(srv.url, "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(v) for kind, v in parse_sse(raw) if kind == "data" and v != "[DONE]"]
    streamed = [ch["logprobs"] for c in chunks for ch in c["choices"] if ch.get("logprobs")]
    assert streamed == [lp]


@pytest.mark.parametrize(
    "route,extra,field,kind",
    [
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "type"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "value"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "value"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "value"),  # without logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "type"),
        ("/v1/completions", {"logprobs": True}, "logprobs", "type"),
        ("/v1/completions", {"logprobs": 1.5}, "logprobs", "type"),  # an integer: never truncated
        ("/v1/completions", {"logprobs": 21}, "logprobs", "value"),
    ],
)
def test_bad_logprobs_fields_are_named(srv, route, extra, field, kind):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "x"}
    st, _, text = call(srv.url, route, {**base, **extra})
    err = json.loads(text)["error"]
    assert st == 400 and err["param"] == field, text
    assert err["message"].startswith({"type": "Invalid type for", "value": "Invalid value for"}[kind]), text


def test_host_chosen_tokens_have_logprobs(srv):
    """A grammar makes the host choose each token: every one still gets its entry."""
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1, **GREEDY}
    st, _, text = call(srv.url, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}})
    assert st == 200, text
    out = json.loads(text)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] > 0
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 1 for e in content)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_completions_echo_logprobs(srv, max_tokens):
    """lm-evaluation-harness' loglikelihood request: the prompt's tokens' log-probs (from the
    model's full forward over the rendered prompt) then the generated ones', OpenAI's shape."""
    from ds4mlx.chat.protocol import get_protocol

    prompt = "The quick brown fox"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, **GREEDY, "max_tokens": max_tokens}
    st, _, text = call(srv.url, "/v1/completions", body)
    assert st == 200, text
    choice = json.loads(text)["choices"][0]
    gen = "".join(srv.tok.decode([t]) for t in srv.tok.encode(TEXT)[:max_tokens])
    assert choice["text"] == prompt + gen
    lp = choice["logprobs"]
    own = srv.tok.encode(prompt)
    n = len(own)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + max_tokens
    assert lp["tokens"][:n] == [srv.tok.decode([t]) for t in own]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the oracle: log-softmax of the model's logits over the rendered prompt, read at each token
    ids = srv.tok.encode(get_protocol().render_completion(prompt, "none"))
    start = next(i for i in range(len(ids) - n, -1, -1) if ids[i : i + n] == own)
    lsm = _log_softmax(srv.model.logits(ids[: start + n]))
    want = [lsm[i - 1, ids[i]] for i in range(start + 1, start + n)]
    assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-4)
    for d, i in zip(lp["top_logprobs"][1:n], range(start + 1, start + n)):
        top = np.argsort(-lsm[i - 1], kind="stable")[:2]
        assert d == pytest.approx({srv.tok.decode([int(j)]): lsm[i - 1, j] for j in top}, abs=1e-4)
    exp = _expected(srv, max_tokens)
    assert lp["token_logprobs"][n:] == pytest.approx([v for _, v, _ in exp], abs=1e-4)
    texts = lp["tokens"]
    assert lp["text_offset"] == [0, *np.cumsum([len(t) for t in texts])[:-1].tolist()]


def test_completions_echo_without_logprobs_prints_the_prompt(srv):
    st, _, text = call(srv.url, "/v1/completions", {"prompt": "say", "echo": True, **GREEDY})
    choice = json.loads(text)["choices"][0]
    assert st == 200 and choice["text"].startswith("say") and "logprobs" not in choice


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_prints_the_prompt_first(srv, logprobs, max_tokens):
    """As OpenAI's legacy API: the prompt (with its tokens' log-probs) is the first chunk; the
    chunks' texts and log-prob entries, joined, are the non-streamed choice's."""
    body = {"prompt": "The quick brown fox", "echo": True, **GREEDY, "max_tokens": max_tokens}
    if logprobs is not None:
        body["logprobs"] = logprobs
    st, _, text = call(srv.url, "/v1/completions", body)
    assert st == 200, text
    whole = json.loads(text)["choices"][0]
    st, _, raw = call(srv.url, "/v1/completions", {**body, "stream": True})
    assert st == 200, raw
    chunks = [json.loads(v)["choices"][0] for kind, v in parse_sse(raw) if kind == "data" and v != "[DONE]"]
    assert chunks[0]["text"] == body["prompt"] and chunks[0]["finish_reason"] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    parts = [c["logprobs"] for c in chunks if "logprobs" in c]
    if logprobs is None:
        assert not parts and "logprobs" not in whole
        return
    assert "logprobs" in chunks[0] and "logprobs" in chunks[-1] and len(parts) == 2
    joined = {k: [v for p in parts for v in p[k]] for k in whole["logprobs"]}
    assert joined == whole["logprobs"]


def test_echo_on_a_prompt_list_prints_each_prompt(srv):
    body = {"prompt": ["one two", "three"], "echo": True, "logprobs": 0, **GREEDY, "max_tokens": 0}
    st, _, text = call(srv.url, "/v1/completions", body)
    assert st == 200, text
    choices = json.loads(text)["choices"]
    assert [c["text"] for c in choices] == ["one two", "three"]
    for c, p in zip(choices, ["one two", "three"]):
        assert c["logprobs"]["tokens"] == [srv.tok.decode([t]) for t in srv.tok.encode(p)]
        assert c["logprobs"]["token_logprobs"][0] is None
        assert all(v < 0 for v in c["logprobs"]["token_logprobs"][1:])
