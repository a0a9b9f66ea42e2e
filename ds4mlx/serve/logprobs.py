"""Generated tokens' log-probs (events.TokenLogprob) in OpenAI's shapes (docs/http-api.md §10):
chat's `choices[].logprobs.content[]` and legacy completions' `choices[].logprobs`."""

from __future__ import annotations

from ..runtime.events import Finish


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(fin: Finish) -> dict | None:
    """`{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}`, None when not asked."""
    if fin.logprobs is None:
        return None
    content = [
        {
            "token": t.text,
            "logprob": t.logprob,
            "bytes": _bytes(t.text),
            "top_logprobs": [{"token": s, "logprob": v, "bytes": _bytes(s)} for _, s, v in t.top],
        }
        for t in fin.logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(fin: Finish) -> dict | None:
    """`{tokens, token_logprobs, top_logprobs (a dict per token), text_offset}`, None when not
    asked; with echo the prompt's tokens come first (the first with null log-prob and top)."""
    if fin.logprobs is None:
        return None
    return token_logprobs((*(fin.prompt_logprobs or ()), *fin.logprobs))


def generated_logprobs(fin: Finish) -> dict | None:
    """The generated tokens' part of `completion_logprobs` (a stream's last chunk: an echo's
    prompt part went first, and the offsets go on from its end)."""
    if fin.logprobs is None:
        return None
    prompt = fin.prompt_logprobs or ()
    return token_logprobs(fin.logprobs, sum(len(t.text) for t in prompt))


def token_logprobs(tokens: tuple, start: int = 0) -> dict:
    """TokenLogprobs in completions' shape, text offsets counted from `start`."""
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.logprob is None else {s: v for _, s, v in t.top} for t in tokens],
        "text_offset": offsets,
    }
